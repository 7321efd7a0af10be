// Host-side entry points of tidal's CUDA kernels, in plain C++ types (no torch), so that the .cu
// files stay free of torch headers and bindings.cpp is the one place that knows about tensors.
// Every launcher enqueues on `stream` and returns the launch status (cudaSuccess or the error).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tidal {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// out[r] = rms_norm(x[r]) * weight, or with `residual_in` given: s = x[r] + residual_in[r],
// residual_out[r] = s, out[r] = rms_norm(s) * weight. Rows have `hidden` contiguous elements.
cudaError_t launch_rms_norm(DType dtype, void* out, int64_t out_stride, const void* x,
                            int64_t x_stride, const void* residual_in, int64_t residual_in_stride,
                            void* residual_out, int64_t residual_out_stride, const void* weight,
                            int64_t num_rows, int hidden, float eps, cudaStream_t stream);

// out[r, :d] = silu(x[r, :d]) * x[r, d:2d].
cudaError_t launch_silu_and_mul(DType dtype, void* out, int64_t out_stride, const void* x,
                                int64_t x_stride, int64_t num_rows, int d, cudaStream_t stream);

// Rotates the first rot_dim channels of every head of q and k by cos_sin_cache[positions[t]]
// (float32, cos half then sin half) and copies the rest; results go to q_out/k_out.
cudaError_t launch_rotary_embedding(DType dtype, void* q_out, int64_t q_out_stride_tok,
                                    int64_t q_out_stride_head, void* k_out,
                                    int64_t k_out_stride_tok, int64_t k_out_stride_head,
                                    const void* q, int64_t q_stride_tok, int64_t q_stride_head,
                                    const void* k, int64_t k_stride_tok, int64_t k_stride_head,
                                    const int64_t* positions, const float* cos_sin_cache,
                                    int64_t cache_stride, int num_tokens, int num_heads,
                                    int num_kv_heads, int head_dim, int rot_dim, bool is_neox,
                                    cudaStream_t stream);

// Scatters key/value rows [num_tokens, num_kv_heads, head_dim] into the paged caches
// [num_blocks, block_size, num_kv_heads, head_dim]; slots < 0 are skipped.
cudaError_t launch_reshape_and_cache(DType dtype, const void* key, int64_t key_stride_tok,
                                     int64_t key_stride_head, const void* value,
                                     int64_t value_stride_tok, int64_t value_stride_head,
                                     void* key_cache, void* value_cache, int64_t cache_stride_blk,
                                     int64_t cache_stride_tok, int64_t cache_stride_head,
                                     const int64_t* slot_mapping, int num_tokens, int num_kv_heads,
                                     int head_dim, int block_size, cudaStream_t stream);

struct PagedDecodeArgs {
  DType dtype;
  void* out;  // [num_tokens, num_heads, head_dim]
  int64_t out_stride_tok, out_stride_head;
  const void* query;
  int64_t q_stride_tok, q_stride_head;
  const void* key_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;
  int64_t kv_stride_blk, kv_stride_tok, kv_stride_head;  // shared by K and V
  const int32_t* block_table;  // [num_seqs, max_blocks]
  int64_t block_table_stride;
  const int32_t* seq_lens;         // [num_seqs]
  const int32_t* query_start_loc;  // [num_seqs + 1]; rows with a query length != 1 are skipped
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  int num_splits;  // > 1: partial results go to the buffers below, then the reduce kernel runs
  float* partial_out;  // [num_tokens, num_heads, num_splits, head_dim]
  float* partial_max;  // [num_tokens, num_heads, num_splits] (log2 domain)
  float* partial_sum;  // [num_tokens, num_heads, num_splits]
};

// Flash-decoding over the paged cache: grid (kv heads, seqs, splits), every query head of a KV
// group in one block, each split walking its share of the context in chunks with an online
// softmax; with num_splits > 1 a second kernel merges the splits.
cudaError_t launch_paged_attention_decode(const PagedDecodeArgs& args, cudaStream_t stream);

// Whether launch_paged_attention_decode has a kernel for this shape.
bool paged_attention_decode_supported(DType dtype, int head_dim, int queries_per_kv);

// Weight formats of the few-row product (skinny_gemm.cu).
enum class SkinnyFormat : int { kW16 = 0, kFp8 = 1, kInt4 = 2, kFp8Groups = 3 };

struct SkinnyGemmArgs {
  SkinnyFormat format;
  const void* x;  // [m, k] in the activation dtype, rows x_stride elements apart
  int64_t x_stride;
  int m;          // 1 .. 8
  const void* w;  // weight rows w_stride bytes apart: [rows, k] 16-bit or e4m3, [rows, k / 8] int32
  int64_t w_stride;
  int64_t n;  // outputs per row (a gated weight has 2 n rows: [gate; up])
  int64_t k;
  void* out;  // [m, n] in the activation dtype
  int64_t out_stride;
  const void* bias;        // [n] in the activation dtype, or null (not with act)
  const float* w_scale;    // FP8: float32 [rows]
  const void* scales;      // INT4: [rows, groups] in the activation dtype; FP8 groups: float32
  const uint8_t* zeros;    // INT4: [rows, groups]
  int64_t group_stride;    // INT4, FP8 groups: the scales' (and zeros') row stride (elements)
  int group_shift;         // the group of input k is k >> group_shift (INT4 5 .. 30: groups
                           // are powers of two from 32; FP8 groups from 64; 30 for one group
                           // over all of K)
  int act;                 // 0: none; 1: SiLU(gate) * up; 2: tanh-GELU(gate) * up
  int pdl;                 // 1: launch as a programmatic dependent (compute capability >= 9)
};

// out = x @ w.T (weight-only dequantization in registers, float32 sums) on mma tensor cores:
// blocks of `tiles` x 8 weight rows, `warps` warps splitting K, `unroll` 16-byte loads in
// flight per tile and lane. cudaErrorInvalidValue for shapes it does not take (k not a
// multiple of the format's chunk, n not a multiple of 8, m outside 1..8), and
// cudaErrorInvalidConfiguration for a launch shape it was not built with.
cudaError_t launch_skinny_gemm(DType dtype, const SkinnyGemmArgs& args, int tiles, int warps,
                               int unroll, cudaStream_t stream);

}  // namespace tidal
