// Every decoder layer of a w8a8 forward in one call: the arithmetic of mars_core.lean_script.layers_w8a8 (not
// its order of operations, nor libm's exp: exp8 below), with RMSNorm, RoPE, the cache writes, attention, SiLU
// and the residual adds as plain or vectorized loops around the file's own `linear`. Built into mars_core/vnni.cpp and mars_core/avx2.cpp (MARS_W8A8_OPS).
//
// Why: on one thread of a slow core, the ~4,000 small torch ops of a SmolLM2 forward cost as much as its 121
// matrix products (docs/experiments.md, "A native layer stack"). Here they cost next to nothing.
//
// Every position is computed on its own, in an order that depends on nothing but its own inputs: a row's outputs
// are bitwise the same whatever other rows, positions or hidden columns the call holds. That is what makes a
// lossless step write AR's answer and a batch row equal the row alone. Attention runs in float32 (the cache's
// dtype): its fixed order per query is what keeps rows independent, which the torch loop gets from float64 instead.
#pragma once
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace mars_w8a8 {

using Linear = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const c10::optional<at::Tensor>&, bool, double, double, int64_t, int64_t);

// out = x * (1 / sqrt(mean(x^2) + eps)) * w per row: transformers' RMSNorm, its mean summed in float64 (a float's
// square is exact there), in a fixed order that both builds share: element i into lane i % 8 of two 4-double
// registers, then a fixed tree. One scalar chain of float64 adds waited on each add's latency, at every norm of every
// position.
inline void rms(const float* x, const float* w, float* out, int64_t rows, int64_t n, double eps) {
  for (int64_t r = 0; r < rows; ++r, x += n, out += n) {
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), b = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
      lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
      hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
    }
    alignas(32) double lane[8];
    _mm256_store_pd(lane, lo);
    _mm256_store_pd(lane + 4, hi);
    for (int64_t l = 0; i < n; ++i, ++l) lane[l] += static_cast<double>(x[i]) * x[i];
    const double s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    const float inv = 1.f / std::sqrt(static_cast<float>(s / n) + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
  }
}

// exp on 8 floats: range reduction by ln 2 (in two parts), a degree-7 Taylor polynomial on |r| <= ln2 / 2 (within
// an ulp or two of std::exp), scaled by 2^n through the exponent bits.
// Written with AVX2 + FMA intrinsics only, so that both kernels' builds (AVX-512 and AVX2) run the same
// instructions and give the same bits. libm's scalar exp was most of a position's cost outside the products:
// SiLU's 1,536 per layer and the softmax's one per key and head. Results below exp's normal range are 0.
constexpr float EXP_TERMS[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};   // after 1 / 7!
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.72283f), lo = _mm256_set1_ps(-87.33654f);
  const __m256 big = _mm256_cmp_ps(x, hi, _CMP_GT_OQ), small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (float k : EXP_TERMS) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k));
  __m256i bits = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  __m256 y = _mm256_castsi256_ps(bits);
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), small);
  return _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::infinity()), big);
}

// Attention's two products for J queries (1..6) that share a key/value head: the queries of one row's heads of a
// group and of the chunk's other rows. Each key or value row is loaded once for all J; every lane of every
// register still computes one query's one output by the same multiply-adds in the same order (a plain sequence of
// fused multiply-adds from 0, over the head's d elements or over the keys), so a query's result does not depend on
// which or how many queries share its block. The AVX-512 build holds 16 lanes to a register and the AVX2 build 8
// (`F16`), by the same lane-wise operations, so both give the same bits.

// Sixteen float lanes: one AVX-512 register, or two AVX2 ones (lanes 0-7 and 8-15), by the same lane-wise ops.
#ifdef __AVX512F__
struct F16 {
  __m512 x;
  static F16 zero() { return {_mm512_setzero_ps()}; }
  static F16 set(float v) { return {_mm512_set1_ps(v)}; }
  static F16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static F16 bcast(const float* p) { return {_mm512_set1_ps(*p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, x); }
  void fma(const F16& a, const F16& b) { x = _mm512_fmadd_ps(a.x, b.x, x); }
  F16 operator-(const F16& b) const { return {_mm512_sub_ps(x, b.x)}; }
  F16 operator+(const F16& b) const { return {_mm512_add_ps(x, b.x)}; }
  F16 operator*(const F16& b) const { return {_mm512_mul_ps(x, b.x)}; }
  F16 operator/(const F16& b) const { return {_mm512_div_ps(x, b.x)}; }
  F16 max(const F16& b) const { return {_mm512_max_ps(x, b.x)}; }
  float top() const { return _mm512_reduce_max_ps(x); }
  // the lanes that are not 0 (NaN included), packed to the front of `out` in order (16 floats written); how many
  int64_t pack_nonzero(float* out) const {
    const __mmask16 m = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    _mm512_storeu_ps(out, _mm512_maskz_compress_ps(m, x));
    return __builtin_popcount(m);
  }
  // the 16 lanes of `flags` (bytes) or, where the lane is not 0, true
  void mark_nonzero(char* flags) const {
    const __mmask16 m = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    const __m128i old = _mm_loadu_si128(reinterpret_cast<const __m128i*>(flags));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(flags), _mm_or_si128(old, _mm_movm_epi8(m)));
  }
  // exp8 below, lane for lane in one register: the same operations, so the same bits
  F16 exp() const {
    const __m512 hi = _mm512_set1_ps(88.72283f), lo = _mm512_set1_ps(-87.33654f);
    const __mmask16 big = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), small = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    for (float k : EXP_TERMS) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(k));
    __m512 y = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23)));
    y = _mm512_mask_blend_ps(small, y, _mm512_setzero_ps());
    return {_mm512_mask_blend_ps(big, y, _mm512_set1_ps(std::numeric_limits<float>::infinity()))};
  }
};
// how many F16s a block holds per query: keys (scores; twice that for up to 3 queries, to keep enough sums in
// flight), value columns (mix); AVX2's 16 registers allow one of each
constexpr int WIDE = 2;
constexpr int COLUMNS = 4;
#else
// for each 8-bit mask, the lanes it sets in order (then zeros): a packing permutation for _mm256_permutevar8x32_ps
struct Packing {
  alignas(32) int32_t lanes[256][8];
  constexpr Packing() : lanes() {
    for (int m = 0; m < 256; ++m)
      for (int l = 0, n = 0; l < 8; ++l)
        if (m >> l & 1) lanes[m][n++] = l;
  }
};
inline constexpr Packing PACKING{};

struct F16 {
  __m256 lo, hi;
  static F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F16 set(float v) { const __m256 s = _mm256_set1_ps(v); return {s, s}; }
  static F16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static F16 bcast(const float* p) { const __m256 v = _mm256_broadcast_ss(p); return {v, v}; }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
  void fma(const F16& a, const F16& b) { lo = _mm256_fmadd_ps(a.lo, b.lo, lo); hi = _mm256_fmadd_ps(a.hi, b.hi, hi); }
  F16 operator-(const F16& b) const { return {_mm256_sub_ps(lo, b.lo), _mm256_sub_ps(hi, b.hi)}; }
  F16 operator+(const F16& b) const { return {_mm256_add_ps(lo, b.lo), _mm256_add_ps(hi, b.hi)}; }
  F16 operator*(const F16& b) const { return {_mm256_mul_ps(lo, b.lo), _mm256_mul_ps(hi, b.hi)}; }
  F16 operator/(const F16& b) const { return {_mm256_div_ps(lo, b.lo), _mm256_div_ps(hi, b.hi)}; }
  F16 max(const F16& b) const { return {_mm256_max_ps(lo, b.lo), _mm256_max_ps(hi, b.hi)}; }
  float top() const {
    alignas(32) float l[8];
    _mm256_store_ps(l, _mm256_max_ps(lo, hi));
    return *std::max_element(l, l + 8);
  }
  static int nonzero(__m256 v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_NEQ_UQ)); }
  int64_t pack_nonzero(float* out) const {
    const int a = nonzero(lo), b = nonzero(hi);
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(lo, _mm256_load_si256(reinterpret_cast<const __m256i*>(PACKING.lanes[a]))));
    const int64_t n = __builtin_popcount(a);
    _mm256_storeu_ps(out + n, _mm256_permutevar8x32_ps(hi, _mm256_load_si256(reinterpret_cast<const __m256i*>(PACKING.lanes[b]))));
    return n + __builtin_popcount(b);
  }
  void mark_nonzero(char* flags) const {
    const int m = nonzero(lo) | nonzero(hi) << 8;
    for (int l = 0; l < 16; ++l) flags[l] |= static_cast<char>(m >> l & 1);
  }
  F16 exp() const { return {exp8(lo), exp8(hi)}; }
};
constexpr int WIDE = 1;
constexpr int COLUMNS = 1;
#endif

// out[j][t] = q[j] . k[., t] for t < end: keys in tiles of 16 stored by dimension (element e of key t at
// k[(t / 16) * ks + e * 16 + t % 16], so a block's loads run through memory in order), W * 16 keys at a time, then
// 16 up to the end of the last tile. Its columns past `end` (zeros, or keys a crop dropped) give scores in `out`'s
// padding, which the caller overwrites.
template <int J, int W>
inline int64_t score_blocks(const float* const* q, const float* k, int64_t ks, int64_t d, int64_t t, int64_t end,
                            float* const* out) {
  for (; t + 16 * W <= end; t += 16 * W) {
    F16 a[J][W];
    for (int j = 0; j < J; ++j)
      for (int w = 0; w < W; ++w) a[j][w] = F16::zero();
    for (int64_t e = 0; e < d; ++e) {
      F16 kv[W];
      for (int w = 0; w < W; ++w) kv[w] = F16::load(k + (t / 16 + w) * ks + e * 16);
      for (int j = 0; j < J; ++j) {
        const F16 qe = F16::bcast(q[j] + e);
        for (int w = 0; w < W; ++w) a[j][w].fma(qe, kv[w]);
      }
    }
    for (int j = 0; j < J; ++j)
      for (int w = 0; w < W; ++w) a[j][w].store(out[j] + t + 16 * w);
  }
  return t;
}

template <int J>
inline void scores(const float* const* q, const float* k, int64_t ks, int64_t d, int64_t end, float* const* out) {
  const int64_t t = score_blocks<J, (J <= 3 ? 2 * WIDE : WIDE)>(q, k, ks, d, 0, end, out);   // enough sums in flight
  score_blocks<J, 1>(q, k, ks, d, t, (end + 15) / 16 * 16, out);
}

// out[j][c .. c + 16W) = sum over t < end of p[j][t] * v[t][c .. c + 16W) (value rows `vs` apart). A key whose weight
// is 0 for every query (`live` false: hidden) is skipped; where only some queries weigh it 0, theirs add 0 * v,
// which leaves a sum that never holds -0 unchanged: the same bits as skipping it.
template <int J, int W>
inline int64_t mix_blocks(const float* const* p, const char* live, const float* v, int64_t vs, int64_t c, int64_t d,
                          int64_t end, float* const* out) {
  for (; c + 16 * W <= d; c += 16 * W) {
    F16 a[J][W];
    for (int j = 0; j < J; ++j)
      for (int w = 0; w < W; ++w) a[j][w] = F16::zero();
    for (int64_t t = 0; t < end; ++t) {
      if (!live[t]) continue;
      F16 vv[W];
      for (int w = 0; w < W; ++w) vv[w] = F16::load(v + t * vs + c + 16 * w);
      for (int j = 0; j < J; ++j) {
        const F16 pt = F16::bcast(p[j] + t);
        for (int w = 0; w < W; ++w) a[j][w].fma(pt, vv[w]);
      }
    }
    for (int j = 0; j < J; ++j)
      for (int w = 0; w < W; ++w) a[j][w].store(out[j] + c + 16 * w);
  }
  return c;
}

template <int J>
inline void mix(const float* const* p, const char* live, const float* v, int64_t vs, int64_t d, int64_t end,
                float* const* out) {
  int64_t c = mix_blocks<J, COLUMNS>(p, live, v, vs, 0, d, end, out);
  c = mix_blocks<J, 1>(p, live, v, vs, c, d, end, out);
  for (; c < d; c += 4) {   // d is a multiple of 4; a head size that is a multiple of 16 never gets here
    __m128 a[J];
    for (int j = 0; j < J; ++j) a[j] = _mm_setzero_ps();
    for (int64_t t = 0; t < end; ++t) {
      if (!live[t]) continue;
      const __m128 vv = _mm_loadu_ps(v + t * vs + c);
      for (int j = 0; j < J; ++j) a[j] = _mm_fmadd_ps(_mm_broadcast_ss(p[j] + t), vv, a[j]);
    }
    for (int j = 0; j < J; ++j) _mm_storeu_ps(out[j] + c, a[j]);
  }
}

constexpr int BLOCK = 6;   // queries per block: their sums, the loads and a broadcast fit AVX2's 16 registers

template <template <int> class F, typename... A>
inline void by_count(int n, A... args) {
  switch (n) {
    case 6: F<6>::run(args...); break;
    case 5: F<5>::run(args...); break;
    case 4: F<4>::run(args...); break;
    case 3: F<3>::run(args...); break;
    case 2: F<2>::run(args...); break;
    default: F<1>::run(args...);
  }
}
template <int J> struct Scores { template <typename... A> static void run(A... a) { scores<J>(a...); } };
template <int J> struct Mix { template <typename... A> static void run(A... a) { mix<J>(a...); } };

// out = g / (1 + exp(-g)) * u, 16 at a time (the last few through a padded copy, by the same instructions).
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  const F16 one = F16::set(1.f), zero = F16::zero();
  auto sixteen = [&](F16 gv, F16 uv) { return gv / (one + (zero - gv).exp()) * uv; };
  int64_t e = 0;
  for (; e + 16 <= n; e += 16) sixteen(F16::load(g + e), F16::load(u + e)).store(out + e);
  if (e == n) return;
  float gb[16] = {}, ub[16] = {}, ob[16];
  std::copy(g + e, g + n, gb);
  std::copy(u + e, u + n, ub);
  sixteen(F16::load(gb), F16::load(ub)).store(ob);
  std::copy(ob, ob + (n - e), out + e);
}

// RoPE on one head's d values (pairs x0, x1 with the table's cos c and sin s): x0 c - x1 s and x0 s + x1 c, each
// a rounded product then a rounded sum, written out with intrinsics 8 (then 4) at a time: left to the compiler's
// vectorizer, the AVX2 build fused some of these into multiply-adds and the two builds' keys differed in a last bit.
inline void rotate(const float* x, const float* cs, int64_t d, float* out) {
  int64_t p = 0;
  for (; p + 8 <= d; p += 8) {
    const __m256 xv = _mm256_loadu_ps(x + p), cv = _mm256_loadu_ps(cs + p);
    const __m256 a = _mm256_mul_ps(xv, _mm256_moveldup_ps(cv));                           // x0 c, x1 c
    const __m256 b = _mm256_mul_ps(_mm256_permute_ps(xv, 0xB1), _mm256_movehdup_ps(cv));  // x1 s, x0 s
    _mm256_storeu_ps(out + p, _mm256_addsub_ps(a, b));
  }
  if (p < d) {   // d is a multiple of 4
    const __m128 xv = _mm_loadu_ps(x + p), cv = _mm_loadu_ps(cs + p);
    _mm_storeu_ps(out + p, _mm_addsub_ps(_mm_mul_ps(xv, _mm_moveldup_ps(cv)),
                                         _mm_mul_ps(_mm_permute_ps(xv, 0xB1), _mm_movehdup_ps(cv))));
  }
}

struct Shape {
  int64_t b, length, heads, kv, d, past;
};

// Layer i's attention: RoPE on the q and k rows of `qkv` (the table holds each row's cos/sin pairs, q's already
// scaled by 1/sqrt(d)), the chunk's k and v written into the caches at columns past.. (keys in tiles of 16 columns
// stored by dimension: [layers, batch, kv, columns / 16, d, 16]; values by column: [layers, batch, kv, columns, d]),
// and each query's softmax over the columns it may see (`hidden`: [b, 1, L * group, past + L], true where it may not) -> att [b*L, heads*d].
// All in float32. The queries that share a key/value head go through the products in blocks (`scores`, `mix`);
// each query's softmax runs on its own (max, exp and division 8 columns at a time; the sum over its nonzero terms
// packed together, in 8 lanes then a fixed tree). A query's result depends on its own inputs and on the order of
// the keys it sees, never on their columns.
inline void attention(int64_t i, const float* qkv, const float* rope, const at::Tensor& kc, const at::Tensor& vc,
                      const bool* hidden, const Shape& s, float* att) {
  const int64_t heads = s.heads, kv = s.kv, d = s.d, group = heads / kv, end = s.past + s.length;
  const int64_t width = (heads + 2 * kv) * d, rows = s.b * s.length;
  std::vector<float> q(static_cast<size_t>(rows) * heads * d), key(d);   // the rotated queries; one key
  float* kb = kc.data_ptr<float>();
  float* vb = vc.data_ptr<float>();
  const int64_t k0 = kc.stride(0), k1 = kc.stride(1), k2 = kc.stride(2), k3 = kc.stride(3);
  const int64_t v0 = vc.stride(0), v1 = vc.stride(1), v2 = vc.stride(2), v3 = vc.stride(3);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t bi = r / s.length, col = s.past + r % s.length;
    const float* row = qkv + r * width;
    const float* cs = rope + r * (heads + kv) * d;   // (cos, sin) per pair of each head
    for (int64_t h = 0; h < heads; ++h) rotate(row + h * d, cs + h * d, d, q.data() + (r * heads + h) * d);
    for (int64_t g = 0; g < kv; ++g) {
      rotate(row + (heads + g) * d, cs + (heads + g) * d, d, key.data());
      float* kt = kb + i * k0 + bi * k1 + g * k2 + (col / 16) * k3 + col % 16;
      for (int64_t e = 0; e < d; ++e) kt[e * 16] = key[e];
      std::copy_n(row + (heads + kv + g) * d, d, vb + i * v0 + bi * v1 + g * v2 + col * v3);
    }
  }
  const int64_t padded = (end + 15) / 16 * 16, per = s.length * group;   // queries per batch row and kv head
  std::vector<float> score(static_cast<size_t>(BLOCK) * padded);
  std::vector<char> live(padded);                  // keys some query of a block weighs
  std::vector<float> terms(padded + 16);           // a query's nonzero softmax terms, packed
  const float inf = std::numeric_limits<float>::infinity();
  const __m256 minus_inf = _mm256_set1_ps(-inf);
  for (int64_t bi = 0; bi < s.b; ++bi)
    for (int64_t g = 0; g < kv; ++g) {
      const float* kt = kb + i * k0 + bi * k1 + g * k2;
      const float* vt = vb + i * v0 + bi * v1 + g * v2;
      for (int64_t first = 0; first < per; first += BLOCK) {   // query u: row l = u / group, head g * group + u % group
        const int n = static_cast<int>(std::min<int64_t>(BLOCK, per - first));
        const float* qs[BLOCK];
        float* ps[BLOCK];
        float* outs[BLOCK];
        for (int j = 0; j < n; ++j) {
          const int64_t u = first + j, r = bi * s.length + u / group, h = g * group + u % group;
          qs[j] = q.data() + (r * heads + h) * d;
          ps[j] = score.data() + j * padded;
          outs[j] = att + r * heads * d + h * d;
        }
        by_count<Scores>(n, qs, kt, k3, d, end, ps);
        for (int j = 0; j < n; ++j) {
          float* sc = ps[j];
          std::fill(sc + end, sc + padded, -inf);
          const bool* hid = hidden ? hidden + (bi * per + first + j) * end : nullptr;
          if (hid) {
            int64_t t = 0;
            for (; t + 8 <= end; t += 8) {
              const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hid + t)));
              const __m256 out = _mm256_castsi256_ps(_mm256_cmpgt_epi32(m, _mm256_setzero_si256()));
              _mm256_storeu_ps(sc + t, _mm256_blendv_ps(_mm256_loadu_ps(sc + t), minus_inf, out));
            }
            for (; t < end; ++t)
              if (hid[t]) sc[t] = -inf;
          }
          F16 most = F16::set(-inf);
          for (int64_t t = 0; t < padded; t += 16) most = most.max(F16::load(sc + t));
          const F16 top = F16::set(most.top());
          // exp (hidden: exactly 0), and the nonzero terms packed together for the sum: a term's lane in the sum
          // is its place among them, not its column, so hidden columns before it (a padded batch row, a lossless
          // step's holes) cannot change the rounding
          int64_t live_terms = 0;
          for (int64_t t = 0; t < padded; t += 16) {
            const F16 e = (F16::load(sc + t) - top).exp();
            e.store(sc + t);
            live_terms += e.pack_nonzero(terms.data() + live_terms);
          }
          std::fill(terms.begin() + live_terms, terms.begin() + (live_terms + 7) / 8 * 8, 0.f);
          __m256 sum8 = _mm256_setzero_ps();   // 8 lanes, then a fixed tree
          for (int64_t t = 0; t < live_terms; t += 8) sum8 = _mm256_add_ps(sum8, _mm256_loadu_ps(terms.data() + t));
          alignas(32) float lanes[8];
          _mm256_store_ps(lanes, sum8);
          const F16 sum = F16::set(((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                                   ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
          for (int64_t t = 0; t < padded; t += 16) (F16::load(sc + t) / sum).store(sc + t);
        }
        std::fill(live.begin(), live.end(), 0);   // past `end` the weights are 0
        for (int j = 0; j < n; ++j)
          for (int64_t t = 0; t < padded; t += 16) F16::load(ps[j] + t).mark_nonzero(live.data() + t);
        by_count<Mix>(n, static_cast<const float* const*>(ps), static_cast<const char*>(live.data()), vt, v3, d, end,
                      static_cast<float* const*>(outs));
      }
    }
}

// A gated adapter's deltas (mars_core.gated) in w8a8: after product j, the rows `rows` (the mask positions) get
// linear(linear(x_row, A_j) narrowed to a part's columns, B_part) added at the part's output columns. A is the
// product's parts' A stacked ([R, in]: their input is the same); each part's B (q, k, v; gate, up; o; down) is a
// product of its own, so the block-diagonal zeros of a fused B are never read. Both are int8 like the base's
// weights (a delta read in fp32 would add a third to a forward's weight bytes). Only those rows change, each from
// its own input, so every other row is the base model's bit for bit and rows stay independent.
struct Lora {
  at::Tensor rows;                          // int64 row indices, or undefined: no delta this call
  c10::List<at::Tensor> a, a_scale, b, b_scale;
  std::vector<std::vector<int64_t>> parts;  // product j -> rows of `index`: (j, a entry, r offset, r width, out offset)
  const int64_t* index = nullptr;

  Lora(const c10::optional<at::Tensor>& rows_in, c10::List<at::Tensor> a, c10::List<at::Tensor> a_scale,
       c10::List<at::Tensor> b, c10::List<at::Tensor> b_scale, const c10::optional<at::Tensor>& index_in,
       int64_t products, int64_t positions)
      : a(std::move(a)), a_scale(std::move(a_scale)), b(std::move(b)), b_scale(std::move(b_scale)), parts(products) {
    if (!rows_in.has_value() || !rows_in->defined() || rows_in->numel() == 0 || !index_in.has_value()) return;
    const at::Tensor& idx = *index_in;
    TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous() && idx.dim() == 2 && idx.size(1) == 5 &&
                    idx.size(0) == static_cast<int64_t>(this->b.size()) && this->b.size() == this->b_scale.size() &&
                    this->a.size() == this->a_scale.size(),
                "layers: a gated adapter's parts [parts, 5] (product, A entry, r offset, r width, out offset) with "
                "one B and scale per part are expected");
    TORCH_CHECK(rows_in->scalar_type() == at::kLong, "layers: int64 mask row indices are expected");
    rows = rows_in->contiguous();
    const int64_t* rp = rows.data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(rp, rp + rows.numel(), [&](int64_t r) { return r >= 0 && r < positions; }),
                "layers: a gated adapter's mask row index lies outside the call's positions");
    index = idx.data_ptr<int64_t>();
    for (int64_t p = 0; p < idx.size(0); ++p) {
      const int64_t* e = index + 5 * p;
      TORCH_CHECK(e[0] >= 0 && e[0] < products && e[1] >= 0 && e[1] < static_cast<int64_t>(this->a.size()),
                  "layers: a gated adapter part names a product or A entry that does not exist");
      parts[e[0]].push_back(p);
    }
  }

  template <Linear linear>
  void add(const at::Tensor& in, int64_t j, at::Tensor& y, double inverse, double step) const {
    if (!rows.defined() || parts[j].empty()) return;
    const int64_t m = rows.size(0), k = in.size(1), n = y.size(1);
    const int64_t* rp = rows.data_ptr<int64_t>();
    auto xm = at::empty({m, k}, in.options());
    for (int64_t i = 0; i < m; ++i) std::copy_n(in.data_ptr<float>() + rp[i] * k, k, xm.data_ptr<float>() + i * k);
    at::Tensor t;
    int64_t a_entry = -1;
    float* yp = y.data_ptr<float>();
    for (int64_t p : parts[j]) {
      const int64_t* e = index + 5 * p;
      if (e[1] != a_entry)
        t = linear(xm, a.get(a_entry = e[1]), a_scale.get(e[1]), c10::nullopt, true, inverse, step, m, 0);
      const auto delta = linear(t.narrow(1, e[2], e[3]).contiguous(), b.get(p), b_scale.get(p), c10::nullopt, true,
                                inverse, step, m, 0);
      const int64_t width = delta.size(1);
      TORCH_CHECK(e[4] + width <= n, "layers: a gated adapter part reaches past its product's outputs");
      const float* dp = delta.data_ptr<float>();
      for (int64_t i = 0; i < m; ++i)
        for (int64_t c = 0; c < width; ++c) yp[rp[i] * n + e[4] + c] += dp[i * width + c];
    }
  }
};

// x [b*L, hidden] through every layer: products in the order qkv, o, gate_up, down per layer, norms in, post.
template <Linear linear>
at::Tensor layers(const at::Tensor& x_in, const c10::List<at::Tensor>& packs, const c10::List<at::Tensor>& scales,
                  const c10::List<c10::optional<at::Tensor>>& biases, const c10::List<bool>& two,
                  const c10::List<at::Tensor>& norms, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t past, int64_t b,
                  int64_t length, int64_t heads, int64_t kv, int64_t d, const at::Tensor& rope_in,
                  const c10::optional<at::Tensor>& hidden_in, double eps, double inverse, double step, int64_t tail,
                  const c10::optional<at::Tensor>& lora_rows, const c10::List<at::Tensor>& lora_a,
                  const c10::List<at::Tensor>& lora_a_scale, const c10::List<at::Tensor>& lora_b,
                  const c10::List<at::Tensor>& lora_b_scale, const c10::optional<at::Tensor>& lora_index) {
  const int64_t rows = b * length, n = x_in.size(1), count = static_cast<int64_t>(norms.size()) / 2;
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(0) == rows,
              "layers: a float32 [b * length, hidden] input is expected");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.dim() == 6 &&
                  v_cache.dim() == 5 && k_cache.is_contiguous() && v_cache.stride(4) == 1 && k_cache.size(4) == d &&
                  k_cache.size(5) == 16 && k_cache.size(3) * 16 >= past + length && v_cache.size(3) >= past + length &&
                  v_cache.size(4) == d,
              "layers: float32 caches with room for the chunk are expected: keys [layers, batch, kv, columns / 16, "
              "d, 16], values [layers, batch, kv, columns, d]");
  TORCH_CHECK(static_cast<int64_t>(packs.size()) == 4 * count && heads % kv == 0 && d % 4 == 0,
              "layers: four products per layer, heads a multiple of kv heads and a head size a multiple of 4 are "
              "expected");
  auto rope = rope_in.contiguous();
  TORCH_CHECK(rope.scalar_type() == at::kFloat && rope.numel() == rows * (heads + kv) * d,
              "layers: a float32 RoPE table [b * length, heads + kv, d / 2, 2] is expected");
  at::Tensor hidden;
  if (hidden_in.has_value() && hidden_in->defined()) {
    hidden = hidden_in->contiguous();
    TORCH_CHECK(hidden.scalar_type() == at::kBool && hidden.numel() == rows * (heads / kv) * (past + length),
                "layers: a bool mask [b, 1, length * group, past + length] is expected");
  }
  const Shape s{b, length, heads, kv, d, past};
  auto x = x_in.contiguous().clone();
  auto h = at::empty({rows, n}, x.options());
  auto att = at::empty({rows, heads * d}, x.options());
  float* xp = x.data_ptr<float>();
  const Lora lora(lora_rows, lora_a, lora_a_scale, lora_b, lora_b_scale, lora_index, 4 * count, rows);
  auto product = [&](const at::Tensor& in, int64_t j) -> at::Tensor {
    auto y = linear(in, packs.get(j), scales.get(j), biases.get(j), two.get(j), inverse, step, length, tail);
    lora.add<linear>(in, j, y, inverse, step);
    return y;
  };
  auto add = [&](const at::Tensor& y) {
    const float* yp = y.data_ptr<float>();
    for (int64_t e = 0; e < rows * n; ++e) xp[e] = xp[e] + yp[e];
  };
  for (int64_t i = 0; i < count; ++i) {
    rms(xp, norms.get(2 * i).data_ptr<float>(), h.data_ptr<float>(), rows, n, eps);
    const at::Tensor qkv = product(h, 4 * i);
    attention(i, qkv.data_ptr<float>(), rope.data_ptr<float>(), k_cache, v_cache,
              hidden.defined() ? hidden.data_ptr<bool>() : nullptr, s, att.data_ptr<float>());
    add(product(att, 4 * i + 1));
    rms(xp, norms.get(2 * i + 1).data_ptr<float>(), h.data_ptr<float>(), rows, n, eps);
    const at::Tensor gate_up = product(h, 4 * i + 2);
    const int64_t half = gate_up.size(1) / 2;
    auto act = at::empty({rows, half}, x.options());
    const float* gu = gate_up.data_ptr<float>();
    float* ap = act.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) silu_mul(gu + r * 2 * half, gu + r * 2 * half + half, ap + r * half, half);
    add(product(act, 4 * i + 3));
  }
  return x;
}

}  // namespace mars_w8a8
