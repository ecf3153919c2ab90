"""Compile check: every launch the NPU policy (k3_ops.backends.npu) can make, through the real triton-ascend compiler.

What runs: the policy's own entry points (``attn_res_forward``, ``fused_attn_res``, ``attn_res_backward``) on CPU
tensors, so every grid, constexpr and launch option is the policy's; triton-ascend compiles each launch through its
``ttir`` stage (frontend + TTIR passes) and its ``ttadapter`` stage (``triton-adapter-opt``: TTIR -> linalg / HIVM)
and enters its ``npubin`` stage, whose first CANN lookup fails on a host without CANN. That failure, and nothing
looser, is what each launch must end in (``expect_npubin``): an ``MLIRCompilationError`` of the binary stage saying
that the CANN toolkit is missing, with the ``ttadapter`` output in the kernel's cache directory. The one stand-in is
the driver (``StandInDriver``: an Atlas A2 target and its core counts, the keys triton-ascend's NPUUtils returns);
nothing is launched, and no binary is produced (docs/kernels.md, "Compile check", says what this does not prove).

Coverage: the cross product of the axes below per op (plus bf16 / fp16 rows too wide for the single-read tile,
where the policy takes its two-pass plan). Launches with the same Triton compile key (same kernel, same
specialisation and constexprs) are compiled once and counted as proven after that (``JITFunction.cache_hook``).
A new kernel variant is covered by one more entry in an axes table: a keyword of one of the policy's fused entry
points (``fused_attn_res``, ``fused_attn_res_quant``, ``fused_attn_res_``: the FP8 output epilogue, the in-place
prefix, the norm's rounding point) goes into ``FUSED_OPS`` as ``name: (values...)``, a new entry point as a new
key, and every value is passed to the policy as that keyword in every combination with the other axes.
``fused_attn_res_full``'s forms (``FULL_FORMS``: the pre-norm mix returned, sum_out, mix=False and its
add-and-snapshot kernel) have a table of their own.

Runs only where the installed ``triton`` is triton-ascend (a venv of its own: it replaces the triton package), on
its own (``python -m pytest -q -m ascend tests/ascend``, see .ci/run); skips with a reason everywhere else.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import itertools
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch


def _triton_ascend_version() -> str | None:
    # From the package metadata: importing triton here would fix its own @jit helpers (tl.sum's combine, ...) as
    # interpreted functions if TRITON_INTERPRET=1 is still set (tests/conftest.py sets it for the CPU suite).
    try:
        return importlib.metadata.version("triton-ascend")
    except importlib.metadata.PackageNotFoundError:
        return None


def _skip_reason() -> str | None:
    if _triton_ascend_version() is None:
        return "triton-ascend is not the installed triton (this check runs in its own venv: see .ci/run)"
    if shutil.which("bishengir-compile") is not None:
        return "CANN's bishengir-compile is installed: compile and run on the Ascend device instead"
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "triton was imported under TRITON_INTERPRET=1 in this process: run tests/ascend on its own"
    return None


SKIP_REASON = _skip_reason()
if SKIP_REASON is not None:
    pytest.skip(SKIP_REASON, allow_module_level=True)
# Compiled kernels, not the interpreter (tests/conftest.py turns it on for the CPU suite). Read by @triton.jit when
# the kernel modules are first imported, which happens in the fixture below.
os.environ["TRITON_INTERPRET"] = "0"

pytestmark = pytest.mark.ascend

#: The binary stage's name in triton-ascend's MLIRCompilationError (its ``npubin`` stage).
NPUBIN_STAGE = "ConvertLinalgRToBinary"
#: The CANN step's first lookup on a host without CANN (triton-ascend builds its CANN utilities there).
CANN_MISSING = "ASCEND_HOME_PATH is not set"
#: Atlas A2 (910B3): 24 AI cores, 2 vector cores each.
TARGET_ARCH = "Ascend910B3"
DEVICE_PROPERTIES = {"max_shared_mem": 1, "num_aicore": 24, "num_vectorcore": 48}


# --------------------------------------------------------------------------------------------------------------
# The stand-in driver and the launch recorder.
# --------------------------------------------------------------------------------------------------------------
class _StandInUtils:
    def get_device_properties(self, device):
        return dict(DEVICE_PROPERTIES)


def _make_stand_in_driver():
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class StandInDriver(DriverBase):
        """What triton's JIT asks of a driver before it compiles: the target, a device and a stream."""

        @classmethod
        def is_active(cls):
            return True

        def __init__(self):
            super().__init__()
            self.utils = _StandInUtils()

        def get_current_target(self):
            return GPUTarget("npu", TARGET_ARCH, 0)

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_benchmarker(self):
            raise NotImplementedError("the compile check launches nothing")

    return StandInDriver()


@dataclass
class Launch:
    kernel: str
    outcome: str  # "npubin": compiled up to the binary stage here; "proven": same compile key compiled before


class Recorder:
    """Wraps every @triton.jit kernel of k3_ops.kernels for the duration of a call: a compile that fails exactly as
    ``expect_npubin`` requires counts as a launch (and the policy goes on, e.g. to the weight-gradient reduction);
    any other failure propagates. Compile keys already proven are skipped through triton's own cache hook."""

    def __init__(self):
        self.proven: set = set()
        self.launches: list[Launch] = []
        self._pending = None

    def cache_hook(self, *, key, fn, **kwargs):
        self._pending = (fn.name, str(key))
        return self._pending in self.proven  # True: triton skips the compile (and the launch)

    def wrap(self, name, run):
        def recorded(*args, **kwargs):
            self._pending = None
            try:
                run(*args, **kwargs)
            except Exception as e:  # noqa: BLE001  (checked precisely, re-raised otherwise)
                expect_npubin(e, name)
                self.proven.add(self._pending)
                self.launches.append(Launch(name, "npubin"))
                return None
            assert self._pending in self.proven, f"{name}: launched without compiling (stale cache?)"
            self.launches.append(Launch(name, "proven"))
            return None

        return recorded


def expect_npubin(e: BaseException, kernel: str) -> None:
    """The compile got through ttir and ttadapter and failed in the binary stage for lack of CANN, nothing else."""
    from triton.compiler.errors import MLIRCompilationError

    if not isinstance(e, MLIRCompilationError) or e.stage_name != NPUBIN_STAGE:
        raise AssertionError(f"{kernel}: expected the {NPUBIN_STAGE} (npubin) stage to fail for lack of CANN, got "
                             f"{type(e).__name__} in stage {getattr(e, 'stage_name', None)}:\n{e}") from e
    if CANN_MISSING not in e.message:
        raise AssertionError(f"{kernel}: the npubin stage failed, but not for lack of CANN:\n{e}") from e
    m = re.search(r"The compiled kernel cache is in (\S+)", e.message)
    assert m is not None, f"{kernel}: no cache directory in the error:\n{e}"
    adapter = Path(m.group(1)) / f"{kernel}.ttadapter"
    assert adapter.is_file(), f"{kernel}: no ttadapter output at {adapter}"
    assert f"func.func @{kernel}(" in adapter.read_text(), f"{kernel}: {adapter} holds no {kernel} function"


def _kernel_modules():
    from k3_ops.kernels import attn_res_bwd, attn_res_fwd, attn_res_npu

    return (attn_res_fwd, attn_res_npu, attn_res_bwd)


#: personality(2) flag: no address-space randomisation for programs this process starts from now on.
ADDR_NO_RANDOMIZE = 0x0040000


@contextlib.contextmanager
def _no_aslr_for_children():
    """triton-adapter-opt 3.2.0 aborts now and then on some inputs ("Malformed type storage object", an assertion in
    MLIR's type storage) depending on where the address-space randomisation puts things: 3 of 100 runs of one
    backward kernel's TTIR aborted, 0 of 400 with randomisation off. Without randomisation each input either
    always lowers or always aborts, so a pass or a failure of this check means the same thing on every run.
    (Linux: the personality is inherited by the compiler subprocesses; elsewhere nothing changes.)"""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        old = libc.personality(0xFFFFFFFF)
    except (OSError, AttributeError):
        yield
        return
    libc.personality(old | ADDR_NO_RANDOMIZE)
    try:
        yield
    finally:
        libc.personality(old)


@pytest.fixture(scope="module")
def recorder(tmp_path_factory, request):
    """The stand-in driver active, a fresh Triton cache, every kernel's launches recorded (a summary line per
    kernel is printed after the run)."""
    import triton
    from triton.runtime.jit import JITFunction

    aslr = _no_aslr_for_children()
    aslr.__enter__()
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))
    mp.delenv("ASCEND_HOME_PATH", raising=False)
    mp.delenv("TRITON_ASCEND_ARCH", raising=False)
    rec = Recorder()
    triton.runtime.driver.set_active(_make_stand_in_driver())
    mp.setattr(JITFunction, "cache_hook", rec.cache_hook)
    for module in _kernel_modules():
        for obj in vars(module).values():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == module.__name__:
                mp.setattr(obj, "run", rec.wrap(obj.fn.__name__, obj.run))
    try:
        yield rec
    finally:
        mp.undo()
        triton.runtime.driver.reset_active()
        aslr.__exit__(None, None, None)
        request.config.pluginmanager.register(_Summary(rec), "ascend_compile_summary")


class _Summary:
    """Prints, after the run, each kernel's launches and how many distinct compile keys reached npubin."""

    def __init__(self, rec: Recorder):
        self.rec = rec

    def pytest_terminal_summary(self, terminalreporter):
        launches = self.rec.launches
        for name in sorted({launch.kernel for launch in launches}):
            n = sum(launch.kernel == name for launch in launches)
            compiled = sum(launch.kernel == name and launch.outcome == "npubin" for launch in launches)
            terminalreporter.write_line(f"ascend compile check: {name}: {n} launches, {compiled} distinct compile "
                                        f"keys compiled up to npubin")


# --------------------------------------------------------------------------------------------------------------
# The configuration space.
# --------------------------------------------------------------------------------------------------------------
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Kimi K3's valid-block counts (up to 8) give K_PAD = next_pow2(K + 1) in {2, 4, 8, 16}: every one of them, K = 0
#: (the first mix) and K = 1 (Triton's == 1 specialisation). H: Kimi K3's width (padded to 8192; fp32 takes the
#: two-pass plan there) and a width that is neither a multiple of 16 nor of the tile (masked tails, single-read in
#: every dtype). A smaller width (H = 96, a 128 tile: 5,180 launches, 268 s alone with two workers) and K = 64
#: (K_PAD = 128: 2,106 launches at the other widths, 348 s) left the whole cross product: their compile keys differ
#: from these only in a constexpr's value. K = 64 keeps one point of its own (LARGE_K_AXES), so a tile past Kimi
#: K3's still goes through the compiler.
KS = (0, 1, 2, 4, 8)
HS = (7168, 1000)
LAYOUTS = ("tokenmajor", "blockmajor", "hstrided")
T = 5  # tokens: never part of a compile key; several per program is the policy's business
BASE_AXES = dict(dtype=tuple(DTYPES), K=KS, H=HS, layout=LAYOUTS)
#: Rows too wide for the single-read tile in bf16 / fp16, where the policy takes the two-pass plan (fp32 takes it
#: at H = 7168 already); the forward's tiles do not depend on H beyond this (the backward's never on H > 8192).
WIDE_AXES = dict(dtype=("bf16", "fp16"), K=KS, H=(16384,), layout=LAYOUTS)
#: A valid-block count past Kimi K3's (K_PAD = 128), at one dtype, width and layout.
LARGE_K_AXES = dict(dtype=("bf16",), K=(64,), H=(7168,), layout=("tokenmajor",))

#: fused_attn_res flags the builder turns into tensors / indices.
FUSED_FLAGS = dict(addend=(False, True), snapshot=(False, True), out_norm=(False, True))
#: The NPU policy's fused entry points and their keywords, passed through as they are, every value in every
#: combination with the axes above. A new keyword (an output epilogue, a rounding option) or a new entry point is
#: covered by one more entry here.
FUSED_OPS: dict[str, dict[str, tuple]] = {
    "fused_attn_res": dict(round_mix=(True, False)),
    "fused_attn_res_quant": dict(out_dtype=(torch.float8_e4m3fn, torch.float8_e4m3fnuz), round_mix=(True, False)),
    "fused_attn_res_": dict(out_dtype=(None, torch.float8_e4m3fn), round_mix=(True, False)),
}
#: attn_res_backward's output_mask (grad_prefix_sum, grad_block_residual, grad_norm_weight, grad_proj_weight); all-False
#: launches nothing. The two weights' entries together, and each alone (both come out of one reduction).
MASKS = tuple((*m, m[2]) for m in itertools.product((False, True), repeat=3) if any(m)) + (
    (False, False, True, False), (False, False, False, True))


def _cases(op: str, axes: dict) -> list:
    names = list(axes)
    params = []
    for values in itertools.product(*(axes[n] for n in names)):
        case = dict(zip(names, values))
        case_id = "-".join([op] + [_id(n, v) for n, v in case.items()])
        params.append(pytest.param(case, id=case_id))
    return params


def _id(name, value) -> str:
    if isinstance(value, bool):
        return name if value else f"no_{name}"
    if name in ("dtype", "layout"):
        return str(value)
    if name == "mask":
        return "mask" + "".join("1" if m else "0" for m in value)
    if name == "out_dtype":
        return "out_" + ("io" if value is None else str(value).replace("torch.", ""))
    return f"{name}{value}"


def _buffer(shape, dtype, layout: str) -> torch.Tensor:
    """A [T, C, H] view of a buffer of the layout; hidden-strided: every other element of a wider allocation."""
    t_, c_, h_ = shape
    if layout == "tokenmajor":
        return torch.zeros(shape, dtype=dtype)
    if layout == "blockmajor":
        return torch.zeros((c_, t_, h_), dtype=dtype).transpose(0, 1)
    return torch.zeros((t_, c_, h_, 2), dtype=dtype)[..., 0]


def _rows(dtype, H: int, layout: str) -> torch.Tensor:
    """A [T, H] activation (prefix, addend, grad_out), hidden-strided with the hidden-strided layout."""
    if layout == "hstrided":
        return torch.zeros((T, H, 2), dtype=dtype)[..., 0]
    return torch.zeros((T, H), dtype=dtype)


def _base_args(case: dict, capacity: int):
    dtype = DTYPES[case["dtype"]]
    H = case["H"]
    blocks = _buffer((T, capacity, H), dtype, case["layout"])
    # Weights in the model dtype, as a serving engine holds them (fp32 weights are another pointer dtype of the
    # same kernels; the policy never converts bf16 / fp16 / fp32 weights).
    w = torch.zeros(H, dtype=dtype)
    return dtype, H, _rows(dtype, H, case["layout"]), blocks, w, w.reshape(1, H)


def _run(recorder: Recorder, call) -> list[Launch]:
    start = len(recorder.launches)
    call()
    return recorder.launches[start:]


# --------------------------------------------------------------------------------------------------------------
# The checks.
# --------------------------------------------------------------------------------------------------------------
def _forward_kernel(dtype, H: int, K: int) -> str:
    """The kernel the policy's plan names for a forward launch."""
    from k3_ops.backends import npu

    plan = npu.forward_plan(H, K, dtype)
    return "attn_res_npu_single_read_kernel" if plan.kernel == "single_read" else "attn_res_npu_kernel"


@pytest.mark.parametrize("case", [p for axes in (BASE_AXES, WIDE_AXES, LARGE_K_AXES) for p in _cases("fwd", axes)])
def test_forward(recorder: Recorder, case: dict):
    from k3_ops.backends import npu

    K = case["K"]
    dtype, H, prefix, blocks, nw, pw = _base_args(case, capacity=K + 1)
    launches = _run(recorder, lambda: npu.attn_res_forward(prefix, blocks, nw, pw, K, 1e-6))
    # K = 0 is an exact copy without a kernel; otherwise exactly the plan's forward kernel.
    assert [launch.kernel for launch in launches] == ([] if K == 0 else [_forward_kernel(dtype, H, K)]), launches


def _fused_cases() -> list:
    cases = []
    for op, keywords in FUSED_OPS.items():
        for axes in (BASE_AXES, WIDE_AXES, LARGE_K_AXES):
            cases += [pytest.param(dict(p.values[0], op=op), id=p.id)
                      for p in _cases(op, dict(axes, **FUSED_FLAGS, **keywords))]
    return cases


@pytest.mark.parametrize("case", _fused_cases())
def test_fused(recorder: Recorder, case: dict):
    from k3_ops.backends import npu

    K = case["K"]
    dtype, H, prefix, blocks, nw, pw = _base_args(case, capacity=K + 2)
    addend = _rows(dtype, H, case["layout"]) if case["addend"] else None
    write_idx = K + 1 if case["snapshot"] else -1
    onw = torch.zeros(H, dtype=dtype) if case["out_norm"] else None
    keywords = {name: case[name] for name in FUSED_OPS[case["op"]]}
    fn = getattr(npu, case["op"])
    launches = _run(recorder, lambda: fn(prefix, addend, blocks, nw, pw, K, 1e-6, block_write_idx=write_idx,
                                         out_norm_weight=onw, out_norm_eps=1e-5, **keywords))
    # K = 0 too: the fused ops still add, snapshot and norm, in one launch of the plan's kernel.
    assert [launch.kernel for launch in launches] == [_forward_kernel(dtype, H, K)], launches


#: fused_attn_res.full's forms beyond fused_attn_res's (vLLM-Ascend's call forms), as the policy's keywords: the
#: pre-norm mix returned (both norm rounding points), the new prefix into sum_out, mix=False (the add-and-snapshot
#: kernel), each with and without an addend, a snapshot and an output norm where the form takes them. Narrower base
#: axes than the other ops': what sets these forms' compile keys is the plan's kernel (single-read, two-pass), fp32's
#: compensated sums, the hidden stride and K = 0 (the mix is the new prefix).
FULL_FORMS = {
    "retmix": dict(return_mix=True),
    "retmix_fp32mix": dict(return_mix=True, round_mix=False),
    "sumout": dict(sum_out=True),
    "sumout_fp32mix": dict(sum_out=True, round_mix=False),
    "nomix": dict(mix=False),
    "nomix_sumout": dict(mix=False, sum_out=True),
}
FULL_AXES = dict(dtype=("bf16", "fp32"), K=(0, 8), H=(7168, 96), layout=("tokenmajor", "hstrided"))
FULL_WIDE_AXES = dict(dtype=("bf16",), K=(8,), H=(16384,), layout=("tokenmajor",))


def _full_cases() -> list:
    cases = []
    for axes in (FULL_AXES, FULL_WIDE_AXES):
        for p in _cases("full", dict(axes, **FUSED_FLAGS, form=tuple(FULL_FORMS))):
            case = p.values[0]
            if not FULL_FORMS[case["form"]].get("mix", True) and case["out_norm"]:
                continue  # mix=False takes no output norm (a rule of the op)
            cases.append(pytest.param(case, id=p.id))
    return cases


@pytest.mark.parametrize("case", _full_cases())
def test_full(recorder: Recorder, case: dict):
    from k3_ops.backends import npu

    K = case["K"]
    dtype, H, prefix, blocks, nw, pw = _base_args(case, capacity=K + 2)
    addend = _rows(dtype, H, case["layout"]) if case["addend"] else None
    write_idx = K + 1 if case["snapshot"] else -1
    onw = torch.zeros(H, dtype=dtype) if case["out_norm"] else None
    form = dict(FULL_FORMS[case["form"]])
    if form.pop("sum_out", False):
        form["sum_out"] = torch.zeros((T, 2 * H), dtype=dtype)[:, :H]  # contiguous rows, token stride 2 H
    launches = _run(recorder, lambda: npu.fused_attn_res_full(prefix, addend, blocks, nw, pw, K, 1e-6, write_idx,
                                                              onw, 1e-5 if onw is not None else None, **form))
    names = [launch.kernel for launch in launches]
    if form.get("mix", True):
        # One launch of the plan's kernel, with MIX_OUT, the new prefix into sum_out or kept in prefix_sum.
        assert names == [_forward_kernel(dtype, H, K)], names
    else:
        stores = case["addend"] or case["snapshot"] or "sum_out" in form
        assert names == (["attn_res_add_snapshot_kernel"] if stores else []), names


@pytest.mark.parametrize("case", [p for axes in (BASE_AXES, LARGE_K_AXES)
                                  for p in _cases("bwd", dict(axes, mask=MASKS))])
def test_backward(recorder: Recorder, case: dict):
    from k3_ops.backends import npu

    K = case["K"]
    dtype, H, prefix, blocks, nw, pw = _base_args(case, capacity=K + 1)
    grad_out = _rows(dtype, H, case["layout"])
    mask = case["mask"]
    launches = _run(recorder, lambda: npu.attn_res_backward(grad_out, prefix, blocks, nw, pw, K, 1e-6, list(mask)))
    if K == 0:
        assert launches == [], launches  # p = 1 exactly: copies and zeros, no kernel
        return
    names = [launch.kernel for launch in launches]
    # The gradient kernel, then (a weight's gradient asked for) the fixed-order weight-gradient reduction.
    assert names == ["attn_res_bwd_kernel"] + (["attn_res_bwd_dw_reduce_kernel"] if mask[2] or mask[3] else []), names
