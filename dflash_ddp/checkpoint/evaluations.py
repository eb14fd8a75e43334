"""The records of real tau a run keeps beside its checkpoints: RUN_DIR/eval.jsonl (one line per evaluated
checkpoint), read by the progress display, the plots, the trackers and the export's model card, and
pruned when a run resumes before an evaluated step.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_ddp.checkpoint.layout import write_best
from dflash_ddp.files import atomic_write_text

EVAL_FILE = "eval.jsonl"


def read_evaluations(run_dir: Path) -> tuple[list[dict], int]:
    """The records of RUN_DIR/eval.jsonl, and how many lines did not parse (a killed append)."""
    path = Path(run_dir) / EVAL_FILE
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return [], 0
    records, bad = [], 0
    for line in lines:
        try:
            record = json.loads(line)
            if isinstance(record, dict) and isinstance(record.get("step"), int) and "tau" in record:
                records.append(record)
                continue
        except ValueError:
            pass
        bad += line.strip() != ""
    return records, bad


def best_record(records: list[dict]) -> dict | None:
    """The lossless evaluation with the highest tau (the earliest among equals)."""
    eligible = [r for r in records if r.get("lossless") and r.get("tau") is not None]
    return max(eligible, key=lambda r: (r["tau"], -r["step"]), default=None)


def prune_evaluations(output_dir: str | Path, start_step: int) -> list[str]:
    """On a resume at `start_step`: drop eval.jsonl lines past it (a resume from an earlier checkpoint
    trains a new future; its checkpoints must be evaluated afresh) and unreadable lines, and point `best`
    at the best remaining evaluation whose checkpoint exists. Returns lines to print."""
    run_dir = Path(output_dir)
    records, bad = read_evaluations(run_dir)
    kept = [r for r in records if r["step"] <= start_step]
    if len(kept) == len(records) and not bad:
        return []
    atomic_write_text(run_dir / EVAL_FILE, "".join(json.dumps(r) + "\n" for r in kept))
    root = run_dir / "checkpoints"
    if root.is_dir():
        best = best_record([r for r in kept if (root / r.get("checkpoint", "")).is_dir()])
        write_best(root, best["checkpoint"] if best else None)
    return [f"{run_dir / EVAL_FILE}: dropped {len(records) - len(kept) + bad} line(s) past step {start_step}"]
