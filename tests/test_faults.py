"""Real faults injected into small runs: a full disk (RLIMIT_FSIZE), signals to single ranks of a torchrun
job, a second job on the same output directory, damaged files, bad numbers. Each ends with one clear
line, a non-zero exit status for errors, and nothing already written lost."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_ddp import soak
from dflash_ddp import train as train_module
from dflash_ddp.checkpoint.manifest import verify_checkpoint
from dflash_ddp.parallel.run_lock import OutputDirLock
from dflash_ddp.train import main

from helpers import file_size_limit, rank_pids, torchrun_cmd, train_flags


def full_at_optimizer(run: Path) -> int:
    """A file size limit between the run's model.safetensors and its larger optimizer.pt (about 200 and 207
    KB with Muon's one momentum per matrix, 400 KB with AdamW's two): the weights are written, torch.save of
    the optimizer state then fails like on a full disk."""
    checkpoint = run / "checkpoints" / "step-00000003"
    weights, optimizer = (
        (checkpoint / name).stat().st_size for name in ("model.safetensors", "optimizer.pt")
    )
    assert weights < optimizer, (weights, optimizer)
    return (weights + optimizer) // 2


def flags(tiny_target, chat_data, out, **settings):
    return train_flags(tiny_target, chat_data, out, **({"save_steps": 3, "max_steps": 3} | settings))


@pytest.fixture
def run_at_step_3(tiny_target, chat_data, tmp_path):
    """A finished 3-step run (checkpoint step-00000003 and the tokenized cache), to be resumed."""
    out = tmp_path / "run"
    assert main(flags(tiny_target, chat_data, out)) == 0
    return out


@pytest.fixture(scope="module")
def run_at_step_6(tiny_target, chat_data, tmp_path_factory):
    """A finished 6-step run (checkpoints 3 and 6), copied by the tests that damage it."""
    out = tmp_path_factory.mktemp("six_steps") / "run"
    assert main(flags(tiny_target, chat_data, out, max_steps=6)) == 0
    return out


def resume_flags(tiny_target, chat_data, out, **settings):
    return flags(
        tiny_target, chat_data, out, **({"max_steps": 12, "resume_override": "max_steps"} | settings)
    )


def logged_steps(out: Path) -> list[int]:
    return [record["step"] for record in soak.logged_steps(out)]


def assert_only_step_3_is_left(out: Path) -> None:
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000003"]
    assert (root / "latest").read_text().strip() == "step-00000003"
    assert verify_checkpoint(root / "step-00000003") == []


@pytest.mark.processes
def test_a_full_disk_during_a_background_save_stops_the_run_at_the_next_step(
    run_at_step_3, tiny_target, chat_data
):
    result = subprocess.run(
        [sys.executable, "-m", "dflash_ddp.train", *resume_flags(tiny_target, chat_data, run_at_step_3)],
        capture_output=True,
        text=True,
        preexec_fn=file_size_limit(full_at_optimizer(run_at_step_3)),
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: saving checkpoint step-00000006 failed (RuntimeError") and "intact" in last
    assert max(logged_steps(run_at_step_3)) < 9  # noticed within a step or two, not at the next save
    assert_only_step_3_is_left(run_at_step_3)


@pytest.mark.processes
def test_a_full_cache_dir_names_cache_dir(tiny_target, chat_data, tmp_path):
    cache = tmp_path / "cache"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_ddp.train",
            *flags(tiny_target, chat_data, tmp_path / "run", cache_dir=cache),
        ],
        capture_output=True,
        text=True,
        preexec_fn=file_size_limit(16_000),  # the tokenized cache file is ~30 KB
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert f"--cache_dir {cache}: cannot write the tokenized-data cache (SafetensorError" in last
    assert "Traceback" not in result.stderr
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name] == []  # no half-written file left


@pytest.mark.processes
def test_a_failing_drafter_rank_exits_with_its_own_message_and_is_the_root_cause(
    run_at_step_3, tiny_target, chat_data, tmp_path
):
    """1+1 job, disk full on the drafter's save: no SIGABRT at teardown, torchrun blames rank 1."""
    logs = tmp_path / "logs"
    args = ["-m", "dflash_ddp.train", *resume_flags(tiny_target, chat_data, run_at_step_3, dist_timeout=60)]
    result = subprocess.run(
        [*torchrun_cmd(2, "--log-dir", str(logs), "--redirects", "3"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=file_size_limit(full_at_optimizer(run_at_step_3)),
    )
    assert result.returncode != 0
    drafter_err = next(logs.glob("*/attempt_0/1/stderr.log")).read_text()
    last = drafter_err.strip().splitlines()[-1]
    assert last.startswith("error (rank 1): saving checkpoint step-00000006 failed"), drafter_err[-3000:]
    everything = result.stderr + "".join(p.read_text() for p in logs.rglob("*.log"))
    assert "terminate called" not in everything and "Signal 6" not in everything
    root_cause = result.stderr.split("Root Cause (first observed failure):")[1]
    assert " rank      : 1 " in root_cause and "exitcode  : 1 " in root_cause, result.stderr[-3000:]
    assert "error (rank 1): saving checkpoint step-00000006 failed" in root_cause  # not "<N/A>"
    assert_only_step_3_is_left(run_at_step_3)
    # the failing rank released the output directory before exiting: the next job takes over no lock
    lock = OutputDirLock(run_at_step_3)
    assert lock.acquire() == []
    lock.release()


def test_a_lock_taken_anew_leaves_no_directory_and_a_removed_lock_file_is_never_held(tmp_path):
    """A job refused at start (its lock released before it wrote anything) leaves no output directory; one
    that found the directory keeps it and its lock file. A job that opened the lock file just before a
    refused job removed it takes the new file instead of holding a removed one."""
    out = tmp_path / "new" / "run"
    lock = OutputDirLock(out)
    assert lock.acquire() == []
    second = OutputDirLock(out)
    with pytest.raises(ValueError, match="is in use by another job"):
        second.acquire()
    lock.release()
    assert not out.exists() and (tmp_path / "new").is_dir()
    out.mkdir()
    lock.acquire()
    lock.release()
    assert [p.name for p in out.iterdir()] == [".dflash_ddp.lock"]

    held = OutputDirLock(tmp_path / "raced")
    held.acquire()
    opened_before = (tmp_path / "raced" / ".dflash_ddp.lock").open("a+")
    held.release()  # removes the file `opened_before` still refers to
    real_open, opens = Path.open, []

    def open_the_removed_file_first(path, *args, **kwargs):
        opens.append(path)
        return opened_before if len(opens) == 1 else real_open(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Path, "open", open_the_removed_file_first)
        late = OutputDirLock(tmp_path / "raced")
        late.acquire()
    assert len(opens) == 2 and (tmp_path / "raced" / ".dflash_ddp.lock").is_file()
    with pytest.raises(ValueError, match="is in use by another job"):
        OutputDirLock(tmp_path / "raced").acquire()
    late.release()


def test_ctrl_c_while_the_job_starts_is_one_line_and_leaves_no_directory(
    tiny_target, chat_data, tmp_path, capsys, monkeypatch
):
    """Ctrl-C while the target downloads or loads, or the data is tokenized: one line, status 130, the output
    directory's lock released (the directory the job made for it removed), no traceback."""

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "prepare", interrupted)
    out = tmp_path / "run"
    assert main(flags(tiny_target, chat_data, out)) == 130
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == "interrupted: stopped before training started; the same command starts again"
    assert not out.exists()


def test_an_output_dir_whose_filesystem_does_not_lock_is_one_line(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(f, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(ValueError, match=r"its filesystem does not lock files \(\[Errno 38\]"):
        OutputDirLock(tmp_path / "run").acquire()


@pytest.mark.processes
def test_sigterm_to_a_target_rank_only_stops_the_whole_job_with_a_checkpoint(
    tiny_target, chat_data, tmp_path
):
    """A 2+1 job where only target rank 1 is signalled (one node preempted): the leader saves and
    every rank exits 0."""
    out = tmp_path / "run"
    args = ["-m", "dflash_ddp.train", *flags(tiny_target, chat_data, out, max_steps=100000, save_steps=1000)]
    job = subprocess.Popen(
        [*torchrun_cmd(3), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert time.time() < deadline and job.poll() is None
        time.sleep(0.05)
    os.kill(rank_pids(job.pid)[1], signal.SIGTERM)
    output = job.communicate(timeout=120)[0]
    assert job.returncode == 0, output[-3000:]
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and verify_checkpoint(saved[0]) == []
    stopped_at = int(saved[0].name.split("-")[1])
    assert f"stop requested (SIGTERM on rank 1): stopped after step {stopped_at}" in output
    assert max(logged_steps(out)) == stopped_at


@pytest.mark.parametrize(
    "manifest",
    [
        b"\x8b\x1f\xff\x00 random bytes",
        b'{"files": []}',
        b'{"step": 6, "files": {}}',
        b"[1, 2]",
        "the real manifest with step 9",
    ],
    ids=["random-bytes", "files-a-list", "files-empty", "not-an-object", "wrong-step"],
)
def test_an_ill_shaped_manifest_invalidates_its_checkpoint_only(
    tiny_target, chat_data, tmp_path, run_at_step_6, manifest
):
    out = tmp_path / "run"
    shutil.copytree(run_at_step_6, out)
    newest = out / "checkpoints" / "step-00000006"
    if isinstance(manifest, str):  # every hash right: only the step disagrees with the directory
        manifest = json.dumps(json.loads((newest / "manifest.json").read_text()) | {"step": 9}).encode()
    else:  # and a damaged file the manifest does not catch
        (newest / "optimizer.pt").write_bytes((newest / "optimizer.pt").read_bytes()[:100])
    (newest / "manifest.json").write_bytes(manifest)
    problems = verify_checkpoint(newest)
    assert problems and all(str(newest) in p for p in problems)
    more = ("--max_steps", "7", "--resume_override", "max_steps")
    assert main(flags(tiny_target, chat_data, out)[:-2] + list(more)) == 0  # resumes step 3, not a traceback
    assert verify_checkpoint(out / "checkpoints" / "step-00000007") == []


def test_a_manifest_listing_a_path_outside_the_directory_is_refused(run_at_step_3):
    ckpt = run_at_step_3 / "checkpoints" / "step-00000003"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for bad in ("../step-00000003/config.json", "/etc/hostname"):
        changed = manifest | {"files": manifest["files"] | {bad: {"sha256": "0", "size": 1}}}
        (ckpt / "manifest.json").write_text(json.dumps(changed))
        assert any("not plain file names" in p for p in verify_checkpoint(ckpt))
    del manifest["files"]["rng-rank0.pt"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert any("does not list ['rng-rank0.pt']" in p for p in verify_checkpoint(ckpt))


def test_a_partial_last_metrics_line_is_dropped_on_resume(run_at_step_3, tiny_target, chat_data, capsys):
    metrics = run_at_step_3 / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 4, "loss": 5.')  # power loss in the middle of an append
    assert main(resume_flags(tiny_target, chat_data, run_at_step_3, max_steps=5)) == 0
    assert "metrics.jsonl: dropped 1 unreadable line(s) (line 4)" in capsys.readouterr().out
    assert logged_steps(run_at_step_3) == [1, 2, 3, 4, 5]


@pytest.mark.processes
def test_a_failing_metrics_append_is_a_save_error(tmp_path):
    code = (
        "import sys\n"
        "from dflash_ddp.observe.progress import TrainingMonitor\n"
        "from dflash_ddp.files import SaveError\n"
        "monitor = TrainingMonitor(sys.argv[1], 10)\n"
        "record = {'step': 1, 'loss': 1.0, 'accuracy': 0.0, 'tau_estimate': 1.0, 'pad': 'x' * 3000}\n"
        "try:\n"
        "    monitor.log(record)\n"
        "except SaveError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        preexec_fn=file_size_limit(1000),
    )
    assert f"appending step 1 to {tmp_path / 'metrics.jsonl'} failed" in result.stdout, result.stderr


@pytest.mark.processes
def test_a_second_job_on_the_same_output_dir_is_refused_and_a_dead_holder_taken_over(
    tiny_target, chat_data, tmp_path, capsys, monkeypatch
):
    """The first job runs in a process of its own (SIGKILLed below); the second and third in this one. The
    second is refused before it loads the target or tokenizes (minutes on a real target and data set)."""
    out = tmp_path / "run"
    train = [sys.executable, "-m", "dflash_ddp.train"]
    first = subprocess.Popen(
        [*train, *flags(tiny_target, chat_data, out, max_steps=100000, save_steps=1000)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists():
            assert time.time() < deadline and first.poll() is None
            time.sleep(0.05)
        capsys.readouterr()
        with monkeypatch.context() as m:
            m.setattr(train_module, "prepare", lambda *_: pytest.fail("the target loaded before the lock"))
            assert main(flags(tiny_target, chat_data, out)) == 2
        refused = capsys.readouterr().err
        assert f"--output_dir {out} is in use by another job (host " in refused
        assert f"pid {first.pid}, started " in refused
    finally:
        first.kill()  # SIGKILL: the lock file still names it
        first.wait()
    root = out / "checkpoints"
    root.mkdir(exist_ok=True)
    for leftover in (".tmp-step-00000005-99",):
        (root / leftover).mkdir()
        (root / leftover / "model.safetensors").write_bytes(b"partial")
    (root / ".latest-99").write_text("step-0000")
    assert main(flags(tiny_target, chat_data, out)) == 0
    third = capsys.readouterr().out
    assert f"took over the lock of {out} from a job that ended without releasing it" in third
    assert f"pid {first.pid}" in third
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000003"]


def test_a_non_finite_loss_stops_the_run_with_one_line_and_no_checkpoint(
    tiny_target, chat_data, tmp_path, capsys
):
    out = tmp_path / "run"
    # Adam moves every weight by about the learning rate: 1e30 overflows them and the next loss is nan
    assert main(flags(tiny_target, chat_data, out, max_steps=6, learning_rate=1e30)) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: non-finite loss") and "Traceback" not in err
    assert not list((out / "checkpoints").glob("step-*"))


def test_links_planted_in_the_output_directory_are_not_written_through(tmp_path, capsys):
    """Whoever can plant links in a shared run directory cannot have a job overwrite the files they point at:
    the lock file is opened without following a link (refused in one line), and the run's own small files
    are replaced, not written through."""
    from dflash_ddp.train import main

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / ".dflash_ddp.lock").symlink_to(victim)
    with pytest.raises(ValueError, match="cannot create it or its lock file"):
        OutputDirLock(locked).acquire()
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").symlink_to(victim)
    (out / "data_stats.json").symlink_to(victim)
    assert main(["--output_dir", str(out), "--max_steps", "1", "--eval_data", ""]) == 0
    assert victim.read_text() == "precious"
    assert (
        not (out / "config.json").is_symlink()
        and json.loads((out / "config.json").read_text())["max_steps"] == 1
    )
