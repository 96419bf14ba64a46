"""Where the peak memory of one call goes (CUDA): the allocations live at the peak, with the code that made them.

    python scripts/bench/mem_profile.py [--points N65536,N262144] [--top 10]

For each point (those of kernel_profile.py: MiTA with its landmark pooling, and SDPA's default dense backend) and
each stage (forward under no_grad; forward + backward, as bench_op.py times them) prints the peak allocated
memory above what was allocated before the call (what bench_op.py reports) and the largest blocks live at that
moment, each with the innermost frame of this repository (or of the script) that allocated it. It records the
allocator's history (``torch.cuda.memory._record_memory_history``) for one call after a warm-up call.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_profile import POINTS, make_fns  # noqa: E402

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _where(frames: list[dict]) -> str:
    """The innermost frame inside the repository (the allocating line of this project's code)."""
    for f in frames:
        name = f.get("filename", "")
        if name.startswith(_REPO) and not name.endswith("mem_profile.py"):
            return f"{os.path.relpath(name, _REPO)}:{f.get('line')} {f.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


def peak_breakdown(fn, no_grad: bool) -> tuple[float, list[tuple[float, str]]]:
    """``(peak MiB above the allocations before the call, [(MiB, where)] of the blocks live at the peak)``."""
    ctx = torch.no_grad() if no_grad else contextlib.nullcontext()
    with ctx:
        fn()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    try:
        with ctx:
            fn()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][torch.cuda.current_device()]
    # Only this call's events: the trace restarts when recording starts.
    live: dict[int, tuple[int, str]] = {}
    cur = best = 0
    at_best: list[tuple[int, str]] = []
    for ev in events:
        act, size = ev["action"], ev["size"]
        if act == "alloc":
            live[ev["addr"]] = (size, _where(ev.get("frames", [])))
            cur += size
            if cur > best:
                best, at_best = cur, list(live.values())
        elif act == "free_requested":
            live.pop(ev["addr"], None)
            cur -= size
    rows = sorted(((s / 2**20, w) for s, w in at_best), reverse=True)
    return best / 2**20, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="N65536,N262144")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    for name in args.points.split(","):
        p = dict(POINTS[name], d=64)
        fns = make_fns(p, "triton")
        for label, fn in fns.items():
            peak, rows = peak_breakdown(fn, no_grad=label.endswith("fwd"))
            print(f"== {name} {label}: peak {peak:.1f} MiB above the call's start")
            for mib, where in rows[: args.top]:
                print(f"   {mib:9.2f} MiB  {where}")
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
