// k3_ops._C: the Python module that carries the library, plus the shared argument checks for the
// eager kernels that are registered from Python (k3_ops/_registration.py calls these before any
// kernel runs, so eager calls and Meta kernels raise identical errors).
#include <torch/extension.h>

#include <utility>

#include "checks.h"

namespace {

// Raise the checks' errors as the matching Python exceptions *inside this module*. Leaving c10::Error to
// torch's own pybind translators relies on this extension and torch sharing pybind11 internals and C++
// exception RTTI across shared objects, which does not hold for every toolchain torch is built with
// (seen: a segfault while translating on one torch 2.11 wheel). The message is the check's, without
// the C++ backtrace.
template <typename... Args>
void checked(void (*check)(Args...), Args... args) {
  try {
    check(std::forward<Args>(args)...);
  } catch (const c10::ValueError& e) {
    throw py::value_error(e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    throw py::type_error(e.what_without_backtrace());
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
}

void check_attn_res(const at::Tensor& prefix_sum, const at::Tensor& block_residual, const at::Tensor& norm_weight,
                    const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps) {
  checked<const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double>(
      &k3_ops::check_attn_res_args, prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps);
}

void check_attn_res_backward(const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                             const at::Tensor& block_residual, const at::Tensor& norm_weight,
                             const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps) {
  checked<const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
          double>(&k3_ops::check_attn_res_backward_args, grad_out, prefix_sum, block_residual, norm_weight,
                  proj_weight, num_valid_blocks, eps);
}

void check_fused_attn_res(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                          const at::Tensor& block_residual, const at::Tensor& norm_weight,
                          const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps, int64_t block_write_idx,
                          const c10::optional<at::Tensor>& out_norm_weight, c10::optional<double> out_norm_eps) {
  checked<const at::Tensor&, const c10::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
          int64_t, double, int64_t, const c10::optional<at::Tensor>&, c10::optional<double>>(
      &k3_ops::check_fused_attn_res_args, prefix_sum, addend, block_residual, norm_weight, proj_weight,
      num_valid_blocks, eps, block_write_idx, out_norm_weight, out_norm_eps);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kimi_k3 schemas, Meta kernels and shared argument checks";
  m.def("check_attn_res", &check_attn_res, "Validate attn_res arguments (raises on bad input)", py::arg("prefix_sum"),
        py::arg("block_residual"), py::arg("norm_weight"), py::arg("proj_weight"), py::arg("num_valid_blocks"),
        py::arg("eps"));
  m.def("check_attn_res_backward", &check_attn_res_backward,
        "Validate attn_res_backward arguments (raises on bad input)", py::arg("grad_out"), py::arg("prefix_sum"),
        py::arg("block_residual"), py::arg("norm_weight"), py::arg("proj_weight"), py::arg("num_valid_blocks"),
        py::arg("eps"));
  m.def("check_fused_attn_res", &check_fused_attn_res, "Validate fused_attn_res arguments (raises on bad input)",
        py::arg("prefix_sum"), py::arg("addend"), py::arg("block_residual"), py::arg("norm_weight"),
        py::arg("proj_weight"), py::arg("num_valid_blocks"), py::arg("eps"), py::arg("block_write_idx"),
        py::arg("out_norm_weight"), py::arg("out_norm_eps"));
}
