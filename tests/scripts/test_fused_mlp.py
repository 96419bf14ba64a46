"""The fused residual + MLP kernel of Figure F's block (scripts/bench/bench_figf.py) against the PyTorch modules.

On the CPU the kernel runs under TRITON_INTERPRET=1 (set by conftest.py). The interpreter rounds float32 -> bfloat16
toward zero where the GPU rounds to nearest, so bf16 results there are held to the float32 reference's tolerance
only; fp16 and the GPU cases are also held to PyTorch's own half-precision modules.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

pytest.importorskip("triton")

from script_loader import load_bench_script  # noqa: E402

fm = load_bench_script("bench_figf")
ResidualMLP, residual_mlp, residual_mlp_reference, why_not_fused = (
    fm.ResidualMLP, fm.residual_mlp, fm.residual_mlp_reference, fm.why_not_fused
)  # fmt: skip

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Relative L2 error against the float32 modules; PyTorch's own half-precision modules are at ~0.3x these.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _case(C: int, hidden: int, shape: tuple[int, ...], dtype: torch.dtype, approximate: str = "none", seed: int = 0):
    torch.manual_seed(seed)
    mod = ResidualMLP(C, hidden, approximate=approximate).to(DEV).eval()
    with torch.no_grad():  # non-trivial norm affine parameters
        mod.norm.weight.normal_(1.0, 0.2)
        mod.norm.bias.normal_(0.0, 0.2)
    x = torch.randn(*shape, C, device=DEV)
    a = torch.randn(*shape, C, device=DEV) * 0.5
    with torch.no_grad():
        ref = residual_mlp_reference(x, a, mod.norm, mod.fc1, mod.act, mod.fc2)
    mod = mod.to(dtype)
    return mod, x.to(dtype), a.to(dtype), ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "C,hidden,shape,approximate",
    [
        (128, 512, (2, 67), "none"),  # Figure F's block; rows not a multiple of the tile
        (32, 80, (5,), "tanh"),  # hidden width not a multiple of the 64-column step; fewer rows than a tile
        (64, 256, (1, 3, 64), "none"),  # extra leading dims, rows exactly a tile
    ],
)
def test_matches_modules(poison, dtype, C, hidden, shape, approximate):
    mod, x, a, ref = _case(C, hidden, shape, dtype, approximate)
    with torch.no_grad():
        assert why_not_fused(x, a, mod.norm, mod.fc1, mod.act, mod.fc2) is None
        out = mod(x, a)
        half = residual_mlp_reference(x, a, mod.norm, mod.fc1, mod.act, mod.fc2)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    err = _rel(out, ref)
    assert err < TOL[dtype], err
    if dtype == torch.float16 or DEV == "cuda":
        # As close to the float32 reference as PyTorch's half-precision modules are, within 1.5x.
        assert err < 1.5 * _rel(half, ref) + 1e-4, (err, _rel(half, ref))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_forms_match_torch(approximate):
    """The kernel's GELU forms (libdevice erf, the erfc fit, tanh) against PyTorch in float64, over the range where
    bf16 activations fall."""
    import triton
    import triton.language as tl

    @triton.jit
    def gelu_kernel(x_ptr, y_ptr, N: tl.constexpr, TANH: tl.constexpr, ERF_POLY: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(y_ptr + o, fm._gelu(tl.load(x_ptr + o), TANH, ERF_POLY))

    x = torch.linspace(-10, 10, 4096, dtype=torch.float64).float().to(DEV)
    ref = torch.nn.functional.gelu(x.double(), approximate=approximate)
    big = ref.abs() > 1e-3
    for poly in (0, 1) if approximate == "none" else (0,):
        y = torch.empty_like(x)
        gelu_kernel[(1,)](x, y, 4096, approximate == "tanh", poly)
        assert (y.double() - ref).abs().max().item() < 2e-6
        # 1 + erf(z) in float32 cancels for negative z (PyTorch's own float32 GELU is off by up to ~1e-3 there);
        # the erfc fit has no cancellation.
        assert ((y.double() - ref).abs() / ref.abs())[big].max().item() < (1e-5 if poly else 2e-3)


def test_no_affine_no_bias(poison):
    torch.manual_seed(1)
    norm = nn.LayerNorm(64, elementwise_affine=False).to(DEV)
    fc1, fc2 = nn.Linear(64, 128, bias=False).to(DEV), nn.Linear(128, 64, bias=False).to(DEV)
    act = nn.GELU()
    x, a = torch.randn(70, 64, device=DEV), torch.randn(70, 64, device=DEV)
    with torch.no_grad():
        ref = residual_mlp_reference(x, a, norm, fc1, act, fc2)
        fc1.half(), fc2.half()
        assert why_not_fused(x.half(), a.half(), norm, fc1, act, fc2) is None
        out = residual_mlp(x.half(), a.half(), norm, fc1, act, fc2)
    assert _rel(out, ref) < TOL[torch.float16]


def test_wrong_bias_breaks_the_match():
    """The comparison above can fail: a kernel that skipped fc2's bias would be far off."""
    mod, x, a, ref = _case(32, 64, (20,), torch.float16)
    with torch.no_grad():
        mod.fc2.bias.add_(0.5)
        out = mod(x, a)
    assert _rel(out, ref) > 10 * TOL[torch.float16]


def test_tile_settings_agree(monkeypatch):
    mod, x, a, ref = _case(64, 192, (100,), torch.float16)
    outs = []
    for cfg in (
        {"bm": 16, "bh": 64, "erf_poly": 0, "reload": 0},
        {"bm": 32, "bh": 32, "erf_poly": 1, "reload": 0},
        {"bm": 64, "bh": 128, "erf_poly": 0, "reload": 1},
        {"bm": 32, "bh": 64, "erf_poly": 1, "reload": 1},
    ):
        for key, val in cfg.items():
            monkeypatch.setitem(fm.MLP_CONFIG, key, val)
        with torch.no_grad():
            outs.append(mod(x, a))
    for out in outs:
        assert _rel(out, ref) < TOL[torch.float16]
        assert (out.float() - outs[0].float()).abs().max().item() <= 2e-3 * outs[0].float().abs().max().item()


def test_training_uses_the_modules():
    """With gradients on, the modules run (same values), so training through the block works."""
    mod, x, a, _ = _case(32, 64, (9,), torch.float16)
    x = x.requires_grad_()
    assert "gradient" in why_not_fused(x, a, mod.norm, mod.fc1, mod.act, mod.fc2)
    out = mod(x, a)
    out.sum().backward()
    assert x.grad is not None and mod.fc1.weight.grad is not None
    assert torch.equal(out.detach(), residual_mlp_reference(x, a, mod.norm, mod.fc1, mod.act, mod.fc2).detach())


def test_reasons_to_fall_back():
    mod, x, a, _ = _case(32, 64, (4,), torch.float16)
    with torch.no_grad():
        assert "dtype" in why_not_fused(x.float(), a.float(), mod.norm, mod.fc1, mod.act, mod.fc2)
        assert "differ" in why_not_fused(x, a[:2], mod.norm, mod.fc1, mod.act, mod.fc2)
        assert "GELU" in why_not_fused(x, a, mod.norm, mod.fc1, nn.ReLU(), mod.fc2)
        m96 = ResidualMLP(96, 192).to(DEV).half()
        x96 = torch.zeros(4, 96, device=DEV, dtype=torch.float16)
        assert "power of two" in why_not_fused(x96, x96, m96.norm, m96.fc1, m96.act, m96.fc2)
        m40 = ResidualMLP(32, 40).to(DEV).half()
        assert "multiple of 16" in why_not_fused(x, a, m40.norm, m40.fc1, m40.act, m40.fc2)
        # The fallback gives the modules' result for such inputs.
        out = residual_mlp(x, a, m40.norm, m40.fc1, m40.act, m40.fc2)
        assert torch.equal(out, residual_mlp_reference(x, a, m40.norm, m40.fc1, m40.act, m40.fc2))


def test_traces_as_one_custom_op():
    """Under torch.compile the kernel enters the graph as mita::residual_mlp (no graph break); its fake
    implementation gives the output's shape and dtype."""
    mod, x, a, ref = _case(32, 64, (3, 17), torch.float16)
    compiled = torch.compile(mod, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(x, a)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert _rel(out, ref) < TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_figure_f_shape(poison, dtype):
    """Figure F's block (C 128, hidden 512) at 16 x 8191 rows."""
    mod, x, a, ref = _case(128, 512, (16, 8191), dtype)
    with torch.no_grad():
        out = mod(x, a)
        half = residual_mlp_reference(x, a, mod.norm, mod.fc1, mod.act, mod.fc2)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1.5 * _rel(half, ref) + 1e-4


def test_custom_op_has_no_defaulted_arguments():
    """torch 2.11 (the GPU machine's) passes a defaulted argument out of a traced call when its value is the default,
    and the autograd wrapper then expects one gradient fewer (run 16; tests/ops/test_triton_op.py checks MiTA's own
    ops): no argument of ``mita::residual_mlp`` has a default."""
    schema = torch.ops.mita.residual_mlp.default._schema
    assert [a.name for a in schema.arguments if a.has_default_value()] == []
