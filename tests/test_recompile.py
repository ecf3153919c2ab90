"""Recompile safety: token counts T in {1, 7, 16, 17, 512} with fixed K, H and dtype use one compiled
kernel per launch path, and after ``k3_ops.warmup`` the default launch table compiles nothing new.

Two ways of counting:
- everywhere (also under the interpreter, which compiles nothing): the launches are intercepted and their Triton
  *compile key* is computed with Triton's own specialisation rules (constexpr values, pointer dtypes and 16-byte
  alignment, and for every int argument not listed in ``do_not_specialize`` whether it is 1 or a multiple of 16).
  The kernels do not run, so this is cheap.
- on a GPU: the compiled variants in each JITFunction's device cache, before and after.
"""
from __future__ import annotations

import inspect

import pytest
import torch

import k3_ops

from conftest import Sample, requires_cuda

TOKEN_COUNTS = (1, 7, 16, 17, 512)
#: The forward kernels by module: kernels/attn_res_fwd.py, kernels/attn_res_decode.py and kernels/attn_res_npu.py
#: (launched by the NPU policy only).
KERNEL_NAMES = ("attn_res_rows_kernel", "attn_res_split_kernel", "attn_res_npu_kernel", "attn_res_token_kernel",
                "attn_res_npu_single_read_kernel")


def _kernel_module(name: str):
    from k3_ops.kernels import attn_res_decode, attn_res_fwd, attn_res_npu

    return {"attn_res_token_kernel": attn_res_decode, "attn_res_npu_single_read_kernel": attn_res_npu}.get(
        name, attn_res_fwd)


def _do_not_specialize(fn) -> set[str]:
    names = getattr(fn, "do_not_specialize", None)  # JITFunction
    if names is None:
        names = getattr(fn, "kwargs", {}).get("do_not_specialize")  # InterpretedFunction
    arg_names = fn.arg_names
    return {arg_names[n] if isinstance(n, int) else n for n in (names or [])}


def compile_key(fn, args, kwargs) -> tuple:
    """What Triton would compile this launch for (its specialisation rules, spelled out)."""
    dns = _do_not_specialize(fn)
    params = inspect.signature(getattr(fn, "fn", fn)).parameters
    constexprs = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    key = []
    # Keyword arguments are parameters too (the fused kernels take theirs by name): the same rules apply to every
    # one of them; the launch options (num_warps, ...) are compile options and enter as they are.
    named = [(n, v) for n, v in sorted(kwargs.items()) if n in fn.arg_names]
    options = tuple(sorted((n, v) for n, v in kwargs.items() if n not in fn.arg_names))
    for name, a in [*zip(fn.arg_names, args), *named]:
        if name in constexprs:  # compiled for its exact value
            key.append((name, repr(a)))
        elif isinstance(a, torch.Tensor):
            key.append((name, a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            key.append((name, a))
        elif isinstance(a, int):
            wide = not -2 ** 31 <= a < 2 ** 31
            key.append((name, "int", wide) if name in dns else (name, a == 1, a % 16 == 0, wide))
        elif isinstance(a, float):
            key.append((name, "fp32"))
        else:
            key.append((name, repr(a)))
    return tuple(key) + options


class _Recorder:
    """Stands in for a kernel: records the compile key of every launch; runs the real kernel if asked."""

    def __init__(self, fn, run: bool):
        self.fn, self.run, self.keys = fn, run, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.append(compile_key(self.fn, args, kwargs))
            if self.run:
                return self.fn[grid](*args, **kwargs)

        return launch


@pytest.fixture
def recorders(monkeypatch):
    """Intercept the forward kernels; ``recorders(run=...)`` returns {name: _Recorder}."""

    def install(run: bool = False):
        recs = {}
        for name in KERNEL_NAMES:
            module = _kernel_module(name)
            recs[name] = _Recorder(getattr(module, name), run)
            monkeypatch.setattr(module, name, recs[name])
        return recs

    return install


def _run_cuda_policy(T, device, config=None, H=7168, K=4, dtype=torch.bfloat16):
    from k3_ops.backends import cuda

    args = Sample(T=T, K=K, cap=8, H=H, dtype=dtype).make(device=device)
    return cuda.attn_res_forward(**args, config=config)


def _cpu_or_cuda() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("path", ["token", "rows", "split"])
def test_one_compile_key_per_cuda_path(recorders, path):
    from k3_ops.backends.cuda import LaunchConfig

    recs = recorders(run=False)
    device = _cpu_or_cuda()
    config, H = LaunchConfig(kernel=path), 7168
    for T in TOKEN_COUNTS:
        _run_cuda_policy(T, device, config, H=H)
    rec = recs[f"attn_res_{path}_kernel"]
    others = [name for name in KERNEL_NAMES if name != f"attn_res_{path}_kernel" and recs[name].keys]
    assert not others, f"the {path} config launched {others}"
    launches_per_call = len(rec.keys) // len(TOKEN_COUNTS)
    assert len(set(rec.keys)) == launches_per_call, (
        f"{len(set(rec.keys))} compile keys for T in {TOKEN_COUNTS} (expected {launches_per_call}: one per launch "
        f"of a call)")


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "attn_res_npu_single_read_kernel"),
                                          (torch.float32, "attn_res_npu_kernel")], ids=["single-read", "two-pass"])
def test_one_compile_key_for_npu_policy(recorders, dtype, kernel):
    from k3_ops.backends import npu

    recs = recorders(run=False)
    with npu.substitute(num_vector_cores=lambda device: 20):
        for T in TOKEN_COUNTS:
            npu.attn_res_forward(**Sample(T=T, K=4, cap=8, H=7168, dtype=dtype).make())
    keys = recs[kernel].keys
    assert len(keys) == len(TOKEN_COUNTS) and len(set(keys)) == 1
    assert sum(len(r.keys) for r in recs.values()) == len(TOKEN_COUNTS)  # nothing else launched


def test_npu_single_read_key_does_not_depend_on_k(recorders):
    # The single-read kernel takes K at run time (no K_PAD): one compiled kernel for every K.
    from k3_ops.backends import npu

    recs = recorders(run=False)
    with npu.substitute(num_vector_cores=lambda device: 20):
        for K in (1, 4, 8, 15, 64):
            npu.attn_res_forward(**Sample(T=7, K=K, cap=64, H=96).make())
    keys = recs["attn_res_npu_single_read_kernel"].keys
    assert len(keys) == 5 and len(set(keys)) == 1


def test_k_is_not_a_compile_key_within_a_k_pad(recorders):
    # K is a runtime argument: K = 5, 6, 7 share K_PAD = 8 and therefore one compiled kernel on every path (the
    # token and rows paths have no K_PAD at all).
    from k3_ops.backends import cuda, npu

    recs = recorders(run=False)
    for K in (5, 6, 7):
        args = Sample(T=7, K=K, cap=8, H=7168).make(device=_cpu_or_cuda())
        cuda.attn_res_forward(**args)
        cuda.attn_res_forward(**args, config=cuda.LaunchConfig(kernel="rows"))
        args = Sample(T=7, K=K, cap=8, H=7168).make()  # the simulated-NPU policy takes CPU tensors
        for forced in ("single_read", "two_pass"):
            with npu.substitute(num_vector_cores=lambda device: 20, forward_kernel=forced):
                npu.attn_res_forward(**args)
    assert recs["attn_res_npu_kernel"].keys and recs["attn_res_npu_single_read_kernel"].keys
    for name, rec in recs.items():
        assert len(rec.keys) % 3 == 0 and len(set(rec.keys)) == len(rec.keys) // 3, name


def test_block_major_shares_token_major_kernels(recorders):
    from k3_ops.backends import cuda

    # T = 64 and 1024 at K = 4: the token kernel (the one-tile plan, then one row at a time), and T = 1024 at K = 17
    # the rows kernel, on the GPU as in the interpreter (at T <= 32, K = 3..4 a GPU runs the cluster kernel, which
    # has no Triton compile key).
    shapes = ((64, 4), (1024, 4), (1024, 17))
    for T, K in shapes:
        plan = cuda.choose_config(T, K, 7168, torch.device(_cpu_or_cuda()))
        assert plan.kernel == ("rows" if K > 16 else "token"), (T, K, plan)
    recs = recorders(run=False)
    for layout in ("tokenmajor", "blockmajor"):
        for T, K in shapes:
            cuda.attn_res_forward(**Sample(T=T, K=K, cap=max(8, K), H=7168, layout=layout).make(device=_cpu_or_cuda()))
    for name in ("attn_res_rows_kernel", "attn_res_token_kernel"):
        keys = recs[name].keys
        assert keys and len(set(keys)) == len(keys) // 2, name


def test_warmup_covers_the_default_table(recorders):
    from k3_ops.backends import cuda

    recs = recorders(run=False)
    device = torch.device(_cpu_or_cuda())
    n = cuda.warmup(7168, torch.bfloat16, device, max_num_valid_blocks=8, max_num_tokens=1024)
    warm = {name: set(rec.keys) for name, rec in recs.items()}
    assert n == len(cuda.warmup_plans(device, 7168, 8, 1024))
    for T in TOKEN_COUNTS + (2, 9, 33, 100):
        for K in (1, 8):
            for layout in ("tokenmajor", "blockmajor"):
                # On the warm-up's device: the plan depends on the device's SM count (CPU: the interpreter's).
                cuda.attn_res_forward(**Sample(T=T, K=K, cap=9, H=7168, layout=layout).make(device=device))
    for name, rec in recs.items():
        new = set(rec.keys) - warm[name]
        assert not new, f"{name}: {len(new)} compile keys not covered by warmup"


def test_warmup_covers_model_weights_and_the_serving_call(recorders):
    # bf16 weights (a K3 checkpoint's) and vLLM's in-place serving call (FP32-mix output norm, with and without a
    # delta and the snapshot): after warmup(serving=True) none of them adds a compile key.
    from k3_ops.backends import cuda

    recs = recorders(run=False)
    device = torch.device(_cpu_or_cuda())
    cuda.warmup(7168, torch.bfloat16, device, max_num_valid_blocks=8, max_num_tokens=1024, serving=True)
    warm = {name: set(rec.keys) for name, rec in recs.items()}
    for T in (1, 4, 7, 64, 300):
        for K in (1, 5, 8):
            args = Sample(T=T, K=K, cap=9, H=7168).make(device=device)
            args["norm_weight"] = args["norm_weight"].bfloat16()
            args["proj_weight"] = args["proj_weight"].bfloat16()
            cuda.attn_res_forward(**args)
            onw = torch.ones(7168, dtype=torch.bfloat16, device=device)
            for delta in (args["prefix_sum"].clone(), None):
                for write in (-1, K):
                    cuda.fused_attn_res_(args["prefix_sum"].clone(), delta, args["block_residual"],
                                         args["norm_weight"], args["proj_weight"], K, 1e-6, write, onw, 1e-6,
                                         round_mix=False)
    for name, rec in recs.items():
        new = set(rec.keys) - warm[name]
        assert not new, f"{name}: {len(new)} compile keys not covered by warmup"


@requires_cuda
@pytest.mark.cuda
def test_cuda_compiled_variants():
    # The real thing: count compiled kernels in the JITFunctions' device caches.
    from k3_ops.backends import cuda

    def count():
        return {name: sum(len(c[0]) for c in getattr(_kernel_module(name), name).device_caches.values())
                for name in KERNEL_NAMES}

    before = count()
    for T in TOKEN_COUNTS:
        _run_cuda_policy(T, "cuda", cuda.LaunchConfig(kernel="rows"))
    after_rows = count()
    assert after_rows["attn_res_rows_kernel"] - before["attn_res_rows_kernel"] <= 1
    for T in TOKEN_COUNTS:
        _run_cuda_policy(T, "cuda", cuda.LaunchConfig(kernel="token"))
    after_token = count()
    assert after_token["attn_res_token_kernel"] - after_rows["attn_res_token_kernel"] <= 1
    split = cuda.LaunchConfig(kernel="split", chunk=64)
    for T in TOKEN_COUNTS:
        _run_cuda_policy(T, "cuda", split, H=64)
    after_split = count()
    assert after_split["attn_res_split_kernel"] - after_token["attn_res_split_kernel"] <= 2  # one per PHASE used
    k3_ops.warmup(7168, torch.bfloat16, "cuda", max_num_valid_blocks=8, max_num_tokens=1024)
    warmed = count()
    for T in TOKEN_COUNTS:
        for K in (1, 4, 8):
            _run_cuda_policy(T, "cuda", K=K)
    torch.cuda.synchronize()
    assert count() == warmed, "the default table compiled new kernels after warmup"
