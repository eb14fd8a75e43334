"""vLLM in the loop (evaluation/engine.py): a server that cannot start is one line with its reason, the
counters and outputs of an OpenAI-compatible server become tau, acceptance by position and the lossless
check, and (where vLLM's own environment is installed: DFLASH_DDP_VLLM_PYTHON) the embedded target's
export served by vLLM is lossless with a tau within 2% of this project's evaluation."""

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflash_ddp.engines import EngineClient, EngineServer
from dflash_ddp.evaluate import main as evaluate_main
from dflash_ddp.evaluation import evaluate as evaluate_module
from dflash_ddp.evaluation.engine import engine_evaluation
from dflash_ddp.export import main as export_main
from dflash_ddp.train import main as train_main

from conftest import DEFAULT_EVAL_PROMPTS, DEFAULT_EVAL_TOKENS
from helpers import side_by_side

ASSETS = Path(__file__).parent.parent / "dflash_ddp" / "assets"
TARGET, HELDOUT = ASSETS / "tiny_qwen3", ASSETS / "data" / "heldout_regenerated.jsonl"
VLLM_PYTHON = os.environ.get("DFLASH_DDP_VLLM_PYTHON")

METRICS = """# HELP vllm:spec_decode_num_drafts_total drafts
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {second}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {first}
"""


class FakeEngine(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that answers each prompt with its reversed ids, repeated, and counts, per
    completion, 2 drafts with 3 tokens accepted (2 at position 0, 1 at position 1)."""

    completions = 0

    def _send(self, body: str, kind: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/v1/models":
            self._send(json.dumps({"data": [{"id": "m"}]}))
        else:
            n = type(self).completions
            self._send(METRICS.format(drafts=2 * n, accepted=3 * n, first=2 * n, second=n), "text/plain")

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).completions += 1
        # a prompt's tokens as its output, reversed and repeated: 6 of them where its 2 drafts accepted 3
        # after the first token, 1 + 3 + 2 (each verify step commits its accepted drafts and one more)
        tokens = (body["prompt"][::-1] * 3)[: min(6, body["max_tokens"])]
        self._send(json.dumps({"choices": [{"token_ids": tokens}]}))

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_counters_and_outputs_make_the_report(fake_engine):
    client = EngineClient(fake_engine)
    prompts = [("a:1", [1, 2, 3]), ("a:2", [4, 5, 6])]
    reference = [[3, 2, 1] * 2, [6, 5, 4] * 2]
    report = engine_evaluation(client, None, prompts, 8, reference=reference)
    assert report["drafts"] == 4 and report["tau"] == (12 - 2) / 4 == 1 + 6 / 4  # accepted + the target's
    assert report["acceptance_by_position"] == [1.0, 0.5] and report["lossless"] is True
    report = engine_evaluation(client, client, prompts, 8)  # a second server's outputs as the reference
    assert report["lossless"] is True and report["tokens_per_s_without_drafter"] > 0
    assert engine_evaluation(client, None, prompts, 8, reference=[reference[0], [0]])["mismatched"] == ["a:2"]
    # outputs cut at 4 tokens: vLLM's counters still hold the drafts accepted past the cut; tau does not
    short = engine_evaluation(client, None, prompts, 4, reference=[r[:4] for r in reference])
    assert short["tau"] == (8 - 2) / 4 and short["tau_counted"] == 1 + 6 / 4


def test_the_servers_evaluate_starts_run_one_at_a_time(tmp_path, monkeypatch, capsys):
    """`evaluate --engine vllm` starts the server with the drafter, decodes, stops it, then the plain one: a
    vLLM server takes its share of the GPU (0.9 by default), so a second beside it would not start. The
    report is built from both servers' outputs and the drafter server's counters."""
    started, alive = [], []

    class OneFakeServer:
        def __init__(self, python, target, speculative=None, dtype="auto", extra_args=()):
            self.speculative = speculative

        def __enter__(self):
            assert not alive, "a second server started while another was running"
            self.server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
            threading.Thread(target=self.server.serve_forever, daemon=True).start()
            self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
            started.append(self.speculative)
            alive.append(self)
            return self

        def __exit__(self, *exc):
            alive.remove(self)
            self.server.shutdown()

    monkeypatch.setattr(evaluate_module, "EngineServer", OneFakeServer)
    run = ["--output_dir", str(tmp_path / "run"), "--max_steps", "0", "--eval_data", ""]
    assert train_main(run) == 0
    assert export_main([str(tmp_path / "run"), str(tmp_path / "export")]) == 0
    capsys.readouterr()
    argv = ["--target_model", str(TARGET), "--drafter", str(tmp_path / "export"), "--data", str(HELDOUT)]
    argv += ["--num_prompts", "2", "--engine", "vllm", "--vllm_python", sys.executable, "--device", "cpu"]
    assert evaluate_main([*argv, "--json", str(tmp_path / "report.json")]) == 0
    assert [spec and spec["method"] for spec in started] == ["dflash", None] and not alive
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["lossless"] is True and report["tau"] == 1 + 3 / 2  # the fake's 2 drafts, 3 accepted
    assert report["tokens_per_s_without_drafter"] > 0


@pytest.mark.processes
def test_a_server_that_cannot_start_is_one_line_with_its_reason(tmp_path, capsys):
    """An interpreter without vLLM: the server exits at once, its last error line is the message, and
    nothing is left running."""
    server = EngineServer(sys.executable, str(TARGET))
    with pytest.raises(ValueError, match="the vLLM server exited at start .*No module named 'vllm'"):
        server.__enter__()
    assert server.process.poll() is not None
    argv = [
        "--target_model",
        str(TARGET),
        "--drafter",
        str(tmp_path),
        "--data",
        str(HELDOUT),
        "--engine",
        "vllm",
    ]
    assert evaluate_main(argv) == 2
    assert "--engine vllm needs --vllm_python" in capsys.readouterr().err


@pytest.mark.processes
@pytest.mark.skipif(not VLLM_PYTHON, reason="vLLM's own environment: set DFLASH_DDP_VLLM_PYTHON (README)")
def test_vllm_serves_the_export_losslessly_with_the_projects_tau(trained_default, tmp_path):
    """The trained default's fp32 export served by vLLM on the held-out prompts the run's own evaluation
    decoded (its eval.json: this project's decoding of the same checkpoint, the same tau as of the export)."""
    assert export_main([str(trained_default), str(tmp_path / "export"), "--dtype", "float32"]) == 0
    engine = ["--target_model", str(TARGET), "--drafter", str(tmp_path / "export"), "--data", str(HELDOUT)]
    engine += ["--num_prompts", str(DEFAULT_EVAL_PROMPTS), "--max_new_tokens", str(DEFAULT_EVAL_TOKENS)]
    engine += ["--device", "cpu", "--engine", "vllm", "--vllm_python", VLLM_PYTHON]
    assert evaluate_main([*engine, "--json", str(tmp_path / "vllm.json")]) == 0
    ours = json.loads((trained_default / "eval.json").read_text())["dflash"]
    theirs = json.loads((tmp_path / "vllm.json").read_text())
    assert theirs["lossless"] is True and theirs["drafts"] > 0
    assert abs(theirs["tau"] / ours["tau"] - 1) < 0.02, (theirs["tau"], ours["tau"])


V2_RUNNER_FAMILIES = {
    "dflash2": ([], "does not support"),
    "dspark": (["--target_topk", "8"], "does not support: dspark speculative decoding"),
    "lilicorr": (["--lilicorr_hidden_size", "32", "--lilicorr_factor_dim", "16"], "does not support"),
}


@pytest.fixture(scope="module")
def v2_runner_refusals(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each V2-runner family's drafter as it starts (`--max_steps 0` saves it as step 0), exported as a trained
    one is, then evaluated in vLLM by the real command, the three commands side by side (a vLLM start is
    mostly one core's imports)."""
    root = tmp_path_factory.mktemp("v2_runner")
    commands = {}
    for family, (flags, _) in V2_RUNNER_FAMILIES.items():
        run, export = root / family / "run", root / family / "export"
        argv = ["--output_dir", str(run), "--drafter", family, "--max_steps", "0", "--eval_data", ""]
        assert train_main([*argv, *flags]) == 0
        assert export_main([str(run), str(export), "--dtype", "float32"]) == 0
        engine = ["--target_model", str(TARGET), "--drafter", str(export), "--data", str(HELDOUT)]
        engine += ["--num_prompts", "1", "--engine", "vllm", "--vllm_python", VLLM_PYTHON, "--device", "cpu"]
        commands[family] = [sys.executable, "-m", "dflash_ddp.evaluate", *engine]
    return dict(zip(commands, side_by_side(list(commands.values())), strict=True))


@pytest.mark.skipif(not VLLM_PYTHON, reason="vLLM's own environment: set DFLASH_DDP_VLLM_PYTHON (README)")
@pytest.mark.parametrize("family", V2_RUNNER_FAMILIES)
def test_a_v2_runner_export_is_refused_by_vllms_cpu_build_in_one_line_naming_the_runner(
    v2_runner_refusals, family
):
    """vLLM serves DFlash2 and LiLiCorr (candidate heads) and DSpark on its V2 runner (GPU) only: the CPU
    build's refusal, which comes after its config validation accepted the export, is the message and the exit
    is 2, never a silent fallback to another family. The refusal reads the export's layout, not its weights:
    the family's drafter as it starts, exported as a trained one is."""
    result, refusal = v2_runner_refusals[family], V2_RUNNER_FAMILIES[family][1]
    assert result.returncode == 2, result.stderr[-3000:]
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and "the vLLM server exited at start" in err[0], err[-5:]
    assert refusal in err[0] and "V1" in err[0], err[0]
