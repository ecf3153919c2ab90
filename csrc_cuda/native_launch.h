// The tensor-level launch functions of k3_ops._C's CUDA C++ kernels (defined in python_cuda.cpp): what the Python
// bindings call and what the launch cache (launch_cache.cpp) replays. Each checks its kernel's layout invariants
// (the launch policy, k3_ops/backends/cuda.py, has checked the op's rules), then launches on the current stream.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace k3_ops {

// The single-read backward (attn_res_bwd.cu): gradients of one attn_res call; the weight gradient as per-program
// FP64 partials in workspace, and (grad_norm_weight or grad_proj_weight given: the ring layout's folded reduction)
// summed and multiplied by the other weight into those.
void attn_res_bwd_single_read_launch(const at::Tensor& grad_out, const at::Tensor& prefix, const at::Tensor& blocks,
                                     const at::Tensor& norm_weight, const at::Tensor& proj_weight,
                                     const c10::optional<at::Tensor>& grad_prefix,
                                     const c10::optional<at::Tensor>& grad_blocks,
                                     const c10::optional<at::Tensor>& workspace,
                                     const c10::optional<at::Tensor>& grad_norm_weight,
                                     const c10::optional<at::Tensor>& grad_proj_weight, int64_t num_valid_blocks,
                                     double eps,
                                     int64_t tokens_per_prog, int64_t grid, int64_t vectors_per_thread);

// The cluster forward (attn_res_cluster.cu): the plain op (addend, new_prefix, out_norm_weight and scale null,
// write_idx -1) or a fused call; fp8_kind 0 (none), 1 (e4m3fn) or 2 (e4m3fnuz), out then one-byte elements;
// norm_gram, gram_tau: ClusterFwdArgs's (the output norm's sum of squares from the first exchange).
void attn_res_cluster_forward(const at::Tensor& prefix, const at::Tensor& blocks, const at::Tensor& norm_weight,
                              const at::Tensor& proj_weight, const at::Tensor& out,
                              const c10::optional<at::Tensor>& addend, const c10::optional<at::Tensor>& new_prefix,
                              const c10::optional<at::Tensor>& out_norm_weight, const c10::optional<at::Tensor>& scale,
                              int64_t num_valid_blocks, double eps, double out_eps, double fp8_max, int64_t write_idx,
                              int64_t cluster_size, bool pdl, bool inplace_prefix, bool norm_rounded_mix,
                              int64_t fp8_kind, bool norm_gram, double gram_tau);

}  // namespace k3_ops
