"""Reading a checkpoint's files, or an exported drafter's: the one path every reader takes (resume, export,
evaluate, the evaluation watcher), so that a damaged file is one error naming it wherever it is read.

In a directory with a manifest (a training checkpoint) each file is checked against its size and sha256 as
it is read; an exported drafter has no manifest, so its files are only parsed. Whatever fails (a missing
file, a hash mismatch, a truncated safetensors header, a refused pickle) is a `CheckpointReadError`.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import torch
from safetensors.torch import load as parse_safetensors

from dflash_ddp.checkpoint.layout import MANIFEST
from dflash_ddp.checkpoint.manifest import read_verified
from dflash_ddp.files import describe_error


class CheckpointReadError(ValueError):
    """A file of a checkpoint or an export is missing, damaged or refused; the message names it."""


def read_bytes(directory: Path, name: str) -> bytes:
    """The bytes of `directory/name`, checked against the manifest when the directory has one."""
    directory = Path(directory)
    try:
        if (directory / MANIFEST).is_file():
            return read_verified(directory, (name,))[name]
        return (directory / name).read_bytes()
    except FileNotFoundError:
        raise CheckpointReadError(f"{directory}: no {name}") from None
    except (OSError, ValueError) as e:
        raise CheckpointReadError(describe_error(e, with_type=False)) from None


def parse_weights(data: bytes, where: Path) -> dict[str, torch.Tensor]:
    """The tensors of safetensors bytes read from `where`."""
    try:
        return parse_safetensors(data)
    except Exception as e:  # SafetensorError for a truncated or altered file
        raise CheckpointReadError(f"{where}: not a readable safetensors file ({describe_error(e)})") from None


def parse_tensor_file(data: bytes, where: Path):
    """torch.load of bytes read from `where` with weights_only=True: tensors and plain containers only,
    never arbitrary objects."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's message offers to load it with weights_only=False: never here
        raise CheckpointReadError(
            f"{where}: refused to load: it holds objects that loading would run as code (a pickle), which this "
            "project never loads; its own checkpoints hold none, so the file was altered or comes from elsewhere"
        ) from None
    except Exception as e:
        raise CheckpointReadError(f"{where}: refused to load ({describe_error(e)})") from None


def parse_json(data: bytes, where: Path) -> dict:
    """A JSON object read from `where`."""
    try:
        value = json.loads(data)
    except ValueError as e:
        raise CheckpointReadError(f"{where}: unreadable ({describe_error(e)})") from None
    if not isinstance(value, dict):
        raise CheckpointReadError(f"{where}: not a JSON object")
    return value


def read_weights(directory: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's (or an export's) safetensors file."""
    return parse_weights(read_bytes(directory, name), Path(directory) / name)


def read_tensor_file(directory: Path, name: str):
    """A checkpoint's torch-saved state (optimizer.pt, scheduler.pt, rng-rank*.pt), weights only."""
    return parse_tensor_file(read_bytes(directory, name), Path(directory) / name)


def read_json(directory: Path, name: str) -> dict:
    """A checkpoint's (or an export's) JSON file as an object."""
    return parse_json(read_bytes(directory, name), Path(directory) / name)
