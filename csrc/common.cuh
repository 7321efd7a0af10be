// Shared device helpers for tidal's CUDA kernels: dtype conversions, 16-byte vectors, warp
// reductions and the dtype switch the launchers use.
//
// The kernels are written against raw pointers and cudaStream_t only (no torch headers), so each
// .cu file compiles in seconds and can be compile-checked on a machine without a GPU. The torch
// side (tensor checks, streams, pybind) lives in bindings.cpp alone.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "launchers.h"

namespace tidal {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N elements of T moved as one access: with N * sizeof(T) == 16 the compiler emits
// LDG.128/STG.128, the widest per-thread access. The pointer must be N * sizeof(T) aligned.
template <typename T, int N>
struct alignas(sizeof(T) * N) VecN {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ VecN<T, N> load_vec(const T* ptr) {
  return *reinterpret_cast<const VecN<T, N>*>(ptr);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* ptr, const VecN<T, N>& val) {
  *reinterpret_cast<VecN<T, N>*>(ptr) = val;
}

template <typename T, int N>
__device__ __forceinline__ VecN<T, N> zero_vec() {
  static_assert(sizeof(VecN<T, N>) == 16, "zero_vec is for 16-byte vectors");
  VecN<T, N> out;
  *reinterpret_cast<uint4*>(&out) = make_uint4(0u, 0u, 0u, 0u);
  return out;
}

// Streaming 16-byte read for data touched once per kernel (the KV cache): evict-first, so it
// doesn't push out the lines that are reused (queries, block tables).
template <typename T>
__device__ __forceinline__ VecN<T, 16 / sizeof(T)> load_vec16_stream(const T* ptr) {
  VecN<T, 16 / sizeof(T)> out;
  *reinterpret_cast<uint4*>(&out) = __ldcs(reinterpret_cast<const uint4*>(ptr));
  return out;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Sum over the whole block; every thread gets the result. `scratch` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = (blockDim.x + 31) >> 5;
  x = warp_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float total = lane < num_warps ? scratch[lane] : 0.f;
  total = warp_sum(total);
  __syncthreads();  // scratch may be reused by the caller right after
  return total;
}

__host__ __device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

inline bool is_aligned16(const void* ptr) {
  return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0;
}

}  // namespace tidal

// Runs the body with `scalar_t` bound to the element type of `dtype`; unknown dtypes return
// cudaErrorInvalidValue from the enclosing launcher.
#define TIDAL_DISPATCH_FLOATING(dtype, ...)                    \
  switch (dtype) {                                             \
    case ::tidal::DType::kFloat32: {                           \
      using scalar_t = float;                                  \
      __VA_ARGS__;                                             \
      break;                                                   \
    }                                                          \
    case ::tidal::DType::kFloat16: {                           \
      using scalar_t = __half;                                 \
      __VA_ARGS__;                                             \
      break;                                                   \
    }                                                          \
    case ::tidal::DType::kBFloat16: {                          \
      using scalar_t = __nv_bfloat16;                          \
      __VA_ARGS__;                                             \
      break;                                                   \
    }                                                          \
    default:                                                   \
      return cudaErrorInvalidValue;                            \
  }
