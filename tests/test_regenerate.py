"""`python -m dflash_ddp.regenerate`: prompts kept, assistant turns regenerated round by round, batches
seeded by their index, and a resume after SIGKILL (with another world size) that gives the uninterrupted
output, every row exactly once."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from regenerated_rows import assert_fields_kept, messages_of, with_fields

from dflash_ddp.data.chat_template import ChatTokenizer, load_target_tokenizer
from dflash_ddp.data.sources import BadRow
from dflash_ddp.regeneration import regenerate as rg
from dflash_ddp.regeneration.parts import settings_path
from dflash_ddp.regeneration.turns import Answer
from dflash_ddp.target_model.info import inspect_target
from dflash_ddp.target_model.loading import load_causal_lm

from conftest import CHATML_TEMPLATE, build_tokenizer
from helpers import kill_job, torchrun_cmd

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(autouse=True)
def one_thread():
    """torch on one thread, like torchrun's workers: outputs are compared bit for bit across processes, and
    a CPU matmul need not round alike on another number of threads. (The tiny target gains nothing from a
    second thread, which on a busy 2-core machine mostly waits.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def flags(target, data, out, **settings) -> list[str]:
    """`--key value` flags; True gives a bare `--key`, False none. --keep_truncated unless told otherwise:
    the random tiny target seldom says EOS within a few tokens, so most of its answers are cut off."""
    merged = {"target_model": target, "data": data, "out": out, "max_new_tokens": 8, "keep_truncated": True}
    argv = []
    for key, value in {**merged, **settings}.items():
        argv += [f"--{key}"] if value is True else [] if value is False else [f"--{key}", str(value)]
    return argv


def run(target, data, out, **settings) -> list[dict]:
    """One in-process run (world size 1); the rows of OUT."""
    assert rg.main(flags(target, data, out, **settings)) == 0
    return read_rows(out)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def first_rows(src: Path, dst: Path, n: int) -> Path:
    dst.write_text("".join(src.read_text().splitlines(keepends=True)[:n]))
    return dst


def finished_rows(parts: Path) -> list[int]:
    """Row indices of every complete line of every part file (a cut-off last line does not count)."""
    rows = []
    for path in sorted(parts.glob("rank*-of-*.jsonl")):
        rows += [json.loads(line)["row"] for line in path.read_bytes().split(b"\n")[:-1]]
    return rows


# ----------------------------------------------------------------------------------------------------------
# rounds, prompts and answers


class StubGenerator:
    """Answers `r<round>:<number of prompt turns>`; its "prompt ids" are copies of the messages, recorded.
    Refuses the prompts `refuse` names as (row index, number of prompt turns), as a chat template would."""

    def __init__(self, refuse=()):
        self.calls: list[list[list[dict]]] = []  # per round, the prompts of the rows that took part
        self.refuse = set(refuse)

    def prompt_ids(self, row, messages):
        if (row.index, len(messages)) in self.refuse:
            raise BadRow(f"{row.where}: the chat template failed on this conversation (refused)")
        return [dict(m) for m in messages]

    def __call__(self, prompts):
        self.calls.append(prompts)
        return [Answer(f"r{len(self.calls)}:{len(p)}", 3, False) for p in prompts]


def test_rounds_use_the_regenerated_earlier_turns():
    conversations = [
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "OLD1"},
            {"role": "user", "content": "U2"},
            {"role": "assistant", "content": "OLD2"},
        ],
        [{"role": "user", "content": "ONLY A PROMPT"}],
        [
            {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "OLD1"},
            {"role": "user", "content": "U2"},
        ],
    ]
    rows = [rg.plan_row(i, f"f:{i + 1}", m) for i, m in enumerate(conversations)]
    assert [r.targets for r in rows] == [[2, 4], [1], [1, 3]]
    stub = StubGenerator()
    records = rg.regenerate_batch(stub, rows, seed=0)

    # round 1 answers every row's first turn; round 2 only the rows with a second one, after round 1's answers
    assert [len(c) for c in stub.calls] == [3, 2]
    assert stub.calls[1][0][2] == {"role": "assistant", "content": "r1:2"}
    assert stub.calls[1][1][1] == {"role": "assistant", "content": "r1:1"}
    assert [r["row"] for r in records] == [0, 1, 2]
    assert records[0]["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "r1:2"},
        {"role": "user", "content": "U2"},
        {"role": "assistant", "content": "r2:4"},
    ]
    assert records[1]["messages"] == [*conversations[1], {"role": "assistant", "content": "r1:1"}]
    assert records[2]["messages"][-1] == {
        "role": "assistant",
        "content": "r2:3",
    }  # the trailing user answered
    assert [r["new_tokens"] for r in records] == [6, 3, 6]
    assert conversations[0][2]["content"] == "OLD1"  # the input is not modified

    # A prompt the template refuses, in round 1 (row 1) or round 2 (row 0): with --skip_bad_rows the row
    # leaves that round and the later ones and is finished as bad; the other rows are answered as before.
    stub = StubGenerator(refuse={(1, 1), (0, 4)})
    records = rg.regenerate_batch(stub, rows, seed=0, skip_bad_rows=True)
    assert [len(c) for c in stub.calls] == [2, 1]  # rows 0 and 2, then row 2 only
    assert records[0] == {"row": 0, "bad": "f:1: the chat template failed on this conversation (refused)"}
    assert records[1] == {"row": 1, "bad": "f:2: the chat template failed on this conversation (refused)"}
    assert records[2]["messages"][1:] == [
        {"role": "assistant", "content": "r1:1"},
        {"role": "user", "content": "U2"},
        {"role": "assistant", "content": "r2:3"},
    ]
    # without it the batch stops at the row, naming it and the flag
    with pytest.raises(BadRow, match="^f:1: the chat template failed .* Pass --skip_bad_rows"):
        rg.regenerate_batch(StubGenerator(refuse={(0, 4)}), rows, seed=0)


HARMONY_SPECIALS = (
    "<|start|>",
    "<|message|>",
    "<|end|>",
    "<|channel|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
)
# gpt-oss's harmony format, as its template renders a conversation (the final answer's reasoning kept)
HARMONY_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% else %}{% if m.thinking and loop.last %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}"
    "<|end|>{% endif %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}"
    "{% if loop.last %}<|return|>{% else %}<|end|>{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def test_an_answer_in_channels_is_stored_as_reasoning_and_answer_and_trains_as_generated():
    """gpt-oss writes its reasoning and its answer in channels marked by special tokens: both are kept (its
    reasoning as reasoning_content), and the stored row renders back to exactly the generated tokens."""
    tokenizer = build_tokenizer(None, HARMONY_SPECIALS, HARMONY_TEMPLATE, eos_token="<|return|>")
    chat = rg.ChatTurns(tokenizer, {}, {tokenizer.convert_tokens_to_ids("<|return|>")})
    messages = [{"role": "user", "content": "the quick fox"}]
    prompt = chat.prompt_ids(rg.plan_row(0, "h.jsonl:1", messages), messages)
    generated = tokenizer(
        "<|channel|>analysis<|message|>the lazy dog<|end|><|start|>assistant<|channel|>final<|message|>"
        "the fox<|return|>",
        add_special_tokens=False,
    )["input_ids"]
    answer = chat.answer(generated)
    assert (answer.text, answer.reasoning, answer.lost) == ("the fox", "the lazy dog", ())
    ids, mask, note = ChatTokenizer(tokenizer, {})([*messages, answer.turn()], "h.jsonl:1")
    assert ids == prompt + generated and mask == [0] * len(prompt) + [1] * len(generated) and note == ""
    # cut by --max_new_tokens inside its final message: the reasoning and the answer so far, counted as cut
    cut = chat.answer(generated[:-3])
    assert (cut.reasoning, cut.hit_max_new_tokens, cut.lost) == ("the lazy dog", True, ())
    # through a server (vLLM's token ids): the same answer, with the server's counts
    from dflash_ddp.engines import Completion, SamplingRequest
    from dflash_ddp.regeneration.served import ServedRow, ServedSettings

    class Server:
        max_model_len = None

        def complete(self, prompt, max_tokens, sampling):
            return Completion(generated, "(its own text)", False, len(generated))

    served = ServedRow(chat, threading.Lock(), Server(), ServedSettings(64, SamplingRequest(), False))
    served.prompt_ids(rg.plan_row(0, "h.jsonl:1", messages), messages)
    assert served([prompt]) == [answer]
    # a tool call in the model's own tokens cannot be stored as text: named, and the row is bad
    call = tokenizer(
        "<|channel|>commentary to=functions.w <|constrain|>json<|message|>{}<|call|>",
        add_special_tokens=False,
    )["input_ids"]
    assert chat.answer(call).lost == ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>")

    class Calls(StubGenerator):
        def __call__(self, prompts):
            return [dataclasses.replace(Answer("x", 3, False), lost=("<|call|>",)) for _ in prompts]

    rows = [rg.plan_row(0, "h.jsonl:1", messages)]
    assert rg.regenerate_batch(Calls(), rows, seed=0, skip_bad_rows=True) == [
        {
            "row": 0,
            "bad": "h.jsonl:1: turn 1: the target answered with special tokens (<|call|>) that structure "
            "its answer (a tool call or a channel in its own tokens) and that a stored text cannot keep",
        }
    ]
    with pytest.raises(BadRow, match="cannot keep. Pass --skip_bad_rows"):
        rg.regenerate_batch(Calls(), rows, seed=0)


def test_tool_calls_are_kept_and_the_answers_around_them_regenerated():
    call = {"role": "assistant", "content": "", "tool_calls": [{"name": "weather", "arguments": "{}"}]}
    messages = [
        {"role": "user", "content": "weather?"},
        call,
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "and tomorrow?"},
        call,
        {"role": "tool", "content": "rain"},
    ]
    # the final answer and the reply after the last tool result; the calls themselves stay as written
    assert rg.plan_row(0, "t.jsonl:1", messages).targets == [3, 7]


def test_a_rows_system_field_is_its_system_prompt_and_stays_a_field(tiny_target, tmp_path):
    """LLaMA-Factory's ShareGPT rows give the system prompt beside the turns: it is the prompt's first turn,
    and the row is written back with it as a field and only its answers replaced (no turn shifted)."""
    rows = [
        {
            "id": "a",
            "system": "Be terse.",
            "conversations": [
                {"from": "human", "value": "Q1"},
                {"from": "gpt", "value": "OLD1"},
                {"from": "human", "value": "Q2"},
                {"from": "gpt", "value": "OLD2"},
            ],
        },
        {"id": "b", "system": "Be terse.", "conversations": [{"from": "human", "value": "Q"}]},
        {
            "id": "c",
            "system": "Be terse.",
            "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "OLD"}],
        },
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = run(tiny_target, data, tmp_path / "out.jsonl")
    assert [r["system"] for r in written] == ["Be terse."] * 3
    first, second, third = written
    assert [t["from"] for t in first["conversations"]] == ["human", "gpt", "human", "gpt"]
    assert [first["conversations"][i]["value"] for i in (0, 2)] == ["Q1", "Q2"]
    assert "OLD1" not in json.dumps(first) and "OLD2" not in json.dumps(first)
    assert [t["from"] for t in second["conversations"]] == ["human", "gpt"]
    assert [t["role"] for t in third["messages"]] == ["user", "assistant"] and "OLD" not in json.dumps(third)
    # the system prompt is in what the target answered
    row = rg.plan_row(0, "w", [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Q"}])
    assert row.targets == [2]


def test_a_tool_call_the_template_drops_is_a_bad_row_before_it_is_answered(tiny_target):
    """An answer after a tool call the template does not render would follow a call the target never saw."""
    info = inspect_target(tiny_target)
    tokenizer = load_target_tokenizer(info.path)
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "w"}}],
    }
    messages = [{"role": "user", "content": "weather?"}, call, {"role": "tool", "content": "sunny"}]
    row = rg.plan_row(0, "t.jsonl:1", messages)
    chat = rg.ChatTurns(tokenizer, {}, {0})
    with pytest.raises(
        BadRow, match="t.jsonl:1: turn 1 calls a tool, which the chat template does not render"
    ):
        chat.prompt_ids(row, row.messages)


def test_a_tool_call_row_stops_the_run_with_one_piece_of_advice(tiny_target, tmp_path, capsys):
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "w"}}],
    }
    messages = [{"role": "user", "content": "weather?"}, call, {"role": "tool", "content": "sunny"}]
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"messages": [*messages, {"role": "assistant", "content": "old"}]}) + "\n")
    assert rg.main(flags(tiny_target, data, tmp_path / "out.jsonl")) == 2
    err = capsys.readouterr().err
    assert "turn 1 calls a tool, which the chat template does not render" in err
    assert err.count("to skip and count such rows") == 1, err


def test_chat_template_file_and_kwargs(tiny_target, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:"
        "{% if enable_thinking is defined and not enable_thinking %} (no thinking){% endif %}{% endif %}"
    )
    info = inspect_target(tiny_target)
    tokenizer = load_target_tokenizer(info.path, str(template))
    model = load_causal_lm(info, torch.device("cpu"), torch.float32)
    row = rg.plan_row(0, "chat.jsonl:7", [{"role": "user", "content": "What is a fox?"}])

    def prompt(**kwargs) -> str:
        config = rg.RegenerateConfig(str(tiny_target), [], "out.jsonl", chat_template_kwargs=kwargs)
        return tokenizer.decode(rg.TargetGenerator(model, tokenizer, config).prompt_ids(row, row.messages))

    assert prompt() == "user: What is a fox?\nassistant:"
    assert prompt(enable_thinking=False) == "user: What is a fox?\nassistant: (no thinking)"

    tokenizer.chat_template = "{{ raise_exception('only system turns, please') }}"
    with pytest.raises(BadRow, match="chat.jsonl:7: the chat template failed .*only system turns"):
        prompt()


def test_multi_turn_and_prompt_only_rows(tiny_target, tmp_path, capsys):
    def user(text):
        return {"role": "user", "content": text}

    def assistant(text):
        return {"role": "assistant", "content": text}

    inputs = [
        {"messages": [{"role": "system", "content": "Be brief."}, user("What is a fox?"), assistant("OLD"),
                      user("And a dog?"), assistant("OLD")]},
        {"messages": [user("What is a list?")]},
        {"conversations": [{"from": "human", "value": "What is a key?"}, {"from": "gpt", "value": "OLD"},
                           {"from": "human", "value": "And a map?"}]},
        {"messages": [user("What is a set?"), assistant("OLD")]},
        {"messages": [user("What is a tuple?")]},
    ]  # fmt: skip
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in inputs))
    out = tmp_path / "out.jsonl"
    rows = run(tiny_target, data, out, batch_size=3)

    expected_roles = [
        ["system", "user", "assistant", "user", "assistant"],
        ["user", "assistant"],
        ["user", "assistant", "user", "assistant"],
        ["user", "assistant"],
        ["user", "assistant"],
    ]
    assert [[m["role"] for m in messages_of(r)] for r in rows] == expected_roles
    assert [t["from"] for t in rows[2]["conversations"]] == ["human", "gpt", "human", "gpt"]  # its own format
    for row, source in zip(rows, inputs, strict=True):
        prompts = [m for m in messages_of(row) if m["role"] != "assistant"]
        given = source.get("messages") or [
            {"role": {"human": "user"}[t["from"]], "content": t["value"]}
            for t in source["conversations"]
            if t["from"] != "gpt"
        ]
        assert prompts == [m for m in given if m["role"] != "assistant"]  # prompts kept, in order
        assert all(m["content"] not in ("", "OLD") for m in messages_of(row) if m["role"] == "assistant")
    assert not out.with_name("out.jsonl.parts").exists() and not out.with_name("out.jsonl.lock").exists()

    # a finished OUT is left alone: asked again, it says so; asked with other settings (which OUT does not
    # follow), it names them (OUT.settings.json holds them)
    before = out.read_bytes()
    assert rg.main(flags(tiny_target, data, out, batch_size=3)) == 0
    assert rg.main(flags(tiny_target, data, out, batch_size=3, max_new_tokens=9)) == 2
    assert (
        "is a finished run with other settings (then -> now): max_new_tokens: 8 -> 9"
        in capsys.readouterr().err
    )
    assert rg.main(flags(tiny_target, data, out, batch_size=3, keep_truncated=False)) == 2
    # ... and so are changed data, another target and another chat template, which it did not follow
    capsys.readouterr()
    other_target = tmp_path / "other_target"
    shutil.copytree(tiny_target, other_target)
    template = tmp_path / "plain.jinja"
    template.write_text(CHATML_TEMPLATE + "{# another template #}")
    for changed, named in (
        (flags(other_target, data, out, batch_size=3), "target_model: "),
        (
            flags(tiny_target, data, out, batch_size=3) + ["--chat_template", str(template)],
            "chat_template_sha256",
        ),
    ):
        assert rg.main(changed) == 2
        assert f"is a finished run with other settings (then -> now): {named}" in capsys.readouterr().err
    data.write_text(data.read_text() + data.read_text().splitlines(keepends=True)[0])
    assert rg.main(flags(tiny_target, data, out, batch_size=3)) == 2
    assert "data: [" in capsys.readouterr().err
    assert out.read_bytes() == before
    # a file this tool did not write (no OUT.settings.json) is not taken for a finished run
    stranger = tmp_path / "human.jsonl"
    stranger.write_text(data.read_text())
    assert rg.main(flags(tiny_target, data, stranger, batch_size=3)) == 2
    assert "no human.jsonl.settings.json beside it says this tool wrote it" in capsys.readouterr().err


def test_a_row_the_template_refuses_stops_the_run_or_is_skipped(tiny_target, chat_data, tmp_path, capsys):
    template = tmp_path / "needs_a_user.jinja"  # like Qwen3's: a prompt without a user turn is refused
    template.write_text(
        "{% if not (messages | selectattr('role', 'equalto', 'user') | list) %}"
        "{{ raise_exception('No user query found in messages.') }}{% endif %}" + CHATML_TEMPLATE
    )
    lines = chat_data.read_text().splitlines(keepends=True)[:4]
    refused = {"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join([*lines[:2], json.dumps(refused) + "\n", *lines[2:]]))
    out, parts = tmp_path / "out.jsonl", tmp_path / "out.jsonl.parts"
    settings = {"batch_size": 2, "chat_template": template}

    # found only when its prompt is rendered: the run stops there, naming it, and keeps batch 0's rows
    assert rg.main(flags(tiny_target, data, out, **settings)) == 2
    err = capsys.readouterr().err
    assert f"{data}:3: the chat template failed" in err and "No user query found" in err, err
    assert "--skip_bad_rows" in err and "Traceback" not in err
    assert err.count("to skip and count such rows") == 1, err  # said once, whoever found the row bad
    assert sorted(finished_rows(parts)) == [0, 1] and not out.exists()

    # the same command with --skip_bad_rows continues the run (the flag is not a setting of OUT.parts)
    summary = rg.regenerate(rg.parse_args(flags(tiny_target, data, out, **settings, skip_bad_rows=True)))
    assert summary.bad == 1 and summary.written == 4
    assert "1 bad rows found while generating (--skip_bad_rows)" in capsys.readouterr().out
    users = [json.loads(line)["messages"][0]["content"] for line in lines]
    assert [r["messages"][0]["content"] for r in read_rows(out)] == users  # the other rows, in order
    assert not parts.exists()


def test_sampling_is_seeded_per_batch(tiny_target, chat_data, tmp_path, monkeypatch):
    data = first_rows(chat_data, tmp_path / "rows.jsonl", 8)
    settings = {"batch_size": 2, "temperature": 1.0, "top_k": 100}
    greedy = run(tiny_target, data, tmp_path / "greedy.jsonl", batch_size=2)
    sampled = run(tiny_target, data, tmp_path / "a.jsonl", **settings)
    assert run(tiny_target, data, tmp_path / "b.jsonl", **settings) == sampled
    assert run(tiny_target, data, tmp_path / "c.jsonl", **settings, seed=1) != sampled
    assert sampled != greedy
    # the settings stay beside the finished output (the parts directory is gone), for the export's stamp
    recorded = json.loads(settings_path(tmp_path / "a.jsonl").read_text())
    assert {k: recorded[k] for k in settings} == settings and recorded["keep_truncated"] is True

    # Two ranks of a world of 2, one after the other in this process: rank 1 takes batches 1 and 3 with a
    # fresh RNG, rank 0 then takes 0 and 2 and merges; the output is the one-process output.
    out = tmp_path / "two_ranks.jsonl"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        assert rg.main(flags(tiny_target, data, out, **settings)) == 0
        assert out.exists() == (rank == "0")
    assert read_rows(out) == sampled


def test_progress_lines_say_how_many_rows_are_left_and_when_the_job_ends(
    tiny_target, chat_data, tmp_path, monkeypatch, capsys
):
    """Rank 0 of a world of 2 takes batches 0 and 2 of 4 (its share of the job): each progress line says how
    many of its rows are left and about how long they take, which is the job's time left."""
    data = first_rows(chat_data, tmp_path / "rows.jsonl", 8)
    monkeypatch.setattr(rg, "PROGRESS_EVERY_S", -1.0)  # a line after every batch
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert rg.main(flags(tiny_target, data, tmp_path / "out.jsonl", batch_size=2)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rank 0: batch")]
    assert [line.split(", ")[0] for line in lines] == ["rank 0: batch 1/4", "rank 0: batch 3/4"]
    assert "2 of its 4 rows left" in lines[0] and "0 of its 4 rows left" in lines[1]
    assert all("left, under a minute left" in line or " min left" in line for line in lines), lines
    assert rg.time_left(30, 10, 60.0) == "about 3 min left" and rg.time_left(5, 0, 1.0) == "time left unknown"


def test_other_settings_than_the_parts_dir_is_an_error(tiny_target, chat_data, tmp_path, monkeypatch, capsys):
    data = first_rows(chat_data, tmp_path / "rows.jsonl", 4)
    out = tmp_path / "out.jsonl"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert rg.main(flags(tiny_target, data, out, batch_size=2)) == 0  # rank 1 alone: rows 2, 3 only
    parts = tmp_path / "out.jsonl.parts"
    assert sorted(finished_rows(parts)) == [2, 3] and not out.exists()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    capsys.readouterr()

    assert rg.main(flags(tiny_target, data, out, batch_size=2, max_new_tokens=9)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert "other settings" in err and "max_new_tokens: 8 -> 9" in err and f"delete {parts}" in err

    original = data.read_text()
    data.write_text(original.replace("What", "Who", 1))  # same file, other content
    assert rg.main(flags(tiny_target, data, out, batch_size=2)) == 2
    assert "data:" in capsys.readouterr().err
    assert sorted(finished_rows(parts)) == [2, 3] and not out.exists()  # nothing was added or merged

    # --keep_truncated (and --skip_bad_rows) are no settings of the parts dir: another value continues it
    data.write_text(original)
    argv = flags(tiny_target, data, out, batch_size=2, keep_truncated=False, skip_bad_rows=True)
    summary = rg.regenerate(rg.parse_args(argv))
    assert out.exists() and not parts.exists()
    # by default the rows cut off by --max_new_tokens are counted and left out
    assert (
        summary.written + summary.empty + summary.hit_max_new_tokens == 4 and summary.hit_max_new_tokens > 0
    )
    assert len(read_rows(out)) == summary.written
    assert "cut off by --max_new_tokens (8) left out" in capsys.readouterr().out


def test_a_rank_finishing_after_the_merge_says_so(tiny_target, chat_data, tmp_path, monkeypatch, capsys):
    data = first_rows(chat_data, tmp_path / "rows.jsonl", 4)
    out = tmp_path / "out.jsonl"
    argv = flags(tiny_target, data, out, batch_size=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    write = rg.PartWriter.write

    def write_then_rank_0_runs(self, records):
        """Rank 1's batch is on disk; rank 0 now does its batch, finds every row finished and writes OUT."""
        write(self, records)
        if self.path.name == "rank1-of-2.jsonl":
            monkeypatch.setenv("RANK", "0")
            assert rg.main(argv) == 0 and out.exists()

    monkeypatch.setattr(rg.PartWriter, "write", write_then_rank_0_runs)
    monkeypatch.setenv("RANK", "1")
    assert rg.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}: 4 of 4 rows" in printed
    assert f"{out} was written by another rank" in printed.splitlines()[-1], printed
    assert not (tmp_path / "out.jsonl.lock").exists()


def test_every_field_of_a_row_survives_regeneration_its_resume_and_the_merge(
    tiny_target, chat_data, tmp_path, monkeypatch, capsys
):
    """Rows with an id, a source and nested metadata (some in ShareGPT format) come back whole, only their
    answers regenerated: in one run, and in a run interrupted twice (rank 1 of 2 alone, then a process
    stopped by a failing disk after its first batch) whose parts a last process continues and merges: the
    same bytes."""
    given = with_fields(read_rows(chat_data)[:8])
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in given))
    settings = {"batch_size": 2}
    reference = run(tiny_target, data, tmp_path / "reference.jsonl", **settings)
    assert_fields_kept(reference, given)

    out, parts = tmp_path / "out.jsonl", tmp_path / "out.jsonl.parts"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert rg.main(flags(tiny_target, data, out, **settings)) == 0  # batches 1 and 3: rows 2, 3, 6, 7
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    write = rg.PartWriter.write

    def write_then_fail(self, records):
        write(self, records)
        raise OSError("No space left on device")

    monkeypatch.setattr(rg.PartWriter, "write", write_then_fail)
    assert rg.main(flags(tiny_target, data, out, **settings)) == 1  # batch 0 written, then stopped
    assert sorted(finished_rows(parts)) == [0, 1, 2, 3, 6, 7] and not out.exists()
    monkeypatch.setattr(rg.PartWriter, "write", write)
    assert rg.main(flags(tiny_target, data, out, **settings)) == 0
    assert not parts.exists() and "wrote" in capsys.readouterr().out
    assert out.read_text() == (tmp_path / "reference.jsonl").read_text()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"batch_size": 0}, "--batch_size 0: must be a positive integer"),
        ({"top_p": 0.5}, "only apply when sampling"),
        ({"temperature": -1}, "--temperature -1.0: must be >= 0"),
        ({"chat_template": "missing.jinja"}, "--chat_template missing.jinja: file not found"),
        ({"data": "missing.jsonl"}, "--data missing.jsonl: file not found"),
        ({"device": "tpu"}, "--device tpu: choose auto, cpu or cuda"),
        ({"chat_template_kwargs": '{"tokenize": false}'}, "--chat_template_kwargs: tokenize cannot be set"),
        ({"out": "DATA"}, "is one of the --data files"),
        ({"target_model": "no_such_dir"}, "--target_model no_such_dir: not a directory"),
        ({"data": "ROW"}, "nothing to generate"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_target, chat_data, tmp_path, capsys, settings, message):
    bad_row = tmp_path / "bad.jsonl"
    bad_row.write_text(
        json.dumps({"messages": [{"role": "system", "content": "Only a system turn."}]}) + "\n"
    )
    settings = {k: {"DATA": chat_data, "ROW": bad_row}.get(v, v) for k, v in settings.items()}
    argv = flags(settings.pop("target_model", tiny_target), settings.pop("data", chat_data),
                 settings.pop("out", tmp_path / "out.jsonl"), **settings)  # fmt: skip
    assert rg.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    if message == "nothing to generate":
        assert f"{bad_row}:1" in err
        # --skip_bad_rows skips such a row instead; with nothing left the run still stops, saying why
        assert rg.main([*argv, "--skip_bad_rows"]) == 2
        assert "no row has anything to generate" in capsys.readouterr().err


@pytest.mark.processes
def test_sigkill_and_restart_give_the_uninterrupted_rows_once_each(
    tiny_target, chat_data, tmp_path, monkeypatch
):
    data = first_rows(chat_data, tmp_path / "rows.jsonl", 24)
    settings = {"batch_size": 2, "max_new_tokens": 24}
    reference = run(tiny_target, data, tmp_path / "reference.jsonl", **settings)
    assert len(reference) == 24

    # A 2-process torchrun job, paused 1 s after each batch it writes, killed as a whole without warning
    # once both ranks have rows on disk and most rows are still to do.
    out = tmp_path / "out.jsonl"
    parts = tmp_path / "out.jsonl.parts"
    python_path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(
        [
            *torchrun_cmd(2),
            str(SCRIPTS / "regenerate_slowly.py"),
            "1.0",
            *flags(tiny_target, data, out, **settings),
        ],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    files = [parts / "rank0-of-2.jsonl", parts / "rank1-of-2.jsonl"]
    deadline = time.time() + 120
    while not all(f.exists() and f.read_bytes().count(b"\n") >= 2 for f in files):
        assert job.poll() is None, job.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "the job wrote no rows in time"
        time.sleep(0.02)
    kill_job(job)
    job.stderr.close()
    assert not out.exists()

    # A kill in the middle of a write leaves half a line: cut rank 1's last row in half, so that its batch
    # is finished only in part.
    lines = files[1].read_bytes().split(b"\n")[:-1]
    files[1].write_bytes(b"".join(line + b"\n" for line in lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    done_at_kill = finished_rows(parts)
    assert 0 < len(done_at_kill) < 24 and len(set(done_at_kill)) == len(done_at_kill)

    # The restart in one process: it must add each missing row once and never rewrite a finished one.
    written = {}
    merge = rg.merge

    def checked_merge(out_path, parts_dir, rows, *args):
        written["rows"] = finished_rows(parts_dir)
        return merge(out_path, parts_dir, rows, *args)

    monkeypatch.setattr(rg, "merge", checked_merge)
    assert rg.main(flags(tiny_target, data, out, **settings)) == 0
    assert sorted(written["rows"]) == list(range(24))  # each row once across the old and new part files
    assert read_rows(out) == reference
    assert not parts.exists() and not (tmp_path / "out.jsonl.lock").exists()


@pytest.mark.processes
def test_sigterm_stops_with_one_line_naming_the_kept_rows_and_the_run_continues(
    tiny_target, chat_data, tmp_path
):
    """A scheduler's preemption (SIGTERM) stops as Ctrl-C does: one line naming OUT's parts, exit 143, and
    the same command finishes the rows as an uninterrupted run writes them."""
    data = first_rows(chat_data, tmp_path / "rows.jsonl", 12)
    settings = {"batch_size": 2, "max_new_tokens": 16}
    reference = run(tiny_target, data, tmp_path / "reference.jsonl", **settings)
    out, parts = tmp_path / "out.jsonl", tmp_path / "out.jsonl.parts"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    job = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPTS / "regenerate_slowly.py"),
            "1.0",
            *flags(tiny_target, data, out, **settings),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.time() + 120
    while not (parts.is_dir() and finished_rows(parts)):
        assert job.poll() is None and time.time() < deadline, job.stderr.read()[-3000:]
        time.sleep(0.02)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143
    line = job.stderr.read().strip().splitlines()[-1]
    assert (
        line == f"stopped (SIGTERM): the rows finished so far are kept in {parts}; the same command continues"
    )
    assert not out.exists()
    assert rg.main(flags(tiny_target, data, out, **settings)) == 0
    assert read_rows(out) == reference


def test_the_start_line_names_the_first_unreadable_row_skipped(tiny_target, chat_data, tmp_path, capsys):
    lines = chat_data.read_text().splitlines(keepends=True)[:2]
    data = tmp_path / "rows.jsonl"
    data.write_text(lines[0] + '{"messages": [\n' + lines[1])
    assert rg.main(flags(tiny_target, data, tmp_path / "out.jsonl", skip_bad_rows=True)) == 0
    assert f"(1 unreadable rows skipped, the first: {data}:2: malformed JSON" in capsys.readouterr().out
