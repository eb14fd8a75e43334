"""Resuming: which checkpoint, and its RNG states (trainer_state.py restores the trainer's other parts).

`--resume auto` (default) takes the newest checkpoint whose manifest verifies, reporting and skipping
corrupt or half-written ones; `never` refuses an output directory that already holds checkpoints
(starting over there would throw that work away); a path resumes from that checkpoint. Whether the
checkpoint belongs to this run is decided in setup/start.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_ddp.checkpoint.layout import resolve_checkpoint
from dflash_ddp.checkpoint.manifest import existing_checkpoints, verify_checkpoint
from dflash_ddp.checkpoint.reader import read_tensor_file


class RestoreError(ValueError):
    """A verified checkpoint could not be loaded into this run's objects (a refused pickle, a state that
    does not fit): the resume is refused."""


def find_checkpoint(output_dir: str | Path, resume: str, report) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start. `report` prints a warning line."""
    if resume not in ("auto", "never"):
        path = resolve_checkpoint(Path(resume))  # a run or its checkpoints/: the checkpoint `latest` names
        problems = verify_checkpoint(path) if path.is_dir() else [f"{path}: not a directory"]
        if problems:
            foreign = not (path / "trainer_state.json").is_file() and (path / "config.json").is_file()
            raise ValueError(
                f"--resume {resume}: not a valid checkpoint: "
                + "; ".join(problems)
                + (
                    " (it holds a config.json and no trainer_state.json: a drafter from elsewhere, whose "
                    "weights --init_from starts a run from)"
                    if foreign
                    else ""
                )
            )
        return path
    root = Path(output_dir) / "checkpoints"
    for tmp in sorted(root.glob(".tmp-*")) if root.is_dir() else []:
        report(f"ignoring {tmp}: a save that never completed (the process died while writing it)")
    found = existing_checkpoints(output_dir)
    if resume == "never":
        if found:
            raise ValueError(
                f"--resume never, but --output_dir {output_dir} already holds checkpoints (newest: "
                f"{found[-1].name}): pass a new --output_dir, or --resume auto to continue that run"
            )
        return None
    for path in reversed(found):
        problems = verify_checkpoint(path)
        if not problems:
            return path
        report(f"skipping corrupt checkpoint {path.name}: " + "; ".join(problems))
    if found:
        raise ValueError(
            f"--output_dir {output_dir}: none of its {len(found)} checkpoints verifies (see above); "
            "restore one, or pass --resume never with a new --output_dir"
        )
    return None


def restore_rng(path: Path, index: int) -> None:
    """Restore drafter rank `index`'s generators from the checkpoint's rng-rank{index}.pt (weights_only);
    nothing to do when it has none for that index (it was saved with fewer drafter ranks)."""
    name = f"rng-rank{index}.pt"
    if not (path / name).is_file():
        return
    state = read_tensor_file(path, name)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
