// reshape_and_cache: scatter this step's K/V rows into the paged cache, one block per token.
//
// A token's K (and V) row is num_kv_heads * head_dim contiguous elements in the cache, so the
// copy is a 16-byte vectorised gather from the (possibly strided: a slice of the fused QKV
// projection) inputs into one contiguous destination row.
#include "common.cuh"

namespace tidal {
namespace {

template <typename T, int VEC>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, int64_t key_stride_tok,
                                         int64_t key_stride_head, const T* __restrict__ value,
                                         int64_t value_stride_tok, int64_t value_stride_head,
                                         T* __restrict__ key_cache, T* __restrict__ value_cache,
                                         int64_t cache_stride_blk, int64_t cache_stride_tok,
                                         int64_t cache_stride_head,
                                         const int64_t* __restrict__ slot_mapping,
                                         int num_kv_heads, int head_dim, int block_size) {
  const int64_t tok = blockIdx.x;
  const int64_t slot = slot_mapping[tok];
  if (slot < 0) return;  // padding token
  const int64_t blk = slot / block_size;
  const int64_t off = slot - blk * block_size;
  const int64_t dst_base = blk * cache_stride_blk + off * cache_stride_tok;
  const int vec_per_head = head_dim / VEC;
  const int num_vec = num_kv_heads * vec_per_head;
  for (int i = threadIdx.x; i < num_vec; i += blockDim.x) {
    const int head = i / vec_per_head;
    const int d = (i - head * vec_per_head) * VEC;
    const int64_t dst = dst_base + head * cache_stride_head + d;
    store_vec<T, VEC>(key_cache + dst,
                      load_vec<T, VEC>(key + tok * key_stride_tok + head * key_stride_head + d));
    store_vec<T, VEC>(value_cache + dst, load_vec<T, VEC>(value + tok * value_stride_tok +
                                                          head * value_stride_head + d));
  }
}

}  // namespace

cudaError_t launch_reshape_and_cache(DType dtype, const void* key, int64_t key_stride_tok,
                                     int64_t key_stride_head, const void* value,
                                     int64_t value_stride_tok, int64_t value_stride_head,
                                     void* key_cache, void* value_cache, int64_t cache_stride_blk,
                                     int64_t cache_stride_tok, int64_t cache_stride_head,
                                     const int64_t* slot_mapping, int num_tokens, int num_kv_heads,
                                     int head_dim, int block_size, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  TIDAL_DISPATCH_FLOATING(dtype, {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const bool vec_ok = head_dim % kVec == 0 && is_aligned16(key) && is_aligned16(value) &&
                        is_aligned16(key_cache) && is_aligned16(value_cache) &&
                        key_stride_tok % kVec == 0 && key_stride_head % kVec == 0 &&
                        value_stride_tok % kVec == 0 && value_stride_head % kVec == 0 &&
                        cache_stride_blk % kVec == 0 && cache_stride_tok % kVec == 0 &&
                        cache_stride_head % kVec == 0;
    const int vec = vec_ok ? kVec : 1;
    const int threads = std::min(512, std::max(32, ceil_div(num_kv_heads * head_dim / vec, 32) * 32));
    const auto* k = static_cast<const scalar_t*>(key);
    const auto* v = static_cast<const scalar_t*>(value);
    auto* kc = static_cast<scalar_t*>(key_cache);
    auto* vc = static_cast<scalar_t*>(value_cache);
    if (vec_ok) {
      reshape_and_cache_kernel<scalar_t, kVec><<<num_tokens, threads, 0, stream>>>(
          k, key_stride_tok, key_stride_head, v, value_stride_tok, value_stride_head, kc, vc,
          cache_stride_blk, cache_stride_tok, cache_stride_head, slot_mapping, num_kv_heads,
          head_dim, block_size);
    } else {
      reshape_and_cache_kernel<scalar_t, 1><<<num_tokens, threads, 0, stream>>>(
          k, key_stride_tok, key_stride_head, v, value_stride_tok, value_stride_head, kc, vc,
          cache_stride_blk, cache_stride_tok, cache_stride_head, slot_mapping, num_kv_heads,
          head_dim, block_size);
    }
  });
  return cudaGetLastError();
}

}  // namespace tidal
