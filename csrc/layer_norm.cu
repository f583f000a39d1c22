// LayerNorm and RMSNorm, forward and backward, float32 accumulation.
//
// Forward and the input gradient run one block per row. The weight and bias
// gradients are column sums over all rows: a second kernel sums chunks of rows per
// column tile into float32 partials and a third adds the partials up, so the result
// is deterministic (no atomics) for any row count.
#include "common.cuh"

namespace megatron_lite {
namespace {

// Threads per row: about 8 elements per thread, a whole number of warps.
int row_threads(int64_t cols) {
  int64_t threads = ceil_div(ceil_div(cols, 8), kWarpSize) * kWarpSize;
  return static_cast<int>(threads < 1024 ? threads : 1024);
}

template <typename T, bool kRms>
__global__ void norm_forward_kernel(const T* __restrict__ x, const float* __restrict__ weight,
                                    const float* __restrict__ bias, T* __restrict__ y,
                                    float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                    int64_t cols, float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  T* yr = y + row * cols;

  float mean = 0.f;
  if (!kRms) {
    float sum = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += to_float(xr[c]);
    mean = block_sum(sum) / cols;
  }
  // Second pass over the centred values: more accurate than E[x^2] - E[x]^2.
  float sum_sq = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = to_float(xr[c]) - mean;
    sum_sq += d * d;
  }
  const float rstd = rsqrtf(block_sum(sum_sq) / cols + eps);

  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = (to_float(xr[c]) - mean) * rstd * weight[c];
    if (bias != nullptr) v += bias[c];
    yr[c] = from_float<T>(v);
  }
  if (threadIdx.x == 0) {
    if (!kRms) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * weight;
// RMSNorm has no centring, so its mean(g) term is absent.
template <typename T, bool kRms>
__global__ void norm_backward_input_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                           const float* __restrict__ weight,
                                           const float* __restrict__ mean_in,
                                           const float* __restrict__ rstd_in, T* __restrict__ dx,
                                           int64_t cols) {
  const int64_t row = blockIdx.x;
  const T* dyr = dy + row * cols;
  const T* xr = x + row * cols;
  const float mean = kRms ? 0.f : mean_in[row];
  const float rstd = rstd_in[row];

  float sum_g = 0.f;
  float sum_g_xhat = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = to_float(dyr[c]) * weight[c];
    sum_g += g;
    sum_g_xhat += g * (to_float(xr[c]) - mean) * rstd;
  }
  const float mean_g = kRms ? 0.f : block_sum(sum_g) / cols;
  const float mean_g_xhat = block_sum(sum_g_xhat) / cols;

  T* dxr = dx + row * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = to_float(dyr[c]) * weight[c];
    const float xhat = (to_float(xr[c]) - mean) * rstd;
    dxr[c] = from_float<T>(rstd * (g - mean_g - xhat * mean_g_xhat));
  }
}

constexpr int kTileCols = 32;
constexpr int kTileRows = 8;
constexpr int64_t kRowsPerChunk = 64;
constexpr int64_t kMaxChunks = 256;

// Block (32, 8) sums dy * xhat and dy over one chunk of rows for 32 columns; a warp
// reads 32 consecutive columns of a row, so loads are coalesced.
template <typename T, bool kRms>
__global__ void norm_backward_params_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                            const float* __restrict__ mean_in,
                                            const float* __restrict__ rstd_in,
                                            float* __restrict__ partial_weight,
                                            float* __restrict__ partial_bias, int64_t rows,
                                            int64_t cols, int64_t rows_per_chunk) {
  __shared__ float tile_w[kTileRows][kTileCols + 1];
  __shared__ float tile_b[kTileRows][kTileCols + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTileCols + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t row_end = min(rows, (chunk + 1) * rows_per_chunk);

  float acc_w = 0.f;
  float acc_b = 0.f;
  if (col < cols) {
    for (int64_t r = chunk * rows_per_chunk + threadIdx.y; r < row_end; r += kTileRows) {
      const float mean = kRms ? 0.f : mean_in[r];
      const float g = to_float(dy[r * cols + col]);
      acc_w += g * (to_float(x[r * cols + col]) - mean) * rstd_in[r];
      acc_b += g;
    }
  }
  tile_w[threadIdx.y][threadIdx.x] = acc_w;
  tile_b[threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float sum_w = 0.f;
    float sum_b = 0.f;
    for (int i = 0; i < kTileRows; ++i) {
      sum_w += tile_w[i][threadIdx.x];
      sum_b += tile_b[i][threadIdx.x];
    }
    partial_weight[chunk * cols + col] = sum_w;
    if (partial_bias != nullptr) partial_bias[chunk * cols + col] = sum_b;
  }
}

__global__ void reduce_partials_kernel(const float* __restrict__ partial, float* __restrict__ out,
                                       int64_t num_chunks, int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float sum = 0.f;
  for (int64_t k = 0; k < num_chunks; ++k) sum += partial[k * cols + col];
  out[col] = sum;
}

}  // namespace

cudaError_t norm_forward(DType dtype, const void* x, const float* weight, const float* bias,
                         void* y, float* mean, float* rstd, int64_t rows, int64_t cols,
                         float eps, bool rms, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto kernel = rms ? norm_forward_kernel<T, true> : norm_forward_kernel<T, false>;
    kernel<<<rows, row_threads(cols), 0, stream>>>(static_cast<const T*>(x), weight, bias,
                                                  static_cast<T*>(y), mean, rstd, cols, eps);
  });
}

int64_t norm_backward_num_chunks(int64_t rows) {
  const int64_t chunks = ceil_div(rows, kRowsPerChunk);
  return chunks < 1 ? 1 : (chunks > kMaxChunks ? kMaxChunks : chunks);
}

cudaError_t norm_backward(DType dtype, const void* dy, const void* x, const float* weight,
                          const float* mean, const float* rstd, void* dx, float* partial_weight,
                          float* partial_bias, int64_t rows, int64_t cols, bool rms,
                          cudaStream_t stream) {
  const int64_t num_chunks = norm_backward_num_chunks(rows);
  const int64_t rows_per_chunk = ceil_div(rows, num_chunks);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* dy_t = static_cast<const T*>(dy);
    const T* x_t = static_cast<const T*>(x);
    if (rows > 0) {
      auto input_kernel =
          rms ? norm_backward_input_kernel<T, true> : norm_backward_input_kernel<T, false>;
      input_kernel<<<rows, row_threads(cols), 0, stream>>>(dy_t, x_t, weight, mean, rstd,
                                                          static_cast<T*>(dx), cols);
    }
    auto params_kernel =
        rms ? norm_backward_params_kernel<T, true> : norm_backward_params_kernel<T, false>;
    const dim3 grid(static_cast<unsigned>(ceil_div(cols, kTileCols)),
                    static_cast<unsigned>(num_chunks));
    params_kernel<<<grid, dim3(kTileCols, kTileRows), 0, stream>>>(
        dy_t, x_t, mean, rstd, partial_weight, partial_bias, rows, cols, rows_per_chunk);
  });
}

cudaError_t norm_reduce_partials(const float* partial, float* out, int64_t num_chunks,
                                 int64_t cols, cudaStream_t stream) {
  constexpr int kThreads = 256;
  reduce_partials_kernel<<<ceil_div(cols, kThreads), kThreads, 0, stream>>>(partial, out,
                                                                          num_chunks, cols);
  return cudaGetLastError();
}

}  // namespace megatron_lite
