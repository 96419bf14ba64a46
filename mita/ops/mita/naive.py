"""naive_mita: the obviously-correct reference of the MiTA operator.

Everything is computed in float32 (float64 when the inputs are float64), one explicit step at a time,
following the contract in README.md. It materialises the per-query routed keys, so it is meant for tests
and small shapes, not for speed.
"""

from __future__ import annotations

import torch

from mita.ops.mita.checks import check_mita_args


def masked_softmax(logits: torch.Tensor, valid: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over ``dim`` where only ``valid`` entries take part; rows with no valid entry give zeros."""
    logits = logits.masked_fill(~valid, float("-inf"))
    row_max = logits.amax(dim=dim, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(logits - row_max) * valid
    return e / e.sum(dim=dim, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries along the last dim; ties go to the lower index.

    ``torch.topk`` leaves the order of equal values unspecified, so this sorts stably instead.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def naive_mita(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    landmarks: torch.Tensor,
    topk: int,
    *,
    experts_per_query: int = 1,
    shared: bool = True,
    shared_scale: float | None = None,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference MiTA attention (see :func:`mita.mita_attention` for the full contract).

    Args:
        q, k, v: ``[B, H, N, d]``.
        landmarks: ``[B, H, m, d]`` landmark queries R (usually pooled from q).
        topk: keys per routed expert.
        experts_per_query: S, experts each query is routed to.
        shared: include the shared (compressed) expert; False is routing-only MiTA.
        shared_scale: scale of the shared logits q . R; None means ``scale ** 2``.
        scale: scale of the routed logits q . k and of the landmark-value softmax; None means d ** -0.5.
        key_padding_mask: ``[B, N]`` bool, True marks padding.

    Returns:
        ``[B, H, N, d]`` in q's dtype.
    """
    scale, shared_scale = check_mita_args(
        q, k, v, landmarks, topk, experts_per_query, shared, shared_scale, scale, key_padding_mask
    )
    for name, t in (("q", q), ("k", k), ("v", v), ("landmarks", landmarks)):
        if not torch.isfinite(t).all():
            raise ValueError(f"{name}: naive_mita needs finite inputs (found NaN or Inf)")
    out_dtype = q.dtype
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, R = q.to(ct), k.to(ct), v.to(ct), landmarks.to(ct)
    B, H, N, d = q.shape
    m = R.shape[2]
    S = experts_per_query
    n_sel = min(topk, N)

    if key_padding_mask is None:
        key_valid = torch.ones(B, N, dtype=torch.bool, device=q.device)
    else:
        key_valid = ~key_padding_mask.to(q.device)
    key_valid_bhn = key_valid[:, None, :].expand(B, H, N)

    # Routed experts: top-k keys of each landmark by raw dot product, over valid keys only.
    rk = R @ k.transpose(-1, -2)  # [B, H, m, N]
    rk_masked = rk.masked_fill(~key_valid_bhn[:, :, None, :], float("-inf"))
    expert_idx = stable_topk_indices(rk_masked, n_sel)  # [B, H, m, n_sel]
    # A slot is real only if it holds a valid key (fewer valid keys than k leaves padded slots).
    expert_valid = torch.gather(key_valid_bhn[:, :, None, :].expand(B, H, m, N), 3, expert_idx)

    # Routing: each query goes to the S landmarks with the largest raw dot product (ties: lower index).
    rq = q @ R.transpose(-1, -2)  # [B, H, N, m]
    route = stable_topk_indices(rq, S)  # [B, H, N, S]

    # Per-query routed keys and values, gathered explicitly: [B, H, N, S, n_sel, d].
    def per_query(x: torch.Tensor) -> torch.Tensor:
        ex = torch.gather(x[:, :, None].expand(B, H, m, N, d), 3, expert_idx[..., None].expand(B, H, m, n_sel, d))
        return torch.stack([ex[b, h][route[b, h]] for b in range(B) for h in range(H)]).view(B, H, N, S, n_sel, d)

    k_r = per_query(k)
    v_r = per_query(v)
    valid_r = torch.stack([expert_valid[b, h][route[b, h]] for b in range(B) for h in range(H)]).view(
        B, H, N, S * n_sel
    )
    routed_logits = torch.einsum("bhnd,bhnskd->bhnsk", q, k_r).reshape(B, H, N, S * n_sel) * scale
    routed_values = v_r.reshape(B, H, N, S * n_sel, d)

    if not shared:
        p = masked_softmax(routed_logits, valid_r)
        out = torch.einsum("bhnj,bhnjd->bhnd", p, routed_values)
        return out.to(out_dtype)

    # Shared expert: landmark values attend over all valid keys with the ordinary scale.
    lv_p = masked_softmax(rk * scale, key_valid_bhn[:, :, None, :].expand(B, H, m, N))
    landmark_values = lv_p @ v  # [B, H, m, d]
    shared_logits = (q @ R.transpose(-1, -2)) * shared_scale  # [B, H, N, m]

    # One softmax over the concatenation [m shared entries ; S * k routed entries].
    logits = torch.cat([shared_logits, routed_logits], dim=-1)
    valid = torch.cat([torch.ones_like(shared_logits, dtype=torch.bool), valid_r], dim=-1)
    p = masked_softmax(logits, valid)
    out = p[..., :m] @ landmark_values + torch.einsum("bhnj,bhnjd->bhnd", p[..., m:], routed_values)
    return out.to(out_dtype)
