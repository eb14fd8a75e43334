"""The drafter's optimizer (--optimizer): AdamW, or Muon for the weight matrices with AdamW for the rest.

Muon (torch.optim.Muon) orthogonalises each 2-D weight's momentum update by Newton-Schulz iterations; its
learning rate is scaled to match AdamW's update RMS (`adjust_lr_fn="match_rms_adamw"`), so one
--learning_rate serves both. Norm weights (1-D) stay with AdamW. The drafter has no embedding and no LM head
of its own (both are the target's, frozen), so every matrix it trains goes to Muon.
"""

from __future__ import annotations

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon")
BETAS = (0.9, 0.95)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for `matrices`, AdamW for `others`, stepped together as one optimizer.

    `param_groups` are the two inner optimizers' own groups, so the learning-rate schedule and a resume set
    the rate on the groups that step; the state dict holds both optimizers' states."""

    def __init__(
        self, matrices: list[nn.Parameter], others: list[nn.Parameter], lr: float, weight_decay: float
    ):
        self.muon = torch.optim.Muon(
            matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"
        )
        self.adamw = torch.optim.AdamW(others, lr=lr, weight_decay=weight_decay, betas=BETAS)
        super().__init__([*matrices, *others], {"lr": lr})
        self._share_groups()

    def _share_groups(self) -> None:
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(
                "the optimizer state is not Muon's with AdamW's (was the run trained with --optimizer adamw?)"
            )
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self._share_groups()  # loading replaced the inner optimizers' group dicts


def optimizer_state_bytes(parameters: list[nn.Parameter], name: str) -> int:
    """Bytes of fp32 state the optimizer --optimizer names keeps for `parameters` (meta tensors will do):
    AdamW two moments per parameter; Muon one momentum per weight matrix, and AdamW's two for the rest."""
    return sum(4 * (1 if name == "muon" and p.ndim == 2 else 2) * p.numel() for p in parameters)


def build_optimizer(
    model: nn.Module, name: str, lr: float, weight_decay: float, fused: bool
) -> torch.optim.Optimizer:
    """The optimizer --optimizer names for `model`'s parameters. `fused` (AdamW alone): the fused kernel,
    which can skip a non-finite step on the device."""
    if name == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=lr, weight_decay=weight_decay, betas=BETAS, fused=fused
        )
    params = list(model.parameters())
    matrices = [p for p in params if p.ndim == 2]
    return MuonWithAdamW(matrices, [p for p in params if p.ndim != 2], lr, weight_decay)
