"""What the user sees and what is recorded: a rich live display on the drafter leader, metrics.jsonl always.

On a terminal the display is a live progress bar with step, loss, accuracy, estimated tau, tokens/s,
how long the drafter waited for data and, in split jobs, hidden-state MiB/s and each target's queue
depth; in a log file (CI, Slurm) the same figures come as one line per
logging step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .checkpoint import SaveError


class TrainingMonitor:
    """Appends one JSON object per logged step to metrics.jsonl and shows progress."""

    def __init__(self, output_dir: str | Path, total_steps: int, start_step: int = 0):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.console = Console(stderr=True)
        self.live = sys.stderr.isatty()
        self.start_time = time.perf_counter()
        self._progress = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[summary]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, summary="")
            self._progress.start()

    def log(self, record: dict) -> None:
        """Record a step's metrics (written at once, flushed) and refresh the display."""
        record = {"time": round(time.perf_counter() - self.start_time, 3), **record}
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk: the same clean stop as a failed checkpoint write
            raise SaveError(
                f"appending step {record['step']} to {self.path} failed ({e}); the checkpoints are intact; "
                "free space under --output_dir and resume"
            ) from None
        summary = (
            f"loss {record['loss']:.3f}  acc {record['accuracy']:.3f}  tau~{record['tau_estimate']:.2f}  "
            f"{record.get('tokens_per_s', 0):,.0f} tok/s  drafter waited {100 * record.get('wait_fraction', 0):.0f}%"
        )
        if record.get("target_inflight"):  # split jobs: the channel's view of the targets
            depth = " ".join(f"{r}:{d}" for r, d in record["target_inflight"].items())
            summary += f"  {record['hidden_state_bytes_per_s'] / 2**20:,.0f} MiB/s  target queues {depth}"
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], summary=summary)
        else:
            self.console.print(
                f"step {record['step']}/{self.total_steps}  {summary}", highlight=False, soft_wrap=True
            )

    def print(self, message: str) -> None:
        """A message above the live display (or a plain line)."""
        self.console.print(message, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
