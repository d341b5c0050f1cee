"""The program that runs inside a sandbox as its PID 1: it runs one job's tests one after another, each in a
fresh process under resource limits, and streams one JSON line per test to the host.

It is started with the system's Python and uses the standard library only (nothing of the project is visible
inside). As PID 1 of the sandbox's PID namespace it cannot be killed by the programs it runs (the kernel drops
signals sent to a namespace's init from inside it), and it is made non-dumpable so they cannot attach to it or
read its pipes. It never sees expected outputs: the host compares, so a program cannot learn or forge verdicts.
Between tests every other process in the namespace is killed and the working directory is wiped, so the tests
of one job are independent runs even though they share a sandbox start.
"""

from __future__ import annotations

import base64
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

WORK = "/tmp/work"
STDERR_KEEP = 4096


def _harden() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    except Exception:
        pass


def _limiter(limits: dict[str, Any], cpu_s: float) -> Callable[[], None]:
    def apply() -> None:
        mem = int(limits["memory_mb"]) * 1024 * 1024
        pairs = [
            (resource.RLIMIT_CPU, (int(cpu_s) + 1, int(cpu_s) + 2)),
            (resource.RLIMIT_NPROC, (int(limits["procs"]),) * 2),
            (resource.RLIMIT_NOFILE, (int(limits["files"]),) * 2),
            (resource.RLIMIT_FSIZE, (int(limits["file_bytes"]),) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        if mem > 0:
            pairs.append((resource.RLIMIT_AS, (mem, mem)))
        for which, value in pairs:
            resource.setrlimit(which, value)

    return apply


def _sweep() -> None:
    """Kill every process of the namespace but this one and reap them all."""
    me = os.getpid()
    for _ in range(50):
        others = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if not others:
            return
        time.sleep(0.002)


def _fresh_workdir(files: dict[str, bytes]) -> None:
    for name in os.listdir("/tmp"):
        path = os.path.join("/tmp", name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
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
    in_path = os.path.join(WORK, ".stdin")
    with open(in_path, "wb") as f:
        f.write(stdin_data)
    stdin = open(in_path, "rb")
    os.unlink(in_path)
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
    out, err = bytearray(), bytearray()
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    status: str | None = None
    deadline = start + wall_s
    exited_at: float | None = None
    while sel.get_map():
        now = time.monotonic()
        if now >= deadline:
            status = "timeout"
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
            _sweep_others(proc.pid)
        for key, _ in sel.select(min(0.05, deadline - now)):
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
    _sweep()
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


def _sweep_others(keep: int) -> None:
    """The test's main process exited: its leftovers (background children) die with it."""
    me = os.getpid()
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) not in (me, keep):
            try:
                os.kill(int(p), signal.SIGKILL)
            except OSError:
                pass


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _text(data: bytes, keep: int | None = None) -> str:
    text = data.decode("utf-8", errors="replace")
    return text[-keep:] if keep else text


def main() -> None:
    _harden()
    job = json.loads(sys.stdin.buffer.read())
    limits = job["limits"]
    files = {name: text.encode() for name, text in job["files"].items()}
    if job.get("compile"):
        _fresh_workdir(files)
        climits = dict(limits, memory_mb=max(int(limits["memory_mb"]), 2048) if limits["memory_mb"] else 0)
        climits["procs"] = max(int(limits["procs"]), 64)
        t = float(job["compile_timeout_s"])
        status, code, sig, _, err, wall, _ = _run(job["compile"], b"", climits, t, t, 1 << 16)
        ok = status == "exited" and code == 0
        _emit({"compile": {"ok": ok, "status": status, "exit": code, "stderr": _text(err, STDERR_KEEP), "time": wall}})
        if not ok:
            return
        binary = job["binary"]
        with open(os.path.join(WORK, binary), "rb") as f:
            files[binary] = f.read()
    for i, stdin_text in enumerate(job["tests"]):
        _fresh_workdir(files)
        status, code, sig, out, err, wall, cpu = _run(
            job["run"],
            stdin_text.encode(),
            limits,
            float(limits["wall_s"]),
            float(limits["cpu_s"]),
            int(limits["output_bytes"]),
        )
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
    _fresh_workdir({})


if __name__ == "__main__":
    main()
