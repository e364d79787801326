// Paged decode attention. Why a kernel: with torch ops, decode attention over a paged cache first
// gathers every sequence's K/V into a padded copy (read + write + read again by SDPA); at 64
// sequences that gather and the CPU SDPA kernel took ~70 % of a decode step. This reads each K/V
// row once, in place, straight from the block table, with one (sequence, kv-head) pair per task so
// the G query heads sharing a kv head reuse each K row while it is in cache.
// Included once per ISA variant, inside its namespace (variant_*.cpp).

// scores[g][t] = scale * q_g . k_t for the chunk's keys, each of the G heads of kv head hk. On AVX-512
// with D = 64 or 128, 16 keys at a time: their 16 product vectors are summed across lanes together
// (simd.h's fsum_each), the rest one dot at a time.
#if INFERD_ISA_LEVEL >= 2
template <int NV, typename T>
static int64_t score16(const float* qb, const T* k, const int64_t* slot, int64_t len, int64_t Hkv, int64_t hk,
                       int64_t G, float scale, float* scores) {
  constexpr int64_t D = NV * LANES;
  int64_t t = 0;
  for (; t + 16 <= len; t += 16)
    for (int64_t g = 0; g < G; ++g) {
      VF q[NV], a[16];
      for (int j = 0; j < NV; ++j) q[j] = fload(qb + g * D + j * LANES);
      for (int i = 0; i < 16; ++i) {
        const T* kr = k + (slot[t + i] * Hkv + hk) * D;
        VF d = fmul(q[0], fload(kr));
        for (int j = 1; j < NV; ++j) d = ffma(q[j], fload(kr + j * LANES), d);
        a[i] = d;
      }
      fstore(scores + g * len + t, fmul(fsum_each(a), fset1(scale)));
    }
  return t;
}
#endif

#if INFERD_ISA_LEVEL == 1
// 8 keys at a time on AVX2 (D = 64 or 128), likewise
template <int NV, typename T>
static int64_t score8(const float* qb, const T* k, const int64_t* slot, int64_t len, int64_t Hkv, int64_t hk,
                      int64_t G, float scale, float* scores) {
  constexpr int64_t D = NV * LANES;
  int64_t t = 0;
  for (; t + 8 <= len; t += 8)
    for (int64_t g = 0; g < G; ++g) {
      const float* q = qb + g * D;
      VF a[8];
      for (int i = 0; i < 8; ++i) {
        const T* kr = k + (slot[t + i] * Hkv + hk) * D;
        VF d0 = fmul(fload(q), fload(kr)), d1 = fmul(fload(q + LANES), fload(kr + LANES));
        for (int j = 2; j < NV; j += 2) {
          d0 = ffma(fload(q + j * LANES), fload(kr + j * LANES), d0);
          d1 = ffma(fload(q + (j + 1) * LANES), fload(kr + (j + 1) * LANES), d1);
        }
        a[i] = fadd(d0, d1);
      }
      fstore(scores + g * len + t, fmul(fsum_each(a), fset1(scale)));
    }
  return t;
}
#endif

template <typename T>
static void score_keys(const float* qb, const T* k, const int64_t* slot, int64_t len, int64_t Hkv, int64_t hk,
                       int64_t G, int64_t D, float scale, float* scores) {
  int64_t t = 0;
#if INFERD_ISA_LEVEL >= 2
  if (D == 4 * LANES) t = score16<4>(qb, k, slot, len, Hkv, hk, G, scale, scores);
  else if (D == 8 * LANES) t = score16<8>(qb, k, slot, len, Hkv, hk, G, scale, scores);
#elif INFERD_ISA_LEVEL == 1
  if (D == 8 * LANES) t = score8<8>(qb, k, slot, len, Hkv, hk, G, scale, scores);
  else if (D == 16 * LANES) t = score8<16>(qb, k, slot, len, Hkv, hk, G, scale, scores);
#endif
  for (; t < len; ++t) {
    const T* kr = k + (slot[t] * Hkv + hk) * D;
    for (int64_t g = 0; g < G; ++g) scores[g * len + t] = dot_lanes(qb + g * D, kr, D) * scale;
  }
}

// acc[g] = sum over the chunk's keys t of p[g][t] * v_t, for each of the G heads of kv head hk. With
// vectors, a head's D values stay in registers across the keys (NV vectors: D = 64 or 128); a
// plain loop kept them in memory, a load and a store per element and key.
#if INFERD_ISA_LEVEL >= 1
template <int NV, typename T>
static void weigh_values_nv(const T* v, const int64_t* slot, int64_t len, int64_t Hkv, int64_t hk, int64_t G,
                            const float* p, float* acc) {
  constexpr int64_t D = NV * LANES;
  for (int64_t g = 0; g < G; ++g) {
    VF a[NV];
    for (int j = 0; j < NV; ++j) a[j] = fzero();
    const float* pg = p + g * len;
    for (int64_t t = 0; t < len; ++t) {
      const T* vr = v + (slot[t] * Hkv + hk) * D;
      const VF w = fset1(pg[t]);
      for (int j = 0; j < NV; ++j) a[j] = ffma(w, fload(vr + j * LANES), a[j]);
    }
    for (int j = 0; j < NV; ++j) fstore(acc + g * D + j * LANES, a[j], LANES);
  }
}
#endif

template <typename T>
static void weigh_values(const T* v, const int64_t* slot, int64_t len, int64_t Hkv, int64_t hk, int64_t G, int64_t D,
                         const float* p, float* acc) {
#if INFERD_ISA_LEVEL >= 1
  if (D == 4 * LANES) return weigh_values_nv<4>(v, slot, len, Hkv, hk, G, p, acc);
  if (D == 8 * LANES) return weigh_values_nv<8>(v, slot, len, Hkv, hk, G, p, acc);
#endif
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const T* __restrict vr = v + (slot[t] * Hkv + hk) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float pt = p[g * len + t];
      float* __restrict a = acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] += pt * static_cast<float>(vr[d]);
    }
  }
}

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
  // kept between calls: at batch 32 this is ~150 KB, which malloc maps fresh (and the kernel
  // zero-fills page by page) every call; every task writes its own part whole
  static thread_local std::vector<float> part_buf;  // (the caller's: the tasks below get a pointer)
  part_buf.resize(std::max<size_t>(part_buf.size(), chunks * Hkv * G * (D + 2)));
  float* const part = part_buf.data();
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
  // one task a chunk, all its kv heads: a slot's heads are adjacent in the cache, so the chunk's
  // slots (64 x every head, 48 KB in fp32) come from memory once, whole and in order, and stay in
  // cache for the other heads (one task a kv head read a third of each slot, on either core)
  const std::vector<int64_t> order = split_order(first, bt, max_blocks, B);
  at::parallel_for(0, chunks, grain == 1 ? 1 : chunks, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * CHUNK);
    int64_t slot[CHUNK];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = order[i];
      const int64_t b = std::upper_bound(first.begin(), first.end(), c) - first.begin() - 1;
      const int64_t start = window > 0 ? std::max<int64_t>(0, ctx[b] - window) : 0;
      const int64_t t0 = start + (c - first[b]) * CHUNK, t1 = std::min(ctx[b], t0 + CHUNK), len = t1 - t0;
      slots_of(b, t0, t1, slot);
      for (int64_t hk = 0; hk < Hkv; ++hk) {
        const int64_t task = c * Hkv + hk;
        const float* qb = q + (b * H + hk * G) * D;
        score_keys(qb, k, slot, len, Hkv, hk, G, D, scale, scores.data());
        float* mx = part + task * G * (D + 2);
        float* sm = mx + G;
        float* acc = sm + G;
        for (int64_t g = 0; g < G; ++g) {
          const SoftmaxPart sp = softmax_part(scores.data() + g * len, len);
          mx[g] = sp.max;
          sm[g] = sp.sum;
        }
        weigh_values(v, slot, len, Hkv, hk, G, D, scores.data(), acc);
      }
    }
  });
  merge_splits(part, first, B, H, Hkv, D, grain == 1, out);
}
