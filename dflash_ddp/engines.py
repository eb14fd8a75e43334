"""Serving engines as users deploy them: vLLM's OpenAI-compatible server, run from its own Python environment
(vLLM pins a transformers older than this project's), or any OpenAI-compatible server already running.

`EngineServer` starts one vLLM server (with or without a drafter), waits for its health check and stops its
whole process group on exit or error; a server that dies or never comes up is one line with the tail of its
log. `EngineClient` completes token-id prompts through `/v1/completions` and reads vLLM's speculative-decoding
counters from `/metrics`. Only the standard library talks HTTP: no dependency is added.
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
        extra_args: tuple[str, ...] = (),
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
        # the target's generation_config.json must not fill the sampling settings a request leaves out
        command += ["--enforce-eager", "--dtype", dtype, "--generation-config", "vllm"]
        if max_model_len:  # else the target's own max_position_embeddings
            command += ["--max-model-len", str(max_model_len)]
        if speculative is not None:
            command += ["--speculative-config", json.dumps(speculative)]
        command += list(extra_args)  # the user's own server flags (tensor or data parallel sizes...)
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


@dataclass(frozen=True)
class SamplingRequest:
    """A request's sampling settings, every one sent explicitly: a server fills what a request leaves out
    from its own defaults (vLLM: the target's generation_config), which would change the output unseen."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # the target's EOS ids: the end of a turn, as in this project

    def body(self) -> dict:
        """The OpenAI-compatible fields (plus vLLM's and SGLang's top_k, stop_token_ids, return_token_ids)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "return_token_ids": True,
        }


@dataclass
class Completion:
    """One completion: its token ids where the server returns them (vLLM), its text, and why it stopped."""

    token_ids: list[int] | None
    text: str
    hit_max_tokens: bool  # finish_reason "length": stopped by max_tokens before any stop token
    completion_tokens: int


class EngineRequestError(ValueError):
    """The server refused one request (HTTP 4xx: a prompt longer than its context, a bad setting)."""


class EngineClient:
    """Completions of token-id prompts, and vLLM's counters, from the server at `url`."""

    def __init__(self, url: str, timeout_s: float = 600):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        card = self._get_json("/v1/models")["data"][0]
        self.model = card["id"]
        self.max_model_len: int | None = card.get("max_model_len")  # vLLM's context limit; others: None

    def _get_json(self, path: str) -> dict:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as response:
                return json.load(response)
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise OSError(f"the server at {self.url} does not answer {path} ({e})") from None

    def complete(self, prompt: list[int], max_tokens: int, sampling: SamplingRequest) -> Completion:
        """One completion of `prompt` (token ids). EngineRequestError with the server's message when it
        refuses the request; OSError naming the server when it cannot be reached or fails."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, **sampling.body()}
        request = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as e:
            message = e.read().decode(errors="replace")[-500:]
            if 400 <= e.code < 500:
                raise EngineRequestError(f"the server at {self.url} refused the request: {message}") from None
            raise OSError(f"the server at {self.url} failed (HTTP {e.code}): {message}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise OSError(f"the server at {self.url} cannot be reached ({e})") from None
        choice = answer["choices"][0]
        ids = choice.get("token_ids")
        used = (answer.get("usage") or {}).get("completion_tokens")
        return Completion(
            list(ids) if ids is not None else None,
            choice.get("text", ""),
            choice.get("finish_reason") == "length",
            used if used is not None else len(ids or []),
        )

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
