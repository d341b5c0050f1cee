"""Multi-host: the real CLI servers on separate network hosts, and a reward host dying mid-step.

Four network namespaces made by this test stand for four machines: a trainer, a rollout host and two
reward hosts, joined by veth pairs to a bridge in the trainer's namespace on a private test subnet that
exists only inside them. `rewardmesh serve reward` runs on each reward host and `rewardmesh serve rollout`
(hf backend, tiny policy) on the rollout host with both reward hosts as its targets. From the trainer's
namespace a client waits for every server's health to be SERVING, then runs one rollout step (8 prompts x 2
samples) scored by a deliberately slow reward function. The moment reward host A has samples in flight it is
SIGKILLed; host B must take them over, so that every sample comes back exactly once, scored, with no error.

Needs root and iproute2 (`ip netns`); skipped otherwise. Everything it starts (processes, namespaces and the
links inside them) it stops, on failure too, and its traffic never leaves the namespaces it made.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from rewardmesh.demo.tiny_models import TinyModelPaths
from tests.support.paths import REPO as ROOT

SUBNET = "10.231.0"  # a /24 that exists only inside this test's namespaces
REWARD_PORT, ROLLOUT_PORT = 50051, 50061
PROMPTS, N = 8, 2
REWARD_SLEEP_S = 1.5  # host B's time per sample (host A holds its samples until it is killed)

pytestmark = [
    pytest.mark.skipif(
        sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None,
        reason="needs Linux, root and iproute2's `ip` to make network namespaces",
    ),
    pytest.mark.timeout(180),
    pytest.mark.root,
    pytest.mark.integration,
    pytest.mark.slow,
]

# The slow reward: marks each call's start and end in a directory the test watches, tagged with the host.
SLOW_REWARD = """
import asyncio
import os
import uuid
from pathlib import Path


async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    marks = Path(os.environ["RM_TEST_MARKS"])
    host, call = os.environ["RM_TEST_HOST"], uuid.uuid4().hex
    (marks / f"{host}-start-{call}").touch()
    await asyncio.sleep(float(os.environ["RM_TEST_SLEEP_S"]))
    (marks / f"{host}-done-{call}").touch()
    return {"score": 1.0, "host": host}
"""

# Runs in the trainer's namespace: `health ADDR...` waits until each serves; `generate ADDR` runs one step.
TRAINER = """
import asyncio
import json
import sys
import time

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rewardmesh.v1 import rollout_pb2, rollout_pb2_grpc


async def health(addresses, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s
    for address in addresses:
        async with aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    print(json.dumps({"unhealthy": address}), flush=True)
                    return 1
                await asyncio.sleep(0.2)
        print(json.dumps({"serving": address}), flush=True)
    return 0


async def generate(address, prompts, n):
    request = rollout_pb2.GenerateRequest(
        prompts=[
            rollout_pb2.Prompt(
                group_id=f"g{i}",
                chat=rollout_pb2.ChatPrompt(messages=[rollout_pb2.ChatMessage(role="user", content=f"{i}+{i}=")]),
                data_source="multihost",
                ground_truth=str(2 * i),
            )
            for i in range(prompts)
        ],
        n=n,
        sampling=rollout_pb2.SamplingParams(temperature=1.0, max_tokens=4, seed=0),
        reward="slow",
    )
    async with aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        async for response in stub.Generate(request, timeout=90):
            result = response.result
            print(json.dumps({
                "sample_id": response.sample.sample_id,
                "scored": response.HasField("result"),
                "score": result.score,
                "error": result.error.message if result.HasField("error") else "",
            }), flush=True)
    return 0


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "health":
        sys.exit(asyncio.run(health(rest)))
    sys.exit(asyncio.run(generate(rest[0], int(rest[1]), int(rest[2]))))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without proxies (gRPC would route the test subnet through them)."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and not k.startswith("REWARDMESH_")}
    env.update(PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[str]
    log_path: Path
    log: IO[str]

    def tail(self, lines: int = 25) -> str:
        self.log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return f"--- {self.name} (exit {self.popen.poll()}) ---\n" + "\n".join(text[-lines:])


@dataclass
class Hosts:
    """Network namespaces joined to a bridge in the first one, and the processes started in them."""

    tmp: Path
    names: dict[str, str] = field(default_factory=dict)  # role -> namespace
    addresses: dict[str, str] = field(default_factory=dict)  # role -> address on the test subnet
    processes: list[Process] = field(default_factory=list)

    def create(self, roles: list[str]) -> None:
        tag = f"rmt{os.getpid()}"
        hub = roles[0]
        for role in roles:
            ns = f"{tag}-{role}"
            result = _ip("netns", "add", ns)
            if result.returncode != 0:
                if not self.names:
                    pytest.skip(f"cannot create a network namespace here: {result.stderr.strip()}")
                raise RuntimeError(f"ip netns add {ns}: {result.stderr.strip()}")
            self.names[role] = ns
            self._run("-n", ns, "link", "set", "lo", "up")
        hub_ns = self.names[hub]
        made = _ip("-n", hub_ns, "link", "add", "br0", "type", "bridge")
        if made.returncode != 0:
            pytest.skip(f"cannot create a bridge inside a network namespace: {made.stderr.strip()}")
        self._run("-n", hub_ns, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
        self._run("-n", hub_ns, "link", "set", "br0", "up")
        self.addresses[hub] = f"{SUBNET}.1"
        for i, role in enumerate(roles[1:], start=2):
            ns, port = self.names[role], f"p{i}"
            # One veth pair: `port` on the bridge in the hub's namespace, eth0 in the host's namespace.
            self._run("link", "add", port, "netns", hub_ns, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._run("-n", hub_ns, "link", "set", port, "master", "br0")
            self._run("-n", hub_ns, "link", "set", port, "up")
            self._run("-n", ns, "addr", "add", f"{SUBNET}.{i}/24", "dev", "eth0")
            self._run("-n", ns, "link", "set", "eth0", "up")
            self.addresses[role] = f"{SUBNET}.{i}"

    def _run(self, *args: str) -> None:
        result = _ip(*args)
        if result.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")

    def start(self, role: str, name: str, argv: list[str], **env: str) -> Process:
        log_path = self.tmp / f"{name}.log"
        log = open(log_path, "w")  # closed in stop_all
        popen = subprocess.Popen(
            ["ip", "netns", "exec", self.names[role], *argv],
            cwd=ROOT,
            env=_clean_env(**env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: stop_all ends it and anything it spawned
        )
        process = Process(name, popen, log_path, log)
        self.processes.append(process)
        return process

    def run(self, role: str, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """A short-lived command in a namespace, ended with its process group if it overruns."""
        popen = subprocess.Popen(
            ["ip", "netns", "exec", self.names[role], *argv], cwd=ROOT, env=_clean_env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(popen, signal.SIGKILL)
            out, err = popen.communicate()
            pytest.fail(f"{' '.join(argv)} in {role} did not finish within {timeout}s:\n{out}\n{err}")
        return subprocess.CompletedProcess(popen.args, popen.returncode, out, err)

    def stop(self, process: Process, sig: signal.Signals = signal.SIGTERM, wait_s: float = 15.0) -> int | None:
        _kill_group(process.popen, sig)
        try:
            return process.popen.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            _kill_group(process.popen, signal.SIGKILL)
            process.popen.wait(timeout=10)
            return None

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            if process.popen.poll() is None:
                self.stop(process, signal.SIGTERM, wait_s=10)
            # Anything the server left in its process group.
            _kill_group(process.popen, signal.SIGKILL)
            process.log.close()
        for ns in reversed(list(self.names.values())):
            _ip("netns", "del", ns)  # takes the veth pairs and the bridge with it


def _kill_group(popen: subprocess.Popen[Any], sig: signal.Signals) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    h = Hosts(tmp_path)
    try:
        h.create(["trainer", "rollout", "reward-a", "reward-b"])
        yield h
    finally:
        h.stop_all()
    leftovers = [ns for ns in h.names.values() if _ip("netns", "pids", ns).returncode == 0]
    assert not leftovers, f"network namespaces left behind: {leftovers}"


def _marks(directory: Path, host: str, kind: str) -> set[str]:
    prefix = f"{host}-{kind}-"
    return {p.name.removeprefix(prefix) for p in directory.iterdir() if p.name.startswith(prefix)}


def test_reward_host_dies_mid_step_and_the_other_takes_over(
    hosts: Hosts, tiny_models: TinyModelPaths, tmp_path: Path
) -> None:
    started = time.monotonic()
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    (tmp_path / "trainer.py").write_text(TRAINER)
    config = tmp_path / "reward.yaml"
    config.write_text(
        textwrap.dedent(f"""\
            server:
              grace_s: 2
            pipelines:
              slow:
                sources:
                  - type: function
                    function: {tmp_path / "slow_reward.py"}:compute_score
                    timeout_s: 30
            """)
    )
    cli = [sys.executable, "-m", "rewardmesh.server.cli"]
    # Host A holds every sample it starts until it is killed, so it surely has work in flight when it dies.
    sleep_s = {"a": "600", "b": str(REWARD_SLEEP_S)}
    servers = {
        host: hosts.start(
            f"reward-{host}", f"reward-{host}",
            [*cli, "serve", "reward", "--host", "0.0.0.0", "--port", str(REWARD_PORT), "--config", str(config)],
            RM_TEST_HOST=host, RM_TEST_MARKS=str(marks), RM_TEST_SLEEP_S=sleep_s[host],
        )
        for host in ("a", "b")
    }  # fmt: skip
    reward_targets = ",".join(f"{hosts.addresses[f'reward-{h}']}:{REWARD_PORT}" for h in ("a", "b"))
    rollout = hosts.start(
        "rollout", "rollout",
        [*cli, "serve", "rollout", "--host", "0.0.0.0", "--port", str(ROLLOUT_PORT), "--backend", "hf",
         "--model", str(tiny_models.policy), "--device", "cpu", "--reward-target", reward_targets, "--grace-s", "2"],
    )  # fmt: skip

    def logs() -> str:
        return "\n".join(p.tail() for p in hosts.processes)

    trainer = [sys.executable, str(tmp_path / "trainer.py")]
    addresses = [f"{hosts.addresses['rollout']}:{ROLLOUT_PORT}"] + [
        f"{hosts.addresses[f'reward-{h}']}:{REWARD_PORT}" for h in ("a", "b")
    ]
    health = hosts.run("trainer", [*trainer, "health", *addresses], timeout=120)
    assert health.returncode == 0, f"servers not SERVING from the trainer's host:\n{health.stdout}\n{logs()}"
    ready_s = time.monotonic() - started

    # The step, from the trainer's namespace; host A is killed as soon as it is scoring.
    step = hosts.start("trainer", "trainer", [*trainer, "generate", addresses[0], str(PROMPTS), str(N)])
    deadline = time.monotonic() + 60
    while not _marks(marks, "a", "start"):
        assert step.popen.poll() is None, f"the step ended before host A scored anything\n{logs()}"
        assert time.monotonic() < deadline, f"host A never started scoring\n{logs()}"
        time.sleep(0.01)
    hosts.stop(servers["a"], signal.SIGKILL)
    in_flight_on_a = _marks(marks, "a", "start") - _marks(marks, "a", "done")

    try:
        step.popen.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the step did not finish after host A died\n{logs()}")
    assert step.popen.returncode == 0, logs()
    step.log.flush()
    results = [json.loads(line) for line in step.log_path.read_text().splitlines() if line.startswith("{")]

    ids = Counter(r["sample_id"] for r in results)
    expected = {f"g{i}/{j}" for i in range(PROMPTS) for j in range(N)}  # the server's ids: <group_id>/<i>
    assert set(ids) == expected, f"samples missing: {expected - set(ids)}, unknown: {set(ids) - expected}\n{logs()}"
    assert max(ids.values()) == 1, f"samples returned more than once: {[i for i, c in ids.items() if c > 1]}"
    assert all(r["scored"] and not r["error"] for r in results), [r for r in results if not r["scored"] or r["error"]]
    assert all(r["score"] == 1.0 for r in results)
    # Host A really had work in flight when it died, and host B scored it again.
    assert in_flight_on_a, "host A finished its samples before it was killed; the test proved nothing"
    done_a, done_b = _marks(marks, "a", "done"), _marks(marks, "b", "done")
    assert len(done_a) + len(done_b) >= PROMPTS * N, (len(done_a), len(done_b))

    # The survivors drain and exit cleanly on SIGTERM.
    assert hosts.stop(rollout) == 0, logs()
    assert hosts.stop(servers["b"]) == 0, logs()
    total_s = time.monotonic() - started
    print(f"servers ready in {ready_s:.1f}s; whole test {total_s:.1f}s; {len(in_flight_on_a)} samples in flight "
          f"on host A when it died, {len(done_b)} scored on host B")  # fmt: skip
