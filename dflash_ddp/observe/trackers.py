"""Experiment trackers: `--report_to` TensorBoard, Weights & Biases and MLflow, as Hugging Face's Trainer
names them, through accelerate's tracker classes (no client of our own).

Only the drafter leader reports (it alone sees the job's metrics), so accelerate's own "main process" gate,
which would pick global rank 0 (a target rank in a split job), is turned off per tracker. accelerate's
tracking module logs through an adapter that refuses to run before accelerate's process state
(PartialState) exists, and creating that state would join or start a process group and pick a device
of its own; this job sets up its own process groups (parallel/topology.py), so that module is given a plain logger. Every tracker is started before training, so that a missing package or an
unwritable directory stops the job at start with one line naming the extra to install. A tracker that
fails later is reported once and dropped: metrics.jsonl stays the record of the run.

Where each one writes, unless its own environment variables say otherwise:
- tensorboard: OUTPUT_DIR/tensorboard/RUN_NAME (a resumed run purges the steps after its checkpoint);
- wandb: OUTPUT_DIR/wandb, offline (no network) unless WANDB_MODE is set; project WANDB_PROJECT or
  dflash_ddp; `wandb sync OUTPUT_DIR/wandb/offline-run-*` uploads it later;
- mlflow: MLFLOW_TRACKING_URI, else sqlite:///OUTPUT_DIR/mlflow.db; experiment MLFLOW_EXPERIMENT_NAME or
  dflash_ddp.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

from dflash_ddp.checkpoint.evaluations import read_evaluations

TRACKERS = ("tensorboard", "wandb", "mlflow")  # each one is also the name of its pyproject extra


REPORT_TO_CHOICES = ("none", "all", *TRACKERS)


# Per-position accuracy is shown as one group, accuracy_per_position/pos_1 ... pos_{block_size - 1} (a group
# name must not also be a scalar's: MLflow's file store keeps a metric "a" as a file and "a/b" under a folder "a").
GROUPS = {"accuracy_per_position": "accuracy_per_position/pos_"}


def install_hint(name: str) -> str:
    return f'pip install -e ".[{name}]" (or pip install {name})'


def resolve_report_to(report_to: list[str]) -> list[str]:
    """--report_to as Hugging Face reads it: `none` (the default), `all` (every installed tracker), or names;
    the trackers to start. Unknown names and missing packages are ValueErrors naming the extra to install."""
    names = [n.strip().lower() for n in report_to if n.strip()] or ["none"]
    unknown = [n for n in names if n not in REPORT_TO_CHOICES]
    if unknown:
        raise ValueError(
            f"--report_to {','.join(unknown)}: choose none, all, or any of {', '.join(TRACKERS)}"
        )
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"--report_to {','.join(names)}: none cannot be combined with a tracker")
        return []
    if "all" in names:
        found = [n for n in TRACKERS if _installed(n)]
        if not found:
            raise ValueError(
                "--report_to all: no tracker package is installed; "
                + "; ".join(f"{n}: {install_hint(n)}" for n in TRACKERS)
            )
        return found
    missing = [n for n in dict.fromkeys(names) if not _installed(n)]
    if missing:
        raise ValueError(
            "; ".join(
                f"--report_to {n}: the {n} package is not installed: {install_hint(n)}" for n in missing
            )
        )
    return list(dict.fromkeys(names))


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """A metrics record as flat numbers: nested dicts as `key/sub`, per-position lists as a group
    (`accuracy_per_position/pos_1`...), other lists as `key/1`..., booleans as 0/1; strings (warning names)
    are left out."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            flat[name] = float(value)
        elif isinstance(value, (int, float)):
            flat[name] = value
        elif isinstance(value, dict):
            flat.update(scalars(value, f"{name}/"))
        elif isinstance(value, (list, tuple)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            group = f"{prefix}{GROUPS[key]}" if key in GROUPS else f"{name}/"
            flat.update({f"{group}{i + 1}": v for i, v in enumerate(value)})
    return flat


def hyperparameters(config: dict) -> dict:
    """The config as the trackers' hyperparameters: numbers, strings, booleans and None as they are, lists
    and dicts as JSON text (TensorBoard and MLflow take scalars only)."""
    return {
        key: value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value)
        for key, value in config.items()
    }


class _PlainLog(logging.LoggerAdapter):
    """accelerate.tracking's logger without its need for accelerate's process state (see the module docstring)."""

    def warning_once(self, *args, **kwargs) -> None:
        self.warning(*args, **kwargs)


def _build(name: str, run_name: str, output_dir: Path, start_step: int):
    """accelerate's tracker object for `name`, not started yet."""
    from accelerate import tracking
    from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker

    tracking.logger = _PlainLog(logging.getLogger(tracking.__name__), {})

    if name == "tensorboard":
        # purge_step: TensorBoard hides the events a killed run logged after the checkpoint it resumes from
        extra = {"purge_step": start_step + 1} if start_step else {}
        tracker = TensorBoardTracker(run_name, output_dir / "tensorboard", **extra)
    elif name == "wandb":
        # accelerate passes its first argument as wandb's project; the run's name is Hugging Face's run_name
        settings = {"name": run_name, "dir": str(output_dir)}
        if "WANDB_MODE" not in os.environ:
            settings["mode"] = "offline"
        tracker = WandBTracker(os.environ.get("WANDB_PROJECT", "dflash_ddp"), **settings)
    else:
        if "MLFLOW_TRACKING_URI" not in os.environ:
            import mlflow

            mlflow.set_tracking_uri(f"sqlite:///{(output_dir / 'mlflow.db').resolve()}")
        tracker = MLflowTracker(experiment_name="dflash_ddp", run_name=run_name)
    tracker.main_process_only = False  # we chose the process: the drafter leader (see the module docstring)
    return tracker


class Trackers:
    """The started trackers of one process; `log` takes a metrics.jsonl record, `log_eval` evaluation results."""

    def __init__(self, started: dict):
        self._started = started  # name -> accelerate tracker
        self.last_step = 0  # the highest step logged so far
        self.evaluated: set[int] = set()  # checkpoint steps whose evaluation was logged

    @property
    def names(self) -> list[str]:
        return list(self._started)

    @classmethod
    def start(
        cls,
        names: list[str],
        run_name: str,
        output_dir: str | Path,
        config: dict | None = None,
        start_step: int = 0,
    ) -> Trackers:
        """Start each named tracker and store `config` once as its hyperparameters; any failure is a
        ValueError naming the tracker, what failed and the extra to install (the trackers already started
        are closed)."""
        out = Path(output_dir)
        started: dict = {}
        for name in names:
            try:
                out.mkdir(parents=True, exist_ok=True)
                tracker = _build(name, run_name or out.resolve().name, out, start_step)
                tracker.start()
                started[name] = tracker
                if config is not None:
                    tracker.store_init_configuration(hyperparameters(config))
            except Exception as e:  # ImportError, OSError, the tracker's own errors: all refuse the start
                Trackers(started).finish()
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ValueError(
                    f"--report_to {name}: the tracker did not start ({type(e).__name__}: {first}); "
                    f"check that {out} is writable and the package works: {install_hint(name)}"
                ) from None
        return cls(started)

    def log(self, record: dict, step: int | None = None, prefix: str = "") -> None:
        """Send a record's numbers (see `scalars`) at `step` (default: the record's own "step")."""
        step = int(record["step"] if step is None else step)
        self.last_step = max(self.last_step, step)
        # the wall clock is the trackers' own (a float32 chart would round it to minutes)
        values = scalars({k: v for k, v in record.items() if k not in ("step", "unix_time")}, prefix)
        for name, tracker in list(self._started.items()):
            try:
                tracker.log(values, step=step)
            except Exception as e:  # a tracker failing mid-run must not stop training
                print(
                    f"warning: --report_to {name} failed at step {step} ({type(e).__name__}: {e}); "
                    "it is dropped for the rest of the run (metrics.jsonl has every step)",
                    file=sys.stderr,
                    flush=True,
                )
                del self._started[name]

    def log_eval(self, step: int, results: dict) -> None:
        """Evaluation results (tau, acceptance histogram, lossless...) as `eval/...` at training step `step`.

        An evaluation of a checkpoint arrives some steps after it was saved; wandb drops values logged at a
        step lower than one it already has, so pass the step training is at when the results arrive. The
        evaluated checkpoint's step (`results["step"]`, as in eval.jsonl) is logged as eval/checkpoint_step."""
        values = {("checkpoint_step" if k == "step" else k): v for k, v in results.items()}
        self.log(values, step=step, prefix="eval/")
        if "step" in results:
            self.evaluated.add(int(results["step"]))

    def finish(self) -> None:
        for tracker in self._started.values():
            try:
                tracker.finish()
            except Exception as e:  # closing must not hide the run's own outcome
                print(f"warning: closing the {tracker.name} tracker failed: {e}", file=sys.stderr)
        self._started = {}


def close_trackers(trackers: Trackers, out: Path, report: dict | None) -> None:
    """Send what arrived after the last logged step (the background evaluation of the final checkpoint, the
    final evaluation's report as final_eval/...) at that step, then close the trackers."""

    for record in read_evaluations(out)[0]:
        if record["step"] not in trackers.evaluated:
            trackers.log_eval(trackers.last_step, record)
    if report:
        trackers.log(report, step=trackers.last_step, prefix="final_eval/")
    trackers.finish()
