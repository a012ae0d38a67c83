// oneDNN's linear through the dispatcher, for kernels that call it from C++.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <vector>

namespace inferq_cpu {

// x @ weight^T (+ bias) by mkldnn::_linear_pointwise, no fused activation. weight is a plain
// fp32 / bf16 tensor (oneDNN reorders it per call) or one that oneDNN packed ahead of time;
// an undefined bias is none.
inline at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x,
                                 weight,
                                 bias.defined() ? c10::IValue(bias) : c10::IValue(),
                                 c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<std::optional<c10::Scalar>>()),
                                 c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace inferq_cpu
