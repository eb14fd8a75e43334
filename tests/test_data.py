"""Reading conversations: every kind of bad input names its file, line and reason, or is skipped and
counted with --skip_bad_rows; globs; the loss mask covers assistant tokens only."""

import json

import pytest
from transformers import AutoTokenizer

from dflash_ddp.data import BadRow, DataStats, read_conversations, tokenize_dataset

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}

BAD_ROWS = {
    "malformed JSON": (b'{"messages": [', "malformed JSON"),
    "missing field": (json.dumps({"text": "hi"}).encode(), "neither 'messages' nor 'conversations'"),
    "wrongly typed field": (
        json.dumps({"messages": [{"role": "user", "content": 3}, GOOD["messages"][1]]}).encode(),
        "turn 0 'content' must be a string",
    ),
    "unknown role": (
        json.dumps({"messages": [{"role": "robot", "content": "x"}, GOOD["messages"][1]]}).encode(),
        "turn 0 has unknown role 'robot'",
    ),
    "empty conversation": (json.dumps({"messages": []}).encode(), "the conversation is empty"),
    "empty assistant turn": (
        json.dumps({"messages": [GOOD["messages"][0], {"role": "assistant", "content": "  "}]}).encode(),
        "turn 1 is an empty assistant turn",
    ),
    "non-UTF-8 bytes": (b'{"messages": "\xff\xfe"}', "not valid UTF-8"),
}


def write(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("kind", BAD_ROWS)
def test_a_bad_row_names_file_line_and_reason(tmp_path, kind):
    raw, reason = BAD_ROWS[kind]
    path = write(tmp_path / "d.jsonl", [json.dumps(GOOD).encode(), raw, json.dumps(GOOD).encode()])
    with pytest.raises(BadRow, match=f"{path}:2: .*{reason}"):
        read_conversations([str(path)])


@pytest.mark.parametrize("kind", BAD_ROWS)
def test_skip_bad_rows_skips_and_counts(tmp_path, kind):
    path = write(
        tmp_path / "d.jsonl", [json.dumps(GOOD).encode(), BAD_ROWS[kind][0], json.dumps(GOOD).encode()]
    )
    stats = DataStats()
    rows = read_conversations([str(path)], skip_bad_rows=True, stats=stats)
    assert [where for where, _ in rows] == [f"{path}:1", f"{path}:3"]
    assert (
        stats.rows == 3 and stats.bad_rows == 1 and BAD_ROWS[kind][1].split()[0] in stats.bad_row_examples[0]
    )


def test_missing_file_empty_dataset_and_globs(tmp_path):
    with pytest.raises(ValueError, match="nowhere.jsonl: file not found"):
        read_conversations([str(tmp_path / "nowhere.jsonl")])
    with pytest.raises(ValueError, match="no usable rows"):
        read_conversations([str(write(tmp_path / "empty.jsonl", [b""]))])
    with pytest.raises(ValueError, match="matches no file"):
        read_conversations([str(tmp_path / "shard-*.jsonl")])
    for i in range(3):
        write(tmp_path / f"shard-{i}.jsonl", [json.dumps(GOOD).encode()])
    rows = read_conversations([str(tmp_path / "shard-*.jsonl")])
    assert [w.split("/")[-1] for w, _ in rows] == ["shard-0.jsonl:1", "shard-1.jsonl:1", "shard-2.jsonl:1"]


def test_sharegpt_rows_are_accepted(tmp_path):
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    rows = read_conversations([str(write(tmp_path / "s.jsonl", [json.dumps(row).encode()]))])
    assert rows[0][1] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_tokenizer_without_chat_template_is_an_error(tiny_target, chat_data):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        tokenize_dataset(tokenizer, [str(chat_data)], 256, 4)


def test_template_without_generation_markers_gives_an_all_zero_mask_error(tiny_target, chat_data):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    tokenizer.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    with pytest.raises(BadRow, match=f"{chat_data}:1: the loss mask is all zeros"):
        tokenize_dataset(tokenizer, [str(chat_data)], 256, 4)


def test_loss_mask_covers_exactly_the_assistant_text(tiny_target, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    row = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "the quick fox"},
            {"role": "assistant", "content": "the lazy dog " * 4},
        ]
    }
    samples, stats = tokenize_dataset(
        tokenizer, [str(write(tmp_path / "r.jsonl", [json.dumps(row).encode()]))], 256, 2
    )
    sample = samples[0]
    masked = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])
    assert masked == "the lazy dog " * 4 + "<|im_end|>"
    assert stats.kept == 1 and stats.bad_rows == 0
