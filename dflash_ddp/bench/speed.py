"""The trainer against a plain loop around transformers' DFlash drafter, side by side, one CPU thread.

Both train on the same sequences of the embedded tiny target (multi-turn conversations of 300-500 tokens
built from its shipped data, one sequence per step) with the same drafter shape; the trainer runs as the
real CLI (`python -m dflash_ddp.train`, colocated), the loop as `dflash_ddp.bench.plain_loop`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dflash_ddp.config import ASSETS, EMBEDDED_TARGET, parse_config
from dflash_ddp.parallel.topology import Topology
from dflash_ddp.setup.run import build_schedule, load_data, prepare

SEQ_LEN = 512


def long_conversations(out: Path, tokenizer, min_tokens: int = 300, max_tokens: int = 500) -> int:
    """Multi-turn conversations of the embedded data, each between min and max tokens; returns the count."""
    rows = [json.loads(line) for line in (ASSETS / "data" / "docstring_qa_regenerated.jsonl").open()]

    def length(messages):
        return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])

    kept, turns = [], []
    for row in rows:
        grown = turns + row["messages"]
        if length(grown) > max_tokens:
            if turns and length(turns) >= min_tokens:
                kept.append({"messages": turns})
            grown = row["messages"]
        turns = grown
    out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return len(kept)


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def trainer_seconds_per_step(flags: list[str]) -> float:
    """Run the real CLI; seconds per step over the logging windows after the first."""
    out = Path(flags[flags.index("--output_dir") + 1])
    subprocess.run(
        [sys.executable, "-m", "dflash_ddp.train", *flags], env=_env(), capture_output=True, check=True
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = list(zip(records, records[1:], strict=False))
    seconds = sum((b["tokens_seen"] - a["tokens_seen"]) / b["tokens_per_s"] for a, b in windows)
    return seconds / (records[-1]["step"] - records[0]["step"])


def plain_seconds_per_step(spec: dict) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    result = subprocess.run(
        [sys.executable, "-m", "dflash_ddp.bench.plain_loop", f.name],
        env=_env(),
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])["s_per_step"]


def plain_spec(cfg, setup, data, schedule, warmup: int) -> dict:
    """The plain loop's input: the schedule's batches of `data` as lists of sequences, and the drafter's
    shape and anchors as `cfg` and `setup` give them, so that both loops do the same work."""
    c = setup.drafter_config
    return {
        "steps": [
            [[torch.as_tensor(x).tolist() for x in data.sample(m)] for m in item.members]
            for item in schedule.batches(0, schedule.total_steps)
        ],
        "target_dir": str(EMBEDDED_TARGET),
        "layer_ids": c.target_layer_ids,
        "mask_id": c.mask_token_id,
        "num_anchors": cfg.num_anchors,
        "block_size": c.block_size,
        "num_layers": c.num_hidden_layers,
        "warmup": warmup,
        "threads": 1,
    }


def bench_plain_loop(steps: int, anchor_counts: tuple[int, ...] = (64, 512), rounds: int = 2) -> None:
    """Print seconds per step of the trainer and of the plain loop, and their ratio, per anchor count."""
    work = Path(tempfile.mkdtemp(prefix="dflash-speed-"))
    print(
        f"(d) trainer vs a plain loop around transformers' DFlash drafter ({steps} steps, 1 thread, 2 layers)"
    )
    data = work / "long.jsonl"
    base = {
        "--data": str(data),
        "--target_model": str(EMBEDDED_TARGET),
        "--num_draft_layers": "2",
        "--block_size": "16",
        "--max_seq_len": str(SEQ_LEN),
        "--tokens_per_batch": str(SEQ_LEN),
        "--eval_data": "",
        "--cache_dir": str(work / "cache"),  # every run reads the one tokenized copy
    }
    cfg, _ = parse_config([x for kv in base.items() for x in kv] + ["--output_dir", str(work / "plan")])
    setup = prepare(cfg, Topology(1, 0, 1))
    long_conversations(data, setup.tokenizer)
    tokenized, _ = load_data(cfg, setup, "")
    for anchors in anchor_counts:
        n = steps if anchors <= 64 else max(12, steps // 8)
        warmup = max(2, n // 10)
        settings = {
            **base,
            "--num_anchors": str(anchors),
            "--max_steps": str(n),
            "--logging_steps": str(warmup),
            "--save_steps": str(n),
        }
        run_cfg = dataclasses.replace(cfg, max_steps=n, num_anchors=anchors)
        schedule = build_schedule(run_cfg, tokenized, Topology(1, 0, 1))
        assert all(len(item.members) == 1 for item in schedule.batches(0, n)), "one sequence per step"
        spec = plain_spec(run_cfg, setup, tokenized, schedule, warmup)
        ours, plain = [], []
        for r in range(rounds):  # alternate: the machine is noisy; keep each one's best round
            flags = [x for kv in settings.items() for x in kv] + [
                "--output_dir",
                str(work / f"run-{anchors}-{r}"),
            ]
            ours.append(trainer_seconds_per_step(flags))
            plain.append(plain_seconds_per_step(spec))
        print(
            f"    {anchors:4d} anchors: trainer {min(ours) * 1e3:7.1f} ms/step, plain loop {min(plain) * 1e3:7.1f} "
            f"ms/step, trainer time / plain time {min(ours) / min(plain):.2f}"
        )
