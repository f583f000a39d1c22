// residual + dropout(x + bias), forward, and the dropout's backward.
//
// The keep mask is never stored: element i's uniform number is a pure function of
// (seed, i) through Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy
// as 1, 2, 3", SC 2011), a counter-based generator, so backward recomputes the same
// mask. Each thread works on groups of four consecutive elements, one Philox call each.
#include "common.cuh"

namespace megatron_lite {
namespace {

constexpr int64_t kGroup = 4;
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;  // grid-stride loops cover the rest

unsigned blocks_for(int64_t groups) {
  const int64_t blocks = ceil_div(groups, kThreads);
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

__device__ __forceinline__ int64_t global_thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Philox4x32-10: ten rounds of two 32x32->64 multiplies, key bumped by Weyl constants.
__device__ __forceinline__ uint4 philox4x32_10(uint4 counter, uint2 key) {
  constexpr unsigned kMul0 = 0xD2511F53u;
  constexpr unsigned kMul1 = 0xCD9E8D57u;
  constexpr unsigned kWeyl0 = 0x9E3779B9u;
  constexpr unsigned kWeyl1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const unsigned hi0 = __umulhi(kMul0, counter.x);
    const unsigned lo0 = kMul0 * counter.x;
    const unsigned hi1 = __umulhi(kMul1, counter.z);
    const unsigned lo1 = kMul1 * counter.z;
    counter = make_uint4(hi1 ^ counter.y ^ key.x, lo1, hi0 ^ counter.w ^ key.y, lo0);
    key.x += kWeyl0;
    key.y += kWeyl1;
  }
  return counter;
}

// Uniform in [0, 1) from the top 24 bits, exactly representable in float32.
__device__ __forceinline__ float to_unit(unsigned bits) { return (bits >> 8) * (1.f / 16777216.f); }

__device__ __forceinline__ float4 uniforms(unsigned long long seed, int64_t group) {
  const unsigned long long g = static_cast<unsigned long long>(group);
  const uint4 bits = philox4x32_10(make_uint4(static_cast<unsigned>(g), static_cast<unsigned>(g >> 32), 0u, 0u),
                                   make_uint2(static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32)));
  return make_float4(to_unit(bits.x), to_unit(bits.y), to_unit(bits.z), to_unit(bits.w));
}

template <typename T>
__global__ void bias_dropout_add_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                        const T* __restrict__ residual, T* __restrict__ out,
                                        const int64_t* __restrict__ seed, float keep_prob,
                                        int64_t n, int64_t cols) {
  const bool dropout = keep_prob < 1.f;
  const float inv_keep = keep_prob > 0.f ? 1.f / keep_prob : 0.f;
  const unsigned long long key = dropout ? static_cast<unsigned long long>(*seed) : 0ull;
  const int64_t groups = ceil_div(n, kGroup);
  for (int64_t g = global_thread_index(); g < groups; g += grid_stride()) {
    const float4 u = dropout ? uniforms(key, g) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float draws[kGroup] = {u.x, u.y, u.z, u.w};
    // One division per group; the bias column then advances with the element.
    int64_t col = bias != nullptr ? (g * kGroup) % cols : 0;
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      const int64_t i = g * kGroup + k;
      if (i >= n) break;
      float v = to_float(x[i]);
      if (bias != nullptr) {
        v += to_float(bias[col]);
        col = col + 1 == cols ? 0 : col + 1;
      }
      if (dropout) v = draws[k] < keep_prob ? v * inv_keep : 0.f;
      out[i] = from_float<T>(to_float(residual[i]) + v);
    }
  }
}

template <typename T>
__global__ void dropout_backward_kernel(const T* __restrict__ dy, T* __restrict__ dx,
                                        const int64_t* __restrict__ seed, float keep_prob,
                                        int64_t n) {
  const bool dropout = keep_prob < 1.f;
  const float inv_keep = keep_prob > 0.f ? 1.f / keep_prob : 0.f;
  const unsigned long long key = dropout ? static_cast<unsigned long long>(*seed) : 0ull;
  const int64_t groups = ceil_div(n, kGroup);
  for (int64_t g = global_thread_index(); g < groups; g += grid_stride()) {
    const float4 u = dropout ? uniforms(key, g) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float draws[kGroup] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      const int64_t i = g * kGroup + k;
      if (i >= n) break;
      float v = to_float(dy[i]);
      if (dropout) v = draws[k] < keep_prob ? v * inv_keep : 0.f;
      dx[i] = from_float<T>(v);
    }
  }
}

}  // namespace

cudaError_t bias_dropout_add_forward(DType dtype, const void* x, const void* bias,
                                     const void* residual, void* out, const int64_t* seed,
                                     float keep_prob, int64_t n, int64_t cols,
                                     cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    bias_dropout_add_kernel<T>
        <<<blocks_for(ceil_div(n, kGroup)), kThreads, 0, stream>>>(
            static_cast<const T*>(x), static_cast<const T*>(bias),
            static_cast<const T*>(residual), static_cast<T*>(out), seed, keep_prob, n, cols);
  });
}

cudaError_t dropout_backward(DType dtype, const void* dy, void* dx, const int64_t* seed,
                             float keep_prob, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dropout_backward_kernel<T>
        <<<blocks_for(ceil_div(n, kGroup)), kThreads, 0, stream>>>(
            static_cast<const T*>(dy), static_cast<T*>(dx), seed, keep_prob, n);
  });
}

}  // namespace megatron_lite
