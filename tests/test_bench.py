"""The benchmark package on a CPU: every section runs through the reference on tiny shapes, writes what it says,
and measures what it claims (timings themselves are not asserted beyond being positive and finite); the pure
logic of the GPU methods (cold input sets, floors and limits, the layer step's flushes) is checked here too, and
the GPU methods themselves run in the CUDA tests at the end."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from k3_ops import bench, reference
from k3_ops.bench import Ops, Options, Timer, cli, common, fused, host, layer, mix, timing, train, writer

from conftest import requires_interpreter

TINY = dict(device="cpu", hidden=32, rep_ms=0.5, quick=True, progress=False)


@pytest.fixture(scope="module")
def timer():
    return Timer("cpu", rep_ms=0.5, quick=True)


def _positive(x) -> bool:
    return isinstance(x, float) and x > 0 and math.isfinite(x)


def test_options_pick_prefers_explicit_then_quick_then_device_then_all():
    defaults = {"all": {"hidden": 7, "tokens": [1]}, "cpu": {"tokens": [2]}, "quick": {"tokens": [3]},
                "quick-cpu": {"hidden": 5}}
    assert Options(device="cpu").pick(defaults, "tokens") == [2]
    assert Options(device="cpu").pick(defaults, "hidden") == 7
    assert Options(device="cpu", quick=True).pick(defaults, "tokens") == [3]
    assert Options(device="cpu", quick=True).pick(defaults, "hidden") == 5
    assert Options(device="cpu", quick=True, tokens=[9]).pick(defaults, "tokens") == [9]
    with pytest.raises(KeyError, match="layouts"):
        Options(device="cpu").pick(defaults, "layouts")


def test_timer_on_cpu(timer):
    assert _positive(timer.wall(lambda: torch.ones(8).sum()))
    assert timer.launch(lambda: None) > 0  # a CPU has no launch timing: wall time per call
    assert timer.mode == "wall"
    with pytest.raises(RuntimeError, match="graph replay needs a CUDA device, got cpu"):
        timer.graph(lambda: None)
    limits = timer.limits()
    assert _positive(limits["copy_bandwidth_Bps"]) and limits["graph_node_us"] is None
    assert limits["l2_bytes"] is None  # no L2 state to time on a CPU
    assert timer.limits() is limits  # measured once per run, reported beside every section
    with pytest.raises(RuntimeError, match="cold-L2 graph replay needs a CUDA device, got cpu"):
        timer.cold([lambda: None])


def test_wall_counts_every_call(timer):
    calls = []
    timer.wall(lambda: calls.append(1), calls=4)
    assert len(calls) == 1 + 3 * 4  # one warm-up call, then three batches (quick) of four
    assert timer.last.samples == 3  # the spread of those three batches


@pytest.mark.parametrize("samples, median, q1, q3", [
    ([5.0], 5.0, 5.0, 5.0),
    ([1.0, 2.0, 3.0, 4.0, 100.0], 3.0, 2.0, 4.0),
    ([4.0, 1.0, 3.0, 2.0], 2.5, 1.75, 3.25),
], ids=["one-sample", "five-with-outlier", "four-unsorted"])
def test_spread_is_the_median_and_interquartile_range(samples, median, q1, q3):
    s = timing.Spread.of(samples)
    assert (s.median, s.q1, s.q3, s.samples) == (median, pytest.approx(q1), pytest.approx(q3), len(samples))
    assert s.relative == pytest.approx((q3 - q1) / median)
    assert s.wide == (s.relative > timing.WIDE_SPREAD)
    with pytest.raises(ValueError, match="at least one sample"):
        timing.Spread.of([])


def test_measure_notes_a_wide_spread():
    class Noisy(Timer):
        def wall(self, fn, calls=None):
            fn()
            return self._record([1.0, 1.0, 2.0, 3.0, 3.0])

    row, notes = {"bytes": 10}, []
    common.measure(Noisy("cpu"), {"x": lambda: torch.ones(1)}, (), row, 1.0, False, notes, "T=1")
    assert row["us:x"] == 2.0 and row["spread:x"] == pytest.approx(1.0)
    assert notes == ["wide spread: x at T=1: interquartile range 100 % of the median over 5 samples"]


@pytest.mark.parametrize("batches", [3, 7], ids=["quick", "full"])
def test_phases_never_report_a_phase_slower_than_its_whole(batches):
    """Each sample times both phases of one call, so the medians keep the order (here the second phase is the
    slow and noisy one, as a backward beside its forward)."""
    import random

    rng = random.Random(batches)
    t = Timer("cpu", rep_ms=0.2)
    t.batches = batches

    def first():
        return rng.random() * 1e-4

    def second(x):
        end = timing.time.perf_counter() + x + rng.random() * 5e-4
        while timing.time.perf_counter() < end:
            pass

    whole, fwd, bwd = t.phases(lambda: first(), second)
    assert 0 < fwd <= whole and 0 < bwd <= whole
    assert t.last.median == whole and t.last.samples == batches


@pytest.mark.parametrize("footprint, allocated, l2", [
    (57_344, 200_704, 50 * 2**20),  # T = 1, K = 1: thousands of small sets
    (44 * 2**20, 150 * 2**20, 50 * 2**20),  # T = 1024, K = 1: a few
    (704 * 2**20, 2600 * 2**20, 50 * 2**20),  # T = 16384: one set is past 3x the L2 already
], ids=["T1-K1", "T1024-K1", "T16384"])
def test_cold_set_count_makes_the_sets_exceed_three_l2(footprint, allocated, l2):
    n = timing.cold_set_count(footprint, allocated, l2)
    assert n * footprint > timing.COLD_FACTOR * l2
    assert n >= 2  # two at least, so that no call reads what the call before it left in the L2
    assert n == 2 or (n - 1) * footprint <= timing.COLD_FACTOR * l2  # and no more than that takes


def test_cold_set_count_keeps_within_its_memory_budget():
    assert timing.cold_set_count(1000, 4000, 10**6, budget=40_000) == 10  # 3001 wanted, 10 fit
    assert timing.cold_set_count(1000, 4000, 10**6, max_sets=100) == 100
    for bad, match in (((0, 1, 1), "footprint must be > 0, got 0"), ((2, 1, 5), "allocated must be >= footprint")):
        with pytest.raises(ValueError, match=match):
            timing.cold_set_count(*bad)


@pytest.mark.parametrize("layout", ["token", "block"])
def test_cold_sets_are_apart_in_memory_and_poisoned_past_k(layout):
    sets = common.ColdSets(3, 2, 4, 8, torch.bfloat16, torch.float32, torch.device("cpu"), layout, K=2)
    ptrs = set()
    for i in range(3):
        prefix, blocks, nw, pw, K, _ = sets.attn_res_args(i, 2)
        assert prefix.shape == (2, 8) and blocks.shape == (2, 4, 8) and nw.shape == (8,) and pw.shape == (1, 8)
        assert blocks[:, 2:].isnan().all() and not blocks[:, :2].isnan().any() and K == 2
        ptrs.add((prefix.data_ptr(), blocks.data_ptr(), nw.data_ptr()))
        assert blocks.untyped_storage().data_ptr() == sets.storage.untyped_storage().data_ptr()  # views
        fargs = sets.fused_args(i, 2, 2)
        assert fargs[7] == 2 and fargs[8].shape == (8,) and fargs[1].data_ptr() != prefix.data_ptr()
    assert len(ptrs) == 3  # every set its own rows and weights
    assert not torch.equal(sets.attn_res_args(0, 2)[2], sets.attn_res_args(1, 2)[2])
    assert common.ColdSets.allocated(2, 4, 8, 2, 4) == (4 + 2) * 2 * 8 * 2 + 3 * 8 * 4
    assert common.footprint(2, 8, 2, 3, 2, 4) == 3 * 2 * 8 * 2 + 2 * 8 * 4


def test_floor_cells_take_the_fastest_floor_and_the_limit():
    row = {"bytes": 3_000_000, "us:k3_ops": 10.0, "us:floor": 9.0, "us:floor_stream": 6.0, "us:floor_row": 7.5}
    common.floor_cells(row, "k3_ops", {"graph_node_us": 1.5, "copy_bandwidth_Bps": 1e12})
    assert (row["floor_us"], row["floor_geometry"], row["floor_frac"]) == (6.0, "stream", 0.6)
    assert row["limit_us"] == pytest.approx(1.5 + 3.0) and row["limit_frac"] == pytest.approx(0.45)
    step = {"bytes": 1_000_000, "us:k3_ops": 100.0}
    common.floor_cells(step, "k3_ops", {"graph_node_us": 2.0, "copy_bandwidth_Bps": 1e12}, nodes=49)
    assert "floor_us" not in step and step["limit_us"] == pytest.approx(49 * 2.0 + 1.0)
    cpu = {"bytes": 10, "us:k3_ops": 1.0}
    common.floor_cells(cpu, "k3_ops", {"graph_node_us": None, "copy_bandwidth_Bps": 1e9})
    assert set(cpu) == {"bytes", "us:k3_ops"}  # nothing measured to make a floor or a limit from


@pytest.mark.parametrize("requested, on_cuda, on_cpu", [
    (None, ["cold"], ["warm"]), (["warm", "cold"], ["warm", "cold"], ["warm"]), (["warm"], ["warm"], ["warm"]),
], ids=["default-cold", "both", "warm"])
def test_l2_modes(requested, on_cuda, on_cpu):
    opts = Options(device="cpu", l2=requested)
    assert common.l2_modes(opts, torch.device("cuda")) == on_cuda
    assert common.l2_modes(opts, torch.device("cpu")) == on_cpu
    with pytest.raises(ValueError, match="l2 must name states from .* got 'tepid'"):
        common.l2_modes(Options(l2=["tepid"]), torch.device("cuda"))


@pytest.mark.parametrize("estimate_us, sleeps", [(5.0, 1), (400.0, 0)], ids=["light-settles", "heavy-does-not"])
def test_timer_settles_before_a_light_call_that_follows_heavy_work(monkeypatch, estimate_us, sleeps):
    from k3_ops.bench import timing

    slept = []
    monkeypatch.setattr(timing.time, "sleep", slept.append)
    t = Timer("cpu", settle_s=0.25)
    t._settle(estimate_us)
    assert slept == []  # nothing heavy yet
    t.after_heavy_work()
    t._settle(estimate_us)
    t._settle(estimate_us)  # once settled, a second light call does not wait again
    assert slept == [0.25] * sleeps
    off = Timer("cpu", settle_s=0.0)
    off.after_heavy_work()
    off._settle(5.0)
    assert len(slept) == sleeps


def test_commit_env_override(monkeypatch):
    monkeypatch.setenv("K3_OPS_COMMIT", "abc1234")
    assert common.commit() == "abc1234"
    assert common.environment(torch.device("cpu"))["commit"] == "abc1234"


@pytest.mark.parametrize("layout", ["token", "block"])
def test_problem_poisons_only_the_unused_slots(layout):
    p = common.Problem(5, 4, 8, torch.bfloat16, torch.device("cpu"), layout)
    p.poison(2)
    blocks = p.blocks(3)
    assert blocks.shape == (3, 4, 8)
    assert blocks[:, 2:].isnan().all() and not blocks[:, :2].isnan().any()
    assert blocks.data_ptr() == p.storage.data_ptr()  # a view, never a copy
    p.restore(2)
    assert not p.blocks(5).isnan().any()


def test_unfused_sequence_matches_the_fused_reference():
    p = common.Problem(4, 5, 32, torch.float32, torch.device("cpu"), "token")
    p.poison(2)
    args = p.fused_args(4, 2, 2)
    ref_out, ref_prefix = reference.fused_attn_res_reference(*args[:7], *args[7:])
    snapshot = p.blocks(4)[:, 2].clone()
    p.blocks(4)[:, 2] = float("nan")
    out, new_prefix = common.unfused(reference.attn_res_reference)(*args)
    torch.testing.assert_close(new_prefix, ref_prefix, rtol=0, atol=0)
    torch.testing.assert_close(p.blocks(4)[:, 2], snapshot, rtol=0, atol=0)  # the slot was written again
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)


def test_mix_section_rows_and_bandwidth(timer):
    res = mix.run(Options(tokens=[1, 3], blocks=[0, 2], l2=["warm", "cold"], **TINY), timer)
    assert [(r["layout"], r["l2"], r["T"], r["K"]) for r in res["rows"]] == [
        (lay, "warm", T, K) for lay in ("token", "block") for K in (0, 2) for T in (1, 3)]  # a CPU has no cold L2
    bw = res["limits"]["copy_bandwidth_Bps"]
    for r in res["rows"]:
        assert r["bytes"] == (r["K"] + 2) * r["T"] * 32 * 2
        # On a CPU the op is the reference formula: no eager row beside it, no floor kernels.
        assert {k.split(":")[1] for k in r if k.startswith("us:")} == {"k3_ops"}
        assert _positive(r["us:k3_ops"]) and r["spread:k3_ops"] >= 0
        assert r["bw:k3_ops"] == pytest.approx(r["bytes"] / (r["us:k3_ops"] * 1e-6) / bw)
    assert not [n for n in res["notes"] if "non-finite" in n]  # NaN slots were never read
    assert res["params"]["timing"] == "wall time per call" and res["params"]["l2"] == ["warm"]
    assert res["params"]["threads"] == torch.get_num_threads() and "not a kernel benchmark" in res["params"]["cpu_note"]
    assert res["plot"] == {"series": ["k3_ops"], "refs": [], "floor": False}
    assert "not a kernel benchmark" in writer.render(res)


def test_mix_section_notes_a_kernel_that_reads_unused_slots(timer):
    def reads_everything(prefix, blocks, nw, pw, K, eps):
        return reference.attn_res_reference(prefix, blocks, nw, pw, blocks.size(1), eps)

    res = mix.run(Options(tokens=[2], blocks=[1], layouts=["token"], refs=False, **TINY), timer,
                  {"bad": Ops(attn_res=reads_everything)})
    assert [n for n in res["notes"] if "non-finite" in n] == ["bad returned non-finite values at token-major T=2 K=1 "
                                                              "warm L2"]


def test_fused_section_times_every_variant_beside_the_unfused_row(timer):
    k3 = common.k3_ops_ops()
    res = fused.run(Options(tokens=[2], blocks=[1, 8], capacity=8, **TINY), timer,
                    {"a": k3, "b": Ops(fused=k3.fused)})
    rows = res["rows"]
    assert [(r["K"], r["write"]) for r in rows] == [(1, 1), (8, -1)]  # the snapshot needs a free slot
    for r in rows:
        assert all(_positive(r[f"us:{n}"]) for n in ("a", "a_inplace", "b", "unfused"))
        assert "us:b_inplace" not in r  # b has no in-place form
        assert r["bytes"] == (r["K"] + 4 + (r["write"] >= 0)) * r["T"] * 32 * 2
        assert r["vs_unfused"] == pytest.approx(r["us:unfused"] / r["us:a"])
    assert res["plot"]["series"] == ["a", "b", "a_inplace"] and res["plot"]["refs"] == ["unfused"]


def test_fused_section_times_the_in_place_call_on_its_own_prefix(timer):
    """The in-place call stores a new prefix on every call: it must not drift the prefix the other calls read."""
    seen = []

    def spy(prefix, *args):
        seen.append(prefix.clone())
        return common.k3_ops_ops().fused(prefix, *args)

    k3 = common.k3_ops_ops()
    fused.run(Options(tokens=[2], blocks=[1], refs=False, **TINY), timer,
              {"k": Ops(fused=spy, fused_inplace=k3.fused_inplace)})
    assert len(seen) > 2 and all(torch.equal(seen[0], p) for p in seen)


def _floor_truth(rows: torch.Tensor, programs: int, block: int, eps: float, norm: bool) -> torch.Tensor:
    """What the floor kernel computes, in float64: each program's columns of every row scaled by that program's
    partial mean square, summed over rows (and, with the norm, scaled again by the mix's partial mean square)."""
    H = rows.shape[-1]
    out = torch.empty(rows.shape[0], H, dtype=torch.float64)
    for p in range(programs):
        c = slice(p * block, min(H, (p + 1) * block))
        x = rows[..., c].double()
        y = (x * torch.rsqrt(x.square().sum(-1, keepdim=True) / H + eps)).sum(1)
        if norm:
            y = y * torch.rsqrt(y.square().sum(-1, keepdim=True) / H + eps)
        out[:, c] = y
    return out


# Tile geometry: T = 3 splits a token over 8 programs (no exchange between them), T = 20 takes one program per
# token. Stream geometry: a token's columns over several programs at every T (H = 1000 in pieces of 256 columns:
# 4 programs, the last one's columns partly masked), the prefix apart from the block rows' tile. Row geometry: one
# program per token over next_pow2(H) columns (H = 1000: the last 24 masked), the rows one at a time.
@pytest.mark.parametrize("geometry", ["tile", "stream", "row"])
@pytest.mark.parametrize("T", [3, 20], ids=lambda T: f"T{T}")
@pytest.mark.parametrize("K", [0, 2, 8], ids=lambda K: f"K{K}")
def test_floor_kernel_reads_every_row_and_stores_what_the_call_stores(device, T, K, geometry, monkeypatch):
    """The floor under a serving call (bench.floor) does the call's loads, stores and reductions: new_prefix
    and the snapshot are torch's add bit for bit, nothing else in the buffer changes, NaN capacity is never read,
    and its output depends on every candidate row as the kernel's stated arithmetic says."""
    from conftest import triton_interpreted

    if device == "cpu" and not triton_interpreted():
        pytest.skip("the floor kernel runs on CPU tensors only under the Triton interpreter")
    from k3_ops.bench import floor

    monkeypatch.setattr(floor, "STREAM_BLOCK", 256)
    H, cap, eps = (64 if geometry == "tile" else 1000), 9, 1e-6
    problem = common.Problem(T, cap, H, torch.bfloat16, torch.device(device), "token")
    problem.poison(K)
    write = K if K < cap else -1
    args = problem.fused_args(T, K, write)
    before = problem.blocks(T).clone()
    out, new_prefix = floor.fused_floor(*args, geometry=geometry)
    if device == "cpu":  # the interpreter's bf16 store truncates (test_kernels_interpreter): one ulp
        torch.testing.assert_close(new_prefix, args[0] + args[1], rtol=2**-7, atol=0)
    else:
        assert torch.equal(new_prefix, args[0] + args[1])
    blocks = problem.blocks(T)
    others = [i for i in range(cap) if i != write]
    assert torch.equal(blocks[:, others].view(torch.int16), before[:, others].view(torch.int16))
    assert torch.equal(blocks[:, write], new_prefix)
    rows_, programs, block, _ = floor._geometry(T, K, H, geometry)
    if geometry == "tile":
        assert programs == (8 if T <= floor.SPLIT_MAX_T else 1)
    elif geometry == "row":
        assert (programs, block, rows_) == (1, 1024, 1)
    else:  # the block rows alone in the tile; the columns cover H
        assert (programs, block, rows_) == (4, 256, max(1, K))
    candidates = torch.cat([before[:, :K], new_prefix[:, None]], 1).cpu()
    truth = _floor_truth(candidates, programs, block, eps, norm=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), truth, rtol=2**-7, atol=1e-2)
    mix = floor.mix_floor(*problem.attn_res_args(T, K), geometry=geometry)
    truth = _floor_truth(torch.cat([before[:, :K], args[0][:, None]], 1).cpu(), programs, block, eps, norm=False)
    torch.testing.assert_close(mix.cpu().double(), truth, rtol=2**-7, atol=1e-2)
    if geometry == "row":  # every form of the row geometry (variants --floors) does the same work
        for warps, stages in ((8, 1), (4, 2)):
            other = floor.row_form(floor.mix_floor, warps, stages)(*problem.attn_res_args(T, K))
            torch.testing.assert_close(other.cpu().double(), truth, rtol=2**-7, atol=1e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_gpu_sections_time_warm_and_cold_with_the_floors_and_train_only_differentiable_references():
    """On a GPU the mix, fused and layer sections time warm and cold rows with the floors in three geometries
    (the cold rows over input sets together past 3x the L2; the layer step's flushes subtracted), and the train
    section (which steps every reference through autograd) does not take the floors, which have no backward."""
    # T = 64 at H = 1024: a few hundred cold sets (H = 7168 at T = 1 takes thousands).
    opts = Options(device="cuda", hidden=1024, tokens=[64], blocks=[2], rep_ms=0.5, quick=True, progress=False,
                   l2=["warm", "cold"])
    timer = Timer("cuda", rep_ms=0.5, quick=True)
    assert timer.l2_bytes >= 2**20
    for section, ours in ((mix, ("k3_ops",)), (fused, ("k3_ops", "k3_ops_inplace"))):
        res = section.run(opts, timer)
        rows = {r["l2"]: r for r in res["rows"] if r["layout"] == "token"}
        assert set(rows) == {"warm", "cold"}
        for r in rows.values():
            assert all(_positive(r[f"us:{n}"]) for n in (*ours, "floor", "floor_stream", "floor_row"))
            assert r["floor_us"] == min(r[f"us:{n}"] for n in ("floor", "floor_stream", "floor_row"))
            assert _positive(r["limit_us"]) and _positive(r["floor_frac"])
        assert rows["cold"]["cold_ratio"] > 3 and rows["cold"]["sets"] >= 2
        assert not [n for n in res["notes"] if "non-finite" in n]
    res = layer.run(Options(device="cuda", hidden=1024, tokens=[4], rep_ms=0.5, quick=True, progress=False,
                            l2=["warm", "cold"]), timer)
    steps = ("k3_ops", "k3_ops_inplace", "unfused", "floor", "floor_stream", "floor_row")
    for r in res["rows"]:
        assert all(_positive(r[f"us:{n}"]) for n in steps)
    cold = next(r for r in res["rows"] if r["l2"] == "cold")
    assert cold["us:k3_ops"] == pytest.approx(cold["with_flush:k3_ops"] - cold["flush_us"])
    assert not [n for n in res["notes"] if "non-finite" in n]
    res = train.run(opts, timer)
    assert {k.split(":")[1] for k in res["rows"][0] if k.startswith("us:")} == {"k3_ops", "eager", "compile"}
    for n in ("k3_ops", "eager", "compile"):
        assert res["rows"][0][f"bwd_us:{n}"] <= res["rows"][0][f"us:{n}"]
    # The backward's floor, timed as the backward phase of the same steps.
    r = res["rows"][0]
    assert _positive(r["bwd_floor_us"]) and r["bwd_vs_floor"] == pytest.approx(r["bwd_floor_us"] / r["bwd_us:k3_ops"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_gpu_cold_timing_rotates_every_set_in_one_graph():
    """Timer.cold runs each call of its list in the graph it replays: every set's output is written."""
    timer = Timer("cuda", rep_ms=0.5, quick=True)
    outs = [torch.zeros(4, device="cuda") for _ in range(5)]
    us = timer.cold([lambda o=o: o.add_(1.0) for o in outs])
    assert _positive(us)
    counts = [int(o[0].item()) for o in outs]
    # Each set as often as the others (the first one warmed once more), replayed several times.
    assert max(counts) - min(counts) <= 1 and min(counts) > 2


def test_layer_step_in_place_equals_the_fused_step():
    step = layer.Step(3, 32, 9, 4, torch.float32, torch.float32, torch.device("cpu"), "token")
    k3 = common.k3_ops_ops()
    before = step.prefix.clone()
    out = step.run(k3.fused, k3.attn_res)
    blocks = step.blocks.clone()
    step.blocks.fill_(float("nan"))
    out_inplace = step.run_inplace(k3.fused_inplace, k3.attn_res)
    torch.testing.assert_close(out_inplace, out, rtol=0, atol=0)
    torch.testing.assert_close(step.blocks[:, :step.final_k], blocks[:, :step.final_k], rtol=0, atol=0)
    assert torch.equal(step.prefix, before) and not torch.equal(step.running, before)  # only its own residual


def test_layer_flush_reads_a_new_l2_window_each_time_and_counts_in_the_step():
    flush = layer.Flush(4096, torch.device("cpu"))
    assert flush.windows.shape == (3, 1024)
    flush.windows[1] = 2.0
    flush.windows[2] = 3.0
    assert [float(flush()) for _ in range(4)] == [1024.0, 2048.0, 3072.0, 1024.0]  # each window in turn
    calls = []
    step = layer.Step(2, 16, 9, 3, torch.float32, torch.float32, torch.device("cpu"), "token")
    k3 = common.k3_ops_ops()
    step.run(k3.fused, k3.attn_res, between=lambda: calls.append(1))
    assert len(calls) == step.calls()  # one read before every call of the step
    reads = flush.reads
    flush.run(step.calls())
    assert flush.reads == reads + step.calls()
    assert layer.subtract_flush(900.0, 850.0) == 50.0
    with pytest.raises(ValueError, match="times must be >= 0"):
        layer.subtract_flush(-1.0, 2.0)
    with pytest.raises(ValueError, match="l2 must be >= 4 bytes, got 2"):
        layer.Flush(2, torch.device("cpu"))


def test_layer_schedule_snapshots_every_third_layer_until_the_buffer_is_full():
    sites = layer.schedule(24, 9)
    assert len(sites) == 48
    writes = [(i // 2, w) for i, (_, w) in enumerate(sites) if w >= 0]
    assert writes == [(layer_, k) for k, layer_ in enumerate(range(0, 24, 3))]
    assert all(w == -1 for _, w in sites[1::2])  # site 2 never writes
    for (k1, w1), (k2, _) in zip(sites[0::2], sites[1::2]):
        assert w1 in (-1, k1) and k2 == k1 + (w1 >= 0)  # site 2 reads the snapshot site 1 wrote
    assert layer.schedule(30, 5)[-1][0] == 4  # capacity 5: at most 4 snapshots (k < capacity - 1)


def test_layer_step_fused_equals_unfused_on_cpu():
    step = layer.Step(3, 32, 9, 6, torch.float32, torch.float32, torch.device("cpu"), "token")
    k3 = common.k3_ops_ops()
    out = step.run(k3.fused, k3.attn_res)
    blocks = step.blocks.clone()
    step.blocks.fill_(float("nan"))
    ref = step.run(common.unfused(reference.attn_res_reference), reference.attn_res_reference)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.blocks[:, :step.final_k], blocks[:, :step.final_k], rtol=1e-5, atol=1e-5)
    assert step.final_k == 2 and step.blocks[:, 2:].isnan().all()


def test_layer_step_bytes_count_every_row_once():
    # Two layers at capacity 3: site (K, write) = (0, 0), (1, -1), (1, -1), (1, -1); final mix K = 1.
    step = layer.Step(2, 16, 3, 2, torch.bfloat16, torch.bfloat16, torch.device("cpu"), "token")
    assert step.sites == [(0, 0), (1, -1), (1, -1), (1, -1)]
    rows = (0 + 2 + 3) + 3 * (1 + 2 + 2) + (1 + 1 + 1)  # reads + writes per call
    assert step.bytes() == rows * 2 * 16 * 2


def test_layer_section(timer):
    res = layer.run(Options(tokens=[1, 2], **TINY), timer)
    assert [(r["T"], r["l2"]) for r in res["rows"]] == [(1, "warm"), (2, "warm")]
    for r in res["rows"]:
        assert r["calls"] == 49 and r["K_final"] == 8
        assert r["site:k3_ops"] == pytest.approx(r["us:k3_ops"] / 49) and _positive(r["us:unfused"])
        assert _positive(r["us:k3_ops_inplace"])
        assert r["bw_floor"] == pytest.approx(r["bytes"] / res["limits"]["copy_bandwidth_Bps"] * 1e6)
        assert "flush_us" not in r  # no cold step on a CPU


def test_host_section_has_torch_add_and_every_call(timer):
    res = host.run(Options(tokens=[1], **TINY), timer)
    assert [(r["impl"], r["call"]) for r in res["rows"]] == [
        ("torch", "torch.add"), ("k3_ops", "attn_res"), ("k3_ops", "fused_attn_res"), ("k3_ops", "fused_attn_res_"),
        ("k3_ops", "fwd+bwd")]
    assert all(_positive(r["wall_us"]) and r["K"] == 8 for r in res["rows"])
    add = res["rows"][0]["wall_us"]
    assert all(r["floor_frac"] == pytest.approx(add / r["wall_us"]) for r in res["rows"][1:])


def test_train_section(timer):
    res = train.run(Options(tokens=[3, 5], blocks=[2], **TINY), timer)
    assert [(r["T"], r["K"]) for r in res["rows"]] == [(3, 2), (5, 2)]
    for r in res["rows"]:
        for n in ("k3_ops", "eager"):
            assert _positive(r[f"us:{n}"]) and _positive(r[f"fwd_us:{n}"]) and _positive(r[f"bwd_us:{n}"])
            # Both phases from the same steps: neither is reported slower than the step.
            assert r[f"fwd_us:{n}"] <= r[f"us:{n}"] and r[f"bwd_us:{n}"] <= r[f"us:{n}"]
        assert r["bytes"] == r["T"] * 32 * 2 * ((2 + 1) + 1 + (8 + 1))  # capacity 8: the training default
        assert not any(k.startswith("bwd_op_us:") for k in r)  # the op alone only beside backward variants
    if timer.device.type == "cpu":
        # Why k3_ops's CPU step may be the slower: said with the table, as the CPU rows are no kernel figures.
        assert any("recomputes the forward" in n and "eager autograd keeps" in n for n in res["notes"])


def test_train_section_times_backward_variants_as_the_op_alone(timer):
    k3 = common.k3_ops_ops()
    res = train.run(Options(tokens=[3], blocks=[2], refs=False, **TINY), timer,
                    {"k3_ops": k3, "bwd[x]": Ops(backward=k3.backward)})
    row = res["rows"][0]
    assert _positive(row["bwd_op_us:k3_ops"]) and _positive(row["bwd_op_us:bwd[x]"])


def test_train_section_notes_a_reference_that_fails_and_times_the_rest(timer):
    """A reference formula that raises (torch.compile's Inductor has, on some torch builds) costs its own cells
    and a note, not the run: the op and the other references are still timed."""
    def broken(*args):
        raise AssertionError("inductor tiling\nsecond line")

    res = train.run(Options(tokens=[3], blocks=[2], **TINY), timer,
                    refs={"eager": reference.attn_res_reference, "broken": broken})
    row = res["rows"][0]
    assert _positive(row["us:k3_ops"]) and _positive(row["us:eager"]) and math.isnan(row["us:broken"])
    assert [n for n in res["notes"] if not n.startswith(("wide spread", "CPU:"))] == [
        "broken failed at token-major T=3 K=2: AssertionError: inductor tiling"]


def test_step_fn_returns_the_gradients_of_all_four_inputs():
    p = common.Problem(3, 4, 16, torch.float32, torch.device("cpu"), "token")
    p.poison(2)
    grads = train.step_fn(reference.attn_res_reference, p.attn_res_args(3, 2), torch.ones(3, 16))()
    assert [g.shape for g in grads] == [(3, 16), (3, 4, 16), (16,), (1, 16)]
    assert (grads[1][:, 2:] == 0).all()


def test_cli_writes_json_markdown_and_plot_and_report_renders_it(tmp_path, capsys):
    threads = torch.get_num_threads()
    results = bench.main(["mix", "fused", "--device", "cpu", "--quick", "--hidden", "32", "--tokens", "1,2",
                          "--blocks", "1", "--rep", "0.5", "--threads", "1", "--out", str(tmp_path)])
    assert torch.get_num_threads() == threads  # the fixed count holds while timing only
    assert set(results) == {"mix", "fused", "_written"}
    out = capsys.readouterr().out
    assert "k3_ops us" in out and f"# wrote {tmp_path / 'mix.json'}" in out
    assert "1 CPU thread (torch.set_num_threads)" in out and "not a kernel benchmark" in out
    saved = json.loads((tmp_path / "mix.json").read_text())
    assert saved["rows"] == results["mix"]["rows"] and saved["environment"]["torch"] == torch.__version__
    assert saved["params"]["threads"] == 1
    md = (tmp_path / "mix.md").read_text().splitlines()
    table = [line for line in md if line.startswith("|")]
    assert table[0].startswith("| layout | L2 | T | K | k3_ops us") and len(table) == 2 + len(saved["rows"])
    if "png" in results["_written"]["mix"]:
        assert (tmp_path / "mix.png").read_bytes()[:4] == b"\x89PNG"
    bench.main(["report", str(tmp_path / "fused.json")])
    assert capsys.readouterr().out == writer.render(results["fused"], "markdown") + "\n"
    pytest.importorskip("matplotlib")
    bench.main(["report", str(tmp_path / "mix.json"), "--plot", str(tmp_path / "again")])
    assert (tmp_path / "again" / "mix.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_formats_write_only_what_is_asked(tmp_path):
    bench.main(["host", "--device", "cpu", "--quick", "--hidden", "32", "--tokens", "1", "--rep", "0.5",
                "--formats", "json", "--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host.json"]


@pytest.mark.parametrize("argv, message", [
    (["mixx", "--device", "cpu"], "unknown section 'mixx': choose from mix, fused, layer, host, train"),
    (["mix", "--l2", "tepid"], "argument --l2: must be warm, cold or both, got 'tepid'"),
    (["mix", "--formats", "json,pdf"], "--formats must come from json, md, png, got 'pdf'"),
    (["mix", "--device", "tpu"], "argument --device: must be one of cpu, cuda, npu with an optional index (cuda:1), "
                                 "got 'tpu'"),
    (["mix", "--hidden", "0"], "argument --hidden: must be an integer >= 1, got '0'"),
    (["mix", "--capacity", "x"], "argument --capacity: must be an integer >= 1, got 'x'"),
    (["mix", "--tokens", "1,a"], "argument --tokens: must be a comma list of integers >= 1, got '1,a'"),
    (["mix", "--blocks", "-1"], "argument --blocks: must be a comma list of integers >= 0, got '-1'"),
    (["mix", "--blocks", "10"], "--blocks must be <= the buffer capacity (mix's default capacity 9), got 10"),
    (["--blocks", "9"], "--blocks must be <= the buffer capacity (train's default capacity 8), got 9"),
    (["mix", "--blocks", "5", "--capacity", "4"], "--blocks must be <= the buffer capacity (--capacity 4), got 5"),
    (["mix", "--layouts", "token,tok"], "argument --layouts: must be a comma list of token / block, got 'tok'"),
    (["mix", "--rep", "0"], "argument --rep: must be a number > 0, got '0'"),
    (["mix", "--threads", "0"], "argument --threads: must be an integer >= 1, got '0'"),
    (["mix", "--max-ref-tokens", "0"], "argument --max-ref-tokens: must be an integer >= 1, got '0'"),
    (["layer", "--layers", "0"], "argument --layers: must be an integer >= 1, got '0'"),
    (["mix", "--configs", "{x"], "argument --configs: must be a JSON object or @file.json, got '{x'"),
    (["train", "--bwd-configs", "@/nonexistent.json"], "argument --bwd-configs: cannot read '/nonexistent.json'"),
    (["mix", "--configs", "[1]"], "argument --configs: must be a JSON object of objects"),
    (["mix", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["mix", "--out", "README.md"], "--out must name a directory, got the file 'README.md'"),
    (["report", "/nonexistent.json"], "no such file: '/nonexistent.json'"),
], ids=["section", "l2", "formats", "device", "hidden", "capacity", "tokens", "blocks-negative", "blocks-over-mix",
        "blocks-over-train", "blocks-over-capacity", "layouts", "rep", "threads", "max-ref-tokens", "layers",
        "configs-json", "bwd-configs-file", "configs-shape", "dtype", "out-file", "report-file"])
def test_cli_rejects_bad_arguments(capsys, monkeypatch, argv, message):
    """Every option's bad value ends the command before anything runs: argparse's usage and one error line, exit
    status 2, no traceback."""
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # README.md is a file there
    monkeypatch.setattr(cli.Timer, "__init__", lambda *a, **k: pytest.fail("timed before its options were checked"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.splitlines()[-1].startswith("python -m k3_ops.bench")


def test_cli_thread_count_must_be_positive():
    with pytest.raises(ValueError, match="--threads must be >= 1, got 0"):
        cli.cpu_threads(0)


def _plot_result(cold: bool) -> dict:
    rows = []
    for l2 in ("warm", "cold") if cold else ("warm",):
        for K in (1, 8):
            for T in (1, 64, 4096):
                us = (2.0 + T * K / 400) * (1.3 if l2 == "cold" else 1.0)
                rows.append({"layout": "token", "l2": l2, "T": T, "K": K, "bytes": (K + 2) * T * 14336,
                             "us:k3_ops": us, "us:eager": 8 * us, "floor_us": 0.7 * us})
    return {"section": "mix", "title": "t", "environment": {"device": "d", "commit": "c"},
            "limits": {"copy_bandwidth_Bps": 3.0e12, "graph_node_us": 1.3}, "params": {"timing": "g"},
            "columns": [], "rows": rows, "plot": {"series": ["k3_ops"], "refs": ["eager"], "floor": True}}


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "warm-and-cold"])
def test_plot_draws_every_comparison_series_within_the_axes(cold):
    """The plot holds the op, the reference and the floor the table holds, the bandwidth limit and the graph
    node, and every line lies inside its panel's y range (the bandwidth line at small T included)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = writer.figure(_plot_result(cold))
    try:
        axes = [ax for ax in fig.axes if ax.get_visible()]
        assert [ax.get_title() for ax in axes] == ["K = 1", "K = 8"]
        for ax in axes:
            labels = [line.get_label() for line in ax.get_lines()]
            for name in ("k3_ops", "eager", "floor (fastest geometry)"):
                assert any(label.startswith(name) for label in labels), (name, labels)
            assert any(label.startswith("graph node + bytes / copy bandwidth") for label in labels)
            assert any(label.startswith("graph node") for label in labels)
            if cold:
                assert "k3_ops, cold L2" in labels and "k3_ops, warm L2" in labels
            low, high = ax.get_ylim()
            for line in ax.get_lines():
                ys = [y for y in line.get_ydata() if y > 0]
                assert ys and low <= min(ys) and max(ys) <= high, line.get_label()
    finally:
        plt.close(fig)


def test_writer_markdown_marks_missing_values():
    res = {"section": "s", "environment": {"device": "d", "torch": "t", "triton": None, "commit": "c"},
           "limits": {"copy_bandwidth_Bps": 4.27e12, "graph_node_us": 1.2}, "params": {"dtype": "bf16"},
           "columns": [["T", "T", "d"], ["us:a", "a us", ".2f"]], "rows": [{"T": 1, "us:a": 2.5}, {"T": 2}]}
    md = writer.render(res, "markdown").splitlines()
    assert "copy bandwidth 4.27 TB/s" in md[0] and "graph node 1.20 us" in md[0]
    assert md[2:] == ["| T | a us |", "|---:|---:|", "| 1 | 2.50 |", "| 2 | - |"]
    with pytest.raises(ValueError, match="formats must come from .* got 'csv'"):
        writer.write(res, "unused", formats=("csv",))


@pytest.mark.parametrize("bps, text", [(3.04e12, "3.04 TB/s"), (2.24e10, "22.4 GB/s"), (1.5e9, "1.5 GB/s")])
def test_table_and_plot_print_the_copy_bandwidth_alike(bps, text):
    """One helper formats the bandwidth for the table header and the plot legend: same units, same rounding (a
    CPU's reads in GB/s, not 0.02 TB/s in one place and 0.025 in the other)."""
    assert writer.bandwidth(bps) == text
    result = _plot_result(cold=False)
    result["limits"]["copy_bandwidth_Bps"] = bps
    assert f"copy bandwidth {text} (read + write)" in writer.header(result)
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = writer.figure(result)
    try:
        labels = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
        assert f"graph node + bytes / copy bandwidth ({text})" in labels
    finally:
        plt.close(fig)


# --- model: the end-to-end training check ---------------------------------------------------------------------
def _tiny_compare(**kw):
    from k3_ops.bench import model

    return model.compare(32, 3, 8, torch.float32, torch.device("cpu"), steps=4, intermediate=16, vocab=32, **kw)


@pytest.mark.parametrize("compile_mode", ["eager", "aot_eager"])
def test_model_curves_agree(compile_mode):
    """k3_ops's stack and the formula's train to the same losses (FP32 CPU: the forward is the formula itself, so
    this compares attn_res_backward with autograd), eagerly and through a fullgraph compile; the losses fall."""
    from k3_ops.bench import model

    r = _tiny_compare(compile_mode=compile_mode)
    assert r["max_rel_diff"] <= model.LOSS_RTOL[torch.float32]
    losses = r["k3_ops"][0]
    assert losses[-1] < losses[0]


def test_model_check_fails_on_a_wrong_mix():
    """The check can fail: a mix that leaves out the oldest block (a wrong num_valid_blocks) breaks the rule."""
    from k3_ops.bench import model

    def wrong(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps):
        return model.k3_ops_attn_res(prefix_sum, block_residual[:, 1:], norm_weight, proj_weight,
                                     num_valid_blocks - 1, eps)

    r = _tiny_compare(compile_mode="eager", candidate=wrong)
    assert r["max_rel_diff"] > model.LOSS_RTOL[torch.float32]


@pytest.mark.interpreter
@requires_interpreter
def test_backward_floor_writes_every_gradient_row():
    """The backward's floor writes what the backward writes: K rows from the blocks, the prefix's row, zeros past K
    (NaN-poisoned capacity is never read), each row after its full-row reduction."""
    from k3_ops.bench.floor import backward_floor

    T, C, H, K = 3, 5, 64, 2
    g = torch.Generator().manual_seed(0)
    gy, prefix = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    blocks = torch.randn(T, C, H, generator=g)
    blocks[:, K:] = float("nan")
    gp, gb = backward_floor(gy, prefix, blocks, None, None, K, 1e-6)
    v = blocks[:, :K]
    torch.testing.assert_close(gb[:, :K], gy[:, None] + v * (v * v).sum(-1, keepdim=True), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gp, gy + prefix * (prefix * prefix).sum(-1, keepdim=True), rtol=1e-5, atol=1e-4)
    assert gb[:, K:].eq(0).all()
