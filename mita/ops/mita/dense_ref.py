"""A second, independent formulation of MiTA (tests and the self-check): dense softmax over m + N columns.

Expert membership and routing come from explicit rank counting (no sorting, no top-k), and routed keys are
columns of the full key set weighted by how many of the query's experts hold them (a key held by two experts
appears twice in the reference softmax, which equals one column with logit + log 2).
"""

from __future__ import annotations

import torch


def _rank(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rank of each entry along the last dim among valid entries (0 = largest; ties: lower index first)."""
    n = scores.shape[-1]
    a = scores[..., :, None]
    b = scores[..., None, :]
    idx = torch.arange(n, device=scores.device)
    beats = (b > a) | ((b == a) & (idx[None, :] < idx[:, None]))
    beats = beats & valid[..., None, :]
    return beats.sum(-1)


def dense_mita(
    q, k, v, R, topk, *, experts_per_query=1, shared=True, shared_scale=None, scale=None, key_padding_mask=None
):
    """MiTA in float64 as one dense masked softmax. Shapes as mita.naive_mita."""
    q, k, v, R = (t.double() for t in (q, k, v, R))
    B, H, N, d = q.shape
    m = R.shape[2]
    scale = d**-0.5 if scale is None else scale
    shared_scale = scale * scale if shared_scale is None else shared_scale
    valid = torch.ones(B, N, dtype=torch.bool) if key_padding_mask is None else ~key_padding_mask
    valid = valid[:, None, :].expand(B, H, N)

    rk = R @ k.transpose(-1, -2)  # [B, H, m, N]
    member = (_rank(rk, valid[:, :, None, :].expand(B, H, m, N)) < topk) & valid[:, :, None, :]
    rq = q @ R.transpose(-1, -2)  # [B, H, N, m]
    routed_to = _rank(rq, torch.ones_like(rq, dtype=torch.bool)) < experts_per_query  # [B, H, N, m]
    counts = routed_to.double() @ member.double()  # [B, H, N, N]: copies of key j among query n's experts

    key_logits = (q @ k.transpose(-1, -2)) * scale + torch.log(counts)  # -inf where the count is 0
    if not shared:
        return torch.softmax(key_logits, dim=-1) @ v
    lv_logits = (rk * scale).masked_fill(~valid[:, :, None, :], float("-inf"))
    landmark_values = torch.softmax(lv_logits, dim=-1) @ v
    logits = torch.cat([rq * shared_scale, key_logits], dim=-1)
    p = torch.softmax(logits, dim=-1)
    return p[..., :m] @ landmark_values + p[..., m:] @ v
