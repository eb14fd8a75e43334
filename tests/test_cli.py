"""The command line explains itself: --help, refusals said once per job, --data without --target_model."""

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from dflash_ddp.cli_help import markdown_reference, usage, with_reference
from dflash_ddp.config import EMBEDDED_PRESET, TrainConfig, parse_config
from dflash_ddp.train import main

from helpers import torchrun_cmd


def test_help_describes_every_flag_in_a_group_with_its_values_and_the_runs_defaults():
    text = usage([])
    assert all(f.metadata["setting"].help for f in dataclasses.fields(TrainConfig))  # each flag described
    for group in ("model:", "data:", "optimisation:", "distributed:", "checkpoints:", "evaluation:"):
        assert f"\n{group}\n" in text
    lines = text.splitlines()

    def entry(flag: str) -> str:  # the description's lines and the values line of a flag
        i = next(i for i, line in enumerate(lines) if line.startswith(f"  --{flag} "))
        j = next(j for j in range(i, len(lines)) if "value:" in lines[j])
        return "\n".join(lines[i : j + 1])

    for f in dataclasses.fields(TrainConfig):  # descriptions wrapped to a terminal's width
        assert all(len(line) <= 110 for line in entry(f.name).splitlines()[:-1]), entry(f.name)

    # no --target_model: the embedded default run's values, and what a run with a target would use
    assert "value: 150 (otherwise -1)" in entry("max_steps")
    assert "value: 0.008 (otherwise 0.0006)" in entry("learning_rate")
    assert "an integer >= 2" in entry("block_size")
    assert "truncate or drop" in entry("overlength")
    assert "none | all | tensorboard | wandb | mlflow" in entry("report_to")
    assert "finite number > 0" in entry("max_grad_norm")
    # with a target (and a flag), the values of that run
    own = usage(["--target_model", "/models/t", "--max_steps", "7"]).splitlines()
    assert any(line.strip().endswith("value: 7") for line in own)
    assert not any("otherwise" in line for line in own)


def test_help_exits_0_before_anything_is_parsed(capsys):
    assert main(["--help", "--block_size", "1"]) == 0
    assert capsys.readouterr().out.startswith("usage: torchrun")


def test_data_without_target_model_is_refused_unless_the_embedded_target_is_named(tmp_path):
    with pytest.raises(ValueError, match="--data needs --target_model"):
        parse_config(["--data", "mine.jsonl"])
    config = tmp_path / "c.yaml"
    config.write_text("data: [mine.jsonl]\n")
    with pytest.raises(ValueError, match="--data needs --target_model"):
        parse_config(["--config", str(config)])
    # on purpose: the embedded default by name, with its preset, on other data
    named, embedded = parse_config(["--target_model", "embedded", "--data", "mine.jsonl"])
    assert embedded and named.data == ["mine.jsonl"] and named.target_model == EMBEDDED_PRESET["target_model"]
    assert named.max_steps == EMBEDDED_PRESET["max_steps"]


@pytest.mark.processes
def test_a_bad_flag_under_torchrun_is_printed_once(tmp_path):
    """Every rank parses the flags; one line is printed, and torchrun's own summary names it as the root cause."""
    done = subprocess.run(
        torchrun_cmd(2)
        + ["-m", "dflash_ddp.train", "--block_size", "1", "--output_dir", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error (rank 0): --block_size 1: must be at least 2"], done.stderr[-3000:]
    assert re.search(r"traceback : error \(rank 0\): --block_size 1: must be at least 2", done.stderr)


def test_the_cli_page_lists_every_setting_as_the_code_declares_it():
    page = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    assert with_reference(page) == page, (
        "docs/cli.md is stale: python -m dflash_ddp.cli_help --write docs/cli.md"
    )
    reference = markdown_reference()
    for f in dataclasses.fields(TrainConfig):
        assert f"| `--{f.name}` | {f.metadata['setting'].help.replace('|', chr(92) + '|')} |" in reference
    assert (
        "| `--overlength` | what happens to longer conversations | truncate or drop | truncate |" in reference
    )
