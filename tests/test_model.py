"""The drafter's attention rule (no leaks), its two attention paths, and its cached inference path."""

import pytest
import torch

from dflash_ddp.drafter.attention import block_layout, dense_block_mask
from dflash_ddp.drafter.blocks import build_block_inputs
from dflash_ddp.drafter.families import FAMILIES
from dflash_ddp.drafter.flex import flex_block_mask
from dflash_ddp.drafter.model import DFlashDraftModel

from helpers import small_draft_config


def sparse_layout(anchors, context_len, block_size, window=None):
    return block_layout(
        anchors, context_len, block_size, num_heads=4, device=torch.device("cpu"), window=window
    )


MASKS = {"dense": dense_block_mask, "flex": flex_block_mask, "sparse": sparse_layout}

BS = 4
SEQ = 24
ANCHORS = [5, 7, 15]  # 5 and 7 are closer than a block: their blocks overlap in position


def small_drafter(seed=0):
    torch.manual_seed(seed)
    return DFlashDraftModel(small_draft_config()).eval()


def setup_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 48, (1, SEQ), generator=g)
    loss_mask = torch.ones(1, SEQ, dtype=torch.long)
    inputs = build_block_inputs(ids, loss_mask, [torch.tensor(ANCHORS)], BS, 49)
    features = torch.randn(1, SEQ, 64, generator=g)
    embeds = torch.randn(1, len(ANCHORS) * BS, 32, generator=g)
    return inputs, features, embeds


@pytest.fixture(params=sorted(MASKS))
def run(request):
    drafter = small_drafter()

    def forward(inputs, features, embeds):
        mask = MASKS[request.param](inputs.anchors, inputs.context_len, BS)
        with torch.no_grad():
            out = drafter(embeds, features, inputs.position_ids, mask).last_hidden_state
        return out.view(len(ANCHORS), BS, -1)

    return forward


@pytest.mark.parametrize("block", range(len(ANCHORS)))
def test_features_at_or_after_anchor_do_not_leak(run, block):
    inputs, features, embeds = setup_inputs()
    base = run(inputs, features, embeds)
    changed = features.clone()
    changed[:, ANCHORS[block] :] += 10 * torch.randn_like(changed[:, ANCHORS[block] :])
    out = run(inputs, changed, embeds)
    torch.testing.assert_close(out[block], base[block], rtol=0, atol=1e-5)


@pytest.mark.parametrize("block", range(len(ANCHORS)))
def test_feature_just_before_anchor_is_seen(run, block):
    inputs, features, embeds = setup_inputs()
    base = run(inputs, features, embeds)
    changed = features.clone()
    changed[:, ANCHORS[block] - 1] += 1.0
    out = run(inputs, changed, embeds)
    assert (out[block] - base[block]).abs().max() > 1e-3


@pytest.mark.parametrize("block", range(len(ANCHORS)))
def test_other_blocks_tokens_do_not_leak(run, block):
    inputs, features, embeds = setup_inputs()
    base = run(inputs, features, embeds)
    changed = embeds.clone().view(len(ANCHORS), BS, -1)
    for other in range(len(ANCHORS)):
        if other != block:
            changed[other] += torch.randn_like(changed[other])
    out = run(inputs, features, changed.view_as(embeds))
    torch.testing.assert_close(out[block], base[block], rtol=0, atol=1e-5)
    own = embeds.clone().view(len(ANCHORS), BS, -1)
    own[block, 2] += 1.0  # a token of the block itself is seen (bidirectional inside the block)
    assert (run(inputs, features, own.view_as(embeds))[block, 0] - base[block, 0]).abs().max() > 1e-3


def test_attention_paths_agree_with_padding_blocks():
    drafter = small_drafter()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 48, (2, SEQ), generator=g)
    loss_mask = torch.ones(2, SEQ, dtype=torch.long)
    # the second sequence has fewer anchors: its last slot is a padding block that sees nothing
    inputs = build_block_inputs(ids, loss_mask, [torch.tensor([3, 9, 20]), torch.tensor([4, 6])], BS, 49)
    features = torch.randn(2, SEQ, 64, generator=g)
    embeds = torch.randn(2, 3 * BS, 32, generator=g)
    with torch.no_grad():
        dense = drafter(embeds, features, inputs.position_ids, dense_block_mask(inputs.anchors, SEQ, BS))
        flex = drafter(embeds, features, inputs.position_ids, flex_block_mask(inputs.anchors, SEQ, BS))
        sparse = drafter(embeds, features, inputs.position_ids, sparse_layout(inputs.anchors, SEQ, BS))
    torch.testing.assert_close(dense.last_hidden_state, flex.last_hidden_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense.last_hidden_state, sparse.last_hidden_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_padding_block_gives_finite_gradients(kind):
    drafter = small_drafter().train()
    inputs = build_block_inputs(
        torch.randint(0, 48, (2, SEQ)), torch.ones(2, SEQ), [torch.tensor([3, 9]), torch.tensor([4])], BS, 49
    )
    out = drafter(
        torch.randn(2, 2 * BS, 32),
        torch.randn(2, SEQ, 64),
        inputs.position_ids,
        MASKS[kind](inputs.anchors, SEQ, BS),
    ).last_hidden_state
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters())


def test_cached_inference_equals_one_shot_forward():
    """Feeding context in pieces through a transformers DFlashCache matches seeing it all at once."""
    from transformers.cache_utils import DFlashCache

    drafter = small_drafter()
    features = torch.randn(1, 12, 64)
    block = torch.randn(1, BS, 32)
    positions = torch.arange(12 + BS)[None]
    with torch.no_grad():
        full = drafter(block, features, positions).last_hidden_state
        cache = DFlashCache(config=drafter.config)
        drafter(
            torch.randn(1, BS, 32),
            features[:, :7],
            torch.cat([positions[:, :7], torch.arange(7, 7 + BS)[None]], 1),
            cache=cache,
        )
        cache.crop(-BS)  # drop the first block's keys: only context stays cached
        pieces = drafter(block, features[:, 7:], positions[:, 7:], cache=cache).last_hidden_state
    torch.testing.assert_close(pieces, full, rtol=1e-5, atol=1e-5)


def test_lean_norm_and_swiglu_have_exact_gradients(monkeypatch):
    """RMSNorm and the MLP half of a layer keep fewer tensors for backward than autograd would, and the MLP
    recomputes itself in row pieces in backward; values and gradients equal plain autograd's."""
    import dflash_ddp.drafter.model as model
    from dflash_ddp.drafter.model import DFlashMLP, RMSNorm

    norm = RMSNorm(8, 1e-6).double()
    norm.weight.data.normal_()
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: norm(x), (x, norm.weight))
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x), reference)
    monkeypatch.setattr(model, "MLP_ROWS", 3)  # several pieces, the last one short
    mlp, post_norm = DFlashMLP(small_drafter().config).double(), RMSNorm(32, 1e-6).double()
    post_norm.weight.data.normal_()
    h = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h: mlp(h, post_norm), (h,))
    params = [h, post_norm.weight, *mlp.parameters()]
    n = post_norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    plain = h + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(n)) * mlp.up_proj(n))
    lean = mlp(h, post_norm)
    torch.testing.assert_close(lean, plain, rtol=0, atol=1e-12)
    grad = torch.randn_like(plain)
    for got, want in zip(
        torch.autograd.grad(lean, params, grad), torch.autograd.grad(plain, params, grad), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_gradient_checkpointing_gives_the_same_outputs_and_gradients():
    from dflash_ddp.drafter.attention import block_layout

    inputs, features, embeds = setup_inputs()
    layout = block_layout(inputs.anchors, SEQ, BS, 4, torch.device("cpu"))
    results = []
    for checkpointing in (False, True):
        drafter = small_drafter().train()
        drafter.gradient_checkpointing = checkpointing
        out = drafter(embeds, features, inputs.position_ids, layout).last_hidden_state
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in drafter.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-6, atol=1e-7)


def family_drafter(family: str):
    """A small training drafter of `family` (seed 0)."""
    from dflash_ddp.drafter.dflash2 import DFlash2DraftConfig
    from dflash_ddp.drafter.dspark import DSparkDraftConfig
    from dflash_ddp.drafter.families import build_model

    config = small_draft_config()
    if family == "dflash2":
        config = DFlash2DraftConfig(**config.to_dict(), conv_group_size=8, conv_kernel_size=3)
    if family == "dspark":
        config = DSparkDraftConfig(**config.to_dict(), markov_rank=8)
    torch.manual_seed(0)
    return build_model(config).train()


def outputs_and_gradients(drafter, contexts=(SEQ,)):
    """The drafter's outputs and summed parameter gradients over one chunk per context length in
    `contexts` (each with its own anchors, so that draft positions and context differ from chunk to chunk)."""
    outs = []
    for length in contexts:
        g = torch.Generator().manual_seed(length)
        anchors = torch.arange(1, length - BS, 3)
        inputs = build_block_inputs(
            torch.zeros(1, length, dtype=torch.long), torch.ones(1, length), [anchors], BS, 49
        )
        positions = inputs.anchors.shape[1] * BS
        embeds = torch.randn(1, positions, 32, generator=g)
        features = torch.randn(1, length, 64, generator=g)
        layout = block_layout(inputs.anchors, length, BS, 4, torch.device("cpu"))
        out = drafter(embeds, features, inputs.position_ids, layout).last_hidden_state
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        outs.append(out.detach())
    return outs, {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_keeping_every_activation_gives_the_recomputing_outputs_and_gradients(family):
    """--recompute none (plain autograd, nothing recomputed, norms' backward whole) against qkv_mlp (today's
    path, the reference): the same outputs and, to fp32 rounding, the same gradients."""
    reference = outputs_and_gradients(family_drafter(family))
    keeping = family_drafter(family)
    keeping.set_recompute(False)
    outs, grads = outputs_and_gradients(keeping)
    torch.testing.assert_close(outs, reference[0], rtol=0, atol=1e-6)
    assert grads.keys() == reference[1].keys()
    for name, grad in reference[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


# graphs compiled per layer class: before attention and after it, two each (the first layer's input needs no
# gradient); DFlash2's hold its convolutions too. DSpark and LiLiCorr are built of these same two layer classes.
COMPILED_GRAPHS = {"dflash": (4, 2), "dflash2": (4, 2)}


@pytest.mark.parametrize("family", sorted(COMPILED_GRAPHS))
def test_compiled_regions_train_as_eager_and_compile_once_for_every_chunk_shape(family):
    """On CUDA a drafter that keeps its activations runs its layers' elementwise chains compiled (here under
    aot_eager, the same graphs without code generation): the same outputs and gradients as eagerly, and one
    graph per region whatever the chunk's draft positions and context (DFlash's after attention holds o_proj,
    the residuals and the MLP)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    graphs, with_o_proj = COMPILED_GRAPHS[family]
    contexts = (SEQ, 40, 31, 52)
    eager = family_drafter(family)
    eager.set_recompute(False)
    reference = outputs_and_gradients(eager, contexts)
    compiled = family_drafter(family)
    compiled.set_recompute(False)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled.compile_regions(counter)
    outs, grads = outputs_and_gradients(compiled, contexts)
    torch.testing.assert_close(outs, reference[0], rtol=0, atol=1e-6)
    for name, grad in reference[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert counter.frame_count == graphs, counter.frame_count
    assert sum("o_proj" in graph.code for graph in counter.graphs) == with_o_proj
    with torch.no_grad():  # decoding runs eagerly: nothing more compiles
        compiled.eval()(torch.randn(1, BS, 32), torch.randn(1, 8, 64), torch.arange(8 + BS)[None])
    assert counter.frame_count == graphs


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("path", sorted(MASKS))
def test_the_sliding_window_in_training_is_the_window_in_decoding(family, path):
    """A drafter whose first layer slides (window 6) and second does not: each training block's output (its
    layers on LayerMasks of the chosen path) equals the cached decoding forward of that block alone, which
    builds the window from positions: the same rule in both."""
    from transformers import DynamicCache

    from dflash_ddp.drafter.attention import LayerMasks
    from dflash_ddp.drafter.dflash2 import DFlash2DraftConfig
    from dflash_ddp.drafter.families import build_model

    fields = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}
    config = small_draft_config(**fields)
    if family == "dflash2":
        config = DFlash2DraftConfig(**config.to_dict(), conv_group_size=8, selector_top_k=4, selector_rank=4)
    torch.manual_seed(0)
    drafter = build_model(config).eval()
    with torch.no_grad():
        for p in drafter.parameters():  # the identity start would hide the convolutions
            p.add_(torch.randn_like(p) * 0.1)
    inputs, features, embeds = setup_inputs()
    anchors = inputs.anchors
    build = MASKS[path]
    masks = LayerMasks(build(anchors, SEQ, BS), build(anchors, SEQ, BS, 6))
    with torch.no_grad():
        trained = drafter(embeds, features, inputs.position_ids, masks).last_hidden_state
        for slot, a in enumerate(ANCHORS):
            block = slice(slot * BS, (slot + 1) * BS)
            positions = torch.arange(a + BS)[None]
            decoded = drafter(
                embeds[:, block], features[:, :a], positions, cache=DynamicCache()
            ).last_hidden_state
            torch.testing.assert_close(decoded, trained[:, block], rtol=1e-5, atol=1e-5)
        # and the window matters: with full attention everywhere the first block's output differs
        everywhere = drafter(embeds, features, inputs.position_ids, LayerMasks(masks.full, masks.full))
        assert not torch.allclose(everywhere.last_hidden_state[:, 2 * BS :], trained[:, 2 * BS :])


def test_a_yarn_targets_rope_is_the_drafters_at_long_positions():
    """A Qwen3 target with YaRN (factor 4 over 32768 positions, as Qwen3 serves past 32K): the drafter built
    from it has the target's cos/sin (attention scaling included) at positions up to 128K."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from dflash_ddp.drafter.config import drafter_config_for
    from dflash_ddp.drafter.model import RotaryEmbedding
    from dflash_ddp.target_model.info import target_info_from_config

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    target = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        max_position_embeddings=131072,
        rope_parameters=yarn,
    )
    info = target_info_from_config(target, None)
    config = drafter_config_for(info, 1, [1, 3], 3, 4)
    assert config.rope_parameters["rope_type"] == "yarn"
    positions = torch.tensor([[0, 1, 4095, 32767, 40000, 65535, 131071]])
    cos, sin = RotaryEmbedding(config)(positions, torch.float32)
    reference = Qwen3RotaryEmbedding(target)
    want_cos, want_sin = reference(torch.zeros(1, 7, 16), positions)
    torch.testing.assert_close(cos, want_cos, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=1e-5, atol=1e-6)
