"""Reading conversations: every kind of bad input names its file, line and reason, or is skipped and
counted with --skip_bad_rows; globs; jsonl, json, parquet and save_to_disk inputs."""

import json

import pytest

from dflash_ddp.data.sources import BadRow, DataStats, read_conversations

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
        "turn 0 has unknown role 'robot' \\(known: human, user, gpt, assistant, system",
    ),
    "empty conversation": (json.dumps({"messages": []}).encode(), "'messages' is empty"),
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
    assert [where for where, _, _ in rows] == [f"{path}:1", f"{path}:3"]
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
    assert [w.split("/")[-1] for w, _, _ in rows] == ["shard-0.jsonl:1", "shard-1.jsonl:1", "shard-2.jsonl:1"]


def test_sharegpt_rows_are_accepted(tmp_path):
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    rows = read_conversations([str(write(tmp_path / "s.jsonl", [json.dumps(row).encode()]))])
    assert rows[0][1] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_either_key_reads_the_other_formats_turns_as_specforges_data_preparation_writes_them(tmp_path):
    """SpecForge writes role/content turns under 'conversations'; some dumps write from/value under
    'messages'; other assistants' names in ShareGPT dumps are the assistant."""
    rows = [
        {"id": "a", "conversations": GOOD["messages"]},
        {"messages": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
        *(
            {"conversations": [{"from": "human", "value": "hi"}, {"from": name, "value": "hello there"}]}
            for name in ("chatgpt", "bing", "bard")
        ),
        {"messages": [GOOD["messages"][0], {"role": "model", "content": "hello there"}]},
    ]
    path = write(tmp_path / "s.jsonl", [json.dumps(row).encode() for row in rows])
    assert [messages for _, messages, _ in read_conversations([str(path)])] == [GOOD["messages"]] * len(rows)
    mixed = {"conversations": [GOOD["messages"][0], {"from": "gpt", "value": "x"}]}
    with pytest.raises(BadRow, match=r"s2.jsonl:1: turn 1 has no 'role' \(the row's first turn has one\)"):
        read_conversations([str(write(tmp_path / "s2.jsonl", [json.dumps(mixed).encode()]))])


def test_skipped_rows_are_counted_per_input_and_each_input_shows_its_first(tmp_path):
    """At scale the first ten examples all came from the first input: each input's first is kept too."""
    bad = json.dumps({"prompt": "p"}).encode()
    first = write(tmp_path / "first.jsonl", [bad] * 12 + [json.dumps(GOOD).encode()])
    second = write(tmp_path / "second.jsonl", [json.dumps(GOOD).encode(), bad])
    stats = DataStats()
    read_conversations([str(first), str(second)], skip_bad_rows=True, stats=stats)
    assert stats.bad_rows_by_input == {str(first): 12, str(second): 1}
    assert len(stats.bad_row_examples) == 11 and stats.bad_row_examples[-1].startswith(f"{second}:2: ")


def test_an_input_without_one_usable_row_is_named_when_skipping_bad_rows(tmp_path):
    """--skip_bad_rows skips rows: a whole file in a format this does not read would otherwise vanish from
    the data beside the good files, counted but unnoticed; it is named in a warning (not refused: a hub
    dataset's shard may hold only bad rows)."""
    good = write(tmp_path / "good.jsonl", [json.dumps(GOOD).encode()] * 3)
    other = write(tmp_path / "other.jsonl", [json.dumps({"prompt": "p", "completion": "c"}).encode()] * 2)
    stats = DataStats()
    assert len(read_conversations([str(good), str(other)], skip_bad_rows=True, stats=stats)) == 3
    assert stats.unusable_inputs == [
        f"{other} (2 rows; the first: {other}:1: the row has neither 'messages' nor 'conversations')"
    ]
    assert stats.unusable_note().startswith("warning: --skip_bad_rows skipped every row of 1 input(s)")
    stats = DataStats()
    read_conversations([str(good)], skip_bad_rows=True, stats=stats)
    assert not stats.unusable_inputs and stats.unusable_note() == ""
    with pytest.raises(BadRow, match=r"bad.jsonl:1: malformed JSON \(Expecting value at column 15\)"):
        read_conversations([str(write(tmp_path / "bad.jsonl", [b'{"messages": [} ']))])
    # a row's system field read as its first turn is no turn of the row's own to point at
    row = {
        "system": "be brief",
        "conversations": [{"speaker": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
    }
    with pytest.raises(BadRow, match=r"turn 1 has no 'from'$"):
        read_conversations([str(write(tmp_path / "sys.jsonl", [json.dumps(row).encode()]))])


def test_parquet_and_save_to_disk_inputs_give_the_same_rows_as_jsonl(tmp_path):
    import datasets

    rows = [GOOD, {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}]
    jsonl = write(tmp_path / "d.jsonl", [json.dumps(r).encode() for r in rows])
    # one schema per file, as datasets requires: messages rows in one, ShareGPT rows in the other
    datasets.Dataset.from_list(rows[:1]).to_parquet(tmp_path / "a.parquet")
    datasets.Dataset.from_list(rows[1:]).save_to_disk(tmp_path / "b_disk")
    expected = [messages for _, messages, _ in read_conversations([str(jsonl)])]
    got = read_conversations([str(tmp_path / "a.parquet"), str(tmp_path / "b_disk")])
    assert [messages for _, messages, _ in got] == expected
    assert [where.split("/")[-1] for where, _, _ in got] == ["a.parquet:row 0", "b_disk:row 0"]


def test_bad_rows_in_parquet_name_the_row(tmp_path):
    import datasets

    bad = {"messages": [{"role": "robot", "content": "x"}, GOOD["messages"][1]]}
    datasets.Dataset.from_list([GOOD, bad]).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(BadRow, match=r"d.parquet:row 1: turn 0 has unknown role 'robot'"):
        read_conversations([str(tmp_path / "d.parquet")])


def test_unreadable_or_unsupported_inputs_are_clear_errors(tmp_path):
    import datasets

    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="broken.parquet: cannot be read as a data set"):
        read_conversations([str(tmp_path / "broken.parquet")])
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="notes.txt: unsupported file type '.txt'"):
        read_conversations([str(tmp_path / "notes.txt")])
    datasets.DatasetDict({"train": datasets.Dataset.from_list([GOOD])}).save_to_disk(tmp_path / "dd")
    with pytest.raises(ValueError, match="a DatasetDict: pass one split's directory, e.g. DIR/train"):
        read_conversations([str(tmp_path / "dd")])
    assert len(read_conversations([str(tmp_path / "dd" / "train")])) == 1


def test_tool_turns_and_extra_keys_reach_the_template(tmp_path):
    row = {
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"name": "weather", "arguments": "{}"}]},
            {"role": "tool", "content": "sunny", "name": "weather"},
            {"role": "assistant", "content": "It is sunny.", "reasoning_content": "the tool said so"},
        ]
    }
    rows = read_conversations([str(write(tmp_path / "t.jsonl", [json.dumps(row).encode()]))])
    assert rows[0][1][1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "weather", "arguments": "{}"}],
    }
    assert rows[0][1][2] == {"role": "tool", "content": "sunny", "name": "weather"}
    assert rows[0][1][3]["reasoning_content"] == "the tool said so"


def test_a_json_file_holding_json_lines_is_read_line_by_line(tmp_path):
    path = write(tmp_path / "d.json", [json.dumps(GOOD).encode(), b'{"messages": ['])
    with pytest.raises(BadRow, match="d.json:2: malformed JSON"):
        read_conversations([str(path)])
    assert len(read_conversations([str(path)], skip_bad_rows=True)) == 1


def test_a_rows_chat_template_kwargs_are_read_and_checked(tmp_path):
    row = {**GOOD, "chat_template_kwargs": {"enable_thinking": False}}
    rows = read_conversations(
        [str(write(tmp_path / "k.jsonl", [json.dumps(row).encode(), json.dumps(GOOD).encode()]))]
    )
    assert [r.template_kwargs for r in rows] == [{"enable_thinking": False}, {}]
    path = write(tmp_path / "bad.jsonl", [json.dumps({**GOOD, "chat_template_kwargs": "thinking"}).encode()])
    with pytest.raises(BadRow, match="bad.jsonl:1: 'chat_template_kwargs' must be a JSON object"):
        read_conversations([str(path)])


def test_a_byte_order_mark_opens_a_file_without_harm(tmp_path):
    """Windows tools start a UTF-8 file with a byte-order mark: the first row reads as any other."""
    bom = b"\xef\xbb\xbf"
    jsonl = write(tmp_path / "d.jsonl", [bom + json.dumps(GOOD).encode(), json.dumps(GOOD).encode()])
    (tmp_path / "d.json").write_bytes(bom + json.dumps([GOOD]).encode())
    assert len(read_conversations([str(jsonl)])) == 2
    assert read_conversations([str(tmp_path / "d.json")])[0].messages == GOOD["messages"]


def test_openai_rows_as_clients_write_them(tmp_path):
    """Content as a list of text parts (joined by newlines), a tool-calling turn with no content key, the
    developer role (the system prompt's), and a system prompt beside ShareGPT turns (LLaMA-Factory's)."""
    row = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "weather"}, {"type": "text", "text": "now?"}],
            },
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
        ]
    }
    sharegpt = {
        "system": "Be kind.",
        "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hey"}],
    }
    path = write(tmp_path / "o.jsonl", [json.dumps(row).encode(), json.dumps(sharegpt).encode()])
    first, second = (c.messages for c in read_conversations([str(path)]))
    assert [m["role"] for m in first] == ["system", "user", "assistant", "tool", "assistant"]
    assert first[1]["content"] == "weather\nnow?" and first[4]["content"] == "Sunny."
    assert first[2]["content"] == "" and first[2]["tool_calls"][0]["function"]["name"] == "w"
    assert second[0] == {"role": "system", "content": "Be kind."} and len(second) == 3
    image = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            GOOD["messages"][1],
        ]
    }
    no_text = {"messages": [GOOD["messages"][0], {"role": "assistant"}]}
    bad = write(tmp_path / "b.jsonl", [json.dumps(image).encode(), json.dumps(no_text).encode()])
    with pytest.raises(
        BadRow, match="b.jsonl:1: turn 0 'content' must be a string or a list of text parts.*image_url"
    ):
        read_conversations([str(bad)])
    stats = DataStats()
    with pytest.raises(ValueError, match="no usable rows .2 read, 2 bad and skipped; the first: .*b.jsonl:1"):
        read_conversations([str(bad)], skip_bad_rows=True, stats=stats)
    assert "turn 1 'content' is missing" in stats.bad_row_examples[1]


def test_parquet_nulls_count_as_absent(tmp_path):
    """Parquet gives each row every column and key any row has, as nulls: rows joined from both formats, and
    template arguments that other rows set, read as the rows that were written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sharegpt = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    table = pa.Table.from_pylist(
        [
            {
                "messages": GOOD["messages"],
                "conversations": None,
                "chat_template_kwargs": {"enable_thinking": True},
            },
            {
                "messages": None,
                "conversations": sharegpt,
                "chat_template_kwargs": {"reasoning_effort": "low"},
            },
        ]
    )
    pq.write_table(table, tmp_path / "mixed.parquet")
    first, second = read_conversations([str(tmp_path / "mixed.parquet")])
    assert first.messages == GOOD["messages"] and first.template_kwargs == {"enable_thinking": True}
    assert [m["content"] for m in second.messages] == ["q", "a"]
    assert second.template_kwargs == {"reasoning_effort": "low"}


def test_file_names_and_folders_as_users_give_them(tmp_path):
    """An upper-case suffix, a one-row .json file written as JSON Lines, a folder of files (named through a
    pattern), an empty file and a limit that leaves the rest unread."""
    upper = write(tmp_path / "d.JSONL", [json.dumps(GOOD).encode()])
    one = write(tmp_path / "one.json", [json.dumps(GOOD).encode()])
    assert len(read_conversations([str(upper), str(one)])) == 2
    folder = tmp_path / "folder"
    folder.mkdir()
    write(folder / "a.jsonl", [json.dumps(GOOD).encode()])
    with pytest.raises(ValueError, match=r"folder: a directory must be written by .*name them: DIR/\*.jsonl"):
        read_conversations([str(folder)])
    empty = write(tmp_path / "empty.jsonl", [b""])
    with pytest.raises(ValueError, match="empty.jsonl: no usable rows .the input is empty."):
        read_conversations([str(empty)])
    tail_bad = write(tmp_path / "t.jsonl", [json.dumps(GOOD).encode(), b'{"messages": ['])
    assert len(read_conversations([str(tail_bad)], limit=1)) == 1
