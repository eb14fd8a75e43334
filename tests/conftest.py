"""Shared fixtures: a small random Qwen3 target with a locally trained ChatML tokenizer, and chat data.

Everything is built on the fly from fixed text and seeds: no download, a second or two per session.
"""

from __future__ import annotations

import functools
import json
import multiprocessing.util
import os
import subprocess
from pathlib import Path

import pytest

# No test reaches a model hub: the hub tests build a cache and read it offline; anything else that named a
# hub repository by mistake fails at once instead of waiting on the network. Set before transformers is imported.
os.environ["HF_HUB_OFFLINE"] = "1"
# The vLLM servers the tests start run their engine in the server's own process instead of two more (its
# engine core, then a worker): 20 s to start on 2 cores instead of 31. The engine, its scheduler and how it
# loads the target and the drafter are the same; launch/gpu_check.sh serves with vLLM's defaults.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

pytest_plugins = ["pytester"]  # the test of the grouping's guard runs an inner session

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "a",
    "python",
    "function",
    "returns",
    "a",
    "list",
    "of",
    "values",
    "sorted",
    "by",
    "key",
    "and",
    "the",
    "parser",
    "reads",
    "each",
    "line",
    "of",
    "the",
    "file",
    "into",
    "a",
    "dictionary",
    "numbers",
    "strings",
    "tuples",
    "sets",
    "maps",
    "iterators",
    "generators",
    "classes",
    "modules",
    "packages",
]


# The README's test command runs two pytest-xdist workers (`-n 2 --dist loadgroup`). The foreground one runs
# the tests marked `processes` (torchrun jobs, the CLIs, vLLM servers) one after another, as a serial run
# would: their timeouts and signal windows see the machine they were written for. The background one runs
# the rest at a lower CPU priority, on the cycles the jobs leave idle: the in-process tests and the tests
# marked `processes(background=True)`, whose processes wait on no clock (measured memory peaks, the quick
# benchmarks' tables; their processes inherit the priority).
def in_background(item: pytest.Item) -> bool:
    """Whether `item` runs in the background worker."""
    mark = item.get_closest_marker("processes")
    return mark is None or mark.kwargs.get("background", False)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group("background" if in_background(item) else "foreground"))


@functools.cache
def leave_the_cores_to_the_foreground() -> None:
    """In the background worker: a lower priority and one torch thread (two threads of a lower-priority
    process wait on each other at every parallel region when one is preempted: the first try of this layout
    ran the in-process tests 4x slower, and the foreground no faster)."""
    os.nice(10)
    torch.set_num_threads(1)


def pytest_runtest_setup(item):
    if os.environ.get("PYTEST_XDIST_WORKER") and in_background(item):
        leave_the_cores_to_the_foreground()


@pytest.fixture(autouse=True)
def in_process_tests_start_no_processes(request, monkeypatch):
    """A test not marked `processes` starts none: one that does fails, saying so, before the process starts
    (it would run in the background beside the jobs, which the mark keeps it out of or lets it in)."""
    if request.node.get_closest_marker("processes"):
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it `@pytest.mark.processes`")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", refuse)


def conversation(i: int) -> dict:
    rng = torch.Generator().manual_seed(i)
    q = " ".join(WORDS[j] for j in torch.randint(len(WORDS), (6,), generator=rng).tolist())
    a = " ".join(WORDS[j] for j in torch.randint(len(WORDS), (40 + i % 20,), generator=rng).tolist())
    return {"messages": [{"role": "user", "content": f"What is {q}?"}, {"role": "assistant", "content": a}]}


def build_tokenizer(
    out: Path | None,
    specials: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"),
    template: str = CHATML_TEMPLATE,
    **special_roles: str,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on WORDS, with `specials` as special tokens and a chat template.

    `special_roles` (eos_token=..., pad_token=..., ...) default to the ChatML tokenizer's."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    roles = special_roles or {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
    }
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **roles)
    fast.chat_template = template
    if out is not None:
        fast.save_pretrained(out)
    return fast


# The tiny targets' shape: 4 heads of 16 (2 KV heads), hidden 64, MLP 128.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def build_target(out: Path, vocab_size: int, num_layers: int = 6, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, num_hidden_layers=num_layers, **TINY_SHAPE)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    return model


def build_moe_target(out: Path, vocab_size: int, num_layers: int = 6, seed: int = 0) -> Qwen3MoeForCausalLM:
    """A random Qwen3-MoE of the tiny target's shape: 4 experts of MLP width 32, 2 routed per token."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        num_hidden_layers=num_layers,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        **TINY_SHAPE,
    )
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_moe_target(tmp_path_factory) -> Path:
    """A directory holding a random 6-layer Qwen3-MoE (hidden 64, 4 experts) and the ChatML tokenizer."""
    out = tmp_path_factory.mktemp("tiny_moe_target")
    tok = build_tokenizer(out)
    build_moe_target(out, vocab_size=len(tok))
    return out


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A directory holding a random 6-layer Qwen3 (hidden 64) and a ChatML tokenizer with a mask token."""
    out = tmp_path_factory.mktemp("tiny_target")
    tok = build_tokenizer(out)
    build_target(out, vocab_size=len(tok))
    return out


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> Path:
    """A jsonl file of 48 short conversations."""
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(48)))
    return path


# the held-out prompts and new tokens of `trained_default`'s evaluation (what an engine's tau is set against)
DEFAULT_EVAL_PROMPTS, DEFAULT_EVAL_TOKENS = 8, 64


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory) -> str:
    """One tokenized-data cache (--cache_dir) for the embedded default's runs that do not test tokenizing: the
    first run tokenizes its data once, the others read it (a cache per tokenizer, data and settings)."""
    return str(tmp_path_factory.mktemp("embedded_cache"))


@pytest.fixture(scope="session")
def trained_default(tmp_path_factory, embedded_cache) -> Path:
    """The embedded default trained colocated for 30 of its 150 steps (`python -m dflash_ddp.train`'s `main`,
    in this process: a process start saved), then evaluated on DEFAULT_EVAL_PROMPTS held-out prompts x
    DEFAULT_EVAL_TOKENS: the run's directory with its eval.json. Trained once for the tests that read it
    (about a minute on 2 cores)."""
    from dflash_ddp.train import main as train_main

    out = tmp_path_factory.mktemp("trained_default") / "run"
    argv = ["--output_dir", str(out), "--max_steps", "30", "--cache_dir", embedded_cache]
    argv += ["--eval_prompts", str(DEFAULT_EVAL_PROMPTS), "--eval_max_new_tokens", str(DEFAULT_EVAL_TOKENS)]
    assert train_main(argv) == 0
    return out
