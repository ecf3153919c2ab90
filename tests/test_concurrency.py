"""Concurrent launches: no kernel path shares mutable state between calls.

Serving engines run independent work on several streams of one GPU (vLLM's dual-batch overlap replays two
micro-batches' graphs at once). Every launch path must then give each call exactly the result it gives alone.

- Interpreter (CI): two interleaved calls with distinct inputs, on every CUDA path (token, rows, split) and the
  NPU policy, plain and fused: every tensor a launch touches is one of its own call's arguments, outputs or
  buffers allocated for that call, and no such buffer is shared with the other call.
- CUDA (the H200): two streams, each replaying its own CUDA graph of 40 chained calls (each call's output is the
  next call's prefix), 20 replays each at the same time, compared bit for bit with the same chain run eagerly;
  the plain and the fused op at T in {1, 4, 8, 33, 64} and K in {1, 2, 4, 8}; two graphs captured on one stream
  and replayed on two streams at once; and a captured chain with PDL on and off giving identical bits.
"""
from __future__ import annotations

import pytest
import torch

import k3_ops

from conftest import Sample, requires_cuda, requires_interpreter

CHAIN = 40
REPLAYS = 20
H, CAP = 7168, 9


# --- Interpreter: what each launch touches ---------------------------------------------------------------------
class _Spy:
    """Wraps a kernel: records the storage of every tensor argument of every launch, then runs it."""

    def __init__(self, fn, log: list):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.extend(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            return self.fn[grid](*args, **kwargs)

        return launch


@pytest.fixture
def spied(monkeypatch):
    from k3_ops.kernels import attn_res_decode, attn_res_fwd, attn_res_npu

    log: list[torch.Tensor] = []
    for module, name in ((attn_res_fwd, "attn_res_rows_kernel"), (attn_res_fwd, "attn_res_split_kernel"),
                         (attn_res_fwd, "attn_res_npu_kernel"), (attn_res_decode, "attn_res_token_kernel"),
                         (attn_res_npu, "attn_res_npu_single_read_kernel")):
        monkeypatch.setattr(module, name, _Spy(getattr(module, name), log))
    return log


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _call(policy: str, path: str | None, fused: bool, args: dict, addend: torch.Tensor, onw: torch.Tensor):
    if policy == "npu":
        from k3_ops.backends import npu as backend

        with backend.substitute(num_vector_cores=lambda device: 4):
            if fused:
                return backend.fused_attn_res(args["prefix_sum"], addend, args["block_residual"], args["norm_weight"],
                                              args["proj_weight"], args["num_valid_blocks"], args["eps"],
                                              args["num_valid_blocks"], onw, 1e-5)
            return (backend.attn_res_forward(**args),)
    from k3_ops.backends import cuda as backend

    config = backend.LaunchConfig(kernel=path)
    plan = backend.choose_config(args["prefix_sum"].size(0), args["num_valid_blocks"], args["prefix_sum"].size(1),
                                 args["prefix_sum"].device, config)
    assert plan.kernel == path
    if fused:
        real = backend.choose_config
        backend.choose_config = lambda T, K, H_, device, cfg=None: plan
        try:
            return backend.fused_attn_res(args["prefix_sum"], addend, args["block_residual"], args["norm_weight"],
                                          args["proj_weight"], args["num_valid_blocks"], args["eps"],
                                          args["num_valid_blocks"], onw, 1e-5)
        finally:
            backend.choose_config = real
    return (backend.attn_res_forward(**args, config=config),)


@requires_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("policy,path", [("cuda", "token"), ("cuda", "rows"), ("cuda", "split"), ("npu", None)],
                         ids=["cuda-token", "cuda-rows", "cuda-split", "npu"])
def test_interleaved_calls_share_no_mutable_state(spied, policy, path, fused):
    samples = [Sample(T=3, K=2, cap=4, H=40, dtype=torch.bfloat16), Sample(T=2, K=3, cap=4, H=40,
                                                                          dtype=torch.bfloat16)]
    calls = []
    for seed, sample in enumerate(samples):
        args = sample.make(seed=seed)
        addend = torch.randn(sample.T, sample.H, generator=torch.Generator().manual_seed(10 + seed)).bfloat16()
        onw = torch.rand(sample.H, generator=torch.Generator().manual_seed(20 + seed)) + 0.5
        calls.append((args, addend, onw))
    touched = []
    outputs = []
    for args, addend, onw in calls:  # A, then B, while A's tensors (and everything its launches saw) stay alive
        start = len(spied)
        outputs.append(_call(policy, path, fused, args, addend, onw))
        touched.append(spied[start:])
    assert all(touched), "no kernel launch was seen"
    owned = []
    for (args, addend, onw), outs in zip(calls, outputs):
        owned.append(_storages([v for v in args.values() if isinstance(v, torch.Tensor)] + [addend, onw, *outs]))
    private = [_storages(t) - o for t, o in zip(touched, owned)]
    # Buffers a call's launches use beyond its own arguments and outputs (the split path's partials) belong to
    # that call alone; and no launch of one call touches anything of the other.
    assert not (private[0] & private[1]), "two calls' launches shared a buffer"
    assert not (_storages(touched[0]) & (owned[1] | private[1])), "call A's launches touched call B's memory"
    assert not (_storages(touched[1]) & (owned[0] | private[0])), "call B's launches touched call A's memory"


# --- CUDA: concurrent graph replays -----------------------------------------------------------------------------
def _chain(op: str, prefix: torch.Tensor, blocks: torch.Tensor, weights: dict, K: int) -> torch.Tensor:
    """CHAIN calls, each consuming the previous call's output as its prefix (the fused op also adds an addend,
    writes its snapshot into slot K and normalises its output)."""
    x = prefix
    for _ in range(CHAIN):
        if op == "plain":
            x = k3_ops.attn_res(x, blocks, weights["norm"], weights["proj"], K, 1e-6)
        else:
            out, new_prefix = k3_ops.fused_attn_res(x, weights["addend"], blocks, weights["norm"], weights["proj"],
                                                    K, 1e-6, block_write_idx=K, out_norm_weight=weights["onw"],
                                                    out_norm_eps=1e-5)
            x = out + new_prefix * 0.5  # both results feed the next call
    return x


def _inputs(T: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    args = Sample(T=T, K=K, cap=CAP, H=H).make(device="cuda", seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    weights = dict(norm=args["norm_weight"], proj=args["proj_weight"],
                   addend=(torch.randn(T, H, device="cuda", generator=g) * 0.1).bfloat16(),
                   onw=1 + 0.1 * torch.randn(H, device="cuda", generator=g))
    return args["prefix_sum"], args["block_residual"], weights


class _Captured:
    """One chain captured as a graph on ``capture_stream``, with its static inputs and eager reference."""

    def __init__(self, op: str, T: int, K: int, seed: int, capture_stream: torch.cuda.Stream):
        self.prefix, self.blocks, self.weights = _inputs(T, K, seed)
        self.blocks_before = self.blocks.clone()
        self.expected = _chain(op, self.prefix, self.blocks.clone(), self.weights, K)
        self.expected_blocks = self.blocks_before.clone()
        _chain(op, self.prefix, self.expected_blocks, self.weights, K)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(capture_stream):
            _chain(op, self.prefix, self.blocks, self.weights, K)  # warm on the capture stream
            capture_stream.synchronize()
            self.blocks.copy_(self.blocks_before)
            with torch.cuda.graph(self.graph, stream=capture_stream):
                self.out = _chain(op, self.prefix, self.blocks, self.weights, K)
        torch.cuda.synchronize()

    def check(self) -> None:
        assert torch.equal(self.out.view(torch.int16), self.expected.view(torch.int16))
        assert torch.equal(self.blocks.view(torch.int16), self.expected_blocks.view(torch.int16))


def _replay_concurrently(graphs: list[_Captured], streams: list[torch.cuda.Stream]) -> int:
    """REPLAYS rounds; in each, every graph replays on its own stream at the same time. Returns the number of
    rounds in which some result differed from its eager chain."""
    bad = 0
    for _ in range(REPLAYS):
        for g in graphs:
            g.blocks.copy_(g.blocks_before)  # the fused chain writes its snapshots again on every replay
        torch.cuda.synchronize()
        for g, s in zip(graphs, streams):
            with torch.cuda.stream(s):
                g.graph.replay()
        torch.cuda.synchronize()
        for g in graphs:
            try:
                g.check()
            except AssertionError:
                bad += 1
    return bad


@pytest.fixture(scope="module")
def warm():
    k3_ops.warmup(H, torch.bfloat16, "cuda", max_num_valid_blocks=8, max_num_tokens=1024)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("op", ["plain", "fused"])
@pytest.mark.parametrize("K", [1, 2, 4, 8], ids=lambda k: f"K{k}")
# The cluster kernel with 8 CTAs per token (T <= 8; T = 24, K = 4), 4 (T = 24, K = 8) and 2 (T = 33, 64, K = 8);
# 4100: K >= 3 stream.
@pytest.mark.parametrize("T", [1, 4, 8, 24, 33, 64, 4100], ids=lambda t: f"T{t}")
def test_two_streams_replay_concurrently(warm, op, T, K):
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    graphs = [_Captured(op, T, K, seed=1, capture_stream=s1), _Captured(op, T, K, seed=2, capture_stream=s2)]
    assert _replay_concurrently(graphs, [s1, s2]) == 0


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("op", ["plain", "fused"])
@pytest.mark.parametrize("T,K", [(1, 8), (8, 4), (64, 8)], ids=["T1-K8", "T8-K4", "T64-K8"])
def test_same_stream_capture_two_stream_replay(warm, op, T, K):
    capture = torch.cuda.Stream()
    graphs = [_Captured(op, T, K, seed=3, capture_stream=capture), _Captured(op, T, K, seed=4, capture_stream=capture)]
    assert _replay_concurrently(graphs, [torch.cuda.Stream(), torch.cuda.Stream()]) == 0


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("op", ["plain", "fused"])
@pytest.mark.parametrize("T,K", [(1, 1), (1, 4), (1, 8), (24, 4), (64, 8), (512, 8), (4100, 8)],
                         ids=["T1-K1", "T1-K4", "T1-K8", "T24-K4", "T64-K8", "T512-K8", "T4100-K8"])
def test_pdl_chain_matches_without_pdl(op, T, K, monkeypatch):
    """A captured chain in which each call consumes its predecessor's output: with PDL a launch may start while
    its predecessor drains, so a read before the dependency wait would show as different bits."""
    from k3_ops.backends import cuda

    results = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("K3_OPS_PDL", pdl)
        cuda.clear_plan_cache()
        k3_ops.warmup(H, torch.bfloat16, "cuda", max_num_valid_blocks=8, max_num_tokens=1024)
        g = _Captured(op, T, K, seed=5, capture_stream=torch.cuda.Stream())
        for _ in range(3):
            g.blocks.copy_(g.blocks_before)
            g.graph.replay()
            torch.cuda.synchronize()
            g.check()
        results[pdl] = g.out.clone()
    cuda.clear_plan_cache()
    assert torch.equal(results["1"].view(torch.int16), results["0"].view(torch.int16))
