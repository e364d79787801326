// The torch ops of the attention that reads the paged KV cache in place (flash_attention_impl.h):
// shape, dtype and bounds checks, then the active kernel variant, and the counters that prove which
// path ran. A fragment of the `inferd` library (ops.cpp defines it): these ops live beside the older
// decode kernel's, not inside its file.
#include "kernels.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

namespace inferd {
namespace {

using at::Tensor;

// since load: prefill calls, their (query tile x key tile) products, split-decode calls, their splits,
// and K/V rows quantized into an int8 cache
std::atomic<int64_t> prefill_calls{0}, prefill_tiles{0}, decode_calls{0}, decode_splits{0}, q8_rows{0};

// 0 float32, 1 bf16, 2 int8 rows of head_dim codes and their fp16 scales (int8_row)
int cache_kind(const Tensor& c, int64_t D) {
  TORCH_CHECK(c.dim() == 3 && c.is_contiguous(), "a KV cache layer must be contiguous [slots, kv_heads, row]");
  switch (c.scalar_type()) {
    case at::kFloat:
      TORCH_CHECK(c.size(2) == D, "the float32 cache's rows are not head_dim long");
      return 0;
    case at::kBFloat16:
      TORCH_CHECK(c.size(2) == D, "the bfloat16 cache's rows are not head_dim long");
      return 1;
    case at::kChar:
      TORCH_CHECK(c.size(2) == int8_row(D),
                  "an int8 cache row is head_dim codes and an fp16 scale per 32 (head_dim + 2 ceil(head_dim / 32) bytes)");
      return 2;
    default:
      TORCH_CHECK(false, "the KV cache must be float32, bfloat16 or int8");
  }
}

void check_tables(const Tensor& bt, int64_t rows, int64_t num_blocks, const int64_t* need, int64_t bs) {
  TORCH_CHECK(bt.scalar_type() == at::kLong && bt.dim() == 2 && bt.is_contiguous() && bt.size(0) == rows,
              "block_tables must be contiguous int64 [sequences, max_blocks]");
  const int64_t* p = bt.data_ptr<int64_t>();
  const int64_t mb = bt.size(1);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(need[r] >= 1 && need[r] <= mb * bs, "a sequence's keys do not fit its block table");
    for (int64_t j = 0; j < (need[r] + bs - 1) / bs; ++j)
      TORCH_CHECK(p[r * mb + j] >= 0 && p[r * mb + j] < num_blocks, "a block table names a block the cache lacks");
  }
}

// Quantize this step's keys and values into an int8 cache at their slots: k_new/v_new [T, Hkv, D]
// float32 or bfloat16 (rows may be strided views of the qkv output), caches int8 [slots, Hkv, int8_row(D)].
void write_kv_q8(Tensor k_new, Tensor v_new, Tensor slots, Tensor kc, Tensor vc) {
  TORCH_CHECK(k_new.dim() == 3 && v_new.sizes() == k_new.sizes() && k_new.dtype() == v_new.dtype());
  TORCH_CHECK(k_new.scalar_type() == at::kFloat || k_new.scalar_type() == at::kBFloat16,
              "new keys and values must be float32 or bfloat16");
  const int64_t T = k_new.size(0), Hkv = k_new.size(1), D = k_new.size(2);
  TORCH_CHECK(kc.scalar_type() == at::kChar && vc.scalar_type() == at::kChar && kc.is_contiguous() &&
                  vc.is_contiguous() && kc.sizes() == vc.sizes() && kc.size(1) == Hkv && kc.size(2) == int8_row(D),
              "the int8 caches must be contiguous [slots, kv_heads, head_dim + 2 ceil(head_dim / 32)]");
  TORCH_CHECK(k_new.stride(2) == 1 && k_new.stride(1) == D && v_new.stride(2) == 1 && v_new.stride(1) == D,
              "k/v rows must be dense [Hkv, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < kc.size(0), "slot out of range");
  active().quantize_kv(k_new.scalar_type() == at::kBFloat16, k_new.data_ptr(), k_new.stride(0), v_new.data_ptr(),
                       v_new.stride(0), sl, T, Hkv, D, kc.data_ptr<int8_t>(), vc.data_ptr<int8_t>());
  q8_rows.fetch_add(T * Hkv, std::memory_order_relaxed);
}

void check_q(const Tensor& q, int64_t Hkv) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float32 [rows, heads, head_dim] with dense rows");
  TORCH_CHECK(q.size(1) % Hkv == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) % 16 == 0, "head_dim must be a multiple of 16");
}

// Prefill attention tiled over the sequences' own KV blocks: q [T, H, D] float32 (row stride free),
// caches [slots, Hkv, row] (float32, bfloat16 or int8), per sequence its block table row, first
// position, query count and first row of q; out [T, H, D] float32, written at those rows only.
void paged_prefill(Tensor q, Tensor k, Tensor v, Tensor block_tables, Tensor starts, Tensor lens, Tensor qrows,
                   int64_t block_size, double scale, int64_t window, double softcap, Tensor out) {
  const int64_t Hkv = k.size(1), H = q.size(1), D = q.size(2), T = q.size(0);
  check_q(q, Hkv);
  const int kind = cache_kind(k, D);
  TORCH_CHECK(cache_kind(v, D) == kind && v.sizes() == k.sizes(), "K and V caches must agree");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3 && out.size(0) == T &&
                  out.size(1) == H && out.size(2) == D, "out must be contiguous float32 [T, H, D]");
  for (const Tensor* t : {&starts, &lens, &qrows})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, "starts, lens, qrows: int64 [S]");
  const int64_t S = starts.numel();
  TORCH_CHECK(lens.numel() == S && qrows.numel() == S);
  const int64_t *st = starts.data_ptr<int64_t>(), *ln = lens.data_ptr<int64_t>(), *qr = qrows.data_ptr<int64_t>();
  std::vector<int64_t> ctx(S);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(st[s] >= 0 && ln[s] >= 1 && qr[s] >= 0 && qr[s] + ln[s] <= T, "a sequence's rows are outside q");
    ctx[s] = st[s] + ln[s];
  }
  TORCH_CHECK(block_size >= 1 && k.size(0) % block_size == 0);
  check_tables(block_tables, S, k.size(0) / block_size, ctx.data(), block_size);
  const int64_t tiles = active().prefill_attention(
      kind, q.data_ptr<float>(), q.stride(0), k.data_ptr(), v.data_ptr(), block_tables.data_ptr<int64_t>(), st, ln, qr,
      out.data_ptr<float>(), S, H, Hkv, D, block_tables.size(1), block_size, static_cast<float>(scale), window,
      static_cast<float>(softcap));
  prefill_calls.fetch_add(1, std::memory_order_relaxed);
  prefill_tiles.fetch_add(tiles, std::memory_order_relaxed);
}

// One query a sequence over the paged cache, each sequence's keys split into tasks merged per head:
// q [B, H, D] float32; ctx_lens [B] (keys 0 .. ctx - 1, the query the last of them) -> [B, H, D].
Tensor paged_decode_split(Tensor q, Tensor k, Tensor v, Tensor block_tables, Tensor ctx_lens, int64_t block_size,
                          double scale, int64_t window, double softcap) {
  const int64_t Hkv = k.size(1), B = q.size(0), H = q.size(1), D = q.size(2);
  check_q(q, Hkv);
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
  const int kind = cache_kind(k, D);
  TORCH_CHECK(cache_kind(v, D) == kind && v.sizes() == k.sizes(), "K and V caches must agree");
  TORCH_CHECK(ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous() && ctx_lens.numel() == B);
  TORCH_CHECK(block_size >= 1 && k.size(0) % block_size == 0);
  check_tables(block_tables, B, k.size(0) / block_size, ctx_lens.data_ptr<int64_t>(), block_size);
  auto out = at::empty({B, H, D}, q.options());
  const int64_t splits = active().split_decode(
      kind, q.data_ptr<float>(), k.data_ptr(), v.data_ptr(), block_tables.data_ptr<int64_t>(),
      ctx_lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, Hkv, D, block_tables.size(1), block_size,
      static_cast<float>(scale), window, static_cast<float>(softcap));
  decode_calls.fetch_add(1, std::memory_order_relaxed);
  decode_splits.fetch_add(splits, std::memory_order_relaxed);
  return out;
}

std::vector<int64_t> attention_counters() {
  return {prefill_calls.load(), prefill_tiles.load(), decode_calls.load(), decode_splits.load(), q8_rows.load()};
}

}  // namespace
}  // namespace inferd

TORCH_LIBRARY_FRAGMENT(inferd, m) {
  using namespace inferd;
  m.def("write_kv_q8(Tensor k_new, Tensor v_new, Tensor slots, Tensor(a!) kc, Tensor(b!) vc) -> ()", &write_kv_q8);
  m.def("paged_prefill(Tensor q, Tensor k, Tensor v, Tensor block_tables, Tensor starts, Tensor lens, Tensor qrows, "
        "int block_size, float scale, int window, float softcap, Tensor(a!) out) -> ()", &paged_prefill);
  m.def("paged_decode_split(Tensor q, Tensor k, Tensor v, Tensor block_tables, Tensor ctx_lens, int block_size, "
        "float scale, int window, float softcap) -> Tensor", &paged_decode_split);
  // prefill calls, prefill tiles, split-decode calls, decode splits, int8 rows written
  m.def("attention_counters() -> int[]", &attention_counters);
}
