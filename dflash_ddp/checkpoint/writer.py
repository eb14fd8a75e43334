"""Checkpoints in the contract layout of design.md, written so that none is ever half-visible.

output_dir/checkpoints/step-00000500/ holds the registered parts (parts.py: model.safetensors with the fp32
trainable weights, optimizer.pt, scheduler.pt), rng-rank{i}.pt (the CPU and CUDA generator states of drafter rank i, i = 0..M-1 within the
drafter group; tensors and plain containers only: loadable with weights_only=True), trainer_state.json,
config.json (the drafter, z-lab layout) and manifest.json (sha256 + size of every file, written last).
The directory is written under a temporary name, fsynced, then renamed; `checkpoints/latest` is
written aside, fsynced and renamed into place. `checkpoints/best` names the checkpoint with the highest real
tau measured so far (written by the evaluation watcher); rotation never removes it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ddp.checkpoint.layout import (
    LEFTOVER_PREFIXES,
    checkpoint_name,
    pointer_lock,
    read_best,
    read_latest,
    step_dirs,
    write_latest,
)
from dflash_ddp.checkpoint.manifest import existing_checkpoints, write_json, write_manifest
from dflash_ddp.checkpoint.parts import StatefulPart, write_part
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.zlab import to_zlab_config
from dflash_ddp.files import SaveError, describe_error, fsync_dir


def rng_state() -> dict:
    """This process's global RNG states as tensors (weights_only-loadable): the CPU generator, and the
    current CUDA device's when there is one. These are the generators a resume restores."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def drafter_rng_states(group) -> dict[int, dict]:
    """Every drafter rank's `rng_state()`, keyed by its index in the drafter group (0 = the leader).

    Called by all drafter ranks at a save; one all-gather of uint8 tensors (no pickling)."""
    mine = rng_state()
    if group is None:
        return {0: mine}
    flat = torch.cat([mine["torch"], mine.get("cuda", torch.empty(0, dtype=torch.uint8))])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, flat, group=group)
    n = mine["torch"].numel()
    return {
        i: {"torch": t[:n].clone(), **({"cuda": t[n:].clone()} if "cuda" in mine else {})}
        for i, t in enumerate(everyone)
    }


@dataclass
class Snapshot:
    """Everything a checkpoint holds, copied to CPU at a step boundary (training may go on meanwhile)."""

    step: int
    parts: dict[str, tuple[str, object]]  # file: (format, host copy of the state)
    trainer_state: dict
    drafter_config: dict
    rng_states: dict[int, dict]
    copied: torch.cuda.Event | None = None  # recorded after the last device-to-host copy; None on the CPU

    def wait_copied(self) -> None:
        """Block until the host copies have landed (they were issued without blocking the training thread)."""
        if self.copied is not None:
            self.copied.synchronize()


class HostStaging:
    """Host copies of the training state, allocated at the first save and refilled by every later one.

    An 8B-class drafter's weights and optimizer are about 12 GB: copying them into fresh pageable memory at
    every save stalls training for seconds and churns host memory. Buffers here are kept per place in the
    state (a new one only when that place's shape or dtype changes), pinned when the state lives on a GPU
    so that the copies run without blocking; `Snapshot.wait_copied` then waits for one event. Reusing them
    is safe because a save starts only after the previous write has finished (`CheckpointWriter.save`)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._device_copies = False

    def copy(self, obj, key: tuple = ()):
        """A copy of `obj` (tensors, dicts, lists, tuples, plain values) whose tensors are host buffers."""
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj.detach(), key)
        if isinstance(obj, dict):
            return {k: self.copy(v, (*key, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.copy(v, (*key, i)) for i, v in enumerate(obj))
        return obj

    def _copy_tensor(self, t: torch.Tensor, key: tuple) -> torch.Tensor:
        on_device = t.device.type != "cpu"
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=on_device and torch.cuda.is_available())
            self._buffers[key] = buffer
        buffer.copy_(t, non_blocking=on_device)
        self._device_copies |= on_device
        return buffer

    def finish(self) -> torch.cuda.Event | None:
        """An event recorded after the copies issued since the last call (None when all were host copies)."""
        if not self._device_copies:
            return None
        self._device_copies = False
        event = torch.cuda.Event()
        event.record()
        return event


def snapshot(
    step: int,
    parts: list[StatefulPart],
    drafter_config: DFlashDraftConfig,
    trainer_state: dict,
    rng_states: dict[int, dict],
    staging: HostStaging | None = None,
) -> Snapshot:
    """Copy every registered part's state and the RNG states to CPU memory (into `staging`'s reused
    buffers when given)."""
    staging = staging or HostStaging()
    states = {p.file: (p.format, staging.copy(p.state_dict(), (p.file,))) for p in parts}
    rng = staging.copy(rng_states, ("rng",))
    return Snapshot(
        step,
        states,
        json.loads(json.dumps(trainer_state)),
        to_zlab_config(drafter_config),
        rng,
        staging.finish(),
    )


def write_checkpoint(
    output_dir: str | Path, snap: Snapshot, save_total_limit: int, protect=frozenset(), removed=None
) -> Path:
    """Write a snapshot atomically, point `latest` at it, and rotate old ones (never the new one, nor
    those named in `protect`, e.g. the checkpoint the run resumed from; the names of those removed are
    appended to the list `removed`). Returns its path.

    Any failure is a SaveError: a full disk surfaces as OSError from Python, RuntimeError from torch.save
    and SafetensorError from safetensors, and all of them must end the run the same clean way."""
    step = snap.step
    root = Path(output_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    snap.wait_copied()
    try:
        tmp.mkdir()
        for file, (format, state) in snap.parts.items():
            write_part(tmp, file, format, state)
        for index, state in sorted(snap.rng_states.items()):
            torch.save(state, tmp / f"rng-rank{index}.pt")
        write_json(tmp / "trainer_state.json", snap.trainer_state)
        write_json(tmp / "config.json", snap.drafter_config)
        write_manifest(tmp, step)
        if final.exists():  # an older save of the same step: move it aside first, so one always exists
            stale = root / f".stale-{final.name}-{os.getpid()}"
            os.replace(final, stale)
            os.replace(tmp, final)
            shutil.rmtree(stale)
        else:
            os.replace(tmp, final)
        fsync_dir(root)
        write_latest(root, final.name)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = (
            "earlier checkpoints and 'latest' are intact"
            if any(root.glob("step-*"))
            else "no checkpoint had been saved yet"
        )
        raise SaveError(
            f"saving checkpoint {final.name} failed ({describe_error(e)}); {kept}; free space (or fix "
            "permissions) under --output_dir and resume"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        gone = _rotate(root, keep=save_total_limit, protect={final.name, *protect})
        if removed is not None:
            removed += gone
    except Exception as e:
        raise SaveError(
            f"removing old checkpoints after saving {final.name} failed ({describe_error(e)}); {final.name} and "
            "'latest' are complete; fix the directory's permissions and resume"
        ) from None
    return final


def remove_leftovers(output_dir: str | Path) -> list[str]:
    """Clear what killed saves left in checkpoints/: temporary directories, half-written `latest` files,
    and older saves of a step set aside for a new save of that step. A set-aside save whose step has no
    directory (the kill fell between the two renames) is its only copy and is moved back instead.
    Only safe while holding the output directory's lock. Returns lines to print."""
    root = Path(output_dir) / "checkpoints"
    found = sorted(p for p in root.iterdir() if p.name.startswith(LEFTOVER_PREFIXES)) if root.is_dir() else []
    notes = []
    for path in found:
        stale = re.fullmatch(r"\.stale-(step-\d{8})-\d+", path.name)
        if stale and path.is_dir() and not (root / stale[1]).exists():
            os.replace(path, root / stale[1])
            notes.append(f"moved {path.name} back to {stale[1]}: a save of that step was killed mid-way")
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        notes.append(f"removed {path.name}: left by a save that was killed")
    return notes


def save_checkpoint(
    output_dir,
    step: int,
    parts: list[StatefulPart],
    drafter_config: DFlashDraftConfig,
    trainer_state: dict,
    rng_states: dict[int, dict],
    save_total_limit: int,
    protect=frozenset(),
) -> Path:
    """Snapshot and write in the calling thread (the simple, blocking form of `CheckpointWriter`)."""
    snap = snapshot(step, parts, drafter_config, trainer_state, rng_states)
    return write_checkpoint(output_dir, snap, save_total_limit, protect)


class CheckpointWriter:
    """Saves in the background: the copy to CPU happens at the step boundary (the only stall training
    sees), the files are written by a thread while training continues. One save at a time; a failed
    write is raised by `check()` at the next step boundary, or at the next save or `wait()`."""

    def __init__(self, output_dir: str | Path, save_total_limit: int, protect=frozenset(), report=print):
        self.output_dir, self.save_total_limit, self.protect, self.report = (
            output_dir,
            save_total_limit,
            protect,
            report,
        )
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.staging = HostStaging()
        self.stall_s = 0.0  # total time training waited for snapshots (and for a previous write to end)

    def save(
        self, step: int, parts: list[StatefulPart], drafter_config, trainer_state: dict, rng_states
    ) -> None:
        """Snapshot now (after the previous save has finished), write in the background."""
        start = time.perf_counter()
        self.wait()
        snap = snapshot(step, parts, drafter_config, trainer_state, rng_states, self.staging)
        stall = time.perf_counter() - start
        self.stall_s += stall
        self._thread = threading.Thread(target=self._write, args=(snap, stall), name="checkpoint-writer")
        self._thread.start()

    def _write(self, snap: Snapshot, stall: float) -> None:
        start, removed = time.perf_counter(), []
        try:
            path = write_checkpoint(self.output_dir, snap, self.save_total_limit, self.protect, removed)
        except BaseException as e:  # raised in the training thread by check(), save() or wait()
            self._error = e
            return
        self.report(
            f"saved {path} (training paused {stall * 1e3:.0f} ms; written in {time.perf_counter() - start:.2f} s "
            f"in the background){removal_note(removed, self.save_total_limit)}"
        )

    def check(self) -> None:
        """Raise the error of a background write that has already failed; never blocks (called every step,
        so that a full disk stops the run at once instead of save_steps steps later)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self, raise_error: bool = True) -> None:
        """Block until the save in flight is on disk; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None and raise_error:
            error, self._error = self._error, None
            raise error


def rotate_checkpoints(output_dir: str | Path, save_total_limit: int, protect=frozenset()) -> list[str]:
    """Rotation once more after the run's last evaluation: `best` may have moved off a checkpoint that only
    being best had kept (with --eval_steps, the final evaluation comes after the last save's rotation).
    Returns the names of the checkpoints removed."""
    return _rotate(Path(output_dir) / "checkpoints", save_total_limit, set(protect))


def _rotate(root: Path, keep: int, protect: set[str]) -> list[str]:
    """Remove all but the newest `keep` checkpoints, `best` and those in `protect`; returns their names."""
    if keep <= 0:
        return []
    removed = []
    with pointer_lock(root):  # `best` cannot move to a checkpoint while it is being removed
        best = read_best(root)
        for old in step_dirs(root)[:-keep]:
            if old.name not in protect and (best is None or old.name != best.name):
                shutil.rmtree(old)
                removed.append(old.name)
    return removed


def removal_note(removed: list[str], save_total_limit: int) -> str:
    """The words for checkpoints rotation removed ('' for none), so that a run's log says where they went."""
    if not removed:
        return ""
    return f"; removed {', '.join(removed)} (--save_total_limit {save_total_limit})"


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
    if latest.is_file() and read_latest(root, report=lambda _line: None) is None:
        if resumed.parent.resolve() == root.resolve():  # point it at the checkpoint this run continues
            write_latest(root, resumed.name)
        else:  # resumed from another directory: this one holds no checkpoint of the run yet
            latest.unlink()
    fsync_dir(root)
    return [
        f"moved {', '.join(p.name for p in later)} to {aside}: later than the resumed step {step}, so not this "
        "run's future (kept, never used by --resume auto)"
    ]
