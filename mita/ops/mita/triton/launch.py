"""Lower host cost per Triton launch: the compiled kernel of each specialisation is kept and launched directly.

``kernel[grid](...)`` on a ``triton.jit`` function binds every argument, computes its specialisation key and
looks the compiled binary up on each call: about 14 us of host time for a 3-argument kernel and 27 us for one
with 24 arguments (triton 3.6 on the H200 host, scripts/bench/host_overhead.py). MiTA's general path issues
15-20 launches per forward, so at N <= 256K, where the GPU work is a few hundred microseconds, the host is the
bottleneck. ``fast(kernel)[grid](...)`` computes a cheaper key in Python (tensor dtypes and 16-byte alignment,
integer values 1 / divisible by 16 / 32-bit range, the constexpr values: exactly what Triton specialises on), and
on a hit launches the cached ``CompiledKernel`` through its own launcher (``compiled[grid](*args)``). The first
call of each key goes through ``kernel[grid]`` as usual (compiling if needed), so results are the same binaries.

Not used under ``TRITON_INTERPRET=1``, while a Triton launch hook is installed (profilers), or after any error of
the direct path (it then turns itself off for the process with a one-time warning). ``MITA_FAST_LAUNCH=0`` or
``launch.ENABLED = False`` turns it off.
"""

from __future__ import annotations

import os
import warnings

import torch

ENABLED = os.environ.get("MITA_FAST_LAUNCH", "1") not in ("0", "")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _hooks_installed() -> bool:
    try:
        from triton import knobs
    except ImportError:  # older triton: no knobs module, no hooks to honour here
        return False
    rt = getattr(knobs, "runtime", None)
    for name in ("launch_enter_hook", "launch_exit_hook"):
        h = getattr(rt, name, None)
        # A hook, or a chain of hooks (newer triton) that holds any.
        if h is not None and getattr(h, "calls", True):
            return True
    return False


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31), a >= (1 << 63))
    if isinstance(a, float):
        return "f"
    if a is None:
        return None
    # Anything else (a constexpr object, a string): its value, which Triton would also specialise on.
    return ("v", a)


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
        key = (torch.cuda.current_device(), tuple(map(_arg_key, args)), tuple(sorted(kwargs.items())))
        try:
            hit = self.cache.get(key)
        except TypeError:  # an unhashable value: take the usual path
            return self.fn[grid](*args, **kwargs)
        if hit is None:
            compiled = self.fn[grid](*args, **kwargs)
            names = self.arg_names[len(args) :]
            if compiled is not None and all(n in kwargs and n in self.constexprs for n in names):
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
    """The :class:`FastKernel` of a ``triton.jit`` function (one per function)."""
    k = _REGISTRY.get(fn)
    if k is None:
        k = _REGISTRY[fn] = FastKernel(fn)
    return k
