"""The row floor beside the op and the other two floors, one run: what one program per token, one row at a time,
costs before any of the op's arithmetic.

``k3_ops.bench.floor``'s row geometry (one program per token, the prefix first, then the K block rows through a
pipelined loop, each row reduced before it is added) in the forms ROW_WARPS x ROW_STAGES = {4, 8} x {1, 2, 3}, the
plain op and the fused call at T = 64, 256, 512, 1024, 8192 x K = 1, 4, 8, beside the op (the launch table) and
the tile and stream floors; then the layer step (bench.layer's schedule) with every site on each row-floor form
and on the stream floor, beside the op's step, at T = 64 and 512. Graph replay, bf16, H = 7168, capacity 9, NaN in
unused slots. Usage, on the GPU machine: python tools/floor_rows.py [--out DIR] [--tokens 64,256] [--layer 64,512];
prints one line per shape (us, and of copy bandwidth in brackets) and writes floor_rows.json.

``--ladder`` times instead, for the plain op at T = 64, 256, 1024 x K = 4, 8, the row floor with the op's steps
added one at a time, each in the row floor's form with 4 and 8 warps (3 stages): ``l0`` the row floor's plain form
(one sum per row); ``l1`` + the folded weight and the statistics as the op takes them, one two-operand reduction per
row (sum v^2, <v, w>), each row weighted by its score, no softmax; ``l2`` + the online softmax (the running max, the
rescale of the accumulator, the final division): the op's arithmetic without its rounding rules and masks. Beside
them the op with the table's plan and with the one-row plan at 8 warps, 3 stages. Writes floor_ladder.json.

``--tile-ladder`` does the same in the one-tile plan's geometry (one program per token, 8 warps, the K block rows in
one [next_pow2(K), next_pow2(H)] tile loaded at once and the prefix apart), where the table runs K <= 4 up to 256
tokens: ``t0`` the tile floor in that layout (one sum per row), ``t1`` + the folded weight in two-operand reductions
(the tile's and the prefix's), each row weighted by its score, ``t2`` + the softmax over the K + 1 scores, ``t3`` =
t2 with its loads in the op's source order before 0f1d84d (the folded weight, the prefix, then the tile; the other
rungs load the tile first), ``t4`` = t3 + the op's correctly rounded score, ``t5`` = t2 + that score (t2's load
order); for the fused call each also adds the addend, the new prefix and snapshot stores and, from ``t0``, the
output norm's reduction with its weight (``t0`` without the weight). Plain op at T = 1, 64, 256 x K = 1, 4, fused
call at T = 1, 64 x K = 1, 4, beside the op and, for the plain op, its kernel launched from Python (``op_py``: the
compiled handle, as the op's first call of a key) and through Triton's JIT (``op_jit``): the same kernel without the
C++ replay's launch. Writes floor_tile_ladder.json.

``--layer-mix`` times the layer step (bench.layer's schedule, one graph) with its fused sites split by block count:
the op everywhere (first and last); the sites at K <= 4 on the tile ladder's t2 (the one-tile geometry with the
simplest form of the arithmetic), the others on the op; the sites at K > 4 and the final mix on the stream floor, the
others on the op; both; and every call on the stream floor. T = 1, 8, 64, 512 (``--layer``). Where the step's time
goes by site class, against its target. Writes floor_layer_mix.json.

``--tile-eager`` launches each plain form (the op, op_jit, t2-t5) once eagerly at T = 64 and 256, K = 4, after two
untimed launches, for a profiler: ``ncu -k regex:"attn_res_token_kernel|_tile_ladder_kernel" python
tools/floor_rows.py --tile-eager``; the forms' order into tile_eager.json (three launches each).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from k3_ops.bench import common, floor, layer  # noqa: E402
from k3_ops.bench.floor import prefix_candidate  # noqa: E402
from k3_ops.bench.timing import Timer  # noqa: E402
from k3_ops.kernels.attn_res_fwd import _score, _sum_pair  # noqa: E402

FORMS = [(warps, stages) for warps in (4, 8) for stages in (1, 2, 3)]
H, CAP = 7168, 9


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def _form(warps: int, stages: int) -> str:
    return f"row_w{warps}_s{stages}"


def _in_form(fn, form: tuple[int, int]):
    """``fn`` with the row geometry's form set each time it runs (so also while a graph captures it)."""
    def call(*args):
        floor.ROW_WARPS, floor.ROW_STAGES = form
        return fn(*args)
    return call


def _setup(max_tokens: int) -> tuple[Timer, dict, float, common.Problem]:
    """Every section's timer, the run's limits and copy bandwidth, and its problem (bf16, H = 7168, capacity 9,
    token-major) at up to ``max_tokens`` tokens."""
    timer = Timer("cuda", rep_ms=10.0)
    limits = timer.limits()
    problem = common.Problem(max_tokens, CAP, H, torch.bfloat16, torch.device("cuda"), "token")
    return timer, limits, limits["copy_bandwidth_Bps"], problem


def _write(out_dir: str, name: str, limits: dict, **result) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump({"environment": common.environment(torch.device("cuda")), "limits": limits, **result}, f,
                  indent=1)


def _time(timer: Timer, impls: dict, args: tuple, row: dict, bw: float, label: str) -> None:
    """Every callable of ``impls`` on ``args`` into ``row`` (bench.common.measure: us, of BW, non-finite noted),
    then one line of them."""
    notes = []
    common.measure(timer, impls, args, row, bw, False, notes, label)
    if notes:
        row["notes"] = notes
    print(f"{label} " + " ".join(f"{k[3:]}={v:.2f}({row['bw:' + k[3:]]:.2f})" for k, v in row.items()
                                 if k.startswith("us:")), flush=True)


@triton.jit
def _ladder_kernel(prefix_ptr, blocks_ptr, nw_ptr, pw_ptr, out_ptr, stride_pt, stride_bt, stride_bc, H, eps, K,
                   BLOCK: tl.constexpr, LEVEL: tl.constexpr, STAGES: tl.constexpr):
    # The row floor (LEVEL 0) with the op's per-row steps added (module docstring); PDL as the floor's.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    w = tl.zeros([BLOCK], tl.float32)
    if LEVEL >= 1:
        w = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(
            pw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(prefix_ptr + t * stride_pt + cols, mask=mask, other=0.0).to(tl.float32)
    if LEVEL == 0:
        acc = v * tl.rsqrt(tl.sum(v * v, axis=0) / H + eps)
    else:
        ss, d = tl.reduce((v * v, v * w), 0, _sum_pair)
        if LEVEL == 1:
            acc = v * (tl.rsqrt(ss / H + eps) * d)
        else:  # the prefix first: its weight exp(0) = 1, the running max its score
            m = tl.rsqrt(ss / H + eps) * d
            acc = v
            total = 1.0
    for i in tl.range(0, K, num_stages=STAGES):
        x = tl.load(blocks_ptr + t * stride_bt + i * stride_bc + cols, mask=mask, other=0.0).to(tl.float32)
        if LEVEL == 0:
            acc += x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        else:
            ss, d = tl.reduce((x * x, x * w), 0, _sum_pair)
            score = tl.rsqrt(ss / H + eps) * d
            if LEVEL == 1:
                acc += x * score
            else:
                m_new = tl.maximum(m, score)
                alpha = tl.exp(m - m_new)
                p = tl.exp(score - m_new)
                acc = acc * alpha + p * x
                total = total * alpha + p
                m = m_new
    if LEVEL == 2:
        acc = acc / total
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_ladder_kernel(prefix_ptr, addend_ptr, blocks_ptr, nw_ptr, pw_ptr, onw_ptr, out_ptr, new_prefix_ptr,
                        stride_pt, stride_at, stride_bt, stride_bc, H, eps, K, write_idx, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr, LEVEL: tl.constexpr, FUSED: tl.constexpr):
    # The one-tile geometry with the op's steps added (module docstring); PDL as the floor's.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    rows = tl.arange(0, ROWS)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    tile_mask = (rows[:, None] < K) & mask[None, :]
    w = tl.zeros([BLOCK], tl.float32)
    if LEVEL == 3 or LEVEL == 4:  # the op's order before 0f1d84d: the folded weight, the prefix, then the tile
        w = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(
            pw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        v = prefix_candidate(prefix_ptr, addend_ptr, blocks_ptr, new_prefix_ptr, t, cols, mask, stride_pt,
                             stride_at, stride_bt, stride_bc, H, write_idx, FUSED)
    x = tl.load(blocks_ptr + t * stride_bt + rows[:, None] * stride_bc + cols[None, :], mask=tile_mask, other=0.0)
    if LEVEL < 3 or LEVEL == 5:
        v = prefix_candidate(prefix_ptr, addend_ptr, blocks_ptr, new_prefix_ptr, t, cols, mask, stride_pt,
                             stride_at, stride_bt, stride_bc, H, write_idx, FUSED)
        if LEVEL >= 1:
            w = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(
                pw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = x.to(tl.float32)
    if LEVEL == 0:
        y = tl.sum(x * tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)[:, None], axis=0)
        y += v * tl.rsqrt(tl.sum(v * v, axis=0) / H + eps)
    else:
        ss, d = tl.reduce((x * x, x * w[None, :]), 1, _sum_pair)
        ss_v, d_v = tl.reduce((v * v, v * w), 0, _sum_pair)
        if LEVEL >= 4:  # the op's score: correctly rounded sqrt and division (t5: with t2's load order)
            score = tl.where(rows < K, _score(ss, d, H, eps, False), -float("inf"))
            score_v = _score(ss_v, d_v, H, eps, False)
        else:
            score = tl.where(rows < K, tl.rsqrt(ss / H + eps) * d, -float("inf"))
            score_v = tl.rsqrt(ss_v / H + eps) * d_v
        if LEVEL == 1:
            y = tl.sum(x * score[:, None], axis=0) + v * score_v
        else:
            m = tl.maximum(tl.max(score, axis=0), score_v)
            p = tl.exp(score - m)
            p_v = tl.exp(score_v - m)
            y = (tl.sum(x * p[:, None], axis=0) + v * p_v) / (tl.sum(p, axis=0) + p_v)
    if FUSED:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # the norm sees the rounded mix, as the op's
        y = y * tl.rsqrt(tl.sum(y * y, axis=0) / H + eps)
        if LEVEL >= 1:
            y = y * tl.load(onw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _tile_ladder(level: int, fused: bool):
    def call(*args):
        if fused:
            prefix, addend, blocks, nw, pw, K, eps, write, onw, _ = args
        else:
            (prefix, blocks, nw, pw, K, eps), addend, write, onw = args, args[0], -1, args[2]
        T, H = prefix.shape
        out = torch.empty_like(prefix)
        new_prefix = torch.empty_like(prefix) if fused else out
        _tile_ladder_kernel[(T,)](prefix, addend, blocks, nw, pw, onw, out, new_prefix, prefix.stride(0),
                                  addend.stride(0), blocks.stride(0), blocks.stride(1), H, eps, K, write,
                                  ROWS=max(1, triton.next_power_of_2(K)), BLOCK=triton.next_power_of_2(H), LEVEL=level,
                                  FUSED=fused, num_warps=8, num_stages=1, launch_pdl=True)
        return (out, new_prefix) if fused else out
    return call


def _op_launch(jit: bool):
    """The plain op's kernel as the table plans it, launched from Python: through ``_launch.launch`` (the compiled
    handle, as the op's first call of a key) or, ``jit``, through Triton's JIT launch (``kernel[grid]``, as under
    the interpreter); the same compiled kernel as the op's C++ replay launches."""
    from unittest import mock

    from k3_ops.backends import cuda, prepare_weights

    def call(prefix, blocks, nw, pw, K, eps):
        T, H = prefix.shape
        plan = cuda.choose_config(T, K, H, prefix.device)
        nw, pw = prepare_weights(nw, pw)
        out = torch.empty_like(prefix)
        if jit:
            with mock.patch.object(cuda, "use_interpreter", lambda t: True):
                cuda.launch_forward(plan, prefix, blocks, nw, pw, out, K, eps)
        else:
            cuda.launch_forward(plan, prefix, blocks, nw, pw, out, K, eps)
        return out
    return call


def tile_ladder(out_dir: str) -> None:
    timer, limits, bw, problem = _setup(256)
    ops = common.k3_ops_ops()
    rows = []
    with torch.inference_mode():
        for K in (1, 4):
            problem.poison(K)
            write = K if K < CAP else -1
            for call, tokens in (("plain", (1, 64, 256)), ("fused", (1, 64))):
                fused = call == "fused"
                op = ops.fused if fused else ops.attn_res
                impls = {"k3_ops": op, **{f"t{level}": _tile_ladder(level, fused) for level in range(6)},
                         **({} if fused else {"op_py": _op_launch(False), "op_jit": _op_launch(True)}),
                         "k3_ops_again": op}
                for T in tokens:
                    args = problem.fused_args(T, K, write) if fused else problem.attn_res_args(T, K)
                    nbytes = common.bytes_moved(T, H, 2, K + 2, 2 + (write >= 0)) if fused else \
                        common.bytes_moved(T, H, 2, K + 1, 1)
                    row = {"call": call, "T": T, "K": K, "bytes": nbytes}
                    _time(timer, impls, args, row, bw, f"tile_ladder {call} T={T} K={K}")
                    rows.append(row)
            problem.restore(K)
    _write(out_dir, "floor_tile_ladder.json", limits, rows=rows)


def tile_eager(out_dir: str) -> None:
    """One eager launch of each plain form of the tile ladder's comparison at T = 64 and 256, K = 4 (after two
    untimed ones), for a profiler (ncu) to read each kernel on its own; their order into tile_eager.json."""
    _, _, _, problem = _setup(256)
    ops = common.k3_ops_ops()
    impls = {"k3_ops": ops.attn_res, "op_jit": _op_launch(True), **{f"t{level}": _tile_ladder(level, False)
                                                                     for level in (2, 3, 4, 5)}}
    order = []
    with torch.inference_mode():
        problem.poison(4)
        for T in (64, 256):
            args = problem.attn_res_args(T, 4)
            for name, fn in impls.items():
                fn(*args), fn(*args)
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push(f"{name} T={T}")
                fn(*args)
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                order.append(f"{name} T={T}")
        problem.restore(4)
    _write(out_dir, "tile_eager.json", {}, order=order)


def _ladder(level: int, warps: int):
    def call(prefix, blocks, nw, pw, K, eps):
        T, H = prefix.shape
        out = torch.empty_like(prefix)
        _ladder_kernel[(T,)](prefix, blocks, nw, pw, out, prefix.stride(0), blocks.stride(0), blocks.stride(1), H,
                             eps, K, BLOCK=triton.next_power_of_2(H), LEVEL=level, STAGES=3, num_warps=warps,
                             num_stages=1, launch_pdl=True)
        return out
    return call


def ladder(out_dir: str) -> None:
    import plan_variants  # the op with a forced plan (tools/plan_variants.py)

    timer, limits, bw, problem = _setup(1024)
    impls = {"k3_ops": common.k3_ops_ops().attn_res,
             "op_w8_s3": plan_variants.variant(lambda T, K, f: plan_variants.token(1, 8, 3, True)).attn_res}
    impls.update({f"l{level}_w{warps}": _ladder(level, warps) for level in (0, 1, 2) for warps in (4, 8)})
    impls["k3_ops_again"] = impls["k3_ops"]
    rows = []
    with torch.inference_mode():
        for K in (4, 8):
            problem.poison(K)
            for T in (64, 256, 1024):
                args = problem.attn_res_args(T, K)
                nbytes = common.bytes_moved(T, H, 2, K + 1, 1)
                row = {"T": T, "K": K, "bytes": nbytes}
                _time(timer, impls, args, row, bw, f"ladder T={T} K={K}")
                rows.append(row)
            problem.restore(K)
    _write(out_dir, "floor_ladder.json", limits, rows=rows)


def _by_blocks(small, large, k_max: int = 4):
    """A fused call that runs ``small`` at K <= k_max and ``large`` above (the layer step's sites by K)."""
    def call(*args):
        return (small if args[5] <= k_max else large)(*args)
    return call


def layer_mix(out_dir: str) -> None:
    timer, limits, bw, _ = _setup(1)
    ops = common.k3_ops_ops()
    t2 = _tile_ladder(2, True)
    stream = floor.fused_floor_stream
    steps = {"k3_ops": (ops.fused, ops.attn_res),
             "t2_small": (_by_blocks(t2, ops.fused), ops.attn_res),
             "stream_large": (_by_blocks(ops.fused, stream), floor.mix_floor_stream),
             "t2_small_stream_large": (_by_blocks(t2, stream), floor.mix_floor_stream),
             "stream": (stream, floor.mix_floor_stream),
             "k3_ops_again": (ops.fused, ops.attn_res)}
    rows = []
    with torch.inference_mode():
        for T in [int(t) for t in _arg("--layer", "1,8,64,512").split(",")]:
            step = layer.Step(T, H, CAP, layer.LAYERS, torch.bfloat16, torch.bfloat16, torch.device("cuda"), "token")
            row = {"T": T, "calls": step.calls(), "bytes": step.bytes(),
                   "sites_small": sum(K <= 4 for K, _ in step.sites), "sites_large": sum(K > 4 for K, _ in step.sites)}
            for name, (fused, mix) in steps.items():
                row["us:" + name] = timer.primary(lambda s=step, f=fused, m=mix: s.run(f, m))
            rows.append(row)
            print(f"layer_mix T={T} " + " ".join(f"{k[3:]}={v:.1f}" for k, v in row.items() if k.startswith("us:")),
                  flush=True)
            del step
    _write(out_dir, "floor_layer_mix.json", limits, rows=rows)


def main() -> None:
    out_dir = _arg("--out", ".")
    for flag, section in (("--ladder", ladder), ("--tile-ladder", tile_ladder), ("--tile-eager", tile_eager),
                          ("--layer-mix", layer_mix)):
        if flag in sys.argv:
            os.makedirs(out_dir, exist_ok=True)
            return section(out_dir)
    tokens = [int(t) for t in _arg("--tokens", "64,256,512,1024,8192").split(",")]
    layer_tokens = [int(t) for t in _arg("--layer", "64,512").split(",") if t]
    os.makedirs(out_dir, exist_ok=True)
    timer, limits, bw, problem = _setup(max(tokens))
    ops = common.k3_ops_ops()
    default = (floor.ROW_WARPS, floor.ROW_STAGES)
    rows = []
    with torch.inference_mode():
        for K in (1, 4, 8):
            problem.poison(K)
            write = K if K < CAP else -1
            for call in ("plain", "fused"):
                for T in tokens:
                    if call == "plain":
                        args = problem.attn_res_args(T, K)
                        nbytes = common.bytes_moved(T, H, 2, K + 1, 1)
                        impls = {"k3_ops": ops.attn_res, "tile": floor.mix_floor, "stream": floor.mix_floor_stream,
                                 **{_form(*f): _in_form(floor.mix_floor_row, f) for f in FORMS}}
                    else:
                        args = problem.fused_args(T, K, write)
                        nbytes = common.bytes_moved(T, H, 2, K + 2, 2 + (write >= 0))
                        impls = {"k3_ops": ops.fused, "tile": floor.fused_floor, "stream": floor.fused_floor_stream,
                                 **{_form(*f): _in_form(floor.fused_floor_row, f) for f in FORMS}}
                    row = {"call": call, "T": T, "K": K, "bytes": nbytes}
                    _time(timer, impls, args, row, bw, f"{call} T={T} K={K}")
                    floor.ROW_WARPS, floor.ROW_STAGES = default
                    best = min(FORMS, key=lambda f: row["us:" + _form(*f)])
                    row["row_best"], row["us:row"] = _form(*best), row["us:" + _form(*best)]
                    rows.append(row)
            problem.restore(K)
    del problem
    steps = []
    with torch.inference_mode():
        for T in layer_tokens:
            step = layer.Step(T, H, CAP, layer.LAYERS, torch.bfloat16, torch.bfloat16, torch.device("cuda"), "token")
            row = {"T": T, "calls": step.calls(), "bytes": step.bytes(),
                   "us:k3_ops": timer.primary(lambda s=step: s.run(ops.fused, ops.attn_res)),
                   "us:stream": timer.primary(lambda s=step: s.run(floor.fused_floor_stream, floor.mix_floor_stream))}
            for form in FORMS:
                row["us:" + _form(*form)] = timer.primary(lambda s=step, f=form: s.run(
                    _in_form(floor.fused_floor_row, f), _in_form(floor.mix_floor_row, f)))
            floor.ROW_WARPS, floor.ROW_STAGES = default
            row["us:row"] = min(row["us:" + _form(*f)] for f in FORMS)
            row["bw_floor"] = row["bytes"] / bw * 1e6
            steps.append(row)
            print(f"layer T={T} " + " ".join(f"{k[3:]}={v:.1f}" for k, v in row.items() if k.startswith("us:"))
                  + f" bw_floor={row['bw_floor']:.1f}", flush=True)
            del step
    _write(out_dir, "floor_rows.json", limits, forms=[_form(*f) for f in FORMS], rows=rows, layer=steps)


if __name__ == "__main__":
    main()
