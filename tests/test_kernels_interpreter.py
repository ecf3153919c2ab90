"""Both Triton launch policies (CUDA: token, rows and split paths; Ascend NPU) under the Triton interpreter, on CPU
tensors, against the float64 truth with the accuracy contract.

Contract: the kernel's max-abs and mean-abs errors against the float64 truth are each at most 1.25x those of
the FP32 eager formula rounded to the output dtype. One interpreter quirk: its fp32 -> bf16 conversion
truncates (rounds toward zero) where the GPU rounds to nearest even. So for bf16 the eager yardstick is rounded
the same way (truncated), and the kernel must additionally stay within one bf16 ulp of the round-to-nearest
eager output: the one-ulp allowance, and nothing more.

These tests skip on GPU machines (kernels are compiled for the GPU there); the CUDA tests cover the policies.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from k3_ops import reference
from k3_ops.testing import assert_accuracy_contract

from conftest import Sample, requires_interpreter

pytestmark = [requires_interpreter, pytest.mark.interpreter]

NPU_TEST_CORES = 8  # vector cores assumed for the NPU policy here: several tokens per program at T > 8
#: The NPU policy as it chooses ("npu") and with each of its two forward kernels forced on every shape.
NPU_POLICIES = ["npu", "npu-single-read", "npu-two-pass"]


def run_policy(policy: str, args: dict, **kw) -> torch.Tensor:
    """attn_res through one launch policy's backend function (the CPU dispatch key runs the reference, so the
    Triton policies are called directly here; tests/test_npu_simulated.py goes through the dispatcher)."""
    if policy.startswith("npu"):
        from k3_ops.backends import npu

        forced = {"npu": None, "npu-single-read": "single_read", "npu-two-pass": "two_pass"}[policy]
        with npu.substitute(num_vector_cores=lambda device: NPU_TEST_CORES, forward_kernel=forced):
            return npu.attn_res_forward(**args, **kw)
    from k3_ops.backends import cuda

    return cuda.attn_res_forward(**args, **kw)


def cuda_config(path: str | None):
    if path is None:
        return {}
    from k3_ops.backends.cuda import LaunchConfig

    if path == "rows-pipelined":  # the large-T default: rows staged through shared memory (prefetch 0)
        return {"config": LaunchConfig(kernel="rows", prefetch=0, num_stages=3)}
    if path == "token-onetile":  # every block row in one tile, the prefix beside it (rows_per_tile 0)
        return {"config": LaunchConfig(kernel="token", rows_per_tile=0, num_warps=8)}
    if path == "token-prefix-first":  # 4-row tiles, the prefix candidate folded first
        return {"config": LaunchConfig(kernel="token", rows_per_tile=4, num_stages=1, prefix_first=True)}
    if path.startswith("token-"):  # the decode kernel with 1- or 8-row tiles (the default is 4)
        return {"config": LaunchConfig(kernel="token", rows_per_tile=int(path[6:-3]), num_stages=1)}
    return {"config": LaunchConfig(kernel=path, prefetch=1) if path == "rows" else LaunchConfig(kernel=path)}


def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounding toward zero (drop the low 16 bits), as the Triton interpreter converts."""
    bits = x.to(torch.float32).contiguous().view(torch.int32) & -65536
    return bits.view(torch.float32).to(torch.bfloat16)


def check_contract(out: torch.Tensor, args: dict, what: str):
    """The accuracy contract (with the interpreter's bf16 truncation accounted for); returns (kernel, eager)."""
    dtype = args["prefix_sum"].dtype
    assert out.dtype == dtype and out.shape == args["prefix_sum"].shape and out.is_contiguous(), what
    assert not out.isnan().any(), f"{what}: NaN in the output (NaN-poisoned capacity leaked?)"
    truth = reference.attn_res_truth(**args)
    eager = reference.attn_res_reference(**args)
    if dtype == torch.bfloat16:
        # The eager formula's FP32 mix (the reference on exactly upcast inputs), rounded like the interpreter.
        up = dict(args, prefix_sum=args["prefix_sum"].float(), block_residual=args["block_residual"].float())
        yardstick = truncate_to_bf16(reference.attn_res_reference(**up))
        # One bf16 ulp (eps * |x| bounds it) from the round-to-nearest eager output, plus an absolute FP32
        # slack for outputs near zero, where the two FP32 computations' own rounding (~1e-7 of the O(1) terms
        # that cancel) is larger than an ulp of the tiny result.
        ulp = torch.finfo(torch.bfloat16).eps * eager.float().abs()
        off = (out.float() - eager.float()).abs()
        bad = off > ulp * 1.0001 + 1e-5
        assert not bool(bad.any()), (
            f"{what}: {int(bad.sum())} elements differ from the eager bf16 output by more than one bf16 ulp: "
            f"max {off.max().item():.3e}")
    else:
        yardstick = eager
    k, e = assert_accuracy_contract(out, yardstick, truth, what=what)
    print(f"{what}: kernel/eager max-abs {k.max_abs / max(e.max_abs, 1e-30):.3f} "
          f"mean-abs {k.mean_abs / max(e.mean_abs, 1e-30):.3f} ({k})")
    return k, e


# (sample, CUDA path the default table must pick for it under the interpreter's 132 "SMs")
CONTRACT_CASES = [
    (Sample(T=7, K=4, cap=8, H=7168, dtype=torch.bfloat16), "token"),  # the Kimi K3 hidden size, decode-ish
    (Sample(T=7, K=4, cap=8, H=7168, dtype=torch.float32), "token"),
    # The full-capacity profile-run shape. H = 64 instead of 7168 keeps it cheap: the interpreter executes
    # every program's ops in Python, and 512 tokens x 9 candidates at H = 7168 take minutes. T = 520: the 2-row
    # tiles the table runs at K = 2 above 512 tokens (and many tokens per NPU program).
    # (The rows kernel, which the table runs only at K > 8, is forced onto these shapes below.)
    (Sample(T=520, K=2, cap=8, H=64, dtype=torch.bfloat16), "token"),
    (Sample(T=300, K=8, cap=8, H=64, dtype=torch.bfloat16), "token"),
    (Sample(T=5, K=3, cap=6, H=320, dtype=torch.bfloat16), "token"),
    (Sample(T=5, K=3, cap=6, H=320, dtype=torch.float16), "token"),
    (Sample(T=5, K=3, cap=6, H=320, dtype=torch.float32), "token"),
    (Sample(T=6, K=1, cap=2, H=96, dtype=torch.float16), "token"),  # K = 1
    (Sample(T=5, K=2, cap=4, H=33, dtype=torch.float16), "token"),  # H not a multiple of anything
    (Sample(T=6, K=3, cap=5, H=96, dtype=torch.bfloat16, layout="blockmajor"), "token"),
    (Sample(T=3, K=20, cap=24, H=48, dtype=torch.float32, proj_2d=False), "token"),  # K + 1 > 16: many tiles
    (Sample(T=2, K=64, cap=64, H=32, dtype=torch.bfloat16), "token"),  # K = 64 (NPU: K_PAD = 128)
]


@pytest.mark.parametrize("sample,expected_path", [pytest.param(s, p, id=s.id) for s, p in CONTRACT_CASES])
@pytest.mark.parametrize("policy", ["cuda", "npu-single-read", "npu-two-pass"])
def test_accuracy_contract(policy, sample, expected_path):
    args = sample.make()
    if policy == "cuda":
        from k3_ops.backends import cuda

        plan = cuda.choose_config(sample.T, sample.K, sample.H, args["prefix_sum"].device)
        assert plan.kernel == expected_path, f"{sample.id}: table picked {plan.kernel}, expected {expected_path}"
    out = run_policy(policy, args)
    check_contract(out, args, f"{policy}:{sample.id}")


# Each CUDA path forced on shapes the table would route to another one: every path must be correct everywhere.
FORCED = [
    Sample(T=7, K=4, cap=8, H=7168, dtype=torch.bfloat16),
    Sample(T=5, K=2, cap=4, H=33, dtype=torch.float16),
    Sample(T=6, K=3, cap=5, H=96, dtype=torch.float32, layout="blockmajor"),
    Sample(T=40, K=15, cap=16, H=40, dtype=torch.bfloat16),  # the split path's largest K (K_PAD = 16)
    Sample(T=3, K=9, cap=9, H=40, dtype=torch.float16),  # ragged last tile: 9 = 4 + 4 + 1 rows
]


@pytest.mark.parametrize("sample", [pytest.param(s, id=s.id) for s in FORCED])
@pytest.mark.parametrize("path", ["token", "token-1row", "token-8row", "token-onetile", "token-prefix-first", "rows",
                                  "rows-pipelined", "split"])
def test_cuda_paths_forced(path, sample):
    args = sample.make(seed=1)
    check_contract(run_policy("cuda", args, **cuda_config(path)), args, f"cuda-{path}:{sample.id}")


@pytest.mark.parametrize("policy", ["cuda"] + NPU_POLICIES[1:])
def test_rows_path_several_tokens_per_program(policy):
    # CUDA: the persistent rows grid is capped at SMs x ctas_per_sm; with ctas_per_sm=... small enough that
    # programs take several tokens (a ragged last stride included), the stream crosses token boundaries.
    sample = Sample(T=11, K=3, cap=4, H=80, dtype=torch.bfloat16)
    args = sample.make(seed=2)
    kw = {}
    if policy == "cuda":
        from k3_ops.backends.cuda import LaunchConfig

        kw = {"config": LaunchConfig(kernel="rows", ctas_per_sm=1)}  # 132 programs under the interpreter
        sample = Sample(T=300, K=3, cap=4, H=48, dtype=torch.bfloat16)  # 300 = 2 x 132 + 36: ragged
        args = sample.make(seed=2)
    check_contract(run_policy(policy, args, **kw), args, f"{policy}:tokens_per_prog")


@pytest.mark.parametrize("policy", ["cuda", "npu"])
def test_k0_is_an_exact_copy(policy):
    sample = Sample(T=4, K=0, cap=3, H=96, dtype=torch.bfloat16)
    args = sample.make()
    args["prefix_sum"] = args["prefix_sum"].t().contiguous().t()  # column-major: the copy must be contiguous
    out = run_policy(policy, args)
    assert out.is_contiguous() and torch.equal(out, args["prefix_sum"])
    assert out.data_ptr() != args["prefix_sum"].data_ptr()


@pytest.mark.parametrize("policy", ["cuda", "npu"])
def test_zero_tokens(policy):
    args = Sample(T=0, K=2, cap=3, H=40, dtype=torch.float16).make()
    out = run_policy(policy, args)
    assert out.shape == (0, 40) and out.dtype == torch.float16


@pytest.mark.parametrize("policy", ["cuda", "npu"])
def test_fp64_routes_to_reference(policy):
    args = Sample(T=3, K=2, cap=3, H=16, dtype=torch.float64).make()
    assert torch.equal(run_policy(policy, args), reference.attn_res_reference(**args))


@pytest.mark.parametrize("policy", ["cuda"] + NPU_POLICIES[1:])
@pytest.mark.parametrize("path", [None, "rows", "token-onetile"])
def test_non_unit_hidden_stride(policy, path):
    # Views whose hidden dimension steps by 2 and 3 elements: the H_STRIDED variant must read them in place.
    if policy.startswith("npu") and path is not None:
        pytest.skip("CUDA launch-table paths only (the NPU kernels are forced by the policy name)")
    s = Sample(T=5, K=3, cap=4, H=40, dtype=torch.float32)
    base = s.make(seed=3)
    prefix = torch.full((s.T, 2 * s.H), float("nan"))
    prefix[:, ::2] = base["prefix_sum"]
    blocks = torch.full((s.T, s.cap, 3 * s.H), float("nan"))
    blocks[:, :, ::3] = base["block_residual"]
    args = dict(base, prefix_sum=prefix[:, ::2], block_residual=blocks[:, :, ::3])
    assert args["prefix_sum"].stride(1) == 2 and args["block_residual"].stride(2) == 3
    out = run_policy(policy, args, **(cuda_config(path) if policy == "cuda" else {}))
    check_contract(out, args, f"{policy}:hidden-strided")
    assert torch.equal(out, run_policy(policy, base, **(cuda_config(path) if policy == "cuda" else {})))


@pytest.mark.parametrize("policy", ["cuda"] + NPU_POLICIES[1:])
def test_weight_dtypes_and_shapes(policy):
    # fp64 weights are cast to fp32 before launch; bf16 weights are read natively; proj [H] or [1, H].
    s = Sample(T=4, K=2, cap=3, H=48, dtype=torch.bfloat16)
    args = s.make(seed=4)
    mixed = dict(args, norm_weight=args["norm_weight"].double(), proj_weight=args["proj_weight"].reshape(-1))
    check_contract(run_policy(policy, mixed), mixed, f"{policy}:fp64-norm-weight")
    low = dict(args, norm_weight=args["norm_weight"].bfloat16(), proj_weight=args["proj_weight"].bfloat16())
    check_contract(run_policy(policy, low), low, f"{policy}:bf16-weights")


def test_cuda_launch_table_overrides():
    from k3_ops.backends import cuda, cuda_table

    old = cuda.set_launch_config(8, 8, cuda.LaunchConfig(kernel="rows", num_warps=2))
    try:
        plan = cuda.choose_config(7, 7, 7168, torch.device("cpu"))  # K = 7..8: the K bucket 8
        assert plan.kernel == "rows" and plan.num_warps == 2 and plan.block_h == 8192
        assert cuda.choose_config(7, 6, 7168, torch.device("cpu")).kernel != "rows"  # K = 5..6: the K bucket 6
    finally:
        cuda.set_launch_config(8, 8, old)
    # Restored: the table resolves to what the old entry resolves to (a cluster entry, to its fallback on the CPU).
    assert cuda.choose_config(7, 7, 7168, torch.device("cpu")) == cuda.choose_config(7, 7, 7168, torch.device("cpu"),
                                                                                      old)
    plan = cuda.choose_config(18, 4, 7168, torch.device("cpu"), cuda.LaunchConfig(kernel="split", chunk=512))
    assert (plan.kernel, plan.chunk, plan.p, plan.k_pad) == ("split", 512, 14, 8)
    # Decode sizes take the per-token kernel, large T the rows kernel; PDL never under the interpreter.
    plan = cuda.choose_config(64, 8, 7168, torch.device("cpu"))
    assert (plan.kernel, plan.rows_per_tile, plan.pdl) == ("token", 4, False)
    assert cuda.choose_config(cuda.TOKEN_MAX_T, 8, 7168, torch.device("cpu")).rows_per_tile == 1
    # 65-128 tokens, K = 5..8: tiles of 4 rows, but of 2 at K = 5..6 (a 4-row tiling would pad them to 8 rows).
    for K, rows in ((5, 2), (6, 2), (7, 4), (8, 4)):
        for T in (65, 128):
            plan = cuda.choose_config(T, K, 7168, torch.device("cpu"))
            assert (plan.kernel, plan.rows_per_tile, plan.num_warps, plan.num_stages) == ("token", rows, 8, 1), (T, K)
    # K = 9..16 keeps the token path up to TOKEN_MAX_T_K16 tokens with 4 stages, then up to LOOP_MAX_T with 3;
    # K > 16 leaves it above TOKEN_MAX_T.
    loop_max = {K: cuda.LOOP_MAX_T[cuda.bucket(K, cuda.K_BUCKETS)] for K in (3, 4, 5, 8, 9, 16)}
    assert loop_max == {3: 1 << 62, 4: 1 << 62, 5: 1 << 62, 8: 1 << 62, 9: 4096, 16: 4096}
    for T, stages in ((cuda.TOKEN_MAX_T + 1, 4), (cuda.TOKEN_MAX_T_K16, 4), (cuda.TOKEN_MAX_T_K16 + 1, 3),
                      (loop_max[16], 3)):
        plan = cuda.choose_config(T, 16, 7168, torch.device("cpu"))
        assert (plan.kernel, plan.rows_per_tile, plan.num_warps, plan.num_stages) == ("token", 1, 4, stages), T
    assert cuda.choose_config(loop_max[9] + 1, 9, 7168, torch.device("cpu")).kernel == "rows"
    assert cuda.choose_config(cuda.TOKEN_MAX_T + 1, 17, 7168, torch.device("cpu")).kernel == "rows"
    assert cuda.choose_config(cuda.TOKEN_MAX_T, 17, 7168, torch.device("cpu")).num_stages == 3
    # Above TOKEN_MAX_T_K16 tokens (up to the largest T): K = 1 keeps the one-tile plan, K = 2 takes 2-row tiles
    # (4 warps, 2 stages, the prefix first), K = 3..8 one row at a time with the prefix first, 3 stages, 4 at
    # K = 5..8 above LOOP_DEEP_ABOVE_T tokens.
    for T in (cuda.TOKEN_MAX_T_K16 + 1, 4096, 70000):
        for K in (1, 2, 3, 4, 5, 8):
            plan = cuda.choose_config(T, K, 7168, torch.device("cpu"))
            if K == 1:
                want = ("token", True, 1, 8, 1, False)
            elif K == 2:
                want = ("token", False, 2, 4, 2, True)
            else:
                want = ("token", False, 1, 4, 4 if K >= 5 and T > cuda_table.LOOP_DEEP_ABOVE_T else 3, True)
            got = (plan.kernel, plan.one_tile, plan.rows_per_tile, plan.num_warps, plan.num_stages, plan.prefix_first)
            assert got == want, (T, K, plan)
    # The one-tile plan at K <= 2 loads the fused call's output norm weight ahead up to 128 tokens and after the
    # mix above (fewer registers, two programs per SM); with 4 rows after at every T (ahead spills).
    for T, K, ahead in ((65, 1, True), (128, 2, True), (129, 1, False), (cuda.TOKEN_MAX_T_K16, 2, False),
                        (128, 3, False)):
        plan = cuda.choose_config(T, K, 7168, torch.device("cpu"))
        assert (plan.kernel, plan.one_tile, plan.onw_ahead) == ("token", True, ahead), (T, K)
    # No entry runs the streaming kernel (opt-in: ``LaunchConfig(kernel="stream")``); the rows kernel only at K > 8.
    assert not any(entry.kernel == "stream" for entry in cuda.LAUNCH_TABLE.values())
    assert {k for (t, k), entry in cuda.LAUNCH_TABLE.items() if entry.kernel == "rows"} == {16, 32, 64, 1 << 62}
    with pytest.raises(ValueError, match=r"LaunchConfig.rows_per_tile must be a power of two >= 1, or 0 for one "
                                         r"tile, got 3"):
        cuda.LaunchConfig(kernel="token", rows_per_tile=3)
    with pytest.raises(ValueError, match=r"LaunchConfig.rows_per_tile 0 \(one tile\) is the token path's only, got "
                                         r"kernel 'rows'"):
        cuda.LaunchConfig(kernel="rows", rows_per_tile=0)
    with pytest.raises(ValueError, match=r"LaunchConfig.prefix_first is the token path's with rows_per_tile >= 1 only, "
                                         r"got kernel 'token', rows_per_tile 0"):
        cuda.LaunchConfig(kernel="token", rows_per_tile=0, prefix_first=True)
    with pytest.raises(ValueError, match=r"LaunchConfig.norm_gram is the cluster path's, or the token path's with "
                                         r"rows_per_tile 0, 1, 2 or 4, only; got kernel 'token', rows_per_tile 8"):
        cuda.LaunchConfig(kernel="token", rows_per_tile=8, norm_gram=True)
    with pytest.raises(ValueError, match=r"LaunchConfig.norm_gram is the cluster path's, .* got kernel 'rows'"):
        cuda.LaunchConfig(kernel="rows", norm_gram=True)
    with pytest.raises(ValueError, match=r"LaunchConfig.norm_gram is the cluster path's, .* got kernel 'stream'"):
        cuda.LaunchConfig(kernel="stream", norm_gram=True)
    with pytest.raises(ValueError, match=r"LaunchConfig.gram_tau must be >= 0, got -0.5"):
        cuda.LaunchConfig(kernel="token", norm_gram=True, gram_tau=-0.5)
    with pytest.raises(ValueError, match=r"LaunchConfig.onw_ahead is the token path's only, got kernel 'rows'"):
        cuda.LaunchConfig(kernel="rows", onw_ahead=False)
    # The Gram norm where the resolved tiles have at most 4 rows (a one-tile plan at K <= 4), else without it; no
    # table entry sets it.
    gram = cuda.LaunchConfig(kernel="token", rows_per_tile=0, num_warps=8, norm_gram=True)
    for K, expected in ((0, True), (1, True), (4, True), (5, False), (8, False)):
        plan = cuda.choose_config(5, K, 7168, torch.device("cpu"), gram)
        assert (plan.norm_gram, plan.gram_tau) == ((True, 2.0 ** -6) if expected else (False, 0.0)), K
    assert not any(entry.norm_gram for entry in cuda.LAUNCH_TABLE.values())
    # The prefix candidate first: the one-row plans at K = 5..16 above 128 tokens and K = 3..4 above 512 (up to
    # LOOP_MAX_T), the 2-row plan at K = 2 above 512, and no other entry.
    for T in (1, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 2048, 2049, 4096, 4097):
        for K in (1, 2, 3, 4, 5, 8, 9, 16, 17):
            plan = cuda.choose_config(T, K, 7168, torch.device("cpu"))
            expected = ((5 <= K <= 16 and 128 < T <= loop_max[5 if K <= 8 else 16])
                        or (2 <= K <= 4 and 512 < T <= loop_max[3]))
            assert plan.prefix_first == expected, (T, K)
            rows = 1 if K > 2 else 2
            assert not expected or (plan.kernel, plan.rows_per_tile, plan.num_warps) == ("token", rows, 4), (
                T, K)
    # One tile: next_pow2(K) rows for the call's K (K = 0: one masked row), no pipelining.
    one = cuda.LaunchConfig(kernel="token", rows_per_tile=0, num_warps=8, num_stages=3)
    for K, rows in ((0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)):
        plan = cuda.choose_config(5, K, 7168, torch.device("cpu"), one)
        assert (plan.kernel, plan.rows_per_tile, plan.one_tile, plan.num_stages) == ("token", rows, True, 1), K
    # A tile past ONE_TILE_MAX_ELEMENTS would only spill: 4-row tiles, unpipelined (three stages of fp32 4-row
    # tiles at H = 7168 need 262 KB of shared memory, past an H200's 227 KB: seen on the device), while the narrow
    # rows of H = 40 still fit 16 in one tile.
    plan = cuda.choose_config(5, 9, 7168, torch.device("cpu"), one)
    assert (plan.rows_per_tile, plan.one_tile, plan.num_stages) == (4, False, 1)
    assert plan == cuda.choose_config(5, 9, 7168, torch.device("cpu"),
                                      cuda.LaunchConfig(kernel="token", rows_per_tile=4, num_warps=8, num_stages=1))
    assert cuda.choose_config(5, 15, 40, torch.device("cpu"), one).rows_per_tile == 16
    # The table's one-tile entries: K <= 4 up to 512 tokens (at K <= 2 above 128 tokens with the output norm's
    # weight after the mix) and K = 1 above; K >= 5 there, and K = 2..4 above, take other plans.
    for T in (1, 5, 128, 256, 400, 512):
        for K in (1, 2, 3, 4):
            own = replace(one, onw_ahead=False) if T > 128 and K <= 2 else one
            assert cuda.choose_config(T, K, 7168, torch.device("cpu")) == cuda.choose_config(T, K, 7168,
                                                                                            torch.device("cpu"), own)
    assert not cuda.choose_config(64, 5, 7168, torch.device("cpu")).one_tile
    assert not cuda.choose_config(200, 8, 7168, torch.device("cpu")).one_tile
    assert cuda.choose_config(513, 2, 7168, torch.device("cpu")).rows_per_tile == 2  # K = 2: 2-row tiles
    assert cuda.choose_config(513, 1, 7168, torch.device("cpu")).one_tile  # K = 1: one tile at every T
    assert not cuda.choose_config(513, 4, 7168, torch.device("cpu")).one_tile  # K = 3..4: one row at a time
    with pytest.raises(ValueError, match=r"LaunchConfig.chunk must be a power of two >= 16, got 100"):
        cuda.LaunchConfig(kernel="split", chunk=100)
    with pytest.raises(ValueError, match=r"must come from T_BUCKETS"):
        cuda.set_launch_config(3, 8, old)


def test_npu_block_h_budget():
    from k3_ops.backends import npu

    for H in (33, 96, 7168):
        for K in (1, 4, 8, 15, 64):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                k_pad = 1 << K.bit_length()
                item = torch.empty((), dtype=dtype).element_size()
                block = npu.npu_block_h(H, k_pad, item, dtype == torch.float32)
                assert block >= 16 and block & (block - 1) == 0
                assert block <= max(16, 1 << (H - 1).bit_length())
                per_col = k_pad * (2 * item + 8 + (28 if dtype == torch.float32 else 0)) + 3 * item + 20
                assert block == 16 or block * per_col <= npu.UB_BUDGET_BYTES, (H, K, dtype, block)
    assert npu.npu_block_h(7168, 16, 2) == 512 and npu.npu_block_h(7168, 8, 2) == 1024


def test_npu_forward_plan():
    """The single-read kernel wherever its estimated working set fits the UB budget (the Kimi K3 hidden size in
    bf16 / fp16 included), the two-pass kernel elsewhere; the choice does not depend on K or the fused flags."""
    from k3_ops.backends import npu

    for H in (1, 33, 96, 1000, 4096, 7168, 8192, 8193, 16384):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            item = torch.empty((), dtype=dtype).element_size()
            need = npu.npu_single_read_bytes(H, item, dtype == torch.float32)
            block = max(16, 1 << (H - 1).bit_length())
            assert need == block * (20 if item < 4 else 32), (H, dtype, need)
            for K in (1, 8, 64):
                plans = {npu.forward_plan(H, K, dtype, fused) for fused in (False, True)}
                kinds = {p.kernel for p in plans}
                assert kinds == {"single_read" if need <= npu.UB_BUDGET_BYTES else "two_pass"}, (H, dtype, K)
                if kinds == {"single_read"}:
                    assert plans == {npu.ForwardPlan("single_read", block)}
                else:
                    assert all(p.k_pad == 1 << K.bit_length() for p in plans)
    assert npu.forward_plan(7168, 8, torch.bfloat16).kernel == "single_read"
    assert npu.forward_plan(7168, 8, torch.float32).kernel == "two_pass"
    assert npu.forward_plan(4096, 8, torch.float32).kernel == "single_read"
    with npu.substitute(forward_kernel="two_pass"):
        assert npu.forward_plan(96, 4, torch.bfloat16) == npu.ForwardPlan("two_pass", 128, 8)
    with npu.substitute(forward_kernel="single_read"):
        assert npu.forward_plan(7168, 4, torch.float32) == npu.ForwardPlan("single_read", 8192)
    with pytest.raises(ValueError, match="forward_kernel must be None, 'single_read' or 'two_pass', got 'rows'"):
        with npu.substitute(forward_kernel="rows"):
            pass


def test_npu_single_read_reads_each_candidate_once(monkeypatch):
    """The single-read kernel's loads, counted at the interpreter's builder (every masked tl.load is one call):
    per token K block rows and one prefix row, plus the two weight rows once per program. Slots >= K are
    NaN-poisoned, so a read of one would show in the contract check."""
    from triton.runtime import interpreter

    sample = Sample(T=11, K=3, cap=6, H=96, dtype=torch.bfloat16)
    args = sample.make(seed=5)
    calls = []
    real = interpreter.InterpreterBuilder.create_masked_load

    def counted(self, ptrs, mask, *a, **kw):
        calls.append(int(mask.data.sum()))
        return real(self, ptrs, mask, *a, **kw)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counted)
    out = run_policy("npu", args)
    monkeypatch.undo()
    programs = min(NPU_TEST_CORES, sample.T)
    assert len(calls) == sample.T * (sample.K + 1) + 2 * programs, len(calls)
    assert sum(calls) == (sample.T * (sample.K + 1) + 2 * programs) * sample.H  # whole rows, nothing more
    check_contract(out, args, "npu:single-read-count")


def test_interpreter_bf16_store_truncates():
    # Pins the quirk the bf16 yardstick above relies on: if a Triton release makes the interpreter round to
    # nearest even, this fails and the allowance can go.
    import triton
    import triton.language as tl

    @triton.jit
    def _cast(x_ptr, y_ptr):
        tl.store(y_ptr, tl.load(x_ptr).to(tl.bfloat16))

    x = torch.tensor([1.0 + 2.0 ** -7 + 2.0 ** -8 + 2.0 ** -10], dtype=torch.float32)  # nearest is up, truncation down
    y = torch.empty(1, dtype=torch.bfloat16)
    _cast[(1,)](x, y)
    assert y.item() == 1.0 + 2.0 ** -7 and x.to(torch.bfloat16).item() == 1.0 + 2.0 ** -6
    assert math.isclose(truncate_to_bf16(x).item(), y.item())

