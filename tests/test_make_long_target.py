"""The tiny-target tool's long-context step: long multi-turn conversations from the corpus."""

import random

from dflash_ddp.tools.make_long_target import long_conversation


def turn(i: int) -> list[dict]:
    return [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]


def test_a_long_conversation_stays_within_its_length_repeats_earlier_turns_and_ends_with_the_given_one():
    turns, sizes = [turn(i) for i in range(50)], [100] * 50
    rng = random.Random(0)
    rows = [long_conversation(turns, sizes, 4000, 0.3, rng) for _ in range(20)]
    for row in rows:
        questions = [m["content"] for m in row["messages"] if m["role"] == "user"]
        assert len(questions) * 100 <= 4000 and len(questions) >= 30
        assert len(set(questions)) < len(questions)  # some questions come back, with their answers
    last = [{"role": "user", "content": "held out"}, {"role": "assistant", "content": "answer"}]
    ended = [long_conversation(turns, sizes, 4000, 0.3, rng, last)["messages"] for _ in range(20)]
    assert all(len(m) // 2 * 100 <= 4000 for m in ended)  # the last turn fits in the room kept for it
    assert 0 < sum(m[-2:] == last for m in ended) < 20  # held-out questions, and repeats of earlier ones
