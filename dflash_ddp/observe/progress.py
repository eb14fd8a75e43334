"""What the user sees and what is recorded: a rich live display on the drafter leader, metrics.jsonl always.

On a terminal the display is a live progress bar (step, elapsed, remaining) with the figures on the lines
below it, wrapped to the terminal's width: loss, accuracy, estimated tau, tokens/s, how long the drafter
waited for data and, in split jobs, hidden-state MiB/s and each target's queue depth; in a log file (CI,
Slurm) the same figures come as one line per logging step.

In split jobs two warnings say when the split is off balance: the drafter waiting for features more
than 10% of a logging window (add target ranks), or the target ranks blocked on full send queues more
than half of it (a target rank could train the drafter instead, or be freed). Each is printed when it
starts and when it ends, and the active ones are recorded with every metrics.jsonl line.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from dflash_ddp.checkpoint.evaluations import read_evaluations
from dflash_ddp.files import SaveError

TAU_LEGEND = (
    "tau~ is estimated on the training batches, teacher-forced: for blocks at random response positions, 1 + "
    "the number of leading block positions whose top-1 equals the data's token. Real tau (speculative "
    "decoding of held-out prompts, shown as 'real' with --eval_steps) is lower: decoding starts each block "
    "where the last one failed, so a stretch the drafter gets wrong costs a block per token and one it gets "
    "right few blocks"
)


DRAFTER_WAIT_LIMIT = 0.10  # of a logging window; above it the targets do not keep the drafter busy


TARGET_BLOCKED_LIMIT = 0.50  # of a logging window, averaged over the target ranks


# an active warning ends only below this share of its limit: a share hovering at the limit would otherwise
# warn and resolve at every other logging step
HYSTERESIS = 0.5


RESOLVED = {
    "drafter_waits": f"the drafter waits less than {100 * HYSTERESIS * DRAFTER_WAIT_LIMIT:.0f}% again",
    "targets_blocked": "the target ranks are blocked on sends less than "
    f"{100 * HYSTERESIS * TARGET_BLOCKED_LIMIT:.0f}% again",
}


def send_wait_fractions(
    now_s: dict[str, float], before_s: dict[str, float], window_s: float
) -> dict[str, float]:
    """Each target's share of the window spent blocked on sends, from its cumulative send-wait seconds at
    the end and at the start of the window; targets not seen at the start are left out (no baseline)."""
    return {
        rank: min(1.0, max(0.0, (wait - before_s[rank]) / window_s))
        for rank, wait in now_s.items()
        if rank in before_s and window_s > 0
    }


def pipeline_warnings(
    drafter_wait: float, target_blocked: dict[str, float], active: frozenset[str] = frozenset()
) -> dict[str, str]:
    """The split's imbalance in one logging window, as {condition: message}; empty when balanced.

    `drafter_wait` is the drafter ranks' mean share of the window spent waiting for features,
    `target_blocked` each target rank's share spent blocked on sends (their mean is compared); a condition
    already `active` holds until its share falls below HYSTERESIS times its limit."""
    warnings = {}

    def over(name: str, share: float, limit: float) -> bool:
        return share > limit * (HYSTERESIS if name in active else 1.0)

    if over("drafter_waits", drafter_wait, DRAFTER_WAIT_LIMIT):
        warnings["drafter_waits"] = (
            f"the drafter waited {100 * drafter_wait:.0f}% of the last logging window for target features "
            f"(over {100 * DRAFTER_WAIT_LIMIT:.0f}%): add target ranks (more processes, or fewer --drafter_ranks); "
            "--plan --calibrate predicts the best split"
        )
    if target_blocked:
        blocked = sum(target_blocked.values()) / len(target_blocked)
        if over("targets_blocked", blocked, TARGET_BLOCKED_LIMIT):
            each = ", ".join(
                f"{rank}: {100 * f:.0f}%"
                for rank, f in sorted(target_blocked.items(), key=lambda kv: int(kv[0]))
            )
            warnings["targets_blocked"] = (
                f"the target ranks were blocked on sends {100 * blocked:.0f}% of the last logging window "
                f"(over {100 * TARGET_BLOCKED_LIMIT:.0f}%; rank: {each}): the drafter is the bottleneck, so "
                + (
                    "a target rank could train the drafter instead (--drafter_ranks) or be freed"
                    if len(target_blocked) > 1
                    else "its one target rank waits for it (more drafter ranks need more processes)"
                )
            )
    return warnings


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))  # 1:02:03, and "2 days, 1:02:03" past a day


class TrainingProgress(Progress):
    """rich's progress bar with each task's `summary` field on the lines below its bar: a split job's figures
    run past 200 columns, and in one row with the bar rich cut them and the bar itself to fit."""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            if task.fields.get("summary"):
                yield Text(task.fields["summary"])


def progress_bar(console: Console) -> TrainingProgress:
    """The live display of a run: step, bar, elapsed and remaining time; the figures below."""
    return TrainingProgress(
        TextColumn("[bold]step {task.completed}/{task.total}"),
        BarColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


class TrainingMonitor:
    """Appends one JSON object per logged step to metrics.jsonl, sends it to the experiment trackers (if
    any: --report_to) and shows progress."""

    def __init__(
        self,
        output_dir: str | Path,
        total_steps: int,
        start_step: int = 0,
        trackers=None,
        quiet: bool = False,
    ):
        """`quiet`: metrics.jsonl and the trackers only, nothing shown (a benchmark printing its own table)."""
        self.path = Path(output_dir) / "metrics.jsonl"
        self.trackers = trackers  # trackers.Trackers, started before training
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.total_steps, self.start_step = total_steps, start_step
        self.console = Console(stderr=True, quiet=quiet)
        self.live = sys.stderr.isatty() and not quiet
        self.start_time = time.perf_counter()
        self._window_start = 0.0  # seconds after start_time when the current logging window began
        self._send_wait_s: dict[str, float] | None = None  # targets' cumulative send waits at its start
        self._warnings: dict[str, str] = {}  # the conditions active in the last window
        self._progress = None
        self._evaluated = 0  # records of eval.jsonl already shown
        self.print(TAU_LEGEND)
        if self.live:
            self._progress = progress_bar(self.console)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, summary="")
            self._progress.start()

    def log(self, record: dict) -> None:
        """Record a step's metrics (written at once, flushed) and refresh the display."""
        now = time.perf_counter() - self.start_time
        record = {"time": round(now, 3), "unix_time": round(time.time(), 3), **record}
        record.update(self._judge_split(record, now))
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk: the same clean stop as a failed checkpoint write
            raise SaveError(
                f"appending step {record['step']} to {self.path} failed ({e}); the checkpoints are intact; "
                "free space under --output_dir and resume"
            ) from None
        if self.trackers is not None:
            self.trackers.log(record)
        # colocated, the "wait" is the target's own forward in the same process, not a starved drafter
        waited = "drafter waited" if record.get("target_send_wait_s") else "target forward"
        summary = (
            f"loss {record['loss']:.3f}  acc {record['accuracy']:.3f}  tau~{record['tau_estimate']:.2f}  "
            f"{record.get('tokens_per_s', 0):,.0f} tok/s  {waited} {100 * record.get('wait_fraction', 0):.0f}%"
        )
        if record.get("target_inflight"):  # split jobs: the channel's view of the targets
            depth = " ".join(f"{r}:{d}" for r, d in record["target_inflight"].items())
            summary += f"  {record['hidden_state_bytes_per_s'] / 2**20:,.0f} MiB/s  target queues {depth}"
        blocked = record.get("target_send_wait_fraction")
        if blocked:
            summary += f"  targets blocked {100 * sum(blocked.values()) / len(blocked):.0f}%"
        summary += self._real_tau(record["step"])
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], summary=summary)
        else:
            self.console.print(
                f"step {record['step']}/{self.total_steps}  {summary}  {self._times(record['step'], now)}",
                highlight=False,
                soft_wrap=True,
            )

    def _times(self, step: int, now: float) -> str:
        """Elapsed and estimated remaining time for a plain log line (a terminal's bar shows its own): the
        rate of this process's steps so far, which a resumed run starts anew."""
        done = step - self.start_step
        left = now / done * (self.total_steps - step) if done > 0 else None
        return f"{_clock(now)} elapsed, " + (
            f"{_clock(left)} left" if left is not None else "time left unknown"
        )

    def _real_tau(self, step: int) -> str:
        """The newest real tau of eval.jsonl (written by the evaluation watcher) for the bar, printing a line
        for each evaluation that arrived since the last call (and sending it to the trackers at `step`)."""

        if not (self.path.parent / "eval.jsonl").is_file():
            return ""
        records, _ = read_evaluations(self.path.parent)
        for r in records[self._evaluated :]:
            if r["tau"] is not None:
                self.print(f"real tau at step {r['step']}: {r['tau']:.2f} ({r['prompts']} held-out prompts)")
            if self.trackers is not None:
                self.trackers.log_eval(step, r)
        self._evaluated = len(records)
        last = next((r for r in reversed(records) if r["tau"] is not None), None)
        return f"  real {last['tau']:.2f}@{last['step']}" if last else ""

    def _judge_split(self, record: dict, now: float) -> dict:
        """The targets' send-wait fractions and the active warnings of this window, for the record; prints a
        warning when its condition starts and a line when it ends (not at every logging step)."""
        send_wait_s = record.get("target_send_wait_s")
        if not send_wait_s:  # colocated: the drafter's "wait" is the target's own compute, not an imbalance
            return {}
        first, before = self._send_wait_s is None, self._send_wait_s or {}
        fractions = send_wait_fractions(send_wait_s, before, now - self._window_start)
        self._send_wait_s, self._window_start = dict(send_wait_s), now
        if first:  # the first window holds the start (models loading, the first batches): not judged
            return {"target_send_wait_fraction": fractions, "warnings": []}
        warnings = pipeline_warnings(record.get("wait_fraction", 0.0), fractions, frozenset(self._warnings))
        for name, message in warnings.items():
            if name not in self._warnings:
                self.print(f"warning at step {record['step']}: {message}")
        if record["step"] < self.total_steps:  # the last window is the job winding down: nothing resolved
            for name in self._warnings.keys() - warnings.keys():
                self.print(f"step {record['step']}: {RESOLVED[name]}")
        self._warnings = warnings
        rounded = {rank: round(f, 4) for rank, f in fractions.items()}
        return {"target_send_wait_fraction": rounded, "warnings": sorted(warnings)}

    def print(self, message: str) -> None:
        """A message above the live display (or a plain line)."""
        self.console.print(message, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
