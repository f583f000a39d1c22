// Scaled masked softmax and scaled causal ("upper triangular") masked softmax.
//
// One warp per row, any row length: the first pass keeps a running max and a sum of
// exponentials rescaled to it (the online softmax), so x is read twice, not three
// times. Masked keys are skipped; a row with no key left is written as zeros.
#include <math.h>

#include "common.cuh"

namespace megatron_lite {
namespace {

constexpr int kWarpsPerBlock = 4;

// Folds (max_b, sum_b) into (max_a, sum_a), both sums taken relative to their max.
__device__ __forceinline__ void merge_max_sum(float& max_a, float& sum_a, float max_b,
                                              float sum_b) {
  const float new_max = fmaxf(max_a, max_b);
  if (new_max == -INFINITY) return;  // both empty; avoids exp(-inf - -inf) = NaN
  sum_a = sum_a * expf(max_a - new_max) + sum_b * expf(max_b - new_max);
  max_a = new_max;
}

template <typename T, bool kCausal>
__global__ void softmax_forward_kernel(const T* __restrict__ x, const bool* __restrict__ mask,
                                       T* __restrict__ y, int64_t rows, int64_t heads,
                                       int64_t sq, int64_t sk, int64_t mask_batch_stride,
                                       int64_t mask_head_stride, int64_t mask_query_stride,
                                       float scale) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  const T* xr = x + row * sk;
  T* yr = y + row * sk;
  const int64_t q = row % sq;

  // Keys [0, limit) may take part; beyond limit everything is masked.
  int64_t limit = sk;
  const bool* mask_row = nullptr;
  if (kCausal) {
    limit = min(sk, q + sk - sq + 1);
  } else if (mask != nullptr) {
    const int64_t batch_head = row / sq;
    mask_row = mask + (batch_head / heads) * mask_batch_stride +
               (batch_head % heads) * mask_head_stride + q * mask_query_stride;
  }
  auto masked = [&](int64_t j) { return j >= limit || (mask_row != nullptr && mask_row[j]); };

  float row_max = -INFINITY;
  float row_sum = 0.f;
  for (int64_t j = lane; j < limit; j += kWarpSize) {
    if (masked(j)) continue;
    merge_max_sum(row_max, row_sum, to_float(xr[j]) * scale, 1.f);
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float other_max = __shfl_xor_sync(kFullMask, row_max, offset);
    const float other_sum = __shfl_xor_sync(kFullMask, row_sum, offset);
    merge_max_sum(row_max, row_sum, other_max, other_sum);
  }

  const float inv_sum = row_sum > 0.f ? 1.f / row_sum : 0.f;
  for (int64_t j = lane; j < sk; j += kWarpSize) {
    const float p = masked(j) ? 0.f : expf(to_float(xr[j]) * scale - row_max) * inv_sum;
    yr[j] = from_float<T>(p);
  }
}

template <typename T>
__global__ void softmax_backward_kernel(const T* __restrict__ dy, const T* __restrict__ y,
                                        T* __restrict__ dx, int64_t rows, int64_t sk,
                                        float scale) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  const T* dyr = dy + row * sk;
  const T* yr = y + row * sk;
  float dot = 0.f;
  for (int64_t j = lane; j < sk; j += kWarpSize) dot += to_float(dyr[j]) * to_float(yr[j]);
  dot = warp_sum(dot);
  T* dxr = dx + row * sk;
  for (int64_t j = lane; j < sk; j += kWarpSize) {
    dxr[j] = from_float<T>(scale * to_float(yr[j]) * (to_float(dyr[j]) - dot));
  }
}

}  // namespace

cudaError_t softmax_forward(DType dtype, const void* x, const bool* mask, void* y, int64_t rows,
                            int64_t heads, int64_t sq, int64_t sk, const int64_t mask_strides[3],
                            float scale, bool causal, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = ceil_div(rows, kWarpsPerBlock);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto kernel = causal ? softmax_forward_kernel<T, true> : softmax_forward_kernel<T, false>;
    kernel<<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(
        static_cast<const T*>(x), mask, static_cast<T*>(y), rows, heads, sq, sk,
        mask_strides[0], mask_strides[1], mask_strides[2], scale);
  });
}

cudaError_t softmax_backward(DType dtype, const void* dy, const void* y, void* dx, int64_t rows,
                             int64_t sk, float scale, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = ceil_div(rows, kWarpsPerBlock);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    softmax_backward_kernel<T><<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(y), static_cast<T*>(dx), rows, sk,
        scale);
  });
}

}  // namespace megatron_lite
