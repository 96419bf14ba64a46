"""The Triton MiTA operator as two ``torch.library`` custom ops, for ``torch.compile``.

Dynamo cannot trace the Triton launch path (compiled-kernel caches, the JIT objects themselves), so inside a
compiled region :func:`mita.ops.mita.triton_mita.triton_mita` calls these opaque ops instead of its autograd
functions: ``mita::triton_fwd`` returns the output and everything the backward needs, ``mita::triton_bwd``
returns the gradients, and the forward's autograd formula connects them. Both have fake (meta) implementations
that give every output's shape from the inputs', so a compiled model has no graph break at MiTA and
``torch.compile(mode="reduce-overhead")`` can capture MiTA layers in CUDA graphs. Eager calls keep the autograd
functions (no custom-op dispatch on the host path). The kernels, and so the numbers, are the same either way.
"""

from __future__ import annotations

import torch

from mita.ops.mita.triton_mita import RoutingPlan, _MiTAFn, mita_bwd, plan_bm_max, plan_shape
from mita.ops.mita.triton_routing import out_layout
from mita.ops.mita.triton_small import _pads, small_bwd, small_fwd

# Aux outputs of the forward, per path (the backward reads them back in this order).
#   short:   lse [BH, N] f32, memb [BH, MP, NP] i8, route [BH, N, S] i32, vt [BH, m, d], lvlse [BH, m] f32
#   general: lse [BH, N] f32, vt [BH, m, d], lv_lse [BH, m] f32, idx [BH, m, ksel] i32, rows [BH, N S] i32,
#            starts [BH, m + 1] i32, tile_e / tile_rs / tile_re [BH, T] i32
# Without the shared expert, vt and the landmark-value LSE are empty (0 elements): the kernels do not read them.


@torch.library.custom_op("mita::triton_fwd", mutates_args=())
def triton_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r: torch.Tensor,
    key_valid: torch.Tensor | None,
    ksel: int,
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
    list no longer matched the inputs under inductor (fixed after run 16 call 4 found it on the GPU)."""
    if short:
        o, lse, memb, route, vt, lvlse = small_fwd(q, k, v, r, key_valid, ksel, S, shared, scale, sscale)
        if not shared:  # small_fwd hands back r and lse there: outputs may not alias inputs or each other
            vt, lvlse = q.new_empty(0), q.new_empty(0, dtype=torch.float32)
        return [o, lse, memb, route, vt, lvlse]
    o, vt, lse, lv_lse, plan = _MiTAFn.fwd(q, k, v, r, key_valid, ksel, S, shared, scale, sscale, train)  # no_grad
    lv = lv_lse if lv_lse is not None else q.new_empty(0, dtype=torch.float32)
    return [o, lse, vt, lv, plan.idx, plan.rows, plan.starts, plan.tile_e, plan.tile_rs, plan.tile_re]


@triton_fwd.register_fake
def _(q, k, v, r, key_valid, ksel, S, shared, scale, sscale, short, train):
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
        o, lse, torch.empty_like(r), lv, q.new_empty(BH, m, ksel, dtype=i32), q.new_empty(BH, N * S, dtype=i32),
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
    q, k, v, r, key_valid, ksel, S, shared, scale, sscale, short, train = inputs
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
