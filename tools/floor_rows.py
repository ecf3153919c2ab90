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
"""
from __future__ import annotations

import json
import os
import sys
from functools import partial

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from k3_ops.bench import common, floor, layer  # noqa: E402
from k3_ops.bench.timing import Timer  # noqa: E402
from k3_ops.kernels.attn_res_fwd import _sum_pair  # noqa: E402

FORMS = [(warps, stages) for warps in (4, 8) for stages in (1, 2, 3)]


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def _form(warps: int, stages: int) -> str:
    return f"row_w{warps}_s{stages}"


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

    timer = Timer("cuda", rep_ms=10.0)
    limits = timer.limits()
    bw = limits["copy_bandwidth_Bps"]
    H, cap = 7168, 9
    impls = {"k3_ops": common.k3_ops_ops().attn_res,
             "op_w8_s3": plan_variants.variant(lambda T, K, f: plan_variants.token(1, 8, 3, True)).attn_res}
    impls.update({f"l{level}_w{warps}": _ladder(level, warps) for level in (0, 1, 2) for warps in (4, 8)})
    rows = []
    problem = common.Problem(1024, cap, H, torch.bfloat16, torch.device("cuda"), "token")
    with torch.inference_mode():
        for K in (4, 8):
            problem.poison(K)
            for T in (64, 256, 1024):
                args = problem.attn_res_args(T, K)
                nbytes = common.bytes_moved(T, H, 2, K + 1, 1)
                row = {"T": T, "K": K, "bytes": nbytes}
                for name, fn in impls.items():
                    if not bool(torch.isfinite(fn(*args)).all()):
                        row.setdefault("non_finite", []).append(name)
                    row["us:" + name] = timer.primary(partial(fn, *args))
                row["us:k3_ops_again"] = timer.primary(partial(impls["k3_ops"], *args))
                rows.append(row)
                print(f"ladder T={T} K={K} " + " ".join(
                    f"{k[3:]}={v:.2f}({nbytes / (v * 1e-6) / bw:.2f})" for k, v in row.items()
                    if k.startswith("us:")), flush=True)
            problem.restore(K)
    with open(os.path.join(out_dir, "floor_ladder.json"), "w") as f:
        json.dump({"environment": common.environment(torch.device("cuda")), "limits": limits, "rows": rows}, f,
                  indent=1)


def main() -> None:
    out_dir = _arg("--out", ".")
    if "--ladder" in sys.argv:
        os.makedirs(out_dir, exist_ok=True)
        return ladder(out_dir)
    tokens = [int(t) for t in _arg("--tokens", "64,256,512,1024,8192").split(",")]
    layer_tokens = [int(t) for t in _arg("--layer", "64,512").split(",") if t]
    os.makedirs(out_dir, exist_ok=True)
    timer = Timer("cuda", rep_ms=10.0)
    limits = timer.limits()
    bw = limits["copy_bandwidth_Bps"]
    ops = common.k3_ops_ops()
    H, cap = 7168, 9
    default = (floor.ROW_WARPS, floor.ROW_STAGES)
    rows = []
    problem = common.Problem(max(tokens), cap, H, torch.bfloat16, torch.device("cuda"), "token")
    with torch.inference_mode():
        for K in (1, 4, 8):
            problem.poison(K)
            write = K if K < cap else -1
            for call in ("plain", "fused"):
                for T in tokens:
                    if call == "plain":
                        args = problem.attn_res_args(T, K)
                        nbytes = common.bytes_moved(T, H, 2, K + 1, 1)
                        impls = {"k3_ops": ops.attn_res, "tile": floor.mix_floor, "stream": floor.mix_floor_stream,
                                 "row": floor.mix_floor_row}
                    else:
                        args = problem.fused_args(T, K, write)
                        nbytes = common.bytes_moved(T, H, 2, K + 2, 2 + (write >= 0))
                        impls = {"k3_ops": ops.fused, "tile": floor.fused_floor, "stream": floor.fused_floor_stream,
                                 "row": floor.fused_floor_row}
                    row = {"call": call, "T": T, "K": K, "bytes": nbytes}
                    for name, fn in impls.items():
                        forms = FORMS if name == "row" else [None]
                        for form in forms:
                            if form is not None:
                                floor.ROW_WARPS, floor.ROW_STAGES = form
                            out = fn(*args)
                            out = out[0] if isinstance(out, tuple) else out
                            if not bool(torch.isfinite(out).all()):
                                row.setdefault("non_finite", []).append(name)
                            row["us:" + (_form(*form) if form else name)] = timer.primary(partial(fn, *args))
                    floor.ROW_WARPS, floor.ROW_STAGES = default
                    best = min(FORMS, key=lambda f: row["us:" + _form(*f)])
                    row["row_best"], row["us:row"] = _form(*best), row["us:" + _form(*best)]
                    rows.append(row)
                    print(f"{call} T={T} K={K} " + " ".join(
                        f"{k[3:]}={v:.2f}({nbytes / (v * 1e-6) / bw:.2f})" for k, v in row.items()
                        if k.startswith("us:")), flush=True)
            problem.restore(K)
    del problem
    steps = []
    with torch.inference_mode():
        for T in layer_tokens:
            step = layer.Step(T, H, cap, layer.LAYERS, torch.bfloat16, torch.bfloat16, torch.device("cuda"), "token")
            row = {"T": T, "calls": step.calls(), "bytes": step.bytes(),
                   "us:k3_ops": timer.primary(lambda s=step: s.run(ops.fused, ops.attn_res)),
                   "us:stream": timer.primary(lambda s=step: s.run(floor.fused_floor_stream, floor.mix_floor_stream))}
            for form in FORMS:
                floor.ROW_WARPS, floor.ROW_STAGES = form
                row["us:" + _form(*form)] = timer.primary(lambda s=step: s.run(floor.fused_floor_row,
                                                                                floor.mix_floor_row))
            floor.ROW_WARPS, floor.ROW_STAGES = default
            row["us:row"] = min(row["us:" + _form(*f)] for f in FORMS)
            row["bw_floor"] = row["bytes"] / bw * 1e6
            steps.append(row)
            print(f"layer T={T} " + " ".join(f"{k[3:]}={v:.1f}" for k, v in row.items() if k.startswith("us:"))
                  + f" bw_floor={row['bw_floor']:.1f}", flush=True)
            del step
    result = {"environment": common.environment(torch.device("cuda")), "limits": limits,
              "forms": [_form(*f) for f in FORMS], "rows": rows, "layer": steps}
    with open(os.path.join(out_dir, "floor_rows.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
