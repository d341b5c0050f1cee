"""The isolation levels and the command lines that build them with kept tools: bubblewrap, or util-linux
``unshare`` + ``mount`` + ``chroot`` + ``setpriv`` where bubblewrap is missing.

Both give a program its own user, network (empty: loopback down, no routes), PID, mount, IPC and UTS namespaces,
a read-only view of the system's /usr (and the /bin, /lib links into it), a private size-limited tmpfs as its
only writable place (gone with the mount namespace), no capabilities and no_new_privs; the runner adds its
system-call filter inside. bubblewrap is the higher level: it is a small, audited setuid-free tool whose whole
job is this, where the fallback is a shell script of the same steps.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

LEVELS = ("bwrap", "unshare")  # strongest first
RANK = {"unshare": 1, "bwrap": 2}
# Top-level system paths a program may need, mirrored read-only (a merged-/usr host has links here).
_SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_ETC_FILES = ("etc/alternatives", "etc/ld.so.cache", "etc/ld.so.conf", "etc/ld.so.conf.d", "etc/localtime")
_DEVICES = ("null", "zero", "full", "random", "urandom")
PATH = "/usr/local/bin:/usr/bin:/bin"
UNSHARE_TOOLS = ("unshare", "mount", "chroot", "setpriv", "sh")


def runner_source() -> str:
    """The in-sandbox runner's code, passed on the command line (no host file needs to be visible inside)."""
    return (Path(__file__).with_name("runner.py")).read_text()


def default_python() -> str:
    """The interpreter programs run with (standard library only): the server's own base Python when it is a
    system one under /usr, else the system's python3, else the server's base Python (its prefix mirrored)."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if base.startswith("/usr/"):
        return base
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            return candidate
    return base


def _extra_ro(python: str) -> list[str]:
    """Directories outside /usr an interpreter lives in (a pyenv or conda build), mirrored read-only."""
    real = os.path.realpath(python)
    if real.startswith("/usr/"):
        return []
    prefix = str(Path(real).parent.parent)
    return [prefix]


@dataclass(frozen=True)
class Level:
    name: str  # "bwrap" | "unshare"
    tool: str  # absolute path of bwrap or unshare

    @staticmethod
    def find(name: str) -> Level | None:
        """The level if its tools are installed (whether the kernel allows it is learnt by a probe run)."""
        if name == "bwrap":
            path = shutil.which("bwrap")
            return Level("bwrap", path) if path else None
        if name == "unshare":
            if all(shutil.which(t, path=PATH + ":/usr/sbin:/sbin") for t in UNSHARE_TOOLS):
                return Level("unshare", str(shutil.which("unshare", path=PATH + ":/usr/sbin:/sbin")))
            return None
        raise ValueError(f"unknown isolation level {name!r} (known: {', '.join(LEVELS)})")

    def command(self, python: str, tmp_bytes: int) -> list[str]:
        """argv that starts the runner as PID 1 of a fresh sandbox (the job goes to its stdin)."""
        inner = [python, "-I", "-S", "-c", runner_source()]
        if self.name == "bwrap":
            return self._bwrap(python, tmp_bytes, inner)
        return self._unshare(python, tmp_bytes, inner)

    def _bwrap(self, python: str, tmp_bytes: int, inner: list[str]) -> list[str]:
        argv = [self.tool, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--as-pid-1"]
        argv += ["--cap-drop", "ALL", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for name in _SYSTEM_DIRS:
            host = f"/{name}"
            if os.path.islink(host):
                argv += ["--symlink", os.readlink(host), host]
            elif os.path.isdir(host):
                argv += ["--ro-bind", host, host]
        for rel in _ETC_FILES:
            argv += ["--ro-bind-try", f"/{rel}", f"/{rel}"]
        for path in _extra_ro(python):
            argv += ["--ro-bind", path, path]
        # /dev holds the device nodes only: read-only, so /tmp stays the one writable place (no /dev/shm).
        argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
        argv += ["--size", str(tmp_bytes), "--tmpfs", "/tmp"]
        argv += ["--remount-ro", "/", "--chdir", "/tmp", "--clearenv", "--setenv", "PATH", PATH]
        argv += ["--setenv", "LANG", "C.UTF-8", "--"]
        return argv + inner

    def _unshare(self, python: str, tmp_bytes: int, inner: list[str]) -> list[str]:
        # The new root is a tmpfs mounted over /tmp of the (private) mount namespace; /tmp inside is another.
        lines = [
            "set -eu",
            "r=/tmp",
            "mount -t tmpfs -o mode=0755,size=4m sandbox-root $r",
            "mkdir -p $r/usr $r/proc $r/dev $r/tmp $r/etc",
            "mount --rbind -o ro /usr $r/usr",
        ]
        for name in _SYSTEM_DIRS:
            host = f"/{name}"
            if os.path.islink(host):
                lines.append(f"ln -s {os.readlink(host)} $r/{name}")
            elif os.path.isdir(host):
                lines.append(f"mkdir -p $r/{name} && mount --rbind -o ro {host} $r/{name}")
        for rel in _ETC_FILES:
            host = f"/{rel}"
            if os.path.isdir(host) and not os.path.islink(host):
                lines.append(f"mkdir -p $r/{rel} && mount --rbind -o ro {host} $r/{rel}")
            elif os.path.exists(host):
                lines.append(f"touch $r/{rel} && mount --bind -o ro {host} $r/{rel}")
        for path in _extra_ro(python):
            lines.append(f"mkdir -p $r{path} && mount --rbind -o ro {path} $r{path}")
        for dev in _DEVICES:
            lines.append(f"touch $r/dev/{dev} && mount --bind /dev/{dev} $r/dev/{dev}")
        lines += [
            "ln -s /proc/self/fd $r/dev/fd",
            "for n in 0:stdin 1:stdout 2:stderr; do ln -s /proc/self/fd/${n%%:*} $r/dev/${n#*:}; done",
            "mount -t proc -o nosuid,nodev,noexec proc $r/proc",
            f"mount -t tmpfs -o mode=1777,nosuid,nodev,size={tmp_bytes} sandbox-tmp $r/tmp",
            "mount -o remount,bind,ro $r",
            "cd $r",
            'exec chroot $r /usr/bin/env -i PATH="$P" LANG=C.UTF-8 /usr/bin/setpriv --no-new-privs'
            " --inh-caps=-all --bounding-set=-all --securebits +noroot,+noroot_locked,+no_setuid_fixup_locked"
            ' -- "$@"',
        ]
        script = "\n".join(lines)
        argv = [self.tool, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount"]
        argv += ["--ipc", "--uts", "--cgroup", "--propagation", "private", "--"]
        return [*argv, "/bin/sh", "-c", f"P={PATH}\n{script}", "sandbox", *inner]
