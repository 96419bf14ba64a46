"""GPU time of build_plan (the routing plan: rows sorted by expert, expert first rows, tile table) at the long-path
sizes, on random routes, optionally beside another version of the plan code.

    python scripts/bench/plan_bench.py [--points 4:1048576:512,...] [--baseline path/to/old/plan.py]
    python scripts/bench/plan_bench.py --device cpu      # smoke run under TRITON_INTERPRET=1, tiny sizes

A point is BH:nrows:m (nrows = N * S routed rows per (batch, head)); --set NAME=INT changes a constant of the plan
module first (e.g. _PLAN_FUSED_MAX=0 takes the chunked path at any size). Each point runs on uniform routes, on
imbalanced ones (Zipf-like: expert e drawn with weight 1 / (e + 1)) and with every row on one expert. Printed per
line: the median time of one call, timed with CUDA events around eager calls ("eager", host launch cost included)
and around replays of a CUDA graph of one call ("graph", the GPU work alone); whether rows and starts equal a
stable torch.sort of the routes; with --baseline, the baseline's times and whether its whole plan (rows, starts,
tile table) is equal. --kernels adds the time of each plan kernel from the PyTorch profiler.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

DEFAULT_POINTS = "4:1048576:512,32:65536:128,4:262144:256,1536:197:25"
# Under the interpreter: the one-program path (first point) and the chunked one (second: nrows * m > 2^18).
SMOKE_POINTS = "3:197:25,2:1100:250"
DISTRIBUTIONS = ("uniform", "zipf", "one")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=None, help=f"BH:nrows:m list (default {DEFAULT_POINTS}; cpu: {SMOKE_POINTS})")
    ap.add_argument("--dists", default=",".join(DISTRIBUTIONS), help="route distributions: uniform, zipf, one")
    ap.add_argument(
        "--baseline",
        default=None,
        help="another version of mita/ops/mita/triton/plan.py, whose build_plan is timed and compared too",
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-graph", action="store_true", help="eager timing only")
    ap.add_argument("--kernels", action="store_true", help="per-kernel times from the PyTorch profiler (cuda)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=INT",
        help="set an integer constant of the plan module first (e.g. _PLAN_FUSED_MAX=0), repeatable",
    )
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (wall-clock times)")
    return ap.parse_args(argv)


def load_baseline(path: str):
    """The module of another plan.py, imported under its own name (its kernels are separate objects)."""
    spec = importlib.util.spec_from_file_location("plan_bench_baseline", os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make_route(torch, BH: int, nrows: int, m: int, dist: str, device: str, seed: int = 0):
    """``[BH, nrows]`` int32 routes in [0, m)."""
    g = torch.Generator(device="cpu").manual_seed(seed + nrows + m)
    if dist == "uniform":
        route = torch.randint(0, m, (BH, nrows), generator=g)
    elif dist == "zipf":
        w = 1.0 / torch.arange(1, m + 1, dtype=torch.float64)
        route = torch.multinomial(w.expand(BH, m), nrows, replacement=True, generator=g)
    elif dist == "one":
        route = torch.full((BH, nrows), m // 2)
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    return route.to(device=device, dtype=torch.int32)


def matches_sort(torch, plan, route, m: int) -> bool:
    """rows and starts against a stable sort of the routes and a count per expert."""
    rows = torch.sort(route.long(), dim=-1, stable=True).indices.int()
    cnt = torch.zeros(route.shape[0], m, dtype=torch.long, device=route.device)
    cnt.scatter_add_(1, route.long(), torch.ones_like(route, dtype=torch.long))
    starts = torch.cat([torch.zeros_like(cnt[:, :1]), cnt.cumsum(1)], 1).int()
    return torch.equal(plan.rows, rows) and torch.equal(plan.starts, starts)


def same_plan(torch, a, b) -> bool:
    """Whole plans equal (tile first / end rows compared where a tile exists)."""
    if a.bm != b.bm or not all(torch.equal(x, y) for x, y in ((a.rows, b.rows), (a.starts, b.starts))):
        return False
    if not torch.equal(a.tile_e, b.tile_e):
        return False
    live = a.tile_e >= 0
    return torch.equal(a.tile_rs[live], b.tile_rs[live]) and torch.equal(a.tile_re[live], b.tile_re[live])


def kernel_times(fn, reps: int) -> str:
    """Mean device time per call of each plan kernel that fn launches (kernel_profile.py's profiler table)."""
    from kernel_profile import kernel_table

    _, rows = kernel_table(fn, reps=reps, top=None)
    return ", ".join(f"{key.split('(')[0]} {ms:.3f}" for key, ms, _ in rows if "plan" in key)


def main(argv=None) -> None:
    args = parse_args(argv)
    dev = args.device
    if dev == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.path.insert(0, os.path.abspath(os.path.join(here, "..", "..")))
    import torch
    from common import cuda_time, environment, time_ms, wall_time

    from mita.ops.mita.triton import plan as tplan

    for item in args.set:
        name, value = item.split("=")
        if not hasattr(tplan, name):
            raise SystemExit(f"mita.ops.mita.triton.plan has no {name}")
        setattr(tplan, name, int(value))
    base = load_baseline(args.baseline) if args.baseline else None
    print(environment(), flush=True)
    points = args.points or (SMOKE_POINTS if dev == "cpu" else DEFAULT_POINTS)
    reps = args.reps if dev == "cuda" else min(args.reps, 2)
    ok_all = True
    for point in points.split(","):
        BH, nrows, m = (int(x) for x in point.split(":"))
        for dist in args.dists.split(","):
            route = make_route(torch, BH, nrows, m, dist, dev)
            idx = torch.zeros(BH, m, 1, dtype=torch.int32, device=dev)
            impls = {"new": tplan} if base is None else {"new": tplan, "baseline": base}
            plans, cells = {}, []
            for name, mod in impls.items():

                def call(mod=mod, idx=idx, route=route, m=m):
                    return mod.build_plan(idx, route, m)

                plans[name] = call()
                if dev == "cuda":
                    eager, _ = cuda_time(call, warmup=2, reps=reps, max_s=5.0)
                    cell = f"{name} eager {eager:.4f} ms"
                    if not args.no_graph:
                        graph, _ = time_ms(call, timing="cuda_graph", warmup=2, reps=reps, max_s=5.0)
                        cell += f", graph {graph:.4f} ms"
                    if args.kernels:
                        cell += f" [{kernel_times(call, reps)}]"
                else:
                    wall, _ = wall_time(call, warmup=0, reps=reps)
                    cell = f"{name} wall {wall:.1f} ms"
                cells.append(cell)
            ok = matches_sort(torch, plans["new"], route, m)
            line = f"BH {BH} nrows {nrows} m {m} {dist:7s}: " + " | ".join(cells) + f" | sorted: {ok}"
            if base is not None:
                same = same_plan(torch, plans["new"], plans["baseline"])
                ok = ok and same
                line += f", equal to baseline: {same}"
            ok_all = ok_all and ok
            print(line, flush=True)
    print("all plans correct" if ok_all else "PLAN MISMATCH", flush=True)
    if not ok_all:
        sys.exit(1)


if __name__ == "__main__":
    main()
