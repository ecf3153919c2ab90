"""The C++ CUDA kernels' replay cache (csrc_cuda/launch_cache.cpp) and its Python recorder (backends/_launch.py).

- CPU: the recorder names every pointer by its role (input, output, scratch, null) and refuses a recipe where a
  pointer has no role or two roles; scalars are packed as Triton's launcher packs them; interpreted launches are
  never recorded.
- GPU (a CUDA build of k3_ops._C): the first call of a key records, the next ones replay, and a replay gives the
  Python path's bits for every op (plain, fused, FP8, in place, backward) on fresh tensors of the same layout,
  NaN-poisoned capacity included; calls whose device work cannot be replayed (aliased inputs, a hidden-strided
  prefix, a cast weight, a Triton launch hook) keep the Python path; an in-place weight update is seen; a replay
  is captured into a CUDA graph; bad input still fails with the eager message; policy changes clear the cache.
"""
from __future__ import annotations

import struct

import pytest
import torch

import k3_ops  # noqa: F401  (registers the ops)

from conftest import Sample, bits_equal, requires_interpreter

OPS = torch.ops.kimi_k3


# --- CPU: the recorder --------------------------------------------------------------------------------------
def _recorder_with(launch_values):
    from k3_ops.backends import _launch

    rec = _launch._Recorder()
    rec.launches.append(("triton", (1234, 256, 0, 1, True, False), (3, 1, 1), launch_values))
    return rec


def test_recipe_names_pointers_by_role():
    from k3_ops.backends import _launch

    a, b = torch.zeros(4), torch.zeros(8)
    out = torch.zeros(4)
    rec = _recorder_with([("*fp32", b), ("*fp32", a), ("*fp32", out), ("i32", -3), ("fp32", 0.1), ("i64", 1 << 40)])
    buf = _launch.scratch((2, 3), torch.float64, "cpu")  # not recording here: a plain torch.empty
    assert buf.shape == (2, 3) and not rec.scratch
    rec.scratch.append(buf)
    rec.launches[0][3].append(("*fp64", buf))
    rec.launches[0][3].append(("*fp32", None))
    scratch, launches = rec.recipe((a, b, 5, None), (out,))
    assert scratch == [([2, 3], [3, 1], torch.float64)]
    kind, function, grid, block, shared, num_ctas, pdl, coop, args = launches[0]
    assert (kind, function, grid, block, shared, num_ctas, pdl, coop) == ("triton", 1234, [3, 1, 1], 256, 0, 1,
                                                                          True, False)
    assert args[:3] == [(1, 1, 0), (1, 0, 0), (2, 0, 0)]  # input 1, input 0, output 0
    assert args[3] == (0, 0, struct.unpack("<I", struct.pack("<i", -3))[0])
    assert args[4] == (0, 0, struct.unpack("<I", struct.pack("<f", 0.1))[0])
    assert args[5] == (0, 0, 1 << 40)
    assert args[6] == (3, 0, 0) and args[7] == (4, 0, 0)  # scratch 0, null


def test_recipe_refuses_unnamed_and_ambiguous_pointers():
    a, out = torch.zeros(4), torch.zeros(4)
    stranger = torch.zeros(4)  # e.g. a cast weight or a contiguous copy made by the policy
    assert _recorder_with([("*fp32", stranger)]).recipe((a,), (out,)) is None
    assert _recorder_with([("*fp32", a)]).recipe((a, a), (out,)) is None  # one address, two inputs
    assert _recorder_with([("*fp32", a)]).recipe((a,), (out,)) is not None
    rec = _recorder_with([("*fp32", a)])
    rec.valid = False  # unrecordable() was called
    assert rec.recipe((a,), (out,)) is None
    from k3_ops.backends import _launch

    assert _launch._Recorder().recipe((a,), (out,)) is None  # no launch: nothing to replay


@requires_interpreter
@pytest.mark.interpreter
def test_interpreted_calls_are_never_recorded():
    from k3_ops.backends import _launch, cuda

    args = Sample(T=2, K=2, cap=3, H=64).make("cpu")
    result, recipe, knobs = _launch.record_call(cuda.attn_res_forward, tuple(args.values()), {}, True)
    assert recipe is None and knobs is None
    assert torch.isfinite(result).all()
    plain, recipe, _ = _launch.record_call(cuda.attn_res_forward, tuple(args.values()), {}, False)
    assert recipe is None and bits_equal(plain, result)


# --- The C++ CUDA kernel's Python path, on CPU tensors (a CUDA build of k3_ops._C; no GPU needed) -----------
requires_cuda_build = pytest.mark.skipif(getattr(k3_ops._C, "set_cuda_kernels", None) is None,
                                         reason="k3_ops._C built without the CUDA sources (no C++ CUDA kernel)")


@requires_cuda_build
@requires_interpreter
@pytest.mark.interpreter
def test_cpp_kernel_calls_the_python_kernels_with_the_schema_arguments():
    """Redispatched to the CUDA key with CPU tensors, each op reaches the C++ kernel, which calls the op's Python
    CUDA kernel (here under the interpreter): keyword-only arguments by name, ScalarType as a torch.dtype, outputs
    back as the schema's returns, and bad input raises the eager check's type and message."""
    cuda_key = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    a = Sample(T=2, K=2, cap=3, H=64).make("cpu")
    p, b, nw, pw = a["prefix_sum"], a["block_residual"], a["norm_weight"], a["proj_weight"]
    out = OPS.attn_res.default.redispatch(cuda_key, p, b, nw, pw, 2, 1e-6)
    assert bits_equal(out, _python_kernel("attn_res")(p, b, nw, pw, 2, 1e-6))
    target = p.clone()
    q, scale = OPS.fused_attn_res_.default.redispatch(cuda_key, target, p, b, nw, pw, 2, 1e-6, 2, nw, 1e-5,
                                                      out_dtype=torch.float8_e4m3fn, round_mix=False)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 1)
    assert bits_equal(target, (p.float() + p.float()).to(p.dtype)), "the new prefix went back into prefix_sum"
    assert [t.dtype for t in OPS.fused_attn_res.quant.redispatch(cuda_key, p, None, b, nw, pw, 2, 1e-6,
                                                                 out_dtype=torch.float8_e4m3fn)] == [
        torch.float8_e4m3fn, p.dtype, torch.float32]
    grads = OPS.attn_res_backward.default.redispatch(cuda_key, p, p, b, nw, pw, 2, 1e-6, [True, False, True, False])
    assert [tuple(g.shape) for g in grads] == [(2, 64), (0,), tuple(nw.shape), (0,)]
    with pytest.raises(ValueError, match=r"num_valid_blocks must be in \[0, block_residual.size\(1\)=3\], got 5"):
        OPS.attn_res.default.redispatch(cuda_key, p, b, nw, pw, 5, 1e-6)
    with pytest.raises(TypeError, match="block_residual.dtype must equal prefix_sum.dtype"):
        OPS.attn_res.default.redispatch(cuda_key, p, b.half(), nw, pw, 2, 1e-6)
    assert k3_ops._C.launch_recipe_count() == 0, "interpreted launches are never recorded"


# --- GPU: record and replay --------------------------------------------------------------------------------
def _has_cpp_launch() -> bool:
    return bool(getattr(k3_ops._C, "cpp_launch_enabled", False))


requires_cpp_launch = pytest.mark.skipif(
    not torch.cuda.is_available() or not _has_cpp_launch(),
    reason="needs an NVIDIA GPU and a CUDA build of k3_ops._C with the C++ launch path (K3_OPS_CPP_LAUNCH != 0)")


def _python_kernel(name: str):
    from k3_ops import _registration

    return _registration._CUDA_KERNELS[name]


def _count() -> int:
    return k3_ops._C.launch_recipe_count()


def _mix_args(T, K, cap=9, H=7168, seed=0, layout="tokenmajor"):
    a = Sample(T=T, K=K, cap=cap, H=H, layout=layout).make("cuda", seed=seed)
    return a


def _fused_args(T, K, seed, write, norm):
    a = _mix_args(T, K, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    addend = torch.randn(T, a["prefix_sum"].size(1), generator=g).to("cuda", torch.bfloat16)
    onw = (1 + 0.1 * torch.randn(a["prefix_sum"].size(1), generator=g)).to("cuda", torch.bfloat16) if norm else None
    return (a["prefix_sum"], addend, a["block_residual"], a["norm_weight"], a["proj_weight"], K, 1e-6,
            K if write else -1, onw, 1e-5 if norm else None)


def _clone(args):
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in args)


def _same(a, b) -> bool:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return len(a) == len(b) and all(bits_equal(x, y) for x, y in zip(a, b))


MIX = [(1, 1), (1, 8), (3, 2), (4, 8), (64, 8), (300, 4)]


@requires_cpp_launch
@pytest.mark.cuda
@pytest.mark.parametrize("T, K", MIX, ids=[f"T{t}-K{k}" for t, k in MIX])
def test_attn_res_replay_gives_the_python_bits(T, K):
    k3_ops._C.clear_launch_recipes()
    first = _mix_args(T, K, seed=0)
    OPS.attn_res(*first.values())
    assert _count() == 1, "the first call records its launches"
    fresh = tuple(_mix_args(T, K, seed=1).values())  # same layout, new values, new addresses
    replayed = OPS.attn_res(*fresh)
    assert _count() == 1
    assert _same(replayed, _python_kernel("attn_res")(*fresh))
    assert torch.isfinite(replayed).all(), "a NaN-poisoned slot >= K was read"


FUSED = [(1, 1, True, True), (1, 8, True, True), (1, 8, False, False), (4, 8, True, False), (64, 8, True, True),
         (300, 2, False, True)]


@requires_cpp_launch
@pytest.mark.cuda
@pytest.mark.parametrize("T, K, write, norm", FUSED,
                         ids=[f"T{t}-K{k}-{'write' if w else 'nowrite'}-{'norm' if n else 'nonorm'}"
                              for t, k, w, n in FUSED])
@pytest.mark.parametrize("op", ["fused_attn_res", "fused_attn_res.quant", "fused_attn_res_"])
def test_fused_replay_gives_the_python_bits(op, T, K, write, norm):
    k3_ops._C.clear_launch_recipes()
    name, overload = (op.split(".") + ["default"])[:2]
    fn = getattr(getattr(OPS, name), overload)
    kwargs = {"out_dtype": torch.float8_e4m3fn} if op == "fused_attn_res.quant" else {}
    if op == "fused_attn_res_":
        kwargs["round_mix"] = False
    fn(*_fused_args(T, K, 0, write, norm), **kwargs)
    assert _count() == 1
    fresh = _fused_args(T, K, 1, write, norm)
    mine, theirs = _clone(fresh), _clone(fresh)
    got = fn(*mine, **kwargs)
    assert _count() == 1, "the second call replays"
    want = _python_kernel(op)(*theirs, **kwargs)
    assert _same(got, want)
    # The buffers the op writes in place: the snapshot slot, and fused_attn_res_'s prefix.
    assert bits_equal(mine[2], theirs[2]) and bits_equal(mine[0], theirs[0])


@requires_cpp_launch
@pytest.mark.cuda
@pytest.mark.parametrize("T, K", [(1, 8), (4, 3), (64, 8)], ids=["T1-K8", "T4-K3", "T64-K8"])
def test_backward_replay_gives_the_python_bits(T, K):
    k3_ops._C.clear_launch_recipes()
    for seed in (0, 1):
        a = _mix_args(T, K, seed=seed)
        gy = torch.randn(T, 7168, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
        args = (gy, *a.values(), [True, True, True, True])
        got = OPS.attn_res_backward(*args)
        want = _python_kernel("attn_res_backward")(*args)
        assert _same(got, want), seed
    assert _count() == 1
    # A training step: forward, then autograd's backward, both through the cache.
    a = _mix_args(T, K, seed=2)
    leaf = a["prefix_sum"].requires_grad_(True)
    (grad,) = torch.autograd.grad(OPS.attn_res(*a.values()), leaf, torch.ones_like(leaf))
    want = _python_kernel("attn_res_backward")(torch.ones_like(leaf), *[v.detach() if isinstance(v, torch.Tensor)
                                                                          else v for v in a.values()],
                                                 [True, False, False, False])[0]
    assert bits_equal(grad, want)


@requires_cpp_launch
@pytest.mark.cuda
def test_calls_the_recorder_cannot_name_keep_the_python_path():
    k3_ops._C.clear_launch_recipes()
    a = _mix_args(2, 3)
    # Aliased inputs: one tensor as prefix and addend.
    p = a["prefix_sum"]
    for _ in range(2):
        got = OPS.fused_attn_res(p, p, a["block_residual"], a["norm_weight"], a["proj_weight"], 3, 1e-6)
    assert _count() == 0
    assert _same(got, _python_kernel("fused_attn_res")(p, p, a["block_residual"], a["norm_weight"],
                                                      a["proj_weight"], 3, 1e-6))
    # A hidden-strided prefix (the policy copies it) and an fp64 weight (the policy casts it).
    strided = torch.empty(2, 7168 * 2, dtype=torch.bfloat16, device="cuda")[:, ::2]
    strided.copy_(p)
    OPS.attn_res(strided, a["block_residual"], a["norm_weight"], a["proj_weight"], 3, 1e-6)
    OPS.attn_res(p, a["block_residual"], a["norm_weight"].double(), a["proj_weight"], 3, 1e-6)
    assert _count() == 0
    # fp64 and K = 0 never launch a kernel: nothing to record.
    OPS.attn_res(p, a["block_residual"], a["norm_weight"], a["proj_weight"], 0, 1e-6)
    assert _count() == 0


@requires_cpp_launch
@pytest.mark.cuda
def test_a_launch_hook_sends_calls_to_python():
    import triton

    k3_ops._C.clear_launch_recipes()
    a = _mix_args(64, 4)  # a shape the table runs on a Triton kernel (the hooks are Triton's)
    OPS.attn_res(*a.values())
    assert _count() == 1
    seen = []
    runtime = triton.knobs.runtime
    old = runtime.launch_enter_hook
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    try:
        if hasattr(old, "add"):
            old.add(hook)
        else:
            runtime.launch_enter_hook = hook
        OPS.attn_res(*a.values())
    finally:
        if hasattr(old, "remove"):
            old.remove(hook)
        else:
            runtime.launch_enter_hook = old
    assert seen, "with a launch hook set the call went through Triton's launcher"


@requires_cpp_launch
@pytest.mark.cuda
def test_replay_sees_an_in_place_weight_update():
    k3_ops._C.clear_launch_recipes()
    a = _mix_args(1, 4)
    before = OPS.attn_res(*a.values())
    with torch.no_grad():
        a["proj_weight"].mul_(-3.0)
    after = OPS.attn_res(*a.values())
    assert _count() == 1
    assert not bits_equal(before, after)
    assert bits_equal(after, _python_kernel("attn_res")(*a.values()))


@requires_cpp_launch
@pytest.mark.cuda
def test_replay_is_captured_by_a_cuda_graph():
    k3_ops._C.clear_launch_recipes()
    a = _mix_args(1, 8)
    args = tuple(a.values())
    OPS.fused_attn_res_(*_fused_args(1, 8, 0, True, True), round_mix=False)
    OPS.attn_res(*args)  # recorded eagerly
    count = _count()
    fused = _fused_args(1, 8, 1, True, True)
    fused_ref = _clone(fused)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = OPS.attn_res(*args)
        fout, _ = OPS.fused_attn_res_(*fused, round_mix=False)
    assert _count() == count, "capture replayed the recorded keys"
    graph.replay()
    torch.cuda.synchronize()
    assert bits_equal(out, _python_kernel("attn_res")(*args))
    want, _ = _python_kernel("fused_attn_res_")(*fused_ref, round_mix=False)
    assert bits_equal(fout, want) and bits_equal(fused[0], fused_ref[0])


@requires_cpp_launch
@pytest.mark.cuda
def test_bad_input_fails_with_the_eager_message_after_recording():
    k3_ops._C.clear_launch_recipes()
    a = _mix_args(2, 3, cap=4)
    OPS.attn_res(*a.values())
    out = torch.zeros(1)
    with pytest.raises(ValueError, match="num_valid_blocks"):
        OPS.attn_res(a["prefix_sum"], a["block_residual"], a["norm_weight"], a["proj_weight"], 5, 1e-6)
    with pytest.raises(TypeError, match="block_residual"):
        OPS.attn_res(a["prefix_sum"], a["block_residual"].half(), a["norm_weight"], a["proj_weight"], 3, 1e-6)
    assert out.item() == 0


@requires_cpp_launch
@pytest.mark.cuda
def test_policy_changes_clear_the_recipes():
    from k3_ops.backends import cuda

    a = _mix_args(1, 2)
    OPS.attn_res(*a.values())
    assert _count() >= 1
    cuda.clear_plan_cache()
    assert _count() == 0
    OPS.attn_res(*a.values())
    old = cuda.set_launch_config(1, 2, cuda.LaunchConfig(kernel="rows"))
    try:
        assert _count() == 0
        assert bits_equal(OPS.attn_res(*a.values()), cuda.attn_res_forward(*a.values(),
                                                                           config=cuda.LaunchConfig(kernel="rows")))
    finally:
        cuda.set_launch_config(1, 2, old)
