"""The mesh on a live one-node Kubernetes 1.20 cluster (make test-cluster): the live-node overlays applied to a real
API server and kubelet, real pods from the project's image, real probes, DNS names and pod deletions.

The tests run in file order and share the cluster: single-node first (admission, Ready pods, the trainer Job, pod
loss, a rolling update), then code-rewards, TLS and shared-fleet, each in a fresh namespace."""

from __future__ import annotations

import copy
import json
import math
import re
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rewardmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from tests.cluster import kube
from tests.cluster.kube import NS, kubectl

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600)]

LIVE_OVERLAYS = ("single-node", "code-rewards", "shared-fleet", "tls")
AUDIT = Path(__file__).with_name("mesh_audit.py")
ROLLOUT_TARGET = f"dns:///rollout.{NS}.svc.cluster.local:50061"


def pod_log(pod: dict[str, Any], container: str) -> str:
    return kubectl("-n", NS, "logs", pod["metadata"]["name"], "-c", container, timeout=60)


def step_rows(log: str) -> list[dict[str, float]]:
    """The trainer demo's per-step table (`step score acc step_s ...`), one dict per row. The rows (stdout) and the
    progress bar (stderr, redrawn with carriage returns) share the pod's log, a row sometimes glued to a bar."""
    header: list[str] = []
    rows = []
    for line in re.split(r"[\r\n]", log):
        words = line.split()
        if words[:2] == ["step", "score"]:
            header = words
            continue
        number = r"(?:-?\d+\.\d+|nan)"
        found = re.search(rf"(?:^|\s)(\d+)((?:\s+{number}){{{len(header) - 1}}})\s*$", line) if header else None
        if found:
            rows.append(dict(zip(header, [float(found[1]), *map(float, found[2].split())], strict=True)))
    return rows


def the_job(objects: list[dict[str, Any]], steps: int | None = None, name: str = "trainer") -> dict[str, Any]:
    """The overlay's trainer Job, optionally with another step count (and name)."""
    job = copy.deepcopy(next(o for o in objects if o["kind"] == "Job"))
    job["metadata"]["name"] = name
    if steps is not None:
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        args[args.index("--steps") + 1] = str(steps)
    return job


def audit_job(name: str, steps: int) -> dict[str, Any]:
    """A Job running mesh_audit.py (from the ConfigMap mesh-audit) in the project's image, as the trainer runs."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS, "labels": {"app.kubernetes.io/component": "audit"}},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/component": "audit"}},
                "spec": {
                    "restartPolicy": "Never",
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 1000,
                        "runAsGroup": 1000,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [
                        {
                            "name": "audit",
                            "image": "rewardmesh:0.1.0",
                            "imagePullPolicy": "IfNotPresent",
                            "command": [
                                "python",
                                "/audit/mesh_audit.py",
                                "--target",
                                ROLLOUT_TARGET,
                                "--steps",
                                str(steps),
                                "--until-file",
                                "/tmp/stop",
                            ],
                            "resources": {
                                "requests": {"cpu": "100m", "memory": "256Mi"},
                                "limits": {"memory": "2Gi"},
                            },
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "volumeMounts": [{"name": "audit", "mountPath": "/audit", "readOnly": True}],
                        }
                    ],
                    "volumes": [{"name": "audit", "configMap": {"name": "mesh-audit"}}],
                },
            },
        },
    }


def audit_lines(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in kube.job_log(name).splitlines() if line.startswith("{")]


def stop_audit(name: str) -> None:
    """The audit goes on until /tmp/stop exists in its pod: create it."""
    (pod,) = kube.get_json("-n", NS, "pods", "-l", f"job-name={name}")["items"]
    kubectl("-n", NS, "exec", pod["metadata"]["name"], "--", "touch", "/tmp/stop")


def assert_every_sample_once(name: str) -> dict[str, Any]:
    """The audit Job's account: every step got all its samples, each once, none failed."""
    lines = audit_lines(name)
    done = lines[-1] if lines and lines[-1].get("done") else None
    assert done is not None, f"audit {name} did not finish: {lines[-3:]}"
    per_step = [line for line in lines if "step" in line]
    assert [line["step"] for line in per_step] == list(range(1, done["steps"] + 1))
    for line in per_step:
        assert line["samples"] == line["expected"], f"samples lost in step {line['step']}: {line}"
        assert line["unique"] == line["samples"], f"a sample came twice in step {line['step']}: {line}"
        assert line["failed"] == 0, f"samples failed in step {line['step']}: {line}"
    return done


def start_audit(name: str, steps: int) -> None:
    kube.delete_job(name)
    kube.apply([audit_job(name, steps)])


def wait_for_steps(what: str, count: int, read: Any, timeout_s: float = 900) -> None:
    kube.wait_until(f"{what} to reach step {count}", lambda: len(read()) >= count or None, timeout_s, interval_s=2)


@pytest.fixture(scope="module")
def single_node() -> Iterator[list[dict[str, Any]]]:
    """live-node/single-node applied, its reward and rollout pods Ready, the trainer Job left to run."""
    kube.reset_namespace()
    objects = kube.render("single-node")
    kube.apply(objects)
    kubectl("-n", NS, "create", "configmap", "mesh-audit", f"--from-file={AUDIT}")
    kube.wait_ready("reward", 1)
    kube.wait_ready("rollout", 1)
    yield objects


def test_every_object_of_every_live_overlay_is_admitted() -> None:
    """The real API server (1.20.2) admits every object, in the API versions the live-node overlays use."""
    kube.reset_namespace()
    kubectl("create", "namespace", NS)
    for overlay in LIVE_OVERLAYS:
        objects = kube.render(overlay)
        out = kube.apply([o for o in objects if o["kind"] != "Namespace"], "--dry-run=server")
        assert out.count("(server dry run)") == len(objects) - 1, f"{overlay}: {out}"
    kinds = {(o["apiVersion"], o["kind"]) for o in kube.render("shared-fleet")}
    assert ("policy/v1beta1", "PodDisruptionBudget") in kinds
    assert ("autoscaling/v2beta2", "HorizontalPodAutoscaler") in kinds


def test_pods_become_ready_through_their_probes(single_node: list[dict[str, Any]]) -> None:
    for component, port in (("reward", "50051"), ("rollout", "50061")):
        (pod,) = kube.pods(component)
        container = pod["spec"]["containers"][0]
        probe = container["readinessProbe"]["exec"]["command"]
        assert probe[:2] == ["rewardmesh", "health"] and port in probe
        assert kube.is_ready(pod)
    # Under the base's RuntimeDefault seccomp profile the reward server says at start that code rewards are off.
    (reward,) = kube.pods("reward")
    name = reward["metadata"]["name"]

    def said() -> str | None:
        text = kubectl("-n", NS, "logs", name, "-c", "reward")
        return text if "code rewards are off" in text else None

    reward_log = kube.wait_until("the reward server's word on code rewards", said, 300)
    assert "seccomp profile" in reward_log
    # The headless Services publish the ready pods' addresses.
    for name in ("reward", "rollout"):
        endpoints = kube.get_json("-n", NS, "endpoints", name)
        assert [a["ip"] for s in endpoints.get("subsets", []) for a in s.get("addresses", [])]


def test_the_trainer_job_trains_through_the_headless_services(single_node: list[dict[str, Any]]) -> None:
    job = the_job(single_node)
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    steps = int(args[args.index("--steps") + 1])
    assert kube.wait_job("trainer", 2400) == "Complete", kube.job_log("trainer")[-3000:]
    log = kube.job_log("trainer")
    (rollout,) = kube.pods("rollout")
    # The dns:/// name expanded to the rollout pod's address.
    assert f"rollout servers: {rollout['status']['podIP']}:50061" in log, log[:2000]
    rows = step_rows(log)
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1)), log[-2000:]
    assert all(math.isfinite(r["score"]) for r in rows)
    assert re.search(rf"^{steps} steps in [0-9.]+s .*mean score first", log, re.M), log[-1000:]
    # The rollout server scores through the reward Service's name: the samples came back scored, and learned from.
    rollout_log = pod_log(rollout, "rollout")
    assert f"reward targets ['dns:///reward.{NS}.svc.cluster.local:50051']" in rollout_log, rollout_log[:3000]
    first, last = (sum(r["score"] for r in part) / len(part) for part in (rows[:10], rows[-10:]))
    assert last > first, (first, last)


def test_losing_a_rollout_and_a_reward_pod_mid_step_loses_no_sample(single_node: list[dict[str, Any]]) -> None:
    """Two of each, then one of each deleted with --grace-period=0 while the trainer and an audit run."""
    kube.delete_job("trainer")
    kubectl("-n", NS, "scale", "deployment/reward", "deployment/rollout", "--replicas=2")
    # A new trainer starts its weights at version 1, and rollout servers refuse weights older than the ones they
    # serve (the last run's): a new run needs new rollout pods.
    kubectl("-n", NS, "rollout", "restart", "deployment/rollout")
    kubectl("-n", NS, "rollout", "status", "deployment/rollout", "--timeout=1500s", timeout=1600)
    kube.wait_ready("reward", 2)
    kube.wait_ready("rollout", 2)
    kube.apply([the_job(single_node, steps=300)])
    start_audit("audit-loss", 40)
    wait_for_steps("the trainer", 3, lambda: step_rows(kube.job_log("trainer")))
    wait_for_steps("the audit", 2, lambda: audit_lines("audit-loss")[:-1])
    before = {p["metadata"]["name"] for p in kube.pods("rollout")}
    at_kill = len(step_rows(kube.job_log("trainer")))
    victims = [sorted(before)[0], sorted(p["metadata"]["name"] for p in kube.pods("reward"))[0]]
    kubectl("-n", NS, "delete", "pod", *victims, "--grace-period=0", "--force")

    # The replacement rollout pod joins while the trainer runs: it gets the current weights before any work.
    replacement = kube.wait_until(
        "the replacement rollout pod to be Ready",
        lambda: next(
            (p for p in kube.pods("rollout") if p["metadata"]["name"] not in before and kube.is_ready(p)), None
        ),
        900,
    )
    kube.wait_ready("reward", 2)
    served = len(audit_lines("audit-loss"))
    wait_for_steps("the audit, with the replacements", served + 3, lambda: audit_lines("audit-loss"))
    stop_audit("audit-loss")
    assert kube.wait_job("audit-loss", 1800) == "Complete", kube.job_log("audit-loss")[-3000:]
    done = assert_every_sample_once("audit-loss")
    assert done["resent"] > 0 or done["failed"] == 0
    assert kube.wait_job("trainer", 3600) == "Complete", kube.job_log("trainer")[-3000:]
    rows = step_rows(kube.job_log("trainer"))
    assert [int(r["step"]) for r in rows] == list(range(1, 301))
    log = kubectl("-n", NS, "logs", replacement["metadata"]["name"], "-c", "rollout")
    versions = [int(v) for v in re.findall(r"applied \d+ tensors .* as policy version (\d+)", log)]
    assert versions and versions[0] > at_kill, (
        f"the replacement applied {versions[:3]}, step at kill {at_kill}\n{log[-3000:]}"
    )


def test_a_rolling_update_of_the_reward_deployment_fails_no_sample(single_node: list[dict[str, Any]]) -> None:
    start_audit("audit-roll", 40)
    wait_for_steps("the audit", 2, lambda: audit_lines("audit-roll")[:-1])
    old = {p["metadata"]["name"] for p in kube.pods("reward")}
    kubectl("-n", NS, "rollout", "restart", "deployment/reward")
    kubectl("-n", NS, "rollout", "status", "deployment/reward", "--timeout=1500s", timeout=1600)
    kube.wait_until(
        "the old reward pods to be gone", lambda: not old & {p["metadata"]["name"] for p in kube.pods("reward")}, 600
    )
    served = len(audit_lines("audit-roll"))
    wait_for_steps("the audit, on the new reward pods", served + 3, lambda: audit_lines("audit-roll"))
    stop_audit("audit-roll")
    assert kube.wait_job("audit-roll", 1800) == "Complete", kube.job_log("audit-roll")[-3000:]
    assert_every_sample_once("audit-roll")


# -- scoring straight at a pod (pod addresses are on this machine's own bridge) ---------------------------------


def score(
    address: str,
    reward: str,
    samples: list[tuple[str, str, str]],
    *,
    token: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    server_name: str = "",
) -> list[Any]:
    """ScoreBatch of (sample_id, response_text, ground_truth) on one pod; its results in order."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (
        grpc.secure_channel(address, credentials, options=options)
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        request = reward_pb2.ScoreBatchRequest(
            reward=reward,
            samples=[common_pb2.Sample(sample_id=s, response_text=r, ground_truth=g) for s, r, g in samples],
        )
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        return list(stub.ScoreBatch(request, timeout=120, metadata=metadata).results)


def pod_address(component: str, port: int) -> str:
    (pod,) = kube.pods(component)
    return f"{pod['status']['podIP']}:{port}"


TESTS = json.dumps({"inputs": ["1 2\n", "20 22\n"], "outputs": ["3\n", "42\n"]})
PROGRAMS = {
    "right": "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
    "wrong": "```python\nprint(0)\n```",
    # Hostile: never ends, and holds its CPU; the sandbox kills it at its time limit, the others are still scored.
    "hostile": "```python\nwhile True:\n    pass\n```",
}
PROFILE = Path("/var/lib/kubelet/seccomp/profiles/rewardmesh-sandbox.json")


def test_code_rewards_are_scored_and_contained_in_the_reward_pod() -> None:
    """code-rewards: the DaemonSet installs the profile on the node, the reward pod runs bubblewrap under it."""
    kube.reset_namespace()
    PROFILE.unlink(missing_ok=True)
    kube.apply([o for o in kube.render("code-rewards") if o["kind"] != "Job"])  # the trainer has no code task
    kube.wait_until(
        "the seccomp installer to be ready",
        lambda: kube.get_json("-n", NS, "daemonset", "seccomp-installer")["status"].get("numberReady") == 1 or None,
        600,
    )
    shipped = (kube.ROOT / "k8s" / "components" / "code-sandbox" / "rewardmesh-sandbox.json").read_text()
    assert PROFILE.read_text() == shipped
    (reward,) = kube.wait_ready("reward", 1)
    kube.wait_ready("rollout", 1)
    log = pod_log(reward, "reward")
    assert "code sandbox: isolation level bwrap" in log, log[-3000:]
    assert "code rewards are off" not in log
    address = pod_address("reward", 50051)
    results = score(address, "code", [(name, text, TESTS) for name, text in PROGRAMS.items()])
    by_id = {r.sample_id: r for r in results}
    assert not by_id["right"].HasField("error") and by_id["right"].score == 1.0, by_id["right"]
    assert not by_id["wrong"].HasField("error") and by_id["wrong"].score == 0.0, by_id["wrong"]
    hostile = by_id["hostile"]
    assert not hostile.HasField("error") and hostile.score == 0.0, hostile
    assert hostile.extras.get("timeout", 0) >= 1, hostile
    # The pod serves on: a right program after the hostile one is scored.
    (again,) = score(address, "code", [("again", PROGRAMS["right"], TESTS)])
    assert again.score == 1.0, again
    assert kube.is_ready(kube.pods("reward")[0])


def fresh_namespace_with_secret(overlay: str, secret: str, *sources: str) -> list[dict[str, Any]]:
    """A new namespace with the Secret an overlay needs (kubectl create secret generic SECRET SOURCES...) made
    before anything that mounts it; the overlay's objects, for the caller to apply."""
    kube.reset_namespace()
    objects = kube.render(overlay)
    kube.apply([o for o in objects if o["kind"] == "Namespace"])
    kubectl("-n", NS, "create", "secret", "generic", secret, *sources)
    return objects


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(where: Path) -> None:
    """A CA and one certificate for every pod (server and client), with the Services' names, as k8s/README.md
    asks of cert-manager."""
    names = f"DNS:reward.{NS}.svc.cluster.local,DNS:rollout.{NS}.svc.cluster.local"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=rewardmesh-test-ca", cwd=where)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj",
             "/CN=rewardmesh", cwd=where)  # fmt: skip
    (where / "ext.cnf").write_text(
        f"subjectAltName={names}\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n"
    )
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
             "tls.crt", "-days", "2", "-extfile", "ext.cnf", cwd=where)  # fmt: skip


def test_tls_pods_talk_mtls_and_refuse_a_client_without_a_certificate(tmp_path: Path) -> None:
    make_certificates(tmp_path)
    files = (f"--from-file={tmp_path / f}" for f in ("tls.crt", "tls.key", "ca.crt"))
    objects = fresh_namespace_with_secret("tls", "rewardmesh-tls", *files)
    kube.apply([o for o in objects if o["kind"] not in ("Namespace", "Job")] + [the_job(objects, steps=20)])
    kube.wait_ready("reward", 1)
    kube.wait_ready("rollout", 1)
    # The trainer reaches the rollout pods, and they the reward pods, over mutual TLS.
    assert kube.wait_job("trainer", 2400) == "Complete", kube.job_log("trainer")[-3000:]
    assert [int(r["step"]) for r in step_rows(kube.job_log("trainer"))] == list(range(1, 21))

    address = pod_address("reward", 50051)
    ca = (tmp_path / "ca.crt").read_bytes()
    server_name = f"reward.{NS}.svc.cluster.local"
    sample = [("s", "the answer is 3", "3")]
    with_cert = grpc.ssl_channel_credentials(
        ca, (tmp_path / "tls.key").read_bytes(), (tmp_path / "tls.crt").read_bytes()
    )
    (ok,) = score(address, "first_number", sample, credentials=with_cert, server_name=server_name)
    assert not ok.HasField("error") and ok.sample_id == "s", ok
    for credentials in (grpc.ssl_channel_credentials(ca), None):  # TLS without a client certificate; plaintext
        with pytest.raises(grpc.RpcError) as refused:
            score(address, "first_number", sample, credentials=credentials, server_name=server_name)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value


def tenant_series(log: str) -> set[tuple[str, str]]:
    """(pipeline, tenant) of every queue-depth series the reward pod printed (console metrics exporter)."""
    found = set()
    decoder = json.JSONDecoder()
    at = log.find('{\n    "resource_metrics"')
    while at >= 0:
        try:
            blob, end = decoder.raw_decode(log, at)
        except ValueError:
            break
        for rm in blob.get("resource_metrics", []):
            for sm in rm.get("scope_metrics", []):
                for metric in sm.get("metrics", []):
                    if metric.get("name") == "rewardmesh.reward.queue_depth":
                        for point in metric["data"]["data_points"]:
                            found.add((point["attributes"]["pipeline"], point["attributes"]["tenant"]))
        at = log.find('{\n    "resource_metrics"', end)
    return found


def test_shared_fleet_scores_each_tenant_under_its_own_name() -> None:
    tokens = {job: secrets.token_hex(16) for job in ("job-a", "job-b")}
    literals = (f"--from-literal={j}={t}" for j, t in tokens.items())
    objects = fresh_namespace_with_secret("shared-fleet", "rewardmesh-tenants", *literals)
    kube.apply([o for o in objects if o["kind"] not in ("Namespace", "Job")])
    (reward,) = kube.wait_ready("reward", 1)
    kube.wait_ready("rollout", 1)
    address = pod_address("reward", 50051)
    pipelines = {"job-a": "first_number", "job-b": "gsm8k"}
    for job, token in tokens.items():
        (result,) = score(address, pipelines[job], [(job, "#### 3", "3")], token=token)
        assert not result.HasField("error") and result.sample_id == job, result

    def series() -> set[tuple[str, str]] | None:
        found = tenant_series(pod_log(reward, "reward"))
        return found if {("first_number", "job-a"), ("gsm8k", "job-b")} <= found else None

    found = kube.wait_until("the reward pod's metrics to name both tenants", series, 300)
    assert ("first_number", "job-b") not in found and ("gsm8k", "job-a") not in found, found
