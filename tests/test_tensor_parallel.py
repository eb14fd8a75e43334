"""Tensor-parallel target groups (--target_tp_size): the groups, the refusals, sharded features equal to the
whole target's, training parity with an unsharded target, resume across a change of group size, and a
mixture-of-experts target. Real torchrun processes on CPU/gloo."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_ddp.parallel.topology import Topology
from dflash_ddp.target_model.tensor_parallel import check_groups_within_nodes
from dflash_ddp.train import main

from conftest import build_tokenizer
from helpers import rank_pids, torchrun_cmd, train_flags

SCRIPTS = Path(__file__).parent / "scripts"
STEPS = 12


def train_args(target, data, out, **overrides) -> list[str]:
    settings = {"max_steps": STEPS, "save_steps": 4, "seed": 1} | overrides
    return ["-m", "dflash_ddp.train", *train_flags(target, data, out, **settings)]


def torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(torchrun_cmd(nproc) + args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def colocated(target, data, out, **overrides) -> None:
    """The same job in this process, with one thread like torchrun's workers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(train_args(target, data, out, **overrides)[2:]) == 0
    finally:
        torch.set_num_threads(threads)


def weights(out: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / f"step-{step:08d}" / "model.safetensors")


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_close_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def tp2_run(tiny_target, chat_data, tmp_path_factory) -> Path:
    """One group of 2 target ranks + 1 drafter rank, 12 steps, checkpoints every 4."""
    out = tmp_path_factory.mktemp("tp") / "tp2"
    torchrun(3, train_args(tiny_target, chat_data, out, target_tp_size=2))
    return out


def test_groups_of_consecutive_target_ranks_compute_and_send_whole_batches():
    t = Topology(world_size=7, rank=6, num_drafters=1, tp_size=2)
    assert t.num_groups == 3 and t.group_ranks(1) == [2, 3] and t.sender_ranks == [0, 2, 4]
    assert [t.group_of(g) for g in range(5)] == [0, 1, 2, 0, 1]
    assert [t.target_of(g) for g in range(5)] == [0, 2, 4, 0, 2]  # the group's first rank sends
    assert Topology(7, 3, 1, 2).group == 1
    assert "target group 1 (ranks 2-3, tensor-parallel 2; rank 2 sends)" in "\n".join(t.describe())
    with pytest.raises(ValueError, match="--target_tp_size 2 does not divide the 3 target ranks"):
        Topology(4, 0, 1, 2)
    with pytest.raises(ValueError, match="one process cannot shard the target"):
        Topology(1, 0, 1, 2)


def test_a_group_never_spans_two_nodes(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_groups_within_nodes(Topology(8, 0, 2, 2))  # groups 0-1, 2-3, 4-5: inside nodes 0-3, 4-7
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"target group 1 \(ranks 2-3\) would span two nodes of 3"):
        check_groups_within_nodes(Topology(6, 0, 2, 2))


@pytest.mark.processes
def test_features_of_a_tp2_group_equal_the_whole_targets(tiny_target, tiny_moe_target, tmp_path):
    """Every tapped layer (the last one final-normed), a padded batch, dense and mixture-of-experts; the
    memory plan's weights per rank equal those each rank holds."""
    targets = [str(tiny_target), str(tiny_moe_target)]
    result = subprocess.run(
        torchrun_cmd(3) + [str(SCRIPTS / "tp_features.py"), str(tmp_path), *targets],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(found) == sorted(targets)
        for target in targets:
            differences = found[target]["relative_differences"]
            assert len(differences) == 3 and max(differences.values()) < 1e-5, (rank, target, differences)
            assert found[target]["q_proj_rows"] == [32, 64]  # each rank holds its half, not a replica
            # the plan's share of the weights is what the rank holds: the MoE's experts split by its
            # expert-parallel plan, the norms whole
            weights = found[target]["weight_bytes"]
            assert weights["local"] == weights["planned"] < weights["all"], (target, weights)
            assert found[target]["sharded_output_gathered_exactly"]
            assert found[target]["soft_top1_equal"] and found[target]["soft_probs_max_difference"] < 1e-2
    assert not (tmp_path / "rank2.json").exists()


@pytest.mark.processes
def test_a_tp2_group_trains_like_the_unsharded_target(tiny_target, chat_data, tmp_path, tp2_run):
    """Colocated vs 1 group of TP 2 + 1 drafter: same batches, weights within float summation order; and 2
    groups of TP 2 train exactly the batches of 1 group."""
    colocated(tiny_target, chat_data, tmp_path / "colocated")
    assert_close_weights(weights(tp2_run), weights(tmp_path / "colocated"))
    two_groups = tmp_path / "2x2+1"
    torchrun(5, train_args(tiny_target, chat_data, two_groups, target_tp_size=2))
    state = json.loads((two_groups / "checkpoints" / f"step-{STEPS:08d}" / "trainer_state.json").read_text())
    assert state["topology"]["target_tp_size"] == 2 and state["topology"]["target_ranks"] == 4
    seen = [(m["step"], m["tokens_seen"], m["epoch"]) for m in metrics(two_groups)]
    assert seen == [(m["step"], m["tokens_seen"], m["epoch"]) for m in metrics(tp2_run)]
    assert_close_weights(weights(two_groups), weights(tp2_run))


@pytest.mark.processes
def test_a_stopped_tp2_run_resumes_with_whole_target_ranks(tiny_target, chat_data, tmp_path, tp2_run):
    """A TP-2 job stopped with SIGTERM in the middle saves the step it is at; resumed as 1 + 1 without
    tensor parallelism it continues at the same global batch and ends where the uninterrupted run ended."""
    out = tmp_path / "run"
    script = [str(SCRIPTS / "train_with_slow_steps.py"), *train_args(tiny_target, chat_data, out)[2:]]
    job = subprocess.Popen(
        torchrun_cmd(3) + script + ["--target_tp_size", "2", "--save_steps", "1000"],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "SLOW_STEP_S": "0.3"},
    )
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert time.time() < deadline and job.poll() is None
        time.sleep(0.05)
    for pid in rank_pids(
        job.pid
    ).values():  # what torchrun does with a SIGTERM it receives: forward it to every worker
        os.kill(pid, signal.SIGTERM)
    output = job.communicate(timeout=120)[0]
    assert job.returncode == 0, output[-3000:]
    [saved] = (out / "checkpoints").glob("step-*")
    stopped_at = int(saved.name.split("-")[1])
    assert 3 <= stopped_at < STEPS, output[-2000:]
    result = torchrun(2, train_args(tiny_target, chat_data, out))
    assert f"resuming from {saved}" in result.stdout, result.stdout[-2000:]
    assert "saved as 2+1 (tensor-parallel groups of 2), now 1+1)" in result.stdout
    assert [m["step"] for m in metrics(out)] == list(range(1, STEPS + 1))
    assert [m["tokens_seen"] for m in metrics(out)] == [m["tokens_seen"] for m in metrics(tp2_run)]
    assert_close_weights(weights(out), weights(tp2_run))


@pytest.mark.processes
def test_a_moe_target_trains_colocated_and_as_a_tp2_group(tiny_moe_target, chat_data, tmp_path):
    colocated(tiny_moe_target, chat_data, tmp_path / "colocated", max_steps=6)
    torchrun(3, train_args(tiny_moe_target, chat_data, tmp_path / "tp2", max_steps=6, target_tp_size=2))
    losses = [[m["loss"] for m in metrics(tmp_path / run)] for run in ("colocated", "tp2")]
    assert len(losses[0]) == 6 and losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert_close_weights(weights(tmp_path / "tp2", 6), weights(tmp_path / "colocated", 6))


@pytest.mark.processes
def test_a_target_whose_heads_cannot_be_split_is_refused_at_start(chat_data, tmp_path):
    """3 attention heads cannot go to 2 ranks: one line naming the count, non-zero exit, no traceback of
    the trainer's (torchrun's agent prints its own for any failed worker)."""
    target = tmp_path / "three_heads"
    tok = build_tokenizer(target)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=16,
    )
    Qwen3ForCausalLM(config).save_pretrained(target)
    result = subprocess.run(
        torchrun_cmd(3) + train_args(target, chat_data, tmp_path / "out", target_tp_size=2),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "--target_tp_size 2 does not divide the target's 3 attention heads" in result.stderr
    assert not re.search(r'File ".*dflash_ddp', result.stderr + result.stdout), result.stderr[-3000:]


@pytest.mark.parametrize(
    "world, family, expected",
    [
        (4, "qwen3", "--target_tp_size 2 does not divide the 3 target ranks"),
        (3, "gpt2", "transformers has no tensor-parallel plan for the model family 'gpt2'"),
        (3, "qwen3_moe", "--target_tp_size 2 does not divide the target's 3 routed experts (each rank holds"),
    ],
)
def test_splits_and_families_tensor_parallelism_cannot_serve_are_refused(
    world, family, expected, tiny_target, chat_data, tmp_path, monkeypatch, capsys
):
    target = tiny_target
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        target = tmp_path / "gpt2"
        tok = build_tokenizer(target)
        GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=4, n_head=2)).save_pretrained(
            target
        )
    if family == "qwen3_moe":  # a group shares its experts out: 3 cannot go to 2 ranks
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        target = tmp_path / "moe"
        tok = build_tokenizer(target)
        shape = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2)
        config = Qwen3MoeConfig(vocab_size=len(tok), num_experts=3, num_experts_per_tok=2, **shape)
        Qwen3MoeForCausalLM(config).save_pretrained(target)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world)}.items():
        monkeypatch.setenv(key, value)
    code = main(train_args(target, chat_data, tmp_path / "out", target_tp_size=2)[2:])
    assert code == 2
    assert expected in capsys.readouterr().err


def test_plan_of_the_qwen3_32b_config_shows_groups_and_each_ranks_share(tmp_path, monkeypatch, capsys):
    """configs/qwen3-32b.yaml as planned by its drafter leader (rank 4 of 8): a target directory with the
    model's config only (no weights are read by --plan)."""
    from safetensors.torch import save_file

    target = tmp_path / "qwen3-32b"
    build_tokenizer(target)
    Qwen3Config(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ).save_pretrained(target)
    save_file({"model.embed_tokens.weight": torch.zeros(1)}, target / "model.safetensors")
    env = {"RANK": "4", "LOCAL_RANK": "4", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = Path(__file__).parents[1] / "configs" / "qwen3-32b.yaml"
    flags = ["--config", str(config), "--target_model", str(target), "--device", "cpu", "--plan"]
    assert main([*flags, "--output_dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "target group 1 (ranks 2-3, tensor-parallel 2; rank 2 sends)" in out
    assert "feeds drafter ranks [5, 7]" in out
    # fp32 on a CPU: 31.0B truncated parameters x 4 bytes / 2 ranks
    assert re.search(r"target_rank_memory: [\d.]+ GiB predicted peak \(weights 57\.\d\d", out)
    assert "weights are 1/2 of the truncated target's" in out


def test_a_transformers_that_loads_sharded_models_differently_is_named(tiny_target, monkeypatch):
    """Sharding across a group replaces one function of transformers' loading; without it, a clear refusal
    instead of an AttributeError in the middle of loading."""
    from transformers.distributed import mixin

    from dflash_ddp.target_model.tensor_parallel import check_tensor_parallel

    check_tensor_parallel(tiny_target, 2)
    monkeypatch.delattr(mixin, "initialize_distributed_mesh")
    with pytest.raises(ValueError, match="install transformers 5.24 or pass --target_tp_size 1"):
        check_tensor_parallel(tiny_target, 2)


def test_a_group_is_checked_for_the_sizes_its_plans_split(tmp_path):
    """DeepSeek V4's plans split its experts (by count) and shared experts alone: its single KV head and its
    heads stay whole on every rank and are no reason to refuse a group (it was refused at every size), and
    the memory plan keeps its attention whole; Qwen3.5-MoE's 2 KV heads are split, so they cap its group."""
    from transformers import DeepseekV4Config, Qwen3_5MoeTextConfig

    from dflash_ddp.target_model.tensor_parallel import attention_split, check_tensor_parallel, split_sizes

    v4 = DeepseekV4Config(num_key_value_heads=1, num_attention_heads=3, vocab_size=1024, n_routed_experts=8)
    v4.save_pretrained(tmp_path / "v4")
    check_tensor_parallel(tmp_path / "v4", 8)
    assert not attention_split(v4) and "routed experts (each rank holds its share)" in split_sizes(v4)
    qwen = Qwen3_5MoeTextConfig(num_key_value_heads=2, vocab_size=1024)
    qwen.save_pretrained(tmp_path / "qwen")
    check_tensor_parallel(tmp_path / "qwen", 2)
    with pytest.raises(ValueError, match="--target_tp_size 4 does not divide the target's 2 KV heads"):
        check_tensor_parallel(tmp_path / "qwen", 4)
    assert attention_split(qwen)
