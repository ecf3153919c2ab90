"""The checks of tests/test_distributed.py, run inside each process of a gloo group (CPU).

``worker(rank, world_size, store_path, out_dir, groups)`` joins the group through a FileStore, runs the named check
groups and writes ``rank<r>.json``: check id -> "" (passed) or the reason it failed. Each check compares a DTensor
call of a kimi_k3 op with the same op on the whole tensors in this process (on the CPU: the reference formula), on
the shared samples of tests/conftest.py (NaN in the unused capacity). A check raising is a failure, not a crash, so
one report names every failing check.
"""
from __future__ import annotations

import json
import os
import traceback

import torch

LAYOUTS = ("tokenmajor", "blockmajor")


def _dist():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    return DTensor, Partial, Replicate, Shard, distribute_tensor


def _token_counts(world_size: int) -> tuple[int, ...]:
    # Uneven splits and a rank without tokens: torch's Shard(0) gives ceil(T / n) rows per rank, so T = 5 on 4 ranks
    # is 2, 2, 1, 0; T = 3 on 4 ranks (1, 1, 1, 0) and T = 1 on 2 have fewer tokens than ranks, which
    # register_sharding cannot shard (the rules fall back to Replicate, see _token_placement).
    return (7, 5, 3) if world_size == 4 else (7, 3, 1)


def _token_placement(num_tokens: int, world_size: int):
    """What a token-sharded output is: Shard(0), or Replicate() with fewer tokens than ranks (k3_ops/_sharding.py,
    _few_tokens)."""
    from torch.distributed.tensor import Replicate, Shard

    return Shard(0) if num_tokens >= world_size else Replicate()


def _bank(distribute_tensor, mesh, bank: torch.Tensor, layout: str, placement):
    """A block_residual DTensor: token-major as it is, block-major as a [C, T, H] DTensor (Shard(1) for tokens)
    viewed through .transpose(0, 1)."""
    from torch.distributed.tensor import Shard

    if layout == "tokenmajor":
        return distribute_tensor(bank, mesh, [placement])
    block_placement = Shard(1) if isinstance(placement, Shard) else placement
    return distribute_tensor(bank.transpose(0, 1).contiguous(), mesh, [block_placement]).transpose(0, 1)


def _sample(T: int, dtype: torch.dtype, layout: str, K: int = 3, cap: int = 5, H: int = 64):
    from conftest import Sample

    return Sample(T=T, K=K, cap=cap, H=H, dtype=dtype, layout=layout)


def _same(dt, ref: torch.Tensor, what: str, exact: bool = True) -> str:
    from conftest import bits_equal

    if dt.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):  # gloo gathers no FP8: gather the bytes
        from torch.distributed.tensor import DTensor

        dt = DTensor.from_local(dt.to_local().view(torch.uint8), dt.device_mesh, dt.placements, run_check=False,
                                shape=dt.shape, stride=dt.stride())
        ref = ref.view(torch.uint8)
    got = dt.full_tensor()
    if exact:
        return "" if bits_equal(got, ref) else f"{what}: not bit-equal to the single-process op"
    try:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    except AssertionError as e:
        return f"{what}: {e}"
    return ""


class Checks:
    def __init__(self, rank: int, world_size: int):
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world_size = rank, world_size
        self.mesh = init_device_mesh("cpu", (world_size,))
        self.results: dict[str, str] = {}

    def record(self, name: str, fn) -> None:
        try:
            self.results[name] = fn() or ""
        except Exception:  # a failing check is reported, the others still run
            self.results[name] = traceback.format_exc(limit=6)

    # --- attn_res and attn_res_backward ---------------------------------------------------------------------
    def forward_backward(self) -> None:
        for T in _token_counts(self.world_size):
            for dtype in (torch.bfloat16, torch.float32):
                for layout in LAYOUTS:
                    for mode in ("replicate", "token"):
                        sample = _sample(T, dtype, layout)
                        self.record(f"attn_res-{mode}-{sample.id}", lambda s=sample, m=mode: self._attn_res(s, m))

    def _attn_res(self, sample, mode: str) -> str:
        DTensor, Partial, Replicate, Shard, distribute_tensor = _dist()
        from conftest import grad_out_for

        args = sample.make("cpu", requires_grad=True)
        ref = torch.ops.kimi_k3.attn_res(*_positional(args))
        gy = grad_out_for(sample, "cpu")
        ref.backward(gy)
        act = Shard(0) if mode == "token" else Replicate()
        d = dict(
            prefix_sum=distribute_tensor(args["prefix_sum"].detach(), self.mesh, [act]).requires_grad_(True),
            block_residual=_bank(distribute_tensor, self.mesh, args["block_residual"].detach(), sample.layout,
                                 act).detach().requires_grad_(True),
            norm_weight=distribute_tensor(args["norm_weight"].detach(), self.mesh, [Replicate()]).requires_grad_(True),
            proj_weight=distribute_tensor(args["proj_weight"].detach(), self.mesh, [Replicate()]).requires_grad_(True),
        )
        if d["block_residual"].placements != (act,):
            return f"block_residual view has {d['block_residual'].placements}, expected {(act,)}"
        out = torch.ops.kimi_k3.attn_res(d["prefix_sum"], d["block_residual"], d["norm_weight"], d["proj_weight"],
                                         sample.K, sample.eps)
        problems = []
        out_act = _token_placement(sample.T, self.world_size) if mode == "token" else act
        if out.placements != (out_act,):
            problems.append(f"out placements {out.placements}")
        if out_act == act and out.to_local().shape[0] != d["prefix_sum"].to_local().shape[0]:
            problems.append("out's local token count differs from prefix_sum's")
        problems.append(_same(out, ref.detach(), "out"))
        out.backward(distribute_tensor(gy, self.mesh, [out_act]))
        weight_grad = Partial() if out_act == Shard(0) else Replicate()
        for name in ("prefix_sum", "block_residual"):
            g = d[name].grad
            if g.placements != (out_act,):  # the input's placement, or Replicate() with fewer tokens than ranks
                problems.append(f"{name}.grad placements {g.placements}")
            problems.append(_same(g, args[name].grad, f"{name}.grad"))
        for name in ("norm_weight", "proj_weight"):
            g = d[name].grad
            if g.placements != (weight_grad,):
                problems.append(f"{name}.grad placements {g.placements}, expected {(weight_grad,)}")
            # A sum over tokens split over ranks: the order of the additions differs (fp32 tolerance).
            problems.append(_same(g, args[name].grad, f"{name}.grad", exact=weight_grad == Replicate()))
        return "; ".join(p for p in problems if p)

    def backward_op(self) -> None:
        """attn_res_backward called directly, with every output_mask, token-sharded."""
        for mask in ([True, True, True, True], [True, False, True, False], [False, True, False, False],
                     [False, False, False, True]):
            T = _token_counts(self.world_size)[1]
            self.record(f"attn_res_backward-token-T{T}-mask{''.join('1' if m else '0' for m in mask)}",
                        lambda mk=mask, t=T: self._backward_op(t, mk))

    def _backward_op(self, T: int, mask: list[bool]) -> str:
        DTensor, Partial, Replicate, Shard, distribute_tensor = _dist()
        from conftest import grad_out_for

        sample = _sample(T, torch.float32, "blockmajor")
        args = sample.make("cpu")
        gy = grad_out_for(sample, "cpu")
        ref = torch.ops.kimi_k3.attn_res_backward(gy, *_positional(args), mask)
        got = torch.ops.kimi_k3.attn_res_backward(
            distribute_tensor(gy, self.mesh, [Shard(0)]), distribute_tensor(args["prefix_sum"], self.mesh, [Shard(0)]),
            _bank(distribute_tensor, self.mesh, args["block_residual"], sample.layout, Shard(0)),
            distribute_tensor(args["norm_weight"], self.mesh, [Replicate()]),
            distribute_tensor(args["proj_weight"], self.mesh, [Replicate()]), sample.K, sample.eps, mask)
        problems = []
        expected = [Shard(0), Shard(0), Partial(), Partial()]
        names = ("grad_prefix_sum", "grad_block_residual", "grad_norm_weight", "grad_proj_weight")
        for i, (name, want) in enumerate(zip(names, mask)):
            placement = expected[i] if want else Replicate()  # not asked for: an empty [0], replicated
            if got[i].placements != (placement,):
                problems.append(f"{name} placements {got[i].placements}, expected {(placement,)}")
            problems.append(_same(got[i], ref[i], name, exact=i < 2))
        return "; ".join(p for p in problems if p)

    # --- placements served by redistributing, and the errors -------------------------------------------------
    def redistributed(self) -> None:
        T = _token_counts(self.world_size)[0]
        self.record("attn_res-hidden-sharded-prefix-and-bank", lambda: self._redistributed(T, "hidden"))
        self.record("attn_res-partial-prefix", lambda: self._redistributed(T, "partial"))
        self.record("attn_res-sharded-weights", lambda: self._redistributed(T, "weights"))
        self.record("error-bank-capacity-sharded", lambda: self._error(T, "capacity"))
        self.record("error-written-bank-partial", lambda: self._error(T, "written"))

    def _redistributed(self, T: int, case: str) -> str:
        DTensor, Partial, Replicate, Shard, distribute_tensor = _dist()
        sample = _sample(T, torch.float32, "tokenmajor")
        args = sample.make("cpu")
        ref = torch.ops.kimi_k3.attn_res(*_positional(args))
        prefix = distribute_tensor(args["prefix_sum"], self.mesh, [Replicate()])
        bank = distribute_tensor(args["block_residual"], self.mesh, [Replicate()])
        nw = distribute_tensor(args["norm_weight"], self.mesh, [Replicate()])
        pw = distribute_tensor(args["proj_weight"], self.mesh, [Replicate()])
        if case == "hidden":  # as after a column-parallel linear: the hidden dim sharded
            prefix = distribute_tensor(args["prefix_sum"], self.mesh, [Shard(1)])
            bank = distribute_tensor(args["block_residual"], self.mesh, [Shard(2)])
        elif case == "partial":  # as after a row-parallel linear without its reduce: rank 0 holds it all
            local = args["prefix_sum"] if self.rank == 0 else torch.zeros_like(args["prefix_sum"])
            prefix = DTensor.from_local(local, self.mesh, [Partial()], run_check=False)
        elif case == "weights":
            nw = distribute_tensor(args["norm_weight"], self.mesh, [Shard(0)])
        out = torch.ops.kimi_k3.attn_res(prefix, bank, nw, pw, sample.K, sample.eps)
        want = (Replicate(),) if case == "weights" else (Shard(0),)
        problems = [] if out.placements == want else [f"out placements {out.placements}, expected {want}"]
        problems.append(_same(out, ref, "out"))
        return "; ".join(p for p in problems if p)

    def _error(self, T: int, case: str) -> str:
        DTensor, Partial, Replicate, Shard, distribute_tensor = _dist()
        sample = _sample(T, torch.float32, "tokenmajor")
        args = sample.make("cpu")
        nw = distribute_tensor(args["norm_weight"], self.mesh, [Replicate()])
        pw = distribute_tensor(args["proj_weight"], self.mesh, [Replicate()])
        prefix = distribute_tensor(args["prefix_sum"], self.mesh, [Shard(0)])
        needles = (("kimi_k3::attn_res", "block_residual", "Shard(dim=1)") if case == "capacity" else
                   ("kimi_k3::fused_attn_res", "block_residual", "Partial(sum)", "written in place"))
        try:
            if case == "capacity":
                bank = distribute_tensor(args["block_residual"], self.mesh, [Shard(1)])
                torch.ops.kimi_k3.attn_res(prefix, bank, nw, pw, sample.K, sample.eps)
            else:
                bank = DTensor.from_local(args["block_residual"].clone(), self.mesh, [Partial()], run_check=False)
                with torch.no_grad():
                    torch.ops.kimi_k3.fused_attn_res(prefix, None, bank, nw, pw, sample.K, sample.eps,
                                                     sample.K)
        except NotImplementedError as e:
            missing = [n for n in needles if n not in str(e)]
            return f"the message lacks {missing}: {e}" if missing else ""
        return "no error raised"

    # --- the serving ops: every overload, written arguments ---------------------------------------------------
    def serving(self) -> None:
        T = _token_counts(self.world_size)[1]
        cases = [("fused_attn_res", {}), ("fused_attn_res-outnorm-snapshot", {"snap": True, "norm": True}),
                 ("fused_attn_res.quant", {"quant": True, "snap": True, "norm": True}),
                 ("fused_attn_res.full-sum_out-return_mix", {"full": dict(return_mix=True), "sum_out": True,
                                                             "norm": True, "snap": True}),
                 ("fused_attn_res.full-mix_false", {"full": dict(mix=False), "snap": True}),
                 ("fused_attn_res.full-no_addend", {"full": dict(return_mix=True), "no_addend": True, "norm": True}),
                 ("fused_attn_res_-snapshot", {"inplace": True, "snap": True, "norm": True}),
                 ("fused_attn_res_-fp8", {"inplace": True, "quant": True, "norm": True}),
                 ("fused_attn_res_-no_addend", {"inplace": True, "no_addend": True})]
        for placement in ("partial", "shard", "replicate"):
            self.record(f"tp_all_reduce-{placement}", lambda p=placement: self._tp_all_reduce(p))
        for layout in LAYOUTS:
            for mode in ("replicate", "token"):
                for name, opts in cases:
                    self.record(f"{name}-{mode}-T{T}-{layout}", lambda n=name, o=opts, m=mode, lay=layout:
                                self._serving(T, lay, m, o))

    def _tp_all_reduce(self, placement: str) -> str:
        """The collective on a DTensor: the logical value (for Partial(), the sum of every rank's local tensor),
        replicated, a new tensor."""
        DTensor, Partial, Replicate, Shard, distribute_tensor = _dist()
        g = torch.Generator().manual_seed(11)
        locals_ = [torch.randn(4, 8, generator=g).to(torch.bfloat16) for _ in range(self.world_size)]
        mine = locals_[self.rank]
        if placement == "partial":
            dt = DTensor.from_local(mine, self.mesh, [Partial()], run_check=False)
            want = torch.stack([x.float() for x in locals_]).sum(0)
        else:
            full = locals_[0]
            dt = distribute_tensor(full, self.mesh, [Shard(0) if placement == "shard" else Replicate()])
            want = full.float()
        out = torch.ops.kimi_k3.tp_all_reduce(dt, "unused")
        if tuple(out.placements) != (Replicate(),):
            return f"placements {out.placements}, expected (Replicate(),)"
        if out.to_local().data_ptr() == dt.to_local().data_ptr():
            return "the output aliases the input"
        try:
            torch.testing.assert_close(out.to_local().float(), want, rtol=2e-2, atol=2e-2)
        except AssertionError as e:
            return str(e)
        return ""

    def _serving(self, T: int, layout: str, mode: str, opts: dict) -> str:
        DTensor, Partial, Replicate, Shard, distribute_tensor = _dist()
        sample = _sample(T, torch.bfloat16, layout)
        args = sample.make("cpu")
        g = torch.Generator().manual_seed(3)
        addend = None if opts.get("no_addend") else torch.randn(T, sample.H, generator=g).to(sample.dtype)
        out_norm = (1 + 0.1 * torch.randn(sample.H, generator=g)) if opts.get("norm") else None
        write = sample.K if opts.get("snap") else -1
        act = Shard(0) if mode == "token" else Replicate()

        def call(prefix, add, bank, nw, pw, onw, sum_out):
            common = (prefix, add, bank, nw, pw, sample.K, sample.eps, write, onw)
            if opts.get("inplace"):
                return torch.ops.kimi_k3.fused_attn_res_(
                    *common, out_dtype=torch.float8_e4m3fn if opts.get("quant") else None)
            if "full" in opts:
                return torch.ops.kimi_k3.fused_attn_res.full(*common, sum_out=sum_out, **opts["full"])
            if opts.get("quant"):
                return torch.ops.kimi_k3.fused_attn_res.quant(*common, out_dtype=torch.float8_e4m3fn)
            return torch.ops.kimi_k3.fused_attn_res(*common)

        ref_prefix, ref_bank = args["prefix_sum"].clone(), args["block_residual"].clone()
        if layout == "blockmajor":
            ref_bank = args["block_residual"].transpose(0, 1).clone().transpose(0, 1)
        ref_sum = torch.full_like(ref_prefix, float("nan")) if opts.get("sum_out") else None
        with torch.no_grad():
            ref = call(ref_prefix, addend, ref_bank, args["norm_weight"], args["proj_weight"], out_norm, ref_sum)
            dprefix = distribute_tensor(args["prefix_sum"].clone(), self.mesh, [act])
            dbank = _bank(distribute_tensor, self.mesh, args["block_residual"].clone(), layout, act)
            dsum = distribute_tensor(torch.full_like(ref_prefix, float("nan")), self.mesh, [act]) \
                if opts.get("sum_out") else None
            locals_before = {n: t.to_local().data_ptr() for n, t in (("prefix_sum", dprefix),
                                                                      ("block_residual", dbank)) if t is not None}
            got = call(dprefix, None if addend is None else distribute_tensor(addend, self.mesh, [act]), dbank,
                       distribute_tensor(args["norm_weight"], self.mesh, [Replicate()]),
                       distribute_tensor(args["proj_weight"], self.mesh, [Replicate()]),
                       None if out_norm is None else distribute_tensor(out_norm, self.mesh, [Replicate()]), dsum)
        problems = []
        for i, (g_out, r_out) in enumerate(zip(got, ref)):
            want = (Replicate(),) if r_out.numel() == 0 or mode == "replicate" else (Shard(0),)
            if g_out.placements != want:
                problems.append(f"output {i} placements {g_out.placements}, expected {want}")
            problems.append(_same(g_out, r_out, f"output {i}"))
        problems.append(_same(dbank, ref_bank, "block_residual after the call"))
        problems.append(_same(dprefix, ref_prefix, "prefix_sum after the call"))
        if dsum is not None:
            problems.append(_same(dsum, ref_sum, "sum_out after the call"))
        for n, t in (("prefix_sum", dprefix), ("block_residual", dbank)):
            if t.to_local().data_ptr() != locals_before[n] or t.placements != (act,):
                problems.append(f"{n}'s local shard or placement was replaced")
        return "; ".join(p for p in problems if p)

    # --- torch.compile ---------------------------------------------------------------------------------------
    def compiled(self) -> None:
        self.record("compile-fullgraph-attn_res-token", self._compiled)

    def _compiled(self) -> str:
        DTensor, Partial, Replicate, Shard, distribute_tensor = _dist()
        sample = _sample(8, torch.float32, "blockmajor")
        args = sample.make("cpu")
        ref = torch.ops.kimi_k3.attn_res(*_positional(args))

        def program(prefix, bank, nw, pw):
            return torch.ops.kimi_k3.attn_res(prefix * 1.0, bank, nw, pw, sample.K, sample.eps) + 0.0

        # aot_eager: Dynamo and AOTAutograd trace the DTensor program (the part DTensor takes part in); Inductor's
        # C++ compile would add minutes on a 2-core CPU and nothing DTensor-specific.
        compiled = torch.compile(program, fullgraph=True, backend="aot_eager")
        out = compiled(distribute_tensor(args["prefix_sum"], self.mesh, [Shard(0)]),
                       _bank(distribute_tensor, self.mesh, args["block_residual"], sample.layout, Shard(0)),
                       distribute_tensor(args["norm_weight"], self.mesh, [Replicate()]),
                       distribute_tensor(args["proj_weight"], self.mesh, [Replicate()]))
        problems = [] if out.placements == (Shard(0),) else [f"out placements {out.placements}"]
        problems.append(_same(out, ref, "compiled out"))
        return "; ".join(p for p in problems if p)


def _positional(args: dict) -> tuple:
    return (args["prefix_sum"], args["block_residual"], args["norm_weight"], args["proj_weight"],
            args["num_valid_blocks"], args["eps"])


def worker(rank: int, world_size: int, store_path: str, out_dir: str, groups: list[str]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # several processes share the machine's cores
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        import k3_ops  # noqa: F401

        checks = Checks(rank, world_size)
        for group in groups:
            getattr(checks, group)()
        results = checks.results
    except Exception:
        results = {"setup": traceback.format_exc()}
    finally:
        # Every rank past its last collective before any leaves: a peer gone while a message is in flight fails it.
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    # Leave without tearing the process group and the interpreter down: their destructors now and then end both
    # ranks in std::terminate ("terminate called without an active exception", SIGABRT) after every check has passed
    # and been written, even with the barrier above and destroy_process_group (about 1 run in 10 of the suite on 2
    # cores). The results are on disk; the test reads them, and a rank that died before writing them still fails it.
    os._exit(0)
