"""RolloutService servicer: decode and validate a request, hand each sample to the `RolloutWorker`, encode.

The data plane (agent loop, reward stream, timing, load counters) is `server/rollout/worker.py`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from rewardmesh.common.errors import InvalidInput, Unavailable
from rewardmesh.common.planes.layout import LAYOUT_VERSION
from rewardmesh.common.tensors import duration_seconds, ids_from, ids_tensor
from rewardmesh.server.decoding import decoder
from rewardmesh.server.limits import DEFAULT_LIMITS, Limits, check, extra_info, finite, keep_traces
from rewardmesh.server.rollout.agent_loop import AgentSettings
from rewardmesh.server.rollout.backends.base import GenerationRequest
from rewardmesh.server.rollout.tools import TOOLS
from rewardmesh.server.rollout.weight_receiver import WeightReceiver
from rewardmesh.server.rollout.worker import Job, PromptInput, RolloutWorker, RunSettings
from rewardmesh.server.status import status_proto
from rewardmesh.v1 import common_pb2, reward_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        worker: RolloutWorker,
        *,
        default_max_tokens: int = 256,
        limits: Limits = DEFAULT_LIMITS,
        max_call_unsent: int = 4096,
    ) -> None:
        if max_call_unsent < 1:
            raise ValueError(f"max_call_unsent must be >= 1, got {max_call_unsent}")
        self.worker = worker
        self.limits = limits
        self.backend = worker.backend
        self.default_max_tokens = default_max_tokens
        # Backpressure: a Generate call has at most this many samples running or finished-but-unsent; the
        # next start only as the client reads, so a client that never reads holds a bounded amount.
        self.max_call_unsent = max_call_unsent
        self.weights = WeightReceiver(worker.backend)
        # Set while the backend boots: GetInfo answers UNAVAILABLE, as a server that is not up yet would, so a
        # trainer leaves it out of a weight update (it would refuse the weights) and its join hook brings it to
        # the current weights once it serves.
        self.booting = ""

    # -- decoding and validation --------------------------------------------------------------

    def _check_prompt(self, i: int, prompt: rollout_pb2.Prompt, max_tokens: int) -> None:
        """Every size of one prompt, checked before any work is done for it (tokenizing included)."""
        lim = self.limits
        where = f"prompts[{i}]"
        which = prompt.WhichOneof("input")
        if which == "token_ids":
            size = len(prompt.token_ids.raw_data) // 4
            check(size, lim.max_tensor_elements, f"{where}.token_ids size", "max_tensor_elements")
            if size + max_tokens > self.backend.max_model_len:
                raise self._too_long(i, max_tokens, size)
        elif which == "chat":
            if not prompt.chat.messages:
                raise InvalidInput(f"{where}.chat.messages is empty")
            chars = sum(len(m.content) + len(m.role) for m in prompt.chat.messages)
            check(chars, lim.max_prompt_chars, f"{where}.chat length (characters)", "max_prompt_chars")
        else:
            raise InvalidInput(f"{where} has no input: set token_ids or chat")
        check(len(prompt.group_id), lim.max_sample_id_chars, f"{where}.group_id length", "max_sample_id_chars")
        for name, text in (("data_source", prompt.data_source), ("ground_truth", prompt.ground_truth)):
            check(len(text), lim.max_text_chars, f"{where}.{name} length", "max_text_chars")
        if prompt.HasField("extra_info"):  # as deep as every message that will carry it can nest it
            extra_info(prompt.extra_info, f"{where}.extra_info", lim)
        for k, sid in enumerate(prompt.sample_ids):
            check(len(sid), lim.max_sample_id_chars, f"{where}.sample_ids[{k}] length", "max_sample_id_chars")

    def _too_long(self, i: int, max_tokens: int, tokens: int) -> InvalidInput:
        return InvalidInput(
            f"sampling.max_tokens {max_tokens} plus prompts[{i}]'s {tokens} tokens exceeds the "
            f"model's context of {self.backend.max_model_len} tokens"
        )

    def _decode(self, i: int, prompt: rollout_pb2.Prompt, group_id: str) -> PromptInput:
        """One checked prompt as the ids the backend generates from; runs off the event loop (tokenizing a
        long chat prompt takes a while, and every other call waits for the loop)."""
        tok = self.backend.tokenizer
        if prompt.WhichOneof("input") == "token_ids":
            ids = ids_from(prompt.token_ids, f"prompts[{i}].token_ids").tolist()
            if not ids:
                raise InvalidInput(f"prompts[{i}].token_ids is empty")
            return PromptInput(prompt, group_id, ids, prompt.token_ids, decoder(tok)(ids))
        messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(tok.encode(text, add_special_tokens=False))
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
        return PromptInput(prompt, group_id, ids, ids_tensor(ids), question)

    def _settings(self, request: rollout_pb2.GenerateRequest) -> RunSettings:
        """The request's counts and sampling parameters, checked (each over its limit: INVALID_ARGUMENT)."""
        lim = self.limits
        if not request.prompts:
            raise InvalidInput("prompts is empty; send at least one prompt")
        if request.n < 1:
            raise InvalidInput(f"n must be >= 1, got {request.n}")
        check(request.n, lim.max_n, "n", "max_n")
        check(len(request.prompts), lim.max_prompts_per_request, "prompts count", "max_prompts_per_request")
        total = len(request.prompts) * request.n
        check(total, lim.max_samples_per_generate, "prompts x n", "max_samples_per_generate")
        sp = request.sampling
        max_tokens = sp.max_tokens if sp.HasField("max_tokens") else self.default_max_tokens
        if max_tokens < 1:
            raise InvalidInput(f"sampling.max_tokens must be >= 1, got {max_tokens}")
        check(max_tokens, lim.max_tokens_limit, "sampling.max_tokens", "max_tokens_limit")
        temperature = finite(sp.temperature, "sampling.temperature") if sp.HasField("temperature") else 1.0
        top_p = finite(sp.top_p, "sampling.top_p") if sp.HasField("top_p") else 1.0
        if temperature < 0:
            raise InvalidInput(f"sampling.temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise InvalidInput(f"sampling.top_p must be in (0, 1], got {top_p}")
        top_k = sp.top_k if sp.HasField("top_k") else 0
        if top_k < 0:
            raise InvalidInput(f"sampling.top_k must be >= 0 (0: off), got {top_k}")
        check(len(sp.stop), lim.max_stop_strings, "sampling.stop count", "max_stop_strings")
        for j, stop in enumerate(sp.stop):
            check(len(stop), lim.max_stop_chars, f"sampling.stop[{j}] length", "max_stop_chars")
        check(len(sp.stop_token_ids), lim.max_stop_token_ids, "sampling.stop_token_ids count", "max_stop_token_ids")
        check(len(request.agent.tools), len(TOOLS), "agent.tools count", "the number of registered tools")
        if not 0 <= sp.min_tokens <= max_tokens:
            raise InvalidInput(f"sampling.min_tokens must be in [0, max_tokens={max_tokens}], got {sp.min_tokens}")
        for j, name in enumerate(request.agent.tools):
            if name not in TOOLS:
                raise InvalidInput(f"agent.tools[{j}]: unknown tool '{name}' (registered: {', '.join(sorted(TOOLS))})")
        if request.reward and self.worker.rewards is None:
            raise InvalidInput(f"reward: '{request.reward}' named, but this rollout server has no --reward-target")
        for i, prompt in enumerate(request.prompts):
            self._check_prompt(i, prompt, max_tokens)
            if prompt.sample_ids and len(prompt.sample_ids) != request.n:
                raise InvalidInput(f"prompts[{i}].sample_ids has {len(prompt.sample_ids)} ids, but n is {request.n}")
        sampling = GenerationRequest(
            prompt_ids=[],
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=list(sp.stop_token_ids),
            stop=list(sp.stop),
            logprobs=sp.logprobs,
            ignore_eos=sp.ignore_eos,
            min_tokens=sp.min_tokens,
        )
        agent = AgentSettings(
            max_turns=max(1, request.agent.max_turns),
            max_response_tokens=request.agent.max_response_tokens,
            tools=list(request.agent.tools),
        )
        timeout = duration_seconds(request.reward_timeout) if request.HasField("reward_timeout") else None
        step = None
        if request.HasField("step_time_left"):  # a deadline on this host's clock, handed on as what is left of it
            step = time.monotonic() + duration_seconds(request.step_time_left)
        return RunSettings(sampling, agent, request.reward, timeout, step)

    def _jobs(self, request: rollout_pb2.GenerateRequest, max_tokens: int) -> list[Job]:
        """The checked request's samples (prompts decoded); run in a thread, off the event loop."""
        stamp = uuid.uuid4().hex[:8]
        jobs: list[Job] = []
        sp = request.sampling
        for i, prompt in enumerate(request.prompts):
            decoded = self._decode(i, prompt, prompt.group_id or f"{stamp}-{i}")
            if len(decoded.ids) + max_tokens > self.backend.max_model_len:
                raise self._too_long(i, max_tokens, len(decoded.ids))
            for k in range(request.n):
                sid = prompt.sample_ids[k] if prompt.sample_ids else f"{decoded.group_id}/{k}"
                jobs.append(Job(sid, decoded, sp.seed + k if sp.HasField("seed") else None))
        if len({j.sample_id for j in jobs}) != len(jobs):
            raise InvalidInput("prompts[].sample_ids: ids must be unique across the request")
        return jobs

    async def _plan(self, request: rollout_pb2.GenerateRequest) -> tuple[list[Job], RunSettings]:
        """Checks first (cheap, on the loop), then the decoding work (in a thread when a prompt is a chat)."""
        settings = self._settings(request)
        max_tokens = settings.sampling.max_tokens
        if any(p.WhichOneof("input") == "chat" for p in request.prompts):
            jobs = await asyncio.to_thread(self._jobs, request, max_tokens)
        else:
            jobs = self._jobs(request, max_tokens)
        return jobs, settings

    # -- RPCs ---------------------------------------------------------------------------------

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateResponse]:
        """Samples stream out as they finish; what finished together shares a message when the client asks."""
        if reason := self.backend.unusable:  # UNAVAILABLE: the trainer asks another server
            raise Unavailable(reason)
        jobs, settings = await self._plan(request)
        per_message = max(1, request.max_samples_per_message)
        loop = asyncio.get_running_loop()
        finished: collections.deque[asyncio.Future[rollout_pb2.GenerateResponse]] = collections.deque()
        wake: list[asyncio.Future[None] | None] = [None]
        job_of: dict[asyncio.Future[rollout_pb2.GenerateResponse], Job] = {}
        started = sent = 0

        def on_done(answer: asyncio.Future[rollout_pb2.GenerateResponse]) -> None:
            finished.append(answer)
            w = wake[0]
            if w is not None and not w.done():
                w.set_result(None)

        def start() -> None:
            """Start what the bound leaves room for, whole prompt groups (one engine request each) where they fit."""
            nonlocal started
            end = _room_end(started, sent + self.max_call_unsent, request.n, len(jobs), self.max_call_unsent)
            if end > started:
                batch = jobs[started:end]
                for job, answer in zip(batch, self.worker.start(batch, settings), strict=True):
                    job_of[answer] = job
                    answer.add_done_callback(on_done)
                started = end

        with self.worker.request():
            start()
            try:
                while sent < len(jobs):
                    if not finished:
                        waiter = wake[0] = loop.create_future()
                        await waiter
                        wake[0] = None
                    ready = [self._response(job_of.pop(t), t) for t in _drain(finished)]
                    for lo in range(0, len(ready), per_message):
                        chunk = ready[lo : lo + per_message]
                        yield chunk[0] if len(chunk) == 1 else rollout_pb2.GenerateResponse(items=chunk)
                        sent += len(chunk)
                        start()  # room for as many as the client just took
            finally:
                # The client went away (or we are done): abort whatever is still generating or waiting.
                for answer in job_of:
                    answer.cancel()

    @staticmethod
    def _response(job: Job, answer: asyncio.Future[rollout_pb2.GenerateResponse]) -> rollout_pb2.GenerateResponse:
        """The sample's response; anything it raised is that sample's INTERNAL error, never a lost sample."""
        exc = answer.exception() if not answer.cancelled() else asyncio.CancelledError("sample cancelled")
        if exc is None:
            return answer.result()
        return rollout_pb2.GenerateResponse(
            sample=common_pb2.Sample(sample_id=job.sample_id, group_id=job.prompt.group_id),
            result=reward_pb2.RewardResult(sample_id=job.sample_id, error=status_proto(exc)),
        )

    async def UpdateWeights(
        self, request_iterator: AsyncIterator[rollout_pb2.UpdateWeightsRequest], context: aio.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        return await self.weights.receive_chunks(self._limited_chunks(request_iterator))

    async def _limited_chunks(
        self, requests: AsyncIterator[rollout_pb2.UpdateWeightsRequest]
    ) -> AsyncIterator[rollout_pb2.UpdateWeightsRequest]:
        """The stream's messages, refused past max_weight_chunks (resending chunks would grow the books for ever)."""
        count = 0
        async for msg in requests:
            count += 1
            check(count, self.limits.max_weight_chunks, "UpdateWeights chunk count", "max_weight_chunks")
            yield msg

    async def TransferWeights(
        self, request: rollout_pb2.TransferWeightsRequest, context: aio.ServicerContext
    ) -> rollout_pb2.TransferWeightsResponse:
        return await self.weights.transfer(request)

    async def KeepTraces(self, request: reward_pb2.KeepTracesRequest, context: aio.ServicerContext) -> Any:
        """Export these samples' trees here and on every reward target (a step's slowest, named by the trainer)."""
        keep_traces(request, self.limits)
        kept, exported = await self.worker.keep_traces(request.sample_ids)
        return reward_pb2.KeepTracesResponse(kept_samples=kept, exported_spans=exported)

    async def GetInfo(self, request: rollout_pb2.GetInfoRequest, context: aio.ServicerContext) -> Any:
        if self.booting:
            raise Unavailable(self.booting)
        rewards = self.worker.rewards
        return rollout_pb2.GetInfoResponse(
            model=self.backend.model,
            backend=self.backend.name,
            policy_version=self.backend.policy_version,
            load=self.worker.load(),
            max_model_len=self.backend.max_model_len,
            tools=sorted(TOOLS),
            reward_targets=[s.address for s in rewards.streams] if rewards else [],
            weight_transports=self.weights.transports(),
            host_id=self.weights.host_id,
            instance_id=self.weights.instance_id,
            dist_chain=True,
            dist_layout=LAYOUT_VERSION,
            dist_host_share=bool(self.weights.host_id),
            cuda_device_uuid=self.weights.cuda_uuid(),
            weight_delta=self.weights.takes_deltas(),
        )


def _room_end(started: int, limit: int, n: int, total: int, bound: int) -> int:
    """Where the next start ends: up to `limit` (started samples not yet sent stay within the bound), in whole
    groups of `n` (a group larger than the bound in pieces, else it waits until the whole group fits)."""
    end = started
    while end < total:
        group_end = min(total, (end // n + 1) * n)
        if group_end <= limit:
            end = group_end
        elif group_end - end > bound:  # never fits whole: as much as there is room for
            return max(end, limit)
        else:
            break
    return end


def _drain(queue: collections.deque[Any]) -> list[Any]:
    out = list(queue)
    queue.clear()
    return out
