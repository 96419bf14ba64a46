"""How often the long-row exact top-k leaves its fast path: a PyTorch model of its start threshold, on the CPU.

The Triton top-k (mita/ops/mita/triton/topk.py, rows longer than 512 keys) takes, per landmark row, the
kk-th largest maximum of 64-key blocks (of groups of f blocks when a row has more than 8192 blocks), rounded down
as its early-stopped bisection leaves it (``--start-steps``), as a start threshold, and emits every key at or
above it into a candidate list of ``cap = next_pow2(max(2 k, 64))`` slots.
A row with more such keys than cap overflows into the refinement passes (up to 8 extra passes over the keys,
~5.7 ms each at N = 1M when every row needs them; run 6). The threshold is tight when a landmark's top keys are
spread over many blocks (independent tokens) and loose when they cluster in a few blocks (neighbouring tokens
alike): this script measures the share of overflowing rows for synthetic sequences with AR(1) correlation along
the tokens, or for q / k tensors saved from a real model.

    python scripts/bench/topk_overflow.py [--n 65536] [--rho 0,0.9,0.99] [--block-top 1,2,4]
    python scripts/bench/topk_overflow.py --qk saved.pt      # a dict with "q" and "k": [N, d] or [B, H, N, d]
"""

from __future__ import annotations

import argparse
import math

import torch

from mita.ops.mita.triton.plan import order_key


def start_key(entries: torch.Tensor, kk: int, steps: int = 32, narrow: bool = True) -> torch.Tensor:
    """``[m]`` int64: the start kernel's threshold key of each row of ``entries`` ``[m, E]`` (-inf: not an entry),
    by the kernel's bisection: over [min, max + 1) of the row's keys when at least kk >= 1 entries are valid and
    ``narrow`` (``_kth_largest_key_narrow``), else over [-2^31, 2^31), halved until at most 2^(32 - steps) wide
    (32 steps: the kk-th largest key)."""
    key, valid = order_key(entries), entries > float("-inf")
    unit = 1 << (32 - steps)
    ok_rows = (valid.sum(-1) >= kk) & (kk >= 1) & narrow
    big = torch.full_like(key, 2**31)
    t = torch.where(ok_rows, torch.where(valid, key, big).amin(-1), torch.full_like(key[:, 0], -(2**31)))
    hi = torch.where(ok_rows, torch.where(valid, key, -big).amax(-1) + 1, torch.full_like(key[:, 0], 2**31))
    while True:
        act = hi - t > unit
        if not act.any():
            return t
        mid = t + (hi - t) // 2
        ok = ((key >= mid[:, None]) & valid).sum(-1) >= kk
        t = torch.where(act & ok, mid, t)
        hi = torch.where(act & ~ok, mid, hi)


def start_overflow(
    r: torch.Tensor,
    k: torch.Tensor,
    kk: int,
    bn: int = 64,
    max_groups: int = 8192,
    block_top: int = 1,
    steps: int = 32,
    narrow: bool = True,
) -> dict:
    """Share of rows of ``r @ k.T`` whose keys at or above the start threshold exceed the candidate list.

    Args:
        r: ``[m, d]`` landmarks; k: ``[N, d]`` keys (float32 scores as the kernels compute them).
        kk: keys per landmark.
        block_top: scores kept per key block (``SCAN_CONFIG["block_top"]``): the start is the kk-th largest of
            them (of their group maxima when a row has more than ``max_groups`` entries).
        steps, narrow: the start kernel's bisection (``SCAN_CONFIG["start_steps"]``, ``["start_narrow"]``), which
            :func:`start_key` repeats: below 32 steps the start's order key is rounded down, as the kernel's
            early-stopped bisection leaves it.

    Returns:
        ``{"overflow": share of rows, "median_count": median keys >= start, "cap": list length, "counts": [m]}``.
    """
    s = r.float() @ k.float().T
    m, N = s.shape
    nb = math.ceil(N / bn)
    blocks = torch.nn.functional.pad(s, (0, nb * bn - N), value=float("-inf")).view(m, nb, bn)
    bmax = blocks.topk(block_top, dim=-1).values.reshape(m, nb * block_top)  # per block, descending
    nb = nb * block_top
    f = 1 << max(0, math.ceil(nb / max_groups) - 1).bit_length()
    ng = math.ceil(nb / f)
    gmax = torch.nn.functional.pad(bmax, (0, ng * f - nb), value=float("-inf")).view(m, ng, f).amax(-1)
    t = start_key(gmax, kk, steps, narrow)
    cnt = (order_key(s) >= t[:, None]).sum(-1)
    cap = 1 << (max(2 * kk, kk, 64) - 1).bit_length()
    return {
        "overflow": (cnt > cap).float().mean().item(),
        "median_count": cnt.float().median().item(),
        "cap": cap,
        "counts": cnt,
    }


def ar1_tokens(n: int, d: int, rho: float, gen: torch.Generator) -> torch.Tensor:
    """``[n, d]`` tokens, each dimension an AR(1) sequence with lag-1 correlation rho (rho = 0: independent)."""
    e = torch.randn(n, d, generator=gen)
    if rho == 0:
        return e
    x = torch.empty(n, d)
    x[0] = e[0]
    c = math.sqrt(1 - rho * rho)
    for t in range(1, n):
        x[t] = rho * x[t - 1] + c * e[t]
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--rho", default="0,0.9,0.99,0.999")
    ap.add_argument("--qk", default="", help="a torch.save'd dict with q and k ([N, d] or [B, H, N, d])")
    ap.add_argument("--block-top", default="1,2,4", help="scores kept per key block (SCAN_CONFIG block_top)")
    ap.add_argument("--start-steps", type=int, default=20, help="the start's bisection steps (SCAN_CONFIG start_steps)")
    ap.add_argument("--start-narrow", type=int, default=1, help="its range from the entries (SCAN_CONFIG start_narrow)")
    args = ap.parse_args()
    if args.qk:
        saved = torch.load(args.qk, map_location="cpu")
        q, k = saved["q"], saved["k"]
        q, k = (t.reshape(-1, t.shape[-2], t.shape[-1]) if t.dim() > 2 else t[None] for t in (q, k))
        n = q.shape[1]
        mk = max(1, int(math.sqrt(n / 4)))
        for i in range(q.shape[0]):
            r = q[i][: n - n % mk].reshape(mk, -1, q.shape[-1]).mean(1)
            for t in (int(x) for x in args.block_top.split(",")):
                res = start_overflow(r, k[i], mk, block_top=t, steps=args.start_steps, narrow=bool(args.start_narrow))
                res.pop("counts")
                print(f"head {i}: N {n}, m = k = {mk}, block_top {t}: {res}", flush=True)
        return
    gen = torch.Generator().manual_seed(0)
    n, d = args.n, args.d
    mk = int(math.sqrt(n / 4))
    w_q, w_k = (torch.randn(d, d, generator=gen) / math.sqrt(d) for _ in range(2))
    for rho in (float(x) for x in args.rho.split(",")):
        x = ar1_tokens(n, d, rho, gen)
        q, k = x @ w_q, x @ w_k
        r = q.view(mk, n // mk, d).mean(1)  # 1-D landmarks: means of consecutive query segments
        for t in (int(x) for x in args.block_top.split(",")):
            res = start_overflow(r, k, mk, block_top=t, steps=args.start_steps, narrow=bool(args.start_narrow))
            res.pop("counts")
            print(f"N {n}, m = k = {mk}, AR(1) rho {rho}, block_top {t}: {res}", flush=True)


if __name__ == "__main__":
    main()
