"""The project's CPU image without Docker, from the same lists the Dockerfile uses.

The Dockerfile stays the way to build the (CUDA) image; this reads what it says goes into one, so the two builds
do not drift: the files come from `.dockerignore` (an allowlist), the system packages from the Dockerfile's
`RUNTIME_PACKAGES`, and the image's user, environment, working directory, ports and entry point from its runtime
stage. Used by build-image.sh:

    python image.py files DEST          # copy the build context (what `COPY . .` receives) into DEST
    python image.py packages            # the runtime's system packages, one line
    python image.py key                 # a hash of everything the image is built from
    python image.py pack ROOTFS.tar OUT.tar NAME:TAG [--entrypoint CMD] [--user U]
                                        # a docker-archive `ctr images import` takes
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import os
import shlex
import shutil
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


def _patterns() -> list[tuple[bool, str]]:
    """(include, pattern) rules of .dockerignore in order; the last rule matching a path decides."""
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        rules.append((include, line.lstrip("!").strip("/")))
    return rules


def _matches(rel: str, pattern: str) -> bool:
    """Docker's matching, as far as this allowlist needs: a pattern names a path or any folder above it; `**/`
    matches any number of folders."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    if pattern.startswith("**/"):
        tail = pattern[3:]
        return any(fnmatch.fnmatchcase(p, tail) for p in parts)
    return any(fnmatch.fnmatchcase(p, pattern) for p in prefixes)


def context_files() -> list[str]:
    """Every file of the checkout the Docker build context holds (relative paths, sorted; links kept as links)."""
    rules = _patterns()
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT, followlinks=False):
        rel_dir = os.path.relpath(dirpath, ROOT)
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in [*filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))]:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            keep = True
            for include, pattern in rules:
                if _matches(rel, pattern):
                    keep = include
            if keep:
                found.append(rel)
    return sorted(found)


def runtime_packages() -> list[str]:
    """The Dockerfile's `ARG RUNTIME_PACKAGES="..."`."""
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("ARG RUNTIME_PACKAGES="):
            return shlex.split(line.split("=", 1)[1])[0].split()
    raise SystemExit("image.py: the Dockerfile has no ARG RUNTIME_PACKAGES=... line")


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile's runtime stage as (INSTRUCTION, arguments), continuation lines joined."""
    lines: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    stage: list[tuple[str, str]] = []
    for line in lines:
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stage = []
        stage.append((word.upper(), rest.strip()))
    return stage


def image_config() -> dict[str, object]:
    """User, environment, working directory, ports, entry point and command of the Dockerfile's last stage."""
    env: dict[str, str] = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    config: dict[str, object] = {}
    for word, rest in _instructions():
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value.replace("$PATH", env.get("PATH", "")).replace("${PATH}", env.get("PATH", ""))
        elif word == "USER":
            config["User"] = rest
        elif word == "WORKDIR":
            config["WorkingDir"] = rest
        elif word == "EXPOSE":
            config["ExposedPorts"] = {f"{p}/tcp" if "/" not in p else p: {} for p in rest.split()}
        elif word in ("ENTRYPOINT", "CMD"):
            config["Entrypoint" if word == "ENTRYPOINT" else "Cmd"] = json.loads(rest)
    config["Env"] = [f"{k}={v}" for k, v in env.items()]
    return config


def build_key() -> str:
    """Changes whenever anything the image is built from changes (the context, the Dockerfile, the scripts)."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    extra = [DOCKERFILE, DOCKERIGNORE, here / "build-image.sh", Path(__file__)]
    for path in [*(ROOT / rel for rel in context_files()), *extra]:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
        digest.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
    return digest.hexdigest()[:16]


def copy_context(dest: Path) -> int:
    for rel in context_files():
        src, dst = ROOT / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    return 0


def pack(rootfs_tar: Path, out: Path, tag: str, overrides: dict[str, object]) -> None:
    """rootfs.tar -> a docker-archive (the `docker save` layout) of one layer with the Dockerfile's config."""
    digest = hashlib.sha256()
    with rootfs_tar.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    config = {**image_config(), **overrides}
    cfg = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{digest.hexdigest()}"]},
        "history": [{"created_by": "k8s/live/build-image.sh"}],
    }
    cfg_bytes = json.dumps(cfg).encode()
    cfg_name = hashlib.sha256(cfg_bytes).hexdigest() + ".json"
    manifest = json.dumps([{"Config": cfg_name, "RepoTags": [tag], "Layers": ["layer/layer.tar"]}]).encode()
    with tarfile.open(out, "w") as t:
        for name, data in ((cfg_name, cfg_bytes), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        t.add(rootfs_tar, arcname="layer/layer.tar")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("files").add_argument("dest", type=Path)
    sub.add_parser("packages")
    sub.add_parser("key")
    p = sub.add_parser("pack")
    p.add_argument("rootfs", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("tag")
    p.add_argument("--entrypoint", help="JSON list, in place of the Dockerfile's (the pause image)")
    p.add_argument("--no-user", action="store_true", help="no USER (the pause image runs as root)")
    args = parser.parse_args(argv)
    if args.command == "files":
        return copy_context(args.dest)
    if args.command == "packages":
        print(" ".join(runtime_packages()))
    elif args.command == "key":
        print(build_key())
    else:
        overrides: dict[str, object] = {}
        if args.entrypoint:
            overrides = {"Entrypoint": json.loads(args.entrypoint), "Cmd": [], "ExposedPorts": {}}
            overrides["Env"] = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
            overrides["WorkingDir"] = "/"
        if args.no_user:
            overrides["User"] = ""
        pack(args.rootfs, args.out, args.tag, overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
