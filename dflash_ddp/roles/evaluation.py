"""The drafter leader's evaluations around training: the background watcher of --eval_steps, the final real-tau
evaluation on --eval_data, and what reaches the trackers after the last step.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from dflash_ddp.checkpoint.evaluations import best_record, read_evaluations
from dflash_ddp.checkpoint.layout import resolve_checkpoint
from dflash_ddp.config import TrainConfig
from dflash_ddp.evaluation.evaluate import evaluate, print_report
from dflash_ddp.evaluation.watch import LOG_FILE, start_in_job
from dflash_ddp.observe.trackers import Trackers


def start_watcher(cfg: TrainConfig, device: torch.device) -> subprocess.Popen:
    """--eval_steps: the evaluation watcher as a background process of the drafter leader (see watch.py)."""

    out = Path(cfg.output_dir)
    print(
        f"real tau every {cfg.eval_steps} steps: evaluated in the background (python -m dflash_ddp.evaluate "
        f"--watch {out}; log in {out / LOG_FILE}) into {out / 'eval.jsonl'} and {out / 'checkpoints' / 'best'}"
    )
    return start_in_job(out, device, out / LOG_FILE)


def finish_watcher(watcher: subprocess.Popen, stopped: bool, out: Path) -> None:
    """Wait for the watcher to evaluate the final checkpoint (a stopped run: end it now), then summarise."""

    if stopped:
        watcher.terminate()
    else:
        print("waiting for the background evaluation of the last checkpoint")
    if watcher.wait() and not stopped:
        print(
            f"the background evaluation failed (exit status {watcher.returncode}); see {out / 'eval_watch.log'}"
        )
    records, _ = read_evaluations(out)
    if records:
        taus = ", ".join(f"{r['step']}: {r['tau']:.2f}" for r in records if r["tau"] is not None)
        best = best_record(records)
        print(f"real tau per evaluated step: {taus}" + (f"; best {best['checkpoint']}" if best else ""))


def run_final_evaluation(cfg: TrainConfig, device: torch.device) -> dict:
    """Measure tau with real speculative decoding on held-out conversations, against baselines."""

    checkpoint = resolve_checkpoint(Path(cfg.output_dir))
    report = evaluate(
        target_dir=cfg.target_model,
        drafter=checkpoint,
        data_path=cfg.eval_data,
        num_prompts=cfg.eval_prompts,
        max_new_tokens=cfg.eval_max_new_tokens,
        device=str(device),
        chat_template=cfg.chat_template,
        template_kwargs=cfg.chat_template_kwargs,
    )
    print_report(report)
    (Path(cfg.output_dir) / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def close_trackers(trackers: Trackers, out: Path, report: dict | None) -> None:
    """Send what arrived after the last logged step (the background evaluation of the final checkpoint, the
    final evaluation's report as final_eval/...) at that step, then close the trackers."""

    for record in read_evaluations(out)[0]:
        if record["step"] not in trackers.evaluated:
            trackers.log_eval(trackers.last_step, record)
    if report:
        trackers.log(report, step=trackers.last_step, prefix="final_eval/")
    trackers.finish()
