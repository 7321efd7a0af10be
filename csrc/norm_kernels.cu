// RMSNorm and fused residual-add + RMSNorm, one block per row.
//
// Rounding follows tidal.worker.ops.torch_ops (HF transformers): the residual sum is rounded to
// the activation dtype, normalised in float32, rounded, then multiplied by the weight and rounded
// again. Matching those steps keeps greedy tokens identical to the torch path.
#include "common.cuh"

namespace tidal {
namespace {

template <typename T, int VEC, bool FUSED_ADD>
__global__ void rms_norm_kernel(T* __restrict__ out, int64_t out_stride, const T* __restrict__ x,
                                int64_t x_stride, const T* __restrict__ residual_in,
                                int64_t residual_in_stride, T* __restrict__ residual_out,
                                int64_t residual_out_stride, const T* __restrict__ weight,
                                int hidden, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int num_vec = hidden / VEC;
  const T* x_row = x + row * x_stride;
  T* res_out_row = FUSED_ADD ? residual_out + row * residual_out_stride : nullptr;

  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < num_vec; i += blockDim.x) {
    VecN<T, VEC> a = load_vec<T, VEC>(x_row + i * VEC);
    if constexpr (FUSED_ADD) {
      const VecN<T, VEC> b = load_vec<T, VEC>(residual_in + row * residual_in_stride + i * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) a.v[j] = from_float<T>(to_float(a.v[j]) + to_float(b.v[j]));
      store_vec<T, VEC>(res_out_row + i * VEC, a);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = to_float(a.v[j]);
      sum_sq += f * f;
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / static_cast<float>(hidden) + eps);

  // Second pass re-reads the row (an L1/L2 hit: one row is a few KiB). In the fused case it
  // reads back what this same thread stored above, so no barrier is needed.
  const T* src = FUSED_ADD ? res_out_row : x_row;
  T* out_row = out + row * out_stride;
  for (int i = threadIdx.x; i < num_vec; i += blockDim.x) {
    const VecN<T, VEC> a = load_vec<T, VEC>(src + i * VEC);
    const VecN<T, VEC> w = load_vec<T, VEC>(weight + i * VEC);
    VecN<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const T normed = from_float<T>(to_float(a.v[j]) * inv_rms);
      o.v[j] = from_float<T>(to_float(normed) * to_float(w.v[j]));
    }
    store_vec<T, VEC>(out_row + i * VEC, o);
  }
}

template <typename T, int VEC>
void launch_rows(T* out, int64_t out_stride, const T* x, int64_t x_stride, const T* residual_in,
                 int64_t residual_in_stride, T* residual_out, int64_t residual_out_stride,
                 const T* weight, int64_t num_rows, int hidden, float eps, cudaStream_t stream) {
  const int num_vec = hidden / VEC;
  const int threads = std::min(1024, std::max(32, ceil_div(num_vec, 32) * 32));
  const dim3 grid(static_cast<unsigned>(num_rows));
  if (residual_in != nullptr) {
    rms_norm_kernel<T, VEC, true><<<grid, threads, 0, stream>>>(
        out, out_stride, x, x_stride, residual_in, residual_in_stride, residual_out,
        residual_out_stride, weight, hidden, eps);
  } else {
    rms_norm_kernel<T, VEC, false><<<grid, threads, 0, stream>>>(
        out, out_stride, x, x_stride, nullptr, 0, nullptr, 0, weight, hidden, eps);
  }
}

}  // namespace

cudaError_t launch_rms_norm(DType dtype, void* out, int64_t out_stride, const void* x,
                            int64_t x_stride, const void* residual_in, int64_t residual_in_stride,
                            void* residual_out, int64_t residual_out_stride, const void* weight,
                            int64_t num_rows, int hidden, float eps, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  TIDAL_DISPATCH_FLOATING(dtype, {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const bool fused = residual_in != nullptr;
    // 16-byte accesses need every row start 16-byte aligned: base pointers and row strides.
    bool vec_ok = hidden % kVec == 0 && is_aligned16(out) && is_aligned16(x) &&
                  is_aligned16(weight) && out_stride % kVec == 0 && x_stride % kVec == 0;
    if (fused) {
      vec_ok = vec_ok && is_aligned16(residual_in) && is_aligned16(residual_out) &&
               residual_in_stride % kVec == 0 && residual_out_stride % kVec == 0;
    }
    auto* o = static_cast<scalar_t*>(out);
    const auto* xi = static_cast<const scalar_t*>(x);
    const auto* ri = static_cast<const scalar_t*>(residual_in);
    auto* ro = static_cast<scalar_t*>(residual_out);
    const auto* w = static_cast<const scalar_t*>(weight);
    if (vec_ok) {
      launch_rows<scalar_t, kVec>(o, out_stride, xi, x_stride, ri, residual_in_stride, ro,
                                  residual_out_stride, w, num_rows, hidden, eps, stream);
    } else {
      launch_rows<scalar_t, 1>(o, out_stride, xi, x_stride, ri, residual_in_stride, ro,
                               residual_out_stride, w, num_rows, hidden, eps, stream);
    }
  });
  return cudaGetLastError();
}

}  // namespace tidal
