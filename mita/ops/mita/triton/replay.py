"""Recorded launch sequences: an eager MiTA call at a shape seen before, without its Python.

At the sizes where the paper trains, an eager call's GPU work takes tens to a few hundred microseconds and its host
work several times that (results/bench/final_tree_2026-12-06: on the H100 host about 0.1 ms of Python per launch
against 14 us for the launch itself). Everything the general path's forward and backward decide on the host follows
from the shapes, strides, dtypes, scalars and settings alone (no host synchronisation reads a value), so the sequence
of allocations and launches of a call is the same for every call with the same signature.

``replayed(fn)`` wraps a function whose work is allocations, PyTorch ops and Triton launches through ``launch.fast``.
The first call of a signature runs ``fn`` as usual while a recorder notes, in order, every allocation and PyTorch op
(a dispatch mode sees them; views are left out) and every launch (kernel, grid, arguments, the compiled binary), each
tensor by where its address lies: an input tensor, or an allocation or op result of the call, plus a byte offset.
Later calls of that signature allocate the same buffers, run the same ops on the new tensors, launch the same
binaries with the new addresses (the compiled launcher directly, as ``launch.fast`` does on a cache hit) and return
the outputs as views of the new buffers, in the structure ``fn`` returned. Buffers are dropped after their last use
as ``fn`` dropped them, so peak memory is the same.

A signature is not replayed (``fn`` runs as usual each time) when its recording saw anything else: an op whose result
depends on more than the shapes (``_UNREPLAYABLE_OPS``: sizes read from values, random numbers), an op with other than
one tensor as its result, a launch that did not take the direct path, a tensor that is neither an input nor made by the
call, an output that is not a view of one of those. The signature holds every tensor's shape, strides, dtype, device and
16-byte alignment, every other argument's value, and the settings dicts the kernels read (``SETTINGS``); module
constants that tests patch are not in it, so the tests turn replay off (``ENABLED``) except where they test it. Only on
CUDA, with direct launches on, outside CUDA-graph capture and the Triton interpreter (tests replay on the CPU under the
interpreter with ``allow_cpu``). ``MITA_REPLAY=0`` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mita.ops.mita.triton import launch as _launch
from mita.ops.mita.triton.plan import RoutingPlan

ENABLED = os.environ.get("MITA_REPLAY", "1") not in ("0", "")
# Signatures kept per wrapped function (calls of further signatures run as usual).
MAX_SIGNATURES = 256
# The settings dicts whose values enter every signature (filled by the modules that own them).
SETTINGS: list[dict] = []

_ALLOC_OPS = frozenset({"empty", "new_empty", "new_empty_strided", "empty_like", "empty_strided"})
_ZERO_ALLOC_OPS = frozenset({"zeros", "zeros_like", "new_zeros"})
# Ops whose result depends on more than the shapes (sizes read from values, random numbers, host reads).
_UNREPLAYABLE_OPS = frozenset(
    {
        "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "argwhere", "repeat_interleave",
        "_local_scalar_dense", "item", "bernoulli", "rand", "randn", "randint", "native_dropout", "multinomial",
        "normal", "uniform", "exponential", "random_",
    }
)  # fmt: skip
_VIEW_OPS = frozenset(
    {
        "view", "detach", "_unsafe_view", "alias", "as_strided", "_reshape_alias", "unsqueeze", "transpose", "t",
        "expand", "slice", "select", "permute", "squeeze", "split", "unbind", "reshape", "record_stream",
    }
)  # fmt: skip


class _Abort(Exception):
    """The recording saw something a replay cannot reproduce."""


def _leaves(obj, out: list) -> None:
    """The tensors of an argument / result structure, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _leaves(x, out)
    elif isinstance(obj, RoutingPlan):
        for x in (obj.idx, obj.rows, obj.starts, obj.tile_e, obj.tile_rs, obj.tile_re):
            _leaves(x, out)


def _signature(obj, out: list, leaves: list, ptrs: list) -> None:
    """The signature of an argument structure into ``out``, its tensors (``_leaves``' order) and their addresses into
    ``leaves`` and ``ptrs``: one pass."""
    if isinstance(obj, torch.Tensor):
        p = obj.data_ptr()
        out.append((obj.shape, obj.stride(), obj.dtype, obj.device, not p & 15))
        leaves.append(obj)
        ptrs.append(p)
    elif isinstance(obj, (tuple, list)):
        out.append(len(obj))
        for x in obj:
            _signature(x, out, leaves, ptrs)
    elif isinstance(obj, RoutingPlan):
        out.append(obj.bm)
        for x in (obj.idx, obj.rows, obj.starts, obj.tile_e, obj.tile_rs, obj.tile_re):
            _signature(x, out, leaves, ptrs)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        out.append((obj.__class__, obj))
    else:
        raise _Abort(f"argument of type {type(obj).__name__}")


class _Recorder(TorchDispatchMode):
    """Notes allocations and zero fills (dispatch mode) and launches (``launch._TLS.recorder``, per thread) of a
    call."""

    def __init__(self, inputs: list[torch.Tensor]):
        super().__init__()
        self.inputs = inputs
        self.in_ptrs = {t.data_ptr(): i for i, t in enumerate(inputs)}
        self.allocs: list[tuple] = []  # (size, stride, dtype, device, ptr, nbytes)
        self.steps: list[tuple] = []
        self.error = ""
        self.inside = 0  # launches running (launch.py counts them)

    # -- allocations -------------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.error or self.inside:
            return out
        name = func.overloadpacket.__name__
        if name in _ALLOC_OPS or name in _ZERO_ALLOC_OPS:
            self._alloc(out)
            if name in _ZERO_ALLOC_OPS:
                self.steps.append(("zero", len(self.allocs) - 1))
        elif name == "zero_" and isinstance(out, torch.Tensor):
            ref = self._where(out)
            if ref[0] != "al" or ref[2] != 0 or not self._whole(out, ref[1]):
                self.error = "zero fill of part of a buffer"
            else:
                self.steps.append(("zero", ref[1]))
        elif name in _UNREPLAYABLE_OPS:
            self.error = f"PyTorch op {name}"
        elif name not in _VIEW_OPS:
            self._op(func, name, args, kwargs or {}, out)
        return out

    def _op(self, func, name, args, kwargs, out) -> None:
        """A PyTorch op that computes (a sum, a cast, an in-place product): run again on the replay's tensors."""
        if not isinstance(out, torch.Tensor):
            self.error = f"PyTorch op {name} with a result that is not one tensor"
            return
        flat: list = []
        _leaves((args, list(kwargs.values())), flat)
        try:
            targs, tkw = self._tmpl(args), {k: self._tmpl(v) for k, v in kwargs.items()}
        except _Abort as e:
            self.error = f"PyTorch op {name}: {e}"
            return
        new = None
        if not any(t.data_ptr() == out.data_ptr() for t in flat):  # a new tensor, not an in-place result
            nbytes = out.untyped_storage().nbytes() - out.storage_offset() * out.element_size()
            self.allocs.append((tuple(out.shape), out.stride(), out.dtype, out.device, out.data_ptr(), nbytes))
            new = len(self.allocs) - 1
        self.steps.append(("op", func, targs, tkw, new))

    def _tmpl(self, obj):
        if isinstance(obj, torch.Tensor):
            ref = self._where(obj)
            if ref[0] == "const":
                raise _Abort("a tensor that is neither an input nor made by the call")
            return ("T", ref[0], ref[1], ref[2], obj.dtype, tuple(obj.shape), obj.stride())
        if isinstance(obj, (tuple, list)):
            return ("L", obj.__class__, [self._tmpl(x) for x in obj])
        return ("C", obj)

    def _alloc(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            self.error = "allocation without a tensor"
            return
        nbytes = t.untyped_storage().nbytes()
        self.allocs.append((tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr(), nbytes))
        self.steps.append(("alloc", len(self.allocs) - 1))

    def _whole(self, t: torch.Tensor, j: int) -> bool:
        size, stride, dtype = self.allocs[j][:3]
        return tuple(t.shape) == size and t.stride() == stride and t.dtype == dtype

    def _where(self, t: torch.Tensor) -> tuple:
        """Where a tensor's address lies: ("in", i, byte offset), ("al", j, byte offset) or ("const", t)."""
        p = t.data_ptr()
        i = self.in_ptrs.get(p)
        if i is not None:
            return ("in", i, 0)
        # The most recent allocation holding the address (a freed buffer's memory can only be handed out again to a
        # later allocation, which is then the most recent one).
        for j in range(len(self.allocs) - 1, -1, -1):
            a = self.allocs[j]
            if a[4] <= p < a[4] + max(a[5], 1):
                return ("al", j, p - a[4])
        return ("const", t)

    # -- launches ----------------------------------------------------------------------------------------------------
    def launch(self, kernel, grid, args, kwargs, direct) -> None:
        if self.error:
            return
        if direct is None and torch.device(self._device()).type == "cuda":
            self.error = f"launch of {kernel.fn.__name__} off the direct path"
            return
        slots = []
        consts = list(args)
        for pos, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                ref = self._where(a)
                if ref[0] == "const":
                    self.error = f"a tensor argument of {kernel.fn.__name__} that is neither an input nor an allocation"
                    return
                slots.append((pos, ref[0], ref[1], ref[2], a.dtype, tuple(a.shape), a.stride()))
                consts[pos] = None
        g = tuple(grid)
        g = (g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)
        self.steps.append(("launch", kernel, g, consts, slots, dict(kwargs), direct))

    def _device(self):
        return self.inputs[0].device if self.inputs else "cpu"

    # -- outputs -----------------------------------------------------------------------------------------------------
    def output(self, obj):
        """The template of a result structure: tensors as references."""
        if isinstance(obj, torch.Tensor):
            for i, x in enumerate(self.inputs):
                if x is obj:
                    return ("in_obj", i)
            ref = self._where(obj)
            if ref[0] == "const":
                raise _Abort("an output that is neither an input nor an allocation of the call")
            elem = obj.element_size()
            if ref[2] % elem:
                raise _Abort("an output at an odd offset")
            return ("view", ref[0], ref[1], ref[2] // elem, tuple(obj.shape), obj.stride(), obj.dtype)
        if isinstance(obj, tuple):
            return ("tuple", tuple(self.output(x) for x in obj))
        if isinstance(obj, list):
            return ("list", [self.output(x) for x in obj])
        if isinstance(obj, RoutingPlan):
            return (
                "plan",
                tuple(self.output(x) for x in (obj.idx, obj.rows, obj.starts, obj.tile_e, obj.tile_rs, obj.tile_re)),
                obj.bm,
            )
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return ("value", obj)
        raise _Abort(f"an output of type {type(obj).__name__}")


class _Program:
    """A recorded call, ready to run again on new inputs."""

    def __init__(self, rec: _Recorder, template):
        self.allocs = [a[:4] for a in rec.allocs]
        self.template = template
        kept = set()
        _template_allocs(template, kept)
        # Each buffer is dropped after its last use (launch or zero fill), unless an output views it.
        last = {}
        for n, st in enumerate(rec.steps):
            if st[0] == "zero":
                last[st[1]] = n
            elif st[0] == "launch":
                for s in st[4]:
                    if s[1] == "al":
                        last[s[2]] = n
            elif st[0] == "op":
                used: list = []
                _tmpl_allocs((st[2], list(st[3].values())), used)
                for j in (*used, *([st[4]] if st[4] is not None else [])):
                    last[j] = n
        drop: dict[int, list[int]] = {}
        for j, n in last.items():
            if j not in kept:
                drop.setdefault(n, []).append(j)
        self.steps = []
        for n, st in enumerate(rec.steps):
            if st[0] == "launch":
                kernel, g, consts, slots, kwargs, direct = st[1:]
                self.steps.append(("launch", kernel, g, consts, slots, kwargs, direct, tuple(drop.get(n, ()))))
            else:
                self.steps.append((*st, tuple(drop.get(n, ()))))
        self.n_launches = sum(st[0] == "launch" for st in self.steps)

    def run(self, inputs: list[torch.Tensor], direct: bool):
        bufs: list = [None] * len(self.allocs)
        in_ptrs = [t.data_ptr() for t in inputs] if direct else None
        buf_ptrs: list = [0] * len(self.allocs)
        stream = None
        for st in self.steps:
            kind = st[0]
            if kind == "alloc":
                j = st[1]
                size, stride, dtype, dev = self.allocs[j]
                b = bufs[j] = torch.empty_strided(size, stride, dtype=dtype, device=dev)
                buf_ptrs[j] = b.data_ptr()
            elif kind == "zero":
                bufs[st[1]].zero_()
            elif kind == "op":
                _, func, targs, tkw, new = st[:5]
                out = func(*_fill(targs, inputs, bufs), **{k: _fill(v, inputs, bufs) for k, v in tkw.items()})
                if new is not None:
                    bufs[new] = out
                    buf_ptrs[new] = out.data_ptr()
            else:
                _, kernel, g, consts, slots, kwargs, rec_direct, _ = st
                args = list(consts)
                if direct:
                    for pos, src, i, off, _dt, _sz, _sd in slots:
                        args[pos] = (buf_ptrs[i] if src == "al" else in_ptrs[i]) + off
                    compiled, run, function, meta, tail = rec_direct
                    if stream is None:
                        stream = _launch._stream_getter()(inputs[0].device.index)
                    run(g[0], g[1], g[2], stream, function, meta, None, None, None, *args, *tail)
                else:
                    for pos, src, i, off, dt, sz, sd in slots:
                        args[pos] = _view(bufs[i] if src == "al" else inputs[i], off, dt, sz, sd)
                    kernel.fn[g](*args, **kwargs)
            for j in st[-1]:
                bufs[j] = None
        return _build(self.template, inputs, bufs)


def _tmpl_allocs(t, used: list) -> None:
    """The allocations an op's argument templates refer to."""
    if isinstance(t, (tuple, list)) and t and t[0] == "T":
        if t[1] == "al":
            used.append(t[2])
    elif isinstance(t, (tuple, list)) and t and t[0] == "L":
        for x in t[2]:
            _tmpl_allocs(x, used)
    elif isinstance(t, (tuple, list)) and not (t and t[0] == "C"):
        for x in t:
            _tmpl_allocs(x, used)


def _fill(t, inputs, bufs):
    """An op's argument from its template, on the replay's tensors."""
    kind = t[0]
    if kind == "C":
        return t[1]
    if kind == "L":
        return t[1](_fill(x, inputs, bufs) for x in t[2])
    _, src, i, off, dtype, size, stride = t
    base = bufs[i] if src == "al" else inputs[i]
    if off == 0 and base.dtype == dtype and tuple(base.shape) == size and base.stride() == stride:
        return base
    return _view(base, off, dtype, size, stride)


def _template_allocs(t, kept: set) -> None:
    kind = t[0]
    if kind == "view" and t[1] == "al":
        kept.add(t[2])
    elif kind == "tuple" or kind == "plan":
        for x in t[1]:
            _template_allocs(x, kept)
    elif kind == "list":
        for x in t[1]:
            _template_allocs(x, kept)


def _view(base: torch.Tensor, byte_off: int, dtype, size, stride) -> torch.Tensor:
    """The tensor of dtype ``dtype`` at ``byte_off`` bytes from ``base``'s first element, with size and stride."""
    start = base.data_ptr() - base.untyped_storage().data_ptr() + byte_off
    elem = torch.empty((), dtype=dtype).element_size()
    if dtype == base.dtype:
        return base.as_strided(size, stride, start // elem)
    return torch.empty(0, dtype=dtype, device=base.device).set_(base.untyped_storage(), start // elem, size, stride)


def _build(t, inputs, bufs):
    kind = t[0]
    if kind == "view":
        _, src, i, off, size, stride, dtype = t
        base = bufs[i] if src == "al" else inputs[i]
        if base.dtype == dtype and src == "al":
            return base.as_strided(size, stride, off)
        return _view(base, off * torch.empty((), dtype=dtype).element_size(), dtype, size, stride)
    if kind == "in_obj":
        return inputs[t[1]]
    if kind == "tuple":
        return tuple(_build(x, inputs, bufs) for x in t[1])
    if kind == "list":
        return [_build(x, inputs, bufs) for x in t[1]]
    if kind == "plan":
        return RoutingPlan(*(_build(x, inputs, bufs) for x in t[1]), t[2])
    return t[1]


def _settings_key() -> tuple:
    return tuple(tuple(d.values()) for d in SETTINGS)


def active(device: torch.device, allow_cpu: bool = False) -> bool:
    """Whether calls on ``device`` may be recorded and replayed now."""
    if not ENABLED:
        return False
    if device.type == "cuda":
        return _launch.ENABLED and not _launch.interpreting() and not torch.cuda.is_current_stream_capturing()
    return allow_cpu and _launch.interpreting()


class Replayed:
    """``fn`` with recorded launch sequences per signature (module docstring). ``allow_cpu``: also under the Triton
    interpreter on the CPU (tests)."""

    def __init__(self, fn: Callable, allow_cpu: bool = False):
        self.fn = fn
        self.allow_cpu = allow_cpu
        self.programs: dict = {}
        self.replays = 0  # calls that ran a recorded program (tests read it)

    def __call__(self, *args):
        sig: list = []
        leaves: list = []
        ptrs: list = []
        try:
            _signature(args, sig, leaves, ptrs)
        except _Abort:
            return self.fn(*args)
        if not leaves or not active(leaves[0].device, self.allow_cpu) or _launch._hooks_installed():
            return self.fn(*args)
        # Which inputs share an address (q = k = v, say): the recorded references name the first of them.
        sig.append(tuple(ptrs.index(p) for p in ptrs))
        key = (tuple(sig), _settings_key(), torch.cuda.current_device() if leaves[0].is_cuda else -1)
        prog = self.programs.get(key, 0)
        if prog is None:  # recorded before and not replayable
            return self.fn(*args)
        if prog != 0:
            self.replays += 1
            return prog.run(leaves, leaves[0].is_cuda)
        if len(self.programs) >= MAX_SIGNATURES:
            return self.fn(*args)
        return self._record(key, args, leaves)

    def _record(self, key, args, leaves):
        rec = _Recorder(leaves)
        _launch._TLS.recorder = rec
        try:
            with rec:
                out = self.fn(*args)
        finally:
            _launch._TLS.recorder = None
        prog = None
        if not rec.error:
            try:
                prog = _Program(rec, rec.output(out))
            except _Abort:
                prog = None
        self.programs[key] = prog
        return out


def replayed(fn: Callable, allow_cpu: bool = False) -> Replayed:
    return Replayed(fn, allow_cpu)
