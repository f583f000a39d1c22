// Rotary position embedding (rotate-half convention), forward and backward.
//
// Channel i < rot_dim / 2 pairs with i + rot_dim / 2:
//   out_i = t_i cos f_i - t_{i+h} sin f_i,   out_{i+h} = t_{i+h} cos f_{i+h} + t_i sin f_{i+h}.
// Backward is the transpose of that rotation; it reads sin at the partner channel,
// so it is exact whatever the layout of freqs (not only cat(f, f)).
#include <math.h>

#include "common.cuh"

namespace megatron_lite {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int64_t kMaxBlocks = 65536;

// One warp per (position, batch * head) row of head_dim channels; lanes stride over
// channels, so the position is one division per row, not per element.
template <typename T, bool kBackward>
__global__ void rotary_kernel(const T* __restrict__ in, const float* __restrict__ freqs,
                              T* __restrict__ out, int64_t seq, int64_t batch_heads,
                              int64_t head_dim, int64_t rot_dim) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t rows = seq * batch_heads;
  const int64_t half = rot_dim / 2;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  for (int64_t row = first_row; row < rows; row += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const T* in_row = in + row * head_dim;
    T* out_row = out + row * head_dim;
    const float* f = freqs + (row / batch_heads) * rot_dim;
    for (int64_t channel = lane; channel < head_dim; channel += kWarpSize) {
      if (channel >= rot_dim) {
        out_row[channel] = in_row[channel];
        continue;
      }
      const bool first_half = channel < half;
      const int64_t partner = first_half ? channel + half : channel - half;
      // Forward: rotate_half(t)_i = -t_{i+h} (first half) or t_{i-h} (second half),
      // times sin f_i. Backward: the transpose moves the sin to the partner channel
      // and flips the sign.
      const float sin_f = sinf(f[kBackward ? partner : channel]);
      const float sign = (first_half != kBackward) ? -1.f : 1.f;
      out_row[channel] = from_float<T>(to_float(in_row[channel]) * cosf(f[channel]) +
                                       sign * to_float(in_row[partner]) * sin_f);
    }
  }
}

template <bool kBackward>
cudaError_t launch_rotary(DType dtype, const void* in, const float* freqs, void* out,
                          int64_t seq, int64_t batch_heads, int64_t head_dim, int64_t rot_dim,
                          cudaStream_t stream) {
  const int64_t rows = seq * batch_heads;
  if (rows * head_dim == 0) return cudaSuccess;
  const int64_t blocks = ceil_div(rows, kWarpsPerBlock);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    rotary_kernel<T, kBackward><<<blocks < kMaxBlocks ? blocks : kMaxBlocks,
                                  kWarpsPerBlock * kWarpSize, 0, stream>>>(
        static_cast<const T*>(in), freqs, static_cast<T*>(out), seq, batch_heads, head_dim,
        rot_dim);
  });
}

}  // namespace

cudaError_t rotary_forward(DType dtype, const void* t, const float* freqs, void* out, int64_t seq,
                           int64_t batch_heads, int64_t head_dim, int64_t rot_dim,
                           cudaStream_t stream) {
  return launch_rotary<false>(dtype, t, freqs, out, seq, batch_heads, head_dim, rot_dim, stream);
}

cudaError_t rotary_backward(DType dtype, const void* dy, const float* freqs, void* dt, int64_t seq,
                            int64_t batch_heads, int64_t head_dim, int64_t rot_dim,
                            cudaStream_t stream) {
  return launch_rotary<true>(dtype, dy, freqs, dt, seq, batch_heads, head_dim, rot_dim, stream);
}

}  // namespace megatron_lite
