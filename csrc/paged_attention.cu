// Paged-attention decode, partitioned over long contexts (flash-decoding, vLLM's "v2" idea).
//
// Grid (num_kv_heads, num_seqs, num_splits). One block serves every query head of one KV group
// (GQA), so each K/V row is read from memory once per group instead of once per query head. A
// block walks its split of the context in chunks of kChunk tokens:
//   1. logits: a group of HEAD_DIM/VEC threads owns one token and reads its K row with 16-byte
//      loads; partial dot products are summed with shuffles; logits land in shared memory;
//   2. online softmax: one warp per query head rescales the running max/sum (log2 domain);
//   3. values: the same token ownership, accumulating p * V into registers.
// With one split the block writes the normalised output; otherwise it writes its partial output,
// max and sum, and paged_decode_reduce_kernel merges the splits.
//
// The number of splits is chosen on the host from shapes only (seqs x kv heads vs SM count), and
// each split's token range is derived from seq_lens on the device, so the launch is the same for
// every step of a captured CUDA graph.
#include "common.cuh"

namespace tidal {
namespace {

constexpr int kThreads = 128;
constexpr int kChunk = 128;      // tokens whose logits sit in shared memory at once
constexpr int kSplitAlign = 32;  // split lengths are a multiple of this many tokens
constexpr int kMaxSplits = 64;   // the reduce kernel keeps per-split statistics in shared memory
constexpr float kLog2e = 1.4426950408889634f;

// Register budget: q and acc take 2 * QPK * VEC floats per thread. QPK <= 2 is capped at 128
// registers so 4 blocks (16 warps) fit on an SM; QPK 4 gets 3 blocks, QPK 8 two.
template <typename T, int HEAD_DIM, int QPK>
__global__ void __launch_bounds__(kThreads, QPK >= 8 ? 2 : (QPK >= 4 ? 3 : 4))
    paged_decode_kernel(const PagedDecodeArgs a) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int TPT = HEAD_DIM / VEC;  // threads sharing one token's row
  static_assert(HEAD_DIM % VEC == 0 && TPT <= 32 && 32 % TPT == 0, "unsupported head_dim");
  constexpr int TOK_PER_ITER = kThreads / TPT;
  constexpr int ITERS = kChunk / TOK_PER_ITER;
  constexpr int NUM_WARPS = kThreads / 32;
  static_assert(kChunk % TOK_PER_ITER == 0, "chunk must be a whole number of iterations");
  // Tokens per thread whose loads are in flight together; fewer when the per-head registers
  // (q and acc, 2 * QPK * VEC floats) are many.
  constexpr int LOADS = QPK >= 4 ? 4 : 8;
  static_assert(ITERS % LOADS == 0, "iterations must split into load batches");

  const int kvh = blockIdx.x;
  const int seq = blockIdx.y;
  const int split = blockIdx.z;
  const int token = a.query_start_loc[seq];
  // Decode rows only (query length 1); padding requests have length 0. Uniform per block, so
  // returning before the barriers is safe.
  if (a.query_start_loc[seq + 1] - token != 1) return;
  const int seq_len = a.seq_lens[seq];
  const int split_len = ceil_div(ceil_div(seq_len, a.num_splits), kSplitAlign) * kSplitAlign;
  const int begin = min(seq_len, split * split_len);
  const int end = min(seq_len, begin + split_len);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int group = tid / TPT;  // which token of an iteration this thread works on
  const int gl = tid % TPT;     // which 16-byte slice of the head this thread owns

  __shared__ float s_logits[QPK][kChunk];
  __shared__ float s_max[QPK];
  __shared__ float s_sum[QPK];
  __shared__ float s_alpha[QPK];
  __shared__ float s_red[NUM_WARPS][QPK][HEAD_DIM];

  // The query slice, pre-scaled so that logits are already in the log2 domain.
  float q[QPK][VEC];
  {
    const T* q_ptr = static_cast<const T*>(a.query) + static_cast<int64_t>(token) * a.q_stride_tok +
                     static_cast<int64_t>(kvh * QPK) * a.q_stride_head + gl * VEC;
    const float qscale = a.scale * kLog2e;
#pragma unroll
    for (int g = 0; g < QPK; ++g) {
      const VecN<T, VEC> v = load_vec<T, VEC>(q_ptr + g * a.q_stride_head);
#pragma unroll
      for (int j = 0; j < VEC; ++j) q[g][j] = to_float(v.v[j]) * qscale;
    }
  }
  float acc[QPK][VEC];
#pragma unroll
  for (int g = 0; g < QPK; ++g) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[g][j] = 0.f;
  }
  if (tid < QPK) {
    s_max[tid] = -INFINITY;
    s_sum[tid] = 0.f;
  }

  const T* k_base = static_cast<const T*>(a.key_cache) + kvh * a.kv_stride_head + gl * VEC;
  const T* v_base = static_cast<const T*>(a.value_cache) + kvh * a.kv_stride_head + gl * VEC;
  const int32_t* bt = a.block_table + static_cast<int64_t>(seq) * a.block_table_stride;
  const int block_size = a.block_size;
  // Element offset of context position `pos` inside one layer's K (or V) cache.
  auto token_offset = [&](int pos) -> int64_t {
    const int64_t blk = bt[pos / block_size];
    return blk * a.kv_stride_blk + static_cast<int64_t>(pos % block_size) * a.kv_stride_tok;
  };

  for (int c0 = begin; c0 < end; c0 += kChunk) {
    const int n = min(kChunk, end - c0);

    // 1. Logits. Each thread issues LOADS independent 16-byte K loads before it uses any of
    //    them (the compiler won't hoist a load above the previous token's shuffles itself).
#pragma unroll
    for (int it0 = 0; it0 < ITERS; it0 += LOADS) {
      // A short chunk (the tail, or a short split) skips whole load batches past its end;
      // n is the same for the whole block, so the shuffles below stay convergent.
      if (it0 * TOK_PER_ITER >= n) break;
      VecN<T, VEC> kv[LOADS];
#pragma unroll
      for (int u = 0; u < LOADS; ++u) {
        const int i = (it0 + u) * TOK_PER_ITER + group;
        // Past the chunk's end, re-read its last token instead of branching: a branch around
        // the load makes the compiler unpack each result inside the branch, which serialises
        // the loads. The extra logits are masked below.
        kv[u] = load_vec16_stream<T>(k_base + token_offset(c0 + min(i, n - 1)));
      }
#pragma unroll
      for (int u = 0; u < LOADS; ++u) {
        const int i = (it0 + u) * TOK_PER_ITER + group;
        float dot[QPK];
#pragma unroll
        for (int g = 0; g < QPK; ++g) dot[g] = 0.f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float kf = to_float(kv[u].v[j]);
#pragma unroll
          for (int g = 0; g < QPK; ++g) dot[g] = fmaf(q[g][j], kf, dot[g]);
        }
#pragma unroll
        for (int g = 0; g < QPK; ++g) {
#pragma unroll
          for (int o = TPT / 2; o > 0; o >>= 1) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
        }
        if (gl == 0) {
#pragma unroll
          for (int g = 0; g < QPK; ++g) s_logits[g][i] = i < n ? dot[g] : -INFINITY;
        }
      }
    }
    __syncthreads();

    // 2. Online softmax over the chunk, one warp per query head.
    for (int g = warp; g < QPK; g += NUM_WARPS) {
      // Entries past n may be stale (skipped load batches): read them as -inf, write p = 0.
      float mx = -INFINITY;
      for (int i = lane; i < n; i += 32) mx = fmaxf(mx, s_logits[g][i]);
      mx = warp_max(mx);
      const float m_old = s_max[g];
      const float m_new = fmaxf(m_old, mx);  // finite: the chunk holds >= 1 real token
      float sum = 0.f;
      for (int i = lane; i < kChunk; i += 32) {
        const float p = i < n ? exp2f(s_logits[g][i] - m_new) : 0.f;
        s_logits[g][i] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);
        s_alpha[g] = alpha;
        s_sum[g] = s_sum[g] * alpha + sum;
        s_max[g] = m_new;
      }
    }
    __syncthreads();

    // 3. Values.
#pragma unroll
    for (int g = 0; g < QPK; ++g) {
      const float alpha = s_alpha[g];
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[g][j] *= alpha;
    }
#pragma unroll
    for (int it0 = 0; it0 < ITERS; it0 += LOADS) {
      if (it0 * TOK_PER_ITER >= n) break;
      VecN<T, VEC> vv[LOADS];
#pragma unroll
      for (int u = 0; u < LOADS; ++u) {
        const int i = (it0 + u) * TOK_PER_ITER + group;
        vv[u] = load_vec16_stream<T>(v_base + token_offset(c0 + min(i, n - 1)));
      }
#pragma unroll
      for (int u = 0; u < LOADS; ++u) {
        const int i = (it0 + u) * TOK_PER_ITER + group;
        // Tokens past the chunk have p == 0 (exp2 of -inf) times a real, finite V row.
#pragma unroll
        for (int g = 0; g < QPK; ++g) {
          const float p = s_logits[g][i];
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[g][j] = fmaf(p, to_float(vv[u].v[j]), acc[g][j]);
        }
      }
    }
    __syncthreads();  // the next chunk overwrites s_logits
  }

  // Merge the token groups: within a warp by shuffles, across warps through shared memory.
#pragma unroll
  for (int g = 0; g < QPK; ++g) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
#pragma unroll
      for (int o = TPT; o < 32; o <<= 1) acc[g][j] += __shfl_xor_sync(0xffffffffu, acc[g][j], o);
    }
  }
  if (lane < TPT) {
#pragma unroll
    for (int g = 0; g < QPK; ++g) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) s_red[warp][g][gl * VEC + j] = acc[g][j];
    }
  }
  __syncthreads();

  for (int idx = tid; idx < QPK * HEAD_DIM; idx += kThreads) {
    const int g = idx / HEAD_DIM;
    const int d = idx - g * HEAD_DIM;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) v += s_red[w][g][d];
    const float l = s_sum[g];
    const float o = l > 0.f ? v / l : 0.f;  // empty split or seq_len 0: zeros
    const int head = kvh * QPK + g;
    if (a.num_splits == 1) {
      T* out = static_cast<T*>(a.out) + static_cast<int64_t>(token) * a.out_stride_tok +
               static_cast<int64_t>(head) * a.out_stride_head;
      out[d] = from_float<T>(o);
    } else {
      const int64_t p = (static_cast<int64_t>(token) * a.num_heads + head) * a.num_splits + split;
      a.partial_out[p * HEAD_DIM + d] = o;
      if (d == 0) {
        a.partial_max[p] = s_max[g];
        a.partial_sum[p] = l;
      }
    }
  }
}

// Merges the splits of one (seq, head): weights exp2(max_s - max) * sum_s. Block = HEAD_DIM
// threads. The per-split max/sum are read once into shared memory by as many threads as there
// are splits (one round of loads, not a dependent chain), then every thread streams its channel
// of the partial outputs with several loads in flight.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(HEAD_DIM) paged_decode_reduce_kernel(const PagedDecodeArgs a) {
  static_assert(HEAD_DIM >= kMaxSplits, "one thread per split loads the split statistics");
  __shared__ float s_max_split[kMaxSplits];
  __shared__ float s_sum_split[kMaxSplits];
  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  const int token = a.query_start_loc[seq];
  if (a.query_start_loc[seq + 1] - token != 1) return;
  const int splits = a.num_splits;
  const int64_t base = (static_cast<int64_t>(token) * a.num_heads + head) * splits;
  const int d = threadIdx.x;
  if (d < splits) {
    s_max_split[d] = a.partial_max[base + d];
    s_sum_split[d] = a.partial_sum[base + d];
  }
  __syncthreads();
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) {
    if (s_sum_split[s] > 0.f) m = fmaxf(m, s_max_split[s]);
  }
  float num = 0.f;
  float den = 0.f;
  const float* po = a.partial_out + base * HEAD_DIM + d;
#pragma unroll 8
  for (int s = 0; s < splits; ++s) {
    const float l = s_sum_split[s];
    // Empty splits (l == 0) wrote zeros: weight 0, no special case needed.
    const float w = l > 0.f ? exp2f(s_max_split[s] - m) * l : 0.f;
    den += w;
    num = fmaf(w, po[static_cast<int64_t>(s) * HEAD_DIM], num);
  }
  T* out = static_cast<T*>(a.out) + static_cast<int64_t>(token) * a.out_stride_tok +
           static_cast<int64_t>(head) * a.out_stride_head;
  out[d] = from_float<T>(den > 0.f ? num / den : 0.f);
}

template <typename T, int HEAD_DIM, int QPK>
cudaError_t launch_typed(const PagedDecodeArgs& a, cudaStream_t stream) {
  const dim3 grid(a.num_kv_heads, a.num_seqs, a.num_splits);
  paged_decode_kernel<T, HEAD_DIM, QPK><<<grid, kThreads, 0, stream>>>(a);
  if (a.num_splits > 1) {
    const dim3 rgrid(a.num_seqs, a.num_heads);
    paged_decode_reduce_kernel<T, HEAD_DIM><<<rgrid, HEAD_DIM, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T, int HEAD_DIM>
cudaError_t launch_head_dim(const PagedDecodeArgs& a, int qpk, cudaStream_t stream) {
  switch (qpk) {
    case 1: return launch_typed<T, HEAD_DIM, 1>(a, stream);
    case 2: return launch_typed<T, HEAD_DIM, 2>(a, stream);
    case 4: return launch_typed<T, HEAD_DIM, 4>(a, stream);
    case 8: return launch_typed<T, HEAD_DIM, 8>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_dtype(const PagedDecodeArgs& a, int qpk, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: return launch_head_dim<T, 64>(a, qpk, stream);
    case 128: return launch_head_dim<T, 128>(a, qpk, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool paged_attention_decode_supported(DType dtype, int head_dim, int queries_per_kv) {
  const bool dtype_ok = dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  const bool head_ok = head_dim == 64 || head_dim == 128;
  const bool qpk_ok = queries_per_kv == 1 || queries_per_kv == 2 || queries_per_kv == 4 ||
                      queries_per_kv == 8;
  return dtype_ok && head_ok && qpk_ok;
}

cudaError_t launch_paged_attention_decode(const PagedDecodeArgs& a, cudaStream_t stream) {
  if (a.num_seqs == 0) return cudaSuccess;
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0 || a.num_splits < 1 ||
      a.num_seqs > 65535 || a.num_splits > kMaxSplits) {
    return cudaErrorInvalidValue;
  }
  const int qpk = a.num_heads / a.num_kv_heads;
  if (!paged_attention_decode_supported(a.dtype, a.head_dim, qpk)) return cudaErrorInvalidValue;
  if (a.dtype == DType::kFloat16) return launch_dtype<__half>(a, qpk, stream);
  return launch_dtype<__nv_bfloat16>(a, qpk, stream);
}

}  // namespace tidal
