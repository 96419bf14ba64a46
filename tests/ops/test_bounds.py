"""Every Triton kernel of the MiTA forward and backward touches only the tensors it is given.

Under the CPU interpreter the ``bounds_checked`` fixture (tests/conftest.py) checks each load, store and atomic of
every launch against the storage of that launch's tensor arguments, so a stray write fails at the store that makes
it, naming the kernel. On a GPU such a store lands in a neighbouring allocation (under a CUDA graph's memory pool,
an input of a later kernel) and shows up, if at all, far from its cause. Awkward shapes: padding anywhere, rows of
fewer valid keys than k, several experts per query, the CSR backward, rows of fewer key blocks than k and the
long-row top-k with its fallback rows; allocations are NaN-poisoned as everywhere else.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from mita.ops import landmarks as lm  # noqa: E402
from mita.ops.mita.triton import common as tc  # noqa: E402
from mita.ops.mita.triton import key_lists as tkl  # noqa: E402
from mita.ops.mita.triton import op as tmop  # noqa: E402
from mita.ops.mita.triton import pool as tp  # noqa: E402
from mita.ops.mita.triton import topk as ttk  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison")


def _forward_backward(B, H, N, d, m, topk, dtype, S, pad, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, d, generator=g).to(dtype).requires_grad_(True) for _ in range(3))
    r = torch.randn(B, H, m, d, generator=g).to(dtype).requires_grad_(True)
    mask = None
    if pad:
        # Padding anywhere in a row (not only at its end); the last row keeps fewer valid keys than topk.
        mask = torch.rand(B, N, generator=g) < 0.4
        mask[-1, max(1, topk // 2) :] = True
    out = tmop.triton_mita(q, k, v, r, topk, experts_per_query=S, key_padding_mask=mask)
    do = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v, r), do)
    assert torch.isfinite(out).all() and all(torch.isfinite(t).all() for t in grads)


@pytest.mark.parametrize(
    "short,csr,B,H,N,d,m,topk,dtype,S,pad",
    [
        (True, False, 2, 1, 70, 32, 5, 7, torch.float16, 2, True),
        (False, False, 2, 2, 150, 32, 6, 40, torch.bfloat16, 1, True),
        (False, True, 2, 1, 150, 32, 6, 40, torch.bfloat16, 2, True),
        (False, False, 1, 1, 63, 64, 4, 100, torch.float32, 1, False),
    ],
    ids=["short", "general", "general-csr", "k_above_n"],
)
def test_mita_kernels_stay_in_bounds(bounds_checked, monkeypatch, short, csr, B, H, N, d, m, topk, dtype, S, pad):
    monkeypatch.setattr(tmop, "SHORT_PATH", short)
    if csr:
        monkeypatch.setattr(tkl, "_MATCH_MAX", 0)
    _forward_backward(B, H, N, d, m, topk, dtype, S, pad)
    path = {"_small_route_kernel", "_small_attn_kernel", "_small_bwd_kernel"} if short else {
        "_mita_fwd_kernel", "_mita_bwd_dq_kernel"}  # fmt: skip
    assert path <= set(bounds_checked)


def _vocab_rows(BH, M, N, d, topk, pad, seed):
    # Landmarks, keys near a vocabulary of 6 (ties in the top-k), and with pad a key mask that leaves the second head
    # fewer valid keys than topk.
    g = torch.Generator().manual_seed(seed)
    vocab = torch.randn(6, d, generator=g)
    k = (vocab[torch.randint(0, 6, (BH, N), generator=g)] + 0.02 * torch.randn(BH, N, d, generator=g)).bfloat16()
    r = torch.randn(BH, M, d, generator=g).bfloat16()
    valid = None
    if pad:
        valid = torch.rand(BH, N, generator=g) > 0.3
        valid[1, topk // 2 :] = False
    return r, k, valid


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("block_top", [None, 2])
def test_long_row_topk_stays_in_bounds(bounds_checked, monkeypatch, pad, block_top):
    """The long-row top-k (block-top pass, select kernel, fallback rows) on rows of few key blocks (the default's
    wide emission) and of many (2 tops, the 1-D emission), with ties from a small vocabulary of keys."""
    monkeypatch.setitem(ttk.SCAN_CONFIG, "block_top", block_top)
    BH, M, N, d, topk = 2, 5, 700, 32, 40
    r, k, valid = _vocab_rows(BH, M, N, d, topk, pad, seed=3)
    idx = ttk.exact_topk(r, k, valid, topk, small_max_n=0, medium_max_n=0, cap=max(64, tc._next_pow2(topk)))
    assert idx.shape == (BH, M, topk)
    assert {"_topk_scan_kernel", "_topk_select_kernel"} <= set(bounds_checked)


@pytest.mark.parametrize("pad", [False, True])
def test_medium_row_topk_stays_in_bounds(bounds_checked, pad):
    """The medium-row top-k (order keys through the scratch buffer, then a few rows per search tile): a row length
    that is no multiple of the key block or of 16, landmarks that fill no tile, ties from a small vocabulary."""
    BH, M, N, d, topk = 2, 19, 593, 32, 40
    r, k, valid = _vocab_rows(BH, M, N, d, topk, pad, seed=4)
    idx = ttk.exact_topk(r, k, valid, topk, small_max_n=0)
    assert idx.shape == (BH, M, topk)
    assert {"_topk_keys_kernel", "_topk_rows_kernel"} <= set(bounds_checked)


@pytest.mark.parametrize("layout", ["1d_masked", "2d"])
def test_pooling_kernels_stay_in_bounds(bounds_checked, layout):
    g = torch.Generator().manual_seed(5)
    if layout == "1d_masked":
        B, H, N, d, m = 2, 2, 90, 32, 7
        x = torch.randn(B, N, 3, H, d, generator=g).bfloat16()[:, :, 0].transpose(1, 2)
        mask = torch.rand(B, N, generator=g) < 0.3
        mask[1, 5:] = True  # fewer valid tokens than landmarks
        assert tp.pool1d_masked_supported(x, m, mask)
        x = x.detach().requires_grad_(True)
        out = lm._Pool1DMasked.apply(x, m, mask)
        (dx,) = torch.autograd.grad(out, x, torch.randn(out.shape, generator=g).bfloat16())
    else:
        N, start, grid, bins, heads, d = 50, 1, (7, 7), (2, 3), 3, 32
        tables = lm._pool_tables(N, start, *grid, *bins, torch.device("cpu"), torch.bfloat16)
        x3 = torch.randn(2, N, 3 * heads * d, generator=g).bfloat16()[:, :, : heads * d]
        out = tp.pool_fwd(x3, tables.member, tables.counts, heads)
        cot = torch.randn(2, bins[0] * bins[1], heads, d, generator=g).bfloat16().transpose(1, 2)
        dx = tp.pool_bwd(cot, tables.token_bins, heads, torch.bfloat16)
    assert torch.isfinite(out).all() and torch.isfinite(dx).all()
    assert any("pool" in name for name in bounds_checked)


def test_bounds_check_catches_a_stray_store(bounds_checked):
    """The fixture itself: a store one block past a tensor's storage fails, naming the kernel; the same store
    masked to the tensor passes."""
    import triton
    import triton.language as tl

    @triton.jit
    def _write_ones(X, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(X + o, tl.full([BLOCK], 1.0, tl.float32), mask=o < n)

    x = torch.zeros(8)
    _write_ones[(1,)](x, 8, BLOCK=16)
    assert torch.equal(x, torch.ones(8))
    with pytest.raises(Exception, match="_write_ones: store of 4 element"):
        _write_ones[(1,)](torch.zeros(8), 12, BLOCK=16)
