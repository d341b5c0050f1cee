"""A GenerateRequest as the run settings and samples a rollout worker takes: every count, size and sampling parameter
checked against the server's limits before any work is done (tokenizing included), each failure an InvalidInput
naming the field (INVALID_ARGUMENT on the wire); then the prompts made into token ids."""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass

from rewardmesh.common.errors import InvalidInput
from rewardmesh.common.tensors import duration_seconds, ids_from, ids_tensor
from rewardmesh.server.decoding import decoder
from rewardmesh.server.limits import Limits, check, extra_info, finite
from rewardmesh.server.rollout.agent_loop import AgentSettings
from rewardmesh.server.rollout.backends.base import GenerationRequest
from rewardmesh.server.rollout.tools import TOOLS
from rewardmesh.server.rollout.worker import Job, PromptInput, RolloutWorker, RunSettings
from rewardmesh.v1 import rollout_pb2


class PromptForm(enum.Enum):
    """Which field of a Prompt's `input` oneof carries it (the values are the field names)."""

    TOKEN_IDS = "token_ids"
    CHAT = "chat"


def prompt_form(prompt: rollout_pb2.Prompt, where: str) -> PromptForm:
    """The prompt's form; InvalidInput when neither field is set."""
    which = prompt.WhichOneof("input")
    if which is None:
        raise InvalidInput(f"{where} has no input: set token_ids or chat")
    return PromptForm(which)


@dataclass(frozen=True)
class RolloutInput:
    """A server's side of a request's checks: its limits and the max_tokens used when a request sets none; the
    model's context, its tokenizer and whether it can score (a reward target) are read from the worker at each
    call, as a backend still booting has no tokenizer yet."""

    worker: RolloutWorker
    limits: Limits
    default_max_tokens: int

    @property
    def max_model_len(self) -> int:
        return int(self.worker.backend.max_model_len)

    def settings(self, request: rollout_pb2.GenerateRequest) -> RunSettings:
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
        sampling = self._sampling(request.sampling)
        max_tokens = sampling.max_tokens
        check(len(request.agent.tools), len(TOOLS), "agent.tools count", "the number of registered tools")
        for j, name in enumerate(request.agent.tools):
            if name not in TOOLS:
                raise InvalidInput(f"agent.tools[{j}]: unknown tool '{name}' (registered: {', '.join(sorted(TOOLS))})")
        if request.reward and self.worker.rewards is None:
            raise InvalidInput(f"reward: '{request.reward}' named, but this rollout server has no --reward-target")
        for i, prompt in enumerate(request.prompts):
            self._check_prompt(i, prompt, max_tokens)
            if prompt.sample_ids and len(prompt.sample_ids) != request.n:
                raise InvalidInput(f"prompts[{i}].sample_ids has {len(prompt.sample_ids)} ids, but n is {request.n}")
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

    def _sampling(self, sp: rollout_pb2.SamplingParams) -> GenerationRequest:
        """The sampling parameters, checked; the per-turn template (prompt ids and seed are set per sample)."""
        lim = self.limits
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
        if not 0 <= sp.min_tokens <= max_tokens:
            raise InvalidInput(f"sampling.min_tokens must be in [0, max_tokens={max_tokens}], got {sp.min_tokens}")
        return GenerationRequest(
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

    def _check_prompt(self, i: int, prompt: rollout_pb2.Prompt, max_tokens: int) -> None:
        """Every size of one prompt, checked before any work is done for it (tokenizing included)."""
        lim = self.limits
        where = f"prompts[{i}]"
        form = prompt_form(prompt, where)
        if form is PromptForm.TOKEN_IDS:
            size = len(prompt.token_ids.raw_data) // 4
            check(size, lim.max_tensor_elements, f"{where}.token_ids size", "max_tensor_elements")
            if size + max_tokens > self.max_model_len:
                raise self._too_long(i, max_tokens, size)
        else:
            if not prompt.chat.messages:
                raise InvalidInput(f"{where}.chat.messages is empty")
            chars = sum(len(m.content) + len(m.role) for m in prompt.chat.messages)
            check(chars, lim.max_prompt_chars, f"{where}.chat length (characters)", "max_prompt_chars")
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
            f"model's context of {self.max_model_len} tokens"
        )

    @staticmethod
    def tokenizes(request: rollout_pb2.GenerateRequest) -> bool:
        """Whether making the jobs tokenizes (a chat prompt), which is worth a thread off the event loop."""
        return any(prompt_form(p, f"prompts[{i}]") is PromptForm.CHAT for i, p in enumerate(request.prompts))

    def jobs(self, request: rollout_pb2.GenerateRequest, max_tokens: int) -> list[Job]:
        """The checked request's samples (prompts decoded); may run in a thread, off the event loop."""
        stamp = uuid.uuid4().hex[:8]
        jobs: list[Job] = []
        sp = request.sampling
        for i, prompt in enumerate(request.prompts):
            decoded = self._decode(i, prompt, prompt.group_id or f"{stamp}-{i}")
            if len(decoded.ids) + max_tokens > self.max_model_len:
                raise self._too_long(i, max_tokens, len(decoded.ids))
            for k in range(request.n):
                sid = prompt.sample_ids[k] if prompt.sample_ids else f"{decoded.group_id}/{k}"
                jobs.append(Job(sid, decoded, sp.seed + k if sp.HasField("seed") else None))
        if len({j.sample_id for j in jobs}) != len(jobs):
            raise InvalidInput("prompts[].sample_ids: ids must be unique across the request")
        return jobs

    def _decode(self, i: int, prompt: rollout_pb2.Prompt, group_id: str) -> PromptInput:
        """One checked prompt as the ids the backend generates from (a chat prompt through the chat template)."""
        tok = self.worker.backend.tokenizer
        if prompt_form(prompt, f"prompts[{i}]") is PromptForm.TOKEN_IDS:
            ids = ids_from(prompt.token_ids, f"prompts[{i}].token_ids").tolist()
            if not ids:
                raise InvalidInput(f"prompts[{i}].token_ids is empty")
            return PromptInput(prompt, group_id, ids, prompt.token_ids, decoder(tok)(ids))
        messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(tok.encode(text, add_special_tokens=False))
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
        return PromptInput(prompt, group_id, ids, ids_tensor(ids), question)
