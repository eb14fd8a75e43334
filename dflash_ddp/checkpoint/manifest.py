"""A checkpoint is valid only if its manifest is well formed, lists every required file under a plain name,
names the step of its directory and trainer_state.json, and every listed file matches its size and hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dflash_ddp.checkpoint.layout import MANIFEST, REQUIRED_FILES, STEP_NAME, step_dirs
from dflash_ddp.files import describe_error, file_sha256, fsync_dir


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_manifest(directory: Path, step: int) -> None:
    """fsync every file, then write manifest.json (sha256 + size of each) last, and fsync the directory."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    for p in files:
        with p.open("rb") as f:
            os.fsync(f.fileno())
    manifest = {p.name: {"sha256": file_sha256(p), "size": p.stat().st_size} for p in files}
    write_json(directory / MANIFEST, {"step": step, "files": manifest})
    with (directory / MANIFEST).open("rb") as f:
        os.fsync(f.fileno())
    fsync_dir(directory)


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


def existing_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoint directories under output_dir, oldest first."""
    return step_dirs(Path(output_dir) / "checkpoints")
