"""The Triton MiTA operator: ``triton_mita`` (and ``triton_mita_pooled``), its autograd functions and its
``torch.library`` custom ops.

- ``triton_mita``: argument checks, then the short path (N <= 256, ``short.small_supported``: ``SmallMiTAFn``) or
  the general path (``_MiTAFn``: exact top-k, routing, plan, landmark values and the fused attention, one autograd
  node whose backward is ``attention_bwd.mita_bwd``). ``SHORT_PATH = False`` forces the general path.
- ``triton_mita_pooled``: 2D landmarks pooled from q by one Triton launch (``pool.py``), with the pooling's gradient
  added inside the short path's backward kernel (one autograd node).
- ``mita::triton_fwd`` / ``mita::triton_bwd``: dynamo cannot trace the Triton launch path (compiled-kernel caches,
  the JIT objects themselves), so inside a compiled region ``triton_mita`` calls these opaque ops instead of its
  autograd functions: ``triton_fwd`` returns the output and everything the backward needs, ``triton_bwd`` returns
  the gradients, and the forward's autograd formula connects them. Both have fake (meta) implementations that give
  every output's shape from the inputs', so a compiled model has no graph break at MiTA and
  ``torch.compile(mode="reduce-overhead")`` can capture MiTA layers in CUDA graphs. Eager calls keep the autograd
  functions (no custom-op dispatch on the host path). The kernels, and so the numbers, are the same either way.

Tested on CPU under TRITON_INTERPRET=1 (triton 3.8) and on one NVIDIA H200 (triton 3.6, torch 2.11).
"""

from __future__ import annotations

import torch

from mita.ops.mita.checks import check_mita_args
from mita.ops.mita.triton import attention_fwd as _afwd
from mita.ops.mita.triton import replay as _replay
from mita.ops.mita.triton.attention_bwd import mita_bwd
from mita.ops.mita.triton.attention_fwd import FWD_CONFIG, mita_fwd
from mita.ops.mita.triton.common import heads_layout, out_layout
from mita.ops.mita.triton.landmark_values import LV_CONFIG
from mita.ops.mita.triton.plan import RoutingPlan, build_plan, plan_bm_max, plan_shape
from mita.ops.mita.triton.pool import pool_fwd
from mita.ops.mita.triton.replay import replayed
from mita.ops.mita.triton.routing import ROUTE_CONFIG, route_topk
from mita.ops.mita.triton.short import _pads, small_fwd, small_supported
from mita.ops.mita.triton.short_bwd import small_bwd
from mita.ops.mita.triton.topk import SCAN_CONFIG, exact_topk

# Calls that fit the short-sequence kernels (N <= 256, see short.small_supported) take them; tests set this
# to False to run the general path at the same shapes.
SHORT_PATH = True


# ----------------------------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------------------------


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One second stream per device for the routing kernel (FWD_CONFIG route_stream)."""
    key = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
    st = _SIDE_STREAMS.get(key)
    if st is None:
        st = _SIDE_STREAMS[key] = torch.cuda.Stream(device=key)
    return st


def _topk_and_lv(r, k, v, key_valid, topk, shared, scale, after_scan=None):
    """``(idx, vt, lv_lse)``: each landmark's exact top-k, and with the shared expert the landmark values
    softmax(R k^T s) v (split-key partials, by default from the top-k pass that scores the same keys, and a merge;
    zeros for a row with no valid key, as the reference gives) and their LSE; without it zeros and None."""
    if shared:
        return exact_topk(r, k, key_valid, topk, lv=(v, scale), after_scan=after_scan)
    return exact_topk(r, k, key_valid, topk, after_scan=after_scan), torch.zeros_like(r), None


class _MiTAFn(torch.autograd.Function):
    """Routing, landmark values and the fused attention as one autograd node: one backward writes dq, dk, dv, dR
    once."""

    @staticmethod
    def fwd(q, k, v, r, key_valid, topk, S, shared, scale, sscale, train=True):
        """``(o, vt, lse, lv_lse, plan)``: output, landmark values (zeros without the shared expert), the attention's
        LSE, the landmark values' LSE (None without the shared expert) and the routing plan. No host sync. train:
        whether a backward may follow (it decides the plan's query tile, :func:`plan_bm_max`)."""
        m = r.shape[1]
        with torch.no_grad():
            mode = int(FWD_CONFIG["route_stream"])
            if mode not in (0, 3):
                raise ValueError(f"FWD_CONFIG['route_stream'] must be 0 or 3, got {mode}")
            if not q.is_cuda or q.shape[-2] < _afwd.ROUTE_STREAM_MIN_N:
                mode = 0
            side = _side_stream(q.device) if mode else None
            main = torch.cuda.current_stream(q.device) if mode else None
            bm = plan_bm_max(train)
            branch = {}

            def fork():
                # The side stream starts after the work queued on this one so far, and runs the plan's kernels,
                # which need only the routes.
                branch["forked"] = True
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    route = branch.pop("route")
                    branch["route"] = route
                    branch["plan"] = build_plan(None, route, m, bm)

            if side is None:
                return _fwd_replayed(q, k, v, r, key_valid, topk, S, shared, scale, sscale, bm)
            # The routing first, in order; the plan's kernels beside the top-k after its block-top pass.
            branch["route"] = route_topk(q, r, S)
            idx, vt, lv_lse = _topk_and_lv(r, k, v, key_valid, topk, shared, scale, after_scan=fork)
            if not branch.get("forked"):
                # The top-k took a path without a block-top pass (short rows): fork now.
                fork()
            main.wait_stream(side)
            route = branch["route"]
            plan = branch.get("plan")
            if plan is None:
                plan = build_plan(idx, route, m, bm)
            else:
                plan.idx = idx
            # Allocated on the side stream, used and freed on this one.
            for t in (route, plan.rows, plan.starts, plan.tile_e, plan.tile_rs, plan.tile_re):
                t.record_stream(main)
            o, lse = mita_fwd(q, k, v, r, vt, plan, S, shared, scale, sscale, full=key_valid is None)
        return o, vt, lse, lv_lse, plan

    @staticmethod
    def in_order(q, k, v, r, key_valid, topk, S, shared, scale, sscale, bm):
        """The forward with every launch on the current stream (what ``fwd`` runs without the second stream);
        ``_fwd_replayed`` replays its launches at signatures seen before (replay.py)."""
        idx, vt, lv_lse = _topk_and_lv(r, k, v, key_valid, topk, shared, scale)
        plan = build_plan(idx, route_topk(q, r, S), r.shape[1], bm)
        o, lse = mita_fwd(q, k, v, r, vt, plan, S, shared, scale, sscale, full=key_valid is None)
        return o, vt, lse, lv_lse, plan

    @staticmethod
    def forward(ctx, q, k, v, r, key_valid, topk, S, shared, scale, sscale, train=True):
        o, vt, lse, lv_lse, plan = _MiTAFn.fwd(q, k, v, r, key_valid, topk, S, shared, scale, sscale, train)
        ctx.save_for_backward(q, k, v, r, vt, o, lse, lv_lse)
        ctx.key_valid, ctx.plan, ctx.S, ctx.shared, ctx.scale, ctx.sscale = key_valid, plan, S, shared, scale, sscale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, r, vt, o, lse, lv_lse = ctx.saved_tensors
        dq, dk, dv, dr = _bwd_replayed(
            do, q, k, v, r, vt, o, lse, ctx.plan, ctx.S, ctx.shared, ctx.scale, ctx.sscale, ctx.key_valid, lv_lse
        )
        return dq, dk, dv, dr, None, None, None, None, None, None, None


# Eager calls at a signature seen before replay the recorded launches (replay.py).
_fwd_replayed = replayed(_MiTAFn.in_order)
_bwd_replayed = replayed(lambda *args: mita_bwd(*args))  # the module's mita_bwd at call time (tests wrap it)
_replay.SETTINGS.extend([FWD_CONFIG, SCAN_CONFIG, ROUTE_CONFIG, LV_CONFIG])


def kernel_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v as the kernels read them (both paths, forward and backward): unchanged when they share one layout
    with a contiguous feature dim (contiguous, or the slices of one ``[B, N, 3, H, d]`` projection), else
    contiguous copies."""
    try:
        heads_layout(q, k, v)
        return q, k, v
    except ValueError:
        return q.contiguous(), k.contiguous(), v.contiguous()


def triton_mita(
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
    """MiTA attention with fused Triton kernels (forward and backward); same contract as ``naive_mita``.

    Args:
        q, k, v: ``[B, H, N, d]``, fp16/bf16/fp32, d in {32, 64, 128}.
        landmarks: ``[B, H, m, d]`` landmark queries R.
        topk: keys per routed expert (an expert holds all valid keys if there are fewer).
        experts_per_query: S, experts each query is routed to (ties to the lower landmark index).
        shared: include the shared expert (landmark keys R, landmark values softmax(R k^T s) v).
        shared_scale: scale of the shared logits; None means ``scale ** 2``.
        scale: scale of the routed logits and of the landmark-value softmax; None means ``d ** -0.5``.
        key_padding_mask: ``[B, N]`` bool, True marks padding.

    Returns:
        ``[B, H, N, d]`` in q's dtype, stored in ``[B, N, H, d]`` order (``o.transpose(1, 2)`` is contiguous).
        Differentiable in q, k, v and landmarks (routing carries no gradient). q, k, v are read in place when
        they share one layout (e.g. the head split of one qkv projection), else copied to contiguous first.
    """
    scale, sscale = check_mita_args(
        q, k, v, landmarks, topk, experts_per_query, shared, shared_scale, scale, key_padding_mask
    )
    return triton_mita_checked(
        q,
        k,
        v,
        landmarks,
        topk,
        experts_per_query=experts_per_query,
        shared=shared,
        shared_scale=sscale,
        scale=scale,
        key_padding_mask=key_padding_mask,
    )


def triton_mita_checked(
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
) -> torch.Tensor:
    """:func:`triton_mita` on arguments ``check_mita_args`` has passed, with both scales resolved to floats (the
    backend's entry: ``mita_attention`` checks them before it dispatches)."""
    sscale = shared_scale
    B, H, N, D = q.shape
    m = landmarks.shape[2]
    S = experts_per_query
    BH = B * H
    topk = min(topk, N)  # keys per expert: at most the row
    rf = landmarks.reshape(BH, m, D).contiguous()
    key_valid = None
    if key_padding_mask is not None:
        # int8 [BH, N] (1 = valid), the form every kernel reads: the launchers' .to(torch.int8) are then no-ops.
        key_valid = (~key_padding_mask).to(torch.int8)[:, None, :].expand(B, H, N).reshape(BH, N)
    short = SHORT_PATH and small_supported(N, m, D)
    # The forward kernels read q, k, v in place (any batch / head / row strides, e.g. the head split of a fused
    # qkv projection) and write the output in [B, N, H, d] order.
    q, k, v = kernel_layout(q, k, v)
    # Whether a backward may follow (else the plan may take larger query tiles: FWD_CONFIG bm_infer).
    train = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, rf))
    if torch.compiler.is_compiling():
        # Inside torch.compile: the same kernels behind two opaque custom ops (triton_fwd / triton_bwd below), no graph
        # break.
        return torch.ops.mita.triton_fwd(q, k, v, rf, key_valid, topk, S, shared, scale, sscale, short, train)[0]
    if short:
        # Image sizes: routing, landmark values and attention in one launch per (batch, head), see short.py.
        return SmallMiTAFn.apply(q, k, v, rf, key_valid, topk, S, shared, scale, sscale)
    # Exact top-k per landmark, top-S routing per query, landmark values and the fused attention (_MiTAFn.fwd).
    return _MiTAFn.apply(q, k, v, rf, key_valid, topk, S, shared, scale, sscale, train)


def pooled_short_supported(q: torch.Tensor, m: int) -> bool:
    """Whether :func:`triton_mita_pooled` takes a call the Triton backend supports (``backend.supports``):
    bf16 q on the short path (N <= 256, see ``small_supported``), eager (not under torch.compile)."""
    return (
        SHORT_PATH
        and q.dim() == 4
        and q.dtype == torch.bfloat16
        and small_supported(q.shape[2], m, q.shape[-1])
        and not torch.compiler.is_compiling()
    )


def triton_mita_pooled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool,
    topk: int,
    *,
    experts_per_query: int = 1,
    shared: bool = True,
    shared_scale: float | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``triton_mita(q, k, v, pool_landmarks(q, ...), topk, ...)`` in one autograd node, for bf16 image sizes.

    ``pool`` is the 2D pooling operator (``mita.ops.landmarks.pool_operator_2d``). The landmarks are pooled by one
    Triton launch outside autograd; the backward kernel adds the pooling's gradient to dq itself (float32, before
    rounding), so there is no pooling backward, float32 buffer or sum of q's two gradients. Same values as the
    two-step form up to that rounding. Callers check :func:`pooled_short_supported` first.
    """
    from mita.ops.landmarks import pool_rows

    B, H, N, D = q.shape
    m = pool.member.shape[0]
    with torch.no_grad():
        x3, heads = pool_rows(q)
        r = pool_fwd(x3, pool.member, pool.counts, heads).view(B, H, m, D)
    scale, sscale = check_mita_args(q, k, v, r, topk, experts_per_query, shared, shared_scale, scale, None)
    q, k, v = kernel_layout(q, k, v)
    return SmallMiTAFn.apply(
        q, k, v, r.view(B * H, m, D), None, min(topk, N), experts_per_query, shared, scale, sscale, pool
    )


class SmallMiTAFn(torch.autograd.Function):
    """The short-sequence path as one autograd node (routing carries no gradient).

    ``pool``: r is q pooled with this 2D operator, computed by the caller without autograd
    (``triton_mita_pooled``); the pooling's gradient then joins dq inside the backward kernel, so a layer has one
    autograd node and no separate pooling backward, float32 buffer or gradient sum."""

    @staticmethod
    def forward(ctx, q, k, v, r, key_valid, topk, S, shared, scale, sscale, pool=None):
        o, lse, memb, route, vt, lvlse = small_fwd(q, k, v, r, key_valid, topk, S, shared, scale, sscale)
        ctx.save_for_backward(q, k, v, r, o, lse, memb, route, vt, lvlse)
        ctx.key_valid, ctx.S, ctx.shared, ctx.scale, ctx.sscale = key_valid, S, shared, scale, sscale
        ctx.pool = pool
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, r, o, lse, memb, route, vt, lvlse = ctx.saved_tensors
        dq, dk, dv, dr = small_bwd(
            do,
            q,
            k,
            v,
            r,
            ctx.key_valid,
            o,
            lse,
            memb,
            route,
            vt,
            lvlse,
            ctx.S,
            ctx.shared,
            ctx.scale,
            ctx.sscale,
            ctx.pool,
        )
        return dq, dk, dv, dr, None, None, None, None, None, None, None


# Aux outputs of the forward, per path (the backward reads them back in this order).
#   short:   lse [BH, N] f32, memb [BH, MP, NP] i8, route [BH, N, S] i32, vt [BH, m, d], lvlse [BH, m] f32
#   general: lse [BH, N] f32, vt [BH, m, d], lv_lse [BH, m] f32, idx [BH, m, topk] i32, rows [BH, N S] i32,
#            starts [BH, m + 1] i32, tile_e / tile_rs / tile_re [BH, T] i32
# Without the shared expert, vt and the landmark-value LSE are empty (0 elements): the kernels do not read them.


@torch.library.custom_op("mita::triton_fwd", mutates_args=())
def triton_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r: torch.Tensor,
    key_valid: torch.Tensor | None,
    topk: int,
    S: int,
    shared: bool,
    scale: float,
    sscale: float,
    short: bool,
    train: bool,
) -> list[torch.Tensor]:
    """``[o, *aux]``; q, k, v ``[BH, N, d]`` or ``[B, H, N, d]`` in one layout (``heads_layout``), r ``[BH, m, d]``;
    o shaped as q, stored in ``[B, N, H, d]`` order (``out_layout``). ``short``: the N <= 256 path. ``train``: a
    backward may follow (the general path's plan then takes the backward's query tile, ``plan_bm_max``).

    No argument has a default: with torch 2.11, a call that leaves a defaulted argument out (as a traced graph does
    when the value equals the default) reaches the autograd wrapper one argument short, so the backward's gradient
    list no longer matched the inputs under inductor (found on the GPU)."""
    if short:
        o, lse, memb, route, vt, lvlse = small_fwd(q, k, v, r, key_valid, topk, S, shared, scale, sscale)
        if not shared:  # small_fwd hands back r and lse there: outputs may not alias inputs or each other
            vt, lvlse = q.new_empty(0), q.new_empty(0, dtype=torch.float32)
        return [o, lse, memb, route, vt, lvlse]
    o, vt, lse, lv_lse, plan = _MiTAFn.fwd(q, k, v, r, key_valid, topk, S, shared, scale, sscale, train)  # no_grad
    lv = lv_lse if lv_lse is not None else q.new_empty(0, dtype=torch.float32)
    return [o, lse, vt, lv, plan.idx, plan.rows, plan.starts, plan.tile_e, plan.tile_rs, plan.tile_re]


@triton_fwd.register_fake
def _(q, k, v, r, key_valid, topk, S, shared, scale, sscale, short, train):
    BH, m, D = r.shape
    N = q.shape[-2]
    f32, i32 = torch.float32, torch.int32
    o = out_layout(q)
    lse = q.new_empty(BH, N, dtype=f32)
    if short:
        NP, MP = _pads(N, m)
        vt = torch.empty_like(r) if shared else q.new_empty(0)
        lvlse = q.new_empty(BH, m, dtype=f32) if shared else q.new_empty(0, dtype=f32)
        return [o, lse, q.new_empty(BH, MP, NP, dtype=torch.int8), q.new_empty(BH, N, S, dtype=i32), vt, lvlse]
    _, T = plan_shape(N * S, m, plan_bm_max(train))
    lv = q.new_empty(BH, m, dtype=f32) if shared else q.new_empty(0, dtype=f32)
    tiles = [q.new_empty(BH, T, dtype=i32) for _ in range(3)]
    return [
        o, lse, torch.empty_like(r), lv, q.new_empty(BH, m, topk, dtype=i32), q.new_empty(BH, N * S, dtype=i32),
        q.new_empty(BH, m + 1, dtype=i32), *tiles,
    ]  # fmt: skip


@torch.library.custom_op("mita::triton_bwd", mutates_args=())
def triton_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r: torch.Tensor,
    key_valid: torch.Tensor | None,
    o: torch.Tensor,
    aux: list[torch.Tensor],
    S: int,
    shared: bool,
    scale: float,
    sscale: float,
    short: bool,
) -> list[torch.Tensor]:
    """``[dq, dk, dv, dr]`` (shapes of q, k, v, r) from the forward's output and aux tensors."""
    if short:
        lse, memb, route, vt, lvlse = aux
        if not shared:
            vt, lvlse = r, lse
        return list(small_bwd(do, q, k, v, r, key_valid, o, lse, memb, route, vt, lvlse, S, shared, scale, sscale))
    lse, vt, lv_lse, idx, rows, starts, tile_e, tile_rs, tile_re = aux
    bm, _ = plan_shape(q.shape[-2] * S, r.shape[1])
    plan = RoutingPlan(idx, rows, starts, tile_e, tile_rs, tile_re, bm)
    return list(
        mita_bwd(do, q, k, v, r, vt, o, lse, plan, S, shared, scale, sscale, key_valid, lv_lse if shared else None)
    )


@triton_bwd.register_fake
def _(do, q, k, v, r, key_valid, o, aux, S, shared, scale, sscale, short):
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), r.new_empty(r.shape)]


def _setup_context(ctx, inputs, output):
    q, k, v, r, key_valid, topk, S, shared, scale, sscale, short, train = inputs
    ctx.has_kv = key_valid is not None
    ctx.save_for_backward(q, k, v, r, *output, *([key_valid] if ctx.has_kv else []))
    ctx.args = (S, shared, scale, sscale, short)


def _backward(ctx, grads):
    q, k, v, r, o, *aux = ctx.saved_tensors
    key_valid = aux.pop() if ctx.has_kv else None
    dq, dk, dv, dr = triton_bwd(grads[0], q, k, v, r, key_valid, o, aux, *ctx.args)
    # One entry per argument as the call passed them (needs_input_grad has one flag each).
    return (dq, dk, dv, dr) + (None,) * (len(ctx.needs_input_grad) - 4)


triton_fwd.register_autograd(_backward, setup_context=_setup_context)
