"""Autograd of kimi_k3::attn_res: gradcheck, the backward op's contract (opcheck, Meta, output_mask),
what autograd saves, needs_input_grad, double backward, and torch.compile of forward + backward.

These run on every device the machine has (the ``device`` fixture: CPU here, CUDA on the H200). The Triton
backward kernels themselves are tested in tests/test_backward_kernels.py.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing._internal.optests import opcheck
from torch.utils._python_dispatch import TorchDispatchMode

import k3_ops
from k3_ops import reference
from k3_ops.testing import assert_close

from conftest import SAMPLES, Sample, bits_equal, grad_out_for, positional, requires_cuda, sample_params

FWD = torch.ops.kimi_k3.attn_res.default
BWD = torch.ops.kimi_k3.attn_res_backward.default
NAMES = ("prefix_sum", "block_residual", "norm_weight", "proj_weight")


def f64_leaves(sample: Sample) -> dict:
    """All four tensor inputs as float64 leaves that require grad (the weights too: gradcheck needs fp64)."""
    args = sample.make("cpu")
    for name in NAMES:
        t = args[name].detach()
        if t.dtype != torch.float64:
            t = t.to(torch.float64)
        args[name] = t.requires_grad_(True)
    return args


# --------------------------------------------------------------------------------------------------------------
# gradcheck (float64, CPU): every input, partial capacity, block-major view, proj [1, H] and [H], K = 0 and 1.
# --------------------------------------------------------------------------------------------------------------
GRADCHECK_SAMPLES = [
    Sample(T=3, K=2, cap=4, H=8, dtype=torch.float64),  # partial capacity (NaN in slots 2, 3), proj [1, H]
    Sample(T=3, K=3, cap=3, H=6, dtype=torch.float64, proj_2d=False),  # full capacity, proj [H]
    Sample(T=4, K=2, cap=5, H=6, dtype=torch.float64, layout="blockmajor"),  # block-major view
    Sample(T=2, K=1, cap=3, H=5, dtype=torch.float64, proj_2d=False),  # one block
    Sample(T=2, K=0, cap=2, H=5, dtype=torch.float64),  # K = 0: identity in prefix_sum, no weight gradient
]


@pytest.mark.parametrize("sample", sample_params(GRADCHECK_SAMPLES))
def test_gradcheck_float64(sample: Sample):
    args = f64_leaves(sample)
    if sample.layout == "blockmajor":
        assert not args["block_residual"].is_contiguous()  # the view itself is the leaf: no copy anywhere
    K, eps = sample.K, sample.eps

    def fn(prefix_sum, block_residual, norm_weight, proj_weight):
        return k3_ops.attn_res(prefix_sum, block_residual, norm_weight, proj_weight, K, eps)

    assert torch.autograd.gradcheck(fn, tuple(args[n] for n in NAMES), eps=1e-6, atol=1e-8, rtol=1e-6)


# --------------------------------------------------------------------------------------------------------------
# The autograd formula on every device: shapes, dtypes, chain rule through the folded weight, NaN capacity.
# --------------------------------------------------------------------------------------------------------------
# Tolerance of the gradients against the float64 truth: one rounding to the I/O dtype (bf16/fp16) dominates;
# fp32 carries FP32 accumulation over H and over tokens (the weight gradients). Absolute parts scale with the
# largest gradient terms (|gy| * |v| ~ 1-10), not with the (sometimes cancelling) result.
GRAD_TOL = {torch.bfloat16: (2**-7, 2**-6), torch.float16: (2**-10, 2**-9), torch.float32: (1e-5, 1e-5),
            torch.float64: (1e-10, 1e-10)}


@pytest.mark.parametrize("sample", sample_params())
def test_grads_against_float64_truth(sample: Sample, device: str):
    args = sample.make(device, requires_grad=True)
    out = FWD(*positional(args))
    gy = grad_out_for(sample, device)
    grads = torch.autograd.grad(out, [args[n] for n in NAMES], gy)
    cpu = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    truths = reference.attn_res_backward_truth(gy.cpu(), *positional(cpu))
    for name, grad, truth in zip(NAMES, grads, truths):
        x = args[name]
        assert grad.shape == x.shape and grad.dtype == x.dtype and grad.device == x.device, name
        rtol, atol = GRAD_TOL[x.dtype]  # the weights' gradients are rounded to the weights' dtype (fp32 here)
        if name in ("norm_weight", "proj_weight"):
            # Sums over T x (K + 1) terms: the error scales with the largest sum, not with each (cancelling) one.
            atol = atol * max(1.0, float(truth.abs().max()))
        assert_close(grad, truth, atol=atol, rtol=rtol, what=f"{sample.id} d{name}")
    g_blocks = grads[1]
    assert bool((g_blocks[:, sample.K:] == 0).all()), "gradient at slots >= K must be exactly zero"
    assert not any(bool(g.isnan().any()) for g in grads), "NaN-poisoned capacity leaked into a gradient"


@pytest.mark.parametrize("create_graph", [False, True], ids=["plain", "create-graph"])
@pytest.mark.parametrize("sample", sample_params([SAMPLES[0], SAMPLES[2], SAMPLES[5]]))
def test_autograd_gradients_are_the_backward_op_outputs(sample: Sample, device: str, create_graph: bool):
    # Exactly: every input's gradient is the backward op's output for it (the weights' included: the op applies
    # the chain rule through the folded weight itself), in a plain backward and where the backward is recorded
    # (create_graph=True). The incoming gradient is the expanded ones of out.sum() (stride 0 everywhere), which
    # the kernels must read as it is or copy.
    args = sample.make(device, requires_grad=True)
    FWD(*positional(args)).sum().backward(create_graph=create_graph)
    ones = torch.ones(sample.T, sample.H, dtype=sample.dtype, device=device)
    det = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    expected = BWD(ones, *positional(det), [True, True, True, True])
    for name, exp in zip(NAMES, expected):
        assert bits_equal(args[name].grad, exp), name


# --------------------------------------------------------------------------------------------------------------
# What autograd saves and asks for.
# --------------------------------------------------------------------------------------------------------------
def test_saves_only_the_inputs():
    # Memory: the graph keeps the four inputs (which the caller holds anyway) and nothing of size T x K x H.
    sample = Sample(T=5, K=3, cap=4, H=16, dtype=torch.bfloat16)
    args = sample.make("cpu", requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = FWD(*positional(args))
    assert len(saved) == 4
    for name, t in zip(NAMES, saved):
        assert t.data_ptr() == args[name].data_ptr() and t.shape == args[name].shape, name
    out.sum().backward()


def test_backward_is_one_op_call():
    # A plain backward is the backward op and nothing after it: the weights' gradients come out of it in their
    # dtype (bf16 weights here) and shape, with no product or cast left to autograd (each a kernel launch on a
    # GPU). Seen by the profiler (a dispatch mode would itself send tensors down a subclass path).
    sample = Sample(T=5, K=3, cap=4, H=16, dtype=torch.bfloat16)
    args = sample.make("cpu")
    args["norm_weight"], args["proj_weight"] = args["norm_weight"].bfloat16(), args["proj_weight"].bfloat16()
    for name in NAMES:
        args[name].requires_grad_(True)
    out = FWD(*positional(args))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.sum().backward()
    events = prof.events()
    bwd_end = max(e.time_range.end for e in events if e.name == "kimi_k3::attn_res_backward")
    after = [e.name for e in events if e.time_range.start >= bwd_end and e.name.startswith("aten::")
             and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
    assert not any(n in after for n in ("aten::mul", "aten::mul_", "aten::to", "aten::_to_copy")), after
    assert args["norm_weight"].grad.dtype == args["proj_weight"].grad.dtype == torch.bfloat16
    assert args["proj_weight"].grad.shape == args["proj_weight"].shape


class _RecordBackwardCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.masks = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is BWD:
            self.masks.append(list(args[7]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("wanted", [w for w in itertools.product([False, True], repeat=4) if any(w)],
                         ids=lambda w: "+".join(n for n, on in zip(("prefix", "blocks", "norm", "proj"), w) if on))
def test_needs_input_grad_selects_outputs(wanted):
    sample = Sample(T=3, K=2, cap=3, H=16, dtype=torch.float32)
    args = sample.make("cpu")
    leaves = []
    for name, on in zip(NAMES, wanted):
        args[name] = args[name].detach().requires_grad_(on)
        if on:
            leaves.append(args[name])
    out = FWD(*positional(args))
    rec = _RecordBackwardCalls()
    with rec:
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    # One call, asking for exactly the gradients some input needs.
    assert rec.masks == [list(wanted)]
    assert all(g is not None for g in grads)


def test_no_input_requires_grad_records_nothing():
    args = SAMPLES[2].make("cpu")
    out = FWD(*positional(args))
    assert not out.requires_grad and out.grad_fn is None


def test_in_place_change_of_a_saved_input_is_caught():
    # The inputs are saved with save_for_backward, so autograd's version counter protects the recompute.
    args = Sample(T=3, K=2, cap=4, H=16, dtype=torch.float32).make("cpu", requires_grad=True)
    out = FWD(*positional(args))
    with torch.no_grad():
        args["block_residual"].mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_double_backward_raises_a_clear_error():
    args = f64_leaves(GRADCHECK_SAMPLES[0])
    out = FWD(*positional(args))
    (g_prefix,) = torch.autograd.grad(out.square().sum(), [args["prefix_sum"]], create_graph=True)
    assert g_prefix.requires_grad  # first order works with create_graph=True ...
    with pytest.raises(RuntimeError, match=r"does not support double backward.*attn_res_reference"):
        g_prefix.sum().backward()  # ... the second order says what is unsupported and what to do instead


# --------------------------------------------------------------------------------------------------------------
# The backward op's own contract: opcheck, Meta == real metadata, output_mask.
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sample", sample_params())
def test_opcheck_forward_with_grad(sample: Sample, device: str):
    # The shared samples with requires_grad=True: opcheck's autograd-registration and aot_dispatch checks run
    # the backward through the registered formula (and through the Meta kernel when traced).
    opcheck(FWD, positional(sample.make(device, requires_grad=True)))


MASKS = [[True, True, True, True], [True, False, False, False], [False, True, False, False],
         [False, False, True, False], [False, False, False, True], [False, False, False, False]]


def mask_id(mask) -> str:
    return "".join("1" if m else "0" for m in mask)


@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("sample", sample_params())
def test_opcheck_backward(sample: Sample, mask, device: str):
    # Called the way autograd calls it: inputs that do not require grad (double backward is refused).
    opcheck(BWD, (grad_out_for(sample, device), *positional(sample.make(device)), mask))


@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("sample", sample_params([SAMPLES[0], SAMPLES[4], SAMPLES[5], SAMPLES[7]]))
def test_backward_outputs_meta_matches_real_and_mask(sample: Sample, mask, device: str):
    args = positional(sample.make(device))
    gy = grad_out_for(sample, device)
    real = BWD(gy, *args, mask)
    full = BWD(gy, *args, [True, True, True, True])
    meta = BWD(gy.to("meta"), *(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args), mask)
    like = [args[0], args[1], args[2], args[3]]  # each output has its input's dtype and (full) shape
    shapes = [(sample.T, sample.H), (sample.T, sample.cap, sample.H), tuple(args[2].shape), tuple(args[3].shape)]
    for i, (r, f, m) in enumerate(zip(real, full, meta)):
        assert (m.shape, m.dtype, m.stride()) == (r.shape, r.dtype, r.stride()), i
        assert r.dtype == like[i].dtype
        if mask[i]:
            assert r.shape == shapes[i] and r.is_contiguous()
            assert bits_equal(r, f), f"output {i} differs between masked and full calls"
        else:
            assert r.shape == (0,), f"output {i} not asked for must be an empty 1-D tensor"


# --------------------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True) of forward + backward.
# --------------------------------------------------------------------------------------------------------------
def _step(prefix_sum, block_residual, norm_weight, proj_weight, K: int, eps: float):
    # A small "training step": mix, a following op, a scalar loss. fullgraph=True: no graph break allowed.
    out = k3_ops.attn_res(prefix_sum, block_residual, norm_weight, proj_weight, K, eps)
    return (out.float().tanh() * 1.5).sum()


COMPILE_SAMPLES = [Sample(T=6, K=3, cap=5, H=96, dtype=torch.bfloat16, layout="blockmajor"),
                   Sample(T=7, K=3, cap=8, H=64, dtype=torch.float32, proj_2d=False)]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("sample", sample_params(COMPILE_SAMPLES))
def test_compile_forward_backward_equals_eager(sample: Sample, backend: str, device: str):
    torch._dynamo.reset()
    eager_args = sample.make(device, requires_grad=True)
    comp_args = sample.make(device, requires_grad=True)
    _step(*positional(eager_args)).backward()
    compiled = torch.compile(_step, backend=backend, fullgraph=True)
    compiled(*positional(comp_args)).backward()
    for name in NAMES:
        # The same kernels run in both (the op is opaque to the compiler); only the surrounding element-wise
        # chain rule and loss may be fused, which moves FP32 results by at most an ulp or so.
        assert_close(comp_args[name].grad, eager_args[name].grad, atol=1e-6, rtol=1e-5, what=f"{sample.id} {name}")


def test_compiled_backward_graph_calls_the_backward_op():
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    args = COMPILE_SAMPLES[0].make("cpu", requires_grad=True)
    torch.compile(_step, backend=backend, fullgraph=True)(*positional(args)).backward()
    assert len(backend.fw_graphs) == 1 and len(backend.bw_graphs) == 1
    fw = backend.fw_graphs[0].code
    bw = backend.bw_graphs[0].code
    assert "kimi_k3.attn_res.default" in fw
    assert "kimi_k3.attn_res_backward.default" in bw and "kimi_k3.attn_res.default" not in bw


@requires_cuda
@pytest.mark.cuda
def test_compile_cuda_peak_memory_has_no_candidate_stack():
    # The saved state is the inputs only: forward + backward of a training-size call must not allocate
    # anything of size T x (K + 1) x H in FP32 beyond the gradient buffers themselves.
    s = Sample(T=2048, K=8, cap=8, H=1024, dtype=torch.bfloat16)
    args = s.make("cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    FWD(*positional(args)).float().sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = sum(args[n].grad.numel() * args[n].grad.element_size() for n in NAMES)
    fp32_stack = s.T * (s.K + 1) * s.H * 4
    assert extra < grads + fp32_stack // 2, (extra, grads, fp32_stack)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("T, K", [(300, 1), (1000, 8)], ids=["t300-k1", "t1000-k8"])
def test_cuda_training_step_is_captured_by_a_cuda_graph(T: int, K: int):
    # A training step (forward, then the gradients of all four inputs) captured into a CUDA graph, as a
    # graph-captured training loop does: every backward launch records (the CUDA C++ kernel's cooperative launch and
    # its in-kernel weight-gradient reduction among them), and a replay on fresh inputs copied into the static
    # buffers gives the eager gradients of those inputs bit for bit (the backward is deterministic).
    s = Sample(T=T, K=K, cap=8, H=7168, dtype=torch.bfloat16)
    leaves = s.make("cuda")
    for n in NAMES:
        leaves[n] = leaves[n].detach().requires_grad_(True)
    gy = grad_out_for(s, "cuda")

    def step():
        return torch.autograd.grad(FWD(*positional(leaves)), [leaves[n] for n in NAMES], gy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: plans, launch records and allocator pools before capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    fresh = s.make("cuda", seed=1)
    with torch.no_grad():
        for n in NAMES:
            leaves[n].copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    want = step()
    for n, got, ref in zip(NAMES, captured, want):
        assert bits_equal(got, ref), f"{n}: the replayed gradient differs from eager on the same inputs"
