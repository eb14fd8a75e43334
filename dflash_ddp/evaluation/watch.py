"""Real tau during training: `python -m dflash_ddp.evaluate --watch RUN_DIR` follows a run's checkpoints.

Each new checkpoint whose step is a multiple of --eval_steps (every one when 0), and the run's final one, is
decoded with real speculative decoding (greedy, the decode loop of evaluate.py) on the first prompts of the
evaluation data. One JSON line per evaluated step is appended to RUN_DIR/eval.jsonl (step, tau, the accepted
length histogram, whether every output equals the target's greedy output, prompts, wall time), and
RUN_DIR/checkpoints/best names the checkpoint with the highest tau so far (rotation never removes it).

What it reads is safe against a run that keeps writing: a checkpoint is evaluated from the bytes of its
config.json, model.safetensors and trainer_state.json as read and checked against its manifest, so a
damaged one is skipped with the reason and one that rotation removes meanwhile is skipped with a note,
never half-read. It resumes (steps already in eval.jsonl are skipped) and stops once the run's final
checkpoint is evaluated (its trainer_state.json names the run's total steps), at --until_step, on Ctrl-C or
SIGTERM, or, started by a training job, when that job is gone.

Settings default to the run's own (RUN_DIR/config.json: target, eval data, prompts, new tokens, chat
template, eval_steps); a flag overrides them, e.g. another --device for a spare GPU.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_ddp.checkpoint.evaluations import EVAL_FILE, best_record, read_evaluations
from dflash_ddp.checkpoint.layout import write_best
from dflash_ddp.checkpoint.manifest import existing_checkpoints, read_verified
from dflash_ddp.checkpoint.reader import parse_json, parse_weights
from dflash_ddp.data.chat_template import json_object, load_target_tokenizer
from dflash_ddp.evaluation.decoding import (
    as_transformers_assistant,
    greedy_generate,
    speculative_generate,
    tau_by_context,
)
from dflash_ddp.evaluation.evaluate import check_compatibility, load_prompts
from dflash_ddp.files import atomic_write_text, describe_error
from dflash_ddp.hub import named_target
from dflash_ddp.parallel.devices import resolve_device
from dflash_ddp.serving.export import drafter_from_state
from dflash_ddp.target_model.loading import eos_token_ids, load_causal_lm, whole_target

LOG_FILE = "eval_watch.log"  # where a training job's own watcher writes its lines


LOCK_FILE = ".eval_watch.lock"


READ = ("config.json", "model.safetensors", "trainer_state.json")


@dataclass
class WatchSettings:
    run_dir: Path
    target_model: str
    data: str
    num_prompts: int
    max_new_tokens: int
    eval_steps: int = (
        0  # evaluate checkpoints whose step is a multiple of it (0: every one) and the final one
    )
    until_step: int | None = None  # stop once a checkpoint at or past this step is evaluated
    device: str = "auto"
    chat_template: str = ""
    template_kwargs: dict = field(default_factory=dict)
    poll_s: float = 10.0
    parent: int | None = None  # stop when this process (the job that started the watcher) has gone


class Evaluator:
    """The target, the prompts and their greedy outputs (computed once: the target does not change), ready
    to decode with each checkpoint's drafter."""

    def __init__(self, settings: WatchSettings, report=print):
        device = resolve_device(settings.device)
        self.info = whole_target(settings.target_model)
        tokenizer = load_target_tokenizer(self.info.path, settings.chat_template)
        self.prompts = load_prompts(tokenizer, settings.data, settings.num_prompts, settings.template_kwargs)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as evaluate.py
        self.target = load_causal_lm(self.info, device, dtype)
        self.eos = eos_token_ids(tokenizer, self.target)
        self.max_new_tokens = settings.max_new_tokens
        start = time.perf_counter()
        self.greedy = [
            greedy_generate(self.target, ids, self.max_new_tokens, self.eos).tokens for _, ids in self.prompts
        ]
        report(
            f"target's greedy outputs of {len(self.prompts)} prompts computed in "
            f"{time.perf_counter() - start:.1f} s on {device}"
        )

    def __call__(self, config: dict, weights: dict[str, torch.Tensor], where: Path) -> dict:
        """Decode every prompt with the checkpoint's drafter; the eval.jsonl record (without the step)."""
        start = time.perf_counter()
        drafter = drafter_from_state(config, weights, where)
        check_compatibility(drafter.config, self.info)
        drafter = as_transformers_assistant(drafter, self.target)
        histogram = [0] * drafter.config.block_size
        tokens = verify_steps = mismatches = 0
        results = []
        for (_, ids), truth in zip(self.prompts, self.greedy, strict=True):
            result = speculative_generate(self.target, drafter, ids, self.max_new_tokens, self.eos)
            results.append(result)
            mismatches += result.tokens != truth
            tokens += len(result.tokens) - 1  # the prefill's token is not a verify step's
            verify_steps += len(result.accepted)
            for length in result.accepted:
                histogram[length - 1] += 1
        return {
            "tau": tokens / verify_steps if verify_steps else None,
            "accept_histogram": histogram,  # entry k-1: verify steps that committed k tokens (bonus included)
            "tau_by_context": tau_by_context(results)[0],
            "lossless": mismatches == 0,
            "mismatches": mismatches,
            "prompts": len(self.prompts),
            "max_new_tokens": self.max_new_tokens,
            "verify_steps": verify_steps,
            "wall_s": round(time.perf_counter() - start, 3),
        }


@dataclass
class _Seen:
    """What the watcher knows about the run's checkpoints so far."""

    done: set[int]  # steps in eval.jsonl
    passed: set[str] = field(default_factory=set)  # not wanted, or removed before they could be read
    invalid: dict[str, float | None] = field(default_factory=dict)  # name -> manifest mtime when judged


def _manifest_mtime(path: Path) -> float | None:
    try:
        return (path / "manifest.json").stat().st_mtime_ns
    except OSError:
        return None


def _total_steps(path: Path) -> int | None:
    """The run's total steps as the checkpoint records them (None: not recorded, or unreadable)."""
    try:
        total = json.loads((path / "trainer_state.json").read_text()).get("total_steps")
    except (OSError, ValueError, AttributeError):
        return None
    return total if isinstance(total, int) else None


class Watcher:
    def __init__(self, settings: WatchSettings, report=print, evaluator=None):
        self.settings, self.report = settings, report
        self.root = settings.run_dir / "checkpoints"
        self.evaluator = evaluator  # built at the first checkpoint to evaluate (loading the target)
        records, bad = read_evaluations(settings.run_dir)
        if bad:  # a killed append left a partial line: rewrite without it before appending after it
            atomic_write_text(settings.run_dir / EVAL_FILE, "".join(json.dumps(r) + "\n" for r in records))
            report(f"{settings.run_dir / EVAL_FILE}: dropped {bad} unreadable line(s)")
        self.records = records
        self.seen = _Seen(done={r["step"] for r in records})
        self.finished = False

    def wanted(self, step: int, total: int | None) -> bool:
        every = self.settings.eval_steps
        return every == 0 or step % every == 0 or step == total

    def scan(self) -> None:
        """Evaluate every wanted checkpoint not yet evaluated, oldest first; decide whether the run is done."""
        found = existing_checkpoints(self.settings.run_dir)
        for path in found:
            step = int(path.name[5:])
            if step in self.seen.done or path.name in self.seen.passed:
                continue
            if path.name in self.seen.invalid and self.seen.invalid[path.name] == _manifest_mtime(path):
                continue
            if not self.wanted(step, _total_steps(path)):
                self.seen.passed.add(path.name)
                continue
            self.evaluate(path, step)
            if self.settings.until_step is not None and step >= self.settings.until_step:
                break
        self.finished = self._finished(found)

    def _finished(self, found: list[Path]) -> bool:
        until = self.settings.until_step
        if until is not None and any(s >= until for s in self.seen.done):
            return True
        if not found:
            return False
        newest = found[-1]
        step = int(newest.name[5:])
        judged = step in self.seen.done or newest.name in self.seen.invalid or newest.name in self.seen.passed
        return judged and step == _total_steps(newest)

    def evaluate(self, path: Path, step: int) -> None:
        mtime = _manifest_mtime(path)
        try:
            files = read_verified(path, READ)  # the bytes the manifest vouches for, even if rotated away now
            config = parse_json(files["config.json"], path / "config.json")
            weights = parse_weights(files["model.safetensors"], path / "model.safetensors")
            state = parse_json(files["trainer_state.json"], path / "trainer_state.json")
        except FileNotFoundError:
            self.report(
                f"{path.name} was removed (rotation) before it could be evaluated: raise --save_total_limit, "
                "or give the watcher a faster device"
            )
            self.seen.passed.add(path.name)
            return
        except ValueError as e:
            self.report(f"skipping invalid checkpoint {path.name}: {e}")
            self.seen.invalid[path.name] = mtime
            return
        if self.evaluator is None:
            self.evaluator = Evaluator(self.settings, self.report)
        record = {"step": step, "checkpoint": path.name, **self.evaluator(config, weights, path)}
        record["total_steps"] = state.get("total_steps")
        record["time"] = round(time.time(), 3)
        self.append(record)
        self.seen.done.add(step)
        best = best_record(self.records)
        if best is record and not write_best(self.root, path.name):
            self.report(f"{path.name} was removed (rotation) before `best` could name it")
        tau = "-" if record["tau"] is None else f"{record['tau']:.3f}"
        verdict = "lossless" if record["lossless"] else f"NOT lossless ({record['mismatches']} differ)"
        self.report(
            f"step {step}: tau {tau} on {record['prompts']} prompts, {verdict}, {record['wall_s']:.1f} s"
            + ("; best so far" if best is record else "")
        )

    def append(self, record: dict) -> None:
        with (self.settings.run_dir / EVAL_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)


def watch(settings: WatchSettings, report=print, evaluator=None) -> int:
    """Follow the run until its final checkpoint is evaluated (or --until_step, or the parent job ends)."""
    watcher = Watcher(settings, report, evaluator)
    while True:
        watcher.scan()
        if watcher.finished:
            report(f"done: {len(watcher.seen.done)} checkpoint(s) evaluated; results in {EVAL_FILE}")
            return 0
        if settings.parent is not None and os.getppid() != settings.parent:
            report("stopping: the training job that started this watcher has ended")
            return 0
        time.sleep(settings.poll_s)


class WatchLock:
    """One watcher per run directory (two would append the same steps twice): an flock on a file there."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = (run_dir / LOCK_FILE).open("a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "unknown"
            self.file.close()
            raise ValueError(
                f"{run_dir} is already being evaluated by another watcher (pid {holder})"
            ) from None
        self.file.truncate(0)
        self.file.write(f"{os.getpid()}\n")
        self.file.flush()

    def release(self) -> None:
        self.file.close()  # closing drops the flock


def _run_config(run_dir: Path, poll_s: float, report) -> dict:
    """RUN_DIR/config.json (written by the job at its start: waited for when the watcher starts first)."""
    path = run_dir / "config.json"
    waited = False
    while not path.is_file():
        if not waited:
            report(f"waiting for {path} (written when the training job starts)")
            waited = True
        time.sleep(poll_s)
    return json.loads(path.read_text())


def settings_from(args: argparse.Namespace, report) -> WatchSettings:
    run_dir = Path(args.watch)
    needs_run = None in (args.target_model, args.data, args.num_prompts, args.max_new_tokens, args.eval_steps)
    run = _run_config(run_dir, args.poll_s, report) if needs_run else {}

    def pick(flag, key, default=None):
        return flag if flag is not None else run.get(key, default)

    settings = WatchSettings(
        run_dir=run_dir,
        target_model=pick(args.target_model, "target_model"),
        data=pick(args.data, "eval_data"),
        num_prompts=pick(args.num_prompts, "eval_prompts", 50),
        max_new_tokens=pick(args.max_new_tokens, "eval_max_new_tokens", 128),
        eval_steps=pick(args.eval_steps, "eval_steps", 0),
        until_step=args.until_step,
        device=args.device,
        chat_template=pick(args.chat_template, "chat_template", ""),
        template_kwargs=pick(args.chat_template_kwargs, "chat_template_kwargs", {}),
        poll_s=args.poll_s,
        parent=args.parent,
    )
    if not settings.target_model or not settings.data:
        raise ValueError(
            f"no target or evaluation data: {run_dir}/config.json has no target_model / eval_data; pass "
            "--target_model and --data"
        )
    if not Path(settings.data).is_file():
        raise ValueError(f"evaluation data {settings.data}: no such file")
    return settings


def start_in_job(run_dir: Path, device: torch.device, log_path: Path) -> subprocess.Popen:
    """The watcher as a child of a training job's drafter leader, on the leader's device, writing its lines
    to `log_path`. On a CPU it runs one thread at low priority (nice 10), so that the training ranks keep
    the cores they need; it exits after the final checkpoint, or when the job is gone."""
    cmd = [sys.executable, "-m", "dflash_ddp.evaluate", "--watch", str(run_dir), "--device", str(device)]
    cmd += ["--poll_s", "2", "--parent", str(os.getpid())]
    env = dict(os.environ)
    if device.type == "cpu":
        cmd += ["--threads", "1", "--nice", "10"]
    with log_path.open("a") as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )


def main(argv: list[str]) -> int:
    """CLI of `python -m dflash_ddp.evaluate --watch RUN_DIR`: 0 when done or stopped, 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m dflash_ddp.evaluate --watch", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--watch", required=True, metavar="RUN_DIR", help="a run's --output_dir")
    parser.add_argument(
        "--eval_steps", type=int, help="evaluate steps that are multiples of it (0: every one)"
    )
    parser.add_argument("--until_step", type=int, help="stop after evaluating a checkpoint at or past it")
    parser.add_argument(
        "--target_model", type=named_target, help="default: the run's (embedded: the tiny one)"
    )
    parser.add_argument("--data", help="conversations to take prompts from; default: the run's --eval_data")
    parser.add_argument("--num_prompts", type=int, help="default: the run's --eval_prompts")
    parser.add_argument("--max_new_tokens", type=int, help="default: the run's --eval_max_new_tokens")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--chat_template", help="default: the run's")
    parser.add_argument("--chat_template_kwargs", type=json_object, help="default: the run's")
    parser.add_argument("--poll_s", type=float, default=10.0, help="seconds between looks at the run")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by N")
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)  # set by a training job's own watcher
    args = parser.parse_args(argv)

    def report(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        if args.nice:
            os.nice(args.nice)
        settings = settings_from(args, report)
        if settings.device.startswith("cuda") and settings.device != "cuda" and torch.cuda.is_available():
            torch.cuda.set_device(torch.device(settings.device))
        lock = WatchLock(settings.run_dir)
        try:
            return watch(settings, report)
        finally:
            lock.release()
    except ValueError as e:
        print(f"error: {describe_error(e, with_type=False)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        report("stopped; run the same command again to continue (evaluated steps are skipped)")
        return 0
