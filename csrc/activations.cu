// Bias + GELU (tanh approximation) and SwiGLU, forward and backward, elementwise.
#include <math.h>

#include "common.cuh"

namespace megatron_lite {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// gelu(v) = 0.5 v (1 + tanh(u)), u = sqrt(2/pi) (v + 0.044715 v^3).
__device__ __forceinline__ float gelu_tanh(float v) {
  const float u = kSqrt2OverPi * (v + kGeluCubic * v * v * v);
  return 0.5f * v * (1.f + tanhf(u));
}

// d gelu / dv = 0.5 (1 + tanh(u)) + 0.5 v (1 - tanh(u)^2) du/dv.
__device__ __forceinline__ float gelu_tanh_grad(float v) {
  const float t = tanhf(kSqrt2OverPi * (v + kGeluCubic * v * v * v));
  const float du_dv = kSqrt2OverPi * (1.f + 3.f * kGeluCubic * v * v);
  return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du_dv;
}

template <typename T>
__device__ __forceinline__ float add_bias(const T* x, const T* bias, int64_t i, int64_t cols) {
  return to_float(x[i]) + (bias != nullptr ? to_float(bias[i % cols]) : 0.f);
}

template <typename T>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                         T* __restrict__ y, int64_t n, int64_t cols) {
  for (int64_t i = global_thread_index(); i < n; i += grid_stride()) {
    y[i] = from_float<T>(gelu_tanh(add_bias(x, bias, i, cols)));
  }
}

template <typename T>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                          const T* __restrict__ bias, T* __restrict__ dx,
                                          int64_t n, int64_t cols) {
  for (int64_t i = global_thread_index(); i < n; i += grid_stride()) {
    dx[i] = from_float<T>(to_float(dy[i]) * gelu_tanh_grad(add_bias(x, bias, i, cols)));
  }
}

__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

// Output element (r, c) reads gate x[r, c] and up x[r, cols + c].
template <typename T>
__global__ void swiglu_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows,
                                      int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = global_thread_index(); i < n; i += grid_stride()) {
    const int64_t gate_index = (i / cols) * 2 * cols + i % cols;
    const float gate = to_float(x[gate_index]);
    const float up = to_float(x[gate_index + cols]);
    y[i] = from_float<T>(gate * sigmoid(gate) * up);
  }
}

// d/dgate silu(gate) = s (1 + gate (1 - s)) with s = sigmoid(gate).
template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                       T* __restrict__ dx, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = global_thread_index(); i < n; i += grid_stride()) {
    const int64_t gate_index = (i / cols) * 2 * cols + i % cols;
    const float gate = to_float(x[gate_index]);
    const float up = to_float(x[gate_index + cols]);
    const float g = to_float(dy[i]);
    const float s = sigmoid(gate);
    dx[gate_index] = from_float<T>(g * up * s * (1.f + gate * (1.f - s)));
    dx[gate_index + cols] = from_float<T>(g * gate * s);
  }
}

}  // namespace

cudaError_t bias_gelu_forward(DType dtype, const void* x, const void* bias, void* y, int64_t n,
                              int64_t cols, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    bias_gelu_forward_kernel<T><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(y), n, cols);
  });
}

cudaError_t bias_gelu_backward(DType dtype, const void* dy, const void* x, const void* bias,
                               void* dx, int64_t n, int64_t cols, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    bias_gelu_backward_kernel<T><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(bias),
        static_cast<T*>(dx), n, cols);
  });
}

cudaError_t swiglu_forward(DType dtype, const void* x, void* y, int64_t rows, int64_t cols,
                           cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T><<<elementwise_blocks(rows * cols), kElementwiseThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<T*>(y), rows, cols);
  });
}

cudaError_t swiglu_backward(DType dtype, const void* dy, const void* x, void* dx, int64_t rows,
                            int64_t cols, cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T><<<elementwise_blocks(rows * cols), kElementwiseThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx), rows, cols);
  });
}

}  // namespace megatron_lite
