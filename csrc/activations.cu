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

// The elementwise kernels below index rows and columns on a 2-D grid: blockIdx.x
// and the threads cover columns, blockIdx.y strides over rows. No integer division
// per element (64-bit division costs more than the memory traffic here).
template <typename T>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                         T* __restrict__ y, int64_t rows, int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const float b = bias != nullptr ? to_float(bias[col]) : 0.f;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t i = row * cols + col;
    y[i] = from_float<T>(gelu_tanh(to_float(x[i]) + b));
  }
}

template <typename T>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                          const T* __restrict__ bias, T* __restrict__ dx,
                                          int64_t rows, int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const float b = bias != nullptr ? to_float(bias[col]) : 0.f;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t i = row * cols + col;
    dx[i] = from_float<T>(to_float(dy[i]) * gelu_tanh_grad(to_float(x[i]) + b));
  }
}

__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

// Output element (row, col) reads gate x[row, col] and up x[row, cols + col].
template <typename T>
__global__ void swiglu_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows,
                                      int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const float gate = to_float(x[row * 2 * cols + col]);
    const float up = to_float(x[row * 2 * cols + cols + col]);
    y[row * cols + col] = from_float<T>(gate * sigmoid(gate) * up);
  }
}

// d/dgate silu(gate) = s (1 + gate (1 - s)) with s = sigmoid(gate).
template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                       T* __restrict__ dx, int64_t rows, int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t gate_index = row * 2 * cols + col;
    const float gate = to_float(x[gate_index]);
    const float up = to_float(x[gate_index + cols]);
    const float g = to_float(dy[row * cols + col]);
    const float s = sigmoid(gate);
    dx[gate_index] = from_float<T>(g * up * s * (1.f + gate * (1.f - s)));
    dx[gate_index + cols] = from_float<T>(g * gate * s);
  }
}

constexpr int kThreads = 256;
constexpr int64_t kMaxRowBlocks = 65535;  // grid.y limit

dim3 rows_cols_grid(int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>(ceil_div(cols, kThreads)),
              static_cast<unsigned>(rows < kMaxRowBlocks ? rows : kMaxRowBlocks));
}

}  // namespace

cudaError_t bias_gelu_forward(DType dtype, const void* x, const void* bias, void* y, int64_t n,
                              int64_t cols, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t rows = n / cols;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    bias_gelu_forward_kernel<T><<<rows_cols_grid(rows, cols), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(y), rows, cols);
  });
}

cudaError_t bias_gelu_backward(DType dtype, const void* dy, const void* x, const void* bias,
                               void* dx, int64_t n, int64_t cols, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t rows = n / cols;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    bias_gelu_backward_kernel<T><<<rows_cols_grid(rows, cols), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(bias),
        static_cast<T*>(dx), rows, cols);
  });
}

cudaError_t swiglu_forward(DType dtype, const void* x, void* y, int64_t rows, int64_t cols,
                           cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T><<<rows_cols_grid(rows, cols), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<T*>(y), rows, cols);
  });
}

cudaError_t swiglu_backward(DType dtype, const void* dy, const void* x, void* dx, int64_t rows,
                            int64_t cols, cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T><<<rows_cols_grid(rows, cols), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx), rows, cols);
  });
}

}  // namespace megatron_lite
