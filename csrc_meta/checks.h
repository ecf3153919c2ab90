// Argument checks for the kimi_k3 ops, written once.
//
// Every rule lives in one template (checks.cpp), instantiated twice:
//   * Symbolic, for the Meta kernels in library.cpp (trace time: FakeTensor, torch.compile, torch.export),
//     where sizes may be SymInts. A size rule that would need a data-dependent guard (unbacked token counts
//     under torch._dynamo.mark_unbacked) becomes a deferred runtime assert through `expect_true`. A violation
//     raises through TORCH_CHECK_VALUE / TORCH_CHECK_TYPE (ValueError / TypeError in Python).
//   * Concrete, for every eager kernel (CPU reference, CUDA / PrivateUse1 Triton), through the pybind
//     functions in python_module.cpp, which the Python registrations call before they write anything. Sizes
//     are plain int64 and a violation is *returned* (no C++ exception, no SymInt, no c10::str), and Python
//     raises it: on the H200's torch 2.11 build the throwing path segfaulted inside the extension.
// So eager calls and traced calls reject exactly the same inputs with exactly the same message, which names
// the argument, the rule and the actual value.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <optional>
#include <string>

namespace k3_ops {

// The first rule an argument list breaks: TypeError (wrong dtype) or ValueError (everything else).
struct Violation {
  bool type_error;
  std::string message;
};
using Verdict = std::optional<Violation>;

// Eager: the first violation, or nothing. Never throws for bad arguments.
Verdict attn_res_violation(const at::Tensor& prefix_sum, const at::Tensor& block_residual,
                           const at::Tensor& norm_weight, const at::Tensor& proj_weight, int64_t num_valid_blocks,
                           double eps);
Verdict attn_res_backward_violation(const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                                    const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                    const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps);
Verdict fused_attn_res_violation(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                 const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                 const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                 int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                 c10::optional<double> out_norm_eps);
// fused_attn_res.quant: fused_attn_res's rules plus an FP8 out_dtype (required).
Verdict fused_attn_res_quant_violation(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                       const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                       const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                       int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                       c10::optional<double> out_norm_eps, at::ScalarType out_dtype);
// fused_attn_res_ (in place): fused_attn_res's rules, an optional FP8 out_dtype, and a prefix_sum that can be
// written in place when an addend is given (no broadcast dimension).
Verdict fused_attn_res_inplace_violation(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                         const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                         const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                         int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                         c10::optional<double> out_norm_eps,
                                         c10::optional<at::ScalarType> out_dtype);
// fused_attn_res.full: fused_attn_res's rules, the output switches (return_mix needs mix; mix=False takes no output
// norm) and the caller's sum_out ([T, H] like prefix_sum, contiguous rows that do not overlap each other, sharing no
// memory with prefix_sum, addend or block_residual).
Verdict fused_attn_res_full_violation(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                      const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                      const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                      int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                      c10::optional<double> out_norm_eps, bool return_mix, bool mix,
                                      const c10::optional<at::Tensor>& sum_out);
// tp_all_reduce: partial 2-D [T, H] of an I/O dtype with H > 0, and a non-empty group name.
Verdict tp_all_reduce_violation(const at::Tensor& partial, const std::string& group_name);

// Trace time (Meta kernels): the same rules on symbolic sizes; raise the violation.
void check_attn_res_args(const at::Tensor& prefix_sum, const at::Tensor& block_residual,
                         const at::Tensor& norm_weight, const at::Tensor& proj_weight,
                         int64_t num_valid_blocks, double eps);
void check_attn_res_backward_args(const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                                  const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                  const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps);
void check_fused_attn_res_args(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                               const at::Tensor& block_residual, const at::Tensor& norm_weight,
                               const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                               int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                               c10::optional<double> out_norm_eps);
void check_fused_attn_res_quant_args(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                     const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                     const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                     int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                     c10::optional<double> out_norm_eps, at::ScalarType out_dtype);
void check_fused_attn_res_inplace_args(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                       const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                       const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                       int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                       c10::optional<double> out_norm_eps, c10::optional<at::ScalarType> out_dtype);
void check_fused_attn_res_full_args(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                    const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                    const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                    int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                    c10::optional<double> out_norm_eps, bool return_mix, bool mix,
                                    const c10::optional<at::Tensor>& sum_out);
void check_tp_all_reduce_args(const at::Tensor& partial, const std::string& group_name);

}  // namespace k3_ops
