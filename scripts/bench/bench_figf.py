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
MiTA's forward (``kernel_profile.py --figf``); dense attention hides them. The batch search then starts at
``--compile-start-tokens`` / N and tries at most three batch sizes (each one is a recompilation).
``--compile-mode max-autotune-no-cudagraphs`` compiles both models with inductor's GEMM autotuning (where it picks a
Triton GEMM, pointwise ops such as the GELU may fuse into it; figf_compiled_max_autotune.csv); it changes only the
layers around attention, the same for both models, and matters only where they weigh, i.e. for MiTA.

``--fused-mlp`` runs each block's second half (residual add, norm, MLP, residual add) as one Triton kernel in both
models (:mod:`mita.ops.fused_mlp`; the same parameters and rounding steps), for a model whose layers around attention
cost less; the CSV name gets ``_fused_mlp`` and its ``mlp`` column says which was used.

    python scripts/bench/bench_figf.py --out results/bench [--max-n 1048576] [--heads 2] [--graph] [--compile]
        [--fused-mlp]
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

from common import (  # noqa: E402
    capture_failure,
    environment,
    fused_mlp_correct,
    mita_correct,
    mlp_settings,
    time_ms,
    write_csv,
)

from mita.ops import fused_mlp  # noqa: E402
from mita.ops.fused_mlp import residual_mlp  # noqa: E402
from mita.registry import create_attention  # noqa: E402

DIM, DEPTH, MLP_RATIO = 128, 3, 4


class Block(nn.Module):
    """Pre-norm encoder block: x + attn(LN x), then x + MLP(LN x).

    ``fused_mlp``: the second residual add, the norm, the MLP and its residual add run as one Triton kernel
    (:func:`mita.ops.fused_mlp.residual_mlp`; same parameters, same model)."""

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
        help="both models run each block's MLP half as one Triton kernel (mita/ops/fused_mlp.py); CSV name gets "
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
        fused_mlp.MLP_CONFIG.update(mlp_settings(args.mlp_config))
    compiled = "compiled" if args.compile else "eager"
    mlp = f"fused (Triton, {fused_mlp.MLP_CONFIG})" if args.fused_mlp else "modules"
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
