"""The drafter's optimizer (--optimizer): AdamW, or Muon for the weight matrices with AdamW for the rest.

Muon (torch.optim.Muon) orthogonalises each 2-D weight's momentum update by Newton-Schulz iterations; its
learning rate is scaled to match AdamW's update RMS (`adjust_lr_fn="match_rms_adamw"`), so one
--learning_rate serves both. Norm weights (1-D), DFlash2's base kernels (3-D) and its selector's codebooks
(lookup tables, as embeddings are) stay with AdamW. The drafter has no embedding and no LM head of its own
(both are the target's, frozen), so every other matrix it trains goes to Muon.

The orthogonalisation (--muon_orthogonalisation) is torch's five Newton-Schulz iterations (`newton_schulz_5`)
by default. `polar_express_3` runs three steps of Polar Express instead (Amsel et al. 2025; the first three of
the five quintics it published, which nanochat and modded-nanogpt run), scaled by the Gram matrix's norm, a
tighter bound on the spectral norm than torch's Frobenius norm: three fifths of the cost, which at one
sequence per step on a CPU is most of what Muon adds to a step, and drafters as good on the embedded
target; but its first steps expand (they are made to be followed by two more), so it carries the last-bit
differences between two CPUs' kernels into visibly different drafters, where the five iterations do not
(docs/benchmarks.md (h)).

Precision (`orthogonalisation_dtype`): bf16 on GPUs, where it is the fast path; fp32 on a CPU, since a CPU
without bf16 instructions multiplies bf16 matrices about 15x slower than fp32, and bf16 kernels round
differently from one CPU to the next (with and without those instructions), which made CPU runs differ
between machines and turned the last-bit differences of a sharded target's features into visible weight
differences. Everything else (momentum, Nesterov, the rate, weight decay, the state dict) is torch's Muon
unchanged.

Grouping (`grouped`, by default on CUDA): each of the drafter's layers holds one matrix of every shape (its 5
layers: 5 q projections, 5 down projections, ...), and torch's step orthogonalises them one by one, some
twenty small kernel launches a matrix that left the GPU idle. `grouped_muon_step` stacks the updates of one
shape and runs the orthogonalisation once per shape as batched products (`batched_newton_schulz`,
`batched_polar_express`), each matrix still scaled by its own norm; the rest of the step and the state are
torch's. A CPU keeps torch's per-matrix step with the fp32 replacement, which its runs' resume and
split-equality checks compare bit for bit (batched kernels round differently from the per-matrix ones).
"""

from __future__ import annotations

import contextlib

import torch
import torch.optim._muon as torch_muon
from torch import nn

OPTIMIZERS = ("adamw", "muon")
BETAS = (0.9, 0.95)
ORTHOGONALISATIONS = ("newton_schulz_5", "polar_express_3")
DEFAULT_ORTHOGONALISATION = "newton_schulz_5"
# the settings that train only with --optimizer muon
MUON_SETTINGS = ("muon_orthogonalisation",)
# Polar Express's first three quintics (a, b, c: x -> a x + b x^3 + c x^5 on the singular values); its
# schedule is greedy, each step the best on the interval the steps before leave, so a prefix is the best
# schedule of its length
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
)


def orthogonalisation_dtype(device: torch.device) -> torch.dtype:
    """The precision of Muon's orthogonalisation on `device`: bf16 on CUDA, as torch does; fp32 elsewhere,
    which every CPU runs fast and rounds the same way."""
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


def polar_express(grad: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Three Polar Express steps on the 2-D `grad`, computed in `dtype`: an approximate orthogonalisation
    U S' V^T of grad = U S V^T, as torch's Newton-Schulz iterations give, in three steps instead of five.

    The scale is ||G G^T||_F^(1/2), at least the spectral norm and closer to it than ||G||_F (by up to the
    fourth root of the rank); it is taken in fp32 whatever `dtype`, and the Gram matrix it needs is the
    first step's."""
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    gram = x @ x.T
    scale = gram.norm().sqrt().clamp(min=eps)
    x, gram = (x / scale).to(dtype), (gram / scale**2).to(dtype)
    for step, (a, b, c) in enumerate(POLAR_EXPRESS):
        if step:
            gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def batched_newton_schulz(
    grads: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """`newton_schulz` of each matrix of `grads` [n, rows, cols] at once, by batched products."""
    a, b, c = coefficients
    x = grads.to(dtype)
    tall = grads.size(-2) > grads.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def batched_polar_express(grads: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """`polar_express` of each matrix of `grads` [n, rows, cols] at once, by batched products."""
    tall = grads.size(-2) > grads.size(-1)
    x = grads.float().mT if tall else grads.float()
    gram = torch.bmm(x, x.mT)
    scale = gram.norm(dim=(-2, -1), keepdim=True).sqrt().clamp(min=eps)
    x, gram = (x / scale).to(dtype), (gram / scale**2).to(dtype)
    for step, (a, b, c) in enumerate(POLAR_EXPRESS):
        if step:
            gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def batched_orthogonalisation(
    name: str, updates: torch.Tensor, group: dict, dtype: torch.dtype
) -> torch.Tensor:
    """The orthogonalisation --muon_orthogonalisation `name` of the stacked `updates` in `dtype`, with the
    settings of torch's Muon param `group`."""
    if name == "polar_express_3":
        return batched_polar_express(updates, group["eps"], dtype)
    return batched_newton_schulz(updates, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)


def grouped_by_default(device: torch.device) -> bool:
    """Whether Muon orthogonalises same-shaped matrices together on `device`: on CUDA, where one batched
    product replaces a launch per matrix; not on a CPU, whose runs stay bit-identical to torch's per-matrix
    step."""
    return device.type == "cuda"


def grouped_muon_step(muon: torch.optim.Muon, name: str, dtype: torch.dtype) -> None:
    """torch's Muon step (`_single_tensor_muon`: its momentum buffers in `muon.state`, Nesterov, rate,
    decoupled weight decay) for every parameter with a gradient, with the orthogonalisation `name` in `dtype`
    run once per group and shape on the stacked updates."""
    for group in muon.param_groups:
        lr, momentum = torch_muon._to_scalar(group["lr"]), group["momentum"]
        by_shape: dict[torch.Size, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for param in group["params"]:
            if param.grad is None:
                continue
            state = muon.state[param]
            if "momentum_buffer" not in state:  # as torch's _init_group
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(param.grad, 1 - momentum)
            update = param.grad.lerp(buf, momentum) if group["nesterov"] else buf
            by_shape.setdefault(param.shape, []).append((param, update))
        for shape, members in by_shape.items():
            updates = torch.stack([update for _, update in members])
            orthogonal = batched_orthogonalisation(name, updates, group, dtype)
            adjusted_lr = torch_muon._adjust_lr(lr, group["adjust_lr_fn"], shape)
            for (param, _), update in zip(members, orthogonal, strict=True):
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-adjusted_lr)


def orthogonalisation(name: str, dtype: torch.dtype):
    """The function torch's Muon step calls as `_zeropower_via_newtonschulz(grad, coefficients, steps, eps)`
    for --muon_orthogonalisation `name` in `dtype`; None where that is torch's own (its iterations in bf16)."""
    if name == "polar_express_3":
        return lambda grad, coefficients, steps, eps: polar_express(grad, eps, dtype)
    if dtype == torch.bfloat16:
        return None
    return lambda grad, coefficients, steps, eps: newton_schulz(grad, coefficients, steps, eps, dtype)


@contextlib.contextmanager
def _orthogonalising_with(replacement):
    """torch's Muon step with `replacement` for its orthogonalisation (None: torch's own): the step looks the
    function up in its module when it runs, so replacing it there for the step's duration changes nothing
    else."""
    if replacement is None:
        yield
        return
    original = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = replacement
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = original


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for `matrices`, AdamW for `others`, stepped together as one optimizer.

    `param_groups` are the two inner optimizers' own groups, so the learning-rate schedule and a resume set
    the rate on the groups that step; the state dict holds both optimizers' states. `orthogonalisation`: one of
    ORTHOGONALISATIONS; `ortho_dtype`: its precision (unset: `orthogonalisation_dtype` of the matrices'
    device); `grouped`: whether same-shaped matrices are orthogonalised together (`grouped_muon_step`; unset:
    `grouped_by_default` of the matrices' device)."""

    def __init__(
        self,
        matrices: list[nn.Parameter],
        others: list[nn.Parameter],
        lr: float,
        weight_decay: float,
        ortho_dtype: torch.dtype | None = None,
        orthogonalisation: str = DEFAULT_ORTHOGONALISATION,
        grouped: bool | None = None,
    ):
        for name in ("_zeropower_via_newtonschulz", "_adjust_lr", "_to_scalar"):
            if not callable(getattr(torch_muon, name, None)):
                raise RuntimeError(
                    f"torch {torch.__version__} has no torch.optim._muon.{name} to run Muon's step with "
                    "its orthogonalisation replaced: install the torch the README pins, or pass --optimizer adamw"
                )
        device = matrices[0].device if matrices else torch.device("cpu")
        self.grouped = grouped_by_default(device) if grouped is None else grouped
        self.ortho_dtype = orthogonalisation_dtype(device) if ortho_dtype is None else ortho_dtype
        self.orthogonalisation = orthogonalisation
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
        if self.grouped:
            grouped_muon_step(self.muon, self.orthogonalisation, self.ortho_dtype)
        else:
            with _orthogonalising_with(orthogonalisation(self.orthogonalisation, self.ortho_dtype)):
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


def trains_nothing(config: dict, key: str) -> bool:
    """Whether setting `key` of a run's `config` (a checkpoint's, as a dict) is idle: a Muon setting in an
    AdamW run."""
    return key in MUON_SETTINGS and config.get("optimizer") != "muon"


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
    model: nn.Module,
    name: str,
    lr: float,
    weight_decay: float,
    fused: bool,
    orthogonalisation: str = DEFAULT_ORTHOGONALISATION,
) -> torch.optim.Optimizer:
    """The optimizer --optimizer names for `model`'s parameters. `fused` (AdamW alone): the fused kernel,
    which can skip a non-finite step on the device; `orthogonalisation` (Muon alone): one of
    ORTHOGONALISATIONS."""
    if name == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=lr, weight_decay=weight_decay, betas=BETAS, fused=fused
        )
    matrices = muon_matrices(model)
    chosen = {id(p) for p in matrices}
    others = [p for p in model.parameters() if id(p) not in chosen]
    return MuonWithAdamW(matrices, others, lr, weight_decay, orthogonalisation=orthogonalisation)
