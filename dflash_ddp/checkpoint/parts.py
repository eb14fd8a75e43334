"""The stateful parts of a checkpoint, registered once: each names its file and format, how its state is
taken and how it is given back. Saving (writer.py) and restoring (trainer_state.py) both go through the one
list, so a new part (an EMA of the weights, say) is one more entry in `model_parts`.

Beside the registered parts a checkpoint holds what is not one object's state: each drafter rank's RNG
(gathered from every rank), trainer_state.json (the run's identity and data cursor) and config.json (the
drafter's shape in the serving layout), all written by writer.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflash_ddp.checkpoint.manifest import write_json
from dflash_ddp.checkpoint.reader import read_json, read_tensor_file, read_weights
from dflash_ddp.drafter.model import DFlashDraftModel, trainable_state_dict

FORMATS = ("safetensors", "torch", "json")  # flat fp32 tensors | weights_only-loadable torch.save | JSON


@dataclass(frozen=True)
class StatefulPart:
    """One registered part: saved as `file` in `format` from `state_dict()`, restored by
    `load_state_dict(state)` (which refuses a state that does not fit)."""

    file: str
    state_dict: Callable[[], Any]
    load_state_dict: Callable[[Any], None]
    format: str = "torch"


def model_parts(drafter: DFlashDraftModel, optimizer, scheduler) -> list[StatefulPart]:
    """The registered parts of a drafter's training: its trainable weights, the optimizer, the schedule."""
    return [
        StatefulPart(
            "model.safetensors",
            lambda: trainable_state_dict(drafter),
            lambda state: load_weights(drafter, state),
            "safetensors",
        ),
        StatefulPart("optimizer.pt", optimizer.state_dict, optimizer.load_state_dict),
        StatefulPart("scheduler.pt", scheduler.state_dict, scheduler.load_state_dict),
    ]


def load_weights(drafter: DFlashDraftModel, state: dict[str, torch.Tensor]) -> None:
    """Strict load: missing or unexpected keys, or wrong shapes, are an error listing them."""
    own = trainable_state_dict(drafter)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"model.safetensors does not fit the drafter: missing {missing}, unexpected {unexpected}, "
            f"shape mismatches {wrong}"
        )
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(state[name])


def write_part(directory: Path, file: str, format: str, state: Any) -> None:
    """Write a part's (host-copied) state as `directory/file`."""
    path = Path(directory) / file
    if format == "safetensors":  # fp32 whatever the training dtype
        save_file({k: v.float().contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
        os.chmod(path, 0o644)  # safetensors writes 0600: readable by the team as every other file here
    elif format == "torch":
        torch.save(state, path)
    elif format == "json":
        write_json(path, state)
    else:
        raise ValueError(f"part {file}: unknown format {format!r} (one of {', '.join(FORMATS)})")


def read_part(directory: Path, part: StatefulPart) -> Any:
    """A part's state as saved in checkpoint `directory`, through the one verified read (reader.py)."""
    readers = {"safetensors": read_weights, "torch": read_tensor_file, "json": read_json}
    return readers[part.format](directory, part.file)


def restore_parts(directory: Path, parts: list[StatefulPart]) -> None:
    """Give every part back its state from checkpoint `directory`, in the order registered."""
    for part in parts:
        part.load_state_dict(read_part(directory, part))
