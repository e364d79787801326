// The softmax steps the attention kernels share: a row of scores exponentiated against its maximum
// (paged decode's chunks, varlen's rows), and the merge of a head's partial softmaxes over its key
// splits (paged decode's chunks, flash decode's splits). Included once per ISA variant, inside its
// namespace (variant.h), after simd.h (fexp).

// x[i] = exp(x[i] - m) for i < n. In vectors on AVX2 only: there GCC leaves the scalar loop
// unvectorised (the clamps stay branches; AVX-512 has masks for them), and the decode softmax ran
// one exp at a time.
static inline void exp_shifted(float* x, int64_t n, float m) {
  int64_t i = 0;
#if INFERD_ISA_LEVEL == 1
  for (; i + LANES <= n; i += LANES) fstore(x + i, fexp(fsub(fload(x + i), fset1(m))));
#endif
  for (; i < n; ++i) x[i] = fexp(x[i] - m);
}

// One softmax's unnormalised part: s[i] = exp(s[i] - max) over its n scores, the max and the sum
struct SoftmaxPart {
  float max, sum;
};
static inline SoftmaxPart softmax_part(float* s, int64_t n) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = s[i] > m ? s[i] : m;
  exp_shifted(s, n, m);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += s[i];
  return {m, sum};
}

// The order a decode step computes its key splits in (split ids as merge_splits numbers them).
// Rows next to each other whose tables start with the same block read the same keys: the k + 1
// rows of a sequence verifying guesses, or requests over one cached prefix. Taken sequence by
// sequence, each row would stream its whole context from memory again (at 4k tokens the KV of a
// small model is ~90 MB, far past any cache); taken split by split across such a run of rows, a
// split's keys come from memory for its first row and from cache for the others. Each split is the
// same computation in either order, so the result is too.
static std::vector<int64_t> split_order(const std::vector<int64_t>& first, const int64_t* bt, int64_t max_blocks,
                                        int64_t B) {
  std::vector<int64_t> order;
  order.reserve(first[B]);
  for (int64_t b0 = 0, b1; b0 < B; b0 = b1) {
    int64_t most = first[b0 + 1] - first[b0];
    for (b1 = b0 + 1; b1 < B && bt[b1 * max_blocks] == bt[b0 * max_blocks]; ++b1)
      most = std::max(most, first[b1 + 1] - first[b1]);
    for (int64_t c = 0; c < most; ++c)
      for (int64_t b = b0; b < b1; ++b)
        if (first[b] + c < first[b + 1]) order.push_back(first[b] + c);
  }
  return order;
}

// The partial softmaxes of each (sequence, kv head)'s key splits, merged in split order: each split's
// weighted values rescaled to the largest maximum, summed, and divided by the total. Split c of kv
// head hk is a record at part + (c * Hkv + hk) * G * (D + 2): its G heads' maxima, their sums, then
// their G x D weighted values; sequence b has splits first[b] .. first[b + 1] - 1. out [B, H, D].
// `parallel`: one task a (sequence, kv head), else one for all (a step too small to share).
static void merge_splits(const float* part, const std::vector<int64_t>& first, int64_t B, int64_t H, int64_t Hkv,
                         int64_t D, bool parallel, float* out) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, parallel ? 1 : B * Hkv, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, hk = bh % Hkv;
      auto at = [&](int64_t c) { return part + (c * Hkv + hk) * G * (D + 2); };
      for (int64_t g = 0; g < G; ++g) {
        float m = -INFINITY;
        for (int64_t c = first[b]; c < first[b + 1]; ++c) m = std::max(m, at(c)[g]);
        float* o = out + (b * H + hk * G + g) * D;
        std::fill(o, o + D, 0.f);
        float total = 0.f;
        for (int64_t c = first[b]; c < first[b + 1]; ++c) {
          const float w = fexp(at(c)[g] - m);
          total += w * at(c)[G + g];
          const float* a = at(c) + 2 * G + g * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
}
