"""--init_from: a run's drafter starts from an existing one (an export, a checkpoint, a serving-layout drafter,
a hub name), checked against the run before any target loads, and grown into another family so that step 0
drafts exactly as the source."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import load_file, save_file

from dflash_ddp.checkpoint.resume import RestoreError
from dflash_ddp.config import EMBEDDED_PRESET, EMBEDDED_TARGET, parse_config
from dflash_ddp.evaluation.decoding import as_transformers_assistant, speculative_generate
from dflash_ddp.evaluation.evaluate import prepare_evaluation
from dflash_ddp.parallel.topology import Topology
from dflash_ddp.serving.export import export_checkpoint, load_drafter, save_drafter
from dflash_ddp.serving.export import main as export_main
from dflash_ddp.setup.run import prepare
from dflash_ddp.setup.trainer import build_trainer
from dflash_ddp.train import main as train_main

from helpers import torchrun_cmd

TIMEOUT_S = 600  # only catches a hang
SHORT = ["--max_steps", "6", "--save_steps", "6", "--logging_steps", "1", "--eval_data", ""]
HELDOUT = EMBEDDED_PRESET["eval_data"]


def launch(args: list[str], out: Path, nproc: int = 0, launcher: tuple = (), env: dict | None = None):
    """The real CLI (one process, or torchrun with `nproc` processes and its `launcher` flags), one thread per
    process; its completed process, whatever its exit."""
    head = (
        [*torchrun_cmd(nproc, *launcher), "-m", "dflash_ddp.train"]
        if nproc
        else [sys.executable, "-m", "dflash_ddp.train"]
    )
    return subprocess.run(
        [*head, *SHORT, "--output_dir", str(out), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def train(args: list[str], out: Path, nproc: int = 0) -> subprocess.CompletedProcess:
    """The real CLI training to the end."""
    done = launch(args, out, nproc)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def export(run: Path, out: Path) -> Path:
    """`python -m dflash_ddp.export RUN OUT`, from its `main` in this process (a process start saved)."""
    assert export_main([str(run), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory, embedded_cache) -> Path:
    """An export of the embedded default after 6 steps (the CLI's `main` in this process)."""
    root = tmp_path_factory.mktemp("source")
    assert train_main([*SHORT, "--output_dir", str(root / "run"), "--cache_dir", embedded_cache]) == 0
    return export(root / "run", root / "export")


def run_setup(flags: list[str], out: Path):
    """The run's set-up (settings, target config, drafter config, --init_from's checks) as train builds it."""
    cfg, _ = parse_config([*flags, "--output_dir", str(out), "--eval_data", ""])
    return cfg, prepare(cfg, Topology(1, 0, cfg.drafter_ranks, cfg.target_tp_size))


def refusal(flags: list[str], out: Path) -> str:
    with pytest.raises(ValueError) as caught:
        run_setup(flags, out)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark", "lilicorr"])
def test_a_max_steps_0_run_exports_a_drafter_that_drafts_exactly_as_the_source(
    source, tmp_path, family, embedded_cache
):
    """`--init_from A --max_steps 0` through the CLI saves the drafter the trainer builds from A, untrained, as
    step 0; its export (bf16, stamped, with a model card) decodes the same tokens with the same accepted lengths
    as A itself, grown into DFlash2, DSpark or LiLiCorr as well (DSpark and LiLiCorr with their default
    --target_topk), and a DFlash
    export holds A's weights bit for bit. The run's own evaluation (--eval_data) measures it as A decodes."""
    run, evaluated = tmp_path / "run", family == "dflash"
    flags = ["--init_from", str(source), "--drafter", family, "--max_steps", "0", "--output_dir", str(run)]
    flags += ["--cache_dir", embedded_cache]
    flags += ["--eval_prompts", "1", "--eval_max_new_tokens", "16"] if evaluated else ["--eval_data", ""]
    if family == "lilicorr":  # a correlator at the tiny drafter's width: its 1024-wide default decodes slowly
        flags += ["--lilicorr_hidden_size", "0", "--lilicorr_factor_dim", "64"]
    assert train_main(flags) == 0
    state = json.loads((run / "checkpoints" / "step-00000000" / "trainer_state.json").read_text())
    assert state["global_step"] == state["total_steps"] == 0 and state["config"]["drafter"] == family
    out = tmp_path / "export"
    export_checkpoint(run, out)
    digest = hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()
    stamp = json.loads((out / "config.json").read_text())["dflash_ddp"]
    assert stamp["global_step"] == 0 and stamp["init_from"]["sha256"] == digest
    card = (out / "README.md").read_text()
    assert "no optimizer step (a `--max_steps 0` run): the drafter it started from, as loaded" in card
    exported = load_drafter(out)
    evaluation = prepare_evaluation(EMBEDDED_TARGET, source, HELDOUT, 3, "cpu")
    target, mine = evaluation.target, as_transformers_assistant(exported, evaluation.target)
    accepted = []
    for _, prompt in evaluation.prompts:
        theirs = speculative_generate(target, evaluation.drafter, prompt, 40, evaluation.eos)
        ours = speculative_generate(target, mine, prompt, 40, evaluation.eos)
        assert ours.tokens == theirs.tokens and ours.accepted == theirs.accepted
        accepted += theirs.accepted
    assert max(accepted) > 1  # the source drafts something worth comparing
    if family == "dflash":
        weights = load_file(source / "model.safetensors")
        assert load_file(out / "model.safetensors").keys() == weights.keys()
        assert all(torch.equal(v, weights[k]) for k, v in load_file(out / "model.safetensors").items())
    if evaluated:  # the in-job evaluation of step 0 (its first prompt, 16 tokens): A's accepted lengths
        report = json.loads((run / "eval.json").read_text())
        first = speculative_generate(target, evaluation.drafter, evaluation.prompts[0][1], 16, evaluation.eos)
        histogram = [first.accepted.count(n) for n in range(1, exported.config.block_size + 1)]
        assert (
            report["step"] == 0 and report["lossless"] and report["dflash"]["accept_histogram"] == histogram
        )
        assert "the run's final evaluation (eval.json, step 0)" in card


def edited(source: Path, tmp_path: Path, **fields) -> Path:
    """A copy of the export with config.json fields replaced."""
    copy = tmp_path / "edited"
    shutil.copytree(source, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(fields)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize(
    ("fields", "flags", "expected"),
    [
        ({"hidden_size": 128}, [], "its hidden_size 128 is not the target's 256"),
        ({"vocab_size": 99}, [], "its vocab_size 99 is not the target's"),
        ({"num_target_layers": 12}, [], "it reads a target of 12 layers, this run's target has 8"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 10.0}},
            [],
            "its RoPE .* is not the target's",
        ),
        ({"intermediate_size": 64}, [], "its intermediate_size 64 is not this run's"),
        ({"draft_vocab_size": 64}, [], "its draft vocabulary is pruned to 64 of the target's"),
        (
            {},
            ["--block_size", "16"],
            "its block size is 8, this run's --block_size is 16; pass --block_size 8",
        ),
        ({}, ["--num_draft_layers", "3"], "it has 2 layers.*pass --num_draft_layers 2, or --init_layers_map"),
        ({}, ["--target_layer_ids", "1", "2"], "target_layer_ids .* leave --target_layer_ids unset"),
        ({}, ["--mask_token_id", "5"], "mask_token_id 3, this run asks for 5"),
        ({}, ["--init_layers_map", "0", "7"], r"\[7\] are not layers of the source \(0..1\)"),
        (
            {},
            ["--sliding_window", "64"],
            "its layers attend as .* pass --sliding_window and --sliding_layers",
        ),
        (
            {"architectures": ["Qwen3DSparkModel"], "markov_rank": 8},
            ["--drafter", "dspark", "--target_topk", "16"],
            "its markov_rank is 8, this run's --markov_rank is 256; pass --markov_rank 8",
        ),
    ],
)
def test_every_mismatch_is_one_line_before_any_target_loads(source, tmp_path, fields, flags, expected):
    drafter = edited(source, tmp_path, **fields) if fields else source
    message = refusal(["--init_from", str(drafter), *flags], tmp_path / "run")
    assert message.startswith(("--init_from", "--init_layers_map")), message
    assert re.search(expected, message), message


def test_a_drafter_of_another_target_is_refused_unless_asked(source, tmp_path):
    """The same shapes, other weights: the stamp's fingerprint tells them apart."""
    target = tmp_path / "retrained"
    shutil.copytree(EMBEDDED_TARGET, target)
    weights = load_file(target / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 0.01
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    flags = ["--target_model", str(target), "--data", EMBEDDED_PRESET["data"][0], "--init_from", str(source)]
    flags += ["--num_draft_layers", "2", "--block_size", "8"]
    message = refusal(flags, tmp_path / "run")
    assert "it was trained for the target" in message and "--init_from_other_target true" in message
    _, setup = run_setup([*flags, "--init_from_other_target", "true"], tmp_path / "run")
    assert setup.warm_start is not None


def test_a_hub_name_is_read_from_the_hub_cache_offline(source, tmp_path, monkeypatch):
    folder = tmp_path / "hub" / "models--org--drafter"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("c" * 40)
    shutil.copytree(source, folder / "snapshots" / ("c" * 40))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _, setup = run_setup(["--init_from", "org/drafter"], tmp_path / "run")
    record = setup.warm_start.record()
    assert record["source"] == "org/drafter" and record["commit"] == "c" * 40 and record["path"] is None
    message = refusal(["--init_from", "org/missing"], tmp_path / "run")
    assert "--init_from org/missing" in message and "HF_HUB_OFFLINE=1" in message


def plan_in_process(args: list[str], capsys) -> str:
    """What `--plan` prints, from the CLI's `main` in this process (a process start saved)."""
    from dflash_ddp.train import main

    capsys.readouterr()
    assert main([*SHORT, *args, "--plan"]) == 0
    return capsys.readouterr().out


@pytest.mark.processes
def test_a_split_job_fine_tunes_an_export_and_records_where_it_started(
    source, tmp_path, capsys, embedded_cache
):
    """1 target + 1 drafter rank through torchrun: the drafter rank starts from the export (its first loss far
    below a start from random weights), and the checkpoint, the export's stamp and its model card name the
    source and its digest; DSpark grown from it says what is new, and back to DFlash what is dropped."""
    done = train(["--init_from", str(source), "--cache_dir", embedded_cache], tmp_path / "tuned", nproc=2)
    assert "starting the drafter from" in done.stdout
    scratch = json.loads((source.parent / "run" / "metrics.jsonl").read_text().splitlines()[0])
    tuned = json.loads((tmp_path / "tuned" / "metrics.jsonl").read_text().splitlines()[0])
    assert tuned["step"] == scratch["step"] == 1 and tuned["loss"] < 0.8 * scratch["loss"]
    digest = hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()
    state = json.loads(
        next((tmp_path / "tuned" / "checkpoints").glob("step-*/trainer_state.json")).read_text()
    )
    assert state["init_from"]["sha256"] == digest and state["init_from"]["kind"] == "export"
    assert state["config"]["init_from"] == str(source)
    out = export(tmp_path / "tuned", tmp_path / "tuned_export")
    assert json.loads((out / "config.json").read_text())["dflash_ddp"]["init_from"]["sha256"] == digest
    assert f"started from `{source}`" in (out / "README.md").read_text()
    # growing and trimming families, as --plan shows them (the same lines start a training run)
    grown = plan_in_process(
        ["--init_from", str(source), "--drafter", "dspark", "--target_topk", "16"], capsys
    )
    assert "new, at a start that drafts as the source: markov_head.markov_w1.weight" in grown
    cfg, setup = run_setup(
        ["--init_from", str(source), "--drafter", "dspark", "--target_topk", "16"], tmp_path / "d"
    )
    save_drafter(build_trainer(cfg, setup, torch.device("cpu"), 6).drafter, tmp_path / "dspark")  # no stamp
    trimmed = plan_in_process(["--init_from", str(tmp_path / "dspark")], capsys)
    assert "(serving layout, dspark, 2 layers)" in trimmed and "checked by shape only" in trimmed
    dropped = next(line for line in trimmed.splitlines() if "dropped (the run's drafter has no place" in line)
    assert "markov_head.markov_w1.weight" in dropped and "confidence_head.proj.weight" in dropped


def refusal_of_the_cli(args: list[str], out: Path, nproc: int = 0, env: dict | None = None) -> str:
    """The real CLI (one process, or torchrun with `nproc`) refusing to start: exit non-zero, nothing written
    to `out`, one error line and no traceback from any process (torchrun's own summary aside); that line."""
    logs = out.parent / "logs"
    done = launch(args, out, nproc, ("--log-dir", str(logs), "--redirects", "3"), env)
    stderr = "".join(p.read_text() for p in sorted(logs.rglob("stderr.log"))) if nproc else done.stderr
    assert done.returncode != 0 and "Traceback" not in stderr, stderr[-3000:]
    assert not out.exists()
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error"), stderr[-3000:]
    return lines[0]


def refusal_in_process(args: list[str], out: Path, capsys) -> str:
    """As `refusal_of_the_cli`, from the CLI's `main` in this process (a process start saved)."""
    from dflash_ddp.train import main

    capsys.readouterr()
    code = main([*SHORT, "--output_dir", str(out), *args])
    stderr = capsys.readouterr().err
    assert code != 0 and not out.exists(), stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error"), stderr[-3000:]
    return lines[0]


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:4000])  # what an interrupted copy or download leaves


def not_json(path: Path) -> None:
    path.write_text("{'model_type': qwen3")


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a tensor's bytes: the file still parses, only its checksum tells
    path.write_bytes(bytes(data))


def hub_cache_of(export: Path, root: Path) -> Path:
    """`export` as the hub cache holds a download of org/drafter: snapshot files linked to blobs, the weights'
    named by their sha256 (an LFS file's); the snapshot's directory."""
    folder, commit = root / "models--org--drafter", "c" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "blobs").mkdir()
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in ("config.json", "model.safetensors", "README.md"):
        data = (export / file).read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file).symlink_to(blob)
    return snapshot


def damaged_copy(kind: str, source: Path, root: Path) -> tuple[str, Path, dict]:
    """A copy of the source drafter as `kind` (--init_from's value, the directory it reads, the environment)."""
    checkpoints = source.parent / "run" / "checkpoints"
    step = checkpoints / (checkpoints / "latest").read_text().strip()
    if kind == "export":
        shutil.copytree(source, root / "export")
        return str(root / "export"), root / "export", {}
    if kind == "checkpoint":
        shutil.copytree(step, root / step.name)
        return str(root / step.name), root / step.name, {}
    if kind == "run directory":
        shutil.copytree(checkpoints, root / "run" / "checkpoints")
        return str(root / "run"), root / "run" / "checkpoints" / step.name, {}
    snapshot = hub_cache_of(source, root / "hub")
    return "org/drafter", snapshot, {"HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1"}


@pytest.mark.processes
@pytest.mark.parametrize(
    ("kind", "file", "damage", "expected", "nproc"),
    [
        ("export", "model.safetensors", cut_short, "not a readable safetensors file", 0),
        ("export", "model.safetensors", cut_short, "not a readable safetensors file", 2),
        ("export", "config.json", not_json, "unreadable", 0),
        ("export", "model.safetensors", Path.unlink, "missing", 0),
        ("checkpoint", "model.safetensors", flip_last_byte, "size or sha256 does not match the manifest", 0),
        ("run directory", "model.safetensors", cut_short, "size or sha256 does not match the manifest", 0),
        ("hub", "model.safetensors", flip_last_byte, "sha256 [0-9a-f]{64} is not the hub's [0-9a-f]{64}", 0),
        ("hub", "config.json", not_json, "unreadable", 0),
    ],
    ids=[
        "export-weights-cut-short",
        "export-weights-cut-short-torchrun",
        "export-config-not-json",
        "export-weights-missing",
        "checkpoint-weights-altered",
        "run-directory-weights-cut-short",
        "hub-weights-altered",
        "hub-config-not-json",
    ],
)
def test_a_damaged_source_is_one_line_naming_the_file_and_what_to_do(
    source, tmp_path, capsys, kind, file, damage, expected, nproc
):
    """Every file --init_from reads goes through the checkpoints' verified read: a damaged one ends the run
    before any target weights load, on every rank, with one line naming it and how to replace it. The real
    CLI where it runs under torchrun or reads the hub cache (whose place is read once, at import), its `main`
    in this process otherwise."""
    init_from, directory, env = damaged_copy(kind, source, tmp_path)
    damage(directory / file)
    args, out = ["--init_from", init_from], tmp_path / "out"
    line = (
        refusal_of_the_cli(args, out, nproc, env) if nproc or env else refusal_in_process(args, out, capsys)
    )
    assert (
        line.startswith("error (rank 0): " if nproc else "error: ") and f"--init_from {init_from}: " in line
    )
    assert re.search(f"{re.escape(str(directory / file))}: {expected}", line), line
    remedy = {
        "export": f"export it again (python -m dflash_ddp.export CHECKPOINT {directory}) or copy it again",
        "checkpoint": f"pick another checkpoint for --init_from (an earlier one in {directory.parent})",
        "run directory": f"pick another checkpoint for --init_from (an earlier one in {directory.parent})",
        "hub": f"download it again into the hub cache {tmp_path / 'hub'}: `hf download org/drafter",
    }[kind]
    assert remedy in line, line


def test_a_source_changed_after_the_set_up_checked_it_is_refused_when_copied(source, tmp_path):
    """The drafter ranks read the weights again: only the file the set-up checked (and the run records)."""
    copy = tmp_path / "export"
    shutil.copytree(source, copy)
    cfg, setup = run_setup(["--init_from", str(copy)], tmp_path / "run")
    flip_last_byte(copy / "model.safetensors")
    with pytest.raises(RestoreError, match=f"{copy / 'model.safetensors'} changed since the run's set-up"):
        build_trainer(cfg, setup, torch.device("cpu"), total_steps=6)


def test_a_resumed_run_keeps_the_start_it_recorded(source, tmp_path, embedded_cache, capsys):
    """A run started from A resumes from its checkpoint: --init_from B then would be ignored, so it is
    refused; --init_from A (or none) resumes, and every later checkpoint still records A."""
    run, cache = tmp_path / "run", ["--cache_dir", embedded_cache]
    base = [*SHORT, "--save_steps", "2", "--output_dir", str(run), *cache]
    assert train_main([*base, "--init_from", str(source), "--max_steps", "2"]) == 0
    other = export(run, tmp_path / "other")  # B: the run's own step 2, other weights than A
    longer = ["--resume_override", "max_steps"]
    capsys.readouterr()
    assert train_main([*base, "--init_from", str(other), "--max_steps", "4", *longer]) == 2
    err = capsys.readouterr().err
    assert f"this run started from {source}; --init_from {other} sets the start of a new run" in err
    assert train_main([*base, "--init_from", str(source), "--max_steps", "4", *longer]) == 0
    assert "this run's start already; it resumes from its checkpoint's weights" in capsys.readouterr().out
    assert train_main([*base, "--max_steps", "6", *longer]) == 0
    digest = hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()
    for step in (2, 4, 6):
        state = json.loads((run / "checkpoints" / f"step-0000000{step}" / "trainer_state.json").read_text())
        assert state["init_from"]["sha256"] == digest, step
    fresh = [*SHORT, "--save_steps", "2", "--output_dir", str(tmp_path / "fresh"), *cache]
    assert train_main([*fresh, "--max_steps", "2"]) == 0
    capsys.readouterr()
    assert train_main([*fresh, "--init_from", str(source), "--max_steps", "4", *longer]) == 2
    assert "this run started from a fresh drafter (no --init_from)" in capsys.readouterr().err


def test_lilicorr_grows_its_convolutions_in_and_out(source, tmp_path):
    """A LiLiCorr drafter (its correlator trained away from its start) grown into LiLiCorr with
    --lilicorr_conv drafts exactly as it does: only the convolutions are new, at the identity. Back without
    them, the run says the convolutions are dropped. Convolutions of another size are refused naming the flag."""
    small = ["--drafter", "lilicorr", "--lilicorr_hidden_size", "0", "--lilicorr_factor_dim", "64"]
    cfg, setup = run_setup(["--init_from", str(source), *small], tmp_path / "a")
    plain = build_trainer(cfg, setup, torch.device("cpu"), 6).drafter
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if name.startswith("lilicorr"):
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
    save_drafter(plain, tmp_path / "lilicorr")
    cfg, setup = run_setup(
        ["--init_from", str(tmp_path / "lilicorr"), *small, "--lilicorr_conv", "true"], tmp_path / "b"
    )
    warm = setup.warm_start
    assert warm.new and all("conv" in name for name in warm.new) and not warm.dropped
    grown = build_trainer(cfg, setup, torch.device("cpu"), 6).drafter
    save_drafter(grown, tmp_path / "grown")
    evaluation = prepare_evaluation(EMBEDDED_TARGET, tmp_path / "lilicorr", HELDOUT, 2, "cpu")
    target, eos = evaluation.target, evaluation.eos
    mine = as_transformers_assistant(load_drafter(tmp_path / "grown"), target)
    theirs_before = as_transformers_assistant(load_drafter(source), target)
    differs = False
    for _, prompt in evaluation.prompts:
        theirs = speculative_generate(target, evaluation.drafter, prompt, 40, eos)
        ours = speculative_generate(target, mine, prompt, 40, eos)
        assert ours.tokens == theirs.tokens and ours.accepted == theirs.accepted
        differs |= speculative_generate(target, theirs_before, prompt, 40, eos).accepted != theirs.accepted
    assert differs  # the correlator's weights change what it drafts: the comparison can fail
    _, setup = run_setup(["--init_from", str(tmp_path / "grown"), *small], tmp_path / "c")
    assert setup.warm_start.new == [] and all("conv" in name for name in setup.warm_start.dropped)
    message = refusal(
        [
            "--init_from",
            str(tmp_path / "grown"),
            *small,
            "--lilicorr_conv",
            "true",
            "--conv_kernel_size",
            "4",
        ],
        tmp_path / "d",
    )
    assert (
        "its conv_kernel_size is 2, this run's --conv_kernel_size is 4; pass --conv_kernel_size 2" in message
    )
