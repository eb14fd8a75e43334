"""PNG plots of a run's metrics: `python -m dflash_ddp.plot RUN_DIR [--out DIR]`.

Reads RUN_DIR/metrics.jsonl (one JSON object per logged step) and, where they exist, the real acceptance
lengths measured with speculative decoding: RUN_DIR/eval.jsonl (one {"step", "tau", ...} per evaluated
checkpoint) and RUN_DIR/eval.json (the evaluation at the end of training). Writes into RUN_DIR (or DIR):

- loss.png        the training loss
- accuracy.png    the accuracy at each block position (1 = the first drafted token) and overall
- tau.png         tau~ (a teacher-forced estimate on training batches) and the real tau
- throughput.png  training tokens per second
- pipeline.png    the fraction of time the drafter waited for batches, and each target rank's queue depth
- tau_by_context.png  real tau by the tokens of context before the block (0-2K, 2K-8K, 8K-32K, 32K+), per
                  evaluated checkpoint and at the end: where the drafter stops paying for itself

matplotlib is an optional extra: `pip install -e ".[plot]"`.
"""

from __future__ import annotations

import json
from pathlib import Path

PLOTS = ("loss", "accuracy", "tau", "throughput", "pipeline", "tau_by_context")


def read_jsonl(path: Path, required: tuple[str, ...]) -> tuple[list[dict], list[str]]:
    """The JSON objects of a file, one per line, each holding `required` keys; notes to print.

    A last line that does not parse is skipped with a note (a running job may be writing it); any other
    bad line is an error naming file:line."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records, notes = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                notes.append(f"note: {path}:{number}: skipped an unreadable last line (still being written?)")
                continue
            raise ValueError(f"{path}:{number}: not a JSON object ({e}); delete or repair the line") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: not a JSON object; delete or repair the line")
        missing = [key for key in required if key not in record]
        if missing:
            raise ValueError(
                f"{path}:{number}: no {', '.join(map(repr, missing))}; is this a dflash_ddp run?"
            )
        records.append(record)
    return records, notes


def read_metrics(run_dir: Path) -> tuple[list[dict], list[str]]:
    """A run's metrics.jsonl records (at least one) and notes to print; ValueError naming what is missing."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{metrics}: no such file (pass the --output_dir of a run that logged a step)")
    records, notes = read_jsonl(metrics, ("step",))
    if not records:
        raise ValueError(f"{metrics}: no logged step yet")
    return records, notes


def real_tau(run_dir: Path, last_step: int) -> tuple[list[tuple[int, float]], tuple[int, float] | None]:
    """Real tau per evaluated checkpoint (eval.jsonl) and at the end of training (eval.json, at the last
    logged step), each empty/None when not measured."""
    during = []
    path = run_dir / "eval.jsonl"
    if path.is_file():
        records, _ = read_jsonl(path, ("step", "tau"))
        during = [(r["step"], r["tau"]) for r in records]
    final = None
    path = run_dir / "eval.json"
    if path.is_file():
        try:
            report = json.loads(path.read_text())
            final = (report.get("step", last_step), report["dflash"]["tau"])  # its own step (a resumed run
            # that trained on without evaluating keeps an earlier end's)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}: no dflash.tau ({e!r}); delete it or run the evaluation again"
            ) from None
    return during, final


def real_tau_by_context(run_dir: Path, last_step: int) -> list[tuple[int, dict[str, float]]]:
    """(step, {context bucket: real tau}) per evaluated checkpoint (eval.jsonl) and at the end (eval.json),
    for the evaluations that measured it."""
    found = []
    if (run_dir / "eval.jsonl").is_file():
        records, _ = read_jsonl(run_dir / "eval.jsonl", ("step", "tau"))
        found = [(r["step"], r["tau_by_context"]) for r in records if r.get("tau_by_context")]
    if (run_dir / "eval.json").is_file():
        report = json.loads((run_dir / "eval.json").read_text())
        if report.get("tau_by_context"):
            found.append((report.get("step", last_step), report["tau_by_context"]))
    return found


def loss_name(run_dir: Path) -> str:
    """The run's objective in words, from its config.json ("the run's weighted objective" without one)."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "the run's weighted objective"
    weighted = f"{config.get('position_weighting', 'decay')}-weighted"
    family = config.get("drafter", "dflash")
    if family == "dspark":
        return (
            f"{weighted} DSpark: {config.get('dspark_ce_alpha', 0.1)} CE + {config.get('dspark_l1_alpha', 0.9)} L1 "
            f"+ {config.get('confidence_alpha', 1.0)} confidence BCE"
        )
    own = {"dflash2": " + the selector's CE", "lilicorr": " + the correlator's terms"}.get(family, "")
    return f"{weighted} {config.get('loss', 'ce')}{own}"


def series(records: list[dict], key: str) -> tuple[list[int], list]:
    """(steps, values) of the records that hold `key`."""
    kept = [r for r in records if r.get(key) is not None]
    return [r["step"] for r in kept], [r[key] for r in kept]


def _axes(figure, title: str, ylabel: str):
    ax = figure.subplots()
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return ax


def draw(name: str, records: list[dict], run_dir: Path, figure) -> bool:
    """Draw plot `name` on `figure`; False when the records hold nothing for it."""
    if name == "loss":
        steps, loss = series(records, "loss")
        _axes(figure, f"training loss ({loss_name(run_dir)})", "loss").plot(steps, loss)
        return bool(steps)
    if name == "accuracy":
        steps, per_position = series(records, "accuracy_per_position")
        if not steps:
            return False
        ax = _axes(figure, "accuracy on training batches", "top-1 accuracy")
        for k in range(max(len(p) for p in per_position)):
            kept = [(s, p[k]) for s, p in zip(steps, per_position, strict=True) if k < len(p)]
            ax.plot(*zip(*kept, strict=True), label=f"block position {k + 1}", linewidth=1)
        ax.plot(*series(records, "accuracy"), label="all positions", color="black", linewidth=2)
        ax.legend(fontsize="small", ncol=2)
        return True
    if name == "tau":
        steps, estimate = series(records, "tau_estimate")
        if not steps:
            return False
        ax = _axes(figure, "acceptance length (tokens per target verify step)", "tau")
        ax.plot(steps, estimate, label="tau~ estimate (teacher-forced, training batches)")
        during, final = real_tau(run_dir, steps[-1])
        if during:
            ax.plot(*zip(*during, strict=True), "o-", label="real tau (speculative decoding, eval.jsonl)")
        if final:
            ax.plot(*final, "s", markersize=9, label="real tau at the end (eval.json)")
        ax.legend(fontsize="small")
        return True
    if name == "tau_by_context":
        measured = real_tau_by_context(run_dir, records[-1]["step"])
        if not measured:
            return False
        ax = _axes(figure, "real tau by tokens of context before the block", "tau")
        buckets = list(dict.fromkeys(b for _, taus in measured for b in taus))
        for bucket in buckets:
            kept = [(step, taus[bucket]) for step, taus in measured if bucket in taus]
            ax.plot(*zip(*kept, strict=True), "o-", label=f"context {bucket} tokens")
        ax.legend(fontsize="small")
        return True
    if name == "throughput":
        steps, rate = series(records, "tokens_per_s")
        _axes(figure, "training throughput", "tokens / s").plot(steps, rate)
        return bool(steps)
    from matplotlib.ticker import MaxNLocator  # plot_run checked that matplotlib is there

    steps, wait = series(records, "wait_fraction")
    if not steps:
        return False
    top, bottom = figure.subplots(2, 1, sharex=True)
    top.plot(steps, [100 * w for w in wait])
    queue_steps, queues = series(records, "target_inflight")
    ranks = sorted({rank for q in queues for rank in q}, key=int)
    # colocated, the drafter's "wait" is the target's own forward in its process, as the live line says
    colocated = "target forward (colocated: the drafter waits its turn)"
    top.set_title("drafter waiting for batches" if ranks else colocated)
    top.set_ylabel("% of the logging window")
    for rank in ranks:  # none in a colocated run: its target runs in the drafter's process
        kept = [(s, q[rank]) for s, q in zip(queue_steps, queues, strict=True) if rank in q]
        bottom.step(*zip(*kept, strict=True), where="post", label=f"target rank {rank}")
    bottom.set_title("sends in flight per target rank" if ranks else "no target ranks (colocated run)")
    bottom.set_ylabel("batches")
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel("optimizer step")
    if ranks:
        bottom.legend(fontsize="small")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return True


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[list[Path], list[str]]:
    """Write the PNGs of a run; returns the files written and notes to print."""
    try:
        from matplotlib.figure import Figure  # the object API: no display, no global pyplot state
    except ImportError:
        raise ValueError('matplotlib is not installed: pip install -e ".[plot]"') from None
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    records, notes = read_metrics(run_dir)
    out = Path(out_dir) if out_dir else run_dir
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in PLOTS:
        figure = Figure(figsize=(8, 6 if name == "pipeline" else 4.5), layout="constrained")
        if draw(name, records, run_dir, figure):
            figure.savefig(out / f"{name}.png", dpi=100)
            written.append(out / f"{name}.png")
        elif name == "tau_by_context":
            notes.append(
                f"note: no evaluation in {run_dir} measured tau by context (eval.jsonl, eval.json: --eval_steps, "
                f"--eval_data); skipped {name}.png"
            )
        else:
            notes.append(f"note: {metrics} holds nothing for {name}.png; skipped")
    return written, notes
