"""(j) Long context on CPU, `python -m dflash_ddp.bench --only long_context [--long_out DIR] [--quick]`.

A tiny target that has seen long inputs (`python -m dflash_ddp.tools.make_long_target`: the embedded target
fine-tuned on multi-turn conversations of 512 to 12K tokens built from its corpus, some turns repeating an
earlier question) and drafters for it trained at equal steps and tokens per step: at 512 tokens, and on the
long conversations with 16 anchors per conversation, with anchors scaled with the length, and with
sliding-window layers. Each is the real CLI (one process, one thread). Then:

1. tau per context bucket for each drafter: the project's speculative decoding of held-out long
   conversations (lengths spread from 512 to 12K tokens), every output checked against the target's greedy
   output, which is decoded once per prompt;
2. memory and seconds per step at 2K, 8K and 16K tokens (one conversation of that length per step) against
   `--plan`'s predicted peak and `--plan --calibrate`'s predicted rate for the same run.

Everything lands under DIR (default runs/bench-long); finished pieces are kept, so a stopped benchmark resumes.
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from dflash_ddp.config import EMBEDDED_PRESET
from dflash_ddp.data.chat_template import load_target_tokenizer
from dflash_ddp.evaluation.decoding import (
    CONTEXT_BUCKETS,
    as_transformers_assistant,
    greedy_generate,
    speculative_generate,
    tau_by_context,
)
from dflash_ddp.evaluation.evaluate import load_prompts
from dflash_ddp.files import atomic_write_text
from dflash_ddp.serving.export import load_drafter
from dflash_ddp.target_model.loading import eos_token_ids, load_causal_lm, whole_target
from dflash_ddp.tools.make_long_target import conversation_ids, long_conversation, question_answer, read_rows

# the drafter's shape and objective for every variant: the embedded default's
SHAPE = {"num_draft_layers": 2, "block_size": 8, "learning_rate": 8e-3, "tokens_per_batch": 8192}
SHORT = {"max_seq_len": 512, "num_anchors": 16}  # the embedded default's data: single-turn, <= 512 tokens
LONG = {"max_seq_len": 12288, "num_anchors": 16, "anchor_scale_tokens": 0}  # 16 whatever the length
# 16 anchors per 160 tokens: the density of the short data's conversations (about 160 tokens each)
SCALED = {**LONG, "anchor_scale_tokens": 160}
VARIANTS = {
    "trained at 512": ("short", SHORT),
    "trained at 512-12K, 16 anchors": ("long", LONG),
    "trained at 512-12K, anchors scaled": ("long", SCALED),
    "trained at 512-12K, anchors scaled, window 1024": ("long", {**SCALED, "sliding_window": 1024}),
    "trained at 512-12K, anchors scaled, window 1024 in layer 0": (
        "long",
        {**SCALED, "sliding_window": 1024, "sliding_layers": "0"},
    ),
}
LENGTHS = (2048, 8192, 16384)
FULL = {"steps": 60, "prompts": 16, "new_tokens": 48, "lengths": LENGTHS, "length_steps": 3, "target": []}
QUICK = {
    "steps": 1,
    "prompts": 2,
    "new_tokens": 8,
    "lengths": (1024,),
    "length_steps": 1,
    "target": ["--max_len", "1024", "--train_conversations", "4", "--heldout_conversations", "2",
               "--train_steps", "2", "--warmup_steps", "1"],
}  # fmt: skip
# a tiny process starts the CLI: a child's peak resident memory would otherwise carry this process's
FRESH = [sys.executable, "-S", "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"]
# one thread, and glibc returning freed blocks at once, so the resident peak is the tensors' peak
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}


def long_target(out: Path, budget: dict) -> dict:
    """The long target and its data, built into OUT/target on first use (about 5 minutes on 2 cores)."""
    root = out / "target"
    if not (root / "build.json").is_file():
        print(f"building the long target in {root} (python -m dflash_ddp.tools.make_long_target)", flush=True)
        cmd = [sys.executable, "-m", "dflash_ddp.tools.make_long_target", "--out_dir", str(root)]
        subprocess.run([*cmd, "--threads", "2", *budget["target"]], check=True)
    return {
        "target_model": str(root / "tiny_qwen3"),
        "long": str(root / "data" / "long_train.jsonl"),
        "heldout": str(root / "data" / "long_heldout.jsonl"),
        "short": EMBEDDED_PRESET["data"][0],
        "max_len": max(json.loads((root / "build.json").read_text())["lengths"]["heldout"]),
    }


def cli(flags: list[str]) -> str:
    """The training CLI with `flags` in a fresh process (see FRESH, ENV); its stdout."""
    done = subprocess.run(
        [*FRESH, sys.executable, "-m", "dflash_ddp.train", *flags],
        env=os.environ | ENV,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"python -m dflash_ddp.train {' '.join(flags)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def as_flags(settings: dict) -> list[str]:
    return [x for k, v in settings.items() for x in (f"--{k}", str(v))]


def train_variant(out: Path, name: str, paths: dict, budget: dict) -> dict:
    """Train one variant (or read its kept result): its run directory, steps and seconds per step."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    result_file = out / "results" / f"{slug}.json"
    if result_file.is_file():
        return json.loads(result_file.read_text())
    data, flags = VARIANTS[name]
    run_dir = out / "runs" / slug
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)  # a run a stopped benchmark left half done
    settings = {"target_model": paths["target_model"], "data": paths[data], "eval_data": "", **SHAPE, **flags,
                "output_dir": run_dir, "max_steps": budget["steps"], "save_steps": budget["steps"],
                "logging_steps": 1, "resume": "never", "seed": budget.get("seed", 0)}  # fmt: skip
    stdout = cli(as_flags(settings))
    trained = int(re.search(r"training took (\d+) s", stdout).group(1))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    result = {
        "variant": name,
        "run_dir": str(run_dir),
        "steps": budget["steps"],
        "s_per_step": trained / budget["steps"],
        "tokens_seen": records[-1].get("tokens_seen"),
        "peak_memory_gib": max(r.get("peak_memory_gib", 0.0) for r in records),
    }
    result_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(result_file, json.dumps(result, indent=1) + "\n")
    print(f"  trained {name}: {result['s_per_step']:.2f} s/step", flush=True)
    return result


def decode_all(paths: dict, trained: list[dict], budget: dict, out: Path) -> dict:
    """tau per context bucket of every trained drafter on the held-out long conversations: the target's
    greedy output once per prompt, then each drafter's speculative decoding checked against it."""
    kept = out / "results" / "decoding.json"
    if kept.is_file() and set(json.loads(kept.read_text())) == {t["variant"] for t in trained}:
        return json.loads(kept.read_text())
    info = whole_target(paths["target_model"])
    tokenizer = load_target_tokenizer(info.path)
    target = load_causal_lm(info, torch.device("cpu"), torch.float32)
    eos = eos_token_ids(tokenizer, target)
    prompts = load_prompts(tokenizer, paths["heldout"], budget["prompts"])
    truth = [greedy_generate(target, p, budget["new_tokens"], eos).tokens for _, p in prompts]
    report = {}
    for run in trained:
        drafter = as_transformers_assistant(load_drafter(latest_checkpoint(Path(run["run_dir"]))), target)
        results = [speculative_generate(target, drafter, p, budget["new_tokens"], eos) for _, p in prompts]
        taus, steps = tau_by_context(results)
        committed = sum(len(r.tokens) - 1 for r in results)
        report[run["variant"]] = {
            "tau": committed / sum(len(r.accepted) for r in results),
            "tau_by_context": taus,
            "verify_steps_by_context": steps,
            "lossless": all(r.tokens == t for r, t in zip(results, truth, strict=True)),
            "prompt_tokens": [len(p) for _, p in prompts],
        }
        print(f"  decoded {run['variant']}: tau {report[run['variant']]['tau']:.3f}", flush=True)
    atomic_write_text(kept, json.dumps(report, indent=1) + "\n")
    return report


def latest_checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()


def one_length_data(paths: dict, length: int, path: Path, count: int) -> None:
    """`count` conversations of about `length` tokens (at most), from the long target's training turns."""
    tok = load_target_tokenizer(paths["target_model"])
    turns = [question_answer(r) for r in read_rows(Path(paths["short"]))]
    sizes = [len(conversation_ids(tok, {"messages": t})) for t in turns]
    rng = random.Random(length)
    rows = [long_conversation(turns, sizes, length, 0.25, rng) for _ in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def measure_length(out: Path, paths: dict, length: int, budget: dict) -> dict:
    """At `length` tokens per step (one conversation), the long variant's settings: --plan's predicted peak
    and --plan --calibrate's predicted seconds per step against a real run's peak and seconds per step."""
    result_file = out / "results" / f"length-{length}.json"
    if result_file.is_file():
        return json.loads(result_file.read_text())
    work = out / "lengths" / str(length)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    steps = budget["length_steps"]
    one_length_data(paths, length, work / "data.jsonl", steps + 4)  # + calibration's batches
    settings = {"target_model": paths["target_model"], "data": work / "data.jsonl", "eval_data": "",
                **SHAPE, **SCALED, "max_seq_len": length, "tokens_per_batch": length,
                "output_dir": work / "run", "max_steps": steps, "save_steps": 1000, "logging_steps": 1,
                "resume": "never"}  # fmt: skip
    planned = cli([*as_flags(settings), "--plan"])
    predicted_gib = float(re.search(r"fits: yes: ([\d.]+) GiB", planned).group(1))
    calibrated = cli([*as_flags(settings), "--plan", "--calibrate"])
    rate = float(
        re.search(r"colocated \(target and drafter take turns\): ([\d.,]+) sequences/s", calibrated)[1]
    )
    start = time.perf_counter()
    cli(as_flags(settings))
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    # a record a step (--logging_steps 1): the step's seconds are its tokens over its rate; the first is warm-up
    per_step = [
        (r["tokens_seen"] - before["tokens_seen"]) / r["tokens_per_s"]
        for before, r in zip(records, records[1:], strict=False)
    ]
    result = {
        "length": length,
        "predicted_gib": predicted_gib,
        "measured_gib": max(r["peak_memory_gib"] for r in records),
        "predicted_s_per_step": 1.0 / rate,
        "measured_s_per_step": statistics.median(per_step) if per_step else wall / steps,
    }
    result_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(result_file, json.dumps(result, indent=1) + "\n")
    print(f"  measured {length} tokens: {result}", flush=True)
    return result


def tables(trained: list[dict], decoded: dict, lengths: list[dict]) -> list[str]:
    buckets = [name for _, _, name in CONTEXT_BUCKETS]
    shown = [b for b in buckets if any(b in d["tau_by_context"] for d in decoded.values())]
    lines = [
        "| drafter | tau | " + " | ".join(f"tau {b}" for b in shown) + " | lossless | s/step | peak GiB |",
        "|" + " --- |" * (5 + len(shown)),
    ]
    for run in trained:
        d = decoded[run["variant"]]
        cells = [
            f"{d['tau_by_context'][b]:.2f} ({d['verify_steps_by_context'][b]})"
            if b in d["tau_by_context"]
            else "-"
            for b in shown
        ]
        lines.append(
            f"| {run['variant']} | {d['tau']:.3f} | " + " | ".join(cells)
            + f" | {'yes' if d['lossless'] else 'NO'} | {run['s_per_step']:.2f} | {run['peak_memory_gib']:.3f} |"
        )  # fmt: skip
    if not lengths:
        return lines
    lines += [
        "",
        "| tokens/step | peak GiB, --plan | peak GiB, measured | plan / measured | s/step, --plan --calibrate "
        "| s/step, measured | calibrate / measured |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in lengths:
        lines.append(
            f"| {m['length']} | {m['predicted_gib']:.3f} | {m['measured_gib']:.3f} | "
            f"{m['predicted_gib'] / m['measured_gib']:.2f} | {m['predicted_s_per_step']:.2f} | "
            f"{m['measured_s_per_step']:.2f} | {m['predicted_s_per_step'] / m['measured_s_per_step']:.2f} |"
        )
    return lines


def bench_long_context(
    out: Path,
    quick: bool,
    jobs: int = 2,
    seed: int = 0,
    variants: list[str] | None = None,
    lengths: bool = True,
) -> list[str]:
    """Build (or reuse) the long target, train `variants` (all unset) with `seed`, decode, measure the
    lengths (unless `lengths` is False); print the tables and write them to OUT/table.md (OUT/seedN/ for
    another seed than 0; the target is shared)."""
    unknown = [v for v in variants or () if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--long_variants {','.join(unknown)}: choose among {', '.join(VARIANTS)}")
    budget = {**(QUICK if quick else FULL), "seed": seed}
    out = out / ("quick" if quick else "full")
    work = out if seed == 0 else out / f"seed{seed}"
    print(f"(j) long context in {work}: {budget}", flush=True)
    paths = long_target(out, budget)
    measure = partial(measure_length, out, paths, budget=budget)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        # --quick measures its length (three processes in turn) beside the trainings, from the start (its
        # seconds per step are no figures at that size; its peak is its own process's); the full benchmark
        # measures alone, after the decoding
        beside = [pool.submit(measure, n) for n in budget["lengths"]] if quick and lengths else []
        trainings = [pool.submit(train_variant, work, name, paths, budget) for name in variants or VARIANTS]
        trained = [training.result() for training in trainings]
    decoded = decode_all(paths, trained, budget, work)
    measured = [m.result() for m in beside] or ([measure(n) for n in budget["lengths"]] if lengths else [])
    lines = tables(trained, decoded, measured)
    print("\n".join(lines))
    atomic_write_text(work / "table.md", "\n".join(lines) + "\n")
    return lines
