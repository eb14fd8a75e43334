"""`python -m dflash_ddp.plot RUN_DIR [--out DIR]`: PNG plots of a run's metrics (observe/plot.py); with
several runs, `python -m dflash_ddp.plot RUN_A RUN_B ... --out DIR`, the runs side by side
(observe/compare.py)."""

import argparse
import sys

from dflash_ddp.observe.compare import compare_runs
from dflash_ddp.observe.plot import plot_run


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 when the plots are written, 1 on unreadable input or without matplotlib, 2 on bad arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m dflash_ddp.plot",
        description="PNG plots of a run's metrics, or of several runs side by side",
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="a run's --output_dir (holds metrics.jsonl)"
    )
    parser.add_argument(
        "--out", default=None, help="where the PNGs go (default: RUN_DIR; needed with several runs)"
    )
    args = parser.parse_args(argv)
    if len(args.run_dirs) > 1 and not args.out:
        parser.error("several runs are compared into one directory: pass --out DIR")
    table = []
    try:
        if len(args.run_dirs) == 1:
            written, notes = plot_run(args.run_dirs[0], args.out)
        else:
            written, notes, table = compare_runs(args.run_dirs, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for note in notes:
        print(note, file=sys.stderr)
    for line in table:
        print(line)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
