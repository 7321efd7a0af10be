// Rotary position embedding for query and key in one launch, one block per token.
//
// cos_sin_cache is float32 [max_position, rot_dim]: cos in the first half, sin in the second.
// Neox layout pairs channel i with i + rot_dim/2 (HF rotate_half); GPT-J pairs 2i with 2i+1.
// Channels past rot_dim are copied unchanged. The rotation is computed in float32 and rounded
// once, which is within one rounding step of torch_ops' half-precision arithmetic.
#include "common.cuh"

namespace tidal {
namespace {

// P rotation pairs per thread. With P = 8 / sizeof(T) the neox halves move as 8-byte vectors and
// the GPT-J interleaved pairs as 16-byte vectors; P = 1 is the scalar path for odd layouts.
template <typename T, bool IS_NEOX, int P>
__device__ __forceinline__ void rotate_heads(T* __restrict__ out, int64_t out_stride_head,
                                             const T* __restrict__ in, int64_t in_stride_head,
                                             const float* __restrict__ cos_ptr,
                                             const float* __restrict__ sin_ptr, int num_heads,
                                             int head_dim, int rot_half) {
  const int groups = rot_half / P;
  for (int i = threadIdx.x; i < num_heads * groups; i += blockDim.x) {
    const int head = i / groups;
    const int j = (i - head * groups) * P;
    const T* src = in + head * in_stride_head;
    T* dst = out + head * out_stride_head;
    const VecN<float, P> c = load_vec<float, P>(cos_ptr + j);
    const VecN<float, P> s = load_vec<float, P>(sin_ptr + j);
    if constexpr (IS_NEOX) {
      const VecN<T, P> xv = load_vec<T, P>(src + j);
      const VecN<T, P> yv = load_vec<T, P>(src + j + rot_half);
      VecN<T, P> xo, yo;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const float x = to_float(xv.v[k]);
        const float y = to_float(yv.v[k]);
        xo.v[k] = from_float<T>(x * c.v[k] - y * s.v[k]);
        yo.v[k] = from_float<T>(y * c.v[k] + x * s.v[k]);
      }
      store_vec<T, P>(dst + j, xo);
      store_vec<T, P>(dst + j + rot_half, yo);
    } else {
      const VecN<T, 2 * P> xy = load_vec<T, 2 * P>(src + 2 * j);
      VecN<T, 2 * P> o;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const float x = to_float(xy.v[2 * k]);
        const float y = to_float(xy.v[2 * k + 1]);
        o.v[2 * k] = from_float<T>(x * c.v[k] - y * s.v[k]);
        o.v[2 * k + 1] = from_float<T>(y * c.v[k] + x * s.v[k]);
      }
      store_vec<T, 2 * P>(dst + 2 * j, o);
    }
  }
  const int rot_dim = 2 * rot_half;
  const int pass = head_dim - rot_dim;
  if (pass > 0) {
    for (int i = threadIdx.x; i < num_heads * pass; i += blockDim.x) {
      const int head = i / pass;
      const int d = rot_dim + (i - head * pass);
      out[head * out_stride_head + d] = in[head * in_stride_head + d];
    }
  }
}

template <typename T, bool IS_NEOX, int P>
__global__ void rotary_kernel(T* __restrict__ q_out, int64_t q_out_stride_tok,
                              int64_t q_out_stride_head, T* __restrict__ k_out,
                              int64_t k_out_stride_tok, int64_t k_out_stride_head,
                              const T* __restrict__ q, int64_t q_stride_tok, int64_t q_stride_head,
                              const T* __restrict__ k, int64_t k_stride_tok, int64_t k_stride_head,
                              const int64_t* __restrict__ positions,
                              const float* __restrict__ cos_sin_cache, int64_t cache_stride,
                              int num_heads, int num_kv_heads, int head_dim, int rot_half) {
  const int64_t tok = blockIdx.x;
  const float* cos_ptr = cos_sin_cache + positions[tok] * cache_stride;
  const float* sin_ptr = cos_ptr + rot_half;
  rotate_heads<T, IS_NEOX, P>(q_out + tok * q_out_stride_tok, q_out_stride_head,
                              q + tok * q_stride_tok, q_stride_head, cos_ptr, sin_ptr, num_heads,
                              head_dim, rot_half);
  rotate_heads<T, IS_NEOX, P>(k_out + tok * k_out_stride_tok, k_out_stride_head,
                              k + tok * k_stride_tok, k_stride_head, cos_ptr, sin_ptr,
                              num_kv_heads, head_dim, rot_half);
}

template <typename T, int P>
void launch(bool is_neox, int num_tokens, int threads, cudaStream_t stream, T* qo,
            int64_t q_out_stride_tok, int64_t q_out_stride_head, T* ko, int64_t k_out_stride_tok,
            int64_t k_out_stride_head, const T* qi, int64_t q_stride_tok, int64_t q_stride_head,
            const T* ki, int64_t k_stride_tok, int64_t k_stride_head, const int64_t* positions,
            const float* cos_sin_cache, int64_t cache_stride, int num_heads, int num_kv_heads,
            int head_dim, int rot_half) {
  if (is_neox) {
    rotary_kernel<T, true, P><<<num_tokens, threads, 0, stream>>>(
        qo, q_out_stride_tok, q_out_stride_head, ko, k_out_stride_tok, k_out_stride_head, qi,
        q_stride_tok, q_stride_head, ki, k_stride_tok, k_stride_head, positions, cos_sin_cache,
        cache_stride, num_heads, num_kv_heads, head_dim, rot_half);
  } else {
    rotary_kernel<T, false, P><<<num_tokens, threads, 0, stream>>>(
        qo, q_out_stride_tok, q_out_stride_head, ko, k_out_stride_tok, k_out_stride_head, qi,
        q_stride_tok, q_stride_head, ki, k_stride_tok, k_stride_head, positions, cos_sin_cache,
        cache_stride, num_heads, num_kv_heads, head_dim, rot_half);
  }
}

}  // namespace

cudaError_t launch_rotary_embedding(DType dtype, void* q_out, int64_t q_out_stride_tok,
                                    int64_t q_out_stride_head, void* k_out,
                                    int64_t k_out_stride_tok, int64_t k_out_stride_head,
                                    const void* q, int64_t q_stride_tok, int64_t q_stride_head,
                                    const void* k, int64_t k_stride_tok, int64_t k_stride_head,
                                    const int64_t* positions, const float* cos_sin_cache,
                                    int64_t cache_stride, int num_tokens, int num_heads,
                                    int num_kv_heads, int head_dim, int rot_dim, bool is_neox,
                                    cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (rot_dim % 2 != 0 || rot_dim > head_dim) return cudaErrorInvalidValue;
  const int rot_half = rot_dim / 2;
  TIDAL_DISPATCH_FLOATING(dtype, {
    constexpr int kPairs = 8 / sizeof(scalar_t);
    auto* qo = static_cast<scalar_t*>(q_out);
    auto* ko = static_cast<scalar_t*>(k_out);
    const auto* qi = static_cast<const scalar_t*>(q);
    const auto* ki = static_cast<const scalar_t*>(k);
    // Vector path: every row/head start and both rotary halves aligned for kPairs-wide
    // accesses (2 * kPairs elements, 16 bytes, for the GPT-J layout), cos/sin rows likewise.
    const int64_t v = 2 * kPairs;
    const bool vec_ok = rot_half % kPairs == 0 && is_aligned16(qo) && is_aligned16(ko) &&
                        is_aligned16(qi) && is_aligned16(ki) && is_aligned16(cos_sin_cache) &&
                        q_out_stride_tok % v == 0 && q_out_stride_head % v == 0 &&
                        k_out_stride_tok % v == 0 && k_out_stride_head % v == 0 &&
                        q_stride_tok % v == 0 && q_stride_head % v == 0 && k_stride_tok % v == 0 &&
                        k_stride_head % v == 0 && cache_stride % kPairs == 0;
    const int pairs = vec_ok ? kPairs : 1;
    const int work = std::max(num_heads, num_kv_heads) * std::max(rot_half / pairs, 1);
    const int threads = std::min(512, std::max(64, ceil_div(work, 32) * 32));
    if (vec_ok) {
      launch<scalar_t, kPairs>(is_neox, num_tokens, threads, stream, qo, q_out_stride_tok,
                               q_out_stride_head, ko, k_out_stride_tok, k_out_stride_head, qi,
                               q_stride_tok, q_stride_head, ki, k_stride_tok, k_stride_head,
                               positions, cos_sin_cache, cache_stride, num_heads, num_kv_heads,
                               head_dim, rot_half);
    } else {
      launch<scalar_t, 1>(is_neox, num_tokens, threads, stream, qo, q_out_stride_tok,
                          q_out_stride_head, ko, k_out_stride_tok, k_out_stride_head, qi,
                          q_stride_tok, q_stride_head, ki, k_stride_tok, k_stride_head, positions,
                          cos_sin_cache, cache_stride, num_heads, num_kv_heads, head_dim, rot_half);
    }
  });
  return cudaGetLastError();
}

}  // namespace tidal
