// PyTorch bindings for the fused kernels: argument checks, output allocation, the
// current device and stream. The only file of the extension that includes
// torch/extension.h; the kernels themselves live in the .cu files.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <limits>
#include <optional>
#include <tuple>

#include "fused_kernels.h"

namespace megatron_lite {
namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "megatron_lite fused kernels take float32, float16 or bfloat16, got ",
                  t.scalar_type());
  }
}

void check_input(const Tensor& t, const Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on ", like.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_same_dtype(const Tensor& t, const Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must be ", like.scalar_type(),
              ", got ", t.scalar_type());
}

void check_float32(const Tensor& t, const Tensor& like, const char* name, int64_t size) {
  check_input(t, like, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == size, name, " must be float32 of ",
              size, " elements");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "megatron_lite ", op, " kernel failed: ",
              cudaGetErrorString(err));
}

// Row-per-block kernels put rows on grid.x.
void check_rows(int64_t rows, const char* op) {
  TORCH_CHECK(rows < std::numeric_limits<int32_t>::max(), op, ": too many rows (", rows, ")");
}

const void* data_or_null(const OptionalTensor& t) {
  return t.has_value() ? t->data_ptr() : nullptr;
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

std::tuple<Tensor, Tensor, Tensor> norm_forward_op(const Tensor& x, const Tensor& weight,
                                                   const OptionalTensor& bias, double eps,
                                                   bool rms) {
  check_input(x, x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1);
  const int64_t rows = cols > 0 ? x.numel() / cols : 0;
  check_rows(rows, "norm_forward");
  check_float32(weight, x, "weight", cols);
  if (bias) check_float32(*bias, x, "bias", cols);
  Tensor y = at::empty_like(x);
  Tensor mean = at::empty({rms ? 0 : rows}, x.options().dtype(at::kFloat));
  Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  check_launch(norm_forward(dtype_of(x), x.data_ptr(), weight.data_ptr<float>(),
                            bias ? bias->data_ptr<float>() : nullptr, y.data_ptr(),
                            rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(), rows,
                            cols, static_cast<float>(eps), rms, current_stream()),
               "norm_forward");
  return {y, mean, rstd};
}

// Returns (dx, dweight, dbias); dbias is undefined (None in Python) without a bias.
std::tuple<Tensor, Tensor, Tensor> norm_backward_op(const Tensor& dy, const Tensor& x,
                                                    const Tensor& weight, const Tensor& mean,
                                                    const Tensor& rstd, bool rms, bool has_bias) {
  check_input(x, x, "x");
  check_input(dy, x, "dy");
  check_same_dtype(dy, x, "dy");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1);
  const int64_t rows = cols > 0 ? x.numel() / cols : 0;
  TORCH_CHECK(dy.numel() == x.numel(), "dy must have x's shape");
  check_float32(weight, x, "weight", cols);
  check_float32(rstd, x, "rstd", rows);
  if (!rms) check_float32(mean, x, "mean", rows);
  const auto f32 = x.options().dtype(at::kFloat);
  const int64_t chunks = norm_backward_num_chunks(rows);
  Tensor dx = at::empty_like(x);
  Tensor partial_weight = at::empty({chunks, cols}, f32);
  Tensor partial_bias = has_bias ? at::empty({chunks, cols}, f32) : Tensor();
  Tensor dweight = at::empty({cols}, f32);
  Tensor dbias = has_bias ? at::empty({cols}, f32) : Tensor();
  const cudaStream_t stream = current_stream();
  check_launch(norm_backward(dtype_of(x), dy.data_ptr(), x.data_ptr(), weight.data_ptr<float>(),
                             rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(),
                             dx.data_ptr(), partial_weight.data_ptr<float>(),
                             has_bias ? partial_bias.data_ptr<float>() : nullptr, rows, cols, rms,
                             stream),
               "norm_backward");
  check_launch(norm_reduce_partials(partial_weight.data_ptr<float>(), dweight.data_ptr<float>(),
                                    chunks, cols, stream),
               "norm_reduce_partials");
  if (has_bias) {
    check_launch(norm_reduce_partials(partial_bias.data_ptr<float>(), dbias.data_ptr<float>(),
                                      chunks, cols, stream),
                 "norm_reduce_partials");
  }
  return {dx, dweight, dbias};
}

// causal: x is [batch * heads, sq, sk]. Otherwise x is [batch, heads, sq, sk] and mask,
// if given, is bool and already expanded to x's shape (stride 0 where broadcast).
Tensor softmax_forward_op(const Tensor& x, const OptionalTensor& mask, double scale, bool causal) {
  check_input(x, x, "x");
  TORCH_CHECK(x.dim() == (causal ? 3 : 4), "x must be ", causal ? 3 : 4, "-D, got ", x.dim(),
              "-D");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t sk = x.size(-1);
  const int64_t sq = x.size(-2);
  TORCH_CHECK(!causal || sk >= sq, "causal softmax needs sk >= sq, got sq=", sq, " sk=", sk);
  const int64_t heads = causal ? 1 : x.size(1);
  const int64_t rows = sk > 0 ? x.numel() / sk : 0;
  int64_t mask_strides[3] = {0, 0, 0};
  if (mask) {
    TORCH_CHECK(!causal, "the causal softmax takes no mask");
    TORCH_CHECK(mask->is_cuda() && mask->device() == x.device(), "mask must be on ", x.device());
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->sizes() == x.sizes(),
                "mask must be bool, expanded to x's shape");
    TORCH_CHECK(mask->stride(3) == 1, "mask must be contiguous along keys");
    for (int d = 0; d < 3; ++d) mask_strides[d] = mask->stride(d);
  }
  Tensor y = at::empty_like(x);
  check_launch(softmax_forward(dtype_of(x), x.data_ptr(), mask ? mask->data_ptr<bool>() : nullptr,
                               y.data_ptr(), rows, heads, sq, sk, mask_strides,
                               static_cast<float>(scale), causal, current_stream()),
               "softmax_forward");
  return y;
}

Tensor softmax_backward_op(const Tensor& dy, const Tensor& y, double scale) {
  check_input(y, y, "y");
  check_input(dy, y, "dy");
  check_same_dtype(dy, y, "dy");
  TORCH_CHECK(dy.sizes() == y.sizes(), "dy must have y's shape");
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t sk = y.size(-1);
  Tensor dx = at::empty_like(y);
  check_launch(softmax_backward(dtype_of(y), dy.data_ptr(), y.data_ptr(), dx.data_ptr(),
                                sk > 0 ? y.numel() / sk : 0, sk, static_cast<float>(scale),
                                current_stream()),
               "softmax_backward");
  return dx;
}

void check_bias(const OptionalTensor& bias, const Tensor& x) {
  if (!bias) return;
  check_input(*bias, x, "bias");
  check_same_dtype(*bias, x, "bias");
  TORCH_CHECK(bias->numel() == x.size(-1), "bias must have ", x.size(-1), " elements");
}

Tensor bias_gelu_forward_op(const Tensor& x, const OptionalTensor& bias) {
  check_input(x, x, "x");
  check_bias(bias, x);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty_like(x);
  check_launch(bias_gelu_forward(dtype_of(x), x.data_ptr(), data_or_null(bias), y.data_ptr(),
                                 x.numel(), x.size(-1), current_stream()),
               "bias_gelu_forward");
  return y;
}

Tensor bias_gelu_backward_op(const Tensor& dy, const Tensor& x, const OptionalTensor& bias) {
  check_input(x, x, "x");
  check_input(dy, x, "dy");
  check_same_dtype(dy, x, "dy");
  check_bias(bias, x);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor dx = at::empty_like(x);
  check_launch(bias_gelu_backward(dtype_of(x), dy.data_ptr(), x.data_ptr(), data_or_null(bias),
                                  dx.data_ptr(), x.numel(), x.size(-1), current_stream()),
               "bias_gelu_backward");
  return dx;
}

Tensor swiglu_forward_op(const Tensor& x) {
  check_input(x, x, "x");
  TORCH_CHECK(x.size(-1) % 2 == 0, "swiglu needs an even last dim, got ", x.size(-1));
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1) / 2;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = cols;
  Tensor y = at::empty(shape, x.options());
  check_launch(swiglu_forward(dtype_of(x), x.data_ptr(), y.data_ptr(),
                              cols > 0 ? y.numel() / cols : 0, cols, current_stream()),
               "swiglu_forward");
  return y;
}

Tensor swiglu_backward_op(const Tensor& dy, const Tensor& x) {
  check_input(x, x, "x");
  check_input(dy, x, "dy");
  check_same_dtype(dy, x, "dy");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1) / 2;
  TORCH_CHECK(dy.numel() * 2 == x.numel(), "dy must be half of x along the last dim");
  Tensor dx = at::empty_like(x);
  check_launch(swiglu_backward(dtype_of(x), dy.data_ptr(), x.data_ptr(), dx.data_ptr(),
                               cols > 0 ? dy.numel() / cols : 0, cols, current_stream()),
               "swiglu_backward");
  return dx;
}

void check_seed(const Tensor& seed, const Tensor& like) {
  check_input(seed, like, "seed");
  TORCH_CHECK(seed.scalar_type() == at::kLong && seed.numel() == 1,
              "seed must be one int64 element");
}

// seed may be None only when keep_prob >= 1 (no dropout: the kernel draws nothing).
Tensor bias_dropout_add_forward_op(const Tensor& x, const OptionalTensor& bias,
                                   const Tensor& residual, const OptionalTensor& seed,
                                   double keep_prob) {
  check_input(x, x, "x");
  check_input(residual, x, "residual");
  check_same_dtype(residual, x, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must have x's shape");
  check_bias(bias, x);
  TORCH_CHECK(seed || keep_prob >= 1.0, "dropout needs a seed");
  if (seed) check_seed(*seed, x);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor out = at::empty_like(x);
  check_launch(bias_dropout_add_forward(dtype_of(x), x.data_ptr(), data_or_null(bias),
                                        residual.data_ptr(), out.data_ptr(),
                                        seed ? seed->data_ptr<int64_t>() : nullptr,
                                        static_cast<float>(keep_prob), x.numel(), x.size(-1),
                                        current_stream()),
               "bias_dropout_add_forward");
  return out;
}

Tensor dropout_backward_op(const Tensor& dy, const Tensor& seed, double keep_prob) {
  check_input(dy, dy, "dy");
  check_seed(seed, dy);
  const c10::cuda::CUDAGuard guard(dy.device());
  Tensor dx = at::empty_like(dy);
  check_launch(dropout_backward(dtype_of(dy), dy.data_ptr(), dx.data_ptr(),
                                seed.data_ptr<int64_t>(), static_cast<float>(keep_prob),
                                dy.numel(), current_stream()),
               "dropout_backward");
  return dx;
}

// t is [seq, batch, heads, head_dim]; freqs is float32 [seq, 1, 1, rot_dim].
Tensor rotary_op(const Tensor& t, const Tensor& freqs, bool backward) {
  check_input(t, t, "t");
  TORCH_CHECK(t.dim() == 4, "t must be [seq, batch, heads, head_dim]");
  const c10::cuda::CUDAGuard guard(t.device());
  const int64_t seq = t.size(0);
  const int64_t head_dim = t.size(3);
  const int64_t rot_dim = freqs.size(-1);
  check_float32(freqs, t, "freqs", seq * rot_dim);
  TORCH_CHECK(freqs.size(0) == seq, "freqs must have ", seq, " positions, got ", freqs.size(0));
  TORCH_CHECK(rot_dim % 2 == 0 && rot_dim <= head_dim, "rotary dim ", rot_dim,
              " must be even and at most head_dim ", head_dim);
  Tensor out = at::empty_like(t);
  const auto launch = backward ? rotary_backward : rotary_forward;
  check_launch(launch(dtype_of(t), t.data_ptr(), freqs.data_ptr<float>(), out.data_ptr(), seq,
                      t.size(1) * t.size(2), head_dim, rot_dim, current_stream()),
               backward ? "rotary_backward" : "rotary_forward");
  return out;
}

}  // namespace
}  // namespace megatron_lite

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace megatron_lite;
  m.doc() = "megatron_lite fused CUDA kernels (raw ops; megatron_lite.kernels wraps them)";
  m.def("norm_forward", &norm_forward_op, "LayerNorm/RMSNorm forward -> (y, mean, rstd)");
  m.def("norm_backward", &norm_backward_op, "LayerNorm/RMSNorm backward -> (dx, dw, db)");
  m.def("softmax_forward", &softmax_forward_op, "scaled (masked or causal) softmax forward");
  m.def("softmax_backward", &softmax_backward_op, "scaled softmax backward");
  m.def("bias_gelu_forward", &bias_gelu_forward_op, "gelu_tanh(x + bias)");
  m.def("bias_gelu_backward", &bias_gelu_backward_op, "bias_gelu input gradient");
  m.def("swiglu_forward", &swiglu_forward_op, "silu(gate) * up");
  m.def("swiglu_backward", &swiglu_backward_op, "swiglu input gradient");
  m.def("bias_dropout_add_forward", &bias_dropout_add_forward_op,
        "residual + dropout(x + bias) with a Philox mask keyed by seed");
  m.def("dropout_backward", &dropout_backward_op, "dropout gradient, mask regenerated from seed");
  m.def("rotary_forward", [](const at::Tensor& t, const at::Tensor& f) { return rotary_op(t, f, false); },
        "rotary position embedding forward");
  m.def("rotary_backward", [](const at::Tensor& dy, const at::Tensor& f) { return rotary_op(dy, f, true); },
        "rotary position embedding backward");
}
