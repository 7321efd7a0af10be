// SiLU-and-mul (the gated MLP activation): out[:, i] = silu(x[:, i]) * x[:, d + i].
//
// Rounded like torch_ops: silu is evaluated in float32 and rounded to the activation dtype before
// the product, which is rounded again.
#include "common.cuh"

namespace tidal {
namespace {

template <typename T>
__device__ __forceinline__ T silu_mul(T gate, T up) {
  const float g = to_float(gate);
  const T s = from_float<T>(g / (1.f + __expf(-g)));
  return from_float<T>(to_float(s) * to_float(up));
}

template <typename T, int VEC>
__global__ void silu_and_mul_kernel(T* __restrict__ out, int64_t out_stride,
                                    const T* __restrict__ x, int64_t x_stride, int d) {
  const int64_t row = blockIdx.x;
  const T* gate = x + row * x_stride;
  const T* up = gate + d;
  T* o = out + row * out_stride;
  for (int i = (blockIdx.y * blockDim.x + threadIdx.x) * VEC; i < d; i += gridDim.y * blockDim.x * VEC) {
    const VecN<T, VEC> a = load_vec<T, VEC>(gate + i);
    const VecN<T, VEC> b = load_vec<T, VEC>(up + i);
    VecN<T, VEC> r;
#pragma unroll
    for (int j = 0; j < VEC; ++j) r.v[j] = silu_mul(a.v[j], b.v[j]);
    store_vec<T, VEC>(o + i, r);
  }
}

template <typename T, int VEC>
void launch(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t num_rows, int d,
            cudaStream_t stream) {
  const int num_vec = d / VEC;
  const int threads = std::min(1024, std::max(32, ceil_div(num_vec, 32) * 32));
  // Wide rows (d of 10k+) get a second grid dimension so one row isn't one block's serial loop.
  const int y_blocks = std::max(1, std::min(8, ceil_div(num_vec, threads * 4)));
  const dim3 grid(static_cast<unsigned>(num_rows), y_blocks);
  silu_and_mul_kernel<T, VEC><<<grid, threads, 0, stream>>>(out, out_stride, x, x_stride, d);
}

}  // namespace

cudaError_t launch_silu_and_mul(DType dtype, void* out, int64_t out_stride, const void* x,
                                int64_t x_stride, int64_t num_rows, int d, cudaStream_t stream) {
  if (num_rows == 0 || d == 0) return cudaSuccess;
  TIDAL_DISPATCH_FLOATING(dtype, {
    constexpr int kVec = 16 / sizeof(scalar_t);
    // The up half starts d elements into the row, so d itself must keep 16-byte alignment.
    const bool vec_ok = d % kVec == 0 && is_aligned16(out) && is_aligned16(x) &&
                        out_stride % kVec == 0 && x_stride % kVec == 0;
    auto* o = static_cast<scalar_t*>(out);
    const auto* xi = static_cast<const scalar_t*>(x);
    if (vec_ok) {
      launch<scalar_t, kVec>(o, out_stride, xi, x_stride, num_rows, d, stream);
    } else {
      launch<scalar_t, 1>(o, out_stride, xi, x_stride, num_rows, d, stream);
    }
  });
  return cudaGetLastError();
}

}  // namespace tidal
