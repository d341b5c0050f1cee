"""Tiny real models built offline, so tests, benchmarks and the demo run real transformers code anywhere.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained in-process on a generated corpus,
and the models are randomly initialised Llama networks saved with ``save_pretrained``. Every build is
deterministic (same bytes for the same seed and library versions).

Models of real size (`SHAPES`): the architectures and sizes of released models, from the configs in
``model_shapes/``, randomly initialised in bf16 with the tiny tokenizer grown to the real vocabulary size: what
a benchmark needs to measure the engine's cost at the sizes users train.
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import json
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from rewardmesh.demo.model_shapes import SHAPES

logger = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2 in every tokenizer built here

# ChatML, as Qwen uses it; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# GPT-4-style split, except that numbers split into runs of at most two digits and never carry a leading
# space, so "7 + 8 = 15" gives "15" as one piece that BPE can turn into one token.
_SPLIT_NUMBERS_1_2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,2}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The same with single digits (Qwen2-style), so the "other" tokenizer really tokenizes differently.
_SPLIT_DIGITS = _SPLIT_NUMBERS_1_2.replace(r"\p{N}{1,2}", r"\p{N}")

# Bumped whenever what a build writes changes, so an old build in a cache directory is rebuilt.
BUILD_VERSION = 3
_MARKER = "tiny_models.json"


@dataclass(frozen=True)
class TinyModelPaths:
    """Where a build put each model directory (each holds its weights, config and tokenizer)."""

    root: Path
    policy: Path
    reward_model: Path
    reward_model_other_tokenizer: Path  # a reward model whose tokenizer differs from the policy's


# --------------------------------------------------------------------------------------------- tokenizer


_SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "our model", "the student", "she", "he", "they"]
_VERBS = ["reads", "writes", "counts", "likes", "finds", "adds", "checks", "answers", "solves", "sees"]
_OBJECTS = ["a book", "the answer", "two numbers", "the question", "a short story", "the sum", "a list"]
_ENDINGS = [".", "!", "?", " today.", " again.", " quickly.", " with care."]
_QUESTIONS = ["What is {a} + {b}?", "Compute {a} + {b}.", "{a} + {b} = ?", "Add {a} and {b}.", "{a}+{b}="]
_ANSWERS = ["{c}", "The answer is {c}.", "{a} + {b} = {c}", "It is {c}.", "#### {c}"]


def _corpus(seed: int = 1234) -> Iterator[str]:
    """A small English/arithmetic/chat corpus; fixed seed, so training sees the same text every run."""
    rng = random.Random(seed)
    for _ in range(400):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
        yield s[0].upper() + s[1:]
    for a in range(10):
        for b in range(10):
            q = rng.choice(_QUESTIONS).format(a=a, b=b)
            r = rng.choice(_ANSWERS).format(a=a, b=b, c=a + b)
            yield f"user\n{q}\nassistant\n{r}\n"
            yield f"{a} + {b} = {a + b}"
    for _ in range(200):
        a, b = rng.randrange(1000), rng.randrange(1000)
        yield f"{a} + {b} = {a + b}, {a} * {b} = {a * b}, {a} - {b} = {a - b}."
    yield "system\nYou are a helpful assistant.\n"
    yield "The quick brown fox jumps over the lazy dog. 0123456789 () [] {} <> + - * / = % # @ $ & ^ ~ `"


def build_tokenizer(vocab_size: int = 512, *, number_tokens: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ChatML special tokens, trained in-process in a few milliseconds.

    Every byte is in the vocabulary (any text round-trips), every digit is its own token, and with
    ``number_tokens`` the numbers 0..18 are each one token (so single-digit sums are one-token answers).
    ``number_tokens=False`` splits digits one by one (a genuinely different tokenizer for re-tokenization).
    Special tokens: ``<|endoftext|>`` (id 0, pad), ``<|im_start|>`` (1), ``<|im_end|>`` (2, eos: the end of
    a ChatML turn).
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = _SPLIT_NUMBERS_1_2 if number_tokens else _SPLIT_DIGITS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if number_tokens:
        tok = _with_number_merges(tok)
    return _chatml_tokenizer(tok)


def _chatml_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """`tok` as a transformers tokenizer with the ChatML specials and chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        padding_side="right",
    )


def grown_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with its vocabulary grown to `vocab_size` ids: the extra ones are byte strings no merge
    produces (text never encodes to them) that decode like any token, so every id a model of that vocabulary
    can sample has text, as with a real tokenizer of that size."""
    base = build_tokenizer()
    spec: dict[str, Any] = json.loads(base.backend_tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in spec["added_tokens"]}
    next_id = max(max(vocab.values()), max(t["id"] for t in spec["added_tokens"])) + 1
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = ("".join(chars) for width in itertools.count(2) for chars in itertools.product(alphabet, repeat=width))
    for token in fillers:
        if next_id >= vocab_size:
            break
        if token not in taken:
            vocab[token] = next_id
            next_id += 1
    if next_id < vocab_size:  # pragma: no cover - the fillers never run out
        raise ValueError(f"could not grow the tokenizer to {vocab_size} ids")
    return _chatml_tokenizer(Tokenizer.from_str(json.dumps(spec)))


def _with_number_merges(tok: Tokenizer) -> Tokenizer:
    """Guarantee "10".."18" are single tokens whatever the trainer learned, by adding their merges first."""
    spec: dict[str, Any] = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges: list[Any] = spec["model"]["merges"]
    added: list[list[str]] = []
    for n in range(10, 19):
        if str(n) not in vocab:
            vocab[str(n)] = max(max(vocab.values()), max(t["id"] for t in spec["added_tokens"])) + 1
            added.append(["1", str(n)[1]])
    spec["model"]["merges"] = added + merges  # highest priority, so "15" always merges
    return Tokenizer.from_str(json.dumps(spec))


# ------------------------------------------------------------------------------------------------ models


def _llama_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    layers: int,
    hidden: int,
    heads: int,
    max_position_embeddings: int,
    initializer_range: float,
    **extra: Any,
) -> LlamaConfig:
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **extra,
    )


def build_policy(
    out: Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 2,
    seed: int = 0,
    max_position_embeddings: int = 512,
) -> Path:
    """A random tiny Llama causal LM with its tokenizer and a generation config that stops at ChatML's end.

    64-wide attention heads by default (two of them): the size vLLM's attention kernels take on CPU and GPU (its CPU
    build refuses 16), so the same policy runs on both backends."""
    config = _llama_config(
        tokenizer,
        layers=layers,
        hidden=hidden,
        heads=heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    _save(model, tokenizer, out)
    return out


def build_reward_model(
    out: Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    seed: int = 0,
    max_position_embeddings: int = 4096,
) -> Path:
    """A random tiny Llama sequence classifier (one logit) with its tokenizer.

    Initialised with a wider spread than a real checkpoint so different texts get clearly different scores,
    which is what makes score-equality tests meaningful.
    """
    config = _llama_config(
        tokenizer,
        layers=layers,
        hidden=hidden,
        heads=heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.2,
        num_labels=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
    _save(model, tokenizer, out)
    return out


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Writing model shards" bar per tiny model is noise in test output
    try:
        model.save_pretrained(out)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    logger.debug("wrote %s: %s", out, sorted(p.name for p in out.iterdir()))


# ------------------------------------------------------------------------------------------- real shapes


def shaped_config(shape: str, tokenizer: PreTrainedTokenizerFast) -> Any:
    """The transformers config of a real shape (`SHAPES`), its special token ids the tokenizer's."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {', '.join(sorted(SHAPES))}")
    spec = SHAPES[shape]
    fields = spec.fields()
    model_type = fields.pop("model_type")
    if len(tokenizer) != fields["vocab_size"]:
        raise ValueError(f"{shape}: the tokenizer has {len(tokenizer)} ids, the model {fields['vocab_size']}")
    return AutoConfig.for_model(
        model_type,
        **fields,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **({"num_labels": 1} if spec.kind == "reward_model" else {}),
    )


def build_shaped_model(out: Path, shape: str, *, seed: int = 0) -> Path:
    """A random model of a real shape (`SHAPES`) in bf16, with the tiny tokenizer grown to its vocabulary."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {', '.join(sorted(SHAPES))}")
    kind = SHAPES[shape].kind
    tokenizer = grown_tokenizer(int(SHAPES[shape].fields()["vocab_size"]))
    config = shaped_config(shape, tokenizer)
    auto: Any = AutoModelForCausalLM if kind == "policy" else AutoModelForSequenceClassification
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.bfloat16)
    if kind == "policy":
        model.generation_config = GenerationConfig(
            eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )
    _save(model, tokenizer, out)
    return out


def build_shaped_models(out: Path, shapes: list[str], *, seed: int = 0) -> dict[str, Path]:
    """Build (or reuse) each named shape under ``out/<shape>``, as `build_tiny_models` builds: a marker written
    last, a staging directory renamed into place, a file lock against concurrent builders."""
    paths: dict[str, Path] = {}
    for shape in shapes:
        spec = {"version": BUILD_VERSION, "shape": shape, "seed": seed}
        build = functools.partial(build_shaped_model, shape=shape, seed=seed)
        paths[shape] = _build_once(Path(out) / shape, spec, build)
    return paths


def _build_once(final: Path, spec: dict[str, Any], build: Callable[[Path], object]) -> Path:
    """`build(staging)` unless `final` holds a complete build of `spec` (its marker file, written last)."""
    if _read_json(final / _MARKER) == spec:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _read_json(final / _MARKER) == spec:  # another process built it while we waited
            return final
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".build-{final.name}-") as tmp:
            staging = Path(tmp) / final.name
            build(staging)
            (staging / _MARKER).write_text(json.dumps(spec) + "\n")
            if final.exists():
                shutil.rmtree(final)
            staging.rename(final)
    logger.info("built %s in %s (%.1f s)", spec.get("shape", final.name), final, time.perf_counter() - t0)
    return final


# ------------------------------------------------------------------------------------------------- build


def build_tiny_models(out: Path, *, seed: int = 0) -> TinyModelPaths:
    """Build (or reuse) the policy and both reward models under ``out``.

    Reuse is keyed on a marker file written last: a build interrupted half-way is redone, and one made by
    another seed or an older version of this module is replaced. Models are written to a staging directory
    and renamed into place, under a file lock, so concurrent builders (test workers, a demo) do not collide.
    """
    out = Path(out)
    paths = TinyModelPaths(
        root=out,
        policy=out / "policy",
        reward_model=out / "reward_model",
        reward_model_other_tokenizer=out / "reward_model_other_tok",
    )
    spec = {"version": BUILD_VERSION, "seed": seed}
    if _is_complete(paths, spec):
        logger.debug("tiny models already built in %s", out)
        return paths

    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(paths, spec):  # another process built it while we waited
            return paths
        t0 = time.perf_counter()
        marker = out / _MARKER
        marker.unlink(missing_ok=True)
        tokenizer = build_tokenizer()
        other_tokenizer = build_tokenizer(vocab_size=400, number_tokens=False)
        with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
            staging = Path(tmp)
            build_policy(staging / "policy", tokenizer, seed=seed)
            build_reward_model(staging / "reward_model", tokenizer, seed=seed + 1)
            build_reward_model(staging / "reward_model_other_tok", other_tokenizer, seed=seed + 2)
            for final in (paths.policy, paths.reward_model, paths.reward_model_other_tokenizer):
                if final.exists():
                    shutil.rmtree(final)
                (staging / final.name).rename(final)
        marker.write_text(json.dumps(spec) + "\n")
    logger.info(
        "built tiny models in %s (%.1f s): policy, reward_model, reward_model_other_tok",
        out,
        time.perf_counter() - t0,
    )
    return paths


def _is_complete(paths: TinyModelPaths, spec: dict[str, int]) -> bool:
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return _read_json(paths.root / _MARKER) == spec and all(
        (d / f).is_file()
        for d in (paths.policy, paths.reward_model, paths.reward_model_other_tokenizer)
        for f in needed
    )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
