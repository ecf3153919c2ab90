// k3_ops._C's CUDA functions (built only where a CUDA toolkit and a CUDA torch are present; see setup.py).
//
// The launch policy (k3_ops/backends/cuda.py, its plan step cuda_plan.py) decides when the single-read backward
// runs and has checked the arguments (kimi_k3::attn_res_backward's rules plus this kernel's: 16-bit candidates, unit
// hidden strides, 16-byte aligned rows, K <= 8); the checks here are internal invariants, so a violation is a bug,
// not bad input.
// c10's stream header, not ATen/cuda/CUDAContext.h: that one pulls in cuBLAS, cuSPARSE and cuSOLVER headers,
// which a toolkit of only nvcc and the runtime (a conda cuda-nvcc install, say) does not ship.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "attn_res_bwd.h"
#include "attn_res_cluster.h"
#include "native_launch.h"

namespace {

namespace kc = k3_ops::cuda;

kc::IoDtype io_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kc::IoDtype::kFloat32;
    case at::kBFloat16: return kc::IoDtype::kBFloat16;
    case at::kHalf: return kc::IoDtype::kFloat16;
    default: TORCH_CHECK(false, "attn_res_bwd_single_read: unsupported dtype ", t.scalar_type());
  }
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The kernel's shared memory depends on the candidates' element size only (it reads bf16 and fp16).
int64_t smem_bytes(int64_t K, int64_t H, int64_t element_size, int64_t vectors_per_thread) {
  if (element_size != 2) return 0;
  return static_cast<int64_t>(
      kc::single_read_smem_bytes(K, H, kc::IoDtype::kBFloat16, static_cast<int>(vectors_per_thread)));
}

}  // namespace

namespace k3_ops {

// Declared in native_launch.h; also replayed by the launch cache (csrc_cuda/launch_cache.cpp).
void attn_res_bwd_single_read_launch(const at::Tensor& grad_out, const at::Tensor& prefix, const at::Tensor& blocks,
                              const at::Tensor& norm_weight, const at::Tensor& proj_weight,
                              const c10::optional<at::Tensor>& grad_prefix,
                              const c10::optional<at::Tensor>& grad_blocks, const c10::optional<at::Tensor>& workspace,
                              const c10::optional<at::Tensor>& grad_norm_weight,
                              const c10::optional<at::Tensor>& grad_proj_weight, int64_t num_valid_blocks, double eps,
                              int64_t tokens_per_prog, int64_t grid, int64_t vectors_per_thread) {
  const int64_t T = blocks.size(0), C = blocks.size(1), H = blocks.size(2);
  TORCH_CHECK(prefix.is_cuda() && prefix.dim() == 2 && grad_out.dim() == 2, "attn_res_bwd_single_read: bad inputs");
  TORCH_CHECK(grad_out.scalar_type() == prefix.scalar_type() && blocks.scalar_type() == prefix.scalar_type(),
              "attn_res_bwd_single_read: candidates and grad_out must share one dtype");
  TORCH_CHECK(grad_out.stride(1) == 1 && prefix.stride(1) == 1 && blocks.stride(2) == 1,
              "attn_res_bwd_single_read: hidden strides must be 1");
  TORCH_CHECK(aligned16(grad_out) && aligned16(prefix) && aligned16(blocks) && grad_out.stride(0) % 8 == 0 &&
                  prefix.stride(0) % 8 == 0 && blocks.stride(0) % 8 == 0 && blocks.stride(1) % 8 == 0,
              "attn_res_bwd_single_read: rows must start on 16-byte boundaries");
  TORCH_CHECK(norm_weight.is_contiguous() && proj_weight.is_contiguous() && norm_weight.numel() == H &&
                  proj_weight.numel() == H,
              "attn_res_bwd_single_read: weights must be contiguous [H]");
  TORCH_CHECK(prefix.element_size() == 2 && smem_bytes(num_valid_blocks, H, 2, vectors_per_thread) > 0,
              "attn_res_bwd_single_read: unsupported shape (K=", num_valid_blocks, ", H=", H, ")");
  TORCH_CHECK(grid >= 1 && grid * tokens_per_prog >= T, "attn_res_bwd_single_read: grid does not cover T");
  for (const auto* out : {&grad_prefix, &grad_blocks}) {
    TORCH_CHECK(!out->has_value() || ((*out)->is_contiguous() && aligned16(**out)),
                "attn_res_bwd_single_read: outputs must be contiguous and 16-byte aligned");
  }
  TORCH_CHECK(!grad_prefix.has_value() || grad_prefix->sizes() == prefix.sizes(), "grad_prefix shape");
  TORCH_CHECK(!grad_blocks.has_value() || grad_blocks->sizes() == blocks.sizes(), "grad_blocks shape");
  TORCH_CHECK(!workspace.has_value() || (workspace->scalar_type() == at::kDouble && workspace->is_contiguous() &&
                                         workspace->size(0) == grid && workspace->size(1) == H),
              "attn_res_bwd_single_read: workspace must be contiguous [grid, H] float64");
  const auto weight_grad_ok = [&](const c10::optional<at::Tensor>& grad, const at::Tensor& weight) {
    return !grad.has_value() || (workspace.has_value() && grad->scalar_type() == weight.scalar_type() &&
                                 grad->is_contiguous() && grad->numel() == H && vectors_per_thread == kc::kRingLayout);
  };
  TORCH_CHECK(weight_grad_ok(grad_norm_weight, norm_weight) && weight_grad_ok(grad_proj_weight, proj_weight),
              "attn_res_bwd_single_read: a weight's gradient must be contiguous [H] of the weight's dtype, with a "
              "workspace, ring layout");

  kc::SingleReadBwdArgs a{};
  a.grad_out = grad_out.data_ptr();
  a.prefix = prefix.data_ptr();
  a.blocks = blocks.data_ptr();
  a.norm_weight = norm_weight.data_ptr();
  a.proj_weight = proj_weight.data_ptr();
  a.grad_prefix = grad_prefix.has_value() ? grad_prefix->data_ptr() : nullptr;
  a.grad_blocks = grad_blocks.has_value() ? grad_blocks->data_ptr() : nullptr;
  a.workspace = workspace.has_value() ? workspace->data_ptr<double>() : nullptr;
  a.grad_norm_weight = grad_norm_weight.has_value() ? grad_norm_weight->data_ptr() : nullptr;
  a.grad_proj_weight = grad_proj_weight.has_value() ? grad_proj_weight->data_ptr() : nullptr;
  a.T = T;
  a.K = num_valid_blocks;
  a.C = C;
  a.H = H;
  a.stride_gyt = grad_out.stride(0);
  a.stride_pt = prefix.stride(0);
  a.stride_bt = blocks.stride(0);
  a.stride_bc = blocks.stride(1);
  a.tokens_per_prog = tokens_per_prog;
  a.eps = eps;
  a.io_dtype = io_dtype(prefix);
  a.nw_dtype = io_dtype(norm_weight);
  a.pw_dtype = io_dtype(proj_weight);
  a.vectors_per_thread = static_cast<int>(vectors_per_thread);

  const c10::cuda::CUDAGuard guard(prefix.device());
  const cudaError_t err = kc::launch_single_read_bwd(a, static_cast<int>(grid), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "attn_res_bwd_single_read launch failed: ", cudaGetErrorString(err));
}

// The cluster forward (csrc_cuda/attn_res_cluster.cu; cluster_size 1: the streaming forward, attn_res_stream.cu),
// declared in native_launch.h; also replayed by the launch cache. The policy (backends/cuda_plan.py,
// cluster_supported and native_layout_ok) has checked its rules; these checks are invariants.
void attn_res_cluster_forward(const at::Tensor& prefix, const at::Tensor& blocks, const at::Tensor& norm_weight,
                              const at::Tensor& proj_weight, const at::Tensor& out,
                              const c10::optional<at::Tensor>& addend, const c10::optional<at::Tensor>& new_prefix,
                              const c10::optional<at::Tensor>& out_norm_weight, const c10::optional<at::Tensor>& scale,
                              int64_t num_valid_blocks, double eps, double out_eps, double fp8_max, int64_t write_idx,
                              int64_t cluster_size, bool pdl, bool inplace_prefix, bool norm_rounded_mix,
                              int64_t fp8_kind, bool norm_gram, double gram_tau) {
  const int64_t T = prefix.size(0), H = prefix.size(1);
  TORCH_CHECK(prefix.is_cuda() && blocks.dim() == 3 && blocks.size(0) == T && blocks.size(2) == H,
              "attn_res_cluster_forward: bad inputs");
  TORCH_CHECK(fp8_kind >= 0 && fp8_kind <= 2, "attn_res_cluster_forward: fp8_kind is 0, 1 or 2");
  // An FP8 out comes as its uint8 view from the policy and as the op's FP8 output from a replay: one-byte elements.
  TORCH_CHECK(blocks.scalar_type() == prefix.scalar_type() &&
                  (fp8_kind != 0 ? out.element_size() == 1 : out.scalar_type() == prefix.scalar_type()),
              "attn_res_cluster_forward: one io dtype (an FP8 out: one-byte elements)");
  TORCH_CHECK((fp8_kind != 0) == scale.has_value() &&
                  (!scale.has_value() || (scale->scalar_type() == at::kFloat && scale->numel() == T &&
                                          scale->is_contiguous())),
              "attn_res_cluster_forward: an FP8 out needs a contiguous fp32 scale of T elements, and only it");
  TORCH_CHECK(prefix.stride(1) == 1 && blocks.stride(2) == 1 && out.is_contiguous() && out.sizes() == prefix.sizes(),
              "attn_res_cluster_forward: unit hidden strides, contiguous out");
  TORCH_CHECK(aligned16(prefix) && aligned16(blocks) && aligned16(out) && prefix.stride(0) % 8 == 0 &&
                  blocks.stride(0) % 8 == 0 && blocks.stride(1) % 8 == 0,
              "attn_res_cluster_forward: rows must start on 16-byte boundaries");
  TORCH_CHECK(norm_weight.is_contiguous() && proj_weight.is_contiguous() && norm_weight.numel() == H &&
                  proj_weight.numel() == H && aligned16(norm_weight) && aligned16(proj_weight),
              "attn_res_cluster_forward: weights must be contiguous, aligned [H]");
  TORCH_CHECK(kc::cluster_fwd_threads(num_valid_blocks, H, io_dtype(prefix), static_cast<int>(cluster_size)) > 0,
              "attn_res_cluster_forward: unsupported shape");
  TORCH_CHECK(!addend.has_value() || (addend->scalar_type() == prefix.scalar_type() && addend->sizes() == prefix.sizes() &&
                                      addend->stride(1) == 1 && aligned16(*addend) && addend->stride(0) % 8 == 0),
              "attn_res_cluster_forward: addend must be a [T, H] row-aligned tensor of the io dtype");
  TORCH_CHECK(!new_prefix.has_value() || (new_prefix->scalar_type() == prefix.scalar_type() &&
                                          new_prefix->is_contiguous() && new_prefix->sizes() == prefix.sizes() &&
                                          aligned16(*new_prefix)),
              "attn_res_cluster_forward: new_prefix must be a contiguous [T, H] tensor of the io dtype");
  TORCH_CHECK(!(inplace_prefix && new_prefix.has_value()),
              "attn_res_cluster_forward: new_prefix or in place, not both");
  TORCH_CHECK(write_idx < 0 || ((new_prefix.has_value() || inplace_prefix) && write_idx >= num_valid_blocks &&
                                write_idx < blocks.size(1)),
              "attn_res_cluster_forward: the snapshot slot must be in [K, C) and needs a fused call");
  TORCH_CHECK(!out_norm_weight.has_value() || (out_norm_weight->is_contiguous() && out_norm_weight->numel() == H &&
                                               aligned16(*out_norm_weight)),
              "attn_res_cluster_forward: out_norm_weight must be a contiguous, aligned [H]");
  TORCH_CHECK(!norm_gram || (cluster_size > 1 && gram_tau >= 0.0),
              "attn_res_cluster_forward: norm_gram is the cluster kernel's (cluster_size > 1), gram_tau >= 0");
  kc::ClusterFwdArgs a{};
  a.addend = addend.has_value() ? addend->data_ptr() : nullptr;
  a.stride_at = addend.has_value() ? addend->stride(0) : 0;
  a.new_prefix = new_prefix.has_value() ? new_prefix->data_ptr() : nullptr;
  a.write_idx = write_idx;
  a.inplace_prefix = inplace_prefix;
  a.out_norm_weight = out_norm_weight.has_value() ? out_norm_weight->data_ptr() : nullptr;
  a.onw_dtype = out_norm_weight.has_value() ? io_dtype(*out_norm_weight) : kc::IoDtype::kFloat32;
  a.out_eps = out_eps;
  a.norm_rounded_mix = norm_rounded_mix;
  a.norm_gram = norm_gram && out_norm_weight.has_value();
  a.gram_tau = static_cast<float>(gram_tau);
  a.fp8 = static_cast<kc::Fp8Kind>(fp8_kind);
  a.scale = scale.has_value() ? scale->data_ptr<float>() : nullptr;
  a.fp8_max = fp8_max;
  a.prefix = prefix.data_ptr();
  a.blocks = blocks.data_ptr();
  a.norm_weight = norm_weight.data_ptr();
  a.proj_weight = proj_weight.data_ptr();
  a.out = out.data_ptr();
  a.T = T;
  a.K = num_valid_blocks;
  a.H = H;
  a.stride_pt = prefix.stride(0);
  a.stride_bt = blocks.stride(0);
  a.stride_bc = blocks.stride(1);
  a.eps = eps;
  a.io_dtype = io_dtype(prefix);
  a.nw_dtype = io_dtype(norm_weight);
  a.pw_dtype = io_dtype(proj_weight);
  const c10::cuda::CUDAGuard guard(prefix.device());
  const cudaError_t err = kc::launch_cluster_fwd(a, static_cast<int>(cluster_size), pdl,
                                                 c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "attn_res_cluster_forward launch failed: ", cudaGetErrorString(err));
}

int64_t cluster_threads(int64_t K, int64_t H, int64_t element_size, int64_t cluster_size) {
  if (element_size != 2) return 0;
  return kc::cluster_fwd_threads(K, H, kc::IoDtype::kBFloat16, static_cast<int>(cluster_size));
}

void register_launch_cache_functions(py::module& m);  // csrc_cuda/launch_cache.cpp

void register_cuda_functions(py::module& m) {
  register_launch_cache_functions(m);
  m.def("attn_res_bwd_single_read", &attn_res_bwd_single_read_launch,
        "The single-read CUDA backward (csrc_cuda/attn_res_bwd.cu): gradients of one attn_res call; the weight "
        "gradient as per-program FP64 partials in workspace (and, given grad_norm_weight or grad_proj_weight, reduced "
        "in the kernel and multiplied by the other weight into them)",
        py::arg("grad_out"), py::arg("prefix"), py::arg("blocks"), py::arg("norm_weight"), py::arg("proj_weight"),
        py::arg("grad_prefix"), py::arg("grad_blocks"), py::arg("workspace"), py::arg("grad_norm_weight"),
        py::arg("grad_proj_weight"),
        py::arg("num_valid_blocks"), py::arg("eps"), py::arg("tokens_per_prog"), py::arg("grid"),
        py::arg("vectors_per_thread"));
  m.def("attn_res_cluster_forward", &attn_res_cluster_forward,
        "The thread-block-cluster forward (csrc_cuda/attn_res_cluster.cu; cluster_size 1: the streaming forward, "
        "attn_res_stream.cu): attn_res of 16-bit rows into out, or a fused call (addend, new_prefix or the prefix "
        "in place, snapshot slot, output norm, FP8 output)",
        py::arg("prefix"), py::arg("blocks"), py::arg("norm_weight"), py::arg("proj_weight"), py::arg("out"),
        py::arg("addend"), py::arg("new_prefix"), py::arg("out_norm_weight"), py::arg("scale"),
        py::arg("num_valid_blocks"), py::arg("eps"), py::arg("out_eps"), py::arg("fp8_max"), py::arg("write_idx"),
        py::arg("cluster_size"), py::arg("pdl"), py::arg("inplace_prefix"), py::arg("norm_rounded_mix"),
        py::arg("fp8_kind"), py::arg("norm_gram") = false, py::arg("gram_tau") = 0.0);
  m.def("attn_res_cluster_threads", &cluster_threads,
        "Threads per CTA of the cluster forward (cluster_size 1: the streaming forward) for this shape (0: not "
        "supported)",
        py::arg("num_valid_blocks"), py::arg("hidden_size"), py::arg("element_size"), py::arg("cluster_size"));
  m.def("attn_res_bwd_single_read_smem_bytes", &smem_bytes,
        "Dynamic shared memory of one single-read backward program (bytes; 0: shape or dtype not supported)",
        py::arg("num_valid_blocks"), py::arg("hidden_size"), py::arg("element_size"), py::arg("vectors_per_thread"));
}

}  // namespace k3_ops
