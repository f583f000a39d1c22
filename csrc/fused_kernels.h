// Launchers for megatron_lite's fused CUDA kernels.
//
// This header is the seam between the kernels (.cu files, compiled by nvcc with CUDA
// headers only, so each compiles in seconds) and the PyTorch bindings (bindings.cpp,
// the only file that includes torch/extension.h). Tensors cross it as raw pointers
// plus sizes; every launcher returns the launch's cudaError_t.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace megatron_lite {

// Element type of the activation tensors; parameters of the norms are always float32.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// LayerNorm (rms == false) or RMSNorm (rms == true) over rows of `cols` elements.
// Writes y, and per row the mean (LayerNorm only) and 1/std that backward reuses.
// bias may be null.
cudaError_t norm_forward(DType dtype, const void* x, const float* weight, const float* bias,
                         void* y, float* mean, float* rstd, int64_t rows, int64_t cols,
                         float eps, bool rms, cudaStream_t stream);

// Writes dx and the float32 partial sums of dweight/dbias, one row per row chunk:
// partial_weight/partial_bias are [num_chunks, cols] with num_chunks from
// norm_backward_num_chunks(rows); partial_bias may be null. norm_reduce_partials
// then sums those rows into dweight/dbias (deterministic: no atomics).
int64_t norm_backward_num_chunks(int64_t rows);
cudaError_t norm_backward(DType dtype, const void* dy, const void* x, const float* weight,
                          const float* mean, const float* rstd, void* dx, float* partial_weight,
                          float* partial_bias, int64_t rows, int64_t cols, bool rms,
                          cudaStream_t stream);
cudaError_t norm_reduce_partials(const float* partial, float* out, int64_t num_chunks,
                                 int64_t cols, cudaStream_t stream);

// Softmax of x * scale over rows of sk elements; rows = batch * heads * sq.
// causal: key j is masked for query q when j > q + sk - sq.
// Otherwise mask (may be null) is bool with mask[b * mask_strides[0] + h * mask_strides[1]
// + q * mask_strides[2] + j] != 0 meaning masked; a zero stride broadcasts that dim.
// Fully masked rows become zeros.
cudaError_t softmax_forward(DType dtype, const void* x, const bool* mask, void* y, int64_t rows,
                            int64_t heads, int64_t sq, int64_t sk, const int64_t mask_strides[3],
                            float scale, bool causal, cudaStream_t stream);
// dx = scale * y * (dy - sum(dy * y)) per row; masked positions have y == 0.
cudaError_t softmax_backward(DType dtype, const void* dy, const void* y, void* dx, int64_t rows,
                             int64_t sk, float scale, cudaStream_t stream);

// y = gelu_tanh(x + bias) elementwise, bias [cols] broadcast over rows (may be null).
cudaError_t bias_gelu_forward(DType dtype, const void* x, const void* bias, void* y, int64_t n,
                              int64_t cols, cudaStream_t stream);
cudaError_t bias_gelu_backward(DType dtype, const void* dy, const void* x, const void* bias,
                               void* dx, int64_t n, int64_t cols, cudaStream_t stream);

// x is [rows, 2 * cols] = [gate, up]; y [rows, cols] = silu(gate) * up.
cudaError_t swiglu_forward(DType dtype, const void* x, void* y, int64_t rows, int64_t cols,
                           cudaStream_t stream);
cudaError_t swiglu_backward(DType dtype, const void* dy, const void* x, void* dx, int64_t rows,
                            int64_t cols, cudaStream_t stream);

// out = residual + keep * (x + bias) / keep_prob, keep drawn from Philox keyed by *seed
// (a device scalar, so drawing it from PyTorch's generator needs no host sync; it may
// be null when keep_prob >= 1, which draws nothing).
// Backward regenerates the same keep mask from the seed instead of storing it.
cudaError_t bias_dropout_add_forward(DType dtype, const void* x, const void* bias,
                                     const void* residual, void* out, const int64_t* seed,
                                     float keep_prob, int64_t n, int64_t cols,
                                     cudaStream_t stream);
cudaError_t dropout_backward(DType dtype, const void* dy, void* dx, const int64_t* seed,
                             float keep_prob, int64_t n, cudaStream_t stream);

// t [seq, batch * heads, head_dim]; freqs [seq, rot_dim] float32 angles (cat(f, f)).
// The first rot_dim channels rotate (rotate-half convention), the rest pass through.
cudaError_t rotary_forward(DType dtype, const void* t, const float* freqs, void* out, int64_t seq,
                           int64_t batch_heads, int64_t head_dim, int64_t rot_dim,
                           cudaStream_t stream);
cudaError_t rotary_backward(DType dtype, const void* dy, const float* freqs, void* dt, int64_t seq,
                            int64_t batch_heads, int64_t head_dim, int64_t rot_dim,
                            cudaStream_t stream);

}  // namespace megatron_lite
