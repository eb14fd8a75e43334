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
import threading
import time
from dataclasses import dataclass
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


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
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


@dataclass
class Snapshot:
    """Everything a checkpoint holds, copied to CPU at a step boundary (training may go on meanwhile)."""

    step: int
    weights: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    trainer_state: dict
    drafter_config: dict
    rng_states: dict[int, dict]


def _cpu_copy(obj):
    """A deep copy with every tensor on the CPU and detached from the live training state."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.clone() if t.device.type == "cpu" else t.to("cpu")
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def snapshot(
    step, drafter: DFlashDraftModel, optimizer, scheduler, trainer_state: dict, rng_states
) -> Snapshot:
    """Copy the trainable weights (fp32), optimizer, scheduler and RNG states to CPU memory."""
    weights = {k: v.float().contiguous() for k, v in _cpu_copy(trainable_state_dict(drafter)).items()}
    return Snapshot(
        step,
        weights,
        _cpu_copy(optimizer.state_dict()),
        _cpu_copy(scheduler.state_dict()),
        json.loads(json.dumps(trainer_state)),
        to_zlab_config(drafter.config),
        _cpu_copy(rng_states),
    )


def write_checkpoint(
    output_dir: str | Path, snap: Snapshot, save_total_limit: int, protect=frozenset()
) -> Path:
    """Write a snapshot atomically, point `latest` at it, and rotate old ones (never the new one, nor
    those named in `protect`, e.g. the checkpoint the run resumed from). Returns its path."""
    step = snap.step
    root = Path(output_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        save_file(snap.weights, tmp / "model.safetensors", metadata={"format": "pt"})
        torch.save(snap.optimizer, tmp / "optimizer.pt")
        torch.save(snap.scheduler, tmp / "scheduler.pt")
        for rank, state in sorted(snap.rng_states.items()):
            torch.save(state, tmp / f"rng-rank{rank}.pt")
        _write_json(tmp / "trainer_state.json", snap.trainer_state)
        _write_json(tmp / "config.json", snap.drafter_config)
        write_manifest(tmp, step)
        if final.exists():  # an older save of the same step: move it aside first, so one always exists
            stale = root / f".stale-{final.name}-{os.getpid()}"
            os.replace(final, stale)
            os.replace(tmp, final)
            shutil.rmtree(stale)
        else:
            os.replace(tmp, final)
        fsync_dir(root)
        latest_tmp = root / f".latest-{os.getpid()}"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, root / "latest")
        fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SaveError(
            f"saving checkpoint {final.name} failed ({e}); earlier checkpoints and 'latest' are intact"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _rotate(root, keep=save_total_limit, protect={final.name, *protect})
    return final


def save_checkpoint(
    output_dir,
    step,
    drafter,
    optimizer,
    scheduler,
    trainer_state,
    rng_states,
    save_total_limit,
    protect=frozenset(),
) -> Path:
    """Snapshot and write in the calling thread (the simple, blocking form of `CheckpointWriter`)."""
    snap = snapshot(step, drafter, optimizer, scheduler, trainer_state, rng_states)
    return write_checkpoint(output_dir, snap, save_total_limit, protect)


class CheckpointWriter:
    """Saves in the background: the copy to CPU happens at the step boundary (the only stall training
    sees), the files are written by a thread while training continues. One save at a time; a failed
    write is raised at the next save or at `wait()`."""

    def __init__(self, output_dir: str | Path, save_total_limit: int, protect=frozenset(), report=print):
        self.output_dir, self.save_total_limit, self.protect, self.report = (
            output_dir,
            save_total_limit,
            protect,
            report,
        )
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stall_s = 0.0  # total time training waited for snapshots (and for a previous write to end)

    def save(self, step, drafter, optimizer, scheduler, trainer_state: dict, rng_states) -> None:
        start = time.perf_counter()
        self.wait()
        snap = snapshot(step, drafter, optimizer, scheduler, trainer_state, rng_states)
        stall = time.perf_counter() - start
        self.stall_s += stall
        self._thread = threading.Thread(target=self._write, args=(snap, stall), name="checkpoint-writer")
        self._thread.start()

    def _write(self, snap: Snapshot, stall: float) -> None:
        start = time.perf_counter()
        try:
            path = write_checkpoint(self.output_dir, snap, self.save_total_limit, self.protect)
        except BaseException as e:  # raised in the training thread by the next save() or wait()
            self._error = e
            return
        self.report(
            f"saved {path} (training paused {stall * 1e3:.0f} ms; written in {time.perf_counter() - start:.2f} s in the background)"
        )

    def wait(self, raise_error: bool = True) -> None:
        """Block until the save in flight is on disk; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None and raise_error:
            error, self._error = self._error, None
            raise error


def write_manifest(directory: Path, step: int) -> None:
    """fsync every file, then write manifest.json (sha256 + size of each) last, and fsync the directory."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    for p in files:
        with p.open("rb") as f:
            os.fsync(f.fileno())
    manifest = {p.name: {"sha256": file_sha256(p), "size": p.stat().st_size} for p in files}
    _write_json(directory / MANIFEST, {"step": step, "files": manifest})
    with (directory / MANIFEST).open("rb") as f:
        os.fsync(f.fileno())
    fsync_dir(directory)


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
        elif file_sha256(p) != meta["sha256"]:
            problems.append(f"{p}: sha256 does not match the manifest")
    return problems


def existing_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoint directories under output_dir, oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def set_aside_later(output_dir: str | Path, resumed: Path, step: int) -> list[str]:
    """Move checkpoints past `step` to checkpoints/abandoned/: they belong to a future this run replaces.

    Left in place, `--resume auto` after a crash would jump to them instead of this run's own newer saves,
    and rotation would keep them. Nothing is deleted. Returns lines to print."""
    root = Path(output_dir) / "checkpoints"
    later = [p for p in existing_checkpoints(output_dir) if int(p.name.split("-")[1]) > step]
    if not later:
        return []
    aside = root / "abandoned"
    aside.mkdir(exist_ok=True)
    for path in later:
        os.replace(path, aside / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    latest = root / "latest"
    if latest.is_file() and not (root / latest.read_text().strip()).is_dir():
        if resumed.parent.resolve() == root.resolve():  # point it at the checkpoint this run continues
            tmp = root / f".latest-{os.getpid()}"
            tmp.write_text(resumed.name + "\n")
            os.replace(tmp, latest)
        else:  # resumed from another directory: this one holds no checkpoint of the run yet
            latest.unlink()
    fsync_dir(root)
    return [
        f"moved {', '.join(p.name for p in later)} to {aside}: later than the resumed step {step}, so not this "
        "run's future (kept, never used by --resume auto)"
    ]


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
