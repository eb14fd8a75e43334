"""The embedded default: shipped assets, the no-argument 8-process job, and that training it works."""

import json
import subprocess
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_ddp.config import ASSETS, EMBEDDED_PRESET, EMBEDDED_TARGET

from helpers import torchrun_cmd


def test_assets_are_small_and_load_offline():
    total = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert total < 20 * 2**20
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_TARGET, local_files_only=True)
    assert tokenizer.mask_token_id is not None and tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_TARGET, local_files_only=True)
    assert model.config.model_type == "qwen3" and model.config.num_hidden_layers == 8
    for path in [*EMBEDDED_PRESET["data"], EMBEDDED_PRESET["eval_data"]]:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        assert len(rows) > 100 and all(r["messages"][-1]["role"] == "assistant" for r in rows)


@pytest.mark.processes
def test_no_argument_job_runs_as_7_plus_1(tmp_path):
    """`torchrun --nproc-per-node 8 -m dflash_ddp.train` with only the step count and evaluation reduced."""
    out = tmp_path / "run"
    cmd = [
        *torchrun_cmd(8),
        "-m",
        "dflash_ddp.train",
        "--max_steps",
        "4",
        "--output_dir",
        str(out),
        "--eval_prompts",
        "2",
        "--eval_max_new_tokens",
        "16",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "training the embedded default: the tiny target " in result.stdout
        and "with its preset, on " in result.stdout
    )
    state = json.loads((out / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert state["topology"] == {
        "world_size": 8,
        "target_ranks": 7,
        "target_tp_size": 1,
        "drafter_ranks": 1,
        "colocated": False,
    }
    report = json.loads((out / "eval.json").read_text())
    assert report["lossless"]


@pytest.mark.processes  # beside the vLLM test that reads the same training: it is trained once
def test_short_training_raises_real_tau_above_baselines(trained_default):
    """30 colocated steps of the default (it trains 150): real speculative decoding accepts clearly more
    than an untrained drafter (tau 1.0) and than prompt lookup; measured 2.43 vs 1.00 vs 1.20 after 60 steps
    on 10 prompts x 96 tokens with the default's D-PACE and Muon at 8e-3 (2.90 after 100 steps), 2.21 vs
    1.00 vs 1.18 on the fixture's 8 x 64 after 40, 2.06 after 30."""
    report = json.loads((trained_default / "eval.json").read_text())
    assert report["lossless"]
    trained, untrained = report["dflash"]["tau"], report["dflash_untrained"]["tau"]
    assert trained > untrained + 0.5, (trained, untrained)
    assert trained > report["prompt_lookup"]["tau"]
