"""The benchmark package on a CPU: every section runs through the reference on tiny shapes, writes what it says,
and measures what it claims (timings themselves are not asserted beyond being positive and finite)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from k3_ops import bench, reference
from k3_ops.bench import Ops, Options, Timer, cli, common, fused, host, layer, mix, train, writer

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
    assert timer.limits() is limits  # measured once per run, reported beside every section


def test_wall_counts_every_call(timer):
    calls = []
    timer.wall(lambda: calls.append(1), calls=4)
    assert len(calls) == 1 + 3 * 4  # one warm-up call, then three batches (quick) of four


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
    res = mix.run(Options(tokens=[1, 3], blocks=[0, 2], **TINY), timer)
    assert [(r["layout"], r["T"], r["K"]) for r in res["rows"]] == [
        (lay, T, K) for lay in ("token", "block") for K in (0, 2) for T in (1, 3)]
    bw = res["limits"]["copy_bandwidth_Bps"]
    for r in res["rows"]:
        assert r["bytes"] == (r["K"] + 2) * r["T"] * 32 * 2
        names = {"k3_ops", "eager"} if r["layout"] == "token" else {"k3_ops"}  # references: token-major only
        assert {k.split(":")[1] for k in r if k.startswith("us:")} == names
        assert all(_positive(r[f"us:{n}"]) for n in names)
        assert r["bw:k3_ops"] == pytest.approx(r["bytes"] / (r["us:k3_ops"] * 1e-6) / bw)
    assert res["notes"] == []  # NaN slots were never read
    assert res["params"]["timing"] == "wall time per call" and res["plot"] == {"series": ["k3_ops"]}


def test_mix_section_notes_a_kernel_that_reads_unused_slots(timer):
    def reads_everything(prefix, blocks, nw, pw, K, eps):
        return reference.attn_res_reference(prefix, blocks, nw, pw, blocks.size(1), eps)

    res = mix.run(Options(tokens=[2], blocks=[1], layouts=["token"], refs=False, **TINY), timer,
                  {"bad": Ops(attn_res=reads_everything)})
    assert res["notes"] == ["bad returned non-finite values at token-major T=2 K=1"]


def test_fused_section_times_every_variant_beside_the_unfused_row(timer):
    k3 = common.k3_ops_ops()
    res = fused.run(Options(tokens=[2], blocks=[1, 8], capacity=8, **TINY), timer,
                    {"a": k3, "b": Ops(fused=k3.fused)})
    rows = res["rows"]
    assert [(r["K"], r["write"]) for r in rows] == [(1, 1), (8, -1)]  # the snapshot needs a free slot
    for r in rows:
        assert all(_positive(r[f"us:{n}"]) for n in ("a", "b", "unfused"))
        assert r["bytes"] == (r["K"] + 4 + (r["write"] >= 0)) * r["T"] * 32 * 2
        assert r["vs_unfused"] == pytest.approx(r["us:unfused"] / r["us:a"])


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_gpu_sections_time_the_floor_beside_the_calls_and_train_only_differentiable_references():
    """On a GPU the mix, fused and layer sections carry the floor in both geometries, and the train section
    (which steps every reference through autograd) does not take the floor, which has no backward."""
    opts = Options(device="cuda", hidden=256, tokens=[4], blocks=[2], rep_ms=0.5, quick=True, progress=False)
    timer = Timer("cuda", rep_ms=0.5, quick=True)
    for section in (mix, fused):
        res = section.run(opts, timer)
        row = next(r for r in res["rows"] if r["layout"] == "token")
        assert all(_positive(row[f"us:{n}"]) for n in ("floor", "floor_stream", "k3_ops"))
        assert res["notes"] == []
    res = layer.run(Options(device="cuda", hidden=256, tokens=[4], rep_ms=0.5, quick=True, progress=False), timer)
    assert all(_positive(res["rows"][0][f"us:{n}"]) for n in ("k3_ops", "unfused", "floor_kernel", "floor_stream"))
    assert res["notes"] == []
    res = train.run(opts, timer)
    assert {k.split(":")[1] for k in res["rows"][0] if k.startswith("us:")} == {"k3_ops", "eager", "compile"}


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
    assert [r["T"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        assert r["calls"] == 49 and r["K_final"] == 8
        assert r["site:k3_ops"] == pytest.approx(r["us:k3_ops"] / 49) and _positive(r["us:unfused"])
        assert r["bw_floor"] == pytest.approx(r["bytes"] / res["limits"]["copy_bandwidth_Bps"] * 1e6)


def test_host_section_has_torch_add_and_every_call(timer):
    res = host.run(Options(tokens=[1], **TINY), timer)
    assert [(r["impl"], r["call"]) for r in res["rows"]] == [
        ("torch", "torch.add"), ("k3_ops", "attn_res"), ("k3_ops", "fused_attn_res"), ("k3_ops", "fwd+bwd")]
    assert all(_positive(r["wall_us"]) and r["K"] == 8 for r in res["rows"])


def test_train_section(timer):
    res = train.run(Options(tokens=[3, 5], blocks=[2], **TINY), timer)
    assert [(r["T"], r["K"]) for r in res["rows"]] == [(3, 2), (5, 2)]
    for r in res["rows"]:
        assert all(_positive(r[f"us:{n}"]) for n in ("k3_ops", "eager")) and _positive(r["bwd_us:k3_ops"])
        assert r["bytes"] == r["T"] * 32 * 2 * ((2 + 1) + 1 + (8 + 1))  # capacity 8: the training default


def test_train_section_notes_a_reference_that_fails_and_times_the_rest(timer):
    """A reference formula that raises (torch.compile's Inductor has, on some torch builds) costs its own cells
    and a note, not the run: the op and the other references are still timed."""
    def broken(*args):
        raise AssertionError("inductor tiling\nsecond line")

    res = train.run(Options(tokens=[3], blocks=[2], **TINY), timer,
                    refs={"eager": reference.attn_res_reference, "broken": broken})
    row = res["rows"][0]
    assert _positive(row["us:k3_ops"]) and _positive(row["us:eager"]) and math.isnan(row["us:broken"])
    assert res["notes"] == ["broken failed at token-major T=3 K=2: AssertionError: inductor tiling"]


def test_step_fn_returns_the_gradients_of_all_four_inputs():
    p = common.Problem(3, 4, 16, torch.float32, torch.device("cpu"), "token")
    p.poison(2)
    grads = train.step_fn(reference.attn_res_reference, p.attn_res_args(3, 2), torch.ones(3, 16))()
    assert [g.shape for g in grads] == [(3, 16), (3, 4, 16), (16,), (1, 16)]
    assert (grads[1][:, 2:] == 0).all()


def test_cli_writes_json_markdown_and_plot_and_report_renders_it(tmp_path, capsys):
    results = bench.main(["mix", "fused", "--device", "cpu", "--quick", "--hidden", "32", "--tokens", "1,2",
                          "--blocks", "1", "--rep", "0.5", "--out", str(tmp_path)])
    assert set(results) == {"mix", "fused", "_written"}
    out = capsys.readouterr().out
    assert "k3_ops us" in out and f"# wrote {tmp_path / 'mix.json'}" in out
    saved = json.loads((tmp_path / "mix.json").read_text())
    assert saved["rows"] == results["mix"]["rows"] and saved["environment"]["torch"] == torch.__version__
    md = (tmp_path / "mix.md").read_text().splitlines()
    assert md[2].startswith("| layout | T | K | k3_ops us") and len(md) == 4 + len(saved["rows"])
    if "png" in results["_written"]["mix"]:
        assert (tmp_path / "mix.png").read_bytes()[:4] == b"\x89PNG"
    bench.main(["report", str(tmp_path / "fused.json")])
    assert capsys.readouterr().out == writer.render(results["fused"], "markdown") + "\n"
    pytest.importorskip("matplotlib")
    bench.main(["report", str(tmp_path / "mix.json"), "--plot", str(tmp_path / "again")])
    assert (tmp_path / "again" / "mix.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_an_unknown_section(capsys):
    with pytest.raises(SystemExit):
        cli.main(["mixx", "--device", "cpu"])
    assert "unknown section 'mixx': choose from mix, fused, layer, host, train" in capsys.readouterr().err


def test_writer_markdown_marks_missing_values():
    res = {"section": "s", "environment": {"device": "d", "torch": "t", "triton": None, "commit": "c"},
           "limits": {"copy_bandwidth_Bps": 4.27e12, "graph_node_us": 1.2}, "params": {"dtype": "bf16"},
           "columns": [["T", "T", "d"], ["us:a", "a us", ".2f"]], "rows": [{"T": 1, "us:a": 2.5}, {"T": 2}]}
    md = writer.render(res, "markdown").splitlines()
    assert "copy bandwidth 4.270 TB/s" in md[0] and "graph node 1.20 us" in md[0]
    assert md[2:] == ["| T | a us |", "|---:|---:|", "| 1 | 2.50 |", "| 2 | - |"]
