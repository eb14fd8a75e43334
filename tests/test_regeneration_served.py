"""Regeneration through a serving engine (regeneration/served.py, `regenerate --engine vllm`): the rows and
their format, the prompts and settings the server receives (a row's own chat template arguments included),
the resume after a kill, a server's refusals and failures, and (where vLLM's own environment is installed:
DFLASH_DDP_VLLM_PYTHON) greedy regeneration through vLLM equal to the transformers path's."""

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from regenerated_rows import assert_fields_kept, with_fields

from dflash_ddp.data.chat_template import load_target_tokenizer
from dflash_ddp.regeneration import regenerate as rg
from dflash_ddp.target_model.loading import eos_token_ids

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "dflash_ddp" / "assets"
VLLM_PYTHON = os.environ.get("DFLASH_DDP_VLLM_PYTHON")


class FakeServer(BaseHTTPRequestHandler):
    """An OpenAI-compatible server: answers a prompt with its last ids reversed, then the first stop id (cut
    at max_tokens, finish_reason "length"); waits `delay` s per completion; answers HTTP `fail` when set;
    records every completion request."""

    delay, fail, max_model_len = 0.0, 0, 4096
    requests: list[dict] = []

    def _send(self, code: int, body: dict) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def do_GET(self):  # noqa: N802 - http.server's name
        self._send(200, {"data": [{"id": "fake", "max_model_len": type(self).max_model_len}]})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = type(self)
        server.requests.append(body)
        time.sleep(server.delay)
        if server.fail:
            self._send(server.fail, {"error": {"message": "engine core died"}})
            return
        ids = [*body["prompt"][-5:][::-1], body["stop_token_ids"][0]]
        cut = ids[: body["max_tokens"]]
        self._send(
            200,
            {
                "choices": [{"token_ids": cut, "finish_reason": "length" if len(cut) < len(ids) else "stop"}],
                "usage": {"completion_tokens": len(cut)},
            },
        )

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    FakeServer.delay, FakeServer.fail, FakeServer.max_model_len, FakeServer.requests = 0.0, 0, 4096, []
    ThreadingHTTPServer.request_queue_size = 256  # many requests in flight: none refused at connect
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def argv(target, data, out, url, **settings) -> list[str]:
    merged = {"target_model": target, "data": data, "out": out, "max_new_tokens": 16, "engine": "vllm"}
    flags = ["--engine_url", url]
    for key, value in {**merged, **settings}.items():
        flags += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return flags


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_come_back_in_order_with_the_servers_answers(tiny_target, chat_data, tmp_path, fake_server):
    out = tmp_path / "out.jsonl"
    assert rg.main(argv(tiny_target, chat_data, out, fake_server, requests_in_flight=4)) == 0
    rows, inputs = read_rows(out), read_rows(chat_data)
    assert len(rows) == len(inputs) == 48
    tokenizer = load_target_tokenizer(tiny_target)
    for row, given in zip(rows, inputs, strict=True):
        assert row["messages"][:-1] == given["messages"][:-1]  # the prompt turns kept, in input order
    # each request: the prompt as the chat template renders it, every sampling setting explicit
    request = FakeServer.requests[0]
    assert request["temperature"] == 0 and request["top_k"] == 0 and request["repetition_penalty"] == 1.0
    assert (
        request["stop_token_ids"] == eos_token_ids(tokenizer, Path(tiny_target))
        and request["return_token_ids"]
    )
    prompt = tokenizer.decode(request["prompt"])
    assert prompt.endswith("<|im_start|>assistant\n")
    answer = tokenizer.decode(request["prompt"][-5:][::-1], skip_special_tokens=True).strip()
    assert {"role": "assistant", "content": answer} in [r["messages"][-1] for r in rows]
    settings = json.loads((tmp_path / "out.jsonl.settings.json").read_text())
    assert settings["engine"] == "server" and settings["served_model"] == "fake"


def test_a_rows_own_template_arguments_render_its_prompt_and_stay_with_it(tiny_target, tmp_path, fake_server):
    template = tmp_path / "template.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:"
        "{% if enable_thinking is defined and not enable_thinking %} (no thinking){% endif %}{% endif %}"
    )
    data = tmp_path / "rows.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "think"}]},
        {
            "messages": [{"role": "user", "content": "quick"}],
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    assert (
        rg.main(argv(tiny_target, data, out, fake_server, chat_template=template, keep_truncated=True)) == 0
    )
    tokenizer = load_target_tokenizer(tiny_target)
    prompts = sorted(tokenizer.decode(r["prompt"]) for r in FakeServer.requests)
    assert prompts == ["user: quick\nassistant: (no thinking)", "user: think\nassistant:"]
    written = read_rows(out)
    assert "chat_template_kwargs" not in written[0]
    assert written[1]["chat_template_kwargs"] == {"enable_thinking": False}


def test_seeds_depend_on_the_row_not_on_the_requests_in_flight(tiny_target, chat_data, tmp_path, fake_server):
    seeds = []
    for in_flight in (1, 8):
        FakeServer.requests = []
        out = tmp_path / f"out{in_flight}.jsonl"
        assert (
            rg.main(
                argv(tiny_target, chat_data, out, fake_server, temperature=1.0, requests_in_flight=in_flight)
            )
            == 0
        )
        seeds.append({tuple(r["prompt"]): r["seed"] for r in FakeServer.requests})
    assert seeds[0] == seeds[1] and len(set(seeds[0].values())) == len(seeds[0])


@pytest.mark.processes
def test_a_kill_and_a_restart_give_every_row_once(tiny_target, chat_data, tmp_path, fake_server):
    reference = tmp_path / "reference.jsonl"
    assert rg.main(argv(tiny_target, chat_data, reference, fake_server)) == 0

    FakeServer.delay = 0.2
    out, parts = tmp_path / "out.jsonl", tmp_path / "out.jsonl.parts"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "dflash_ddp.regenerate", *argv(tiny_target, chat_data, out, fake_server)]
    job = subprocess.Popen([*command, "--requests_in_flight", "2"], env=env, stderr=subprocess.PIPE)
    part = parts / "rank0-of-1.jsonl"
    deadline = time.time() + 120
    while not (part.exists() and part.read_bytes().count(b"\n") >= 4):
        assert job.poll() is None, job.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "no rows written in time"
        time.sleep(0.02)
    job.kill()
    job.wait()
    job.stderr.close()
    done = [json.loads(line)["row"] for line in part.read_bytes().split(b"\n")[:-1]]
    assert 4 <= len(done) < 48 and not out.exists()

    FakeServer.delay, FakeServer.requests = 0.0, []
    assert rg.main(argv(tiny_target, chat_data, out, fake_server, requests_in_flight=8)) == 0
    assert len(FakeServer.requests) == 48 - len(done)  # the finished rows are not asked again
    assert out.read_text() == reference.read_text()
    assert not parts.exists()


def test_every_field_of_a_row_survives_the_engine_path_its_resume_and_the_merge(
    tiny_target, chat_data, tmp_path, fake_server, monkeypatch
):
    """Rows with an id, a source and nested metadata (some in ShareGPT format) come back whole through the
    engine, only their answers replaced; a run stopped after its first rows (a failing disk) and continued
    writes the same bytes."""
    given = with_fields(read_rows(chat_data)[:12])
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in given))
    reference = tmp_path / "reference.jsonl"
    assert rg.main(argv(tiny_target, data, reference, fake_server)) == 0
    assert_fields_kept(read_rows(reference), given)

    out, part = tmp_path / "out.jsonl", tmp_path / "out.jsonl.parts" / "rank0-of-1.jsonl"
    write = rg.PartWriter.write

    def write_then_fail(self, records):
        write(self, records)
        raise OSError("No space left on device")

    monkeypatch.setattr(rg.PartWriter, "write", write_then_fail)
    assert rg.main(argv(tiny_target, data, out, fake_server, requests_in_flight=1)) == 1
    assert 0 < part.read_bytes().count(b"\n") < 12 and not out.exists()
    monkeypatch.setattr(rg.PartWriter, "write", write)
    assert rg.main(argv(tiny_target, data, out, fake_server, requests_in_flight=4)) == 0
    assert out.read_text() == reference.read_text()


def test_a_prompt_longer_than_the_servers_context_is_a_bad_row(
    tiny_target, chat_data, tmp_path, fake_server, capsys
):
    FakeServer.max_model_len = (
        60  # the tiny data's prompts are 20-50 tokens: with 16 new tokens, some do not fit
    )
    out = tmp_path / "out.jsonl"
    assert rg.main(argv(tiny_target, chat_data, out, fake_server)) == 2
    assert "do not fit the server's context of 60 tokens" in capsys.readouterr().err
    assert rg.main(argv(tiny_target, chat_data, out, fake_server, skip_bad_rows=True)) == 0
    assert "bad rows" in capsys.readouterr().out and 0 < len(read_rows(out)) < 48


def test_a_failing_server_stops_the_run_with_one_line_and_keeps_the_rows(
    tiny_target, chat_data, tmp_path, fake_server, capsys
):
    FakeServer.fail = 500
    out = tmp_path / "out.jsonl"
    assert rg.main(argv(tiny_target, chat_data, out, fake_server, requests_in_flight=2)) == 1
    err = capsys.readouterr().err
    assert f"the server at {fake_server} failed (HTTP 500)" in err and "engine core died" in err
    FakeServer.fail = 0
    assert rg.main(argv(tiny_target, chat_data, out, fake_server)) == 0 and len(read_rows(out)) == 48


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--engine", "vllm"], "--engine vllm needs one of --vllm_python"),
        (["--engine_url", "http://127.0.0.1:9"], "need --engine vllm"),
        (["--engine", "vllm", "--engine_url", "http://127.0.0.1:9"], "does not answer /v1/models"),
    ],
)
def test_engine_flags_are_checked(tiny_target, chat_data, tmp_path, capsys, flags, message):
    base = ["--target_model", str(tiny_target), "--data", str(chat_data), "--out", str(tmp_path / "o.jsonl")]
    assert rg.main([*base, *flags]) in (1, 2)
    assert message in capsys.readouterr().err


@pytest.mark.processes
@pytest.mark.skipif(not VLLM_PYTHON, reason="vLLM's own environment: set DFLASH_DDP_VLLM_PYTHON (README)")
def test_greedy_regeneration_through_vllm_equals_the_transformers_path(tmp_path):
    """The embedded target (vLLM's CPU attention needs head sizes of 64 and more), 12 held-out rows, each
    with an id, a source and nested metadata (some in ShareGPT format), which come back whole."""
    data = tmp_path / "rows.jsonl"
    given = with_fields(read_rows(ASSETS / "data" / "heldout_regenerated.jsonl")[:12])
    data.write_text("".join(json.dumps(row) + "\n" for row in given))
    common = ["--target_model", str(ASSETS / "tiny_qwen3"), "--data", str(data), "--max_new_tokens", "48"]
    common += ["--keep_truncated"]
    assert (
        rg.main([*common, "--out", str(tmp_path / "hf.jsonl"), "--batch_size", "4", "--device", "cpu"]) == 0
    )
    served = ["--engine", "vllm", "--vllm_python", VLLM_PYTHON, "--out", str(tmp_path / "vllm.jsonl")]
    assert rg.main([*common, *served]) == 0
    ours, theirs = read_rows(tmp_path / "hf.jsonl"), read_rows(tmp_path / "vllm.jsonl")
    assert len(ours) == 12
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    assert not differ, f"rows {differ} differ"
    assert_fields_kept(theirs, given, answers_changed=False)  # the rows hold this target's own answers
