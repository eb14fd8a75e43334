"""The parts directory of a regeneration run: the merge into OUT (order, each row once, what is left
out), damaged parts, and part files that survive a kill mid-write and are read from their tail."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from dflash_ddp.data.sources import BadRow, read_conversations_and_rows
from dflash_ddp.regeneration import parts as parts_mod
from dflash_ddp.regeneration.turns import plan_row


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("keep_truncated", [False, True])
def test_merge_orders_rows_leaves_out_bad_empty_and_cut_rows_and_waits_for_missing_rows(
    tmp_path, keep_truncated
):
    def record(row, answer, hit=False):
        messages = [{"role": "user", "content": f"q{row}"}, {"role": "assistant", "content": answer}]
        return json.dumps({"row": row, "messages": messages, "hit_max_new_tokens": hit, "new_tokens": 5})

    out, parts = tmp_path / "out.jsonl", tmp_path / "out.jsonl.parts"
    parts.mkdir()
    (parts / "settings.json").write_text('{"rows": 5}')  # as the run's start writes it
    # rows from two world sizes, out of order, one found twice, one file ending in a line cut by a kill
    (parts / "rank0-of-2.jsonl").write_text(record(2, "c", hit=True) + "\n" + record(0, "a") + "\n")
    (parts / "rank1-of-2.jsonl").write_text(
        record(1, "") + "\n" + json.dumps({"row": 4, "bad": "f:5: refused"}) + "\n" + record(3, "d")[:20]
    )
    rows = [
        plan_row(
            i, f"f:{i + 1}", [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "old"}]
        )
        for i in range(5)
    ]
    assert parts_mod.merge(out, parts, rows, keep_truncated) is None  # row 3 is not finished
    assert not out.exists() and parts.exists()

    (parts / "rank0-of-1.jsonl").write_text(record(3, "d") + "\n" + record(0, "a") + "\n")
    summary = parts_mod.merge(out, parts, rows, keep_truncated)
    # the settings outlive OUT.parts, beside OUT, with the merge-time choice
    assert json.loads(parts_mod.settings_path(out).read_text()) == {
        "rows": 5,
        "keep_truncated": keep_truncated,
    }
    # row 1 (empty) and row 4 (bad) are always left out; row 2 (cut off by --max_new_tokens) by default
    assert summary == parts_mod.Summary(
        rows=5, written=2 + keep_truncated, bad=1, empty=1, hit_max_new_tokens=1, turns=4, new_tokens=20
    )
    written = ["a", "c", "d"] if keep_truncated else ["a", "d"]
    assert [r["messages"][1]["content"] for r in read_rows(out)] == written
    assert read_rows(out)[0] == {
        "messages": [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a"}]
    }
    assert not parts.exists()


def test_a_damaged_parts_directory_is_an_error_naming_the_line(tmp_path):
    parts = tmp_path / "out.jsonl.parts"
    parts.mkdir()
    (parts / "rank0-of-1.jsonl").write_text('{"row": 0, "messages": []}\n{"text": "mine"}\n')
    with pytest.raises(ValueError, match="rank0-of-1.jsonl:2: not a regenerated row"):
        parts_mod.index_parts(parts, 4)
    (parts / "rank0-of-1.jsonl").write_text('{"row": 7, "messages": []}\n')
    with pytest.raises(ValueError, match="rank0-of-1.jsonl:1: row 7 is outside 0..3"):
        parts_mod.index_parts(parts, 4)


def test_part_writer_drops_a_cut_line_and_keeps_its_file_to_itself(tmp_path):
    path = tmp_path / "rank0-of-1.jsonl"
    path.write_bytes(b'{"row": 0}\n{"row": 1, "mess')
    writer = parts_mod.PartWriter(path)
    assert path.read_bytes() == b'{"row": 0}\n'
    writer.write([{"row": 1}, {"row": 2}])
    assert path.read_bytes() == b'{"row": 0}\n{"row": 1}\n{"row": 2}\n'
    with pytest.raises(ValueError, match="being written by another process"):
        parts_mod.PartWriter(path)
    writer.close()
    parts_mod.PartWriter(path).close()  # free again once the first writer is gone


class CountingPath(type(Path())):
    """A path whose opened files count the bytes read from them (in `bytes_read`)."""

    bytes_read = 0

    def open(self, *args, **kwargs):
        file = super().open(*args, **kwargs)

        class Counting:
            def __getattr__(self, name):
                return getattr(file, name)

            def read(self, *size):
                data = file.read(*size)
                CountingPath.bytes_read += len(data)
                return data

        return Counting()


def test_part_writer_reads_only_the_tail(tmp_path, monkeypatch):
    path = tmp_path / "rank0-of-1.jsonl"
    lines = b"".join(b'{"row": %d, "messages": []}\n' % i for i in range(200_000))  # about 6 MB
    path.write_bytes(lines + b'{"row": 200000, "mess')
    CountingPath.bytes_read = 0
    parts_mod.PartWriter(CountingPath(path)).close()
    assert path.read_bytes() == lines
    assert CountingPath.bytes_read <= parts_mod.TAIL_CHUNK < len(lines) // 4

    # the last newline found across chunk boundaries, or nowhere
    monkeypatch.setattr(parts_mod, "TAIL_CHUNK", 4)
    for content, kept in [
        (b"ab\ncdefghijk", b"ab\n"),
        (b"abc\ndefg", b"abc\n"),
        (b"abcd\n", b"abcd\n"),
        (b"abcdefghi", b""),
        (b"", b""),
    ]:
        path.write_bytes(content)
        parts_mod.PartWriter(path).close()
        assert path.read_bytes() == kept, content


def test_rows_with_kept_tool_calls_are_written(tmp_path):
    call = {"role": "assistant", "content": "", "tool_calls": [{"name": "weather", "arguments": "{}"}]}
    messages = [{"role": "user", "content": "weather?"}, call, {"role": "tool", "content": "sunny"}]
    messages.append({"role": "assistant", "content": "It is sunny."})
    parts = tmp_path / "out.jsonl.parts"
    parts.mkdir()
    (parts / "settings.json").write_text("{}")
    record = {"row": 0, "messages": messages, "hit_max_new_tokens": False, "new_tokens": 4}
    (parts / "rank0-of-1.jsonl").write_text(json.dumps(record) + "\n")
    summary = parts_mod.merge(tmp_path / "out.jsonl", parts, [plan_row(0, "f:1", messages)])
    assert summary.written == 1 and summary.empty == 0 and summary.turns == 1  # only the answer was generated
    assert read_rows(tmp_path / "out.jsonl") == [{"messages": messages}]


def test_the_merge_writes_each_input_row_back_with_only_its_answers_replaced(tmp_path):
    """Every field of a row and every turn not regenerated (their own keys too) as read; the regenerated
    turns replaced whole, in the row's own format; a part line of an earlier version (which carried the
    row's chat_template_kwargs itself) merges the same."""
    chat = {
        "id": "a-1",
        "messages": [
            {"role": "system", "content": "S", "name": "house rules"},
            {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "OLD", "reasoning_content": "old thinking"},
            {"role": "user", "content": "U2"},
        ],
        "chat_template_kwargs": {"enable_thinking": False},
        "meta": {"source": "web", "scores": [0.5, None]},
    }
    share = {
        "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "OLD"}],
        "split": "test",
    }
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps(chat) + "\n" + json.dumps(share) + "\n")
    rows = [
        plan_row(i, where, messages, kwargs, fields)
        for i, ((where, messages, kwargs), fields) in enumerate(read_conversations_and_rows([str(data)]))
    ]
    assert [r.targets for r in rows] == [[2, 4], [1]]
    answer = [{"role": "assistant", "content": text} for text in ("A1", "A2", "B")]
    generated = [
        [*rows[0].messages[:2], answer[0], rows[0].messages[3], answer[1]],
        [rows[1].messages[0], answer[2]],
    ]
    parts = tmp_path / "out.jsonl.parts"
    parts.mkdir()
    (parts / "settings.json").write_text("{}")
    records = [
        {"row": 0, "messages": generated[0], "hit_max_new_tokens": False, "new_tokens": 6},
        {"row": 1, "messages": generated[1], "hit_max_new_tokens": False, "new_tokens": 2},
    ]
    records[0]["chat_template_kwargs"] = {"enable_thinking": False}  # as earlier versions wrote it
    (parts / "rank0-of-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = parts_mod.merge(tmp_path / "out.jsonl", parts, rows)
    assert summary.written == 2 and summary.turns == 3
    assert read_rows(tmp_path / "out.jsonl") == [
        {
            "id": "a-1",
            "messages": [
                {"role": "system", "content": "S", "name": "house rules"},
                {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "A1"},
                {"role": "user", "content": "U2"},
                {"role": "assistant", "content": "A2"},
            ],
            "chat_template_kwargs": {"enable_thinking": False},
            "meta": {"source": "web", "scores": [0.5, None]},
        },
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "B"}], "split": "test"},
    ]
    assert list(read_rows(tmp_path / "out.jsonl")[0]) == list(chat)  # the fields in their order


def test_a_field_json_cannot_hold_is_a_bad_row_and_a_date_is_written_as_text():
    messages = [{"role": "user", "content": "Q"}]
    when = datetime.datetime(2026, 12, 4, 9, 30)
    row = plan_row(0, "d.parquet:row 0", messages, None, {"messages": messages, "when": when})
    assert row.fields["when"] == "2026-12-04T09:30:00"
    with pytest.raises(BadRow, match=r"d.parquet:row 3: field 'image' cannot be written .* --skip_bad_rows"):
        plan_row(3, "d.parquet:row 3", messages, None, {"messages": messages, "image": b"\x89PNG"})
