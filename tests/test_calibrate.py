"""`--plan --calibrate`: the split arithmetic on given rates, and measured runs with one side slowed on purpose."""

import re
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch

from dflash_ddp.drafter.trainer import DrafterTrainer
from dflash_ddp.setup import calibrate
from dflash_ddp.setup.calibrate import Measurement, Rates, candidate_splits, predict, recommend, report
from dflash_ddp.target_model.features import TargetFeatureExtractor
from dflash_ddp.train import main

from helpers import torchrun_cmd, train_flags

RECOMMENDED = re.compile(r"^recommended split: (\d+) target ranks \+ (\d+) drafter ranks", re.MULTILINE)

# ------------------------------------------------------------------------------------- the arithmetic


def test_prediction_of_one_split():
    split = predict(8, 3, 2, Rates(target=2.0, drafter=4.0))
    assert split.sequences_per_s == 6.0  # min(3 x 2, 2 x 4): the targets are the bottleneck
    assert split.drafter_wait == pytest.approx(0.25) and split.target_idle == 0.0
    assert split.idle_ranks == [5, 6, 7]
    with pytest.raises(ValueError, match="not a split of 4 processes"):
        predict(4, 3, 2, Rates(1.0, 1.0))


def test_colocated_runs_target_and_drafter_in_turn():
    split = predict(1, 1, 1, Rates(target=3.0, drafter=1.5))
    assert split.sequences_per_s == pytest.approx(1.0)  # 1/3 s + 2/3 s per sequence
    assert split.drafter_wait == pytest.approx(1 / 3) and split.target_idle == pytest.approx(2 / 3)
    assert candidate_splits(1, Rates(3.0, 1.5)) == [split] and recommend(1, Rates(3.0, 1.5)) == split


def test_every_split_of_the_world_is_a_candidate():
    splits = candidate_splits(4, Rates(1.0, 1.0))
    assert sorted((s.target_ranks, s.drafter_ranks) for s in splits) == [
        (1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (3, 1)
    ]  # fmt: skip


def test_a_slow_target_gets_more_target_ranks_and_a_slow_drafter_fewer():
    slow_target = recommend(8, Rates(target=1.0, drafter=10.0))
    slow_drafter = recommend(8, Rates(target=10.0, drafter=1.0))
    assert (slow_target.target_ranks, slow_target.drafter_ranks) == (7, 1)
    assert (slow_drafter.target_ranks, slow_drafter.drafter_ranks) == (1, 7)
    balanced = recommend(8, Rates(target=1.0, drafter=1.0))
    assert (balanced.target_ranks, balanced.drafter_ranks) == (4, 4)
    assert balanced.drafter_wait == balanced.target_idle == 0.0 and balanced.idle_ranks == []


def test_a_tensor_parallel_group_is_one_target_unit():
    """With groups of 2 the target ranks come in pairs, each pair at the group's measured rate."""
    splits = candidate_splits(5, Rates(1.0, 1.0), tp_size=2)
    assert sorted((s.target_ranks, s.drafter_ranks) for s in splits) == [
        (2, 1), (2, 2), (2, 3), (4, 1)
    ]  # fmt: skip
    best = recommend(8, Rates(target=1.0, drafter=2.0), tp_size=2)  # a group feeds half a drafter
    assert (best.target_ranks, best.drafter_ranks, best.sequences_per_s) == (6, 2, 3.0)
    assert predict(8, 4, 2, Rates(1.0, 2.0), tp_size=2).sequences_per_s == 2.0  # 2 groups
    with pytest.raises(ValueError, match="not a split"):
        predict(8, 3, 1, Rates(1.0, 1.0), tp_size=2)
    measurement = Measurement(Rates(1.0, 2.0), batches=3, sequences=30, target_s=30.0, drafter_s=15.0)
    text = "\n".join(report(measurement, 8, torch.device("cpu"), 2, 2**20, tp_size=2))
    assert "one target group (2 ranks, tensor-parallel):" in text
    assert "    4 (2 groups of 2) + 4: 2.00 sequences/s" in text
    assert RECOMMENDED.findall(text) == [("6", "2")]
    assert "(3 groups of 2, tensor-parallel)" in text and "--drafter_ranks 2 --target_tp_size 2" in text


def test_six_plus_one_when_a_seventh_target_rank_adds_nothing():
    """A drafter rank six times as fast as a target rank: 7+1, 6+2 and 6+1 all give 6 sequences/s; the
    split with fewer processes wins and rank 7 sits idle."""
    best = recommend(8, Rates(target=1.0, drafter=6.0))
    assert (best.target_ranks, best.drafter_ranks, best.idle_ranks) == (6, 1, [7])
    assert best.sequences_per_s == 6.0 and best.drafter_wait == 0.0 and best.target_idle == 0.0


def test_splits_within_two_percent_count_as_equal():
    # 7+1 is 1.5% faster than 6+1: a tie, the smaller job wins; at 3% faster the larger one does
    assert recommend(8, Rates(target=1.0, drafter=6.09)).target_ranks == 6
    assert recommend(8, Rates(target=1.0, drafter=6.18)).target_ranks == 7


def test_report_names_the_recommended_split_and_the_idle_rank():
    measurement = Measurement(
        Rates(target=1.0, drafter=6.0), batches=3, sequences=30, target_s=30.0, drafter_s=5.0
    )
    lines = report(measurement, 8, torch.device("cpu"), drafter_ranks=1, allreduce_bytes=2**20)
    text = "\n".join(lines)
    assert RECOMMENDED.findall(text) == [("6", "1")]
    assert "--nproc-per-node 7 ... --drafter_ranks 1" in text
    assert "idle: rank 7 of 8" in text
    assert re.search(r"7 \+ 1: 6\.00 sequences/s.*<- this launch", text)
    assert "global batch" not in text  # the recommended split keeps this launch's one drafter rank
    assert "ranks started on this one share its cores" in text  # a CPU's prediction is per machine
    # a recommendation with more drafter ranks says that the step grows with them, and how to keep it
    fast_target = Measurement(
        Rates(target=6.0, drafter=1.0), batches=3, sequences=30, target_s=5.0, drafter_s=30.0
    )
    lines = report(
        fast_target, 8, torch.device("cpu"), drafter_ranks=1, allreduce_bytes=2**20, accumulation=6
    )
    [note] = [line for line in lines if "global batch" in line]
    drafters = int(RECOMMENDED.findall("\n".join(lines))[0][1])
    assert drafters > 1 and f"6 now, {6 * drafters} with {drafters} drafter ranks" in note
    keep = (
        f"--gradient_accumulation_steps {6 // drafters}"
        if 6 % drafters == 0
        else f"--tokens_per_batch x 6/{6 * drafters}"
    )
    assert note.endswith(keep), note
    # one process: the colocated prediction, and the split for an 8-process launch of this machine
    lines = report(measurement, 1, torch.device("cpu"), drafter_ranks=1, allreduce_bytes=2**20)
    assert any(line.startswith("  this launch, colocated") for line in lines)
    assert RECOMMENDED.findall("\n".join(lines)) == [("6", "1")]


# ------------------------------------------------------------------------------- measured, one side slowed

SLOWDOWN_S = 10.0


def slow_down(monkeypatch, cls, name: str) -> None:
    """Every call of `cls.name` takes SLOWDOWN_S longer on the clock the calibration reads.

    The clock runs ahead instead of the call sleeping: the slowdown costs no test time, and a loaded
    machine (whose real step times vary several-fold) cannot blur which side is the slow one."""
    original, extra_s = getattr(cls, name), [0.0]

    def slowed(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        extra_s[0] += SLOWDOWN_S
        return result

    monkeypatch.setattr(cls, name, slowed)
    monkeypatch.setattr(
        calibrate, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + extra_s[0])
    )


def calibrate_as_leader_of_4(monkeypatch, capsys, tiny_target, chat_data, out) -> tuple[int, int]:
    """`--plan --calibrate` in this process as the drafter leader (rank 3) of a 4-process launch: planning
    and measuring need no process group. Returns the recommended (target ranks, drafter ranks)."""
    for name, value in (("WORLD_SIZE", "4"), ("RANK", "3"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    assert main(train_flags(tiny_target, chat_data, out) + ["--plan", "--calibrate"]) == 0
    text = capsys.readouterr().out
    assert "splits of 4 processes:" in text
    [split] = RECOMMENDED.findall(text)
    assert not (out / "checkpoints").exists()
    return int(split[0]), int(split[1])


def test_a_slowed_target_gets_more_target_ranks(monkeypatch, capsys, tiny_target, chat_data, tmp_path):
    slow_down(monkeypatch, TargetFeatureExtractor, "__call__")
    assert calibrate_as_leader_of_4(monkeypatch, capsys, tiny_target, chat_data, tmp_path / "run") == (3, 1)


def test_a_slowed_drafter_gets_fewer_target_ranks(monkeypatch, capsys, tiny_target, chat_data, tmp_path):
    slow_down(monkeypatch, DrafterTrainer, "step")
    assert calibrate_as_leader_of_4(monkeypatch, capsys, tiny_target, chat_data, tmp_path / "run") == (1, 3)


def test_calibrate_without_plan_is_refused(tiny_target, chat_data, tmp_path, capsys):
    assert main(train_flags(tiny_target, chat_data, tmp_path / "run") + ["--calibrate"]) == 2
    assert "pass --plan --calibrate" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- the embedded default

# The embedded default with smaller batches, so that the measured steps take seconds on a 2-core machine.
EMBEDDED_SMALL = ["--plan", "--calibrate", "--tokens_per_batch", "512", "--max_seq_len", "512"]


def test_embedded_default_colocated_prints_the_recommended_split(tmp_path, capsys, embedded_cache):
    assert main([*EMBEDDED_SMALL, "--output_dir", str(tmp_path / "run"), "--cache_dir", embedded_cache]) == 0
    text = capsys.readouterr().out
    assert "this launch, colocated" in text and "splits of 8 processes (torchrun --nproc-per-node 8):" in text
    assert len(RECOMMENDED.findall(text)) == 1


@pytest.mark.processes
def test_embedded_default_under_torchrun_plans_on_the_leader_only(tmp_path, embedded_cache):
    flags = [*EMBEDDED_SMALL, "--output_dir", str(tmp_path / "run"), "--cache_dir", embedded_cache]
    result = subprocess.run(
        [*torchrun_cmd(4), "-m", "dflash_ddp.train", *flags], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(RECOMMENDED.findall(result.stdout)) == 1 and result.stdout.count("calibration on") == 1
    assert "splits of 4 processes:" in result.stdout and "<- this launch" in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.processes
def test_a_tensor_parallel_group_times_its_own_forward_under_torchrun(tiny_target, chat_data, tmp_path):
    """--plan --calibrate --target_tp_size 2 with 3 processes: group 0 (ranks 0-1) measures the sharded
    forward, the leader its steps; one report, the group counted as one unit."""
    flags = train_flags(tiny_target, chat_data, tmp_path / "run") + ["--target_tp_size", "2"]
    result = subprocess.run(
        [*torchrun_cmd(3), "-m", "dflash_ddp.train", *flags, "--plan", "--calibrate"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("one target group (2 ranks, tensor-parallel):") == 1
    assert RECOMMENDED.findall(result.stdout) == [("2", "1")]
    assert "2 (1 group of 2) + 1:" in result.stdout and "<- recommended, this launch" in result.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()
