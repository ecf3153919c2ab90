"""Tensor parallelism: ``kimi_k3::tp_all_reduce`` and ``fused_attn_res_(..., tp_group=)`` (k3_ops/tp.py, docs/tp.md).

Contract, checked on every rank of real process groups (spawned processes, a FileStore in tmp_path):
- the serving call with ``tp_group`` equals ``all_reduce(partial)`` + the plain call bit for bit on the fallback path
  (it is that composition), and on the fused path equals the fixed-order reference (all_gather of the partials, an
  FP32 sum in rank order, rounded once) + the plain call bit for bit; the fused and NCCL sums agree bit for bit at
  world size 2 (one commutative addition) and within a few ulps of the sum beyond (NCCL's own order and per-hop
  rounding);
- every rank gets the same bits; the caller's partial is never written; the snapshot row is the new prefix;
- a group of one rank is the plain call (no kernel); through the fused kernel (forced) it is the plain call too;
- the same under torch.compile (fullgraph) and, on GPUs, CUDA-graph capture and replay with fresh inputs.
On the CPU: gloo groups of 1, 2 and 4 (the fallback path), the schema's Meta kernel and checks, the size rule, and
the one-shot kernel at world size 1 under the Triton interpreter. On GPUs (``-m cuda``): NCCL groups of 1 and, where
the machine has the GPUs, 2, 4 and 8, through both paths, T = 1..8192.
"""
from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import pytest
import torch

import k3_ops
from k3_ops import tp

from conftest import bits_equal, requires_interpreter, spawn_bounded

OP = torch.ops.kimi_k3.tp_all_reduce.default


def _gloo_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


requires_gloo = pytest.mark.skipif("not __import__('test_tp')._gloo_available()",
                                   reason="needs torch.distributed with the gloo backend")


def _nccl_gpus(n: int):
    """Skip marks for a test on ``n`` GPUs through NCCL (the device is queried at collection only via skipif)."""
    return [pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)"),
            pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < n,
                               reason=f"needs {n} GPUs on one host for a world size of {n}"),
            pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                               reason="needs torch.distributed with NCCL")]


# --------------------------------------------------------------------------------------------------------------
# Inputs shared by every rank, and each rank's own partial.
# --------------------------------------------------------------------------------------------------------------
def _case_inputs(T: int, H: int, K: int, cap: int, dtype: torch.dtype, seed: int, device) -> dict:
    """The serving call's inputs, the same on every rank (one seed); capacity slots >= K NaN-poisoned."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(T, cap, H, generator=g).to(dtype)
    buf[:, K:] = float("nan")
    return dict(prefix=torch.randn(T, H, generator=g).to(dtype).to(device), buf=buf.to(device),
                norm_w=(1 + 0.1 * torch.randn(H, generator=g)).to(device),
                proj_w=(torch.randn(1, H, generator=g) / H ** 0.5).to(device),
                out_norm_w=(1 + 0.1 * torch.randn(H, generator=g)).to(device))


def _partial(T: int, H: int, dtype: torch.dtype, seed: int, rank: int, device, strided: bool) -> torch.Tensor:
    """This rank's partial sum (a different draw per rank); ``strided``: a [T, H] view with a token stride > H and
    a hidden stride of 2, so the kernels' stride handling is exercised."""
    g = torch.Generator().manual_seed(seed * 1000 + 17 * (rank + 1))
    if strided:
        return torch.randn(T, 2 * H + 3, generator=g).to(dtype).to(device)[:, 1:2 * H + 1:2]
    return torch.randn(T, H, generator=g).to(dtype).to(device)


def _serving_call(inp: dict, addend, K: int, write: int, tp_group=None) -> tuple:
    """fused_attn_res_ on copies of the shared inputs: (out, new prefix, buffer after the call)."""
    prefix, buf = inp["prefix"].clone(), inp["buf"].clone()
    out, _ = k3_ops.fused_attn_res_(prefix, addend, buf, inp["norm_w"], inp["proj_w"], K, 1e-6,
                                    block_write_idx=write, out_norm_weight=inp["out_norm_w"], tp_group=tp_group)
    return out, prefix, buf


def _fixed_order_sum(partial: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of the fused path: every rank's partial (all_gather), summed in FP32 in rank order 0..n-1,
    rounded once to the dtype; and the FP32 sum of the partials' magnitudes (the scale of rounding errors)."""
    import torch.distributed as dist

    parts = [torch.empty(partial.shape, dtype=partial.dtype, device=partial.device) for _ in range(group.size())]
    dist.all_gather(parts, partial.contiguous(), group=group)
    acc, mag = parts[0].float(), parts[0].float().abs()
    for p in parts[1:]:
        acc, mag = acc + p.float(), mag + p.float().abs()
    return acc.to(partial.dtype), mag


def _same_on_every_rank(t: torch.Tensor, group) -> bool:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(bits_equal(p, parts[0]) for p in parts)


def _error_in_roundings(a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor) -> float:
    """Largest |a - b| in units of one rounding of a partial sum: the dtype's eps times the sum of the partials'
    magnitudes (a bound on every partial sum, whatever the order)."""
    scale = magnitude.clamp_min(torch.finfo(a.dtype).tiny) * torch.finfo(a.dtype).eps
    return ((a.float() - b.float()).abs() / scale).max().item() if a.numel() else 0.0


# --------------------------------------------------------------------------------------------------------------
# The worker every rank runs (a module-level function, so spawn can pickle it).
# --------------------------------------------------------------------------------------------------------------
# (T, H, K, cap, dtype, strided partial)
CPU_CASES = [(1, 96, 2, 4, torch.bfloat16, False), (5, 7168, 3, 4, torch.bfloat16, True),
             (33, 64, 0, 2, torch.float32, False), (7, 48, 1, 3, torch.float16, True)]
GPU_CASES = [(T, 7168, 4, 9, torch.bfloat16, False) for T in (1, 8, 64, 512, 8192)]
GPU_CASES += [(5, 33, 2, 4, torch.float16, True), (17, 4096, 8, 8, torch.float32, False),
              (3, 7168, 2, 3, torch.bfloat16, True)]
# Beyond world size 2 NCCL's (gloo's) sum is another order of world_size - 1 additions, each rounded to the dtype,
# against one FP32 sum rounded once: each rounding is at most half an eps of a partial sum, and a partial sum is at
# most the sum of the magnitudes. One rounding per addition, plus the final one.
def _roundings(world: int) -> float:
    return 0.5 * world


def _check_case(case, rank, group, device, plan, failures):
    T, H, K, cap, dtype, strided = case
    world = group.size()
    seed = (T * 131 + H * 7 + K * 3 + cap + dtype.itemsize + strided) % 10_000  # the same in every process
    inp = _case_inputs(T, H, K, cap, dtype, seed, device)
    partial = _partial(T, H, dtype, seed, rank, device, strided)
    before = partial.clone()
    write = K if K < cap else -1
    where = f"rank {rank}/{world} plan {plan} T={T} H={H} K={K} {dtype} strided={strided}"

    with tp.forced_plan(plan):
        out, prefix, buf = _serving_call(inp, partial, K, write, tp_group=group)
        functional = k3_ops.fused_attn_res(inp["prefix"], partial, inp["buf"].clone(), inp["norm_w"], inp["proj_w"],
                                           K, 1e-6, block_write_idx=write, out_norm_weight=inp["out_norm_w"],
                                           tp_group=group.group_name)
    if not bits_equal(partial, before):
        failures.append(f"{where}: the caller's partial was written")
    import torch.distributed as dist

    nccl_sum = partial.contiguous().clone()
    dist.all_reduce(nccl_sum, group=group)
    fixed_sum, magnitude = _fixed_order_sum(partial, group)
    fused_path = (plan == "fused" or (plan is None and world > 1
                                      and tp.tp_plan(T, H, world, dtype, torch.device(device)) == "fused"))
    expected = fixed_sum if fused_path else nccl_sum
    if world == 1 and plan is None:
        expected = partial  # a group of one rank adds the partial as it is
    out_e, prefix_e, buf_e = _serving_call(inp, expected, K, write)
    for name, got, want in (("out", out, out_e), ("new prefix", prefix, prefix_e), ("buffer", buf, buf_e),
                            ("functional out", functional[0], out_e), ("functional new prefix", functional[1],
                                                                        prefix_e)):
        if not bits_equal(got, want):
            failures.append(f"{where}: {name} differs from the reference composition "
                            f"(max abs {(got.float() - want.float()).abs().nan_to_num(float('inf')).max().item()})")
    if write >= 0 and not bits_equal(buf[:, write], prefix):
        failures.append(f"{where}: the snapshot row is not the new prefix")
    for name, t in (("out", out), ("new prefix", prefix)):
        if not _same_on_every_rank(t, group):
            failures.append(f"{where}: {name} differs between ranks")
    # The two paths' sums: bit for bit at world size 2, within NCCL's per-hop roundings beyond.
    if world <= 2 and not bits_equal(nccl_sum, fixed_sum):
        failures.append(f"{where}: the all-reduce's sum differs from the FP32 fixed-order sum at world size {world}")
    if world > 2 and dtype != torch.float64:
        err = _error_in_roundings(nccl_sum, fixed_sum, magnitude)
        if err > _roundings(world):
            failures.append(f"{where}: the all-reduce's sum is {err:.2f} roundings from the fixed-order sum, more "
                            f"than {world} additions' {_roundings(world)}")


def _check_compile(rank, group, device, plan, failures):
    T, H, K, cap, dtype = 6, 128, 2, 4, torch.bfloat16
    inp = _case_inputs(T, H, K, cap, dtype, 7, device)
    partial = _partial(T, H, dtype, 7, rank, device, False)

    def layer(prefix, partial, buf):
        out, _ = k3_ops.fused_attn_res_(prefix, partial, buf, inp["norm_w"], inp["proj_w"], K, 1e-6,
                                        block_write_idx=K, out_norm_weight=inp["out_norm_w"], tp_group=group)
        return out

    backend = "aot_eager" if torch.device(device).type == "cpu" else "inductor"
    with tp.forced_plan(plan):
        eager = _serving_call(inp, partial, K, K, tp_group=group)
        prefix, buf = inp["prefix"].clone(), inp["buf"].clone()
        compiled = torch.compile(layer, backend=backend, fullgraph=True)(prefix, partial, buf)
    for name, got, want in (("out", compiled, eager[0]), ("new prefix", prefix, eager[1]), ("buffer", buf, eager[2])):
        if not bits_equal(got, want):
            failures.append(f"rank {rank} plan {plan}: torch.compile({backend}) {name} differs from eager")


def _check_graph(rank, group, device, plan, failures):
    T, H, K, cap, dtype = 8, 7168, 3, 4, torch.bfloat16
    inp = _case_inputs(T, H, K, cap, dtype, 11, device)
    static = dict(prefix=inp["prefix"].clone(), partial=_partial(T, H, dtype, 11, rank, device, False),
                  buf=inp["buf"].clone())
    with tp.forced_plan(plan):
        tp.warmup(group, H, dtype, device, max_num_tokens=T)
        k3_ops.warmup(H, dtype, device, max_num_valid_blocks=K, max_num_tokens=T, serving=True)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # a warm eager call on the capture stream (allocator and NCCL state)
            _serving_call(inp, static["partial"], K, K, tp_group=group)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, _ = k3_ops.fused_attn_res_(static["prefix"], static["partial"], static["buf"], inp["norm_w"],
                                            inp["proj_w"], K, 1e-6, block_write_idx=K,
                                            out_norm_weight=inp["out_norm_w"], tp_group=group)
        for replay in range(3):  # fresh inputs each replay, against an eager call on the same values
            fresh = _case_inputs(T, H, K, cap, dtype, 100 + replay, device)
            fresh_partial = _partial(T, H, dtype, 100 + replay, rank, device, False)
            static["prefix"].copy_(fresh["prefix"])
            static["buf"].copy_(inp["buf"])
            static["partial"].copy_(fresh_partial)
            graph.replay()
            want = _serving_call(dict(inp, prefix=fresh["prefix"]), fresh_partial, K, K, tp_group=group)
            torch.cuda.synchronize()
            if not (bits_equal(out, want[0]) and bits_equal(static["prefix"], want[1])):
                failures.append(f"rank {rank} plan {plan}: CUDA-graph replay {replay} differs from eager")


def _worker(rank: int, world: int, backend: str, store_path: str, plans: list, extras: bool) -> None:
    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (NCCL's NVLS), in the fallback either
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120), device_id=device if device.type == "cuda" else None)
    group = dist.group.WORLD
    failures: list[str] = []
    try:
        with torch.inference_mode():
            for plan in plans:
                for case in (GPU_CASES if device.type == "cuda" else CPU_CASES):
                    _check_case(case, rank, group, device, plan, failures)
                if extras and device.type == "cuda":
                    _check_graph(rank, group, device, plan, failures)
        if extras:
            for plan in plans:
                _check_compile(rank, group, device, plan, failures)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if failures:
        raise AssertionError("\n".join(failures[:20]))


def _spawn(world: int, backend: str, plans: list, extras: bool, timeout_s: float) -> None:
    """Run ``_worker`` on ``world`` spawned ranks; raise the first rank's failure; kill the ranks past the timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn_bounded(_worker, (world, backend, os.path.join(tmp, "store"), plans, extras), world, timeout_s,
                      f"world size {world} ({backend})")


# --------------------------------------------------------------------------------------------------------------
# CPU: schema, Meta kernel, checks, the size rule, the kernel at world size 1 (interpreter), gloo groups.
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_meta_output_is_a_new_contiguous_sum(strided):
    base = torch.empty(7, 2 * 33, dtype=torch.bfloat16, device="meta")
    partial = base[:, ::2] if strided else base[:, :33]
    out = OP(partial, "g")
    assert (out.shape, out.dtype, out.stride()) == (torch.Size([7, 33]), torch.bfloat16, (33, 1))


def test_meta_traces_a_symbolic_token_count():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda p: OP(p, "g"), tracing_mode="symbolic")(torch.empty(5, 16, dtype=torch.float16))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    shape = node.meta["val"].shape
    assert not isinstance(shape[0], int) and str(shape[0]) == str(next(iter(gm.graph.nodes)).meta["val"].shape[0])
    assert shape[1] == 16 and node.meta["val"].dtype == torch.float16


@pytest.mark.parametrize("partial, name, error, message", [
    (torch.empty(3), "g", ValueError, "partial must be 2-D [T, H], got a 1-D tensor of shape [3]"),
    (torch.empty(3, 4, dtype=torch.int32), "g", TypeError,
     "partial.dtype must be one of torch.bfloat16, torch.float16, torch.float32, torch.float64, got torch.int32"),
    (torch.empty(3, 0), "g", ValueError, "partial.size(1) (hidden size) must be > 0, got 0"),
    (torch.empty(3, 4), "", ValueError, "group_name must name a process group (ProcessGroup.group_name), got ''"),
], ids=["rank1", "int32", "H0", "no-group"])
def test_bad_arguments_are_rejected_eagerly_and_at_trace_time(partial, name, error, message):
    with pytest.raises(error) as eager:
        OP(partial, name)
    with pytest.raises(error) as meta:
        OP(partial.to("meta"), name)
    assert str(eager.value) == message
    assert message in str(meta.value)


def test_size_rule():
    cuda = torch.device("cuda", 0)
    for world, limit in tp.ONE_SHOT_MAX_BYTES.items():
        T = limit // (7168 * 2)
        assert tp.tp_plan(T, 7168, world, torch.bfloat16, cuda) == "fused"
        assert tp.tp_plan(T + 1, 7168, world, torch.bfloat16, cuda) == "fallback"
    assert tp.tp_plan(1, 7168, 2, torch.bfloat16, torch.device("cpu")) == "fallback"
    assert tp.tp_plan(1, 7168, 2, torch.float64, cuda) == "fallback"
    with tp.forced_plan("fused"):
        assert tp.tp_plan(8192, 7168, 8, torch.bfloat16, torch.device("cpu")) == "fused"
    assert tp.tp_plan(8192, 7168, 8, torch.bfloat16, cuda) == "fallback"
    with pytest.raises(ValueError, match="plan must be one of fused, fallback or None, got 'nccl'"):
        with tp.forced_plan("nccl"):
            pass


@requires_interpreter
@pytest.mark.parametrize("copy", [True, False], ids=["copied", "in-workspace"])
@pytest.mark.parametrize("T, H, grid", [(5, 33, 3), (1, 7168, 1), (9, 64, 9)], ids=lambda v: str(v))
def test_one_shot_kernel_at_world_size_one(T, H, grid, copy):
    """The one-shot kernel with one rank (its own buffer and signal pad): the sum is the partial bit for bit at any
    strides, and every signal-pad slot is back to 0 after the launch (both barriers consumed their signals)."""
    from k3_ops.kernels.tp_all_reduce import tp_one_shot_all_reduce_kernel

    g = torch.Generator().manual_seed(T * H)
    buf = torch.full((T * H + 5,), float("nan"), dtype=torch.bfloat16)
    if copy:
        partial = torch.randn(H, T, generator=g).to(torch.bfloat16).t()  # token stride 1, hidden stride T
    else:
        partial = buf[:T * H].view(T, H)
        partial.copy_(torch.randn(T, H, generator=g))
    expected = partial.clone()
    pads = torch.zeros(grid + 4, dtype=torch.int32)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
    tp_one_shot_all_reduce_kernel[(grid,)](partial, partial.stride(0), partial.stride(1), out,
                                          torch.tensor([buf.data_ptr()]), torch.tensor([pads.data_ptr()]), T, H, 0,
                                          WORLD_SIZE=1, BLOCK_H=16, COPY=copy)
    assert bits_equal(out, expected)
    assert bits_equal(buf[:T * H].view(T, H), expected)
    assert torch.count_nonzero(pads).item() == 0


@requires_gloo
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gloo_groups(world):
    """The fallback path on CPU process groups of 1, 2 and 4 ranks (and torch.compile at 2)."""
    _spawn(world, "gloo", [None], extras=world == 2, timeout_s=90)


# --------------------------------------------------------------------------------------------------------------
# GPUs: one GPU through the fused kernel (world size 1), and 2, 4, 8 GPUs through both paths.
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [pytest.param(n, marks=_nccl_gpus(n), id=f"tp{n}") for n in (1, 2, 4, 8)])
def test_nccl_groups(world):
    _spawn(world, "nccl", ["fused", "fallback", None], extras=True, timeout_s=540)


def test_bench_section_without_several_gpus_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    from k3_ops.bench import cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    results = cli.main(["tp", "--out", str(tmp_path)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines == ["tp: needs several GPUs, one process each: torchrun --nproc-per-node N -m k3_ops.bench tp "
                     "(N = 2, 4 or 8); skipped"]
    assert "tp" not in results and not list(tmp_path.iterdir())
