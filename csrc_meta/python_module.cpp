// k3_ops._C: the Python module that carries the library, plus the shared argument checks for the eager
// kernels that are registered from Python. k3_ops/_registration.py calls these before any kernel runs and
// raises what they return, so eager calls and Meta kernels reject the same inputs with the same message.
//
// Each function returns None, or (is_type_error, message) for the first rule the arguments break. Nothing is
// thrown across this boundary for bad input (see checks.h for why).
#include <torch/extension.h>

#include "checks.h"

#ifdef K3_WITH_CUDA
namespace k3_ops {
void register_cuda_functions(py::module& m);  // csrc_cuda/python_cuda.cpp
}
#endif

namespace {

py::object to_python(const k3_ops::Verdict& v) {
  if (!v) {
    return py::none();
  }
  return py::make_tuple(v->type_error, v->message);
}

py::object check_attn_res(const at::Tensor& prefix_sum, const at::Tensor& block_residual, const at::Tensor& norm_weight,
                          const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps) {
  return to_python(
      k3_ops::attn_res_violation(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps));
}

py::object check_attn_res_backward(const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                                   const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                   const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps) {
  return to_python(k3_ops::attn_res_backward_violation(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                                       num_valid_blocks, eps));
}

py::object check_fused_attn_res(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                c10::optional<double> out_norm_eps) {
  return to_python(k3_ops::fused_attn_res_violation(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                                    num_valid_blocks, eps, block_write_idx, out_norm_weight,
                                                    out_norm_eps));
}

py::object check_fused_attn_res_quant(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                      const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                      const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                      int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                      c10::optional<double> out_norm_eps, at::ScalarType out_dtype) {
  return to_python(k3_ops::fused_attn_res_quant_violation(prefix_sum, addend, block_residual, norm_weight,
                                                          proj_weight, num_valid_blocks, eps, block_write_idx,
                                                          out_norm_weight, out_norm_eps, out_dtype));
}

py::object check_fused_attn_res_inplace(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                        const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                        const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                        int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                        c10::optional<double> out_norm_eps, c10::optional<at::ScalarType> out_dtype) {
  return to_python(k3_ops::fused_attn_res_inplace_violation(prefix_sum, addend, block_residual, norm_weight,
                                                            proj_weight, num_valid_blocks, eps, block_write_idx,
                                                            out_norm_weight, out_norm_eps, out_dtype));
}

py::object check_fused_attn_res_full(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                     const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                     const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                     int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                     c10::optional<double> out_norm_eps, bool return_mix, bool mix,
                                     const c10::optional<at::Tensor>& sum_out) {
  return to_python(k3_ops::fused_attn_res_full_violation(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                                         num_valid_blocks, eps, block_write_idx, out_norm_weight,
                                                         out_norm_eps, return_mix, mix, sum_out));
}

py::object check_tp_all_reduce(const at::Tensor& partial, const std::string& group_name) {
  return to_python(k3_ops::tp_all_reduce_violation(partial, group_name));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kimi_k3 schemas, Meta kernels and shared argument checks";
  m.def("check_attn_res", &check_attn_res,
        "First attn_res argument rule broken, as (is_type_error, message), or None", py::arg("prefix_sum"),
        py::arg("block_residual"), py::arg("norm_weight"), py::arg("proj_weight"), py::arg("num_valid_blocks"),
        py::arg("eps"));
  m.def("check_attn_res_backward", &check_attn_res_backward,
        "First attn_res_backward argument rule broken, as (is_type_error, message), or None", py::arg("grad_out"),
        py::arg("prefix_sum"), py::arg("block_residual"), py::arg("norm_weight"), py::arg("proj_weight"),
        py::arg("num_valid_blocks"), py::arg("eps"));
  m.def("check_fused_attn_res", &check_fused_attn_res,
        "First fused_attn_res argument rule broken, as (is_type_error, message), or None", py::arg("prefix_sum"),
        py::arg("addend"), py::arg("block_residual"), py::arg("norm_weight"), py::arg("proj_weight"),
        py::arg("num_valid_blocks"), py::arg("eps"), py::arg("block_write_idx"), py::arg("out_norm_weight"),
        py::arg("out_norm_eps"));
  m.def("check_fused_attn_res_quant", &check_fused_attn_res_quant,
        "First fused_attn_res.quant argument rule broken, as (is_type_error, message), or None",
        py::arg("prefix_sum"), py::arg("addend"), py::arg("block_residual"), py::arg("norm_weight"),
        py::arg("proj_weight"), py::arg("num_valid_blocks"), py::arg("eps"), py::arg("block_write_idx"),
        py::arg("out_norm_weight"), py::arg("out_norm_eps"), py::arg("out_dtype"));
  m.def("check_fused_attn_res_inplace", &check_fused_attn_res_inplace,
        "First fused_attn_res_ argument rule broken, as (is_type_error, message), or None", py::arg("prefix_sum"),
        py::arg("addend"), py::arg("block_residual"), py::arg("norm_weight"), py::arg("proj_weight"),
        py::arg("num_valid_blocks"), py::arg("eps"), py::arg("block_write_idx"), py::arg("out_norm_weight"),
        py::arg("out_norm_eps"), py::arg("out_dtype"));
  m.def("check_fused_attn_res_full", &check_fused_attn_res_full,
        "First fused_attn_res.full argument rule broken, as (is_type_error, message), or None", py::arg("prefix_sum"),
        py::arg("addend"), py::arg("block_residual"), py::arg("norm_weight"), py::arg("proj_weight"),
        py::arg("num_valid_blocks"), py::arg("eps"), py::arg("block_write_idx"), py::arg("out_norm_weight"),
        py::arg("out_norm_eps"), py::arg("return_mix"), py::arg("mix"), py::arg("sum_out"));
  m.def("check_tp_all_reduce", &check_tp_all_reduce,
        "First tp_all_reduce argument rule broken, as (is_type_error, message), or None", py::arg("partial"),
        py::arg("group_name"));
#ifdef K3_WITH_CUDA
  // The CUDA C++ kernels (csrc_cuda/), present only in builds against a CUDA torch with a CUDA toolkit.
  k3_ops::register_cuda_functions(m);
  m.attr("has_cuda_kernels") = true;
#else
  m.attr("has_cuda_kernels") = false;
#endif
}
