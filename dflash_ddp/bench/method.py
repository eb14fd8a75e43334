"""(g) The method benchmark, `python -m dflash_ddp.bench --method`: each objective variant trained at equal
budget (same steps, sequences, anchors and seeds) on two targets, measured by real tau: the project's own
speculative decoding of held-out prompts, every output checked against the target's greedy output.

Targets: the embedded tiny target on its docstring data, and a second one built on this machine by the
tiny-target tool from other text (sections 1 and 8 of the manual pages), with another tokenizer size.
Each run is the real CLI (`python -m dflash_ddp.train`, one process, one thread, so it trains the weights a
split job would); each finished (target, variant, seed) is kept under OUT/results/, so a stopped benchmark
resumes where it stopped. A variant beats the baseline only when its worst seed beats the baseline's best.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from dflash_ddp.config import EMBEDDED_PRESET
from dflash_ddp.files import atomic_write_text

BASELINE = "decay"
# name -> flags on top of the target's settings (every variant names its whole objective, so that a change
# of the defaults does not change what a name measures); the names are what the docs' table shows
ADAMW = {"optimizer": "adamw"}
# Muon with torch's five Newton-Schulz iterations (the default orthogonalisation), named so that the variants
# keep their meaning should the default change
MUON_NS5 = {"optimizer": "muon", "muon_orthogonalisation": "newton_schulz_5"}
# today's default objective and optimizer (the variant dpace-muon-lr8e-3)
DEFAULT_OBJECTIVE = {"position_weighting": "dpace", **MUON_NS5, "learning_rate": 8e-3}
POLAR_EXPRESS_3 = {"muon_orthogonalisation": "polar_express_3"}
# not a flag: the share of the budget's steps a variant trains, for variants compared at equal wall time
STEP_SHARE = "step_share"
# LiLiCorr's correlator in the recipe's proportions: Model-Optimizer's is 1024 wide with factors of 1024 on
# Qwen3-8B's 4096, so a quarter of the tiny drafters' 256 (at their full width the lattice's 8 candidates per
# slot made a step about 10x DFlash's here; at a quarter it is about 2x)
LILICORR = {"drafter": "lilicorr", "target_topk": 64, "lilicorr_hidden_size": 64, "lilicorr_factor_dim": 64}
VARIANTS = {
    "decay": {
        "position_weighting": "decay",
        **ADAMW,
    },  # the paper's exp(-(k-1)/gamma), gamma 4 for blocks of 8
    "decay-gamma2": {"position_weighting": "decay", "loss_gamma": 2.0, **ADAMW},
    # the decay's schedule: gamma from 1 at the first step to 3 at the last (decay-gamma2's mean gamma)
    "decay-gamma1to3": {"position_weighting": "decay", "loss_gamma_start": 1.0, "loss_gamma": 3.0, **ADAMW},
    "dpace": {"position_weighting": "dpace", **ADAMW},
    "dpace-prompt-end": {
        "position_weighting": "dpace",
        "anchor_rule": "prompt_end",
        **ADAMW,
    },  # the older rule
    "dpace-muon": {"position_weighting": "dpace", **MUON_NS5},  # the same learning rate (RMS-matched)
    # Muon's learning rate and warm-up: twice and four times the peak rate; a fifth of the steps warming up
    "dpace-muon-lr4e-3": {"position_weighting": "dpace", **MUON_NS5, "learning_rate": 4e-3},
    "dpace-muon-lr8e-3": DEFAULT_OBJECTIVE,
    "dpace-muon-pe3-lr8e-3": {**DEFAULT_OBJECTIVE, **POLAR_EXPRESS_3},  # three Polar Express steps
    "dpace-muon-warmup0.2": {"position_weighting": "dpace", **MUON_NS5, "warmup_ratio": 0.2},
    # Spec-AUF on top of the default (D-PACE's weights replaced by the support up to the first failure)
    "auf-muon": {"position_weighting": "auf", **MUON_NS5},
    # soft targets: the target's top 8 next tokens, by KL, and by TV with a tenth of the token's CE (DSpark's)
    "dpace-kl": {"position_weighting": "dpace", "loss": "kl", "target_topk": 8, **ADAMW},
    "dpace-tv": {"position_weighting": "dpace", "loss": "tv", "target_topk": 8, "ce_weight": 0.1, **ADAMW},
    # twice the anchors at equal wall time: a step with 32 anchors took 1.71x one with 16 here (12 steps of
    # the embedded default, one thread, 53 s vs 31 s), so the variant gets 150 / 1.71 = 88 of the 150 steps
    "dpace-anchors32": {"position_weighting": "dpace", "num_anchors": 32, **ADAMW, STEP_SHARE: 1 / 1.71},
    # one sequence per step (512 tokens) at equal wall time, where Muon's orthogonalisation costs most: a
    # step of the defaults took 1.44x the paper's recipe's here (60 steps of each side by side, one thread,
    # 15.4 s vs 10.7 s to step 50), so the defaults get 600 steps and the paper's recipe 864
    "decay-one-seq": {"position_weighting": "decay", **ADAMW, "tokens_per_batch": 512, STEP_SHARE: 5.76},
    "dpace-muon-lr8e-3-one-seq": {**DEFAULT_OBJECTIVE, "tokens_per_batch": 512, STEP_SHARE: 4.0},
    # DFlash2 on today's default objective, and its two pieces apart: the convolutions alone (the selector's
    # loss off, so it stays a no-op that drafts the LM head's best token) and the selector with one-tap
    # convolutions (a per-token gate, no look-back inside the block)
    "dflash2": {**DEFAULT_OBJECTIVE, "drafter": "dflash2"},
    "dflash2-convs-only": {**DEFAULT_OBJECTIVE, "drafter": "dflash2", "selector_loss_alpha": 0.0},
    "dflash2-selector-only": {**DEFAULT_OBJECTIVE, "drafter": "dflash2", "conv_kernel_size": 1},
    "dflash2-pe3": {**DEFAULT_OBJECTIVE, **POLAR_EXPRESS_3, "drafter": "dflash2"},
    # DSpark on today's default objective: its own loss (the reference's 0.1 CE + 0.9 L1 against the
    # target's top 64 + 1.0 confidence BCE) with D-PACE's position weights, rank-256 Markov head
    "dspark": {**DEFAULT_OBJECTIVE, "drafter": "dspark", "target_topk": 64},
    "dspark-gated": {
        **DEFAULT_OBJECTIVE,
        "drafter": "dspark",
        "target_topk": 64,
        "markov_head_type": "gated",
    },
    "dspark-rnn": {**DEFAULT_OBJECTIVE, "drafter": "dspark", "target_topk": 64, "markov_head_type": "rnn"},
    # LiLiCorr with Model-Optimizer's objective, its correlator scaled as LILICORR says
    "lilicorr": {**DEFAULT_OBJECTIVE, **LILICORR},
    "lilicorr-conv": {**DEFAULT_OBJECTIVE, **LILICORR, "lilicorr_conv": True},
}
# The embedded default's shape and batches (the README's run) for both targets, at the learning rate every
# variant was first measured with (a variant that changes it names the change).
TRAINING = {
    **{
        key: EMBEDDED_PRESET[key]
        for key in ("num_draft_layers", "block_size", "num_anchors", "max_seq_len", "tokens_per_batch")
    },
    "learning_rate": 2e-3,
}
MANPAGES = ["--corpus", "manpages", "--vocab_size", "1024", "--system_frac", "0", "--threads", "1"]
FULL = {
    "max_steps": EMBEDDED_PRESET["max_steps"], "eval_prompts": 20, "eval_max_new_tokens": 96, "seeds": 3,
    "target": [*MANPAGES, "--n_heldout", "100", "--train_steps", "0", "--train_minutes", "8"],
}  # fmt: skip
QUICK = {
    "max_steps": 4, "eval_prompts": 2, "eval_max_new_tokens": 8, "seeds": 1,
    "target": [*MANPAGES, "--n_heldout", "10", "--max_conversations", "80", "--train_steps", "3",
               "--max_new_tokens", "48", "--min_answer_tokens", "8"],
}  # fmt: skip


def embedded_target(out: Path, budget: dict) -> dict:
    return {"target_model": EMBEDDED_PRESET["target_model"], "data": EMBEDDED_PRESET["data"][0],
            "eval_data": EMBEDDED_PRESET["eval_data"]}  # fmt: skip


def manpage_target(out: Path, budget: dict) -> dict:
    """The second target, built by the tiny-target tool into OUT/targets/manpages on first use (about 12 min
    on 2 cores: 8 of training, the rest regenerating its data; seconds for --quick)."""
    root = out / "targets" / "manpages"
    data = root / "data"
    if not (data / "heldout_regenerated.jsonl").is_file():
        print(
            f"building the second target in {root} (python -m dflash_ddp.tools.make_tiny_target)", flush=True
        )
        cmd = [
            sys.executable,
            "-m",
            "dflash_ddp.tools.make_tiny_target",
            "--out_dir",
            str(root),
            *budget["target"],
        ]
        subprocess.run(cmd, check=True)
    return {"target_model": str(root / "tiny_qwen3"), "data": str(data / "manpage_qa_regenerated.jsonl"),
            "eval_data": str(data / "heldout_regenerated.jsonl")}  # fmt: skip


TARGETS = {"embedded": embedded_target, "manpages": manpage_target}


def run_one(out: Path, target: str, paths: dict, variant: str, seed: int, budget: dict) -> dict:
    """Train and evaluate one (target, variant, seed), or read its kept result."""
    result_file = out / "results" / target / variant / f"seed{seed}.json"
    if result_file.is_file():
        return json.loads(result_file.read_text())
    run_dir = out / "runs" / target / variant / f"seed{seed}"
    flags_of_variant = {k: v for k, v in VARIANTS[variant].items() if k != STEP_SHARE}
    steps = max(1, round(budget["max_steps"] * VARIANTS[variant].get(STEP_SHARE, 1.0)))
    settings = {**paths, **TRAINING, **flags_of_variant, "seed": seed, "output_dir": run_dir,
                "max_steps": steps, "save_steps": steps, "resume": "never",
                "eval_prompts": budget["eval_prompts"], "eval_max_new_tokens": budget["eval_max_new_tokens"]}  # fmt: skip
    if run_dir.exists():  # a run the benchmark's stop interrupted: start it again
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    flags = [x for k, v in settings.items() for x in (f"--{k}", str(v))]
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "dflash_ddp.train", *flags], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{target}/{variant}/seed{seed} failed:\n{done.stderr[-3000:]}")
    report = json.loads((run_dir / "eval.json").read_text())
    trained = re.search(r"training took (\d+) s", done.stdout)
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    drafter = json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())["drafter"]
    feature_bytes = 2 * len(drafter["dflash_config"]["target_layer_ids"]) * drafter["hidden_size"]  # bf16
    result = {
        "target": target,
        "variant": variant,
        "seed": seed,
        "tau": report["dflash"]["tau"],
        # by block position: verify steps that committed k tokens; the confidence head's calibration (DSpark)
        "accept_histogram": report["dflash"]["accept_histogram"],
        "confidence_calibration": report["dflash"].get("confidence_calibration"),
        "lossless": report["lossless"],
        "prompts": report["num_prompts"],
        "train_s": int(trained.group(1)) if trained else None,
        "steps": steps,
        "s_per_step": int(trained.group(1)) / steps if trained else None,
        "wall_s": round(wall, 1),
        "channel_bytes_per_token": feature_bytes + 6 * settings.get("target_topk", 0),
        "budget": {k: budget[k] for k in ("max_steps", "eval_prompts", "eval_max_new_tokens")},
    }
    result_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(result_file, json.dumps(result, indent=1) + "\n")
    print(f"  {target}/{variant}/seed{seed}: tau {result['tau']:.3f} ({wall:.0f} s)", flush=True)
    return result


def summarise(results: list[dict], targets: list[str]) -> list[str]:
    """The table: per target and variant, mean and spread of real tau over seeds, cost, and the verdict."""
    lines = [
        "| target | variant | real tau, mean (min-max) | per seed | lossless | steps | s/step | channel B/token "
        "| vs decay |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for target in targets:
        by_variant = {
            v: sorted(
                (r for r in results if r["target"] == target and r["variant"] == v), key=lambda r: r["seed"]
            )
            for v in VARIANTS
        }
        base = [r["tau"] for r in by_variant[BASELINE]]
        for variant, runs in by_variant.items():
            if not runs:
                continue
            taus = [r["tau"] for r in runs]
            mean = statistics.mean(taus)
            verdict = "-"
            if variant != BASELINE and base:
                change = f"{100 * (mean / statistics.mean(base) - 1):+.1f}%"
                if min(taus) > max(base):
                    verdict = f"{change}, wins (worst seed above decay's best)"
                elif max(taus) < min(base):
                    verdict = f"{change}, loses"
                else:
                    verdict = f"{change}, within the spread"
            steps = [r["s_per_step"] for r in runs if r["s_per_step"]]
            channel = runs[0].get("channel_bytes_per_token", "-")
            trained = runs[0].get("steps", runs[0].get("budget", {}).get("max_steps", "-"))
            lines.append(
                f"| {target} | {variant} | {mean:.3f} ({min(taus):.3f}-{max(taus):.3f}) | "
                f"{' '.join(f'{t:.3f}' for t in taus)} | {sum(r['lossless'] for r in runs)}/{len(runs)} | "
                f"{trained} | {statistics.mean(steps):.2f} | {channel} | {verdict} |"
                if steps
                else f"| {target} | {variant} | {mean:.3f} | - | - | {trained} | - | {channel} | {verdict} |"
            )
    return lines


def kept_results(out: Path, targets: list[str]) -> list[dict]:
    """Every finished (target, variant, seed) result under OUT/results, whichever run of the benchmark made it."""
    files = sorted(p for t in targets for p in (out / "results" / t).glob("*/seed*.json"))
    return [r for r in (json.loads(p.read_text()) for p in files) if r["variant"] in VARIANTS]


def bench_method(out: Path, quick: bool, jobs: int, targets: list[str], variants: list[str]) -> list[str]:
    """Run (or resume) every (target, variant, seed) of `variants` and print the table of every result kept
    (also those of variants an earlier run measured); returns its lines."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants {','.join(unknown)}: choose among {', '.join(VARIANTS)}")
    budget = QUICK if quick else FULL
    out = out / ("quick" if quick else "full")
    print(f"(g) method benchmark in {out}: {budget}, variants {', '.join(variants)}", flush=True)
    # seed by seed, so that a benchmark stopped early holds whole seeds of every variant on every target
    work = [(t, v, s) for s in range(budget["seeds"]) for t in targets for v in variants]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        # submitted before any run, so no run's worker waits on a build still queued; --quick builds beside the
        # first runs, the full build alone (it trains for a fixed time: a neighbour would change the target)
        builds = {target: pool.submit(TARGETS[target], out, budget) for target in targets}
        if not quick:
            wait(builds.values())
        list(pool.map(lambda w: run_one(out, w[0], builds[w[0]].result(), *w[1:], budget), work))
    lines = summarise(kept_results(out, targets), targets)
    print("\n".join(lines))
    atomic_write_text(out / "table.md", "\n".join(lines) + "\n")
    return lines
