"""PyTorch backend of the MiTA operator.

Static shapes and no host synchronisation (no ``.item()``, no data-dependent shapes), so torch.compile and
CUDA graphs can capture it. Differences from the naive reference: the matmuls run in the input dtype
(softmax and routing scores in float32), expert tiles are gathered once per landmark, and queries are
processed in chunks so the per-query gathered keys stay within a fixed memory budget.
"""

from __future__ import annotations

import torch

from mita.ops.mita.naive import masked_softmax, stable_topk_indices

# Elements of gathered per-query keys (one of k or v) allowed per chunk of queries.
_CHUNK_ELEMENTS = 1 << 25


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, H, M, *rest], idx [B, H, J] -> [B, H, J, *rest] (rows of x picked per batch and head)."""
    B, H, M = x.shape[:3]
    rest = x.shape[3:]
    flat = x.reshape(B, H, M, -1)
    out = torch.gather(flat, 2, idx[..., None].expand(*idx.shape, flat.shape[-1]))
    return out.view(*idx.shape, *rest)


def torch_mita(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    landmarks: torch.Tensor,
    topk: int,
    *,
    experts_per_query: int,
    shared: bool,
    shared_scale: float,
    scale: float,
    key_padding_mask: torch.Tensor | None,
    chunk_elements: int = _CHUNK_ELEMENTS,
) -> torch.Tensor:
    """MiTA forward in plain PyTorch ops (autograd gives the backward). Arguments are already checked.

    Shapes as in :func:`mita.mita_attention`; ``scale`` and ``shared_scale`` are resolved floats.
    """
    B, H, N, d = q.shape
    m = landmarks.shape[2]
    S = experts_per_query
    n_sel = min(topk, N)
    R = landmarks

    if key_padding_mask is None:
        key_valid = torch.ones(B, 1, N, dtype=torch.bool, device=q.device)
    else:
        key_valid = ~key_padding_mask[:, None, :]

    # Routing scores in float32 (as the reference), so the selected sets agree with it.
    rk = R.float() @ k.float().transpose(-1, -2)  # [B, H, m, N]
    with torch.no_grad():
        expert_idx = stable_topk_indices(rk.masked_fill(~key_valid[:, :, None, :], float("-inf")), n_sel)
        expert_valid = torch.gather(key_valid[:, :, None, :].expand(B, H, m, N), 3, expert_idx)
        rq = q.float() @ R.float().transpose(-1, -2)  # [B, H, N, m]
        route = rq.argmax(dim=-1, keepdim=True) if S == 1 else stable_topk_indices(rq, S)  # [B, H, N, S]

    # Expert tiles: [B, H, m, n_sel, d], gathered once per landmark.
    k_e = _gather_rows(k, expert_idx.reshape(B, H, m * n_sel)).view(B, H, m, n_sel, d)
    v_e = _gather_rows(v, expert_idx.reshape(B, H, m * n_sel)).view(B, H, m, n_sel, d)

    if shared:
        lv_p = masked_softmax(rk * scale, key_valid[:, :, None, :].expand(B, H, m, N))
        landmark_values = (lv_p @ v.float()).to(q.dtype)  # [B, H, m, d]

    chunk = max(1, chunk_elements // max(1, B * H * S * n_sel * d))
    outs = []
    for c0 in range(0, N, chunk):
        c1 = min(N, c0 + chunk)
        C = c1 - c0
        q_c = q[:, :, c0:c1]
        e_c = route[:, :, c0:c1].reshape(B, H, C * S)
        k_r = _gather_rows(k_e, e_c).reshape(B, H, C, S * n_sel, d)
        v_r = _gather_rows(v_e, e_c).reshape(B, H, C, S * n_sel, d)
        valid_r = _gather_rows(expert_valid, e_c).reshape(B, H, C, S * n_sel)
        routed_logits = torch.einsum("bhcd,bhcjd->bhcj", q_c, k_r).float() * scale
        if shared:
            shared_logits = (q_c @ R.transpose(-1, -2)).float() * shared_scale  # [B, H, C, m]
            logits = torch.cat([shared_logits, routed_logits], dim=-1)
            valid = torch.cat([torch.ones_like(shared_logits, dtype=torch.bool), valid_r], dim=-1)
            p = masked_softmax(logits, valid).to(q.dtype)
            o = p[..., :m] @ landmark_values + torch.einsum("bhcj,bhcjd->bhcd", p[..., m:], v_r)
        else:
            p = masked_softmax(routed_logits, valid_r).to(q.dtype)
            o = torch.einsum("bhcj,bhcjd->bhcd", p, v_r)
        outs.append(o)
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
