"""Figure F: inference throughput of a 3-layer Transformer encoder (dim 128, MLP ratio 4), bf16.

Full attention runs on the fastest PyTorch SDPA backend (each is tried at every N, the fastest is kept and
named); MiTA uses the registered MiTA layer (1D landmarks, m * k ~ N / 4). The batch size of each (method, N)
is doubled from 1 while tokens/s improves by more than 5% and memory lasts; out-of-memory is recorded as "OOM".
No speed-up is reported for MiTA when its correctness gate fails.

``--graph`` times replays of a CUDA graph capturing one forward (after a warm-up on a side stream) for both models
instead of eager calls, removing the host launch overhead; the CSV (figf_cuda_graph.csv) says so in its ``timing``
column, and a model that cannot be captured gets ``capture failed: <reason>`` as its tokens/s.

``--compile`` wraps both models in ``torch.compile`` (the same call for each; MiTA's Triton operator enters the
graph as its ``torch.library`` custom ops) and writes figf_compiled.csv. In eager mode the layer norms, GELU, residual
adds and head split/merge copies of this dim-128 model run as separate, slow memory-bound kernels that take most of
MiTA's forward (``profile.py kernels --figf``); dense attention hides them. The batch search then starts at
``--compile-start-tokens`` / N and tries at most three batch sizes (each one is a recompilation).
``--compile-mode max-autotune-no-cudagraphs`` compiles both models with inductor's GEMM autotuning (where it picks a
Triton GEMM, pointwise ops such as the GELU may fuse into it; figf_compiled_max_autotune.csv); it changes only the
layers around attention, the same for both models, and matters only where they weigh, i.e. for MiTA.

``--fused-mlp`` runs each block's second half (residual add, norm, MLP, residual add) as one Triton kernel in both
models (the fused MLP below; the same parameters and rounding steps), for a model whose layers around attention
cost less; the CSV name gets ``_fused_mlp`` and its ``mlp`` column says which was used.

    python scripts/bench/bench_figf.py --out results/bench [--max-n 1048576] [--heads 2] [--graph] [--compile]
        [--fused-mlp] [--mlp-config bh=32,reload=1]

The fused MLP (the first half of this file, bench-only: :func:`residual_mlp`, :class:`ResidualMLP`) computes

    out = x1 + fc2(act(fc1(LayerNorm(x1)))),   x1 = x + a      (a: the attention branch's output)

PyTorch runs this as five or more memory-bound kernels at narrow widths (the residual add, the layer norm, fc1
writing the 4C-wide hidden activations, the activation reading and writing them again, fc2 reading them back; at
C = 128 the hidden tensor is 4x the block's input). Here each program takes a tile of rows, keeps the tile and its
hidden activations on chip (the hidden width in chunks), and writes only ``out``: the block reads x and a once and
writes one tensor. ``--fused-mlp`` uses it in both models, the dense one and MiTA's, since these layers are the
same in both.

Rounding follows PyTorch's half-precision modules step by step: x1, the normalised rows, fc1's output (bias
added), the activation and fc2's output (bias added) are each rounded to the input dtype, the sums in between are
float32; only the order of the float32 sums differs.

Used when the inputs are CUDA (or CPU under ``TRITON_INTERPRET=1``) fp16 / bf16 tensors, C is a power of two in
16..256, the hidden width a multiple of 16, the activation ``nn.GELU`` (either form) and no gradient is needed;
otherwise :func:`residual_mlp` runs :func:`residual_mlp_reference` (the modules themselves), which is also what the
kernel is tested against. Inside ``torch.compile`` the kernel is the custom op ``mita::residual_mlp``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from common import capture_failure, environment, mita_correct, time_ms, write_csv  # noqa: E402

from mita.ops.mita.triton.launch import interpreting  # noqa: E402
from mita.registry import create_attention  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    triton = None

if __name__ == "__main__":
    # One module whether run or imported (profile.py, compile_check.py import it): the custom op below reads this
    # module's MLP_CONFIG, so a second copy of the module must not exist.
    sys.modules.setdefault("bench_figf", sys.modules[__name__])

# ---- The fused MLP kernel (the MLP half of Figure F's block) -------------------------------------------------------

# Launch settings (timed on the GPU in run 16): rows per program, hidden columns per step, warps, pipeline
# stages, a register cap (0: none); ``erf_poly``: exact GELU's erf from an erfc fit (relative error below 1.2e-7, see
# _gelu) instead of libdevice's erff; ``reload``: the residual x1 is parked in the output buffer and read back at the
# end instead of being held in registers across the hidden loop. The defaults were the fastest of the settings timed
# on the H200 (run 16, calls 1-3; 1M rows of Figure F's block: 1.20 ms against 1.88 ms for
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


def mlp_settings(text: str) -> dict[str, int]:
    """``"key=value,..."`` -> launch settings of the fused MLP kernel (integers, keys of ``MLP_CONFIG``).

    Raises:
        SystemExit: an unknown key.
    """
    out = {}
    for kv in filter(None, text.split(",")):
        key, val = (x.strip() for x in kv.split("="))
        if key not in MLP_CONFIG:
            raise SystemExit(f"unknown fused MLP setting {key!r} (keys: {sorted(MLP_CONFIG)})")
        out[key] = int(val)
    return out


def fused_mlp_correct(
    device: str = "cuda", dim: int = 128, hidden: int = 512, dtype: torch.dtype = torch.bfloat16
) -> tuple[bool, str]:
    """Correctness gate of the fused MLP kernel above, which ``--fused-mlp`` puts in both models: ``dtype`` against
    the float32 modules at 1000 rows (not a multiple of its tile), within 1.5x of the modules' own error in
    ``dtype``; also fails when the kernel cannot run these inputs (it would fall back to the
    modules). (Under TRITON_INTERPRET=1 use float16: the interpreter truncates float32 -> bfloat16.)

    Returns:
        ``(ok, message)``.
    """
    torch.manual_seed(0)
    mod = ResidualMLP(dim, hidden).to(device)
    x, a = torch.randn(1000, dim, device=device), torch.randn(1000, dim, device=device)
    with torch.inference_mode():
        ref = residual_mlp_reference(x, a, mod.norm, mod.fc1, mod.act, mod.fc2).double()
        mod = mod.to(dtype)
        xb, ab = x.to(dtype), a.to(dtype)
        why = why_not_fused(xb, ab, mod.norm, mod.fc1, mod.act, mod.fc2)
        if why is not None:
            return False, f"the kernel would not run: {why}"
        out = mod(xb, ab).double()
        half = residual_mlp_reference(xb, ab, mod.norm, mod.fc1, mod.act, mod.fc2).double()
    err, base = ((out - ref).norm() / ref.norm()).item(), ((half - ref).norm() / ref.norm()).item()
    if not err <= 1.5 * base + 1e-4:
        return False, f"rel err {err:.2e} against the {dtype} modules' {base:.2e}"
    return True, "ok"


# ---- Figure F ---------------------------------------------------------------------------------------------------


DIM, DEPTH, MLP_RATIO = 128, 3, 4


class Block(nn.Module):
    """Pre-norm encoder block: x + attn(LN x), then x + MLP(LN x).

    ``fused_mlp``: the second residual add, the norm, the MLP and its residual add run as one Triton kernel
    (:func:`residual_mlp`; same parameters, same model)."""

    def __init__(self, attn: nn.Module, fused_mlp: bool = False) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = attn
        self.mlp = nn.Sequential(nn.Linear(DIM, MLP_RATIO * DIM), nn.GELU(), nn.Linear(MLP_RATIO * DIM, DIM))
        self.fused_mlp = fused_mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.norm1(x))
        if self.fused_mlp:
            return residual_mlp(x, a, self.norm2, self.mlp[0], self.mlp[1], self.mlp[2])
        x = x + a
        return x + self.mlp(self.norm2(x))


def budget(n: int) -> tuple[int, int]:
    """m, k with m * k = N / 4 and m = k when N / 4 is a square (else k = 2 m)."""
    m = 2 ** int(math.floor(math.log2(n / 4) / 2))
    return m, (n // 4) // m


def build(method: str, n: int, heads: int, sdpa: str = "auto", fused_mlp: bool = False) -> nn.Module:
    if method == "full":
        attns = [create_attention("full", DIM, heads, sdpa_backend=sdpa, use_flash_attn=False) for _ in range(DEPTH)]
    else:
        m, k = budget(n)
        attns = [
            create_attention("mita", DIM, heads, m=m, k=k, landmark_layout="1d", backend="triton") for _ in range(DEPTH)
        ]
    return nn.Sequential(*[Block(a, fused_mlp) for a in attns]).cuda().to(torch.bfloat16).eval()


def throughput(model: nn.Module, n: int, batch: int, timing: str = "eager") -> float:
    """Tokens per second of one forward at this batch (median of CUDA-event timings of eager calls or of CUDA-graph
    replays)."""
    x = torch.randn(batch, n, DIM, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        ms, _ = time_ms(lambda: model(x), timing, warmup=1, reps=5, max_s=6.0)
    return batch * n / (ms * 1e-3)


def tune(
    model: nn.Module, n: int, max_tokens: int, timing: str = "eager", start_b: int = 1, max_tries: int = 64
) -> tuple[str | float, int, float]:
    """Best tokens/s over batch sizes start_b, 2 start_b, 4 start_b, ... (at most max_tries of them); returns
    (tokens/s, or "OOM", or "capture failed: <reason>" when not even the first batch could be captured; batch;
    peak MiB)."""
    best, best_b, best_mem, b, tries = None, 0, 0.0, start_b, 0
    while b * n <= max(max_tokens, start_b * n) and tries < max_tries:
        tries += 1
        try:
            torch.cuda.reset_peak_memory_stats()
            tps = throughput(model, n, b, timing)
            mem = torch.cuda.max_memory_allocated() / 2**20
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            break
        except RuntimeError as e:
            if timing == "eager":
                raise
            if best is None:
                return capture_failure(e), b, 0.0
            break
        if best is not None and tps < 1.05 * best:
            if tps > best:
                best, best_b, best_mem = tps, b, mem
            break
        best, best_b, best_mem = tps, b, mem
        b *= 2
    torch.cuda.empty_cache()
    return (best if best is not None else "OOM"), best_b, best_mem


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--max-n", type=int, default=1 << 20)
    ap.add_argument("--min-n", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=1 << 22)
    ap.add_argument("--time-budget-s", type=float, default=300.0)
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile both models (eager timing of the compiled forward); writes figf_compiled.csv",
    )
    ap.add_argument(
        "--compile-mode",
        default="default",
        choices=["default", "max-autotune-no-cudagraphs"],
        help="torch.compile mode of both models with --compile",
    )
    ap.add_argument("--compile-start-tokens", type=int, default=1 << 19, help="first batch * N tried with --compile")
    ap.add_argument(
        "--fused-mlp",
        action="store_true",
        help="both models run each block's MLP half as one Triton kernel (residual_mlp above); CSV name gets "
        "'_fused_mlp'",
    )
    ap.add_argument(
        "--mlp-config", default="", help="with --fused-mlp: launch settings over MLP_CONFIG, key=value,... (integers)"
    )
    ap.add_argument("--dense", default="cudnn,flash,efficient", help="dense SDPA backends tried (fastest kept)")
    ap.add_argument(
        "--graph",
        action="store_true",
        help="time CUDA-graph replays of the forward (no host launch overhead); writes figf_cuda_graph.csv",
    )
    args = ap.parse_args()
    timing = "cuda_graph" if args.graph else "eager"
    csv_name = "figf_cuda_graph.csv" if args.graph else "figf.csv"
    if args.compile:
        csv_name = csv_name.replace(".csv", "_compiled.csv")
        cfg = torch._dynamo.config
        limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, limit, max(getattr(cfg, limit), 64))
    if args.mlp_config and not args.fused_mlp:
        raise SystemExit("--mlp-config sets the fused MLP kernel's launch settings: it needs --fused-mlp")
    if args.fused_mlp:
        MLP_CONFIG.update(mlp_settings(args.mlp_config))
    compiled = "compiled" if args.compile else "eager"
    mlp = f"fused (Triton, {MLP_CONFIG})" if args.fused_mlp else "modules"
    mode = None if args.compile_mode == "default" else args.compile_mode
    if args.compile and mode is not None:
        compiled = f"compiled ({mode})"
        csv_name = csv_name.replace("_compiled.csv", "_compiled_max_autotune.csv")
    if args.fused_mlp:
        csv_name = csv_name.replace(".csv", "_fused_mlp.csv")

    def model_of(method: str, n: int, sdpa: str = "auto") -> nn.Module:
        m = build(method, n, args.heads, sdpa, args.fused_mlp)
        return torch.compile(m, mode=mode) if args.compile else m

    def tune_of(model: nn.Module, n: int, first_tokens: int) -> tuple[str | float, int, float]:
        if not args.compile:
            return tune(model, n, args.max_tokens, timing)
        return tune(model, n, args.max_tokens, timing, start_b=max(1, first_tokens // n), max_tries=3)

    os.makedirs(args.out, exist_ok=True)
    env = environment()
    ok, msg = mita_correct("triton")
    print(f"correctness gate triton: {'PASS' if ok else 'FAIL'} ({msg})", flush=True)
    if args.fused_mlp:  # the speed-up then also rests on the fused MLP kernel
        mlp_ok, mlp_msg = fused_mlp_correct()
        print(f"correctness gate fused MLP: {'PASS' if mlp_ok else 'FAIL'} ({mlp_msg})", flush=True)
        ok, msg = ok and mlp_ok, f"{msg}; fused MLP: {mlp_msg}"
    t_start = time.time()
    rows = []
    n = args.min_n
    while n <= args.max_n:
        if time.time() - t_start > args.time_budget_s:
            rows.append(
                dict(N=n, method="all", tokens_per_s="not run (time budget)", timing=timing, model=compiled, **env)
            )
            n *= 2
            continue
        torch.manual_seed(0)
        full = {}
        for sdpa in args.dense.split(","):
            if n >= 1 << 18 and sdpa == "efficient":
                continue
            try:
                full[sdpa] = tune_of(model_of("full", n, sdpa), n, 1)
            except RuntimeError as e:
                full[sdpa] = (f"error: {str(e).splitlines()[0][:60]}", 0, 0.0)
        numeric = {s: r for s, r in full.items() if isinstance(r[0], float)}
        best_sdpa = max(numeric, key=lambda s: numeric[s][0]) if numeric else None
        failed = [r[0] for r in full.values() if str(r[0]).startswith("capture failed")]
        f_tps, f_b, f_mem = numeric[best_sdpa] if best_sdpa else (failed[0] if failed else "OOM", 0, 0.0)
        m, k = budget(n)
        try:
            m_tps, m_b, m_mem = tune_of(model_of("mita", n), n, args.compile_start_tokens)
        except RuntimeError as e:  # a compile failure (eager errors are bugs and are raised above in tune)
            if not args.compile:
                raise
            m_tps, m_b, m_mem = f"error: {str(e).splitlines()[0][:60]}", 0, 0.0
        speedup = ""
        if isinstance(m_tps, float) and isinstance(f_tps, float):
            speedup = m_tps / f_tps if ok else "refused: correctness gate failed"
        elif isinstance(m_tps, float) and f_tps == "OOM":
            speedup = "full OOM"
        rows.append(
            dict(
                N=n,
                method=f"full ({best_sdpa})",
                tokens_per_s=f_tps,
                batch=f_b,
                peak_mib=f_mem,
                m="",
                k="",
                speedup="",
                timing=timing,
                model=compiled,
                mlp=mlp,
                **env,
            )
        )
        rows.append(
            dict(
                N=n,
                method="mita (triton)",
                tokens_per_s=m_tps,
                batch=m_b,
                peak_mib=m_mem,
                m=m,
                k=k,
                speedup=speedup,
                correctness="PASS" if ok else "FAIL",
                timing=timing,
                model=compiled,
                mlp=mlp,
                **env,
            )
        )
        all_full = {s: r[0] for s, r in full.items()}
        print(
            f"N={n:8d} full[{best_sdpa}] {f_tps} (B={f_b}, {f_mem:.0f} MiB) all={all_full}"
            f" | mita m={m} k={k} {m_tps} (B={m_b}, {m_mem:.0f} MiB) speedup {speedup}",
            flush=True,
        )
        write_csv(os.path.join(args.out, csv_name), rows)
        n *= 2


if __name__ == "__main__":
    main()
