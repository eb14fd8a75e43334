"""The tokenized data set: filtering with counts, several processes, and a cache that is reused exactly
when files, tokenizer, template and settings are unchanged."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer

from dflash_ddp.data import dataset
from dflash_ddp.data.chat_template import ChatTokenizer
from dflash_ddp.data.dataset import TokenizeSettings, load_or_tokenize, tokenize_dataset
from dflash_ddp.data.sources import BadRow

from conftest import conversation

SETTINGS = TokenizeSettings(max_seq_len=256, block_size=4)


def chat(tokenizer_dir, **template_kwargs) -> ChatTokenizer:
    return ChatTokenizer(AutoTokenizer.from_pretrained(tokenizer_dir), template_kwargs)


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_samples_match_their_conversations_and_batches_pad_on_the_right(tiny_target, chat_data):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    data, stats = tokenize_dataset(chat(tiny_target), [str(chat_data)], SETTINGS)
    assert len(data) == stats.kept == stats.rows == 48
    ids, mask = data.sample(5)
    expected = tokenizer.apply_chat_template(conversation(5)["messages"], tokenize=True, return_dict=True)
    assert ids.tolist() == expected["input_ids"]
    assert tokenizer.decode(ids[mask.bool()]) == conversation(5)["messages"][1]["content"] + "<|im_end|>"
    batch = data.batch([5, 0], pad_id=0)
    assert batch.input_ids.shape == (2, max(data.lengths[5], data.lengths[0]))
    assert batch.sample_ids.tolist() == [5, 0] and batch.num_tokens == data.lengths[5] + data.lengths[0]
    assert stats.tokens == sum(data.lengths) and stats.response_tokens == int(data.loss_mask.sum()) - sum(
        int(data.sample(i)[1][0]) for i in range(len(data))
    )


def test_overlength_truncate_or_drop_and_too_short_samples_are_counted(tiny_target, chat_data):
    lengths = tokenize_dataset(chat(tiny_target), [str(chat_data)], SETTINGS)[0].lengths
    limit = sorted(lengths)[len(lengths) // 2]  # half the samples are longer
    longer = sum(n > limit for n in lengths)
    cut, cut_stats = tokenize_dataset(
        chat(tiny_target), [str(chat_data)], TokenizeSettings(max_seq_len=limit, block_size=4)
    )
    assert cut_stats.truncated == longer and len(cut) == 48 and max(cut.lengths) == limit
    kept, drop_stats = tokenize_dataset(
        chat(tiny_target), [str(chat_data)], TokenizeSettings(limit, 4, overlength="drop")
    )
    assert drop_stats.overlength_dropped == longer and len(kept) == 48 - longer
    assert max(kept.lengths) <= limit
    # a block size so large that only the longest answers have 2 * block_size response tokens
    full, _ = tokenize_dataset(chat(tiny_target), [str(chat_data)], SETTINGS)
    responses = sorted(int(full.sample(i)[1][1:].sum()) for i in range(len(full)))
    block_size = responses[len(responses) // 2] // 2 + 1
    _, short_stats = tokenize_dataset(chat(tiny_target), [str(chat_data)], TokenizeSettings(256, block_size))
    assert short_stats.too_short == sum(r < 2 * block_size for r in responses) > 0
    assert short_stats.kept == 48 - short_stats.too_short
    with pytest.raises(ValueError, match="no sample is left with at least 400 response tokens"):
        tokenize_dataset(chat(tiny_target), [str(chat_data)], TokenizeSettings(256, 200))


@pytest.mark.processes
def test_several_processes_give_the_same_data(tiny_target, tmp_path, monkeypatch):
    rows = [conversation(i) for i in range(600)]
    rows[300] = {"messages": [{"role": "user", "content": "no answer"}]}
    path = write_rows(tmp_path / "many.jsonl", rows)
    settings = TokenizeSettings(256, 4, skip_bad_rows=True)
    one, one_stats = tokenize_dataset(chat(tiny_target), [str(path)], settings, num_proc=1)
    monkeypatch.setattr(dataset, "PROGRESS_EVERY_S", -1.0)  # a progress line after every chunk
    progress = []
    two, two_stats = tokenize_dataset(
        chat(tiny_target), [str(path)], settings, num_proc=2, log=progress.append
    )
    assert progress[0] == "tokenizing 599 rows with 2 process(es)"
    assert [line.split(" (")[0] for line in progress[1:]] == [
        f"tokenized {n}/599 rows" for n in (256, 512, 599)
    ]
    assert one.fingerprint() == two.fingerprint() and one_stats == two_stats
    assert one_stats.bad_rows == 1 and len(one) == 599


def test_the_cache_is_reused_only_when_nothing_changed(tiny_target, chat_data, tmp_path, monkeypatch):
    tokenizer_dir = tmp_path / "tokenizer"
    shutil.copytree(tiny_target, tokenizer_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    data_file = tmp_path / "chat.jsonl"
    shutil.copy(chat_data, data_file)
    cache = tmp_path / "cache"

    def load(settings=SETTINGS, template_suffix="", **kwargs):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tokenizer.chat_template += template_suffix
        chat = ChatTokenizer(tokenizer, kwargs)
        return load_or_tokenize(chat, tokenizer_dir, [str(data_file)], settings, cache, log=lambda _: None)

    first, stats, from_cache = load()
    assert not from_cache
    tokenize = dataset.tokenize_dataset
    monkeypatch.setattr(dataset, "tokenize_dataset", lambda *a, **k: pytest.fail("tokenized again"))
    again, again_stats, from_cache = load()
    assert from_cache and again.fingerprint() == first.fingerprint() and again_stats == stats
    assert torch.equal(again.offsets, first.offsets)
    assert load(TokenizeSettings(256, 4, skip_bad_rows=True))[2]  # clean data: the same tokens either way
    monkeypatch.setattr(dataset, "tokenize_dataset", tokenize)

    assert not load(TokenizeSettings(max_seq_len=128, block_size=4))[2]  # a setting
    assert not load(enable_thinking=False)[2]  # the template's arguments
    assert not load(template_suffix="{# another template #}")[2]  # the template (--chat_template)
    config = tokenizer_dir / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"model_max_length": 4096}))
    assert not load()[2]  # the tokenizer's files
    with data_file.open("a") as f:
        f.write(json.dumps(conversation(100)) + "\n")
    changed, _, from_cache = load()  # the data's content
    assert not from_cache and len(changed) == len(first) + 1
    assert load()[2]
    assert not list(cache.glob("*.tmp*"))  # no half-written cache left behind
    # a bad row, skipped into a cache by one run: a run without --skip_bad_rows is refused as its data would
    with data_file.open("a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    assert not load(TokenizeSettings(256, 4, skip_bad_rows=True))[2]
    with pytest.raises(
        BadRow, match=r"chat.jsonl:\d+: .*\(1 bad rows in all, skipped by an earlier run with"
    ):
        load()


CONCURRENT = """
import sys, time
from pathlib import Path
from transformers import AutoTokenizer
from dflash_ddp.data import dataset
from dflash_ddp.data.chat_template import ChatTokenizer
target, data, cache, go = sys.argv[1:]
tokenize = dataset.tokenize_dataset
def slow_tokenize(*args, **kwargs):  # long enough that all processes overlap
    time.sleep(2)
    return tokenize(*args, **kwargs)
dataset.tokenize_dataset = slow_tokenize
chat = ChatTokenizer(AutoTokenizer.from_pretrained(target), {})
Path(go + ".ready." + str(__import__("os").getpid())).touch()
while not Path(go).exists():  # start together, after the imports
    time.sleep(0.01)
out, stats, from_cache = dataset.load_or_tokenize(chat, Path(target), [data], dataset.TokenizeSettings(256, 4), Path(cache))
print("FROM_CACHE" if from_cache else "TOKENIZED", out.fingerprint())
"""


@pytest.mark.processes
def test_processes_of_one_job_tokenize_once(tiny_target, chat_data, tmp_path):
    go = tmp_path / "go"
    cmd = [
        sys.executable,
        "-c",
        CONCURRENT,
        str(tiny_target),
        str(chat_data),
        str(tmp_path / "cache"),
        str(go),
    ]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    deadline = time.time() + 120
    while len(list(tmp_path.glob("go.ready.*"))) < 3:
        assert time.time() < deadline and all(p.poll() is None for p in procs), "the processes did not start"
        time.sleep(0.05)
    go.touch()
    outputs = [p.communicate(timeout=120)[0].split("\n")[-2].split() for p in procs]
    assert sorted(kind for kind, _ in outputs) == ["FROM_CACHE", "FROM_CACHE", "TOKENIZED"]
    assert len({fingerprint for _, fingerprint in outputs}) == 1


def test_a_damaged_cache_is_replaced_and_an_unusable_cache_dir_is_a_clear_error(
    tiny_target, chat_data, tmp_path
):
    cache = tmp_path / "cache"
    logs = []
    first, _, _ = load_or_tokenize(
        chat(tiny_target), tiny_target, [str(chat_data)], SETTINGS, cache, log=logs.append
    )
    (cached,) = cache.glob("*.safetensors")
    cached.write_bytes(cached.read_bytes()[:100])  # e.g. a copy cut short
    again, _, from_cache = load_or_tokenize(
        chat(tiny_target), tiny_target, [str(chat_data)], SETTINGS, cache, log=logs.append
    )
    assert not from_cache and again.fingerprint() == first.fingerprint()
    assert any("ignoring the unreadable cache file" in line for line in logs)
    assert load_or_tokenize(chat(tiny_target), tiny_target, [str(chat_data)], SETTINGS, cache, log=print)[2]
    # tokens changed in a file that still reads (a shared --cache_dir rewritten, bits flipped on disk): the
    # hash written with them, which a resume compares as the data fingerprint, no longer matches them
    with safe_open(cached, framework="pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    tensors["input_ids"] = tensors["input_ids"].flip(0).contiguous()
    save_file(tensors, cached, metadata=metadata)
    logs.clear()
    again, _, from_cache = load_or_tokenize(
        chat(tiny_target), tiny_target, [str(chat_data)], SETTINGS, cache, log=logs.append
    )
    assert not from_cache and again.fingerprint() == first.fingerprint()
    assert any("do not match the hash written with them" in line for line in logs), logs
    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")
    with pytest.raises(
        ValueError, match=f"the tokenized-data cache {blocked}/cache cannot be written .*--cache_dir DIR"
    ):
        load_or_tokenize(chat(tiny_target), tiny_target, [str(chat_data)], SETTINGS, blocked / "cache")


def test_a_sample_truncated_then_too_short_is_counted_once(tiny_target, tmp_path):
    # a long prompt and a short answer: cut to --max_seq_len, almost no response tokens are left
    row = {
        "messages": [
            {"role": "user", "content": "the quick fox " * 40},
            {"role": "assistant", "content": "a dog"},
        ]
    }
    path = write_rows(tmp_path / "long_prompt.jsonl", [row, conversation(1)])
    _, stats = tokenize_dataset(
        chat(tiny_target), [str(path)], TokenizeSettings(max_seq_len=100, block_size=4)
    )
    assert stats.too_short == 1 and stats.truncated == 1 and stats.kept == 1  # conversation(1) was cut


def test_a_huge_row_is_cut_to_the_characters_its_first_tokens_can_span(tiny_target, tmp_path, monkeypatch):
    # a row of 200k characters (words, CJK, emoji, runs of spaces), its answer past the cut too
    pieces = ["hello ", "数据", "🙂", " " * 9, "representation", "\n\n", "x=1;"]
    text = "".join(pieces[(i * 7919) % len(pieces)] for i in range(20_000))
    row = {"messages": [{"role": "user", "content": "say it"}, {"role": "assistant", "content": text}]}
    # and one whose answer quotes a token text past the cut: a template may render its start by it
    marked = {"messages": [row["messages"][0], {"role": "assistant", "content": text + "<|im_end|> done"}]}
    path = write_rows(tmp_path / "huge.jsonl", [row, marked])
    settings = TokenizeSettings(max_seq_len=256, block_size=4)
    tokenizer = chat(tiny_target)
    whole_ids, whole_mask, _ = tokenizer(row["messages"], "huge.jsonl:1")
    bound = (256 + dataset.CUT_MARGIN_TOKENS) * dataset.longest_token_chars(tokenizer.tokenizer)
    assert bound < len(text)
    rendered = []  # the length of each answer the template is given
    call = ChatTokenizer.__call__
    monkeypatch.setattr(
        ChatTokenizer,
        "__call__",
        lambda self, m, *a: rendered.append(len(m[1]["content"])) or call(self, m, *a),
    )
    data, stats = tokenize_dataset(tokenizer, [str(path)], settings)
    assert rendered == [bound, len(marked["messages"][1]["content"])]
    for i in range(2):
        ids, mask = data.sample(i)
        assert ids.tolist() == whole_ids[:256] and mask.tolist() == whole_mask[:256]
    assert stats.truncated == 2 and stats.kept == 2


def test_rows_trained_in_a_context_the_target_is_not_served_are_counted_and_said(tmp_path):
    from test_chat_template import R1_STYLE

    from conftest import build_tokenizer

    tokenizer = build_tokenizer(None, ("<|User|>", "<|Assistant|>", "<|eos|>"), R1_STYLE, eos_token="<|eos|>")
    thought = {"role": "assistant", "content": "the quick fox\n</think>\n\n" + "the lazy dog " * 8}
    rows = [{"messages": [{"role": "user", "content": f"the fox {i}"}, thought]} for i in range(3)]
    path = write_rows(tmp_path / "r1.jsonl", rows)
    _, stats = tokenize_dataset(ChatTokenizer(tokenizer, {}), [str(path)], SETTINGS)
    assert stats.context_differs == 3 and len(stats.context_examples) == 3
    (note,) = stats.notes()
    assert note.startswith("warning: 3 of the 3 rows kept train an assistant turn after other text than the")
    assert f"first: {path}:1: turn 1 is trained after " in note


def test_tokenizing_processes_follow_the_data_and_the_cores(monkeypatch):
    monkeypatch.setattr(dataset.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert dataset.tokenizing_processes(3, 10) == 3  # as asked
    assert dataset.tokenizing_processes(0, 19_999) == 1  # small data: starting workers costs more
    assert dataset.tokenizing_processes(0, 400_000) == 8  # one a core, at most 8
    monkeypatch.setattr(dataset.os, "sched_getaffinity", lambda pid: {0, 1})
    assert dataset.tokenizing_processes(0, 400_000) == 2


def test_a_cache_without_room_is_refused_before_tokenizing_and_a_wait_is_said(
    tiny_target, chat_data, tmp_path, monkeypatch
):
    import fcntl
    import threading
    from collections import namedtuple

    cache = tmp_path / "cache"
    cache.mkdir()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(dataset.shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1000))
    monkeypatch.setattr(dataset, "tokenize_dataset", lambda *a, **k: pytest.fail("tokenized on a full disk"))
    with pytest.raises(
        ValueError, match=f"--cache_dir {cache}: 0.00 GiB free, and the tokenized data of these"
    ):
        load_or_tokenize(chat(tiny_target), tiny_target, [str(chat_data)], SETTINGS, cache)
    monkeypatch.undo()
    # another process holds the lock: the wait is said, then the data is tokenized once it is free
    key = dataset.cache_key(chat(tiny_target), tiny_target, [str(chat_data)], SETTINGS)
    holder = (cache / f"tokenized-{key}.lock").open("a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    lines = []
    threading.Timer(0.5, holder.close).start()
    _, _, from_cache = load_or_tokenize(
        chat(tiny_target), tiny_target, [str(chat_data)], SETTINGS, cache, log=lines.append
    )
    assert not from_cache and lines[0].startswith(f"waiting for the tokenized-data cache {cache}")
