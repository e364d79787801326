// Attention over a flat batch of whole sequences, without a KV cache (the pooling runner: an
// encoder's bidirectional attention, or a decoder's causal one for embeddings). Why a kernel: with
// torch ops each sequence's q/k/v rows are gathered into a padded copy per length bucket and the
// result scattered back (two copies of every row, each layer), or SDPA is called once per
// sequence; at 64 short sequences either cost more than the layer's matmuls. This reads q, k, v in
// place from the fused projection's output (row-strided views) and writes each output row once.
// One task per (sequence, head, block of queries): the block's keys and values (one head of one
// sequence, at most a few tens of KB) stay in cache across its queries.
// Included once per ISA variant, inside its namespace (variant_*.cpp), after softmax_impl.h.

static constexpr int64_t VARLEN_QBLOCK = 16;

template <typename T>
static void varlen_attention(const T* q, const T* k, const T* v, int64_t q_stride, int64_t k_stride, int64_t v_stride,
                             const int64_t* starts, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale,
                             bool causal, T* out, int64_t out_stride) {
  const int64_t G = H / Hkv;
  std::vector<int64_t> first(S + 1, 0);  // each sequence's first task
  for (int64_t s = 0; s < S; ++s)
    first[s + 1] = first[s] + H * ((starts[s + 1] - starts[s] + VARLEN_QBLOCK - 1) / VARLEN_QBLOCK);
  at::parallel_for(0, first[S], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(D), acc(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
      const int64_t r = task - first[s], h = r % H, blk = r / H, hk = h / G;
      const int64_t s0 = starts[s], len = starts[s + 1] - s0;
      const int64_t i1 = std::min(len, (blk + 1) * VARLEN_QBLOCK);
      scores.resize(len);
      for (int64_t i = blk * VARLEN_QBLOCK; i < i1; ++i) {
        const T* qr = q + (s0 + i) * q_stride + h * D;
        for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(qr[d]);
        const int64_t n = causal ? i + 1 : len;
        for (int64_t j = 0; j < n; ++j) scores[j] = dot_lanes(qf.data(), k + (s0 + j) * k_stride + hk * D, D) * scale;
        const float sum = softmax_part(scores.data(), n).sum;
        std::fill(acc.begin(), acc.end(), 0.f);
        float* a = acc.data();
        for (int64_t j = 0; j < n; ++j) {
          const T* vr = v + (s0 + j) * v_stride + hk * D;
          const float p = scores[j];
          int64_t d = 0;
#if INFERD_ISA_LEVEL >= 1
          const VF w = fset1(p);
          for (; d + LANES <= D; d += LANES) fstore(a + d, ffma(w, fload(vr + d), fload(a + d)), LANES);
#endif
          for (; d < D; ++d) a[d] += p * static_cast<float>(vr[d]);
        }
        const float inv = 1.f / sum;
        T* o = out + (s0 + i) * out_stride + h * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(a[d] * inv);
      }
    }
  });
}
