"""The lean launch path (k3_ops/backends/_launch.py) and the per-call work it saves.

- The cache key covers what Triton specialises on: the ints outside ``do_not_specialize`` (H) are keyed, token
  counts, K and strides are not (so one cached launch serves every T and K).
- Weights are passed as they are, never cached: an in-place update of a parameter is seen by the next call.
- Profiler hooks: an empty hook chain (Triton >= 3.4 always has one) does not count as a hook.
- GPU: after ``warmup`` the direct launches are cached, a call adds no entry, and they give the JIT launch's bits.
"""
from __future__ import annotations

import pytest
import torch

from conftest import Sample, requires_cuda, requires_interpreter


def test_specialised_ints_are_keyed_and_runtime_ints_are_not():
    from triton.runtime.jit import JITFunction

    from k3_ops.backends import _launch
    from k3_ops.kernels import attn_res_decode, attn_res_fwd

    for kernel in (attn_res_decode.attn_res_token_kernel, attn_res_fwd.attn_res_rows_kernel,
                   attn_res_fwd.attn_res_split_kernel):
        if not isinstance(kernel, JITFunction):  # under the interpreter: the same function, as the GPU JIT sees it
            kernel = JITFunction(kernel.fn, do_not_specialize=kernel.kwargs["do_not_specialize"])
        spec = _launch._specialised_ints(kernel)
        assert "H" in spec, kernel
        for runtime in ("T", "K", "stride_pt", "stride_bt", "stride_bc", "stride_ot", "write_idx", "stride_at"):
            assert runtime not in spec, (kernel, runtime)


def test_hook_chains():
    from k3_ops.backends import _launch

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not _launch._hooked(None)
    assert not _launch._hooked(Chain([]))
    assert _launch._hooked(Chain([print]))
    assert _launch._hooked(print)


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["token", "rows"])
def test_in_place_weight_update_is_seen(path):
    from k3_ops import reference
    from k3_ops.backends import cuda

    args = Sample(T=3, K=2, cap=4, H=40, dtype=torch.bfloat16).make()
    args["norm_weight"] = args["norm_weight"].bfloat16()  # a kernel dtype: passed to the kernel as it is
    config = cuda.LaunchConfig(kernel=path)
    before = cuda.attn_res_forward(**args, config=config)
    args["norm_weight"].mul_(-3.0)
    args["proj_weight"].add_(0.05)
    after = cuda.attn_res_forward(**args, config=config)
    expected = reference.attn_res_reference(**args)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after.float(), expected.float(), rtol=2 ** -6, atol=2 ** -6)


@requires_cuda
@pytest.mark.cuda
def test_direct_launches_are_cached_and_match_the_jit():
    import k3_ops
    from k3_ops.backends import _launch, cuda

    if not _launch.direct_launch_supported():
        pytest.skip("this Triton's launcher convention is not the one the direct launch uses (Triton < 3.3)")
    k3_ops.warmup(7168, torch.bfloat16, "cuda", max_num_valid_blocks=8, max_num_tokens=1024)
    args = Sample(T=5, K=8, cap=9, H=7168).make(device="cuda")
    k3_ops.attn_res(**args)
    n = _launch.cache_size()
    assert n > 0
    direct = k3_ops.attn_res(**args)
    assert _launch.cache_size() == n, "a warm call added a cache entry"
    _launch.clear_cache()
    jit = k3_ops.attn_res(**args)  # the first call of a key goes through the JIT
    assert torch.equal(direct, jit)
    cuda.clear_plan_cache()
