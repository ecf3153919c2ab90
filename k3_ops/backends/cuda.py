"""CUDA launch policy: the kimi_k3 ops on NVIDIA GPUs (and on CPU tensors under ``TRITON_INTERPRET=1``, which is
how CI tests this policy without a GPU).

Every call goes one way:

1. the cases that launch no kernel (fp64, T = 0, K = 0: backends/__init__.py, _fused.py, _backward.py);
2. the outputs (``FusedArgs.allocate`` for the fused calls, ``allocate_full`` for fused_attn_res.full);
3. the plan: ``choose_config`` (the launch table's plan, cached per (T bucket, K, H, device)), ``serving_config``
   (the serving calls'), ``choose_backward_plan``; each runs the pure plan step of cuda_plan.py on the device's
   ``DeviceFacts``;
4. the launch: ``launch_forward`` (a native kernel's C++ entry, or the plan's Triton kernel through
   ``_launch.launch``), ``launch_add_snapshot`` (fused_attn_res.full with mix=False: no plan, one program per token)
   or ``_backward.run_attn_res_backward``.

In a CUDA build of k3_ops._C the op's CUDA kernel is C++ (csrc_cuda/launch_cache.cpp): it replays the launches this
policy recorded for the call's metadata, and runs this module only on the first call of each key and for calls it
cannot replay. ``warmup`` compiles every plan the table can pick for a model, before graph capture.

Concurrency: no path keeps state between launches or shares a buffer across calls, so any number of launches may
be in flight on any streams of one device, eagerly or replayed from CUDA graphs.

Layouts: ``prefix_sum`` and ``block_residual`` are read in place at any token / block strides (token-major
[T, C, H] and block-major [C, T, H].transpose(0, 1) views alike); outputs are new and contiguous. Unit hidden
stride is the fast path; a non-unit hidden stride runs the ``H_STRIDED`` variant (compiled on first use, not by
``warmup``).
"""
from __future__ import annotations

import functools
import os
import threading

import torch

from .. import reference
from ..kernels import attn_res_decode as _decode
from ..kernels import attn_res_fwd as _fwd
from . import TRITON_COMPILE_OPTIONS, _backward, _launch, cuda_plan, prepare_weights, trivial_attn_res
from ._forward import kernel_arguments
from ._fused import (
    ADD_SNAPSHOT_FORMS,
    FULL_FORMS,
    FusedArgs,
    add_snapshot_args,
    add_snapshot_outputs,
    full_outputs,
    kernel_output,
    trivial_full_call,
    trivial_fused_attn_res,
    trivial_serving_call,
)
from .cuda_plan import (
    BACKWARD_CONFIG,
    BACKWARD_KERNEL_DEFAULTS,
    INTERPRETER_NUM_SMS,
    REDUCE_NUM_WARPS,
    RING_LAYOUT,
    ROWS_BACKWARD_MAX_H,
    SCALARS_PROGRAMS_PER_SM,
    SINGLE_READ_SMEM_MIN_K,
    SPLIT_BACKWARD_MIN_ROWS,
    BackwardConfig,
    DeviceFacts,
    Plan,
    forward_constexprs,
    forward_grid,
    native_layout_ok,
    single_read_layout_ok,
)
from .cuda_table import (
    K_BUCKETS,
    LAUNCH_TABLE,
    LOOP_MAX_T,
    NATIVE_KERNELS,
    SERVING_TOKEN_CONFIG,
    T_BUCKETS,
    TOKEN_MAX_T,
    TOKEN_MAX_T_K16,
    LaunchConfig,
    bucket,
)

__all__ = [
    # The ops' entry points (k3_ops._registration).
    "attn_res_forward",
    "fused_attn_res",
    "fused_attn_res_quant",
    "fused_attn_res_",
    "fused_attn_res_full",
    "attn_res_backward",
    "warmup",
    "FULL_FORMS",
    "ADD_SNAPSHOT_FORMS",
    # The device and the plans of this process.
    "use_interpreter",
    "num_sms",
    "pdl_enabled",
    "device_facts",
    "choose_config",
    "serving_config",
    "choose_backward_plan",
    "cluster_supported",
    "single_read_supported",
    "warmup_plans",
    "set_launch_config",
    "clear_plan_cache",
    # The launch step.
    "launch_forward",
    "launch_add_snapshot",
    # From the plan modules, for benchmarks and tools.
    "LaunchConfig",
    "LAUNCH_TABLE",
    "T_BUCKETS",
    "K_BUCKETS",
    "TOKEN_MAX_T",
    "TOKEN_MAX_T_K16",
    "LOOP_MAX_T",
    "NATIVE_KERNELS",
    "SERVING_TOKEN_CONFIG",
    "INTERPRETER_NUM_SMS",
    "bucket",
    "Plan",
    "DeviceFacts",
    "BackwardConfig",
    "BACKWARD_CONFIG",
    "BACKWARD_KERNEL_DEFAULTS",
    "ROWS_BACKWARD_MAX_H",
    "SPLIT_BACKWARD_MIN_ROWS",
    "SCALARS_PROGRAMS_PER_SM",
    "REDUCE_NUM_WARPS",
    "SINGLE_READ_SMEM_MIN_K",
    "RING_LAYOUT",
]


# --------------------------------------------------------------------------------------------------------------
# The device.
# --------------------------------------------------------------------------------------------------------------
def use_interpreter(t: torch.Tensor | torch.device) -> bool:
    """True when kernels on ``t`` (a tensor or a device) run under the Triton interpreter (TRITON_INTERPRET=1, or
    a CPU tensor)."""
    device = t if isinstance(t, torch.device) else t.device
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


_properties_cache: dict[int, object] = {}


def _properties(device: torch.device):
    """``torch.cuda.get_device_properties`` of a CUDA ``device``, read once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = _properties_cache.get(index)
    if props is None:
        props = _properties_cache[index] = torch.cuda.get_device_properties(index)
    return props


def num_sms(device: torch.device) -> int:
    """Streaming-multiprocessor count of ``device`` (the interpreter's stand-in count on CPU)."""
    return _properties(device).multi_processor_count if device.type == "cuda" else INTERPRETER_NUM_SMS


def pdl_enabled(device: torch.device) -> bool:
    """Whether forward launches on ``device`` use programmatic dependent launch: a GPU of compute capability 9.0+
    (not the interpreter), a Triton with ``launch_pdl``, and ``K3_OPS_PDL`` not "0". Read into the device's facts
    once; ``clear_plan_cache()`` after changing the variable."""
    if use_interpreter(device) or os.environ.get("K3_OPS_PDL", "1") == "0":
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return _properties(device).major >= 9 and "launch_pdl" in CUDAOptions.__dataclass_fields__


def _has_cuda_kernels() -> bool:
    from .. import _C

    return bool(getattr(_C, "has_cuda_kernels", False))


_facts_cache: dict[torch.device, DeviceFacts] = {}


def device_facts(device: torch.device) -> DeviceFacts:
    """What the plan step needs of ``device`` (cuda_plan.DeviceFacts), read once per device (``clear_plan_cache``
    reads them again)."""
    facts = _facts_cache.get(device)
    if facts is None:
        if device.type == "cuda" and device.index is None:  # "cuda": the current device, whichever it is now
            return device_facts(torch.device("cuda", torch.cuda.current_device()))
        facts = _facts_cache[device] = _read_facts(device)
    return facts


def _read_facts(device: torch.device) -> DeviceFacts:
    interpreted = use_interpreter(device)
    if device.type != "cuda":
        return DeviceFacts(interpreted=interpreted, num_sms=INTERPRETER_NUM_SMS)
    props = _properties(device)
    native = None
    if not interpreted and _has_cuda_kernels():
        from .. import _C

        native = _C
    return DeviceFacts(interpreted=interpreted, num_sms=props.multi_processor_count,
                       capability=(props.major, props.minor), pdl=pdl_enabled(device),
                       smem_optin=props.shared_memory_per_block_optin,
                       cluster_threads=None if native is None else native.attn_res_cluster_threads,
                       single_read_smem=None if native is None else native.attn_res_bwd_single_read_smem_bytes)


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL_CONTEXT = _NullContext()


def _device_guard(t: torch.Tensor):
    # Triton launches on the *current* device; make it the tensors' device (a no-op context when it already is,
    # the common case, which costs no device switch).
    if t.device.type == "cuda" and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NULL_CONTEXT


def _stream(t: torch.Tensor) -> int | None:
    # The raw current stream of the tensors' device (what Triton's driver would look up), or None off-GPU.
    return torch._C._cuda_getCurrentRawStream(t.device.index) if t.device.type == "cuda" else None


# --------------------------------------------------------------------------------------------------------------
# Plans of this process: the pure plan step on this device's facts, cached per key.
# --------------------------------------------------------------------------------------------------------------
#: Resolved table plans by (T bucket, K, H, device), and serving plans by (table plan, K, H, device).
_plan_cache: dict[tuple, Plan] = {}
_serving_cache: dict[tuple, Plan] = {}
_table_lock = threading.Lock()


def choose_config(T: int, K: int, H: int, device: torch.device, config: LaunchConfig | None = None) -> Plan:
    """The plan of a call: the table entry for (bucket(T), bucket(K)), or ``config`` if given, resolved for K, H and
    ``device``. Table plans are resolved once per (T bucket, K, H, device)."""
    if config is None:
        key = (bucket(T, T_BUCKETS), K, H, device)
        plan = _plan_cache.get(key)
        if plan is None:
            plan = _plan_cache[key] = cuda_plan.table_plan(T, K, H, device_facts(device))
        return plan
    return cuda_plan.resolve(K, H, device_facts(device), config)


def serving_config(T: int, K: int, H: int, device: torch.device, config: LaunchConfig | None = None) -> Plan:
    """The plan of a serving call (fused_attn_res.quant, fused_attn_res_, the FP32-mix norm): ``choose_config`` 's
    where its kernel has the serving flags, else ``cuda_plan.serving_plan`` 's (cached)."""
    plan = choose_config(T, K, H, device, config)
    kernel = plan.kernel
    if kernel in ("rows", "token") or (kernel in NATIVE_KERNELS and plan.fallback.kernel in ("rows", "token")):
        return plan
    key = (plan, K, H, device)
    served = _serving_cache.get(key)
    if served is None:
        served = _serving_cache[key] = cuda_plan.serving_plan(plan, K, H, device_facts(device))
    return served


def choose_backward_plan(T: int, K: int, H: int, device: torch.device, config: BackwardConfig | None = None,
                         element_size: int = 2):
    """``cuda_plan.backward_plan`` on ``device`` (element_size: the candidates'; 0 rules the C++ kernel out)."""
    return cuda_plan.backward_plan(T, K, H, device_facts(device), config, element_size)


def cluster_supported(K: int, H: int, device: torch.device, cluster_size: int, element_size: int = 2) -> bool:
    """``cuda_plan.cluster_supported`` on ``device``."""
    return cuda_plan.cluster_supported(K, H, device_facts(device), cluster_size, element_size)


def single_read_supported(K: int, H: int, device: torch.device, element_size: int = 2,
                          vectors_per_thread: int = 2) -> bool:
    """``cuda_plan.single_read_supported`` on ``device``."""
    return cuda_plan.single_read_supported(K, H, device_facts(device), element_size, vectors_per_thread)


def warmup_plans(device: torch.device, H: int, max_num_valid_blocks: int, max_num_tokens: int) -> dict[Plan, tuple]:
    """``cuda_plan.table_plans`` on ``device``: what ``warmup`` compiles."""
    return cuda_plan.table_plans(H, max_num_valid_blocks, max_num_tokens, device_facts(device))


def set_launch_config(t_bucket: int, k_bucket: int, config: LaunchConfig) -> LaunchConfig:
    """Replace one table entry (for tuning); returns the previous one. Buckets must be in T_BUCKETS/K_BUCKETS."""
    if t_bucket not in T_BUCKETS or k_bucket not in K_BUCKETS:
        raise ValueError(f"(t_bucket, k_bucket) must come from T_BUCKETS={T_BUCKETS} and K_BUCKETS={K_BUCKETS}, "
                         f"got ({t_bucket}, {k_bucket})")
    with _table_lock:
        old = LAUNCH_TABLE[(t_bucket, k_bucket)]
        LAUNCH_TABLE[(t_bucket, k_bucket)] = config
        _plan_cache.clear()
        _serving_cache.clear()
    _launch.clear_recipes()
    return old


def clear_plan_cache() -> None:
    """Forget resolved plans, device facts and the C++ launch recipes made from them (after changing
    ``K3_OPS_PDL``; ``set_launch_config`` clears the plans itself)."""
    with _table_lock:
        _plan_cache.clear()
        _serving_cache.clear()
        _facts_cache.clear()
    _launch.clear_recipes()


# --------------------------------------------------------------------------------------------------------------
# The ops.
# --------------------------------------------------------------------------------------------------------------
def attn_res_forward(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                     proj_weight: torch.Tensor, num_valid_blocks: int, eps: float, *,
                     config: LaunchConfig | None = None) -> torch.Tensor:
    """kimi_k3::attn_res on CUDA tensors (or CPU tensors under the Triton interpreter).

    Args (already checked by ``k3_ops._C.check_attn_res``):
        prefix_sum: [T, H] bf16/fp16/fp32 (fp64 goes to the reference), any strides.
        block_residual: [T, C, H] same dtype, any strides (token-major or block-major view); only slots < K read.
        norm_weight: [H]; proj_weight: [H] or [1, H]; any floating dtype (non bf16/fp16/fp32 cast to fp32).
        num_valid_blocks: K in [0, C]. eps: > 0.
        config: bypass the launch table (benchmarks / tuning); None uses ``LAUNCH_TABLE``.
    Returns: a new contiguous [T, H] tensor of prefix_sum.dtype.
    """
    out = trivial_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps)
    if out is not None:
        return out
    T, H = prefix_sum.shape
    K = int(num_valid_blocks)
    nw, pw = prepare_weights(norm_weight, proj_weight)
    out = torch.empty((T, H), dtype=prefix_sum.dtype, device=prefix_sum.device)
    plan = choose_config(T, K, H, prefix_sum.device, config)
    launch_forward(plan, prefix_sum, block_residual, nw, pw, out, K, float(eps))
    return out


def fused_attn_res(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                   norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                   block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                   out_norm_eps: float | None = None, *, round_mix: bool = True,
                   config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res on CUDA tensors (or CPU tensors under the Triton interpreter); arguments already
    checked by ``k3_ops._C.check_fused_attn_res``. Returns ``(out, new_prefix)``, new contiguous [T, H]; writes
    ``block_residual[:, block_write_idx]`` when ``block_write_idx >= 0``, nothing else.

    The forward's plan for (T, K) with the kernels' fused flags (kernels/attn_res_fwd.py): the add, the new_prefix
    and snapshot stores and the RMSNorm epilogue happen inside the mix kernel, in one launch (the opt-in split path
    takes two, three with the output norm). Same plan and arithmetic as ``attn_res_forward`` for the same T and K,
    so ``out`` equals it bit for bit without the norm. The FP32-mix norm (round_mix=False with an output norm) takes
    the serving calls' plan. fp64 and T = 0 run the reference composition (no kernel). config: as for
    ``attn_res_forward``.
    """
    trivial = trivial_fused_attn_res(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                     eps, block_write_idx, out_norm_weight, out_norm_eps, attn_res_forward, round_mix)
    if trivial is not None:
        return trivial
    # round_mix matters only with an output norm; without one the launch is exactly the rounded-mix call's.
    serving = not round_mix and out_norm_weight is not None
    fused, out = FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                    eps if out_norm_eps is None else out_norm_eps, round_mix=not serving)
    _launch_fused(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out,
                  serving, config)
    return out, fused.new_prefix


def fused_attn_res_quant(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                         norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                         block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                         out_norm_eps: float | None = None, *, out_dtype: torch.dtype, round_mix: bool = True,
                         config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res.quant on CUDA tensors (or CPU tensors under the Triton interpreter); arguments
    already checked by ``k3_ops._C.check_fused_attn_res_quant``. Returns ``(q, new_prefix, scale)``: q [T, H] of the
    FP8 out_dtype, new_prefix [T, H], scale [T, 1] fp32; writes ``block_residual[:, block_write_idx]`` when
    ``block_write_idx >= 0``, nothing else. One launch with the serving flags (``serving_config``); fp64 and T = 0
    run the reference composition.
    """
    trivial = trivial_serving_call(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                   eps, block_write_idx, out_norm_weight, out_norm_eps, inplace=False,
                                   out_dtype=out_dtype, round_mix=round_mix, attn_res_fn=attn_res_forward)
    if trivial is not None:
        return trivial
    fused, out = FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                    eps if out_norm_eps is None else out_norm_eps, round_mix=round_mix,
                                    out_dtype=out_dtype)
    _launch_fused(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out, True,
                  config)
    return out, fused.new_prefix, fused.scale


def fused_attn_res_(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                    norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                    block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                    out_norm_eps: float | None = None, *, out_dtype: torch.dtype | None = None,
                    round_mix: bool = True, config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res_ on CUDA tensors (or CPU tensors under the Triton interpreter); arguments already
    checked by ``k3_ops._C.check_fused_attn_res_inplace``. Stores round(prefix_sum + addend) back into prefix_sum
    (with an addend), snapshots it into ``block_residual[:, block_write_idx]`` (when >= 0), and returns
    ``(out, scale)`` (scale [T, 1] fp32 with an FP8 out_dtype, else empty): one launch with the serving flags, the
    in-place prefix store included (``serving_config``). fp64 and T = 0 run the reference composition.
    """
    trivial = trivial_serving_call(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                   eps, block_write_idx, out_norm_weight, out_norm_eps, inplace=True,
                                   out_dtype=out_dtype, round_mix=round_mix, attn_res_fn=attn_res_forward)
    if trivial is not None:
        return trivial
    fused, out = FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight,
                                    eps if out_norm_eps is None else out_norm_eps, inplace=True,
                                    round_mix=round_mix, out_dtype=out_dtype)
    _launch_fused(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out, True,
                  config)
    return out, fused.scale if fused.scale is not None else out.new_empty((0,), dtype=torch.float32)


def fused_attn_res_full(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_residual: torch.Tensor,
                        norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                        block_write_idx: int = -1, out_norm_weight: torch.Tensor | None = None,
                        out_norm_eps: float | None = None, *, round_mix: bool = True, return_mix: bool = False,
                        mix: bool = True, sum_out: torch.Tensor | None = None, config: LaunchConfig | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kimi_k3::fused_attn_res.full on CUDA tensors (or CPU tensors under the Triton interpreter); arguments already
    checked by ``k3_ops._C.check_fused_attn_res_full``. Returns ``(out, new_prefix, mix)``, each output not produced
    an empty [0] tensor; writes ``block_residual[:, block_write_idx]`` (>= 0) and ``sum_out`` (given), nothing else.

    One launch: the table's plan for the calls fused_attn_res makes (an addend, the new prefix into a fresh tensor
    or ``sum_out``, the rounded-mix norm), so their ``out`` is fused_attn_res's bit for bit; the serving plan
    (``serving_config``) for those only the serving flags serve: the new prefix kept in prefix_sum (no addend), the
    FP32-mix norm, ``return_mix``. The native cluster / stream kernels store no mix and new prefixes only at token
    stride H: such calls run their plan's Triton fallback (``native_layout_ok``). ``mix=False``:
    ``attn_res_add_snapshot_kernel`` (no launch without an addend, ``sum_out`` or snapshot). fp64 and T = 0 run the
    reference composition. config: as for ``attn_res_forward``.
    """
    trivial = trivial_full_call(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                                block_write_idx, out_norm_weight, out_norm_eps, round_mix=round_mix,
                                return_mix=return_mix, mix=mix, sum_out=sum_out, attn_res_fn=attn_res_forward)
    if trivial is not None:
        return trivial
    if not mix:
        target, new_prefix = add_snapshot_outputs(prefix_sum, addend, sum_out)
        launch_add_snapshot(prefix_sum, addend, target, block_residual, block_write_idx)
        return full_outputs(None, prefix_sum, None, new_prefix)
    fused, out = FusedArgs.allocate_full(prefix_sum, addend, block_write_idx, out_norm_weight,
                                         eps if out_norm_eps is None else out_norm_eps, round_mix=round_mix,
                                         return_mix=return_mix, sum_out=sum_out)
    _launch_fused(prefix_sum, block_residual, norm_weight, proj_weight, int(num_valid_blocks), eps, fused, out,
                  fused.serving, config)
    return full_outputs(fused, prefix_sum, out, None if sum_out is not None else fused.new_prefix)


def _launch_fused(prefix_sum: torch.Tensor, block_residual: torch.Tensor, norm_weight: torch.Tensor,
                  proj_weight: torch.Tensor, K: int, eps: float, fused: FusedArgs, out: torch.Tensor, serving: bool,
                  config: LaunchConfig | None) -> None:
    # The plan and the launch of a fused call; the serving calls (in place, FP8, the FP32-mix norm) take the serving
    # plan and store an FP8 output through its bytes.
    T, H = prefix_sum.shape
    nw, pw = prepare_weights(norm_weight, proj_weight)
    if serving:
        plan = serving_config(T, K, H, prefix_sum.device, config)
        out = kernel_output(out)
    else:
        plan = choose_config(T, K, H, prefix_sum.device, config)
    launch_forward(plan, prefix_sum, block_residual, nw, pw, out, K, float(eps), fused)


def attn_res_backward(grad_out: torch.Tensor, prefix_sum: torch.Tensor, block_residual: torch.Tensor,
                      norm_weight: torch.Tensor, proj_weight: torch.Tensor, num_valid_blocks: int, eps: float,
                      output_mask, *, config: BackwardConfig | None = None):
    """kimi_k3::attn_res_backward on CUDA tensors (or CPU tensors under the Triton interpreter).

    Args (already checked by ``k3_ops._C.check_attn_res_backward``):
        grad_out: [T, H] of prefix_sum.dtype, any strides (a non-unit hidden stride, e.g. the expanded gradient
            of ``out.sum()``, is copied to contiguous first).
        prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps: as for ``attn_res_forward``
            (any token / block strides, block-major views included; only slots < K are read).
        output_mask: [want grad_prefix_sum, want grad_block_residual, want grad_norm_weight,
            want grad_proj_weight].
        config: bypass ``BACKWARD_CONFIG`` (benchmarks / tuning).
    Returns:
        (grad_prefix_sum: new contiguous [T, H] of prefix_sum.dtype,
         grad_block_residual: new contiguous [T, C, H] of block_residual.dtype, exact zeros at slots >= K,
         grad_norm_weight, grad_proj_weight: each of its weight's shape and dtype, from dL/dw of
         w = norm_weight * proj_weight reduced over tokens in a fixed order (identical bits from run to run),
         times the other weight in FP32, rounded once);
        an output not asked for by output_mask is an empty 1-D tensor and costs nothing.
    """
    trivial = _backward.trivial_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                                  num_valid_blocks, eps, output_mask)
    if trivial is not None:
        return trivial
    T, C, H = block_residual.shape
    facts = device_facts(prefix_sum.device)
    plan = cuda_plan.backward_plan(T, int(num_valid_blocks), H, facts, config, prefix_sum.element_size())
    if plan.kernel == "single_read" and not single_read_layout_ok(grad_out, prefix_sum, block_residual):
        # The choice without the C++ kernel (element size 0 rules it out): the Triton kernels take any strides and
        # alignment.
        plan = cuda_plan.backward_plan(T, int(num_valid_blocks), H, facts, config, element_size=0)
    with _device_guard(prefix_sum):
        return _backward.run_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                               num_valid_blocks, eps, output_mask, plan)


# --------------------------------------------------------------------------------------------------------------
# The launch step.
# --------------------------------------------------------------------------------------------------------------
#: The native kernels' FP8 output kinds (csrc_cuda/attn_res_cluster.h, Fp8Kind) by out_dtype.
_NATIVE_FP8_KINDS = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e4m3fnuz: 2}


def launch_forward(plan: Plan, prefix_sum: torch.Tensor, block_residual: torch.Tensor, nw: torch.Tensor,
                   pw: torch.Tensor, out: torch.Tensor, K: int, eps: float, fused: FusedArgs | None = None) -> None:
    """Launch ``plan`` 's forward on these tensors: the plain op, or with ``fused`` a fused call (its flags switch
    the kernels' fused variant on). ``nw`` / ``pw``: the prepared weights; ``out``: [T, H] (an FP8 output as its
    bytes). A native plan runs its kernel where the call's layout allows (``native_layout_ok``), else its
    fallback."""
    while plan.kernel in NATIVE_KERNELS:
        if native_layout_ok(prefix_sum, block_residual, nw, pw, out, fused):
            _launch_native(plan, prefix_sum, block_residual, nw, pw, out, K, eps, fused)
            return
        plan = plan.fallback
    T, H = prefix_sum.shape
    if (H > 1 and prefix_sum.stride(1) != 1 and plan.kernel in ("token", "rows")
            and not (fused and fused.inplace and fused.addend is not None)):
        # A hidden-strided prefix row is copied (a [T, H] copy) so that the kernel reads it with the unit-stride
        # layout: the strided variant would reduce in another order and give other bits than the same values
        # passed contiguously. Not for the in-place serving call with an addend, which must store into the caller's
        # prefix (without one it stores nothing there).
        _launch.unrecordable()  # the copy is device work outside the recorded launches
        prefix_sum = prefix_sum.contiguous()
    args, runtime, flags, vec, h_strided = kernel_arguments(prefix_sum, block_residual, nw, pw, out, K, eps, fused)
    interpreted = use_interpreter(prefix_sum)
    # The compile key: the plan, the call's VEC and hidden-stride flag, the fused flags' values; the token kernel
    # takes H as a constexpr.
    key = (plan, vec, h_strided, *flags.items(), *((H,) if plan.kernel == "token" else ()))
    constexprs = functools.partial(forward_constexprs, plan, H, vec, h_strided, flags,
                                   prefix_sum.dtype == torch.float32, interpreted)
    grid = forward_grid(plan, T, device_facts(prefix_sum.device).num_sms if plan.kernel == "rows" else 0)
    stream = _stream(prefix_sum)
    with _device_guard(prefix_sum):
        if plan.kernel == "token":
            _launch.launch(_decode.attn_res_token_kernel, grid, args, runtime, key, constexprs, ntensors=5,
                           interpreted=interpreted, stream=stream)
        elif plan.kernel == "rows":
            _launch.launch(_fwd.attn_res_rows_kernel, grid, args, runtime, key, constexprs, ntensors=5,
                           interpreted=interpreted, stream=stream)
        elif plan.kernel == "tiles":
            # The Ascend kernel's algorithm, which takes its tokens per program after eps.
            tiles_args = (*args[:9], plan.tokens_per_prog, *args[9:])
            _launch.launch(_fwd.attn_res_npu_kernel, grid, tiles_args, runtime, key, constexprs, ntensors=5,
                           interpreted=interpreted, stream=stream)
        else:
            out_norm = fused is not None and fused.out_norm_weight is not None
            # The split's partials of this call (FP64 per chunk and candidate; with OUT_NORM one more per chunk, the
            # partial sum of squares of the rounded mix): a fresh buffer, so concurrent calls never share one.
            partials = _launch.scratch((T * plan.p_pad * (2 * plan.k_pad + int(out_norm)),), torch.float64,
                                       prefix_sum.device)
            split_args = (*args[:5], partials, *args[5:])
            for phase in (1, 2, 3) if out_norm else (1, 2):
                _launch.launch(_fwd.attn_res_split_kernel, grid, split_args, runtime, (*key, phase),
                               lambda phase=phase: dict(constexprs(), PHASE=phase), ntensors=6,
                               interpreted=interpreted, stream=stream)


def _launch_native(plan: Plan, prefix_sum, block_residual, nw, pw, out, K: int, eps: float,
                   fused: FusedArgs | None) -> None:
    # The cluster / streaming kernel (csrc_cuda/attn_res_cluster.cu): the plain op and every fused call. The Gram
    # norm is the cluster kernel's, with the output norm (the streaming kernel has none).
    onw = None if fused is None else fused.out_norm_weight
    gram = plan.norm_gram and onw is not None and plan.cluster_size > 1
    if fused is None:
        tensors = (prefix_sum, block_residual, nw, pw, out, None, None, None, None)
        flags, floats = (-1, 0, 0, 0, 0), (eps, 1.0, 0.0, 0.0)
    else:
        tensors = (prefix_sum, block_residual, nw, pw, out, fused.addend, fused.new_prefix, onw, fused.scale)
        flags = (fused.write_idx, int(fused.inplace), int(fused.round_mix), _NATIVE_FP8_KINDS[fused.out_dtype],
                 int(gram))
        floats = (eps, fused.out_eps, reference.FP8_MAX.get(fused.out_dtype, 0.0), plan.gram_tau if gram else 0.0)
    _launch.launch_native("cluster_fwd", tensors, (K, plan.cluster_size, plan.pdl, *flags), floats)
    from .. import _C

    with _device_guard(prefix_sum):
        _C.attn_res_cluster_forward(*tensors, K, floats[0], floats[1], floats[2], flags[0], plan.cluster_size,
                                    plan.pdl, bool(flags[1]), bool(flags[2]), flags[3], bool(flags[4]), floats[3])


def launch_add_snapshot(prefix_sum: torch.Tensor, addend: torch.Tensor | None, new_prefix: torch.Tensor | None,
                        block_residual: torch.Tensor, block_write_idx: int) -> None:
    """fused_attn_res.full with mix=False: ``attn_res_add_snapshot_kernel`` stores round(prefix_sum + addend) (or
    prefix_sum) into ``new_prefix`` (None: nowhere) and ``block_residual[:, block_write_idx]`` (>= 0); no launch
    when there is nothing to write. One program per token (a row of H elements is a few KB: the grid, not the
    program, carries the bandwidth). Launched without PDL: it waits for its predecessor as any launch does, and a
    PDL successor's gdc_wait waits for its completion (it never triggers its dependents early)."""
    if new_prefix is None and block_write_idx < 0:
        return  # nothing to write: the new prefix is prefix_sum itself
    args, runtime, flags = add_snapshot_args(prefix_sum, addend, new_prefix, block_residual, block_write_idx, 1)
    key = ("add_snapshot", *flags.items())

    def constexprs() -> dict:
        return dict(flags, num_warps=4, **TRITON_COMPILE_OPTIONS)

    with _device_guard(prefix_sum):
        _launch.launch(_fwd.attn_res_add_snapshot_kernel, (prefix_sum.size(0),), args, runtime, key, constexprs,
                       ntensors=2, interpreted=use_interpreter(prefix_sum), stream=_stream(prefix_sum))


# --------------------------------------------------------------------------------------------------------------
# Warm-up: compile every key the table can pick (before CUDA-graph capture).
# --------------------------------------------------------------------------------------------------------------
def warmup(hidden_size: int, dtype: torch.dtype, device: torch.device | str | None = None,
           max_num_valid_blocks: int = 8, max_num_tokens: int = 65536, fused: bool = True, serving: bool = False,
           weight_dtype: torch.dtype | None = None, full: bool = False) -> int:
    """Compile every launch-table key for one model before CUDA-graph capture; returns the number of plans run.

    Each distinct plan (compile key) that the table can pick for T in 1..max_num_tokens and K in
    1..max_num_valid_blocks (``warmup_plans``) runs once on a small zero-filled token-major problem, which compiles
    it and caches its launch handle. Buffers whose token / block strides are multiples of 16 bytes (every
    token-major or block-major buffer when H * itemsize is) share these kernels. fp64 runs the reference: nothing
    to compile. Re-run after changing ``LAUNCH_TABLE`` or ``K3_OPS_PDL``.

    ``fused=True`` also compiles each plan's fused_attn_res variants that a Kimi K3 decoder layer uses (residual
    addend and output RMSNorm, with and without the block snapshot). ``serving=True`` also compiles the in-place
    serving call vLLM's Kimi K3 model makes (fused_attn_res_ with and without a delta, with and without the
    snapshot, the output norm of the FP32 mix; no FP8 output). ``full=True`` also compiles fused_attn_res.full's
    call forms (``FULL_FORMS``, ``ADD_SNAPSHOT_FORMS``: vLLM-Ascend's). ``weight_dtype``: the dtype of the norm and
    projection weights (a pointer's dtype is part of a compile key); None compiles for the I/O dtype and fp32.
    Other flag combinations compile on first use, outside capture.
    """
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return 0
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    H = int(hidden_size)
    facts = device_facts(device)
    plans = cuda_plan.table_plans(H, max_num_valid_blocks, max_num_tokens, facts)
    weight_dtypes = [weight_dtype] if weight_dtype is not None else list(dict.fromkeys([dtype, torch.float32]))
    with torch.no_grad():
        for wdtype in weight_dtypes:
            w = torch.ones(H, dtype=wdtype, device=device)
            for plan, (T, K) in plans.items():
                prefix = torch.zeros((T, H), dtype=dtype, device=device)
                blocks = torch.zeros((T, K, H), dtype=dtype, device=device)
                out = torch.empty((T, H), dtype=dtype, device=device)
                spare = torch.zeros((T, K + 1, H), dtype=dtype, device=device)  # slot K takes the snapshot
                # A native plan's fallback runs the calls the native kernel leaves to it: compiled too.
                for p in (plan,) if plan.fallback is None else (plan, plan.fallback):
                    launch_forward(p, prefix, blocks, w, w, out, K, 1e-6)
                    if fused:
                        for write_idx in (-1, K):
                            args, out = FusedArgs.allocate(prefix, prefix, write_idx, w, 1e-6)
                            launch_forward(p, prefix, spare, w, w, out, K, 1e-6, args)
                if serving:
                    serving_plan = cuda_plan.serving_plan(plan, K, H, facts)
                    for p in (serving_plan,) if serving_plan.fallback is None else (serving_plan,
                                                                                     serving_plan.fallback):
                        for addend in (prefix, None):
                            for write_idx in (-1, K):
                                target = torch.zeros((T, H), dtype=dtype, device=device)  # updated in place
                                args, out = FusedArgs.allocate(target, addend, write_idx, w, 1e-6, inplace=True,
                                                               round_mix=False)
                                launch_forward(p, target, spare, w, w, kernel_output(out), K, 1e-6, args)
                if full:
                    _warmup_full(plan, K, H, facts, prefix, spare, w)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(plans)


def _warmup_full(plan: Plan, K: int, H: int, facts: DeviceFacts, prefix: torch.Tensor, spare: torch.Tensor,
                 w: torch.Tensor) -> None:
    # Each form on the plan fused_attn_res_full would take (the serving plan where the form has a serving flag) and
    # on that plan's fallback (the calls a native kernel leaves to it), then the add-and-snapshot kernel.
    for addend, write, norm, round_mix, ret, into in FULL_FORMS:
        sum_out = torch.empty_like(prefix) if into else None
        args, out = FusedArgs.allocate_full(prefix, prefix if addend else None, K if write else -1,
                                            w if norm else None, 1e-6, round_mix=round_mix, return_mix=ret,
                                            sum_out=sum_out)
        base = cuda_plan.serving_plan(plan, K, H, facts) if args.serving else plan
        for p in (base,) if base.fallback is None else (base, base.fallback):
            launch_forward(p, prefix, spare, w, w, out, K, 1e-6, args)
    for addend, write in ADD_SNAPSHOT_FORMS:
        launch_add_snapshot(prefix, prefix if addend else None, torch.empty_like(prefix) if addend else None, spare,
                            K if write else -1)
