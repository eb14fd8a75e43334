"""Golden assistant masks: the exact text the loss covers, for a ChatML/Qwen3-style template (with and
without thinking, with and without generation markers) and a Llama-3-style one, on local tokenizers."""

import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_ddp.data.chat_template import ChatTokenizer, load_chat_template
from dflash_ddp.data.sources import BadRow

from conftest import build_tokenizer

TEMPLATES = Path(__file__).parent / "templates"
QWEN3 = (TEMPLATES / "qwen3_style.jinja").read_text()
QWEN3_UNMARKED = QWEN3.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
LLAMA3 = (TEMPLATES / "llama3_style.jinja").read_text()

QWEN3_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def qwen3_tokenizer(template: str):
    return build_tokenizer(None, QWEN3_SPECIALS, template, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def llama3_tokenizer():
    return build_tokenizer(
        None, LLAMA3_SPECIALS, LLAMA3, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )


def masked_spans(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded runs of masked tokens, in order."""
    runs, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def spans(tokenizer, messages, **options) -> list[str]:
    kwargs = options.pop("template_kwargs", {})
    ids, mask = ChatTokenizer(tokenizer, kwargs, **options)(messages, "row 1")[:2]
    assert (
        ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    )
    return masked_spans(tokenizer, ids, mask)


SYSTEM = {"role": "system", "content": "be brief"}
USER_1 = {"role": "user", "content": "what does the parser read"}
USER_2 = {"role": "user", "content": "and the dog"}
THINK_1 = {"role": "assistant", "content": "<think>\nthe file\n</think>\n\neach line of the file"}
THINK_2 = {"role": "assistant", "content": "<think>\nlazy\n</think>\n\nthe lazy dog"}
PLAIN_1 = {"role": "assistant", "content": "each line of the file"}
PLAIN_2 = {"role": "assistant", "content": "the lazy dog"}


@pytest.mark.parametrize("template", [QWEN3, QWEN3_UNMARKED], ids=["markers", "growing prefixes"])
def test_qwen3_style_with_thinking(template):
    tokenizer = qwen3_tokenizer(template)
    multi_turn = [SYSTEM, USER_1, THINK_1, USER_2, THINK_2]
    # the first answer lost its thinking block (it precedes the last user turn); the last one keeps it
    assert spans(tokenizer, multi_turn) == [
        "each line of the file<|im_end|>",
        "<think>\nlazy\n</think>\n\nthe lazy dog<|im_end|>",
    ]
    assert spans(tokenizer, multi_turn, last_turn_only=True) == [
        "<think>\nlazy\n</think>\n\nthe lazy dog<|im_end|>"
    ]


def test_qwen3_style_without_thinking():
    off = {"template_kwargs": {"enable_thinking": False}}
    messages = [USER_1, PLAIN_1, USER_2, PLAIN_2]
    # growing prefixes: the empty thinking block belongs to the generation prompt, so it is not learned
    assert spans(qwen3_tokenizer(QWEN3_UNMARKED), messages, **off) == [
        "each line of the file<|im_end|>",
        "the lazy dog<|im_end|>",
    ]
    # with markers the template's author decides: this one puts the empty block inside {% generation %}
    assert spans(qwen3_tokenizer(QWEN3), messages, **off) == [
        "each line of the file<|im_end|>",
        "<think>\n\n</think>\n\nthe lazy dog<|im_end|>",
    ]


def test_a_rows_own_template_arguments_win_over_the_runs():
    """A row regenerated with thinking off (its "chat_template_kwargs") is rendered with it off in a run whose
    --chat_template_kwargs leave it on: the same masks as a run with thinking off."""
    tokenizer = qwen3_tokenizer(QWEN3_UNMARKED)
    messages = [USER_1, PLAIN_1, USER_2, PLAIN_2]
    row = ChatTokenizer(tokenizer, {"enable_thinking": True})(messages, "row 1", {"enable_thinking": False})
    assert row == ChatTokenizer(tokenizer, {"enable_thinking": False})(messages, "row 1")
    assert row != ChatTokenizer(tokenizer, {"enable_thinking": True})(messages, "row 1")
    with pytest.raises(BadRow, match="row 1: chat_template_kwargs sets tokenize, which chat rendering sets"):
        ChatTokenizer(tokenizer, {})(messages, "row 1", {"tokenize": False})


def test_llama3_style_without_generation_markers():
    tokenizer = llama3_tokenizer()
    messages = [SYSTEM, USER_1, PLAIN_1, USER_2, {"role": "assistant", "content": "  the lazy dog \n"}]
    assert spans(tokenizer, messages) == ["each line of the file<|eot_id|>", "the lazy dog<|eot_id|>"]
    assert spans(tokenizer, messages, last_turn_only=True) == ["the lazy dog<|eot_id|>"]


def test_chatml_template_of_the_test_target(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    assert spans(tokenizer, [SYSTEM, USER_1, PLAIN_1]) == ["each line of the file<|im_end|>"]


def test_chat_template_file_replaces_the_tokenizers(tiny_target, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    load_chat_template(tokenizer, str(TEMPLATES / "qwen3_style.jinja"))
    assert tokenizer.chat_template == QWEN3
    with pytest.raises(ValueError, match="--chat_template .*nowhere.jinja: file not found"):
        load_chat_template(tokenizer, str(tmp_path / "nowhere.jinja"))


def test_tokenizer_without_chat_template_is_an_error(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template.*--chat_template"):
        load_chat_template(tokenizer, "")


def test_a_template_that_marks_nothing_gives_an_all_zero_mask_error(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.content }}{% generation %}{% endgeneration %}{% endfor %}"
    )
    with pytest.raises(BadRow, match="data.jsonl:7: the loss mask is all zeros"):
        ChatTokenizer(tokenizer, {})([USER_1, PLAIN_1], "data.jsonl:7")


def test_a_conversation_the_template_refuses_names_the_row():
    tokenizer = qwen3_tokenizer(
        QWEN3_UNMARKED.replace(
            "{%- set ns",
            "{%- if messages[0].role == 'assistant' -%}{{ raise_exception('no user query') }}{%- endif -%}{%- set ns",
            1,
        )
    )
    with pytest.raises(
        BadRow, match="data.jsonl:3: the chat template refuses this conversation: no user query"
    ):
        ChatTokenizer(tokenizer, {})([PLAIN_1, USER_1, PLAIN_2], "data.jsonl:3")


MISTRAL_STYLE = (  # the system prompt travels with the LAST user turn, as in Mistral v0.3's template
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{{- bos_token }}{%- for m in rest %}{%- if m.role == 'user' %}"
    "{%- if loop.last and system %}{{- '[INST] ' + system + '\\n\\n' + m.content + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + m.content + '[/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + m.content + eos_token }}{%- endif %}{%- endfor %}"
)


def test_a_template_that_moves_earlier_text_is_refused_not_mismasked():
    tokenizer = build_tokenizer(
        None, ("<s>", "</s>", "[INST]", "[/INST]"), MISTRAL_STYLE, bos_token="<s>", eos_token="</s>"
    )
    # no system prompt: consistent, and the space before the answer is the answer's first token
    assert spans(tokenizer, [USER_1, PLAIN_1]) == [" each line of the file</s>"]
    with pytest.raises(
        BadRow, match="d.jsonl:4: turn 2: the chat template renders the turns before it differently"
    ):
        ChatTokenizer(tokenizer, {})([SYSTEM, USER_1, PLAIN_1, USER_2, PLAIN_2], "d.jsonl:4")
    # a system prompt that depends on the conversation's length: refused too
    counting = qwen3_tokenizer("<|im_start|>system\nturns={{ messages|length }}<|im_end|>\n" + QWEN3_UNMARKED)
    with pytest.raises(BadRow, match="renders the turns before it differently"):
        ChatTokenizer(counting, {})([USER_1, PLAIN_1], "d.jsonl:5")


def test_text_after_the_last_turn_does_not_stretch_the_spans():
    ending = QWEN3_UNMARKED + "{%- if not add_generation_prompt -%}{{- '<|endoftext|>' -}}{%- endif -%}"
    multi_turn = [SYSTEM, USER_1, THINK_1, USER_2, THINK_2]
    assert spans(qwen3_tokenizer(ending), multi_turn) == spans(qwen3_tokenizer(QWEN3), multi_turn)


def test_an_assistant_turn_without_a_prompt_is_a_bad_row():
    with pytest.raises(BadRow, match="d.jsonl:9: turn 0 is an assistant turn"):
        ChatTokenizer(llama3_tokenizer(), {})([PLAIN_1, USER_1, PLAIN_2], "d.jsonl:9")


def test_both_ways_give_the_same_masks_on_the_embedded_data():
    from dflash_ddp.config import EMBEDDED_PRESET
    from dflash_ddp.data.sources import read_conversations

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_PRESET["target_model"])
    marked = ChatTokenizer(tokenizer, {})
    unmarked_tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_PRESET["target_model"])
    unmarked_tokenizer.chat_template = re.sub(
        r"\{%-?\s*(end)?generation\s*-?%\}", "", tokenizer.chat_template
    )
    unmarked = ChatTokenizer(unmarked_tokenizer, {})
    assert marked.has_generation_markers and not unmarked.has_generation_markers
    for where, messages, _ in read_conversations(EMBEDDED_PRESET["data"])[:300]:
        assert marked(messages, where) == unmarked(messages, where), where


def test_an_end_token_written_only_after_the_whole_conversation_is_not_taken_for_a_turns_end():
    plain = (  # turns separated by plain text; <|endoftext|> once, after the last turn
        "{% for m in messages %}{{ '### ' + m.role + ':\\n' + m.content + '\\n\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% else %}{{ '<|endoftext|>' }}{% endif %}"
    )
    tokenizer = build_tokenizer(None, template=plain)
    chat = ChatTokenizer(tokenizer, {})
    assert chat.end_of_turn is None
    with pytest.raises(BadRow, match="d.jsonl:2: turn 1: the chat template renders this turn differently"):
        chat([USER_1, PLAIN_1, USER_2, PLAIN_2], "d.jsonl:2")  # never a span running into the next user turn


@pytest.mark.parametrize("template", [QWEN3, QWEN3_UNMARKED], ids=["markers", "growing prefixes"])
def test_an_answer_that_writes_the_end_of_turn_text_is_masked_whole(template):
    """An answer quoting the end-of-turn token's text (a conversation about chat templates) is masked to its
    own end of turn, not to the quote, with and without generation markers."""
    quoting = {"role": "assistant", "content": "ends with <|im_end|> then goes on"}
    assert spans(qwen3_tokenizer(template), [USER_1, quoting, USER_2, THINK_2]) == [
        "ends with <|im_end|> then goes on<|im_end|>",
        "<think>\nlazy\n</think>\n\nthe lazy dog<|im_end|>",
    ]


TOOLS_TEMPLATE = (  # ChatML that writes an assistant's tool calls
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ (c.function or c).name }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_calls_the_template_drops_are_a_bad_row():
    """A template that does not render tool calls would leave a tool-calling turn an empty answer in the loss:
    the row is refused, naming the call; a template that renders them masks the call."""
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "w"}}],
    }
    messages = [USER_1, call, {"role": "tool", "content": "sunny"}, PLAIN_2]
    with pytest.raises(BadRow, match="row 1: turn 1 calls a tool, which the chat template does not render"):
        spans(qwen3_tokenizer(QWEN3_UNMARKED), messages)
    assert spans(qwen3_tokenizer(TOOLS_TEMPLATE), messages) == [
        "<tool_call>w</tool_call><|im_end|>",
        "the lazy dog<|im_end|>",
    ]


def test_a_tool_call_ended_by_its_own_token_does_not_train_the_tools_output():
    """Llama 3.1 ends a tool-calling turn with <|eom_id|>, not the <|eot_id|> after answers: the turn ends
    there, and the tool's output after it stays out of the loss."""
    template = (
        "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{% if m.tool_calls %}"
        "{{ m.tool_calls[0].function.name }}<|eom_id|>{% else %}{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    tokenizer = build_tokenizer(None, (*LLAMA3_SPECIALS, "<|eom_id|>"), template, eos_token="<|eot_id|>")
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        USER_1,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny and warm"},
        {"role": "assistant", "content": "the lazy dog"},
    ]
    assert spans(tokenizer, messages) == ["get_weather<|eom_id|>", "the lazy dog<|eot_id|>"]


def test_an_end_of_turn_quoted_in_the_reasoning_does_not_end_the_turn():
    template = QWEN3_UNMARKED.replace(
        "{%- set reasoning = '' -%}", "{%- set reasoning = m.get('reasoning_content', '') -%}"
    )
    assert template != QWEN3_UNMARKED
    said = {
        "role": "assistant",
        "reasoning_content": "it ends with <|im_end|> then",
        "content": "the lazy dog",
    }
    assert spans(qwen3_tokenizer(template), [USER_1, said]) == [
        "<think>\nit ends with <|im_end|> then\n</think>\n\nthe lazy dog<|im_end|>"
    ]


def test_a_turn_marked_in_pieces_keeps_all_of_them_with_last_turn_only():
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}<think>"
        "{{ m.reasoning_content }}</think>{% endgeneration %}{{ '\\n' }}{% generation %}{{ m.content }}<|im_end|>"
        "{% endgeneration %}\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    first = {"role": "assistant", "reasoning_content": "the file", "content": "each line of the file"}
    last = {"role": "assistant", "reasoning_content": "lazy", "content": "the lazy dog"}
    messages = [USER_1, first, USER_2, last]
    assert spans(qwen3_tokenizer(template), messages, last_turn_only=True) == [
        "<think>lazy</think>",
        "the lazy dog<|im_end|>",
    ]


R1_STYLE = (
    "{% for m in messages %}{% if m.role == 'user' %}<|User|>{{ m.content }}{% else %}<|Assistant|>"
    "{{ m.content.split('</think>')[-1] }}<|eos|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
)


def test_a_turn_trained_after_other_text_than_its_generation_prompt_is_pointed_out(tmp_path):
    """DeepSeek-R1's distilled models: the generation prompt opens <think>, the rendered history drops the
    thinking: the answer would train in a context the target never generates it in."""
    tokenizer = build_tokenizer(None, ("<|User|>", "<|Assistant|>", "<|eos|>"), R1_STYLE, eos_token="<|eos|>")
    answer = {"role": "assistant", "content": "lazy\n</think>\n\nthe lazy dog"}
    ids, mask, note = ChatTokenizer(tokenizer, {})([USER_1, answer], "d.jsonl:3")
    assert note.startswith("d.jsonl:3: turn 1 is trained after ")
    assert note.endswith("where the target generates it after 'parser read<|Assistant|><think>\\n'")
    assert masked_spans(tokenizer, ids, mask) == ["\n\nthe lazy dog<|eos|>"]
    # the Qwen3-style template keeps thinking on as served: nothing to say
    assert (
        ChatTokenizer(qwen3_tokenizer(QWEN3_UNMARKED), {})([USER_1, THINK_1], "d.jsonl:4").context_note == ""
    )


def test_an_end_of_turn_quoted_in_reasoning_the_template_drops_is_not_counted():
    """Qwen3 drops the thinking of an answer before the last user turn: a quote inside it (in its
    reasoning_content, or in <think> inside its content) is not in the rendering, and the turn still ends at
    its own end-of-turn, not the next user turn's."""
    template = QWEN3_UNMARKED.replace(
        "{%- set reasoning = '' -%}", "{%- set reasoning = m.get('reasoning_content', '') -%}"
    )
    last = {"role": "assistant", "content": "the lazy dog"}
    for first in (
        {"role": "assistant", "reasoning_content": "it ends with <|im_end|> then", "content": "each line"},
        {"role": "assistant", "content": "<think>it ends with <|im_end|> then</think>each line"},
    ):
        assert spans(qwen3_tokenizer(template), [USER_1, first, USER_2, last]) == [
            "each line<|im_end|>",
            "<think>\n\n</think>\n\nthe lazy dog<|im_end|>",
        ]


def test_a_marked_template_refusing_a_part_of_the_conversation_still_masks_the_whole():
    """The generation prompts only check the context: Qwen3-2507 raises on a conversation with no user turn
    (the part before an opening assistant turn), and the whole conversation, which it renders, is masked."""
    refusing = QWEN3.replace(
        "{%- for m in messages -%}\n{%- if m.role == 'assistant'",
        "{%- if ns.last_user < 0 -%}{{- raise_exception('No user query found in messages.') -}}{%- endif -%}\n"
        "{%- for m in messages -%}\n{%- if m.role == 'assistant'",
        1,
    )
    assert refusing != QWEN3
    messages = [SYSTEM, {"role": "assistant", "content": "each line"}, USER_1, PLAIN_2]
    tokenizer = qwen3_tokenizer(refusing)
    assert spans(tokenizer, messages) == [
        "each line<|im_end|>",
        "<think>\n\n</think>\n\nthe lazy dog<|im_end|>",
    ]
    assert spans(tokenizer, messages, last_turn_only=True) == [
        "<think>\n\n</think>\n\nthe lazy dog<|im_end|>"
    ]


def test_last_turn_only_with_markers_keeps_the_last_turn_where_earlier_text_counts_the_turns():
    counting = qwen3_tokenizer("<|im_start|>system\nturns={{ messages|length }}<|im_end|>\n" + QWEN3)
    messages = [USER_1, PLAIN_1, USER_2, PLAIN_2]
    assert spans(counting, messages, last_turn_only=True) == ["<think>\n\n</think>\n\nthe lazy dog<|im_end|>"]
