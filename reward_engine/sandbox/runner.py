"""The program that runs inside a sandbox as its PID 1: it serves jobs (a program and its tests) one after
another, runs each test in a fresh process under resource limits, and streams one JSON line per test to the host.

It is started with the system's Python and uses the standard library only (nothing of the project is visible
inside). As PID 1 of the sandbox's PID namespace it cannot be killed by the programs it runs (the kernel drops
signals sent to a namespace's init from inside it), and it is made non-dumpable so they cannot attach to it or
read its pipes. Before anything runs it installs a seccomp filter that every test inherits (new namespaces,
mounts, tracing, BPF, io_uring, keys and kernel modules refused). It never sees expected outputs: the host
compares, so a program cannot learn or forge verdicts.

One sandbox serves many jobs (a warm sandbox). Between two tests, and again between two jobs, it is reset: every
other process in the namespace is killed, /tmp is wiped, System V IPC objects are removed and the keyrings are
cleared; each test gets its limits afresh. After a job the runner checks that nothing is left (no process, no
file in /tmp, no IPC object, no key) and says so on its ``done`` line; anything left and the host retires the
sandbox. Protocol: one ``{"ready": pid}`` line at start, then per job (one JSON line on stdin) its ``compile`` and
``test`` lines and a ``done`` line; end of stdin ends the sandbox. The ready line says which filter is in place.
A ``{"stop": true}`` line while a job runs (its caller took it back) kills its running test at once and skips the
rest; the sandbox is reset and checked as after any job (``done`` says ``stopped``), so a stop costs a reset, not a
new sandbox. A stop line that comes after its job ended is dropped.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import resource
import select
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, BinaryIO

WORK = "/tmp/work"
STDERR_KEEP = 4096
_LIBC = ctypes.CDLL(None, use_errno=True)
# The system-call filter: calls no test needs that widen what the kernel exposes (namespaces and mounts, other
# processes' memory, kernel modules and keys, BPF, io_uring, tracing, the clock, the host name), refused with
# EPERM. Numbers on x86_64 and aarch64; elsewhere no filter is installed (the pool says so).
_REFUSED = {
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "chroot": (161, 51), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "move_mount": (429, 429), "open_tree": (428, 428), "mount_setattr": (442, 442), "ptrace": (101, 117),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264), "acct": (163, 89), "reboot": (169, 142), "swapon": (167, 224),
    "swapoff": (168, 225), "syslog": (103, 116), "quotactl": (179, 60), "quotactl_fd": (443, 443),
    "lookup_dcookie": (212, 18), "vhangup": (153, 58), "settimeofday": (164, 170), "clock_settime": (227, 112),
    "clock_adjtime": (305, 266), "adjtimex": (159, 171), "sethostname": (170, 161), "setdomainname": (171, 162),
    "kcmp": (312, 272), "pidfd_getfd": (438, 438), "process_madvise": (440, 440), "personality": (135, 92),
    "iopl": (172, -1), "ioperm": (173, -1), "modify_ldt": (154, -1), "uselib": (134, -1),
}  # fmt: skip
_ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}  # column, AUDIT_ARCH_*
_CLONE, _CLONE3 = (56, 220), (435, 435)
_CLONE_NEW = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)  # the keyctl syscall's number, where known
_KEYCTL_JOIN_SESSION_KEYRING, _KEYCTL_CLEAR = 1, 7
_SESSION, _USER, _USER_SESSION = -3, -4, -5  # KEY_SPEC_* keyrings a test could leave keys in
_IPC_RMID = 0
# Keyrings every process of the sandbox's user has (empty once cleared); any other key is a leftover.
_OWN_KEYRINGS = ("_uid.", "_uid_ses.", ".user_reg", "_ses")


def _filter(machine: str) -> bytes | None:
    """A seccomp BPF program refusing _REFUSED, clone with namespace flags, and clone3 (ENOSYS: libc then uses
    clone, whose flags a filter can see); any other architecture's calls (x32, i386) kill. None where unknown."""
    if machine not in _ARCHES:
        return None
    column, arch = _ARCHES[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    allow, kill = 0x7FFF0000, 0x80000000
    refuse, nosys = 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_ERRNO | EPERM, ENOSYS
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if machine == "x86_64":
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]  # the x32 ABI's numbers
    for numbers in _REFUSED.values():
        if numbers[column] >= 0:
            prog += [(jeq, 0, 1, numbers[column]), (ret, 0, 0, refuse)]
    prog += [(jeq, 0, 1, _CLONE3[column]), (ret, 0, 0, nosys)]
    prog += [(jeq, 0, 3, _CLONE[column]), (ld, 0, 0, 16), (jset, 0, 1, _CLONE_NEW), (ret, 0, 0, refuse)]
    prog += [(ret, 0, 0, allow)]
    return b"".join(struct.pack("<HBBI", *op) for op in prog)


def _install_filter() -> str:
    """Load the system-call filter for this process and all it starts; what is in place, for the host."""
    program = _filter(os.uname().machine)
    if program is None:
        return "none (no table for this architecture)"

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = Prog(len(program) // 8, program)
    if _LIBC.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS (bubblewrap and setpriv set it already)
        raise OSError(ctypes.get_errno(), "no_new_privs")
    if _LIBC.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "loading the system-call filter failed")
    return "seccomp"


def _harden() -> str:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        _LIBC.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    except Exception:
        pass
    if _KEYCTL is not None:  # a session keyring of its own: the host's (a container runtime's) is never written
        _LIBC.syscall(_KEYCTL, _KEYCTL_JOIN_SESSION_KEYRING, None)
    return _install_filter()


def _limiter(limits: dict[str, Any], cpu_s: float) -> Callable[[], None]:
    def apply() -> None:
        mem = int(limits["memory_mb"]) * 1024 * 1024
        pairs = [
            (resource.RLIMIT_CPU, (int(cpu_s) + 1, int(cpu_s) + 2)),
            (resource.RLIMIT_NPROC, (int(limits["procs"]),) * 2),
            (resource.RLIMIT_NOFILE, (int(limits["files"]),) * 2),
            (resource.RLIMIT_FSIZE, (int(limits["file_bytes"]),) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
            (resource.RLIMIT_MSGQUEUE, (0, 0)),  # no POSIX message queue (one would outlive the test)
        ]
        if mem > 0:
            pairs.append((resource.RLIMIT_AS, (mem, mem)))
        for which, value in pairs:
            resource.setrlimit(which, value)

    return apply


def _reap() -> None:
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _sweep() -> None:
    """Kill every process of the namespace but this one (kill(-1) from its init reaches them all) and reap them."""
    for _ in range(500):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            _reap()
            return
        except OSError:
            pass
        _reap()
        time.sleep(0.002)


def _ipc_ids(kind: str) -> list[int]:
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return []
    return [int(row.split()[1]) for row in rows if len(row.split()) > 1]


def _clear_ipc() -> None:
    """Remove the System V shared memory, message queues and semaphores the tests left (they outlive processes)."""
    for i in _ipc_ids("shm"):
        _LIBC.shmctl(i, _IPC_RMID, None)
    for i in _ipc_ids("msg"):
        _LIBC.msgctl(i, _IPC_RMID, None)
    for i in _ipc_ids("sem"):
        _LIBC.semctl(i, 0, _IPC_RMID)


def _clear_keys() -> None:
    """Unlink every key from the keyrings that outlive a process (the user's, the user session's, this one's)."""
    if _KEYCTL is not None:
        for ring in (_SESSION, _USER, _USER_SESSION):
            _LIBC.syscall(_KEYCTL, _KEYCTL_CLEAR, ring)


def _leftover_keys() -> list[str]:
    try:
        with open("/proc/keys") as f:
            rows = f.read().splitlines()
    except OSError:
        return []
    left = []
    for row in rows:
        parts = row.split(None, 8)
        if len(parts) < 9:
            continue
        kind, description = parts[7], parts[8]
        if kind == "keyring" and description.startswith(_OWN_KEYRINGS):
            continue
        left.append(f"key {kind}:{description.split(':')[0]}")
    return left


def _give_back(path: str) -> None:
    """Owner permissions on every directory under ``path``, so a test's chmod 000 cannot keep its files."""
    for root, dirs, _files in os.walk(path):
        for name in dirs:
            try:
                os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)
            except OSError:
                pass


def _wipe_tmp() -> None:
    for name in os.listdir("/tmp"):
        path = os.path.join("/tmp", name)
        if os.path.isdir(path) and not os.path.islink(path):
            try:
                os.chmod(path, 0o700)
            except OSError:
                pass
            _give_back(path)
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


class _Inbox:
    """The host's lines on stdin, read here rather than through a buffered file so that a running test's wait can
    watch for a stop: while a job runs, the only lines the host sends are stops."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.closed = False  # the host ended the sandbox
        self.stopped = False  # the running job was taken back

    def read(self) -> None:
        chunk = os.read(0, 65536)
        if chunk:
            self.buffer.extend(chunk)
        else:
            self.closed = True
        self.stopped = self.stopped or self._line_or_end()

    def stop_asked(self) -> bool:
        """Whether the running job was taken back (without waiting)."""
        if not self.stopped:
            if self._line_or_end():
                self.stopped = True
            elif select.select([0], [], [], 0)[0]:
                self.read()
        return self.stopped

    def _line_or_end(self) -> bool:
        """A whole line (a stop, while a job runs) or the end of stdin: either ends the running job."""
        return b"\n" in self.buffer or self.closed

    def job(self) -> dict[str, Any] | None:
        """The next job, waited for; None at the end of stdin."""
        while True:
            end = self.buffer.find(b"\n")
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[: end + 1]
                record = json.loads(line) if line.strip() else {}
                if record and not record.get("stop"):
                    self.stopped = False
                    return record
            elif self.closed:
                return None
            else:
                self.read()


_INBOX = _Inbox()


def _reset() -> None:
    """Between tests: no process but this one, no IPC object, no key."""
    _sweep()
    _clear_ipc()
    _clear_keys()


def _leftovers() -> list[str]:
    """What a job left after the reset (empty when the sandbox is as it started)."""
    me = os.getpid()
    left = [f"process {p}" for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
    left += [f"/tmp/{name}" for name in os.listdir("/tmp")]
    left += [f"System V {kind} {i}" for kind in ("shm", "msg", "sem") for i in _ipc_ids(kind)]
    for _ in range(50):  # an unlinked key lingers until the kernel's key collector runs
        keys = _leftover_keys()
        if not keys:
            break
        time.sleep(0.002)
    return left + keys


def _fresh_workdir(files: dict[str, bytes]) -> None:
    _wipe_tmp()
    os.makedirs(WORK, exist_ok=True)
    for name, data in files.items():
        path = os.path.join(WORK, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o755)


def _run(
    argv: list[str], stdin_data: bytes, limits: dict[str, Any], wall_s: float, cpu_s: float, out_cap: int
) -> tuple[str, int | None, int | None, bytes, bytes, float, float]:
    """One process under limits: (status, exit code, signal, stdout, stderr tail, wall, cpu)."""
    stdin = _stdin_file(stdin_data)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            cwd=WORK,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,
            preexec_fn=_limiter(limits, cpu_s),
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK, "TMPDIR": "/tmp", "LANG": "C.UTF-8"},
        )
    except OSError as exc:
        stdin.close()
        return "error", None, None, b"", str(exc).encode(), 0.0, 0.0
    stdin.close()
    assert proc.stdout is not None and proc.stderr is not None
    deadline = start + wall_s
    status, out, err = _read(proc, deadline, out_cap)
    if status:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(timeout=max(0.0, deadline + 1 - time.monotonic()) if status is None else 2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    wall = time.monotonic() - start
    _reset()
    proc.stdout.close()
    proc.stderr.close()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    code = proc.returncode
    if status is None:
        status = "exited"
    sig = -code if code is not None and code < 0 else None
    if cpu > cpu_s and status == "exited" and sig in (signal.SIGXCPU, signal.SIGKILL):
        status = "timeout"
    return status, (code if code is not None and code >= 0 else None), sig, bytes(out[:out_cap]), bytes(err), wall, cpu


def _stdin_file(data: bytes) -> BinaryIO:
    """The test's stdin as an open file already unlinked, so the test cannot find it in its work dir."""
    in_path = os.path.join(WORK, ".stdin")
    with open(in_path, "wb") as f:
        f.write(data)
    stdin = open(in_path, "rb")
    os.unlink(in_path)
    return stdin


def _read(proc: subprocess.Popen[bytes], deadline: float, out_cap: int) -> tuple[str | None, bytearray, bytearray]:
    """The test's stdout and stderr until both close, or until it runs out of time or output or the host stops it
    (the status that ends it, else None)."""
    out, err = bytearray(), bytearray()
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    sel.register(0, selectors.EVENT_READ, _INBOX)  # a stop from the host
    status: str | None = None
    exited_at: float | None = None
    while len(sel.get_map()) > 1:
        now = time.monotonic()
        if now >= deadline:
            status = "timeout"
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
            _kill_others()  # the test's main process exited: its leftovers (background children) die with it
        for key, _ in sel.select(min(0.05, deadline - now)):
            if key.data is _INBOX:
                _INBOX.read()
                if _INBOX.stopped:
                    status = "stopped"
                    break
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = key.data
            if buf is out:
                out.extend(chunk)
                if len(out) > out_cap:
                    status = "output_limit"
                    break
            elif len(err) < 1 << 20:
                err.extend(chunk)
        if status:
            break
    sel.close()
    return status, out, err


def _kill_others() -> None:
    """Every process but this one (an exited test's main process stays a zombie until waited for)."""
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _text(data: bytes, keep: int | None = None) -> str:
    text = data.decode("utf-8", errors="replace")
    return text[-keep:] if keep else text


def _serve(job: dict[str, Any]) -> None:
    """One job: its compile (if any), then each test in a fresh process, one line each."""
    limits = job["limits"]
    files = {name: text.encode() for name, text in job["files"].items()}
    if job.get("compile"):
        if _INBOX.stop_asked():
            return
        _fresh_workdir(files)
        climits = dict(limits, memory_mb=max(int(limits["memory_mb"]), 2048) if limits["memory_mb"] else 0)
        climits["procs"] = max(int(limits["procs"]), 64)
        t = float(job["compile_timeout_s"])
        status, code, sig, _, err, wall, _ = _run(job["compile"], b"", climits, t, t, 1 << 16)
        if status == "stopped":
            return
        ok = status == "exited" and code == 0
        _emit({"compile": {"ok": ok, "status": status, "exit": code, "stderr": _text(err, STDERR_KEEP), "time": wall}})
        if not ok:
            return
        binary = job["binary"]
        with open(os.path.join(WORK, binary), "rb") as f:
            files[binary] = f.read()
    for i, stdin_text in enumerate(job["tests"]):
        if _INBOX.stop_asked():
            return
        _fresh_workdir(files)
        status, code, sig, out, err, wall, cpu = _run(
            job["run"],
            stdin_text.encode(),
            limits,
            float(limits["wall_s"]),
            float(limits["cpu_s"]),
            int(limits["output_bytes"]),
        )
        if status == "stopped":
            return
        _emit(
            {
                "test": i,
                "status": status,
                "exit": code,
                "signal": sig,
                "stdout": base64.b64encode(out).decode(),  # bounded size whatever the bytes are
                "stderr": _text(err, STDERR_KEEP),
                "time": wall,
                "cpu": cpu,
            }
        )
        if job.get("stop_on_error") and (status != "exited" or code != 0):
            break


def main() -> None:
    _emit({"ready": os.getpid(), "filter": _harden()})
    while (job := _INBOX.job()) is not None:  # the end of stdin ends the sandbox
        _serve(job)
        _reset()
        _wipe_tmp()
        left = _leftovers()
        _emit({"done": True, "clean": not left, "left": left[:20], "stopped": _INBOX.stopped})
        if left:
            return


if __name__ == "__main__":
    main()
