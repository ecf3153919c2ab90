// Autograd (and ADInplaceOrView) kernels of the kimi_k3 ops, in C++.
//
// Why C++: an Autograd kernel registered from Python (torch.library.register_autograd) runs on every call, with
// or without grad, and redispatches to the device kernel through Python again: about 18 us of host time per call
// on the H200, more than the decode-size kernel itself (docs/benchmarks.md, "Host cost of an eager call"). Here
// the Autograd key costs a C++ function call and the device kernel is reached by one redispatch.
//
// attn_res: saves only its four tensor inputs (the backward recomputes r, d and p per token instead of keeping
// [T, K + 1, H] FP32 intermediates) and calls kimi_k3::attn_res_backward, asking only for the gradients some input
// needs; that op returns each input's gradient in the input's shape and dtype (the two weights' included), so the
// backward is that one op call and it traces under torch.compile / AOTAutograd. attn_res_backward has no derivative: differentiating it (double
// backward) raises a message that says what to use instead.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <ATen/core/grad_mode.h>

#include <array>
#include <initializer_list>
#include <string>
#include <stdexcept>
#include <tuple>

namespace k3_ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_attn_res(const at::Tensor& prefix_sum, const at::Tensor& block_residual, const at::Tensor& norm_weight,
                         const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kimi_k3::attn_res", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         int64_t, double)>();
  return op.call(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps);
}

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Grads call_attn_res_backward(const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                             const at::Tensor& block_residual, const at::Tensor& norm_weight,
                             const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                             std::array<bool, 4> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kimi_k3::attn_res_backward", "")
                       .typed<Grads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, int64_t, double, std::array<bool, 4>)>();
  return op.call(grad_out, prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps, output_mask);
}

class AttnResBackwardFunction : public torch::autograd::Function<AttnResBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                               const at::Tensor& block_residual, const at::Tensor& norm_weight,
                               const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                               std::array<bool, 4> output_mask) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [gp, gb, gn, gj] = call_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                                   num_valid_blocks, eps, output_mask);
    return {gp, gb, gn, gj};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    throw std::runtime_error(
        "kimi_k3::attn_res does not support double backward: kimi_k3::attn_res_backward has no derivative "
        "(asked for by create_graph=True followed by a second backward, e.g. a gradient penalty or "
        "Hessian-vector product). For second-order gradients differentiate the plain PyTorch formula "
        "k3_ops.reference.attn_res_reference instead of the fused op.");
  }
};

bool records(std::initializer_list<const at::Tensor*> inputs);
Grads attn_res_backward_autograd(const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                                 const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                 const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                 std::array<bool, 4> output_mask);

class AttnResFunction : public torch::autograd::Function<AttnResFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& prefix_sum, const at::Tensor& block_residual,
                            const at::Tensor& norm_weight, const at::Tensor& proj_weight, int64_t num_valid_blocks,
                            double eps) {
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = call_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps);
    }
    // save_for_backward (not plain members) so that an in-place write to an input before backward is caught by
    // autograd's version counter.
    ctx->save_for_backward({prefix_sum, block_residual, norm_weight, proj_weight});
    ctx->saved_data["num_valid_blocks"] = num_valid_blocks;
    ctx->saved_data["eps"] = eps;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool need_prefix = ctx->needs_input_grad(0), need_blocks = ctx->needs_input_grad(1);
    const bool need_norm = ctx->needs_input_grad(2), need_proj = ctx->needs_input_grad(3);
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    auto saved = ctx->get_saved_variables();
    const at::Tensor &prefix_sum = saved[0], &block_residual = saved[1], &norm_weight = saved[2],
                     &proj_weight = saved[3];
    // Through the op's own autograd (AttnResBackwardFunction where a graph is built, create_graph=True), so that a
    // second differentiation finds a node whose backward refuses clearly.
    auto [grad_p, grad_b, grad_n, grad_j] = attn_res_backward_autograd(
        grad_out, prefix_sum, block_residual, norm_weight, proj_weight, ctx->saved_data["num_valid_blocks"].toInt(),
        ctx->saved_data["eps"].toDouble(), std::array<bool, 4>{need_prefix, need_blocks, need_norm, need_proj});
    return {need_prefix ? grad_p : at::Tensor(), need_blocks ? grad_b : at::Tensor(),
            need_norm ? grad_n : at::Tensor(), need_proj ? grad_j : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Whether autograd must record this call: grad mode on and some tensor input requires grad. Inference calls skip
// the Function machinery (node, saved variables) altogether.
bool records(std::initializer_list<const at::Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) {
    return false;
  }
  for (const at::Tensor* t : inputs) {
    if (t->requires_grad()) {
      return true;
    }
  }
  return false;
}

at::Tensor attn_res_autograd(const at::Tensor& prefix_sum, const at::Tensor& block_residual,
                             const at::Tensor& norm_weight, const at::Tensor& proj_weight, int64_t num_valid_blocks,
                             double eps) {
  if (!records({&prefix_sum, &block_residual, &norm_weight, &proj_weight})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps);
  }
  return AttnResFunction::apply(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps);
}

Grads attn_res_backward_autograd(const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                                 const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                 const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                 std::array<bool, 4> output_mask) {
  if (!records({&grad_out, &prefix_sum, &block_residual, &norm_weight, &proj_weight})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_attn_res_backward(grad_out, prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                  eps, output_mask);
  }
  auto outs = AttnResBackwardFunction::apply(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                             num_valid_blocks, eps, output_mask);
  return {outs[0], outs[1], outs[2], outs[3]};
}

// --- The inference ops (fused_attn_res, fused_attn_res.quant, fused_attn_res.full, fused_attn_res_) ------------
// No backward. Autograd: where autograd would have to record one (grad mode on and an input requires grad), fail
// before anything is written instead of returning outputs that silently carry no gradient; otherwise go on below
// autograd. ADInplaceOrView: bump the version counter of every argument the schema marks as written (Tensor(a!)),
// as torch does for its own in-place ops (a Triton store is invisible to autograd otherwise). Both are boxed, so
// one pair serves every overload; both used to be Python kernels run on every call.
void inference_only_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  if (at::GradMode::is_enabled()) {
    std::string needs;
    const auto first = stack->size() - args.size();
    for (size_t i = 0; i < args.size(); ++i) {
      const c10::IValue& v = (*stack)[first + i];
      if (v.isTensor() && v.toTensor().requires_grad()) {
        needs += (needs.empty() ? "" : ", ") + args[i].name();
      }
    }
    if (!needs.empty()) {
      const auto& name = op.schema().operator_name();
      throw std::runtime_error(
          name.name + (name.overload_name.empty() ? "" : "." + name.overload_name) +
          " is an inference op and has no backward, but " + needs +
          " requires grad (with grad mode on); for training use k3_ops.attn_res (differentiable) with the residual "
          "add, snapshot copy and RMSNorm as separate ops, or call it under torch.no_grad() / "
          "torch.inference_mode()");
    }
  }
  at::AutoDispatchBelowAutograd guard;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

void inference_only_inplace_or_view(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                                    torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const auto first = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* alias = args[i].alias_info();
    const c10::IValue& v = (*stack)[first + i];
    if (alias != nullptr && alias->isWrite() && v.isTensor()) {
      v.toTensor().unsafeGetTensorImpl()->bump_version();
    }
  }
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(kimi_k3, Autograd, m) {
  m.impl("attn_res", &attn_res_autograd);
  m.impl("attn_res_backward", &attn_res_backward_autograd);
  for (const char* name : {"fused_attn_res", "fused_attn_res.quant", "fused_attn_res.full", "fused_attn_res_"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&inference_only_autograd>());
  }
}

TORCH_LIBRARY_IMPL(kimi_k3, ADInplaceOrView, m) {
  for (const char* name : {"fused_attn_res", "fused_attn_res.quant", "fused_attn_res.full", "fused_attn_res_"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&inference_only_inplace_or_view>());
  }
}

}  // namespace k3_ops
