"""Peak memory of the Triton MiTA op, counted on the CPU: every allocation the launchers make, with the kernel
launches themselves skipped (buffer sizes never depend on values: the op makes no host synchronisation).

Dense attention holds the output in the forward and o, dq, dk, dv plus float32 workspace in the forward and
backward (cuDNN on the H200: about six [B, H, N, d] tensors at its peak, scripts/bench/profiler.py memory). These
bounds keep MiTA's buffers below that: the output, the routing plan and small partials in the forward; o, do's
gradient outputs and the per-entry rows of the routed keys in the backward (no copy of do, partial sums capped).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mita.ops.mita.triton import common as tc
from mita.ops.mita.triton import launch
from mita.ops.mita.triton.op import triton_mita


def _peak_bytes(fn) -> int:
    """Peak of the running sum of allocations made inside ``fn`` (frees of earlier blocks count as negative)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("N,m,S", [(4096, 32, 1), (8192, 64, 1), (4096, 32, 2)])
def test_peak_memory_bounds(monkeypatch, N, m, S):
    monkeypatch.setattr(launch.FastKernel, "_launch", lambda self, grid, args, kwargs: None)
    B, H, d = 1, 2, 64
    q, k, v = (torch.randn(B, H, N, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    r = torch.randn(B, H, m, d, dtype=torch.bfloat16)
    do = torch.randn(B, H, N, d, dtype=torch.bfloat16)  # [B, H, N, d] contiguous: not the output's layout

    def fwd():
        # The backend's entry point itself: CPU tensors on any machine (mita_attention sends CPU tensors to the
        # Triton backend only under TRITON_INTERPRET, and setting that here would change how later imports build
        # their kernels).
        return triton_mita(q, k, v, r, m, experts_per_query=S)

    def fwd_bwd():
        fwd().backward(do)

    fwd_bwd()  # warm caches; the grads it leaves are not part of the measured call's allocations
    for t in (q, k, v):
        t.grad = None
    one = q.numel() * q.element_size()
    with torch.no_grad():
        f_peak = _peak_bytes(fwd)
    fb_peak = _peak_bytes(fwd_bwd)
    # Forward: the output plus the plan and LSE (a sixteenth of it each at d = 64) and, with S = 2, the float32
    # partial outputs of the two slots (four outputs' worth) before they are merged.
    # Forward, S = 1: the output plus the plan and LSE (a thirty-second of it each at d = 64). S = 2 holds the
    # float32 partial outputs of both slots (four outputs' worth) and their merged float32 sum (two).
    assert f_peak <= one * (1.125 if S == 1 else 6.5), f_peak / one
    # Forward + backward: o, dq, dk, dv, and the routed per-entry float32 rows dk_e, dv_e (4 m k / N tensors'
    # worth); a copy of do, or rows kept alive past their use, would add a whole tensor. S = 2 adds dq's float32
    # rows of both slots and their sum.
    rows = 4 * m * m / N
    assert fb_peak <= one * (4.25 + rows if S == 1 else 7.25 + rows), fb_peak / one


def test_grad_layouts_reads_do_in_place():
    B, H, N, d = 2, 3, 10, 16
    o = tc.out_layout(torch.empty(B, H, N, d))
    for do in (torch.randn(B, H, N, d), tc.out_layout(o).normal_(), torch.randn(B, N, H, d).transpose(1, 2)):
        o2, do2, lay = tc.grad_layouts(o, do)
        assert o2 is o and do2 is do
        assert lay == (do.stride(0), do.stride(1), do.stride(2))
    # An expanded gradient (out.sum().backward()) has a zero feature stride: copied once.
    ex = torch.ones(()).expand(B, H, N, d)
    _, do2, lay = tc.grad_layouts(o, ex)
    assert do2.is_contiguous() and lay == (H * N * d, N * d, d)
    # o in another layout than the forward wrote: copied into it.
    o3, _, _ = tc.grad_layouts(o.contiguous(), ex)
    assert o3.stride() == tc.out_strides(o3)
