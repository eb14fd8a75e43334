"""`python -m dflash_ddp.evaluate --target_model DIR --drafter DIR --data FILE`: real speculative decoding
(evaluation/evaluate.py); `python -m dflash_ddp.evaluate --watch RUN_DIR`: follow a training run and
evaluate its checkpoints as they appear (evaluation/watch.py)."""

import sys

from dflash_ddp.evaluation import evaluate, watch


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the watcher when --watch is given, else to the one-off evaluation."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--watch" or a.startswith("--watch=") for a in argv):
        return watch.main(argv)
    return evaluate.main(argv)


if __name__ == "__main__":
    sys.exit(main())
