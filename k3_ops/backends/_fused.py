"""``FusedArgs``: what a fused call adds to a forward launch, the same on every device (``cuda.py``, ``npu.py``).

Four ops launch with it:

- ``kimi_k3::fused_attn_res``: new_prefix out of place, the norm of the dtype-rounded mix;
- ``kimi_k3::fused_attn_res.quant``: the same with an FP8 output and a selectable norm rounding point;
- ``kimi_k3::fused_attn_res_``: the new prefix stored back into ``prefix_sum`` (the in-place serving call), with
  the same options;
- ``kimi_k3::fused_attn_res.full``: the new prefix into the caller's ``sum_out`` (or nowhere without an addend), the
  rounded pre-norm mix as an extra output (``mix_out``), and, with ``mix=False``, the add and the snapshot alone
  (``add_snapshot_args``: a kernel of their own).

A fused call is a plain forward launch plus one ``FusedArgs`` (its tensors and options, allocated by
``FusedArgs.allocate``) and the keyword arguments ``fused_kernel_args`` makes of it, so every kernel with the fused
flags (kernels/attn_res_fwd.py, "Serving-call helpers") takes the same keywords; ``_forward.kernel_arguments`` adds
them to the plain arguments. Also here: the fused calls that launch no kernel, and how an FP8 output is stored. No
triton import here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .. import reference
from . import KERNEL_IO_DTYPES, hidden_strided, next_power_of_2, prepare_weights, stride_vec

__all__ = ["FusedArgs", "trivial_fused_attn_res", "trivial_serving_call", "trivial_full_call", "full_outputs",
           "kernel_output", "fused_kernel_args", "fused_hidden_dims", "fused_token_strides", "FULL_FORMS",
           "ADD_SNAPSHOT_FORMS", "ADD_SNAPSHOT_BLOCK", "add_snapshot_outputs", "add_snapshot_args"]


@dataclass(frozen=True)
class FusedArgs:
    """What a fused call adds to a forward launch.

    addend: [T, H] of the I/O dtype, any strides, or None. new_prefix: new contiguous [T, H] output, or None when
    the new prefix goes back into prefix_sum (``inplace``). write_idx: snapshot slot (>= K), or -1.
    out_norm_weight: [H] contiguous kernel-readable weight, or None. out_eps: the output norm's eps (already
    defaulted to eps). round_mix: the output norm sees the dtype-rounded mix (True) or the FP32 mix (False).
    out_dtype: an FP8 output dtype, or None; scale: its [T, 1] fp32 per-token scales. scratch: an FP32
    [programs, H] row per program for kernels that keep a row between passes (the NPU kernel; see
    ``needs_scratch``), else None. mix_out: a new contiguous [T, H] of the I/O dtype that takes the mix rounded to
    the I/O dtype (fused_attn_res.full's ``return_mix``), or None. new_prefix may also be the caller's ``sum_out``
    (unit hidden stride, any token stride); ``inplace`` without an addend stores nothing into prefix_sum (the new
    prefix is prefix_sum itself), which is how fused_attn_res.full keeps it without an addend or ``sum_out``.
    """

    addend: torch.Tensor | None
    new_prefix: torch.Tensor | None
    write_idx: int
    out_norm_weight: torch.Tensor | None
    out_eps: float
    inplace: bool = False
    round_mix: bool = True
    out_dtype: torch.dtype | None = None
    scale: torch.Tensor | None = None
    scratch: torch.Tensor | None = None
    mix_out: torch.Tensor | None = None

    @staticmethod
    def allocate(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_write_idx: int,
                 out_norm_weight: torch.Tensor | None, out_eps: float, *, inplace: bool = False,
                 round_mix: bool = True, out_dtype: torch.dtype | None = None) -> tuple[FusedArgs, torch.Tensor]:
        """The fused arguments and the fresh ``out`` ([T, H] contiguous, of out_dtype or prefix_sum's dtype), with
        a fresh new_prefix (unless ``inplace``) and, for an FP8 out_dtype, the [T, 1] fp32 scale."""
        T, H = prefix_sum.shape
        new_prefix = None if inplace else torch.empty((T, H), dtype=prefix_sum.dtype, device=prefix_sum.device)
        out = torch.empty((T, H), dtype=out_dtype or prefix_sum.dtype, device=prefix_sum.device)
        scale = None if out_dtype is None else torch.empty((T, 1), dtype=torch.float32, device=prefix_sum.device)
        onw = None if out_norm_weight is None else prepare_weights(out_norm_weight, out_norm_weight)[0]
        return FusedArgs(addend, new_prefix, int(block_write_idx), onw, float(out_eps), inplace, bool(round_mix),
                         out_dtype, scale), out

    @staticmethod
    def allocate_full(prefix_sum: torch.Tensor, addend: torch.Tensor | None, block_write_idx: int,
                      out_norm_weight: torch.Tensor | None, out_eps: float, *, round_mix: bool, return_mix: bool,
                      sum_out: torch.Tensor | None) -> tuple[FusedArgs, torch.Tensor]:
        """fused_attn_res.full's arguments and fresh ``out``: the new prefix into ``sum_out`` where given, a fresh
        new_prefix with an addend, otherwise kept in prefix_sum (``inplace`` without an addend: nothing stored); a
        fresh ``mix_out`` with ``return_mix``."""
        keep = sum_out is None and addend is None
        fused, out = FusedArgs.allocate(prefix_sum, addend, block_write_idx, out_norm_weight, out_eps,
                                        inplace=keep or sum_out is not None, round_mix=round_mix)
        mix_out = torch.empty_like(out) if return_mix else None
        return replace(fused, new_prefix=fused.new_prefix if sum_out is None else sum_out, inplace=keep,
                       mix_out=mix_out), out

    @property
    def norm_fp32_mix(self) -> bool:
        """The output norm runs on the FP32 mix (only meaningful with an output norm)."""
        return self.out_norm_weight is not None and not self.round_mix

    @property
    def serving(self) -> bool:
        """Any of the serving options that only the kernels' serving flags implement (kernels/attn_res_fwd.py,
        "Serving-call helpers"): a launch policy routes such calls to a kernel that has them."""
        return self.inplace or self.norm_fp32_mix or self.out_dtype is not None or self.mix_out is not None

    @property
    def needs_scratch(self) -> bool:
        """Whether a kernel that writes its output chunk by chunk in several passes (the NPU kernel) needs an FP32
        scratch row per program: the FP32 mix for the norm, or the row before quantisation."""
        return self.norm_fp32_mix or self.out_dtype is not None

    def with_scratch(self, scratch: torch.Tensor) -> FusedArgs:
        return replace(self, scratch=scratch)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> FusedArgs:
        """The same arguments with every tensor passed through ``fn`` (the NPU seam's raw tensors)."""
        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return replace(self, addend=opt(self.addend), new_prefix=opt(self.new_prefix),
                       out_norm_weight=opt(self.out_norm_weight), scale=opt(self.scale), scratch=opt(self.scratch),
                       mix_out=opt(self.mix_out))


def trivial_fused_attn_res(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                           block_write_idx, out_norm_weight, out_norm_eps,
                           attn_res_fn: Callable[..., torch.Tensor], round_mix: bool = True,
                           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The calls that launch no fused kernel (None otherwise): fp64 (the kernels' I/O dtypes are bf16/fp16/fp32)
    and T = 0 run the reference composition with the device's ``attn_res_fn`` as the mix (with round_mix=False the
    reference computes the FP32 mix itself, which for fp64 is the mix and for T = 0 empty)."""
    if prefix_sum.dtype in KERNEL_IO_DTYPES and prefix_sum.size(0) > 0:
        return None
    return reference.fused_attn_res_reference(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                              num_valid_blocks, eps, block_write_idx, out_norm_weight,
                                              out_norm_eps, round_mix=round_mix, attn_res_fn=attn_res_fn)


def trivial_serving_call(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                         block_write_idx, out_norm_weight, out_norm_eps, *, inplace: bool, out_dtype, round_mix: bool,
                         attn_res_fn: Callable[..., torch.Tensor]) -> tuple | None:
    """``trivial_fused_attn_res`` for fused_attn_res.quant (``inplace=False``: ``(q, new_prefix, scale)``) and
    fused_attn_res_ (``inplace=True``: ``(out, scale)``): fp64 and T = 0 run the reference composition (on the
    tensors' own device), None otherwise."""
    if prefix_sum.dtype in KERNEL_IO_DTYPES and prefix_sum.size(0) > 0:
        return None
    fn = reference.fused_attn_res_inplace_reference if inplace else reference.fused_attn_res_quant_reference
    return fn(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, block_write_idx,
              out_norm_weight, out_norm_eps, out_dtype=out_dtype, round_mix=round_mix, attn_res_fn=attn_res_fn)


def trivial_full_call(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                      block_write_idx, out_norm_weight, out_norm_eps, *, round_mix: bool, return_mix: bool, mix: bool,
                      sum_out, attn_res_fn: Callable[..., torch.Tensor]) -> tuple | None:
    """``trivial_fused_attn_res`` for fused_attn_res.full: fp64 and T = 0 run the reference composition (on the
    tensors' own device), None otherwise."""
    if prefix_sum.dtype in KERNEL_IO_DTYPES and prefix_sum.size(0) > 0:
        return None
    return reference.fused_attn_res_full_reference(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                                   num_valid_blocks, eps, block_write_idx, out_norm_weight,
                                                   out_norm_eps, round_mix=round_mix, return_mix=return_mix, mix=mix,
                                                   sum_out=sum_out, attn_res_fn=attn_res_fn)


def full_outputs(fused: FusedArgs | None, prefix_sum: torch.Tensor, out: torch.Tensor | None,
                 new_prefix: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_attn_res.full's (out, new_prefix, mix): ``new_prefix`` the fresh tensor the call stored the new prefix
    into (None where it went to sum_out or stayed in prefix_sum); every output not produced an empty [0] tensor."""
    def produced(t: torch.Tensor | None) -> torch.Tensor:
        return prefix_sum.new_empty((0,)) if t is None else t

    return produced(out), produced(new_prefix), produced(None if fused is None else fused.mix_out)


def add_snapshot_outputs(prefix_sum: torch.Tensor, addend: torch.Tensor | None, sum_out: torch.Tensor | None,
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fused_attn_res.full with mix=False: (where the kernel stores the new prefix: sum_out, a fresh [T, H] with an
    addend, else None; that fresh tensor, the call's new_prefix output, or None)."""
    fresh = None
    if addend is not None and sum_out is None:
        fresh = torch.empty(prefix_sum.shape, dtype=prefix_sum.dtype, device=prefix_sum.device)
    return (fresh if sum_out is None else sum_out), fresh


#: fused_attn_res.full's call forms that the policies' ``warmup(full=True)`` compiles (vLLM-Ascend's,
#: docs/fused_attn_res.md), as (addend, snapshot, output norm, round_mix, return_mix, sum_out): its fused op with and
#: without an addend and a snapshot, the rounded-mix norm, with and without the pre-norm mix returned; its Triton form,
#: the new prefix into sum_out, with the FP32-mix norm or none. (The calls with an addend, no sum_out and no return_mix
#: are fused_attn_res's own variants.)
FULL_FORMS = tuple((addend, write, True, True, ret, False) for addend in (True, False) for write in (False, True)
                   for ret in (False, True)) + ((True, False, True, False, False, True),
                                                (True, False, False, True, False, True))
#: fused_attn_res.full's mix=False calls, as (addend, snapshot): the add, with or without the snapshot; the snapshot.
ADD_SNAPSHOT_FORMS = ((True, False), (True, True), (False, True))


#: Hidden elements per step of the add-and-snapshot kernel (fused_attn_res.full with mix=False): a streaming copy
#: with no reduction, so a short tile (16-byte vectors for 16-bit rows over 4 warps) loses nothing and fits any UB.
ADD_SNAPSHOT_BLOCK = 1024


def add_snapshot_args(prefix_sum: torch.Tensor, addend: torch.Tensor | None, new_prefix: torch.Tensor | None,
                      block_residual: torch.Tensor, block_write_idx: int, tokens_per_prog: int,
                      ) -> tuple[tuple, dict, dict]:
    """``attn_res_add_snapshot_kernel``'s (positional arguments, runtime keywords, constexprs) for the add and the
    snapshot of fused_attn_res.full with mix=False: the new prefix (round(prefix_sum + addend), or prefix_sum)
    stored into ``new_prefix`` (unit hidden stride; None: nowhere) and into ``block_residual[:, block_write_idx]``
    (>= 0). Tensors as the kernel gets them (the NPU seam's raw ones on the NPU)."""
    T, H = prefix_sum.shape
    bs_t, bs_c, bs_h = block_residual.stride()
    strides = [prefix_sum.stride(0), bs_t, bs_c] + [t.stride(0) for t in (addend, new_prefix) if t is not None]
    vec = stride_vec(prefix_sum.dtype, strides)
    dims = [(prefix_sum, 1), (block_residual, 2)] + ([(addend, 1)] if addend is not None else [])
    args = (prefix_sum, block_residual, T, H, tokens_per_prog, prefix_sum.stride(0) // vec, prefix_sum.stride(1),
            bs_t // vec, bs_c // vec, bs_h)
    runtime = dict(addend_ptr=addend, newp_ptr=new_prefix,
                   stride_at=0 if addend is None else addend.stride(0) // vec,
                   stride_ah=0 if addend is None else addend.stride(1),
                   stride_nt=0 if new_prefix is None else new_prefix.stride(0) // vec,
                   write_idx=max(int(block_write_idx), 0))
    constexprs = dict(BLOCK=min(next_power_of_2(H), ADD_SNAPSHOT_BLOCK), VEC=vec, H_STRIDED=hidden_strided(*dims),
                      HAS_ADDEND=addend is not None, STORE_PREFIX=new_prefix is not None,
                      SNAPSHOT=block_write_idx >= 0)
    return args, runtime, constexprs


def kernel_output(out: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel stores ``out`` through: FP8 outputs as their uint8 view (the kernels write e4m3 bit
    patterns they compute themselves), every other dtype as it is."""
    return out.view(torch.uint8) if out.dtype in reference.FP8_MAX else out


def fused_hidden_dims(fused: FusedArgs | None) -> tuple[tuple[torch.Tensor, int], ...]:
    """(tensor, hidden dim) pairs the kernels address through H_STRIDED (the addend; new_prefix is contiguous and
    an in-place prefix is prefix_sum itself, already counted)."""
    return () if fused is None or fused.addend is None else ((fused.addend, 1),)


def fused_token_strides(fused: FusedArgs | None) -> tuple[int, ...]:
    """Token strides the kernels divide by VEC: new_prefix's, the addend's and mix_out's."""
    if fused is None:
        return ()
    strides = (() if fused.new_prefix is None else (fused.new_prefix.stride(0),)) + (
        () if fused.addend is None else (fused.addend.stride(0),))
    return strides if fused.mix_out is None else (*strides, fused.mix_out.stride(0))


def fused_kernel_args(fused: FusedArgs | None, vec: int) -> dict:
    """Keyword arguments that switch a forward kernel to the fused variant; {} for the plain forward. The serving
    arguments appear only in serving calls (so fused_attn_res's launches are what they were before they existed),
    and then all of them, in one order: the CUDA launch cache keys a variant on its flags' values alone
    (backends/cuda.py, ``launch_forward``), which then tell every combination apart by position."""
    if fused is None:
        return {}
    a, n = fused.addend, fused.new_prefix
    kw = dict(addend_ptr=a, newp_ptr=n, onw_ptr=fused.out_norm_weight,
              stride_at=0 if a is None else a.stride(0) // vec, stride_ah=0 if a is None else a.stride(1),
              stride_nt=0 if n is None else n.stride(0) // vec, write_idx=max(fused.write_idx, 0),
              out_eps=fused.out_eps, HAS_ADDEND=a is not None, FUSED=True, SNAPSHOT=fused.write_idx >= 0,
              OUT_NORM=fused.out_norm_weight is not None)
    if fused.serving:
        fp8 = fused.out_dtype
        kw.update(scale_ptr=fused.scale, INPLACE_PREFIX=fused.inplace, NORM_FP32_MIX=fused.norm_fp32_mix,
                  FP8_OUT=fp8 is not None, FP8_FNUZ=fp8 == torch.float8_e4m3fnuz,
                  FP8_MAX=reference.FP8_MAX.get(fp8, reference.FP8_MAX[torch.float8_e4m3fn]))
    if fused.mix_out is not None:
        # The rounded mix, stored at out's token stride (both are new contiguous [T, H] tensors).
        kw.update(mix_ptr=fused.mix_out, MIX_OUT=True)
    if fused.scratch is not None:
        kw.update(scratch_ptr=fused.scratch)
    return kw
