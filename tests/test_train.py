"""The colocated training job through its real entry point: bad inputs, a short run, its files."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_ddp.checkpoint.manifest import verify_checkpoint
from dflash_ddp.train import main

from conftest import conversation
from helpers import train_flags


def base_args(tiny_target, chat_data, out):
    return train_flags(tiny_target, chat_data, out, tokens_per_batch=1024, logging_steps=5, save_steps=10)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--target_layer_ids", "1,6"],
            "--target_layer_ids \\[1, 6\\]: \\[6\\] out of range; the target has 6 layers",
        ),
        (["--mask_token_id", "100000"], "--mask_token_id 100000 is outside the target's embedding"),
        (["--block_size", "1"], "--block_size 1: must be at least 2"),
    ],
)
def test_bad_inputs_exit_2_with_a_message(tiny_target, chat_data, tmp_path, capsys, extra, message):
    assert main(base_args(tiny_target, chat_data, tmp_path / "run") + extra) == 2
    assert re.search(message, capsys.readouterr().err)


def test_target_without_weights_is_refused(tiny_target, chat_data, tmp_path, capsys):
    empty = tmp_path / "empty_target"
    empty.mkdir()
    (empty / "config.json").write_text((tiny_target / "config.json").read_text())
    assert main(base_args(empty, chat_data, tmp_path / "run")) == 2
    assert "no *.safetensors weights" in capsys.readouterr().err


def test_tokenizer_without_mask_token_asks_for_mask_token_id(tiny_target, chat_data, tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    for f in tiny_target.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg.pop("mask_token", None)
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert main(base_args(target, chat_data, tmp_path / "run")) == 2
    assert "pass --mask_token_id" in capsys.readouterr().err


def test_plan_prints_topology_without_training(tiny_target, chat_data, tmp_path, capsys):
    assert main(base_args(tiny_target, chat_data, tmp_path / "run") + ["--plan"]) == 0
    out = capsys.readouterr().out
    assert "colocated" in out and "target_layer_ids" in out
    assert not (tmp_path / "run").exists()


def test_a_sequence_longer_than_the_batch_budget_is_a_batch_of_its_own(tiny_target, tmp_path, capsys):
    """--max_seq_len 4096 with --tokens_per_batch 512: each long multi-turn conversation is one batch, whole
    (all its assistant turns in the loss), and --plan sizes the message for it."""
    data = tmp_path / "long.jsonl"
    turns = lambda seed: [m for t in range(30) for m in conversation(seed * 100 + t)["messages"]]  # noqa: E731
    data.write_text("".join(json.dumps({"messages": turns(i)}) + "\n" for i in range(3)))
    args = train_flags(tiny_target, data, tmp_path / "run", max_seq_len=4096, tokens_per_batch=512)
    args += ["--max_steps", "3", "--save_steps", "3", "--logging_steps", "1"]
    assert main([*args, "--plan"]) == 0
    assert "up to 3.0 MiB of features per batch" in capsys.readouterr().out  # 4096 x 3 taps x 64 x fp32
    assert main(args) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lengths = [len(load_conversation_ids(tiny_target, turns(i))) for i in range(3)]
    # each one longer than the budget, truncated to --max_seq_len, one batch a step
    assert min(lengths) > 512 and records[-1]["tokens_seen"] == sum(min(n, 4096) for n in lengths)


def load_conversation_ids(target, messages) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target).apply_chat_template(
        messages, tokenize=True, return_dict=True
    )["input_ids"]


def test_plan_predicts_every_context_length_and_the_longest_that_fits(
    tiny_target, chat_data, tmp_path, capsys
):
    """--plan at 8K-128K tokens per sequence: each rank's peak and the message, judged against this machine or,
    with --plan_gpu_memory, GPUs of that size; the longest length that fits."""
    args = base_args(tiny_target, chat_data, tmp_path / "run") + ["--plan"]
    assert main(args + ["--plan_gpu_memory", "141"]) == 0
    lines = {line.split(":")[0].strip(): line for line in capsys.readouterr().out.splitlines() if ":" in line}
    for length in ("8K", "16K", "32K", "64K", "128K"):
        assert "fits a 141 GiB GPU" in lines[f"context_{length}"], lines
    assert "past the target's max_position_embeddings 512" in lines["context_8K"]
    # the longest that fits, named as past the target's positions (512 here: none of the lengths is within)
    assert (
        "131072 would fit the memory, past the target's max_position_embeddings 512"
        in lines["longest_context"]
    )
    sizes = [float(lines[f"context_{n}"].split("message ")[1].split(" MiB")[0]) for n in ("8K", "16K", "32K")]
    assert sizes[1] == pytest.approx(2 * sizes[0], rel=0.05) and sizes[2] == pytest.approx(
        4 * sizes[0], rel=0.05
    )
    # a GPU of 2.05 GiB (0.05 usable beside CUDA's own), sized as CUDA runs (bf16): the longer lengths no
    # longer fit
    assert main(args + ["--plan_gpu_memory", "2.05"]) == 0
    lines = {line.split(":")[0].strip(): line for line in capsys.readouterr().out.splitlines() if ":" in line}
    assert (
        "does NOT fit a 2.05 GiB GPU" in lines["context_32K"]
        and "fits a 2.05 GiB GPU" in lines["context_16K"]
    )
    assert "16384 would fit the memory" in lines["longest_context"]


def test_short_run_learns_and_writes_contract_checkpoints(tiny_target, chat_data, tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(base_args(tiny_target, chat_data, out) + ["--max_steps", "20", "--learning_rate", "3e-3"]) == 0
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    # Learning, measured on the same batches: a run whose updates are negligible sees the same data and anchors
    # in the same order, so its losses are the noise-free baseline (successive logged losses of one run differ
    # by more from batch to batch than 20 steps on this random-word data lower them).
    still = tmp_path / "still"
    assert (
        main(base_args(tiny_target, chat_data, still) + ["--max_steps", "20", "--learning_rate", "1e-9"]) == 0
    )
    baseline = [json.loads(line)["loss"] for line in (still / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] < b for r, b in zip(records[1:], baseline[1:], strict=True)), (records, baseline)
    for r in records:
        assert {"loss", "accuracy", "tau_estimate", "tokens_per_s", "wait_fraction", "lr"} <= r.keys()

    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000020"
    ckpt = root / "step-00000020"
    assert verify_checkpoint(ckpt) == []
    for name in ("optimizer.pt", "scheduler.pt", "rng-rank0.pt"):
        torch.load(ckpt / name, weights_only=True)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == 20 and state["tokens_seen"] > 0
    assert set(state["fingerprints"]) == {"target", "target_commit", "tokenizer", "data"}
    assert state["fingerprints"]["target_commit"] is None  # a local directory, not a hub snapshot
    assert all(t.dtype == torch.float32 for t in load_file(ckpt / "model.safetensors").values())
    assert not list(root.glob(".tmp-*"))

    # running the finished job again resumes at its last step, has nothing left to do and says so
    capsys.readouterr()
    assert (
        main(base_args(tiny_target, chat_data, out) + ["--max_steps", "20", "--learning_rate", "3e-3"]) == 0
    )
    assert f"already finished at step 20 (checkpoint {ckpt})" in capsys.readouterr().out
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    # --resume never would start over on top of that work: refused
    assert main(base_args(tiny_target, chat_data, out) + ["--max_steps", "20", "--resume", "never"]) == 2


def test_skip_bad_rows_through_the_cli(tiny_target, chat_data, tmp_path, capsys):
    data = tmp_path / "mixed.jsonl"
    data.write_text(chat_data.read_text() + '{"messages": [\n' + '{"messages": []}\n')
    out = tmp_path / "run"
    assert main(base_args(tiny_target, data, out) + ["--max_steps", "2"]) == 2
    assert f"{data}:49: malformed JSON" in capsys.readouterr().err
    assert main(base_args(tiny_target, data, out) + ["--max_steps", "2", "--skip_bad_rows"]) == 0
    stats = json.loads((out / "data_stats.json").read_text())
    assert stats["rows"] == 50 and stats["bad_rows"] == 2 and stats["kept"] == 48


def test_data_settings_through_the_cli_and_the_tokenization_cache(tiny_target, chat_data, tmp_path, capsys):
    template = Path(__file__).parent / "templates" / "qwen3_style.jinja"
    flags = [
        "--max_steps", "1",
        "--chat_template", str(template),
        "--chat_template_kwargs", '{"enable_thinking": false}',
        "--max_seq_len", "228",
        "--overlength", "drop",
        "--cache_dir", str(tmp_path / "cache"),
        "--num_proc", "2",
    ]  # fmt: skip
    assert main(base_args(tiny_target, chat_data, tmp_path / "a") + flags) == 0
    stats = json.loads((tmp_path / "a" / "data_stats.json").read_text())
    assert 0 < stats["overlength_dropped"] < 48 and stats["truncated"] == 0
    assert stats["kept"] + stats["overlength_dropped"] + stats["too_short"] == 48
    first = capsys.readouterr().out
    assert "tokenizing" in first and f"{stats['overlength_dropped']} dropped for --max_seq_len" in first
    # another run with the same data and settings reads the cache; the counts come with it
    assert main(base_args(tiny_target, chat_data, tmp_path / "b") + flags) == 0
    assert "tokenizing" not in capsys.readouterr().out
    assert json.loads((tmp_path / "b" / "data_stats.json").read_text()) == stats


def test_train_last_turn_only_through_the_cli(tiny_target, tmp_path):
    rows = []
    for i in range(24):
        first, second = conversation(i)["messages"], conversation(100 + i)["messages"]
        rows.append({"messages": first + second})  # two exchanges per conversation
    data = tmp_path / "multi_turn.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = {}
    for flag in ([], ["--train_last_turn_only"]):
        out = tmp_path / f"run{len(flag)}"
        assert (
            main(
                train_flags(tiny_target, data, out, max_seq_len=512, tokens_per_batch=2048, max_steps=1)
                + flag
            )
            == 0
        )
        tokens[bool(flag)] = json.loads((out / "data_stats.json").read_text())["response_tokens"]
    assert 0.3 < tokens[True] / tokens[False] < 0.7  # about half: only the second answer is learned


def test_only_a_lost_peer_is_reported_without_traceback():
    from dflash_ddp.parallel.exits import lost_peer

    gloo = RuntimeError("[../pair.cc:553] Connection closed by peer [127.0.0.1]:33488. This is typically ...")
    assert lost_peer(gloo)
    assert lost_peer(RuntimeError("NCCL error: remote process exited or there was a network error"))
    assert not lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))  # a bug
    assert not lost_peer(torch.distributed.DistBackendError("NCCL error: invalid usage"))


def test_eval_data_the_evaluation_would_refuse_stops_the_run_before_it_trains(
    tiny_target, chat_data, tmp_path, capsys
):
    """--eval_data is read after training; its prompts are read and rendered at start too, so a bad row among
    them is refused before any step (only the rows --eval_prompts takes are read)."""
    from types import SimpleNamespace

    from dflash_ddp.data.chat_template import load_target_tokenizer
    from dflash_ddp.evaluation.in_job import check_eval_prompts

    good = chat_data.read_text().splitlines()[0]
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(f'{good}\n{{"messages": [\n')
    out = tmp_path / "run"
    flags = base_args(tiny_target, chat_data, out) + ["--max_steps", "2", "--eval_prompts", "2"]
    assert main(flags + ["--eval_data", str(heldout)]) == 2
    assert f"error: --eval_data {heldout}: {heldout}:2: malformed JSON" in capsys.readouterr().err
    assert not out.exists()  # refused before the run wrote anything
    cfg = SimpleNamespace(eval_data=str(heldout), eval_prompts=1, chat_template_kwargs={})
    check_eval_prompts(cfg, load_target_tokenizer(tiny_target))  # the first row alone: fine


def test_a_final_evaluation_that_stops_says_what_is_kept_and_how_to_evaluate_it(tiny_target, tmp_path):
    """Should the final evaluation stop on bad input after training (the file changed meanwhile), its error
    is one line that says the checkpoints are kept and how to evaluate them, not a traceback."""
    from types import SimpleNamespace

    from dflash_ddp.evaluation.in_job import final_evaluation_or_error

    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text('{"messages": [\n')
    cfg = SimpleNamespace(
        output_dir=str(tmp_path / "run"),
        target_model=str(tiny_target),
        eval_data=str(heldout),
        eval_prompts=2,
        eval_max_new_tokens=8,
        chat_template="",
        chat_template_kwargs={},
    )
    report, error = final_evaluation_or_error(cfg, torch.device("cpu"))
    assert report is None
    assert error.startswith("the final evaluation stopped: ")
    assert "Training finished and its checkpoints are kept" in error
    assert f"python -m dflash_ddp.evaluate --target_model {tiny_target} --drafter " in error


def test_a_max_seq_len_past_the_targets_positions_is_pointed_out(tiny_target, chat_data, tmp_path, capsys):
    args = base_args(tiny_target, chat_data, tmp_path / "run") + ["--plan"]
    assert main(args + ["--max_seq_len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "note: --max_seq_len 1024 is past the target's max_position_embeddings 512 (" in out
    assert main(args + ["--max_seq_len", "512"]) == 0
    assert "note: --max_seq_len" not in capsys.readouterr().out


def test_a_tokenizer_of_its_own_code_is_pointed_out_and_not_run(tiny_target, chat_data, tmp_path, capsys):
    import shutil

    target = shutil.copytree(tiny_target, tmp_path / "target")
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_own.OwnTokenizer", None]}
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "tokenization_own.py").write_text("raise SystemExit('the checkpoint's code ran')\n")
    assert main(base_args(target, chat_data, tmp_path / "run") + ["--plan"]) == 0
    out = capsys.readouterr().out
    assert "tokenizer_config.json names a tokenizer of its own code (tokenization_own.OwnTokenizer)" in out


def test_ctrl_c_during_the_final_evaluation_ends_it_at_once_and_says_how_to_finish_it(tmp_path, monkeypatch):
    """After training there is no step to finish: a signal interrupts the evaluation at once (it had been
    caught and ignored, and the evaluation ran on for minutes), and the line says the same command evaluates."""
    import os
    import signal

    from dflash_ddp.evaluation import in_job
    from dflash_ddp.parallel.signals import interrupt_on_stop

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def evaluation_interrupted(cfg, device):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal did not interrupt")

    monkeypatch.setattr(in_job, "run_final_evaluation", evaluation_interrupted)
    try:
        interrupt_on_stop()
        report, error = in_job.final_evaluation_or_error(object(), torch.device("cpu"))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert report is None and "the final evaluation was interrupted" in error
    assert "the same command evaluates the last one" in error


def test_token_ids_past_the_targets_embeddings_are_refused_naming_the_sample():
    """A tokenizer with more tokens than the target's vocab_size: refused after tokenizing, before the
    target's forward would fail on the id (on a GPU, a device-side assert)."""
    from types import SimpleNamespace

    import torch

    from dflash_ddp.data.dataset import TokenizedDataset
    from dflash_ddp.setup.run import check_token_ids

    ids = torch.tensor([1, 2, 3, 4, 5, 12, 6])
    data = TokenizedDataset(ids, torch.ones_like(ids), torch.tensor([0, 3, 7]))
    setup = SimpleNamespace(info=SimpleNamespace(vocab_size=13, path=Path("target")), tokenizer=[0] * 20)
    check_token_ids(data, setup)  # every id has an embedding
    setup.info.vocab_size = 12
    with pytest.raises(
        ValueError,
        match=r"sample 1 holds token id 12, and the target has embeddings for ids below 12 "
        r"\(target/config.json vocab_size\) while its tokenizer has 20 tokens",
    ):
        check_token_ids(data, setup)


@pytest.mark.processes
def test_a_sigterm_during_start_up_leaves_no_directory_behind(tiny_target, chat_data, tmp_path):
    """torchrun ends the job's other processes with SIGTERM when one refuses to start: the drafter leader,
    still preparing, removes the output directory its lock made and exits quietly (the peer said why)."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "slow_start.py"
    script.write_text(
        "import sys, time\n"
        "from dflash_ddp import train\n"
        "def slow(cfg, topology):\n"
        "    print('preparing', flush=True)\n"
        "    time.sleep(120)\n"
        "train.prepare = slow\n"
        "sys.exit(train.main(sys.argv[1:]))\n"
    )
    out = tmp_path / "run"
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}  # the leader of a 1+1 job
    job = subprocess.Popen(
        [sys.executable, str(script), *base_args(tiny_target, chat_data, out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert job.stdout.readline() == "preparing\n" and out.is_dir()
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143
    assert not out.exists() and job.stderr.read() == ""
