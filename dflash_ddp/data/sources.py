"""Conversations from jsonl/json/parquet files or `save_to_disk` directories, checked row by row.

Every unusable row raises BadRow naming its place ('file:line' or 'file:row N') and the reason, or with
`--skip_bad_rows` is counted in DataStats and skipped. Problems of a whole input (missing, unreadable,
empty) always raise ValueError.
"""

from __future__ import annotations

import glob
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    # tool results: never in the loss, kept for the template to render
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
    # OpenAI's newer name for the system prompt's role
    "developer": "system",
    # other assistants' names in ShareGPT dumps, and Gemini's
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}


@dataclass
class DataStats:
    """Counts printed at start and stored in the run directory."""

    rows: int = 0
    bad_rows: int = 0  # skipped with --skip_bad_rows
    truncated: int = 0  # longer than --max_seq_len, cut (--overlength truncate)
    overlength_dropped: int = 0  # longer than --max_seq_len, dropped (--overlength drop)
    too_short: int = 0  # fewer than 2*block_size response tokens
    kept: int = 0
    tokens: int = 0  # of the kept samples
    response_tokens: int = 0  # of the kept samples: tokens the loss covers
    bad_row_examples: list[str] = field(default_factory=list)
    bad_rows_by_input: dict[str, int] = field(default_factory=dict)  # skipped while read, per input
    # inputs none of whose rows is usable, all skipped: a file in another format, most likely
    unusable_inputs: list[str] = field(default_factory=list)
    inputs: dict[str, int] = field(default_factory=dict)  # each data file's bytes, as tokenized
    # kept rows with a turn trained after other text than its generation prompt (chat_template.context_note)
    context_differs: int = 0
    context_examples: list[str] = field(default_factory=list)

    def skip(self, error: BadRow, first_of_input: bool = False) -> None:
        """Count a skipped row (--skip_bad_rows), keeping the first few reasons for data_stats.json (and the
        first of each input, so that an input's bad rows are not hidden behind an earlier one's)."""
        self.bad_rows += 1
        if len(self.bad_row_examples) < 10 or first_of_input:
            self.bad_row_examples.append(str(error))

    def note_context(self, note: str) -> None:
        """Count a row whose trained turn follows other text than the target's generation prompt."""
        if note:
            self.context_differs += 1
            if len(self.context_examples) < 5:
                self.context_examples.append(note)

    def summary(self) -> str:
        """One line with every count, as printed at start."""
        return (
            f"{self.rows} rows, {self.bad_rows} bad rows skipped, {self.truncated} truncated and "
            f"{self.overlength_dropped} dropped for --max_seq_len, {self.too_short} dropped with fewer than "
            f"2*block_size response tokens, {self.kept} kept ({self.tokens} tokens, "
            f"{self.response_tokens} in the loss)"
        )

    def notes(self) -> list[str]:
        """The warnings printed at start beside the summary."""
        return [note for note in (self.unusable_note(), self.context_note()) if note]

    def context_note(self) -> str:
        """The line that counts rows trained in a context the target does not meet when serving ('' when
        none is)."""
        if not self.context_differs:
            return ""
        return (
            f"warning: {self.context_differs} of the {self.kept} rows kept train an assistant turn after other text than "
            "the generation prompt the target is served with (the chat template renders the turn's context "
            "otherwise once the conversation goes on: an earlier turn's thinking dropped, a system prompt moved, "
            f"a generation prompt's <think> left out); first: {self.context_examples[0]}; the drafter learns "
            "those answers after text it does not meet when serving (a few tokens such as an empty thinking "
            "block matter little, a whole reasoning left out does): pass a --chat_template that renders each "
            "turn as the target generates it, or --train_last_turn_only where the last turn renders as served "
            "(examples in data_stats.json)"
        )

    def unusable_note(self) -> str:
        """The line that names inputs all of whose rows were skipped ('' when none was)."""
        if not self.unusable_inputs:
            return ""
        return (
            f"warning: --skip_bad_rows skipped every row of {len(self.unusable_inputs)} input(s), which add "
            f"nothing to the data: {'; '.join(self.unusable_inputs)}; is the file in another format?"
        )


class BadRow(ValueError):
    """A row that cannot be used; `--skip_bad_rows` skips and counts these instead of stopping."""


class Conversation(NamedTuple):
    """One usable row: where it is, its turns, and its own chat template arguments (a row's
    "chat_template_kwargs" object, applied over the run's --chat_template_kwargs; {} when absent)."""

    where: str
    messages: list[dict]
    template_kwargs: dict


def _row_template_kwargs(row: dict, where: str) -> dict:
    kwargs = row.get("chat_template_kwargs")
    if kwargs is None:  # absent, or a parquet column's null
        return {}
    if not isinstance(kwargs, dict):
        raise BadRow(
            f"{where}: 'chat_template_kwargs' must be a JSON object such as {{\"enable_thinking\": true}}"
        )
    # None = absent: parquet gives every row every key its column holds in any row, as nulls, which would
    # otherwise override the run's --chat_template_kwargs
    return {k: v for k, v in kwargs.items() if v is not None}


def _text(content, where: str, i: int, text_key: str) -> str:
    """A turn's text: a string, or OpenAI's list of content parts, joined by newlines (as vLLM renders them
    for a template that takes strings) when every part is text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "\n".join(part["text"] for part in content)
    kinds = (
        sorted({str(part.get("type")) for part in content if isinstance(part, dict)})
        if isinstance(content, list)
        else [type(content).__name__]
    )
    raise BadRow(
        f"{where}: turn {i} '{text_key}' must be a string or a list of text parts "
        f'([{{"type": "text", "text": "..."}}]); got {", ".join(kinds) or "an empty list"}'
    )


def _turns(row: dict, where: str) -> tuple[list, str, str]:
    """The row's turns and their role and text keys: OpenAI's 'messages' (role/content) or ShareGPT's
    'conversations' (from/value). A null counts as absent: parquet data joined from both formats holds
    both columns, each row filling one."""
    found = row_format(row)
    if found is None:
        present = [key for key, _, _ in FORMATS if key in row]
        if present:
            raise BadRow(f"{where}: '{present[0]}' is null")
        raise BadRow(f"{where}: the row has neither 'messages' nor 'conversations'")
    key, role_key, text_key = found
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"{where}: '{key}' is empty or not a list")
    system = row.get("system")  # LLaMA-Factory's ShareGPT rows give the system prompt beside the turns
    if system is not None and not isinstance(system, str):
        raise BadRow(f"{where}: 'system' must be a string (the system prompt)")
    if system_turn_added(row):
        turns = [{role_key: "system", text_key: system}, *turns]
    return turns, role_key, text_key


def system_turn_added(row: dict) -> bool:
    """Whether the row's `system` field (LLaMA-Factory's ShareGPT rows) is read as its first turn: a text,
    beside turns that hold no system turn (regeneration writes the row back without it)."""
    system, found = row.get("system"), row_format(row)
    if not isinstance(system, str) or not system.strip() or found is None:
        return False
    key, role_key, _ = found
    turns = row[key] if isinstance(row[key], list) else []
    return not any(isinstance(t, dict) and str(t.get(role_key)).lower() == "system" for t in turns)


# (the row's key, its turns' role key, their text key)
FORMATS = (("messages", "role", "content"), ("conversations", "from", "value"))


def row_format(row: dict) -> tuple[str, str, str] | None:
    """The row's format (FORMATS): the first whose key holds something; 'messages' where a row has both.
    Its turns' keys are the other format's where its first turn has that format's role key and not its
    own: SpecForge's data preparation writes role/content turns under 'conversations'."""
    found = next((f for f in FORMATS if row.get(f[0]) is not None), None)
    if found and isinstance(row[found[0]], list):
        first = next((t for t in row[found[0]] if isinstance(t, dict)), {})
        other = next(f for f in FORMATS if f != found)
        if other[1] in first and found[1] not in first:
            return (found[0], other[1], other[2])
    return found


def _normalise_messages(row: dict, where: str, require_assistant: bool = True) -> list[dict]:
    turns, role_key, text_key = _turns(row, where)
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRow(f"{where}: turn {i} must be a JSON object with '{role_key}' and '{text_key}'")
        if role_key not in turn:
            first = " (the row's first turn has one)" if i > system_turn_added(row) else ""
            raise BadRow(f"{where}: turn {i} has no '{role_key}'{first}")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise BadRow(
                f"{where}: turn {i} has unknown role '{turn[role_key]}' (known: {', '.join(ROLE_ALIASES)})"
            )
        # other keys (reasoning_content, tool_calls, name...) go to the template; None = absent (parquet
        # gives every turn every key of the column's schema)
        extra = {k: v for k, v in turn.items() if k not in (role_key, text_key) and v is not None}
        if turn.get(text_key) is None:  # an assistant's tool calls need no text (OpenAI leaves it out)
            if not extra.get("tool_calls"):
                missing = "is null" if text_key in turn else "is missing"
                raise BadRow(f"{where}: turn {i} '{text_key}' {missing}")
            content = ""
        else:
            content = _text(turn[text_key], where, i, text_key)
        if role == "assistant" and not content.strip() and not extra.get("tool_calls"):
            raise BadRow(f"{where}: turn {i} is an empty assistant turn")
        messages.append({**extra, "role": role, "content": content})
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadRow(f"{where}: the conversation has no assistant turn")
    return messages


def data_files(paths: list[str]) -> list[Path]:
    """Files and `save_to_disk` directories named directly or through glob patterns, in a stable order."""
    found = []
    for path in paths:
        if glob.has_magic(path):
            matched = sorted(glob.glob(path))
            if not matched:
                raise ValueError(f"--data {path}: the pattern matches no file")
            found += [Path(m) for m in matched]
        elif not Path(path).exists():
            raise ValueError(f"--data {path}: file not found")
        else:
            found.append(Path(path))
    for p in found:
        if p.is_dir() and not (p / "state.json").is_file():
            if (p / "dataset_dict.json").is_file():
                hint = " (a DatasetDict: pass one split's directory, e.g. DIR/train)"
            else:
                hint = " (for a folder of data files, name them: DIR/*.jsonl)"
            raise ValueError(f"--data {p}: a directory must be written by datasets' save_to_disk{hint}")
        if p.is_file() and _suffix(p) not in (".jsonl", ".json", ".parquet"):
            raise ValueError(
                f"--data {p}: unsupported file type '{p.suffix}' (use .jsonl, .json or .parquet)"
            )
    return found


def data_file_contents(paths: list[str]) -> list[Path]:
    """Every file whose bytes make up the --data inputs (a save_to_disk directory counts as its files)."""
    return [
        f
        for path in data_files(paths)
        for f in (sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    ]


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _jsonl_rows(path: Path):
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            if not raw.strip():
                continue
            try:
                # utf-8-sig: a byte-order mark, which Windows tools write, opens the first line
                yield where, json.loads(raw.decode("utf-8-sig"))
            except UnicodeDecodeError:
                yield where, BadRow(f"{where}: not valid UTF-8")
            except json.JSONDecodeError as e:
                # json says "Invalid control character at" and gives the place apart
                yield (
                    where,
                    BadRow(f"{where}: malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno})"),
                )


def _json_rows(path: Path):
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON Lines under a .json name, as `datasets` accepts
            yield from _jsonl_rows(path)
            return
        raise ValueError(f"--data {path}: not a valid JSON file ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {path}: not valid UTF-8 ({e})") from None
    if isinstance(data, dict):  # one row: JSON Lines of one line under a .json name
        data = [data]
    if not isinstance(data, list):
        raise ValueError(f"--data {path}: a .json file must hold a list of rows (or rows one per line)")
    yield from ((f"{path}:row {i}", row) for i, row in enumerate(data))


def _arrow_rows(path: Path):
    """Rows of a parquet file (streamed in record batches) or a save_to_disk directory (memory-mapped)."""
    try:
        if path.is_dir():
            import datasets

            yield from ((f"{path}:row {i}", row) for i, row in enumerate(datasets.load_from_disk(str(path))))
            return
        import pyarrow.parquet as pq

        i = 0
        for record_batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in record_batch.to_pylist():
                yield f"{path}:row {i}", row
                i += 1
    except (OSError, ValueError) as e:  # pyarrow's errors derive from these; name the file, no traceback
        raise ValueError(f"--data {path}: cannot be read as a data set ({type(e).__name__}: {e})") from None


def _rows(path: Path):
    if _suffix(path) == ".jsonl":
        return _jsonl_rows(path)
    if _suffix(path) == ".json":
        return _json_rows(path)
    return _arrow_rows(path)


def _conversations(paths: list[str], skip_bad_rows: bool, stats: DataStats, require_assistant: bool):
    """(Conversation, the row as read) for every usable row of the --data inputs, in order. An input none of
    whose rows is usable under `skip_bad_rows` is named in `stats.unusable_inputs`: most likely a whole file
    in a format this does not read, whose loss would otherwise go unnoticed beside the other inputs (a
    shard of a hub dataset may hold only bad rows too, so it is said, not refused)."""
    for path in data_files(paths):
        file_stats = DataStats()
        for where, row in _rows(path):
            stats.rows += 1
            file_stats.rows += 1
            try:
                if isinstance(row, BadRow):
                    raise row
                if not isinstance(row, dict):
                    raise BadRow(f"{where}: a row must be a JSON object")
                messages = _normalise_messages(row, where, require_assistant)
                file_stats.kept += 1
                yield Conversation(where, messages, _row_template_kwargs(row, where)), row
            except BadRow as e:
                if not skip_bad_rows:
                    raise
                file_stats.skip(e)
                stats.skip(e, first_of_input=file_stats.bad_rows == 1)
        if file_stats.bad_rows:
            stats.bad_rows_by_input[str(path)] = file_stats.bad_rows
        if file_stats.rows and not file_stats.kept:
            stats.unusable_inputs.append(
                f"{path} ({file_stats.rows} rows; the first: {file_stats.bad_row_examples[0]})"
            )


def read_conversations(
    paths: list[str],
    skip_bad_rows: bool = False,
    stats: DataStats | None = None,
    require_assistant: bool = True,
    limit: int | None = None,
) -> list[Conversation]:
    """Rows of the --data inputs as Conversations, where = 'file:line' or 'file:row N'.

    `require_assistant=False` accepts prompt-only rows (for regeneration); `limit`: stop after that many
    usable rows (the rest is not read).

    A bad row raises BadRow naming its place and the reason, or with `skip_bad_rows` is counted in
    `stats` and skipped. Problems of a whole file (missing, wrong type) always raise."""
    stats = stats if stats is not None else DataStats()
    rows = list(itertools.islice(_conversations(paths, skip_bad_rows, stats, require_assistant), limit))
    if not rows:
        raise ValueError(_no_rows(paths, stats))
    return [c for c, _ in rows]


def read_conversations_and_rows(
    paths: list[str],
    skip_bad_rows: bool = False,
    stats: DataStats | None = None,
    require_assistant: bool = True,
) -> list[tuple[Conversation, dict]]:
    """read_conversations' rows, each with the row itself as read (every field, the conversation in its own
    format): regeneration writes the rows back with only their answers replaced."""
    stats = stats if stats is not None else DataStats()
    rows = list(_conversations(paths, skip_bad_rows, stats, require_assistant))
    if not rows:
        raise ValueError(_no_rows(paths, stats))
    return rows


def _no_rows(paths: list[str], stats: DataStats) -> str:
    named = ", ".join(paths)
    if not stats.rows:
        return f"--data {named}: no usable rows (the input is empty)"
    first = f"; the first: {stats.bad_row_examples[0]}" if stats.bad_row_examples else ""
    return f"--data {named}: no usable rows ({stats.rows} read, {stats.bad_rows} bad and skipped{first})"
