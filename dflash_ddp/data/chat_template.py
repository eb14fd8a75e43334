"""A conversation -> token ids and the assistant-only loss mask, with the target's own chat template.

The mask covers what the model itself generates after the generation prompt: the assistant's text up to
and including its end-of-turn token. Two ways to find it:

- the template has `{% generation %}` markers: transformers' `return_assistant_tokens_mask` reads them;
- it has none (the official Qwen3 and Llama-3 templates): each assistant turn i starts where the
  rendering of the conversation before it, with the generation prompt, stops matching the rendering of the
  whole conversation, and ends after the end-of-turn special token the template writes after an answer
  (learned once from a probe conversation), never past the turn's own rendering (Llama 3.1 ends a tool
  call with <|eom_id|>). A template that later rewrites the turn itself (Qwen3 drops
  the thinking block of answers before the last user turn) is handled: both ends are found in the whole
  conversation's rendering. One that rewrites text BEFORE the turn (Mistral moves the system prompt to
  the last user turn; Qwen3 drops the thinking of an earlier tool-calling turn) is refused for that row,
  never mis-masked: add {% generation %} markers to such a template.

Either way, a trained turn whose context is not its generation prompt (R1's distilled models open <think> in
the prompt and drop it from the history) is reported with the row (`context_note`), not refused.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from jinja2 import TemplateError

from dflash_ddp.data.sources import BadRow

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


PROBE = "\u2063dflash-probe"  # invisible separator: never part of real text


# apply_chat_template's own arguments: passed through --chat_template_kwargs they would collide or change
# what is rendered (a generation prompt after every conversation, token ids instead of text)
RESERVED_KWARGS = {
    "add_generation_prompt",
    "chat_template",
    "continue_final_message",
    "conversation",
    "documents",
    "messages",
    "return_assistant_tokens_mask",
    "return_dict",
    "tokenize",
    "tools",
}


def check_template_kwargs(kwargs: dict) -> None:
    """Refuse --chat_template_kwargs keys that are apply_chat_template's own arguments."""
    clash = sorted(RESERVED_KWARGS & set(kwargs))
    if clash:
        raise ValueError(
            f"--chat_template_kwargs: {', '.join(clash)} cannot be set (chat rendering sets it); pass only "
            "the template's own variables, such as enable_thinking"
        )


def row_template_kwargs(run_kwargs: dict, row_kwargs: dict, where: str) -> dict:
    """The template arguments of one row: its own over the run's; BadRow naming the row when it sets one of
    apply_chat_template's own arguments."""
    clash = sorted(RESERVED_KWARGS & set(row_kwargs))
    if clash:
        raise BadRow(
            f"{where}: chat_template_kwargs sets {', '.join(clash)}, which chat rendering sets itself: keep only "
            "the template's own variables, such as enable_thinking"
        )
    return {**run_kwargs, **row_kwargs}


def load_target_tokenizer(target_dir: str | Path, template_file: str = ""):
    """The target's tokenizer (local files only) with `--chat_template` applied; ValueError naming the
    directory when it cannot be loaded or ends up without a chat template."""
    from transformers import AutoTokenizer  # here: config.py imports this module and stays light

    if Path(target_dir).is_dir() and not any(
        any(Path(target_dir).glob(pattern)) for pattern in ("tokenizer*", "vocab*", "*.tiktoken", "*.model")
    ):  # transformers would build an empty tokenizer of the model type, or ask for sentencepiece
        raise ValueError(
            f"--target_model {target_dir}: no tokenizer files (tokenizer.json, tokenizer_config.json, ...) in the "
            "directory; copy them from the model's release"
        )
    try:  # never run a checkpoint's own code, nor ask on a terminal whether to
        tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            raise ValueError(
                f"--target_model {target_dir}: its tokenizer is code of its own (auto_map), which is not run; "
                "use a release of the model whose tokenizer transformers loads by itself (a tokenizer.json)"
            ) from None
        raise ValueError(f"--target_model {target_dir}: cannot load its tokenizer ({e})") from None
    load_chat_template(tokenizer, template_file)
    return tokenizer


def tokenizer_code_note(target_dir: str | Path) -> str:
    """A warning when the target's tokenizer_config.json names a tokenizer class of its own code (auto_map),
    which transformers skips without running it, reading the tokenizer files instead ("" otherwise)."""
    path = Path(target_dir) / "tokenizer_config.json"
    try:
        auto_map = json.loads(path.read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return ""
    # {"AutoTokenizer": [slow, fast]} or one name; an older form is the [slow, fast] list itself
    own = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
    own = [own] if isinstance(own, str) else own if isinstance(own, list) else []
    if not any(own):
        return ""
    return (
        f"note: {path} names a tokenizer of its own code ({', '.join(str(c) for c in own if c)}), which is "
        "not run: the tokens come from its tokenizer files as transformers reads them; if the model's own "
        "tokenizer splits text otherwise, the drafter learns other tokens than the server sends (compare "
        "the two on a few rows, or pass a release whose tokenizer needs no code of its own)"
    )


def load_chat_template(tokenizer, template_file: str) -> None:
    """Replace the tokenizer's chat template with the jinja file `--chat_template` names (if any)."""
    if template_file:
        path = Path(template_file)
        if not path.is_file():
            raise ValueError(
                f"--chat_template {template_file}: file not found (a Jinja file, not a template's name: leave it "
                "out to use the target tokenizer's own template)"
            )
        tokenizer.chat_template = path.read_text(encoding="utf-8")
    if not tokenizer.chat_template:
        raise ValueError(
            "the tokenizer of --target_model has no chat template: add one to its tokenizer_config.json "
            "or pass --chat_template FILE.jinja"
        )


@dataclass
class ChatTokenizer:
    """Renders and tokenizes conversations; picklable, so tokenization can run in worker processes."""

    tokenizer: object
    template_kwargs: dict
    last_turn_only: bool = False

    def __post_init__(self):
        self.has_generation_markers = bool(GENERATION_MARKER.search(self.tokenizer.chat_template))
        if not self.has_generation_markers and not self.tokenizer.is_fast:
            raise ValueError(
                "the chat template has no {% generation %} markers and the tokenizer is not a fast "
                "tokenizer: the assistant spans need character offsets (use a tokenizer.json tokenizer)"
            )
        self.end_of_turn = self._end_of_turn_text()

    def render(
        self, messages: list[dict], add_generation_prompt: bool = False, kwargs: dict | None = None
    ) -> str:
        """The conversation as text, with the template's own arguments (`kwargs`: a row's, run's included)."""
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(self.template_kwargs if kwargs is None else kwargs),
        )

    def _end_of_turn_text(self) -> str | None:
        """The special token the template writes right after an answer ('<|im_end|>', '<|eot_id|>', '</s>'),
        found after both answers of a two-exchange probe; None when there is none (or not the same one
        after both), and spans then end where the next rendering prefix starts."""
        first, last = PROBE + "1", PROBE + "2"
        probe = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "and?"},
            {"role": "assistant", "content": last},
        ]
        try:
            text = self.render(probe)
        except (TemplateError, ValueError, TypeError) as e:
            raise ValueError(
                f"the chat template (--chat_template, or the tokenizer's own) cannot render a user/assistant "
                f"exchange: {type(e).__name__}: {e}"
            ) from None
        if first not in text or last not in text:
            raise ValueError("the chat template does not render the assistant's content verbatim")
        specials = sorted(
            set(self.tokenizer.all_special_tokens) | set(self.tokenizer.get_added_vocab()),
            key=len,
            reverse=True,
        )
        after = [text.split(answer, 1)[1].lstrip() for answer in (first, last)]
        token = next((t for t in specials if t and after[0].startswith(t)), None)
        return token if token and after[1].startswith(token) else None

    def __call__(
        self, messages: list[dict], where: str, row_kwargs: dict | None = None
    ) -> MaskedConversation:
        """Token ids and the 0/1 assistant mask of one conversation (rendered with the row's own template
        arguments over the run's), and a note when a trained turn follows other text than the generation
        prompt the target is served with; BadRow when it cannot be masked."""
        kwargs = row_template_kwargs(self.template_kwargs, row_kwargs or {}, where)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.last_turn_only:
            turns = turns[-1:]
        try:
            text = self.render(messages, kwargs=kwargs)
            if self.has_generation_markers:
                # the prompts serve the context check alone: a template that refuses a part of the
                # conversation (Qwen3-2507's "No user query found") still masks the whole by its markers
                prompts = self._prompts(messages, turns, kwargs)
                ids, mask = self._marked(messages, kwargs, prompts.get(turns[-1]) if turns else None)
            else:
                prompts = {
                    i: self.render(messages[:i], add_generation_prompt=True, kwargs=kwargs)
                    for i in turns
                    if i
                }
                ids, mask = self._by_prefixes(messages, where, kwargs, text, turns, prompts)
        except BadRow:
            raise
        except (
            TemplateError,
            ValueError,
            TypeError,
        ) as e:  # a template's raise_exception, an empty prefix...
            raise BadRow(f"{where}: the chat template refuses this conversation: {e}") from None
        if not any(mask):
            raise BadRow(f"{where}: the loss mask is all zeros: the chat template marks no assistant tokens")
        check_tool_calls_rendered(lambda m: self.render(m, kwargs=kwargs), messages, where)
        return MaskedConversation(ids, mask, context_note(text, prompts, where))

    def _prompts(self, messages: list[dict], turns: list[int], kwargs: dict) -> dict[int, str]:
        """Each trained turn's generation prompt, or none where the template refuses one of them."""
        try:
            return {
                i: self.render(messages[:i], add_generation_prompt=True, kwargs=kwargs) for i in turns if i
            }
        except (TemplateError, ValueError, TypeError):
            return {}

    def _marked(
        self, messages: list[dict], kwargs: dict, last_prompt: str | None
    ) -> tuple[list[int], list[int]]:
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        if self.last_turn_only and any(mask):
            mask = self._last_turn(ids, mask, last_prompt)
        return ids, mask

    def _last_turn(self, ids: list[int], mask: list[int], last_prompt: str | None) -> list[int]:
        """The marked tokens of the last turn: from where its generation prompt's tokens end (a template may
        mark a turn in pieces: a reasoning channel, then the answer); the last marked run where the prompt
        parts from the conversation before its end (a system prompt that counts the turns)."""
        runs = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
        start = runs[-1]
        if last_prompt is not None:
            prompt_ids = self.tokenizer(last_prompt, add_special_tokens=False)["input_ids"]
            agree = next(
                (k for k, (a, b) in enumerate(zip(prompt_ids, ids, strict=False)) if a != b), len(prompt_ids)
            )
            if agree >= len(prompt_ids) - 1:  # the prompt's last token may merge with the answer's first
                start = agree
        return [m if k >= start else 0 for k, m in enumerate(mask)]

    def _by_prefixes(
        self, messages: list[dict], where: str, kwargs: dict, text: str, turns: list[int], prompts: dict
    ) -> tuple[list[int], list[int]]:
        spans = [self._span(messages, i, text, where, kwargs, prompts) for i in turns]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        # a token overlapping a span is the model's to predict (as transformers' generation masks do)
        mask = [int(any(start < e and end > s for s, e in spans)) for start, end in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask

    def _quoted(self, turn: dict, text: str, start: int) -> int:
        """How many end-of-turn texts the turn's rendering quotes: those in the part of each of its texts
        (content, reasoning) that the rendering writes after `start`, each text once (transformers gives
        the reasoning under two names). A template may drop a text, or its start (Qwen3 drops the thinking
        of an answer before the last user turn): only the longest end of it found in `text` counts."""
        texts = {v for k, v in turn.items() if k != "role" and isinstance(v, str) and self.end_of_turn in v}
        return sum(written_end(v, text, start).count(self.end_of_turn) for v in texts)

    def _span(
        self, messages: list[dict], i: int, text: str, where: str, kwargs: dict, prompts: dict
    ) -> tuple[int, int]:
        """Character span of assistant turn i inside `text`, the rendering of the whole conversation."""
        if i == 0:
            raise BadRow(f"{where}: turn 0 is an assistant turn: nothing precedes it")
        before = self.render(messages[:i], kwargs=kwargs)
        start = common_prefix(prompts[i], text)
        if start < common_prefix(before, prompts[i]):
            raise BadRow(
                f"{where}: turn {i}: the chat template renders the turns before it differently once the "
                "conversation goes on (it moves or rewrites earlier text), so its span cannot be derived: "
                "add {% generation %} markers to the template (--chat_template FILE)"
            )
        upto = self.render(messages[: i + 1], kwargs=kwargs)
        # where the turn's own rendering ends, when it renders alike as the last turn and followed
        own_end = len(upto.rstrip()) if text.startswith(upto) else None
        if self.end_of_turn:
            # the first end-of-turn after the turn's start and after those its own text quotes (the template
            # writes the content verbatim: the probe checked)
            quoted = self._quoted(messages[i], text, start)
            end = text.find(self.end_of_turn, start)
            for _ in range(quoted):
                end = text.find(self.end_of_turn, end + 1) if end >= 0 else end
            if end >= 0 and (own_end is None or end + len(self.end_of_turn) <= own_end):
                return start, end + len(self.end_of_turn)
            if own_end is None:
                raise BadRow(f"{where}: turn {i}: no '{self.end_of_turn}' after the assistant's text")
        if own_end is not None:
            # a turn ended by another token (Llama 3.1 ends a tool call with <|eom_id|>), or a template
            # without one: the turn ends where its own rendering does
            return start, own_end
        raise BadRow(
            f"{where}: turn {i}: the chat template renders this turn differently inside the whole conversation "
            "than as its last turn, and writes no end-of-turn token that is the same after every answer (gpt-oss "
            "ends the last answer with <|return|>, the others with <|end|>): pass --train_last_turn_only, or add "
            "{% generation %} markers to the template (--chat_template FILE)"
        )


class MaskedConversation(NamedTuple):
    """A conversation's token ids, its 0/1 loss mask, and `context_note` ('' or why a trained turn's context
    is not what the target is served: `context_note`)."""

    ids: list[int]
    mask: list[int]
    context_note: str


def context_note(text: str, prompts: dict[int, str], where: str) -> str:
    """'' when the rendering of the whole conversation `text` starts with the generation prompt of each
    trained turn (`prompts`: turn -> the conversation before it with the generation prompt); else where the
    first one parts from it: that turn is trained after text the target does not see when it generates it
    (an earlier turn without its thinking, a system prompt moved, R1's `<think>` left out)."""
    for i in sorted(prompts):
        if not text.startswith(prompts[i]):
            at = common_prefix(prompts[i], text)
            return (
                f"{where}: turn {i} is trained after {text[max(0, at - 24) : at + 24]!r} where the target "
                f"generates it after {prompts[i][max(0, at - 24) : at + 24]!r}"
            )
    return ""


def check_tool_calls_rendered(render, messages: list[dict], where: str) -> None:
    """BadRow when `render` (a conversation -> its text) gives the same text without the assistants' tool
    calls: a template that drops them would leave a tool-calling turn an empty answer in the loss, and a
    regenerated answer would follow a call it never saw."""
    calling = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("tool_calls")]
    if not calling:
        return
    without = [
        {k: v for k, v in m.items() if k != "tool_calls"} if i in calling else m
        for i, m in enumerate(messages)
    ]
    try:
        dropped = render(without) == render(messages)
    except (TemplateError, ValueError, TypeError):  # it needs the calls to render the turn: it reads them
        return
    if dropped:
        raise BadRow(
            f"{where}: turn {calling[0]} calls a tool, which the chat template does not render (the loss "
            "would train an empty answer there): pass a template that renders tool_calls (--chat_template "
            "FILE), or --skip_bad_rows to skip and count such rows"
        )


def written_end(part: str, text: str, start: int) -> str:
    """The longest end of `part` that `text` holds at or after `start` ('' for none): a binary search, as
    every end of a held end is held too."""
    lo, hi = 0, len(part)  # part[hi:] is held; find the smallest such index
    while lo < hi:
        mid = (lo + hi) // 2
        if text.find(part[mid:], start) >= 0:
            hi = mid
        else:
            lo = mid + 1
    return part[lo:]


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over C-speed slice comparisons)."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def json_object(text: str) -> dict:
    """argparse type of --chat_template_kwargs: a JSON object, or a usage error showing one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as '{{\"enable_thinking\": false}}', got {text!r}"
        )
    return value
