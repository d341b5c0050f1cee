"""RolloutService servicer: validate, fan each sample into the agent loop, stream it out the moment it is scored."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from grpc import aio
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue

from client.reward_client import RewardClient
from client.telemetry import inject, traceparent, tracer
from client.tensors import ids_from, ids_tensor
from client.weights import WeightAssembler
from reward_engine.errors import InvalidInput
from rewardmesh.v1 import common_pb2, reward_pb2, rollout_pb2, rollout_pb2_grpc
from server.agent_loop import AgentSettings, Rollout, run_agent_loop
from server.backends.base import Backend, GenerationRequest
from server.status import status_proto
from server.tools import TOOLS

log = logging.getLogger(__name__)

FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "max_turns": common_pb2.FINISH_REASON_MAX_TURNS,
}


@dataclass
class _Job:
    """One sample to generate: its identity, prompt tokens and what its reward needs."""

    sample_id: str
    group_id: str
    prompt_ids: list[int]
    prompt_text: str
    prompt: rollout_pb2.Prompt
    seed: int | None


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, backend: Backend, rewards: RewardClient | None = None, *, default_max_tokens: int = 256) -> None:
        self.backend = backend
        self.rewards = rewards
        self.default_max_tokens = default_max_tokens
        self.running_samples = 0
        self.pending_rewards = 0
        self.active_requests = 0

    # -- validation ---------------------------------------------------------------------------

    def _prompt_ids(self, i: int, prompt: rollout_pb2.Prompt) -> tuple[list[int], str]:
        tok = self.backend.tokenizer
        which = prompt.WhichOneof("input")
        if which == "token_ids":
            ids = ids_from(prompt.token_ids, f"prompts[{i}].token_ids").tolist()
            if not ids:
                raise InvalidInput(f"prompts[{i}].token_ids is empty")
            return ids, tok.decode(ids, skip_special_tokens=True)
        if which == "chat":
            if not prompt.chat.messages:
                raise InvalidInput(f"prompts[{i}].chat.messages is empty")
            messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(tok.encode(text, add_special_tokens=False)), messages[-1]["content"]
        raise InvalidInput(f"prompts[{i}] has no input: set token_ids or chat")

    def _plan(self, request: rollout_pb2.GenerateRequest) -> tuple[list[_Job], GenerationRequest, AgentSettings]:
        if not request.prompts:
            raise InvalidInput("prompts is empty; send at least one prompt")
        if request.n < 1:
            raise InvalidInput(f"n must be >= 1, got {request.n}")
        sp = request.sampling
        max_tokens = sp.max_tokens if sp.HasField("max_tokens") else self.default_max_tokens
        if max_tokens < 1:
            raise InvalidInput(f"sampling.max_tokens must be >= 1, got {max_tokens}")
        temperature = sp.temperature if sp.HasField("temperature") else 1.0
        top_p = sp.top_p if sp.HasField("top_p") else 1.0
        if temperature < 0:
            raise InvalidInput(f"sampling.temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise InvalidInput(f"sampling.top_p must be in (0, 1], got {top_p}")
        for j, name in enumerate(request.agent.tools):
            if name not in TOOLS:
                raise InvalidInput(f"agent.tools[{j}]: unknown tool '{name}' (registered: {', '.join(sorted(TOOLS))})")
        if request.reward and self.rewards is None:
            raise InvalidInput(f"reward: '{request.reward}' named, but this rollout server has no --reward-target")
        limit = self.backend.max_model_len
        stamp = uuid.uuid4().hex[:8]
        jobs: list[_Job] = []
        for i, prompt in enumerate(request.prompts):
            ids, text = self._prompt_ids(i, prompt)
            if len(ids) + max_tokens > limit:
                raise InvalidInput(
                    f"sampling.max_tokens {max_tokens} plus prompts[{i}]'s {len(ids)} tokens exceeds the model's "
                    f"context of {limit} tokens"
                )
            if prompt.sample_ids and len(prompt.sample_ids) != request.n:
                raise InvalidInput(f"prompts[{i}].sample_ids has {len(prompt.sample_ids)} ids, but n is {request.n}")
            group = prompt.group_id or f"{stamp}-{i}"
            for k in range(request.n):
                sid = prompt.sample_ids[k] if prompt.sample_ids else f"{group}/{k}"
                seed = sp.seed + k if sp.HasField("seed") else None
                jobs.append(_Job(sid, group, ids, text, prompt, seed))
        if len({j.sample_id for j in jobs}) != len(jobs):
            raise InvalidInput("prompts[].sample_ids: ids must be unique across the request")
        template = GenerationRequest(
            prompt_ids=[],
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=sp.top_k if sp.HasField("top_k") else 0,
            stop_token_ids=list(sp.stop_token_ids),
            stop=list(sp.stop),
        )
        settings = AgentSettings(
            max_turns=max(1, request.agent.max_turns),
            max_response_tokens=request.agent.max_response_tokens,
            tools=list(request.agent.tools),
        )
        return jobs, template, settings

    # -- one sample ---------------------------------------------------------------------------

    def _sample(self, job: _Job, rollout: Rollout) -> common_pb2.Sample:
        resp = rollout.response_ids
        sample = common_pb2.Sample(
            sample_id=job.sample_id,
            group_id=job.group_id,
            prompt_ids=ids_tensor(job.prompt_ids),
            response_ids=ids_tensor(resp),
            response_mask=ids_tensor(rollout.response_mask),
            prompt_text=job.prompt_text,
            response_text=self.backend.tokenizer.decode(resp, skip_special_tokens=True),
            data_source=job.prompt.data_source,
            ground_truth=job.prompt.ground_truth,
            policy_version=rollout.policy_version,
            finish_reason=FINISH.get(rollout.finish_reason, common_pb2.FINISH_REASON_UNSPECIFIED),
            timing=common_pb2.SampleTiming(
                generate_sequences=rollout.generate_s,
                tool_calls=rollout.tool_s,
                num_preempted=rollout.num_preempted,
                num_turns=rollout.num_turns,
                prompt_length=len(job.prompt_ids),
                response_length=len(resp),
            ),
        )
        if job.prompt.HasField("extra_info"):
            sample.extra_info.CopyFrom(job.prompt.extra_info)
        return sample

    async def _run(
        self,
        job: _Job,
        template: GenerationRequest,
        settings: AgentSettings,
        reward: str,
        reward_timeout: float | None,
    ) -> rollout_pb2.GenerateResponse:
        attrs: dict[str, AttributeValue] = {
            "rewardmesh.sample_id": job.sample_id,
            "rewardmesh.group_id": job.group_id,
            "rewardmesh.prompt_length": len(job.prompt_ids),
        }
        with tracer().start_as_current_span("rollout.sample", attributes=attrs) as span:
            response = await self._run_traced(job, template, settings, reward, reward_timeout, span)
            response.trace_context.update(traceparent(span))
            return response

    async def _run_traced(
        self,
        job: _Job,
        template: GenerationRequest,
        settings: AgentSettings,
        reward: str,
        reward_timeout: float | None,
        span: trace.Span,
    ) -> rollout_pb2.GenerateResponse:
        def on_turn(kind: str, name: str, start_ns: int, end_ns: int) -> None:
            attrs = {"rewardmesh.tool": name} if kind == "tool_call" else {"rewardmesh.turn": name}
            tracer().start_span(kind, start_time=start_ns, attributes=attrs).end(end_time=end_ns)

        self.running_samples += 1
        try:
            sampling = GenerationRequest(**{**vars(template), "seed": job.seed})
            rollout = await run_agent_loop(self.backend, job.prompt_ids, sampling, settings, on_turn)
        except (ValueError, RuntimeError) as exc:  # a backend failure is this sample's error, not the stream's
            log.warning("sample %s failed in generation: %s", job.sample_id, exc)
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            failed = common_pb2.Sample(sample_id=job.sample_id, group_id=job.group_id)
            return rollout_pb2.GenerateResponse(
                sample=failed, result=reward_pb2.RewardResult(sample_id=job.sample_id, error=status_proto(exc))
            )
        finally:
            self.running_samples -= 1
        sample = self._sample(job, rollout)
        span.set_attributes(
            {
                "rewardmesh.response_length": len(rollout.response_ids),
                "rewardmesh.num_preempted": rollout.num_preempted,
                "rewardmesh.num_turns": rollout.num_turns,
                "rewardmesh.policy_version": rollout.policy_version,
            }
        )
        if not reward or self.rewards is None:
            return rollout_pb2.GenerateResponse(sample=sample)
        self.pending_rewards += 1
        started = time.perf_counter()
        try:
            with tracer().start_as_current_span("reward", attributes={"rewardmesh.pipeline": reward}) as rspan:
                result = await self.rewards.submit(sample, reward, timeout=reward_timeout, trace_context=inject())
                rspan.set_attributes({"rewardmesh.score": result.score, "rewardmesh.batch.size": result.batch_size})
                if result.HasField("error"):
                    rspan.set_status(Status(StatusCode.ERROR, result.error.message))
        finally:
            self.pending_rewards -= 1
        sample.timing.reward = time.perf_counter() - started
        sample.timing.reward_queue = result.timing.queue
        sample.timing.reward_compute = result.timing.compute
        span.set_attribute("rewardmesh.score", result.score)
        return rollout_pb2.GenerateResponse(sample=sample, result=result)

    # -- RPCs ---------------------------------------------------------------------------------

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateResponse]:
        jobs, template, settings = self._plan(request)
        timeout = request.reward_timeout.ToTimedelta().total_seconds() if request.HasField("reward_timeout") else None
        self.active_requests += 1
        tasks = [asyncio.create_task(self._run(j, template, settings, request.reward, timeout)) for j in jobs]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            # The client went away (or we are done): abort whatever is still generating or waiting.
            for task in tasks:
                task.cancel()
            self.active_requests -= 1

    async def UpdateWeights(
        self, request_iterator: AsyncIterator[rollout_pb2.UpdateWeightsRequest], context: aio.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        assembler = WeightAssembler(self.backend.weight_specs())
        version = 0
        first = True
        async for msg in request_iterator:
            if first:
                version, first = msg.policy_version, False
            assembler.add(msg.chunk)
        tensors = assembler.finish()
        version = version or self.backend.policy_version + 1
        started = time.perf_counter()
        await self.backend.update_weights(tensors, version)
        spent = time.perf_counter() - started
        log.info(
            "applied %d tensors (%d bytes) as policy version %d in %.3fs",
            len(tensors),
            assembler.num_bytes,
            version,
            spent,
        )
        return rollout_pb2.UpdateWeightsResponse(
            policy_version=self.backend.policy_version,
            num_tensors=len(tensors),
            num_bytes=assembler.num_bytes,
            apply_seconds=spent,
        )

    async def GetInfo(self, request: rollout_pb2.GetInfoRequest, context: aio.ServicerContext) -> Any:
        return rollout_pb2.GetInfoResponse(
            model=self.backend.model,
            backend=self.backend.name,
            policy_version=self.backend.policy_version,
            load=rollout_pb2.RolloutLoad(
                running_samples=self.running_samples,
                pending_rewards=self.pending_rewards,
                active_requests=self.active_requests,
            ),
            max_model_len=self.backend.max_model_len,
            tools=sorted(TOOLS),
            reward_targets=[s.address for s in self.rewards.streams] if self.rewards else [],
        )
