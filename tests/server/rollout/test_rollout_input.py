"""server/rollout/rollout_input.py: the prompt forms are the proto's, and a prompt with none fails naming it."""

from __future__ import annotations

import pytest

from rewardmesh.common.errors import InvalidInput
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.server.rollout.rollout_input import PromptForm, prompt_form
from rewardmesh.v1 import rollout_pb2


def test_every_field_of_the_input_oneof_is_a_prompt_form() -> None:
    fields = {f.name for f in rollout_pb2.Prompt.DESCRIPTOR.oneofs_by_name["input"].fields}
    assert fields == {form.value for form in PromptForm}


def test_prompt_form() -> None:
    assert prompt_form(rollout_pb2.Prompt(token_ids=ids_tensor([1, 2])), "prompts[0]") is PromptForm.TOKEN_IDS
    chat = rollout_pb2.Prompt(chat=rollout_pb2.ChatPrompt(messages=[rollout_pb2.ChatMessage(role="user")]))
    assert prompt_form(chat, "prompts[0]") is PromptForm.CHAT
    with pytest.raises(InvalidInput, match=r"^prompts\[3\] has no input: set token_ids or chat$"):
        prompt_form(rollout_pb2.Prompt(group_id="g"), "prompts[3]")
