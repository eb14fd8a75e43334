"""The drafter's optimizers: what each keeps per parameter is what the memory plan counts for it."""

import pytest
import torch

from dflash_ddp.drafter.model import DFlashDraftModel
from dflash_ddp.drafter.optimizer import build_optimizer, optimizer_state_bytes
from dflash_ddp.setup.plan import drafter_sizes

from helpers import small_draft_config


def held_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the per-parameter tensors an optimizer holds after a step (not its scalar step counts)."""
    state = optimizer.state_dict()
    inner = [state] if "state" in state else list(state.values())
    return sum(
        t.numel() * t.element_size()
        for s in inner
        for per_param in s["state"].values()
        for t in per_param.values()
        if torch.is_tensor(t) and t.ndim > 0
    )


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_predicted_state_is_what_the_optimizer_holds_after_a_step(name):
    config = small_draft_config()
    drafter = DFlashDraftModel(config)
    optimizer = build_optimizer(drafter, name, lr=1e-3, weight_decay=0.0, fused=False)
    for p in drafter.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    params = list(drafter.parameters())
    assert held_state_bytes(optimizer) == optimizer_state_bytes(params, name)
    assert drafter_sizes(config, name) == (
        sum(p.numel() for p in params),
        held_state_bytes(optimizer),
    )


def test_muon_keeps_one_momentum_per_matrix_where_adamw_keeps_two():
    params = list(DFlashDraftModel(small_draft_config()).parameters())
    matrices = sum(p.numel() for p in params if p.ndim == 2)
    assert optimizer_state_bytes(params, "adamw") - optimizer_state_bytes(params, "muon") == 4 * matrices
