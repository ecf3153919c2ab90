// k3_ops._C: the Python module that carries the library, plus the shared argument checks for the
// eager kernels that are registered from Python (k3_ops/_registration.py calls these before any
// kernel runs, so eager calls and Meta kernels raise identical errors).
#include <torch/extension.h>

#include "checks.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "kimi_k3 schemas, Meta kernels and shared argument checks";
  m.def("check_attn_res", &k3_ops::check_attn_res_args, "Validate attn_res arguments (raises on bad input)",
        py::arg("prefix_sum"), py::arg("block_residual"), py::arg("norm_weight"), py::arg("proj_weight"),
        py::arg("num_valid_blocks"), py::arg("eps"));
  m.def("check_attn_res_backward", &k3_ops::check_attn_res_backward_args,
        "Validate attn_res_backward arguments (raises on bad input)", py::arg("grad_out"), py::arg("prefix_sum"),
        py::arg("block_residual"), py::arg("norm_weight"), py::arg("proj_weight"), py::arg("num_valid_blocks"),
        py::arg("eps"));
  m.def("check_fused_attn_res", &k3_ops::check_fused_attn_res_args,
        "Validate fused_attn_res arguments (raises on bad input)", py::arg("prefix_sum"), py::arg("addend"),
        py::arg("block_residual"), py::arg("norm_weight"), py::arg("proj_weight"), py::arg("num_valid_blocks"),
        py::arg("eps"), py::arg("block_write_idx"), py::arg("out_norm_weight"), py::arg("out_norm_eps"));
}
