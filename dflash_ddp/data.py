"""Conversations -> token ids with an assistant-only loss mask -> token-budget batches in a seeded order.

The order contract (design.md): the list of global batches of an epoch is a pure function of
(seed, epoch, the tokenized data, the batching settings), independent of how many ranks consume it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


@dataclass
class Sample:
    """One tokenized conversation."""

    sample_id: int
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class Batch:
    """A right-padded batch of samples, as the target and the drafter consume it."""

    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S] 1 = real token
    loss_mask: torch.Tensor  # [B, S] 1 = assistant token
    sample_ids: torch.Tensor  # [B]

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


@dataclass
class DataStats:
    """Counts printed at start and stored in the run directory."""

    rows: int = 0
    bad_rows: int = 0  # skipped with --skip_bad_rows
    truncated: int = 0
    too_short: int = 0
    kept: int = 0
    bad_row_examples: list[str] = field(default_factory=list)

    def skip(self, error: BadRow) -> None:
        """Count a skipped row (--skip_bad_rows), keeping the first few reasons for data_stats.json."""
        self.bad_rows += 1
        if len(self.bad_row_examples) < 10:
            self.bad_row_examples.append(str(error))


class BadRow(ValueError):
    """A row that cannot be used; `--skip_bad_rows` skips and counts these instead of stopping."""


def _normalise_messages(row: dict, where: str, require_assistant: bool = True) -> list[dict]:
    if "messages" in row:
        turns = row["messages"]
        role_key, text_key = "role", "content"
    elif "conversations" in row:
        turns = row["conversations"]
        role_key, text_key = "from", "value"
    else:
        raise BadRow(f"{where}: the row has neither 'messages' nor 'conversations'")
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"{where}: the conversation is empty or not a list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise BadRow(f"{where}: turn {i} needs '{role_key}' and '{text_key}'")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise BadRow(f"{where}: turn {i} has unknown role '{turn[role_key]}'")
        if not isinstance(turn[text_key], str):
            raise BadRow(f"{where}: turn {i} '{text_key}' must be a string")
        if role == "assistant" and not turn[text_key].strip():
            raise BadRow(f"{where}: turn {i} is an empty assistant turn")
        messages.append({"role": role, "content": turn[text_key]})
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadRow(f"{where}: the conversation has no assistant turn")
    return messages


def expand_paths(paths: list[str]) -> list[Path]:
    """Files named directly or through glob patterns, in a stable order."""
    files = []
    for path in paths:
        if glob.has_magic(path):
            matched = sorted(glob.glob(path))
            if not matched:
                raise ValueError(f"--data {path}: the pattern matches no file")
            files += [Path(m) for m in matched]
        elif not Path(path).is_file():
            raise ValueError(f"--data {path}: file not found")
        else:
            files.append(Path(path))
    return files


def _jsonl_rows(path: Path):
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            if not raw.strip():
                continue
            try:
                yield where, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield where, BadRow(f"{where}: not valid UTF-8")
            except json.JSONDecodeError as e:
                yield where, BadRow(f"{where}: malformed JSON ({e.msg})")


def _json_rows(path: Path):
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--data {path}: not a valid UTF-8 JSON file ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"--data {path}: a .json file must hold a list of rows")
    yield from ((f"{path}:row {i}", row) for i, row in enumerate(data))


def read_conversations(
    paths: list[str],
    skip_bad_rows: bool = False,
    stats: DataStats | None = None,
    require_assistant: bool = True,
):
    """Rows of jsonl/json files as (where, messages), where = 'file:line'.

    `require_assistant=False` accepts prompt-only rows (for regeneration).

    A bad row raises BadRow naming its place and the reason, or with `skip_bad_rows` is counted in
    `stats` and skipped. Problems of a whole file (missing, wrong type) always raise."""
    stats = stats if stats is not None else DataStats()
    rows = []
    for path in expand_paths(paths):
        if path.suffix not in (".jsonl", ".json"):
            raise ValueError(f"--data {path}: unsupported file type '{path.suffix}' (use .jsonl or .json)")
        for where, row in _jsonl_rows(path) if path.suffix == ".jsonl" else _json_rows(path):
            stats.rows += 1
            try:
                if isinstance(row, BadRow):
                    raise row
                if not isinstance(row, dict):
                    raise BadRow(f"{where}: a row must be a JSON object")
                rows.append((where, _normalise_messages(row, where, require_assistant)))
            except BadRow as e:
                if not skip_bad_rows:
                    raise
                stats.skip(e)
    if not rows:
        raise ValueError(f"--data {paths}: no usable rows")
    return rows


def tokenize_conversation(tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """Token ids and assistant mask from the tokenizer's own chat template (its generation markers)."""
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if not any(mask):
        raise BadRow(
            f"{where}: the loss mask is all zeros: the chat template marks no assistant tokens "
            "({% generation %} markers are needed)"
        )
    return ids, mask


def tokenize_dataset(
    tokenizer, paths: list[str], max_seq_len: int, block_size: int, skip_bad_rows: bool = False
) -> tuple[list[Sample], DataStats]:
    """Tokenize, truncate to max_seq_len, and drop samples with fewer than 2*block_size response tokens."""
    if not tokenizer.chat_template:
        raise ValueError(
            "the tokenizer of --target_model has no chat template: add one to its tokenizer_config.json"
        )
    stats = DataStats()
    samples = []
    for where, messages in read_conversations(paths, skip_bad_rows, stats):
        try:
            ids, mask = tokenize_conversation(tokenizer, messages, where)
        except BadRow as e:
            if not skip_bad_rows:
                raise
            stats.skip(e)
            continue
        if len(ids) > max_seq_len:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            stats.truncated += 1
        if sum(mask[1:]) < 2 * block_size:
            stats.too_short += 1
            continue
        samples.append(Sample(sample_id=len(samples), input_ids=ids, loss_mask=mask))
    stats.kept = len(samples)
    if not samples:
        raise ValueError(f"--data {paths}: no sample has at least {2 * block_size} response tokens")
    return samples, stats


def data_fingerprint(samples: list[Sample]) -> str:
    """A content hash of the tokenized data (ids and masks), stored with checkpoints."""
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.input_ids, s.loss_mask]).encode())
    return h.hexdigest()[:16]


def epoch_batches(lengths: list[int], tokens_per_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """The global batches of one epoch, as lists of sample indices.

    A seeded permutation, then buckets of similar length (sorting within windows of the permutation),
    then greedy packing under the padded-token budget B * max_len <= tokens_per_batch, then a seeded
    shuffle of the batches. A new epoch gives a new permutation, so batch composition changes too.
    """
    rng = random.Random(f"dflash-batches:{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = 64 * max(1, tokens_per_batch // max(1, max(lengths)))
    batches = []
    for start in range(0, len(order), window):
        bucket = sorted(order[start : start + window], key=lambda i: (lengths[i], i))
        current, longest = [], 0
        for i in bucket:
            longest_if_added = max(longest, lengths[i])
            if current and longest_if_added * (len(current) + 1) > tokens_per_batch:
                batches.append(current)
                current, longest_if_added = [], lengths[i]
            current.append(i)
            longest = longest_if_added
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(samples: list[Sample], pad_id: int) -> Batch:
    """Right-pad samples into a Batch."""
    longest = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), longest), dtype=torch.long)
    loss = torch.zeros((len(samples), longest), dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        ids[b, :n] = torch.tensor(s.input_ids)
        attn[b, :n] = 1
        loss[b, :n] = torch.tensor(s.loss_mask)
    return Batch(ids, attn, loss, torch.tensor([s.sample_id for s in samples]))
