"""A drafter that already exists, as `--init_from` names it: an export of this project, a drafter in the
z-lab / vLLM serving layout (DFlash, DFlash2, DSpark), or a checkpoint of this project (its weights only),
from a local path or a hub name. Read here: where its files are, its config, how it was trained (the
stamp, where it has one), the digest of its weights, and the weights themselves.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_ddp.checkpoint.layout import resolve_checkpoint
from dflash_ddp.checkpoint.reader import read_json, read_weights
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.zlab import from_zlab_config
from dflash_ddp.hub import download, hub_model_name

WEIGHTS = "model.safetensors"
DRAFTER_FILES = ["config.json", WEIGHTS, "README.md"]


@dataclass(frozen=True)
class SourceDrafter:
    """An existing drafter's files and what they say about it."""

    name: str  # as the user gave it: a path or a hub name
    path: Path  # the directory read: an export, a checkpoint's step directory or a hub snapshot
    kind: str  # "checkpoint", "export" (this project's, stamped) or "serving layout" (no stamp)
    config: DFlashDraftConfig
    stamp: dict | None  # how it was trained: the export's stamp, or a checkpoint's fingerprints and target
    commit: str | None = None  # a hub snapshot's commit

    @property
    def where(self) -> str:
        return f"--init_from {self.name}"

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """{tensor name: shape} from the weights file's header (nothing loaded)."""
        with safe_open(self.path / WEIGHTS, framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - not a dict

    def weights(self) -> dict[str, torch.Tensor]:
        """Every tensor of the weights file (read once, safetensors: no pickle)."""
        return read_weights(self.path, WEIGHTS)

    def sha256(self) -> str:
        """The digest of the weights file, as the hub shows it."""
        digest = hashlib.sha256()
        with (self.path / WEIGHTS).open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        return digest.hexdigest()


def hub_drafter_name(name: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when `name` is a hub name and no local path; None for a local directory."""
    return None if Path(name).exists() else hub_model_name(name)


def locate_source_drafter(name: str, commit: str | None = None) -> SourceDrafter:
    """The drafter `--init_from` names: a local directory (an export; a checkpoint, or a run directory whose
    latest checkpoint is taken) or a hub name (org/name[@revision], through the hub cache; `commit`: read
    exactly this snapshot from the cache). Errors are one line naming the flag and what to do."""
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
    for file in ("config.json", WEIGHTS):
        if not (path / file).is_file():
            raise ValueError(
                f"--init_from {name}: {path} has no {file}; a drafter to start from has config.json and "
                f"{WEIGHTS} (an export, a checkpoint, or a serving-layout drafter)"
            )
    data = read_json(path, "config.json")
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
        raise ValueError(f"{e}; --init_from takes a DFlash, DFlash2 or DSpark drafter") from None
    if (path / "trainer_state.json").is_file():
        state = read_json(path, "trainer_state.json")
        fingerprints, settings = state.get("fingerprints", {}), state.get("config", {})
        stamp = {
            "target_fingerprint": fingerprints.get("target"),
            "target_commit": fingerprints.get("target_commit"),
            "tokenizer_fingerprint": fingerprints.get("tokenizer"),
            "target_model": settings.get("target_model"),
            "global_step": state.get("global_step"),
        }
        return SourceDrafter(name, path, "checkpoint", config, stamp, commit)
    stamp = data.get("dflash_ddp")
    return SourceDrafter(name, path, "export" if stamp else "serving layout", config, stamp, commit)
