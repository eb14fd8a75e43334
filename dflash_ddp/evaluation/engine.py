"""A serving engine in the loop, as users deploy it: vLLM's OpenAI-compatible server, run from its own Python
environment (vLLM pins a transformers older than this project's), or servers already running.

`EngineServer` starts one server (with or without the drafter), waits for its health check and stops its
whole process group on exit or error; a server that dies or never comes up is one line with the tail of its
log. `EngineClient` decodes token ids through `/v1/completions` and reads the speculative-decoding counters
of `/metrics`. `engine_evaluation` decodes the prompts with and without the drafter and reports tau and
acceptance by position from vLLM's own counters, and the lossless check against the engine's own output.
Only the standard library talks HTTP: no dependency is added.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

STARTUP_TIMEOUT_S = 600  # a cold vLLM start on 2 CPU cores took 30-50 s; a large target on a GPU, minutes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineServer:
    """`python -m vllm.entrypoints.openai.api_server` for `target` (with `speculative`, the drafter's
    speculative config), started from the interpreter `python` on a free local port."""

    def __init__(  # noqa: PLR0913 - the server's settings, each named
        self,
        python: str,
        target: str,
        speculative: dict | None = None,
        dtype: str = "auto",
        max_model_len: int = 0,
    ):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        command = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            target,
            "--port",
            str(self.port),
        ]
        command += ["--enforce-eager", "--dtype", dtype]
        if max_model_len:  # else the target's own max_position_embeddings
            command += ["--max-model-len", str(max_model_len)]
        if speculative is not None:
            command += ["--speculative-config", json.dumps(speculative)]
        self.command = command
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> EngineServer:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ValueError(f"the vLLM server exited at start ({self.reason()})")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise ValueError(f"the vLLM server did not come up in {STARTUP_TIMEOUT_S} s ({self.reason()})")

    def reason(self) -> str:
        """vLLM's own words for a failure: its last error line, else the last line of its log, and where."""
        lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if re.search(r"Value error|does not support|not supported", line)]
        errors = errors or [line for line in lines if "Error:" in line]
        last = (errors or lines or ["no output"])[-1]
        return f"{last[-300:]}; log: {self.log}"

    def stop(self) -> None:
        """SIGTERM to the server's process group (its engine runs in child processes), SIGKILL after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (cumulative since the server started)."""

    drafts: float
    accepted: float
    accepted_per_position: list[float]

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        per = [a - b for a, b in zip(self.accepted_per_position, other.accepted_per_position, strict=True)]
        return SpecCounters(self.drafts - other.drafts, self.accepted - other.accepted, per)


class EngineClient:
    """Greedy or sampled completions of token ids, and the counters, from a server at `url`."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=30) as response:
            self.model = json.load(response)["data"][0]["id"]

    def complete(
        self, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> list[int]:
        """The generated token ids (the engine stops at the model's EOS, as greedy decoding here does)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
        body |= {"seed": seed, "return_token_ids": True}
        request = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return list(json.load(response)["choices"][0]["token_ids"])

    def counters(self) -> SpecCounters:
        """The speculative-decoding counters of `/metrics` (zeros from a server without a drafter)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()

        def total(name: str) -> float:
            found = re.search(rf"^vllm:{name}_total{{[^}}]*}} (\S+)$", text, re.M)
            return float(found.group(1)) if found else 0.0

        per = re.findall(
            r'^vllm:spec_decode_num_accepted_tokens_per_pos_total{[^}]*position="(\d+)"[^}]*} (\S+)$',
            text,
            re.M,
        )
        by_position = [float(v) for _, v in sorted(per, key=lambda item: int(item[0]))]
        return SpecCounters(
            total("spec_decode_num_drafts"), total("spec_decode_num_accepted_tokens"), by_position
        )


def _decode(client: EngineClient, prompts, max_new_tokens: int, temperature: float, seed: int):
    start = time.perf_counter()
    outputs = [
        client.complete(ids, max_new_tokens, temperature, seed + i) for i, (_, ids) in enumerate(prompts)
    ]
    return outputs, time.perf_counter() - start


def engine_evaluation(  # noqa: PLR0913 - the evaluation's inputs, each named
    drafter_client: EngineClient,
    plain_client: EngineClient | None,
    prompts: list[tuple[str, list[int]]],
    max_new_tokens: int,
    reference: list[list[int]] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict:
    """Decode `prompts` on the server with the drafter and on the one without it (or compare with
    `reference`, the project's own greedy outputs, when there is none); tau and acceptance by position from
    the drafter server's counters (tau = 1 + accepted / drafts: each verify step commits the accepted drafts
    and one token of the target's)."""
    before = drafter_client.counters()
    drafted, seconds = _decode(drafter_client, prompts, max_new_tokens, temperature, seed)
    counted = drafter_client.counters() - before
    if plain_client is not None:
        reference, plain_seconds = _decode(plain_client, prompts, max_new_tokens, temperature, seed)
    else:
        plain_seconds = None
    tokens = sum(len(o) for o in drafted)
    mismatched = [
        where for (where, _), a, b in zip(prompts, drafted, reference or [], strict=False) if a != b
    ]
    report = {
        "engine": "vllm",
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "drafts": counted.drafts,
        "tau": 1 + counted.accepted / counted.drafts if counted.drafts else None,
        "acceptance_by_position": [a / counted.drafts for a in counted.accepted_per_position]
        if counted.drafts
        else [],
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_without_drafter": (
            sum(len(o) for o in reference) / plain_seconds if plain_seconds else None
        ),
        "mismatched": mismatched,
    }
    # at a temperature the two servers draw differently: a sample, not a token-for-token check
    report["lossless"] = None if temperature > 0 or reference is None else not mismatched
    return report
