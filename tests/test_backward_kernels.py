"""The backward kernels of kimi_k3::attn_res: Triton, through both launch policies, and the CUDA C++
single-read kernel (csrc_cuda/; GPU only: no interpreter runs CUDA C++).

- Interpreter (TRITON_INTERPRET=1, CPU tensors): ``backends.cuda.attn_res_backward`` (FP64 statistics) and
  ``backends.npu.attn_res_backward`` (double-float FP32 statistics: no FP64 on Ascend) against the float64 truth
  with the accuracy contract, plus the structural properties: exact zeros at slots >= K, NaN capacity never read, every
  output slot written, output_mask, identical bits from run to run and across grids, strided inputs.
- CUDA (requires_cuda; runs on the H200): the same properties at training sizes, the registered op, and one
  compiled Triton kernel for every token count; the C++ kernel is built where a toolkit is, is the default for
  the shapes it runs, keeps the contract for each of its compiled variants, and hands unaligned or
  hidden-strided rows to the Triton kernel "auto" would otherwise pick.

Accuracy contract (the forward's, k3_ops.testing.assert_accuracy_contract): max-abs and mean-abs errors against
the float64 truth at most 1.25x those of the FP32 eager backward (reference.attn_res_backward_reference) rounded
to the same dtype. Interpreter quirk: its FP32 -> bf16 conversion truncates instead of rounding to nearest even,
so under the interpreter bf16 gradients are held against the eager FP32 result truncated the same way (an
error of up to one bf16 ulp instead of half of one, on both sides); on the GPU rounding is to nearest even and
the kernel is held against the eager result rounded to nearest even.
"""
from __future__ import annotations

import os

import pytest
import torch

from k3_ops import _C, reference
from k3_ops.backends import next_power_of_2
from k3_ops.testing import assert_accuracy_contract, error_stats

from conftest import Sample, bits_equal, grad_out_for, positional, requires_cuda, requires_interpreter, sample_params

BWD = torch.ops.kimi_k3.attn_res_backward.default
FULL = [True, True, True, True]


def policy_backward(policy: str, *args, **kw):
    """Run one launch policy's attn_res_backward (both accept CPU tensors under the interpreter). "cuda" is the
    CUDA policy's default; "cuda-rows", "cuda-stats-apply" and "cuda-tiles" force one of its kernels
    (``BackwardConfig(kernel=...)``; rows and stats_apply hold a whole row, H <= 8192, tiles is the fallback for
    wider rows). Under the interpreter stats_apply gets four column chunks per row (at least 16 columns each) and
    few programs, so that the small test shapes span several chunks and token ranges; on a GPU its defaults."""
    if policy.startswith("cuda"):
        from k3_ops.backends import cuda

        small = (dict(stats_programs_per_sm=3, apply_programs_per_sm=5,
                      apply_block=max(16, next_power_of_2(args[0].size(-1)) // 4))
                 if args[0].device.type == "cpu" else {})
        forced = {"cuda-rows": dict(kernel="rows"), "cuda-tiles": dict(kernel="tiles"),
                  "cuda-stats-apply": dict(kernel="stats_apply", **small),
                  "cuda-single-read": dict(kernel="single_read"),
                  "cuda-single-read-v1": dict(kernel="single_read", vectors_per_thread=1),
                  "cuda-single-read-v2": dict(kernel="single_read", vectors_per_thread=2),
                  "cuda-single-read-smem": dict(kernel="single_read", vectors_per_thread=0),
                  "cuda-single-read-ring": dict(kernel="single_read", vectors_per_thread=3)}
        if policy in forced:
            kw = dict(kw, config=cuda.BackwardConfig(**forced[policy]))
        return cuda.attn_res_backward(*args, **kw)
    from k3_ops.backends import npu

    # Three "vector cores": programs walk multi-token ranges even at small T.
    with npu.substitute(num_vector_cores=lambda device: 3):
        return npu.attn_res_backward(*args, **kw)


def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> bf16 by dropping the low 16 bits (round toward zero): what the interpreter's store does."""
    return (x.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def check_contract(sample: Sample, outs, gy, args, *, interpreted: bool):
    """The accuracy contract for the four outputs, slots < K only for grad_block_residual (>= K is tested for
    exact zeros separately); the samples' weights are FP32, so the weights' gradients carry the accumulation over
    tokens unrounded. Also the chain rule between the two weights' gradients: both are the folded weight's times
    the other weight, so grad_norm_weight * norm_weight and grad_proj_weight * proj_weight agree to FP32
    rounding. Returns {output name: (kernel errors, eager errors)}."""
    cpu = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in positional(args))
    gy = gy.cpu()
    eager = reference.attn_res_backward_reference(gy, *cpu, FULL)
    truth = reference.attn_res_backward_truth(gy, *cpu)
    if interpreted and sample.dtype == torch.bfloat16:
        up = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in cpu)
        eager_fp32 = reference.attn_res_backward_reference(gy.float(), *up, FULL)
        eager = (truncate_to_bf16(eager_fp32[0]), truncate_to_bf16(eager_fp32[1]), eager[2], eager[3])
    K = sample.K
    pairs = [("grad_prefix_sum", outs[0], eager[0], truth[0]),
             ("grad_block_residual", outs[1][:, :K], eager[1][:, :K], truth[1][:, :K]),
             ("grad_norm_weight", outs[2], eager[2], truth[2]), ("grad_proj_weight", outs[3], eager[3], truth[3])]
    report = {}
    for name, k_out, e_out, t_out in pairs:
        k_err, e_err = assert_accuracy_contract(k_out.cpu(), e_out, t_out, what=f"{sample.id} {name}")
        report[name] = (k_err, e_err)
    nw, pw = cpu[2].reshape(-1), cpu[3].reshape(-1)
    via_norm, via_proj = outs[2].cpu().reshape(-1) * nw, outs[3].cpu().reshape(-1) * pw
    assert torch.allclose(via_norm, via_proj, rtol=2**-21, atol=0), f"{sample.id}: weight gradients' chain rule"
    return report


class _nan_fill:
    """torch.empty returns NaN-filled memory inside this block (deterministic mode's uninitialised fill)."""

    def __enter__(self):
        self.saved = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        return self

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.saved[0])
        torch.utils.deterministic.fill_uninitialized_memory = self.saved[1]
        return False


# --------------------------------------------------------------------------------------------------------------
# Interpreter: both launch policies.
# --------------------------------------------------------------------------------------------------------------
CASES = [
    Sample(T=7, K=4, cap=8, H=7168, dtype=torch.bfloat16),  # the Kimi K3 hidden size, partial capacity
    Sample(T=40, K=8, cap=8, H=96, dtype=torch.bfloat16),  # full capacity, multi-token programs (small H: speed)
    Sample(T=5, K=1, cap=6, H=33, dtype=torch.float16),  # K = 1, odd H, zeros over several K_PAD-row chunks
    Sample(T=6, K=3, cap=5, H=96, dtype=torch.bfloat16, layout="blockmajor"),  # block-major view
    Sample(T=7, K=3, cap=8, H=64, dtype=torch.float32, proj_2d=False),  # fp32, proj [H]
    Sample(T=4, K=11, cap=12, H=40, dtype=torch.float32),  # K_PAD = 16
    Sample(T=3, K=0, cap=2, H=48, dtype=torch.bfloat16),  # K = 0: exact copy, no launch
]
POLICIES = ["cuda", "cuda-rows", "cuda-stats-apply", "cuda-tiles", "npu"]


def test_cuda_backward_plan_resolution():
    """Which kernel and knobs the CUDA policy picks (no launch, any machine): by default the stats/apply split
    from SPLIT_BACKWARD_MIN_ROWS token-candidate rows on (its grids about SMs x programs-per-SM programs over
    1024-column chunks) and the rows kernel below, both up to ROWS_BACKWARD_MAX_H; the tiles kernel beyond that
    width or when asked; each with its own measured defaults unless the config overrides them; the reduction's
    warps are its own; the register cap is a GPU compile option only."""
    from k3_ops.backends import cuda

    cpu, gpu_like = torch.device("cpu"), torch.device("cuda", 0)
    n = cuda.SPLIT_BACKWARD_MIN_ROWS
    assert n % 16 == 0
    assert cuda.choose_backward_plan(n // 16, 15, 7168, cpu).kernel == "stats_apply"  # exactly n rows
    assert cuda.choose_backward_plan(n // 16 - 1, 15, 7168, cpu).kernel == "rows"
    # The smallest measured shape (1-warp split, 318af1a): the split 1.26x faster than rows; the larger
    # shapes 1.28-1.57x. Below the threshold (unmeasured) the rows kernel's single launch.
    assert cuda.choose_backward_plan(4096, 1, 7168, cpu).kernel == "stats_apply"
    assert cuda.choose_backward_plan(16384, 8, 7168, cpu).kernel == "stats_apply"
    assert cuda.choose_backward_plan(2048, 1, 7168, cpu).kernel == "rows"
    split = cuda.choose_backward_plan(4096, 8, 7168, cpu)
    cfg, sms = cuda.BackwardConfig(), cuda.num_sms(cpu)
    assert (split.kernel, split.block_h, split.k_pad, split.apply_block) == ("stats_apply", 8192, 16, 1024)
    assert (dict(split.launch_options)["num_warps"], split.num_stages) == cuda.BACKWARD_KERNEL_DEFAULTS["stats_apply"]
    assert split.num_programs == -(-sms * cfg.stats_programs_per_sm // 7)  # 7 chunks of 1024 columns
    assert split.apply_programs == -(-sms * cfg.apply_programs_per_sm // 7)
    assert split.scalars_programs == min(4096, sms * cuda.SCALARS_PROGRAMS_PER_SM)  # its own grid
    assert dict(split.apply_options)["num_warps"] == cfg.apply_warps and split.apply_num_stages == cfg.apply_stages
    assert dict(split.reduce_options)["num_warps"] == cuda.REDUCE_NUM_WARPS
    forced = cuda.BackwardConfig(kernel="stats_apply")
    assert cuda.choose_backward_plan(3, 8, 7168, cpu, forced).num_programs == 3, "never more token ranges than tokens"
    # The C++ kernel never runs under the interpreter: asking for it gets the Triton choice of "auto".
    assert not cuda.single_read_supported(8, 7168, cpu)
    single_read = cuda.BackwardConfig(kernel="single_read")
    assert cuda.choose_backward_plan(4096, 8, 7168, cpu, single_read).kernel == "stats_apply"
    assert cuda.choose_backward_plan(64, 8, 7168, cpu, single_read).kernel == "rows"
    rows = cuda.choose_backward_plan(4096, 8, 7168, cpu, cuda.BackwardConfig(kernel="rows"))
    assert (rows.kernel, rows.block_h, rows.k_pad, rows.num_programs) == ("rows", 8192, 16, sms)
    assert (dict(rows.launch_options)["num_warps"], rows.num_stages) == cuda.BACKWARD_KERNEL_DEFAULTS["rows"]
    wide = cuda.choose_backward_plan(4096, 8, cuda.ROWS_BACKWARD_MAX_H + 1, cpu)
    assert wide.kernel == "tiles" and wide.block_h * wide.k_pad == cuda.BackwardConfig().tile_elems
    assert (dict(wide.launch_options)["num_warps"], wide.num_stages) == cuda.BACKWARD_KERNEL_DEFAULTS["tiles"]
    forced = cuda.choose_backward_plan(4096, 1, 7168, cpu, cuda.BackwardConfig(kernel="tiles", num_stages=1,
                                                                                   num_warps=4, maxnreg=128))
    assert forced.kernel == "tiles" and forced.num_stages == 1
    assert dict(forced.launch_options) == {"num_warps": 4}, "maxnreg must not reach the interpreter"
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":  # a compiling GPU
        capped = cuda.choose_backward_plan(4096, 1, 7168, gpu_like, cuda.BackwardConfig(kernel="tiles", maxnreg=128))
        assert dict(capped.launch_options)["maxnreg"] == 128


@pytest.mark.parametrize("fits, K, want", [
    ({0, 2, 3}, 8, 3), ({0, 2, 3}, 1, 3),  # the ring wherever it runs
    ({0, 2}, 8, 0), ({0, 2}, 5, 0), ({0, 2}, 4, 2), ({0, 2}, 1, 2),  # no ring (H > 7168): by K
    ({2}, 8, 2), ({0}, 1, 0),  # the preferred layout does not fit: the other one
    (set(), 8, None),  # none: the Triton kernels
], ids=["k8-ring", "k1-ring", "k8", "k5", "k4", "k1", "k8-no-smem-fit", "k1-no-reg-fit", "neither"])
def test_single_read_layout_policy(fits: set, K: int, want):
    """"auto" with vectors_per_thread None: the ring layout where it runs, else the shared-memory layout from
    SINGLE_READ_SMEM_MIN_K on and the register layout below, each falling back to the other where only that one
    fits; an explicit layout is never swapped.
    (The plan step on a described GPU whose shared memory holds exactly the layouts in ``fits``; the real check is
    test_cuda_single_read_kernel_is_built.)"""
    from k3_ops.backends import cuda_plan

    assert cuda_plan.SINGLE_READ_SMEM_MIN_K == 5, "the cases below straddle the measured threshold"
    gpu = cuda_plan.DeviceFacts(interpreted=False, num_sms=132, capability=(9, 0), smem_optin=1000,
                                single_read_smem=lambda K, H, size, vpt: 100 if vpt in fits else 2000)
    plan = cuda_plan.backward_plan(4096, K, 7168, gpu)
    assert (plan.kernel, plan.vectors_per_thread) == (("single_read", want) if want is not None else ("stats_apply", 0))
    for vpt in (0, 1, 2, 3):
        plan = cuda_plan.backward_plan(4096, K, 7168, gpu,
                                       cuda_plan.BackwardConfig(kernel="single_read", vectors_per_thread=vpt))
        assert plan.kernel == ("single_read" if vpt in fits else "stats_apply"), vpt
        assert plan.kernel != "single_read" or plan.vectors_per_thread == vpt


@pytest.mark.parametrize("knobs, field", [(dict(kernel="fast"), "kernel"), (dict(num_warps=3), "num_warps"),
                                          (dict(num_stages=0), "num_stages"), (dict(maxnreg=300), "maxnreg"),
                                          (dict(tile_elems=100), "tile_elems"), (dict(programs_per_sm=0),
                                                                                 "programs_per_sm"),
                                          (dict(apply_block=1000), "apply_block"), (dict(apply_warps=3), "apply_warps"),
                                          (dict(apply_stages=0), "apply_stages"),
                                          (dict(apply_programs_per_sm=0), "apply_programs_per_sm"),
                                          (dict(stats_programs_per_sm=0), "stats_programs_per_sm"),
                                          (dict(vectors_per_thread=4), "vectors_per_thread")],
                         ids=lambda v: v if isinstance(v, str) else None)
def test_backward_config_rejects_bad_knobs(knobs, field):
    from k3_ops.backends import cuda

    value = next(iter(knobs.values()))
    with pytest.raises(ValueError, match=rf"BackwardConfig\.{field} .*got {value!r}"):
        cuda.BackwardConfig(**knobs)


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("sample", sample_params(CASES))
def test_interpreter_accuracy_contract_and_zero_capacity(sample: Sample, policy: str):
    args = sample.make("cpu")  # slots >= K hold NaN
    gy = grad_out_for(sample, "cpu")
    # Deterministic mode fills every torch.empty with NaN: an output slot the kernel does not write stays NaN.
    with _nan_fill():
        outs = policy_backward(policy, gy, *positional(args), FULL)
    gp, gb, gn, gj = outs
    assert gp.shape == (sample.T, sample.H) and gp.dtype == sample.dtype and gp.is_contiguous()
    assert gb.shape == (sample.T, sample.cap, sample.H) and gb.dtype == sample.dtype and gb.is_contiguous()
    for g, weight in ((gn, args["norm_weight"]), (gj, args["proj_weight"])):
        assert g.shape == weight.shape and g.dtype == weight.dtype and g.is_contiguous()
    assert bool((gb[:, sample.K:] == 0).all()), "slots >= K must get exact zeros"
    assert not any(bool(o.isnan().any()) for o in outs), "NaN: a slot was left unwritten or NaN capacity was read"
    check_contract(sample, outs, gy, args, interpreted=True)
    if sample.K == 0:
        assert bits_equal(gp, gy) and bool((gn == 0).all()) and bool((gj == 0).all())


MASKS = [[True, False, False, False], [False, True, False, False], [False, False, True, False],
         [False, False, False, True], [False, False, True, True], [True, True, False, False],
         [False, False, False, False]]


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "".join("1" if x else "0" for x in m))
def test_interpreter_output_mask(mask, policy: str):
    sample = Sample(T=5, K=3, cap=6, H=40, dtype=torch.bfloat16)
    args = sample.make("cpu")
    gy = grad_out_for(sample, "cpu")
    full = policy_backward(policy, gy, *positional(args), FULL)
    with _nan_fill():
        part = policy_backward(policy, gy, *positional(args), mask)
    for i, (p, f) in enumerate(zip(part, full)):
        if mask[i]:
            assert bits_equal(p, f), f"output {i} differs between the masked and the full call"
        else:
            assert p.shape == (0,) and p.dtype == f.dtype, f"output {i} not asked for must be an empty 1-D tensor"


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("policy", POLICIES)
def test_interpreter_deterministic_bits(policy: str):
    sample = Sample(T=17, K=5, cap=8, H=72, dtype=torch.float32)
    args = sample.make("cpu")
    gy = grad_out_for(sample, "cpu")
    first = policy_backward(policy, gy, *positional(args), FULL)
    second = policy_backward(policy, gy, *positional(args), FULL)
    for a, b in zip(first, second):
        assert bits_equal(a, b)


@requires_interpreter
@pytest.mark.interpreter
def test_interpreter_grid_changes_only_the_weight_gradient_order():
    # Per-token gradients do not depend on how tokens are spread over programs (bit for bit); the weights'
    # gradients only change their summation order (close, not necessarily equal).
    from k3_ops.backends import _backward, next_power_of_2

    sample = Sample(T=10, K=3, cap=4, H=48, dtype=torch.bfloat16)
    args = sample.make("cpu")
    gy = grad_out_for(sample, "cpu")
    k_pad = next_power_of_2(sample.K + 1)
    results = []
    for programs in (1, 3, 10):
        plan = _backward.BackwardPlan(num_programs=programs, block_h=32, k_pad=k_pad, acc64=True)
        results.append(_backward.run_attn_res_backward(gy, *positional(args), FULL, plan))
    for other in results[1:]:
        assert bits_equal(other[0], results[0][0]) and bits_equal(other[1], results[0][1])
        for i in (2, 3):
            torch.testing.assert_close(other[i], results[0][i], rtol=1e-6, atol=1e-6)


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("policy", POLICIES)
def test_interpreter_strided_inputs(policy: str):
    # grad_out as autograd hands it over for out.sum() (expanded, stride 0) and prefix_sum / block_residual with
    # a non-unit hidden stride: same bits as contiguous copies of the same values.
    sample = Sample(T=6, K=2, cap=4, H=24, dtype=torch.float16)
    args = sample.make("cpu")
    gy = torch.ones((), dtype=sample.dtype).expand(sample.T, sample.H)
    wide_p = torch.full((sample.T, 2 * sample.H), float("nan"), dtype=sample.dtype)
    wide_p[:, ::2] = args["prefix_sum"]
    wide_b = torch.full((sample.T, sample.cap, 2 * sample.H), float("nan"), dtype=sample.dtype)
    wide_b[:, :, ::2] = args["block_residual"]
    strided = {**args, "prefix_sum": wide_p[:, ::2], "block_residual": wide_b[:, :, ::2]}
    assert strided["prefix_sum"].stride(1) == 2 and strided["block_residual"].stride(2) == 2
    got = policy_backward(policy, gy, *positional(strided), FULL)
    want = policy_backward(policy, gy.contiguous(), *positional(args), FULL)
    for a, b in zip(got, want):
        assert bits_equal(a, b)


@requires_interpreter
@pytest.mark.interpreter
def test_npu_prefix_row_sum_is_bit_exact():
    # The NPU plan takes grad_prefix's row out of the dv tile by a masked sum of its bit patterns instead of a store
    # through a zero-stride pointer tile (which triton-ascend cannot lower): the same bits, signed zeros included
    # (a float sum would start from +0.0 and lose them). Columns where w and the prefix are zero and grad_out is
    # -0.0 give dv = -0.0 wherever gs_K < 0.
    from dataclasses import replace

    from k3_ops.backends import _backward, npu

    sample = Sample(T=7, K=3, cap=5, H=40, dtype=torch.float32)
    args = sample.make("cpu")
    args["norm_weight"][:4] = 0.0
    args["prefix_sum"][:, :4] = 0.0
    gy = grad_out_for(sample, "cpu")
    gy[:, :4] = -0.0
    with npu.substitute(num_vector_cores=lambda device: 3):
        plan = npu.backward_plan(args["prefix_sum"], sample.K)
        assert plan.prefix_row_sum and plan.df and plan.kernel == "tiles"
        summed = npu.attn_res_backward(gy, *positional(args), FULL)
        tiled = _backward.run_attn_res_backward(gy, *positional(args), FULL, replace(plan, prefix_row_sum=False))
    for a, b in zip(summed, tiled):
        assert bits_equal(a, b)
    gp = summed[0]
    assert bool(((gp == 0) & gp.signbit()).any()), "no -0.0 in grad_prefix: the signed-zero case went untested"


# --------------------------------------------------------------------------------------------------------------
# CUDA (the H200): the compiled kernels at training sizes, through the registered op.
# --------------------------------------------------------------------------------------------------------------
CUDA_CASES = [
    Sample(T=4096, K=8, cap=8, H=7168, dtype=torch.bfloat16),  # Kimi K3 training shape, full capacity
    Sample(T=16384, K=4, cap=8, H=2048, dtype=torch.bfloat16),  # long sequence, partial capacity
    Sample(T=2048, K=8, cap=8, H=7168, dtype=torch.float32, proj_2d=False),
    Sample(T=1024, K=3, cap=5, H=7168, dtype=torch.float16, layout="blockmajor"),
    Sample(T=7, K=4, cap=8, H=7168, dtype=torch.bfloat16),  # few tokens: fewer programs than SMs
    Sample(T=33, K=20, cap=24, H=4096, dtype=torch.bfloat16),  # K_PAD = 32
]


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("sample", sample_params(CUDA_CASES))
def test_cuda_accuracy_contract_and_zero_capacity(sample: Sample):
    args = sample.make("cuda")
    gy = grad_out_for(sample, "cuda")
    with _nan_fill():
        outs = BWD(gy, *positional(args), FULL)
    gp, gb, gn, gj = outs
    assert all(o.device.type == "cuda" for o in outs)
    assert bool((gb[:, sample.K:] == 0).all()), "slots >= K must get exact zeros"
    assert not any(bool(o.isnan().any()) for o in outs), "NaN: a slot was left unwritten or NaN capacity was read"
    # Eager on the same GPU (what the kernel replaces); truth in float64 from the same inputs.
    eager = reference.attn_res_backward_reference(gy, *positional(args), FULL)
    truth = reference.attn_res_backward_truth(gy, *positional(args))
    K = sample.K
    for name, k_out, e_out, t_out in (("grad_prefix_sum", gp, eager[0], truth[0]),
                                      ("grad_block_residual", gb[:, :K], eager[1][:, :K], truth[1][:, :K]),
                                      ("grad_norm_weight", gn, eager[2], truth[2]),
                                      ("grad_proj_weight", gj, eager[3], truth[3])):
        k_err, e_err = assert_accuracy_contract(k_out, e_out, t_out, what=f"{sample.id} {name}")
        print(f"{sample.id} {name}: kernel/eager max_abs {k_err.max_abs / max(e_err.max_abs, 1e-30):.3f} "
              f"mean_abs {k_err.mean_abs / max(e_err.mean_abs, 1e-30):.3f}")


def check_gpu_policy(policy: str, sample: Sample, gy: torch.Tensor, args: dict) -> None:
    """One CUDA policy's backward on the GPU (outputs pre-filled with NaN): exact zeros past K, no NaN (nothing
    unwritten, no NaN capacity read), the accuracy contract, identical bits on a second run."""
    with _nan_fill():
        outs = policy_backward(policy, gy, *positional(args), FULL)
    assert bool((outs[1][:, sample.K:] == 0).all()), "slots >= K must get exact zeros"
    assert not any(bool(o.isnan().any()) for o in outs)
    check_contract(sample, outs, gy, args, interpreted=False)
    again = policy_backward(policy, gy, *positional(args), FULL)
    assert all(bits_equal(a, b) for a, b in zip(outs, again)), f"{policy} must be deterministic"


def triton_auto_kernel(T: int, K: int) -> str:
    """The kernel "auto" picks where the single-read CUDA C++ kernel does not run."""
    from k3_ops.backends import cuda

    return "stats_apply" if T * (K + 1) >= cuda.SPLIT_BACKWARD_MIN_ROWS else "rows"


@requires_cuda
@pytest.mark.cuda
def test_cuda_single_read_kernel_is_built():
    """Where a CUDA toolkit is present, the build must carry the C++ kernels (else the default backward silently
    loses its fastest kernel); and "auto" picks it for the shapes it runs."""
    from torch.utils.cpp_extension import CUDA_HOME

    from k3_ops import _C
    from k3_ops.backends import cuda

    if CUDA_HOME is None or os.environ.get("K3_OPS_NO_CUDA") == "1":
        pytest.skip("no CUDA toolkit (or K3_OPS_NO_CUDA=1): k3_ops was built without csrc_cuda/")
    assert _C.has_cuda_kernels, "k3_ops._C was built without the CUDA C++ kernels: rebuild with the toolkit"
    dev = torch.device("cuda")
    for K in (1, 4, 5, 8):  # K3's rows: the ring layout at every K (it fits the H100's and H200's opt-in)
        plan = cuda.choose_backward_plan(4096, K, 7168, dev)
        assert (plan.kernel, plan.vectors_per_thread) == ("single_read", cuda.RING_LAYOUT), (K, plan)
    for K in (1, 8):  # wider than the ring's 896 threads: the layout measured fastest for each K
        plan = cuda.choose_backward_plan(4096, K, 8000, dev)
        vpt = 0 if K >= cuda.SINGLE_READ_SMEM_MIN_K else 2
        assert (plan.kernel, plan.vectors_per_thread) == ("single_read", vpt), (K, plan)
    assert cuda.choose_backward_plan(4096, 9, 7168, dev).kernel == "stats_apply", "K <= 8 only"
    assert cuda.choose_backward_plan(4096, 8, 7168, dev, element_size=4).kernel == "stats_apply", "16-bit only"
    assert cuda.choose_backward_plan(4096, 8, 7164, dev).kernel == "stats_apply", "H % 8 == 0 only"
    assert cuda.choose_backward_plan(4096, 8, 8200, dev).kernel == "tiles"
    # H = 8192, K = 8 needs 237056 bytes (register layout) or 237216 (shared-memory layout): more than the H200's
    # opt-in of 232448, so neither layout runs and the Triton split takes it.
    if cuda.device_facts(dev).smem_optin < 237056:
        assert cuda.choose_backward_plan(4096, 8, 8192, dev).kernel == "stats_apply", "H = 8192, K = 8: no fit"


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["cuda-single-read-v2", "cuda-single-read-v1", "cuda-single-read-smem",
                                    "cuda-single-read-ring"])
@pytest.mark.parametrize("sample", sample_params([
    Sample(T=300, K=1, cap=8, H=7168, dtype=torch.bfloat16),  # K = 1 at full capacity: 7 zero slots per token
    Sample(T=500, K=2, cap=3, H=1000, dtype=torch.float16),  # 125 vectors: a half-used thread pair, rows variant 6
    Sample(T=129, K=6, cap=7, H=4096, dtype=torch.bfloat16, layout="blockmajor"),
    Sample(T=3, K=8, cap=8, H=7168, dtype=torch.bfloat16),  # fewer tokens than SMs
    Sample(T=1000, K=7, cap=8, H=7168, dtype=torch.bfloat16, proj_2d=False),
    Sample(T=700, K=7, cap=8, H=8192, dtype=torch.float16),  # 1024 threads, the largest shared memory that fits
]))
def test_cuda_single_read_contract(sample: Sample, policy: str):
    """The CUDA C++ kernel (every layout: registers with 2 and 1 vectors per thread, shared memory, the ring) on
    shapes beyond CUDA_CASES: each rows variant (K + 2 <= 3, 6, 10), a row width that leaves part of the last thread
    idle, block-major views, few tokens (a ring that never fills), ring sizes that are no multiple of K + 2; zeros
    past K, no NaN read from the NaN-poisoned capacity, the accuracy contract (the ring's in-kernel weight-gradient
    reduction included), identical bits run to run. H = 8192 is past the ring's 896 threads: the plan falls back."""
    from k3_ops.backends import cuda

    args = sample.make("cuda")
    gy = grad_out_for(sample, "cuda")
    vpt = {"cuda-single-read-v2": 2, "cuda-single-read-v1": 1, "cuda-single-read-smem": 0,
           "cuda-single-read-ring": cuda.RING_LAYOUT}[policy]
    forced = cuda.BackwardConfig(kernel="single_read", vectors_per_thread=vpt)
    runs = vpt != cuda.RING_LAYOUT or sample.H <= 7168  # the ring's 896 threads hold H <= 7168
    assert (cuda.choose_backward_plan(sample.T, sample.K, sample.H, gy.device, forced).kernel == "single_read") == runs
    check_gpu_policy(policy, sample, gy, args)


@requires_cuda
@pytest.mark.cuda
def test_cuda_single_read_falls_back_on_unaligned_rows():
    """Rows that do not start on 16-byte boundaries (an odd element offset) or a strided hidden dimension take the
    Triton kernel "auto" would pick without the C++ one: bit for bit that kernel's result."""
    from k3_ops.backends import cuda

    sample = Sample(T=1024, K=8, cap=8, H=7168, dtype=torch.bfloat16)
    args = sample.make("cuda")
    gy = grad_out_for(sample, "cuda")
    wide = torch.empty((sample.T, sample.H + 1), dtype=sample.dtype, device="cuda")
    wide[:, 1:] = args["prefix_sum"]
    odd = {**args, "prefix_sum": wide[:, 1:]}
    assert odd["prefix_sum"].data_ptr() % 16 != 0
    triton_kernel = cuda.BackwardConfig(kernel=triton_auto_kernel(sample.T, sample.K))
    want = cuda.attn_res_backward(gy, *positional(args), FULL, config=triton_kernel)
    got = cuda.attn_res_backward(gy, *positional(odd), FULL)
    assert all(bits_equal(a, b) for a, b in zip(got, want))
    wide_h = torch.empty((sample.T, 2 * sample.H), dtype=sample.dtype, device="cuda")
    wide_h[:, ::2] = args["prefix_sum"]
    got = cuda.attn_res_backward(gy, *positional({**args, "prefix_sum": wide_h[:, ::2]}), FULL)
    assert all(bits_equal(a, b) for a, b in zip(got, want))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["cuda-rows", "cuda-stats-apply", "cuda-tiles", "cuda-single-read"])
@pytest.mark.parametrize("sample", sample_params(CUDA_CASES))
def test_cuda_each_kernel_contract(sample: Sample, policy: str):
    """Every CUDA backward kernel forced on the GPU (the default is one of them; tiles is the fallback for
    H > 8192, forced here at H <= 8192): the same contract, zeros past K, no NaN, identical bits run to run;
    and which kernel the policy resolves to."""
    from k3_ops.backends import cuda

    args = sample.make("cuda")
    gy = grad_out_for(sample, "cuda")
    check_gpu_policy(policy, sample, gy, args)
    cuda_dev = torch.device("cuda")
    kernel = policy.removeprefix("cuda-").replace("-", "_")
    forced = cuda.BackwardConfig(kernel=kernel)
    size = sample.dtype.itemsize
    single_read = cuda.single_read_supported(sample.K, sample.H, cuda_dev, size)
    assert single_read == (size == 2 and sample.K <= 8 and bool(_C.has_cuda_kernels)), sample.id
    expect = kernel if kernel != "single_read" or single_read else triton_auto_kernel(sample.T, sample.K)
    assert cuda.choose_backward_plan(sample.T, sample.K, sample.H, cuda_dev, forced, size).kernel == expect
    assert cuda.choose_backward_plan(sample.T, sample.K, 8193, cuda_dev, forced, size).kernel == "tiles"
    auto = "single_read" if single_read else triton_auto_kernel(sample.T, sample.K)
    assert cuda.choose_backward_plan(sample.T, sample.K, sample.H, cuda_dev, element_size=size).kernel == auto


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("sample", sample_params([
    Sample(T=4096, K=8, cap=8, H=7168, dtype=torch.bfloat16),  # no slot past K
    Sample(T=4096, K=1, cap=8, H=7168, dtype=torch.bfloat16),  # 7 zero slots per token
    Sample(T=300, K=3, cap=5, H=7168, dtype=torch.bfloat16),  # a short last program
]))
def test_cuda_deterministic_bits(sample: Sample):
    # The ring kernel stores each program's last token after its arrival at the split grid barrier, while other
    # programs may already sum the weight gradient: no gradient may change a bit from run to run.
    args = sample.make("cuda")
    gy = grad_out_for(sample, "cuda")
    first = BWD(gy, *positional(args), FULL)
    for _ in range(2):
        again = BWD(gy, *positional(args), FULL)
        for a, b in zip(first, again):
            assert bits_equal(a, b)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "".join("1" if x else "0" for x in m))
def test_cuda_output_mask(mask):
    sample = Sample(T=300, K=5, cap=8, H=1024, dtype=torch.bfloat16, layout="blockmajor")
    args = sample.make("cuda")
    gy = grad_out_for(sample, "cuda")
    full = BWD(gy, *positional(args), FULL)
    part = BWD(gy, *positional(args), mask)
    for i, (p, f) in enumerate(zip(part, full)):
        assert bits_equal(p, f) if mask[i] else p.shape == (0,), i


@requires_cuda
@pytest.mark.cuda
def test_cuda_token_counts_share_one_compiled_kernel():
    # T, K, C and strides are runtime arguments: T in {1, 7, 16, 17, 512} (fixed K, H, dtype, layout) compiles
    # the gradient kernel and the reduction once each.
    from k3_ops.kernels import attn_res_bwd

    kernels = {name: getattr(attn_res_bwd, name) for name in dir(attn_res_bwd) if name.endswith("_kernel")}

    def compiled() -> dict[str, int]:
        return {n: sum(len(entry[0]) for entry in k.device_caches.values()) for n, k in kernels.items()}

    from k3_ops.backends import cuda

    before = compiled()
    for T in (1, 7, 16, 17, 512):
        sample = Sample(T=T, K=6, cap=8, H=7168, dtype=torch.bfloat16)
        args = sample.make("cuda")
        for kernel in ("rows", "stats_apply"):  # the Triton kernels (the default here is the C++ one)
            cuda.attn_res_backward(grad_out_for(sample, "cuda"), *positional(args), FULL,
                                   config=cuda.BackwardConfig(kernel=kernel))
    after = compiled()
    assert all(after[n] - before[n] <= 1 for n in kernels), (before, after)
    assert sum(after.values()) >= 4, "the gradient kernels and the reduction must have compiled"


@requires_cuda
@pytest.mark.cuda
def test_cuda_cpu_and_gpu_agree():
    sample = Sample(T=64, K=4, cap=6, H=7168, dtype=torch.bfloat16)
    gy = grad_out_for(sample, "cpu")
    cpu = BWD(gy, *positional(sample.make("cpu")), FULL)
    gpu = BWD(gy.cuda(), *positional(sample.make("cuda")), FULL)
    for c, g in zip(cpu, gpu):
        # Both are within the contract of the truth; here only a gross-disagreement check (one bf16 ulp, FP32
        # weights to 1e-5 of their scale).
        stats = error_stats(g.cpu(), c)
        scale = float(c.abs().max())
        assert stats.max_abs <= (2**-7 if c.dtype == torch.bfloat16 else 1e-5) * max(1.0, scale), stats


# --------------------------------------------------------------------------------------------------------------
# Simulated Ascend NPU (tests/test_npu_simulated.py's fixture): the registered op and autograd on PrivateUse1.
# --------------------------------------------------------------------------------------------------------------
from test_npu_simulated import simulated_npu  # noqa: E402,F401  (module-scoped PrivateUse1 "npu" device)

NPU_CASES = [
    Sample(T=7, K=4, cap=8, H=7168, dtype=torch.bfloat16),
    Sample(T=9, K=3, cap=5, H=96, dtype=torch.float16, layout="blockmajor"),
    Sample(T=6, K=2, cap=3, H=33, dtype=torch.float32, proj_2d=False),
    Sample(T=3, K=0, cap=2, H=48, dtype=torch.bfloat16),
]


def _spy_backward_launch(monkeypatch) -> list:
    from k3_ops.backends import _backward

    calls = []
    real = _backward.run_attn_res_backward

    def spy(*args, **kwargs):
        calls.append(kwargs.get("plan", args[8] if len(args) > 8 else None))
        return real(*args, **kwargs)

    monkeypatch.setattr(_backward, "run_attn_res_backward", spy)
    return calls


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("sample", sample_params(NPU_CASES))
def test_simulated_npu_backward_op(simulated_npu, sample: Sample, monkeypatch):  # noqa: F811  (the fixture)
    # torch.ops.kimi_k3.attn_res_backward on PrivateUse1 tensors: dispatcher -> PrivateUse1 kernel -> NPU launch
    # policy (through the seam) -> Triton under the interpreter; outputs on the device, contract against the truth.
    calls = _spy_backward_launch(monkeypatch)
    cpu_args = sample.make()
    args = sample.make(device=simulated_npu.device)
    gy_cpu = grad_out_for(sample, "cpu")
    outs = BWD(gy_cpu.to(simulated_npu.device), *positional(args), FULL)
    assert all(o.device.type == "npu" for o in outs)
    outs = tuple(o.cpu() for o in outs)
    if sample.K == 0:
        assert calls == [] and bits_equal(outs[0], gy_cpu)  # exact copy, no launch
        return
    assert len(calls) == 1 and calls[0].df and not calls[0].acc64  # the NPU policy's double-float plan
    assert bool((outs[1][:, sample.K:] == 0).all()) and not any(bool(o.isnan().any()) for o in outs)
    check_contract(sample, outs, gy_cpu, cpu_args, interpreted=True)


_CHILD_ENV = "K3_OPS_SIMULATED_NPU_AUTOGRAD_CHILD"


@requires_interpreter
@pytest.mark.interpreter
def test_simulated_npu_autograd():
    """Autograd through the simulated NPU, in a fresh interpreter: the autograd engine sizes its per-device
    queues once, at the first backward of a process, so a PrivateUse1 device registered after any earlier
    backward (any other test in the suite) has none and the engine asserts. The child runs only the test below."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    node = f"{Path(__file__).name}::test_simulated_npu_autograd_child"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
                            cwd=Path(__file__).parent, env={**os.environ, _CHILD_ENV: "1"}, capture_output=True,
                            text=True, timeout=900)
    tail = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0 and "1 passed" in result.stdout, tail


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.skipif("os.environ.get('K3_OPS_SIMULATED_NPU_AUTOGRAD_CHILD') != '1'",
                    reason="runs inside test_simulated_npu_autograd's fresh interpreter only (see there)")
def test_simulated_npu_autograd_child(simulated_npu, monkeypatch):  # noqa: F811  (the fixture)
    # Gradients on the "npu" device: the registered autograd formula runs the NPU backward kernel and the
    # gradients land on the device, with every input's shape and dtype.
    # Simulation limit: a view recorded by autograd / ADInplaceOrView of a wrapper tensor (.detach(), or the
    # launch's reshape of a grad-requiring weight) comes back as a plain tensor without the backing storage, so
    # only prefix_sum and block_residual require grad here, set in place; the weight gradients are covered on CPU,
    # under the interpreter and on CUDA.
    calls = _spy_backward_launch(monkeypatch)
    sample = Sample(T=5, K=3, cap=4, H=40, dtype=torch.bfloat16, layout="blockmajor")
    names = ("prefix_sum", "block_residual")
    args = sample.make(device=simulated_npu.device)
    cpu_args = sample.make()
    for a in (args, cpu_args):
        for name in names:
            a[name].requires_grad_(True)  # no .detach(): it too would be a recorded view on the wrapper
    out = torch.ops.kimi_k3.attn_res.default(*positional(args))
    gy_cpu = grad_out_for(sample, "cpu")
    # torch.autograd.grad, not .backward(): accumulating into .grad detaches, which the simulation cannot follow.
    grads = torch.autograd.grad(out, [args[n] for n in names], gy_cpu.to(simulated_npu.device))
    assert len(calls) == 1
    refs = torch.autograd.grad(torch.ops.kimi_k3.attn_res.default(*positional(cpu_args)), [cpu_args[n] for n in names],
                               gy_cpu)
    for name, g, ref in zip(names, grads, refs):
        assert g is not None and g.device.type == "npu" and g.shape == ref.shape and g.dtype == ref.dtype, name
        # Same math, FP32 vs double-float statistics, bf16 rounding (truncating in the interpreter): one bf16 ulp.
        tol = 2**-7 if g.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(g.cpu().float(), ref.float(), rtol=tol, atol=tol * float(ref.abs().max()))
