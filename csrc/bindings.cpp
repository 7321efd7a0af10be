// Python bindings of tidal's CUDA kernels: tensor checks, device guard and stream, then the
// plain launchers of launchers.h. Every op writes into tensors the caller allocated, so the
// Python wrappers (tidal.worker.ops.cuda_ops) own allocation and keep torch_ops' semantics.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "launchers.h"

namespace {

// Error messages never stream integers: in the H200 image (system g++ 13.3, torch 2.11 +
// cu130) `std::ostream << int64_t` compiled into an extension segfaulted, in a check's message
// or not, so a failed check with a number in it killed the process instead of raising (root
// cause not found; strings and dtypes streamed fine). std::to_string does not use the stream.
std::string num(int64_t v) { return std::to_string(v); }

std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + num(t.size(d));
  return s + "]";
}

tidal::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return tidal::DType::kFloat32;
    case at::kHalf: return tidal::DType::kFloat16;
    case at::kBFloat16: return tidal::DType::kBFloat16;
    default: TORCH_CHECK(false, "tidal kernels: unsupported dtype ", t.scalar_type());
  }
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "tidal kernel ", op, " failed: ", cudaGetErrorString(err));
}

cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
}

void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  check_cuda(t, name);
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " must be [",
              num(rows), ", ", num(cols), "], got ", shape_of(t));
  TORCH_CHECK(t.stride(1) == 1 || cols == 1, name, " must be contiguous in its last dim");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), name, " has dtype ", b.scalar_type(),
              ", expected ", a.scalar_type());
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  check_rows(x, "x", rows, hidden);
  check_rows(out, "out", rows, hidden);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == hidden, "weight must be [hidden]");
  check_same_dtype(x, out, "out");
  check_same_dtype(x, weight, "weight");
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(tidal::launch_rms_norm(dtype_of(x), out.data_ptr(), out.stride(0), x.data_ptr(),
                                      x.stride(0), nullptr, 0, nullptr, 0, weight.data_ptr(), rows,
                                      static_cast<int>(hidden), static_cast<float>(eps),
                                      current_stream(x)),
               "rms_norm");
}

void fused_add_rms_norm(at::Tensor out, at::Tensor residual_out, const at::Tensor& x,
                        const at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  check_rows(x, "x", rows, hidden);
  check_rows(residual, "residual", rows, hidden);
  check_rows(out, "out", rows, hidden);
  check_rows(residual_out, "residual_out", rows, hidden);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == hidden, "weight must be [hidden]");
  check_same_dtype(x, residual, "residual");
  check_same_dtype(x, out, "out");
  check_same_dtype(x, residual_out, "residual_out");
  check_same_dtype(x, weight, "weight");
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(tidal::launch_rms_norm(dtype_of(x), out.data_ptr(), out.stride(0), x.data_ptr(),
                                      x.stride(0), residual.data_ptr(), residual.stride(0),
                                      residual_out.data_ptr(), residual_out.stride(0),
                                      weight.data_ptr(), rows, static_cast<int>(hidden),
                                      static_cast<float>(eps), current_stream(x)),
               "fused_add_rms_norm");
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  check_rows(x, "x", rows, 2 * d);
  check_rows(out, "out", rows, d);
  check_same_dtype(x, out, "out");
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(tidal::launch_silu_and_mul(dtype_of(x), out.data_ptr(), out.stride(0),
                                          x.data_ptr(), x.stride(0), rows, static_cast<int>(d),
                                          current_stream(x)),
               "silu_and_mul");
}

void check_heads(const at::Tensor& t, const char* name, int64_t tokens, int64_t head_dim) {
  check_cuda(t, name);
  TORCH_CHECK(t.dim() == 3 && t.size(0) == tokens && t.size(2) == head_dim, name,
              " must be [tokens, heads, head_dim], got ", shape_of(t));
  TORCH_CHECK(t.stride(2) == 1, name, " must be contiguous in its last dim");
}

void rotary_embedding(at::Tensor q_out, at::Tensor k_out, const at::Tensor& positions,
                      const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_sin_cache,
                      bool is_neox) {
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  check_heads(q, "query", tokens, head_dim);
  check_heads(k, "key", tokens, head_dim);
  check_heads(q_out, "query_out", tokens, head_dim);
  check_heads(k_out, "key_out", tokens, head_dim);
  TORCH_CHECK(q_out.size(1) == q.size(1) && k_out.size(1) == k.size(1), "head count mismatch");
  check_same_dtype(q, k, "key");
  check_same_dtype(q, q_out, "query_out");
  check_same_dtype(q, k_out, "key_out");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == tokens && positions.is_contiguous(),
              "positions must be int64 [tokens]");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.stride(1) == 1,
              "cos_sin_cache must be float32 [max_position, rot_dim]");
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(tidal::launch_rotary_embedding(
                   dtype_of(q), q_out.data_ptr(), q_out.stride(0), q_out.stride(1),
                   k_out.data_ptr(), k_out.stride(0), k_out.stride(1), q.data_ptr(), q.stride(0),
                   q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                   positions.data_ptr<int64_t>(), cos_sin_cache.data_ptr<float>(),
                   cos_sin_cache.stride(0), static_cast<int>(tokens), static_cast<int>(q.size(1)),
                   static_cast<int>(k.size(1)), static_cast<int>(head_dim),
                   static_cast<int>(cos_sin_cache.size(1)), is_neox, current_stream(q)),
               "rotary_embedding");
}

void check_cache(const at::Tensor& cache, const char* name) {
  check_cuda(cache, name);
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1, name,
              " must be [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous");
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                       at::Tensor value_cache, const at::Tensor& slot_mapping) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(key_cache.strides() == value_cache.strides() &&
                  key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must have the same layout");
  const int64_t tokens = slot_mapping.size(0);
  const int64_t kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  TORCH_CHECK(key.size(0) >= tokens && value.size(0) >= tokens, "fewer key rows than slots");
  for (const auto* t : {&key, &value}) {
    check_cuda(*t, "key/value");
    TORCH_CHECK(t->dim() == 3 && t->size(1) == kv_heads && t->size(2) == head_dim &&
                    t->stride(2) == 1,
                "key/value must be [tokens, num_kv_heads, head_dim], last dim contiguous");
    check_same_dtype(key_cache, *t, "key/value");
  }
  check_same_dtype(key_cache, value_cache, "value_cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  const c10::cuda::CUDAGuard guard(key.device());
  check_launch(tidal::launch_reshape_and_cache(
                   dtype_of(key_cache), key.data_ptr(), key.stride(0), key.stride(1),
                   value.data_ptr(), value.stride(0), value.stride(1), key_cache.data_ptr(),
                   value_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1),
                   key_cache.stride(2), slot_mapping.data_ptr<int64_t>(),
                   static_cast<int>(tokens), static_cast<int>(kv_heads),
                   static_cast<int>(head_dim), static_cast<int>(key_cache.size(1)),
                   current_stream(key)),
               "reshape_and_cache");
}

bool paged_attention_decode_supported(const at::Tensor& query, int64_t num_kv_heads) {
  if (query.dim() != 3 || num_kv_heads <= 0 || query.size(1) % num_kv_heads != 0) return false;
  const auto st = query.scalar_type();
  if (st != at::kHalf && st != at::kBFloat16) return false;
  return tidal::paged_attention_decode_supported(dtype_of(query), static_cast<int>(query.size(2)),
                                                 static_cast<int>(query.size(1) / num_kv_heads));
}

void paged_attention_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                            int64_t num_seqs, double scale, int64_t num_splits,
                            const c10::optional<at::Tensor>& partial_out,
                            const c10::optional<at::Tensor>& partial_max,
                            const c10::optional<at::Tensor>& partial_sum) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(key_cache.strides() == value_cache.strides(), "K and V caches differ in layout");
  const int64_t tokens = query.size(0), heads = query.size(1), head_dim = query.size(2);
  check_heads(query, "query", tokens, head_dim);
  check_heads(out, "out", tokens, head_dim);
  TORCH_CHECK(out.size(1) == heads, "out must have as many heads as query");
  check_same_dtype(query, out, "out");
  check_same_dtype(query, key_cache, "key_cache");
  check_same_dtype(query, value_cache, "value_cache");
  TORCH_CHECK(key_cache.size(3) == head_dim, "head_dim mismatch between query and cache");
  const int64_t kv_heads = key_cache.size(2);
  TORCH_CHECK(paged_attention_decode_supported(query, kv_heads),
              "paged_attention_decode: no kernel for this dtype/head_dim/GQA ratio");
  // 16-byte loads of q and of every cache row.
  const int64_t vec = 16 / query.element_size();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(query.data_ptr()) % 16 == 0 &&
                  query.stride(0) % vec == 0 && query.stride(1) % vec == 0,
              "query must be 16-byte aligned per head");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(key_cache.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(value_cache.data_ptr()) % 16 == 0 &&
                  key_cache.stride(0) % vec == 0 && key_cache.stride(1) % vec == 0 &&
                  key_cache.stride(2) % vec == 0,
              "KV cache must be 16-byte aligned per head");
  for (const auto* t : {&block_table, &seq_lens, &query_start_loc}) {
    check_cuda(*t, "metadata");
    TORCH_CHECK(t->scalar_type() == at::kInt, "block_table/seq_lens/query_start_loc must be int32");
  }
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1, "block_table must be 2-D");
  TORCH_CHECK(seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "seq_lens/query_start_loc must be contiguous");
  TORCH_CHECK(num_seqs <= seq_lens.size(0) && num_seqs + 1 <= query_start_loc.size(0) &&
                  num_seqs <= block_table.size(0),
              "num_seqs exceeds the metadata");
  TORCH_CHECK(num_splits >= 1, "num_splits must be >= 1");

  tidal::PagedDecodeArgs args{};
  args.dtype = dtype_of(query);
  args.out = out.data_ptr();
  args.out_stride_tok = out.stride(0);
  args.out_stride_head = out.stride(1);
  args.query = query.data_ptr();
  args.q_stride_tok = query.stride(0);
  args.q_stride_head = query.stride(1);
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.kv_stride_blk = key_cache.stride(0);
  args.kv_stride_tok = key_cache.stride(1);
  args.kv_stride_head = key_cache.stride(2);
  args.block_table = block_table.data_ptr<int32_t>();
  args.block_table_stride = block_table.stride(0);
  args.seq_lens = seq_lens.data_ptr<int32_t>();
  args.query_start_loc = query_start_loc.data_ptr<int32_t>();
  args.num_seqs = static_cast<int>(num_seqs);
  args.num_heads = static_cast<int>(heads);
  args.num_kv_heads = static_cast<int>(kv_heads);
  args.head_dim = static_cast<int>(head_dim);
  args.block_size = static_cast<int>(key_cache.size(1));
  args.scale = static_cast<float>(scale);
  args.num_splits = static_cast<int>(num_splits);
  if (num_splits > 1) {
    TORCH_CHECK(partial_out.has_value() && partial_max.has_value() && partial_sum.has_value(),
                "num_splits > 1 needs the partial buffers");
    const int64_t need = tokens * heads * num_splits;
    for (const auto* t : {&*partial_out, &*partial_max, &*partial_sum}) {
      check_cuda(*t, "partial buffer");
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                  "partial buffers must be contiguous float32");
    }
    TORCH_CHECK(partial_out->numel() >= need * head_dim && partial_max->numel() >= need &&
                    partial_sum->numel() >= need,
                "partial buffers too small");
    args.partial_out = partial_out->data_ptr<float>();
    args.partial_max = partial_max->data_ptr<float>();
    args.partial_sum = partial_sum->data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(query.device());
  check_launch(tidal::launch_paged_attention_decode(args, current_stream(query)),
               "paged_attention_decode");
}

// The group of input k is k >> (this) for `groups` scale columns of `group_size` inputs over
// k: one group over all of K (30), or a power of two from `min_group`.
int group_shift_of(int64_t group_size, int64_t groups, int64_t k, int64_t min_group) {
  TORCH_CHECK(group_size > 0 && groups * group_size >= k, "group_size ", num(group_size),
              " and ", num(groups), " groups do not cover ", num(k));
  if (group_size >= k) return 30;
  TORCH_CHECK(group_size >= min_group && (group_size & (group_size - 1)) == 0,
              "group_size must be a power of two >= ", num(min_group),
              " (or cover all of K), got ", num(group_size));
  int shift = 0;
  while ((int64_t{1} << shift) < group_size) ++shift;
  return shift;
}

// out [m, n] = x [m, k] @ w.T on the few-row tensor-core product (skinny_gemm.cu). `format`:
// 0 a weight of x's dtype [rows, k]; 1 e4m3 [rows, k] with float32 `w_scale` [rows]; 2 INT4 in
// tidal's layout, int32 [rows, k / 8] with `scales` (x's dtype) and uint8 `zeros` [rows, G];
// 3 e4m3 [rows, k] with float32 `scales` [rows, G] per row and group of `group_size` inputs
// (block-wise FP8, weight-only here).
// `act` 1 / 2: rows = 2 n ([gate; up]) and out = SiLU / tanh-GELU(gate) * up. `pdl`: launched
// as a programmatic dependent of the stream's previous kernel (compute capability >= 9.0).
void skinny_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, int64_t format,
                 const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& w_scale,
                 const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& zeros,
                 int64_t group_size, int64_t act, int64_t tiles, int64_t warps, int64_t unroll,
                 bool pdl) {
  check_cuda(x, "x");
  check_cuda(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D, contiguous in its last dim");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1 && m <= 8, "skinny_gemm takes 1 to 8 rows, got ", num(m));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x must be bfloat16 or float16");
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1, "w must be 2-D, contiguous in its last dim");
  TORCH_CHECK(act >= 0 && act <= 2, "act must be 0, 1 or 2");
  const int64_t rows = w.size(0);
  const int64_t n = act != 0 ? rows / 2 : rows;
  TORCH_CHECK(act == 0 || rows % 2 == 0, "a gated weight needs an even number of rows");
  tidal::SkinnyGemmArgs a{};
  switch (format) {
    case 0:
      check_same_dtype(x, w, "w");
      TORCH_CHECK(w.size(1) == k, "w has ", num(w.size(1)), " columns, x ", num(k));
      a.format = tidal::SkinnyFormat::kW16;
      break;
    case 1:
      TORCH_CHECK(w.scalar_type() == at::kFloat8_e4m3fn, "format 1 needs an e4m3 weight");
      TORCH_CHECK(w.size(1) == k, "w has ", num(w.size(1)), " columns, x ", num(k));
      TORCH_CHECK(w_scale.has_value() && w_scale->is_cuda() &&
                      w_scale->scalar_type() == at::kFloat && w_scale->is_contiguous() &&
                      w_scale->numel() == rows,
                  "format 1 needs a contiguous float32 w_scale of ", num(rows), " values");
      a.format = tidal::SkinnyFormat::kFp8;
      a.w_scale = w_scale->data_ptr<float>();
      break;
    case 2: {
      TORCH_CHECK(w.scalar_type() == at::kInt && w.size(1) * 8 == k,
                  "format 2 needs an int32 weight of k / 8 columns");
      TORCH_CHECK(scales.has_value() && zeros.has_value(), "format 2 needs scales and zeros");
      check_same_dtype(x, *scales, "scales");
      TORCH_CHECK(zeros->scalar_type() == at::kByte, "zeros must be uint8");
      TORCH_CHECK(scales->dim() == 2 && zeros->dim() == 2 && scales->size(0) == rows &&
                      zeros->size(0) == rows && scales->size(1) == zeros->size(1) &&
                      scales->stride(1) == 1 && zeros->stride(1) == 1 &&
                      scales->stride(0) == zeros->stride(0),
                  "scales and zeros must be [rows, groups] with one row stride");
      a.format = tidal::SkinnyFormat::kInt4;
      a.scales = scales->data_ptr();
      a.zeros = zeros->data_ptr<uint8_t>();
      a.group_stride = scales->stride(0);
      a.group_shift = group_shift_of(group_size, scales->size(1), k, 32);
      break;
    }
    case 3: {
      TORCH_CHECK(w.scalar_type() == at::kFloat8_e4m3fn, "format 3 needs an e4m3 weight");
      TORCH_CHECK(w.size(1) == k, "w has ", num(w.size(1)), " columns, x ", num(k));
      TORCH_CHECK(scales.has_value() && scales->is_cuda() &&
                      scales->scalar_type() == at::kFloat && scales->dim() == 2 &&
                      scales->size(0) == rows && scales->stride(1) == 1,
                  "format 3 needs float32 scales [", num(rows), ", groups]");
      a.format = tidal::SkinnyFormat::kFp8Groups;
      a.scales = scales->data_ptr();
      a.group_stride = scales->stride(0);
      a.group_shift = group_shift_of(group_size, scales->size(1), k, 64);
      break;
    }
    default:
      TORCH_CHECK(false, "unknown weight format ", num(format));
  }
  check_rows(out, "out", m, n);
  check_same_dtype(x, out, "out");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && (x.stride(0) * 2) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 &&
                  (w.stride(0) * w.element_size()) % 16 == 0,
              "x and w rows must be 16-byte aligned");
  if (bias.has_value()) {
    TORCH_CHECK(act == 0, "bias with a gated weight is not supported");
    check_same_dtype(x, *bias, "bias");
    TORCH_CHECK(bias->is_cuda() && bias->is_contiguous() && bias->numel() == n,
                "bias must be contiguous [n]");
    a.bias = bias->data_ptr();
  }
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.m = static_cast<int>(m);
  a.w = w.data_ptr();
  a.w_stride = w.stride(0) * w.element_size();
  a.n = n;
  a.k = k;
  a.out = out.data_ptr();
  a.out_stride = out.stride(0);
  a.act = static_cast<int>(act);
  if (pdl) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.get_device());
    TORCH_CHECK(major >= 9, "pdl needs compute capability 9.0 or more");
    a.pdl = 1;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(tidal::launch_skinny_gemm(dtype_of(x), a, static_cast<int>(tiles),
                                         static_cast<int>(warps), static_cast<int>(unroll),
                                         current_stream(x)),
               "skinny_gemm");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tidal CUDA kernels";
  m.def("rms_norm", &rms_norm, "RMSNorm into out");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual add + RMSNorm");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :d]) * x[:, d:]");
  m.def("rotary_embedding", &rotary_embedding, "rotary embedding of query and key");
  m.def("reshape_and_cache", &reshape_and_cache, "scatter K/V into the paged cache");
  m.def("paged_attention_decode_supported", &paged_attention_decode_supported,
        "whether the decode kernel covers this query dtype/head_dim/GQA ratio");
  m.def("paged_attention_decode", &paged_attention_decode, "flash-decoding over the paged cache");
  m.def("skinny_gemm", &skinny_gemm, "few-row product on tensor cores (16-bit, FP8, INT4 weights)");
}
