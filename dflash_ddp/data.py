"""Conversations -> token ids with an assistant-only loss mask -> token-budget batches in a seeded order.

The order contract (design.md): the list of global batches of an epoch is a pure function of
(seed, epoch, the tokenized data, the batching settings), independent of how many ranks consume it.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
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
    truncated: int = 0
    too_short: int = 0
    kept: int = 0


def _normalise_messages(row: dict, where: str) -> list[dict]:
    if "messages" in row:
        turns = row["messages"]
        role_key, text_key = "role", "content"
    elif "conversations" in row:
        turns = row["conversations"]
        role_key, text_key = "from", "value"
    else:
        raise ValueError(f"{where}: the row has neither 'messages' nor 'conversations'")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: the conversation is empty or not a list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise ValueError(f"{where}: turn {i} needs '{role_key}' and '{text_key}'")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise ValueError(f"{where}: turn {i} has unknown role '{turn[role_key]}'")
        if not isinstance(turn[text_key], str):
            raise ValueError(f"{where}: turn {i} '{text_key}' must be a string")
        messages.append({"role": role, "content": turn[text_key]})
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the conversation has no assistant turn")
    return messages


def read_conversations(paths: list[str]) -> list[tuple[str, list[dict]]]:
    """Rows of jsonl/json files as (where, messages), where = 'file:line'. Bad rows raise with their place."""
    rows = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--data {path}: file not found")
        if p.suffix == ".jsonl":
            with p.open("rb") as f:
                for line_no, raw in enumerate(f, start=1):
                    where = f"{path}:{line_no}"
                    if not raw.strip():
                        continue
                    try:
                        row = json.loads(raw.decode("utf-8"))
                    except UnicodeDecodeError:
                        raise ValueError(f"{where}: not valid UTF-8") from None
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{where}: malformed JSON ({e.msg})") from None
                    rows.append((where, _normalise_messages(row, where)))
        elif p.suffix == ".json":
            data = json.loads(p.read_text(encoding="utf-8"))
            if not isinstance(data, list):
                raise ValueError(f"--data {path}: a .json file must hold a list of rows")
            rows.extend(
                (f"{path}:row {i}", _normalise_messages(r, f"{path}:row {i}")) for i, r in enumerate(data)
            )
        else:
            raise ValueError(f"--data {path}: unsupported file type '{p.suffix}' (use .jsonl or .json)")
    if not rows:
        raise ValueError(f"--data {paths}: no rows")
    return rows


def tokenize_conversation(tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """Token ids and assistant mask from the tokenizer's own chat template (its generation markers)."""
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer of --target_model has no chat template (needed for {where})")
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if not any(mask):
        raise ValueError(
            f"{where}: the loss mask is all zeros: the chat template marks no assistant tokens "
            "({% generation %} markers are needed)"
        )
    return ids, mask


def tokenize_dataset(
    tokenizer, paths: list[str], max_seq_len: int, block_size: int
) -> tuple[list[Sample], DataStats]:
    """Tokenize, truncate to max_seq_len, and drop samples with fewer than 2*block_size response tokens."""
    stats = DataStats()
    samples = []
    for where, messages in read_conversations(paths):
        stats.rows += 1
        ids, mask = tokenize_conversation(tokenizer, messages, where)
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
