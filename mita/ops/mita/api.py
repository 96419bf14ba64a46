"""mita_attention: the public MiTA operator and its backend dispatch."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from mita.ops.landmarks import pool_landmarks, pool_operator_2d
from mita.ops.mita.checks import check_mita_args
from mita.ops.mita.naive import naive_mita
from mita.ops.mita.torch_impl import torch_mita

# name -> (fn, supports). fn(q, k, v, landmarks, topk, *, experts_per_query, shared, shared_scale, scale,
# key_padding_mask) with resolved scales; supports(...same arguments...) -> None if it can run the call, else why.
_BACKENDS: dict[str, tuple[Callable, Callable]] = {}
_NOTICED: set[str] = set()
_OPTIONAL_LOADED = False


def register_backend(name: str, fn: Callable, supports: Callable | None = None) -> None:
    """Register a MiTA backend.

    Args:
        name: backend name, used by ``mita_attention(..., backend=name)``.
        fn: callable with :func:`naive_mita`'s signature; receives already-checked arguments with ``scale`` and
            ``shared_scale`` resolved to floats.
        supports: callable with the same arguments returning None when ``fn`` can run the call, otherwise a short
            reason (e.g. ``"head dim 100 not in (32, 64, 128)"``). None means it supports everything.
    """
    _BACKENDS[name] = (fn, supports or (lambda *a, **kw: None))


def _naive_backend(q, k, v, landmarks, topk, **kw):
    return naive_mita(q, k, v, landmarks, topk, **kw)


register_backend("torch", torch_mita)
register_backend("naive", _naive_backend)


def _load_optional_backends() -> None:
    """Register the Triton backend (``mita.ops.mita.triton``) as "triton" if its package imports."""
    global _OPTIONAL_LOADED
    if _OPTIONAL_LOADED:
        return
    _OPTIONAL_LOADED = True
    try:
        from mita.ops.mita.triton import backend
    except ImportError:
        return
    register_triton(backend)


def register_triton(backend) -> None:
    """Register the Triton backend module's (``mita.ops.mita.triton.backend``) entry and support check under the
    name "triton"."""
    register_backend("triton", backend.triton_entry, backend.supports)


def list_backends() -> list[str]:
    """Names of the registered MiTA backends."""
    _load_optional_backends()
    return sorted(_BACKENDS)


def _notice_once(key: str, message: str) -> None:
    if key not in _NOTICED:
        _NOTICED.add(key)
        warnings.warn(message, stacklevel=3)


def mita_attention(
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
    backend: str | None = None,
) -> torch.Tensor:
    """Mixture-of-Top-k Attention (MiTA).

    For one head with queries q, keys k, values v ([N, d]) and landmarks R ([m, d], usually pooled queries):

    1. Routed experts: ``I_i = top-k_j (R_i . k_j)`` over valid keys (raw dot products; ties: lower key index).
    2. Shared expert: landmark values ``V~ = softmax(R k^T * scale) v`` over valid keys; shared keys are R.
    3. Routing: ``e(n) = argmax_i (R_i . q_n)`` (``experts_per_query`` = S > 1: the S largest; ties: lower index).
    4. Output: one softmax over ``m`` shared entries (logits ``q_n . R_i * shared_scale``, values ``V~_i``)
       and ``S * k`` routed entries (logits ``q_n . k_j * scale`` for ``j`` in ``I_e(n)``, values ``v_j``).
       With ``shared=False`` (routing-only) only the routed entries take part.

    Top-k indices and routing carry no gradient; gradients reach q, k, v and the landmarks through every
    logit and value they enter. Padded keys are never selected, never attended in the shared expert and never
    attended by any query; padded query rows hold finite values that callers ignore. If a sequence has fewer
    valid keys than ``topk``, each expert holds all of them. Inputs are expected finite: the fast backends do
    not check (a check would synchronise the device) and propagate NaN; ``naive_mita`` raises.

    Args:
        q, k, v: ``[B, H, N, d]``, one floating dtype, one device.
        landmarks: ``[B, H, m, d]``; :func:`mita.pool_landmarks` builds them from q.
        topk: keys per routed expert (k); any int >= 1 (values above N select every key).
        experts_per_query: S in ``[1, m]``.
        shared: include the shared (compressed) expert.
        shared_scale: scale of the shared logits; None means ``scale ** 2`` (the reference code's quirk: it
            passes ``R * scale`` to a kernel that scales by ``scale`` again). Pass ``scale`` for the
            "standard" variant.
        scale: scale of routed logits and of the landmark-value softmax; None means ``d ** -0.5``.
        key_padding_mask: ``[B, N]`` bool, True marks padding.
        backend: ``"triton"``, ``"torch"``, ``"naive"`` or None (fastest available: Triton on CUDA when it
            supports the call, else PyTorch; a Triton fallback is announced once).

    Returns:
        ``[B, H, N, d]`` in q's dtype.

    Raises:
        ValueError: naming the argument, for bad shapes, dtypes, devices, ``topk < 1``, ``m < 1``,
            ``experts_per_query`` outside ``[1, m]``, non-positive scales, an unknown backend, or a backend
            that cannot run the call.
    """
    scale, shared_scale = check_mita_args(
        q, k, v, landmarks, topk, experts_per_query, shared, shared_scale, scale, key_padding_mask
    )
    _load_optional_backends()
    kwargs = dict(
        experts_per_query=experts_per_query,
        shared=shared,
        shared_scale=shared_scale,
        scale=scale,
        key_padding_mask=key_padding_mask,
    )
    if backend is None:
        backend = "torch"
        if q.is_cuda and "triton" in _BACKENDS:
            reason = _BACKENDS["triton"][1](q, k, v, landmarks, topk, **kwargs)
            if reason is None:
                backend = "triton"
            else:
                _notice_once(f"triton:{reason}", f"MiTA: Triton kernel not used ({reason}); using the PyTorch backend")
    elif backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)} or None, got {backend!r}")
    fn, supports = _BACKENDS[backend]
    reason = supports(q, k, v, landmarks, topk, **kwargs)
    if reason is not None:
        raise ValueError(f"backend {backend!r} cannot run this call: {reason}")
    return fn(q, k, v, landmarks, topk, **kwargs)


def mita_attention_pooled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    m: int | tuple[int, int],
    topk: int,
    *,
    layout: str = "official",
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    experts_per_query: int = 1,
    shared: bool = True,
    shared_scale: float | None = None,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    backend: str | None = None,
    fold: bool = True,
) -> torch.Tensor:
    """MiTA with its landmarks pooled from the queries: ``mita_attention(q, k, v, pool_landmarks(q, m, ...), topk,
    ...)``, what a MiTA layer computes.

    With a 2D layout, no padding, bfloat16 and a short sequence on the Triton backend (chosen, or the default on
    CUDA), the pooling runs inside the attention's autograd node (the Triton package's ``triton_mita_pooled``: one
    node, the pooling's gradient added to dq inside the backward kernel): the same output as the two-step form and
    q's gradient up to one rounding. ``fold=False`` always takes the two-step form.

    Args:
        q, k, v: ``[B, H, N, d]``.
        m, layout, grid, num_prefix_tokens: the landmarks, as :func:`mita.pool_landmarks` takes them (only the
            ``"1d"`` layout accepts padding).
        topk, experts_per_query, shared, shared_scale, scale, key_padding_mask, backend: as :func:`mita_attention`.
        fold: allow the folded pooling.

    Returns:
        ``[B, H, N, d]`` in q's dtype.
    """
    kwargs = dict(experts_per_query=experts_per_query, shared=shared, shared_scale=shared_scale, scale=scale)
    if fold and layout != "1d" and key_padding_mask is None:
        kernels = _folded_pooling_kernels(q, m, backend)
        if kernels is not None:
            pool = pool_operator_2d(
                q.shape[2], m, layout=layout, grid=grid, num_prefix_tokens=num_prefix_tokens, device=q.device
            )
            return kernels.triton_mita_pooled(q, k, v, pool, topk, **kwargs)
    # Only the 1D layout pools around padding; the image layouts pool every token (padded keys stay masked below).
    pool_mask = key_padding_mask if layout == "1d" else None
    landmarks = pool_landmarks(
        q, m, layout=layout, grid=grid, num_prefix_tokens=num_prefix_tokens, key_padding_mask=pool_mask
    )
    return mita_attention(q, k, v, landmarks, topk, **kwargs, key_padding_mask=key_padding_mask, backend=backend)


@functools.lru_cache(maxsize=1)
def _triton_kernels():
    # The Triton package once its kernels import (Triton present), else None.
    try:
        from mita.ops.mita import triton as kernels
        from mita.ops.mita.triton import triton_mita_pooled  # noqa: F401
    except ImportError:
        return None
    return kernels


def _folded_pooling_kernels(q: torch.Tensor, m: int | tuple[int, int], backend: str | None):
    """The Triton package when :func:`mita_attention_pooled` can fold the pooling into its short path for q (the
    Triton backend chosen or left to the default on CUDA, and a call it takes), else None."""
    if backend not in (None, "triton") or (backend is None and not q.is_cuda):
        return None
    kernels = _triton_kernels()
    if kernels is None or kernels.supports(q) is not None:
        return None
    n_landmarks = m[0] * m[1] if isinstance(m, (tuple, list)) else m
    return kernels if kernels.pooled_short_supported(q, n_landmarks) else None
