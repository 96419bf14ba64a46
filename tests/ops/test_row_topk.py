"""Per-row top-k selection as an attention bias (mita/ops/row_topk.py): the Triton kernel (interpreted on the CPU,
compiled on CUDA) against the stable-sort form, both against the definition by ranks, on awkward shapes, ties,
padding (-inf), NaN and signed zeros, with poisoned allocations."""

from __future__ import annotations

import pytest
import torch

from mita.ops import row_topk
from mita.ops.row_topk import kernel_supported, row_topk_bias

# Every test here runs with poisoned allocations (tests/conftest.py: NaN floats, integers no kernel writes).
pytestmark = pytest.mark.usefixtures("poison")

_CUDA = torch.cuda.is_available()
INF = float("-inf")


def by_rank(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The definition: entry j is kept iff it is finite and fewer than k finite entries rank before it (larger, or
    equal at a lower column)."""
    s = scores.double()
    finite = ~(s.isnan() | (s == INF))
    s = s.masked_fill(~finite, INF)
    cols = torch.arange(s.shape[-1], device=s.device)
    greater = s[..., None, :] > s[..., :, None]  # [..., j, i]: s_i > s_j
    tied_before = (s[..., None, :] == s[..., :, None]) & (cols[None, :] < cols[:, None])
    rank = ((greater | tied_before) & finite[..., None, :]).sum(-1)
    keep = finite & (rank < k)
    return torch.zeros(s.shape, device=s.device).masked_fill(~keep, INF)


def scores_with_ties(shape, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(shape, generator=g)
    src = s[..., 1::3].clone()
    s[..., 0 : 3 * src.shape[-1] : 3] = src  # exact ties: column 3i equals column 3i + 1
    return s.to(dtype).to(device)


@pytest.mark.parametrize(
    "shape,k",
    [((1, 1), 1), ((3, 17), 5), ((2, 3, 37), 40), ((5, 64), 64), ((2, 300), 96), ((4, 1000), 1), ((3, 2000), 96)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_sort_and_definition(shape, k, dtype):
    s = scores_with_ties(shape, dtype, seed=shape[-1] + k)
    flat = s.view(-1, shape[-1])
    flat[0, shape[-1] // 2 :] = INF  # a padded row
    if flat.shape[0] > 1:
        flat[1, 0] = float("nan")
        flat[1, -1] = -0.0
    assert kernel_supported(s)
    got = row_topk_bias(s, k)
    assert got.dtype == dtype and got.shape == s.shape
    ref = row_topk._sort_bias(s, k, dtype)
    assert torch.equal(got, ref)
    if shape[-1] <= 300:
        assert torch.equal(got.double(), by_rank(s, k))
    finite = ~(s.float().isnan() | (s.float() == INF))
    assert torch.equal((got == 0).sum(-1), finite.sum(-1).clamp(max=k))


def test_signed_zeros_tie_and_all_padding_rows_select_nothing():
    s = torch.tensor([[0.0, -0.0, -1.0, 0.0], [INF, INF, INF, INF]])
    got = row_topk_bias(s, 2)
    assert torch.equal(got[0], torch.tensor([0.0, 0.0, INF, INF]))  # -0.0 ties +0.0: the lower index first
    assert torch.equal(got[1], torch.full((4,), INF))


def test_strided_input_and_output_dtype():
    s = scores_with_ties((6, 40), torch.float32).t()  # non-contiguous rows
    got = row_topk_bias(s, 7, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), row_topk._sort_bias(s.contiguous(), 7, torch.float32))


def test_rows_longer_than_the_kernel_take_the_sort():
    s = scores_with_ties((2, row_topk.MAX_COLS + 1), torch.bfloat16)
    assert not kernel_supported(s)
    got = row_topk_bias(s, 33)
    assert torch.equal((got == 0).sum(-1), torch.tensor([33, 33]))
    assert torch.equal(got, row_topk._sort_bias(s, 33, s.dtype))


@pytest.mark.parametrize("k", [0, -1, 2.0, True])
def test_bad_k_is_a_clear_error(k):
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        row_topk_bias(torch.zeros(2, 3), k)


def test_integer_bias_dtype_is_refused():
    with pytest.raises(ValueError, match="floating dtype"):
        row_topk_bias(torch.zeros(2, 3), 1, dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("shape,k", [((32, 2, 2000, 2000), 96), ((4, 2, 4096, 4096), 128), ((64, 2, 384, 384), 64)])
def test_gpu_kernel_equals_sort(shape, k):
    """Long Range Arena shapes (ListOps, Text, a compacted Pathfinder batch) in bf16 on the GPU."""
    s = scores_with_ties(shape, torch.bfloat16, device="cuda")
    s[0, 0, :, shape[-1] // 3 :] = INF
    got = row_topk_bias(s, k)
    assert torch.equal(got, row_topk._sort_bias(s, k, s.dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 3e4])
def test_extreme_and_subnormal_scores(dtype, scale):
    """Half-precision keys are bisected on their top bits only: subnormals, the largest finite values and tiny
    differences keep their order."""
    g = torch.Generator().manual_seed(int(scale * 7) + 3)
    s = torch.randn(32, 300, generator=g) * scale
    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal / 4  # a subnormal of the dtype
    s[:, :6] = torch.tensor([big, -big, tiny, -tiny, 0.0, -0.0])
    s = s.to(dtype)
    for k in (1, 7, 150, 299):
        assert torch.equal(row_topk_bias(s, k), row_topk._sort_bias(s, k, dtype)), k


@pytest.mark.parametrize("shape", [(3, 2, 5, 40), (2, 7, 300), (4, 33)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_key_padding_mask_equals_minus_inf_scores(shape, dtype):
    """The padding mask ([B, M], one row of it per leading index) selects as -inf scores in its columns would, in
    the kernel and in the sort form (a strided view of the scores included)."""
    s = scores_with_ties(shape, dtype, seed=len(shape))
    g = torch.Generator().manual_seed(5)
    pad = torch.rand(shape[0], shape[-1], generator=g) < 0.4
    pad[0] = True  # a batch with every key padded selects nothing
    view = pad.view(shape[0], *([1] * (len(shape) - 2)), shape[-1])
    want = row_topk._sort_bias(s.masked_fill(view, INF), 9, dtype)
    assert torch.equal(row_topk_bias(s, 9, key_padding_mask=pad), want)
    if len(shape) > 2:
        t = s.transpose(-2, -3).contiguous().transpose(-2, -3)  # same values, other strides
        assert torch.equal(row_topk_bias(t, 9, key_padding_mask=pad), want)


def test_key_padding_mask_shape_is_checked():
    with pytest.raises(ValueError, match="key_padding_mask must be a bool"):
        row_topk_bias(torch.zeros(2, 3, 4), 1, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask must be a bool"):
        row_topk_bias(torch.zeros(2, 3, 4), 1, key_padding_mask=torch.zeros(2, 4))
