"""Checkpoints in the contract layout of design.md, written so that none is ever half-visible.

output_dir/checkpoints/step-00000500/ holds model.safetensors (fp32 trainable weights), optimizer.pt,
scheduler.pt, rng-rank*.pt (tensors and plain containers only: loadable with weights_only=True),
trainer_state.json, config.json (the drafter, z-lab layout) and manifest.json (sha256 + size of every
file, written last). The directory is written under a temporary name, fsynced, then renamed;
`checkpoints/latest` is replaced atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .export import to_zlab_config
from .model import DFlashDraftModel, trainable_state_dict

MANIFEST = "manifest.json"


class SaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions); every earlier checkpoint is untouched."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def rng_state() -> dict:
    """This process's RNG states as tensors (weights_only-loadable)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    drafter: DFlashDraftModel,
    optimizer: torch.optim.Optimizer,
    scheduler,
    trainer_state: dict,
    rng_states: dict[int, dict],
    save_total_limit: int,
    protect: set[str] = frozenset(),
) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, and rotate old ones (never the new one,
    nor those named in `protect`, e.g. the checkpoint the run resumed from). Returns its path."""
    root = Path(output_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        weights = {k: v.float().contiguous().cpu() for k, v in trainable_state_dict(drafter).items()}
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        for rank, state in sorted(rng_states.items()):
            torch.save(state, tmp / f"rng-rank{rank}.pt")
        _write_json(tmp / "trainer_state.json", trainer_state)
        _write_json(tmp / "config.json", to_zlab_config(drafter.config))
        write_manifest(tmp, step)
        if final.exists():  # an older save of the same step: move it aside first, so one always exists
            stale = root / f".stale-{final.name}-{os.getpid()}"
            os.replace(final, stale)
            os.replace(tmp, final)
            shutil.rmtree(stale)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SaveError(
            f"saving checkpoint {final.name} failed ({e}); earlier checkpoints and 'latest' are intact"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest_tmp = root / f".latest-{os.getpid()}"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    _rotate(root, keep=save_total_limit, protect={final.name, *protect})
    return final


def write_manifest(directory: Path, step: int) -> None:
    """fsync every file, then write manifest.json (sha256 + size of each) last, and fsync the directory."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    for p in files:
        with p.open("rb") as f:
            os.fsync(f.fileno())
    manifest = {p.name: {"sha256": _sha256(p), "size": p.stat().st_size} for p in files}
    _write_json(directory / MANIFEST, {"step": step, "files": manifest})
    with (directory / MANIFEST).open("rb") as f:
        os.fsync(f.fileno())
    _fsync_dir(directory)


def _rotate(root: Path, keep: int, protect: set[str]) -> None:
    if keep <= 0:
        return
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for old in done[:-keep]:
        if old.name not in protect:
            shutil.rmtree(old)


def verify_checkpoint(path: str | Path) -> list[str]:
    """Problems with a checkpoint directory (empty list = valid): missing manifest, sizes, hashes."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return [f"{path}: no {MANIFEST} (the save did not complete)"]
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as e:
        return [f"{manifest_path}: unreadable ({e})"]
    problems = []
    for name, meta in files.items():
        p = path / name
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != meta["size"]:
            problems.append(f"{p}: size {p.stat().st_size}, manifest says {meta['size']}")
        elif _sha256(p) != meta["sha256"]:
            problems.append(f"{p}: sha256 does not match the manifest")
    return problems


def existing_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoint directories under output_dir, oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def _resolve(path: Path) -> Path:
    """A checkpoint directory, or an output directory / its checkpoints/ folder (then `latest`)."""
    for root in (path / "checkpoints", path):
        if (root / "latest").is_file():
            return root / (root / "latest").read_text().strip()
    return path


def inspect(path: Path) -> str:
    """A human summary: step, data position, topology at save, config, file sizes, manifest status."""
    path = _resolve(path)
    state = json.loads((path / "trainer_state.json").read_text())
    problems = verify_checkpoint(path)
    topo = state.get("topology", {})
    lines = [
        f"checkpoint   {path}",
        f"manifest     {'verified' if not problems else 'INVALID: ' + '; '.join(problems)}",
        f"step         {state.get('global_step')}  (epoch {state.get('epoch')}, "
        f"{state.get('batches_consumed')} global batches consumed, {state.get('tokens_seen')} tokens)",
        f"topology     {topo.get('target_ranks')} target + {topo.get('drafter_ranks')} drafter rank(s) "
        f"(world size {topo.get('world_size')})",
        f"fingerprints {state.get('fingerprints')}",
        "files",
    ]
    lines += [f"  {p.name:<22} {p.stat().st_size:>14,d} bytes" for p in sorted(path.iterdir()) if p.is_file()]
    lines.append("config")
    lines += [f"  {k:<28} {v!r}" for k, v in sorted(state.get("config", {}).items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_ddp.checkpoint inspect|verify DIR`: verify exits 1 when the manifest fails."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("inspect", "verify"):
        print(
            "usage: python -m dflash_ddp.checkpoint inspect|verify CHECKPOINT_OR_OUTPUT_DIR", file=sys.stderr
        )
        return 2
    path = _resolve(Path(argv[1]))
    if not path.is_dir():
        print(f"error: {path}: no such checkpoint directory", file=sys.stderr)
        return 2
    if argv[0] == "inspect":
        try:
            print(inspect(path))
        except (OSError, json.JSONDecodeError) as e:
            print(f"error: {path}: unreadable trainer_state.json ({e})", file=sys.stderr)
            return 1
        return 0
    problems = verify_checkpoint(path)
    for problem in problems:
        print(problem)
    print(f"{path}: {'OK' if not problems else 'FAILED'}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
