"""Soak test (a benchmark, not CI): a 3+1 CPU job hit by real faults at random steps, resumed after each.

    python -m dflash_ddp.soak [--faults 5] [--steps 60] [--seed 0] [--workdir DIR]

Each fault is one of: SIGKILL to a random rank, SIGTERM to a random rank, or a full disk at a random
save (the drafter leader's file-size limit is lowered with prlimit while it runs, so the save fails the
way it fails on a full disk). After each fault the same command resumes the job; at the end the weights
must be bit-identical to an uninterrupted run and metrics.jsonl must hold every step exactly once, with
the uninterrupted run's values. Prints the faults survived, the steps lost (must be 0) and the steps
recomputed (trained after the last checkpoint before a crash, so trained again).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash_ddp.checkpoint.manifest import existing_checkpoints
from dflash_ddp.config import ASSETS, EMBEDDED_TARGET
from dflash_ddp.parallel.jobs import SMALL_JOB, as_flags, torchrun_cmd, worker_pids

SETTINGS = {
    "target_model": str(EMBEDDED_TARGET),
    "data": str(ASSETS / "data" / "docstring_qa_regenerated.jsonl"),
    **SMALL_JOB,
    "save_steps": 4,
    "seed": 5,
    "dist_timeout": 60,
}


WORLD = 4  # 3 target ranks + 1 drafter rank


KINDS = ("SIGKILL", "SIGTERM", "full disk")


FULL_DISK_BYTES = 64 * 1024  # above metrics.jsonl's size, below every checkpoint's weights file


def job_command(out: Path, cache: Path, steps: int) -> list[str]:
    """torchrun of the 3+1 job writing to `out`."""
    flags = SETTINGS | {"output_dir": str(out), "cache_dir": str(cache), "max_steps": steps}
    return [*torchrun_cmd(WORLD), "-m", "dflash_ddp.train", *as_flags(flags)]


def logged_steps(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being appended right now
            break
    return records


def saved_step(out: Path) -> int:
    """The step of the newest checkpoint (0 when none)."""
    found = existing_checkpoints(out)
    return int(found[-1].name[5:]) if found else 0


def run_with_fault(out: Path, cache: Path, steps: int, kind: str, planned: int, rng: random.Random) -> dict:
    """Start the job, inject one fault once it has trained step `planned` (or the first step after its
    resume point, when a crash sent it back further), wait for the job to end."""
    start = saved_step(out)
    at = max(planned, start + 1)
    job = subprocess.Popen(
        job_command(out, cache, steps),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines, target_rank, injected = [], None, False
    for line in job.stdout:  # the leader's progress lines ("step N/M ..."), read as they come
        lines.append(line)
        if injected or not (line.startswith("step ") and int(line.split()[1].split("/")[0]) >= at):
            continue
        ranks = worker_pids(job.pid)
        target_rank = WORLD - 1 if kind == "full disk" else rng.choice(sorted(ranks))
        if kind == "SIGKILL":
            os.kill(ranks[target_rank], signal.SIGKILL)
        elif kind == "SIGTERM":
            os.kill(ranks[target_rank], signal.SIGTERM)
        else:  # the drafter leader writes the checkpoints: its next save meets a full disk
            resource.prlimit(ranks[target_rank], resource.RLIMIT_FSIZE, (FULL_DISK_BYTES, FULL_DISK_BYTES))
        injected = True
    job.wait()
    last_logged = max((r["step"] for r in logged_steps(out)), default=0)
    return {
        "kind": kind,
        "rank": target_rank,
        "after_step": at,
        "injected": injected,
        "exit": job.returncode,
        "resumed_from": start,
        "saved": saved_step(out),
        "recomputed": max(0, last_logged - saved_step(out)),
        # the rank's own error line, not torchrun's summary after it
        "last_line": next((line.strip() for line in reversed(lines) if line.startswith("error")), "no error"),
    }


def compare(ref: Path, out: Path, steps: int) -> tuple[bool, int]:
    """(final weights bit-identical, number of reference steps missing or different in metrics.jsonl)."""
    import torch
    from safetensors.torch import load_file

    name = f"step-{steps:08d}"
    a = load_file(ref / "checkpoints" / name / "model.safetensors")
    b = load_file(out / "checkpoints" / name / "model.safetensors")
    identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = ("step", "loss", "accuracy", "grad_norm", "lr", "tokens_seen")
    ours = [{k: r[k] for k in keys} for r in logged_steps(out)]
    lost = sum(1 for r in logged_steps(ref) if ours.count({k: r[k] for k in keys}) != 1)
    return identical, lost + max(0, len(ours) - steps)


def main(argv: list[str] | None = None) -> int:
    """Run the soak; exit 0 when the faulted run ends bit-identical with no step lost."""
    parser = argparse.ArgumentParser(prog="python -m dflash_ddp.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0, help="picks the faults, their steps and ranks")
    parser.add_argument("--workdir", default="", help="kept afterwards when given (default: a temporary dir)")
    args = parser.parse_args(argv)
    if args.faults < 1 or args.steps < args.faults + 10:
        parser.error("--faults must be >= 1 and --steps >= faults + 10")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    cache, ref, out = work / "cache", work / "uninterrupted", work / "faulted"
    rng = random.Random(args.seed)
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(max(0, args.faults - len(KINDS)))]
    rng.shuffle(kinds)
    kinds = kinds[: args.faults]
    # increasing steps with room after the last one: a target signalled after it has computed its last
    # batch would see the job end normally instead of stopping it
    planned = sorted(rng.sample(range(2, args.steps - 8), len(kinds)))
    start = time.perf_counter()
    done = subprocess.run(job_command(ref, cache, args.steps), capture_output=True, text=True)
    if done.returncode != 0:
        print(f"the uninterrupted run failed:\n{done.stdout[-3000:]}", file=sys.stderr)
        return 1
    results = []
    for number, kind in enumerate(kinds, 1):
        result = run_with_fault(out, cache, args.steps, kind, planned[number - 1], rng)
        results.append(result)
        print(
            f"fault {number}/{len(kinds)}: {kind} to rank {result['rank']} after step {result['after_step']} "
            f"(resumed from step {result['resumed_from']}): exit {result['exit']}, newest checkpoint "
            f"step {result['saved']}, {result['recomputed']} step(s) to recompute; {result['last_line']}",
            flush=True,
        )
    final = subprocess.run(job_command(out, cache, args.steps), capture_output=True, text=True)
    if final.returncode != 0:
        print(f"the final resume failed:\n{final.stdout[-3000:]}", file=sys.stderr)
        return 1
    identical, lost = compare(ref, out, args.steps)
    survived = sum(r["injected"] for r in results)
    print(
        f"soak: {survived} of {len(results)} faults injected and survived "
        f"({', '.join(f'{kinds.count(k)} {k}' for k in KINDS)}); final weights "
        f"{'bit-identical to' if identical else 'DIFFERENT from'} the uninterrupted run; steps lost: {lost}; "
        f"steps recomputed: {sum(r['recomputed'] for r in results)}; {time.perf_counter() - start:.0f} s; in {work}"
    )
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if identical and lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
