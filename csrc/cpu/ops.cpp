// The torch ops (torch.ops.inferd.*): shape and dtype checks, then the active kernel variant.
// The fused decode step (fused_decode.cpp) calls the same ops through the dispatcher, so eager and
// fused forwards run the same code.
#include "kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

namespace inferd {
namespace {

using at::Tensor;

void check_norm(const Tensor& x, const Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && x.dtype() == w.dtype());
  TORCH_CHECK(x.size(1) == w.size(0));
  TORCH_CHECK(x.dtype() == at::kFloat || x.dtype() == at::kBFloat16, "float32 or bfloat16 only");
}

Tensor norm(const Tensor& x, const Tensor* d, const Tensor& w, double eps) {
  check_norm(x, w);
  auto out = at::empty_like(x);
  const auto& k = active();
  if (x.dtype() == at::kFloat)
    k.norm_f32(x.data_ptr<float>(), d ? d->data_ptr<float>() : nullptr, out.data_ptr<float>(), w.data_ptr<float>(),
               x.size(0), x.size(1), eps);
  else
    k.norm_bf16(x.data_ptr<bf16>(), d ? d->data_ptr<bf16>() : nullptr, out.data_ptr<bf16>(), w.data_ptr<bf16>(),
                x.size(0), x.size(1), eps);
  return out;
}

Tensor rms_norm(Tensor x, Tensor w, double eps) { return norm(x, nullptr, w, eps); }

// x is updated in place (x += d); returns rms_norm(x).
Tensor add_rms_norm(Tensor x, Tensor d, Tensor w, double eps) {
  TORCH_CHECK(d.is_contiguous() && d.sizes() == x.sizes() && d.dtype() == x.dtype());
  return norm(x, &d, w, eps);
}

// x: [T, H_total, D] view whose first `heads` heads are rotated in place; cos/sin [T, D] float32.
void rope_(Tensor x, int64_t heads, Tensor cos, Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be [T, H, D] with dense rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == at::kFloat);
  const int64_t T = x.size(0), D = x.size(2);
  const auto& k = active();
  if (x.dtype() == at::kFloat)
    k.rope_f32(x.data_ptr<float>(), T, heads, x.stride(0), D, cos.data_ptr<float>(), sin.data_ptr<float>());
  else {
    TORCH_CHECK(x.dtype() == at::kBFloat16, "float32 or bfloat16 only");
    k.rope_bf16(x.data_ptr<bf16>(), T, heads, x.stride(0), D, cos.data_ptr<float>(), sin.data_ptr<float>());
  }
}

Tensor silu_mul(Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0);
  const int64_t rows = gu.size(0), F = gu.size(1) / 2;
  auto out = at::empty({rows, F}, gu.options());
  const auto& k = active();
  if (gu.dtype() == at::kFloat)
    k.silu_mul_f32(gu.data_ptr<float>(), out.data_ptr<float>(), rows, F);
  else {
    TORCH_CHECK(gu.dtype() == at::kBFloat16, "float32 or bfloat16 only");
    k.silu_mul_bf16(gu.data_ptr<bf16>(), out.data_ptr<bf16>(), rows, F);
  }
  return out;
}

// Store this step's keys and values at their cache slots: k_new/v_new [T, Hkv, D] (rows may be
// strided views of the fused qkv output), slots [T] int64, caches [slots, Hkv, D] of the same dtype.
// One call instead of two index_copy_ dispatches per layer.
void write_kv(Tensor k_new, Tensor v_new, Tensor slots, Tensor kc, Tensor vc) {
  TORCH_CHECK(k_new.dim() == 3 && v_new.sizes() == k_new.sizes() && kc.is_contiguous() && vc.is_contiguous());
  TORCH_CHECK(k_new.dtype() == kc.dtype() && v_new.dtype() == kc.dtype() && vc.dtype() == kc.dtype());
  const int64_t T = k_new.size(0), Hkv = k_new.size(1), D = k_new.size(2);
  TORCH_CHECK(kc.size(1) == Hkv && kc.size(2) == D && slots.numel() == T && slots.is_contiguous());
  TORCH_CHECK(k_new.stride(2) == 1 && k_new.stride(1) == D && v_new.stride(2) == 1 && v_new.stride(1) == D,
              "k/v rows must be dense [Hkv, D]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t n = kc.size(0), row = Hkv * D * kc.element_size();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < n, "slot out of range");
  const char* ks = static_cast<const char*>(k_new.data_ptr());
  const char* vs = static_cast<const char*>(v_new.data_ptr());
  char* kd = static_cast<char*>(kc.data_ptr());
  char* vd = static_cast<char*>(vc.data_ptr());
  const int64_t ksb = k_new.stride(0) * k_new.element_size(), vsb = v_new.stride(0) * v_new.element_size();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kd + sl[t] * row, ks + t * ksb, row);
    std::memcpy(vd + sl[t] * row, vs + t * vsb, row);
  }
}

// q [B, H, D] float32; k/v caches [slots, Hkv, D] float32 or bfloat16; block_tables [B, max_blocks]
// int64; ctx_lens [B] int64 (keys 0..ctx-1 are attended; the query is the last of them).
Tensor paged_decode(Tensor q, Tensor k, Tensor v, Tensor block_tables, Tensor ctx_lens, int64_t block_size,
                    double scale, int64_t window) {
  TORCH_CHECK(q.dtype() == at::kFloat && q.is_contiguous(), "q must be contiguous float32");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && block_tables.is_contiguous() && ctx_lens.is_contiguous());
  TORCH_CHECK(k.dtype() == v.dtype(), "K and V caches must share a dtype");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(H % Hkv == 0 && k.size(2) == D);
  auto out = at::empty({B, H, D}, q.options());
  const auto& kn = active();
  if (k.dtype() == at::kFloat) {
    kn.decode_f32(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), block_tables.data_ptr<int64_t>(),
                  ctx_lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, Hkv, D, block_tables.size(1),
                  block_size, static_cast<float>(scale), window);
  } else {
    TORCH_CHECK(k.dtype() == at::kBFloat16, "KV cache must be float32 or bfloat16");
    kn.decode_bf16(q.data_ptr<float>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), block_tables.data_ptr<int64_t>(),
                   ctx_lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, Hkv, D, block_tables.size(1),
                   block_size, static_cast<float>(scale), window);
  }
  return out;
}

// Attention within each sequence of a flat batch (the pooling runner): q [T, H, D], k/v [T, Hkv, D]
// may be views of one fused projection (rows strided, heads and elements contiguous); starts [S + 1]
// int64. Returns [T, H * D] in q's dtype.
Tensor varlen_attention(Tensor q, Tensor k, Tensor v, Tensor starts, double scale, bool causal) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2));
  TORCH_CHECK(q.dtype() == k.dtype() && k.dtype() == v.dtype(), "q, k, v must share a dtype");
  for (const Tensor* x : {&q, &k, &v})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2), "heads and their elements must be contiguous");
  TORCH_CHECK(starts.dtype() == at::kLong && starts.is_contiguous() && starts.dim() == 1 && starts.size(0) >= 1);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), S = starts.size(0) - 1;
  TORCH_CHECK(H % Hkv == 0);
  const int64_t* st = starts.data_ptr<int64_t>();
  TORCH_CHECK(st[0] == 0 && st[S] == T, "starts must run from 0 to the number of rows");
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(st[s + 1] > st[s], "every sequence needs a row");
  auto out = at::empty({T, H * D}, q.options());
  const auto& kn = active();
  if (q.dtype() == at::kFloat) {
    kn.varlen_f32(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), q.stride(0), k.stride(0), v.stride(0),
                  st, S, H, Hkv, D, static_cast<float>(scale), causal, out.data_ptr<float>(), H * D);
  } else {
    TORCH_CHECK(q.dtype() == at::kBFloat16, "float32 or bfloat16 only");
    kn.varlen_bf16(q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), q.stride(0), k.stride(0), v.stride(0),
                   st, S, H, Hkv, D, static_cast<float>(scale), causal, out.data_ptr<bf16>(), H * D);
  }
  return out;
}

// x rounded once per call into scratch owned by the calling thread (a decode step makes ~120
// calls); the pointers are taken here because parallel workers have thread_locals of their own.
struct Rounded { const int8_t* xq; const float* dx; const float* xs; const int32_t* xi; };
Rounded round_input(const Tensor& x, int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  auto xf = x.scalar_type() == at::kFloat && x.is_contiguous() ? x : x.to(at::kFloat).contiguous();
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> dxs;
  thread_local std::vector<int32_t> xi;
  xq.resize(M * K);
  dxs.resize(2 * M * nb);
  xi.resize(M * nb);
  active().quantize_rows(xf.data_ptr<float>(), M, K, xq.data(), dxs.data(), dxs.data() + M * nb, xi.data());
  return {xq.data(), dxs.data(), dxs.data() + M * nb, xi.data()};
}

// sum(xq) per 16 (the GGUF types with 16-weight scales), from the rounded rows
const int32_t* sums16(const int8_t* xq, int64_t M, int64_t K) {
  thread_local std::vector<int32_t> xi16;
  xi16.resize(M * K / 16);
  for (int64_t i = 0; i < M * K / 16; ++i) {
    int32_t s = 0;
    for (int k = 0; k < 16; ++k) s += xq[i * 16 + k];
    xi16[i] = s;
  }
  return xi16.data();
}

// What a test or a benchmark asks to prove the integer GEMMs ran: calls and rows since load.
std::atomic<int64_t> gemm_calls{0}, gemm_rows{0};

// What the kernels do to x, as floats: each 32-block rounded to 255 levels of its largest magnitude.
Tensor fake_quant(Tensor x) {
  auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.numel() / xf.size(-1), K = xf.size(-1), nb = K / 32;
  TORCH_CHECK(K % 32 == 0, "the input size must be a multiple of 32");
  auto xq = at::empty({M, K}, at::kChar);
  auto dx = at::empty({M, nb}, at::kFloat);
  auto xs = at::empty({M, nb}, at::kFloat);
  auto xi = at::empty({M, nb}, at::kInt);
  active().quantize_rows(xf.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), dx.data_ptr<float>(),
                         xs.data_ptr<float>(), xi.data_ptr<int32_t>());
  return (xq.to(at::kFloat).view({M, nb, 32}) * dx.unsqueeze(-1)).view(xf.sizes());
}

// The packed records: uint8 [G / 2, nb * bytes], G / 2 = ceil(N / 32) pairs of 16-column groups,
// `half` bytes a record with fp16 scales, `full` with fp32 ones. Returns whether they are fp16.
bool check_packed(const Tensor& x, const Tensor& w, int64_t N, int64_t half, int64_t full) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "x must be [M, K] with K a multiple of 32");
  const int64_t cells = (N + 31) / 32 * (x.size(1) / 32);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && (w.numel() == cells * half || w.numel() == cells * full),
              "packed weights do not match x and N (repack with inferd.quant.w4a8)");
  return w.numel() == cells * half;
}

Tensor finish(const Tensor& x, Tensor y, int64_t M) {
  gemm_calls.fetch_add(1, std::memory_order_relaxed);
  gemm_rows.fetch_add(M, std::memory_order_relaxed);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// x [M, K] float32 or bfloat16 times packed records (`half` bytes each with fp16 scales, `full` with
// fp32 ones) through the active variant's `gemm` -> [M, N] in x's dtype: one integer GEMM for any M,
// no dequantized copy.
Tensor packed_linear(const Tensor& x, const Tensor& w, int64_t N, int64_t half, int64_t full,
                     decltype(&Kernels::w4a8_gemm) gemm) {
  const bool fp16 = check_packed(x, w, N, half, full);
  const int64_t M = x.size(0), K = x.size(1);
  const Rounded r = round_input(x, M, K);
  auto y = at::empty({M, N}, at::kFloat);
  (active().*gemm)(w.data_ptr<uint8_t>(), fp16, r.xq, r.dx, r.xs, r.xi, M, K, N, y.data_ptr<float>());
  return finish(x, y, M);
}

// int4 codes packed with their scales and mins (inferd.quant.w4a8.pack4)
Tensor w4a8_linear(Tensor x, Tensor w, int64_t N) { return packed_linear(x, w, N, 640, 768, &Kernels::w4a8_gemm); }

// int8 codes packed with one scale per (column, 32-block) (inferd.quant.w4a8.pack8)
Tensor w8a8_linear(Tensor x, Tensor w, int64_t N) { return packed_linear(x, w, N, 1088, 1152, &Kernels::w8a8_gemm); }

// x [M, K] times a GGUF block type's records (inferd.quant.gguf_blocks.pack; `type` a BlockType)
Tensor blocks_linear(Tensor x, Tensor w, int64_t N, int64_t type) {
  TORCH_CHECK(type >= 0 && type < BT_COUNT, "unknown GGUF block type ", type);
  const BlockFormat& f = kBlockFormats[type];
  TORCH_CHECK(x.dim() == 2 && x.size(1) % (32 * block_super(f)) == 0,
              "x must be [M, K] with K a multiple of ", 32 * block_super(f));
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t cells = (N + 31) / 32 * (K / (32 * block_super(f)));
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == cells * block_record(f),
              "packed weights do not match x, N and the block type (repack with inferd.quant.gguf_blocks)");
  const Rounded r = round_input(x, M, K);
  const int32_t* xi16 = f.sub == 16 ? sums16(r.xq, M, K) : nullptr;
  auto y = at::empty({M, N}, at::kFloat);
  active().blocks_gemm(static_cast<int>(type), w.data_ptr<uint8_t>(), r.xq, r.dx, r.xs, r.xi, xi16, M, K, N,
                       y.data_ptr<float>());
  return finish(x, y, M);
}

// x [M, K] float32/bfloat16 times w [N, K] float16 or bfloat16 (a GGUF F16/BF16 tensor, kept in its
// 16 bits) -> [M, N] in x's dtype, computed in fp32: each weight widened exactly, no float32 copy
Tensor half_linear(Tensor x, Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "half_linear: x [M, K] and w [N, K] disagree");
  TORCH_CHECK((w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16) && w.is_contiguous(),
              "half_linear: w must be contiguous float16 or bfloat16");
  TORCH_CHECK(x.size(1) % 16 == 0, "half_linear: the input size must be a multiple of 16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto xf = x.scalar_type() == at::kFloat && x.is_contiguous() ? x : x.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, at::kFloat);
  active().half_gemm(reinterpret_cast<const uint16_t*>(w.data_ptr()), w.scalar_type() == at::kBFloat16,
                     xf.data_ptr<float>(), M, K, N, y.data_ptr<float>());
  return finish(x, y, M);
}

// y [T, N] float32 += each row's LoRA delta: slots [T] int64 (-1: none), a [S, parts, R, K] and b
// [S, R, N] float32 (inferd.model.lora's slot stacks), ranks [S, parts] int64, part_n: each part's
// outputs (summing to N). In place; x [T, K] float32.
void lora_add_(Tensor y, Tensor x, Tensor a, Tensor b, Tensor slots, Tensor ranks, at::IntArrayRef part_n) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_add_: x [T, K] and y [T, N] disagree");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
                  b.scalar_type() == at::kFloat && x.is_contiguous() && y.is_contiguous() && a.is_contiguous() &&
                  b.is_contiguous(), "lora_add_: x, y, a, b must be contiguous float32");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), P = static_cast<int64_t>(part_n.size());
  TORCH_CHECK(a.dim() == 4 && a.size(1) == P && a.size(3) == K, "lora_add_: a must be [slots, parts, rank, K]");
  const int64_t S = a.size(0), R = a.size(2);
  TORCH_CHECK(R <= 256 && K % 16 == 0, "lora_add_: rank <= 256 and K a multiple of 16");
  int64_t total = 0;
  for (int64_t n : part_n) total += n;
  TORCH_CHECK(total == N && b.dim() == 3 && b.size(0) == S && b.size(1) == R && b.size(2) == N,
              "lora_add_: b must be [slots, rank, N] with N the parts' outputs");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T && slots.is_contiguous() &&
                  ranks.scalar_type() == at::kLong && ranks.numel() == S * P && ranks.is_contiguous(),
              "lora_add_: slots [T] and ranks [slots, parts] int64");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* rp = ranks.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] < S, "lora_add_: slot ", sp[t], " of ", S);
  for (int64_t i = 0; i < S * P; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] <= R, "lora_add_: a rank past R");
  active().lora_bgmv(x.data_ptr<float>(), T, K, a.data_ptr<float>(), b.data_ptr<float>(), sp, rp, S, P,
                     part_n.data(), R, y.data_ptr<float>(), N);
}

// Weight-only int8 with one scale per (row, 32-block), Q8_0's form: x [M, K] float32/bfloat16 times
// q [N, K] int8, s [N, K/32] float16 -> [M, N] in x's dtype. Each thread dequantizes a panel of 64 weight
// rows into a buffer of its own (~150 KB at K = 576: L2) and multiplies every row of x by it in one
// GEMM: a step dequantizes each weight once, whatever M is, and never holds a copy of the layer.
Tensor w8_linear(Tensor x, Tensor q, Tensor s) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), nb = K / 32;
  TORCH_CHECK(K % 32 == 0 && q.size(1) == K, "x and the int8 weights disagree on K");
  TORCH_CHECK(s.scalar_type() == at::kHalf && s.is_contiguous() && s.dim() == 2 && s.size(0) == N && s.size(1) == nb);
  auto xf = x.scalar_type() == at::kFloat && x.is_contiguous() ? x : x.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, at::kFloat);
  constexpr int64_t P = 64;
  const int8_t* qp = q.data_ptr<int8_t>();
  const at::Half* sp = s.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + P - 1) / P, 1, [&](int64_t p0, int64_t p1) {
    // per thread, kept between calls: a decode step makes ~120 of them
    thread_local std::vector<float> w, out;
    w.resize(P * K);
    out.resize(M * P);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * P, n = std::min(P, N - n0);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t b = 0; b < nb; ++b) {
          const float d = static_cast<float>(sp[(n0 + r) * nb + b]);
          const int8_t* src = qp + (n0 + r) * K + b * 32;
          float* dst = w.data() + r * K + b * 32;
          for (int j = 0; j < 32; ++j) dst[j] = static_cast<float>(src[j]) * d;
        }
      // inside a parallel region at::mm runs on this thread alone
      auto wt = at::from_blob(w.data(), {n, K}, at::kFloat);
      auto ot = at::from_blob(out.data(), {M, n}, at::kFloat);
      at::mm_out(ot, xf, wt.t());
      for (int64_t i = 0; i < M; ++i) std::memcpy(yp + i * N + n0, out.data() + i * n, n * sizeof(float));
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Per 32-block of w [N, K] (fp32), the fp16 scale whose round-to-nearest int8 codes leave the least
// squared error, among amax / 127 and d / n (n = 1..16) of the block's 16-level spacing d =
// (max - min) / 15; scales whose codes leave int8 do not count, a tie keeps the earlier candidate.
// What inferd.quant.linear._best_block_scale computes with torch ops, one block in registers instead of
// [rows, blocks, 17, 32] temporaries: the whole default model's int8 rewrite in ~2 s, not ~16.
Tensor int8_block_scales(Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) % 32 == 0,
              "int8_block_scales: w must be contiguous float32 [N, K], K a multiple of 32");
  const int64_t blocks = w.numel() / 32;
  Tensor out = at::empty({w.size(0), w.size(1) / 32}, w.options());
  const float* p = w.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, blocks, 1024, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* x = p + b * 32;
      float amax = 0.f, hi = x[0], lo = x[0];
      for (int j = 0; j < 32; ++j) {
        amax = std::max(amax, std::fabs(x[j]));
        hi = std::max(hi, x[j]);
        lo = std::min(lo, x[j]);
      }
      const float d = (hi - lo) / 15.f;
      float best = INFINITY, pick = 0.f;
      for (int c = 0; c <= 16; ++c) {
        const float raw = std::max(c == 0 ? amax / 127.f : d / static_cast<float>(c), 5.9604645e-08f);  // 2^-24
        const float sc = static_cast<float>(c10::Half(raw));
        float err = 0.f;
        bool fits = true;
        for (int j = 0; j < 32; ++j) {
          const float q = std::nearbyint(x[j] / sc);
          fits &= std::fabs(q) <= 127.f;
          const float r = q * sc - x[j];
          err += r * r;
        }
        if (fits && err < best) best = err, pick = sc;
      }
      o[b] = pick;
    }
  });
  return out;
}

std::vector<int64_t> op_gemm_counters() { return {gemm_calls.load(), gemm_rows.load()}; }
std::string op_isa() { return active().name; }
std::string op_select_isa(std::string name) { return select_isa(name); }
std::vector<std::string> op_cpu_features() { return cpu_features(); }
std::vector<std::string> op_runnable_isas() { return runnable_isas(); }

}  // namespace
}  // namespace inferd

TORCH_LIBRARY(inferd, m) {
  using namespace inferd;
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor d, Tensor w, float eps) -> Tensor", &add_rms_norm);
  m.def("rope_(Tensor(a!) x, int heads, Tensor cos, Tensor sin) -> ()", &rope_);
  m.def("silu_mul(Tensor gu) -> Tensor", &silu_mul);
  m.def("write_kv(Tensor k_new, Tensor v_new, Tensor slots, Tensor(a!) kc, Tensor(b!) vc) -> ()", &write_kv);
  m.def("paged_decode(Tensor q, Tensor k, Tensor v, Tensor block_tables, Tensor ctx_lens, int block_size, "
        "float scale, int window) -> Tensor", &paged_decode);
  m.def("varlen_attention(Tensor q, Tensor k, Tensor v, Tensor starts, float scale, bool causal) -> Tensor",
        &varlen_attention);
  m.def("w4a8_linear(Tensor x, Tensor w, int N) -> Tensor", &w4a8_linear);
  m.def("w8a8_linear(Tensor x, Tensor w, int N) -> Tensor", &w8a8_linear);
  m.def("blocks_linear(Tensor x, Tensor w, int N, int type) -> Tensor", &blocks_linear);
  m.def("half_linear(Tensor x, Tensor w) -> Tensor", &half_linear);
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor slots, Tensor ranks, int[] part_n) -> ()",
        &lora_add_);
  m.def("w8_linear(Tensor x, Tensor q, Tensor s) -> Tensor", &w8_linear);
  m.def("gemm_counters() -> int[]", &op_gemm_counters);
  m.def("fake_quant(Tensor x) -> Tensor", &fake_quant);
  m.def("int8_block_scales(Tensor w) -> Tensor", &int8_block_scales);
  // the kernel variant: which one runs, which this CPU could run, and the features that decide it
  m.def("isa() -> str", &op_isa);
  m.def("select_isa(str name) -> str", &op_select_isa);
  m.def("cpu_features() -> str[]", &op_cpu_features);
  m.def("runnable_isas() -> str[]", &op_runnable_isas);
}
