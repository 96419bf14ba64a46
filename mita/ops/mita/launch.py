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

Programmatic dependent launch (PDL, sm_90 and newer): the forward's kernels are launched with ``launch_pdl`` and
begin with :func:`pdl_enter` (``griddepcontrol.wait``, then ``griddepcontrol.launch_dependents``), so the next
kernel of the stream is launched while this one runs and its programs wait on the device, not behind the launch.
Every program waits for the previous kernel (and so, transitively, for all earlier work of the stream) before its
first load or store, so the order of memory operations is the one of plain launches. :func:`pdl_kw` gives a
launch's ``PDL`` constexpr and ``launch_pdl`` option; ``PDL_CONFIG["enabled"]`` 0 (default): off, None: on where
the device and triton support it, 1: on (an error where unsupported); ``MITA_PDL=1`` / ``auto`` set 1 / None.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("MITA_FAST_LAUNCH", "1") not in ("0", "")

# Off by default: run 19 measured the forward slower with it at 64K (0.164 -> 0.174 ms), level at 256K and 1M.
PDL_CONFIG = dict(enabled={"": 0, "0": 0, "1": 1, "auto": None}.get(os.environ.get("MITA_PDL", "0"), 0), only=None)


def _interpreting() -> bool:
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
        if not ENABLED or _interpreting() or _hooks_installed():
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


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel launched with :func:`pdl_kw`: wait for the previous kernel of the stream to
    finish (its writes visible), then let the next one launch. Nothing when PDL is False (e.g. the interpreter)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


_PDL_DEVICES: dict = {}


def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_supported(device) -> bool:
    """Whether kernels on ``device`` can take programmatic dependent launch: a CUDA device of compute capability
    9.0 or newer and a triton with the ``launch_pdl`` option, not under the interpreter."""
    if _interpreting() or device is None or torch.device(device).type != "cuda":
        return False
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    ok = _PDL_DEVICES.get(idx)
    if ok is None:
        ok = _PDL_DEVICES[idx] = torch.cuda.get_device_capability(idx)[0] >= 9 and _triton_has_pdl()
    return ok


def pdl_kw(device, name: str = "") -> dict:
    """Keyword arguments of a launch of a kernel that begins with :func:`pdl_enter`: ``PDL`` and, when on,
    ``launch_pdl=True`` (``PDL_CONFIG["enabled"]``: None where :func:`pdl_supported`, 0 off, 1 on; ``only``: None
    for every kernel, else a list of the kernels' names that take it, separated by ',' or '+': pool, route, scan,
    select, start, fallback, final, lv_merge, plan, mita_fwd)."""
    only = PDL_CONFIG["only"]
    if only is not None and name not in str(only).replace("+", ",").split(","):
        return {"PDL": False}
    mode = PDL_CONFIG["enabled"]
    if mode not in (None, 0, 1):
        raise ValueError(f"PDL_CONFIG['enabled'] must be None, 0 or 1, got {mode!r}")
    if mode is None:
        on = pdl_supported(device)
    elif mode:
        if not pdl_supported(device):
            raise ValueError(f"PDL_CONFIG['enabled'] is 1 but {device} does not support programmatic dependent launch")
        on = True
    else:
        on = False
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
