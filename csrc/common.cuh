// Device helpers shared by the kernels: float conversion per dtype, warp and block
// reductions, and a dtype switch for the launchers. CUDA headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fused_kernels.h"

namespace megatron_lite {

// Every kernel computes in float32 and converts at load and store.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

// Sum over the block, returned to every thread. blockDim.x must be a multiple of 32.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_totals[kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  v = warp_sum(v);
  __syncthreads();  // a previous call's readers are done with warp_totals
  if (lane == 0) warp_totals[warp] = v;
  __syncthreads();
  const int num_warps = blockDim.x / kWarpSize;
  return warp_sum(lane < num_warps ? warp_totals[lane] : 0.f);
}

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Calls launch(T{}) with T the element type named by dtype, then reports the launch.
template <typename Launch>
cudaError_t dispatch_dtype(DType dtype, Launch launch) {
  switch (dtype) {
    case DType::kFloat32:
      launch(float{});
      break;
    case DType::kFloat16:
      launch(__half{});
      break;
    case DType::kBFloat16:
      launch(__nv_bfloat16{});
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace megatron_lite
