"""Targets as they ship: every architecture of the zoo (target_zoo.py: tiny random models built from
transformers' own config classes, saved by `save_pretrained`, vision-language wrappers included) trains
through the CLI, exports and decodes losslessly; the text model of a wrapper is all a target rank loads;
the drafter computes with Gemma's conventions; hybrid caches roll back; a hybrid vision-language target
trains as a tensor-parallel group; a target that cannot be served is refused in one line."""

import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from rich.console import Console
from safetensors.torch import load_file, save_file
from target_zoo import (
    DBRX_ROPE_THETA,
    EXPERT_WIDTH,
    TOP_K,
    ZOO_NAMES,
    build_model,
    build_zoo_target,
    defined_fields,
    make_config,
    zoo_config,
)
from transformers import BertConfig, BertModel, DeepseekV4ForCausalLM, DynamicCache
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

from dflash_ddp.drafter.config import drafter_config_for, resolve_target_layer_ids
from dflash_ddp.drafter.objective import chunked_weighted_ce, head_logits
from dflash_ddp.drafter.weighting import LossSettings
from dflash_ddp.evaluate import main as evaluate_main
from dflash_ddp.evaluation.decoding import (
    crop_rolls_back,
    greedy_generate,
    new_target_cache,
    speculative_generate,
    untrained_drafter,
)
from dflash_ddp.evaluation.evaluate import evaluate
from dflash_ddp.evaluation.report import print_report
from dflash_ddp.export import main as export_main
from dflash_ddp.hub import LAYER_OF_WEIGHT
from dflash_ddp.parallel.machine import MemoryPlan
from dflash_ddp.setup import run as setup_run
from dflash_ddp.setup.run import target_weights
from dflash_ddp.target_model import kernels, quantization
from dflash_ddp.target_model.features import TargetFeatureExtractor, decoder_layers, stream_readout
from dflash_ddp.target_model.forward_code import causal_lm_class
from dflash_ddp.target_model.head import SharedTargetHead
from dflash_ddp.target_model.info import inspect_target, target_info_from_config, truncated_parameter_count
from dflash_ddp.target_model.loading import load_causal_lm, load_text_model
from dflash_ddp.target_model.memory import TargetLoad, target_memory
from dflash_ddp.target_model.quantization import WeightStorage, truncated_weight_bytes, weight_storage
from dflash_ddp.target_model.tensor_parallel import check_tensor_parallel
from dflash_ddp.target_model.text_stack import (
    generating_part,
    text_model_of,
    truncated_text_config,
)
from dflash_ddp.train import main as train_main

from conftest import build_tokenizer
from helpers import one_thread, target_forward_peaks, torchrun_cmd, train_flags

CPU = torch.device("cpu")
HYBRIDS = ("qwen3_5", "qwen3_next", "falcon_h1", "nemotron_h", "kimi_linear")  # recurrent layers


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """name -> a directory holding that zoo target and the ChatML tokenizer (built once per module)."""
    root = tmp_path_factory.mktemp("zoo")

    def target(name: str) -> Path:
        out = root / name
        if not (out / "config.json").is_file():
            tok = build_tokenizer(out)
            build_zoo_target(name, out, len(tok), unwritten=(tok.eos_token_id,))
        return out

    return target


def train(target: Path, data: Path, out: Path, **settings) -> None:
    """Two colocated steps of the CLI (`python -m dflash_ddp.train`'s main, in this process with one thread
    as torchrun's workers have), taps 1 and 2: every zoo target has 4 layers."""
    with one_thread():
        assert (
            train_main(train_flags(target, data, out, max_steps=2, target_layer_ids="1,2", **settings)) == 0
        )


def train_export_decode(target: Path, data: Path, out: Path) -> dict:
    """`train`, then the export CLI and the evaluation CLI on one prompt of 8 tokens: its JSON report."""
    train(target, data, out / "run")
    assert export_main([str(out / "run"), str(out / "export"), "--dtype", "float32"]) == 0
    flags = ["--num_prompts", "1", "--max_new_tokens", "8", "--json", str(out / "eval.json")]
    args = ["--target_model", str(target), "--drafter", str(out / "export"), "--data", str(data)]
    assert evaluate_main(args + flags) == 0
    return json.loads((out / "eval.json").read_text())


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_every_zoo_target_trains_exports_and_decodes_losslessly(name, zoo, chat_data, tmp_path):
    target = zoo(name)
    report = train_export_decode(target, chat_data, tmp_path)
    assert report["lossless"] and report["dflash"]["mismatches"] == 0 and report["dflash"]["tokens"] == 8
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    info = inspect_target(target)
    assert exported["vocab_size"] == info.vocab_size and exported["hidden_size"] == info.hidden_size
    assert exported["rope_parameters"] == info.rope_parameters  # the full-attention layers' rope
    # the target's conventions, where vLLM's models read them (Gemma 4: a cap of 30; Gemma: x8; Falcon-H1)
    assert exported.get("final_logit_softcapping") == info.final_logit_softcapping
    assert exported["dflash_config"].get("input_embedding_scale", 1.0) == info.embedding_scale
    assert exported.get("logit_scale", 1.0) == info.logit_scale
    assert exported["dflash_ddp"]["target_model_type"] == info.model_type
    card = (tmp_path / "export" / "README.md").read_text()
    assert f"model type `{info.model_type}`" in card


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_a_rows_features_do_not_depend_on_its_batch_or_the_prefills_pieces(name, zoo):
    """The extractor gives a causal model no padding mask (rows are right-padded, and nothing causal reaches
    a row's padding from its real positions): in a padded batch, in one pass and in pieces of 5 positions a
    row (10 over the batch's two: pieces start inside every zoo target's windows and chunks of 8), a row's
    features equal the row's alone. Taps 1 and 3 run every layer kind; taps 1 and 2 cut the hybrids to
    their linear-attention layers, whose prefill in pieces once stopped in transformers' mask builder (a
    cache without an attention layer)."""
    info = inspect_target(zoo(name))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0  # the second row ends inside the third piece
    pieces = () if info.own_cache else ((10, 1e-4),)  # MiniMax's own cache: refused pieces at start
    for taps in ([1, 2], [1, 3]):  # the last layer through the final norm, whatever the family calls it
        alone = TargetFeatureExtractor(info, taps, CPU, torch.float32)
        rows = [alone(ids[i : i + 1, :n], mask[i : i + 1, :n])[0][0] for i, n in enumerate((24, 13))]
        for prefill, tolerance in ((0, 1e-5), *pieces):  # pieces: sums over fewer positions round apart
            extractor = TargetFeatureExtractor(info, taps, CPU, torch.float32, prefill_tokens=prefill)
            features, _ = extractor(ids, mask)
            close = dict(rtol=tolerance, atol=tolerance, msg=f"taps {taps}, prefill {prefill}")
            torch.testing.assert_close(features[0], rows[0], **close)
            torch.testing.assert_close(features[1, :13], rows[1], **close)
            assert not features[1, 13:].any()  # padding zeroed


def features_at_taps_1_2(info) -> tuple[torch.Tensor, torch.Tensor]:
    """12 seeded token ids and the features a target rank computes of them at taps 1 and 2 (CPU, fp32)."""
    ids = torch.randint(4, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    return ids, TargetFeatureExtractor(info, [1, 2], CPU, torch.float32)(ids, torch.ones_like(ids))[0]


def peak_load(taps: list[int], piece: int = 0, rows: int = 2, length: int = 2048) -> TargetLoad:
    """What the target's plan reads for a CPU forward of `rows` rows of `length` positions in fp32 up to
    `taps`, in one pass or prefilled `piece` positions at a time."""
    return TargetLoad(
        weight_bytes=0,  # the weights are resident before the measurement starts
        target_layer_ids=taps,
        layers=max(taps) + 1,
        tokens_per_batch=rows * length,
        dtype_bytes=4,
        prefill_tokens=piece,
        max_seq_len=length,
        device_type="cpu",
    )


def planned_and_measured(
    *forwards: tuple[Path, list[int]] | tuple[Path, list[int], int], rows: int = 2, length: int = 2048
) -> list[tuple[MemoryPlan, int]]:
    """For each target and its taps (and the positions of its prefill's pieces, where a third item gives
    them), the plan for that forward of `rows` rows of `length` and its measured peak (bytes), all measured
    in one fresh process."""
    runs = [(t, taps, rest[0] if rest else 0) for t, taps, *rest in forwards]
    peaks = target_forward_peaks(runs, rows, length)
    return [
        (target_memory(inspect_target(t), peak_load(taps, piece, rows, length)), m)
        for (t, taps, piece), m in zip(runs, peaks, strict=True)
    ]


@pytest.mark.parametrize("name", ["falcon", "opt", "mpt", "nemotron_h", "falcon_h1", "dbrx"])
def test_a_tap_on_the_last_layer_reads_transformers_final_normed_output_whatever_the_norm_is_called(
    name, zoo
):
    """transformers' hidden_states[N] is the final-normed output, whose norm the families call `ln_f`
    (Falcon), `final_layer_norm` (OPT), `norm_f` (MPT, Nemotron-H, DBRX) or `final_layernorm` (Falcon-H1)."""
    target = zoo(name)
    info = inspect_target(target)
    ids = torch.randint(4, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    taps = [1, info.num_layers - 1]
    features, _ = TargetFeatureExtractor(info, taps, CPU, torch.float32)(ids, torch.ones_like(ids))
    whole = load_causal_lm(info, CPU, torch.float32)
    with torch.no_grad():
        hidden = whole(input_ids=ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i + 1] for i in taps], dim=-1)
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)


def test_dbrx_is_read_from_its_sub_configs_and_runs_with_its_checkpoints_rope_theta(zoo):
    """DBRX keeps its KV heads in `attn_config` and its experts in `ffn_config`, and its rope base in
    `attn_config`, which transformers 5 reads no more (the model would run with the 10000 default)."""
    info = inspect_target(zoo("dbrx"))
    assert (info.num_attention_heads, info.num_key_value_heads) == (4, 2)
    assert info.mlp_widths == (EXPERT_WIDTH * TOP_K,) * 4
    assert info.rope_parameters["rope_theta"] == DBRX_ROPE_THETA
    assert drafter_config_for(info, 1, [1, 2], 0, 4).rope_parameters["rope_theta"] == DBRX_ROPE_THETA
    rotary = load_causal_lm(info, CPU, torch.float32).transformer.rotary_emb
    head_dim = info.head_dim
    expected = 1.0 / DBRX_ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    torch.testing.assert_close(rotary.inv_freq, expected)


@pytest.mark.processes
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak reset")
def test_the_plan_counts_the_scores_of_a_target_transformers_runs_eagerly(zoo):
    """gpt-oss has no SDPA path in transformers: every layer materialises its [rows, heads, queries, keys]
    scores (and their fp32 softmax), the largest part of a long forward. The plan against a real one (1.24x
    when written; 1.34x in pieces of 1024, which bound the scores)."""
    target = zoo("gpt_oss")
    info = inspect_target(target)
    assert info.eager_attention and not inspect_target(zoo("qwen3")).eager_attention
    [(plan, measured)] = planned_and_measured((target, [1, 2]))
    assert 1.0 <= plan.total / measured <= 1.5, (plan.describe(), measured / 2**30)
    assert plan.parts["attention scores"] > plan.total / 2


@pytest.mark.processes
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak reset")
def test_a_windowed_layer_is_planned_with_its_window_of_keys(zoo, tmp_path):
    """A sliding-window or chunked layer's cache keeps only its window (transformers' sliding cache layers):
    prefilled in pieces, a query attends to that window and its piece (DeepSeek V4's also to the compressed
    keys), not to every key before it. The plan in pieces of 1024 against real forwards of one row of 4096
    (the row shape whose pieces attend to the most keys) of DeepSeek V4 (every layer windowed, scores
    materialised), Gemma 3 tapped within its sliding layers (its full mask, sized by a full layer past the
    cut, is skipped) and gpt-oss (sliding and full layers): 1.33x, 1.68x and 1.31x (2.47x, 3.26x and 1.32x
    while every key before a piece counted). A Mistral whose config sets a window but no layer types (v0.1) builds a windowed mask even in
    one pass: 1.32x with the mask's building (0.16x while read as full attention)."""
    model_class, config = zoo_config("mistral", 256)
    config.sliding_window = 8
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path)
    assert inspect_target(tmp_path).key_window == 8
    names, bounds = ("deepseek_v4", "gemma3_text", "gpt_oss", "mistral"), (1.6, 2.0, 1.5, 1.5)
    forwards = [(zoo(name), taps, 1024) for name, taps in zip(names[:3], ([1], [1, 2], [1]), strict=True)]
    measurements = planned_and_measured(*forwards, (tmp_path, [1, 2]), rows=1, length=4096)
    for name, bound, (plan, measured) in zip(names, bounds, measurements, strict=True):
        assert 1.0 <= plan.total / measured <= bound, (name, plan.describe(), measured / 2**30)


@pytest.mark.processes
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak reset")
def test_masks_a_forward_builds_beyond_what_its_layers_need_are_planned(tmp_path):
    """Ministral builds a full mask beside its sliding layers, Qwen2-MoE a sliding one with a window of 0
    beside its full layers (never skipped: a boolean queries x keys, and two more while it is built); Falcon
    builds its full mask even in one pass, where SDPA's causal flag would do, and with ALiBi adds that onto
    it, a mask per head. One row of 4096: Ministral (every layer sliding, a window of 2048) in pieces of 1024,
    1.22x; Qwen2-MoE in one pass, 1.04x (0.58x while the mask's building was not counted, 0.26x before the
    mask was); Falcon in one pass 1.09x, with ALiBi 1.04x (0.29x and 0.08x at 2048 before they counted)."""
    targets = []
    for name, model_class, family in (
        ("ministral", "MinistralForCausalLM", dict(sliding_window=2048, head_dim=16)),
        ("qwen2_moe", "Qwen2MoeForCausalLM", {}),
        ("falcon", "FalconForCausalLM", dict(ffn_hidden_size=128)),
        ("falcon_alibi", "FalconForCausalLM", dict(ffn_hidden_size=128, alibi=True)),
    ):
        config = make_config(model_class.replace("ForCausalLM", "Config"), **family)
        torch.manual_seed(0)
        getattr(transformers, model_class)(config).save_pretrained(tmp_path / name)
        targets.append(tmp_path / name)
    forwards = [(targets[0], [1, 2], 1024), *((t, [1, 2]) for t in targets[1:])]
    measurements = planned_and_measured(*forwards, rows=1, length=4096)
    for name, (plan, measured) in zip(
        ("ministral", "qwen2_moe", "falcon", "falcon_alibi"), measurements, strict=True
    ):
        assert 1.0 <= plan.total / measured <= 1.6, (name, plan.describe(), measured / 2**30)


@pytest.mark.processes
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak reset")
def test_the_plan_counts_the_widths_of_latent_attention(zoo, tmp_path):
    """Multi-head latent attention (DeepSeek V2/V3, Kimi, GLM-5) points `head_dim` at its RoPE part, while
    each layer expands the latent it caches into keys and values for every query head, wider than that. A
    DeepSeek V3 with values as wide as its keys (which torch's fused CPU kernel runs): the plan 1.35x its
    measured peak when written, 0.86x before it knew the latent's widths. The zoo's DeepSeek V3 (values
    narrower than its keys) runs SDPA's unfused path on the CPU, whose scores the plan counts there only
    (1.08x its measured peak when written; CUDA's memory-efficient kernel takes such values)."""
    model_class, config = zoo_config("deepseek_v3", 256)
    config.v_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path)
    [(plan, measured)] = planned_and_measured((tmp_path, [1, 2]))
    assert 1.0 <= plan.total / measured <= 1.5, (plan.describe(), measured / 2**30)
    assert "attention scores" not in plan.parts
    narrow, load = inspect_target(zoo("deepseek_v3")), peak_load([1, 2])
    assert "attention scores" in target_memory(narrow, load).parts
    assert "attention scores" not in target_memory(narrow, replace(load, device_type="cuda")).parts


@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "longcat_flash"])
def test_the_plan_counts_the_kv_cache_of_every_attention_layer_it_runs(name, zoo):
    """A prefill in pieces keeps the batch's keys and values until its last piece: the plan counts exactly
    the bytes of the cache transformers fills for the layers cut at the last tap (grouped heads; latent
    attention's latent and rope key; LongCat-Flash's two attention layers in every decoder layer, where a
    plan of one per layer said half)."""
    info = inspect_target(zoo(name))
    taps, rows, length = [1, 2], 2, 24
    model = load_text_model(info.path, info.text_stack(), max(taps) + 1, torch.float32)
    assert len(decoder_layers(model)) == max(taps) + 1
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(4, 200, (rows, length)), cache=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in {layer.keys, layer.values})
    assert target_memory(info, peak_load(taps, piece=8, rows=rows, length=length)).parts["KV cache"] == held


@pytest.mark.processes
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak reset")
def test_the_plan_counts_the_reference_code_of_a_hybrids_linear_layers(zoo):
    """Without the kernel packages (always on a CPU) transformers runs a hybrid's linear-attention and
    Mamba-2 layers with its reference code, whose fp32 intermediates per position are many times the
    layer's width (GLM-5's decay per channel: chunk x key width per head). The plan against a real forward
    of the gated delta rule (Qwen3.5), KDA (GLM-5) and Mamba-2 (Nemotron-H): 1.09x, 1.11x and 1.27x when
    written, where it said 0.49x, 0.11x and 0.33x before it counted them."""
    names = ("qwen3_5", "glm5_next", "nemotron_h")
    measurements = planned_and_measured(*((zoo(name), [1]) for name in names))
    for name, (plan, measured) in zip(names, measurements, strict=True):
        assert 1.0 <= plan.total / measured <= 1.4, (name, plan.describe(), measured / 2**30)


def build_deepseek_v32(out: Path) -> Path:
    """A DeepSeek V3.2 of the zoo's DeepSeek V3 shape, with 4 index heads of 64 before every layer."""
    _, config = zoo_config("deepseek_v3", 256)
    fields = {
        k: v for k, v in config.to_dict().items() if k in defined_fields(transformers.DeepseekV32Config)
    }
    fields.update(index_n_heads=4, index_head_dim=64, mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    torch.manual_seed(0)
    transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**fields)).save_pretrained(out)
    return out


@pytest.mark.processes
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak reset")
def test_the_plan_counts_the_scores_of_a_sparse_attention_indexer(zoo, tmp_path):
    """DeepSeek Sparse Attention's indexer (DeepSeek V3.2, GLM-5, Mistral Large 4, ...) scores every key for
    every query in fp32 before an indexed layer's attention, the keys first copied out for every query by
    torch's broadcasting matmul: 772 bytes per query-key pair at DeepSeek V3.2's widths. The plan against a
    real forward of a DeepSeek V3.2 with 4 index heads of 64 (1.01x when written, 0.16x before it counted
    them) and of the zoo's GLM-5 tapped to its indexed layer (scores per pool of 2 keys: 1.22x, 0.87x).
    DeepSeek V4's compressed layers (run eagerly) attend to their own keys and a compressed key per few
    after them: their scores are that much wider than the queries' keys (1.31x with its block bias
    counted, 0.84x before)."""
    info = inspect_target(zoo("deepseek_v4"))
    assert info.key_compression == {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}
    # its compressed layers' cache keeps one tensor as keys and values, its sliding layer's two
    assert info.shared_key_value == {"compressed_sparse_attention", "heavily_compressed_attention"}
    forwards = (build_deepseek_v32(tmp_path), [1]), (zoo("glm5_next"), [3]), (zoo("deepseek_v4"), [1])
    bounds, largest = (1.1, 1.3, 1.4), ("indexer scores", "indexer scores", "attention scores")
    for bound, part, (plan, measured) in zip(bounds, largest, planned_and_measured(*forwards), strict=True):
        assert 1.0 <= plan.total / measured <= bound, (plan.describe(), measured / 2**30)
        assert max(plan.parts, key=plan.parts.get) == part


def test_plan_names_the_prefill_pieces_with_which_a_long_context_fits(chat_data, tmp_path, capsys):
    """A long context whose indexer scores cannot fit in one pass: --plan says which
    --target_prefill_tokens makes it fit (pieces bound the queries scored at once), and that setting's
    plan fits."""
    target = build_deepseek_v32(tmp_path / "dsv32")
    build_tokenizer(target)
    flags = train_flags(target, chat_data, tmp_path / "run", max_seq_len=32768, tokens_per_batch=32768)
    flags += ["--plan", "--plan_gpu_memory", "24"]
    assert train_main(flags) == 0
    fits = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("fits:"))
    assert fits.strip().startswith("fits: NO:") and fits.endswith("; fits with --target_prefill_tokens 2048")
    assert train_main([*flags, "--target_prefill_tokens", "2048"]) == 0
    fits = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("fits:"))
    assert fits.strip().startswith("fits: yes:")


def test_a_gpu_run_names_the_kernel_packages_its_hybrid_target_lacks(zoo, monkeypatch):
    """On CUDA the reference code runs only where a kernel does not import: the plan counts its memory when
    the scan's kernel is missing (the convolution's alone costs little) and the run names the packages to
    install; with both importable neither. On a CPU it always runs, with nothing to install."""
    info = inspect_target(zoo("qwen3_5"))
    load = TargetLoad(weight_bytes=0, target_layer_ids=[1], layers=2, tokens_per_batch=4096, dtype_bytes=2)
    importable: set[str] = set()
    monkeypatch.setattr(kernels, "kernel_imports", lambda module, function: module in importable)
    reference = "linear layers' reference code"
    note = kernels.kernels_note(info, 2, "cuda")
    assert "`pip install flash-linear-attention causal-conv1d`" in note and "the plan counts" in note
    assert reference in target_memory(info, load).parts
    importable.add("fla.ops.gated_delta_rule")
    note = kernels.kernels_note(info, 2, "cuda")
    assert "`pip install causal-conv1d`" in note and "the plan counts" not in note
    assert reference not in target_memory(info, load).parts
    importable.add("causal_conv1d")
    assert kernels.kernels_note(info, 2, "cuda") is None
    assert "with fused kernels" in kernels.linear_layers_summary(info, 2, "cuda")
    assert reference in target_memory(info, replace(load, device_type="cpu")).parts
    assert kernels.kernels_note(info, 2, "cpu") is None


def test_a_vision_language_target_loads_its_text_model_only_and_plans_what_it_loads(
    zoo, chat_data, tmp_path, capsys
):
    """The Qwen3.5 checkpoint as it ships: target ranks build and read its text model (no vision tower),
    --plan counts exactly what they load and names what it leaves out."""
    target = zoo("qwen3_5")
    info = inspect_target(target)
    assert info.architecture == "Qwen3_5ForConditionalGeneration" and info.other_parameters > 0
    extractor = TargetFeatureExtractor(info, [1, 2], CPU, torch.float32)
    loaded = sum(p.numel() for p in extractor.model.parameters())
    assert truncated_parameter_count(info, 3) == loaded
    assert not any("visual" in name for name, _ in extractor.model.named_parameters())
    assert train_main([*train_flags(target, chat_data, tmp_path), "--plan"]) == 0
    printed = capsys.readouterr().out
    assert f"{info.other_parameters / 1e6:.2f}M parameters beside it" in printed
    assert "never loaded and not counted" in printed and "3 linear_attention" in printed
    assert (
        "gated_delta layers with transformers' reference code (on the CPU), its memory counted below"
        in printed
    )


@pytest.mark.parametrize("name", ["gemma3", "gemma4_text"])
def test_the_drafter_embeds_and_scores_as_the_gemma_target_does(name, zoo):
    """The shared embedding equals the target's get_input_embeddings() output (sqrt(hidden) scaled), and the
    loss's logits equal the target's own soft-capped logits on the same final hidden state."""
    info = inspect_target(zoo(name))
    head = SharedTargetHead.from_target(info)
    target = load_causal_lm(info, CPU, torch.float32)
    ids = torch.randint(0, info.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    assert info.embedding_scale == 8.0
    torch.testing.assert_close(head.embed(ids), target.get_input_embeddings()(ids), rtol=0, atol=0)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    hidden = out.hidden_states[-1]  # final-normed
    ours = head_logits(hidden, head.lm_head_weight, head.logit_scale, head.logit_softcapping)
    torch.testing.assert_close(ours, out.logits, rtol=1e-5, atol=1e-5)
    if name == "gemma4_text":  # the zoo's Gemma 4 caps its logits at 30, as the released ones do
        assert head.logit_softcapping == 30.0 and ours.abs().max() < 30


def test_the_loss_differentiates_through_scale_and_soft_capping():
    """The chunked loss with a logit scale and soft-capping (Falcon-H1, Gemma) equals autograd's."""
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(10, 16, generator=g) * 4).requires_grad_()
    head = torch.randn(50, 16, generator=g)
    labels, weights = torch.randint(0, 50, (10,), generator=g), torch.rand(10, generator=g)
    settings = LossSettings(chunk_rows=3, logit_scale=0.25, logit_softcap=5.0)
    loss, _ = chunked_weighted_ce(hidden, head, labels, weights, settings)
    (grad,) = torch.autograd.grad(loss, hidden)
    reference = hidden.detach().clone().requires_grad_()
    logits = torch.tanh(reference @ head.T * 0.25 / 5.0) * 5.0
    expected = (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * weights).sum()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, reference.grad)


class OracleDrafter:
    """Drafts the target's own greedy continuation with one token wrong, at a position that cycles through
    the block: the decoder then accepts every length from 0 to block_size - 1 drafts in turn."""

    def __init__(self, greedy: list[int], prompt_len: int, block_size: int = 4):
        self.config = SimpleNamespace(block_size=block_size, mask_token_id=0, target_layer_ids=[1, 2])
        self.greedy, self.prompt_len, self.cycles = greedy, prompt_len, 0

    def __call__(self, noise_embeds, context_hidden_states, position_ids, cache):
        self.anchor_pos = int(position_ids[0, -1]) - self.config.block_size + 1
        return SimpleNamespace(last_hidden_state=noise_embeds)

    def bind_target(self, embedding):
        pass  # reads nothing of the target

    def confidences(self, hidden, previous):
        return None  # no confidence head

    def draft_tokens(self, hidden, head, anchor):
        first = self.anchor_pos - self.prompt_len + 1  # index in `greedy` of the first drafted token
        drafts = (self.greedy + [0] * 8)[first : first + self.config.block_size - 1]
        wrong = self.cycles % self.config.block_size  # block_size - 1: every draft is right
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % 50
        self.cycles += 1
        return torch.tensor([drafts])


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_hybrid_targets_recurrent_state_rolls_back_to_the_accepted_prefix(name, zoo):
    """Linear-attention and Mamba layers cannot crop their state like keys and values: after each partial
    acceptance the decoder continues from the last accepted token's state, so the output stays greedy."""
    target = load_causal_lm(inspect_target(zoo(name)), CPU, torch.float32)
    prompt = torch.randint(3, 200, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = greedy_generate(target, prompt, 24).tokens
    result = speculative_generate(target, OracleDrafter(greedy, len(prompt)), prompt, 24)
    assert result.tokens == greedy
    assert {1, 2, 3, 4} <= set(result.accepted[:-1])  # every acceptance length, each rolled back


@pytest.mark.processes
@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v4"])
def test_a_target_trains_as_a_tensor_parallel_group(name, zoo, chat_data, tmp_path):
    """Qwen3.5 as it ships (Gated DeltaNet + gated attention under a vision wrapper) and DeepSeek V4 (4
    hyper-connection streams, compressed attention, hash-routed experts): one group of 2 target ranks + 1
    drafter rank trains the colocated run's steps to the same losses."""
    target = zoo(name)
    train(target, chat_data, tmp_path / "colocated", seed=1)
    result = launch_tp2(target, chat_data, tmp_path / "tp2")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [
        [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("colocated", "tp2")
    ]
    assert len(losses[0]) == 2 and losses[1] == pytest.approx(losses[0], rel=1e-4)


@pytest.mark.processes
def test_a_tensor_parallel_plan_that_does_not_run_is_one_line_on_the_group(zoo, chat_data, tmp_path):
    """transformers 5.25's GLM-5 plan shards its linear-attention layers' output projection but not their
    inputs: the group's ranks say so in one line before training, without a traceback."""
    result = launch_tp2(zoo("glm5_next"), chat_data, tmp_path / "tp2")
    assert result.returncode != 0 and "[rank" not in result.stderr, result.stderr[-3000:]  # no traceback
    lines = [line for line in result.stderr.splitlines() if line.startswith("error (rank")]
    assert lines and all(  # torchrun may stop the other rank before it prints
        "transformers' tensor-parallel plan for model type 'glm5_next_text' does not run" in line
        and "pass --target_tp_size 1" in line
        for line in lines
    )


def launch_tp2(target: Path, data: Path, out: Path) -> subprocess.CompletedProcess:
    """The CLI under torchrun: 2 target ranks in one tensor-parallel group + 1 drafter rank, 2 steps."""
    flags = train_flags(target, data, out, max_steps=2, target_layer_ids="1,2", seed=1)
    return subprocess.run(
        torchrun_cmd(3) + ["-m", "dflash_ddp.train", *flags, "--target_tp_size", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_taps_skip_the_layers_a_vision_targets_forward_skips_on_text(zoo, chat_data, tmp_path, capsys):
    """Llama 3.2 Vision's cross-attention layers run only with an image: its default taps (40 layers: 1, 10,
    19, 28, 37) move off layer 28 to the layer before, whose output is the stream layer 28 passes on; a tap
    asked on such a layer is one line (a KeyError at the first batch before)."""
    info = target_info_from_config(transformers.MllamaTextConfig(), Path("llama-3.2-vision"))
    assert resolve_target_layer_ids(info, None) == [1, 10, 19, 27, 37]
    target = zoo("mllama")  # its layer 4 attends to images
    assert train_main(train_flags(target, chat_data, tmp_path / "run", target_layer_ids="2,4")) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "layers [4] of model type 'mllama_text_model' attend to an image and are skipped on text" in line


def _is_wrapper(name: str) -> bool:
    """Whether the zoo's `name` ships as more than the causal LM of its text config."""
    model_class, config = zoo_config(name, 300)
    return model_class is not causal_lm_class(config.get_text_config(decoder=True))


WRAPPERS = tuple(name for name in ZOO_NAMES if _is_wrapper(name))


@pytest.mark.parametrize(
    ("name", "released"), [(name, False) for name in WRAPPERS] + [("qwen3_vl_moe", True), ("kimi_k25", True)]
)
def test_a_wrappers_text_model_reads_its_weights_as_the_wrapper_does(name, released, tmp_path):
    """Target ranks load a wrapper's text model alone, with the wrapper's own weight transforms: transformers
    converts some checkpoints only as it loads the wrapper. Released Qwen3-VL-MoE checkpoints (`released`) keep
    their experts as [experts, hidden, 2 x width] (its load stopped on their shapes before); Ernie 4.5 VL's
    keep Baidu's layout, one expert list split into text and vision experts, as transformers saves it too (its
    load stopped on missing weights); BLIP-2's OPT owns its embedding one level below the model that
    loads (missing weights). Kimi K2.5's release names its architecture `KimiK25ForConditionalGeneration`,
    which transformers spells `Kimi_K25...` (refused as having no causal LM before). The features equal the
    hidden states of the wrapper's own text model."""
    model_class, config = zoo_config(name, 300)
    moe = getattr(config.get_text_config(decoder=True), "moe_intermediate_size", None)
    if moe is not None:  # experts of 2 x 24 rows, not the hidden width: a transposed load cannot pass
        config.get_text_config(decoder=True).moe_intermediate_size = [24, 16] if isinstance(moe, list) else 24
    torch.manual_seed(0)
    model = build_model(model_class, config).eval()
    model.save_pretrained(tmp_path)
    if released and name == "kimi_k25":
        config_file = tmp_path / "config.json"
        saved = json.loads(config_file.read_text())
        config_file.write_text(json.dumps(saved | {"architectures": ["KimiK25ForConditionalGeneration"]}))
    elif released:
        weights = load_file(tmp_path / "model.safetensors")
        weights = {
            k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in weights.items()
        }
        save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    info = inspect_target(tmp_path)
    ids, features = features_at_taps_1_2(info)
    # the wrapper's own text model (BLIP-2's forward asks for an image), as built before it was saved
    text_model = text_model_of(generating_part(model, config.get_text_config(decoder=True))[1])
    with torch.no_grad():
        hidden = text_model(input_ids=ids, output_hidden_states=True).hidden_states
    readout = stream_readout(text_model)  # a hyper-connection model's mean, Gemma 3n's AltUp readout
    torch.testing.assert_close(features, torch.cat([readout(hidden[i]) for i in (2, 3)], dim=-1))
    # what a download by hub name fetches for target ranks holds the text model's layers and nothing of its
    # vision tower (Inkling 2's and Mistral Large 3's files name the text model otherwise than it does)
    read = target_weights(info)
    held = [n for n in load_file(tmp_path / "model.safetensors") if read.holds(n)]
    assert {layer.group(1) for n in held if (layer := LAYER_OF_WEIGHT.search(n))} >= {"0", "3"}
    assert not [n for n in held if "vision" in n or "visual" in n]  # nor any of the vision tower


FP4_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)


def as_release(source: Path, target: Path, spec: dict, quantize=None) -> Path:
    """A copy in `target` of the zoo target `source` rewritten as a quantized release: each saved tensor
    through `quantize(name, tensor)` (the tensors it is saved as; none: as it was) and `spec` as its
    config's `quantization_config`."""
    shutil.copytree(source, target)
    if quantize is not None:
        weights = {}
        for name, tensor in load_file(target / "model.safetensors").items():
            weights |= quantize(name, tensor)
        save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = spec
    (target / "config.json").write_text(json.dumps(config))
    return target


def layer_matrix(name: str, tensor: torch.Tensor) -> bool:
    """Whether a saved tensor is a linear layer's weight matrix inside the decoder layers."""
    return tensor.dim() == 2 and ".layers." in name and name.endswith(".weight") and "norm" not in name


def fp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 32 values as 4-bit e2m1 codes packed two a byte ([..., 16] uint8, the even value low) under
    the power of two that scales their largest to at most 6, and that power's exponent ([..., 1])."""
    exponent = torch.ceil(torch.log2(rows.abs().amax(-1, keepdim=True).clamp(min=2**-100) / 6))
    codes = (rows / 2**exponent).unsqueeze(-1).sub(FP4_VALUES).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), exponent


def parameter_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's parameters as loaded."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def keep_fp8_as_a_gpu_does(monkeypatch) -> None:
    """transformers' FP8 loads keep the weights in FP8, as on a GPU of compute capability 8.9 or more: its
    environment check skipped (the load holds the same tensors on the CPU; only the kernels differ)."""
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *args, **kwargs: None)


# the `quantization_config` of FP8 releases (DeepSeek's block scales of 128 x 128)
FP8_RELEASE = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
# per zoo target, a module of every layer its FP8 release keeps in bf16 (`modules_to_not_convert`)
UNCONVERTED = {"deepseek_v3": "self_attn.kv_a_proj_with_mqa", "qwen3_5_moe": "mlp.shared_expert_gate"}


def fp8_release(zoo, name: str, tmp_path: Path) -> Path:
    """Zoo target `name` as FP8 releases ship (DeepSeek V3/V4, Qwen3.5, MiniMax-M2): every weight matrix of
    its decoder layers in float8 e4m3 beside its block scale (`weight_scale_inv`; one block of 128 x 128
    holds a tiny matrix whole), the embedding, norms, routers (no Linear in transformers), LM head and the
    `UNCONVERTED` modules as they were and named in the config's `quantization_config` (by their names in
    the checkpoint's class, as releases name them)."""
    kept = ["lm_head"]  # filled as the tensors are read, written after them

    def quantize(saved: str, tensor: torch.Tensor) -> dict:
        module = saved.removesuffix(".weight")
        if module.endswith(UNCONVERTED[name]):
            kept.append(module)
        elif layer_matrix(saved, tensor) and not module.endswith("mlp.gate"):
            scale = tensor.abs().amax().clamp(min=1e-8) / torch.finfo(torch.float8_e4m3fn).max
            weight = (tensor / scale).to(torch.float8_e4m3fn)
            return {saved: weight, f"{module}.weight_scale_inv": scale.reshape(1, 1).float()}
        return {saved: tensor}

    spec = FP8_RELEASE | {"modules_to_not_convert": kept}
    return as_release(zoo(name), tmp_path / f"{name}_fp8", spec, quantize)


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_5_moe"])
def test_an_fp8_release_is_read_as_transformers_reads_it_and_trains_on_the_cpu(
    name, zoo, chat_data, tmp_path
):
    """On a CPU transformers dequantizes an FP8 release as it loads (a GPU of compute capability 8.9 or more
    keeps its FP8 weights): target ranks read the same features as transformers' own load of the checkpoint
    (a wrapper's text model alone too: Qwen3.5's quantization config is the wrapper's, and without it the
    FP8 weights were read as numbers), and the CLIs train, export and decode it losslessly."""
    target = fp8_release(zoo, name, tmp_path)
    info = inspect_target(target)
    ids, features = features_at_taps_1_2(info)
    own = text_model_of(zoo_config(name, info.vocab_size)[0].from_pretrained(target, dtype=torch.float32))
    with torch.no_grad():
        hidden = own(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(features, torch.cat([hidden[2], hidden[3]], dim=-1))
    assert train_export_decode(target, chat_data, tmp_path)["lossless"]


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_5_moe"])
def test_the_plan_counts_an_fp8_release_as_transformers_holds_it(
    name, zoo, chat_data, tmp_path, capsys, monkeypatch
):
    """The weights of a target rank, predicted from the config, equal those transformers' load holds: on the
    CPU dequantized to the compute dtype; on a GPU that keeps FP8 (--plan_gpu_memory plans for one) a byte a
    weight, the blocks' fp32 scales beside them and the rest in bf16. A GPU's load is the CPU's with
    transformers' environment check skipped (it holds the same tensors; only the kernels differ)."""
    target = fp8_release(zoo, name, tmp_path)
    info, layers = inspect_target(target), 3
    stack = info.text_stack()

    on_cpu = weight_storage(info, CPU)
    assert not on_cpu.kept
    dequantized = load_text_model(target, stack, layers, torch.float32)
    assert truncated_weight_bytes(info, layers, on_cpu, torch.float32) == parameter_bytes(dequantized)
    on_gpu = weight_storage(info, torch.device("cuda"), elsewhere=True)
    assert on_gpu.kept and on_gpu.method == "fp8"
    keep_fp8_as_a_gpu_does(monkeypatch)
    kept = load_text_model(target, stack, layers, torch.bfloat16)
    assert {p.dtype for p in kept.parameters()} == {torch.float8_e4m3fn, torch.float32, torch.bfloat16}
    assert truncated_weight_bytes(info, layers, on_gpu, torch.bfloat16) == parameter_bytes(kept)
    # the modules the release keeps in bf16, named as its class names them, stay so in the text model alone
    # and in its causal LM (converted, they lacked their scales and the load stopped)
    whole = load_text_model(target, stack, info.num_layers, torch.bfloat16, with_head=True)
    for model, count in ((kept, layers), (whole, info.num_layers + 1)):
        plain = [m for n, m in model.named_modules() if n.endswith((UNCONVERTED[name], "lm_head"))]
        assert len(plain) == count and all(type(m) is torch.nn.Linear for m in plain)
    monkeypatch.undo()
    plan = train_flags(target, chat_data, tmp_path / "run") + ["--plan", "--plan_gpu_memory", "80"]
    assert train_main(plan) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if "target_quantization" in line]
    assert "fp8 as released (quantization_config), kept so on a GPU of compute capability 8.9" in line


def mxfp4_release(zoo, tmp_path: Path) -> Path:
    """The zoo's gpt-oss as OpenAI ships it: each expert matrix [experts, in, out] as 4-bit values
    (`*_blocks`: [experts, out, in / 32, 16] bytes, two values a byte) under a shared power of two per 32
    (`*_scales`: its exponent + 127), the rest as it was, and the config's `quantization_config`."""

    def quantize(name: str, tensor: torch.Tensor) -> dict:
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return {name: tensor}
        blocks, exponent = fp4(tensor.transpose(1, 2).unflatten(-1, (-1, 32)))
        return {f"{name}_blocks": blocks, f"{name}_scales": (exponent.squeeze(-1) + 127).to(torch.uint8)}

    skipped = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    spec = {"quant_method": "mxfp4", "modules_to_not_convert": skipped}
    return as_release(zoo("gpt_oss"), tmp_path / "gpt_oss_mxfp4", spec, quantize)


def test_gpt_oss_as_released_in_mxfp4_is_read_as_transformers_reads_it_and_planned_as_held(
    zoo, chat_data, tmp_path
):
    """gpt-oss ships its experts in MXFP4: on the CPU transformers dequantizes them as it loads (target ranks
    read the features of its own load); a GPU with its kernels keeps them packed, which the plan counts as
    the release's bytes (the packed experts and their exponents as stored, their biases in fp32, the rest
    in bf16)."""
    target = mxfp4_release(zoo, tmp_path)
    info = inspect_target(target)
    ids, features = features_at_taps_1_2(info)
    own = transformers.GptOssForCausalLM.from_pretrained(target, dtype=torch.float32).model
    assert not torch.equal(
        own.layers[0].mlp.experts.down_proj,
        load_file(zoo("gpt_oss") / "model.safetensors")["model.layers.0.mlp.experts.down_proj"],
    )  # dequantized from 4 bits
    with torch.no_grad():
        hidden = own(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(features, torch.cat([hidden[2], hidden[3]], dim=-1))
    on_cpu = weight_storage(info, CPU)
    assert on_cpu.method == "mxfp4" and not on_cpu.kept
    assert truncated_weight_bytes(info, info.num_layers, on_cpu, torch.float32) == parameter_bytes(own)
    on_gpu = weight_storage(info, torch.device("cuda"), elsewhere=True)
    assert on_gpu.kept
    stored = load_file(target / "model.safetensors")
    held = sum(
        t.numel() * (1 if t.dtype == torch.uint8 else 4 if ".experts." in name else 2)
        for name, t in stored.items()
        if not name.startswith("lm_head")
    )
    assert truncated_weight_bytes(info, info.num_layers, on_gpu, torch.bfloat16) == held
    assert train_export_decode(target, chat_data, tmp_path)["lossless"]


def deepseek_v4_release(zoo, tmp_path: Path) -> Path:
    """The zoo's DeepSeek V4 as its releases ship: its base model's original names at the files' top
    (`embed.weight`, `layers.0.attn.wq_a.weight`, `hc_head_fn`; refused as incomplete before), the routed experts in
    FP4, two 4-bit values a byte (int8) under a power-of-two scale per 32 (`.scale`, e8m0), every other
    weight matrix of the layers in FP8 under one power-of-two scale (e8m0); `scale_fmt: ue8m0`,
    `expert_dtype: fp4`."""

    def quantize(name: str, tensor: torch.Tensor) -> dict:
        module = name.removesuffix(".weight")
        if layer_matrix(name, tensor) and ".experts." in name and ".shared_experts." not in name:
            packed, exponent = fp4(tensor.unflatten(-1, (-1, 32)))
            scale = (2 ** exponent.squeeze(-1)).to(torch.float8_e8m0fnu)
            return {name: packed.flatten(-2).view(torch.int8), f"{module}.scale": scale}
        if layer_matrix(name, tensor) and not module.endswith("ffn.gate"):
            scale = 2 ** torch.ceil(torch.log2(tensor.abs().amax().clamp(min=1e-8) / 448))
            weight = (tensor / scale).to(torch.float8_e4m3fn)
            return {name: weight, f"{module}.scale": scale.reshape(1, 1).to(torch.float8_e8m0fnu)}
        return {name: tensor}

    def released(name: str, tensor: torch.Tensor) -> dict:
        """Under the release's names: its base model's at the top (`embed.weight`, `layers.*`, `hc_head_fn`),
        where transformers saves `model.embed_tokens.weight`."""
        top = {"embed_tokens.weight": "embed.weight", **{f"hc_head.hc_{k}": f"hc_head_{k}" for k in HC_HEAD}}
        return {
            top.get(k, k): v
            for k, v in ((k.removeprefix("model."), v) for k, v in quantize(name, tensor).items())
        }

    spec = FP8_RELEASE | {"scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    return as_release(zoo("deepseek_v4"), tmp_path / "deepseek_v4_release", spec, released)


HC_HEAD = ("fn", "base", "scale")


def test_deepseek_v4_as_released_is_read_as_transformers_reads_it_and_planned_as_held(
    zoo, chat_data, tmp_path, monkeypatch
):
    """DeepSeek V4 ships FP8 linears and FP4 experts under power-of-two scales: on the CPU transformers
    dequantizes both as it loads (target ranks read the features of its own load: the mean of the streams);
    on a GPU that keeps them the plan counts what transformers' load holds (the experts half a byte a weight),
    byte for byte."""
    target = deepseek_v4_release(zoo, tmp_path)
    info = inspect_target(target)
    ids, features = features_at_taps_1_2(info)
    own = DeepseekV4ForCausalLM.from_pretrained(target, dtype=torch.float32).model
    with torch.no_grad():
        hidden = own(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(features, torch.cat([hidden[2].mean(-2), hidden[3].mean(-2)], dim=-1))
    assert train_export_decode(target, chat_data, tmp_path)["lossless"]
    stack, layers = info.text_stack(), 3
    keep_fp8_as_a_gpu_does(monkeypatch)
    kept = load_text_model(target, stack, layers, torch.bfloat16)
    assert {torch.int8, torch.float8_e4m3fn, torch.float8_e8m0fnu} <= {p.dtype for p in kept.parameters()}
    on_gpu = weight_storage(info, torch.device("cuda"), elsewhere=True)
    assert truncated_weight_bytes(info, layers, on_gpu, torch.bfloat16) == parameter_bytes(kept)


def test_a_gpu_that_keeps_fp8_weights_without_their_kernels_is_named_before_they_load(
    zoo, chat_data, tmp_path, capsys, monkeypatch
):
    """transformers runs kept FP8 weights with the `kernels` package's FP8 kernel, and without it stops at
    the first forward, after the weights have loaded: a run on such a GPU stops at its start instead, before
    the target's weights are read or cut into a view, in one line naming the package; --plan says so."""
    target = fp8_release(zoo, "deepseek_v3", tmp_path)
    kept = WeightStorage("fp8", True, "this GPU (an H200, compute capability 9.0)")
    monkeypatch.setattr(quantization, "is_kernels_available", lambda: False)
    monkeypatch.setattr(setup_run, "weight_storage", lambda info, device: kept)  # as on a GPU that keeps FP8

    def download(*args, **kwargs):
        raise AssertionError("the target's weights were fetched before the refusal")

    monkeypatch.setattr(setup_run, "fetch_target_weights", download)
    capsys.readouterr()
    assert train_main(train_flags(target, chat_data, tmp_path / "run")) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"--target_model {target}: transformers runs FP8 weights with the kernels package" in line
    assert "`pip install kernels`" in line
    assert "`pip install kernels`" in kept.describe(torch.bfloat16)
    with pytest.raises(ValueError, match="`pip install kernels`"):  # evaluation's and regeneration's loads
        quantization.check_kernels(inspect_target(target), kept)


def test_a_release_quantized_by_a_package_not_installed_is_one_line_naming_it(
    zoo, chat_data, tmp_path, capsys
):
    """Kimi K2's INT4 release (compressed-tensors): transformers needs the package to read it; the plan
    says so in one line before anything loads."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 32, "strategy": "group"}
    spec = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    target = as_release(zoo("deepseek_v3"), tmp_path / "int4", spec)
    capsys.readouterr()
    assert train_main([*train_flags(target, chat_data, tmp_path / "run"), "--plan"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"--target_model {target}: its weights are quantized (config.json quantization_config)" in line
    assert "compressed-tensors" in line and "pip install" in line


def test_a_cpu_run_on_a_gpu_machine_loads_an_fp8_release_dequantized(zoo, tmp_path, monkeypatch):
    """transformers judges whether to keep FP8 weights by the machine's GPU, not by the device the run asks
    for: a run with --device cpu on a GPU machine asks for them dequantized (its FP8 kernels run on CUDA
    only), and the plan counts them so."""
    target = fp8_release(zoo, "deepseek_v3", tmp_path)
    info = inspect_target(target)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as transformers sees it
    keep_fp8_as_a_gpu_does(monkeypatch)
    assert not weight_storage(info, CPU).kept
    model = load_text_model(target, info.text_stack(), 3, torch.float32, dequantize=True)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.dtype for p in load_text_model(target, info.text_stack(), 3, torch.float32).parameters()} > {
        torch.float32
    }  # without the request, kept


def test_modules_a_release_keeps_unconverted_stay_so_however_it_writes_their_names(zoo):
    """`modules_to_not_convert` as releases write it (names of their own class, plain, as patterns,
    escaped or anchored) still matches the modules of the text model loaded alone and of its causal LM."""
    info = inspect_target(zoo("deepseek_v3"))
    names = [
        r"model\.layers\.\d+\.self_attn\.kv_a_proj_with_mqa",
        "^model.layers.1.mlp",
        "model.layers.*.mlp.gate",
    ]
    for with_head, into in ((False, ""), (True, "model.")):
        config = info.text_stack().config
        config.quantization_config = {"quant_method": "fp8", "modules_to_not_convert": names}
        unconverted = truncated_text_config(info.text_stack(), 3, with_head).quantization_config[
            "modules_to_not_convert"
        ]
        for module in (
            "layers.2.self_attn.kv_a_proj_with_mqa",
            "layers.1.mlp.down_proj",
            "layers.2.mlp.gate",
        ):
            assert not should_convert_module(into + module, unconverted), (module, unconverted)
        assert should_convert_module(into + "layers.2.mlp.down_proj", unconverted)


def test_a_target_without_a_text_head_is_refused_in_one_line(chat_data, tmp_path, capsys):
    target = tmp_path / "bert"
    tok = build_tokenizer(target)
    BertModel(
        BertConfig(
            vocab_size=len(tok),
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            intermediate_size=64,
        )
    ).save_pretrained(target)
    capsys.readouterr()  # the save's progress bar, where transformers' logging shows it
    assert train_main(train_flags(target, chat_data, tmp_path / "run")) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "BertModel (bert) has no causal-LM text head" in line


def test_a_masked_lm_encoder_is_refused_in_one_line(tmp_path):
    """BertForMaskedLM has an LM head, but it fills in masked tokens reading both ways: it was accepted, its
    head called a vision tower by the plan, and the run stopped on a missing pooler."""
    target = tmp_path / "bert"
    tok = build_tokenizer(target)
    config = BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64
    )
    transformers.BertForMaskedLM(config).save_pretrained(target)
    with pytest.raises(ValueError, match="BertForMaskedLM is a masked-language-model encoder"):
        inspect_target(target)


def test_an_encoder_decoder_target_is_refused_in_one_line(chat_data, tmp_path, capsys):
    """An encoder-decoder's decoder layers also attend to the encoder's output, which the drafter is never
    given (Florence-2's BART stopped on a missing MLP width, T5Gemma 2 in its decoder's forward before)."""
    target = tmp_path / "bart"
    tok = build_tokenizer(target)
    transformers.BartForConditionalGeneration(
        transformers.BartConfig(
            vocab_size=len(tok),
            d_model=32,
            encoder_layers=2,
            decoder_layers=4,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
        )
    ).save_pretrained(target)
    capsys.readouterr()
    assert train_main(train_flags(target, chat_data, tmp_path / "run")) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "BartForConditionalGeneration is an encoder-decoder model" in line


def test_a_target_whose_layers_read_what_only_its_wrapper_computes_is_refused_in_one_line(
    chat_data, tmp_path, capsys
):
    """Voxtral Realtime transcribes a stream: its text decoder's norms are conditioned on a time embedding
    of the delay that only the wrapper computes (its forward alone stopped in a traceback)."""
    target = tmp_path / "voxtral_realtime"
    tok = build_tokenizer(target)
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "head_dim": 16}
    transformers.VoxtralRealtimeForConditionalGeneration(
        transformers.VoxtralRealtimeConfig(
            text_config={**tiny, "vocab_size": len(tok), "num_hidden_layers": 4, "num_key_value_heads": 2},
            audio_config={**tiny, "num_hidden_layers": 1, "num_key_value_heads": 2},
        )
    ).save_pretrained(target)
    capsys.readouterr()
    assert train_main(train_flags(target, chat_data, tmp_path / "run")) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "VoxtralRealtimeForConditionalGeneration's decoder layers" in line
    assert "conditioned on a time embedding of its transcription delay" in line


def test_a_target_whose_embedding_is_narrower_than_its_hidden_states_is_refused_in_one_line(
    chat_data, tmp_path, capsys
):
    """OPT-350m projects its 512-wide embedding to 1024-wide hidden states and back before its LM head; a
    drafter shares the embedding and head at the hidden width, so it cannot draft for it (a shape error deep
    in the drafter's first step before)."""
    target = tmp_path / "opt"
    tok = build_tokenizer(target)
    _, config = zoo_config("opt", len(tok))
    config.word_embed_proj_dim = 32
    transformers.OPTForCausalLM(config).save_pretrained(target)
    capsys.readouterr()  # the save's progress bar
    assert train_main(train_flags(target, chat_data, tmp_path / "run")) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "OPTForCausalLM (opt) projects between its hidden states (64 wide) and its input embedding" in line


def test_a_target_that_insists_on_its_own_cache_is_refused_pieces_in_one_line(chat_data, tmp_path, capsys):
    """MiniMax's forward refuses any cache but its own (MiniMaxCache), so it cannot be prefilled in pieces,
    whose shared cache this project lays out: refused at start with the setting to change (in one pass it
    trains)."""
    target = tmp_path / "minimax"
    tok = build_tokenizer(target)
    transformers.MiniMaxForCausalLM(make_config("MiniMaxConfig", vocab_size=len(tok))).save_pretrained(target)
    assert inspect_target(target).own_cache == "MiniMaxCache"
    capsys.readouterr()  # the save's progress bar
    flags = [*train_flags(target, chat_data, tmp_path / "run"), "--target_prefill_tokens", "64", "--plan"]
    assert train_main(flags) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--target_prefill_tokens 64: minimax" in line and "pass --target_prefill_tokens 0" in line


def test_a_zoo_config_sets_only_the_fields_its_class_defines():
    """The zoo builds each family from its config class's defaults; a field the class does not define (which
    no released checkpoint has) is refused, so a zoo target cannot hide a failure a real one shows."""
    for name in ZOO_NAMES:
        zoo_config(name, 64)
    with pytest.raises(TypeError, match="Qwen3_5MoeTextConfig defines no intermediate_size"):
        make_config("Qwen3_5MoeTextConfig", intermediate_size=128)
    assert "intermediate_size" not in zoo_config("qwen3_5_moe", 64)[1].text_config.to_dict()


@pytest.mark.parametrize(
    ("name", "streams_shape"),
    [("deepseek_v4", (4, 64)), ("glm5_next", (4, 64)), ("qwen4_exp", (4 * 64,))],  # [B, S, *streams_shape]
)
def test_a_hyper_connection_target_feeds_the_drafter_the_mean_of_its_streams(
    name, streams_shape, zoo, chat_data, tmp_path, capsys
):
    """DeepSeek V4 and GLM-5 pass 4 residual streams between layers; a tapped layer's feature is the mean of
    its post-mix streams, as vLLM feeds a drafter (`aux_recon.mean(dim=1)` after layer L for tap L), and
    --plan says so. Qwen4-exp passes its 4 streams side by side ([B, S, 4 x hidden])."""
    info = inspect_target(zoo(name))
    assert train_main([*train_flags(zoo(name), chat_data, tmp_path), "--plan"]) == 0
    assert "4 residual streams between layers (hyper-connections)" in capsys.readouterr().out
    ids = torch.randint(3, info.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    features, _ = TargetFeatureExtractor(info, [1, 2], CPU, torch.float32)(ids, torch.ones_like(ids))
    whole = load_causal_lm(info, CPU, torch.float32)
    streams = {}
    hooks = [
        decoder_layers(whole)[i].register_forward_hook(
            lambda _m, _a, out, i=i: streams.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in (1, 2)
    ]
    with torch.no_grad():
        whole(input_ids=ids)
    for hook in hooks:
        hook.remove()
    assert info.hidden_size == 64 and streams[1].shape == (2, 24, *streams_shape)
    expected = torch.cat([streams[i].view(2, 24, 4, -1).mean(dim=-2) for i in (1, 2)], dim=-1)
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)


class _PassedOn(torch.nn.Module):
    """A decoder layer that passes its input streams on as they are."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def test_gemma_3n_feeds_the_drafter_its_altup_streams_read_out_as_its_final_hidden_state(
    zoo, chat_data, tmp_path, capsys
):
    """Gemma 3n passes 4 AltUp streams ([4, B, S, H]) between its layers and reads its last layer's out into
    its final hidden state (the first stream, the others through its unembedding projections at its
    magnitude, their mean, normed). A tapped layer's feature is that readout: a tap on the last layer is
    transformers' final hidden state, and one on layer 1, normed, is the final hidden state of the same model
    with its later layers passing their input on. --plan says so. Its MLP width is given per layer (the
    drafter takes the widest), and its release's vision tower, which transformers builds only with timm, is
    never built here: it is counted from the files' headers."""
    target = zoo("gemma3n")
    info = inspect_target(target)
    assert train_main([*train_flags(target, chat_data, tmp_path), "--plan"]) == 0
    assert "4 AltUp streams between layers" in capsys.readouterr().out
    ids = torch.randint(3, info.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    features, _ = TargetFeatureExtractor(info, [1, 3], CPU, torch.float32)(ids, torch.ones_like(ids))
    whole = load_causal_lm(info, CPU, torch.float32)
    with torch.no_grad():
        final = whole.model(input_ids=ids).last_hidden_state
        torch.testing.assert_close(features[..., 64:], final, rtol=1e-5, atol=1e-5)
        whole.model.layers[2], whole.model.layers[3] = _PassedOn(), _PassedOn()
        after_layer_1 = whole.model(input_ids=ids).last_hidden_state
        torch.testing.assert_close(whole.model.norm(features[..., :64]), after_layer_1, rtol=1e-5, atol=1e-5)

    read = target_weights(info)
    saved = load_file(target / "model.safetensors")
    assert any(n.startswith("model.vision_tower.") for n in saved)
    assert info.other_parameters == sum(t.numel() for n, t in saved.items() if not read.holds(n))
    per_layer = transformers.Gemma3nTextConfig(
        num_hidden_layers=3, intermediate_size=[64, 96, 32], num_kv_shared_layers=0
    )
    widths = target_info_from_config(per_layer, Path("gemma-3n"))
    assert widths.mlp_widths == (64, 96, 32) and widths.intermediate_size == 96
    # its sparse gates are cut at statistics of the whole gate, which a tensor-parallel plan would split
    with pytest.raises(ValueError, match="activation_sparsity_pattern in .*pass --target_tp_size 1"):
        check_tensor_parallel(target, 2)


RECURRENT_STATE_TARGETS = {  # recurrent layers whose state transformers' crop cannot roll back
    "zamba": (  # Mamba layers, two of them sharing one attention block
        "ZambaForCausalLM",
        dict(
            num_hidden_layers=6,
            attention_head_dim=32,
            mamba_d_state=8,
            mamba_dt_rank=8,
            n_mamba_heads=2,
            attn_layer_period=2,
            attn_layer_offset=0,
        ),
    ),
    "recurrent_gemma": (  # Griffin: 2 recurrent blocks then a local-attention one
        "RecurrentGemmaForCausalLM",
        dict(
            lru_width=64,
            attention_window_size=16,
            block_types=["recurrent", "recurrent", "attention"],
            num_key_value_heads=1,
        ),
    ),
}


def recurrent_state_target(name: str, out: Path) -> Path:
    tok = build_tokenizer(out)
    model_class, fields = RECURRENT_STATE_TARGETS[name]
    config = make_config(model_class.replace("ForCausalLM", "Config"), vocab_size=len(tok), **fields)
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(out)
    return out


def test_a_target_whose_crop_does_not_roll_back_decodes_from_a_copy_of_its_cache(chat_data, tmp_path):
    """Zamba's (v1) Mamba layers record one state a forward where transformers' crop reads one a position: its
    crop stopped the evaluation (or, by one position, restored another state). The decoder finds so on a
    few tokens before decoding, restores a copy of the cache instead and equals greedy decoding; transformers'
    rows, which crop, are left out with one line saying why."""
    target = recurrent_state_target("zamba", tmp_path / "zamba")
    drafter = untrained_drafter(drafter_config_for(inspect_target(target), 1, [1, 2], 0, 4))
    report = evaluate(target, drafter, chat_data, num_prompts=2, max_new_tokens=24, device="cpu")
    assert report["lossless"] and report["dflash"]["mismatches"] == 0
    assert "prompt_lookup" not in report and "transformers_dflash" not in report
    notes = "\n".join(report["notes"])
    assert (
        "which model type 'zamba' cannot (its recurrent layers keep fewer states than a crop reads)" in notes
    )
    whole = load_causal_lm(inspect_target(target), CPU, torch.float32)
    assert new_target_cache(whole).is_croppable and not crop_rolls_back(whole, 4)


def test_a_target_that_keeps_its_state_outside_its_cache_is_refused_by_the_evaluation(chat_data, tmp_path):
    """transformers' RecurrentGemma keeps its recurrent state on its modules, not in the cache it is given,
    which counts no positions: nothing a decoder restores rolls it back, and the evaluation says so in one
    line instead of excusing its mismatches as the target's own cache divergence."""
    target = recurrent_state_target("recurrent_gemma", tmp_path / "recurrent_gemma")
    drafter = untrained_drafter(drafter_config_for(inspect_target(target), 1, [1, 2], 0, 4))
    with pytest.raises(ValueError, match="'recurrent_gemma' keeps its state outside the cache .* counts 0"):
        evaluate(target, drafter, chat_data, num_prompts=2, max_new_tokens=24, device="cpu")


def test_a_target_whose_cache_changes_its_logits_is_said_in_one_line_not_called_lossy(chat_data, tmp_path):
    """transformers' DeepSeek V4 selects other compressed blocks with its cache than without once a context
    has more of them than its indexer's top-k (as `glm_moe_dsa` does): greedy decoding itself leaves the
    cacheless forward, and the evaluation names the model type instead of failing the drafter. Its cache
    cannot be cropped either: the decoder restores a copy, and transformers' assisted rows are left out."""
    target = tmp_path / "dsv4"
    tok = build_tokenizer(target)
    _, config = zoo_config("deepseek_v4", len(tok))
    config.index_topk = 2
    torch.manual_seed(0)
    DeepseekV4ForCausalLM(config).save_pretrained(target)
    drafter = untrained_drafter(drafter_config_for(inspect_target(target), 1, [1, 2], 0, 4))
    report = evaluate(target, drafter, chat_data, num_prompts=2, max_new_tokens=24, device="cpu")
    assert report["mismatched"] and all(
        m["target_cache_differs_at"] <= m["first_difference"] for m in report["mismatched"]
    )
    assert report["lossless"] and "prompt_lookup" not in report
    notes = "\n".join(report["notes"])
    assert (
        "model type 'deepseek_v4': transformers' implementation gives other tokens with its KV cache" in notes
    )
    assert "which model type 'deepseek_v4' cannot (compressed attention)" in notes
    assert "near tie" not in notes
    console = Console(record=True, width=200)
    print_report(report, console)
    last = console.export_text().strip().splitlines()[-1]  # not "every output equals greedy"
    assert last.startswith("not checked token for token: ") and "output(s) leave greedy's" in last
