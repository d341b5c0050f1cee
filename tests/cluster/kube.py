"""kubectl against the live node (KUBECONFIG from k8s/live/cluster.sh), and waits on conditions, never on time.

The node is a shared 2-CPU machine: every wait has a generous limit and, when it runs out, says what the cluster
looked like (pods, recent events, the last lines of the pods' logs), so a failure explains itself."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import yaml

ROOT = Path(__file__).resolve().parents[2]
NS = "rewardmesh"
KUBECTL = os.environ.get("REWARDMESH_KUBECTL", "kubectl")  # the cluster's own v1.20 kubectl (on PATH in the run)
T = TypeVar("T")


def _check_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("k8s_check_live", ROOT / "k8s" / "check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECK = _check_module()


class KubectlError(RuntimeError):
    pass


def kubectl(*args: str, stdin: str | None = None, timeout: float = 180, check: bool = True) -> str:
    proc = subprocess.run(
        [KUBECTL, *args], input=stdin, capture_output=True, text=True, errors="replace", timeout=timeout
    )
    if check and proc.returncode != 0:
        raise KubectlError(f"kubectl {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def get_json(*args: str) -> Any:
    return json.loads(kubectl("get", *args, "-o", "json"))


def render(overlay: str) -> list[dict[str, Any]]:
    """The objects of a live-node overlay (k8s/overlays/live-node/NAME), rendered as k8s/check.py renders."""
    return list(CHECK.render(ROOT / "k8s" / "overlays" / "live-node" / overlay))


def apply(objects: list[dict[str, Any]], *extra: str) -> str:
    return kubectl("apply", *extra, "-f", "-", stdin=yaml.safe_dump_all(objects, sort_keys=False))


def describe_cluster() -> str:
    """What a failed wait prints: the pods, the latest events, the tail of every pod's log."""
    parts = [kubectl("-n", NS, "get", "pods", "-o", "wide", check=False)]
    events = kubectl("-n", NS, "get", "events", "--sort-by=.lastTimestamp", check=False).splitlines()
    parts.append("\n".join(events[-25:]))
    for pod in get_json("-n", NS, "pods").get("items", []):
        name = pod["metadata"]["name"]
        for c in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
            tail = kubectl("-n", NS, "logs", name, "-c", c["name"], "--tail=15", check=False, timeout=30)
            if tail.strip():
                parts.append(f"--- {name}/{c['name']}\n{tail}")
    return "\n".join(parts)


def wait_until(what: str, probe: Callable[[], T | None], timeout_s: float, interval_s: float = 2.0) -> T:
    """probe() until it returns something other than None/False; on timeout, fail with the cluster's state."""
    deadline = time.monotonic() + timeout_s
    last_error = ""
    while True:
        try:
            value = probe()
            if value is not None and value is not False:
                return value
        except (KubectlError, subprocess.TimeoutExpired) as exc:  # the API server busy: ask again
            last_error = str(exc)
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s:.0f}s waiting for {what}"
                + (f" (last error: {last_error})" if last_error else "")
                + "\n"
                + describe_cluster()
            )
        time.sleep(interval_s)


def pods(component: str) -> list[dict[str, Any]]:
    """The pods of a component (reward, rollout, trainer, ...) that are not being deleted."""
    items = get_json("-n", NS, "pods", "-l", f"app.kubernetes.io/component={component}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def wait_ready(component: str, count: int, timeout_s: float = 900) -> list[dict[str, Any]]:
    """Until exactly `count` pods of `component` exist and are Ready (their readiness probes pass)."""

    def probe() -> list[dict[str, Any]] | None:
        found = pods(component)
        return found if len(found) == count and all(is_ready(p) for p in found) else None

    return wait_until(f"{count} Ready {component} pod(s)", probe, timeout_s)


def job_state(name: str) -> str | None:
    """'Complete' or 'Failed' once the Job finished, else None."""
    status = get_json("-n", NS, "job", name).get("status", {})
    for c in status.get("conditions") or []:
        if c["status"] == "True" and c["type"] in ("Complete", "Failed"):
            return str(c["type"])
    return None


def wait_job(name: str, timeout_s: float) -> str:
    return wait_until(f"Job {name} to finish", lambda: job_state(name), timeout_s, interval_s=5)


def job_log(name: str) -> str:
    return kubectl("-n", NS, "logs", f"job/{name}", timeout=60)


def delete_job(name: str) -> None:
    """A finished Job is kept (ttlSecondsAfterFinished), and its pod template cannot change: delete it to re-run."""
    kubectl("-n", NS, "delete", "job", name, "--ignore-not-found", "--wait=true", timeout=300)


def reset_namespace() -> None:
    """Remove everything of the last overlay: pods at once (no drain to wait out), then the namespace."""
    if not kubectl("get", "namespace", NS, "--ignore-not-found", "-o", "name").strip():
        return
    kubectl("-n", NS, "delete", "pods", "--all", "--grace-period=0", "--force", check=False, timeout=300)
    kubectl("delete", "namespace", NS, "--wait=false", timeout=120)
    wait_until(
        f"namespace {NS} to be gone",
        lambda: not kubectl("get", "namespace", NS, "--ignore-not-found", "-o", "name").strip(),
        600,
    )
