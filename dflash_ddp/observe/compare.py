"""Runs side by side: `python -m dflash_ddp.plot RUN_A RUN_B ... --out DIR`.

Recipes are compared by what decoding gets from them, not by their losses, which are different objectives
(DSpark's adds an L1 distance and a BCE, DFlash2's a selector's CE): one table of each run's recipe and
its last figures, and plots of the per-position accuracy, tau~ and real tau, and throughput against the
optimizer step, one line per run:

- compare_accuracy.png    accuracy (teacher-forced top-1 over the block's drafted positions)
- compare_tau.png         tau~ (lines) and the real tau of speculative decoding (markers), where measured
- compare_throughput.png  training tokens per second (comparable only on the same machine and split)
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_ddp.observe.plot import read_metrics, real_tau, series


def recipe(run_dir: Path) -> str:
    """The run's drafter family, position weighting, loss and optimizer, from its config.json."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "(no config.json)"
    return (
        ", ".join(
            str(config.get(key, default))
            for key, default in (("drafter", "dflash"), ("position_weighting", "decay"), ("loss", "ce"))
        )
        + f", {config.get('optimizer', 'adamw')} {config.get('learning_rate', '?')}"
    )


def label(run_dir: Path, runs: list[Path]) -> str:
    """The shortest name that tells the runs apart: the directory's name, or its path where names repeat."""
    names = [r.name for r in runs]
    return run_dir.name if names.count(run_dir.name) == 1 else str(run_dir)


def summary_table(runs: list[Path], records: dict[Path, list[dict]]) -> list[str]:
    """The lines of a table: each run's recipe, last step, accuracy and tau~, and its last real tau."""
    rows = [("run", "recipe", "step", "accuracy", "tau~", "real tau (at step)")]
    for run in runs:
        last = records[run][-1]
        during, final = real_tau(run, last["step"])
        measured = final or (during[-1] if during else None)
        rows.append(
            (
                label(run, runs),
                recipe(run),
                str(last["step"]),
                f"{last['accuracy']:.3f}" if "accuracy" in last else "-",
                f"{last['tau_estimate']:.2f}" if "tau_estimate" in last else "-",
                f"{measured[1]:.2f} ({measured[0]})" if measured else "not measured",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]


def compare_runs(run_dirs: list[str | Path], out_dir: str | Path) -> tuple[list[Path], list[str], list[str]]:
    """Write the comparison PNGs of several runs into `out_dir`; returns the files written, notes to print
    and the summary table's lines."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError('matplotlib is not installed: pip install -e ".[plot]"') from None
    runs = [Path(r) for r in run_dirs]
    records, notes = {}, []
    for run in runs:
        records[run], read_notes = read_metrics(run)
        notes += read_notes
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, key, title, ylabel in (
        (
            "accuracy",
            "accuracy",
            "accuracy over the block's drafted positions (teacher-forced)",
            "top-1 accuracy",
        ),
        ("tau", "tau_estimate", "acceptance length: tau~ (lines), real tau (markers)", "tau"),
        ("throughput", "tokens_per_s", "training throughput", "tokens / s"),
    ):
        figure = Figure(figsize=(8, 4.5), layout="constrained")
        ax = figure.subplots()
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        drawn = False
        for run in runs:
            steps, values = series(records[run], key)
            if not steps:
                continue
            (line,) = ax.plot(steps, values, label=label(run, runs))
            drawn = True
            if name == "tau":
                during, final = real_tau(run, steps[-1])
                measured = during + ([final] if final else [])
                if measured:
                    ax.plot(*zip(*measured, strict=True), "o", color=line.get_color())
        if not drawn:
            notes.append(f"note: no run logged {key}; skipped compare_{name}.png")
            continue
        ax.legend(fontsize="small")
        figure.savefig(out / f"compare_{name}.png", dpi=100)
        written.append(out / f"compare_{name}.png")
    notes.append(
        "note: losses are not compared: each family's objective is its own (plot each run for its loss)"
    )
    return written, notes, summary_table(runs, records)
