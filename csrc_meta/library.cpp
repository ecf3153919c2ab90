// The kimi_k3 operator library: every schema, defined once, and its Meta kernels.
//
// Registration flow (see also k3_ops/_registration.py):
//   1. This translation unit is built into k3_ops._C. Importing k3_ops loads it, which runs the
//      TORCH_LIBRARY block below (the schemas) and the Meta registrations.
//   2. k3_ops/_registration.py then attaches the device kernels (CPU reference, CUDA and PrivateUse1
//      Triton launchers) and autograd from Python. Nothing defines these schemas a second time.
//
// Meta kernels compute output metadata from symbolic sizes only (sym_sizes / empty_symint), so a
// dynamic token count traces under torch.compile and torch.export. They run the same argument checks
// as eager calls (checks.cpp), so bad input fails at trace time with the eager message.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "checks.h"

namespace k3_ops {
namespace {

at::Tensor new_like_prefix(const at::Tensor& prefix_sum, c10::optional<at::ScalarType> dtype = c10::nullopt) {
  // A new contiguous [T, H] tensor, whatever the strides of prefix_sum (of prefix_sum's dtype unless given).
  return at::empty_symint(prefix_sum.sym_sizes(), prefix_sum.options()
                                                      .dtype(dtype.value_or(prefix_sum.scalar_type()))
                                                      .memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor attn_res_meta(const at::Tensor& prefix_sum, const at::Tensor& block_residual,
                         const at::Tensor& norm_weight, const at::Tensor& proj_weight, int64_t num_valid_blocks,
                         double eps) {
  check_attn_res_args(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps);
  return new_like_prefix(prefix_sum);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attn_res_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& prefix_sum, const at::Tensor& block_residual,
    const at::Tensor& norm_weight, const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
    std::array<bool, 4> output_mask) {
  check_attn_res_backward_args(grad_out, prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps);
  // Outputs that output_mask does not ask for are empty 1-D tensors, so no memory is spent on them.
  auto nothing = [&](const at::Tensor& like) {
    return at::empty_symint({c10::SymInt(0)}, like.options());
  };
  at::Tensor grad_prefix = output_mask[0] ? new_like_prefix(prefix_sum) : nothing(prefix_sum);
  at::Tensor grad_blocks = output_mask[1]
      ? at::empty_symint({prefix_sum.sym_size(0), block_residual.sym_size(1), prefix_sum.sym_size(1)},
                         block_residual.options().memory_format(at::MemoryFormat::Contiguous))
      : nothing(block_residual);
  // Each weight's gradient has the weight's shape and dtype ([H] or [1, H]), contiguous.
  const auto like_weight = [&](const at::Tensor& weight, bool wanted) {
    return wanted ? at::empty_symint(weight.sym_sizes(), weight.options().memory_format(at::MemoryFormat::Contiguous))
                  : nothing(weight);
  };
  return {grad_prefix, grad_blocks, like_weight(norm_weight, output_mask[2]), like_weight(proj_weight, output_mask[3])};
}

std::tuple<at::Tensor, at::Tensor> fused_attn_res_meta(
    const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend, const at::Tensor& block_residual,
    const at::Tensor& norm_weight, const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
    int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight, c10::optional<double> out_norm_eps,
    bool round_mix) {
  (void)round_mix;  // no rule: it only picks the output norm's rounding point
  check_fused_attn_res_args(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                            block_write_idx, out_norm_weight, out_norm_eps);
  // block_residual is mutated in place (Tensor(a!)): nothing to allocate for it.
  return {new_like_prefix(prefix_sum), new_like_prefix(prefix_sum)};
}

// [T, 1] fp32: one dequantisation scale per token row of an FP8 output.
at::Tensor token_scale_like(const at::Tensor& prefix_sum) {
  return at::empty_symint({prefix_sum.sym_size(0), c10::SymInt(1)}, prefix_sum.options().dtype(at::kFloat));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_attn_res_quant_meta(
    const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend, const at::Tensor& block_residual,
    const at::Tensor& norm_weight, const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
    int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight, c10::optional<double> out_norm_eps,
    at::ScalarType out_dtype, bool round_mix) {
  (void)round_mix;
  check_fused_attn_res_quant_args(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                  eps, block_write_idx, out_norm_weight, out_norm_eps, out_dtype);
  return {new_like_prefix(prefix_sum, out_dtype), new_like_prefix(prefix_sum), token_scale_like(prefix_sum)};
}

std::tuple<at::Tensor, at::Tensor> fused_attn_res_inplace_meta(
    const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend, const at::Tensor& block_residual,
    const at::Tensor& norm_weight, const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
    int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight, c10::optional<double> out_norm_eps,
    c10::optional<at::ScalarType> out_dtype, bool round_mix) {
  (void)round_mix;
  check_fused_attn_res_inplace_args(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                    eps, block_write_idx, out_norm_weight, out_norm_eps, out_dtype);
  // prefix_sum and block_residual are mutated in place (Tensor(a!), Tensor(b!)): nothing to allocate for them.
  at::Tensor out = new_like_prefix(prefix_sum, out_dtype);
  // Without an FP8 output there is no scale: an empty 1-D tensor (as attn_res_backward's unrequested outputs).
  at::Tensor scale = out_dtype.has_value() ? token_scale_like(prefix_sum)
                                           : at::empty_symint({c10::SymInt(0)}, prefix_sum.options().dtype(at::kFloat));
  return {out, scale};
}

// fused_attn_res.full: outputs that are not produced are empty 1-D tensors (as attn_res_backward's unrequested
// outputs), so no memory is spent on them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_attn_res_full_meta(
    const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend, const at::Tensor& block_residual,
    const at::Tensor& norm_weight, const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
    int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight, c10::optional<double> out_norm_eps,
    bool round_mix, bool return_mix, bool mix, const c10::optional<at::Tensor>& sum_out) {
  (void)round_mix;
  check_fused_attn_res_full_args(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks, eps,
                                 block_write_idx, out_norm_weight, out_norm_eps, return_mix, mix, sum_out);
  auto nothing = [&] { return at::empty_symint({c10::SymInt(0)}, prefix_sum.options()); };
  // The new prefix is returned only where it exists nowhere else: prefix_sum itself without an addend, the
  // caller's sum_out where given. block_residual and sum_out are mutated in place (Tensor(a!), Tensor(b!)).
  at::Tensor new_prefix = addend.has_value() && !sum_out.has_value() ? new_like_prefix(prefix_sum) : nothing();
  return {mix ? new_like_prefix(prefix_sum) : nothing(), new_prefix,
          return_mix ? new_like_prefix(prefix_sum) : nothing()};
}

at::Tensor tp_all_reduce_meta(const at::Tensor& partial, c10::string_view group_name) {
  check_tp_all_reduce_args(partial, std::string(group_name));
  return new_like_prefix(partial);
}

}  // namespace

TORCH_LIBRARY(kimi_k3, m) {
  // out[t] = sum_i softmax_i(rsqrt(mean(v_i^2) + eps) * <v_i, norm_weight * proj_weight>) * v_i over the
  // candidates v_0..v_{K-1} = block_residual[t, :K] and v_K = prefix_sum[t]; see docs/attn_res.md.
  m.def(
      "attn_res(Tensor prefix_sum, Tensor block_residual, Tensor norm_weight, Tensor proj_weight, "
      "int num_valid_blocks, float eps) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  // Gradients of attn_res's four tensor inputs, recomputed from the inputs; output_mask asks for each (an output not
  // asked for is an empty 1-D tensor). The two weights' gradients come from the gradient of the folded weight
  // w = norm_weight * proj_weight, summed over tokens in the compute dtype, times the other weight, rounded once
  // to each weight's dtype.
  m.def(
      "attn_res_backward(Tensor grad_out, Tensor prefix_sum, Tensor block_residual, Tensor norm_weight, "
      "Tensor proj_weight, int num_valid_blocks, float eps, bool[4] output_mask) -> "
      "(Tensor grad_prefix_sum, Tensor grad_block_residual, Tensor grad_norm_weight, Tensor grad_proj_weight)",
      {at::Tag::pt2_compliant_tag});
  // The serving variant: residual add, optional block snapshot (in place), mix, optional RMSNorm.
  m.def(
      "fused_attn_res(Tensor prefix_sum, Tensor? addend, Tensor(a!) block_residual, Tensor norm_weight, "
      "Tensor proj_weight, int num_valid_blocks, float eps, int block_write_idx=-1, "
      "Tensor? out_norm_weight=None, float? out_norm_eps=None, *, bool round_mix=True) -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  // round_mix picks the output norm's rounding point in all three serving ops: True (default), the norm sees the
  // dtype-rounded mix (fused == rms_norm(attn_res(...)) of the unfused ops); False, the FP32 mix (vLLM's kernels).
  // fused_attn_res with an FP8 output (per-token dynamic scale): an overload, because it returns one tensor more,
  // so that fused_attn_res's own returns, and every caller of them, stay as they were. docs/fused_attn_res.md.
  m.def(
      "fused_attn_res.quant(Tensor prefix_sum, Tensor? addend, Tensor(a!) block_residual, Tensor norm_weight, "
      "Tensor proj_weight, int num_valid_blocks, float eps, int block_write_idx=-1, Tensor? out_norm_weight=None, "
      "float? out_norm_eps=None, *, ScalarType out_dtype, bool round_mix=True) -> "
      "(Tensor out, Tensor new_prefix, Tensor scale)",
      {at::Tag::pt2_compliant_tag});
  // Every output of the serving call, as vLLM-Ascend's fused AttnRes op offers them: with return_mix the pre-norm mix
  // rounded to prefix_sum's dtype (what a rounded-mix output norm normalises) beside out; with sum_out the new prefix
  // stored into the caller's [T, H] tensor; with mix=False only the add and the snapshot. An output not produced is
  // an empty [0] tensor: out with mix=False, new_prefix without an addend (it is prefix_sum) or with sum_out, mix
  // without return_mix. docs/fused_attn_res.md, "Every output".
  m.def(
      "fused_attn_res.full(Tensor prefix_sum, Tensor? addend, Tensor(a!) block_residual, Tensor norm_weight, "
      "Tensor proj_weight, int num_valid_blocks, float eps, int block_write_idx=-1, Tensor? out_norm_weight=None, "
      "float? out_norm_eps=None, *, bool round_mix=True, bool return_mix=False, bool mix=True, "
      "Tensor(b!)? sum_out=None) -> (Tensor out, Tensor new_prefix, Tensor mix)",
      {at::Tag::pt2_compliant_tag});
  // The serving call as vLLM's Kimi K3 model makes it: round(prefix_sum + addend) is stored back INTO
  // prefix_sum (the running residual, Tensor(a!)), then the snapshot (Tensor(b!)), mix, output norm and
  // optional FP8 output as above. scale is [T, 1] fp32 with an FP8 out_dtype, else an empty [0].
  m.def(
      "fused_attn_res_(Tensor(a!) prefix_sum, Tensor? addend, Tensor(b!) block_residual, Tensor norm_weight, "
      "Tensor proj_weight, int num_valid_blocks, float eps, int block_write_idx=-1, Tensor? out_norm_weight=None, "
      "float? out_norm_eps=None, *, ScalarType? out_dtype=None, bool round_mix=True) -> (Tensor out, Tensor scale)",
      {at::Tag::pt2_compliant_tag});
  // Tensor parallelism: the sum over the ranks of group_name of every rank's partial [T, H], returned as a new
  // contiguous [T, H] of partial's dtype on every rank (the addend of the serving call after a row-parallel
  // layer). A schema of its own, so torch.compile and CUDA graphs see one opaque call whose kernel picks the
  // one-shot symmetric-memory path or NCCL's all-reduce (k3_ops/tp.py); docs/tp.md.
  m.def("tp_all_reduce(Tensor partial, str group_name) -> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(kimi_k3, Meta, m) {
  m.impl("attn_res", &attn_res_meta);
  m.impl("attn_res_backward", &attn_res_backward_meta);
  m.impl("fused_attn_res", &fused_attn_res_meta);
  m.impl("fused_attn_res.quant", &fused_attn_res_quant_meta);
  m.impl("fused_attn_res.full", &fused_attn_res_full_meta);
  m.impl("fused_attn_res_", &fused_attn_res_inplace_meta);
  m.impl("tp_all_reduce", &tp_all_reduce_meta);
}

}  // namespace k3_ops
