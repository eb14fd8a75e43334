"""The drafter leader's evaluations around training: the background watcher of --eval_steps and the final
real-tau evaluation on --eval_data.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Protocol

import torch

from dflash_ddp.checkpoint.evaluations import best_record, read_evaluations
from dflash_ddp.checkpoint.layout import resolve_checkpoint
from dflash_ddp.checkpoint.reader import read_json
from dflash_ddp.evaluation.evaluate import evaluate, load_prompts
from dflash_ddp.evaluation.report import print_report
from dflash_ddp.evaluation.watch import LOG_FILE, start_in_job

FINAL_FILE = "eval.json"  # the final evaluation's report


class EvaluationSettings(Protocol):
    """What these evaluations read of the run's settings (TrainConfig has them all)."""

    output_dir: str
    target_model: str
    eval_data: str
    eval_prompts: int
    eval_max_new_tokens: int
    eval_steps: int
    chat_template: str
    chat_template_kwargs: dict


def start_watcher(cfg: EvaluationSettings, device: torch.device) -> subprocess.Popen:
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


def check_eval_prompts(cfg: EvaluationSettings, tokenizer) -> None:
    """Read and render --eval_data's prompts at start, as the evaluations after training will: a file they
    would refuse stops the run before it trains, not after (ValueError naming the file and row)."""
    try:
        load_prompts(tokenizer, cfg.eval_data, cfg.eval_prompts, cfg.chat_template_kwargs)
    except ValueError as e:
        raise ValueError(f"--eval_data {cfg.eval_data}: {e}") from None


def final_evaluation_or_error(cfg: EvaluationSettings, device: torch.device) -> tuple[dict | None, str]:
    """`run_final_evaluation`'s report and "", or None and the line that says why it stopped (bad input or a
    failed read: the trained checkpoints stay, and the command that evaluates them later)."""
    try:
        return run_final_evaluation(cfg, device), ""
    except KeyboardInterrupt:
        return None, (
            "the final evaluation was interrupted; training finished and its checkpoints are kept: the same "
            "command evaluates the last one"
        )
    except (ValueError, OSError) as e:
        checkpoint = resolve_checkpoint(Path(cfg.output_dir))
        return None, (
            f"the final evaluation stopped: {e}. Training finished and its checkpoints are kept; evaluate the "
            f"last with `python -m dflash_ddp.evaluate --target_model {cfg.target_model} --drafter {checkpoint} "
            "--data FILE`"
        )


def run_final_evaluation(cfg: EvaluationSettings, device: torch.device) -> dict:
    """Measure tau with real speculative decoding on held-out conversations, against baselines."""

    checkpoint = resolve_checkpoint(Path(cfg.output_dir))
    step = int(read_json(checkpoint, "trainer_state.json")["global_step"])
    print(
        f"evaluating {checkpoint} on {cfg.eval_prompts} prompts of {cfg.eval_data} (real speculative decoding)"
    )
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
    # with its step: a resume that trains on (from a --max_steps 0 run's step 0, say) may leave it behind
    (Path(cfg.output_dir) / FINAL_FILE).write_text(json.dumps({"step": step, **report}, indent=2) + "\n")
    return report


def evaluated_at(out: Path, step: int) -> bool:
    """Whether the run's final evaluation (eval.json) measured its checkpoint of `step` (a file from before
    eval.json named its step is taken as the last checkpoint's, as it was written)."""
    try:
        return json.loads((out / FINAL_FILE).read_text()).get("step", step) == step
    except (OSError, ValueError, AttributeError):
        return False
