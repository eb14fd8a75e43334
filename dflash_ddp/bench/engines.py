"""(k) A serving engine beside this project's own paths, side by side in one run (vLLM from its own Python):

- `--only engine_tau --drafter EXPORT --vllm_python PATH`: the drafter's tau at temperatures 0, 0.6 and 1.0
  in this project's decoder (speculative sampling) and in vLLM, with vLLM's drafts the argmax (its default)
  and sampled from the drafter (`draft_sample_method: probabilistic`, as this project's decoder does);
- `--only regeneration --vllm_python PATH`: rows/s of `regenerate` through transformers' generate and through
  a vLLM server on the same rows, greedy, and whether the two wrote the same rows.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from pathlib import Path

import torch

from dflash_ddp.config import EMBEDDED_PRESET
from dflash_ddp.data.chat_template import load_target_tokenizer
from dflash_ddp.engines import EngineClient, EngineServer, SamplingRequest
from dflash_ddp.evaluation.engine import engine_evaluation
from dflash_ddp.evaluation.evaluate import load_prompts, prepare_evaluation, run_evaluation
from dflash_ddp.evaluation.sampling import Sampling
from dflash_ddp.regeneration.regenerate import RegenerateConfig, regenerate
from dflash_ddp.target_model.loading import eos_token_ids

TEMPERATURES = (0.0, 0.6, 1.0)
HELDOUT = Path(EMBEDDED_PRESET["eval_data"])


def bench_engine_tau(drafter: str, vllm_python: str, num_prompts: int, max_new_tokens: int) -> None:
    """Tau by temperature of the export `drafter` on the embedded target, in both engines."""
    target = Path(EMBEDDED_PRESET["target_model"])
    print(f"\n(k) tau by temperature: {drafter}, {num_prompts} held-out prompts x {max_new_tokens} tokens")
    setup = prepare_evaluation(target, drafter, HELDOUT, num_prompts, "cpu")
    ours = {}
    for t in TEMPERATURES:
        report = run_evaluation(setup, max_new_tokens, sampling=Sampling(t, 1.0, 0) if t else None)
        ours[t] = report["dflash"]["tau"]
    tokenizer = load_target_tokenizer(target)
    prompts = load_prompts(tokenizer, HELDOUT, num_prompts)
    eos = tuple(eos_token_ids(tokenizer, target))
    speculative = {"method": "dflash", "model": str(Path(drafter).resolve())}
    speculative["num_speculative_tokens"] = setup.drafter.config.block_size - 1  # the drafter loaded once
    theirs: dict[str, dict[float, float]] = {}
    for method in ("greedy", "probabilistic"):
        spec = {**speculative, "draft_sample_method": method}
        with EngineServer(vllm_python, str(target), spec, "float32") as server:
            client = EngineClient(server.url)
            theirs[method] = {}
            for t in TEMPERATURES:
                sampling = SamplingRequest(t, 1.0, seed=0, stop_token_ids=eos)
                report = engine_evaluation(client, None, prompts, max_new_tokens, None, sampling)
                theirs[method][t] = report["tau"]
                print(
                    f"  vLLM, {method} drafts, T={t}: tau {report['tau']:.3f} ({report['drafts']:.0f} drafts)"
                )
    print("| temperature | this project | vLLM, argmax drafts (its default) | vLLM, drafts sampled |")
    print("| --- | --- | --- | --- |")
    for t in TEMPERATURES:
        print(f"| {t} | {ours[t]:.3f} | {theirs['greedy'][t]:.3f} | {theirs['probabilistic'][t]:.3f} |")


def bench_regeneration(vllm_python: str, num_rows: int, max_new_tokens: int) -> None:
    """Rows/s of greedy regeneration of the first `num_rows` training rows, transformers vs vLLM."""
    target = EMBEDDED_PRESET["target_model"]
    print(
        f"\n(k) regeneration: {num_rows} rows of the embedded data, max_new_tokens {max_new_tokens}, greedy"
    )
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "rows.jsonl"
        lines = Path(EMBEDDED_PRESET["data"][0]).read_text().splitlines(keepends=True)
        data.write_text("".join(lines[:num_rows]))
        common = {"target_model": target, "data": [str(data)], "max_new_tokens": max_new_tokens}
        common["keep_truncated"] = True
        rates = {}
        out_hf = Path(tmp) / "transformers.jsonl"
        start = time.perf_counter()
        regenerate(RegenerateConfig(out=str(out_hf), batch_size=16, device="cpu", **common))
        rates["transformers"] = num_rows / (time.perf_counter() - start)
        out_vllm = Path(tmp) / "vllm.jsonl"
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(EngineServer(vllm_python, target, None, "float32"))
            start = time.perf_counter()  # the server's start-up (30-50 s here) is not counted
            config = RegenerateConfig(out=str(out_vllm), engine="vllm", engine_url=[server.url], **common)
            regenerate(config)
            rates["vllm"] = num_rows / (time.perf_counter() - start)
        same = sum(
            json.loads(a) == json.loads(b)
            for a, b in zip(out_hf.read_text().splitlines(), out_vllm.read_text().splitlines(), strict=True)
        )
    print(f"| path | rows/s | vs transformers | torch threads {torch.get_num_threads()} |")
    print("| --- | --- | --- | --- |")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.2f} | {rate / rates['transformers']:.2f}x | |")
    print(f"rows written alike by both paths: {same}/{num_rows}")
