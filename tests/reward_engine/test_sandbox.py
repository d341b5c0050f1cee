"""The code reward source and its sandbox, fast paths: the shipped test set in both forms, both isolation
levels, refusal of weaker isolation, the engine's pipelines, and SandboxFusion's /run_code over plain HTTP."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import aiohttp
import pytest

from rewardmesh.common.errors import InvalidInput, SourceFailed
from rewardmesh.demo.code_problems import PROBLEMS
from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.reward_engine.isolation import WORKER_NICENESS
from rewardmesh.reward_engine.sandbox import levels
from rewardmesh.reward_engine.sandbox.executor import Job, JobResult, Sandbox, SandboxUnavailable
from rewardmesh.reward_engine.sandbox.grading import extract_program, job_of, outcome, plan, stdout_matches
from rewardmesh.reward_engine.sandbox.process import SandboxProcess
from rewardmesh.reward_engine.sources.code import CodeSource, score_kind
from rewardmesh.v1 import reward_pb2
from tests.support.sandbox import held_uids, needs_bwrap
from tests.support.servers import http_gateway, reward_server, reward_stub, sample
from tests.support.waiting import eventually, holds_for

MakeSource = Callable[..., CodeSource]
needs_gpp = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")


def test_extracts_the_program_as_verl_does() -> None:
    text = "think\n```text\nnot code\n```\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```\n"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("```\nprint(3)\n```\n```\nprint(5)\n```") == "print(3)\n"
    assert extract_program("print(4)") == "print(4)"
    assert extract_program("```cpp\nint main(){}\n```\n```python\nx\n```", "cpp") == "int main(){}\n"


def test_stdout_comparison_ignores_trailing_space_and_float_noise() -> None:
    assert stdout_matches("3 \n\n", "3")
    assert stdout_matches("1.5000000001\n", "1.5")
    assert not stdout_matches("4\n", "3\n")
    assert not stdout_matches("1 2", "1 2 3")


def test_malformed_tests_name_the_field() -> None:
    with pytest.raises(InvalidInput, match="ground_truth: 'inputs' and 'outputs'"):
        plan("print(1)", json.dumps({"inputs": ["1"], "outputs": []}))
    with pytest.raises(InvalidInput, match="ground_truth: not valid JSON"):
        plan("print(1)", "{oops")
    with pytest.raises(InvalidInput, match="language: 'cobol'"):
        plan("x", json.dumps({"inputs": ["1"], "outputs": ["1"], "language": "cobol"}))


def test_score_follows_data_source_like_verl() -> None:
    assert score_kind("codecontests") == "pass_rate"
    assert score_kind("taco") == "pass_rate"
    assert score_kind("openai_humaneval") == "all_passed"
    assert score_kind("anything", "pass_rate") == "pass_rate"


@pytest.fixture(scope="module")
def bwrap_source() -> Iterator[CodeSource]:
    source = CodeSource("code", timeout_s=5.0, workers=2)
    yield source
    source.sandbox.close()


@pytest.fixture
def code_source() -> Iterator[MakeSource]:
    """Code sources whose warm sandboxes end with the test."""
    made: list[CodeSource] = []

    def make(**options: Any) -> CodeSource:
        made.append(CodeSource("code", **options))
        return made[-1]

    yield make
    for source in made:
        source.sandbox.close()


@needs_bwrap
@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.name for p in PROBLEMS])
async def test_shipped_problems_canonical_pass_wrong_fail(problem: Any, bwrap_source: CodeSource) -> None:
    if problem.language == "cpp" and shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    good = await bwrap_source.grade(problem.canonical, problem.ground_truth, problem.data_source)
    assert good.score == 1.0 and all(t.outcome == "passed" for t in good.tests), good.tests
    bad = await bwrap_source.grade(problem.wrong, problem.ground_truth, problem.data_source)
    assert bad.score < 1.0 and any(t.outcome == "wrong_answer" for t in bad.tests), bad.tests
    assert bwrap_source.sandbox.level is not None and bwrap_source.sandbox.level.name == "bwrap"


@needs_bwrap
async def test_outcomes_per_test_and_pass_fraction(bwrap_source: CodeSource) -> None:
    truth = json.dumps({"inputs": ["1\n", "2\n", "3\n", "4\n"], "outputs": ["1\n", "4\n", "9\n", "16\n"]})
    program = (
        "```python\nn = int(input())\nif n == 2: print(5)\nelif n == 3: raise SystemExit(3)\nelse: print(n*n)\n```"
    )
    g = await bwrap_source.grade(program, truth, "apps")
    assert [t.outcome for t in g.tests] == ["passed", "wrong_answer", "runtime_error", "passed"]
    assert g.score == 0.5
    extras = g.extras()
    assert extras["pass_rate"] == 0.5 and extras["acc"] == 0.0 and extras["wrong_answer"] == 1.0
    assert extras["outcome/2"] == -2.0 and extras["time_s/0"] > 0
    # all-passed scoring stops at the first crash: later tests are reported as skipped, not run
    g = await bwrap_source.grade(program, truth, "mbpp")
    assert g.score == 0.0 and [t.outcome for t in g.tests] == ["passed", "wrong_answer", "runtime_error", "skipped"]


async def test_unshare_level_runs_and_contains(code_source: MakeSource) -> None:
    if levels.Level.find("unshare") is None:
        pytest.skip("util-linux unshare/mount/setpriv/chroot missing")
    src = code_source(isolation="unshare", timeout_s=5.0, workers=1)
    problem = PROBLEMS[0]
    assert (await src.grade(problem.canonical, problem.ground_truth, problem.data_source)).score == 1.0
    assert (await src.grade(problem.wrong, problem.ground_truth, problem.data_source)).score == 0.0
    hostile = "import socket, os\nsocket.create_connection(('127.0.0.1', 22), 1)\nopen('/usr/x', 'w')\nprint('out')"
    g = await src.grade(hostile, json.dumps({"inputs": [""], "outputs": ["out"]}))
    assert g.tests[0].outcome == "runtime_error" and "Network is unreachable" in g.tests[0].reason
    assert src.sandbox.level is not None and src.sandbox.level.name == "unshare"


async def test_refuses_weaker_isolation_unless_allowed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, code_source: MakeSource
) -> None:
    if levels.Level.find("unshare") is None:
        pytest.skip("util-linux unshare/mount/setpriv/chroot missing")
    monkeypatch.setenv("PATH", str(tmp_path))  # bubblewrap is looked up on PATH: here it is missing
    assert levels.Level.find("bwrap") is None
    strict = code_source(workers=1)
    with pytest.raises(SandboxUnavailable, match=r"'bwrap' is not available: bwrap: not installed.*allow_weaker"):
        await strict.grade(PROBLEMS[0].canonical, PROBLEMS[0].ground_truth)
    [out] = await strict.score_batch([_input(PROBLEMS[0].canonical, PROBLEMS[0].ground_truth)])
    assert isinstance(out, SandboxUnavailable)  # a sample error, never a score
    lenient = code_source(workers=1, allow_weaker_isolation=True)
    assert (await lenient.grade(PROBLEMS[0].canonical, PROBLEMS[0].ground_truth)).score == 1.0
    assert lenient.sandbox.level is not None and lenient.sandbox.level.name == "unshare"


def _input(response: str, truth: str, data_source: str = "") -> Any:
    import numpy as np

    from rewardmesh.reward_engine.types import RewardInput

    empty = np.zeros(0, np.int32)
    return RewardInput("s", empty, empty, response_text=response, ground_truth=truth, data_source=data_source)


def test_engine_offers_a_code_pipeline_and_config_type() -> None:
    engine = RewardEngine()
    engine.add_builtin_rules()
    assert engine.get("code").sources[0].source.kind == "code"
    engine.add_from_config({"my_code": {"sources": [{"type": "code", "timeout_s": 2.0, "score": "pass_rate"}]}})
    assert engine.get("my_code").sources[0].source.kind == "code"
    with pytest.raises(ValueError, match="unknown option"):
        engine.add_from_config({"bad": {"sources": [{"type": "code", "timeout": 2}]}})
    with pytest.raises(ValueError, match="'samples_per_sandbox' must be an integer >= 1, got 0"):
        engine.add_from_config({"bad": {"sources": [{"type": "code", "samples_per_sandbox": 0}]}})


@needs_bwrap
async def test_code_pipeline_over_grpc() -> None:
    problem = PROBLEMS[1]
    async with reward_server() as server, reward_stub(server.address) as stub:
        good = sample("a", response=problem.canonical, truth=problem.ground_truth)
        good.data_source = problem.data_source
        bad = sample("b", response=problem.wrong, truth=problem.ground_truth)
        bad.data_source = problem.data_source
        broken = sample("c", response="print(1)", truth="{not json")
        reply = await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward="code", samples=[good, bad, broken]))
        listing = await stub.ListRewards(reward_pb2.ListRewardsRequest())
    [code] = [p for p in listing.pipelines if p.name == "code"]
    assert code.sources[0].kind == reward_pb2.REWARD_SOURCE_KIND_CODE
    by_id = {r.sample_id: r for r in reply.results}
    assert by_id["a"].score == 1.0 and by_id["a"].extras["pass_rate"] == 1.0
    assert by_id["b"].score < 1.0 and by_id["b"].extras["wrong_answer"] >= 1
    assert by_id["c"].error.code != 0 and "ground_truth" in by_id["c"].error.message


@needs_bwrap
async def test_run_code_over_plain_http() -> None:
    async with reward_server() as server, http_gateway(server) as gw, aiohttp.ClientSession() as http:

        async def run(**body: Any) -> tuple[int, dict[str, Any]]:
            async with http.post(f"{gw.url}/run_code", json=body) as resp:
                return resp.status, await resp.json()

        status, ok = await run(code="print(input() * 2)", stdin="ab", language="python", run_timeout=5)
        assert status == 200 and ok["status"] == "Success" and ok["run_result"]["stdout"] == "abab\n"
        assert ok["run_result"]["status"] == "Finished" and ok["run_result"]["return_code"] == 0
        assert ok["compile_result"] is None
        status, failed = await run(code="raise SystemExit(3)", language="python")
        assert failed["status"] == "Failed" and failed["run_result"]["return_code"] == 3
        status, slow = await run(code="while True: pass", run_timeout=1)
        assert slow["status"] == "Failed" and slow["run_result"]["status"] == "TimeLimitExceeded"
        if shutil.which("g++"):
            status, bad = await run(code="int main( {", language="cpp", compile_timeout=20)
            assert bad["status"] == "Failed" and bad["compile_result"]["return_code"] != 0
            assert "error" in bad["compile_result"]["stderr"]
        status, err = await run(code="print(1)", run_timeout=-1)
        assert status == 400 and "run_timeout" in err["error"]["message"]
        status, err = await run(code="print(1)", language="cobol")
        assert status == 400 and err["error"]["code"] == "INVALID_ARGUMENT" and "language" in err["error"]["message"]
        replies = await asyncio.gather(*(run(code=f"print({i})") for i in range(4)))
        assert [r[1]["run_result"]["stdout"] for r in replies] == [f"{i}\n" for i in range(4)]


LEVELS = ["bwrap", "unshare"]
_SYSCALLS = {"x86_64": {"add_key": 248}, "aarch64": {"add_key": 217}}.get(os.uname().machine, {})


def _level_or_skip(level: str) -> None:
    if levels.Level.find(level) is None:
        pytest.skip(f"the {level} level's tools are not installed")


async def _sample(source: CodeSource, program: str, truth: str) -> tuple[JobResult, list[str]]:
    """A sample through the source's pool, with the sandbox it ran in (JobResult.sandbox) and each test's outcome."""
    p = plan(program, truth)
    result = await source.sandbox.run(job_of(p, source.sandbox.python))
    return result, [outcome(p, i, run)[0] for i, run in enumerate(result.runs)]


@pytest.mark.parametrize("level", LEVELS)
async def test_tests_of_a_sample_are_independent_runs(level: str, code_source: MakeSource) -> None:
    """A sample's tests share its sandbox: each sees a wiped /tmp and no leftover process."""
    _level_or_skip(level)
    src = code_source(isolation=level, timeout_s=5.0, workers=1)
    program = (
        "import os, subprocess\n"
        "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "print(os.path.exists('/tmp/flag'), len(pids))\n"
        "open('/tmp/flag', 'w').write('x')\n"
        "subprocess.Popen(['sleep', '100'], start_new_session=True)\n"
    )
    truth = json.dumps({"inputs": [""] * 5, "outputs": ["False 2"] * 5})  # itself and the runner (PID 1)
    result, outcomes = await _sample(src, program, truth)
    assert outcomes == ["passed"] * 5, result.runs


@pytest.mark.parametrize("level", LEVELS)
async def test_programs_run_nicer_than_the_server(level: str, code_source: MakeSource) -> None:
    """A tenant's CPU-bound programs get the cycles the server leaves, never those of the loop every tenant needs."""
    _level_or_skip(level)
    src = code_source(isolation=level, timeout_s=5.0, workers=1)
    expected = min(os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICENESS, 19)
    truth = json.dumps({"inputs": [""], "outputs": [str(expected)]})
    result, outcomes = await _sample(src, "import os\nprint(os.getpriority(os.PRIO_PROCESS, 0))\n", truth)
    assert outcomes == ["passed"], result.runs


# What one sample leaves behind, and what the next one looks for.
LEAVER = f"""import ctypes, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
os.environ['LEFT_BEHIND'] = '1'
os.putenv('LEFT_BEHIND', '1')
os.chdir('/tmp')
open('/tmp/left-behind', 'w').write('x')
os.makedirs('/tmp/locked/inner')
open('/tmp/locked/inner/f', 'w').write('x')
os.chmod('/tmp/locked/inner', 0)
os.chmod('/tmp/locked', 0)
if os.fork() == 0:  # a daemon: its own session, SIGTERM ignored, its parent gone
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(100)
    os._exit(0)
os.wait()
made = ['shm'] if libc.shmget(0x5eed, 4096, 0o1000 | 0o600) >= 0 else []
add_key = {_SYSCALLS.get("add_key")!r}
if add_key and libc.syscall(add_key, b'user', b'left-behind', b'x', 1, ctypes.c_int(-4)) > 0:  # the user keyring
    made.append('key')
for path in ('/dev/shm/left-behind', '/dev/left-behind'):
    try:
        open(path, 'w').write('x')
        made.append(path)
    except OSError:
        pass
print(' '.join(made))
"""
LOOKER = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
seen = []
if 'LEFT_BEHIND' in os.environ:
    seen.append('environment')
if os.getcwd() != '/tmp/work':
    seen.append('cwd ' + os.getcwd())
if sorted(os.listdir('/tmp')) != ['work'] or os.listdir('.') != ['main.py']:
    seen.append(f"files {os.listdir('/tmp')} {os.listdir('.')}")
for path in ('/dev/shm/left-behind', '/dev/left-behind'):
    if os.path.exists(path):
        seen.append(path)
pids = {int(p) for p in os.listdir('/proc') if p.isdigit()}
if pids != {1, os.getpid()}:
    seen.append(f'processes {sorted(pids)}')
if libc.shmget(0x5eed, 0, 0) >= 0:
    seen.append('shm')
if 'left-behind' in open('/proc/keys').read():
    seen.append('key')
print(' '.join(seen) or 'nothing')
"""
NOTHING = json.dumps({"inputs": [""], "outputs": ["nothing"]})


@pytest.mark.parametrize("level", LEVELS)
async def test_nothing_a_sample_leaves_is_seen_by_the_next_in_the_same_sandbox(
    level: str, code_source: MakeSource
) -> None:
    """A file in /tmp (one locked with chmod 000 too), a daemon, a changed environment variable and working
    directory, a System V shared memory segment and a key: the next sample in the same sandbox sees none of it."""
    _level_or_skip(level)
    src = code_source(isolation=level, timeout_s=5.0, workers=1)
    await src.warmup()
    left, _ = await _sample(src, LEAVER, NOTHING)
    run = left.runs[0]
    assert run.status == "exited" and run.exit_code == 0, run.stderr
    assert "shm" in run.stdout.split(), run.stdout
    assert "key" not in run.stdout.split() or not _SYSCALLS, run.stdout  # the system-call filter refuses keys
    assert "/dev" not in run.stdout, run.stdout  # /tmp is the only writable place
    for _ in range(2):
        looked, outcomes = await _sample(src, LOOKER, NOTHING)
        assert outcomes == ["passed"], looked.runs[0].stdout + looked.runs[0].stderr
        assert looked.sandbox == left.sandbox and looked.nth > left.nth, "not the same sandbox"


def _warm_spare(sandbox: Sandbox) -> SandboxProcess | None:
    with sandbox._lock:
        return sandbox.warm.warm_spare()


def _processes_with(argv: list[str]) -> list[int]:
    """Host pids of the processes running exactly ``argv`` (the host sees into every sandbox's processes)."""
    wanted, found = ("\0".join(argv) + "\0").encode(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() == wanted:
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("level", LEVELS)
async def test_a_stopped_sample_leaves_nothing_and_its_sandbox_serves_the_next(
    level: str, code_source: MakeSource
) -> None:
    """A pipeline takes back a sample whose program runs (for another tenant's): its slot takes the warm spare at
    once, so the next sample runs while the runner kills the program and everything it started and resets the
    sandbox, which becomes the spare; while the spare is still starting a stop waits for the reset and the slot's
    sandbox serves on. The stopped program's sandbox serves a later sample, which finds nothing left, and the two
    sandboxes never share a uid. A stop that comes after its job ended is dropped."""
    _level_or_skip(level)
    src = code_source(isolation=level, timeout_s=300.0, workers=1)
    sandbox = src.sandbox
    await sandbox.prestart()  # the slot's sandbox and the spare, warm
    marker = ["sleep", "31337.5"]
    hang = f"import subprocess\nsubprocess.Popen({marker!r})\ntime.sleep(300)"
    program = LEAVER.replace("print(' '.join(made))", hang)
    sandbox.straggler_after_s = math.inf  # its one slot stays its own however long it takes to start (no step aside)

    async def stopped(expected: int) -> SandboxProcess:
        """Run the hanging program, stop it once it runs, and return its sandbox."""
        job = asyncio.create_task(sandbox.run(job_of(plan(program, NOTHING), sandbox.python), sandbox.claim()))
        await eventually(lambda: len(_processes_with(marker)) == 1, "the program and its child run")
        [box] = [run.box for run in sandbox._running]
        assert box is not None
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        await eventually(lambda: not _processes_with(marker), "the program's child is gone")
        await eventually(lambda: sandbox.stats["jobs stopped"] == expected, "the stop is counted")
        return box

    spare = _warm_spare(sandbox)
    assert spare is not None
    first = await stopped(1)
    assert sandbox.stats["stops that gave the slot the spare"] == 1
    looked, outcomes = await _sample(src, LOOKER, NOTHING)  # in the former spare
    assert outcomes == ["passed"] and looked.sandbox == spare.serial, looked.runs[0].stderr
    await eventually(lambda: sandbox.warm.spare is first, "the stopped sandbox, reset, is the spare")
    assert sandbox.warm.uid_of[0] != sandbox.warm.spare_uid
    second = await stopped(2)  # the slot takes the first stopped sandbox
    assert second is spare and sandbox.stats["stops that gave the slot the spare"] == 2
    looked, outcomes = await _sample(src, LOOKER, NOTHING)
    assert outcomes == ["passed"], looked.runs[0].stdout + looked.runs[0].stderr
    assert looked.sandbox == first.serial, "not the first stopped sample's sandbox"
    await eventually(lambda: sandbox.warm.spare is second, "the second stopped sandbox, reset, is the spare")
    starting: Future[SandboxProcess | None] = Future()
    with sandbox._lock:  # as if the spare were still starting: the next stop finds none warm, and waits for its reset
        sandbox.warm.spare, sandbox.warm.spare_starting = None, starting
    third = await stopped(3)
    assert third is first and sandbox.stats["stops that gave the slot the spare"] == 2
    starting.set_result(second)  # up now
    looked, outcomes = await _sample(src, LOOKER, NOTHING)
    assert outcomes == ["passed"] and looked.sandbox == first.serial, looked.runs[0].stderr
    assert not [k for k in sandbox.stats if k.startswith("retired")], sandbox.stats
    late = first.exchange(b'{"stop": true}\n', "done", 0.5, 1 << 16)  # no job runs: nothing answers it
    assert late.timed_out and not late.records and late.final is None
    looked, outcomes = await _sample(src, LOOKER, NOTHING)
    assert outcomes == ["passed"] and looked.sandbox == first.serial, looked.runs[0].stderr


@needs_bwrap
async def test_a_stopped_sandbox_that_gave_its_slot_the_spare_and_is_retired_gives_the_next_spare_its_uid(
    code_source: MakeSource,
) -> None:
    """A sandbox that serves two samples: the second, a hanging program, is stopped, and its slot takes the warm
    spare at once. The stopped sandbox has served its samples, so it is retired instead of becoming the spare; the
    next spare starts under its uid, and no two live sandboxes share one."""
    src = code_source(timeout_s=300.0, workers=1, samples_per_sandbox=2)
    sandbox = src.sandbox
    await sandbox.prestart()
    sandbox.straggler_after_s = math.inf
    first, _ = await _sample(src, LOOKER, NOTHING)
    hang = job_of(plan("import time\ntime.sleep(300)", NOTHING), sandbox.python)
    job = asyncio.create_task(sandbox.run(hang, sandbox.claim()))  # a pipeline's job: stopped when taken back
    await eventually(lambda: len(sandbox._running) == 1, "the hanging program runs")
    [run] = sandbox._running
    assert run.box is not None and run.box.serial == first.sandbox and run.uid is not None
    stopped_uid = run.uid
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    await eventually(lambda: sandbox.stats["retired: served its samples"] == 1, "the stopped sandbox is retired")
    assert sandbox.stats["stops that gave the slot the spare"] == 1
    await eventually(lambda: _warm_spare(sandbox) is not None, "the next spare is up")
    assert sandbox.warm.spare_uid == stopped_uid and sandbox.warm.uid_of[0] != stopped_uid
    looked, outcomes = await _sample(src, LOOKER, NOTHING)  # in the former spare, now the slot's
    assert outcomes == ["passed"] and looked.sandbox != first.sandbox, looked.runs[0].stderr


@needs_bwrap
async def test_a_job_past_its_straggler_time_whose_spare_died_steps_aside_once_a_new_spare_is_up(
    code_source: MakeSource,
) -> None:
    """The pool's spare dies while a hanging job holds the only slot. Past its straggler time the job may step aside
    only into a warm spare, so the pool starts a new one, and the job steps aside once it is up; every uid is held
    once."""
    src = code_source(timeout_s=300.0, workers=1)
    sandbox = src.sandbox
    await sandbox.prestart()
    sandbox.straggler_after_s, most = 0.2, sandbox.max_stragglers
    sandbox.max_stragglers = 0  # none steps aside until the spare is dead
    hang = job_of(plan("import time\ntime.sleep(300)", NOTHING), sandbox.python)
    job = asyncio.create_task(sandbox.run(hang, sandbox.claim()))
    await eventually(lambda: len(sandbox._running) == 1, "the hanging program runs")
    spare = _warm_spare(sandbox)
    assert spare is not None
    spare.kill()
    sandbox.max_stragglers = most
    await eventually(lambda: sandbox.stats["jobs that stepped aside"] == 1, "the job stepped aside")
    assert sandbox.slots == 2
    [run] = sandbox._running
    assert run.uid is not None
    assert held_uids(sandbox, run.uid) == list(range(1 + 1 + sandbox.max_stragglers))
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job


@needs_bwrap
async def test_a_job_past_its_straggler_time_steps_aside_and_its_sandbox_is_the_next_spare_when_it_ends(
    code_source: MakeSource,
) -> None:
    """Two slots; pipeline jobs that hang until their 4 s budget. Alone past the straggler time (0.4 s), the first
    keeps its slot: the other is free. Once the second takes that, the first (claimed first) steps aside: the pool's
    capacity grows by one (its listeners hear it) and a slot is free at once for the next job, which runs in the
    spare's sandbox while the first runs on. Each hanging job ends at its budget, a timeout, never a pass; no
    sandbox is retired: the slot's serves on, and the first's, reset, is kept under its uid. The next job to step
    aside leaves its slot the spare, and the kept sandbox is the next spare: no sandbox starts. Every uid is held
    once throughout, and the capacity is back to the slots."""
    src = code_source(timeout_s=4.0, workers=2)
    sandbox = src.sandbox
    await sandbox.prestart()
    grew: list[int] = []
    sandbox.on_capacity(lambda: grew.append(sandbox.slots))
    every_uid = list(range(2 + 1 + sandbox.max_stragglers))

    def job(program: str) -> Job:
        return job_of(plan(program, NOTHING), sandbox.python)

    hang = "import time\ntime.sleep(60)"
    first = asyncio.create_task(sandbox.run(job(hang), sandbox.claim()))
    await holds_for(lambda: sandbox.stragglers == 0, "alone past its straggler time, it keeps its slot", 0.8)
    second = asyncio.create_task(sandbox.run(job(hang), sandbox.claim()))
    await eventually(lambda: sandbox.stragglers == 1, "the first stepped aside")
    [aside] = [run for run in sandbox._running if run.aside]
    assert aside.seq == min(run.seq or 0 for run in sandbox._running)  # the one claimed first
    assert grew == [3] and sandbox.slots == 3
    claim = sandbox.claim()
    assert claim.slot.done() and not first.done()  # a slot at once, while the first runs on
    echoed = await asyncio.wait_for(sandbox.run(job("print('nothing')"), claim), 60)
    assert [r.status for r in echoed.runs] == ["exited"] and echoed.runs[0].stdout.strip() == "nothing"
    hung = await asyncio.wait_for(asyncio.gather(first, second), 60)
    assert [[r.status for r in result.runs] for result in hung] == [["timeout"], ["timeout"]]
    assert hung[0].sandbox != echoed.sandbox
    await eventually(lambda: sandbox.stragglers == 0, "the stragglers ended")
    assert sandbox.slots == 2 and not [k for k in sandbox.stats if k.startswith("retired")], sandbox.stats
    assert [box.serial for box, _ in sandbox.warm.kept] == [hung[0].sandbox]
    assert held_uids(sandbox) == every_uid
    started = sandbox.stats["started"]
    more = [asyncio.create_task(sandbox.run(job(hang), sandbox.claim())) for _ in range(2)]
    await eventually(lambda: sandbox.stragglers == 1, "one of the next two stepped aside")
    [aside] = [run for run in sandbox._running if run.aside]
    assert _warm_spare(sandbox) is not None and not sandbox.warm.kept  # the kept sandbox is the spare
    assert sandbox.stats["started"] == started and sandbox.stats["spares that were kept"] == 1
    assert held_uids(sandbox, aside.uid) == every_uid
    for task in more:
        task.cancel()
    await asyncio.gather(*more, return_exceptions=True)


@pytest.mark.parametrize("level", LEVELS)
async def test_a_sandbox_serves_a_bounded_number_of_samples(level: str, code_source: MakeSource) -> None:
    _level_or_skip(level)
    src = code_source(isolation=level, workers=1, samples_per_sandbox=3)
    await src.warmup()
    seen = []
    for _ in range(7):
        result, outcomes = await _sample(src, LOOKER, NOTHING)
        assert outcomes == ["passed"], result.runs[0].stdout
        seen.append((result.sandbox, result.nth))
    assert [nth for _, nth in seen] == [1, 2, 3, 1, 2, 3, 1]
    assert len({box for box, _ in seen}) == 3 and seen[0][0] == seen[2][0] != seen[3][0] == seen[5][0]
    assert src.sandbox.stats["retired: served its samples"] == 2
    assert src.sandbox.stats["jobs in a warm sandbox"] == 7  # each replacement was started ahead


# A program that runs out of its time with a file and a child process left behind.
OUT_OF_TIME = """import os, time
open('/tmp/left-behind', 'w').write('x')
if os.fork() == 0:
    time.sleep(600)
while True:
    pass
"""


@pytest.mark.parametrize("level", LEVELS)
async def test_a_test_that_runs_out_of_time_keeps_its_sandbox_clean_and_one_over_another_limit_retires_it(
    level: str, code_source: MakeSource
) -> None:
    """Running out of time, the program is killed with everything it started and the sandbox reset, as a stopped
    one's is: the same sandbox serves the next sample, which finds nothing left. A test over its output limit
    retires its sandbox."""
    _level_or_skip(level)
    src = code_source(isolation=level, workers=1, timeout_s=1.0, max_output_bytes=1000)
    first, _ = await _sample(src, LOOKER, NOTHING)
    hit, outcomes = await _sample(src, OUT_OF_TIME, NOTHING)
    assert outcomes == ["timeout"] and hit.sandbox == first.sandbox
    after, outcomes = await _sample(src, LOOKER, NOTHING)
    assert outcomes == ["passed"], after.runs[0].stdout + after.runs[0].stderr
    assert after.sandbox == hit.sandbox and after.nth == hit.nth + 1, (hit.sandbox, hit.nth, after.sandbox, after.nth)
    hit, outcomes = await _sample(src, "print('x' * 5000)", NOTHING)
    assert outcomes == ["output_limit"]
    after, outcomes = await _sample(src, LOOKER, NOTHING)
    assert outcomes == ["passed"], after.runs[0].stdout
    assert hit.sandbox != after.sandbox and after.nth == 1, (hit.sandbox, after.sandbox, after.nth)
    assert src.sandbox.stats["retired: a test hit a limit"] == 1


@needs_bwrap
async def test_a_sandbox_that_died_while_warm_is_replaced(code_source: MakeSource) -> None:
    src = code_source(workers=1)
    await src.warmup()
    first, _ = await _sample(src, LOOKER, NOTHING)
    [box] = src.sandbox.warm.idle.values()
    os.kill(box.proc.pid, signal.SIGKILL)  # as the kernel's OOM killer would
    again, outcomes = await _sample(src, LOOKER, NOTHING)
    assert outcomes == ["passed"] and again.sandbox != first.sandbox


def _patched_runner(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """The real runner with ``code`` run before its main(): a runner that misbehaves in a way no program can cause."""
    source = levels.runner_source()
    patched = source.replace('\nif __name__ == "__main__":', f'\n{code}\n\nif __name__ == "__main__":')
    assert patched != source
    monkeypatch.setattr(levels, "runner_source", lambda: patched)


@needs_bwrap
async def test_a_reset_that_leaves_something_retires_the_sandbox(
    monkeypatch: pytest.MonkeyPatch, code_source: MakeSource
) -> None:
    _patched_runner(monkeypatch, "_leftovers = lambda: ['/tmp/stuck']")
    src = code_source(workers=1)
    first, outcomes = await _sample(src, LOOKER, NOTHING)
    assert outcomes == ["passed"]
    second, _ = await _sample(src, LOOKER, NOTHING)
    assert second.sandbox != first.sandbox
    assert src.sandbox.stats["retired: left something after the reset"] == 2


@needs_bwrap
async def test_a_runner_that_prints_garbage_fails_the_sample_and_is_retired(
    monkeypatch: pytest.MonkeyPatch, code_source: MakeSource
) -> None:
    src = code_source(workers=1)
    await src.sandbox.start()  # proven with the real runner; the sandbox that serves the sample is started after
    _patched_runner(monkeypatch, "_serve = lambda job: print('{not json', flush=True)")
    with pytest.raises(SourceFailed, match="unreadable line from the sandbox"):
        await src.grade(LOOKER, NOTHING)
    assert src.sandbox.stats["retired: runner misbehaved"] == 1


@needs_bwrap
@needs_gpp
async def test_cpp_compiles_and_runs_in_a_warm_sandbox(code_source: MakeSource) -> None:
    problem = next(p for p in PROBLEMS if p.language == "cpp")
    src = code_source(workers=1)
    await src.warmup()
    good, outcomes = await _sample(src, problem.canonical, problem.ground_truth)
    assert set(outcomes) == {"passed"}, good.runs
    bad, outcomes = await _sample(src, problem.wrong, problem.ground_truth)
    assert "wrong_answer" in outcomes and bad.sandbox == good.sandbox and bad.nth == good.nth + 1
    looked, outcomes = await _sample(src, LOOKER, NOTHING)  # the compiler and its binary left nothing
    assert outcomes == ["passed"] and looked.sandbox == good.sandbox, looked.runs[0].stdout


async def test_run_code_sits_behind_the_gateways_token() -> None:
    async with reward_server() as server, http_gateway(server, token="s3cret") as gw, aiohttp.ClientSession() as http:
        async with http.post(f"{gw.url}/run_code", json={"code": "print(1)"}) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "UNAUTHENTICATED"
        async with http.post(f"{gw.url}/t/s3cret/run_code", json={"code": "print(1)"}) as resp:  # verl's way
            assert resp.status == 200 and (await resp.json())["run_result"]["stdout"] == "1\n"
