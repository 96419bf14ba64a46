"""Lower host cost per Triton launch: the compiled kernel of each specialisation is kept and launched directly.

``kernel[grid](...)`` on a ``triton.jit`` function binds every argument, computes its specialisation key and looks
the compiled binary up on each call: about 14 us of host time for a 3-argument kernel and 27 us for one with 24
arguments (triton 3.6 on the H200 host). MiTA's general path makes 6-8 launches per forward and 7 per backward, so
at N <= 64K, where the GPU work is tens to a few hundred microseconds, the host is the bottleneck
(``scripts/bench/profiler.py host`` measures it). ``fast(kernel)[grid](...)`` keys each call by its arguments
(``_key_ptrs``, one loop: a tensor's dtype and 16-byte alignment, an int's value, one marker for all floats, which
Triton does not specialise on; the keyword arguments, i.e. constexprs and launch options, as given), which is
finer than what Triton specialises on, so a cached binary is always the one Triton would pick. On a hit it
calls the cached ``CompiledKernel``'s launcher itself (``compiled.run``, the call ``compiled[grid](*args)`` makes,
without its per-call closure, device and hook lookups) with every tensor passed as its device address, an int:
Triton's C launcher then neither calls ``data_ptr()`` nor asks the driver about the pointer
(``cuPointerGetAttribute``, one driver call per tensor argument and launch, 10-20 per MiTA launch). The first call
of each key goes through ``kernel[grid]`` as usual (compiling if needed, and checking every pointer), so results are
the same binaries. At most ``MAX_KEYS`` keys are kept per kernel (calls of further keys take Triton's path). Only
CUDA tensors reach a cached launch: a key records whether each tensor is on CUDA, and a key with a CPU tensor never
compiles.

Not used under ``TRITON_INTERPRET=1`` (read once per process: :func:`interpreting`), while a Triton launch hook is
installed (profilers), or after any error of the direct path (it then turns itself off for the process with a
one-time warning). ``MITA_FAST_LAUNCH=0`` or ``launch.ENABLED = False`` turns it off.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings

import torch

_Tensor = torch.Tensor
ENABLED = os.environ.get("MITA_FAST_LAUNCH", "1") not in ("0", "")
# Per thread, the recorder of replay.py while it records a call there (it is told every launch of that thread).
_TLS = threading.local()


# Keys kept per kernel: calls with arguments of ever new values (say, a new sequence length each call) stop adding
# entries here and take Triton's own path.
MAX_KEYS = 1024


@functools.cache
def interpreting() -> bool:
    """Whether TRITON_INTERPRET is set (read on the first call; ``interpreting.cache_clear()`` reads it again)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _knobs():
    try:
        from triton import knobs
    except ImportError:  # older triton: no knobs module, no hooks to honour here
        return None
    return knobs


def _hooks_installed() -> bool:
    knobs = _knobs()
    if knobs is None:
        return False
    rt = getattr(knobs, "runtime", None)
    for name in ("launch_enter_hook", "launch_exit_hook"):
        h = getattr(rt, name, None)
        # A hook, or a chain of hooks (newer triton) that holds any.
        if h is not None and getattr(h, "calls", True):
            return True
    return False


def _other_key(a):
    # A positional argument that is neither a tensor nor an int: floats share one key (Triton does not specialise on
    # their values), bools are kept apart from the ints they equal, anything else is its own value.
    if a.__class__ is float:
        return float
    if a.__class__ is bool:
        return (bool, a)
    return a


def _key_ptrs(args) -> tuple[tuple, list]:
    """The cache key of a launch's positional arguments and the arguments as the direct launch passes them. Key: per
    tensor its dtype, whether it is 16-byte aligned and whether it is on CUDA, per int its value (finer than Triton's
    classes of 1 / multiples of 16 / 32-bit range, never coarser), per float one marker. Arguments: each tensor
    replaced by its address (``data_ptr()``), everything else as given. One loop over the arguments, ints tested
    first (most arguments are ints)."""
    key, ptrs = [], []
    add_key, add_ptr = key.append, ptrs.append
    for a in args:
        if a.__class__ is int:
            add_key(a)
            add_ptr(a)
        elif isinstance(a, _Tensor):
            p = a.data_ptr()
            add_key((a.dtype, not p & 15, a.is_cuda))
            add_ptr(p)
        else:
            add_key(_other_key(a))
            add_ptr(a)
    return tuple(key), ptrs


@functools.cache
def _stream_getter():
    """Triton's own ``get_current_stream(device)`` (the raw CUDA stream its launches use), looked up once."""
    from triton.runtime import driver

    return driver.active.get_current_stream


class FastKernel:
    """A ``triton.jit`` kernel whose compiled binaries are launched directly after the first call of each key."""

    def __init__(self, fn):
        self.fn = fn
        self.arg_names = list(fn.arg_names)
        # Parameters that may be given by keyword and cached with the binary: the constexprs only.
        self.constexprs = {p.name for p in getattr(fn, "params", ()) if getattr(p, "is_constexpr", False)}
        self.cache: dict = {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return self._launch(grid, args, kwargs)

        return launch

    direct = 0  # launches that took the direct path (tests read it)

    def _launch(self, grid, args, kwargs):
        rec = getattr(_TLS, "recorder", None)
        if rec is None:
            return self._launch_now(grid, args, kwargs)
        # The Triton interpreter runs PyTorch ops inside a launch: the recorder leaves those out.
        rec.inside += 1
        try:
            out = self._launch_now(grid, args, kwargs)
        finally:
            rec.inside -= 1
        direct = None
        if ENABLED and not interpreting():
            akey, _ = _key_ptrs(args)
            direct = self.cache.get((torch.cuda.current_device(), akey, tuple(kwargs.items())))
        rec.launch(self, grid, args, kwargs, direct)
        return out

    def _launch_now(self, grid, args, kwargs):
        global ENABLED
        if not ENABLED or interpreting() or _hooks_installed():
            return self.fn[grid](*args, **kwargs)
        dev = torch.cuda.current_device()
        # Keyword arguments as given (one call site passes them in one order).
        akey, ptrs = _key_ptrs(args)
        key = (dev, akey, tuple(kwargs.items()))
        try:
            hit = self.cache.get(key)
        except TypeError:  # an unhashable value: take the usual path
            return self.fn[grid](*args, **kwargs)
        if hit is None:
            compiled = self.fn[grid](*args, **kwargs)
            names = self.arg_names[len(args) :]
            cacheable = all(n in kwargs and n in self.constexprs for n in names)
            if compiled is not None and cacheable and len(self.cache) < MAX_KEYS:
                # The launcher and handles exist once the kernel has run (``run`` loads them otherwise).
                self.cache[key] = (
                    compiled, compiled.run, compiled.function, compiled.packed_metadata,
                    tuple(kwargs[n] for n in names),
                )  # fmt: skip
            return compiled
        compiled, run, function, meta, tail = hit
        try:
            # What ``compiled[grid](*args)`` runs, with no launch hook installed (checked above), the grid as 3 ints
            # and the tensors as addresses.
            g = tuple(grid)
            run(
                g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, _stream_getter()(dev), function, meta,
                None, None, None, *ptrs, *tail,
            )  # fmt: skip
            self.direct += 1
        except Exception as e:  # noqa: BLE001 (any failure of the direct path: fall back for good)
            ENABLED = False
            warnings.warn(f"MiTA: direct Triton launches turned off ({type(e).__name__}: {e})", stacklevel=2)
            return self.fn[grid](*args, **kwargs)
        return compiled


_REGISTRY: dict = {}


def fast(fn) -> FastKernel:
    """The :class:`FastKernel` of a ``triton.jit`` function (one per function). Looked up by ``id(fn)``: hashing a
    JIT function computes its cache key, about a microsecond per launch; the entry keeps ``fn`` alive, so its id is
    never reused."""
    k = _REGISTRY.get(id(fn))
    if k is None:
        k = _REGISTRY[id(fn)] = FastKernel(fn)
    return k
