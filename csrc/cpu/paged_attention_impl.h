// Paged decode attention. Why a kernel: with torch ops, decode attention over a paged cache first
// gathers every sequence's K/V into a padded copy (read + write + read again by SDPA); at 64
// sequences that gather and the CPU SDPA kernel took ~70 % of a decode step. This reads each K/V
// row once, in place, straight from the block table, with one (sequence, kv-head) pair per task so
// the G query heads sharing a kv head reuse each K row while it is in cache.
// Included once per ISA variant, inside its namespace (variant_*.cpp).

// q . k over D as 16 lane sums added at the end in a fixed order: the lanes are independent, so the
// compiler vectorises the loop without reassociating anything (a plain `s += q[d] * k[d]` is a
// serial chain it may not reorder: it ran ~4x slower), and every variant sums in the same order.
static constexpr int64_t LANE = 16;

template <typename T>
static inline float dot_lanes(const float* __restrict q, const T* __restrict k, int64_t D) {
  float part[LANE] = {};
  int64_t d = 0;
  for (; d + LANE <= D; d += LANE)
    for (int64_t l = 0; l < LANE; ++l) part[l] += q[d + l] * static_cast<float>(k[d + l]);
  for (; d < D; ++d) part[d % LANE] += q[d] * static_cast<float>(k[d]);
  float s = 0.f;
  for (int64_t l = 0; l < LANE; ++l) s += part[l];
  return s;
}

template <typename T>
static void decode_attention(const float* q, const T* k, const T* v, const int64_t* bt, const int64_t* ctx,
                             float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks,
                             int64_t bs, float scale, int64_t window) {
  const int64_t G = H / Hkv;
  // one task per (sequence, kv head), spread over the threads even at batch 1: the K/V rows come
  // from DRAM (a decode step streams ~100 MB of weights between two visits of a layer's cache), and
  // two threads waiting on memory beat one
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += ctx[b];
  const int64_t grain = work * H * D < (1 << 12) ? B * Hkv : 1;
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, hk = task % Hkv;
      const int64_t n = ctx[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      const int64_t len = n - start;
      scores.resize(G * len);
      const float* qb = q + (b * H + hk * G) * D;
      const int64_t* table = bt + b * max_blocks;
      for (int64_t t = start; t < n; ++t) {
        const int64_t slot = table[t / bs] * bs + t % bs;
        const T* kr = k + (slot * Hkv + hk) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * len + (t - start)] = dot_lanes(qb + g * D, kr, D) * scale;
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        float m = sg[0];  // len >= 1
        for (int64_t i = 1; i < len; ++i) m = sg[i] > m ? sg[i] : m;
        float sum = 0.f;
        for (int64_t i = 0; i < len; ++i) { sg[i] = std::exp(sg[i] - m); sum += sg[i]; }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < len; ++i) sg[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = start; t < n; ++t) {
        const int64_t slot = table[t / bs] * bs + t % bs;
        const T* __restrict vr = v + (slot * Hkv + hk) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + (t - start)];
          float* __restrict a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(vr[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D, out + (b * H + hk * G + g) * D);
    }
  });
}
