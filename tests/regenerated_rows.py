"""Rows that carry fields beside their conversation (an id, a source, nested metadata), and the check that a
regeneration writes each back whole with only its answers replaced: shared by the tests of both engines."""

from __future__ import annotations


def messages_of(row: dict) -> list[dict]:
    """A written row's turns as {role, content}, whichever format it keeps (a ShareGPT row stays one)."""
    turns = row.get("messages") or row["conversations"]
    if "role" in turns[0]:  # messages, or SpecForge's role/content turns under 'conversations'
        return turns
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]


def with_fields(rows: list[dict]) -> list[dict]:
    """`rows` ({"messages": ...}) with the fields a data set's rows carry beside the conversation, each row's
    own: an id before it, a source and nested metadata after it; every third row under 'conversations', in
    ShareGPT's format or (every other such row) in SpecForge's role/content turns."""
    out = []
    for i, row in enumerate(rows):
        if i % 3 == 2 and i % 2:
            row = {"conversations": row["messages"]}
        elif i % 3 == 2:
            speaker = {"user": "human", "assistant": "gpt", "system": "system"}
            row = {
                "conversations": [
                    {"from": speaker[m["role"]], "value": m["content"]} for m in row["messages"]
                ]
            }
        out.append(
            {"id": f"row-{i}", **row, "source": ["web", "books"][i % 2], "meta": {"split": "train", "n": [i]}}
        )
    return out


def assert_fields_kept(written: list[dict], given: list[dict], answers_changed: bool = True) -> None:
    """Each written row is its input row, in the same format and key order, every field as it was and every
    turn but the assistant turns unchanged; those replaced by a regenerated turn of two keys (role and text),
    with new text where `answers_changed` (not where the input holds the target's own greedy answers)."""
    assert len(written) == len(given)
    for row, source in zip(written, given, strict=True):
        key = "messages" if "messages" in source else "conversations"
        assert list(row) == list(source)
        assert {k: v for k, v in row.items() if k != key} == {k: v for k, v in source.items() if k != key}
        assert len(row[key]) == len(source[key])
        for turn, was, raw in zip(messages_of(row), messages_of(source), row[key], strict=True):
            assert turn["role"] == was["role"]
            if turn["role"] != "assistant":
                assert turn == was
            else:
                assert len(raw) == 2 and (turn["content"] != was["content"] or not answers_changed), (
                    turn,
                    was,
                )
