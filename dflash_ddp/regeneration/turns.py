"""The rows of a regeneration and their turns: which assistant turns to generate, the prompts the target's
chat template renders for them, the rounds that generate them (round j answers every row's j-th turn,
after its earlier turns were regenerated), and the row written back with its answers replaced and every
other field kept. Who generates is a parameter: the target through transformers' `generate`
(regenerate.py) or a serving engine (served.py)."""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Protocol

import torch
from jinja2 import TemplateError

from dflash_ddp.data.chat_template import check_tool_calls_rendered, row_template_kwargs
from dflash_ddp.data.sources import ROLE_ALIASES, BadRow, row_format, system_turn_added


@dataclass
class Row:
    """One input conversation and the positions of the assistant turns to generate, in order."""

    index: int
    where: str
    messages: list[dict]  # the turns as the chat template takes them (roles normalised)
    targets: list[int]  # message positions; len(messages) means "append a turn"
    template_kwargs: dict = field(default_factory=dict)  # the row's own chat_template_kwargs
    fields: dict = field(default_factory=dict)  # the row as read: every field, written back by output_row


def plan_row(
    index: int,
    where: str,
    messages: list[dict],
    template_kwargs: dict | None = None,
    fields: dict | None = None,
) -> Row:
    """Every assistant turn is regenerated, except those that call tools (the tool results after them answer
    those very calls, so they are kept as written); a trailing user or tool turn gets a reply. BadRow if
    nothing is left, or if a field of the row (`fields`, as read; by default the row of `messages` and
    `template_kwargs` alone) cannot be written back as JSON."""
    targets = [i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")]
    if messages[-1]["role"] in ("user", "tool"):
        targets.append(len(messages))
    if not targets:
        raise BadRow(
            f"{where}: nothing to generate (no assistant turn to regenerate: those that call tools are kept as "
            "written; and the last turn is not a user or tool turn); pass --skip_bad_rows to skip and count such rows"
        )
    if targets[0] == 0:
        raise BadRow(f"{where}: turn 0 is an assistant turn, so there is no prompt to answer")
    if fields is None:
        fields = {"messages": messages} | (
            {"chat_template_kwargs": template_kwargs} if template_kwargs else {}
        )
    return Row(index, where, messages, targets, template_kwargs or {}, json_fields(fields, where))


def _json_default(value):
    if isinstance(value, (datetime.date, datetime.time)):  # a parquet timestamp or date column
        return value.isoformat()
    raise TypeError(type(value).__name__)


def json_fields(fields: dict, where: str) -> dict:
    """The row's fields as the output writes them (JSON: a parquet column's dates and times as ISO text),
    checked before anything is generated; BadRow naming a field that JSON cannot hold (bytes, an image)."""
    out = {}
    for name, value in fields.items():
        try:
            out[name] = json.loads(json.dumps(value, default=_json_default))
        except (TypeError, ValueError) as e:
            raise BadRow(
                f"{where}: field {name!r} cannot be written to the regenerated row as JSON ({e}); drop that "
                "column from the data, or pass --skip_bad_rows to skip and count such rows"
            ) from None
    return out


def output_row(row: Row, messages: list[dict]) -> dict:
    """The row as read with its regenerated answers: every field, and every turn not regenerated, kept as
    they were; each regenerated assistant turn (and an appended answer) written in the row's own format,
    `messages` ({role, content}) or ShareGPT `conversations` ({from, value}; or {role, content} as
    SpecForge writes them), the assistant named as the row's own assistant turns name it. A regenerated turn
    is replaced whole: its other keys (reasoning_content ...) belonged to the answer it replaces; the
    reasoning a model wrote in a channel of its own (gpt-oss) is its `reasoning_content`."""
    key, role_key, text_key = row_format(row.fields)
    turns = list(row.fields[key])
    speaker = next(
        (t[role_key] for t in turns if ROLE_ALIASES.get(str(t[role_key]).lower()) == "assistant"),
        "assistant" if role_key == "role" else "gpt",
    )
    added = int(system_turn_added(row.fields))  # the row's `system` field, read as its first turn
    for position in row.targets:
        turn = {role_key: speaker, text_key: messages[position]["content"]}
        if "reasoning_content" in messages[position]:
            turn["reasoning_content"] = messages[position]["reasoning_content"]
        if position - added == len(turns):
            turns.append(turn)
        else:
            turns[position - added] = turn
    return {**row.fields, key: turns}


@dataclass
class Answer:
    """One generated turn: decoded text (special tokens and surrounding whitespace removed) and its length."""

    text: str
    new_tokens: int  # generated tokens, EOS included
    hit_max_new_tokens: bool  # stopped by --max_new_tokens before any EOS
    reasoning: str = ""  # the reasoning the model wrote in a channel of its own (gpt-oss's analysis)
    # special tokens that structure the answer (a tool call in the model's own format) and that a stored
    # text cannot keep: the turn is a bad row
    lost: tuple[str, ...] = ()

    def turn(self) -> dict:
        """The answer as the assistant turn written back."""
        turn = {"role": "assistant", "content": self.text}
        if self.reasoning:
            turn["reasoning_content"] = self.reasoning
        return turn


# one message of gpt-oss's harmony format: its channel (any header after it), its text, its end
HARMONY_MESSAGE = re.compile(r"<\|channel\|>(\w+)[^<]*<\|message\|>(.*?)(?:<\|end\|>)?", re.S)
HARMONY_CUT_MESSAGE = re.compile(r"<\|channel\|>(\w+)[^<]*<\|message\|>(.*)", re.S)  # its text cut anywhere


def harmony_answer(text: str, cut: bool = False) -> tuple[str, str] | None:
    """(reasoning, answer) of text generated in gpt-oss's harmony format (decoded with its special tokens),
    or None where it is not that format or holds more than analysis and final messages (a tool call).
    `cut`: generation stopped at --max_new_tokens, so the last message may have been cut anywhere."""
    reasoning, final = [], []
    head, start, tail = text.rpartition("<|start|>")
    if cut and start and "assistant".startswith(tail):  # a next message cut before its channel: nothing yet
        text = head
    messages = text.split("<|start|>assistant")
    for position, message in enumerate(messages):
        match = HARMONY_MESSAGE.fullmatch(message)
        if match is None and cut and position == len(messages) - 1:
            if "<|message|>" not in message:  # cut in its header: none of its text yet
                continue
            match = HARMONY_CUT_MESSAGE.fullmatch(message)
        if match is None or match[1] not in ("analysis", "final"):
            return None
        (reasoning if match[1] == "analysis" else final).append(match[2])
    return "\n".join(reasoning).strip(), "".join(final).strip()


class ChatTurns:
    """The target's tokenizer and chat template: a row's prompt ids, and generated ids as an answer."""

    def __init__(self, tokenizer, template_kwargs: dict, eos: set[int]):
        self.tokenizer, self.template_kwargs, self.eos = tokenizer, template_kwargs, eos
        # the ids a decode without special tokens leaves out: the named ones and every added token marked special
        decoder = getattr(tokenizer, "added_tokens_decoder", {})
        self.special_ids = set(tokenizer.all_special_ids) | {i for i, t in decoder.items() if t.special}

    def prompt_ids(self, row: Row, messages: list[dict]) -> list[int]:
        """Prompt ids ending in the generation prompt, with the row's template arguments over the run's;
        BadRow naming the row when the template refuses it."""
        kwargs = row_template_kwargs(self.template_kwargs, row.template_kwargs, row.where)
        check_tool_calls_rendered(
            lambda m: self.tokenizer.apply_chat_template(m, tokenize=False, **kwargs), messages, row.where
        )
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
            )
        # e.g. a template's raise_exception on a role order it does not accept
        except (TemplateError, ValueError, TypeError) as e:
            raise BadRow(f"{row.where}: the chat template failed on this conversation ({e})") from None
        return list(rendered["input_ids"])

    def answer(self, generated: list[int]) -> Answer:
        """The text up to the first EOS; without one the turn never finished (cut by max_new_tokens). Special
        tokens inside it structure the answer: gpt-oss's channels are read into reasoning and answer; others
        (a tool call in the model's own tokens) are named as `lost`."""
        end = next((i for i, t in enumerate(generated) if t in self.eos), None)
        tokens = generated if end is None else generated[:end]
        length, unfinished = len(generated) if end is None else end + 1, end is None
        specials = [t for t in tokens if t in self.special_ids]
        if specials:
            harmony = harmony_answer(self.tokenizer.decode(tokens, skip_special_tokens=False), unfinished)
            if harmony is not None:
                return Answer(harmony[1], length, unfinished, reasoning=harmony[0])
        text = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        lost = tuple(dict.fromkeys(self.tokenizer.convert_ids_to_tokens(specials)))
        return Answer(text, length, unfinished, lost=lost)


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

    def refuse(b: int, reason: str) -> None:
        if not skip_bad_rows:  # the reason may name --skip_bad_rows itself already
            said = "--skip_bad_rows" in reason
            raise BadRow(
                f"{reason}{'' if said else '. Pass --skip_bad_rows to skip and count such rows'}; the "
                "finished rows are kept, so the same command with --skip_bad_rows continues this run"
            ) from None
        bad[b] = reason

    for j in range(max(len(row.targets) for row in rows)):
        prompts = {}  # batch position -> prompt ids, for the rows taking part in round j
        for b, row in enumerate(rows):
            if j >= len(row.targets) or b in bad:
                continue
            try:
                prompts[b] = generate.prompt_ids(row, messages[b][: row.targets[j]])
            except BadRow as e:
                refuse(b, str(e))
        if not prompts:  # every row left is bad
            continue
        for b, answer in zip(prompts, generate(list(prompts.values())), strict=True):
            if answer.lost:
                refuse(
                    b,
                    f"{rows[b].where}: turn {rows[b].targets[j]}: the target answered with special tokens "
                    f"({', '.join(answer.lost)}) that structure its answer (a tool call or a channel in its own "
                    "tokens) and that a stored text cannot keep",
                )
                continue
            position = rows[b].targets[j]
            if position == len(messages[b]):
                messages[b].append(answer.turn())
            else:
                messages[b][position] = answer.turn()
            hit[b] |= answer.hit_max_new_tokens
            new_tokens[b] += answer.new_tokens
    return [
        record(row, messages[b], hit[b], new_tokens[b]) if b not in bad else {"row": row.index, "bad": bad[b]}
        for b, row in enumerate(rows)
    ]


def record(row: Row, messages: list[dict], hit: bool, new_tokens: int) -> dict:
    """A finished row as its part-file line ("row" first: the index reads only that). Its other fields are
    not repeated here: the merge takes them from the input (whose bytes settings.json pins), output_row."""
    return {"row": row.index, "messages": messages, "hit_max_new_tokens": hit, "new_tokens": new_tokens}
