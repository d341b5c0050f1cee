"""The offline tiny models: real transformers checkpoints that load back, tokenize, chat and generate."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

from rewardmesh.demo.model_shapes import SHAPES
from rewardmesh.demo.tiny_models import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    TinyModelPaths,
    build_reward_model,
    build_tiny_models,
    build_tokenizer,
    grown_tokenizer,
    shaped_config,
)

TEXTS = [
    "Hello world! 7 + 8 = 15.",
    "What is 123 + 4567? The answer is 4690.",
    "Ünïcödé, emoji 🙂, tabs\tand  double  spaces, trailing newline\n",
    "",
    "   ",
]


def _digest(root: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _contents(root: Path) -> dict[str, str]:
    return {name: sha for name, (sha, _) in _digest(root).items()}


def test_layout(tiny_models: TinyModelPaths) -> None:
    for d in (tiny_models.policy, tiny_models.reward_model, tiny_models.reward_model_other_tokenizer):
        assert d.parent == tiny_models.root
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (d / f).is_file(), d / f
    assert (tiny_models.policy / "generation_config.json").is_file()


def test_models_load_back(tiny_models: TinyModelPaths) -> None:
    tok: Any = AutoTokenizer.from_pretrained(tiny_models.policy, local_files_only=True)
    policy: Any = AutoModelForCausalLM.from_pretrained(tiny_models.policy, local_files_only=True)
    assert isinstance(policy, LlamaForCausalLM)
    assert policy.config.vocab_size == len(tok)
    assert policy.config.max_position_embeddings == 512
    assert policy.generation_config.pad_token_id == tok.pad_token_id
    assert tok.eos_token_id in policy.generation_config.eos_token_id

    for path in (tiny_models.reward_model, tiny_models.reward_model_other_tokenizer):
        rm_tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        rm = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
        assert isinstance(rm, LlamaForSequenceClassification)
        assert rm.config.num_labels == 1
        assert rm.config.pad_token_id == rm_tok.pad_token_id is not None
        assert rm.config.vocab_size == len(rm_tok)
        with torch.inference_mode():
            logits = rm(torch.tensor([rm_tok.encode("The answer is 15.")])).logits
        assert logits.shape == (1, 1)
        assert torch.isfinite(logits).all()

    # the reward model shares the policy's tokenizer byte for byte; the other one does not
    same = (tiny_models.reward_model / "tokenizer.json").read_bytes()
    assert same == (tiny_models.policy / "tokenizer.json").read_bytes()
    other: Any = AutoTokenizer.from_pretrained(tiny_models.reward_model_other_tokenizer, local_files_only=True)
    assert other.get_vocab() != tok.get_vocab()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(tiny_models: TinyModelPaths, text: str) -> None:
    for path in (tiny_models.policy, tiny_models.reward_model_other_tokenizer):
        tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        ids = tok.encode(text)
        assert tok.decode(ids) == text


def test_digits_and_small_numbers_are_single_tokens(tiny_models: TinyModelPaths) -> None:
    tok: Any = AutoTokenizer.from_pretrained(tiny_models.policy, local_files_only=True)
    number_ids = []
    for n in range(19):
        ids = tok.encode(str(n))
        assert len(ids) == 1, (n, ids)
        number_ids.append(ids[0])
        # also inside an equation, where the answer follows "= "
        eq = tok.encode(f"{n // 2} + {n - n // 2} = {n}")
        assert eq[-1] == ids[0]
        assert tok.decode(eq[-1:]) == str(n)
    assert len(set(number_ids)) == 19
    assert tok.convert_ids_to_tokens(number_ids[:10]) == [str(d) for d in range(10)]
    # longer numbers split into pieces that are digits only (no space or symbol glued on)
    pieces = [tok.decode([i]) for i in tok.encode("2024 + 999 = 3023, x=45")]
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert all(p.isdigit() for p in digit_pieces), pieces
    assert "".join(digit_pieces) == "2024999302345"


def test_special_tokens_and_sizes(tiny_models: TinyModelPaths) -> None:
    tok: Any = AutoTokenizer.from_pretrained(tiny_models.policy, local_files_only=True)
    assert tok.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END]) == [0, 1, 2]
    assert tok.eos_token == IM_END
    assert tok.pad_token == ENDOFTEXT
    assert tok.bos_token is None
    assert tok.encode(f"{IM_START}user")[0] == 1
    assert 300 <= len(tok) <= 1024
    other: Any = AutoTokenizer.from_pretrained(tiny_models.reward_model_other_tokenizer, local_files_only=True)
    assert len(other) != len(tok)
    assert len(other.encode("15")) == 2  # the other tokenizer splits every digit


def test_chat_template(tiny_models: TinyModelPaths) -> None:
    tok: Any = AutoTokenizer.from_pretrained(tiny_models.policy, local_files_only=True)
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    full = tok.apply_chat_template(
        [*messages, {"role": "assistant", "content": "7"}], tokenize=False, add_generation_prompt=False
    )
    assert full == text + "7<|im_end|>\n"
    # transformers 5 returns a BatchEncoding from tokenize=True
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == tok.encode(text)
    assert ids[0] == tok.convert_tokens_to_ids(IM_START)
    assert ids.count(tok.convert_tokens_to_ids(IM_END)) == 1


def test_policy_generates(tiny_models: TinyModelPaths) -> None:
    tok: Any = AutoTokenizer.from_pretrained(tiny_models.policy, local_files_only=True)
    policy: Any = AutoModelForCausalLM.from_pretrained(tiny_models.policy, local_files_only=True)
    inputs: Any = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    prompt_len = inputs["input_ids"].shape[1]
    torch.manual_seed(0)
    out = policy.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape == (1, prompt_len + 6)
    assert torch.equal(out[0, :prompt_len], inputs["input_ids"][0])
    new = out[0, prompt_len:]
    assert int(new.min()) >= 0 and int(new.max()) < len(tok)
    assert isinstance(tok.decode(new), str)


def test_rebuild_is_fast_and_changes_nothing(tiny_models: TinyModelPaths) -> None:
    before = _digest(tiny_models.root)
    t0 = time.perf_counter()
    again = build_tiny_models(tiny_models.root)
    assert time.perf_counter() - t0 < 30  # only a stall; "nothing rebuilt" is the unchanged mtimes below
    assert again == tiny_models
    assert _digest(tiny_models.root) == before


def test_build_is_deterministic(tiny_models: TinyModelPaths, tmp_path: Path) -> None:
    fresh = build_tiny_models(tmp_path / "a")
    assert _contents(fresh.root) == _contents(tiny_models.root)
    assert not list(fresh.root.glob(".build-*"))  # the staging directory is gone

    reseeded = build_tiny_models(tmp_path / "b", seed=1)
    a, b = _contents(fresh.root), _contents(reseeded.root)
    assert a["policy/tokenizer.json"] == b["policy/tokenizer.json"]
    assert a["policy/model.safetensors"] != b["policy/model.safetensors"]
    assert a["reward_model/model.safetensors"] != b["reward_model/model.safetensors"]


def test_incomplete_or_other_seed_build_is_redone(tmp_path: Path) -> None:
    paths = build_tiny_models(tmp_path)
    reference = _contents(tmp_path)
    (paths.reward_model / "model.safetensors").unlink()
    build_tiny_models(tmp_path)
    assert _contents(tmp_path) == reference

    build_tiny_models(tmp_path, seed=3)
    assert _contents(tmp_path)["policy/model.safetensors"] != reference["policy/model.safetensors"]
    assert '"seed": 3' in (tmp_path / "tiny_models.json").read_text()


def test_tokenizer_builds_fast_and_identically() -> None:
    t0 = time.perf_counter()
    a = build_tokenizer()
    assert time.perf_counter() - t0 < 30  # only a stall: the machine may be loaded many times over
    b = build_tokenizer()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_benchmark_sized_reward_model(tmp_path: Path) -> None:
    tok = build_tokenizer()
    out = build_reward_model(tmp_path / "rm", tok, layers=4, hidden=256, heads=4)
    rm = AutoModelForSequenceClassification.from_pretrained(out, local_files_only=True)
    assert (rm.config.num_hidden_layers, rm.config.hidden_size, rm.config.num_attention_heads) == (4, 256, 4)
    with torch.inference_mode():
        assert torch.isfinite(rm(torch.tensor([tok.encode("1 + 1 = 2")])).logits).all()


# -------------------------------------------------------------------------------------------------- real shapes


@pytest.fixture(scope="module")
def qwen_vocab_tokenizer() -> Any:
    return grown_tokenizer(151936)


def test_the_grown_tokenizer_has_the_real_vocabulary_and_tokenizes_as_the_tiny_one(qwen_vocab_tokenizer: Any) -> None:
    tok, tiny = qwen_vocab_tokenizer, build_tokenizer()
    assert len(tok) == 151936 and tok.eos_token_id == tiny.eos_token_id and tok.pad_token_id == tiny.pad_token_id
    text = "What is 17 + 25? The answer is 42."
    assert tok.encode(text) == tiny.encode(text)  # the grown ids are never produced from text
    grown = [*range(len(tiny), len(tok), 997), len(tok) - 1]
    assert all(tok.decode([i]) for i in grown)  # every id a model of this vocabulary samples has text
    assert len(set(tok.convert_ids_to_tokens(grown))) == len(grown)


@pytest.mark.parametrize(
    ("shape", "parameters", "head_dim"),
    [
        ("qwen2.5-0.5b", 494_032_768, 64),
        ("qwen2.5-1.5b", 1_543_714_304, 128),
        ("qwen2.5-0.5b-rm", 494_032_768 + 896, 64),
    ],
)
def test_real_shapes_have_the_released_models_sizes(
    qwen_vocab_tokenizer: Any, shape: str, parameters: int, head_dim: int
) -> None:
    """The configs give the released models' parameter counts (checked on the meta device: no weights built)."""
    config = shaped_config(shape, qwen_vocab_tokenizer)
    auto: Any = AutoModelForCausalLM if SHAPES[shape].kind == "policy" else AutoModelForSequenceClassification
    with torch.device("meta"):
        model = auto.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert config.hidden_size // config.num_attention_heads == head_dim and config.vocab_size == 151936
    with pytest.raises(ValueError, match="unknown model shape 'qwen9'"):
        shaped_config("qwen9", qwen_vocab_tokenizer)
