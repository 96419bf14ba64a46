"""Compile the Triton kernels (MiTA's, and the fused MLP of Figure F's block) for sm_90 (H100/H200) without a GPU:
catches compile errors before a device run.

    python scripts/bench/compile_check.py [--maxnreg 128] [--only mita_fwd,route]
    python scripts/bench/compile_check.py --point lra_listops,deit_s    # what one call launches at these points

Each kernel is compiled (TTIR -> TTGIR -> PTX -> cubin with Triton's bundled ptxas) at the constexpr settings the
launchers use for bf16, d 64, with 16-byte aligned pointers and strides as a launch specialises them; the shared
memory of each, its asynchronous copies (cp.async: software-pipelined loads) and barriers are printed, with the
registers per thread (from the cubin, by the bundled cuobjdump) and the programs one SM holds at once as registers,
shared memory and warps allow (sm_90: 64K registers, 228 KiB shared memory, 64 warps): a kernel whose loads wait
on global memory runs faster with more programs per SM.

``--point`` compiles instead what one forward + backward of ``mita_attention`` (landmarks pooled beforehand, as
``profiler.py host`` calls it) launches at the named points of bench_op / profiler (the training shapes, the LRA
shapes of their experiment files, the long points): the call runs on the CPU with every launch recorded instead of
run, and each distinct launch is compiled with its own arguments' types, its constexprs and launch options (ints of
value 1 and pointers, ints divisible by 16 specialised as a launch specialises them), printed with its grid.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import bench_figf as fm  # noqa: E402  (the fused MLP kernel of Figure F's block)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mita.ops.mita.triton import attention_bwd as abwd  # noqa: E402
from mita.ops.mita.triton import attention_fwd as afwd  # noqa: E402
from mita.ops.mita.triton import landmark_values as tlv  # noqa: E402
from mita.ops.mita.triton import plan as tplan  # noqa: E402
from mita.ops.mita.triton import pool as tp  # noqa: E402
from mita.ops.mita.triton import routing as trt  # noqa: E402
from mita.ops.mita.triton import short as ts  # noqa: E402
from mita.ops.mita.triton import short_bwd as tsb  # noqa: E402
from mita.ops.mita.triton import topk as ttk  # noqa: E402
from mita.ops.mita.triton import topk_scan as tks  # noqa: E402

# Pointer arguments by name (everything else in upper case is a float32 pointer; lower/mixed case is a scalar).
_BF16 = {"Q", "K", "V", "R", "VT", "O", "DO", "DVT", "DK", "DV"}
_I32 = {"IDX", "POS", "ROWS", "STARTS", "TILE_E", "TILE_RS", "TILE_RE", "ROUTE", "PTR", "KK", "DONE", "OFF"}
_I64 = {"LO", "HI", "CAND"}
_I8 = {"KV", "ARG"}
_FLOAT_SCALARS = {"scale", "sscale", "scale_log2", "sscale_log2"}
_INT_SCALARS = {"NQB", "N", "M", "TOPK", "NROWS", "T", "L", "NR", "BMQ", "CH", "G", "NB", "NBLK", "CAP", "NC"}
_INT_SCALARS |= {"H", "SB", "SH", "SN", "DSB", "DSH", "DSN"}  # heads_layout (q, k, v; the upstream gradient)


def _sig(fn, consts: dict, overrides: dict | None = None) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif overrides and name in overrides:
            sig[name] = overrides[name]
        elif name in _INT_SCALARS:
            sig[name] = "i32"
        elif name in _FLOAT_SCALARS:
            sig[name] = "fp32"
        elif name in _BF16:
            sig[name] = "*bf16"
        elif name in _I32:
            sig[name] = "*i32"
        elif name in _I64:
            sig[name] = "*i64"
        elif name in _I8:
            sig[name] = "*i8"
        elif name.isupper() and len(name) > 1 or name in ("O",):
            sig[name] = "*fp32"
        else:
            sig[name] = "i32"
    return sig


# Strides a launch passes as multiples of 16 (d = 64 rows): Triton specialises on that, as on 16-byte aligned pointers.
_STRIDES = {"SB", "SH", "SN", "DSB", "DSH", "DSN"}


def _aligned(fn, sig: dict) -> dict:
    """The divisibility attributes a real launch gets (pointers from torch allocations, d = 64 strides); without
    them the software pipeliner sees unaligned loads and the cubin (cp.async stages, shared memory) is not the one
    that runs."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if sig.get(name, "constexpr") != "constexpr" and (sig[name].startswith("*") or name in _STRIDES)
    }


def resources(c, warps: int) -> str:
    """Registers per thread of a compiled kernel and its programs per SM (registers, shared memory and warps)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(c.asm["cubin"])
        try:
            out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return "registers ?"
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if m is None:
        return "registers ?"
    reg, stack = int(m.group(1)), int(m.group(2))
    per_sm = ttk.programs_per_sm(reg, c.metadata.shared, warps)
    return f"{reg} regs{f' (stack {stack} B)' if stack else ''}, {per_sm} programs/SM"


_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                 torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}  # fmt: skip


def _arg_type(a) -> str:
    """Triton's signature type of a launch argument ("constexpr" where a launch specialises the value: None, 1)."""
    if isinstance(a, torch.Tensor):
        return "*" + _TRITON_TYPES[a.dtype]
    if a is None or (a.__class__ is int and a == 1):
        return "constexpr"
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        return "i32" if -(2**31) <= a < 2**31 else "i64"
    if isinstance(a, float):
        return "fp32"
    raise TypeError(f"unexpected launch argument of type {type(a).__name__}")


def recorded_launches(names: list[str]) -> list[tuple]:
    """``(point, kernel, grid, args, kwargs)`` of each distinct launch (kernel, argument types, constexprs, options)
    of one forward + backward at each point, recorded on the CPU instead of run (profiler.py's launch stubs)."""
    import profiler as prof

    from mita.ops.mita.api import mita_attention
    from mita.ops.mita.triton import launch

    pts = [prof.point(n) for n in names]  # unknown names stop the run first
    prof.cpu_launch_stubs()
    seen: dict = {}
    current = [""]

    def record(self, grid, args, kwargs):
        key = (self.fn.__name__, tuple(_arg_type(a) for a in args), tuple(kwargs.items()))
        seen.setdefault(key, (current[0], self.fn.jit, tuple(grid), args, kwargs))

    launch.FastKernel._launch = record
    for p in pts:
        current[0] = p["name"]
        shape = (p["B"], p["H"], p["N"], p["d"])
        q, k, v = (torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        r = prof.point_landmarks(q, p).detach().requires_grad_(True)
        mita_attention(q, k, v, r, p["k"], backend="triton").backward(torch.zeros(shape, dtype=torch.bfloat16))
    return list(seen.values())


def compile_launch(fn, args, kwargs, target):
    """Compile one recorded launch: its arguments' types, its constexprs (given by keyword, or None / 1 values) and
    launch options; 16-byte aligned pointers and ints divisible by 16 carry the divisibility a launch gives them."""
    names = fn.arg_names
    sig = {n: _arg_type(a) for n, a in zip(names, args)}
    consts = {n: a for n, a in zip(names, args) if sig[n] == "constexpr"}
    consts |= {n: kwargs[n] for n in names[len(args) :]}
    sig |= dict.fromkeys(names[len(args) :], "constexpr")
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (n, a) in enumerate(zip(names, args))
        if sig[n] != "constexpr"
        and ((isinstance(a, torch.Tensor) and a.data_ptr() % 16 == 0) or (a.__class__ is int and a % 16 == 0))
    }
    opts = {k: v for k, v in kwargs.items() if k not in names}
    opts.setdefault("num_warps", 4)
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=target, options=opts)


def report(label: str, width: int, build, describe) -> bool:
    """Compile one kernel (``build()``) and print its line: ``describe(compiled)`` after "ok", or why it failed.
    Whether it compiled."""
    try:
        c = build()
    except Exception as e:  # noqa: BLE001 (report every kernel, then fail)
        print(f"{label:{width}s} FAILED: {str(e).strip().splitlines()[-1][:300]}", flush=True)
        return False
    print(f"{label:{width}s} ok  {describe(c)}", flush=True)
    return True


def compile_points(names: list[str], target) -> int:
    """Compile every distinct launch at the points; the number that failed."""
    failed = 0
    for point, fn, grid, args, kwargs in recorded_launches(names):
        cap = f" cap {kwargs['maxnreg']}" if kwargs.get("maxnreg") else ""

        def describe(c, grid=grid, cap=cap):
            warps = c.metadata.num_warps
            return f"grid {str(grid):16s} w{warps}{cap} shared {c.metadata.shared} B, {resources(c, warps)}"

        failed += not report(
            f"{point} {fn.__name__.strip('_')}",
            40,
            lambda f=fn, a=args, k=kwargs: compile_launch(f, a, k, target),
            describe,
        )
    return failed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--maxnreg", type=int, default=0, help="compile every kernel with this register cap (0: none)")
    ap.add_argument("--only", default="", help="comma-separated name prefixes of the kernels to compile")
    ap.add_argument("--point", default="", help="comma-separated benchmark points: compile what a call launches there")
    args = ap.parse_args()
    target = GPUTarget("cuda", 90, 32)
    if args.point:
        sys.exit(1 if compile_points([x for x in args.point.split(",") if x], target) else 0)
    common = dict(D=64, PREC="tf32", UP=False)
    cases = [
        (
            "mita_fwd",
            afwd._mita_fwd_kernel,
            dict(S=1, SHARED=True, DIRECT=True, BM=16, BN=32, BS=32, FULL=False, **common),
            4,
            None,
        ),
        (
            "mita_fwd 64",
            afwd._mita_fwd_kernel,
            dict(S=1, SHARED=True, DIRECT=True, BM=64, BN=64, BS=64, FULL=False, **common),
            afwd._fwd_launch(64, 64, 64),
            {"O": "*bf16"},
        ),
        (
            "mita_fwd 64 full",
            afwd._mita_fwd_kernel,
            dict(S=1, SHARED=True, DIRECT=True, BM=64, BN=64, BS=64, FULL=True, **common),
            afwd._fwd_launch(64, 64, 64),
            {"O": "*bf16"},
        ),
        (
            "mita_bwd_dq",
            abwd._mita_bwd_dq_kernel,
            dict(S=1, SHARED=True, DIRECT=True, BM=16, BN=32, BS=32, ONE_S=False, **common),
            4,
            None,
        ),
        (
            "mita_bwd_dq S=2",
            abwd._mita_bwd_dq_kernel,
            dict(S=2, SHARED=True, DIRECT=False, BM=64, BN=64, BS=64, ONE_S=True, **common),
            8,
            {"DQ": "*fp32"},
        ),
        (
            "dkdv_final match",
            abwd._dkdv_final_kernel,
            dict(CSR=False, LV=True, HAS_KV=True, BK=32, KP=32, BS=32, **common),
            4,
            None,
        ),
        (
            "dkdv_final csr",
            abwd._dkdv_final_kernel,
            dict(CSR=True, LV=True, HAS_KV=False, BK=16, KP=512, BS=64, **common),
            4,
            None,
        ),
        (
            "shared_merge",
            abwd._shared_merge_kernel,
            dict(D=64, BC=64),
            2,
            {"DVTP": "*fp32", "VT": "*bf16", "DVT": "*bf16"},
        ),
        (
            "dr_merge",
            abwd._dr_merge_kernel,
            dict(D=64, BCA=64, BCB=16),
            2,
            {"DRA": "*fp32", "DRB": "*fp32", "DR": "*bf16", "NCA": "i32", "NCB": "i32"},
        ),
        ("plan_local", tplan._plan_local_kernel, dict(MP=32, BR=64, BC=1024, BT=32), 4, {"TT": "i32"}),
        ("plan_count", tplan._plan_count_kernel, dict(MP=512, BR=1024), 4, {"CNTS": "*i32", "CR": "i32"}),
        ("plan_count MP=32", tplan._plan_count_kernel, dict(MP=32, BR=64), 4, {"CNTS": "*i32", "CR": "i32"}),
        ("plan_offsets", tplan._plan_offsets_kernel, dict(MP=512, BE=32, BC=128), 4, {"CNTS": "*i32"}),
        (
            "plan_scatter",
            tplan._plan_scatter_kernel,
            dict(MP=512, BR=64, BT=2),
            1,
            {"CNTS": "*i32", "CR": "i32", "TT": "i32"},
        ),
        (
            "plan_scatter MP=32",
            tplan._plan_scatter_kernel,
            dict(MP=32, BR=64, BT=32),
            1,
            {"CNTS": "*i32", "CR": "i32", "TT": "i32"},
        ),
        (
            "topk_small",
            tks._topk_small_kernel,
            dict(HAS_KV=False, BS=16, NP=256, KP=32, EXACT=False, **common),
            4,
            None,
        ),
    ]
    cases.append(("lv_bwd_dkdv", tlv._lv_bwd_dkdv_kernel, dict(HAS_KV=True, BS=32, BN=64, **common), 4, None))
    for mode in range(4):
        cases.append(
            (
                f"topk_scan mode {mode}",
                tks._topk_scan_kernel,
                dict(
                    MODE=mode,
                    P=16,
                    SKIP=mode == 2,
                    HAS_KV=False,
                    BS=64,
                    BN=64,
                    EXACT=False,
                    TOPT=2,
                    BG=8,
                    ET=2,
                    LVF=0,
                    EVEN=0,
                    LAZY=0,
                    **common,
                ),  # fmt: skip
                4,
                {"CMAX": "*fp32", "ARG": "*i8", "CNT": "*i32"},
            )
        )
    small = {"MEMB": "*i8", "DQ": "*bf16", "PMEMB": "*bf16"}

    def launch_opts(name: str) -> dict:
        # The short kernels' launch options as short.CONFIG sets them (warps, stages, a register cap).
        return {k: v for k, v in ts._cfg(name, 256).items() if k in ("num_warps", "num_stages", "maxnreg")}

    # N = 197: the last blocks as CONFIG's tail gives them (16 rows when on).
    tq, bt, tqb = ts._tail(197, 64, "attn"), ts._tail(197, 64, "attn"), ts._tail(197, 64, "bwd")
    for S, kv, mp in ((1, False, 32), (2, True, 16)):
        sc = dict(SHARED=True, MP=mp, NP=256, **common)
        route = dict(BS=16, EXACT=False, HAS_KV=kv, **sc)
        cases.append((f"small_route MP={mp}", ts._small_route_kernel, route, launch_opts("route"), small))
        attn = dict(S=S, BM=64, BN=64, TQ=tq, BT=bt, EXACT=False, **sc)
        cases.append((f"small_attn S={S}", ts._small_attn_kernel, attn, launch_opts("attn"), small))
        bwd = dict(S=S, BM=64, BN=64, TQ=tqb, HAS_KV=kv, POOL=not kv, **sc)
        cases.append((f"small_bwd S={S}", tsb._small_bwd_kernel, bwd, launch_opts("bwd"), small))
    ints = {name: "i32" for name in ("C", "DH", "SXG", "SXN", "SGG", "SGH", "SGM")}
    pool_fwd = {"MEMB": "*bf16", "X": "*bf16", "OUT": "*bf16", **ints}
    pool_bwd = {"G": "*bf16", "BIDX": "*i32", "BW": "*fp32", "DX": "*bf16", **ints}
    cases.append(("pool_fwd", tp._pool_fwd_kernel, dict(MP=32, BN=64, BC=64, UP=False), 4, pool_fwd))
    cases.append(("pool_bwd", tp._pool_bwd_kernel, dict(KB=4, BN=32, BC=64), 4, pool_bwd))
    pool1d = {"X": "*bf16", "OUT": "*bf16", "L": "i32"}
    for bl, warps, even in ((64, 4, False), (64, 4, True), (256, 8, True)):
        cases.append(
            (f"pool1d_fwd BL={bl} even={int(even)}", tp._pool1d_fwd_kernel, dict(D=64, BL=bl, EVEN=even), warps, pool1d)
        )
    # 1D landmarks with padding (the LRA layers' pooling), head dim 32 as there.
    masked = {"X": "*bf16", "MASK": "*u8", "OUT": "*bf16", "N": "i32", "M": "i32", "SMB": "i32"}
    blocks = dict(D=32, BI=32, BN=64, BC=1024)
    fwd_blocks = dict(blocks, BN=128)
    cases.append(
        ("pool1d_masked_fwd", tp._pool1d_masked_fwd_kernel, dict(PREC="tf32", UP=False, **fwd_blocks), 4, masked)
    )
    masked_bwd = {"G": "*bf16", "MASK": "*u8", "DX": "*bf16", "CH": "i32", "SMB": "i32"}
    masked_bwd |= {n: "i32" for n in ("N", "M", "SGB", "SGH", "SGM")}
    cases.append(("pool1d_masked_bwd", tp._pool1d_masked_bwd_kernel, blocks, 4, masked_bwd))
    # The fused residual + MLP kernel of Figure F's block (C 128, hidden 512), at the tiles run 16 timed.
    mlp = {n: "*bf16" for n in fm._residual_mlp_kernel.arg_names if n.endswith("_ptr")} | {"M": "i32", "eps": "fp32"}
    flags = dict(HAS_LNW=True, HAS_LNB=True, HAS_B1=True, HAS_B2=True, TANH=False, UP=False)
    # Shipped (168 registers, 3 per SM), the first version, x1 held in registers, and a 128-row tile with 8 warps
    # (~180 registers: 1 per SM); run 16 timed each (notes/kernels-notes.md).
    for bm, bh, reload, poly, warps, stages in (
        (64, 32, 1, 1, 4, 3),
        (64, 64, 0, 0, 4, 3),
        (64, 32, 0, 1, 4, 3),
        (128, 32, 1, 1, 8, 3),
    ):
        consts = dict(C=128, HID=512, BM=bm, BH=bh, ERF_POLY=bool(poly), RELOAD=bool(reload), **flags)
        name = f"residual_mlp {bm}x{bh} reload {reload} poly {poly} w{warps} s{stages}"
        cases.append((name, fm._residual_mlp_kernel, consts, dict(num_warps=warps, num_stages=stages), mlp))
    # The top-k, routing and landmark-value modules list their own cases.
    for mod in (ttk, trt, tlv):
        cases += mod._compile_cases()
    failed = 0
    only = [x for x in args.only.split(",") if x]
    for name, fn, consts, warps, over in cases:
        if only and not any(name.startswith(x) for x in only):
            continue
        # Constexprs a case leaves out take their defaults (as a launch that does not pass them).
        consts = {
            **{p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty},
            **consts,
        }
        # warps: the number of warps, or a launch's options (num_warps, num_stages, maxnreg).
        opts = dict(warps) if isinstance(warps, dict) else dict(num_warps=warps)
        if args.maxnreg:
            opts["maxnreg"] = args.maxnreg

        def build(fn=fn, consts=consts, over=over, opts=opts):
            sig = _sig(fn, consts, over)
            src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=_aligned(fn, sig))
            return triton.compile(src, target=target, options=opts)

        def describe(c, warps=opts["num_warps"]):
            ptx = c.asm["ptx"]
            return (
                f"shared {c.metadata.shared} B, cp.async {ptx.count('cp.async.')}, bar.sync {ptx.count('bar.sync')}, "
                f"{resources(c, warps)}"
            )

        failed += not report(name, 28, build, describe)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
