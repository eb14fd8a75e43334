"""The parts directory of a regeneration run (OUT.parts/): its settings.json, one append-only part file
per rank, and the merge of all parts into OUT. See regenerate.py for the resume contract.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from dflash_ddp.files import atomic_write_text, fsync_dir
from dflash_ddp.regeneration.turns import Row, output_row

ROW_PREFIX = re.compile(rb'^\{"row": (\d+), ')  # how json.dumps starts every part-file record


TAIL_CHUNK = 1 << 20  # bytes read at a time, from the end, to find a part file's last complete line


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive flock on `path` (created if missing): start-up and merge of all ranks run one at a time."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def start_parts(out: Path, parts: Path, settings: dict) -> bool:
    """Create OUT.parts with settings.json, or check an existing one. Returns False when the run already
    finished (OUT exists and OUT.parts does not). Called under the lock."""
    if not parts.is_dir():
        if out.exists():
            return False
        # Built under a temporary name and renamed: OUT.parts never exists without its settings.
        tmp = parts.with_name(parts.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with (tmp / "settings.json").open("w") as f:
            f.write(json.dumps(settings, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, parts)
        fsync_dir(parts.parent)
        return True
    old = json.loads((parts / "settings.json").read_text())
    old.pop("skip_bad_rows", None)  # recorded by earlier versions; see the module docstring
    changed = [
        f"{key}: {old.get(key)!r} -> {settings.get(key)!r}"
        for key in sorted(set(old) | set(settings))
        if old.get(key) != settings.get(key)
    ]
    if changed:
        raise ValueError(
            f"{parts} was started with other settings (started -> now): "
            + "; ".join(changed)
            + f". Run with the same settings to continue, or delete {parts} to start over."
        )
    return True


class PartWriter:
    """This rank's part file, held under an exclusive flock for the life of the process (two jobs writing
    the same OUT would interleave rows); the released lock of a killed process is free again at once."""

    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("ab+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(
                f"{path} is being written by another process: one job per --out at a time"
            ) from None
        # A kill mid-write leaves a line without its newline: drop it before appending after it. Only the
        # tail is read, from the end back in chunks: part files can be gigabytes.
        end = self.file.seek(0, os.SEEK_END)
        while end > 0:
            start = max(0, end - TAIL_CHUNK)
            self.file.seek(start)
            newline = self.file.read(end - start).rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        os.ftruncate(self.file.fileno(), end)

    def write(self, records: list[dict]) -> None:
        """Append finished rows and make them durable before they count as done."""
        self.file.write(b"".join(json.dumps(r).encode() + b"\n" for r in records))
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        """Close the file, releasing its lock."""
        self.file.close()  # releases the flock


def index_parts(parts: Path, num_rows: int) -> dict[int, tuple[Path, int]]:
    """Finished rows -> (part file, byte offset of its line), over every part file of any world size.

    Only newline-terminated lines count: the cut-off line of a killed writer is ignored (and dropped by that
    rank's next PartWriter). A row found twice keeps its first line."""
    index: dict[int, tuple[Path, int]] = {}
    for path in sorted(parts.glob("rank*-of-*.jsonl")):
        offset = 0
        with path.open("rb") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.endswith(b"\n"):
                    break
                # Only the leading row number is read: a restart of a large job must not parse gigabytes
                # of JSON; the merge parses each line anyway.
                match = ROW_PREFIX.match(line)
                if match is None:
                    raise ValueError(
                        f"{path}:{line_no}: not a regenerated row; the parts directory is damaged"
                    )
                row = int(match.group(1))
                if not 0 <= row < num_rows:
                    raise ValueError(f"{path}:{line_no}: row {row!r} is outside 0..{num_rows - 1}")
                index.setdefault(row, (path, offset))
                offset += len(line)
    return index


@dataclass
class Summary:
    """What the merge did with each row: rows = written + bad + empty (+ hit_max_new_tokens unless kept)."""

    rows: int = 0
    written: int = 0
    bad: int = 0  # left out: the chat template refused the row (--skip_bad_rows)
    empty: int = 0  # left out: a generated answer was empty
    hit_max_new_tokens: int = 0  # an answer was cut off (and not empty): left out unless --keep_truncated
    turns: int = 0  # generated turns, over every row not bad
    new_tokens: int = 0


def settings_path(out: Path) -> Path:
    """OUT.settings.json: the settings a finished OUT was generated with (a drafter's export stamps them)."""
    return out.with_name(out.name + ".settings.json")


def merge(out: Path, parts: Path, rows: list[Row], keep_truncated: bool = False) -> Summary | None:
    """Write OUT from the part files when every row is finished, then remove OUT.parts. Each line of OUT is
    the input row (`rows`, in input order) with its regenerated answers, every other field kept. Called
    under the lock; None when rows are still missing (another rank is at work, or one died: run again)."""
    num_rows = len(rows)
    index = index_parts(parts, num_rows)
    if len(index) < num_rows:
        return None
    summary = Summary(rows=num_rows)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as dst:
        files = {}
        # Rows in input order, each read back at its offset: the whole data set need not fit in memory.
        for row in range(num_rows):
            path, offset = index[row]
            src = files.get(path) or files.setdefault(path, path.open("rb"))
            src.seek(offset)
            record = json.loads(src.readline())
            if "bad" in record:
                summary.bad += 1
                continue
            # tool-calling turns were kept as written (their content may be empty): not generated here
            generated = [
                m for m in record["messages"] if m["role"] == "assistant" and not m.get("tool_calls")
            ]
            summary.turns += len(generated)
            summary.new_tokens += record["new_tokens"]
            if not all(m["content"] for m in generated):
                summary.empty += 1
                continue
            if record["hit_max_new_tokens"]:
                summary.hit_max_new_tokens += 1
                if not keep_truncated:
                    continue
            # the row's own chat_template_kwargs among its fields: training renders it as it was generated
            dst.write(json.dumps(output_row(rows[row], record["messages"]), ensure_ascii=False) + "\n")
            summary.written += 1
        for src in files.values():
            src.close()
        dst.flush()
        os.fsync(dst.fileno())
    # OUT.parts, which holds the settings, is removed below: they stay beside OUT (written first, so OUT never
    # exists without them) for the export to stamp into the drafter it trained.
    settings = json.loads((parts / "settings.json").read_text()) | {"keep_truncated": keep_truncated}
    atomic_write_text(settings_path(out), json.dumps(settings, indent=2) + "\n")
    os.replace(tmp, out)
    fsync_dir(out.parent)
    shutil.rmtree(parts)
    return summary
