// A product of a few activation rows (1 to 8) by a weight [N, K] that is bound by the weight's
// bytes: out[m, n] = sum_k x[m, k] * w[n, k], for decode at small batch and speculative
// verifies. Weights are 16-bit (the activations' dtype), FP8 e4m3 with a float32 scale per
// output row or per row and group of >= 64 inputs (block-wise FP8; weight-only either way), or
// INT4 in tidal's layout (``worker/ops/int4_torch.py``: eight 4-bit values per int32 along K, a
// scale and a zero point per output row and group).
//
// Why tensor cores for a GEMV: the weight is multiplied on ``mma.sync.m16n8k16`` with the
// activation rows as the A operand and eight weight rows as the B operand, so converting the
// weight (FP8 -> f16, INT4 -> bf16 / f16) is the only per-weight arithmetic, whatever the
// number of rows; an elementwise GEMV adds one FMA per weight and row. (INT4 runs at about
// 1.2-2.6 TB/s of an H200's 4.8, against 4 TB/s for bf16 weights: Nsight Compute shows DRAM
// at 38 % and issue slots at 49 % on the gate/up weight, at 36 % occupancy, so it is neither
// purely bound by instructions nor by memory. tools/results/skinny_gemm_h200_llama8b*.json.)
//
// The layout trick that makes it a plain stream of 16-byte loads: the mma's K order is free
// (a sum), so each lane of a quad (the four lanes holding one B column, one weight row) loads
// its own 16 contiguous bytes of that row, and the A fragment is built from the activation
// values at the same K positions, which the lane also loads as contiguous bytes (lane
// (g, t) owns activation row g and weight row g of the tile; the mma's logical K positions
// 2t, 2t+1, 2t+8, 2t+9 map onto the lane's own chunk). No weight reordering at load time.
//
// A block takes R tiles of eight weight rows (R / 2 gate and R / 2 up tiles for a fused
// [gate; up] weight, so the gated epilogue has both halves in one thread) over the whole K,
// split among its warps in interleaved chunks; the warps' partial sums meet in shared memory.
// Each warp keeps U chunks of loads in flight per tile before it multiplies.
//
// One INT4 row with groups of 128 or more takes a staged form (XS): the block first copies the
// activation row into shared memory as f16 pairs in the mma's order (stage_x), so the loop
// neither pairs nor converts activations, the nibbles become f16 with one shift a word, and
// each warp keeps a ring of U chunks' weight loads in flight. 5-7 % faster than the direct
// form per Llama-3.1-8B weight at one row (o: 3 % slower); slower at two rows, so one only.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "common.cuh"
#include "launchers.h"

namespace tidal {
namespace {

constexpr int kMaxRows = 8;  // activation rows: the A fragment's first eight rows

template <typename T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  // (0x4300 | q) is the bf16 number 128 + q for q < 128: a nibble becomes a number with one
  // LOP3 and no int -> float conversion.
  static constexpr uint32_t kMagic = 0x43004300u;
};
template <>
struct Pair<__half> {
  using type = __half2;
  static constexpr uint32_t kMagic = 0x64006400u;  // f16 1024 + q
};

__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t as_u32(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
template <typename P>
__device__ __forceinline__ P from_u32(uint32_t u) {
  return *reinterpret_cast<P*>(&u);
}
template <typename T>
__device__ __forceinline__ T from_u16(uint16_t u) {
  return *reinterpret_cast<T*>(&u);
}

// Keeps a loop-invariant pointer in a register: without it the compiler recomputes the row
// addresses (64-bit multiplies) inside the loop, and INT4's loop is bound by instructions.
template <typename Ptr>
__device__ __forceinline__ void pin(Ptr& p) {
  uint64_t v = reinterpret_cast<uint64_t>(p);
  asm volatile("mov.b64 %0, %0;" : "+l"(v));
  p = reinterpret_cast<Ptr>(v);
}

// (v & 0x000F000F) | magic in one instruction.
__device__ __forceinline__ uint32_t nibbles_or(uint32_t v, uint32_t magic) {
  uint32_t out;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(out) : "r"(v), "r"(magic));
  return out;
}

// (v & 0x00F000F0) | magic: nibbles 1 and 5 as f16 1024 + 16 q (exact: 16 q fits f16's
// mantissa step at 1024), so one shift serves four nibble pairs (the staged INT4 path).
__device__ __forceinline__ uint32_t nibbles_hi_or(uint32_t v, uint32_t magic) {
  uint32_t out;
  asm("lop3.b32 %0, %1, 0x00F000F0, %2, 0xEA;" : "=r"(out) : "r"(v), "r"(magic));
  return out;
}

// C += A * B on one m16n8k16 mma: A (16 x 16) = four registers a0..a3, B (16 x 8) = b0, b1.
// Lane (g, t) holds a0 = A[g][2t..2t+1], a1 = A[g+8][2t..2t+1], a2 = A[g][2t+8..2t+9],
// a3 = A[g+8][2t+8..2t+9], b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g], and gets
// c[0], c[1] = C[g][2t], C[g][2t+1] and c[2], c[3] = C[g+8][2t], C[g+8][2t+1].
//
// Rows g + 8 of A are not zero padding: they carry the lane's other activation pairs, so one
// mma sums half of the lane's K positions into C row g and the next the other half into C row
// g + 8 of a second accumulator (``even`` / ``odd`` slots below). Every A register then comes
// straight from a load or a conversion, with no zero registers to move into place.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], uint32_t a0, uint32_t a1,
                                                        uint32_t a2, uint32_t a3, uint32_t b0,
                                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], uint32_t a0, uint32_t a1,
                                                 uint32_t a2, uint32_t a3, uint32_t b0,
                                                 uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two e4m3 values (the low 16 bits of `v`) widened exactly to f16x2, lower byte in the lower
// half.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t v) {
  uint32_t out;
  asm("{\n .reg .b16 lo;\n cvt.u16.u32 lo, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}"
      : "=r"(out)
      : "r"(v));
  return out;
}

// Two activation values (a bf16 or f16 pair) as an f16 pair times 2^-4, the FP8 path's A
// operand: e4m3's widening is exact in f16, and the 2^-4 keeps activations up to 2^20 finite
// (the one-row and few-row Triton GEMVs do the same); the epilogue multiplies 16 back.
template <typename T>
__device__ __forceinline__ uint32_t x_pair_to_f16(uint32_t v);
template <>
__device__ __forceinline__ uint32_t x_pair_to_f16<__nv_bfloat16>(uint32_t v) {
  const float lo = __uint_as_float(v << 16) * 0.0625f;
  const float hi = __uint_as_float(v & 0xffff0000u) * 0.0625f;
  return as_u32(__floats2half2_rn(lo, hi));
}
template <>
__device__ __forceinline__ uint32_t x_pair_to_f16<__half>(uint32_t v) {
  return as_u32(__hmul2(from_u32<__half2>(v), __float2half2_rn(0.0625f)));
}

// The loads are volatile asm so that they keep their program order against the fence that
// follows a step's loads (see the main loop).
// kStream: the weights, read once (evict-first); else the activations, read by every block
// (cached, read-only).
template <bool kStream>
__device__ __forceinline__ uint4 load16(const void* p) {
  uint4 v;
  if constexpr (kStream)
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  else
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  return v;
}
// Programmatic dependent launch (sm_90; the launch attribute is set where the caller asks):
// what a block does before this point overlaps the previous kernel in the stream, so only
// weights and their scales are read before it (no kernel writes those); the activations, the
// output and everything after come after it. It also lets the next kernel launch and fetch
// its own weights while this one runs. Without the attribute both return at once.
__device__ __forceinline__ void dependent_launch_point() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" : : "l"(p));
}
// 16 bytes from global to shared memory without passing through registers (the weight ring
// of the INT4 one-row form): issued, committed as a group, waited for by group count.
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* p) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" : : "r"(smem), "l"(p));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" : : "n"(N) : "memory");
}
// A 16-byte shared-memory load (volatile for the same reason as the global ones).
__device__ __forceinline__ uint4 load16_shared(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ uint16_t load_u16(const void* p) {
  uint16_t v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float load_f32(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint16_t load_u8(const void* p) {
  uint16_t v;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ float activate(float g, int act) {
  if (act == 1) return g / (1.f + __expf(-g));  // SiLU
  // tanh-approximated GELU
  const float c = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return 0.5f * g * (1.f + tanhf(c));
}

// Weight formats.
constexpr int kW16 = 0;   // the activations' dtype
constexpr int kWFp8 = 1;  // e4m3, float32 scale per row
constexpr int kWInt4 = 2; // tidal's INT4 layout
constexpr int kWFp8G = 3; // e4m3, float32 scale per row and group of >= 64 inputs (block FP8)
template <int WK>
constexpr bool kIsFp8 = WK == kWFp8 || WK == kWFp8G;

template <int WK>
struct Fmt;
template <>
struct Fmt<kW16> {
  static constexpr int kLaneK = 8;  // K values in a lane's 16 bytes
  static constexpr int kXVecs = 1;  // 16-byte activation vectors per lane and chunk
  // Accumulator slots per tile, in (row g, row g + 8) pairs (chunk_mma); more pairs split
  // the chain of dependent mmas, each of which waits out the previous one's latency.
  static constexpr int kAcc = 2;
};
template <>
struct Fmt<kWFp8> {
  static constexpr int kLaneK = 16;
  static constexpr int kXVecs = 2;
  static constexpr int kAcc = 4;
};
template <>
struct Fmt<kWFp8G> : Fmt<kWFp8> {};
template <>
struct Fmt<kWInt4> {
  static constexpr int kLaneK = 32;
  static constexpr int kXVecs = 4;
  static constexpr int kAcc = 2;
};

// One lane's 16 weight bytes times the activations at the same K positions. Accumulator
// slots come in pairs: an even slot's C row g and the next odd slot's C row g + 8 hold the
// useful sums (see mma16816). `zq`: INT4's (magic + zero point) pair; `sq`: INT4's scale pair
// for the pre-scaled (small group) form.
template <typename T, int WK, bool PRESCALE, bool XS>
__device__ __forceinline__ void chunk_mma(float (&c)[Fmt<WK>::kAcc][4], const uint4& w,
                                          const uint4 (&xv)[4], uint32_t zq, uint32_t sq) {
  using P = typename Pair<T>::type;
  constexpr int kAcc = Fmt<WK>::kAcc;
  const uint32_t* wu = reinterpret_cast<const uint32_t*>(&w);
  if constexpr (WK == kW16) {
    // Positions (0,1) (4,5) into row g, (2,3) (6,7) into row g + 8.
    const uint32_t* xu = reinterpret_cast<const uint32_t*>(&xv[0]);
    mma16816<T>(c[0], xu[0], xu[1], xu[2], xu[3], wu[0], wu[2]);
    mma16816<T>(c[1], xu[0], xu[1], xu[2], xu[3], wu[1], wu[3]);
  } else if constexpr (kIsFp8<WK>) {
#pragma unroll
    for (int j = 0; j < 4; j += 2) {
      // Words j and j + 1 hold positions 4j .. 4j+7 of the lane's 16; the activations were
      // converted to f16 pairs by the caller: pair i of the lane is x(2i, 2i+1).
      const uint32_t* xa = reinterpret_cast<const uint32_t*>(&xv[j >> 1]);
      const int slot = (j >> 1) % (kAcc / 2) * 2;
      mma16816<__half>(c[slot], xa[0], xa[1], xa[2], xa[3], e4m3x2_to_f16x2(wu[j]),
                       e4m3x2_to_f16x2(wu[j + 1]));
      mma16816<__half>(c[slot + 1], xa[0], xa[1], xa[2], xa[3], e4m3x2_to_f16x2(wu[j] >> 16),
                       e4m3x2_to_f16x2(wu[j + 1] >> 16));
    }
  } else if constexpr (XS) {
    // Staged activations (see stage_x): xv[j] is positions 8j .. 8j+7 of the lane's 32 as
    // f16 pairs (x0, x4), (x1, x5), (x2, x6), (x3, x7), times 2^-4. The weights become f16
    // q - z exactly: the low nibble of each byte pair through 1024 + q minus `zq` (1024 + z),
    // the high one through 1024 + 16 q times 1/16 plus `sq` (-(64 + z)), so one shift serves
    // the word's four pairs.
    uint32_t magic, sixteenth;
    asm("mov.b32 %0, %1;" : "=r"(magic) : "n"(0x64006400u));
    asm("mov.b32 %0, %1;" : "=r"(sixteenth) : "n"(0x2C002C00u));  // f16 1/16
    const __half2 zp = from_u32<__half2>(zq), zh = from_u32<__half2>(sq);
    const __half2 h16 = from_u32<__half2>(sixteenth);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t word = wu[j];
      const uint32_t w8 = word >> 8;
      const uint32_t q0 = as_u32(__hsub2(from_u32<__half2>(nibbles_or(word, magic)), zp));
      const uint32_t q1 =
          as_u32(__hfma2(from_u32<__half2>(nibbles_hi_or(word, magic)), h16, zh));
      const uint32_t q2 = as_u32(__hsub2(from_u32<__half2>(nibbles_or(w8, magic)), zp));
      const uint32_t q3 = as_u32(__hfma2(from_u32<__half2>(nibbles_hi_or(w8, magic)), h16, zh));
      const uint32_t* xu = reinterpret_cast<const uint32_t*>(&xv[j]);
      const int slot = j % (kAcc / 2) * 2;
      mma16816<__half>(c[slot], xu[0], xu[1], xu[2], xu[3], q0, q2);
      mma16816<__half>(c[slot + 1], xu[0], xu[1], xu[2], xu[3], q1, q3);
    }
  } else {
    const P zp = from_u32<P>(zq);
    // In a register, so that mask-and-or is one LOP3 (it takes one immediate).
    uint32_t magic;
    asm("mov.b32 %0, %1;" : "=r"(magic) : "n"(Pair<T>::kMagic));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // Word j: K positions 8j .. 8j+7 of the lane's 32; pair i = nibbles (i, i + 4).
      const uint32_t word = wu[j];
      uint32_t q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        P v = __hsub2(from_u32<P>(nibbles_or(word >> (4 * i), magic)), zp);
        if constexpr (PRESCALE) v = __hmul2(v, from_u32<P>(sq));
        q[i] = as_u32(v);
      }
      // The activations in the same pairing: (x0, x4), (x1, x5), (x2, x6), (x3, x7).
      const uint32_t* xu = reinterpret_cast<const uint32_t*>(&xv[j]);
      const uint32_t x04 = __byte_perm(xu[0], xu[2], 0x5410);
      const uint32_t x15 = __byte_perm(xu[0], xu[2], 0x7632);
      const uint32_t x26 = __byte_perm(xu[1], xu[3], 0x5410);
      const uint32_t x37 = __byte_perm(xu[1], xu[3], 0x7632);
      const int slot = j % (kAcc / 2) * 2;
      mma16816<T>(c[slot], x04, x15, x26, x37, q[0], q[2]);
      mma16816<T>(c[slot + 1], x04, x15, x26, x37, q[1], q[3]);
    }
  }
}

// The staged activations (INT4 with groups of 128 or more, when they fit; see stage_x): per
// activation row, per chunk of 128 K values, the quad's four lanes' 32 values in 80-byte
// slots (64 bytes and 16 of padding, so that the quad's four 16-byte loads of a step hit
// different banks), rows padded to start 64 bytes apart modulo 128 (so rows g and g + 1 of
// a load phase do not collide either).
constexpr int kXsLane = 80;
constexpr int kXsChunk = 4 * kXsLane;
constexpr int64_t kXsMaxBytes = 40 * 1024;  // under the 48 KB a launch gets without opt-in
// One activation row only: at two rows the staged form measured slower than the direct one
// on two of the four Llama-3.1-8B weights (o 7.15 against 6.72 us, gate/up 29.7 against
// 28.8), and from four rows most rows no longer fit.
__host__ __device__ constexpr int64_t xs_row_bytes(int64_t k) {
  return k / 128 * kXsChunk + (4 - (k / 128 * (kXsChunk / 16)) % 8 + 8) % 8 * 16;
}

// Copies the m activation rows into shared memory once per block, in the staged layout: f16
// times 2^-4 (as the FP8 path's activations, finite up to 2^20), already in the pairs the
// INT4 mma takes, (x0, x4), (x1, x5), (x2, x6), (x3, x7) of every eight. This takes the
// pairing and the conversion out of the main loop, where they cost as much as the weights'
// own unpacking.
// A thread takes kB vectors a round, all loads first: with few warps a block stages many
// vectors per thread, and one load in flight at a time made the copy cost more than the
// weights (a fused gate/up at two rows and two warps: 51 against 29 us).
template <typename T>
__device__ __forceinline__ void stage_x(const SkinnyGemmArgs& a, char* xs) {
  constexpr int kB = 4;
  const int vecs = static_cast<int>(a.k / 8);
  const int total = a.m * vecs;
  const int64_t row_bytes = xs_row_bytes(a.k);
  for (int v0 = threadIdx.x; v0 < total; v0 += kB * blockDim.x) {
    uint4 raw[kB];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int v = min(v0 + b * static_cast<int>(blockDim.x), total - 1);
      const int r = v / vecs, p = v - r * vecs;
      raw[b] = load16<false>(reinterpret_cast<const T*>(a.x) + r * a.x_stride + p * 8);
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int v = v0 + b * static_cast<int>(blockDim.x);
      if (v >= total) break;
      const int r = v / vecs, p = v - r * vecs;  // vector p: K positions 8p .. 8p + 7
      const uint32_t* u = reinterpret_cast<const uint32_t*>(&raw[b]);
      const uint32_t f0 = x_pair_to_f16<T>(u[0]), f1 = x_pair_to_f16<T>(u[1]);
      const uint32_t f2 = x_pair_to_f16<T>(u[2]), f3 = x_pair_to_f16<T>(u[3]);
      uint4 o;
      o.x = __byte_perm(f0, f2, 0x5410);
      o.y = __byte_perm(f0, f2, 0x7632);
      o.z = __byte_perm(f1, f3, 0x5410);
      o.w = __byte_perm(f1, f3, 0x7632);
      // Chunk p / 16, lane (p / 4) % 4, vector p % 4 of the lane's four.
      *reinterpret_cast<uint4*>(xs + r * row_bytes + (p >> 4) * kXsChunk +
                                ((p >> 2) & 3) * kXsLane + (p & 3) * 16) = o;
    }
  }
}

// What one chunk (kQuadK values of K) of every tile reads: the weight vectors, the
// activations at the same K positions and, for INT4, the zero points and scales.
template <int WK, int R>
struct ChunkLoads {
  uint4 w[R];
  uint4 x[4];
  uint16_t zero[R];      // INT4: the lane's row's zero point
  uint16_t scale[R][2];  // INT4: columns 2t and 2t + 1 (groups >= 128), or the lane's row
  float fscale[R][2];    // FP8 groups: columns 2t and 2t + 1
};

// Where a lane's loads come from (fixed for the kernel); offsets from here are 32-bit.
template <int R>
struct LaneRows {
  const char* w[R];       // the weight row at the lane's first K position
  const char* x;          // the activation row at the lane's first K position
  const uint8_t* zero[R];  // INT4: the lane's row of zero points
  const uint16_t* scale[R];  // INT4: tile column 2t's row of scales (groups >= 128), else
                             // the lane's row
  const uint16_t* scale1[R];  // INT4 with groups >= 128: tile column 2t + 1's row
  const float* fscale[R];     // FP8 groups: tile column 2t's row of scales
  const float* fscale1[R];    // and 2t + 1's
};

// INT4: the zero points and scales of chunk `c`'s group for the lane's rows.
template <int R, bool PRESCALE>
__device__ __forceinline__ void load_int4_groups(const SkinnyGemmArgs& a, const LaneRows<R>& lr,
                                                 int c, int t, ChunkLoads<kWInt4, R>& out) {
  // The lane's 32 K values lie in one group (groups are powers of two >= 32, or one group);
  // with groups of 128 or more the quad's 128 share it.
  const uint32_t grp =
      (static_cast<uint32_t>(c) * 128u + static_cast<uint32_t>(t) * 32u) >> a.group_shift;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    out.zero[r] = load_u8(lr.zero[r] + grp);
    out.scale[r][0] = load_u16(lr.scale[r] + grp);
    if constexpr (!PRESCALE) out.scale[r][1] = load_u16(lr.scale1[r] + grp);
  }
}

template <typename T, int WK, int R, bool PRESCALE, bool XS>
__device__ __forceinline__ void load_chunk(const SkinnyGemmArgs& a, const LaneRows<R>& lr,
                                           int c, int t, ChunkLoads<WK, R>& out) {
  using F = Fmt<WK>;
  // A chunk's bytes of a weight row and of an activation row.
  constexpr uint32_t kWBytes = 64;  // four lanes' 16 bytes, in every format
  constexpr uint32_t kXBytes = 4 * F::kLaneK * sizeof(T);
  const uint32_t cu = static_cast<uint32_t>(c);
#pragma unroll
  for (int r = 0; r < R; ++r) out.w[r] = load16<true>(lr.w[r] + cu * kWBytes);
  if constexpr (!XS) {  // (staged: read from shared memory just before the mma, load_xs)
    const char* xp = lr.x + cu * kXBytes;
#pragma unroll
    for (int j = 0; j < F::kXVecs; ++j) out.x[j] = load16<false>(xp + 16 * j);
  }
  if constexpr (WK == kWInt4) load_int4_groups<R, PRESCALE>(a, lr, c, t, out);
  if constexpr (WK == kWFp8G) {
    // The quad's 64 K values lie in one group (groups of 64 or more).
    const uint32_t grp = (cu * 64u) >> a.group_shift;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      out.fscale[r][0] = load_f32(lr.fscale[r] + grp);
      out.fscale[r][1] = load_f32(lr.fscale1[r] + grp);
    }
  }
}

// The staged activations of chunk `c` for the lane.
template <int WK, int R>
__device__ __forceinline__ void load_xs(uint32_t xs, int c, ChunkLoads<WK, R>& out) {
  const uint32_t xa = xs + static_cast<uint32_t>(c) * kXsChunk;
#pragma unroll
  for (int j = 0; j < 4; ++j) out.x[j] = load16_shared(xa + 16 * j);
}

// A chunk's sums of tile columns 2t and 2t + 1 (the rows of other lanes), times each column's
// scale for the chunk's group, into the tile's accumulator: the scale multiplies the sums
// instead of every weight.
template <int ACC>
__device__ __forceinline__ void add_scaled(float (&acc)[ACC][4], const float (&part)[ACC][4],
                                           float s0, float s1) {
  float p0 = 0.f, p1 = 0.f;
#pragma unroll
  for (int i = 0; i < ACC; i += 2) {
    p0 += part[i][0] + part[i + 1][2];
    p1 += part[i][1] + part[i + 1][3];
  }
  acc[0][0] += p0 * s0;
  acc[0][1] += p1 * s1;
}

// One chunk of every tile, from its loads: FP8's activations to f16 pairs, INT4's zero points
// and scales, and the mma steps.
template <typename T, int WK, int R, bool PRESCALE, bool XS>
__device__ __forceinline__ void chunk_step(float (&acc)[R][Fmt<WK>::kAcc][4],
                                           ChunkLoads<WK, R>& ld) {
  if constexpr (kIsFp8<WK>) {
    // Sixteen activations as eight f16 pairs, in the two vectors' places.
    uint32_t* x0 = reinterpret_cast<uint32_t*>(&ld.x[0]);
    uint32_t* x1 = reinterpret_cast<uint32_t*>(&ld.x[1]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x0[i] = x_pair_to_f16<T>(x0[i]);
      x1[i] = x_pair_to_f16<T>(x1[i]);
    }
  }
  if constexpr (WK == kWInt4) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint32_t z = ld.zero[r];
      if constexpr (PRESCALE) {
        // (magic | z) is the number magic + z, as for the weights' nibbles.
        const uint32_t zq = Pair<T>::kMagic | (z * 0x10001u);
        const uint32_t s = static_cast<uint32_t>(ld.scale[r][0]) * 0x10001u;
        chunk_mma<T, WK, true, false>(acc[r], ld.w[r], ld.x, zq, s);
      } else {
        // Staged: the f16 pairs 1024 + z and -(64 + z) (sign, exponent 6, mantissa 16 z),
        // one IMAD each; else magic + z in T.
        const uint32_t zq = (XS ? 0x64006400u : Pair<T>::kMagic) + z * 0x10001u;
        const uint32_t zh = XS ? z * 0x100010u + 0xD400D400u : 0u;
        float part[Fmt<WK>::kAcc][4] = {};
        chunk_mma<T, WK, false, XS>(part, ld.w[r], ld.x, zq, zh);
        add_scaled(acc[r], part, to_float(from_u16<T>(ld.scale[r][0])),
                   to_float(from_u16<T>(ld.scale[r][1])));
      }
    }
  } else if constexpr (WK == kWFp8G) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float part[Fmt<WK>::kAcc][4] = {};
      chunk_mma<T, WK, false, false>(part, ld.w[r], ld.x, 0u, 0u);
      add_scaled(acc[r], part, ld.fscale[r][0], ld.fscale[r][1]);
    }
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) chunk_mma<T, WK, false, false>(acc[r], ld.w[r], ld.x, 0u, 0u);
  }
}

// The weight ring (opt-in, TIDAL_SKINNY_RING=1; the one-row INT4 form only): each warp's
// next 2U chunks of weights in flight through shared memory (cp.async) rather than U chunks
// in registers, so the bytes in flight no longer cost registers (72 a thread, 36 %
// occupancy, DRAM at 38 %: the register ring is what limits them). Its shared memory: a
// slot of 16 bytes per lane, tile and stage, after the staged activations.
template <int WARPS, int R, int U>
constexpr int64_t ring_bytes() {
  return static_cast<int64_t>(WARPS) * (2 * U) * R * 32 * 16;
}

template <typename T, int WK, int R, int WARPS, int U, bool PRESCALE, bool XS, bool RING>
__global__ void __launch_bounds__(WARPS * 32)
    skinny_gemm_kernel(const SkinnyGemmArgs a) {
  using F = Fmt<WK>;
  constexpr int kQuadK = 4 * F::kLaneK;  // K per chunk: the quad's four lanes
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = a.k / kQuadK;
  const bool gated = a.act != 0;

  // This lane's weight row in each tile, and whether the tile exists (N is a multiple of 8,
  // so a tile is whole or absent). Absent tiles and activation rows past m read row 0: their
  // sums land in outputs nobody writes (A row g only feeds C row g), and the loop needs no
  // predicates, which would keep the compiler from issuing the loads back to back.
  int64_t row[R];
  bool row_ok[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    int64_t n;
    if (gated) {
      constexpr int half = R / 2 > 0 ? R / 2 : 1;
      const int64_t base = static_cast<int64_t>(blockIdx.x) * 8 * half + (r % half) * 8 + g;
      row_ok[r] = base < a.n;
      n = r < half ? base : a.n + base;
    } else {
      n = static_cast<int64_t>(blockIdx.x) * 8 * R + r * 8 + g;
      row_ok[r] = n < a.n;
    }
    row[r] = row_ok[r] ? n : 0;
  }
  const bool x_ok = g < a.m;
  LaneRows<R> lr;
  lr.x = reinterpret_cast<const char*>(
      reinterpret_cast<const T*>(a.x) + (x_ok ? g : 0) * a.x_stride + t * F::kLaneK);
  // Bytes of a weight row per K value, times 2 (INT4 is half a byte).
  constexpr int kW2 = WK == kW16 ? 2 * sizeof(T) : kIsFp8<WK> ? 2 : 1;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    lr.w[r] = reinterpret_cast<const char*>(a.w) + row[r] * a.w_stride + t * F::kLaneK * kW2 / 2;
    if constexpr (WK == kWInt4) {
      lr.zero[r] = a.zeros + row[r] * a.group_stride;
      const int64_t srow = PRESCALE || !row_ok[r] ? row[r] : row[r] - g + 2 * t;
      lr.scale[r] = reinterpret_cast<const uint16_t*>(a.scales) + srow * a.group_stride;
      lr.scale1[r] = lr.scale[r] + (PRESCALE ? 0 : a.group_stride);
      pin(lr.zero[r]);
      pin(lr.scale[r]);
      pin(lr.scale1[r]);
    }
    if constexpr (WK == kWFp8G) {
      // Tile columns 2t and 2t + 1: the rows whose sums this lane holds (see add_scaled).
      const int64_t srow = row_ok[r] ? row[r] - g + 2 * t : row[r];
      lr.fscale[r] = reinterpret_cast<const float*>(a.scales) + srow * a.group_stride;
      lr.fscale1[r] = lr.fscale[r] + (row_ok[r] ? a.group_stride : 0);
      pin(lr.fscale[r]);
      pin(lr.fscale1[r]);
    }
    pin(lr.w[r]);
  }
  pin(lr.x);

  float acc[R][F::kAcc][4] = {};

  if constexpr (XS && RING) {
    constexpr int S = 2 * U;  // stages of the ring
    const int last = chunks - 1;
    extern __shared__ uint4 xs_smem[];
    const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(xs_smem));
    // This lane's slot of stage s and tile r: ring + (s * R + r) * 512.
    const uint32_t ring = smem0 + static_cast<uint32_t>(a.m * xs_row_bytes(a.k)) +
                          static_cast<uint32_t>((warp * S * R * 32 + lane) * 16);
    ChunkLoads<WK, R> ld[S];  // (the registers: each stage's zero points and scales)
#pragma unroll
    for (int st = 0; st < S; ++st) {
      const int c = min(warp + st * WARPS, last);
#pragma unroll
      for (int r = 0; r < R; ++r) cp_async16(ring + (st * R + r) * 512, lr.w[r] + c * 64u);
      cp_async_commit();
      load_int4_groups<R, PRESCALE>(a, lr, c, t, ld[st]);
    }
    // (Weights, zero points and scales only so far: they overlap the previous kernel's end.)
    dependent_launch_point();
    stage_x<T>(a, reinterpret_cast<char*>(xs_smem));
    __syncthreads();
    const uint32_t xs = smem0 + static_cast<uint32_t>((x_ok ? g : 0) * xs_row_bytes(a.k)) +
                        t * kXsLane;
    for (int c0 = warp; c0 < chunks; c0 += WARPS * S) {
#pragma unroll
      for (int st = 0; st < S; ++st) {
        const int c = c0 + st * WARPS;
        // S groups are in flight: the oldest, this stage's, is complete after this (each
        // lane waits for its own copies: no other lane reads its slots).
        cp_async_wait<S - 1>();
        if (c < chunks) {
#pragma unroll
          for (int r = 0; r < R; ++r) ld[st].w[r] = load16_shared(ring + (st * R + r) * 512);
          load_xs<WK, R>(xs, c, ld[st]);
          chunk_step<T, WK, R, PRESCALE, XS>(acc, ld[st]);
        }
        // The slot is free once its weights were multiplied (the mma consumed the loads).
        const int next = min(c + S * WARPS, last);
#pragma unroll
        for (int r = 0; r < R; ++r) cp_async16(ring + (st * R + r) * 512, lr.w[r] + next * 64u);
        cp_async_commit();
        load_int4_groups<R, PRESCALE>(a, lr, next, t, ld[st]);
      }
    }
    cp_async_wait<0>();
  } else if constexpr (XS) {
    // A ring of U chunks' weight loads in flight per tile: chunk c's slot is refilled with
    // chunk c + U * WARPS as soon as c is multiplied, so the loads never wait for a whole
    // step's arithmetic (which, at four times the bf16 work per byte, kept INT4 at about
    // half the bf16 bytes' rate). Past its last chunk a warp re-reads the last one (cached)
    // and skips it, so the loads need no predicates.
    const int last = chunks - 1;
    ChunkLoads<WK, R> ld[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      load_chunk<T, WK, R, PRESCALE, XS>(a, lr, min(warp + u * WARPS, last), t, ld[u]);
    // (Those loads read weights only: they overlap the previous kernel's end.)
    dependent_launch_point();
    // Every thread stages (no thread has returned yet); the first loads are already out.
    extern __shared__ uint4 xs_smem[];
    stage_x<T>(a, reinterpret_cast<char*>(xs_smem));
    __syncthreads();
    const uint32_t xs = static_cast<uint32_t>(__cvta_generic_to_shared(xs_smem)) +
                        static_cast<uint32_t>((x_ok ? g : 0) * xs_row_bytes(a.k)) +
                        t * kXsLane;
    for (int c0 = warp; c0 < chunks; c0 += WARPS * U) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * WARPS;
        if (c < chunks) {
          load_xs<WK, R>(xs, c, ld[u]);
          chunk_step<T, WK, R, PRESCALE, XS>(acc, ld[u]);
        }
        load_chunk<T, WK, R, PRESCALE, XS>(a, lr, min(c + U * WARPS, last), t, ld[u]);
      }
    }
  } else {
  // The first step's weight bytes head for L2 while the previous kernel ends (its loads also
  // read activations, which must wait for it).
  if (chunks > 0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t c = static_cast<uint32_t>(min(warp + u * WARPS, chunks - 1));
#pragma unroll
      for (int r = 0; r < R; ++r) prefetch_l2(lr.w[r] + c * 64u);
    }
  }
  dependent_launch_point();
  // U chunks a step, then the chunks left one at a time. A step's loads all issue before its
  // first mma: the branch after them (never taken) ends the basic block, and the assembler
  // does not move the loads past it; otherwise it starts the first mma as soon as its operands
  // are "ready" by its latency model and every later load waits behind that stalled mma.
  const int full = chunks - (WARPS * (U - 1));
  int c0 = warp;
  for (; c0 < full; c0 += WARPS * U) {
    ChunkLoads<WK, R> ld[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      load_chunk<T, WK, R, PRESCALE, XS>(a, lr, c0 + u * WARPS, t, ld[u]);
    if (a.k < 0) asm volatile("trap;");
#pragma unroll
    for (int u = 0; u < U; ++u) chunk_step<T, WK, R, PRESCALE, XS>(acc, ld[u]);
  }
  for (; c0 < chunks; c0 += WARPS) {
    ChunkLoads<WK, R> ld;
    load_chunk<T, WK, R, PRESCALE, XS>(a, lr, c0, t, ld);
    chunk_step<T, WK, R, PRESCALE, XS>(acc, ld);
  }
  }

  // The accumulators of each tile, then the warps' partial sums of each tile column, summed
  // by warp 0 in warp order.
  float sum[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    sum[r][0] = sum[r][1] = 0.f;
#pragma unroll
    for (int i = 0; i < F::kAcc; i += 2) {
      sum[r][0] += acc[r][i][0] + acc[r][i + 1][2];
      sum[r][1] += acc[r][i][1] + acc[r][i + 1][3];
    }
  }
  __shared__ float part[WARPS > 1 ? WARPS - 1 : 1][R][32][2];
  if (WARPS > 1) {
    if (warp > 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        part[warp - 1][r][lane][0] = sum[r][0];
        part[warp - 1][r][lane][1] = sum[r][1];
      }
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int w = 0; w < WARPS - 1; ++w)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        sum[r][0] += part[w][r][lane][0];
        sum[r][1] += part[w][r][lane][1];
      }
  }
  if (!x_ok) return;

  // Lane (g, t) holds outputs (row g, tile columns 2t and 2t + 1).
  T* orow = reinterpret_cast<T*>(a.out) + g * a.out_stride;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (gated && r >= R / 2) break;
    int64_t col0;
    if (gated)
      col0 = static_cast<int64_t>(blockIdx.x) * 8 * (R / 2) + r * 8 + 2 * t;
    else
      col0 = static_cast<int64_t>(blockIdx.x) * 8 * R + r * 8 + 2 * t;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t col = col0 + j;
      if (col >= a.n) continue;
      float v = sum[r][j];
      if constexpr (WK == kWFp8) v *= 16.f * a.w_scale[col];
      if constexpr (XS || WK == kWFp8G) v *= 16.f;  // the activations' 2^-4
      if (gated) {
        float u = sum[r + R / 2][j];
        if constexpr (WK == kWFp8) u *= 16.f * a.w_scale[a.n + col];
        if constexpr (XS || WK == kWFp8G) u *= 16.f;
        // Rounded as the unfused ops round: the product to T, then act(gate) * up to T.
        const float gr = to_float(from_float<T>(v));
        const float ur = to_float(from_float<T>(u));
        orow[col] = from_float<T>(activate(gr, a.act) * ur);
      } else {
        if (a.bias != nullptr) v += to_float(reinterpret_cast<const T*>(a.bias)[col]);
        orow[col] = from_float<T>(v);
      }
    }
  }
}

template <typename Kernel>
cudaError_t launch_kernel(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          const SkinnyGemmArgs& a) {
  if (smem > 48 * 1024) {
    // (Above the 48 KB a launch gets without asking; only the opt-in weight ring asks.)
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = a.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, a);
}

template <typename T, int WK, bool PRESCALE, bool XS, bool RING = false>
cudaError_t launch_typed(const SkinnyGemmArgs& a, int r, int warps, int u, cudaStream_t stream) {
  const size_t xs_bytes = XS ? static_cast<size_t>(a.m * xs_row_bytes(a.k)) : 0;
  const int rows_per_block = 8 * r;
  const int64_t outs_per_block = a.act != 0 ? rows_per_block / 2 : rows_per_block;
  const dim3 grid(static_cast<unsigned>((a.n + outs_per_block - 1) / outs_per_block));
  const dim3 block(32 * warps);
#define TIDAL_SKINNY_CASE(R_, W_, U_)                                                        \
  if (r == R_ && warps == W_ && u == U_)                                                      \
    return launch_kernel(skinny_gemm_kernel<T, WK, R_, W_, U_, PRESCALE, XS, RING>, grid,     \
                         block, xs_bytes + (RING ? ring_bytes<W_, R_, U_>() : 0), stream, a);
#define TIDAL_SKINNY_WARPS(R_, U_) \
  TIDAL_SKINNY_CASE(R_, 2, U_)     \
  TIDAL_SKINNY_CASE(R_, 4, U_)     \
  TIDAL_SKINNY_CASE(R_, 8, U_)
  if constexpr (RING) {
    // The weight ring is built for the staged form's measured shapes and their neighbours
    // (``launch_shape``'s rule); another shape runs the register ring.
    TIDAL_SKINNY_CASE(2, 2, 1)
    TIDAL_SKINNY_CASE(2, 4, 1)
    TIDAL_SKINNY_CASE(2, 4, 2)
    TIDAL_SKINNY_CASE(2, 8, 1)
    TIDAL_SKINNY_CASE(2, 8, 2)
    TIDAL_SKINNY_CASE(4, 2, 1)
    return launch_typed<T, WK, PRESCALE, XS, false>(a, r, warps, u, stream);
  } else {
    TIDAL_SKINNY_WARPS(1, 1)
    TIDAL_SKINNY_WARPS(1, 2)
    TIDAL_SKINNY_WARPS(1, 4)
    TIDAL_SKINNY_WARPS(2, 1)
    TIDAL_SKINNY_WARPS(2, 2)
    TIDAL_SKINNY_WARPS(2, 4)
    TIDAL_SKINNY_WARPS(4, 1)
    TIDAL_SKINNY_WARPS(4, 2)
    return cudaErrorInvalidConfiguration;
  }
#undef TIDAL_SKINNY_WARPS
#undef TIDAL_SKINNY_CASE
}

// TIDAL_SKINNY_STAGED=0 turns the staged INT4 activations off: a switch for measuring the two
// forms side by side (tools/bench_skinny_gemm.py), read once.
bool staging_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TIDAL_SKINNY_STAGED");
    return v == nullptr || std::string(v) != "0";
  }();
  return on;
}

// TIDAL_SKINNY_RING=1 turns the staged form's weight ring in shared memory on (see
// ring_bytes): not yet measured on a GPU, so off unless asked, read once.
bool ring_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TIDAL_SKINNY_RING");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

template <typename T>
cudaError_t launch_format(const SkinnyGemmArgs& a, int r, int warps, int u,
                          cudaStream_t stream) {
  switch (a.format) {
    case SkinnyFormat::kW16:
      return launch_typed<T, kW16, false, false>(a, r, warps, u, stream);
    case SkinnyFormat::kFp8:
      return launch_typed<T, kWFp8, false, false>(a, r, warps, u, stream);
    case SkinnyFormat::kFp8Groups:
      return launch_typed<T, kWFp8G, false, false>(a, r, warps, u, stream);
    case SkinnyFormat::kInt4:
      if (a.group_shift < 7) return launch_typed<T, kWInt4, true, false>(a, r, warps, u, stream);
      if (a.m == 1 && xs_row_bytes(a.k) <= kXsMaxBytes && staging_enabled()) {
        if (ring_enabled()) return launch_typed<T, kWInt4, false, true, true>(a, r, warps, u, stream);
        return launch_typed<T, kWInt4, false, true>(a, r, warps, u, stream);
      }
      return launch_typed<T, kWInt4, false, false>(a, r, warps, u, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

namespace {

// K values in one lane's 16-byte weight load (a chunk of K is four of them).
int lane_k(SkinnyFormat format) {
  switch (format) {
    case SkinnyFormat::kW16: return Fmt<kW16>::kLaneK;
    case SkinnyFormat::kFp8: return Fmt<kWFp8>::kLaneK;
    case SkinnyFormat::kFp8Groups: return Fmt<kWFp8G>::kLaneK;
    case SkinnyFormat::kInt4: return Fmt<kWInt4>::kLaneK;
  }
  return 0;
}

}  // namespace

cudaError_t launch_skinny_gemm(DType dtype, const SkinnyGemmArgs& a, int tiles, int warps,
                               int unroll, cudaStream_t stream) {
  if (a.m < 1 || a.m > kMaxRows || a.n < 1 || a.n % 8 != 0 ||
      a.k % (4 * lane_k(a.format)) != 0 ||
      (a.act != 0 && tiles % 2 != 0))
    return cudaErrorInvalidValue;
  if (a.format == SkinnyFormat::kInt4 && (a.group_shift < 5 || a.group_shift > 30 ||
                                          a.k > (int64_t{1} << 30)))
    return cudaErrorInvalidValue;
  if (a.format == SkinnyFormat::kFp8Groups &&
      (a.group_shift < 6 || a.group_shift > 30 || a.k > (int64_t{1} << 30)))
    return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kBFloat16: return launch_format<__nv_bfloat16>(a, tiles, warps, unroll, stream);
    case DType::kFloat16: return launch_format<__half>(a, tiles, warps, unroll, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace tidal
