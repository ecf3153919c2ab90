"""The fused Triton path of kimi_k3::fused_attn_res (kernels/attn_res_fwd.py with its fused flags).

Interpreter: the CUDA policy with the token, rows and split paths forced (with and without each flag: addend,
snapshot, output norm), the NPU policy, the NPU policy on the simulated PrivateUse1 device through the
dispatcher. CUDA (requires_cuda): the same contract on the GPU per path, with and without PDL, and the number of
kernel launches per fused call.
"""
from __future__ import annotations

import pytest
import torch

from conftest import Sample, requires_cuda, requires_interpreter, triton_interpreted
from test_fused import NORM_RTOL, FusedCase, _truncate_to_bf16, bits, positional
from test_npu_simulated import NpuTensor, simulated_npu  # noqa: F401  (the fixture)

#: Forced launch configurations per path: the per-token kernel with one- and two-row tiles (the decode default is
#: four; two rows over 8 warps also load the output norm's weight ahead) and with one tile of every block row, the
#: rows kernel with its row held in registers (prefetch 1) and pipelined through shared memory (prefetch 0, the
#: large-T default), and the split kernel.
FORCED = {
    "token": dict(kernel="token", rows_per_tile=2, num_warps=4),
    "token-1row": dict(kernel="token", rows_per_tile=1, num_warps=4, num_stages=1),
    # The table's plan at 65-128 tokens, K = 5..6: the loop with the output norm's weight loaded ahead (ONW_AHEAD).
    "token-2row-w8": dict(kernel="token", rows_per_tile=2, num_warps=8, num_stages=1),
    # The prefix candidate folded first: the fused call's stores before the loop (LaunchConfig.prefix_first).
    "token-prefix-first": dict(kernel="token", rows_per_tile=1, num_warps=4, num_stages=3, prefix_first=True),
    "token-2row-w8-prefix-first": dict(kernel="token", rows_per_tile=2, num_warps=8, num_stages=1, prefix_first=True),
    # The table's plan at K = 9..16, 129-512 tokens: one row, 4 stages, the prefix first.
    "token-1row-s4-prefix-first": dict(kernel="token", rows_per_tile=1, num_warps=4, num_stages=4, prefix_first=True),
    "token-onetile": dict(kernel="token", rows_per_tile=0, num_warps=8),  # every block row in one tile
    # The same with the output norm's weight loaded after the mix where the default loads it ahead (K <= 2).
    "token-onetile-after": dict(kernel="token", rows_per_tile=0, num_warps=8, onw_ahead=False),
    # The output norm's sum of squares from the statistics (LaunchConfig.norm_gram): one tile, the loops of 1, 2
    # and 4 rows with the prefix first and last.
    "token-onetile-gram": dict(kernel="token", rows_per_tile=0, num_warps=8, norm_gram=True),
    "token-1row-gram": dict(kernel="token", rows_per_tile=1, num_warps=4, num_stages=1, norm_gram=True),
    "token-prefix-first-gram": dict(kernel="token", rows_per_tile=1, num_warps=4, num_stages=3, prefix_first=True,
                                    norm_gram=True),
    "token-2row-w8-gram": dict(kernel="token", rows_per_tile=2, num_warps=8, num_stages=1, norm_gram=True),
    "token-4row-prefix-first-gram": dict(kernel="token", rows_per_tile=4, num_warps=8, num_stages=1,
                                         prefix_first=True, norm_gram=True),
    "rows": dict(kernel="rows", prefetch=1),
    "rows-pipelined": dict(kernel="rows", prefetch=0, num_stages=3),
    "split": dict(kernel="split", chunk=16),
    "stream": dict(kernel="stream"),  # CUDA C++ (a GPU only): shapes it cannot run take its token fallback
    # The cluster kernel (CUDA C++, a GPU only) with the Gram norm (kGram), 8 and 2 CTAs per token.
    "cluster8-gram": dict(kernel="cluster", cluster_size=8, norm_gram=True),
    "cluster2-gram": dict(kernel="cluster", cluster_size=2, norm_gram=True),
}
#: The CUDA C++ paths (no interpreter).
NATIVE_PATHS = [p for p, kw in FORCED.items() if kw["kernel"] in ("stream", "cluster")]


def _forced(path: str):
    from k3_ops.backends import cuda

    return cuda.LaunchConfig(**FORCED[path])


def _run_policy(case: FusedCase, args: dict, path: str, monkeypatch):
    """The CUDA policy's fused_attn_res with the launch path forced, and the same policy's attn_res of its
    new_prefix on the same path (the bit-exactness reference)."""
    from k3_ops.backends import cuda

    config = _forced(path)
    real = cuda.choose_config
    seen = []

    def choose(T, K, H, device, cfg=None):
        plan = real(T, K, H, device, config)
        seen.append(plan.kernel)
        return plan

    monkeypatch.setattr(cuda, "choose_config", choose)
    out, new_prefix = cuda.fused_attn_res(*positional(args))
    expected = FORCED[path]["kernel"]
    size = {"stream": 1, "cluster": config.cluster_size}.get(expected)
    if size and (case.base.K < config.min_k
                 or not cuda.cluster_supported(case.base.K, case.base.H, args["prefix_sum"].device, size)):
        expected = "token"  # the plan is its fallback (CLUSTER_FALLBACK_CONFIG); fp32 rows fall back per call
    assert seen == [expected], f"expected the {path} path, the policy chose {seen}"
    mix = cuda.attn_res_forward(new_prefix, args["block_residual"], args["norm_weight"], args["proj_weight"],
                                case.base.K, case.base.eps, config=config)
    return out, new_prefix, mix


def check_contract(case: FusedCase, args: dict, buf_before: torch.Tensor, out, new_prefix, mix,
                   truncating_bf16: bool) -> None:
    """new_prefix == prefix_sum + addend (or, under the interpreter's truncating bf16 store, its truncation),
    snapshot row == new_prefix, no other byte of the buffer written, out == mix or RMSNorm(mix) within tolerance."""
    buf = args["block_residual"]
    expected_prefix = args["prefix_sum"] + args["addend"] if case.addend else args["prefix_sum"]
    if not torch.equal(bits(new_prefix), bits(expected_prefix)):
        assert truncating_bf16 and case.base.dtype == torch.bfloat16 and case.addend, (
            f"{case.id}: new_prefix != prefix_sum + addend")
        exact = args["prefix_sum"].float() + args["addend"].float()
        assert torch.equal(bits(new_prefix), bits(_truncate_to_bf16(exact))), f"{case.id}: new_prefix wrong"
    idx = case.write_idx
    others = [i for i in range(case.base.cap) if i != idx]
    assert torch.equal(bits(buf[:, others]), bits(buf_before[:, others])), f"{case.id}: bytes outside the slot changed"
    if idx >= 0:
        assert torch.equal(bits(buf[:, idx]), bits(new_prefix)), f"{case.id}: snapshot row != new_prefix"
    assert not out.isnan().any(), f"{case.id}: NaN in out (poisoned capacity read?)"
    if case.norm == "none":
        assert torch.equal(bits(out), bits(mix)), f"{case.id}: out != attn_res(new_prefix, ...) on the same path"
    else:
        norm_eps = case.base.eps if args["out_norm_eps"] is None else args["out_norm_eps"]
        expected = torch.nn.functional.rms_norm(mix.float(), (case.base.H,), args["out_norm_weight"].float(),
                                                norm_eps).to(case.base.dtype)
        rtol = NORM_RTOL[case.base.dtype] * (2 if truncating_bf16 and case.base.dtype == torch.bfloat16 else 1)
        torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=rtol, msg=case.id)


# Small shapes (the interpreter is slow); every flag on and off at least once per path.
FLAG_CASES = [
    FusedCase(Sample(T=3, K=2, cap=4, H=40, dtype=torch.float16), addend=False, write="none"),  # FUSED only
    FusedCase(Sample(T=3, K=2, cap=4, H=40, dtype=torch.float16), write="none"),  # + addend
    FusedCase(Sample(T=2, K=1, cap=3, H=33, dtype=torch.float32, proj_2d=False)),  # + snapshot, odd H
    FusedCase(Sample(T=3, K=2, cap=4, H=48, dtype=torch.bfloat16), addend=False, write="last", norm="own"),
    FusedCase(Sample(T=2, K=3, cap=5, H=64, dtype=torch.bfloat16, layout="blockmajor"), norm="eps", views=True),
    FusedCase(Sample(T=2, K=0, cap=2, H=32, dtype=torch.float16), norm="own"),  # K = 0: the mix is new_prefix
]


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("path", [p for p in FORCED if p not in NATIVE_PATHS])  # CUDA C++: no interpreter
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in FLAG_CASES])
def test_cuda_policy_paths_under_interpreter(case: FusedCase, path: str, monkeypatch):
    args = case.make("cpu")
    buf_before = args["block_residual"].clone()
    out, new_prefix, mix = _run_policy(case, args, path, monkeypatch)
    check_contract(case, args, buf_before, out, new_prefix, mix, truncating_bf16=True)


GRAM_PATHS = [p for p in FORCED if p.endswith("-gram")]


def _cancelling_case(T: int, K: int, H: int, device: str) -> dict:
    """Fused-call inputs whose K + 1 candidates cancel in pairs (K odd): the prefix v and -v (1 +- 2^-10), block
    rows u and -u (1 +- 2^-10), all scores 0 (proj_weight 0), so the mix is about 2^-11 of each candidate and its
    sum of squares about 2^-22 of the candidates' (below fp16's ulp of them): one FP32 ulp of a pairwise product is
    then a large error in it, which is what the Gram guard (LaunchConfig.gram_tau) catches."""
    g = torch.Generator().manual_seed(11)
    dt = torch.float16
    v = torch.randn(T, H, generator=g, dtype=torch.float64)
    buf = torch.full((T, K + 2, H), float("nan"), dtype=torch.float64)

    def near_negative(x):
        return -x * (1 + (torch.randint(0, 2, x.shape, generator=g) * 2 - 1) * 2.0 ** -10)

    buf[:, 0] = near_negative(v)
    for i in range(1, K, 2):
        u = torch.randn(T, H, generator=g, dtype=torch.float64)
        buf[:, i], buf[:, i + 1] = u, near_negative(u)
    return dict(prefix_sum=v.to(device, dt), addend=None, block_residual=buf.to(device, dt),
                norm_weight=torch.ones(H, device=device), proj_weight=torch.zeros(H, device=device),
                num_valid_blocks=K, eps=1e-6, block_write_idx=-1,
                out_norm_weight=(1 + 0.1 * torch.randn(H, generator=g)).to(device, dt), out_norm_eps=1e-6)


def _gram_call(args: dict, path: str, gram_tau: float, monkeypatch):
    from k3_ops.backends import cuda

    config = cuda.LaunchConfig(**dict(FORCED[path], gram_tau=gram_tau))
    real = cuda.choose_config
    monkeypatch.setattr(cuda, "choose_config", lambda T, K, H, device, cfg=None: real(T, K, H, device, config))
    out, new_prefix = cuda.fused_attn_res(*positional(args))
    monkeypatch.setattr(cuda, "choose_config", real)
    mix = cuda.attn_res_forward(new_prefix, args["block_residual"], args["norm_weight"], args["proj_weight"],
                                args["num_valid_blocks"], args["eps"], config=config)
    expected = torch.nn.functional.rms_norm(mix.float(), (mix.shape[1],), args["out_norm_weight"].float(),
                                            args["out_norm_eps"])
    return out, expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("path", GRAM_PATHS)
def test_norm_gram_guard_on_cancelling_candidates(path: str, K: int, device: str, monkeypatch):
    """With candidates that cancel, the norm's sum of squares from their pairwise products is far off (shown with
    the guard off, gram_tau 0); with the default guard the call reduces over the mix and matches torch's RMSNorm
    of the same path's mix."""
    if device == "cpu" and not triton_interpreted():
        pytest.skip("CPU tensors reach the Triton kernels only under the interpreter (TRITON_INTERPRET=1)")
    if device == "cpu" and path in NATIVE_PATHS:
        pytest.skip("a CUDA C++ kernel: no interpreter")
    args = _cancelling_case(T=3, K=K, H=256 if device == "cpu" else 7168, device=device)
    rtol = NORM_RTOL[torch.float16]
    out, expected = _gram_call(args, path, 0.0, monkeypatch)
    err = ((out.float() - expected).abs() / (rtol * (1 + expected.abs()))).max().item()
    assert err > 1, f"{path}: the unguarded Gram norm is within tolerance ({err:.2f}): the case does not cancel"
    out, expected = _gram_call(args, path, cuda_default_gram_tau(), monkeypatch)
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=rtol)


def _correlated_case(T: int, K: int, H: int, device: str) -> dict:
    """Fused-call inputs whose candidates share a common row (v_i = base + 0.5 noise_i) and differ in score: every
    pairwise product is about as large as a row's own sum of squares, so a pair left out or counted twice in the
    Gram norm moves the output by far more than the norm's tolerance."""
    g = torch.Generator().manual_seed(12)
    dt = torch.bfloat16
    base = torch.randn(H, generator=g)
    v = base + 0.5 * torch.randn(T, H, generator=g)
    buf = torch.full((T, K + 2, H), float("nan"))
    buf[:, :K] = base + 0.5 * torch.randn(T, K, H, generator=g)
    return dict(prefix_sum=v.to(device, dt), addend=(0.1 * torch.randn(T, H, generator=g)).to(device, dt),
                block_residual=buf.to(device, dt), norm_weight=(1 + 0.1 * torch.randn(H, generator=g)).to(device),
                proj_weight=(0.5 * torch.randn(H, generator=g)).to(device), num_valid_blocks=K, eps=1e-6,
                block_write_idx=K, out_norm_weight=(1 + 0.1 * torch.randn(H, generator=g)).to(device, dt),
                out_norm_eps=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("K", [0, 1, 2, 3, 4, 8])
@pytest.mark.parametrize("path", GRAM_PATHS)
def test_norm_gram_correlated_candidates(path: str, K: int, device: str, monkeypatch):
    """Every pair of candidates in the Gram norm, once: on candidates whose products are all large, the output
    matches torch's RMSNorm of the same path's mix (and without the guard, so that the sum from the products is
    the one checked)."""
    if device == "cpu" and not triton_interpreted():
        pytest.skip("CPU tensors reach the Triton kernels only under the interpreter (TRITON_INTERPRET=1)")
    if device == "cpu" and path in NATIVE_PATHS:
        pytest.skip("a CUDA C++ kernel: no interpreter")
    args = _correlated_case(T=3, K=K, H=96 if device == "cpu" else 7168, device=device)
    rtol = NORM_RTOL[torch.bfloat16] * (2 if device == "cpu" else 1)  # the interpreter's truncating bf16 store
    out, expected = _gram_call(args, path, 0.0, monkeypatch)
    torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("K", [0, 1, 2], ids=lambda k: f"K{k}")
def test_onw_ahead_keeps_bits(K: int, device: str, monkeypatch):
    """Where the output norm's weight is loaded (with the inputs or after the mix: LaunchConfig.onw_ahead) moves
    only a load: out and new_prefix are the same bits either way."""
    from k3_ops.backends import cuda

    if device == "cpu" and not triton_interpreted():
        pytest.skip("CPU tensors reach the Triton kernels only under the interpreter (TRITON_INTERPRET=1)")
    case = FusedCase(Sample(T=3, K=K, cap=K + 2, H=96 if device == "cpu" else 7168, dtype=torch.bfloat16),
                     norm="own")
    dev = torch.device(device)
    # The default: ahead where the tiles have at most 2 rows over 8 warps (the one tile at K <= 2), not with 4 rows.
    assert cuda.choose_config(3, K, case.base.H, dev, _forced("token-onetile")).onw_ahead
    assert not cuda.choose_config(3, 4, case.base.H, dev, _forced("token-onetile")).onw_ahead
    assert not cuda.choose_config(3, K, case.base.H, dev, _forced("token-onetile-after")).onw_ahead
    results = {}
    for ahead, path in ((True, "token-onetile"), (False, "token-onetile-after")):
        cuda.clear_plan_cache()  # no launch recorded for the other plan is replayed (the C++ launch path)
        results[ahead] = [bits(t) for t in _run_policy(case, case.make(device), path, monkeypatch)[:2]]
        monkeypatch.undo()
    cuda.clear_plan_cache()
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False])), "out or new_prefix differ"


def cuda_default_gram_tau() -> float:
    from k3_ops.backends import cuda

    return cuda.LaunchConfig().gram_tau


@requires_interpreter
@pytest.mark.interpreter
def test_cuda_policy_k3_hidden_size_under_interpreter(monkeypatch):
    """H = 7168 (not a power of two) on the decode path, one token, all flags."""
    case = FusedCase(Sample(T=1, K=2, cap=3, H=7168, dtype=torch.bfloat16), norm="own")
    args = case.make("cpu")
    buf_before = args["block_residual"].clone()
    out, new_prefix, mix = _run_policy(case, args, "token", monkeypatch)
    check_contract(case, args, buf_before, out, new_prefix, mix, truncating_bf16=True)


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("kernel", ["single_read", "two_pass"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in FLAG_CASES[1:]])
def test_npu_on_simulated_device(simulated_npu, case: FusedCase, kernel: str):  # noqa: F811
    """The registered op on PrivateUse1 tensors reaches the NPU policy's fused launch (one kernel launch), with
    each of the policy's forward kernels (the single-read one is its choice at these sizes)."""
    from k3_ops.backends import npu

    assert npu.forward_plan(case.base.H, case.base.K, case.base.dtype).kernel == "single_read"
    with npu.substitute(forward_kernel=kernel):
        _check_npu_on_simulated_device(simulated_npu, case)


def _check_npu_on_simulated_device(simulated_npu, case: FusedCase):  # noqa: F811
    from k3_ops.backends import npu

    cpu_args = case.make("cpu")
    dev_args = {k: (v.to(simulated_npu.device) if isinstance(v, torch.Tensor) else v) for k, v in cpu_args.items()}
    if case.views:  # keep the strided views: rebuild them on the device from the same storage layout
        dev_args["prefix_sum"] = cpu_args["prefix_sum"].t().contiguous().to(simulated_npu.device).t()
    buf = dev_args["block_residual"]
    buf_before = simulated_npu.raw(buf).clone()
    launches = []
    real = npu.launch_forward
    try:
        npu.launch_forward = lambda *a, **k: (launches.append(a), real(*a, **k))[1]
        out, new_prefix = torch.ops.kimi_k3.fused_attn_res(*positional(dev_args))
    finally:
        npu.launch_forward = real
    assert isinstance(out, NpuTensor) and isinstance(new_prefix, NpuTensor)
    assert len(launches) == 1 and launches[0][-1] is not None, "expected one fused NPU kernel launch"
    raw_args = {k: (simulated_npu.raw(v) if isinstance(v, torch.Tensor) else v) for k, v in dev_args.items()}
    mix = npu.attn_res_forward(new_prefix, buf, dev_args["norm_weight"], dev_args["proj_weight"], case.base.K,
                               case.base.eps)
    raw_args["block_residual"] = simulated_npu.raw(buf)
    check_contract(case, raw_args, buf_before, simulated_npu.raw(out), simulated_npu.raw(new_prefix),
                   simulated_npu.raw(mix), truncating_bf16=True)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    # The NPU policy on CPU tensors: handed to Triton as they are (the module's simulated-NPU fixture, which maps
    # wrapper tensors to their storage, may still be active when these run).
    return t


NPU_WIDE_CASES = [
    # Wider than the single-read pre-pass chunk (new_prefix formed in SINGLE_READ_CHUNK pieces), the Kimi K3 size.
    FusedCase(Sample(T=3, K=2, cap=4, H=7168, dtype=torch.bfloat16), norm="own", views=True),
    FusedCase(Sample(T=4, K=3, cap=5, H=2500, dtype=torch.float32, layout="blockmajor"), write="last"),
]


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("kernel", ["single_read", "two_pass"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in NPU_WIDE_CASES])
def test_npu_policy_wide_rows_under_interpreter(case: FusedCase, kernel: str):
    from k3_ops.backends import npu

    assert npu.SINGLE_READ_CHUNK < case.base.H
    args = case.make("cpu")
    buf = args["block_residual"]
    buf_before = buf.clone()
    with npu.substitute(raw_tensor=_cpu, num_vector_cores=lambda device: 2, forward_kernel=kernel):
        out, new_prefix = npu.fused_attn_res(*positional(args))
        mix = npu.attn_res_forward(new_prefix, buf, args["norm_weight"], args["proj_weight"], case.base.K,
                                   case.base.eps)
    check_contract(case, args, buf_before, out, new_prefix, mix, truncating_bf16=True)


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("kernel", ["single_read", "two_pass"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_npu_fused_k0_out_is_new_prefix(kernel: str, dtype: torch.dtype):
    """K = 0: the mix IS new_prefix, bit for bit, signed zeros included (fp32 scores in double-float give the
    prefix a weight of 1 + tiny, so p * x / p would not do)."""
    from k3_ops.backends import npu

    case = FusedCase(Sample(T=5, K=0, cap=2, H=40, dtype=dtype))
    args = case.make("cpu")
    args["prefix_sum"][:, :6] = -0.0
    args["addend"][:, :6] = -0.0
    with npu.substitute(raw_tensor=_cpu, num_vector_cores=lambda device: 2, forward_kernel=kernel):
        out, new_prefix = npu.fused_attn_res(*positional(args))
    assert bool(((new_prefix == 0) & new_prefix.signbit()).any())
    assert torch.equal(bits(out), bits(new_prefix)), "out != new_prefix at K = 0"
    assert torch.equal(bits(args["block_residual"][:, 0]), bits(new_prefix)), "snapshot row != new_prefix"


# --- CUDA ------------------------------------------------------------------------------------------------
CUDA_CASES = [
    FusedCase(Sample(T=8, K=8, cap=9, H=7168, dtype=torch.bfloat16), norm="own"),
    FusedCase(Sample(T=8, K=1, cap=9, H=7168, dtype=torch.bfloat16), addend=False, write="none"),
    FusedCase(Sample(T=1, K=4, cap=9, H=7168, dtype=torch.float16, layout="blockmajor"), norm="eps", views=True),
    FusedCase(Sample(T=300, K=8, cap=9, H=7168, dtype=torch.bfloat16), norm="own"),
    FusedCase(Sample(T=200, K=12, cap=16, H=7168, dtype=torch.bfloat16), norm="own"),
    FusedCase(Sample(T=1024, K=8, cap=9, H=7168, dtype=torch.bfloat16), norm="own"),  # one row above 512 tokens
    FusedCase(Sample(T=700, K=4, cap=9, H=7168, dtype=torch.bfloat16), norm="own"),  # the same at K = 3..4
    FusedCase(Sample(T=33, K=3, cap=5, H=4096, dtype=torch.float32), write="last", norm="own"),
    FusedCase(Sample(T=5, K=0, cap=9, H=7168, dtype=torch.bfloat16), norm="eps"),
]


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("pdl", ["1", "0"], ids=["pdl", "nopdl"])
@pytest.mark.parametrize("path", list(FORCED))
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CUDA_CASES])
def test_cuda_paths(case: FusedCase, path: str, pdl: str, monkeypatch):
    from k3_ops.backends import cuda

    if pdl == "0" and FORCED[path]["kernel"] == "split":
        pytest.skip("the split path launches without PDL either way")
    monkeypatch.setenv("K3_OPS_PDL", pdl)
    cuda.clear_plan_cache()
    args = case.make("cuda")
    buf_before = args["block_residual"].clone()
    out, new_prefix, mix = _run_policy(case, args, path, monkeypatch)
    check_contract(case, args, buf_before, out, new_prefix, mix, truncating_bf16=False)
    cuda.clear_plan_cache()


def _kernel_launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()  # compile first
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("norm", ["none", "own"])
@pytest.mark.parametrize("T", [1, 8, 64, 4096], ids=lambda t: f"T{t}")
def test_kernel_launches_per_call(T: int, norm: str):
    """One kernel per fused call on the token, rows and cluster paths (allocation issues no kernel); the split path
    takes two, three with the output norm. A cluster entry runs the call with or without the output norm itself."""
    from k3_ops.backends import cuda

    case = FusedCase(Sample(T=T, K=8, cap=9, H=7168, dtype=torch.bfloat16), norm=norm)
    args = case.make("cuda")
    n = _kernel_launches(lambda: cuda.fused_attn_res(*positional(args)))
    plan = cuda.choose_config(T, 8, 7168, torch.device("cuda"))
    expected = (3 if norm != "none" else 2) if plan.kernel == "split" else 1
    assert n == expected, f"{case.id} ({plan.kernel}): {n} kernel launches per fused call"
