"""The drafter's configuration: its shape (as wide as the target, DFlash's own depth, taps, mask token and
block size) and the decisions that derive it from the target before anything trains.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import PretrainedConfig

from dflash_ddp.target_model.info import TargetInfo

FULL, SLIDING = "full_attention", "sliding_attention"


class DFlashDraftConfig(PretrainedConfig):
    """Shape of a DFlash drafter. Width follows the target; depth, taps, mask and block are DFlash's own."""

    model_type = "dflash_draft"
    family = "dflash"  # the --drafter value (families.py)
    run_settings: ClassVar[
        tuple[str, ...]
    ] = ()  # the family's own fields, set by the run's settings of those names
    serving_fields: ClassVar[
        tuple[str, ...]
    ] = ()  # the family's own fields of the serving config's dflash_config
    optional_serving: ClassVar[dict] = {}  # serving fields the engines default when a config leaves them out
    serving_top_level: ClassVar[bool] = (
        False  # whether the engines read those fields at the config's top level too
    )
    top_level_serving: ClassVar[
        tuple[tuple[str, object], ...]
    ] = ()  # (name, value) constants read at the top level

    # the fields (a transformers 5 config is a dataclass: each one a keyword argument with its default)
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    rope_parameters: dict | None = None  # None: plain RoPE, theta 1e6
    initializer_range: float = 0.02
    num_target_layers: int = 36
    target_layer_ids: list[int] | tuple[int, ...] = (1, 9, 17, 25, 33)
    mask_token_id: int = 151669
    block_size: int = 16
    # per layer "full_attention" or "sliding_attention" (z-lab's and the engines' names; None: all full),
    # and the window
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # the target's conventions, which the drafter computes with: its embedding's row scale (Gemma's
    # sqrt(hidden), Falcon-H1's multiplier), the soft-capping of its logits (None: none) and their scale
    input_embedding_scale: float = 1.0
    final_logit_softcapping: float | None = None
    logit_scale: float = 1.0
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        self.rope_parameters = dict(self.rope_parameters or {"rope_type": "default", "rope_theta": 1000000.0})
        self.target_layer_ids = list(self.target_layer_ids)
        self.layer_types = list(self.layer_types) if self.layer_types else [FULL] * self.num_hidden_layers
        super().__post_init__(**kwargs)

    @classmethod
    def run_values(cls, run) -> dict:
        """The family's own fields from the run's settings of the same names (`run`: the run's config)."""
        return {name: getattr(run, name) for name in cls.run_settings}

    def settings_to_match(self, source: DFlashDraftConfig) -> tuple[str, ...]:
        """The family's own settings a warm start from `source` (a drafter of the same family) must equal:
        all of them, but for parts one side lacks, which the run starts new or drops."""
        return self.run_settings

    @property
    def slides(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return SLIDING in self.layer_types

    def window_of(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx`, or None for full attention."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING else None

    def shape_errors(self) -> list[str]:
        """What makes this shape unservable, each naming the setting to change (empty when it is sound)."""
        errors = []
        unknown = sorted(set(self.layer_types) - {FULL, SLIDING})
        if unknown or len(self.layer_types) != self.num_hidden_layers:
            errors.append(
                f"sliding_layers: layer_types {self.layer_types} must name {FULL} or {SLIDING} for each of the "
                f"{self.num_hidden_layers} layers"
            )
        if self.slides and (self.sliding_window or 0) < self.block_size:
            errors.append(
                f"sliding_window {self.sliding_window} must be at least block_size {self.block_size}: a block "
                "always sees itself whole"
            )
        return errors

    def extra_saved_per_position(self) -> int:
        """Elements a layer of this family keeps for backward per draft position beyond a DFlash layer's
        (memory.saved_per_position)."""
        return 0

    def kept_normed_inputs_per_position(self) -> int:
        """Elements a layer keeps per draft position when nothing is recomputed (`--recompute none`) beyond what
        every family's attention and MLP then keep (memory.kept_per_position): DFlash's normed attention and
        MLP inputs and one 1/rms."""
        return 2 * self.hidden_size + 1

    def extra_backward_per_position(self) -> int:
        """Elements that exist only during one layer's backward, per draft position, beyond a DFlash layer's
        (memory.backward_per_position)."""
        return 0

    lookup_table_label = "lookup tables"  # the memory plan's name for a family's tables

    def lookup_table_params(self) -> int:
        """Parameters of the family's lookup tables (kept on AdamW), shown apart in the memory plan."""
        return 0

    def extra_loss_bytes(self, rows: int, positions: int, dtype_bytes: int) -> int:
        """Bytes the family's loss holds beside DFlash's, for a loss piece of `rows` rows of a chunk of
        `positions` draft positions (what a family's loss does for the whole chunk at once)."""
        return 0


def resolve_attention(requested: str, device: torch.device) -> str:
    """--attention auto: the compiled flex kernel on CUDA, the block-sparse path elsewhere."""
    if requested != "auto":
        return requested
    return "flex" if device.type == "cuda" else "sparse"


def resolve_mask_token_id(tokenizer, info: TargetInfo, requested: int | None) -> int:
    """The mask token: --mask_token_id, else the tokenizer's mask token; it must have an embedding row."""
    mask_id = requested if requested is not None else getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise ValueError(
            f"the tokenizer of {info.path} defines no mask token: pass --mask_token_id with an id whose "
            f"embedding row exists (an unused/reserved token, < vocab size {info.vocab_size})"
        )
    if not 0 <= mask_id < info.vocab_size:
        raise ValueError(
            f"--mask_token_id {mask_id} is outside the target's embedding (vocab size {info.vocab_size})"
        )
    return mask_id


def default_target_layer_ids(num_layers: int, num_taps: int = 5) -> list[int]:
    """K layers evenly spaced from 1 to N-3 (the paper's choice: [1, 9, 17, 25, 33] for 36 layers)."""
    if num_layers < 4:
        raise ValueError(f"the target has {num_layers} layers; pass --target_layer_ids explicitly")
    last = num_layers - 3
    num_taps = min(num_taps, last)
    if num_taps == 1:
        return [last]
    return [round(1 + i * (last - 1) / (num_taps - 1)) for i in range(num_taps)]


def resolve_target_layer_ids(info: TargetInfo, requested: list[int] | None) -> list[int]:
    """--target_layer_ids, else the paper's default; every id must name a decoder layer of the target that runs
    on text. A default tap on a layer the forward skips on text (Llama 3.2 Vision's cross-attention layers)
    moves to the layer before it, whose output is the stream that layer would pass on."""
    skipped = set(info.image_only_layers)
    if requested is None:
        ids = sorted({i - 1 if i in skipped else i for i in default_target_layer_ids(info.num_layers)})
    else:
        ids = list(requested)
    bad = [i for i in ids if not 0 <= i < info.num_layers]
    if bad:
        raise ValueError(
            f"--target_layer_ids {ids}: {bad} out of range; the target has {info.num_layers} layers (0..{info.num_layers - 1})"
        )
    if sorted(set(ids)) != ids:
        raise ValueError(f"--target_layer_ids {ids}: give distinct ids in increasing order")
    image_only = [i for i in ids if i in skipped]
    if image_only:
        raise ValueError(
            f"--target_layer_ids {ids}: layers {image_only} of model type '{info.model_type}' attend to an image "
            f"and are skipped on text, so they have no output to tap; tap another layer (those: {sorted(skipped)})"
        )
    return ids


def drafter_config_for(
    info: TargetInfo,
    num_layers: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    block_size: int,
    config_class: type[DFlashDraftConfig] = DFlashDraftConfig,
    family_fields: dict | None = None,
    sliding: tuple[int, list[int] | None] = (0, None),
) -> DFlashDraftConfig:
    """A drafter as wide as the target (hidden, MLP, heads, head_dim) with DFlash's own depth and settings;
    `config_class` and `family_fields` (its `run_settings`) choose the family; `sliding` is (--sliding_window,
    --sliding_layers): a window of 0 keeps every layer on full attention, and with a window the layers named
    slide (every layer when none are named, as z-lab's published DFlash2 drafter does). A shape the engines
    could not serve is refused, naming the flag to change."""
    window, sliding_layers = sliding
    if window and sliding_layers is None:
        sliding_layers = list(range(num_layers))
    layer_types = [SLIDING if window and i in (sliding_layers or ()) else FULL for i in range(num_layers)]
    config = config_class(
        **(family_fields or {}),
        vocab_size=info.vocab_size,
        hidden_size=info.hidden_size,
        intermediate_size=info.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=info.num_attention_heads,
        num_key_value_heads=info.num_key_value_heads,
        head_dim=info.head_dim,
        rms_norm_eps=info.rms_norm_eps,
        max_position_embeddings=info.max_position_embeddings,
        rope_parameters=info.rope_parameters,
        num_target_layers=info.num_layers,
        target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id,
        block_size=block_size,
        layer_types=layer_types,
        sliding_window=window or None,
        input_embedding_scale=info.embedding_scale,
        final_logit_softcapping=info.final_logit_softcapping,
        logit_scale=info.logit_scale,
    )
    errors = config.shape_errors()
    if errors:
        raise ValueError(f"the {config.family} drafter for {info.path}: --" + "; --".join(errors))
    return config
