"""Registers, spills and shared memory of the forward kernels compiled for sm_90 WITHOUT a GPU.

Compiles the Triton kernels ahead of time (``triton.compile`` for target cuda:90) and runs the ``ptxas`` that
ships with Triton with ``-v`` on the PTX, so register pressure of a launch configuration can be read on any
machine (the H200 time is then spent only on timings). Triton versions differ between machines; treat the
figures as close, not exact. Usage: python tools/ptxas_info.py
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3_ops.kernels import attn_res_fwd  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
TARGET = GPUTarget("cuda", 90, 32)


def rows_signature(dtype: str, fused: dict) -> tuple[dict, dict]:
    sig = {"prefix_ptr": f"*{dtype}", "blocks_ptr": f"*{dtype}", "nw_ptr": "*fp32", "pw_ptr": "*fp32",
           "out_ptr": f"*{dtype}", "T": "i32", "K": "i32", "H": "i32", "eps": "fp32"}
    for s in ("stride_pt", "stride_ph", "stride_bt", "stride_bc", "stride_bh", "stride_ot"):
        sig[s] = "i32"
    const = {}
    for name in ("BLOCK_H", "VEC", "H_STRIDED", "ACC64", "PREFETCH", "NUM_STAGES", "W_RELOAD"):
        sig[name] = "constexpr"
    if fused:
        sig.update({"addend_ptr": f"*{dtype}" if fused.get("HAS_ADDEND") else "constexpr", "newp_ptr": f"*{dtype}",
                    "onw_ptr": "*fp32" if fused.get("OUT_NORM") else "constexpr",
                    "stride_at": "i32", "stride_ah": "i32", "stride_nt": "i32", "write_idx": "i32",
                    "out_eps": "fp32"})
        if not fused.get("HAS_ADDEND"):
            const["addend_ptr"] = None
        if not fused.get("OUT_NORM"):
            const["onw_ptr"] = None
        for name in ("HAS_ADDEND", "FUSED", "SNAPSHOT", "OUT_NORM"):
            sig[name] = "constexpr"
            const[name] = bool(fused.get(name, name == "FUSED"))
    return sig, const


def _source(fn, sig: dict, const: dict) -> ASTSource:
    # ASTSource keys constexprs and attributes by argument index; pointers get the 16-byte divisibility the JIT
    # infers for torch allocations (so loads vectorise as they do at run time).
    names = list(fn.arg_names)
    missing = [n for n in names if n not in sig]
    for n in missing:  # defaults not named in this variant (e.g. fused arguments of the plain kernel)
        sig[n] = "constexpr"
        const.setdefault(n, fn.params[names.index(n)].default)
    sig = {n: sig[n] for n in names}
    constexprs = {(names.index(n),): v for n, v in const.items()}
    # Likewise H (7168): the JIT specialises ints divisible by 16 unless do_not_specialize names them.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n == "H"}
    return ASTSource(fn, sig, constexprs, attrs)


def ptxas_v(ptx: str, maxnreg: int | None = None) -> str:
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(ptx)
        cmd = [PTXAS, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")]
        if maxnreg:
            cmd += ["--maxrregcount", str(maxnreg)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        text = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    return (f"regs={regs.group(1) if regs else '?'} stack={stack.group(1) if stack else '?'} "
            f"spill st/ld={spill.group(1) + '/' + spill.group(2) if spill else '?'}")


def rows(dtype="bf16", block_h=8192, num_warps=4, prefetch=1, num_stages=3, fused=None, acc64=False, reload=False,
         maxnreg=None):
    sig, const = rows_signature(dtype, fused or {})
    const.update(BLOCK_H=block_h, VEC=8 if dtype != "fp32" else 4, H_STRIDED=False, ACC64=acc64,
                 PREFETCH=prefetch, NUM_STAGES=num_stages, W_RELOAD=reload)
    src = _source(attn_res_fwd.attn_res_rows_kernel, sig, const)
    k = triton.compile(src, target=TARGET, options={"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})})
    return k.asm["ptx"], k.metadata.shared


def main() -> None:
    cases = [
        ("plain w4 p1", dict()),
        ("plain w4 p0 s3", dict(prefetch=0, num_stages=3)),
        ("plain w4 p2", dict(prefetch=2)),
        ("plain w8 p1", dict(num_warps=8)),
        ("fused add+snap w4 p1", dict(fused=dict(HAS_ADDEND=True, SNAPSHOT=True))),
        ("fused add+snap+norm w4 p1", dict(fused=dict(HAS_ADDEND=True, SNAPSHOT=True, OUT_NORM=True))),
        ("fused add+snap+norm w4 p0 s3", dict(prefetch=0, num_stages=3,
                                               fused=dict(HAS_ADDEND=True, SNAPSHOT=True, OUT_NORM=True))),
        ("fused add+snap+norm w8 p1", dict(num_warps=8, fused=dict(HAS_ADDEND=True, SNAPSHOT=True, OUT_NORM=True))),
    ]
    fz = dict(HAS_ADDEND=True, SNAPSHOT=True, OUT_NORM=True)
    cases += [
        ("plain w4 p1 R", dict(reload=True)),
        ("plain w4 p2 R", dict(prefetch=2, reload=True)),
        ("plain w4 p0 s3 R", dict(prefetch=0, reload=True)),
        ("fused add+snap+norm w4 p1 R", dict(reload=True, fused=fz)),
        ("fused add+snap+norm w4 p0 s3 R", dict(prefetch=0, reload=True, fused=fz)),
        ("fused add+snap w4 p1 R", dict(reload=True, fused=dict(HAS_ADDEND=True, SNAPSHOT=True))),
        ("fused snap (no addend) w4 p1 R", dict(reload=True, fused=dict(SNAPSHOT=True))),
    ]
    only = sys.argv[1:]
    for name, kw in cases:
        if only and not any(o in name for o in only):
            continue
        ptx, shared = rows(**kw)
        print(f"{name:34s} {ptxas_v(ptx)} shared={shared}")


if __name__ == "__main__":
    main()


def sweep_maxnreg() -> None:
    fz = dict(HAS_ADDEND=True, SNAPSHOT=True, OUT_NORM=True)
    for name, kw, cap in [("plain w8 p1", dict(num_warps=8), 128), ("plain w8 p2", dict(num_warps=8, prefetch=2), 128),
                          ("plain w8 p0 s3", dict(num_warps=8, prefetch=0), 128),
                          ("plain w8 p1 R", dict(num_warps=8, reload=True), 128),
                          ("plain w8 p2 R", dict(num_warps=8, prefetch=2, reload=True), 128),
                          ("fused w8 p1", dict(num_warps=8, fused=fz), 128),
                          ("fused w8 p1 R", dict(num_warps=8, fused=fz, reload=True), 128),
                          ("plain w16 p2", dict(num_warps=16, prefetch=2), 64),
                          ("plain w16 p2 R", dict(num_warps=16, prefetch=2, reload=True), 64),
                          ("plain w16 p1", dict(num_warps=16, prefetch=1), 64)]:
        ptx, shared = rows(**kw, maxnreg=cap)
        print(f"{name:34s} cap {cap}: {ptxas_v(ptx)} shared={shared}")


def sweep_fused_p0() -> None:
    for name, fz in [("snap", dict(SNAPSHOT=True)), ("add", dict(HAS_ADDEND=True)),
                     ("add+snap", dict(HAS_ADDEND=True, SNAPSHOT=True)), ("norm", dict(OUT_NORM=True)),
                     ("add+snap+norm", dict(HAS_ADDEND=True, SNAPSHOT=True, OUT_NORM=True))]:
        for st in (3, 4):
            ptx, shared = rows(prefetch=0, num_stages=st, fused=fz, dtype="bf16")
            print(f"fused {name:14s} w4 p0 s{st}: {ptxas_v(ptx)} shared={shared}")
    for st in (2, 4, 5):
        ptx, shared = rows(prefetch=0, num_stages=st)
        print(f"plain w4 p0 s{st}: {ptxas_v(ptx)} shared={shared}")


def bwd(dtype="bf16", k_pad=16, tile=4096, num_warps=16, num_stages=1, acc64=True, maxnreg=None):
    """The backward gradient kernel (all outputs), as the CUDA policy launches it."""
    from k3_ops.kernels import attn_res_bwd

    fn = attn_res_bwd.attn_res_bwd_kernel
    sig = {"gy_ptr": f"*{dtype}", "prefix_ptr": f"*{dtype}", "blocks_ptr": f"*{dtype}", "nw_ptr": "*fp32",
           "pw_ptr": "*fp32", "gp_ptr": f"*{dtype}", "gb_ptr": f"*{dtype}", "ws_ptr": "*fp64" if acc64 else "*fp32",
           "eps": "fp32"}
    for n in ("T", "K", "C", "H", "tokens_per_prog", "stride_gyt", "stride_pt", "stride_ph", "stride_bt",
              "stride_bc", "stride_bh", "stride_gpt", "stride_gbt", "stride_gbc"):
        sig[n] = "i32"
    const = dict(BLOCK_H=max(16, tile // k_pad), K_PAD=k_pad, VEC=8 if dtype != "fp32" else 4, H_STRIDED=False,
                 WRITE_PREFIX=True, WRITE_BLOCKS=True, COMPUTE_DW=True, ACC64=acc64, DF=False, NUM_STAGES=num_stages)
    for n in const:
        sig[n] = "constexpr"
    src = _source(fn, sig, const)
    opts = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    k = triton.compile(src, target=TARGET, options=opts)
    return k.asm["ptx"], k.metadata.shared


def sweep_bwd() -> None:
    for kw in [dict(), dict(num_stages=2), dict(num_stages=3), dict(tile=2048, num_warps=8, num_stages=2),
               dict(tile=2048, num_warps=8, num_stages=3), dict(tile=8192, num_warps=16, num_stages=2),
               dict(k_pad=2, num_stages=2), dict(k_pad=2, tile=2048, num_warps=8, num_stages=3)]:
        ptx, shared = bwd(**kw)
        print(f"bwd {kw}: {ptxas_v(ptx)} shared={shared}")
