"""Top-k, routing and landmark-value kernels (mita/ops/mita/triton: topk*.py, routing.py, landmark_values.py): exact
top-k, top-S routing, split-key landmark values.

Integer-valued inputs make every score exact in float32 whatever the summation order, so index sets are compared
exactly, ties included. Without a GPU the kernels run under TRITON_INTERPRET=1 at small shapes.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from mita.ops.mita.naive import stable_topk_indices  # noqa: E402
from mita.ops.mita.triton import attention_bwd as abwd  # noqa: E402
from mita.ops.mita.triton import attention_fwd as afwd  # noqa: E402
from mita.ops.mita.triton import common as tc  # noqa: E402
from mita.ops.mita.triton import landmark_values as tlv  # noqa: E402
from mita.ops.mita.triton import op as tmop  # noqa: E402
from mita.ops.mita.triton import plan as tplan  # noqa: E402
from mita.ops.mita.triton import pool as tp  # noqa: E402
from mita.ops.mita.triton import routing as trt  # noqa: E402
from mita.ops.mita.triton import short as ts  # noqa: E402
from mita.ops.mita.triton import short_bwd as tsb  # noqa: E402
from mita.ops.mita.triton import topk as ttk  # noqa: E402
from mita.ops.mita.triton import topk_scan as tks  # noqa: E402
from mita.ops.mita.triton import topk_select as tsel  # noqa: E402
from mita.ops.mita.triton.launch import interpreting  # noqa: E402

# Every test here runs with poisoned allocations (tests/conftest.py: NaN floats, integers no kernel writes).
pytestmark = pytest.mark.usefixtures("poison")

if not _CUDA and type(trt._route_kernel).__name__ != "InterpretedFunction":
    # Imported earlier without the interpreter: reload the kernel modules, each after the ones it imports from.
    for _mod in (tc, tks, tlv, tsel, ttk, trt, afwd, tplan, abwd, ts, tsb, tp, tmop):
        importlib.reload(_mod)

DEV = "cuda" if _CUDA else "cpu"


def _ints(shape, lo, hi, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).to(DEV, dtype)


def _ref_topk(r, k, valid, topk):
    sc = r.double() @ k.double().transpose(1, 2)
    if valid is not None:
        sc = sc.masked_fill(~valid[:, None, :], float("-inf"))
    idx = stable_topk_indices(sc, topk)
    if valid is not None:
        ok = torch.gather(valid[:, None, :].expand_as(sc), 2, idx)
        idx = torch.where(ok, idx, -1)
    return idx


@pytest.fixture(autouse=True)
def long_rows(request, monkeypatch):
    """Rows beyond the short rows' length take the long-row path here (the tests of this module are about it), except
    in the tests named for the medium-row path, which take the module's default."""
    if "medium" not in request.node.name:
        monkeypatch.setattr(ttk, "MEDIUM_N", 0)


@pytest.fixture(params=[1, 3, 8], ids=["block_top1", "block_top3", "block_top8"])
def block_top(request, monkeypatch):
    """The long-row top-k's start from each key block's maximum (1), from its 3 largest scores, and from its 8 (which
    the select kernel's emission then reads, every one: only blocks with 8 candidates or more are scored again)."""
    monkeypatch.setitem(ttk.SCAN_CONFIG, "block_top", request.param)
    return request.param


# The long-row top-k's launches without padding: block tops, the per-row select kernel and the fallback (one
# persistent launch, which also selects the fallback rows' top-k).
_TOPK_LAUNCHES = ["_topk_scan_kernel", "_topk_select_kernel", "_topk_fallback_kernel"]


def _ascending(idx):
    # Indices ascending, then -1 (the order exact_topk returns).
    a = torch.where(idx < 0, 1 << 30, idx.long()).sort(-1).values
    return torch.where(a == 1 << 30, -1, a).cpu()


def _same_sets(a, b):
    return torch.equal(_ascending(a), _ascending(b))


@pytest.mark.parametrize("path", ["small", "medium", "long"])
@pytest.mark.parametrize(
    "N,M,d,topk,span,pad", [(70, 5, 32, 9, 2, False), (150, 20, 32, 40, 3, True), (130, 4, 64, 130, 1, True)]
)
def test_exact_topk_matches_stable_sort(path, N, M, d, topk, span, pad):
    BH = 2
    r = _ints((BH, M, d), -span, span + 1, 1, torch.bfloat16)
    k = _ints((BH, N, d), -span, span + 1, 2, torch.bfloat16)
    valid = None
    if pad:
        valid = torch.ones(BH, N, dtype=torch.bool, device=DEV)
        valid[0, N // 3 :] = False
        valid[1, :5] = False
    kw = {
        "small": {},
        "medium": dict(small_max_n=0, medium_max_n=4096),
        "long": dict(small_max_n=0, cap=max(64, tc._next_pow2(topk))),
    }[path]
    got = ttk.exact_topk(r, k, valid, topk, **kw)
    assert got.shape == (BH, M, topk) and got.dtype == torch.int32
    assert _same_sets(got, _ref_topk(r, k, valid, topk))
    # Ascending valid indices first, then -1.
    key = torch.where(got < 0, 1 << 30, got.long())
    assert torch.equal(key, key.sort(-1).values)


@pytest.mark.parametrize(
    "N,M,d,topk,dtype,pad",
    [
        (1025, 21, 64, 49, torch.bfloat16, False),  # a 1024-key tile and a 16-key tail; a partial group of rows
        (2000, 7, 32, 64, torch.float16, True),
        (593, 19, 128, 40, torch.float32, True),
        (530, 9, 32, 64, torch.bfloat16, True),  # a 512-key tile and a 32-key tail
    ],
)
def test_exact_topk_medium_rows(N, M, d, topk, dtype, pad):
    """Medium rows (order keys through the scratch buffer, then a few rows per search tile): the stable sort's
    indices, ties included (integer scores from a span of 2), ascending, then -1 where a row has fewer valid keys than
    topk (or none); with lv the same indices and the landmark values."""
    BH = 3
    r = _ints((BH, M, d), -2, 3, N, dtype)
    k = _ints((BH, N, d), -2, 3, N + 1, dtype)
    valid = None
    if pad:
        valid = torch.rand(BH, N, generator=torch.Generator().manual_seed(N)).to(DEV) > 0.3
        valid[1] = False
        valid[1, 7 : 7 + topk // 2] = True
        valid[2] = False
    got = ttk.exact_topk(r, k, valid, topk, small_max_n=0)
    assert got.shape == (BH, M, topk) and got.dtype == torch.int32
    assert torch.equal(got.long().cpu(), _ascending(_ref_topk(r, k, valid, topk)))
    v = _ints((BH, N, d), -2, 3, N + 2, dtype)
    idx, vt, _ = ttk.exact_topk(r, k, valid, topk, small_max_n=0, lv=(v, d**-0.5))
    assert torch.equal(idx, got)
    ref = _lv_ref(r, k, v, valid, d**-0.5)
    assert ((vt.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 1e-2)


def test_exact_topk_long_rows_massive_ties_and_refinement(block_top):
    # Many keys tie with the k-th score and the candidate list is short: the refinement passes must narrow the
    # threshold to the k-th key itself and the emitting pass must keep the lowest-index ties.
    BH, N, M, d, topk = 1, 200, 3, 32, 20
    r = _ints((BH, M, d), 0, 2, 3)
    k = _ints((BH, N, d), 0, 2, 4)
    k[:, 50:180] = k[:, 10:11]
    got = ttk.exact_topk(r, k, None, topk, small_max_n=0, cap=64)
    assert _same_sets(got, _ref_topk(r, k, None, topk))
    assert _same_sets(ttk.exact_topk(r, k, None, topk), _ref_topk(r, k, None, topk))


def test_exact_topk_long_rows_start_from_block_maxima(block_top):
    # Enough key blocks (N / 64 >= k) for the block-maximum start threshold; integer ties across blocks.
    r = _ints((1, 3, 32), -2, 3, 9, torch.bfloat16)
    k = _ints((1, 1300, 32), -2, 3, 10, torch.bfloat16)
    valid = torch.ones(1, 1300, dtype=torch.bool, device=DEV)
    valid[0, 1000:1100] = False
    got = ttk.exact_topk(r, k, valid, 8)
    assert _same_sets(got, _ref_topk(r, k, valid, 8))


def test_exact_topk_long_rows_count_first_then_refine_some_rows(block_top):
    # One landmark tile mixes rows the count pass settles (random scores) with a row it cannot: its start (the
    # 4th largest block maximum) is a level 600 keys reach, above which only two keys lie, so it is refined.
    N, M, d, topk = 1024, 5, 32, 4
    g = torch.Generator().manual_seed(21)
    r = torch.randn(1, M, d, generator=g)
    e1 = torch.zeros(d)
    e1[0] = 1.0
    r[0, 1] = e1
    k = torch.randn(1, N, d, generator=g) * 0.1
    k[0, :, 0] = 1.0
    k[0, 100:700, 0] = 2.0
    k[0, 300, 0] = 3.0
    k[0, 900, 0] = 3.0
    r, k = r.to(DEV), k.to(DEV)
    got = ttk.exact_topk(r, k, None, topk, small_max_n=0, cap=64)
    assert _same_sets(got, _ref_topk(r, k, None, topk))


def _mixed_rows_inputs(N, d):
    # Landmark rows: 0-2 random integer scores (candidates fit the list: the select kernel); 3 every key tied (more
    # ties than the list holds: ordered emission, lowest indices kept); 4 three keys at level 3 and 600 at
    # level 2 (refinement, then ties at the k-th score); 5 scores -k0: 697 zeros tie below three keys at 1.
    g = torch.Generator().manual_seed(31)
    r = torch.randint(-2, 3, (1, 6, d), generator=g).float()
    k = torch.randint(-2, 3, (1, N, d), generator=g).float()
    r[0, 3:] = 0.0
    r[0, 3, 1] = 1.0
    k[0, :, 1] = 1.0
    r[0, 4, 2] = 1.0
    k[0, :, 2] = 1.0
    k[0, 100:700, 2] = 2.0
    k[0, [50, 300, 650], 2] = 3.0
    r[0, 5, 0] = -1.0
    k[0, :, 0] = 0.0
    k[0, [40, 400, 600], 0] = -1.0
    return r.to(DEV), k.to(DEV)


def _mixed_rows_padding(N):
    # Padding at the start and around key 300, one of the three top keys of row 4.
    valid = torch.ones(1, N, dtype=torch.bool, device=DEV)
    valid[0, :20] = False
    valid[0, 290:310] = False
    return valid


@pytest.mark.parametrize("pad", [False, True])
def test_exact_topk_long_rows_select_and_fallback_rows_in_one_tile(pad, block_top):
    N, d, topk = 700, 32, 8
    r, k = _mixed_rows_inputs(N, d)
    valid = _mixed_rows_padding(N) if pad else None
    got = ttk.exact_topk(r, k, valid, topk, small_max_n=0, cap=64)
    ref = _ref_topk(r, k, valid, topk)
    assert _same_sets(got, ref)
    key = torch.where(got < 0, 1 << 30, got.long())
    assert torch.equal(key, key.sort(-1).values)


def test_exact_topk_long_rows_fewer_valid_keys_than_k(block_top):
    # 70 keys in long-row mode, topk 40, one head with 25 valid keys: all 25 (ascending) then -1.
    r = _ints((2, 3, 32), -1, 2, 11)
    k = _ints((2, 70, 32), -1, 2, 12)
    valid = torch.ones(2, 70, dtype=torch.bool, device=DEV)
    valid[1, 25:] = False
    got = ttk.exact_topk(r, k, valid, 40, small_max_n=0)
    assert _same_sets(got, _ref_topk(r, k, valid, 40))
    assert torch.equal(got[1, :, :25].long().cpu(), torch.arange(25).expand(3, 25))
    assert torch.all(got[1, :, 25:] == -1)


def test_exact_topk_long_rows_launches(triton_launches):
    # Without padding the long-row path is Triton launches only: block maxima, the select kernel, the fallback (one
    # persistent launch, which also selects the fallback rows' top-k: 3 launches), and no PyTorch kernel besides the
    # allocations.
    launches = triton_launches
    r = _ints((1, 3, 32), -1, 2, 15)
    k = _ints((1, 70, 32), -1, 2, 16)
    got = ttk.exact_topk(r, k, None, 5, small_max_n=0)
    assert launches == _TOPK_LAUNCHES
    assert _same_sets(got, _ref_topk(r, k, None, 5))


@pytest.mark.parametrize("pad", [False, True])
def test_exact_topk_fallback_rows_top_k_in_fallback_kernel(triton_launches, pad):
    """The fallback rows' top-k is selected inside the persistent fallback kernel (no further launch): the
    reference's result on rows that mix list-fitting and overflowing candidates."""
    N, d, topk = 700, 32, 8
    r, k = _mixed_rows_inputs(N, d)
    valid = _mixed_rows_padding(N) if pad else None
    ref = _ref_topk(r, k, valid, topk)
    st: dict = {}
    got = ttk.exact_topk(r, k, valid, topk, small_max_n=0, cap=64, stats=st)
    assert int(st["overflow_rows"]) > 0
    assert _same_sets(got, ref)
    names = [n for n in triton_launches if n.startswith("_topk")]
    assert names == _TOPK_LAUNCHES, names


def _float_inputs(BH, M, N, d, seed, rho=0.0):
    # bf16 Gaussian landmarks and keys (AR(1) along N with correlation rho): real-valued scores, few exact ties.
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(BH, M, d, generator=g)
    k = torch.randn(BH, N, d, generator=g)
    if rho:
        for i in range(1, N):
            k[:, i] = rho * k[:, i - 1] + (1 - rho**2) ** 0.5 * k[:, i]
    return r.to(DEV, torch.bfloat16), k.to(DEV, torch.bfloat16)


@pytest.mark.parametrize(
    "N,M,topk,cap,rho,pad,emit_top,eb",
    [
        pytest.param(2000, 8, 16, None, 0.0, False, None, None, marks=pytest.mark.slow),
        (4096, 8, 32, None, 0.0, True, 2, 16),
        (2048, 4, 64, 64, 0.0, False, 3, 16),  # with a coarse start (12 bisection steps): rows overflow
        (2048, 8, 16, None, 0.95, False, None, None),
    ],
    ids=["iid", "pad_e2_steps", "cap_k_overflow", "correlated"],
)
def test_exact_topk_select_kernel_real_valued_scores(monkeypatch, N, M, topk, cap, rho, pad, emit_top, eb):
    """The per-row select kernel (start, count + emit from the block tops with blocks scored again, top-k) on
    real-valued scores: a stable sort's selection, indices ascending then -1; every row's count of keys at or above
    its start at least k (a lower bound of the k-th score) and the overflow count the rows whose count passes the
    list; overflowing rows (cap = k, correlated keys) take the fallback (cap = k with a coarse start: 12 bisection
    steps); several emission steps per row (select_eb 16) with padding."""
    r, k = _float_inputs(2, M, N, 32, 40 + N, rho)
    valid = None
    if pad:
        valid = torch.ones(2, N, dtype=torch.bool, device=DEV)
        valid[1, N // 2 :] = False
    monkeypatch.setitem(ttk.SCAN_CONFIG, "emit_top", emit_top)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "select_eb", eb)
    if cap is not None:
        monkeypatch.setitem(ttk.SCAN_CONFIG, "start_steps", 12)
    st: dict = {}
    got = ttk.exact_topk(r, k, valid, topk, small_max_n=0, cap=cap, stats=st)
    counts, overflow = st["counts"].cpu(), int(st["overflow_rows"])
    assert _same_sets(got, _ref_topk(r.float(), k.float(), valid, topk))
    key = torch.where(got < 0, 1 << 30, got.long())
    assert torch.equal(key, key.sort(-1).values)
    kk = topk if valid is None else valid.sum(-1).clamp(max=topk).cpu().repeat_interleave(M)
    assert (counts >= kk).all()
    assert overflow == int((counts > st["cap"]).sum())
    if cap is not None or rho:
        assert overflow > 0, "expected rows that overflow the candidate list"


def test_exact_topk_select_eb_out_of_range(monkeypatch):
    r, k = _float_inputs(1, 4, 600, 32, 3)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "select_eb", 24)
    with pytest.raises(ValueError, match="select_eb"):
        ttk.exact_topk(r, k, None, 8, small_max_n=0)


def test_exact_topk_settings_follow_the_config(monkeypatch):
    """The long-row settings are computed once per shape and configuration: the same call reuses them, and a changed
    SCAN_CONFIG entry or module constant that _scan_plan reads gives new ones (an invalid one raises on every call)."""
    r, k = _float_inputs(1, 4, 600, 32, 3)
    ttk._settings.cache_clear()
    ttk.exact_topk(r, k, None, 8, small_max_n=0)
    ttk.exact_topk(r, k, None, 8, small_max_n=0)
    info = ttk._settings.cache_info()
    assert (info.hits, info.misses) == (1, 1)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "num_warps", 2)
    monkeypatch.setattr(ttk, "_SCAN_PROGRAMS", 4)
    got = ttk.exact_topk(r, k, None, 8, small_max_n=0)
    assert ttk._settings.cache_info().misses == 2
    assert torch.equal(got, ttk.exact_topk(r, k, None, 8))
    # The entry that call made (a hit: same key), 4 programs for one landmark tile: 4 key chunks instead of 10.
    st = ttk._settings(1, 4, 600, 32, 8, None, False, False, r.dtype, r.device.index, interpreting(), ttk._config_key())
    assert ttk._settings.cache_info().misses == 2
    assert st.scan_kw["num_warps"] == st.select_kw["num_warps"] == st.fb_kw["num_warps"] == 2
    assert (st.plan.G, st.plan.NB) == (4, 10)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "start_steps", 40)
    for _ in range(2):
        with pytest.raises(ValueError, match="start_steps"):
            ttk.exact_topk(r, k, None, 8, small_max_n=0)


def test_exact_topk_block_top_rows_of_few_blocks(monkeypatch):
    """Rows of fewer key blocks than topk (N 1024, topk 64: 16 blocks of 64, as the LRA image and Pathfinder shapes):
    with 2 tops per block the start threshold is the smallest of 32 entries, every key reaches it and every row
    overflows its candidate list; the default takes 8 per block (2 topk entries, at least 8), which the emission reads,
    every one, and no row overflows on tokens of a few distinct values (a small vocabulary plus position noise, as LRA
    inputs). Same indices either way."""
    assert (ttk._block_top(16, 64, 64), ttk._block_top(32, 64, 64), ttk._block_top(63, 128, 64)) == (8, 8, 8)
    assert (ttk._block_top(8, 64, 64), ttk._block_top(10, 256, 64), ttk._block_top(64, 64, 64)) == (16, 64, 2)
    assert (ttk._block_top(256, 64, 64), ttk._block_top(16384, 512, 64), ttk._block_top(4, 512, 64)) == (2, 1, 64)
    g = torch.Generator().manual_seed(7)
    BH, M, N, d, topk = 1, 8, 1024, 32, 64
    vocab = torch.randn(12, d, generator=g)
    k = vocab[torch.randint(0, 12, (BH, N), generator=g)] + 0.05 * torch.randn(BH, N, d, generator=g)
    r = k[:, torch.randint(0, N, (M,), generator=g)] + 0.3 * torch.randn(BH, M, d, generator=g)
    r, k = r.to(DEV, torch.bfloat16), k.to(DEV, torch.bfloat16)
    got, over = {}, {}
    for bt in (2, None):
        monkeypatch.setitem(ttk.SCAN_CONFIG, "block_top", bt)
        st: dict = {}
        got[bt] = ttk.exact_topk(r, k, None, topk, stats=st)
        over[bt] = int(st["overflow_rows"])
    assert over == {2: M, None: 0}
    assert st["cap"] == 128 and ttk._settings.cache_info().currsize >= 1
    p = ttk._scan_plan(BH, M, N, d, topk, None, False, False)
    assert (p.topt, p.et, p.planes) == (8, 8, 8)
    assert torch.equal(got[2], got[None])
    assert _same_sets(got[None], _ref_topk(r, k, None, topk))


@pytest.mark.parametrize(
    "key,bad",
    [
        ("block_top", 0),
        ("block_top", 65),
        ("bn", 8),
        ("bn", 256),
        ("emit_top", 1),
        ("emit_top", 4),
        ("start_steps", 11),
        ("start_steps", 33),
        ("lv_lazy", 3),
        ("final_narrow", 3),
    ],  # fmt: skip
)
def test_exact_topk_scan_config_out_of_range(monkeypatch, key, bad):
    monkeypatch.setitem(ttk.SCAN_CONFIG, key, bad)
    r, k = _ints((1, 3, 32), -2, 3, 1), _ints((1, 700, 32), -2, 3, 2)
    with pytest.raises(ValueError, match=key):
        ttk.exact_topk(r, k, None, 8, small_max_n=0)


@pytest.mark.parametrize("narrow", [0, 1, 2])
@pytest.mark.parametrize("pad", [False, True])
def test_exact_topk_start_steps_lower_bound(monkeypatch, pad, narrow):
    """SCAN_CONFIG start_steps < 32 stops the start threshold's bisection early: a looser lower bound (more keys at
    or above it in every row, never fewer than k), the same exact selection. Integer scores over a wide range (few
    ties, large magnitudes) make the low bits of the threshold matter: at 12 steps some rows overflow the list
    and take the refinement passes."""
    N, M, topk = 2100, 6, 8
    r = _ints((2, M, 32), -40, 41, 31)
    k = _ints((2, N, 32), -40, 41, 32)
    valid = None
    if pad:
        valid = torch.ones(2, N, dtype=torch.bool, device=DEV)
        valid[1, 1500:] = False
    ref = _ref_topk(r, k, valid, topk)
    counts = {}
    monkeypatch.setitem(ttk.SCAN_CONFIG, "start_narrow", min(narrow, 1))
    monkeypatch.setitem(ttk.SCAN_CONFIG, "final_narrow", narrow)
    for steps in (32, 24, 12):
        monkeypatch.setitem(ttk.SCAN_CONFIG, "start_steps", steps)
        st = {}
        got = ttk.exact_topk(r, k, valid, topk, small_max_n=0, cap=64, stats=st)
        assert _same_sets(got, ref), steps
        counts[steps] = st["counts"].cpu()
    assert (counts[32] >= topk).all()
    assert (counts[24] >= counts[32]).all() and (counts[12] >= counts[24]).all()
    assert (counts[12] > counts[32]).any(), counts
    # 32 steps: the exact kk-th largest block top, whichever range the bisection starts from.
    monkeypatch.setitem(ttk.SCAN_CONFIG, "start_steps", 32)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "start_narrow", 1 - min(narrow, 1))
    st = {}
    ttk.exact_topk(r, k, valid, topk, small_max_n=0, cap=64, stats=st)
    assert torch.equal(st["counts"].cpu(), counts[32])


@pytest.mark.parametrize("narrow", [0, 1, 2])
def test_exact_topk_final_narrow_edge_rows(monkeypatch, narrow):
    """The final selection's bisection over the list's own key range (final_narrow 1), over the whole 32-bit range (0)
    and its threshold from a sort of the list (2): the same selection for rows with one valid key, fewer valid keys
    than k, none, and massive ties; negative and positive scores in one row."""
    monkeypatch.setitem(ttk.SCAN_CONFIG, "final_narrow", narrow)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "start_narrow", min(narrow, 1))
    N, M, topk = 700, 4, 6
    r = _ints((3, M, 32), -3, 4, 41)
    k = _ints((3, N, 32), -3, 4, 42)
    k[2, 100:600] = k[2, 50:51]  # head 2: most keys tie
    valid = torch.ones(3, N, dtype=torch.bool, device=DEV)
    valid[0, 1:] = False  # one valid key
    valid[1, 4:] = False  # fewer than k
    got = ttk.exact_topk(r, k, valid, topk, small_max_n=0)
    assert _same_sets(got, _ref_topk(r, k, valid, topk))
    assert (got[0, :, 1:] == -1).all() and (got[1, :, 4:] == -1).all()
    key = torch.where(got < 0, 1 << 30, got.long())
    assert torch.equal(key, key.sort(-1).values)  # ascending valid indices, then -1
    valid[1] = False  # none
    got = ttk.exact_topk(r, k, valid, topk, small_max_n=0)
    assert (got[1] == -1).all()
    assert _same_sets(got, _ref_topk(r, k, valid, topk))


def test_exact_topk_whole_tiles_of_tied_candidates():
    """Every block holds many keys at or above the start (massive ties): all of them are scored again."""
    r, k = _ints((2, 5, 32), -1, 2, 3), _ints((2, 900, 32), -1, 2, 4)
    got = ttk.exact_topk(r, k, None, 40, small_max_n=0, cap=512)
    assert torch.equal(got.cpu().long(), _ref_topk(r, k, None, 40).sort(-1).values.cpu())


@pytest.mark.parametrize("pad", [False, True], ids=["select_kernel", "select_kernel_pad"])
@pytest.mark.parametrize("emit_top", [2, 3])
def test_exact_topk_sparse_emit_single_and_rescanned_blocks(monkeypatch, block_top, pad, emit_top):
    """The select kernel's count + emit step writes a block's one key at or above the start from the block tops
    alone (emit_top 3: also a block's two) and scores again only the other blocks: keys planted so that one row has
    single-key blocks, one has blocks with two (a tie at the maximum in one of them) and one a whole block of equal
    keys, over several key chunks, with and without padding."""
    _sparse_emit_case(monkeypatch, pad, emit_top)


@pytest.mark.parametrize("select_eb", [None, 16])
def test_exact_topk_sparse_emit_long_chunks(monkeypatch, block_top, select_eb):
    """The same planted keys with few programs, so each key chunk holds 24 blocks (the block-top pass's steps): the
    select kernel's count + emit step reads 64 blocks' tops per step (the default, one masked step) or 16
    (SCAN_CONFIG select_eb: 3 steps)."""
    monkeypatch.setattr(ttk, "_SCAN_PROGRAMS", 4)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "select_eb", select_eb)
    _sparse_emit_case(monkeypatch, True, 3)


def _sparse_emit_case(monkeypatch, pad, emit_top):
    monkeypatch.setitem(ttk.SCAN_CONFIG, "emit_top", emit_top)
    BH, M, N, d = 2, 6, 3000, 32
    r = _ints((BH, M, d), -1, 2, 5)
    k = _ints((BH, N, d), -1, 2, 6) * 0.25  # background scores well below the planted keys
    valid = None
    if pad:
        valid = torch.ones(BH, N, dtype=torch.bool, device=DEV)
        valid[1, 2500:] = False
    for h in range(BH):
        for i in range(12):
            k[h, 64 * (2 + 3 * i) + 5] = r[h, 0] * 2
        for i in range(6):
            k[h, 64 * (1 + 7 * i) + 9] = r[h, 1] * 2
            k[h, 64 * (1 + 7 * i) + 40] = r[h, 1] * (2 if i == 0 else 1.5)
        k[h, 64 * 30 : 64 * 31] = r[h, 2] * 2
    st: dict = {}
    got = ttk.exact_topk(r, k, valid, 12, small_max_n=0, stats=st)
    assert _same_sets(got, _ref_topk(r, k, valid, 12))
    # Row 0 of each head: its start is the 12th planted key, reached by exactly those 12 (one per block).
    counts = st["counts"].view(BH, M).cpu()
    assert counts[:, 0].tolist() == [12, 12]


def test_exact_topk_fully_padded_row(block_top):
    r = _ints((2, 4, 32), -2, 3, 5)
    k = _ints((2, 90, 32), -2, 3, 6)
    valid = torch.ones(2, 90, dtype=torch.bool, device=DEV)
    valid[1] = False
    for kw in ({}, dict(small_max_n=0)):
        got = ttk.exact_topk(r, k, valid, 8, **kw)
        assert torch.all(got[1] == -1)
        assert _same_sets(got[0:1], _ref_topk(r[0:1], k[0:1], valid[0:1], 8))


@pytest.mark.parametrize(
    "bt,pad",
    # block_top is off by default; one case in the default selection, the others in the slow one.
    [(2, True), pytest.param(2, False, marks=pytest.mark.slow), pytest.param(4, False, marks=pytest.mark.slow),
     pytest.param(4, True, marks=pytest.mark.slow)],
)  # fmt: skip
def test_exact_topk_block_top_start(monkeypatch, bt, pad):
    """Start from the bt largest scores of each key block: exact on the mixed rows (list fits, all ties, refinement,
    ties below the top keys), on integer scores with many ties across blocks, and on correlated tokens, with and
    without padding; on the correlated tokens it leaves fewer rows for the refinement passes than block maxima."""
    monkeypatch.setitem(ttk.SCAN_CONFIG, "block_top", bt)
    N, d, topk = 700, 32, 8
    r, k = _mixed_rows_inputs(N, d)
    valid = _mixed_rows_padding(N) if pad else None
    got = ttk.exact_topk(r, k, valid, topk, small_max_n=0, cap=64)
    assert _same_sets(got, _ref_topk(r, k, valid, topk))
    key = torch.where(got < 0, 1 << 30, got.long())
    assert torch.equal(key, key.sort(-1).values)
    r2 = _ints((2, 6, 32), -2, 3, 17, torch.bfloat16)
    k2 = _ints((2, 1300, 32), -2, 3, 18, torch.bfloat16)
    v2 = None if not pad else torch.rand(2, 1300, generator=torch.Generator().manual_seed(3)).to(DEV) > 0.2
    assert _same_sets(ttk.exact_topk(r2, k2, v2, 16, small_max_n=0), _ref_topk(r2, k2, v2, 16))
    # Correlated tokens (a smoothed random walk): every row overflows the block-maximum start.
    g = torch.Generator().manual_seed(4)
    x = torch.cumsum(torch.randn(1, 2048, 32, generator=g), dim=1) * 0.05 + torch.randn(1, 2048, 32, generator=g)
    kx = x.to(DEV)
    rx = x[:, :: 2048 // 16][:, :16].contiguous().to(DEV)
    st, st1 = {}, {}
    got = ttk.exact_topk(rx, kx, None, 16, stats=st)
    assert _same_sets(got, _ref_topk(rx, kx, None, 16))
    monkeypatch.setitem(ttk.SCAN_CONFIG, "block_top", 1)
    ttk.exact_topk(rx, kx, None, 16, stats=st1)
    assert int(st1["overflow_rows"]) > 8
    assert int(st["overflow_rows"]) < int(st1["overflow_rows"])


def test_exact_topk_block_top_default(monkeypatch):
    """block_top None (the default): the start takes 2 scores per key block while the select kernel holds every entry
    itself (N / bn * 2 <= _START_ENTRIES), else block maxima. Same per-row counts as the explicit settings."""
    g = torch.Generator().manual_seed(4)
    x = torch.cumsum(torch.randn(1, 2048, 32, generator=g), dim=1) * 0.05 + torch.randn(1, 2048, 32, generator=g)
    kx = x.to(DEV)
    rx = x[:, :: 2048 // 16][:, :16].contiguous().to(DEV)
    counts = {}
    for bt in (1, 2, None):
        monkeypatch.setitem(ttk.SCAN_CONFIG, "block_top", bt)
        st: dict = {}
        ttk.exact_topk(rx, kx, None, 16, stats=st)
        counts[bt] = st["counts"].cpu()
    assert not torch.equal(counts[1], counts[2])
    assert torch.equal(counts[None], counts[2])
    # 2048 keys = 32 blocks of 64: with room for fewer than 64 entries the default falls back to block maxima.
    monkeypatch.setattr(ttk, "_START_ENTRIES", 63)
    st = {}
    ttk.exact_topk(rx, kx, None, 16, stats=st)
    assert torch.equal(st["counts"].cpu(), counts[1])


@pytest.mark.parametrize("S", [1, 2, 3])
def test_route_topk_matches_stable_sort(S):
    q = _ints((2, 77, 32), -2, 3, 7, torch.bfloat16)
    r = _ints((2, 19, 32), -2, 3, 8, torch.bfloat16)
    got = trt.route_topk(q, r, S)
    ref = stable_topk_indices(q.double() @ r.double().transpose(1, 2), S)
    assert torch.equal(got.view(2, 77, S).long().cpu(), ref.cpu())


def test_route_top1_multiple_landmark_tiles_and_ties():
    # M = 150: two landmark tiles of 128, the second partial; scores tie often (small integers), across tiles
    # too, and the first 40 queries score 0 against every landmark (landmark 0 wins).
    q = _ints((2, 300, 32), -1, 2, 13)
    r = _ints((2, 150, 32), -1, 2, 14)
    q[:, :40] = 0.0
    r[:, 140] = r[:, 3]
    got = trt.route_topk(q, r, 1)
    ref = stable_topk_indices(q.double() @ r.double().transpose(1, 2), 1)
    assert torch.equal(got.view(2, 300, 1).long().cpu(), ref.cpu())
    assert torch.all(got[:, :40] == 0)


def _route_top1_launch(triton_launches, N: int, M: int, seed: int) -> dict:
    """Top-1 routes of integer-valued queries and landmarks (ties often) against the stable sort; the routing
    kernel's launch arguments."""
    q = _ints((2, N, 32), -1, 2, seed)
    r = _ints((2, M, 32), -1, 2, seed + 1)
    got = trt.route_topk(q, r, 1)
    ref = stable_topk_indices(q.double() @ r.double().transpose(1, 2), 1)
    assert torch.equal(got.view(2, N, 1).long().cpu(), ref.cpu())
    (kw,) = [kw for name, kw in triton_launches.kwargs if name == "_route_kernel"]
    return kw


@pytest.mark.parametrize("N,M", [(256, 64), (300, 150)])
def test_route_top1_unmasked_tiles(triton_launches, N, M):
    """Whole query and landmark tiles load without masks (N = 256, m = 64: 2 x 128-query tiles, one 64-landmark
    tile), the same routes as the stable sort; other shapes keep the masks."""
    assert _route_top1_launch(triton_launches, N, M, 21)["EVEN"] == (N == 256)


@pytest.mark.parametrize("N,M,persistent", [(512, 64, 1), (512, 64, 0), (300, 64, 1), (512, 40, 1)])
def test_route_top1_persistent(monkeypatch, triton_launches, N, M, persistent):
    """ROUTE_CONFIG persistent: S = 1 over one whole landmark tile (m = 64) in programs that loop over the query
    tiles (4 x 128 queries for N = 512), the same routes as the stable sort; shapes that need masks (N = 300, m = 40)
    keep the per-tile grid."""
    monkeypatch.setitem(trt.ROUTE_CONFIG, "persistent", persistent)
    kw = _route_top1_launch(triton_launches, N, M, 23)
    assert kw["PERSIST"] == bool(persistent and N == 512 and M == 64)
    monkeypatch.setitem(trt.ROUTE_CONFIG, "persistent", -1)
    with pytest.raises(ValueError, match="persistent"):
        trt.route_topk(_ints((2, N, 32), -1, 2, 23), _ints((2, M, 32), -1, 2, 24), 1)


def _lv_logits(r, k, valid, scale):
    s = (r.double() @ k.double().transpose(1, 2)) * scale
    return s if valid is None else s.masked_fill(~valid[:, None, :], float("-inf"))


def _lv_ref(r, k, v, valid, scale):
    p = torch.softmax(_lv_logits(r, k, valid, scale), -1).nan_to_num(0.0)
    return p @ v.double()


@pytest.mark.parametrize(
    "N,M,d,dtype,pad",
    [
        (100, 7, 32, torch.float32, False),
        (300, 20, 32, torch.float32, True),
        (530, 9, 64, torch.bfloat16, True),
        (200, 5, 128, torch.float16, False),
    ],
)
def test_landmark_values_forward_backward(N, M, d, dtype, pad):
    BH = 2
    g = torch.Generator().manual_seed(N)
    r, k, v = (torch.randn(BH, n, d, generator=g).to(DEV, dtype).requires_grad_() for n in (M, N, N))
    valid = None
    if pad:
        valid = torch.ones(BH, N, dtype=torch.bool, device=DEV)
        valid[0, N // 2 :] = False
        valid[1] = False
    scale = d**-0.5
    out = tlv.LandmarkValuesFn.apply(r, k, v, valid, scale)
    ref = _lv_ref(r, k, v, valid, scale)
    dvt = torch.randn(BH, M, d, generator=g).to(DEV, dtype)
    grads = torch.autograd.grad(out, (r, k, v), dvt)
    ref_grads = torch.autograd.grad(ref, (r, k, v), dvt.double())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < tol, err
    if pad:
        assert torch.all(out[1] == 0)
    for a, b in zip(grads, ref_grads):
        assert torch.isfinite(a).all()
        e = ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert e < 2 * tol, e


@pytest.mark.parametrize("N,M,d,topk,span,pad", [(700, 5, 32, 40, 2, True), (1100, 3, 64, 64, 3, False)])
def test_exact_topk_final_orders(N, M, d, topk, span, pad):
    """The final selection orders the chosen indices by one tl.sort of the list: the reference's rows, ascending,
    then -1 where a row has fewer valid keys than k (rows with all, some and no valid keys; integer scores with
    many ties)."""
    r = _ints((3, M, d), -span, span + 1, N)
    k = _ints((3, N, d), -span, span + 1, N + 1)
    valid = None
    if pad:
        valid = torch.ones(3, N, dtype=torch.bool, device=DEV)
        valid[1, 20:] = False  # 20 valid keys < k
        valid[2] = False
    got = ttk.exact_topk(r, k, valid, topk, small_max_n=0)
    ref = _ref_topk(r, k, valid, topk)
    want = torch.where(ref < 0, 1 << 30, ref.long()).sort(-1).values
    assert torch.equal(torch.where(got < 0, 1 << 30, got.long()).cpu(), want.cpu())


def _lse_ref(r, k, valid, scale):
    return torch.logsumexp(_lv_logits(r, k, valid, scale), -1) / torch.log(torch.tensor(2.0, dtype=torch.float64))


@pytest.mark.parametrize(
    "N,M,d,topk,dtype,pad,small,medium,lv_div",
    [
        (1025, 16, 64, 8, torch.float32, False, 0, 0, 1),
        (700, 20, 32, 16, torch.bfloat16, True, 0, 0, 1),
        (600, 5, 128, 64, torch.float16, True, 0, 0, 1),
        (90, 7, 32, 9, torch.float32, True, 512, 0, 1),  # the on-chip top-k, then the separate landmark values
        (1025, 16, 64, 8, torch.float32, False, 0, 2048, 1),
        (700, 20, 32, 16, torch.bfloat16, True, 0, 2048, 1),
        (600, 80, 32, 16, torch.bfloat16, True, 0, 2048, 8),  # one key chunk: the keys kernel writes them
    ],
    ids=["long-1025", "long-700", "long-600-d128", "small", "medium-1025", "medium-700", "medium-direct"],
)
def test_exact_topk_with_landmark_values(monkeypatch, N, M, d, topk, dtype, pad, small, medium, lv_div):
    """exact_topk(lv=...): the same selection as without it, and the landmark values and their LSE, from the
    block-top pass's scores (merged in the select kernel), from the medium-row keys kernel's (merged in the rows
    kernel, or written directly from one key chunk) or, on the on-chip path, from the separate split-key pass. Fully
    padded rows give zeros, -inf."""
    # Several key chunks, so the merge combines partials (lv_div 1: up to N / m chunks), except in the direct case.
    monkeypatch.setitem(ttk.SCAN_CONFIG, "lv_div", lv_div)
    BH = 3
    g = torch.Generator().manual_seed(N + d)
    r, k, v = (torch.randn(BH, n, d, generator=g).to(DEV, dtype) for n in (M, N, N))
    valid = None
    if pad:
        valid = torch.rand(BH, N, generator=g).to(DEV) > 0.3
        valid[1] = False
    scale = d**-0.5
    kw = dict(small_max_n=small, medium_max_n=medium)
    idx, vt, lse = ttk.exact_topk(r, k, valid, topk, lv=(v, scale), **kw)
    assert torch.equal(idx, ttk.exact_topk(r, k, valid, topk, **kw))
    assert _same_sets(idx, _ref_topk(r, k, valid, topk))
    ref = _lv_ref(r, k, v, valid, scale)
    assert vt.dtype == dtype and vt.shape == (BH, M, d) and torch.isfinite(vt).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((vt.double() - ref).norm() / ref.norm()).item() < tol
    lref = _lse_ref(r, k, valid, scale)
    fin = torch.isfinite(lref)
    assert torch.equal(torch.isfinite(lse), fin)
    assert torch.allclose(lse[fin].double(), lref[fin], atol=1e-4, rtol=0)
    if pad:
        assert torch.all(vt[1] == 0) and torch.all(lse[1] == float("-inf"))


@pytest.mark.parametrize("dtype,lazy", [(torch.float32, 1), (torch.bfloat16, 1), (torch.bfloat16, 2)])
def test_exact_topk_even_lazy_landmark_values(monkeypatch, triton_launches, dtype, lazy):
    """The block-top pass without masks (EVEN: no padding) and lv_lazy (its landmark-value softmax rescaled only when
    a maximum grows by more than 2^8): the same selection as the masked pass (an all-true key mask), landmark values
    and LSE against float64. Key norms grow 12x along N, so later blocks of a chunk raise the maxima."""
    monkeypatch.setitem(ttk.SCAN_CONFIG, "lv_div", 4)  # 4 chunks of 4 key blocks
    monkeypatch.setitem(ttk.SCAN_CONFIG, "bs", 16)  # one tile of 16 landmarks (even needs whole tiles)
    BH, N, M, d = 1, 1024, 16, 32
    g = torch.Generator().manual_seed(5)
    r, v = torch.randn(BH, M, d, generator=g), torch.randn(BH, N, d, generator=g)
    k = torch.randn(BH, N, d, generator=g) * torch.linspace(1.0, 12.0, N)[:, None]
    r, k, v = (t.to(DEV, dtype) for t in (r, k, v))
    scale = d**-0.5
    base = ttk.exact_topk(r, k, torch.ones(BH, N, dtype=torch.bool, device=DEV), 16, small_max_n=0)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "lv_lazy", lazy)
    triton_launches.kwargs.clear()
    idx, vt, lse = ttk.exact_topk(r, k, None, 16, small_max_n=0, lv=(v, scale))
    mode0 = [kw for name, kw in triton_launches.kwargs if name == "_topk_scan_kernel" and kw["MODE"] == 0]
    assert len(mode0) == 1 and mode0[0]["EVEN"] and mode0[0]["LAZY"] == lazy and mode0[0]["LVF"]
    assert torch.equal(idx, base)
    ref = _lv_ref(r, k, v, None, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((vt.double() - ref).norm() / ref.norm()).item() < tol
    assert torch.allclose(lse.double(), _lse_ref(r, k, None, scale), atol=1e-4, rtol=0)


@pytest.mark.parametrize("even,pad,emit_top", [(1, False, 3), (0, True, 2)])
def test_exact_topk_block_tops_with_ties(monkeypatch, triton_launches, even, pad, emit_top):
    """Block tops as a maximum, then the first key equal to it (with EVEN and lv_lazy the landmark values reuse
    those maxima): the reference's selection. Keys on a coarse grid make many scores tie (also inside a block), and
    some blocks hold several of a row's top keys; padding takes the masked pass."""
    monkeypatch.setitem(ttk.SCAN_CONFIG, "lv_div", 2)
    monkeypatch.setitem(ttk.SCAN_CONFIG, "emit_top", emit_top)
    BH, N, M, d = (1, 512, 64, 32) if even else (2, 512, 32, 32)
    g = torch.Generator().manual_seed(11)
    r = torch.randn(BH, M, d, generator=g).round()
    k = (torch.randn(BH, N, d, generator=g) * 2).round() / 2
    v = torch.randn(BH, N, d, generator=g)
    kv = None
    if pad:
        kv = torch.ones(BH, N, dtype=torch.bool)
        kv[1, 350:] = False
        kv = kv.to(DEV)
    r, k, v = (t.to(DEV, torch.bfloat16) for t in (r, k, v))
    triton_launches.kwargs.clear()
    idx, _, _ = ttk.exact_topk(r, k, kv, 8, small_max_n=0, lv=(v, d**-0.5))
    mode0 = [kw for name, kw in triton_launches.kwargs if name == "_topk_scan_kernel" and kw["MODE"] == 0]
    assert len(mode0) == 1 and mode0[0]["EVEN"] == bool(even)
    ref = torch.sort(_ref_topk(r, k, kv, 8), dim=-1).values
    assert torch.equal(idx.long().cpu(), ref.long().cpu())


def test_exact_topk_landmark_values_fused_launches(monkeypatch, triton_launches):
    """With lv: the top-k's launches, the merge inside the select kernel; no separate landmark-value pass."""
    launches = triton_launches
    r = _ints((1, 3, 32), -1, 2, 15)
    k, v = _ints((1, 70, 32), -1, 2, 16), _ints((1, 70, 32), -2, 3, 17)
    idx, vt, lse = ttk.exact_topk(r, k, None, 5, small_max_n=0, lv=(v, 0.5))
    assert _same_sets(idx, _ref_topk(r, k, None, 5))
    assert launches == _TOPK_LAUNCHES, launches
    assert [kw["MERGE"] for name, kw in triton_launches.kwargs if name == "_topk_select_kernel"] == [True]
    ref = _lv_ref(r, k, v, None, 0.5)
    assert ((vt.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert torch.allclose(lse.double(), _lse_ref(r, k, None, 0.5), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="lv_div"):
        monkeypatch.setitem(ttk.SCAN_CONFIG, "lv_div", 0)
        ttk.exact_topk(r, k, None, 5, small_max_n=0, lv=(v, 0.5))


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N,M,topk", [(1000, 25, 25), (4097, 32, 64), (65536, 128, 128), (262144, 64, 256)])
def test_gpu_exact_topk_and_route(N, M, topk):
    r = _ints((2, M, 64), -3, 4, N, torch.bfloat16)
    k = _ints((2, N, 64), -3, 4, N + 1, torch.bfloat16)
    valid = torch.ones(2, N, dtype=torch.bool, device=DEV)
    valid[1, N // 2 :] = False
    assert _same_sets(ttk.exact_topk(r, k, valid, topk), _ref_topk(r, k, valid, topk))
    assert _same_sets(ttk.exact_topk(r, k, None, topk), _ref_topk(r, k, None, topk))
    got = trt.route_topk(k, r, 2)
    ref = stable_topk_indices(k.double() @ r.double().transpose(1, 2), 2)
    assert torch.equal(got.view(2, N, 2).long(), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N,M,topk", [(513, 16, 64), (1025, 49, 49), (2000, 32, 64), (4096, 32, 32), (4096, 32, 128)])
def test_gpu_exact_topk_medium_rows(N, M, topk):
    r = _ints((6, M, 64), -3, 4, N, torch.bfloat16)
    k = _ints((6, N, 64), -3, 4, N + 1, torch.bfloat16)
    valid = torch.rand(6, N, generator=torch.Generator().manual_seed(N)).to(DEV) > 0.3
    valid[1, N // 2 :] = False
    valid[2] = False
    valid[2, 3 : 3 + topk // 2] = True
    for kv in (valid, None):
        got = ttk.exact_topk(r, k, kv, topk)
        assert torch.equal(got.long().cpu(), _ascending(_ref_topk(r, k, kv, topk)))


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N,M", [(65536, 128), (262144, 256)])
@pytest.mark.parametrize("cap", [None, "k"])
@pytest.mark.parametrize("bt", [1, 2])
def test_gpu_exact_topk_select_and_fallback_paths(monkeypatch, N, M, cap, bt):
    # Integer scores over a wider range (fewer ties): with the default list every row takes the select kernel's
    # emission; with cap = k most rows take the refinement and ordered emission. Both equal a stable sort.
    r = _ints((2, M, 64), -8, 9, N + 2, torch.bfloat16)
    k = _ints((2, N, 64), -8, 9, N + 3, torch.bfloat16)
    valid = torch.ones(2, N, dtype=torch.bool, device=DEV)
    valid[0, : N // 4] = False
    kw = dict(cap=M) if cap == "k" else {}
    monkeypatch.setitem(ttk.SCAN_CONFIG, "block_top", bt)
    for kv in (None, valid):
        got = ttk.exact_topk(r, k, kv, M, **kw)
        assert _same_sets(got, _ref_topk(r, k, kv, M))
        key = torch.where(got < 0, 1 << 30, got.long())
        assert torch.equal(key, key.sort(-1).values)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N,M,pad", [(65536, 128, False), (262144, 256, True)])
def test_gpu_persistent_fallback_graph_replays(monkeypatch, N, M, pad):
    """The persistent fallback kernel (one program per SM, grid barriers between its passes) where most rows
    overflow (cap = k, integer scores with ties): bitwise the default list's result and a stable sort's
    selection, eagerly and in a CUDA graph replayed three times over a poisoned output (the barrier counter starts
    again at every replay); and with the default list."""
    r = _ints((2, M, 64), -8, 9, N + 7, torch.bfloat16)
    k = _ints((2, N, 64), -8, 9, N + 8, torch.bfloat16)
    valid = None
    if pad:
        valid = torch.ones(2, N, dtype=torch.bool, device=DEV)
        valid[1, N // 3 :] = False
    base = ttk.exact_topk(r, k, valid, M)
    st = {}
    got = ttk.exact_topk(r, k, valid, M, cap=M, stats=st)
    assert int(st["overflow_rows"]) > 0
    assert torch.equal(got, base)
    assert _same_sets(base, _ref_topk(r, k, valid, M))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ttk.exact_topk(r, k, valid, M, cap=M)
    for _ in range(3):
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, base)
    assert _same_sets(ttk.exact_topk(r, k, valid, M), _ref_topk(r, k, valid, M))


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N,M", [(65536, 128), (262144, 256)])
@pytest.mark.parametrize("steps", [32, 20, 12])
def test_gpu_exact_topk_start_steps(monkeypatch, N, M, steps):
    """The start threshold's bisection stopped early (start_steps 20, and 12, which rounds it down by 2^20 order-key
    units): exact on the select kernel's path and on the refinement path (cap = k: rows overflow, so the fallback
    launches do work), with and without padding; with the landmark values."""
    r = _ints((2, M, 64), -8, 9, N + 5, torch.bfloat16)
    k = _ints((2, N, 64), -8, 9, N + 6, torch.bfloat16)
    v = torch.randn(2, N, 64, generator=torch.Generator().manual_seed(N)).to(DEV, torch.bfloat16)
    valid = torch.ones(2, N, dtype=torch.bool, device=DEV)
    valid[0, : N // 4] = False
    monkeypatch.setitem(ttk.SCAN_CONFIG, "start_steps", steps)
    for kv in (None, valid):
        ref = _ref_topk(r, k, kv, M)
        for kw in ({}, dict(cap=M)):
            st = {}
            got = ttk.exact_topk(r, k, kv, M, stats=st, **kw)
            assert _same_sets(got, ref), kw
            assert (st["counts"] >= M).all()
            if kw:
                assert int(st["overflow_rows"]) > 0
        idx, vt, lse = ttk.exact_topk(r, k, kv, M, lv=(v, 0.125))
        assert _same_sets(idx, ref)
        assert torch.isfinite(vt).all() and torch.isfinite(lse).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("bt", [1, 2])
def test_gpu_exact_topk_correlated_tokens(monkeypatch, bt):
    """Correlated tokens (every row overflows the block-maximum start) at 64K, bf16: exact with block maxima and
    with two scores per key block, which admits fewer keys (CPU model: median 715 against 1439; the list holds
    256, so the rows still overflow). Integer tokens (a moving average of noise, rounded to [-8, 8]) keep the
    scores exact in float32, with ties."""
    monkeypatch.setitem(ttk.SCAN_CONFIG, "block_top", bt)
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 65536 + 63, 64, generator=g).unfold(1, 64, 1).mean(-1) * 32).round().clamp(-8, 8)
    k = x.to(DEV, torch.bfloat16)
    r = x[:, ::512].contiguous().to(DEV, torch.bfloat16)
    st = {}
    got = ttk.exact_topk(r, k, None, 128, stats=st)
    assert _same_sets(got, _ref_topk(r, k, None, 128))
    assert int(st["overflow_rows"]) > 200
    median = st["counts"].float().median().item()
    assert (median < 1000) if bt == 2 else (median > 1300)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "N,M,rho,lv",
    [(65536, 128, 0.0, True), (262144, 256, 0.0, True), (65536, 128, 0.9, False), (1 << 20, 512, 0.0, False)],
)
def test_gpu_select_kernel(N, M, rho, lv):
    """The per-row select kernel on the GPU, bf16 Gaussian tokens (rho: correlated along N): the blocks it scores
    again must reproduce the block-top pass's tensor-core scores to the bit, else keys go missing or twice (64K uses
    three block-top planes, 256K and 1M two, so more blocks are scored again). Against float32 scores: distinct
    indices, ascending, each a key whose score reaches the row's k-th largest (up to the rounding of the kernels'
    sums); every row's count at or above its start at least k and the overflow count the rows past the list;
    correlated tokens make rows overflow into the fallback; the landmark values against float32."""
    g = torch.Generator(device=DEV).manual_seed(N)
    if rho:
        # Correlated along N: moving averages of 64 noise vectors (neighbouring keys nearly equal).
        k = torch.randn(2, N + 63, 64, device=DEV, generator=g).unfold(1, 64, 1).mean(-1) * 8
    else:
        k = torch.randn(2, N, 64, device=DEV, generator=g)
    k = k.to(torch.bfloat16)
    v = torch.randn(2, N, 64, device=DEV, generator=g).to(torch.bfloat16)
    r = k.view(2, M, N // M, 64).float().mean(2).to(torch.bfloat16)
    st: dict = {}
    res = ttk.exact_topk(r, k, None, M, stats=st, lv=(v, 0.125) if lv else None)
    idx = res[0] if lv else res
    s = r.float() @ k.float().transpose(1, 2)
    assert (idx >= 0).all()
    assert (idx[..., 1:] > idx[..., :-1]).all()
    kth = s.topk(M, dim=-1).values[..., -1:]
    chosen = torch.gather(s, 2, idx.long())
    assert (chosen >= kth - 1e-4 * kth.abs().clamp_min(1.0)).all()
    assert (st["counts"] >= M).all()
    assert int(st["overflow_rows"]) == int((st["counts"] > st["cap"]).sum())
    if rho:
        assert int(st["overflow_rows"]) > 0
    if lv:
        ref = torch.softmax(s * 0.125, -1) @ v.float()
        assert torch.isfinite(res[1]).all()
        assert ((res[1].float() - ref).norm() / ref.norm()).item() < 1e-2
        torch.testing.assert_close(res[2], torch.logsumexp(s * 0.125, -1) * 1.4426950408889634, rtol=0, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N,M", [(197, 25), (65536, 128), (1 << 20, 512)])
def test_gpu_landmark_values(N, M):
    g = torch.Generator().manual_seed(N)
    r, k, v = (torch.randn(1, n, 64, generator=g).to(DEV, torch.bfloat16).requires_grad_() for n in (M, N, N))
    out = tlv.LandmarkValuesFn.apply(r, k, v, None, 0.125)
    dvt = torch.randn(1, M, 64, generator=g).to(DEV, torch.bfloat16)
    grads = torch.autograd.grad(out, (r, k, v), dvt)
    rf, kf, vf = (t.detach().float().requires_grad_() for t in (r, k, v))
    ref = torch.softmax(rf @ kf.transpose(1, 2) * 0.125, -1) @ vf
    ref_grads = torch.autograd.grad(ref, (rf, kf, vf), dvt.float())
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
    for a, b in zip(grads, ref_grads):
        assert ((a.float() - b).norm() / b.norm()).item() < 4e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("lazy", [None, 1])
@pytest.mark.parametrize("N,M", [(65536, 128), (1 << 20, 512)])
def test_gpu_exact_topk_with_landmark_values(monkeypatch, lazy, N, M):
    monkeypatch.setitem(ttk.SCAN_CONFIG, "lv_lazy", lazy)
    # Integer landmarks and keys: float32 scores are exact, so the selection can be compared with float64's.
    r = _ints((2, M, 64), -2, 3, N, torch.bfloat16)
    k = _ints((2, N, 64), -2, 3, N + 1, torch.bfloat16)
    v = torch.randn(2, N, 64, generator=torch.Generator().manual_seed(N)).to(DEV, torch.bfloat16)
    valid = torch.ones(2, N, dtype=torch.bool, device=DEV)
    valid[1, N // 3 :] = False
    idx, vt, lse = ttk.exact_topk(r, k, valid, M, lv=(v, 0.125))
    assert _same_sets(idx, _ref_topk(r, k, valid, M))
    s = (r.float() @ k.float().transpose(1, 2)) * 0.125
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    ref = torch.softmax(s, -1) @ v.float()
    assert torch.isfinite(vt).all()
    assert ((vt.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.allclose(lse, torch.logsumexp(s, -1) * 1.4426950408889634, atol=1e-3, rtol=0)


def test_fallback_programs_resident_per_sm(monkeypatch):
    """The persistent fallback kernel's programs per SM: what the SM's registers (255 per thread, the most any
    specialisation takes, in per-warp units of 256), shared memory (the compiled kernel's, 1 KiB reserved per program)
    and threads hold at once, capped at _FB_RESIDENT_MAX; 1 when the compiled kernel or the device does not say."""
    import types

    prop = types.SimpleNamespace(
        regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472, max_threads_per_multi_processor=2048
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: prop)
    dev = torch.device("cuda", 0)

    def kern(smem):
        return types.SimpleNamespace(n_regs=64, metadata=types.SimpleNamespace(shared=smem))

    assert ttk._resident_per_sm(kern(65536), 4, dev) == 2  # 2 x 4 warps x 8K registers
    assert ttk._resident_per_sm(kern(0), 8, dev) == 1  # 64K registers for one, whatever this binary takes
    assert ttk._resident_per_sm(kern(120000), 4, dev) == 1  # shared memory for one
    monkeypatch.setattr(ttk, "_FB_RESIDENT_MAX", 8)
    assert ttk._resident_per_sm(kern(0), 1, dev) == 8
    prop.regs_per_multiprocessor = 1 << 20
    assert ttk._resident_per_sm(kern(0), 16, dev) == 4  # 2048 threads
    prop.shared_memory_per_multiprocessor = 102400
    assert ttk._resident_per_sm(kern(65536), 4, dev) == 1
    assert ttk._resident_per_sm(types.SimpleNamespace(), 4, dev) == 1
    del prop.regs_per_multiprocessor
    assert ttk._resident_per_sm(kern(0), 4, dev) == 1


@triton.jit
def _select_probe_kernel(KEY, VALID, ROWV, KK, SEL, L: tl.constexpr, R: tl.constexpr):
    o_r = tl.arange(0, R)
    o_l = tl.arange(0, L)
    p = o_r[:, None] * L + o_l[None, :]
    m_j = tl.load(ROWV + o_r) != 0
    m_v = (tl.load(VALID + p) != 0) & m_j[:, None]
    sel = tks._topk_select(tl.load(KEY + p), m_v, m_j, tl.load(KK))
    tl.store(SEL + p, sel.to(tl.int8))


def _select_reference(key, valid, row_valid, kk):
    """Top-kk of each valid row among its valid entries: larger key first, ties to the lower column."""
    sel = torch.zeros_like(key, dtype=torch.int8)
    for i in range(key.shape[0]):
        if not row_valid[i]:
            continue
        cols = [j for j in range(key.shape[1]) if valid[i, j]]
        cols.sort(key=lambda j: (-int(key[i, j]), j))
        sel[i, cols[:kk]] = 1
    return sel


@pytest.mark.parametrize("L", [16, 64, 512, 2048])
def test_topk_select_four_way_search(L):
    """``_topk_select`` (the exact top-k over int32 order keys of the short kernels and of per-query top-k's
    ``row_topk_bias``; int64 count fields from 1024 entries) against a sort: keys at both ends of int32 (the order
    key of a NaN with every bit set is the smallest int32), rows of one repeated key, keys one or two apart (the
    search's last steps), kk above a row's valid count, rows with no valid entry, masked rows."""
    R = 16
    g = torch.Generator().manual_seed(L)
    lo, hi = -(2**31), 2**31 - 1
    key = torch.randint(lo, hi, (R, L), generator=g, dtype=torch.int64)
    key[1] = torch.randint(-3, 3, (L,), generator=g)  # many ties, w <= 6
    key[2] = 7  # one repeated key
    key[3, ::2] = lo  # the smallest int32 (a NaN's order key), valid
    key[3, 1::2] = hi
    key[4] = torch.randint(lo, lo + 4, (L,), generator=g)  # near the bottom: thresholds just above lo
    key[5] = torch.randint(hi - 4, hi + 1, (L,), generator=g)  # near the top: hi = max + 1 past int32
    key[6] = torch.arange(L) * 2  # distinct, two apart
    key = key.to(torch.int32)
    valid = torch.rand(R, L, generator=g) > 0.2
    valid[2] = True
    valid[7] = False  # no valid entry
    valid[8] = torch.arange(L) < 3  # fewer valid entries than kk
    row_valid = torch.ones(R, dtype=torch.bool)
    row_valid[9] = False
    for kk in (1, 5, L // 2, L):
        sel = torch.empty(R, L, dtype=torch.int8, device=DEV)
        args = (key, valid.to(torch.int8), row_valid.to(torch.int8), torch.tensor([kk], dtype=torch.int32))
        _select_probe_kernel[(1,)](*(a.to(DEV) for a in args), sel, L=L, R=R)
        assert torch.equal(sel.cpu(), _select_reference(key, valid, row_valid, kk)), kk
