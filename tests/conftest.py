"""Test selection: GPU tests need CUDA; slow tests run with `-m slow` or RUN_SLOW=1."""

from __future__ import annotations

import os
import sys

# Test modules live in folders that mirror the code (tests/ops, tests/layers, ...); their shared helpers
# (script_loader.py) sit here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Without a GPU, Triton kernels run in its CPU interpreter. The variable must be set before anything imports
# triton (torch may), in every pytest-xdist worker too, so it is set here rather than in a test module.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# GPU tests with a million-token row (any integer parameter at least this large) need tens of GiB each; under
# pytest-xdist (`--dist loadgroup`, scripts/gpu/gpu_suite.sh) they share one worker so they never run side by side.
LARGE_ROW = 1 << 20


def pytest_collection_modifyitems(config, items):
    markexpr = config.getoption("-m") or ""
    run_slow = os.environ.get("RUN_SLOW") == "1" or "slow" in markexpr and "not slow" not in markexpr
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    not_slow = pytest.mark.skip(reason="slow: run with -m slow or RUN_SLOW=1")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(not_slow)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "gpu" in item.keywords and any(type(v) is int and v >= LARGE_ROW for v in params.values()):
            item.add_marker(pytest.mark.xdist_group("large_rows"))


@pytest.fixture(autouse=True)
def _no_replay(request, monkeypatch):
    """Recorded launch sequences (mita/ops/mita/triton/replay.py) are keyed by shapes and settings dicts, not by the
    module constants tests patch: off in every test but those marked ``replay``."""
    if "replay" not in request.keywords:
        from mita.ops.mita.triton import replay

        monkeypatch.setattr(replay, "ENABLED", False)


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After a GPU test, hand its cached blocks back to the driver, so workers running side by side on one GPU do
    not hold each other's peaks."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# Integers: a value no kernel writes (not 0, not the -1 of "no key"; negative where signed: an index read from memory
# nobody wrote points outside every tensor). Bools stay as allocated.
_INT_POISON = {
    torch.int8: -77,
    torch.int16: -12345,
    torch.int32: -123456789,
    torch.int64: -123456789,
    torch.uint8: 0xA5,
}


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    # Under no_grad: an allocation may ask for requires_grad=True (torch.compile's pattern set-up does), and an
    # in-place fill of such a leaf is an autograd error.
    with torch.no_grad():
        if t.is_floating_point():
            return t.fill_(float("nan"))
        value = _INT_POISON.get(t.dtype)
        return t if value is None else t.fill_(value)


@pytest.fixture
def poison(monkeypatch, request):
    """Fill every fresh allocation of uninitialised memory (``torch.empty``, ``torch.empty_like``,
    ``torch.empty_strided``, ``Tensor.new_empty``, ``Tensor.new_empty_strided``) with NaN (floats) or an integer no
    kernel writes, so memory a kernel forgets to write fails loudly. Tests marked ``no_poison`` (they count the
    PyTorch ops a call makes, which the fills would add to) are left alone."""
    if request.node.get_closest_marker("no_poison"):
        return

    def wrap(real, method=False):
        if method:
            return lambda self, *a, **kw: _poisoned(real(self, *a, **kw))
        return lambda *a, **kw: _poisoned(real(*a, **kw))

    for name in ("empty", "empty_like", "empty_strided"):
        monkeypatch.setattr(torch, name, wrap(getattr(torch, name)))
    for name in ("new_empty", "new_empty_strided"):
        monkeypatch.setattr(torch.Tensor, name, wrap(getattr(torch.Tensor, name), method=True))


class _Launches(list):
    """Kernel names in launch order; ``kwargs``: (name, keyword arguments: constexprs and launch options) per call;
    ``inside``: whether a launch is running (under the interpreter its PyTorch ops are the kernel's own)."""

    def __init__(self):
        super().__init__()
        self.kwargs: list[tuple[str, dict]] = []
        self.inside = False


@pytest.fixture
def triton_launches(monkeypatch):
    """The names of the Triton kernels launched while the test runs, in order (a list the test may clear).
    Counted at Triton's own launch path, which the project's direct launches of cached binaries (on a GPU) bypass,
    so those are switched off here."""
    from mita.ops.mita.triton import launch, topk_scan

    monkeypatch.setattr(launch, "ENABLED", False)
    launches = _Launches()
    jit_type = type(topk_scan._topk_scan_kernel)
    real_getitem = jit_type.__getitem__

    def counting_getitem(self, grid):
        name = self.fn.__name__ if hasattr(self, "fn") else str(self)
        launches.append(name)
        run = real_getitem(self, grid)

        def call(*args, **kwargs):
            launches.kwargs.append((name, kwargs))
            launches.inside = True
            try:
                return run(*args, **kwargs)
            finally:
                launches.inside = False

        return call

    monkeypatch.setattr(jit_type, "__getitem__", counting_getitem)
    return launches


class OutOfBounds(AssertionError):
    """A Triton kernel (under the CPU interpreter) read or wrote memory outside every tensor it was given."""


@pytest.fixture
def bounds_checked(monkeypatch):
    """Under the Triton CPU interpreter, every load, store and atomic of a kernel must touch only the storage of the
    tensors passed to that launch (masked-off lanes excepted); anything else raises :class:`OutOfBounds` naming the
    kernel. On a GPU a stray store lands in a neighbouring allocation and shows up, if ever, far from its cause (a
    corrupted input of a later step); here it fails at the store. The fixture yields the list of checked launches."""
    import numpy as np
    from triton.runtime import interpreter as ti

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("bounds checking needs the Triton interpreter")
    state = {"ranges": None, "kernel": None}
    checked: list[str] = []

    def storage_ranges(values):
        out = []
        for a in values:
            if isinstance(a, (tuple, list)):
                out += storage_ranges(a)
            elif isinstance(a, torch.Tensor):
                s = a.untyped_storage()
                out.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
        return out

    real_call = ti.GridExecutor.__call__

    def call(self, *args, **kwargs):
        outer = dict(state)
        state["ranges"] = np.array(storage_ranges([*args, *kwargs.values()]), dtype=np.uint64).reshape(-1, 2)
        state["kernel"] = self.fn.__name__
        checked.append(self.fn.__name__)
        try:
            return real_call(self, *args, **kwargs)
        finally:
            state.update(outer)

    def check(what, ptrs, mask=None):
        if state["ranges"] is None:
            return
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        if mask is not None:
            addr = addr[np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)]
        addr = addr.reshape(-1)
        if addr.size == 0:
            return
        size = np.uint64(max(1, ptrs.get_element_ty().primitive_bitwidth // 8))
        lo, hi = state["ranges"][:, 0], state["ranges"][:, 1]
        inside = ((addr[:, None] >= lo[None]) & (addr[:, None] + size <= hi[None])).any(axis=1)
        if not inside.all():
            bad = addr[~inside]
            raise OutOfBounds(
                f"{state['kernel']}: {what} of {bad.size} element(s) outside every argument's storage "
                f"(first address {int(bad[0]):#x}; arguments span "
                + ", ".join(f"[{int(a):#x}, {int(b):#x})" for a, b in state["ranges"])
                + ")"
            )

    B = ti.InterpreterBuilder
    names = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")
    real = {n: getattr(B, n) for n in names}

    def masked_load(self, ptrs, mask, *a, **kw):
        check("load", ptrs, mask)
        return real["create_masked_load"](self, ptrs, mask, *a, **kw)

    def masked_store(self, ptrs, value, mask, *a, **kw):
        check("store", ptrs, mask)
        return real["create_masked_store"](self, ptrs, value, mask, *a, **kw)

    def atomic_rmw(self, op, ptr, val, mask, *a, **kw):
        check("atomic", ptr, mask)
        return real["create_atomic_rmw"](self, op, ptr, val, mask, *a, **kw)

    def atomic_cas(self, ptr, *a, **kw):
        check("atomic", ptr)
        return real["create_atomic_cas"](self, ptr, *a, **kw)

    monkeypatch.setattr(ti.GridExecutor, "__call__", call)
    monkeypatch.setattr(B, "create_masked_load", masked_load)
    monkeypatch.setattr(B, "create_masked_store", masked_store)
    monkeypatch.setattr(B, "create_atomic_rmw", atomic_rmw)
    monkeypatch.setattr(B, "create_atomic_cas", atomic_cas)
    return checked
