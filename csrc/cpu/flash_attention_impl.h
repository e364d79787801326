// Attention that reads the paged KV cache in place, at any context length, over float32, bf16 or
// int8 cache rows.
//
// Why: prefill attention used to gather every key and value of the context into a padded copy and
// build a [queries x keys] mask per group, once per chunk and layer: a 32k-token prompt in 512-token
// chunks copied the whole context 64 times a layer, and the masks grew with the square of its
// length. Here a chunk's queries walk the sequence's own blocks tile by tile with an online softmax
// (flash attention): the working set is one tile of keys and values and the chunk's running
// output, whatever the context's length; causality, sliding windows and Gemma's soft-capping are
// computed per tile. A decode (one query a sequence) cuts its keys into splits of SPLIT keys that
// run as separate tasks and are merged (flash-decoding), so one long sequence uses every core.
//
// The int8 rows ("q8"): one (slot, kv head) row is head_dim signed codes followed by one fp16
// scale per 32 values (q8_0's granularity; the last group shorter where head_dim is not a multiple
// of 32), value = code * scale (amax / 127 of its 32): 1 + 1 / 16 bytes a value, 1.88x bf16's tokens
// in the same memory. A scale per row let one outlier coarsen the whole head (Gemma 3 270M: mean KL
// 0.0075 against bf16). Keys and values are quantized once, when written (quantize_kv), and read in
// place: a tile is widened into a small fp32 scratch with its scales folded in, never the cache.
//
// The layout of the prefill work ("queries in lanes"): a task is one sequence's tile of query
// positions x the G query heads of one kv head, M = positions x G columns. The scaled queries are
// transposed once per task into qt [D][M]; each key tile's scores are computed as st [keys][M]
// (a key's elements broadcast, M columns in vector lanes), so the softmax's per-query maxima and
// sums are plain vector maxima and sums down the rows, the causal and window masks are a prefix and
// a suffix of each row, and P . V accumulates into ot [D][M] the same way. No transpose of a key or
// value tile is ever needed.
//
// Written once over simd.h's VF (one float on the generic variant). Included once per ISA variant,
// inside its namespace (variant.h), after softmax_impl.h (the split merge).

// lanes still at -inf (a query that has seen no key yet) shift by 0, so exp never meets -inf - -inf
// (-inf is the one float below the lowest finite one)
static inline VF finite_or_zero(VF m) { return fselect_lt(m, -3.40282347e+38f, fzero(), m); }

// cap * tanh(x / cap) on a VF. tanh from exp for |t| >= 0.25, where 1 - e^-2|t| loses nothing that
// matters; below, its odd series to t^7 (error under 1e-7 relative), where that subtraction would
static inline VF softcap_lanes(VF x, float cap) {
  const VF t = fmul(x, fset1(1.f / cap));
  const VF a = fabs(t);
  const VF e = fexp_or_zero(fmul(a, fset1(-2.f)));
  const VF big = fcopysign(fdiv(fsub(fset1(1.f), e), fadd(fset1(1.f), e)), t);
  const VF t2 = fmul(t, t);
  VF s = ffma(t2, fset1(-17.f / 315.f), fset1(2.f / 15.f));
  s = ffma(t2, s, fset1(-1.f / 3.f));
  s = ffma(t2, s, fset1(1.f));
  const VF small = fmul(t, s);
  return fmul(fselect_lt(a, 0.25f, small, big), fset1(cap));
}

// ---- the cache's rows --------------------------------------------------------------------------
static inline int64_t row_len(const float*, int64_t D) { return D; }
static inline int64_t row_len(const bf16*, int64_t D) { return D; }
static inline int64_t row_len(const int8_t*, int64_t D) { return int8_row(D); }

// group g's scale of an int8 row (fp16 bits after the codes, unaligned)
static inline float kv_scale(const int8_t* row, int64_t D, int64_t g) {
  uint16_t h;
  std::memcpy(&h, row + D + 2 * g, sizeof h);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// one row as D floats (D a multiple of LANES, and LANES of 32), its int8 scales folded in
template <typename E>
static inline void widen_row(const E* row, int64_t D, float* dst) {
  for (int64_t d = 0; d < D; d += LANES) fstore(dst + d, fload(row + d));
}
static inline void widen_row(const int8_t* row, int64_t D, float* dst) {
  for (int64_t g = 0; g * KV_GROUP < D; ++g) {
    const VF sv = fset1(kv_scale(row, D, g));
    for (int64_t d = g * KV_GROUP; d < std::min(D, (g + 1) * KV_GROUP); d += LANES)
      fstore(dst + d, fmul(fload(row + d), sv));
  }
}

// keys t0 .. t0 + n - 1 of kv head hk, walked through the block table, as n rows of D floats
template <typename E>
static void widen_rows(const E* c, const int64_t* table, int64_t bs, int64_t t0, int64_t n, int64_t Hkv, int64_t hk,
                       int64_t D, float* dst) {
  const int64_t rl = row_len(c, D);
  int64_t blk = t0 / bs, off = t0 % bs;
  for (int64_t i = 0; i < n; ++i) {
    widen_row(c + ((table[blk] * bs + off) * Hkv + hk) * rl, D, dst + i * D);
    if (++off == bs) off = 0, ++blk;
  }
}

// ---- quantize new rows into the int8 cache -------------------------------------------------------
// Per group: the scale is amax / 127 rounded to fp16 (at most fp16's largest), and the codes are x
// divided by that stored scale, so code * scale is the value the kernels read back.
template <typename S>
static inline void quantize_row(const S* x, int64_t D, int8_t* dst) {
  for (int64_t g = 0; g * KV_GROUP < D; ++g) {
    const int64_t d0 = g * KV_GROUP, d1 = std::min(D, d0 + KV_GROUP);
    float amax = 0.f;
    for (int64_t d = d0; d < d1; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
    const c10::Half h(std::min(amax / 127.f, 65504.f));
    const float scale = static_cast<float>(h);
    for (int64_t d = d0; d < d1; ++d) {
      const float r = scale > 0.f ? std::nearbyint(static_cast<float>(x[d]) / scale) : 0.f;
      dst[d] = static_cast<int8_t>(r > 127.f ? 127.f : (r < -127.f ? -127.f : r));
    }
    const uint16_t bits = h.x;
    std::memcpy(dst + D + 2 * g, &bits, sizeof bits);
  }
}

template <typename S>
static void quantize_kv_rows(const S* k, int64_t ks, const S* v, int64_t vs, const int64_t* slots, int64_t T,
                             int64_t Hkv, int64_t D, int8_t* kc, int8_t* vc) {
  const int64_t rl = row_len(kc, D);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < Hkv; ++h) {
        quantize_row(k + t * ks + h * D, D, kc + (slots[t] * Hkv + h) * rl);
        quantize_row(v + t * vs + h * D, D, vc + (slots[t] * Hkv + h) * rl);
      }
  });
}

static void quantize_kv_any(bool src_bf16, const void* k, int64_t ks, const void* v, int64_t vs, const int64_t* slots,
                            int64_t T, int64_t Hkv, int64_t D, int8_t* kc, int8_t* vc) {
  if (src_bf16)
    quantize_kv_rows(static_cast<const bf16*>(k), ks, static_cast<const bf16*>(v), vs, slots, T, Hkv, D, kc, vc);
  else
    quantize_kv_rows(static_cast<const float*>(k), ks, static_cast<const float*>(v), vs, slots, T, Hkv, D, kc, vc);
}

// ---- the register block both prefill products share ----------------------------------------------
// C[i][:] (=, or = C * colscale +) sum over k of A(i, k) * B[k][:], for NI rows i and MV vectors of
// columns: A(i, k) = A[i * ai + k * ak] broadcast, B's rows `bk` floats apart, C's `cs`. The NI x MV
// sums stay in registers across all K (AVX-512: 6 x 4 of 32 registers; AVX2: 6 x 2 of 16).
#if INFERD_ISA_LEVEL >= 2
static constexpr int MV = 4, NI = 6, NIV = 4;
#elif INFERD_ISA_LEVEL == 1
static constexpr int MV = 2, NI = 6, NIV = 4;
#else
static constexpr int MV = 4, NI = 4, NIV = 4;
#endif
static constexpr int CB = MV * LANES;  // columns a block

template <int R>
static inline void gemm_block(const float* A, int64_t ai, int64_t ak, const float* B, int64_t bk, int64_t K,
                              float* C, int64_t cs, const float* colscale) {
  VF acc[R][MV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < MV; ++j) acc[i][j] = fzero();
  for (int64_t kk = 0; kk < K; ++kk) {
    const float* b = B + kk * bk;
    VF bv[MV];
    for (int j = 0; j < MV; ++j) bv[j] = fload(b + j * LANES);
    for (int i = 0; i < R; ++i) {
      const VF a = fset1(A[i * ai + kk * ak]);
      for (int j = 0; j < MV; ++j) acc[i][j] = ffma(a, bv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < MV; ++j) {
      float* c = C + i * cs + j * LANES;
      fstore(c, colscale ? ffma(fload(c), fload(colscale + j * LANES), acc[i][j]) : acc[i][j]);
    }
}

// rows 0 .. n-1 of C for one block of columns: blocks of R rows, the rest in smaller blocks
template <int R>
static void gemm_rows(int64_t n, const float* A, int64_t ai, int64_t ak, const float* B, int64_t bk, int64_t K,
                      float* C, int64_t cs, const float* colscale) {
  int64_t i = 0;
  for (; i + R <= n; i += R) gemm_block<R>(A + i * ai, ai, ak, B, bk, K, C + i * cs, cs, colscale);
  if constexpr (R > 1) {
    if (i < n) gemm_rows<R / 2 ? R / 2 : 1>(n - i, A + i * ai, ai, ak, B, bk, K, C + i * cs, cs, colscale);
  }
}

// ---- prefill: tiled over KV blocks, online softmax ---------------------------------------------
static constexpr int64_t NK = 128;  // keys a tile

struct PrefillTask {
  int64_t s, q0, qn, hk, cost;
};

struct PrefillScratch {
  std::vector<float> qt, st, ot, kt, vt, m, l, alpha;
};

template <typename E>
static int64_t prefill_task(const PrefillTask& task, const float* q, int64_t qs, const E* k, const E* v,
                            const int64_t* bt, const int64_t* starts, const int64_t* qrows, float* out, int64_t H,
                            int64_t Hkv, int64_t D, int64_t max_blocks, int64_t bs, float scale, int64_t window,
                            float softcap, PrefillScratch& w) {
  const int64_t G = H / Hkv, s = task.s, hk = task.hk, qn = task.qn;
  const int64_t* table = bt + s * max_blocks;
  const int64_t p0 = starts[s] + task.q0, p1 = p0 + qn;  // query positions [p0, p1)
  const int64_t M = qn * G, Mp = (M + CB - 1) / CB * CB;
  w.qt.resize(D * Mp);
  w.ot.resize(D * Mp);
  w.st.resize(NK * Mp);
  w.kt.resize(NK * D);
  w.vt.resize(NK * D);
  w.m.resize(Mp);
  w.l.resize(Mp);
  w.alpha.resize(Mp);
  float *qt = w.qt.data(), *ot = w.ot.data(), *st = w.st.data(), *kt = w.kt.data(), *vt = w.vt.data();
  float *mrow = w.m.data(), *lrow = w.l.data(), *alpha = w.alpha.data();
  // column m = (query position p0 + m / G, head hk * G + m % G); padded columns hold zero queries
  for (int64_t m = 0; m < Mp; ++m) {
    if (m < M) {
      const float* src = q + (qrows[s] + task.q0 + m / G) * qs + (hk * G + m % G) * D;
      for (int64_t d = 0; d < D; ++d) qt[d * Mp + m] = src[d] * scale;
    } else {
      for (int64_t d = 0; d < D; ++d) qt[d * Mp + m] = 0.f;
    }
    mrow[m] = -INFINITY;
    lrow[m] = 0.f;
  }
  std::fill(ot, ot + D * Mp, 0.f);
  const int64_t lo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
  int64_t tiles = 0;
  for (int64_t t0 = lo; t0 < p1; t0 += NK) {
    const int64_t nk = std::min(NK, p1 - t0);
    widen_rows(k, table, bs, t0, nk, Hkv, hk, D, kt);
    widen_rows(v, table, bs, t0, nk, Hkv, hk, D, vt);
    // st [nk][Mp] = kt . qt
    for (int64_t c = 0; c < Mp; c += CB) gemm_rows<NI>(nk, kt, D, 1, qt + c, Mp, D, st + c, Mp, nullptr);
    if (softcap > 0.f)
      for (int64_t n = 0; n < nk; ++n)
        for (int64_t c = 0; c < Mp; c += LANES) fstore(st + n * Mp + c, softcap_lanes(fload(st + n * Mp + c), softcap));
    // a key after a query (the diagonal tile), or one a query's window has left behind: a prefix and a
    // suffix of the key's row of columns
    const bool causal = t0 + nk - 1 > p0, windowed = window > 0 && t0 <= p1 - 1 - window;
    if (causal || windowed)
      for (int64_t n = 0; n < nk; ++n) {
        const int64_t kp = t0 + n;
        float* row = st + n * Mp;
        if (kp > p0) std::fill(row, row + std::min(Mp, (kp - p0) * G), -INFINITY);
        if (window > 0) {
          const int64_t first = std::max<int64_t>(0, (kp + window - p0) * G);
          if (first < Mp) std::fill(row + first, row + Mp, -INFINITY);
        }
      }
    // online softmax, per column: the new maximum, the old sums and outputs rescaled by alpha
    for (int64_t c = 0; c < Mp; c += LANES) {
      const VF mo = fload(mrow + c);
      VF mx = mo;
      for (int64_t n = 0; n < nk; ++n) mx = fmax(mx, fload(st + n * Mp + c));
      const VF sh = finite_or_zero(mx);
      const VF al = fexp_or_zero(fsub(mo, sh));
      VF sum = fzero();
      for (int64_t n = 0; n < nk; ++n) {
        const VF p = fexp_or_zero(fsub(fload(st + n * Mp + c), sh));
        fstore(st + n * Mp + c, p);
        sum = fadd(sum, p);
      }
      fstore(lrow + c, ffma(fload(lrow + c), al, sum));
      fstore(mrow + c, mx);
      fstore(alpha + c, al);
    }
    // ot [D][Mp] = ot * alpha + vt^T . st
    for (int64_t c = 0; c < Mp; c += CB) gemm_rows<NIV>(D, vt, 1, D, st + c, Mp, nk, ot + c, Mp, alpha + c);
    ++tiles;
  }
  for (int64_t m = 0; m < M; ++m) {
    float* dst = out + ((qrows[s] + task.q0 + m / G) * H + hk * G + m % G) * D;
    const float inv = 1.f / lrow[m];
    for (int64_t d = 0; d < D; ++d) dst[d] = ot[d * Mp + m] * inv;
  }
  return tiles;
}

// q [T, H, D] rows qs floats apart (a view of the qkv projection); out [T, H, D]; sequence s has
// queries at rows qrows[s] .. + lens[s] - 1, positions starts[s] .. (its keys 0 .. starts[s] + lens[s]
// - 1 are in the cache, this chunk's included). Returns the tiles computed.
template <typename E>
static int64_t prefill_attention(const float* q, int64_t qs, const E* k, const E* v, const int64_t* bt,
                                 const int64_t* starts, const int64_t* lens, const int64_t* qrows, float* out,
                                 int64_t S, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks, int64_t bs,
                                 float scale, int64_t window, float softcap) {
  const int64_t G = H / Hkv;
  // query positions a task: about 256 columns (128 past head_dim 128), so that its queries, output
  // and one tile of scores stay in a core's L2 while the keys stream past
  const int64_t qt = std::max<int64_t>(1, std::min<int64_t>(256, 32768 / D) / G);
  std::vector<PrefillTask> tasks;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t q0 = 0; q0 < lens[s]; q0 += qt) {
      const int64_t qn = std::min(qt, lens[s] - q0), p0 = starts[s] + q0;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
      for (int64_t hk = 0; hk < Hkv; ++hk) tasks.push_back({s, q0, qn, hk, (p0 + qn - lo) * qn});
    }
  // the longest first, each thread taking the next when it is free: a causal chunk's last tiles
  // see many more keys than its first, and a static cut left one core idle half the time
  std::stable_sort(tasks.begin(), tasks.end(), [](const PrefillTask& a, const PrefillTask& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0}, tiles{0};
  const int64_t n = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    static thread_local PrefillScratch w;
    int64_t mine = 0;
    for (int64_t i; (i = next.fetch_add(1)) < n;)
      mine += prefill_task(tasks[i], q, qs, k, v, bt, starts, qrows, out, H, Hkv, D, max_blocks, bs, scale, window,
                           softcap, w);
    tiles += mine;
  });
  return tiles.load();
}

static int64_t prefill_attention_any(int cache, const float* q, int64_t qs, const void* k, const void* v,
                                     const int64_t* bt, const int64_t* starts, const int64_t* lens,
                                     const int64_t* qrows, float* out, int64_t S, int64_t H, int64_t Hkv, int64_t D,
                                     int64_t max_blocks, int64_t bs, float scale, int64_t window, float softcap) {
  if (cache == 0)
    return prefill_attention(q, qs, static_cast<const float*>(k), static_cast<const float*>(v), bt, starts, lens,
                             qrows, out, S, H, Hkv, D, max_blocks, bs, scale, window, softcap);
  if (cache == 1)
    return prefill_attention(q, qs, static_cast<const bf16*>(k), static_cast<const bf16*>(v), bt, starts, lens,
                             qrows, out, S, H, Hkv, D, max_blocks, bs, scale, window, softcap);
  return prefill_attention(q, qs, static_cast<const int8_t*>(k), static_cast<const int8_t*>(v), bt, starts, lens,
                           qrows, out, S, H, Hkv, D, max_blocks, bs, scale, window, softcap);
}

// ---- decode: one query a sequence, split over its keys -------------------------------------------
// Keys a task. A sequence's keys are cut into splits of SPLIT, each a task over one kv head with its
// own maximum, sum and weighted values, merged per head in split order. The cut depends only on the
// sequence's own length, never on the batch, so a row's result does not either; at 32k tokens one
// sequence is 64 splits x its kv heads of tasks, for every core.
static constexpr int64_t SPLIT = 512;
static constexpr int64_t SUB = 64;  // keys widened at a time (a multiple of every variant's LANES)

struct DecodeScratch {
  std::vector<float> qs, scores, kt, vt;
};

template <typename E>
static void decode_split(int64_t b, int64_t t0, int64_t t1, int64_t hk, const float* q, const E* k, const E* v,
                         const int64_t* table, int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale,
                         float softcap, float* part, DecodeScratch& w) {
  const int64_t G = H / Hkv, len = t1 - t0;
  w.qs.resize(G * D);
  w.scores.resize(G * SPLIT);
  w.kt.resize(SUB * D);
  w.vt.resize(SUB * D);
  float *qs = w.qs.data(), *sc = w.scores.data(), *kt = w.kt.data(), *vt = w.vt.data();
  const float* qb = q + (b * H + hk * G) * D;
  for (int64_t i = 0; i < G * D; ++i) qs[i] = qb[i] * scale;
  for (int64_t u0 = 0; u0 < len; u0 += SUB) {
    const int64_t n = std::min(SUB, len - u0), np = (n + LANES - 1) / LANES * LANES;
    widen_rows(k, table, bs, t0 + u0, n, Hkv, hk, D, kt);
    std::fill(kt + n * D, kt + np * D, 0.f);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qs + g * D;
      for (int64_t i = 0; i < np; i += LANES) {
        // LANES keys' dots at once: one vector of partial products a key, summed across lanes together
        VF a[LANES];
        for (int j = 0; j < LANES; ++j) a[j] = fzero();
        for (int64_t d = 0; d < D; d += LANES) {
          const VF qv = fload(qg + d);
          for (int j = 0; j < LANES; ++j) a[j] = ffma(qv, fload(kt + (i + j) * D + d), a[j]);
        }
        VF r = fsum_each(a);
        if (softcap > 0.f) r = softcap_lanes(r, softcap);
        float* dst = sc + g * SPLIT + u0 + i;
        if (i + LANES <= n) {
          fstore(dst, r);
        } else {
          float tmp[LANES];
          fstore(tmp, r);
          for (int64_t j = 0; j < n - i; ++j) dst[j] = tmp[j];
        }
      }
    }
  }
  // per head: the split's maximum, exp, sum
  float* mx = part;
  float* sm = part + G;
  float* acc = part + 2 * G;
  for (int64_t g = 0; g < G; ++g) {
    float* sg = sc + g * SPLIT;
    float m = -INFINITY;
    int64_t i = 0;
    if (len >= LANES) {
      VF mv = fload(sg);
      for (i = LANES; i + LANES <= len; i += LANES) mv = fmax(mv, fload(sg + i));
      m = fhmax(mv);
    }
    for (; i < len; ++i) m = std::max(m, sg[i]);
    const VF mvv = fset1(m);
    VF sv = fzero();
    for (i = 0; i + LANES <= len; i += LANES) {
      const VF p = fexp_or_zero(fsub(fload(sg + i), mvv));
      fstore(sg + i, p);
      sv = fadd(sv, p);
    }
    float sum = fsum(sv);
    for (; i < len; ++i) {
      sg[i] = fexp(sg[i] - m);
      sum += sg[i];
    }
    mx[g] = m;
    sm[g] = sum;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t u0 = 0; u0 < len; u0 += SUB) {
    const int64_t n = std::min(SUB, len - u0);
    widen_rows(v, table, bs, t0 + u0, n, Hkv, hk, D, vt);
    for (int64_t g = 0; g < G; ++g) {
      const float* p = sc + g * SPLIT + u0;
      float* ag = acc + g * D;
      // four vectors of the head's output at a time stay in registers across the sub-chunk's keys
      for (int64_t d0 = 0; d0 < D; d0 += 4 * LANES) {
        const int nv = static_cast<int>(std::min<int64_t>(4, (D - d0) / LANES));
        VF a[4];
        for (int j = 0; j < nv; ++j) a[j] = fload(ag + d0 + j * LANES);
        for (int64_t t = 0; t < n; ++t) {
          const VF wt = fset1(p[t]);
          const float* vr = vt + t * D + d0;
          for (int j = 0; j < nv; ++j) a[j] = ffma(wt, fload(vr + j * LANES), a[j]);
        }
        for (int j = 0; j < nv; ++j) fstore(ag + d0 + j * LANES, a[j]);
      }
    }
  }
}

// q [B, H, D] float32; out [B, H, D]; keys 0 .. ctx[b] - 1 (the last of them this query's own), the
// last `window` of them with a window. Returns the splits computed.
template <typename E>
static int64_t split_decode(const float* q, const E* k, const E* v, const int64_t* bt, const int64_t* ctx, float* out,
                            int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks, int64_t bs, float scale,
                            int64_t window, float softcap) {
  const int64_t G = H / Hkv;
  std::vector<int64_t> first(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = window > 0 ? std::max<int64_t>(0, ctx[b] - window) : 0;
    first[b + 1] = first[b] + (ctx[b] - start + SPLIT - 1) / SPLIT;
  }
  const int64_t splits = first[B], tasks = splits * Hkv, stride = G * (D + 2);
  static thread_local std::vector<float> part_buf;  // the caller's; tasks get the pointer
  part_buf.resize(std::max<size_t>(part_buf.size(), tasks * stride));
  float* const part = part_buf.data();
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += ctx[b];
  const int64_t grain = work * H * D < (1 << 14) ? tasks : 1;
  const std::vector<int64_t> order = split_order(first, bt, max_blocks, B);
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    static thread_local DecodeScratch w;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = order[i / Hkv], hk = i % Hkv, task = c * Hkv + hk;
      const int64_t b = std::upper_bound(first.begin(), first.end(), c) - first.begin() - 1;
      const int64_t start = window > 0 ? std::max<int64_t>(0, ctx[b] - window) : 0;
      const int64_t t0 = start + (c - first[b]) * SPLIT, t1 = std::min(ctx[b], t0 + SPLIT);
      decode_split(b, t0, t1, hk, q, k, v, bt + b * max_blocks, H, Hkv, D, bs, scale, softcap, part + task * stride, w);
    }
  });
  merge_splits(part, first, B, H, Hkv, D, grain == 1, out);
  return splits;
}

static int64_t split_decode_any(int cache, const float* q, const void* k, const void* v, const int64_t* bt,
                                const int64_t* ctx, float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                                int64_t max_blocks, int64_t bs, float scale, int64_t window, float softcap) {
  if (cache == 0)
    return split_decode(q, static_cast<const float*>(k), static_cast<const float*>(v), bt, ctx, out, B, H, Hkv, D,
                        max_blocks, bs, scale, window, softcap);
  if (cache == 1)
    return split_decode(q, static_cast<const bf16*>(k), static_cast<const bf16*>(v), bt, ctx, out, B, H, Hkv, D,
                        max_blocks, bs, scale, window, softcap);
  return split_decode(q, static_cast<const int8_t*>(k), static_cast<const int8_t*>(v), bt, ctx, out, B, H, Hkv, D,
                      max_blocks, bs, scale, window, softcap);
}
