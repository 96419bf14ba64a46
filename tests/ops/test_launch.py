"""Direct launches of cached Triton binaries (mita/ops/mita/triton/launch.py): keys, caching rules, fallback, and on the
GPU bitwise agreement with Triton's own launch path."""

from __future__ import annotations

import warnings

import pytest
import torch

from mita.ops.mita.triton import launch


class _Param:
    def __init__(self, name, is_constexpr):
        self.name, self.is_constexpr = name, is_constexpr


class _FakeCompiled:
    """A compiled kernel's launcher as the direct path calls it: ``run(gx, gy, gz, stream, function, metadata,
    launch_metadata, enter_hook, exit_hook, *args)``."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def run(self, gx, gy, gz, stream, function, meta, launch_meta, enter, exit_, *args):
        if self.fail:
            raise TypeError("launcher signature changed")
        assert (stream, function, meta) == ("stream 0", "function", "metadata")
        assert launch_meta is None and enter is None and exit_ is None
        self.log.append(("direct", (gx, gy, gz), args))


class _FakeJit:
    """Stands in for a triton.jit function: X, N runtime, BLOCK constexpr."""

    arg_names = ["X", "N", "BLOCK"]
    params = [_Param("X", False), _Param("N", False), _Param("BLOCK", True)]

    def __init__(self, fail=False):
        self.log = []
        self.compiled = _FakeCompiled(self.log, fail)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return self.compiled

        return run


@pytest.fixture
def on_gpu_path(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "_stream_getter", lambda: lambda dev: f"stream {dev}")


def _key(args):
    return launch._key_ptrs(args)[0]


def test_key_separates_what_triton_specialises_on():
    x = torch.zeros(64)
    key = _key
    assert key([x]) == key([torch.ones(64)])
    assert key([x]) != key([x[1:]])  # 16-byte alignment
    assert key([x]) != key([x.to(torch.float16)])
    # Ints by value: at least as fine as Triton's classes (1, multiples of 16, 32-bit range, 64-bit unsigned).
    ints = (1, 16, 17, 32, 2**31, 2**63)
    assert len({key([v]) for v in ints}) == len(ints)
    assert key([True]) != key([1]) and key([False]) != key([0])  # equal as ints, typed apart by Triton
    assert key([0.5]) == key([2.0]) and key([1.0]) != key([1])  # floats: one class; an int 1 is specialised
    assert key([None]) != key([0])
    assert key([x, 3, 0.25]) == key([torch.ones(64), 3, 4.0])
    # The direct launch's arguments: tensors as their addresses; the key says the tensor is not on CUDA.
    akey, ptrs = launch._key_ptrs([x, 3, 0.25, None, True])
    assert ptrs == [x.data_ptr(), 3, 0.25, None, True]
    assert akey[0] == (torch.float32, True, False)


def test_new_keys_stop_being_cached_at_the_limit(monkeypatch, on_gpu_path):
    monkeypatch.setattr(launch, "MAX_KEYS", 3)
    fn = _FakeJit()
    k = launch.FastKernel(fn)
    x = torch.zeros(64)
    for n in (16, 17, 18, 19, 16, 19):
        k[(1,)](x, n, BLOCK=64)
    assert len(k.cache) == 3
    # 16 was cached (direct the second time); 19 came after the limit (Triton's path both times).
    assert [e[0] for e in fn.log] == ["jit", "jit", "jit", "jit", "direct", "jit"]


def test_interpreting_is_read_once_until_cleared(monkeypatch):
    launch.interpreting.cache_clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch.interpreting() is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert launch.interpreting() is True  # cached
    launch.interpreting.cache_clear()
    assert launch.interpreting() is False
    monkeypatch.undo()
    launch.interpreting.cache_clear()


def test_first_call_compiles_then_direct_launch_with_constexpr_tail(on_gpu_path):
    fn = _FakeJit()
    k = launch.FastKernel(fn)
    x = torch.zeros(64)
    k[(4,)](x, 32, BLOCK=64, num_warps=4)
    k[(8,)](torch.ones(64), 32, BLOCK=64, num_warps=4)  # same key: another tensor of the same dtype and alignment
    assert fn.log[0][0] == "jit"
    # Direct: the grid as 3 ints, the tensor as its address, the constexpr tail after the runtime arguments.
    y = torch.ones(64)
    k[(8, 2)](y, 32, BLOCK=64, num_warps=4)
    assert fn.log[2] == ("direct", (8, 2, 1), (y.data_ptr(), 32, 64))
    del fn.log[2]
    assert fn.log[1][0] == "direct" and fn.log[1][1] == (8, 1, 1) and fn.log[1][2][1:] == (32, 64)
    assert k.direct == 2
    k[(8,)](x, 33, BLOCK=64, num_warps=4)  # new key (another int value): Triton's own path again
    k[(8,)](x, 32, BLOCK=128, num_warps=4)  # new constexpr value
    k[(8,)](x, 32, BLOCK=64, num_warps=8)  # new launch option
    assert [e[0] for e in fn.log] == ["jit", "direct", "jit", "jit", "jit"]
    assert len(k.cache) == 4


def test_runtime_argument_by_keyword_is_never_cached(on_gpu_path):
    fn = _FakeJit()
    k = launch.FastKernel(fn)
    x = torch.zeros(64)
    for n in (32, 48):
        k[(1,)](x, N=n, BLOCK=64)
    assert [e[0] for e in fn.log] == ["jit", "jit"]
    assert fn.log[1][3]["N"] == 48
    assert not k.cache


def test_failure_of_the_direct_path_turns_it_off_and_relaunches(on_gpu_path):
    fn = _FakeJit(fail=True)
    k = launch.FastKernel(fn)
    x = torch.zeros(64)
    k[(1,)](x, 32, BLOCK=64)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        k[(1,)](x, 32, BLOCK=64)
    assert launch.ENABLED is False
    assert any("turned off" in str(m.message) for m in w)
    assert [e[0] for e in fn.log] == ["jit", "jit"]  # the failed direct launch was redone the usual way


def test_unhashable_argument_takes_triton_path(on_gpu_path):
    fn = _FakeJit()
    k = launch.FastKernel(fn)
    for _ in range(2):
        k[(1,)](torch.zeros(4), 4, BLOCK=[4])
    assert [e[0] for e in fn.log] == ["jit", "jit"] and not k.cache


def test_disabled_or_interpreting_always_takes_triton_path(monkeypatch):
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(launch, "interpreting", lambda: True)
    fn = _FakeJit()
    k = launch.FastKernel(fn)
    for _ in range(3):
        k[(1,)](torch.zeros(4), 4, BLOCK=4)
    assert [e[0] for e in fn.log] == ["jit"] * 3 and not k.cache


def test_registry_returns_one_wrapper_per_function():
    fn = _FakeJit()
    assert launch.fast(fn) is launch.fast(fn)
    assert launch.fast(fn).fn is fn


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("short", [True, False])
def test_direct_launches_match_triton_launches_on_gpu(monkeypatch, short):
    """Forward and backward bitwise equal with direct launches on and off, over shapes whose specialisations differ
    (N 197 / 256 / 1000 / 4097, d 64 / 32, bf16 / fp16, with and without padding), and the direct path was used."""
    from mita.ops.mita.triton import op as tmop

    monkeypatch.setattr(tmop, "SHORT_PATH", short)
    cases = [(2, 3, 197, 64, 25, torch.bfloat16, False), (1, 2, 256, 32, 16, torch.float16, True)]
    if not short:
        cases += [(1, 2, 1000, 64, 24, torch.bfloat16, True), (1, 1, 4097, 64, 40, torch.bfloat16, False)]

    def run(B, H, N, d, m, dtype, pad):
        g = torch.Generator(device="cuda").manual_seed(N)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
        r = torch.randn(B, H, m, d, device="cuda", dtype=dtype, generator=g)
        mask = None
        if pad:
            mask = torch.zeros(B, N, dtype=torch.bool, device="cuda")
            mask[:, N - N // 5 :] = True
        ins = [t.requires_grad_() for t in (q, k, v, r)]
        o = tmop.triton_mita(*ins, m, key_padding_mask=mask)
        grads = torch.autograd.grad(o, ins, torch.randn(o.shape, device="cuda", dtype=dtype, generator=g))
        return [o.detach(), *grads]

    direct0 = sum(k.direct for k in launch._REGISTRY.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failure of the direct path warns: fail the test on it
        for _ in range(2):  # the second round launches every key directly
            for c in cases:
                monkeypatch.setattr(launch, "ENABLED", True)
                fast = run(*c)
                monkeypatch.setattr(launch, "ENABLED", False)
                ref = run(*c)
                for a, b in zip(fast, ref):
                    assert torch.equal(a, b), c
    # The short path is three kernels (route, attention, and since run 11 one fused backward per (batch, head)).
    used = [k for k in launch._REGISTRY.values() if k.cache]
    assert len(used) >= (3 if short else 10)
    # Every kernel of every case launched directly in the second round at least.
    assert sum(k.direct for k in launch._REGISTRY.values()) - direct0 >= len(cases) * (3 if short else 10)


def test_an_installed_launch_hook_sends_launches_through_triton(monkeypatch, on_gpu_path):
    knobs = pytest.importorskip("triton.knobs")
    rt = knobs.runtime
    hook = getattr(rt, "launch_enter_hook", None)
    if hasattr(hook, "add"):
        monkeypatch.setattr(hook, "calls", [lambda *a: None])
    else:
        monkeypatch.setattr(rt, "launch_enter_hook", lambda *a: None)
    assert launch._hooks_installed()
    fn = _FakeJit()
    k = launch.FastKernel(fn)
    for _ in range(2):
        k[(1,)](torch.zeros(4), 4, BLOCK=4)
    assert [e[0] for e in fn.log] == ["jit", "jit"]
