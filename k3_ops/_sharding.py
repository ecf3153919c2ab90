"""DTensor sharding rules of every kimi_k3 op, as data, registered with torch.distributed.tensor.

Every kimi_k3 op is per token: token t of each output reads token t of the activations ([T, ...] arguments) and
the whole of the per-hidden weights, and nothing else (attn_res_backward's weight gradients are sums over tokens).
So each op has two modes per mesh dimension, and ``RULES`` says what each argument and output is in them:

    replicate   every tensor Replicate                      -> outputs Replicate
    token       activations Shard(0) (block_residual: dim 0 of its logical [T, C, H] view, which is the
                Shard(1) of a block-major [C, T, H] buffer passed as .transpose(0, 1)), weights Replicate
                                                            -> token outputs Shard(0), weight gradients Partial()

and the local op runs on each rank's tokens with no communication (uneven splits and ranks without tokens
included). The mode of a mesh dimension follows from the arguments' placements there (``_mode``):

- a written argument (``Tensor(a!)``: block_residual of the serving ops, prefix_sum of fused_attn_res_, sum_out
  of .full) decides: Replicate -> replicate, Shard(0) -> token; it is never redistributed (the write would land in
  a temporary), so any other placement of it is an error, as are two written arguments that disagree;
- else an activation that is Shard(0), Partial() (reduced by a reduce-scatter, as sequence parallelism does after a
  row-parallel linear) or sharded on its hidden dim (an all-to-all to Shard(0); gloo does it as an all-gather and a
  local chunk) makes the dimension token-sharded; with all activations Replicate it is replicated;
- weights are always used whole: Shard or Partial weights are all-gathered / all-reduced to Replicate;
- rejected (an error naming the op, the argument and the placement): block_residual sharded on its capacity dim
  (every token mixes all K blocks: serving it would gather the whole bank on every call; redistribute it to
  Shard(0) yourself) and placements this module does not know (e.g. _StridedShard).

Registration goes through torch.distributed.tensor.experimental.register_sharding (public since torch 2.6), which
expands one rule per mesh dimension to every combination over the mesh and lets DTensor pick the one of least
redistribution cost. On a mesh whose dimensions all get one mode (every 1-D mesh) the rule offers that one
combination only; with mixed modes it offers both rows and DTensor picks (for ops with a written argument only when
every argument already has the picked placements, so that no write can be redistributed away).

fused_attn_res_ and fused_attn_res.full are the exceptions: DTensor treats every op whose name ends in "_" as a torch
in-place op that returns its first argument, which fused_attn_res_ (returning (out, scale)) is not, and newer
DTensor dispatchers (torch 2.15) take an op with a keyword-only written argument (.full's sum_out) for an out=
variant and return that argument instead of the op's outputs. Each gets a DTensor kernel of its own through
torch.library.register_torch_dispatch: the same rule data pick the placements, the other arguments are redistributed
to them, and the op runs in place on the local shards of its written arguments.

Importing this module registers everything; it does nothing (and raises nothing) where torch.distributed or DTensor
is missing. docs/distributed.md's table is ``placements_table()``; tests/test_distributed.py checks it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["RULES", "ShardingRule", "placements_table", "REGISTERED", "COLLECTIVES"]

REPLICATE, TOKEN = "replicate", "token"


def _nothing(args: dict) -> frozenset:
    return frozenset()


@dataclass(frozen=True)
class ShardingRule:
    """The placements of one kimi_k3 overload (``op``: ``attn_res``, ``fused_attn_res.quant``, ...).

    activations: [T, ...] tensor arguments (Shard(0) in token mode); weights: per-hidden tensor arguments (always
    Replicate); written: arguments the op writes in place (never redistributed); outputs: (name, placement in token
    mode); empty: the outputs that are empty [0] tensors for given arguments (a dict name -> value), which are
    Replicate in both modes (there is nothing to shard).
    """

    op: str
    activations: tuple[str, ...]
    weights: tuple[str, ...]
    outputs: tuple[tuple[str, str], ...]
    written: tuple[str, ...] = ()
    empty: Callable[[dict], frozenset] = _nothing
    communication: str = "none"

    def output_placements(self, mode: str, args: dict) -> list[str]:
        empty = self.empty(args)
        return ["Replicate()" if mode == REPLICATE or name in empty else placement
                for name, placement in self.outputs]


_SERVING_IN = ("prefix_sum", "addend", "block_residual")
_SERVING_W = ("norm_weight", "proj_weight", "out_norm_weight")


def _backward_empty(args: dict) -> frozenset:
    mask = list(args["output_mask"])
    names = ("grad_prefix_sum", "grad_block_residual", "grad_norm_weight", "grad_proj_weight")
    return frozenset(name for name, want in zip(names, mask) if not want)


def _full_empty(args: dict) -> frozenset:
    empty = set()
    if not args["mix"]:
        empty.add("out")
    if args["addend"] is None or args["sum_out"] is not None:
        empty.add("new_prefix")
    if not args["return_mix"]:
        empty.add("mix")
    return frozenset(empty)


def _inplace_empty(args: dict) -> frozenset:
    return frozenset() if args["out_dtype"] is not None else frozenset({"scale"})


RULES: tuple[ShardingRule, ...] = (
    ShardingRule("attn_res", ("prefix_sum", "block_residual"), ("norm_weight", "proj_weight"),
                 (("out", "Shard(0)"),)),
    ShardingRule("attn_res_backward", ("grad_out", "prefix_sum", "block_residual"), ("norm_weight", "proj_weight"),
                 (("grad_prefix_sum", "Shard(0)"), ("grad_block_residual", "Shard(0)"),
                  ("grad_norm_weight", "Partial()"), ("grad_proj_weight", "Partial()")),
                 empty=_backward_empty,
                 communication="none in the op; the weights' gradients stay Partial() until a redistribute / "
                               "full_tensor (an all-reduce of H values each) or FSDP's reduce-scatter sums them"),
    ShardingRule("fused_attn_res", _SERVING_IN, _SERVING_W, (("out", "Shard(0)"), ("new_prefix", "Shard(0)")),
                 written=("block_residual",)),
    ShardingRule("fused_attn_res.quant", _SERVING_IN, _SERVING_W,
                 (("out", "Shard(0)"), ("new_prefix", "Shard(0)"), ("scale", "Shard(0)")),
                 written=("block_residual",)),
    ShardingRule("fused_attn_res.full", (*_SERVING_IN, "sum_out"), _SERVING_W,
                 (("out", "Shard(0)"), ("new_prefix", "Shard(0)"), ("mix", "Shard(0)")),
                 written=("block_residual", "sum_out"), empty=_full_empty),
    ShardingRule("fused_attn_res_", _SERVING_IN, _SERVING_W, (("out", "Shard(0)"), ("scale", "Shard(0)")),
                 written=("prefix_sum", "block_residual"), empty=_inplace_empty),
)

# Overloads served by a DTensor kernel of their own instead of register_sharding (see the module docstring):
# fused_attn_res_ (its name), and .full, whose keyword-only written sum_out makes newer DTensor dispatchers (torch
# 2.15) take it for an out= variant and return its out arguments instead of its outputs.
_OWN_KERNEL = frozenset({"fused_attn_res_", "fused_attn_res.full"})

#: Collectives among the ops, which no placement rule describes. tp_all_reduce sums each rank's local partial over a
#: process group; a DTensor already says what its local tensors sum to (Partial()), so on a DTensor the op returns
#: that logical value replicated, through DTensor's own communication (an all-reduce of a Partial() dim, an
#: all-gather of a Shard dim; nothing for a Replicate() one), and its group_name argument is not used.
COLLECTIVES = {"tp_all_reduce": "DTensor's own: all-reduce of each Partial() mesh dim, all-gather of each Shard one"}

REGISTERED: dict[str, str] = {}  # overload -> how it was registered ("register_sharding" / "torch_dispatch")


def placements_table() -> str:
    """The markdown table of docs/distributed.md, from ``RULES``."""
    lines = ["| op | mode | input placements | output placements | communication |", "|---|---|---|---|---|"]
    for rule in RULES:
        for mode in (REPLICATE, TOKEN):
            act = "Replicate()" if mode == REPLICATE else "Shard(0)"
            ins = [f"{name} {act}" for name in rule.activations] + [f"{name} Replicate()" for name in rule.weights]
            outs = [f"{name} {'Replicate()' if mode == REPLICATE else p}" for name, p in rule.outputs]
            comm = "none" if mode == REPLICATE else rule.communication
            lines.append(f"| `{rule.op}` | {mode} | {', '.join(ins)} | {', '.join(outs)} | {comm} |")
    return "\n".join(lines) + "\n"


# --- applying the rules --------------------------------------------------------------------------------------
def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.kimi_k3, packet), overload or "default")


def _bind(op, args: tuple, kwargs: dict) -> tuple[dict, list[str]]:
    """name -> value for every schema argument (defaults filled in), and the names in the order DTensor lists the
    op's tensor inputs (positional arguments as passed, then keyword arguments)."""
    schema_args = op._schema.arguments
    bound = {a.name: a.default_value for a in schema_args if a.has_default_value()}
    order = []
    for a, value in zip(schema_args, args):
        bound[a.name] = value
        order.append(a.name)
    for name, value in kwargs.items():
        bound[name] = value
        order.append(name)
    return bound, order


def _is_spec(value) -> bool:
    # A DTensorSpec (what register_sharding passes for a tensor) or a DTensor, without importing private classes.
    return hasattr(value, "placements") and (hasattr(value, "mesh") or hasattr(value, "device_mesh"))


def _ndim(spec) -> int:
    meta = getattr(spec, "tensor_meta", None)
    return len(meta.shape) if meta is not None else spec.ndim


def _mode(rule: ShardingRule, bound: dict, own_kernel: bool = False) -> list[str]:
    """The mode of every mesh dimension for these arguments (rules in the module docstring), or an error that names
    the op, the argument and the placement."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    specs = {name: v for name, v in bound.items() if _is_spec(v)}
    mesh_ndim = len(next(iter(specs.values())).placements)
    modes = []
    for dim in range(mesh_ndim):
        decided, votes = {}, False
        for name, spec in specs.items():
            p = spec.placements[dim]
            where = (f"kimi_k3::{rule.op}: {name} has placement {p!r} on mesh dim {dim} "
                     f"(placements {tuple(spec.placements)!r})")
            if name in rule.written:
                if isinstance(p, Replicate):
                    decided[name] = REPLICATE
                elif type(p) is Shard and p.dim == 0:
                    decided[name] = TOKEN
                else:
                    raise NotImplementedError(
                        f"{where}; it is written in place, so it cannot be redistributed: give it Replicate() or "
                        "Shard(0) (the token dim) on every mesh dim")
                continue
            if isinstance(p, Replicate):
                continue
            if name in rule.weights:
                if type(p) in (Shard, Partial):
                    continue  # gathered / reduced to Replicate: the op needs every hidden element of a weight
            elif type(p) is Partial:
                votes = True  # reduce-scatter to Shard(0)
                continue
            elif type(p) is Shard:
                d = p.dim % _ndim(spec)
                if d == 0 or d == _ndim(spec) - 1:
                    votes = True  # the token dim, or the hidden dim (all-to-all to Shard(0))
                    continue
                raise NotImplementedError(
                    f"{where}: sharding the capacity dim of block_residual is not served (every token mixes all "
                    "its valid blocks, so each call would gather the whole bank); redistribute it to Shard(0) "
                    "(tokens) or Replicate()")
            raise NotImplementedError(f"{where}: not a placement this op serves (Replicate(), Shard(0), the hidden "
                                      "dim's Shard or Partial() for activations)")
        if len(set(decided.values())) > 1:
            raise NotImplementedError(
                f"kimi_k3::{rule.op}: the arguments written in place disagree on mesh dim {dim}: "
                + ", ".join(f"{n} {specs[n].placements[dim]!r}" for n in decided)
                + "; they must have the same placement (both Replicate() or both Shard(0))")
        modes.append(next(iter(decided.values())) if decided else (TOKEN if votes else REPLICATE))
    return modes if own_kernel else _few_tokens(rule, specs, modes)


def _few_tokens(rule: ShardingRule, specs: dict, modes: list[str]) -> list[str]:
    """register_sharding's expansion drops every Shard of a dim shorter than its number of shards (DTensor's
    is_tensor_shardable), so with fewer tokens than ranks on the token-sharded dims only the replicated mode is left:
    take it (an all-gather of those few tokens), unless a written argument is token-sharded, which cannot move."""
    name, spec = next((n, s) for n, s in specs.items() if n in rule.activations)
    mesh = getattr(spec, "mesh", None) or spec.device_mesh
    shards = 1
    for dim, mode in enumerate(modes):
        shards *= mesh.size(dim) if mode == TOKEN else 1
    num_tokens = spec.shape[0]
    if num_tokens >= shards:
        return modes
    written = [n for n in rule.written if n in specs and any(p.is_shard() for p in specs[n].placements)]
    if written:
        raise NotImplementedError(
            f"kimi_k3::{rule.op}: {written[0]} is token-sharded (placements {tuple(specs[written[0]].placements)!r}) "
            f"with {num_tokens} tokens over {shards} shards; DTensor's register_sharding refuses a Shard of a dim "
            "shorter than its number of shards, and a written argument cannot be gathered: use at least as many "
            "tokens as ranks, or Replicate()")
    return [REPLICATE] * len(modes)


def _placement(text: str):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {"Replicate()": Replicate(), "Shard(0)": Shard(0), "Partial()": Partial()}[text]


def _input_placements(rule: ShardingRule, mode: str, bound: dict, order: list[str]) -> list:
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for name in order:
        if not _is_spec(bound[name]):
            out.append(None)
        elif name in rule.activations and mode == TOKEN:
            out.append(Shard(0))
        else:
            out.append(Replicate())
    return out


def _strategy(rule: ShardingRule, op, *args, **kwargs):
    bound, order = _bind(op, args, kwargs)
    modes = _mode(rule, bound)

    def row(mode):
        return ([_placement(p) for p in rule.output_placements(mode, bound)],
                _input_placements(rule, mode, bound, order))

    if len(set(modes)) == 1:
        return [row(modes[0])]
    if rule.written:
        # With mixed modes DTensor picks a combination by cost; only when every argument already has the wanted
        # placements is the pick certain to be the one that leaves the written arguments where they are.
        wanted = _wanted(rule, modes, bound)
        for name, spec in bound.items():
            if _is_spec(spec) and tuple(spec.placements) != wanted[name]:
                raise NotImplementedError(
                    f"kimi_k3::{rule.op}: {name} has placements {tuple(spec.placements)}; on a mesh whose dims "
                    f"are {modes} (from the arguments written in place) every argument must already be "
                    f"{wanted[name]} (redistribute it first)")
    return [row(REPLICATE), row(TOKEN)]


def _wanted(rule: ShardingRule, modes: list[str], bound: dict) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    return {name: tuple(Shard(0) if (m == TOKEN and name in rule.activations) else Replicate() for m in modes)
            for name, v in bound.items() if _is_spec(v)}


# --- fused_attn_res_: its own DTensor kernel ---------------------------------------------------------------------
def _inplace_dtensor_kernel(rule: ShardingRule, op):
    """A torch_dispatch rule of ``op`` for DTensor: the placements from ``rule`` (as register_sharding would pick
    them), the non-written arguments redistributed to them, the op run in place on the local shards, the outputs
    wrapped with their global shapes (uneven token splits included)."""

    def kernel(mode, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        bound, _ = _bind(op, args, kwargs)
        modes = _mode(rule, bound, own_kernel=True)
        wanted = _wanted(rule, modes, bound)
        mesh = bound["prefix_sum"].device_mesh
        local = {}
        for name, value in bound.items():
            if isinstance(value, DTensor):
                if value.device_mesh != mesh:
                    raise NotImplementedError(f"kimi_k3::{rule.op}: {name} is on mesh {value.device_mesh}, "
                                              f"prefix_sum on {mesh}; all arguments must share one mesh")
                if tuple(value.placements) != wanted[name]:
                    # Never a written argument: _mode takes their placements as the wanted ones.
                    value = value.redistribute(mesh, wanted[name])
                local[name] = value.to_local()
            elif isinstance(value, torch.Tensor):
                raise NotImplementedError(f"kimi_k3::{rule.op}: {name} is a plain tensor and prefix_sum a DTensor; "
                                          "pass every tensor argument as a DTensor")
        names = [a.name for a in op._schema.arguments]
        outs = func(*[local.get(n, bound[n]) for n in names[:len(args)]],
                    **{n: local.get(n, bound[n]) for n in kwargs})
        num_tokens = bound["prefix_sum"].shape[0]
        per_mode = {m: rule.output_placements(m, bound) for m in set(modes)}
        results = []
        for i, t in enumerate(outs):
            placements = tuple(_placement(per_mode[m][i]) for m in modes)
            shape = list(t.shape)
            if any(p.is_shard() for p in placements):
                shape[0] = num_tokens
            results.append(DTensor.from_local(t, mesh, placements, run_check=False, shape=torch.Size(shape),
                                              stride=_contiguous_strides(shape)))
        return tuple(results)

    return kernel


def _collective_dtensor_kernel(name: str):
    """tp_all_reduce on a DTensor: its logical value, Replicate() on every mesh dim (see ``COLLECTIVES``)."""

    def kernel(mode, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor, Replicate

        partial = args[0] if args else (kwargs or {})["partial"]
        if not isinstance(partial, DTensor):
            raise NotImplementedError(f"kimi_k3::{name}: partial must be a DTensor here, got {type(partial).__name__}")
        mesh = partial.device_mesh
        out = partial.redistribute(mesh, [Replicate()] * mesh.ndim)
        # A new tensor, as the op's schema promises (where nothing moves, redistribute keeps the local tensor).
        return out.clone() if out.to_local().data_ptr() == partial.to_local().data_ptr() else out

    return kernel


def _contiguous_strides(shape: list[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _cache_on_every_option(op) -> None:
    """DTensor caches a sharding decision by the tensor specs, the arguments from the first int one on and the int
    keyword arguments only (register_sharding's conservative default); .full's mix / return_mix, fused_attn_res_'s
    out_dtype and .quant's out_dtype change which outputs exist and their dtypes, so every keyword argument must be
    part of the key. No public API sets this: set DTensor's per-op schema info where this torch keeps it, else
    leave it (a torch that does not keep it there does not cache by it either)."""
    from torch.distributed.tensor import DTensor

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    table = getattr(propagator, "op_to_schema_info", None)
    info = table.get(op) if isinstance(table, dict) else None
    if info is None or not hasattr(info, "static_kwargkey"):
        return
    info.static_kwargkey = [a.name for a in op._schema.arguments if a.kwarg_only]


def _register() -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # a torch without DTensor's public registration API
        return
    from functools import partial

    for rule in RULES:
        op = _overload(rule.op)
        if rule.op in _OWN_KERNEL:
            torch.library.register_torch_dispatch(op, DTensor, _inplace_dtensor_kernel(rule, op))
            REGISTERED[rule.op] = "register_torch_dispatch"
            continue
        register_sharding(op)(partial(_strategy, rule, op))
        _cache_on_every_option(op)
        REGISTERED[rule.op] = "register_sharding"
    for name in COLLECTIVES:
        if hasattr(torch.ops.kimi_k3, name):
            torch.library.register_torch_dispatch(_overload(name), DTensor, _collective_dtensor_kernel(name))
            REGISTERED[name] = "register_torch_dispatch"


_register()
