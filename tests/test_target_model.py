"""The target side: which hidden states are tapped, what is loaded, and bad target directories."""

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

from dflash_ddp.drafter.config import default_target_layer_ids
from dflash_ddp.target_model.features import (
    TargetFeatureExtractor,
    capture_layer_outputs,
    decoder_layers,
    last_layer_norm,
)
from dflash_ddp.target_model.forward_code import MaskBuilding, mask_building, text_model_class
from dflash_ddp.target_model.head import SharedTargetHead
from dflash_ddp.target_model.info import (
    LinearMixer,
    SparseIndexer,
    full_attention_rope,
    inspect_target,
    key_compression,
    key_window,
    layer_mlp_widths,
    layer_types,
    linear_mixer,
    sparse_indexer,
    target_info_from_config,
)
from dflash_ddp.target_model.memory import TargetLoad, target_memory

from helpers import forward_peaks_command, measure_forward_peaks


@pytest.mark.parametrize("family", ["tiny_target", "tiny_moe_target"])
def test_layer_id_l_taps_hidden_states_l_plus_one(family, request):
    """Also for a mixture-of-experts target (Qwen3-MoE: experts and router in every layer)."""
    target = request.getfixturevalue(family)
    info = inspect_target(target)
    full = AutoModelForCausalLM.from_pretrained(target).eval()
    ids = torch.randint(5, 200, (2, 17))
    attn = torch.ones_like(ids)
    with torch.no_grad():
        reference = full(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states
    taps = [0, 2, 3]
    extractor = TargetFeatureExtractor(info, taps, torch.device("cpu"), torch.float32)
    features, soft = extractor(ids, attn)
    assert soft is None
    expected = torch.cat([reference[i + 1] for i in taps], dim=-1)
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)
    # later layers are not even loaded
    assert len(extractor.layers) == max(taps) + 1


def test_a_tap_on_the_last_layer_reads_the_final_normed_output_as_transformers_does(tiny_target):
    """transformers' hidden_states[N] (what its DFlash generate and the z-lab reference feed the drafter for a
    tap on layer N-1) is the final-normed output; training and our decode loop must read the same."""
    info = inspect_target(tiny_target)
    last = info.num_layers - 1
    full = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    ids = torch.randint(5, 200, (2, 17))
    attn = torch.ones_like(ids)
    taps = [1, last]
    with torch.no_grad():
        reference = full(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states
        raw = capture_layer_outputs(decoder_layers(full), taps, stop_after_last=False)
        normed = capture_layer_outputs(
            decoder_layers(full), taps, False, last_layer_norm(full, taps, info.num_layers)
        )
        with raw as unnormed, normed as decoded:
            full(input_ids=ids, attention_mask=attn)
    expected = torch.cat([reference[i + 1] for i in taps], dim=-1)
    assert not torch.allclose(unnormed[last], reference[last + 1], atol=1e-2)  # the rule matters here
    torch.testing.assert_close(torch.cat([decoded[i] for i in taps], dim=-1), expected, rtol=1e-5, atol=1e-5)
    extractor = TargetFeatureExtractor(info, taps, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(extractor(ids, attn)[0], expected, rtol=1e-5, atol=1e-5)
    assert last_layer_norm(full, [1, last - 1], info.num_layers) is None


def test_shared_head_reads_only_embedding_and_lm_head(tiny_target):
    info = inspect_target(tiny_target)
    head = SharedTargetHead.from_target(info)
    full = AutoModelForCausalLM.from_pretrained(tiny_target)
    assert torch.equal(head.embed_tokens.weight, full.model.embed_tokens.weight)
    assert torch.equal(head.lm_head_weight, full.lm_head.weight)
    assert not any(p.requires_grad for p in head.parameters())


def test_default_taps_match_the_paper():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(8) == [1, 2, 3, 4, 5]


def test_target_directory_without_safetensors_or_config(tiny_target, tmp_path):
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_target / "config.json", no_weights)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        inspect_target(no_weights)
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    shutil.copy(tiny_target / "model.safetensors", no_config)
    with pytest.raises(ValueError, match="no config.json"):
        inspect_target(no_config)
    with pytest.raises(ValueError, match="not a directory"):
        inspect_target(tmp_path / "missing")


def test_plan_says_which_target_layers_run_and_whether_the_last_is_final_normed(
    tiny_target, chat_data, tmp_path, capsys
):
    from dflash_ddp.train import main

    flags = ["--target_model", str(tiny_target), "--data", str(chat_data), "--output_dir", str(tmp_path)]
    assert main([*flags, "--plan", "--target_layer_ids", "1,3"]) == 0
    assert "0..3 of 6 (later layers, the final norm and the LM head skipped)" in capsys.readouterr().out
    assert main([*flags, "--plan", "--target_layer_ids", "1,5"]) == 0
    assert "0..5 of 6 (all layers, the last one's output final-normed" in capsys.readouterr().out
    soft = ["--target_layer_ids", "1,3", "--loss", "tv", "--target_topk", "8"]
    assert main([*flags, "--plan", *soft]) == 0
    out = capsys.readouterr().out
    assert "0..5 of 6 (all layers, the final norm and the LM head: the top 8 next-token probabilities" in out
    assert "2 more layer(s) than the taps need" in out and "more target compute per token" in out
    assert "MiB of soft targets (48 bytes a token" in out and "soft-target logits" in out
    assert main([*flags, "--plan", *soft[:-1], "100000"]) == 2  # more than the vocabulary
    assert "--target_topk 100000 is more than the target's" in capsys.readouterr().err


def test_soft_targets_are_the_top_k_of_the_whole_targets_next_token_distribution(tiny_target):
    """--target_topk: every layer and the LM head run; the tapped features are unchanged, bit for bit; the
    top-k are those of transformers' own logits, with k = vocabulary the whole distribution (to bf16)."""
    info = inspect_target(tiny_target)
    full = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    ids = torch.randint(5, 200, (2, 17))
    attn = torch.ones_like(ids)
    attn[1, 11:] = 0
    with torch.no_grad():
        probs = torch.softmax(full(input_ids=ids, attention_mask=attn).logits.float(), -1)
    taps = [1, 3]
    truncated, _ = TargetFeatureExtractor(info, taps, torch.device("cpu"), torch.float32)(ids, attn)
    extractor = TargetFeatureExtractor(info, taps, torch.device("cpu"), torch.float32, topk=5)
    assert len(extractor.layers) == info.num_layers
    features, soft = extractor(ids, attn)
    assert torch.equal(features, truncated)
    assert soft.ids.dtype == torch.int32 and soft.probs.dtype == torch.bfloat16 and soft.k == 5
    real = attn.bool()
    top = probs.topk(5, -1)
    assert torch.equal(soft.ids[real].long(), top.indices[real])
    torch.testing.assert_close(soft.probs[real].float(), top.values[real], rtol=1e-2, atol=1e-3)
    assert not soft.probs[~real].any() and not soft.ids[~real].any()  # padding carries nothing
    everything = TargetFeatureExtractor(info, taps, torch.device("cpu"), torch.float32, topk=info.vocab_size)
    _, whole = everything(ids, attn)
    dense = torch.zeros_like(probs).scatter(-1, whole.ids.long(), whole.probs.float())
    torch.testing.assert_close(dense[real], probs[real], rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("topk", [0, 4])
def test_a_prefill_in_pieces_equals_one_pass(tiny_target, topk):
    """--target_prefill_tokens: pieces of 48 positions over the batch's 3 rows (16 a row) sharing a KV cache
    give the features (and soft targets) of one pass, for a padded batch whose rows end before, inside and
    after a piece; no call of the model runs more than the 48 positions."""
    info = inspect_target(tiny_target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 290, (3, 130), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 100:] = 0  # a row that ends inside the third piece
    mask[2, 48:] = 0  # one that ends with the first
    whole = TargetFeatureExtractor(info, [1, 3, 5], torch.device("cpu"), torch.float32, topk=topk)
    pieces = TargetFeatureExtractor(
        info, [1, 3, 5], torch.device("cpu"), torch.float32, topk=topk, prefill_tokens=48
    )
    calls = []
    pieces.model.register_forward_pre_hook(
        lambda _, args, kwargs: calls.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    (a, soft_a), (b, soft_b) = whole(ids, mask), pieces(ids, mask)
    assert len(calls) == 9 and max(calls) == 48  # 130 positions a row in pieces of 16
    assert a.shape == b.shape == (3, 130, 3 * info.hidden_size)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    if topk:
        assert torch.equal(soft_a.ids, soft_b.ids)
        torch.testing.assert_close(soft_b.probs.float(), soft_a.probs.float(), rtol=0, atol=1e-2)


def test_a_batch_of_more_rows_than_a_pieces_positions_runs_in_groups_of_rows(tiny_target):
    """A batch of many short rows: with --target_prefill_tokens below its row count, the rows run in groups
    of that many, a position of each at a time, so that no call of the model runs more positions than the
    plan's piece (the features those of one pass)."""
    info = inspect_target(tiny_target)
    ids = torch.randint(4, 290, (5, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[3, 7:] = 0
    whole = TargetFeatureExtractor(info, [1, 3], torch.device("cpu"), torch.float32)
    groups = TargetFeatureExtractor(info, [1, 3], torch.device("cpu"), torch.float32, prefill_tokens=2)
    calls = []
    groups.model.register_forward_pre_hook(
        lambda _, args, kwargs: calls.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    (a, _), (b, _) = whole(ids, mask), groups(ids, mask)
    assert calls.count((2, 1)) == 24 and calls.count((1, 2)) == 6 and len(calls) == 30  # rows 2 + 2 + 1
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


FORWARDS = {"one_pass": (8, 4096, 0), "pieces": (2, 8192, 2048)}  # rows, length, prefill piece


@pytest.fixture(scope="module")
def forward_peaks(tiny_target) -> dict[str, int]:
    """Each of FORWARDS' peaks, taps 1-3, measured in processes of their own side by side (one core each)."""
    commands = [
        forward_peaks_command([(tiny_target, [1, 2, 3], piece)], rows, length)
        for rows, length, piece in FORWARDS.values()
    ]
    return {name: peaks[0] for name, peaks in zip(FORWARDS, measure_forward_peaks(commands), strict=True)}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak reset")
@pytest.mark.parametrize("name", FORWARDS)
def test_the_plan_predicts_a_target_forwards_peak(tiny_target, forward_peaks, name):
    """The target rank's predicted peak against a real forward's, in one pass (a layer's tensors and the
    taps, or the features' concatenation and masked copy after the last layer) and with the prefill in
    pieces (2048 positions over two rows), where a piece after cached keys attends through an explicit
    mask: transformers' boolean [queries, keys] one, which torch turns into an additive one per row (in fp32
    four bytes per row, query and key: 32 MiB a row for 1024 x 8192, where the activations take a few).
    1.36x and 1.26x when written: the plan sums a layer's attention and MLP tensors (a hybrid's run side by
    side), most of the forward at this width; on an H200 at Qwen3-8B's shape it predicted 1.06x the
    measured peak."""
    rows, length, piece = FORWARDS[name]
    info = inspect_target(tiny_target)
    load = TargetLoad(
        weight_bytes=0,  # the weights are resident before the measurement starts
        target_layer_ids=[1, 2, 3],
        layers=4,
        tokens_per_batch=rows * length,
        dtype_bytes=4,
        prefill_tokens=piece,
        max_seq_len=length,
    )
    plan = target_memory(info, load)
    measured = forward_peaks[name]
    assert 1.0 <= plan.total / measured <= 1.4, (plan.describe(), measured / 2**30)
    if piece:
        without_mask = plan.total - plan.parts["attention mask"] - plan.parts["repeated keys and values"]
        assert measured > 2 * without_mask  # the plan missed more than half of it before it counted the mask


@pytest.mark.parametrize(
    ("config_class", "widths"),
    [
        # experts x active + shared expert, no dense width at all (the released Qwen3.5/3.6-MoE text config)
        ("Qwen3_5MoeTextConfig", {512 * 8 + 512}),
        ("Qwen3MoeConfig", {768 * 8}),
        # 3 dense layers, then 8 routed experts of 2048 + 1 shared
        ("DeepseekV3Config", {18432, 2048 * 8 + 2048}),
        # intermediate_size is only an alias of the experts' width: every layer sparse
        ("DeepseekV4Config", {2048 * 6 + 2048}),
        ("GptOssConfig", {2880 * 4}),  # intermediate_size names the experts' width
        ("NemotronHConfig", {0, 21504, 7688 * 2 + 7688}),  # Mamba/attention blocks have no MLP
        # the older families' names for the dense width, or their convention where they name none
        ("FalconConfig", {18176}),  # ffn_hidden_size
        ("OPTConfig", {3072}),  # ffn_dim
        ("GPT2Config", {4 * 768}),  # n_inner unset: 4x the hidden size, as its class documents
        ("GPTNeoConfig", {4 * 2048}),  # intermediate_size unset: likewise
        ("MptConfig", {4 * 2048}),  # expansion_ratio
        ("BloomConfig", {4 * 64}),  # no field: 4x the hidden size in its code
        ("DbrxConfig", {3584 * 1}),  # its experts' width and count in `ffn_config`
        ("DogeConfig", {2048}),  # 16384 experts configured, `is_moe` false
        ("AriaTextConfig", {4096 * 2 + 2 * 4096}),  # `moe_topk` of `moe_num_experts`, 2 shared experts
        ("Ernie4_5_MoeConfig", {1536 * 6 + 2 * 1536}),  # shared experts as a count of the experts' width
        # experts per modality (text, vision): text tokens pass the text experts and the shared ones, as wide
        ("Ernie4_5_VLMoeTextConfig", {12288, 1536 * 6 + 2 * 1536}),
        ("LongcatFlashConfig", {2048 * 12 + 12288}),  # the dense sublayers beside the shortcut MoE's experts
        ("AfmoeConfig", {6144, 1408 * 6 + 2 * 1408}),  # `num_dense_layers` dense first layers
        ("ErgoConfig", {32768, 4096 * 8 + 8192}),  # a dense first block, then experts + a shared MLP
        ("OpenAIGPTConfig", {4 * 768}),  # GPT-1: no field, 4x the hidden size in its code
        # Cohere's MoE: experts of intermediate_size, dense first layers of prefix_dense_intermediate_size
        (
            (
                "Cohere2MoeConfig",
                {"mlp_layer_types": ["dense"] + ["sparse"] * 39, "prefix_dense_intermediate_size": 512},
            ),
            {512, 22528 * 2},
        ),
        # Kolibri's first layers are dense at their own width, the others 6 experts of 512 + 1 shared
        (("Kolibri1_1Config", {"mlp_only_intermediate_size": 1024}), {1024, 512 * 6 + 512}),
    ],
)
def test_a_targets_mlp_width_is_read_by_meaning_per_layer(config_class, widths):
    name, fields = config_class if isinstance(config_class, tuple) else (config_class, {})
    assert set(layer_mlp_widths(getattr(transformers, name)(**fields))) == widths


def test_an_mpt_checkpoints_kv_n_heads_is_not_read_as_its_kv_heads():
    """llm-foundry's MPT exports carry `attn_config.kv_n_heads`, which transformers' MPT never reads (its
    attention is multi-head): only DBRX's sub-configs are read."""
    mpt = transformers.MptConfig(attn_config={"attn_type": "multihead_attention", "kv_n_heads": 1})
    assert target_info_from_config(mpt, Path("mpt")).num_key_value_heads == mpt.n_heads


@pytest.mark.parametrize(
    ("config_class", "theta"),
    [
        ("Qwen3Config", 10_000.0),
        ("Gemma3TextConfig", 1_000_000.0),  # its full-attention layers' entry, not the sliding ones' 10000
        ("ErgoConfig", 1_000_000.0),  # global layers without positions: the sliding layers' rope
        ("NemotronHConfig", 10_000.0),  # no positions anywhere: plain rope for the drafter's own
    ],
)
def test_the_drafter_takes_the_rope_of_the_targets_full_attention_layers_or_the_nearest(config_class, theta):
    assert full_attention_rope(getattr(transformers, config_class)())["rope_theta"] == theta


HCA = "heavily_compressed_attention"


@pytest.mark.parametrize(
    ("config_class", "indexer", "compression"),
    [
        ("DeepseekV32Config", SparseIndexer(64, 128), {}),
        ("GlmMoeDsaConfig", SparseIndexer(32, 128), {}),
        ("Glm5NextTextConfig", SparseIndexer(32, 128, pool=16), {}),  # scores pools of 16 keys
        ("MistralLarge4TextConfig", SparseIndexer(32, 128), {}),
        # an indexer before its compressed sparse layers, scoring the compressed keys; none before the others
        ("DeepseekV4Config", SparseIndexer(64, 128, pool=4), {"compressed_sparse_attention": 4, HCA: 128}),
        ("MiniMaxM3VLTextConfig", None, {}),  # index fields, but no layer of the default config is sparse
        ("Qwen3Config", None, {}),
    ],
)
def test_a_targets_sparse_attention_indexer_is_read_from_its_config(config_class, indexer, compression):
    """The memory plan counts the indexer's scores from these (their default configs are the released
    models' widths)."""
    config = getattr(transformers, config_class)()
    assert sparse_indexer(config) == indexer
    assert key_compression(config) == compression


@pytest.mark.parametrize(
    ("config_class", "window"),
    [
        ("DeepseekV4Config", 128),  # every layer: a window, plus compressed keys in most
        ("GptOssConfig", 128),
        ("Gemma3TextConfig", 4096),
        ("Llama4TextConfig", 8192),  # chunked layers: the cache keeps a chunk
        ("Qwen2MoeConfig", 0),  # a sliding_window field, but every layer full attention
        ("MistralConfig", 4096),  # no layer types: a window set is every layer's (v0.1)
    ],
)
def test_the_keys_a_windowed_layer_keeps_are_read_from_its_config(config_class, window):
    """The plan counts a windowed layer's masks and attention by these (the config classes' defaults)."""
    assert key_window(getattr(transformers, config_class)()) == window


@pytest.mark.parametrize(
    ("config_class", "always", "by_window", "causal_skip"),
    [
        ("Qwen3Config", {"full_attention"}, False, True),  # its sliding mask only where a layer slides
        (
            "MinistralConfig",
            {"full_attention", "sliding_attention"},
            False,
            True,
        ),  # both, whatever the layers
        (
            "Qwen2MoeConfig",
            {"full_attention", "sliding_attention"},
            False,
            True,
        ),  # a window of 0: never skipped
        ("Llama4TextConfig", set(), False, True),  # a mask per kind of layer present
        ("MistralConfig", set(), True, True),  # one mask for every layer, sliding where a window is set
        ("FalconConfig", {"full_attention"}, False, False),  # built even where SDPA's causal flag would do
        ("DogeConfig", set(), True, False),  # likewise, through a variable naming the builder
        ("DeepseekV32Config", {"full_attention"}, False, False),  # ... through its dict of keywords
    ],
)
def test_the_masks_a_targets_forward_builds_are_read_from_its_code(
    config_class, always, by_window, causal_skip
):
    """transformers builds some masks that no layer reads (Ministral's full mask beside sliding layers only
    in a prefill in pieces, Qwen2-MoE's sliding one in one pass: a boolean queries x keys each, and the
    windowed one two more while it is built), and some families build theirs in one pass where SDPA's causal
    flag would do (`allow_is_causal_skip=False`); the plan counts those its code builds."""
    building = MaskBuilding(frozenset(always), by_window, causal_skip)
    assert mask_building(getattr(transformers, config_class)()) == building


def test_an_unread_full_mask_counts_only_where_no_full_layer_past_the_cut_sizes_it():
    """Ministral (every layer sliding) builds its full mask in each piece as wide as the sliding cache's
    keys; Gemma 3 cut before its first full layer sizes it by that layer's empty cache, and SDPA skips it."""
    load = TargetLoad(0, [2], 3, tokens_per_batch=4096, dtype_bytes=2, prefill_tokens=1024, max_seq_len=4096)
    own = 512 - 1 + 1024  # the window the cache keeps and the piece
    sliding = 1024 * own + 1024 * own * 2  # the boolean, and the additive copy per row
    for config, unread in (
        (transformers.MinistralConfig(num_hidden_layers=4, sliding_window=512, head_dim=16), 1024 * own),
        (transformers.Gemma3TextConfig(num_hidden_layers=6, sliding_window=512), 0),  # full: layer 5
    ):
        info = target_info_from_config(config, Path("unused"))
        assert target_memory(info, load).parts["attention mask"] == sliding + unread, type(config).__name__


def test_a_family_that_picks_its_mask_by_the_window_is_planned_as_sliding_where_one_is_set():
    """MiniMax names its attention layers full, yet gives them the sliding mask where the config sets a
    window (Mistral's choice of mask)."""
    assert set(layer_types(transformers.MiniMaxConfig())) == {"full_attention", "linear_attention"}
    windowed = transformers.MiniMaxConfig(sliding_window=4096)
    assert set(layer_types(windowed)) == {"sliding_attention", "linear_attention"}
    assert key_window(windowed) == 4096


def test_eager_scores_joined_to_fp32_sinks_are_planned_in_fp32():
    """DeepSeek V4 keeps its attention sinks in fp32 in a bf16 checkpoint: its eager scores, joined to them,
    are shifted and softmaxed in fp32 (about 11.7 bytes a score in bf16, where gpt-oss's bf16 sinks keep
    them at about 5.7): planned at 12 and 10 bytes."""
    load = TargetLoad(0, [1], 2, tokens_per_batch=4096, dtype_bytes=2, max_seq_len=4096)
    # DeepSeek V4's first layers are heavily compressed: a compressed key per 128 beside their own
    for name, keys, per_score in (("DeepseekV4Config", 4096 + 32, 12), ("GptOssConfig", 4096, 10)):
        info = target_info_from_config(getattr(transformers, name)(num_hidden_layers=4), Path("unused"))
        scores = target_memory(info, load).parts["attention scores"]
        assert scores == 4096 * keys * info.num_attention_heads * per_score, name


def test_an_eager_familys_masks_are_planned_per_row_in_its_dtype():
    """transformers' eager_mask turns each boolean mask into an additive one per row in the activations'
    dtype, which the layers add to their scores as it is (gpt-oss: its full and its sliding mask)."""
    info = target_info_from_config(transformers.GptOssConfig(num_hidden_layers=4), Path("unused"))
    load = TargetLoad(0, [3], 4, tokens_per_batch=4096, dtype_bytes=2, prefill_tokens=512, max_seq_len=2048)
    sliding = info.key_window - 1 + 512  # the window its cache keeps and a piece of one row
    assert target_memory(info, load).parts["attention mask"] == 512 * (2048 + sliding) * 2


def test_deepseek_v4s_cache_and_masks_are_planned_as_its_layers_keep_them():
    """DeepSeek V4's layers cache one tensor as both keys and values, and beside them a compressed key per
    4 positions (per 128 in its heavily compressed layers); in pieces a query attends to the window its
    cache keeps, its piece and the compressed keys, and each compressed layer holds its block bias and the
    mask joined to it beside the model's one mask."""
    config = transformers.DeepseekV4Config(num_hidden_layers=4)  # 3 heavily compressed layers, then 1 sparse
    info = target_info_from_config(config, Path("unused"))
    load = TargetLoad(0, [3], 4, tokens_per_batch=4096, dtype_bytes=2, prefill_tokens=1024, max_seq_len=4096)
    parts = target_memory(info, load).parts
    positions = 3 * (4096 + 4096 // 128) + 4096 + 4096 // 4
    indexer_keys = 4096 // 4 * 128  # the sparse layer's indexer: a key of 128 per compressed block
    assert parts["KV cache"] == (positions * config.head_dim + indexer_keys) * 2
    # one additive mask per row (run eagerly), which every layer reads: the window the cache keeps and the
    # piece; the sparse layer's block bias over its compressed keys, and the mask joined to it
    own, compressed = config.sliding_window - 1 + 1024, 4096 // 4
    assert parts["attention mask"] == 1024 * own * 2 + 1024 * (own + compressed + compressed) * 2


def test_the_plan_bounds_what_a_windowed_layers_cache_keeps_for_any_batch_shape():
    """transformers' cache keeps a windowed layer's last window - 1 keys of each row: a batch of rows
    shorter than the window keeps every position. The plan of a prefill in pieces counts the batch's
    positions, which any shape of rows up to --tokens_per_batch reaches at most (32 rows of 32 reach it)."""
    config = transformers.MistralConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, sliding_window=64
    )
    info = target_info_from_config(config, Path("unused"))
    load = TargetLoad(0, [1], 2, tokens_per_batch=1024, dtype_bytes=4, prefill_tokens=256, max_seq_len=1024)
    planned = target_memory(info, load).parts["KV cache"]
    kept = []
    for rows in (1, 16, 32):
        cache, length, piece = DynamicCache(config=config), 1024 // rows, 256 // rows  # as the extractor cuts
        for start in range(0, length, piece):
            for layer in range(2):
                keys = torch.zeros(rows, 2, min(piece, length - start), 16)
                cache.update(keys, keys, layer)
        kept.append(sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers) * 4)
    assert kept[0] < kept[1] < kept[2] == planned


def test_the_plan_counts_deepseek_v32s_indexer_at_long_context():
    """At DeepSeek V3.2's released widths (64 index heads of 128) the indexer's fp32 work is 772 bytes per
    query-key pair: a row of 8K positions in one pass needs 48 GiB for it, more than anything else a target
    rank holds but its weights; pieces of 1024 positions bound it to an eighth."""
    info = target_info_from_config(transformers.DeepseekV32Config(num_hidden_layers=4), Path("unused"))
    load = TargetLoad(weight_bytes=0, target_layer_ids=[1], layers=2, tokens_per_batch=8192, dtype_bytes=2)
    parts = target_memory(info, replace(load, max_seq_len=8192)).parts
    one_pass = parts.pop("indexer scores")
    assert one_pass == 8192 * 8192 * 772 and one_pass > max(v for k, v in parts.items() if k != "weights")
    pieces = target_memory(info, replace(load, max_seq_len=8192, prefill_tokens=1024)).parts["indexer scores"]
    assert pieces == one_pass // 8


def test_zamba2s_mamba_layers_are_read_and_a_target_without_attention_is_refused_in_one_line():
    """Zamba2 names its Mamba-2 heads its own way (their reference code's memory is counted from these); a
    pure state-space model has no attention whose shape the drafter could take."""
    assert linear_mixer(transformers.Zamba2Config()) == LinearMixer("mamba2", 8, 640, 640, 64, 256)
    assert linear_mixer(transformers.ZambaConfig()) is None  # Mamba-1 layers: heads, no head width
    with pytest.raises(
        ValueError, match="target model type 'mamba2' has no attention layers .* not supported"
    ):
        target_info_from_config(transformers.Mamba2Config(), Path("unused"))


def test_a_config_without_the_width_its_layers_need_is_one_line_naming_the_model_type_and_field():
    """A hand-written config.json (no class fills its defaults) with experts and no expert width."""
    config = SimpleNamespace(model_type="my_moe", num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    with pytest.raises(
        ValueError,
        match="model type 'my_moe': layer 0 has experts but its config gives no "
        "moe_intermediate_size and num_experts_per_tok; check the checkpoint's config.json",
    ):
        layer_mlp_widths(config)


def test_a_text_model_class_its_package_does_not_export_is_found_in_its_familys_code():
    """transformers' auto mapping names Voxtral Realtime's text model, which its package does not export:
    looking it up there raised a ValueError out of target inspection."""
    config = transformers.VoxtralRealtimeTextConfig()
    with pytest.raises(ValueError, match="Could not find VoxtralRealtimeTextModel"):
        transformers.AutoModel._model_mapping[type(config)]
    assert text_model_class(config).__name__ == "VoxtralRealtimeTextModel"


def test_weights_that_their_config_does_not_describe_are_refused_with_both_shapes(tiny_target, tmp_path):
    """A config.json edited or copied from another size of the model: one line naming the weights and both
    shapes (transformers raised 'look at the above report', a report its logging level had hidden)."""
    from dflash_ddp.target_model.loading import load_text_model

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    config = json.loads((target / "config.json").read_text())
    config["intermediate_size"] *= 2
    (target / "config.json").write_text(json.dumps(config))
    info = inspect_target(target)
    with pytest.raises(ValueError, match="do not have the shapes") as refused:
        load_text_model(target, info.text_stack(), 2, torch.float32)
    message = str(refused.value)
    assert "layers.0.mlp.down_proj.weight: (64, 128) saved, (64, 256) by the config" in message, message
    assert f"{target}/config.json" in message and "\n" not in message


def test_a_checkpoint_of_custom_code_is_refused_without_running_or_asking(tiny_target, tmp_path, monkeypatch):
    """A config or tokenizer that names code of its own (auto_map) for a class transformers lacks: one line,
    at once (transformers asked on a terminal whether to run it, then the run failed anyway)."""
    from dflash_ddp.data.chat_template import load_target_tokenizer
    from dflash_ddp.target_model.tensor_parallel import check_tensor_parallel
    from dflash_ddp.target_model.text_stack import read_text_stack

    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)
    ran = tmp_path / "ran"
    target = tmp_path / "custom"
    shutil.copytree(tiny_target, target)

    def own_code(json_file: str, fields: dict, module: str, base: str, body: str) -> None:
        """`fields` into the target's `json_file`, naming `module`.py, whose class leaves `ran` if it runs."""
        saved = json.loads((target / json_file).read_text())
        (target / json_file).write_text(json.dumps(saved | fields))
        (target / f"{module}.py").write_text(
            f"open({str(ran)!r}, 'w').close()\nfrom transformers import {base}\n{body}"
        )

    own_code(
        "config.json",
        {"model_type": "mytiny", "auto_map": {"AutoConfig": "configuration_mytiny.MyTinyConfig"}},
        "configuration_mytiny",
        "Qwen3Config",
        "class MyTinyConfig(Qwen3Config):\n    model_type = 'mytiny'\n",
    )
    with pytest.raises(ValueError, match=r"its config.json names code of its own \(auto_map\)"):
        read_text_stack(target)
    with pytest.raises(ValueError, match=r"its config.json names code of its own \(auto_map\)"):
        check_tensor_parallel(target, 2)  # --target_tp_size reads the config first
    own_code(
        "tokenizer_config.json",
        {"tokenizer_class": "XTokenizer", "auto_map": {"AutoTokenizer": [None, "tok_x.XTokenizer"]}},
        "tok_x",
        "PreTrainedTokenizerFast",
        "class XTokenizer(PreTrainedTokenizerFast):\n    pass\n",
    )
    with pytest.raises(ValueError, match=r"its tokenizer is code of its own \(auto_map\), which is not run"):
        load_target_tokenizer(target)
    assert not ran.exists()
    bare = tmp_path / "no_tokenizer"
    bare.mkdir()
    shutil.copy(tiny_target / "config.json", bare / "config.json")
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_target_tokenizer(bare)


def test_a_drafter_given_as_the_target_is_named_as_one(tmp_path):
    drafter = tmp_path / "export"
    drafter.mkdir()
    (drafter / "config.json").write_text(
        json.dumps({"architectures": ["DFlashDraftModel"], "model_type": "qwen3"})
    )
    with pytest.raises(
        ValueError, match=r"this is a drafter \(DFlashDraftModel\), not a target: .* --init_from"
    ):
        inspect_target(drafter)
