"""(l) Warm start, `python -m dflash_ddp.bench --only warm_start`: what `--init_from` buys a team adapting a
drafter to its own traffic. One target (the embedded tiny target), two domains: A, the embedded docstring
conversations the default drafter trains on, and B, questions about manual-page commands (sections 1 and 8 of
this machine's manual), answered by the same target. Per seed:

- source:    the embedded default on A (150 steps), not trained on B;
- fine-tune: `--init_from` the source, N steps on B;
- scratch N and scratch 4N: random weights, N and 4N steps on B;

each with the embedded default's recipe, measured by real tau (the project's speculative decoding, every output
checked against greedy) on B's held-out prompts and on A's (what adapting costs on the first domain). Each run
is the real CLI, one process and one thread; finished runs are kept under OUT/results/, so a stopped
benchmark resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_ddp.checkpoint.layout import resolve_checkpoint
from dflash_ddp.config import EMBEDDED_PRESET
from dflash_ddp.files import atomic_write_text

QUICK = {"source_steps": 4, "steps": 2, "eval_prompts": 2, "eval_max_new_tokens": 8, "seeds": 1, "rows": 40}
FULL = {
    "source_steps": 150,
    "steps": 30,
    "eval_prompts": 20,
    "eval_max_new_tokens": 96,
    "seeds": 3,
    "rows": 0,
}
HELDOUT_B = 100  # domain B's held-out prompts
ARMS = ("source", "fine-tune", "scratch N", "scratch 4N")
ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", *cmd], env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}")
    return done


def domain_b(out: Path, budget: dict) -> tuple[Path, Path]:
    """Domain B's training and held-out conversations, answered by the embedded target (built once)."""
    from dflash_ddp.tools.tiny_corpus import build_conversations, collect_manpage_entries, split_rows

    root = out / "domain_b"
    train, heldout = root / "manpage_qa_regenerated.jsonl", root / "heldout_regenerated.jsonl"
    if train.is_file() and heldout.is_file():
        return train, heldout
    root.mkdir(parents=True, exist_ok=True)
    rows = build_conversations(collect_manpage_entries(), seed=0, system_frac=0.0)
    if not rows:
        raise RuntimeError("no manual pages under /usr/share/man: domain B is made from them")
    train_rows, heldout_rows = split_rows(rows, HELDOUT_B, seed=0)
    train_rows = train_rows[: budget["rows"]] if budget["rows"] else train_rows
    for name, part, done in (("prompts", train_rows, train), ("heldout_prompts", heldout_rows, heldout)):
        prompts = root / f"{name}.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"domain B: {len(part)} {name} answered by the embedded target", flush=True)
        cmd = [
            "dflash_ddp.regenerate",
            "--target_model",
            EMBEDDED_PRESET["target_model"],
            "--data",
            str(prompts),
        ]
        run(
            [*cmd, "--out", str(done), "--max_new_tokens", "160", "--batch_size", "16"],
            f"regenerating {name}",
        )
    return train, heldout


def arm_steps(arm: str, budget: dict) -> int:
    """Optimizer steps of `arm`: the source's on A, the others' on B."""
    return {"source": budget["source_steps"], "scratch 4N": 4 * budget["steps"]}.get(arm, budget["steps"])


def arm_flags(arm: str, seed: int, out: Path, data_b: Path, budget: dict) -> tuple[list[str], Path]:
    """The training command of `arm` for `seed` and where it writes."""
    run_dir = out / "runs" / arm.replace(" ", "_") / f"seed{seed}"
    steps = arm_steps(arm, budget)
    flags = ["--seed", str(seed), "--max_steps", str(steps), "--save_steps", str(steps), "--eval_data", ""]
    flags += ["--resume", "never", "--output_dir", str(run_dir)]
    if arm != "source":
        flags += ["--target_model", "embedded", "--data", str(data_b)]
    if arm == "fine-tune":
        flags += ["--init_from", str(out / "runs" / "source" / f"seed{seed}")]
    return flags, run_dir


def tau_on(run_dir: Path, data: str | Path, budget: dict, name: str) -> dict:
    """Real tau of the run's last checkpoint on `data`'s held-out prompts."""
    report = run_dir / f"eval_{name}.json"
    if not report.is_file():
        drafter = resolve_checkpoint(run_dir)
        cmd = [
            "dflash_ddp.evaluate",
            "--target_model",
            EMBEDDED_PRESET["target_model"],
            "--drafter",
            str(drafter),
        ]
        cmd += ["--data", str(data), "--num_prompts", str(budget["eval_prompts"])]
        run(
            [*cmd, "--max_new_tokens", str(budget["eval_max_new_tokens"]), "--json", str(report)],
            f"{run_dir}",
        )
    found = json.loads(report.read_text())
    return {"tau": found["dflash"]["tau"], "lossless": found["lossless"]}


def run_arm(out: Path, arm: str, seed: int, data: tuple[Path, Path], budget: dict) -> dict:
    """Train and evaluate one (arm, seed) on both domains, or read its kept result."""
    result_file = out / "results" / arm.replace(" ", "_") / f"seed{seed}.json"
    if result_file.is_file():
        return json.loads(result_file.read_text())
    flags, run_dir = arm_flags(arm, seed, out, data[0], budget)
    if not (run_dir / "checkpoints" / "latest").is_file():
        start = time.perf_counter()
        run(["dflash_ddp.train", *flags], f"{arm}/seed{seed}")
        print(f"  trained {arm}/seed{seed} in {time.perf_counter() - start:.0f} s", flush=True)
    b, a = tau_on(run_dir, data[1], budget, "b"), tau_on(run_dir, EMBEDDED_PRESET["eval_data"], budget, "a")
    result = {
        "arm": arm,
        "seed": seed,
        "tau_b": b["tau"],
        "tau_a": a["tau"],
        "lossless": b["lossless"] and a["lossless"],
    }
    result_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(result_file, json.dumps(result, indent=1) + "\n")
    print(f"  {arm}/seed{seed}: tau on B {result['tau_b']:.3f}, on A {result['tau_a']:.3f}", flush=True)
    return result


def summarise(results: list[dict], budget: dict) -> list[str]:
    """Per arm: steps on B, mean (min-max) real tau on each domain over seeds, and lossless runs."""
    lines = [
        "| arm | steps on B | tau on B, mean (min-max) | tau on A, mean (min-max) | per seed (B / A) | lossless |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for arm in ARMS:
        runs = sorted((r for r in results if r["arm"] == arm), key=lambda r: r["seed"])
        if not runs:
            continue
        cells = []
        for key in ("tau_b", "tau_a"):
            taus = [r[key] for r in runs]
            cells.append(f"{statistics.mean(taus):.3f} ({min(taus):.3f}-{max(taus):.3f})")
        per_seed = " ".join(f"{r['tau_b']:.2f}/{r['tau_a']:.2f}" for r in runs)
        lossless = f"{sum(r['lossless'] for r in runs)}/{len(runs)}"
        on_b = 0 if arm == "source" else arm_steps(arm, budget)
        lines.append(f"| {arm} | {on_b} | {cells[0]} | {cells[1]} | {per_seed} | {lossless} |")
    return lines


def bench_warm_start(out: Path, quick: bool, jobs: int) -> list[str]:
    """Run (or resume) every (arm, seed) and print the table; returns its lines."""
    budget = QUICK if quick else FULL
    out = out / ("quick" if quick else "full")
    print(f"(l) warm-start benchmark in {out}: {budget}", flush=True)
    data = domain_b(out, budget)
    seeds = range(budget["seeds"])
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # the sources first: the fine-tunes start from them
        results = list(pool.map(lambda seed: run_arm(out, "source", seed, data, budget), seeds))
        work = [(arm, seed) for seed in seeds for arm in ARMS[1:]]
        results += list(pool.map(lambda w: run_arm(out, *w, data, budget), work))
    lines = summarise(results, budget)
    print("\n".join(lines))
    atomic_write_text(out / "table.md", "\n".join(lines) + "\n")
    return lines
