"""The rows of a regeneration and their turns: which assistant turns to generate, the prompts the target's
chat template renders for them, and the rounds that generate them (round j answers every row's j-th turn,
after its earlier turns were regenerated). Who generates is a parameter: the target through transformers'
`generate` (regenerate.py) or a serving engine (served.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol

import torch
from jinja2 import TemplateError

from dflash_ddp.data.chat_template import row_template_kwargs
from dflash_ddp.data.sources import BadRow


@dataclass
class Row:
    """One input conversation and the positions of the assistant turns to generate, in order."""

    index: int
    where: str
    messages: list[dict]
    targets: list[int]  # message positions; len(messages) means "append a turn"
    template_kwargs: dict = field(default_factory=dict)  # the row's own chat_template_kwargs


def plan_row(index: int, where: str, messages: list[dict], template_kwargs: dict | None = None) -> Row:
    """Every assistant turn is regenerated, except those that call tools (the tool results after them answer
    those very calls, so they are kept as written); a trailing user or tool turn gets a reply. BadRow if
    nothing is left."""
    targets = [i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")]
    if messages[-1]["role"] in ("user", "tool"):
        targets.append(len(messages))
    if not targets:
        raise BadRow(
            f"{where}: nothing to generate (no assistant turn, and the last turn is not a user turn)"
        )
    if targets[0] == 0:
        raise BadRow(f"{where}: turn 0 is an assistant turn, so there is no prompt to answer")
    return Row(index, where, messages, targets, template_kwargs or {})


@dataclass
class Answer:
    """One generated turn: decoded text (special tokens and surrounding whitespace removed) and its length."""

    text: str
    new_tokens: int  # generated tokens, EOS included
    hit_max_new_tokens: bool  # stopped by --max_new_tokens before any EOS


class ChatTurns:
    """The target's tokenizer and chat template: a row's prompt ids, and generated ids as an answer."""

    def __init__(self, tokenizer, template_kwargs: dict, eos: set[int]):
        self.tokenizer, self.template_kwargs, self.eos = tokenizer, template_kwargs, eos

    def prompt_ids(self, row: Row, messages: list[dict]) -> list[int]:
        """Prompt ids ending in the generation prompt, with the row's template arguments over the run's;
        BadRow naming the row when the template refuses it."""
        kwargs = row_template_kwargs(self.template_kwargs, row.template_kwargs, row.where)
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
            )
        # e.g. a template's raise_exception on a role order it does not accept
        except (TemplateError, ValueError, TypeError) as e:
            raise BadRow(f"{row.where}: the chat template failed on this conversation ({e})") from None
        return list(rendered["input_ids"])

    def answer(self, generated: list[int]) -> Answer:
        """The text up to the first EOS; without one the turn never finished (cut by max_new_tokens)."""
        end = next((i for i, t in enumerate(generated) if t in self.eos), None)
        tokens = generated if end is None else generated[:end]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        return Answer(text, len(generated) if end is None else end + 1, end is None)


class TurnGenerator(Protocol):
    """What the rounds need: a row's prompt, and the answers to a list of prompts (in order)."""

    def prompt_ids(self, row: Row, messages: list[dict]) -> list[int]: ...

    def __call__(self, prompts: list[list[int]]) -> list[Answer]: ...


def seed_of(*parts: int) -> int:
    """A seed from integers (the run's seed, then a batch, or a row and a round): a hash, so that neighbours
    get unrelated streams."""
    digest = hashlib.sha256(("dflash-regenerate:" + ":".join(map(str, parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def regenerate_batch(
    generate: TurnGenerator, rows: list[Row], seed: int, skip_bad_rows: bool = False
) -> list[dict]:
    """The finished records of `rows`, round by round; seeded first, so recomputing a batch gives the same
    answers whatever ran before.

    A row whose prompt the chat template refuses (in any round) raises BadRow, or with `skip_bad_rows`
    leaves this and later rounds and is finished as {"row", "bad"}: done for good, never retried."""
    torch.manual_seed(seed)
    messages = [[dict(m) for m in row.messages] for row in rows]
    hit, new_tokens = [False] * len(rows), [0] * len(rows)
    bad: dict[int, str] = {}  # batch position -> the reason
    for j in range(max(len(row.targets) for row in rows)):
        prompts = {}  # batch position -> prompt ids, for the rows taking part in round j
        for b, row in enumerate(rows):
            if j >= len(row.targets) or b in bad:
                continue
            try:
                prompts[b] = generate.prompt_ids(row, messages[b][: row.targets[j]])
            except BadRow as e:
                if not skip_bad_rows:
                    raise BadRow(
                        f"{e}. Pass --skip_bad_rows to skip and count such rows; the finished rows are kept, "
                        "so the same command with --skip_bad_rows continues this run"
                    ) from None
                bad[b] = str(e)
        if not prompts:  # every row left is bad
            continue
        for b, answer in zip(prompts, generate(list(prompts.values())), strict=True):
            position, turn = rows[b].targets[j], {"role": "assistant", "content": answer.text}
            if position == len(messages[b]):
                messages[b].append(turn)
            else:
                messages[b][position] = turn
            hit[b] |= answer.hit_max_new_tokens
            new_tokens[b] += answer.new_tokens
    return [
        record(row, messages[b], hit[b], new_tokens[b]) if b not in bad else {"row": row.index, "bad": bad[b]}
        for b, row in enumerate(rows)
    ]


def record(row: Row, messages: list[dict], hit: bool, new_tokens: int) -> dict:
    """A finished row as its part-file line ("row" first: the index reads only that); the row's own template
    arguments travel with it, so that training renders it as it was generated."""
    out = {"row": row.index, "messages": messages, "hit_max_new_tokens": hit, "new_tokens": new_tokens}
    return out | ({"chat_template_kwargs": row.template_kwargs} if row.template_kwargs else {})
