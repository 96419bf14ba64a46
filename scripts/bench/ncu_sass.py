"""Summaries of an Nsight Compute source page (SASS with per-instruction counters), as exported on the GPU machine:

    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > source.log
    python scripts/bench/ncu_sass.py source.log[.gz] _topk_scan_kernel            # opcode mix and stall reasons
    python scripts/bench/ncu_sass.py source.log[.gz] _topk_select_kernel --window 100  # hot address ranges

For one kernel of the report: its stall reasons over all warp samples, then either the opcodes by share of executed
instructions and of samples, or (``--window W``) the listing cut into ranges of W instructions, each range holding
at least 1% of the samples or of the executed instructions printed with its hottest instruction (loops show up as
ranges with many executions).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip


def rows_of(path: str, kernel: str) -> tuple[list[dict], list[str]]:
    """The instruction rows of ``kernel`` (its first section in the page) and the page's column names."""
    opener = gzip.open if path.endswith(".gz") else open
    rows, hdr, cur = [], [], None
    with opener(path, "rt") as f:
        for r in csv.reader(f):
            if r and r[0] == "Kernel Name":
                if cur == kernel and rows:
                    break
                cur, hdr = r[1], []
            elif r and r[0] == "Address":
                hdr = r
            elif cur == kernel and hdr:
                rows.append(dict(zip(hdr, r)))
    if not rows:
        raise SystemExit(f"no kernel named {kernel!r} in {path}")
    return rows, hdr


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):  # predicate
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("page")
    ap.add_argument("kernel")
    ap.add_argument("--window", type=int, default=0, help="print ranges of this many instructions instead of opcodes")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    rows, hdr = rows_of(args.page, args.kernel)
    samples = [num(d["Warp Stall Sampling (All Samples)"]) for d in rows]
    execd = [num(d["Instructions Executed"]) for d in rows]
    tot_s, tot_i = sum(samples) or 1.0, sum(execd) or 1.0
    print(f"{args.kernel}: {len(rows)} instructions, {tot_s:.0f} samples, {tot_i:.0f} executed (warp level)")
    stalls = collections.Counter()
    for d in rows:
        for h in hdr:
            if h.startswith("stall_") and "Not Issued" not in h:
                stalls[h[6:]] += num(d[h])
    print("stalls:", ", ".join(f"{k} {v / tot_s * 100:.1f}%" for k, v in stalls.most_common(10)))
    if args.window:
        w = args.window
        for i in range(0, len(rows), w):
            s, e = sum(samples[i : i + w]), sum(execd[i : i + w])
            if s / tot_s > 0.01 or e / tot_i > 0.01:
                hot = max(range(i, min(i + w, len(rows))), key=lambda j: samples[j])
                print(f"[{i:5d}] samples {s / tot_s * 100:5.1f}%  executed {e / tot_i * 100:5.1f}%  hottest: "
                      f"{rows[hot]['Source'].strip()[:60]}")  # fmt: skip
        return
    ops = collections.defaultdict(lambda: [0.0, 0.0])
    for d, s, e in zip(rows, samples, execd):
        op = ops[opcode(d["Source"])]
        op[0] += e
        op[1] += s
    for name, (e, s) in sorted(ops.items(), key=lambda x: -x[1][0])[: args.top]:
        print(f"  {name:10s} executed {e / tot_i * 100:5.1f}%  samples {s / tot_s * 100:5.1f}%")


if __name__ == "__main__":
    main()
