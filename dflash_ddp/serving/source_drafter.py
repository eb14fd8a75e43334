"""A drafter that already exists, as `--init_from` names it: an export of this project, a drafter in the
z-lab / vLLM serving layout (DFlash, DFlash2, DSpark, LiLiCorr), or a checkpoint of this project (its weights only),
from a local path or a hub name. Read here: where its files are, its config, how it was trained (the
stamp, where it has one), the digest of its weights, and the weights themselves. Every file read goes
through the checkpoints' verified read (checkpoint/reader.py), so a damaged one is one line naming it and
what to do, before any target weights load.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_ddp.checkpoint.layout import MANIFEST, resolve_checkpoint
from dflash_ddp.checkpoint.reader import CheckpointReadError, parse_weights, read_bytes, read_json
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.zlab import from_zlab_config
from dflash_ddp.hub import cache_dir, download, hub_model_name

WEIGHTS = "model.safetensors"
DRAFTER_FILES = ["config.json", WEIGHTS, "README.md"]
# The hub cache names an LFS file's blob by its sha256: the checksum a downloaded weights file must match.
HUB_BLOB = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class SourceDrafter:
    """An existing drafter's files and what they say about it."""

    name: str  # as the user gave it: a path or a hub name
    path: Path  # the directory read: an export, a checkpoint's step directory or a hub snapshot
    kind: str  # "checkpoint", "export" (this project's, stamped) or "serving layout" (no stamp)
    config: DFlashDraftConfig
    stamp: dict | None  # how it was trained: the export's stamp, or a checkpoint's fingerprints and target
    shapes: dict[str, tuple[int, ...]]  # {tensor name: shape} of the weights file, as the set-up read it
    sha256: str  # the digest of the weights file the set-up checked, as the hub shows it
    commit: str | None = None  # a hub snapshot's commit

    @property
    def where(self) -> str:
        return f"--init_from {self.name}"

    def weights(self) -> dict[str, torch.Tensor]:
        """Every tensor of the weights file (safetensors: no pickle), read again through the same checks and
        refused unless it is the file the set-up checked: the digest the run records is what it copies."""
        with _damage_named(self.name, self.path, self.commit):
            data = read_bytes(self.path, WEIGHTS)
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise ValueError(
                f"{self.where}: {self.path / WEIGHTS} changed since the run's set-up checked it; start the run "
                "again once it is no longer being written"
            )
        return parse_weights(data, self.path / WEIGHTS)


def hub_drafter_name(name: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when `name` is a hub name and no local path; None for a local directory."""
    return None if Path(name).exists() else hub_model_name(name)


def _what_to_do(name: str, path: Path, commit: str | None) -> str:
    """How to replace a damaged file of the drafter `--init_from name` read from `path`: download a hub
    snapshot again, pick another checkpoint, or export (or copy) a drafter again."""
    if commit is not None:
        repo_id = hub_model_name(name)[0]
        return (
            f"download it again into the hub cache {cache_dir()}: `hf download {repo_id} "
            f"config.json {WEIGHTS} --revision {commit} --force-download`"
        )
    if (path / "trainer_state.json").is_file() or (path / MANIFEST).is_file():
        return f"pick another checkpoint for --init_from (an earlier one in {path.parent})"
    return f"export it again (python -m dflash_ddp.export CHECKPOINT {path}) or copy it again"


@contextmanager
def _damage_named(name: str, path: Path, commit: str | None) -> Iterator[None]:
    """A damaged file read inside becomes one line: the flag, the file and what to do about it."""
    try:
        yield
    except CheckpointReadError as e:
        raise ValueError(f"--init_from {name}: {e}; {_what_to_do(name, path, commit)}") from None


def _check_weights(path: Path, commit: str | None) -> tuple[dict[str, tuple[int, ...]], str]:
    """({tensor name: shape}, sha256) of the weights file after the verified read (checked against a
    checkpoint's manifest, or a hub download's blob name) has parsed all of it; a CheckpointReadError names
    what is wrong."""
    data = read_bytes(path, WEIGHTS)
    digest = hashlib.sha256(data).hexdigest()
    blob = (path / WEIGHTS).resolve()
    if commit is not None and HUB_BLOB.fullmatch(blob.name) and blob.name != digest:
        raise CheckpointReadError(
            f"{path / WEIGHTS}: sha256 {digest} is not the hub's {blob.name} (the cache's copy {blob})"
        )
    return {k: tuple(v.shape) for k, v in parse_weights(data, path / WEIGHTS).items()}, digest


def locate_source_drafter(name: str, commit: str | None = None) -> SourceDrafter:
    """The drafter `--init_from` names: a local directory (an export; a checkpoint, or a run directory whose
    latest checkpoint is taken) or a hub name (org/name[@revision], through the hub cache; `commit`: read
    exactly this snapshot from the cache). Every file it reads goes through the checkpoints' verified read,
    whole, here, on every rank. Errors are one line naming the flag and what to do."""
    hub = hub_drafter_name(name)
    if hub is not None:
        repo_id, revision = hub
        path = download(
            repo_id, commit or revision, DRAFTER_FILES, flag="--init_from", local_only=commit is not None
        )
        commit = path.name
    else:
        path = resolve_checkpoint(Path(name))
        if not path.is_dir():
            raise ValueError(
                f"--init_from {name}: no such directory (nor a hub name org/name); pass an export, a checkpoint "
                "or a run directory of this project, or a drafter in the serving layout"
            )
    missing = [file for file in ("config.json", WEIGHTS) if not (path / file).is_file()]
    if len(missing) == 2:
        raise ValueError(
            f"--init_from {name}: {path} has neither config.json nor {WEIGHTS}; pass an export, a checkpoint "
            "or a run directory of this project, or a drafter in the serving layout"
        )
    checkpoint = (path / "trainer_state.json").is_file()
    with _damage_named(name, path, commit):
        if missing:
            raise CheckpointReadError(f"{path / missing[0]}: missing")
        if checkpoint and not (path / MANIFEST).is_file():  # written last: the save did not complete
            raise CheckpointReadError(f"{path / MANIFEST}: missing (the save did not complete)")
        data = read_json(path, "config.json")
        shapes, sha256 = _check_weights(path, commit)
        state = read_json(path, "trainer_state.json") if checkpoint else None
    pruned = data.get("draft_vocab_size")
    if pruned is not None and pruned != data.get("vocab_size"):
        raise ValueError(
            f"--init_from {name}: its draft vocabulary is pruned to {pruned} of the target's {data.get('vocab_size')} "
            "tokens (draft_vocab_size in config.json); this project's drafters draft over the whole vocabulary: "
            "start from a drafter without a pruned vocabulary"
        )
    try:
        config = from_zlab_config(data, f"--init_from {name}: {path}/config.json")
    except ValueError as e:
        raise ValueError(f"{e}; --init_from takes a DFlash, DFlash2, DSpark or LiLiCorr drafter") from None
    if state is not None:
        fingerprints, settings = state.get("fingerprints", {}), state.get("config", {})
        stamp = {
            "target_fingerprint": fingerprints.get("target"),
            "target_commit": fingerprints.get("target_commit"),
            "tokenizer_fingerprint": fingerprints.get("tokenizer"),
            "target_model": settings.get("target_model"),
            "global_step": state.get("global_step"),
        }
        return SourceDrafter(name, path, "checkpoint", config, stamp, shapes, sha256, commit)
    stamp = data.get("dflash_ddp")
    kind = "export" if stamp else "serving layout"
    return SourceDrafter(name, path, kind, config, stamp, shapes, sha256, commit)
