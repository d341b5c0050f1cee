"""SandboxFusion's ``POST /run_code`` on the reward server's HTTP gateway, so verl's ``sandbox_fusion`` client
(``reward.sandbox_fusion.url``) runs its programs in this server's sandbox unchanged.

Request fields as SandboxFusion's RunCodeRequest: ``code``, ``language``, ``stdin``, ``run_timeout``,
``compile_timeout``, ``memory_limit_MB``, ``files`` (name -> base64), ``fetch_files``. The reply is a
RunCodeResponse: ``status`` (Success | Failed | SandboxError), ``message``, ``compile_result`` and
``run_result`` (each ``status`` Finished | TimeLimitExceeded | Error, ``execution_time``, ``return_code``,
``stdout``, ``stderr``), ``executor_pod_name``, ``files``. The sandbox is the built-in ``code`` pipeline's when
the server has one (one pool for both doors), else one of its own. A call holds one of the pool's slots from when
it asks until its program ends, counted apart (``Sandbox.held_outside``): the pipeline hands over that many fewer
samples meanwhile, so its samples wait in its fair queue, never behind a call in the pool.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import replace
from typing import Any

from aiohttp import web

from rewardmesh.common.errors import InvalidInput
from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.reward_engine.sandbox.executor import Job, JobResult, Sandbox, TestRun
from rewardmesh.reward_engine.sandbox.grading import Plan, job_of

# Largest values a caller may ask for; beyond them the request is refused, not silently clipped.
MAX_RUN_TIMEOUT_S = 60.0
MAX_COMPILE_TIMEOUT_S = 120.0
MAX_MEMORY_MB = 8192
MAX_CODE_CHARS = 1 << 20
_LANGUAGES = {"python": "python", "python3": "python", "cpp": "cpp"}
_RUN_STATUS = {"exited": "Finished", "timeout": "TimeLimitExceeded"}


def _number(body: dict[str, Any], key: str, default: float, top: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= top:
        raise InvalidInput(f"{key}: expected a number in (0, {top:g}], got {value!r}")
    return float(value)


def _result(run: TestRun) -> dict[str, Any]:
    code = run.exit_code if run.exit_code is not None else (128 + run.signal if run.signal else None)
    return {
        "status": _RUN_STATUS.get(run.status, "Error"),
        "execution_time": run.time_s,
        "return_code": code,
        "stdout": run.stdout,
        "stderr": run.stderr,
    }


class RunCode:
    """The handler; ``engine`` lends its code pipeline's sandbox."""

    def __init__(self, engine: RewardEngine) -> None:
        self.engine = engine
        self._own: Sandbox | None = None

    def sandbox(self) -> Sandbox:
        named = self.engine.pipelines.get("code")
        for pipeline in [named] if named else self.engine.pipelines.values():
            for ws in pipeline.sources:
                if ws.source.sandbox is not None:
                    return ws.source.sandbox
        if self._own is None:
            self._own = Sandbox()
        return self._own

    def _job(self, body: Any, sandbox: Sandbox) -> Job:
        if not isinstance(body, dict):
            raise InvalidInput("body: expected a JSON object with 'code'")
        code = body.get("code")
        if not isinstance(code, str) or not code.strip():
            raise InvalidInput("code: expected a non-empty string")
        if len(code) > MAX_CODE_CHARS:
            raise InvalidInput(f"code: {len(code)} characters, over the limit of {MAX_CODE_CHARS}")
        language = _LANGUAGES.get(str(body.get("language") or "python"))
        if language is None:
            raise InvalidInput(f"language: {body.get('language')!r} is not supported here (python, cpp)")
        stdin = body.get("stdin") or ""
        if not isinstance(stdin, str):
            raise InvalidInput("stdin: expected a string")
        if body.get("fetch_files"):
            raise InvalidInput("fetch_files: not supported (the sandbox's files are gone when the run ends)")
        run_s = _number(body, "run_timeout", 10.0, MAX_RUN_TIMEOUT_S)
        compile_s = _number(body, "compile_timeout", 10.0, MAX_COMPILE_TIMEOUT_S)
        memory = _number(body, "memory_limit_MB", float(sandbox.limits.memory_mb), MAX_MEMORY_MB)
        job = job_of(Plan(language, "stdio", code, [stdin]), sandbox.python)
        files = body.get("files") or {}
        if not isinstance(files, dict):
            raise InvalidInput("files: expected an object of name -> base64 content")
        for name, data in files.items():
            if not isinstance(name, str) or "/" in name or name.startswith(".") or not isinstance(data, str):
                raise InvalidInput(f"files: {name!r} must be a plain file name with base64 text")
            try:
                job.files[name] = base64.b64decode(data, validate=True).decode()
            except (binascii.Error, UnicodeDecodeError) as exc:
                raise InvalidInput(f"files[{name!r}]: not base64 of UTF-8 text ({exc})") from None
        limits = replace(sandbox.limits, cpu_s=run_s, wall_s=run_s, memory_mb=int(memory), compile_timeout_s=compile_s)
        return replace(job, limits=limits)

    async def handle(self, request: web.Request) -> web.Response:
        """Errors are raised: the gateway answers them as JSON with the status of their gRPC code."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"body: not valid JSON: {exc}") from None
        sandbox = self.sandbox()
        job = self._job(body, sandbox)
        return web.json_response(self.reply(job, await sandbox.run(job)))

    @staticmethod
    def reply(job: Job, result: JobResult) -> dict[str, Any]:
        compile_result = None
        if job.compile:
            compile_result = {
                "status": "Finished" if result.compile_ok or result.compile_stderr else "Error",
                "execution_time": result.compile_time_s,
                "return_code": 0 if result.compile_ok else 1,
                "stdout": "",
                "stderr": result.compile_stderr,
            }
            if not result.compile_ok:
                return _response("Failed", "compilation failed", compile_result, None)
        run = result.runs[0]
        if run.status == "sandbox_error":
            return _response("SandboxError", run.stderr or "the sandbox failed", compile_result, None)
        run_result = _result(run)
        ok = run_result["status"] == "Finished" and run_result["return_code"] == 0
        message = (
            ""
            if ok
            else {"timeout": "time limit exceeded", "output_limit": "output limit exceeded"}.get(run.status, "")
        )
        return _response("Success" if ok else "Failed", message, compile_result, run_result)


def _response(
    status: str, message: str, compile_result: dict[str, Any] | None, run_result: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "status": status,
        "message": message,
        "compile_result": compile_result,
        "run_result": run_result,
        "executor_pod_name": None,
        "files": {},
    }
