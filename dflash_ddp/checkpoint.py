"""Checkpoints in the contract layout of design.md, written so that none is ever half-visible.

output_dir/checkpoints/step-00000500/ holds model.safetensors (fp32 trainable weights), optimizer.pt,
scheduler.pt, rng-rank{i}.pt (the CPU and CUDA generator states of drafter rank i, i = 0..M-1 within the
drafter group; tensors and plain containers only: loadable with weights_only=True), trainer_state.json,
config.json (the drafter, z-lab layout) and manifest.json (sha256 + size of every file, written last).
The directory is written under a temporary name, fsynced, then renamed; `checkpoints/latest` is
written aside, fsynced and renamed into place. `checkpoints/best` names the checkpoint with the highest real
tau measured so far (written by the evaluation watcher, see watch.py); rotation never removes it.

A checkpoint is valid only if its manifest is well formed, lists every required file under a plain name,
names the step of its directory and trainer_state.json, and every listed file matches its size and hash.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from .export import to_zlab_config
from .model import DFlashDraftModel, trainable_state_dict

MANIFEST = "manifest.json"
STEP_NAME = re.compile(r"step-\d{8}")
# Written by every save besides the rng-rank{i}.pt of each drafter rank.
REQUIRED_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "config.json")
# Names a killed save can leave behind in checkpoints/ (removed once the job holds the output directory).
LEFTOVER_PREFIXES = (".tmp-", ".stale-", ".latest-", ".best-")


class SaveError(RuntimeError):
    """Writing a checkpoint or the run's records failed (disk full, permissions); every earlier checkpoint
    is untouched."""


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
    weights: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
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
    step, drafter: DFlashDraftModel, optimizer, scheduler, trainer_state: dict, rng_states, staging=None
) -> Snapshot:
    """Copy the trainable weights, optimizer, scheduler and RNG states to CPU memory (into `staging`'s
    reused buffers when given)."""
    staging = staging or HostStaging()
    weights = staging.copy(trainable_state_dict(drafter), ("weights",))
    optimizer_state = staging.copy(optimizer.state_dict(), ("optimizer",))
    scheduler_state = staging.copy(scheduler.state_dict(), ("scheduler",))
    rng = staging.copy(rng_states, ("rng",))
    return Snapshot(
        step,
        weights,
        optimizer_state,
        scheduler_state,
        json.loads(json.dumps(trainer_state)),
        to_zlab_config(drafter.config),
        rng,
        staging.finish(),
    )


def write_checkpoint(
    output_dir: str | Path, snap: Snapshot, save_total_limit: int, protect=frozenset()
) -> Path:
    """Write a snapshot atomically, point `latest` at it, and rotate old ones (never the new one, nor
    those named in `protect`, e.g. the checkpoint the run resumed from). Returns its path.

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
        weights = {
            k: v.float().contiguous() for k, v in snap.weights.items()
        }  # fp32 whatever the training dtype
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        torch.save(snap.optimizer, tmp / "optimizer.pt")
        torch.save(snap.scheduler, tmp / "scheduler.pt")
        for index, state in sorted(snap.rng_states.items()):
            torch.save(state, tmp / f"rng-rank{index}.pt")
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
        write_latest(root, final.name)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SaveError(
            f"saving checkpoint {final.name} failed ({describe_error(e)}); earlier checkpoints and 'latest' "
            "are intact; free space (or fix permissions) under --output_dir and resume"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _rotate(root, keep=save_total_limit, protect={final.name, *protect})
    except Exception as e:
        raise SaveError(
            f"removing old checkpoints after saving {final.name} failed ({describe_error(e)}); {final.name} and "
            "'latest' are complete; fix the directory's permissions and resume"
        ) from None
    return final


def describe_error(error: BaseException, with_type: bool = True) -> str:
    """One line for an exception: its type and the first line of its message (without the type: the first
    line alone, or the type's name when the message is empty)."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if not with_type:
        return first or type(error).__name__
    return f"{type(error).__name__}: {first}"


def atomic_write_text(path: Path, text: str) -> None:
    """Replace a small file so that it holds the old text or the new one, never a part (also after a power
    loss): written aside as .NAME-PID, fsynced, renamed, directory fsynced; the aside file is removed when
    any step fails (a full disk)."""
    tmp = path.with_name(f".{path.name}-{os.getpid()}")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_latest(root: Path, name: str) -> None:
    """Point checkpoints/latest at `name` atomically (after a power loss `latest` holds the old name or the
    new one, never nothing)."""
    atomic_write_text(root / "latest", name + "\n")


def read_latest(root: Path, report=print) -> Path | None:
    """The checkpoint `root/latest` names, or None (with a warning) unless it is a step-NNNNNNNN directory
    in `root` itself: `latest` is never followed elsewhere (`..`, an absolute path, an empty file)."""
    latest = root / "latest"
    if not latest.is_file():
        return None
    try:
        name = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        report(f"warning: ignoring {latest} ({describe_error(e)}); using the newest valid checkpoint")
        return None
    if not STEP_NAME.fullmatch(name) or not (root / name).is_dir():
        report(
            f"warning: ignoring {latest}: it names {name!r}, not a step-NNNNNNNN checkpoint in {root}; "
            "using the newest valid checkpoint"
        )
        return None
    return root / name


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

    def save(self, step, drafter, optimizer, scheduler, trainer_state: dict, rng_states) -> None:
        """Snapshot now (after the previous save has finished), write in the background."""
        start = time.perf_counter()
        self.wait()
        snap = snapshot(step, drafter, optimizer, scheduler, trainer_state, rng_states, self.staging)
        stall = time.perf_counter() - start
        self.stall_s += stall
        self._thread = threading.Thread(target=self._write, args=(snap, stall), name="checkpoint-writer")
        self._thread.start()

    def _write(self, snap: Snapshot, stall: float) -> None:
        start = time.perf_counter()
        try:
            path = write_checkpoint(self.output_dir, snap, self.save_total_limit, self.protect)
        except BaseException as e:  # raised in the training thread by check(), save() or wait()
            self._error = e
            return
        self.report(
            f"saved {path} (training paused {stall * 1e3:.0f} ms; written in {time.perf_counter() - start:.2f} s in the background)"
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
    with pointer_lock(root):  # `best` cannot move to a checkpoint while it is being removed
        best = read_best(root)
        for old in _step_dirs(root)[:-keep]:
            if old.name not in protect and (best is None or old.name != best.name):
                shutil.rmtree(old)


@contextmanager
def pointer_lock(root: Path) -> Iterator[None]:
    """An exclusive lock between rotation, which must not remove the checkpoint `best` names, and a writer of
    `best` (the watcher, another process), which must not name one rotation is removing: an flock on the
    checkpoints directory itself (no lock file to leave behind)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def read_best(root: Path) -> Path | None:
    """The checkpoint `root/best` names, or None (no file, unreadable, or not a step-NNNNNNNN directory in
    `root`: a best checkpoint moved aside by a resume from an earlier step)."""
    try:
        name = (root / "best").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if STEP_NAME.fullmatch(name) and (root / name).is_dir() else None


def write_best(root: Path, name: str | None) -> bool:
    """Point checkpoints/best at `name` atomically (None removes it); False, and nothing changed, when that
    checkpoint no longer exists (rotation removed it first)."""
    with pointer_lock(root):
        if name is None:
            (root / "best").unlink(missing_ok=True)
            return True
        if not (root / name).is_dir():
            return False
        atomic_write_text(root / "best", name + "\n")
        return True


def read_verified(path: Path, names: tuple[str, ...]) -> dict[str, bytes]:
    """The bytes of the files `names` of checkpoint `path`, each checked against its manifest as read, so
    that what the caller uses is what the manifest vouches for even when rotation removes the directory
    meanwhile. A checkpoint that does not verify is a ValueError; one that is gone, FileNotFoundError."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        if not path.is_dir():
            raise
        raise ValueError(f"{path}: no {MANIFEST} (the save did not complete)") from None
    except ValueError as e:
        raise ValueError(f"{path / MANIFEST}: unreadable ({describe_error(e)})") from None
    problems = _manifest_problems(path, manifest)
    if problems:
        raise ValueError("; ".join(problems))
    found = {}
    for name in names:
        meta = manifest["files"].get(name)
        if meta is None:
            raise ValueError(f"{path / MANIFEST}: does not list {name}")
        data = (path / name).read_bytes()
        if len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise ValueError(f"{path / name}: size or sha256 does not match the manifest")
        found[name] = data
    return found


def _manifest_problems(path: Path, manifest) -> list[str]:
    """What is wrong with the shape of a parsed manifest (not yet its files' content)."""
    where = path / MANIFEST
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return [f"{where}: not a manifest (expected an object with 'step' and a 'files' mapping)"]
    step, files = manifest.get("step"), manifest["files"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return [f"{where}: 'step' is {step!r}, not a step number"]
    if STEP_NAME.fullmatch(path.name) and step != int(path.name[5:]):
        return [f"{where}: step {step} does not match the directory name {path.name}"]
    bad = [
        name
        for name, meta in files.items()
        if name in ("", ".", "..")
        or Path(name).name != name
        or "\\" in name
        or not isinstance(meta, dict)
        or not isinstance(meta.get("sha256"), str)
        or not isinstance(meta.get("size"), int)
    ]
    if bad:
        return [f"{where}: entries {bad} are not plain file names with a sha256 and a size"]
    missing = [name for name in REQUIRED_FILES if name not in files]
    return [f"{where}: does not list {missing}"] if missing else []


def _state_problems(path: Path, step: int, files: dict) -> list[str]:
    """trainer_state.json (already hash-checked) must name the manifest's step and the saved topology's
    RNG files must all be listed."""
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        saved_step, drafters = state["global_step"], int(state["topology"]["drafter_ranks"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{path / 'trainer_state.json'}: unreadable ({describe_error(e)})"]
    if saved_step != step:
        return [f"{path / 'trainer_state.json'}: global_step {saved_step}, the manifest says {step}"]
    missing = [f"rng-rank{i}.pt" for i in range(drafters) if f"rng-rank{i}.pt" not in files]
    return [f"{path / MANIFEST}: does not list {missing}"] if missing else []


def verify_checkpoint(path: str | Path) -> list[str]:
    """Problems with a checkpoint directory (empty list = valid): a missing, unreadable or ill-shaped
    manifest, a required file it does not list, a name leaving the directory, a step that disagrees with
    the directory name or trainer_state.json, a size or hash that does not match."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return [f"{path}: no {MANIFEST} (the save did not complete)"]
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:  # random bytes: UnicodeDecodeError and JSONDecodeError are both here
        return [f"{manifest_path}: unreadable ({describe_error(e)})"]
    problems = _manifest_problems(path, manifest)
    if problems:
        return problems
    for name, meta in manifest["files"].items():
        p = path / name
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != meta["size"]:
            problems.append(f"{p}: size {p.stat().st_size}, manifest says {meta['size']}")
        elif file_sha256(p) != meta["sha256"]:
            problems.append(f"{p}: sha256 does not match the manifest")
    return problems or _state_problems(path, manifest["step"], manifest["files"])


def _step_dirs(root: Path) -> list[Path]:
    """The step-NNNNNNNN directories in a checkpoints folder, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if STEP_NAME.fullmatch(p.name) and p.is_dir())


def existing_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoint directories under output_dir, oldest first."""
    return _step_dirs(Path(output_dir) / "checkpoints")


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


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or an output directory / its checkpoints/ folder (then `latest`, or the
    newest checkpoint when `latest` names nothing usable; the warning goes to stderr)."""
    for root in (path / "checkpoints", path):
        found = _step_dirs(root)
        if (root / "latest").exists() or found:
            named = read_latest(root, report=lambda line: print(line, file=sys.stderr))
            return named or (found[-1] if found else path)
    return path


def inspect(path: Path) -> str:
    """A human summary: step, data position, topology at save, config, file sizes, manifest status."""
    path = resolve_checkpoint(path)
    state = json.loads((path / "trainer_state.json").read_text())
    problems = verify_checkpoint(path)
    topo = state.get("topology", {})
    lines = [
        f"checkpoint   {path}",
        f"manifest     {'verified' if not problems else 'INVALID: ' + '; '.join(problems)}",
        f"step         {state.get('global_step')}  (epoch {state.get('epoch')}, "
        f"{state.get('batches_consumed')} global batches consumed, {state.get('tokens_seen')} tokens)",
        f"topology     {topo.get('target_ranks')} target + {topo.get('drafter_ranks')} drafter rank(s) "
        f"(world size {topo.get('world_size')}, tensor-parallel groups of {topo.get('target_tp_size', 1)})",
        f"fingerprints {state.get('fingerprints')}",
        "files",
    ]
    lines += [f"  {p.name:<22} {p.stat().st_size:>14,d} bytes" for p in sorted(path.iterdir()) if p.is_file()]
    lines.append("config")
    lines += [f"  {k:<28} {v!r}" for k, v in sorted(state.get("config", {}).items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_ddp.checkpoint inspect|verify DIR`: verify exits 1 when the manifest fails."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("inspect", "verify"):
        print(
            "usage: python -m dflash_ddp.checkpoint inspect|verify CHECKPOINT_OR_OUTPUT_DIR", file=sys.stderr
        )
        return 2
    path = resolve_checkpoint(Path(argv[1]))
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
