"""Registers, spills and shared memory of the forward kernels compiled for sm_90 WITHOUT a GPU.

Compiles the Triton kernels ahead of time (``triton.compile`` for target cuda:90) and runs ``ptxas -v`` on the
PTX, with the ptxas Triton itself assembles sm_90 with (``find_ptxas``), so register pressure of a launch
configuration can be read on any machine (the H200 time is then spent only on timings). Triton versions differ
between machines (code generation and ptxas both); treat the figures as close, not exact.
Usage: python tools/ptxas_info.py [-h] [--json | --store-order | --schedule | --counts | WORD ...]
  WORD ...       print the cases whose names contain one of the words (all cases without any), e.g. fused default
  --json         registers / spills of the budget cases as JSON (tests/test_register_budget.py reads it)
  --store-order  the fused kernels' store order in their Triton IR as JSON (tests/test_store_order.py reads it)
  --schedule     where the one-tile plan's global loads sit in its sm_90 SASS
  --counts       sm_90 instruction counts of the per-token kernel's plans as the launch table runs them
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3_ops.backends import TRITON_COMPILE_OPTIONS  # noqa: E402
from k3_ops.kernels import attn_res_fwd  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def find_ptxas(arch: int = TARGET.arch) -> tuple[str, str] | None:
    """(path, CUDA release) of the ptxas Triton assembles sm_<arch> with; None where this triton has none.

    Triton's own lookup, not a fixed file: the binary follows the PTX version Triton emits, and that moves with
    the release (triton 3.6-3.8 use their bundled ``bin/ptxas`` below sm_100; 3.9 emits PTX 9.4 for sm_90, which
    only its bundled ``bin/ptxas-blackwell`` accepts). ``TRITON_PTXAS_PATH`` / ``TRITON_PTXAS_BLACKWELL_PATH``
    override it here as they do for Triton's own compiles. ``get_ptxas(arch)`` returning a tool with ``.path``
    and ``.version`` is the API of triton 3.6, 3.8 and 3.9.
    """
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:  # no CUDA backend in this triton (e.g. triton-ascend)
        return None
    try:
        tool = get_ptxas(arch)
    except RuntimeError:  # Triton's "Cannot find ptxas"
        return None
    return tool.path, tool.version


def rows_signature(dtype: str, fused: dict) -> tuple[dict, dict]:
    sig = {"prefix_ptr": f"*{dtype}", "blocks_ptr": f"*{dtype}", "nw_ptr": "*fp32", "pw_ptr": "*fp32",
           "out_ptr": f"*{dtype}", "T": "i32", "K": "i32", "H": "i32", "eps": "fp32"}
    for s in ("stride_pt", "stride_ph", "stride_bt", "stride_bc", "stride_bh", "stride_ot"):
        sig[s] = "i32"
    const = {}
    for name in ("BLOCK_H", "VEC", "H_STRIDED", "ACC64", "PREFETCH", "NUM_STAGES"):
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
        # The serving flags (fused_attn_res_ / fused_attn_res.quant): the prefix stored in place (no new_prefix),
        # the FP32-mix norm, the FP8 output through a uint8 view with its fp32 scales.
        if fused.get("INPLACE_PREFIX"):
            sig["newp_ptr"] = "constexpr"
            const["newp_ptr"] = None
        if fused.get("FP8_OUT"):
            sig["out_ptr"] = "*u8"
            sig["scale_ptr"] = "*fp32"
        for name in ("INPLACE_PREFIX", "NORM_FP32_MIX", "FP8_OUT", "FP8_FNUZ", "FP8_MAX"):
            if name in fused:
                sig[name] = "constexpr"
                const[name] = fused[name]
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


def _options(num_warps: int, maxnreg: int | None = None) -> dict:
    # The launches' own compile options (k3_ops.backends.TRITON_COMPILE_OPTIONS), so the figures are theirs.
    return {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {}), **TRITON_COMPILE_OPTIONS}


def resources(ptx: str) -> dict:
    """ptxas -v's report for one kernel: registers, stack frame and spill bytes (-1 where not reported)."""
    found = find_ptxas()
    if found is None:
        raise RuntimeError(f"triton {triton.__version__} has no ptxas for sm_{TARGET.arch}")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([found[0], "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    text = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed: {text}")

    def grab(pattern: str, group: int = 1) -> int:
        m = re.search(pattern, text)
        return int(m.group(group)) if m else -1

    spill = r"(\d+) bytes spill stores, (\d+) bytes spill loads"
    return {"regs": grab(r"Used (\d+) registers"), "stack": grab(r"(\d+) bytes stack frame"),
            "spill_stores": grab(spill, 1), "spill_loads": grab(spill, 2)}


def ptxas_v(ptx: str) -> str:
    r = resources(ptx)
    return f"regs={r['regs']} stack={r['stack']} spill st/ld={r['spill_stores']}/{r['spill_loads']}"


def rows(dtype="bf16", block_h=8192, num_warps=4, prefetch=1, num_stages=3, fused=None, acc64=False, maxnreg=None,
         asm="ptx"):
    sig, const = rows_signature(dtype, fused or {})
    const.update(BLOCK_H=block_h, VEC=8 if dtype != "fp32" else 4, H_STRIDED=False, ACC64=acc64,
                 PREFETCH=prefetch, NUM_STAGES=num_stages)
    src = _source(attn_res_fwd.attn_res_rows_kernel, sig, const)
    k = triton.compile(src, target=TARGET, options=_options(num_warps, maxnreg))
    return k.asm[asm], k.metadata.shared


def token(dtype="bf16", block_h=8192, rows=4, num_warps=8, num_stages=1, fused=None, acc64=False, one_tile=False,
          onw_ahead=False, prefix_first=False, norm_gram=False, asm="ptx", weights="fp32"):
    """The per-token decode kernel (kernels/attn_res_decode.py) with PDL, as the CUDA policy launches it; ``asm``:
    which of the compiled forms to return ("ptx", "cubin", or "ttir" for the Triton IR); ``weights``: the dtype of
    the norm and projection weights (the benchmarks' are the I/O dtype)."""
    from k3_ops.kernels import attn_res_decode

    sig, const = rows_signature(dtype, fused or {})
    sig["nw_ptr"] = sig["pw_ptr"] = f"*{weights}"
    del sig["PREFETCH"]
    for name in ("ROWS", "USE_PDL", "ONE_TILE", "ONW_AHEAD", "PREFIX_FIRST", "NORM_GRAM", "H_EXACT"):
        sig[name] = "constexpr"
    const.update(BLOCK_H=block_h, ROWS=rows, VEC=8 if dtype != "fp32" else 4, H_STRIDED=False, ACC64=acc64,
                 NUM_STAGES=num_stages, USE_PDL=True, ONE_TILE=one_tile, ONW_AHEAD=onw_ahead,
                 PREFIX_FIRST=prefix_first, NORM_GRAM=norm_gram, H_EXACT=7168)
    src = _source(attn_res_decode.attn_res_token_kernel, sig, const)
    k = triton.compile(src, target=TARGET, options=_options(num_warps))
    return k.asm[asm], k.metadata.shared


def bwd(dtype="bf16", k_pad=16, tile=4096, num_warps=16, num_stages=1, acc64=True, maxnreg=None, kernel="tiles",
        block=1024):
    """The backward gradient kernel (all outputs), as the CUDA policy launches it ("rows": the streaming kernel,
    one [8192] row per step; "stats" / "apply": the two streams of the stats_apply split, ``block`` columns)."""
    from k3_ops.kernels import attn_res_bwd

    if kernel in ("stats", "apply"):
        return split_bwd(kernel, dtype, k_pad, block, num_warps, num_stages, acc64)
    fn = attn_res_bwd.attn_res_bwd_rows_kernel if kernel == "rows" else attn_res_bwd.attn_res_bwd_kernel
    sig = {"gy_ptr": f"*{dtype}", "prefix_ptr": f"*{dtype}", "blocks_ptr": f"*{dtype}", "nw_ptr": "*fp32",
           "pw_ptr": "*fp32", "gp_ptr": f"*{dtype}", "gb_ptr": f"*{dtype}", "ws_ptr": "*fp64" if acc64 else "*fp32",
           "eps": "fp32"}
    for n in ("T", "K", "C", "H", "tokens_per_prog", "stride_gyt", "stride_pt", "stride_ph", "stride_bt",
              "stride_bc", "stride_bh", "stride_gpt", "stride_gbt", "stride_gbc"):
        sig[n] = "i32"
    const = dict(BLOCK_H=8192 if kernel == "rows" else max(16, tile // k_pad), K_PAD=k_pad,
                 VEC=8 if dtype != "fp32" else 4, H_STRIDED=False, WRITE_PREFIX=True, WRITE_BLOCKS=True,
                 COMPUTE_DW=True, ACC64=acc64, NUM_STAGES=num_stages)
    if kernel != "rows":
        const["DF"] = False
    for n in const:
        sig[n] = "constexpr"
    src = _source(fn, sig, const)
    k = triton.compile(src, target=TARGET, options=_options(num_warps, maxnreg))
    return k.asm["ptx"], k.metadata.shared


def split_bwd(which: str, dtype: str, k_pad: int, block: int, num_warps: int, num_stages: int, acc64: bool):
    from k3_ops.kernels import attn_res_bwd

    acc = "*fp64" if acc64 else "*fp32"
    sig = {"gy_ptr": f"*{dtype}", "prefix_ptr": f"*{dtype}", "blocks_ptr": f"*{dtype}", "nw_ptr": "*fp32",
           "pw_ptr": "*fp32"}
    ints = ["T", "K", "H", "tokens_per_prog", "stride_gyt", "stride_pt", "stride_ph", "stride_bt", "stride_bc",
            "stride_bh"]
    const = dict(BLOCK_C=block, K_PAD=k_pad, VEC=8 if dtype != "fp32" else 4, H_STRIDED=False, ACC64=acc64,
                 NUM_STAGES=num_stages)
    if which == "stats":
        fn = attn_res_bwd.attn_res_bwd_stats_kernel
        sig["part_ptr"] = acc
    else:
        fn = attn_res_bwd.attn_res_bwd_apply_kernel
        sig.update({"sc_ptr": "*fp32", "gp_ptr": f"*{dtype}", "gb_ptr": f"*{dtype}", "ws_ptr": acc})
        ints += ["C", "stride_gpt", "stride_gbt", "stride_gbc"]
        const.update(WRITE_PREFIX=True, WRITE_BLOCKS=True, COMPUTE_DW=True)
    sig.update({n: "i32" for n in ints})
    sig.update({n: "constexpr" for n in const})
    k = triton.compile(_source(fn, sig, const), target=TARGET, options=_options(num_warps))
    return k.asm["ptx"], k.metadata.shared


FUSED_ALL = dict(HAS_ADDEND=True, SNAPSHOT=True, OUT_NORM=True)
#: vLLM's pre-attention call through fused_attn_res_: in-place add, snapshot, FP32-mix norm, optionally FP8.
SERVING = dict(FUSED_ALL, INPLACE_PREFIX=True, NORM_FP32_MIX=True)
SERVING_FP8 = dict(SERVING, FP8_OUT=True, FP8_MAX=448.0)


def store_order(ir: str, pointer_args: list[str]) -> list[list]:
    """The ``tt.store`` and ``tt.reduce`` operations of a kernel's Triton IR in program order, each with the pointer
    arguments it derives from: a store through its pointer operand, a reduction through all its operands (a loaded
    value derives from the pointer it was loaded through). [[kind, line, [argument, ...]], ...]"""
    defs, events = {}, []

    def refs(text: str) -> set[str]:
        return {r.split("#")[0] for r in re.findall(r"%[\w.#]+", text)}

    body = ir[ir.index("tt.func public"):]
    for line_no, line in enumerate(body.splitlines()):
        line = line.split(" loc(")[0].strip()
        m = re.match(r"(%[\w.]+)(?::\d+)? = (.*)", line)
        if m:
            defs[m.group(1)] = refs(m.group(2))
            if '"tt.reduce"' in m.group(2):
                events.append(["reduce", line_no, refs(m.group(2))])
        elif line.startswith("tt.store "):
            events.append(["store", line_no, refs(line.split(",")[0])])

    def roots(names: set[str], seen: set[str]) -> set[str]:
        out = set()
        for n in names - seen:
            seen.add(n)
            if n[1:] in pointer_args:
                out.add(n[1:])
            out |= roots(defs.get(n, set()), seen)
        return out

    return [[kind, line_no, sorted(roots(names, set()))] for kind, line_no, names in events]


#: The kernel variants whose store order tests/test_store_order.py checks: the per-token kernel at 128 columns over
#: 8 warps, so that a row tensor is held by two threads each (a replicated layout), with the one-tile plan and with
#: 4-row tiles; the rows kernel's in-place serving call as the large-T table runs it.
ORDER_CASES = {
    "one-tile-inplace": ("token", dict(block_h=128, rows=4, one_tile=True, fused=SERVING)),
    "one-tile-fused": ("token", dict(block_h=128, rows=4, one_tile=True, fused=FUSED_ALL)),
    "tiles-inplace": ("token", dict(block_h=128, rows=4, fused=SERVING)),
    "rows-inplace": ("rows", dict(prefetch=0, num_stages=3, fused=SERVING)),
}
FORWARD_CASES = [
    ("plain w4 p1", dict()),
    ("plain w4 p2", dict(prefetch=2)),
    ("plain w4 p0 s3 (default)", dict(prefetch=0, num_stages=3)),
    ("plain w4 p0 s4", dict(prefetch=0, num_stages=4)),
    ("plain w8 p1", dict(num_warps=8)),
    ("fused add+snap+norm w4 p1", dict(fused=FUSED_ALL)),
    ("fused add+snap+norm w4 p0 s3", dict(prefetch=0, num_stages=3, fused=FUSED_ALL)),
    ("fused snap w4 p0 s3", dict(prefetch=0, num_stages=3, fused=dict(SNAPSHOT=True))),
    ("fused add+snap+norm w8 p1", dict(num_warps=8, fused=FUSED_ALL)),
    ("serving in-place fp32-norm w4 p0 s3", dict(prefetch=0, num_stages=3, fused=SERVING)),
    ("serving in-place fp32-norm fp8 w4 p0 s3", dict(prefetch=0, num_stages=3, fused=SERVING_FP8)),
]
BACKWARD_CASES = [
    ("K_PAD 16, 16 warps, tile 4096, 1 stage", dict()),
    ("K_PAD 16, 16 warps, tile 4096, 3 stages", dict(num_stages=3)),
    ("K_PAD 16, 8 warps, tile 2048, 3 stages (default)", dict(tile=2048, num_warps=8, num_stages=3)),
    ("K_PAD 2, 8 warps, tile 2048, 3 stages (default)", dict(k_pad=2, tile=2048, num_warps=8, num_stages=3)),
    ("rows kernel, K_PAD 16, 8 warps, 3 stages", dict(kernel="rows", k_pad=16, num_warps=8, num_stages=3)),
    ("rows kernel, K_PAD 2, 8 warps, 3 stages", dict(kernel="rows", k_pad=2, num_warps=8, num_stages=3)),
    ("rows kernel, K_PAD 16, 8 warps, 2 stages", dict(kernel="rows", k_pad=16, num_warps=8, num_stages=2)),
    ("rows kernel, K_PAD 16, 16 warps, 3 stages", dict(kernel="rows", k_pad=16, num_warps=16, num_stages=3)),
    ("rows kernel, K_PAD 16, 8 warps, 2 stages, FP32", dict(kernel="rows", k_pad=16, num_warps=8, num_stages=2,
                                                            acc64=False)),
    ("rows kernel, K_PAD 16, 16 warps, 2 stages, FP32", dict(kernel="rows", k_pad=16, num_warps=16, num_stages=2,
                                                             acc64=False)),
]


def budget_cases() -> list[tuple[str, str, dict]]:
    """The plans the CUDA policy launches by default (read from the live launch table and backward config; the
    backward at H = 7168: both kernels "auto" picks between, the stats/apply split's two streams and the rows
    kernel), and the tiles backward it falls back to for H > 8192."""
    from k3_ops.backends import cuda

    # The rows kernel as the table launches it at large T (K > 8).
    plan = cuda.LAUNCH_TABLE[(cuda.bucket(16384, cuda.T_BUCKETS), cuda.bucket(32, cuda.K_BUCKETS))]
    assert plan.kernel == "rows", plan
    fwd = dict(num_warps=plan.num_warps or 4, prefetch=plan.prefetch, num_stages=plan.num_stages)
    def bwd_kw(k_pad: int, config=None) -> list[tuple[str, dict]]:
        """("", kw) for a one-kernel plan; ("", stats kw), ("-apply", apply kw) for the stats_apply split."""
        p = cuda.choose_backward_plan(4096, k_pad - 1, 7168, torch.device("cpu"), config)
        kw = dict(kernel=p.kernel, tile=p.block_h * p.k_pad, num_warps=dict(p.launch_options)["num_warps"],
                  num_stages=p.num_stages, acc64=p.acc64, k_pad=k_pad)
        if p.kernel != "stats_apply":
            return [("", kw)]
        return [("", dict(kw, kernel="stats", block=p.apply_block)),
                ("-apply", dict(kw, kernel="apply", block=p.apply_block, num_warps=dict(p.apply_options)["num_warps"],
                                num_stages=p.apply_num_stages))]

    tiles = cuda.BackwardConfig(kernel="tiles")
    tp = cuda.choose_backward_plan(4096, 15, 7168, torch.device("cpu"), tiles)
    tiles_kw = dict(tile=tiles.tile_elems, num_warps=dict(tp.launch_options)["num_warps"], num_stages=tp.num_stages,
                    acc64=tiles.acc64)
    return [("forward-default", "fwd", fwd), ("forward-default-fused", "fwd", dict(fwd, fused=FUSED_ALL)),
            *[(f"backward-split{suffix}-kpad{k}", "bwd", kw) for k in (16, 2)
              for suffix, kw in bwd_kw(k, cuda.BackwardConfig(kernel="stats_apply"))],
            *[(f"backward-rows-kpad{k}", "bwd", kw) for k in (16, 2)
              for _, kw in bwd_kw(k, cuda.BackwardConfig(kernel="rows"))],
            ("backward-tiles-kpad16", "bwd", dict(tiles_kw, k_pad=16)),
            ("backward-tiles-kpad2", "bwd", dict(tiles_kw, k_pad=2)),
            *one_tile_cases(), *loop_cases()]


def loop_cases() -> list[tuple[str, str, dict]]:
    """The per-token loop plans the table runs at K = 5..8 and 9..16 above 128 tokens and K = 3..4 above 512 (one
    row at a time, 4 warps, the prefix candidate first; 3 stages, but 4 at K = 9..16 up to 512 tokens: ``-s3``
    names that bucket's plan above them), plain, fused with every flag and as vLLM's in-place call makes it,
    H = 7168."""
    from k3_ops.backends import cuda

    cases = []
    for K, T, tag in ((8, 256, ""), (16, 256, ""), (16, 1024, "-s3"), (4, 1024, "")):
        plan = cuda.choose_config(T, K, 7168, torch.device("cpu"))
        kw = dict(rows=plan.rows_per_tile, num_warps=plan.num_warps, num_stages=plan.num_stages,
                  prefix_first=plan.prefix_first)
        name = f"forward-loop-k{K}{tag}"
        cases += [(name, "token", kw), (f"{name}-fused", "token", dict(kw, fused=FUSED_ALL)),
                  (f"{name}-serving", "token", dict(kw, fused=SERVING))]
    return cases


def one_tile_cases() -> list[tuple[str, str, dict]]:
    """The one-tile plan (``LaunchConfig(kernel="token", rows_per_tile=0, num_warps=8)``, the table's at K <= 4 up to
    512 tokens) at K = 1, 2, 4 (tiles of 1, 2 and 4 rows, H = 7168), plain and fused with every flag, the output
    norm's weight ahead where the policy loads it so (at most two rows over 8 warps), and there also without it
    (``-fused-after``, ``LaunchConfig.onw_ahead`` False: the registers that decide 1 or 2 programs per SM)."""
    from k3_ops.backends import cuda

    config = cuda.LaunchConfig(kernel="token", rows_per_tile=0, num_warps=8)
    cases = []
    for K in (1, 2, 4):
        plan = cuda.choose_config(1, K, 7168, torch.device("cpu"), config)
        kw = dict(rows=plan.rows_per_tile, num_warps=plan.num_warps, num_stages=plan.num_stages, one_tile=True)
        cases.append((f"forward-one-tile-k{K}", "token", kw))
        cases.append((f"forward-one-tile-k{K}-fused", "token",
                      dict(kw, fused=FUSED_ALL, onw_ahead=plan.onw_ahead)))
        if plan.onw_ahead:
            cases.append((f"forward-one-tile-k{K}-fused-after", "token", dict(kw, fused=FUSED_ALL)))
    return cases


def sass(cubin: bytes) -> list[str]:
    """The instruction lines of a cubin's sm_90 SASS (nvdisasm, Triton's bundled one), labels kept as lines that
    start with '.L_'."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in text.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4}\*/", line) or re.match(r"\.L_x_\d+:", line.strip())]


def load_schedule(cubin: bytes) -> dict:
    """Where a kernel's global loads sit in its sm_90 SASS (``sass``): the instruction count, the index of every LDG
    and of the first warp shuffle (the first cross-thread reduction step).
    Loads issued well after the others, among the arithmetic on the first ones, mean a schedule that works on the
    rows already in while the rest are in flight (docs/kernels.md, "One tile")."""
    code = [line for line in sass(cubin) if not line.startswith(".L_")]
    ldg = [i for i, line in enumerate(code) if "LDG" in line]
    shfl = next((i for i, line in enumerate(code) if "SHFL" in line), len(code))
    return {"instructions": len(code), "ldg": ldg, "first_shuffle": shfl}


#: The opcodes ``sass_counts`` reports: barriers and warp shuffles (the reductions' rounds), the special-function
#: unit (rsqrt, exp, reciprocal), subroutine calls (the correctly rounded sqrt and division's slow paths), the
#: global loads (LDGSTS: asynchronous copies into shared memory) and stores.
COUNTED = ("BAR", "SHFL", "MUFU", "CALL", "LDG", "LDGSTS", "STG")


def sass_counts(cubin: bytes) -> dict:
    """A kernel's sm_90 instruction count, the COUNTED opcodes' counts, and the length of its longest loop (the
    instructions from a backward branch's target to the branch: a loop body, 0 without a loop)."""
    labels, code, loop = {}, [], 0
    for line in sass(cubin):
        if line.startswith(".L_"):
            labels[line[:-1]] = len(code)
            continue
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and target.group(1) in labels:
            loop = max(loop, len(code) - labels[target.group(1)])
        code.append(line)
    ops = [re.sub(r"^/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", line).split(" ")[0].split(".")[0] for line in code]
    return {"instructions": len(code), **{op: ops.count(op) for op in COUNTED}, "loop_body": loop}


def count_cases() -> list[tuple[str, bytes]]:
    """(name, cubin) of the per-token kernel's plans as the CUDA table launches them at H = 7168 (bf16 rows and
    weights): the one-tile plan at K = 1, 2, 4 and the one-row loop plan (4 warps, 3 stages, the prefix first;
    K = 5..8 from 129 tokens), each plain, fused (addend, snapshot, output norm) and serving (in place)."""
    cases = []
    for name, fused in (("plain", None), ("fused", FUSED_ALL), ("serving", SERVING)):
        for K in (1, 2, 4):
            rows = 1 << (K - 1).bit_length()
            ahead = fused is not None and rows <= 2
            cases.append((f"one-tile-k{K}-{name}", token(rows=rows, one_tile=True, fused=fused, onw_ahead=ahead,
                                                         asm="cubin", weights="bf16")[0]))
        cases.append((f"loop-w4-s3-{name}", token(rows=1, num_warps=4, num_stages=3, prefix_first=True, fused=fused,
                                                  asm="cubin", weights="bf16")[0]))
    return cases


def schedule_cases() -> list[tuple[str, bytes]]:
    """(name, cubin) of the one-tile plan at K = 4 (plain, fused, in-place serving; bf16 weights, as the benchmarks
    pass them)."""
    return [(f"op-one-tile-k4-{name}", token(rows=4, one_tile=True, fused=fused, asm="cubin", weights="bf16")[0])
            for name, fused in (("plain", None), ("fused", FUSED_ALL), ("serving", SERVING))]


def main() -> None:
    """Print every case whose name contains one of the command-line words (all cases without any);
    ``--json`` prints {"triton": version, "ptxas": [path, CUDA release] or null, "cases": {name: resources}} for
    ``budget_cases()`` instead (used by tests/test_register_budget.py; no cases where there is no ptxas);
    ``--store-order`` prints the same with {name: store_order(...)} for ``ORDER_CASES`` (tests/test_store_order.py);
    ``--schedule`` the global loads' places in the sm_90 SASS of ``schedule_cases()`` (``load_schedule``);
    ``--counts`` the instruction counts of ``count_cases()`` (``sass_counts``)."""
    args = sys.argv[1:]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return
    found = find_ptxas()
    if args[:1] == ["--counts"]:
        print(f"triton {triton.__version__}: name, instructions, {', '.join(COUNTED)}, loop body")
        for name, cubin in count_cases():
            r = sass_counts(cubin)
            print(f"{name:22s} {r['instructions']:5d} " + " ".join(f"{op} {r[op]:3d}" for op in COUNTED)
                  + f" loop {r['loop_body']}")
        return
    if args[:1] == ["--schedule"]:
        print(f"triton {triton.__version__}: name, instructions, LDG indices, first shuffle")
        for name, cubin in schedule_cases():
            r = load_schedule(cubin)
            print(f"{name:24s} {r['instructions']:5d} ldg {' '.join(map(str, r['ldg']))} shuffle {r['first_shuffle']}")
        return
    if args[:1] == ["--store-order"]:
        from k3_ops.kernels import attn_res_decode

        kernels = {"token": (token, attn_res_decode.attn_res_token_kernel),
                   "rows": (rows, attn_res_fwd.attn_res_rows_kernel)}
        cases = {}
        for name, (kind, kw) in ORDER_CASES.items() if found else ():
            compile_, fn = kernels[kind]
            cases[name] = store_order(compile_(asm="ttir", **kw)[0], [n for n in fn.arg_names if n.endswith("_ptr")])
        print(json.dumps({"triton": triton.__version__, "ptxas": found, "cases": cases}))
        return
    if args[:1] == ["--json"]:
        out = {}
        for name, kind, kw in budget_cases() if found else []:
            ptx = {"fwd": rows, "token": token, "bwd": bwd}[kind](**kw)[0]
            out[name] = resources(ptx)
        print(json.dumps({"triton": triton.__version__, "ptxas": found, "cases": out}))
        return
    print(f"triton {triton.__version__}, ptxas {found[1] if found else None} ({found[0] if found else 'not found'})")
    for name, kw in FORWARD_CASES:
        if not args or any(o in name for o in args):
            ptx, shared = rows(**kw)
            print(f"forward  {name:46s} {ptxas_v(ptx)} shared={shared}")
    for name, _, kw in one_tile_cases():
        if not args or any(o in name for o in args):
            ptx, shared = token(**kw)
            print(f"forward  {name:46s} {ptxas_v(ptx)} shared={shared}")
    for name, kw in BACKWARD_CASES:
        if not args or any(o in name for o in args):
            ptx, shared = bwd(**kw)
            print(f"backward {name:46s} {ptxas_v(ptx)} shared={shared}")


if __name__ == "__main__":
    main()
