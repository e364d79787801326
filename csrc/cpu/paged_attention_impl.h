// Paged decode attention. Why a kernel: with torch ops, decode attention over a paged cache first
// gathers every sequence's K/V into a padded copy (read + write + read again by SDPA); at 64
// sequences that gather and the CPU SDPA kernel took ~70 % of a decode step. This reads each K/V
// row once, in place, straight from the block table, with one (sequence, kv-head) pair per task so
// the G query heads sharing a kv head reuse each K row while it is in cache.
// Included once per ISA variant, inside its namespace (variant_*.cpp).

// q . k over D. In registers on AVX2/AVX-512 (16 or 8 lanes, one horizontal sum a dot): a plain
// `s += q[d] * k[d]` is a serial chain the compiler may not reorder, and lane sums kept in an
// array went through memory (a vector store, then scalar reloads stalling on store forwarding).
#if INFERD_ISA_LEVEL >= 1
template <typename T>
static inline float dot_lanes(const float* q, const T* k, int64_t D) {
  VF a = fzero(), b = fzero();  // two chains: a head of 64 is 2 or 4 steps
  int64_t d = 0;
  for (; d + 2 * LANES <= D; d += 2 * LANES) {
    a = ffma(fload(q + d), fload(k + d), a);
    b = ffma(fload(q + d + LANES), fload(k + d + LANES), b);
  }
  for (; d + LANES <= D; d += LANES) a = ffma(fload(q + d), fload(k + d), a);
  float s = fsum(fadd(a, b));
  for (; d < D; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}
#else
template <typename T>
static inline float dot_lanes(const float* q, const T* k, int64_t D) {
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}
#endif

// Keys per task. A sequence's context is cut into chunks of CHUNK keys, each a task over one kv
// head: at batch 1 a 100-token context makes 6 tasks for 2 threads, not 3. Each chunk keeps its own
// running max, sum and weighted values; they are merged per head in chunk order. The cut depends
// only on the sequence's own length, never on the batch, so a row's result does not either.
static constexpr int64_t CHUNK = 64;

template <typename T>
static void decode_attention(const float* q, const T* k, const T* v, const int64_t* bt, const int64_t* ctx,
                             float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks,
                             int64_t bs, float scale, int64_t window) {
  const int64_t G = H / Hkv;
  std::vector<int64_t> first(B + 1, 0);  // each sequence's first chunk
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = window > 0 ? std::max<int64_t>(0, ctx[b] - window) : 0;
    first[b + 1] = first[b] + (ctx[b] - start + CHUNK - 1) / CHUNK;
  }
  const int64_t chunks = first[B];
  // per (chunk, kv head): G maxima, G sums, G x D weighted values
  std::vector<float> part(chunks * Hkv * G * (D + 2));
  // the cache slots of keys t0..t1 of sequence b, walked without a division per key
  auto slots_of = [&](int64_t b, int64_t t0, int64_t t1, int64_t* out) {
    const int64_t* table = bt + b * max_blocks;
    int64_t blk = t0 / bs, off = t0 % bs;
    for (int64_t t = t0; t < t1; ++t) {
      out[t - t0] = table[blk] * bs + off;
      if (++off == bs) off = 0, ++blk;
    }
  };
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += ctx[b];
  const int64_t grain = work * H * D < (1 << 12) ? chunks * Hkv : 1;
  at::parallel_for(0, chunks * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * CHUNK);
    int64_t slot[CHUNK];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task / Hkv, hk = task % Hkv;
      const int64_t b = std::upper_bound(first.begin(), first.end(), c) - first.begin() - 1;
      const int64_t start = window > 0 ? std::max<int64_t>(0, ctx[b] - window) : 0;
      const int64_t t0 = start + (c - first[b]) * CHUNK, t1 = std::min(ctx[b], t0 + CHUNK), len = t1 - t0;
      const float* qb = q + (b * H + hk * G) * D;
      slots_of(b, t0, t1, slot);
      for (int64_t t = t0; t < t1; ++t) {
        const T* kr = k + (slot[t - t0] * Hkv + hk) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * len + (t - t0)] = dot_lanes(qb + g * D, kr, D) * scale;
      }
      float* mx = part.data() + task * G * (D + 2);
      float* sm = mx + G;
      float* acc = sm + G;
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        float m = sg[0];  // len >= 1
        for (int64_t i = 1; i < len; ++i) m = sg[i] > m ? sg[i] : m;
        float sum = 0.f;
        for (int64_t i = 0; i < len; ++i) sg[i] = expf_lanes(sg[i] - m);
        for (int64_t i = 0; i < len; ++i) sum += sg[i];
        mx[g] = m;
        sm[g] = sum;
      }
      std::fill(acc, acc + G * D, 0.f);
      for (int64_t t = t0; t < t1; ++t) {
        const T* __restrict vr = v + (slot[t - t0] * Hkv + hk) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + (t - t0)];
          float* __restrict a = acc + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(vr[d]);
        }
      }
    }
  });
  // merge each (sequence, head)'s chunks in order: rescale to the largest max, divide by the total
  at::parallel_for(0, B * Hkv, grain == 1 ? 1 : B * Hkv, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, hk = task % Hkv;
      auto at = [&](int64_t c) { return part.data() + (c * Hkv + hk) * G * (D + 2); };
      for (int64_t g = 0; g < G; ++g) {
        float m = -INFINITY;
        for (int64_t c = first[b]; c < first[b + 1]; ++c) m = std::max(m, at(c)[g]);
        float* o = out + (b * H + hk * G + g) * D;
        std::fill(o, o + D, 0.f);
        float total = 0.f;
        for (int64_t c = first[b]; c < first[b + 1]; ++c) {
          const float w = expf_lanes(at(c)[g] - m);
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
