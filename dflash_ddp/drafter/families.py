"""The drafter families `--drafter` chooses from: each is a config class and a model class, the model carrying
its own loss (`loss_terms`) and its own way of drafting a block (`draft_tokens`). The trainer, the decoding,
the checkpoints and the export read a drafter through these alone; a family's settings, metrics and serving
layout are the other places it touches (docs/design.md, "Adding to it").
"""

from __future__ import annotations

from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.dflash2 import DFlash2DraftConfig, DFlash2DraftModel
from dflash_ddp.drafter.dspark import DSparkDraftConfig, DSparkDraftModel
from dflash_ddp.drafter.lilicorr import LiLiCorrDraftConfig, LiLiCorrDraftModel
from dflash_ddp.drafter.model import DFlashDraftModel

# --drafter value -> (config class, model class); the model class's name is the serving architecture
FAMILIES: dict[str, tuple[type[DFlashDraftConfig], type[DFlashDraftModel]]] = {
    "dflash": (DFlashDraftConfig, DFlashDraftModel),
    "dflash2": (DFlash2DraftConfig, DFlash2DraftModel),
    "dspark": (DSparkDraftConfig, DSparkDraftModel),
    "lilicorr": (LiLiCorrDraftConfig, LiLiCorrDraftModel),
}


# other names of the same layouts: vLLM registers a DSpark drafter of a Qwen3 target as Qwen3DSparkModel,
# the name the reference's published drafters carry
ARCHITECTURE_ALIASES = {"Qwen3DSparkModel": "dspark"}


def model_class(config: DFlashDraftConfig) -> type[DFlashDraftModel]:
    """The model class of a drafter config."""
    return FAMILIES[config.family][1]


def build_model(config: DFlashDraftConfig) -> DFlashDraftModel:
    """A drafter of `config`'s family, initialised with the global RNG."""
    return model_class(config)(config)


def architecture(config: DFlashDraftConfig) -> str:
    """The serving config's `architectures` entry for `config`'s family."""
    return model_class(config).__name__


def config_class_for(architectures: list[str] | None, where: str) -> type[DFlashDraftConfig]:
    """The config class of a serving config whose `architectures` is given (absent: DFlash)."""
    known = {model.__name__: config for config, model in FAMILIES.values()}
    known |= {alias: FAMILIES[family][0] for alias, family in ARCHITECTURE_ALIASES.items()}
    name = (architectures or ["DFlashDraftModel"])[0]
    if name not in known:
        raise ValueError(
            f"{where}: architectures {architectures}: not a drafter this project loads ({', '.join(known)})"
        )
    return known[name]
