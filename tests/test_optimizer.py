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
    assert held_state_bytes(optimizer) == optimizer_state_bytes(drafter, name)
    assert drafter_sizes(config, name) == (
        sum(p.numel() for p in params),
        held_state_bytes(optimizer),
    )


def test_muon_keeps_one_momentum_per_matrix_where_adamw_keeps_two():
    drafter = DFlashDraftModel(small_draft_config())
    matrices = sum(p.numel() for p in drafter.parameters() if p.ndim == 2)
    assert optimizer_state_bytes(drafter, "adamw") - optimizer_state_bytes(drafter, "muon") == 4 * matrices


def test_the_fp32_orthogonalisation_agrees_with_torchs_bf16_one_and_bf16_is_torchs_exactly():
    import torch.optim._muon as torch_muon

    from dflash_ddp.drafter.optimizer import newton_schulz

    coefficients = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    for shape in ((48, 160), (160, 48)):  # wide and tall: the tall one is orthogonalised transposed
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        torchs = torch_muon._zeropower_via_newtonschulz(grad, coefficients, 5, 1e-7)
        assert torch.equal(newton_schulz(grad, coefficients, 5, 1e-7, torch.bfloat16), torchs)
        fp32 = newton_schulz(grad, coefficients, 5, 1e-7, torch.float32)
        assert fp32.dtype == torch.float32 and fp32.shape == shape
        torch.testing.assert_close(fp32, torchs.float(), rtol=0.05, atol=0.02)  # bf16's 8 bits of mantissa
        assert not torch.equal(fp32, torchs.float())


def test_polar_express_orthogonalises_in_three_steps_alike_in_fp32_and_bf16():
    """Three Polar Express steps: every singular value of the update lifted from up to a thousand times apart
    into one band (its first steps overshoot, as its schedule plans: wider than torch's five Newton-Schulz
    iterations give, [0.2, 1.2]), the singular vectors kept, fp32 and bf16 alike within bf16's rounding."""
    from dflash_ddp.drafter.optimizer import polar_express

    generator = torch.Generator().manual_seed(0)
    left, _ = torch.linalg.qr(torch.randn(160, 48, generator=generator))
    right, _ = torch.linalg.qr(torch.randn(48, 48, generator=generator))
    grad = (left * torch.logspace(-3, 0, 48)) @ right.T  # singular values from 1e-3 to 1
    for g in (grad, grad.T):  # tall and wide: the tall one is orthogonalised transposed
        out = polar_express(g, 1e-7, torch.float32)
        assert out.dtype == torch.float32 and out.shape == g.shape
        values = torch.linalg.svdvals(out)
        assert values.min() > 0.08 and values.max() < 2.0
        u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
        kept = torch.diagonal(u.T @ out.double() @ vh.T)  # the update along each singular pair of g
        torch.testing.assert_close(kept.norm(), out.double().norm(), rtol=1e-4, atol=0)
        bf16 = polar_express(g, 1e-7, torch.bfloat16)
        assert bf16.dtype == torch.bfloat16
        torch.testing.assert_close(out, bf16.float(), rtol=0.05, atol=0.03)
        assert not torch.equal(out, bf16.float())
    zero = polar_express(torch.zeros(8, 12), 1e-7, torch.float32)
    assert torch.equal(zero, torch.zeros(8, 12))


def muon_after_a_step(ortho_dtype, grads, lr=1e-2, orthogonalisation="newton_schulz_5"):
    from dflash_ddp.drafter.optimizer import MuonWithAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40))
    params = list(model.parameters())
    matrices, others = [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]
    optimizer = MuonWithAdamW(matrices, others, lr, 0.0, ortho_dtype, orthogonalisation)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("orthogonalisation", ["newton_schulz_5", "polar_express_3"])
def test_muon_orthogonalises_in_fp32_on_the_cpu_and_keeps_torchs_state(orthogonalisation):
    import torch.optim._muon as torch_muon

    from dflash_ddp.drafter.optimizer import newton_schulz, orthogonalisation_dtype, polar_express

    assert orthogonalisation_dtype(torch.device("cpu")) == torch.float32
    assert orthogonalisation_dtype(torch.device("cuda", 0)) == torch.bfloat16
    shapes = [(40, 24), (40,), (40,), (40,)]
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    torch.manual_seed(0)
    start = torch.nn.Linear(24, 40).weight.detach().clone()
    cpu_default, opt32 = muon_after_a_step(None, grads, orthogonalisation=orthogonalisation)
    bf16, opt16 = muon_after_a_step(torch.bfloat16, grads, orthogonalisation=orthogonalisation)
    # torch's step with the fp32 orthogonalisation: Nesterov momentum 0.95 from a zero buffer, the
    # RMS-matched rate 0.2 * sqrt(max(A, B)), no weight decay
    update = grads[0].lerp(0.05 * grads[0], 0.95)
    coefficients = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    orthogonal = (
        polar_express(update, 1e-7, torch.float32)
        if orthogonalisation == "polar_express_3"
        else newton_schulz(update, coefficients, 5, 1e-7, torch.float32)
    )
    expected = start - 1e-2 * 0.2 * 40**0.5 * orthogonal
    torch.testing.assert_close(cpu_default[0].weight, expected, rtol=0, atol=1e-7)
    assert not torch.equal(cpu_default[0].weight, bf16[0].weight)
    torch.testing.assert_close(cpu_default[0].weight, bf16[0].weight, rtol=0, atol=1e-3)
    assert torch_muon._zeropower_via_newtonschulz.__module__ == "torch.optim._muon"  # restored after the step

    def layout(state):  # the state dicts' keys, shapes and dtypes: what a checkpoint holds
        return {
            name: {i: {k: (tuple(v.shape), v.dtype) for k, v in s.items()} for i, s in inner["state"].items()}
            for name, inner in state.items()
        }

    assert layout(opt32.state_dict()) == layout(opt16.state_dict())
    opt16.load_state_dict(opt32.state_dict())  # a checkpoint of either resumes in the other
    other = "newton_schulz_5" if orthogonalisation == "polar_express_3" else "polar_express_3"
    _, opt_other = muon_after_a_step(None, grads, orthogonalisation=other)
    assert layout(opt_other.state_dict()) == layout(opt32.state_dict())  # the same state either way


def test_muon_trains_the_same_bits_on_a_cpu_without_bf16_instructions():
    """oneDNN and ATen held to AVX2 (a CPU without bf16 instructions, as CI and many servers are) train the
    same weights as this CPU's fastest path: the orthogonalisation's precision no longer depends on the CPU
    (in bf16 the two differ)."""
    import os
    import subprocess
    import sys

    script = (
        "import torch, hashlib\n"
        "from dflash_ddp.drafter.optimizer import MuonWithAdamW\n"
        "torch.manual_seed(0)\n"
        "w, b = torch.nn.Parameter(torch.randn(96, 320)), torch.nn.Parameter(torch.zeros(96))\n"
        "opt = MuonWithAdamW([w], [b], 1e-2, 0.0)\n"
        "for step in range(3):\n"
        "    w.grad, b.grad = torch.randn(96, 320), torch.randn(96)\n"
        "    opt.step()\n"
        "print(hashlib.sha256(w.detach().numpy().tobytes()).hexdigest())\n"
    )
    digests = []
    for isa in ({}, {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}):
        env = {**os.environ, "OMP_NUM_THREADS": "1", **isa}
        result = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-2000:]
        digests.append(result.stdout.strip())
    assert digests[0] == digests[1]
