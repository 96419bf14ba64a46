"""Lower host cost per Triton launch: the compiled kernel of each specialisation is kept and launched directly.

``kernel[grid](...)`` on a ``triton.jit`` function binds every argument, computes its specialisation key and
looks the compiled binary up on each call: about 14 us of host time for a 3-argument kernel and 27 us for one
with 24 arguments (triton 3.6 on the H200 host). MiTA's general path makes 6-8 launches per forward and 7 per
backward, so at N <= 64K, where the GPU work is tens to a few hundred microseconds, the host is the bottleneck
(``scripts/bench/profiler.py host`` measures it). ``fast(kernel)[grid](...)`` keys each call in one pass over its
arguments (``_key``: a tensor's dtype and 16-byte alignment, an int's value, one marker for all floats, which
Triton does not specialise on; the keyword arguments, i.e. constexprs and launch options, as given), which is
finer than what Triton specialises on, so a cached binary is always the one Triton would pick; on a hit it
launches the cached ``CompiledKernel`` through its own launcher (``compiled[grid](*args)``). The first call of
each key goes through ``kernel[grid]`` as usual (compiling if needed), so results are the same binaries. At most
``MAX_KEYS`` keys are kept per kernel (calls of further keys take Triton's path).

Not used under ``TRITON_INTERPRET=1`` (read once per process: :func:`interpreting`), while a Triton launch hook is
installed (profilers), or after any error of the direct path (it then turns itself off for the process with a
one-time warning). ``MITA_FAST_LAUNCH=0`` or ``launch.ENABLED = False`` turns it off.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

ENABLED = os.environ.get("MITA_FAST_LAUNCH", "1") not in ("0", "")
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


def _key(args) -> tuple:
    """The cache key of a launch's positional arguments: per tensor its dtype and whether it is 16-byte aligned, per
    int its value (finer than Triton's classes of 1 / multiples of 16 / 32-bit range, never coarser), per float one
    marker. One pass, no call per tensor or int."""
    T = torch.Tensor
    return tuple(
        [
            (a.dtype, not a.data_ptr() & 15) if isinstance(a, T) else (a if a.__class__ is int else _other_key(a))
            for a in args
        ]
    )


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
        global ENABLED
        if not ENABLED or interpreting() or _hooks_installed():
            return self.fn[grid](*args, **kwargs)
        # Keyword arguments as given (one call site passes them in one order).
        key = (torch.cuda.current_device(), _key(args), tuple(kwargs.items()))
        try:
            hit = self.cache.get(key)
        except TypeError:  # an unhashable value: take the usual path
            return self.fn[grid](*args, **kwargs)
        if hit is None:
            compiled = self.fn[grid](*args, **kwargs)
            names = self.arg_names[len(args) :]
            cacheable = all(n in kwargs and n in self.constexprs for n in names)
            if compiled is not None and cacheable and len(self.cache) < MAX_KEYS:
                self.cache[key] = (compiled, tuple(kwargs[n] for n in names))
            return compiled
        compiled, tail = hit
        try:
            # The compiled kernel's launcher indexes a 3-D grid.
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *tail)
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
