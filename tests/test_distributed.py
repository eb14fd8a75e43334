"""One torchrun job with target and drafter ranks (gloo on CPU, real processes): parity, the channel,
multi-node rendezvous, failures."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_ddp.parallel.topology import Topology

from helpers import kill_job, rank_pids, torchrun_cmd, train_colocated, train_flags

SCRIPTS = Path(__file__).parent / "scripts"


def torchrun(nproc: int, args: list[str], *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(nproc, *extra) + args, capture_output=True, text=True, timeout=timeout)


def train_args(tiny_target, chat_data, out, **overrides) -> list[str]:
    settings = {"max_steps": 6, "save_steps": 100, "seed": 1} | overrides
    return ["-m", "dflash_ddp.train", *train_flags(tiny_target, chat_data, out, **settings)]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    latest = (out / "checkpoints" / "latest").read_text().strip()
    return load_file(out / "checkpoints" / latest / "model.safetensors")


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_topology_roles_and_invalid_splits():
    t = Topology(world_size=8, rank=7, num_drafters=1)
    assert t.role == "drafter" and t.target_ranks == list(range(7)) and t.is_leader
    assert [t.target_of(g) for g in range(9)] == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    t2 = Topology(world_size=8, rank=6, num_drafters=2)
    assert t2.drafter_ranks == [6, 7] and [t2.drafter_of(g) for g in range(4)] == [6, 7, 6, 7]
    with pytest.raises(ValueError, match="--drafter_ranks 8: .* pass at most 7"):
        Topology(8, 0, 8)
    with pytest.raises(ValueError, match="--drafter_ranks 0"):
        Topology(8, 0, 0)


CHUNKED = {"drafter_chunk_tokens": 24}  # 8 anchors x block 4 = 32 draft positions: split 6 + 2


@pytest.fixture(scope="module")
def chunked_colocated(tiny_target, chat_data, tmp_path_factory) -> Path:
    """The default job trained colocated, in this process, with the drafter's batches processed in chunks
    (some sequences split across two): the run the split jobs below must train bit for bit."""
    out = tmp_path_factory.mktemp("chunked") / "colocated"
    train_colocated(train_args(tiny_target, chat_data, out, **CHUNKED))
    return out


@pytest.mark.processes
def test_split_jobs_train_bit_identical_drafters(tiny_target, chat_data, tmp_path, chunked_colocated):
    """Colocated and 1+1 give the same losses and the same final weights, bit for bit, with the drafter's
    batches processed in chunks (some sequences split across two). The 1+1 job resumes from the step-0
    checkpoint of a --max_steps 0 job, which streamed nothing and exited 0. (A 3+1 job across two nodes
    trains the same weights: test_two_nodes_on_localhost_train_a_3_plus_1_job.)"""
    reference = final_weights(chunked_colocated)
    untrained = torchrun(2, train_args(tiny_target, chat_data, tmp_path / "1+1", max_steps=0, **CHUNKED))
    assert untrained.returncode == 0, untrained.stderr[-3000:]
    assert "Traceback" not in untrained.stderr and not (tmp_path / "1+1" / "metrics.jsonl").exists()
    state = json.loads(
        (tmp_path / "1+1" / "checkpoints" / "step-00000000" / "trainer_state.json").read_text()
    )
    assert state["global_step"] == state["batches_consumed"] == state["tokens_seen"] == 0
    assert state["topology"]["target_ranks"] == 1 and state["config"]["max_steps"] == 0
    out = tmp_path / "1+1"
    result = torchrun(2, train_args(tiny_target, chat_data, out, **CHUNKED))
    assert result.returncode == 0, result.stderr[-3000:]
    # resumed from step 0, without --resume_override: the 6 steps as the colocated run trains them
    assert "max_steps: 0 -> 6 (from a checkpoint of step 0)" in result.stdout
    assert f"resuming from {out / 'checkpoints' / 'step-00000000'}" in result.stdout
    assert losses(out) == losses(chunked_colocated)
    weights = final_weights(out)
    assert all(torch.equal(weights[k], reference[k]) for k in reference), f"{out.name} differs"


SOFT_TARGETS = {"loss": "tv", "target_topk": 4, "ce_weight": 0.1}
# each position weighting once, with Muon (the default) and AdamW: the paper's recipe (decay, AdamW), Spec-AUF
# with soft targets, and DFlash2 with the default's D-PACE (the plain DFlash default is DFlash2 less its
# selector and convolutions)
OBJECTIVES = {
    "decay-adamw": {"position_weighting": "decay", "optimizer": "adamw"},
    "auf-tv": {"position_weighting": "auf", **SOFT_TARGETS},
    "dflash2": {"drafter": "dflash2", "selector_rank": 16, "selector_top_k": 8},
}


@pytest.mark.processes
@pytest.mark.parametrize("name", OBJECTIVES)
def test_two_drafter_ranks_match_one_with_twice_the_batch(tiny_target, chat_data, tmp_path, name):
    """1+2 (one target rank feeding a data-parallel drafter of 2 ranks) trains the same function as one
    drafter accumulating 2 batches per step, with every position weighting, with soft targets and with Muon:
    the loss is normalised over every rank's blocks, not per rank, and every optimizer steps on the summed
    gradient; and a DFlash2 drafter (its selector's loss is normalised with the rest). The one drafter runs
    colocated, in this process: the split jobs' tests hold a 1+1 job to the colocated run bit for bit (the
    default objective, DFlash2, soft targets), and a 2+2 job resumed as 1+1 accumulating 2 batches to it in
    test_resume.py."""
    objective = OBJECTIVES[name]
    train_colocated(
        train_args(tiny_target, chat_data, tmp_path / "one", gradient_accumulation_steps=2, **objective)
    )
    two = torchrun(3, train_args(tiny_target, chat_data, tmp_path / "1+2", drafter_ranks=2, **objective))
    assert two.returncode == 0, two.stderr[-3000:]
    assert losses(tmp_path / "1+2") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    a, b = final_weights(tmp_path / "one"), final_weights(tmp_path / "1+2")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def colocated_and_split(tiny_target, data, tmp_path, **settings) -> tuple[dict, dict]:
    """The final weights of a colocated run (one thread, as torchrun's workers: see above) and of a 2+1 job
    with the same settings, after checking that they logged the same losses."""
    train_colocated(train_args(tiny_target, data, tmp_path / "colocated", **settings))
    split = torchrun(3, train_args(tiny_target, data, tmp_path / "2+1", **settings))
    assert split.returncode == 0, split.stderr[-3000:]
    assert losses(tmp_path / "2+1") == losses(tmp_path / "colocated")
    return final_weights(tmp_path / "colocated"), final_weights(tmp_path / "2+1")


@pytest.mark.processes
def test_dflash2_trains_bit_identical_drafters_colocated_and_split(tiny_target, chat_data, tmp_path):
    """A DFlash2 drafter trained colocated and by a 2+1 job, in chunks that split sequences, is the same
    drafter bit for bit, convolutions and selector included."""
    settings = {**OBJECTIVES["dflash2"], "drafter_chunk_tokens": 24}
    reference, weights = colocated_and_split(tiny_target, chat_data, tmp_path, **settings)
    assert reference["candidate_selector.successor_codebook"].abs().sum() > 0  # the selector trained
    assert all(torch.equal(weights[k], reference[k]) for k in reference)


@pytest.mark.processes
def test_soft_targets_train_bit_identical_drafters_colocated_and_split(tiny_target, chat_data, tmp_path):
    """With --loss tv --target_topk 4, the soft targets computed in the drafter's own process and those sent
    by a target rank over the channel train the same weights, bit for bit."""
    reference, weights = colocated_and_split(
        tiny_target, chat_data, tmp_path, position_weighting="dpace", **SOFT_TARGETS
    )
    assert all(torch.equal(weights[k], reference[k]) for k in reference)
    state = json.loads(next((tmp_path / "2+1" / "checkpoints").glob("step-*/trainer_state.json")).read_text())
    assert state["config"]["loss"] == "tv" and state["config"]["target_topk"] == 4


@pytest.mark.processes
def test_messages_of_varying_length_arrive_intact(tiny_target):
    """Features, and with --target_topk the soft targets' ids and bf16 probabilities, bit for bit; a slow
    drafter's receiver holds two messages ahead of training (the cap it was given), never more. Without and
    with soft targets, one after the other in one job."""
    result = torchrun(2, [str(SCRIPTS / "channel_roundtrip.py"), str(tiny_target), "0,5"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all 6 messages intact (top-0)" in result.stdout
    assert "all 6 messages intact (top-5)" in result.stdout


@pytest.mark.processes
def test_two_nodes_on_localhost_train_a_3_plus_1_job(tiny_target, chat_data, tmp_path, chunked_colocated):
    """Two torchrun agents of 2 processes each meet at one rendezvous as a 3+1 job, which trains the colocated
    run's losses and weights bit for bit, the drafter's batches processed in chunks."""
    port = free_port()
    args = train_args(tiny_target, chat_data, tmp_path / "2nodes", **CHUNKED)
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[1][-3000:] + outputs[0][-3000:]
    state = json.loads(
        next((tmp_path / "2nodes" / "checkpoints").glob("step-*/trainer_state.json")).read_text()
    )
    assert state["topology"] == {
        "world_size": 4,
        "target_ranks": 3,
        "target_tp_size": 1,
        "drafter_ranks": 1,
        "colocated": False,
    }
    assert losses(tmp_path / "2nodes") == losses(chunked_colocated)
    weights, reference = final_weights(tmp_path / "2nodes"), final_weights(chunked_colocated)
    assert all(torch.equal(weights[k], reference[k]) for k in reference)


def kill_rank_while_training(nproc: int, args: list[str], out: Path, rank: int) -> tuple[str, int, dict]:
    """Start a job, SIGKILL one rank once training is under way; returns (output, exit code, rank pids)."""
    job = subprocess.Popen(
        torchrun_cmd(nproc) + args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() and time.time() < deadline:
            time.sleep(0.5)
        assert (out / "metrics.jsonl").exists(), "the job never started training"
        ranks = rank_pids(job.pid)
        os.kill(ranks[rank], signal.SIGKILL)
        killed_at = time.time()
        output = job.communicate(timeout=90)[0]
        assert time.time() - killed_at < 60, "the other ranks took too long to notice"
    finally:
        if job.poll() is None:
            kill_job(job)
    return output, job.returncode, ranks


@pytest.mark.processes
def test_killing_a_target_rank_ends_the_job_with_the_rank_named(tiny_target, chat_data, tmp_path):
    out = tmp_path / "killed"
    args = train_args(tiny_target, chat_data, out, max_steps=100000, dist_timeout=30)
    output, returncode, ranks = kill_rank_while_training(3, args, out, rank=1)
    assert returncode != 0
    assert "rank 1" in output or "rank: 1" in output, output[-3000:]
    leftovers = [
        pid
        for pid in ranks.values()
        if Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    ]
    assert leftovers == []


@pytest.mark.processes
def test_accelerate_launch_with_the_cpu_profile(tiny_target, chat_data, tmp_path):
    profile = Path(__file__).parents[1] / "configs" / "accelerate" / "cpu.yaml"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(profile),
        "--main_process_port",
        str(free_port()),
    ]
    result = subprocess.run(
        cmd + train_args(tiny_target, chat_data, tmp_path / "acc", max_steps=3),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads(next((tmp_path / "acc" / "checkpoints").glob("step-*/trainer_state.json")).read_text())
    assert state["topology"]["world_size"] == 4 and state["topology"]["target_ranks"] == 3


def test_plan_describes_the_split_on_the_drafter_leader(
    tiny_target, chat_data, tmp_path, monkeypatch, capsys
):
    from dflash_ddp.train import main

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "6")  # the first drafter rank leads
    assert main(train_args(tiny_target, chat_data, tmp_path / "plan", drafter_ranks=2)[2:] + ["--plan"]) == 0
    out = capsys.readouterr().out
    assert "target ranks [0, 1, 2, 3, 4, 5], drafter ranks [6, 7] (data-parallel drafter)" in out
    assert "target rank 0 computes batches g = 0 mod 6 and feeds drafter ranks [6]" in out
    assert "target rank 1 computes batches g = 1 mod 6 and feeds drafter ranks [7]" in out
    assert "message_size" in out and "target_rank_memory" in out and "drafter_rank_memory" in out
    assert not (tmp_path / "plan").exists()


def test_more_drafters_than_batches_per_epoch_is_refused(
    tiny_target, chat_data, tmp_path, monkeypatch, capsys
):
    from dflash_ddp.train import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    args = train_args(tiny_target, chat_data, tmp_path / "x", drafter_ranks=2, gradient_accumulation_steps=40)
    assert main(args[2:]) == 2
    assert "one optimizer step takes 80" in capsys.readouterr().err


@pytest.mark.processes
def test_ranks_that_read_different_data_refuse_to_start(tiny_target, chat_data, tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(chat_data.read_text().splitlines(keepends=True)[:-1]))  # one row fewer
    flags = train_flags(tiny_target, chat_data, tmp_path / "run", max_steps=2)
    flags = flags[: flags.index("--data")] + flags[flags.index("--data") + 2 :]
    script = [str(SCRIPTS / "train_with_data_per_rank.py"), str(chat_data), str(other)]
    result = torchrun(2, [*script, *flags])
    assert result.returncode != 0
    pattern = r"the ranks tokenized different data \(ranks \[0\] have data \w+; ranks \[1\] have data \w+\)"
    assert re.search(pattern, result.stderr), result.stderr[-3000:]


def test_the_drafter_refuses_a_batch_its_schedule_does_not_expect():
    from dflash_ddp.data.batch import Batch
    from dflash_ddp.data.schedule import ScheduledBatch
    from dflash_ddp.parallel.channel import ChannelError, Message
    from dflash_ddp.roles.drafter import check_batch

    ids = torch.ones(2, 3, dtype=torch.long)
    batch = Batch(ids, ids, ids, torch.tensor([7, 9]))
    message = Message(g=5, epoch=0, batch=batch, features=torch.zeros(2, 3, 4), source=2)
    assert check_batch(message, ScheduledBatch(5, 0, 1, [7, 9]), rank=3) is message
    with pytest.raises(
        ChannelError, match="drafter rank 3: expected global batch 5 with samples \\[7, 8\\].*from rank 2"
    ):
        check_batch(message, ScheduledBatch(5, 0, 1, [7, 8]), rank=3)


@pytest.mark.processes
def test_killing_the_drafter_leader_gives_every_rank_a_clear_message(tiny_target, chat_data, tmp_path):
    out = tmp_path / "killed"
    args = train_args(tiny_target, chat_data, out, max_steps=100000, drafter_ranks=2, dist_timeout=30)
    output, _, _ = kill_rank_while_training(4, args, out, rank=2)  # 2+2: ranks 2 and 3 draft, 2 leads
    # the other drafter rank ends with one line: "lost the connection..." when its all-reduce with the
    # leader fails first, or the channel's message when a target it waits for has already gone. The
    # targets' lines are not asserted: once a rank exits, torchrun ends the others, a race.
    assert "error (rank 3): " in output, output[-3000:]
    assert "dflash_ddp/" not in output  # no traceback through our code on any surviving rank


@pytest.mark.processes
def test_a_slow_first_drafter_step_does_not_time_out_the_channel(tiny_target, chat_data, tmp_path):
    """The drafter's first forward takes 2x --dist_timeout (as a first compiled step on a GPU can): it happens
    in the warm-up, before the channel opens, so no target's send waits on it and the 1+1 job completes."""
    out = tmp_path / "slow"
    args = train_args(tiny_target, chat_data, out, max_steps=4, dist_timeout=5, max_inflight=1)
    script = str(SCRIPTS / "train_with_slow_first_forward.py")
    # gloo connects the ranks within --dist_timeout too: 5 s leaves room for a loaded machine
    env = {**os.environ, "SLOW_FIRST_FORWARD_S": "10"}
    done = subprocess.run(
        torchrun_cmd(2) + [script, *args[2:]], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())][-1] == 4


def test_ranks_share_a_gpu_only_through_the_gloo_channel(monkeypatch):
    """Two local ranks on a one-GPU node: refused under NCCL with a line saying what to do, sharing cuda:0
    with --channel_backend gloo (the one-GPU check of a split job)."""
    from dflash_ddp.parallel import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert devices.select_device("cuda", 0) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="local rank 1: this node has 1 GPU.*--channel_backend gloo"):
        devices.select_device("cuda", 1)
    assert devices.select_device("cuda", 1, share_gpus=True) == torch.device("cuda", 0)
    # the run's set-up picks its device (for the memory plan) the same way, before any process group
    from dflash_ddp.config import parse_config
    from dflash_ddp.setup.plan import run_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    shared, _ = parse_config(["--device", "cuda", "--channel_backend", "gloo", "--drafter_ranks", "1"])
    assert run_device(shared) == torch.device("cuda", 0)
    nccl, _ = parse_config(["--device", "cuda", "--drafter_ranks", "1"])
    with pytest.raises(ValueError, match="local rank 1"):
        run_device(nccl)


def test_the_channel_header_travels_as_named_fields():
    from dflash_ddp.parallel.channel import DATA, END, HEADER_LEN, VERSION, Header

    header = Header(g=7, epoch=2, batch_size=3, num_tokens=900, width=1280, dtype_code=1, topk=8)
    encoded = header.encode()
    assert encoded.dtype == torch.int64 and encoded.shape == (HEADER_LEN,)
    assert encoded[:3].tolist() == [VERSION, DATA, 7] and encoded[11:].eq(0).all()  # the wire layout
    assert Header.decode(encoded) == header
    assert Header.decode(Header(kind=END).encode()).kind == END


@pytest.mark.processes
def test_a_16k_token_sequence_trains_the_same_drafter_split_as_colocated(tmp_path):
    """Two 16K-token multi-turn conversations (every assistant turn in the loss), the target prefilled in
    pieces of 4096: a 2+1 job trains the colocated run's weights bit for bit, and each target's outstanding
    sends never held more than --max_inflight messages (measured by the sender, logged per target), nor the
    drafter's messages received ahead of training (measured by the receiver). The target is the tiny one's
    shape with one attention head, tapped at its first two layers (the layers after them never run): its
    attention over 16K tokens is most of the test's time."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from conftest import TINY_SHAPE, build_tokenizer, conversation

    target = tmp_path / "one_head"
    heads = {"num_attention_heads": 1, "num_key_value_heads": 1}
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(build_tokenizer(target)), num_hidden_layers=4, **TINY_SHAPE | heads)
    Qwen3ForCausalLM(config).save_pretrained(target)
    data = tmp_path / "long.jsonl"
    turns = lambda seed: [m for t in range(230) for m in conversation(seed * 1000 + t)["messages"]]  # noqa: E731
    data.write_text("".join(json.dumps({"messages": turns(i)}) + "\n" for i in range(2)))
    settings = {"max_seq_len": 16384, "tokens_per_batch": 16384, "target_prefill_tokens": 4096}
    settings |= {"target_layer_ids": "0,1"}
    reference, weights = colocated_and_split(target, data, tmp_path, max_steps=2, max_inflight=1, **settings)
    assert all(torch.equal(weights[k], reference[k]) for k in reference)
    records = [json.loads(line) for line in (tmp_path / "2+1" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["tokens_seen"] == 2 * 16384
    message_mib = 16384 * (2 * 64 * 4 + 2 * 8) / 2**20  # tokens x (2 taps x hidden 64 x fp32 + 2 int64 ids)
    peaks = [mib for r in records for mib in r["target_peak_send_mib"].values()]
    assert peaks and all(message_mib <= mib <= 1.01 * message_mib for mib in peaks)  # one message at most
    # the drafter's side too: one message received ahead of the one in training, never more
    received = [r["drafter_peak_receive_mib"] for r in records]
    assert all(message_mib <= mib <= 1.01 * message_mib for mib in received), received


def test_ctrl_c_ends_a_wait_at_a_job_barrier_at_once(monkeypatch):
    """A rank waiting at the start barrier while another loads its target for minutes: Ctrl-C interrupts
    the wait (a wait inside the store's C++ call held it off until the barrier's hour-long timeout)."""
    import threading

    from dflash_ddp.parallel import topology

    class Store:  # the other rank never arrives
        def set(self, key, value):
            pass

        def add(self, key, amount):
            return 1

        def check(self, keys):
            return False

    monkeypatch.setattr(topology, "job_store", Store)
    monkeypatch.setattr(topology.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(topology.dist, "get_world_size", lambda: 2)
    main = threading.main_thread().ident
    threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT)).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        topology.job_barrier("channel-open", timeout_s=60)
    assert time.monotonic() - start < 5
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not reach the end barrier within 0 s"):
        topology.job_barrier("end", timeout_s=0.2)


@pytest.mark.parametrize(
    "error,kind,says",
    [
        (
            "[gloo] Timed out waiting 15000ms for recv operation to complete",
            "ChannelError",
            "target rank 0 is stuck",
        ),
        ("[gloo] Connection closed by peer [127.0.0.1]:1234", "PeerLost", "target rank 0 died"),
    ],
)
def test_a_drafter_whose_target_went_silent_names_it_as_its_own_failure(monkeypatch, error, kind, says):
    """A target rank stuck (SIGSTOP, a hung forward): the drafter's receive times out and is the rank that can
    name it, so it is not reported as a consequence (torchrun's summary had blamed a healthy target rank,
    whose sends had stopped being taken, and shown no message); a target that died is its consequence."""
    from types import SimpleNamespace

    from dflash_ddp.parallel import channel

    class Work:
        def wait(self):
            raise RuntimeError(error)

    monkeypatch.setattr(channel.dist, "batch_isend_irecv", lambda ops: [Work()])
    monkeypatch.setattr(channel.dist, "P2POp", lambda *args: None)
    with pytest.raises(channel.ChannelError) as failed:
        channel.ChannelReceiver._recv_into(SimpleNamespace(rank=2), [torch.empty(1)], 0, "batch 5")
    assert type(failed.value).__name__ == kind and says in str(failed.value)
