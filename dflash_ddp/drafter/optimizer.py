"""The drafter's optimizer (--optimizer): AdamW, or Muon for the weight matrices with AdamW for the rest.

Muon (torch.optim.Muon) orthogonalises each 2-D weight's momentum update by Newton-Schulz iterations; its
learning rate is scaled to match AdamW's update RMS (`adjust_lr_fn="match_rms_adamw"`), so one
--learning_rate serves both. Norm weights (1-D), DFlash2's base kernels (3-D) and its selector's codebooks
(lookup tables, as embeddings are) stay with AdamW. The drafter has no embedding and no LM head of its own
(both are the target's, frozen), so every other matrix it trains goes to Muon.

torch runs the Newton-Schulz iterations in bf16, the fast path on GPUs. On a CPU they run in fp32 here
(`orthogonalisation_dtype`): a CPU without bf16 instructions multiplies bf16 matrices about 15x slower than
fp32, and bf16 kernels round differently from one CPU to the next (with and without those instructions), so
bf16 made CPU runs differ between machines and turned the last-bit differences of a sharded target's
features into visible weight differences. Everything else (momentum, Nesterov, the rate, weight decay, the
state dict) is torch's Muon unchanged.
"""

from __future__ import annotations

import contextlib

import torch
import torch.optim._muon as torch_muon
from torch import nn

OPTIMIZERS = ("adamw", "muon")
BETAS = (0.9, 0.95)


def orthogonalisation_dtype(device: torch.device) -> torch.dtype:
    """The precision of Muon's Newton-Schulz iterations on `device`: bf16 on CUDA, as torch does; fp32
    elsewhere, which every CPU runs fast and rounds the same way."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(
    grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """torch's quintic Newton-Schulz orthogonalisation of the 2-D `grad` (torch.optim._muon, after Keller
    Jordan's Muon), computed in `dtype` instead of bf16 alone."""
    a, b, c = coefficients
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextlib.contextmanager
def _orthogonalising_in(dtype: torch.dtype):
    """torch's Muon step with its Newton-Schulz iterations in `dtype`: the step looks the function up in its
    module when it runs, so replacing it there for the step's duration changes nothing else."""
    if dtype == torch.bfloat16:
        yield
        return
    original = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = lambda grad, coefficients, steps, eps: newton_schulz(
        grad, coefficients, steps, eps, dtype
    )
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = original


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for `matrices`, AdamW for `others`, stepped together as one optimizer.

    `param_groups` are the two inner optimizers' own groups, so the learning-rate schedule and a resume set
    the rate on the groups that step; the state dict holds both optimizers' states. `ortho_dtype`: the
    precision of the orthogonalisation (unset: `orthogonalisation_dtype` of the matrices' device)."""

    def __init__(
        self,
        matrices: list[nn.Parameter],
        others: list[nn.Parameter],
        lr: float,
        weight_decay: float,
        ortho_dtype: torch.dtype | None = None,
    ):
        if not callable(getattr(torch_muon, "_zeropower_via_newtonschulz", None)):
            raise RuntimeError(
                f"torch {torch.__version__} has no torch.optim._muon._zeropower_via_newtonschulz to run Muon's "
                "orthogonalisation in fp32: install the torch the README pins, or pass --optimizer adamw"
            )
        device = matrices[0].device if matrices else torch.device("cpu")
        self.ortho_dtype = orthogonalisation_dtype(device) if ortho_dtype is None else ortho_dtype
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
        with _orthogonalising_in(self.ortho_dtype):
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


def muon_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon orthogonalises: the weight matrices, not the lookup tables the model names in
    `embedding_tables` (a row of a table moves only when its token occurs; Muon's authors keep embeddings,
    like every non-matrix parameter, on AdamW)."""
    tables = set(getattr(model, "embedding_tables", ()))
    return [p for name, p in model.named_parameters() if p.ndim == 2 and name not in tables]


def optimizer_state_bytes(model: nn.Module, name: str) -> int:
    """Bytes of fp32 state the optimizer --optimizer names keeps for `model` (meta tensors will do): AdamW
    two moments per parameter; Muon one momentum per weight matrix, and AdamW's two for the rest."""
    matrices = {id(p) for p in muon_matrices(model)} if name == "muon" else set()
    return sum(4 * (1 if id(p) in matrices else 2) * p.numel() for p in model.parameters())


def build_optimizer(
    model: nn.Module, name: str, lr: float, weight_decay: float, fused: bool
) -> torch.optim.Optimizer:
    """The optimizer --optimizer names for `model`'s parameters. `fused` (AdamW alone): the fused kernel,
    which can skip a non-finite step on the device."""
    if name == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=lr, weight_decay=weight_decay, betas=BETAS, fused=fused
        )
    matrices = muon_matrices(model)
    chosen = {id(p) for p in matrices}
    return MuonWithAdamW(matrices, [p for p in model.parameters() if id(p) not in chosen], lr, weight_decay)
