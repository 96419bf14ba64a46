"""The feed-forward half of a pre-norm Transformer block as one Triton kernel, for inference.

    out = x1 + fc2(act(fc1(LayerNorm(x1)))),   x1 = x + a      (a: the attention branch's output)

PyTorch runs this as five or more memory-bound kernels at narrow widths (the residual add, the layer norm, fc1
writing the 4C-wide hidden activations, the activation reading and writing them again, fc2 reading them back; at
C = 128 the hidden tensor is 4x the block's input). Here each program takes a tile of rows, keeps the tile and its
hidden activations on chip (the hidden width in chunks), and writes only ``out``: the block reads x and a once and
writes one tensor. The Figure F benchmark (``scripts/bench/bench_figf.py --fused-mlp``) uses it in both models, the
dense one and MiTA's, since these layers are the same in both.

Rounding follows PyTorch's half-precision modules step by step: x1, the normalised rows, fc1's output (bias
added), the activation and fc2's output (bias added) are each rounded to the input dtype, the sums in between are
float32; only the order of the float32 sums differs.

Used when the inputs are CUDA (or CPU under ``TRITON_INTERPRET=1``) fp16 / bf16 tensors, C is a power of two in
16..256, the hidden width a multiple of 16, the activation ``nn.GELU`` (either form) and no gradient is needed;
otherwise :func:`residual_mlp` runs :func:`residual_mlp_reference` (the modules themselves), which is also what the
kernel is tested against. Inside ``torch.compile`` the kernel is the custom op ``mita::residual_mlp``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mita.ops.mita.triton import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    triton = None

# Launch settings (GPU A/B: scripts/bench/mlp_bench.py): rows per program, hidden columns per step, warps, pipeline
# stages, a register cap (0: none); ``erf_poly``: exact GELU's erf from an erfc fit (relative error below 1.2e-7, see
# _gelu) instead of libdevice's erff; ``reload``: the residual x1 is parked in the output buffer and read back at the
# end instead of being held in registers across the hidden loop. The defaults were the fastest of the settings timed
# on the H200 (results/bench/h200_run16, calls 1-3; 1M rows of Figure F's block: 1.20 ms against 1.88 ms for
# PyTorch's modules through torch.compile and 1.34 ms for 64-column steps holding x1; 168 registers, 3 programs/SM).
MLP_CONFIG: dict[str, int] = {"bm": 64, "bh": 32, "num_warps": 4, "num_stages": 3, "maxnreg": 0, "erf_poly": 1,
                              "reload": 1}  # fmt: skip


def residual_mlp_reference(x: torch.Tensor, a: torch.Tensor, norm: nn.Module, fc1: nn.Module, act: nn.Module,
                           fc2: nn.Module) -> torch.Tensor:  # fmt: skip
    """The modules in PyTorch: ``x1 = x + a; x1 + fc2(act(fc1(norm(x1))))``."""
    x1 = x + a
    return x1 + fc2(act(fc1(norm(x1))))


def why_not_fused(x: torch.Tensor, a: torch.Tensor, norm: nn.Module, fc1: nn.Module, act: nn.Module,
                  fc2: nn.Module) -> str | None:  # fmt: skip
    """None when the Triton kernel can run these inputs and modules, else the reason it cannot."""
    if triton is None:
        return "triton is not installed"
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting()):
        return f"device {x.device.type} is not CUDA (and TRITON_INTERPRET is not set)"
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {x.dtype} (the kernel takes float16 / bfloat16)"
    if a.shape != x.shape or a.dtype != x.dtype or a.device != x.device:
        return "x and a differ in shape, dtype or device"
    if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
        return "norm is not a LayerNorm over the last dimension"
    if not isinstance(fc1, nn.Linear) or not isinstance(fc2, nn.Linear):
        return "fc1 / fc2 are not nn.Linear"
    if not isinstance(act, nn.GELU):
        return f"activation {type(act).__name__} (the kernel has GELU)"
    C, hidden = x.shape[-1], fc1.out_features
    if C & (C - 1) or not 16 <= C <= 256:
        return f"width {C} is not a power of two in 16..256"
    if fc1.in_features != C or fc2.in_features != hidden or fc2.out_features != C or norm.normalized_shape[0] != C:
        return "module widths do not chain C -> hidden -> C"
    if hidden % 16:
        return f"hidden width {hidden} is not a multiple of 16"
    params = [p for mod in (norm, fc1, fc2) for p in mod.parameters()]
    if any(p.dtype != x.dtype or p.device != x.device for p in params):
        return "parameters differ from x in dtype or device"
    if torch.is_grad_enabled() and (x.requires_grad or a.requires_grad or any(p.requires_grad for p in params)):
        return "a gradient is needed (the kernel is inference-only)"
    return None


def residual_mlp(x: torch.Tensor, a: torch.Tensor, norm: nn.LayerNorm, fc1: nn.Linear, act: nn.Module,
                 fc2: nn.Linear) -> torch.Tensor:  # fmt: skip
    """``x + a`` followed by the block's MLP with its residual, fused where possible (see the module docstring);
    x, a ``[..., C]``."""
    if why_not_fused(x, a, norm, fc1, act, fc2) is not None:
        return residual_mlp_reference(x, a, norm, fc1, act, fc2)
    return residual_mlp_op(
        x, a, norm.weight, norm.bias, float(norm.eps), fc1.weight, fc1.bias, fc2.weight, fc2.bias,
        act.approximate == "tanh",
    )  # fmt: skip


@torch.library.custom_op("mita::residual_mlp", mutates_args=())
def residual_mlp_op(
    x: torch.Tensor,
    a: torch.Tensor,
    ln_w: torch.Tensor | None,
    ln_b: torch.Tensor | None,
    eps: float,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    tanh: bool,
) -> torch.Tensor:
    """The kernel on tensors: w1 ``[hidden, C]``, w2 ``[C, hidden]`` (nn.Linear layout); out shaped as x."""
    C = x.shape[-1]
    hidden = w1.shape[0]
    x2, a2 = x.reshape(-1, C).contiguous(), a.reshape(-1, C).contiguous()
    M = x2.shape[0]
    out = torch.empty_like(x2)
    if M == 0:
        return out.view(x.shape)
    cfg = MLP_CONFIG
    bh = min(cfg["bh"], hidden)
    while hidden % bh:
        bh //= 2
    bm = cfg["bm"]
    w1c, w2c = w1.contiguous(), w2.contiguous()
    grid = (triton.cdiv(M, bm),)
    _residual_mlp_kernel[grid](
        x2, a2, out,
        ln_w if ln_w is not None else x2, ln_b if ln_b is not None else x2,
        w1c, b1 if b1 is not None else x2, w2c, b2 if b2 is not None else x2,
        M, eps,
        C=C, HID=hidden, BM=bm, BH=bh,
        HAS_LNW=ln_w is not None, HAS_LNB=ln_b is not None, HAS_B1=b1 is not None, HAS_B2=b2 is not None,
        TANH=tanh, ERF_POLY=bool(cfg["erf_poly"]), RELOAD=bool(cfg["reload"]), UP=interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {}),
    )  # fmt: skip
    return out.view(x.shape)


@residual_mlp_op.register_fake
def _(x, a, ln_w, ln_b, eps, w1, b1, w2, b2, tanh):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


if triton is not None:

    @triton.jit
    def _mm(a, b, acc, UP: tl.constexpr):
        # UP: the CPU interpreter multiplies bf16 tiles as their raw 16-bit patterns, so it upcasts first.
        if UP:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        return tl.dot(a, b, acc)

    @triton.jit
    def _gelu(t, TANH: tl.constexpr, ERF_POLY: tl.constexpr):
        """GELU of float32 t: tanh form, or exact form with libdevice's erf or (ERF_POLY) with
        1 + erf(z) = erfc(-z) from the Chebyshev-fitted erfc(|z|) = u exp(-z^2 + P(u)), u = 1 / (1 + |z| / 2), whose
        fractional error is below 1.2e-7 everywhere (Numerical Recipes, erfcc): an exp, a division, 10 FMAs."""
        if TANH:
            u = 0.7978845608028654 * (t + 0.044715 * t * t * t)
            return 0.5 * t * (2.0 / (1.0 + tl.exp(-2.0 * u)))
        if ERF_POLY:
            az = tl.abs(t) * 0.7071067811865476
            u = 1.0 / (1.0 + 0.5 * az)
            p = -0.82215223 + u * 0.17087277
            p = 1.48851587 + u * p
            p = -1.13520398 + u * p
            p = 0.27886807 + u * p
            p = -0.18628806 + u * p
            p = 0.09678418 + u * p
            p = 0.37409196 + u * p
            p = 1.00002368 + u * p
            e = u * tl.exp(u * p - az * az - 1.26551223)  # erfc(|z|)
            return 0.5 * t * tl.where(t >= 0, 2.0 - e, e)
        return 0.5 * t * (1.0 + tl.math.erf(t * 0.7071067811865476))

    @triton.jit
    def _residual_mlp_kernel(
        x_ptr, a_ptr, out_ptr, lnw_ptr, lnb_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
        M, eps,
        C: tl.constexpr, HID: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr,
        HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr,
        TANH: tl.constexpr, ERF_POLY: tl.constexpr, RELOAD: tl.constexpr, UP: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        cols = tl.arange(0, C)
        hcols = tl.arange(0, BH)
        rmask = rows[:, None] < M
        offs = rows[:, None] * C + cols[None, :]
        x = tl.load(x_ptr + offs, mask=rmask, other=0.0)
        dt = x.dtype
        # x1 = x + a, rounded as PyTorch's add would round it.
        x1 = (x.to(tl.float32) + tl.load(a_ptr + offs, mask=rmask, other=0.0).to(tl.float32)).to(dt)
        xf = x1.to(tl.float32)
        mean = tl.sum(xf, axis=1) / C
        xc = xf - mean[:, None]
        var = tl.sum(xc * xc, axis=1) / C
        h = xc * tl.rsqrt(var + eps)[:, None]
        if HAS_LNW:
            h = h * tl.load(lnw_ptr + cols).to(tl.float32)[None, :]
        if HAS_LNB:
            h = h + tl.load(lnb_ptr + cols).to(tl.float32)[None, :]
        h = h.to(dt)
        if RELOAD:
            tl.store(out_ptr + offs, x1, mask=rmask)
        acc = tl.zeros([BM, C], dtype=tl.float32)
        for j in range(0, HID, BH):
            # fc1 rows j..j+BH (a [BH, C] tile of w1) and fc2 columns j..j+BH (a [C, BH] tile of w2).
            w1t = tl.load(w1_ptr + (j + hcols)[:, None] * C + cols[None, :])
            t = _mm(h, tl.trans(w1t), tl.zeros([BM, BH], dtype=tl.float32), UP)
            if HAS_B1:
                t = t + tl.load(b1_ptr + j + hcols).to(tl.float32)[None, :]
            g = _gelu(t.to(dt).to(tl.float32), TANH, ERF_POLY)
            w2t = tl.load(w2_ptr + cols[:, None] * HID + (j + hcols)[None, :])
            acc = _mm(g.to(dt), tl.trans(w2t), acc, UP)
        if HAS_B2:
            acc = acc + tl.load(b2_ptr + cols).to(tl.float32)[None, :]
        y = acc.to(dt).to(tl.float32)
        if RELOAD:
            tl.debug_barrier()  # x1 was stored by other threads of this program
            x1 = tl.load(out_ptr + offs, mask=rmask, other=0.0)
        tl.store(out_ptr + offs, (x1.to(tl.float32) + y).to(dt), mask=rmask)


class ResidualMLP(nn.Module):
    """A pre-norm block's feed-forward half with its two residual adds: ``forward(x, a) = x1 + mlp(norm(x1))``,
    ``x1 = x + a``; fused by :func:`residual_mlp` in inference, the plain modules otherwise.

    Parameter names (``norm``, ``fc1``, ``act``, ``fc2``) are those of an ``nn.LayerNorm`` and timm's ``Mlp``."""

    def __init__(self, dim: int, hidden: int, eps: float = 1e-5, approximate: str = "none") -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate=approximate)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return residual_mlp(x, a, self.norm, self.fc1, self.act, self.fc2)


__all__ = ["MLP_CONFIG", "ResidualMLP", "residual_mlp", "residual_mlp_op", "residual_mlp_reference", "why_not_fused"]
