#include "checks.h"

#include <c10/core/ScalarType.h>
#include <c10/core/SymBool.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <string>

namespace k3_ops {
namespace {

// TORCH_SYM_CHECK raises RuntimeError; shape and value rules raise ValueError like the rest of the
// Python API, so the symbolic variant of TORCH_CHECK_VALUE is spelled out here.
#define K3_SYM_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE((cond).expect_true(__FILE__, __LINE__), __VA_ARGS__)

// Python spelling ("torch.int64"), since that is what the caller wrote. Spelled out here rather than taken
// from c10::getDtypeNames, whose result crashed torch 2.11 for complex dtypes in our tests.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBool: return "torch.bool";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// Sizes are read and formatted through these helpers. Tensors with concrete sizes (every eager call) never go
// through the SymInt API at all: on the H200's torch 2.11 build, formatting a SymInt read from a plain CPU
// tensor's sym_size() into an error message segfaulted (a garbage SymInt inside c10::str, seen with cuda-gdb).
// Only tensors with symbolic sizes (FakeTensor / Meta under tracing) use sym_size, where it is required.
bool symbolic(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

c10::SymInt size_of(const at::Tensor& t, int64_t d) {
  return symbolic(t) ? t.sym_size(d) : c10::SymInt(t.size(d));
}

std::string fmt(const c10::SymInt& s) {
  if (auto v = s.maybe_as_int()) {
    return std::to_string(*v);
  }
  return s.toSymNode()->str();
}

std::string shape_of(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) {
    out += (i ? ", " : "") + (symbolic(t) ? fmt(t.sym_size(i)) : std::to_string(t.size(i)));
  }
  return out + "]";
}

bool is_io_dtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat || t == at::kDouble;
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& prefix_sum) {
  TORCH_CHECK_VALUE(t.device() == prefix_sum.device(), name, " must be on prefix_sum's device (",
                    prefix_sum.device(), "), got ", t.device());
}

void check_floating_weight(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()), name, ".dtype must be a floating dtype, got ",
                   dtype_name(t.scalar_type()));
}

void check_eps(double eps, const char* name) {
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0.0, name, " must be finite and > 0, got ", eps);
}

// grad_out of the backward and addend of the fused op are "another [T, H] tensor like prefix_sum".
void check_like_prefix(const at::Tensor& t, const char* name, const at::Tensor& prefix_sum) {
  TORCH_CHECK_VALUE(t.dim() == 2, name, " must be 2-D [T, H] like prefix_sum, got a ", t.dim(),
                    "-D tensor of shape ", shape_of(t));
  TORCH_CHECK_TYPE(t.scalar_type() == prefix_sum.scalar_type(), name, ".dtype must equal prefix_sum.dtype=",
                   dtype_name(prefix_sum.scalar_type()), ", got ", dtype_name(t.scalar_type()));
  check_same_device(t, name, prefix_sum);
  K3_SYM_CHECK_VALUE(size_of(t, 0).sym_eq(size_of(prefix_sum, 0)), name, ".size(0) must equal prefix_sum.size(0)=",
                     fmt(size_of(prefix_sum, 0)), " (token count), got ", fmt(size_of(t, 0)));
  K3_SYM_CHECK_VALUE(size_of(t, 1).sym_eq(size_of(prefix_sum, 1)), name, ".size(1) must equal prefix_sum.size(1)=",
                     fmt(size_of(prefix_sum, 1)), " (hidden size), got ", fmt(size_of(t, 1)));
}

}  // namespace

void check_attn_res_args(const at::Tensor& prefix_sum, const at::Tensor& block_residual,
                         const at::Tensor& norm_weight, const at::Tensor& proj_weight,
                         int64_t num_valid_blocks, double eps) {
  // Ranks first: every later rule indexes sizes.
  TORCH_CHECK_VALUE(prefix_sum.dim() == 2, "prefix_sum must be 2-D [T, H], got a ", prefix_sum.dim(),
                    "-D tensor of shape ", shape_of(prefix_sum));
  TORCH_CHECK_VALUE(block_residual.dim() == 3,
                    "block_residual must be 3-D [T, C, H] (pass a block-major [C, T, H] buffer as "
                    ".transpose(0, 1)), got a ", block_residual.dim(), "-D tensor of shape ",
                    shape_of(block_residual));
  TORCH_CHECK_VALUE(norm_weight.dim() == 1, "norm_weight must be 1-D [H], got a ", norm_weight.dim(),
                    "-D tensor of shape ", shape_of(norm_weight));
  TORCH_CHECK_VALUE(proj_weight.dim() == 1 || proj_weight.dim() == 2,
                    "proj_weight must be [H] or [1, H] (an nn.Linear(H, 1) weight), got a ", proj_weight.dim(),
                    "-D tensor of shape ", shape_of(proj_weight));
  if (proj_weight.dim() == 2) {
    K3_SYM_CHECK_VALUE(size_of(proj_weight, 0).sym_eq(1),
                       "proj_weight must be [H] or [1, H] (an nn.Linear(H, 1) weight), got shape ",
                       shape_of(proj_weight));
  }

  // Dtypes: the candidates share one I/O dtype; the weights may be any floating dtype.
  TORCH_CHECK_TYPE(is_io_dtype(prefix_sum.scalar_type()),
                   "prefix_sum.dtype must be one of torch.bfloat16, torch.float16, torch.float32, torch.float64, got ",
                   dtype_name(prefix_sum.scalar_type()));
  TORCH_CHECK_TYPE(block_residual.scalar_type() == prefix_sum.scalar_type(),
                   "block_residual.dtype must equal prefix_sum.dtype=", dtype_name(prefix_sum.scalar_type()),
                   ", got ", dtype_name(block_residual.scalar_type()));
  check_floating_weight(norm_weight, "norm_weight");
  check_floating_weight(proj_weight, "proj_weight");

  check_same_device(block_residual, "block_residual", prefix_sum);
  check_same_device(norm_weight, "norm_weight", prefix_sum);
  check_same_device(proj_weight, "proj_weight", prefix_sum);

  // Sizes: one hidden size H >= 1 and one token count T across all arguments.
  const c10::SymInt H = size_of(prefix_sum, 1);
  K3_SYM_CHECK_VALUE(H.sym_ge(1), "prefix_sum.size(1) (hidden size H) must be >= 1, got ", fmt(H));
  K3_SYM_CHECK_VALUE(size_of(block_residual, 2).sym_eq(H), "block_residual.size(2) must equal prefix_sum.size(1)=",
                     fmt(H), " (hidden size), got ", fmt(size_of(block_residual, 2)));
  K3_SYM_CHECK_VALUE(size_of(norm_weight, 0).sym_eq(H), "norm_weight.size(0) must equal prefix_sum.size(1)=", fmt(H),
                     " (hidden size), got ", fmt(size_of(norm_weight, 0)));
  K3_SYM_CHECK_VALUE(size_of(proj_weight, -1).sym_eq(H), "proj_weight.size(-1) must equal prefix_sum.size(1)=", fmt(H),
                     " (hidden size), got ", fmt(size_of(proj_weight, -1)));
  K3_SYM_CHECK_VALUE(size_of(block_residual, 0).sym_eq(size_of(prefix_sum, 0)),
                     "block_residual.size(0) must equal prefix_sum.size(0)=", fmt(size_of(prefix_sum, 0)),
                     " (token count), got ", fmt(size_of(block_residual, 0)));

  // The valid prefix of the buffer: dim 1 is only capacity.
  const c10::SymInt C = size_of(block_residual, 1);
  TORCH_CHECK_VALUE(num_valid_blocks >= 0, "num_valid_blocks must be in [0, block_residual.size(1)=", fmt(C),
                    "], got ", num_valid_blocks);
  K3_SYM_CHECK_VALUE(C.sym_ge(num_valid_blocks), "num_valid_blocks must be in [0, block_residual.size(1)=", fmt(C),
                     "], got ", num_valid_blocks);
  check_eps(eps, "eps");
}

void check_attn_res_backward_args(const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                                  const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                  const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps) {
  check_attn_res_args(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps);
  check_like_prefix(grad_out, "grad_out", prefix_sum);
}

void check_fused_attn_res_args(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                               const at::Tensor& block_residual, const at::Tensor& norm_weight,
                               const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                               int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                               c10::optional<double> out_norm_eps) {
  check_attn_res_args(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps);
  if (addend.has_value()) {
    check_like_prefix(*addend, "addend", prefix_sum);
  }
  if (block_write_idx != -1) {
    // The snapshot goes into free capacity: never over a valid block, never past the buffer.
    const c10::SymInt C = size_of(block_residual, 1);
    TORCH_CHECK_VALUE(block_write_idx >= num_valid_blocks, "block_write_idx must be -1 (no snapshot) or in "
                      "[num_valid_blocks=", num_valid_blocks, ", block_residual.size(1)=", fmt(C), "), got ", block_write_idx);
    K3_SYM_CHECK_VALUE(C.sym_gt(block_write_idx), "block_write_idx must be -1 (no snapshot) or in [num_valid_blocks=",
                       num_valid_blocks, ", block_residual.size(1)=", fmt(C), "), got ", block_write_idx);
  }
  if (out_norm_weight.has_value()) {
    const at::Tensor& w = *out_norm_weight;
    TORCH_CHECK_VALUE(w.dim() == 1, "out_norm_weight must be 1-D [H], got a ", w.dim(), "-D tensor of shape ",
                      shape_of(w));
    K3_SYM_CHECK_VALUE(size_of(w, 0).sym_eq(size_of(prefix_sum, 1)),
                       "out_norm_weight.size(0) must equal prefix_sum.size(1)=", fmt(size_of(prefix_sum, 1)),
                       " (hidden size), got ", fmt(size_of(w, 0)));
    check_floating_weight(w, "out_norm_weight");
    check_same_device(w, "out_norm_weight", prefix_sum);
  } else {
    TORCH_CHECK_VALUE(!out_norm_eps.has_value(), "out_norm_eps needs out_norm_weight (there is no output norm "
                      "without it), got out_norm_eps=", out_norm_eps.value_or(0.0), " and out_norm_weight=None");
  }
  if (out_norm_eps.has_value()) {
    check_eps(*out_norm_eps, "out_norm_eps");
  }
}

}  // namespace k3_ops
