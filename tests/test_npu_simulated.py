"""A simulated Ascend NPU: torch.ops.kimi_k3.attn_res on PrivateUse1 tensors goes through the dispatcher to the
PrivateUse1 kernel, the NPU launch policy and the Triton kernel (under the interpreter), without torch_npu.

How the simulation works:
- ``torch.utils.backend_registration._setup_privateuseone_for_python_backend("npu")`` makes PrivateUse1 a Python
  backend named "npu" (device guard, hooks and device module stubs).
- An ``NpuTensor`` is a wrapper tensor on the "npu" device (``torch._C._acc.create_empty_tensor``) that holds a
  CPU tensor, ``.raw``, as its storage. Only ``empty.memory_format``, ``empty_strided`` and ``_copy_from`` have
  their own kernels; a PrivateUse1 *fallback* runs every other aten op on the backing tensors and wraps the
  results (views stay views of the backing storage, in-place ops return their wrapper).
- The wrapper's strides and data_ptr are not real, so the kernels must get the backing tensor: that is the NPU
  policy's documented seam, ``k3_ops.backends.npu.substitute(raw_tensor=...)``, plus a vector-core count.

Registering a PrivateUse1 backend is process-global: the rename happens once per process (torch allows no
other), the kernel registrations live in ``torch.library.Library`` objects that the module-scoped fixture
destroys at teardown, and the device reports itself available (``torch.accelerator``) only while the fixture is
active, so CPU/CUDA tests in the same run are unaffected. Other test modules reuse the fixture
with ``from test_npu_simulated import simulated_npu  # noqa: F401``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch
from torch.utils._pytree import tree_map

import k3_ops
from k3_ops import reference

from conftest import Sample, requires_interpreter, sample_params

pytestmark = [requires_interpreter, pytest.mark.interpreter]

SIM_VECTOR_CORES = 4  # several tokens per program for T > 4


class NpuTensor(torch.Tensor):
    """A tensor on the simulated "npu" device whose data lives in the CPU tensor ``raw``."""

    # Plain subclass semantics for torch functions: everything goes to the dispatcher, i.e. to PrivateUse1.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, raw: torch.Tensor):
        wrapper = torch._C._acc.create_empty_tensor(tuple(raw.shape), raw.dtype)
        wrapper.__class__ = cls
        return wrapper

    def __init__(self, raw: torch.Tensor):
        self.raw = raw

    def __repr__(self):
        return f"NpuTensor({self.raw!r})"


def to_raw(t):
    """The seam's raw_tensor: the backing CPU tensor of a simulated-NPU tensor."""
    if not isinstance(t, NpuTensor):
        raise TypeError(f"expected a simulated-NPU tensor, got {type(t).__name__} on {getattr(t, 'device', None)}")
    return t.raw


def _unwrap(x):
    return x.raw if isinstance(x, NpuTensor) else x


def _fallback(op, *args, **kwargs):
    """Every aten op without its own kernel: run it on the backing CPU tensors, wrap tensor results."""
    if op is torch.ops.aten.as_strided.default:
        # Wrapper strides are always contiguous, so as_strided's arguments describe a contiguous base.
        base = args[0].raw
        if not base.is_contiguous():
            raise NotImplementedError(f"simulated npu: as_strided on a non-contiguous tensor {tuple(base.stride())}")
    inputs = [a for a in args if isinstance(a, NpuTensor)]
    uargs, ukwargs = tree_map(_unwrap, (args, kwargs))
    if ukwargs.get("device") is not None:
        ukwargs["device"] = "cpu"
    out = op(*uargs, **ukwargs)

    def rewrap(o):
        if not isinstance(o, torch.Tensor):
            return o
        for a in inputs:  # in-place / out= ops return their (wrapper) argument
            if o is a.raw:
                return a
        return NpuTensor(o)

    return tree_map(rewrap, out)


def _empty_memory_format(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return NpuTensor(torch.empty(size, dtype=dtype or torch.get_default_dtype(),
                                 memory_format=memory_format or torch.contiguous_format))


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return NpuTensor(torch.empty_strided(size, stride, dtype=dtype or torch.get_default_dtype()))


def _copy_from(src, dst, non_blocking=False):
    data = src.raw if isinstance(src, NpuTensor) else src
    (dst.raw if isinstance(dst, NpuTensor) else dst).copy_(data)
    return dst


@dataclass
class SimulatedNpu:
    device: torch.device

    @staticmethod
    def raw(t: torch.Tensor) -> torch.Tensor:
        return to_raw(t)


class _Availability:
    """Whether the simulated device reports itself available: only while the fixture is active, so that
    torch.accelerator (used e.g. by opcheck's RNG freezing) ignores it in the rest of the pytest run."""

    active = False


def _setup_backend_once() -> None:
    if torch._C._get_privateuse1_backend_name() == "npu":
        return  # already set up by an earlier module in this process
    from torch.utils import backend_registration as br

    class Hooks(br._DummyPrivateUse1Hook):
        def is_available(self) -> bool:
            return _Availability.active

    class Module(br._DummyBackendModule):
        def is_available(self) -> bool:
            return _Availability.active

        def get_rng_state(self, device=None):
            return torch.empty(0, dtype=torch.uint8)  # no RNG on the simulated device

        def set_rng_state(self, state, device=None) -> None:
            pass

    br._setup_privateuseone_for_python_backend("npu", backend_module=Module(), hook=Hooks())


@pytest.fixture(scope="module")
def simulated_npu():
    """A PrivateUse1 device named "npu" backed by CPU storage, with the NPU policy's seam pointed at it."""
    if "torch_npu" in sys.modules:
        pytest.skip("torch_npu is loaded: PrivateUse1 is a real Ascend device in this process")
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", "npu"):
        pytest.skip(f"PrivateUse1 is already registered as {name!r} in this process")
    _setup_backend_once()
    fallback_lib = torch.library.Library("_", "IMPL")
    fallback_lib.fallback(_fallback, "PrivateUse1")
    aten_lib = torch.library.Library("aten", "IMPL")
    aten_lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    aten_lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    aten_lib.impl("_copy_from", _copy_from, "PrivateUse1")
    from k3_ops.backends import npu

    _Availability.active = True
    try:
        with npu.substitute(raw_tensor=to_raw, num_vector_cores=lambda device: SIM_VECTOR_CORES):
            yield SimulatedNpu(torch.device("npu", 0))
    finally:
        _Availability.active = False
        aten_lib._destroy()
        fallback_lib._destroy()


def test_simulated_device_round_trip(simulated_npu):
    x = torch.randn(3, 5)
    y = x.to(simulated_npu.device)
    assert isinstance(y, NpuTensor) and y.device.type == "npu"
    assert torch.equal(y.transpose(0, 1).cpu(), x.t())
    assert torch.equal(simulated_npu.raw(y.transpose(0, 1)), x.t())  # a view of the backing storage


SIM_SAMPLES = [
    Sample(T=7, K=4, cap=8, H=7168, dtype=torch.bfloat16),
    Sample(T=9, K=3, cap=5, H=96, dtype=torch.float16, layout="blockmajor"),
    Sample(T=6, K=2, cap=3, H=33, dtype=torch.float32, proj_2d=False),
    Sample(T=3, K=0, cap=2, H=48, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("sample", sample_params(SIM_SAMPLES))
def test_dispatch_reaches_npu_kernel(simulated_npu, sample, monkeypatch):
    from k3_ops.backends import npu

    calls = []
    real_launch = npu.launch_forward

    def spy(*args, **kwargs):
        calls.append(args)
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(npu, "launch_forward", spy)
    cpu_args = sample.make()
    args = sample.make(device=simulated_npu.device)  # same values, drawn on the CPU, moved to the "npu"
    if sample.layout == "blockmajor":
        # A [C, T, H] npu buffer passed as .transpose(0, 1): the kernel must see the view's real strides.
        assert simulated_npu.raw(args["block_residual"]).stride()[:2] == (sample.H, sample.T * sample.H)
    out = torch.ops.kimi_k3.attn_res(**args)
    assert isinstance(out, NpuTensor) and out.device.type == "npu"
    assert out.shape == (sample.T, sample.H) and out.dtype == sample.dtype
    result = out.cpu()
    if sample.K == 0:
        assert calls == [] and torch.equal(result, cpu_args["prefix_sum"])  # exact copy, no launch
        return
    assert len(calls) == 1 and calls[0][-1] == SIM_VECTOR_CORES  # the Triton launch, with the seam's cores
    assert not result.isnan().any()
    expected = reference.attn_res_reference(**cpu_args)
    # One bf16 ulp of allowance: the interpreter's fp32 -> bf16 store truncates (tests/test_kernels_interpreter.py
    # checks the full accuracy contract of this policy; here the point is the dispatch path).
    tol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}[sample.dtype]
    torch.testing.assert_close(result.float(), expected.float(), rtol=tol, atol=1e-5)


@pytest.mark.parametrize("H,dtype,launches", [(64, torch.bfloat16, 1), (8192, torch.float32, 4)],
                         ids=["single-read", "two-pass"])
def test_warmup_on_simulated_device(simulated_npu, H, dtype, launches):
    # k3_ops.warmup dispatches on the device type: one launch per distinct forward plan for K in 1..8. The
    # single-read kernel takes K at run time (one launch); the two-pass kernel needs one per K_PAD (2, 4, 8, 16).
    from k3_ops.backends import npu

    assert {npu.forward_plan(H, K, dtype).kernel for K in range(1, 9)} == {
        "single_read" if launches == 1 else "two_pass"}
    assert k3_ops.warmup(H, dtype, simulated_npu.device, max_num_valid_blocks=8) == launches
