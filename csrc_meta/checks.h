// Argument checks for the kimi_k3 ops, written once.
//
// Two callers share these functions:
//   * the Meta kernels in meta_kernels.cpp (trace time: FakeTensor, torch.compile, torch.export), where
//     sizes may be symbolic, and
//   * every eager kernel (CPU reference, CUDA / PrivateUse1 Triton), through the pybind functions in
//     python_module.cpp, which the Python registrations call before they write anything.
// So eager calls and traced calls reject exactly the same inputs with exactly the same message.
//
// Every message names the argument, the rule and the actual value. Sizes are compared as SymInts;
// where a comparison would need a data-dependent guard (unbacked token counts under
// torch._dynamo.mark_unbacked) `expect_true` turns it into a deferred runtime assert instead.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace k3_ops {

// Shared by all three ops: shapes, dtypes, devices of the forward inputs, the valid-block count and eps.
void check_attn_res_args(const at::Tensor& prefix_sum, const at::Tensor& block_residual,
                         const at::Tensor& norm_weight, const at::Tensor& proj_weight,
                         int64_t num_valid_blocks, double eps);

// attn_res_backward: the forward rules plus grad_out and output_mask.
void check_attn_res_backward_args(const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                                  const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                  const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps);

// fused_attn_res: the forward rules plus addend, block_write_idx and the optional output norm.
void check_fused_attn_res_args(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                               const at::Tensor& block_residual, const at::Tensor& norm_weight,
                               const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                               int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                               c10::optional<double> out_norm_eps);

}  // namespace k3_ops
