"""Time the MLP half of Figure F's block (residual add, layer norm, fc1, GELU, fc2, residual add) three ways in one
process: PyTorch's modules eager, the same modules through ``torch.compile``, and the fused Triton kernel
(mita/ops/fused_mlp.py) at each launch setting given. Times are medians of CUDA-graph replays (no host overhead);
a setting whose output is further from the float32 modules than 1.5x the bf16 modules' error is reported as FAIL
and not timed.

    python scripts/bench/mlp_bench.py [--rows 1048576,65536] [--dim 128] [--settings bm=64,bh=64,num_warps=4;...]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from common import environment, mlp_settings, time_ms  # noqa: E402

from mita.ops import fused_mlp as fm  # noqa: E402

DEFAULT_SETTINGS = ";".join(
    [
        "bm=64",  # MLP_CONFIG's defaults
        "bh=32",
        "bh=32,reload=1",
        "bh=32,reload=1,erf_poly=1",
        "bh=16,reload=1,erf_poly=1",
        "bh=32,reload=1,erf_poly=1,num_stages=2",
        "bh=32,reload=1,num_warps=8",
        "bh=64,reload=1,num_warps=8",
        "bh=32,reload=1,erf_poly=1,maxnreg=128",
        "bh=32,reload=1,erf_poly=1,num_stages=2,maxnreg=128",
        "bm=32,bh=64,reload=1",
    ]
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1048576,65536")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ratio", type=int, default=4)
    ap.add_argument(
        "--settings", default=DEFAULT_SETTINGS, help="';'-separated settings, each key=value,... over MLP_CONFIG"
    )
    args = ap.parse_args()
    print(environment(), flush=True)
    C, hidden = args.dim, args.ratio * args.dim
    torch.manual_seed(0)
    mod = fm.ResidualMLP(C, hidden).cuda().eval()
    for rows in (int(r) for r in args.rows.split(",")):
        mod.float()
        x = torch.randn(rows, C, device="cuda")
        a = torch.randn(rows, C, device="cuda") * 0.5
        with torch.inference_mode():
            ref = fm.residual_mlp_reference(x, a, mod.norm, mod.fc1, mod.act, mod.fc2)
        mod.bfloat16()
        x, a = x.bfloat16(), a.bfloat16()

        def modules(x=x, a=a):
            return fm.residual_mlp_reference(x, a, mod.norm, mod.fc1, mod.act, mod.fc2)

        compiled = torch.compile(modules)
        with torch.inference_mode():
            base_err = _rel(modules(), ref)
            t_mod, _ = time_ms(modules, "cuda_graph", reps=20)
            compiled()
            t_cmp, _ = time_ms(compiled, "cuda_graph", reps=20)
            gb = 2 * rows * C * 3 / 1e9  # bytes read (x, a) and written (out), bf16
            print(f"rows {rows}: modules {t_mod:.4f} ms, compiled {t_cmp:.4f} ms (bf16 modules' error {base_err:.2e})")
            for setting in args.settings.split(";"):
                saved = dict(fm.MLP_CONFIG)
                fm.MLP_CONFIG.update(mlp_settings(setting))
                try:
                    out = mod(x, a)
                    err = _rel(out, ref)
                    if not err <= 1.5 * base_err + 1e-4:
                        print(f"  {setting}: FAIL (error {err:.2e})", flush=True)
                        continue
                    t, spread = time_ms(lambda x=x, a=a: mod(x, a), "cuda_graph", reps=20)
                    print(
                        f"  {setting}: {t:.4f} ms (spread {spread:.4f}), {t_cmp / t:.2f}x compiled, "
                        f"{gb / t:.2f} TB/s of x, a, out; error {err:.2e}",
                        flush=True,
                    )
                except Exception as e:  # a setting the compiler rejects (shared memory) is reported, not fatal
                    print(f"  {setting}: error {str(e).splitlines()[0][:100]}", flush=True)
                finally:
                    fm.MLP_CONFIG.clear()
                    fm.MLP_CONFIG.update(saved)


if __name__ == "__main__":
    main()
