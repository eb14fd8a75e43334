"""Predicted peak memory of a target rank: its share of the weights it runs plus one forward's activations at
`--tokens_per_batch`, the features in flight and, with soft targets, the LM head's logits chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ddp.parallel.machine import MemoryPlan
from dflash_ddp.target_model.info import (
    COMPRESSED_LAYER_TYPES,
    INDEXED_LAYER_TYPES,
    WINDOWED_LAYER_TYPES,
    TargetInfo,
)
from dflash_ddp.target_model.kernels import runs_reference_scan

SOFT_TARGET_CHUNK = 1024  # positions whose full-vocabulary logits exist at once when taking the top-k
# layer types that keep no keys and build no attention mask (None: a layer a family's config leaves out)
NON_ATTENTION_LAYER_TYPES = ("linear_attention", "conv", "mlp", "moe", None)
HYBRID_ATTENTION = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
# the mask a kind of layer reads where it is another kind's (the families' mask mappings)
MASK_READ_BY = {
    "indexed_attention": "full_attention",  # Mistral Large 4, Kolibri 1.1
    "compressed_sparse_attention": "sliding_attention",  # DeepSeek V4: one mask for every layer
    "heavily_compressed_attention": "sliding_attention",
}


@dataclass(frozen=True)
class TargetLoad:
    """What a target rank holds and runs, as the memory formula reads it."""

    # the bytes of the weights it loads (the truncated text model), before its tensor-parallel share
    weight_bytes: int
    target_layer_ids: list[int]
    layers: int  # decoder layers it runs
    tokens_per_batch: int
    dtype_bytes: int
    inflight: int = 0  # batches sent and not yet received (0 colocated)
    tp_size: int = 1
    unsharded_bytes: int = 0  # of weight_bytes, those a tensor-parallel plan leaves whole on every rank
    attention_split: bool = True  # a group splits the attention's heads (DeepSeek V4's plan does not)
    topk: int = 0  # soft targets: the whole LM head and the top-k of each position
    prefill_tokens: int = 0  # positions run at once (0: a sequence in one pass)
    max_seq_len: int = 0
    device_type: str = "cuda"  # where it runs ("cpu": torch's fused attention there takes fewer shapes)


def target_memory(info: TargetInfo, load: TargetLoad) -> MemoryPlan:
    """Predicted peak of a target rank: its share of the weights it runs (`weight_bytes` over the `tp_size`
    ranks of its tensor-parallel group, but `unsharded_bytes` whole on each), one forward's activations,
    features in flight; with `topk` soft targets also the whole LM head on every rank, one chunk's fp32
    logits and the top-k in flight. With a
    prefill in pieces, the activations of one piece (`prefill_tokens` positions over the batch's rows), the
    KV cache of the whole batch (DeepSeek V4's compressed keys beside it) and the mask its later pieces
    attend through (`attention_mask_bytes`)."""
    target_layer_ids, tokens_per_batch, dtype_bytes = (
        load.target_layer_ids,
        load.tokens_per_batch,
        load.dtype_bytes,
    )
    inflight, tp_size, topk = load.inflight, load.tp_size, load.topk
    width = len(target_layer_ids) * info.hidden_size
    heads, mla = info.num_attention_heads, info.latent_attention
    # a layer's live tensors during a no-grad forward: residual in and out (a hyper-connection target's
    # streams each), normed input and the all-reduced output whole on every rank; the attention's tensors,
    # gate, up and their product split across the group (summed: a hybrid's mixers run side by side, and
    # an MoE layer's routed copies exceed its experts' widths)
    attention_tp = tp_size if load.attention_split else 1
    mixers = attention_width(info) * tp_size // attention_tp + 3 * info.mlp_width
    # Gemma 3n's AltUp layer holds four sets of its streams at once (its input, their predictions, the
    # correction's repeated innovation and the corrected streams) beside a few single-stream tensors
    residual = 4 + 4 * info.residual_streams if info.altup else 2 + 2 * info.residual_streams
    per_token = residual * info.hidden_size + mixers // tp_size
    # Gemma 3n's and 4's per-layer inputs and the keys and values their KV-shared layers reuse, held from
    # the first layer (from the layer that stores them) to the forward's end
    per_token += info.per_layer_inputs + shared_keys_and_values(info, load.layers) // attention_tp
    piece, layers = load.prefill_tokens, load.layers
    indexed = indexed_layers(info, layers)
    pieces = in_pieces(load)
    running = piece if pieces else tokens_per_batch  # positions of all rows run at once
    features = tokens_per_batch * width * dtype_bytes
    # the taps (or the pieces' features so far) are held through the forward; when it ends their
    # concatenation and its masked copy exist beside them (the pieces' list, with a prefill in pieces), the
    # layers' tensors gone: the larger of the two moments
    after = (2 if pieces else 1) * features
    parts = {
        "weights": (load.weight_bytes - load.unsharded_bytes) // tp_size + load.unsharded_bytes,
        "activations": max(running * per_token * dtype_bytes, after),
        "tapped features": features,
        "sends in flight": inflight * tokens_per_batch * width * dtype_bytes,
    }
    # the pieces' keys and values (latent attention: the latent), kept until the batch's last piece
    if pieces:
        width = mla.latent + mla.rope if mla else info.num_key_value_heads * info.head_dim // attention_tp
        # every position of the batch: a windowed layer keeps its window per row, which is every position
        # of a batch of rows shorter than it (DeepSeek V4's compressed keys beside them); keys and values
        # (one tensor in DeepSeek V4's compressed layers, latent attention's latent)
        positions = 0
        for kind in attention_layer_types(info, layers):
            tensors = 1 if mla or kind in info.shared_key_value else 2
            positions += tensors * (tokens_per_batch + compressed_keys(info, kind, tokens_per_batch))
        parts["KV cache"] = positions * width * dtype_bytes
        if indexed:  # and the indexer's keys (DeepSeek V4's: one per compressed block)
            indexer = info.sparse_indexer
            indexer_keys = tokens_per_batch // (indexer.pool if info.key_compression else 1)
            parts["KV cache"] += indexer_keys * indexed * indexer.width * dtype_bytes
        if mla:  # each layer expands the latent of every key so far for every query head
            expanded = heads // attention_tp * (mla.query_key + mla.nope + mla.value)
            parts["expanded keys and values"] = tokens_per_batch * expanded * dtype_bytes
    parts.update(attention_mask_bytes(info, load, running))
    # the masks are built before the first layer runs, beside the embeddings only: the larger moment
    building = parts.pop("building a windowed mask", 0)
    if building:
        # beside the embeddings (a hyper-connection model's streams; Gemma 3n's streams come after the masks)
        # and the per-layer inputs of Gemma 3n and 4
        streams = 1 if info.altup else info.residual_streams
        embeddings = running * (info.hidden_size * streams + info.per_layer_inputs) * dtype_bytes
        parts["activations"] = max(parts["activations"], embeddings + building)
    # a layer's work space lives while it runs, and layers (the indexer before its attention) run one after
    # another: only the largest counts
    workspaces = {"attention scores": parts.pop("attention scores", 0)}
    if indexed:
        workspaces["indexer scores"] = running * row_keys(load) * indexer_pair_bytes(info)
    workspaces["linear layers' reference code"] = running * reference_mixer_bytes(info, load)
    largest = max(workspaces, key=workspaces.get)
    if workspaces[largest]:
        parts[largest] = workspaces[largest]
    if topk:
        parts["LM head"] = info.vocab_size * info.hidden_size * dtype_bytes
        # a chunk's logits, their softmax and the top-k's work space in fp32
        parts["soft-target logits"] = 3 * min(tokens_per_batch, SOFT_TARGET_CHUNK) * info.vocab_size * 4
        parts["soft targets"] = (2 + inflight) * tokens_per_batch * topk * 6  # the top-k, masked, in flight
    return MemoryPlan(parts)


def shared_keys_and_values(info: TargetInfo, layers: int) -> int:
    """Keys and values per token that the first `layers` layers keep for the KV-shared layers after them
    (Gemma 3n and 4: the last earlier layer of each kind stores its own for the shared layers of that kind)."""
    if not info.kv_shared_layers or not info.layer_types:
        return 0
    earlier = info.layer_types[: info.num_layers - info.kv_shared_layers]
    stores = {kind: len(earlier) - 1 - earlier[::-1].index(kind) for kind in set(earlier)}
    return sum(2 * info.num_key_value_heads * info.head_dim for i in stores.values() if i < layers)


def attention_width(info: TargetInfo) -> int:
    """A layer's attention tensors per token, over all heads: the query and the attention's output (grouped
    keys and values are a fraction of them); with latent attention also the query's copy joined to its rope
    part, the keys and values expanded from the latent and the product they are cut from."""
    heads, mla = info.num_attention_heads, info.latent_attention
    if mla:
        return heads * (3 * mla.query_key + mla.nope + 2 * mla.value)
    return 2 * heads * info.head_dim


def attention_layer_types(info: TargetInfo, layers: int) -> list[str]:
    """The softmax-attention kind of each attention layer in the first `layers` decoder layers, skipping
    linear-attention, convolution, Mamba and MLP blocks; a type not known to lack attention counts as one
    (the plan errs high). Every layer is "full_attention" where the family names no types (LongCat-Flash: two
    in each decoder layer); a hybrid layer (attention beside Mamba-2: Falcon-H1's "hybrid",
    "hybrid_sliding") is the attention it runs."""
    if not info.layer_types:
        return ["full_attention"] * layers * info.attention_per_layer
    kinds = [t for t in info.layer_types[:layers] if t not in NON_ATTENTION_LAYER_TYPES]
    return [HYBRID_ATTENTION.get(t, t) for t in kinds]


def row_keys(load: TargetLoad) -> int:
    """The keys a query attends to at most: its row's positions, at most --max_seq_len and the batch's."""
    return min(load.max_seq_len, load.tokens_per_batch) or load.tokens_per_batch


def in_pieces(load: TargetLoad) -> bool:
    """Whether some batch of the run is prefilled in pieces (--target_prefill_tokens below the batch)."""
    return 0 < load.prefill_tokens < load.tokens_per_batch


def compressed_keys(info: TargetInfo, kind: str, keys: int) -> int:
    """The compressed keys that queries with `keys` keys of their own attend to beside them in layers of
    `kind` (DeepSeek V4's compressed layers: one per 4 positions, or 128 in its heavily compressed ones)."""
    rate = info.key_compression.get(kind)
    return keys // rate if rate else 0


def own_keys(info: TargetInfo, load: TargetLoad, kind: str, running: int) -> int:
    """The most keys of its row a query of `kind`'s layers attends to beside compressed ones: every
    position of its row, or in a windowed layer prefilled in pieces the window its cache keeps (one less
    than the window) and the piece's positions of the row (all `running` where a row runs alone)."""
    keys = row_keys(load)
    if not (in_pieces(load) and info.key_window and kind in WINDOWED_LAYER_TYPES):
        return keys
    return min(keys, info.key_window - 1 + min(running, keys))


def indexed_layers(info: TargetInfo, layers: int) -> int:
    """How many of the first `layers` decoder layers run a sparse-attention indexer."""
    if info.sparse_indexer is None:
        return 0
    return sum(t in INDEXED_LAYER_TYPES for t in info.layer_types[:layers])


def indexer_pair_bytes(info: TargetInfo) -> int:
    """Bytes per query-key pair of a row while one layer's indexer runs (transformers' code; layers run one
    at a time): the fp32 product of queries [heads x width] with keys, for which torch's broadcasting matmul
    first copies the keys out for every query ([width] per pair), then the scaled scores and their ReLU
    beside it ([heads] each, a score per pool of keys; DeepSeek V3.2's code keeps two of them at once,
    GLM-5's and DeepSeek V4's three, the same at their released widths), and about 4 bytes around them (the
    heads' weighted sum the top-k reads, masks of the visible keys). Measured on CPU forwards of DeepSeek
    V3.2 at 4-32 heads and GLM-5 at pools of 1-4: the plan 1.00-1.22x the peaks (docs/LOG.md, 2026-12-05)."""
    indexer = info.sparse_indexer
    return 4 * max(indexer.width + indexer.heads, 3 * indexer.heads) // indexer.pool + 4


def reference_mixer_bytes(info: TargetInfo, load: TargetLoad) -> int:
    """Bytes per position of a linear-attention or state-space layer run by transformers' reference
    implementation (kernels.py: on a CPU, or a GPU without the kernel packages), beside the layer's own
    tensors: its fp32 copies of the inputs, the chunked algorithm's intermediates, and KDA's [chunk x key]
    decay per position and head; Mamba-2's chunk states [value x state] shared by a chunk's positions.
    Fitted on CPU forwards of the zoo's hybrids at two widths (more for Mamba-2's chunk and state, and
    Zamba2's, whose B and C copies per head weigh more): the plan 1.04-1.27x their measured peaks, Zamba2's
    with wide heads and small states up to 1.63x (docs/LOG.md, 2026-12-05)."""
    m = info.linear_mixer
    if not runs_reference_scan(info, load.layers, load.device_type):
        return 0
    if m.kind == "mamba2":
        per_head = 11 * m.value + 2 * m.state + 2 * m.chunk + 3 * m.value * m.state // m.chunk
    else:
        per_head = 7 * (m.key + m.value) + m.chunk + (3 * m.chunk * m.key if m.kind == "kda" else 0)
    return m.heads * per_head * 4  # whole on every rank: no tensor-parallel plan splits these layers


def score_bytes(info: TargetInfo, load: TargetLoad) -> int:
    """Bytes per [rows, heads, queries, keys] attention score where each layer materialises its scores (0
    where a fused kernel never does). Eagerly (gpt-oss, DeepSeek V4): the scores, with the mask added,
    their fp32 softmax and its cast back. On the CPU, latent attention's values narrower than its keys,
    which torch's fused CPU kernel refuses (CUDA's memory-efficient one takes them): SDPA's unfused path,
    the scores, their softmax and a boolean check of the masked ones."""
    if info.eager_attention:  # with fp32 sinks: the scores, then fp32 copies joined, shifted and softmaxed
        return 2 * load.dtype_bytes + 8 if info.fp32_sinks else 3 * load.dtype_bytes + 4
    mla = info.latent_attention
    if load.device_type == "cpu" and mla is not None and mla.value != mla.query_key:
        return 2 * load.dtype_bytes + 1
    return 0


def attention_mask_bytes(info: TargetInfo, load: TargetLoad, running: int) -> dict[str, int]:
    """What a target's attention adds where a forward needs an explicit mask: in a piece of the prefill
    after the first (its queries sit after cached keys, which torch's causal flag cannot express), in one
    pass in sliding-window or chunked layers over rows longer than their window (the extractor gives the
    model no padding mask, so SDPA's full-attention layers need none then: TargetFeatureExtractor._piece),
    and always in a family transformers runs eagerly (no SDPA: gpt-oss, DeepSeek V4). A boolean [queries,
    keys] mask per mask such layers read, held through the forward, which each layer's call turns into an
    additive mask of the activations' dtype for every row (eagerly, transformers builds it so at once); grouped keys and values repeated to every query
    head (SDPA's grouped path takes no mask on CUDA); eagerly, each layer's scores [rows, heads, queries,
    keys], at long context the largest part, which pieces bound. In pieces a windowed layer's queries
    attend to its cached window and their piece (DeepSeek V4's also to the compressed keys), not to every
    key before them (the most where a row runs alone): on CPU forwards of one row of 4096 in pieces of
    1024, the plan 1.33x, 1.68x and 1.31x the peaks of DeepSeek V4, Gemma 3 and gpt-oss (2.47x, 3.26x and
    1.32x while every key counted); the repeated keys stay the batch's (rows shorter than the window keep
    every key). Masks the forward builds that no layer reads (`TargetInfo.masks_built`: Ministral's full
    one beside sliding layers only, Qwen2-MoE's sliding one with a window of 0 beside full ones) count as
    a boolean each; a windowed mask is built as two booleans joined (returned as "building a windowed
    mask", a moment before the layers run: Qwen2-MoE's one pass of a row of 4096 1.04x, 0.26x before).
    `running`: the positions of all rows run at once; a row's keys are at most --max_seq_len and the rows'
    together at most --tokens_per_batch. Measured on the CPU (fp32: the mask 0.08 of a forward's 0.11 GiB,
    a test); on an H200 the GPU check's 32K-token prefill in pieces of 8192 peaked 0.73
    GiB above a plan without it, the 0.75 GiB this gives (8192 x 32768 x 3 bytes in bf16)."""
    tokens, keys = load.tokens_per_batch, row_keys(load)
    kinds = set(attention_layer_types(info, load.layers))
    # masks the forward builds that none of these layers reads (Ministral's full one beside sliding layers
    # only, Qwen2-MoE's sliding one beside full layers only)
    unread = set(info.masks_built) - {MASK_READ_BY.get(kind, kind) for kind in kinds}
    if "full_attention" in attention_layer_types(info, info.num_layers):
        # a full layer past the cut: the full mask is sized against its empty cache and skipped
        unread.discard("full_attention")
    scores = score_bytes(info, load)
    if not in_pieces(load) and not scores and info.causal_skip:  # one pass: SDPA's causal kernel, no mask
        kinds.discard("full_attention")
        unread.discard("full_attention")
        if keys < info.key_window:  # nor in windowed layers whose window spans the row
            kinds -= set(WINDOWED_LAYER_TYPES)
            unread -= set(WINDOWED_LAYER_TYPES)
    if not kinds | unread:
        return {}
    dtype_bytes = load.dtype_bytes
    heads = info.num_attention_heads // (load.tp_size if load.attention_split else 1)
    own = {kind: own_keys(info, load, kind, running) for kind in kinds}
    # the keys of each mask the layers read (DeepSeek V4's layers all read its sliding one), and of an unread
    # one the cache's
    widths: dict[str, int] = {}
    for kind in kinds:
        mask = MASK_READ_BY.get(kind, kind)
        widths[mask] = max(widths.get(mask, 0), own[kind])
    widths |= {mask: max(own.values(), default=keys) for mask in unread}
    # a boolean mask each, shared by the rows (a chunked one is per row: transformers' chunks start after
    # each row's left padding); eagerly, an additive one per row in the activations' dtype instead, which
    # the layers add to their scores as it is (transformers' eager_mask)
    booleans = {
        mask: (running if mask == "chunked_attention" else min(running, keys)) * width
        for mask, width in widths.items()
    }
    if info.eager_attention:
        parts = {"attention mask": sum(running * width * dtype_bytes for width in widths.values())}
    else:
        parts = {"attention mask": sum(booleans.values())}
    # a windowed mask is built as the causal one and the window's, then their conjunction: two booleans
    # more while it is built (before the layers run)
    windowed = [size for mask, size in booleans.items() if mask in WINDOWED_LAYER_TYPES]
    if windowed:
        parts["building a windowed mask"] = 2 * max(windowed)
    if not kinds:
        return parts
    # DeepSeek V4's compressed layers attend to their own keys and the compressed ones after them
    attended = max(own[kind] + compressed_keys(info, kind, keys) for kind in kinds)
    if not info.eager_attention:  # the additive copy of the largest mask per row, which SDPA's call makes
        parts["attention mask"] += running * attended * dtype_bytes
    if info.alibi_mask:  # Falcon adds ALiBi onto that copy: a mask per head, held through the layers
        parts["attention mask"] += running * heads * attended * dtype_bytes
    if any(kind in COMPRESSED_LAYER_TYPES for kind in kinds):  # their block bias and the mask joined to it
        compressed = max(compressed_keys(info, kind, keys) for kind in kinds)
        parts["attention mask"] += running * (attended + compressed) * dtype_bytes
    if info.num_attention_heads > info.num_key_value_heads or info.eager_attention:
        # the keys all rows attend to: at most every position (a batch of rows shorter than the window)
        repeated = max(tokens + compressed_keys(info, kind, tokens) for kind in kinds)
        parts["repeated keys and values"] = 2 * repeated * heads * info.head_dim * dtype_bytes
    if scores:  # one layer's
        parts["attention scores"] = running * attended * heads * scores
    return parts
