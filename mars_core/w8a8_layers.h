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

// out = x * (1 / sqrt(mean(x^2) + eps)) * w per row: transformers' RMSNorm, its mean summed in float64.
inline void rms(const float* x, const float* w, float* out, int64_t rows, int64_t n, double eps) {
  for (int64_t r = 0; r < rows; ++r, x += n, out += n) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
    const float inv = 1.f / std::sqrt(static_cast<float>(s / n) + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
  }
}

// exp on 8 floats: range reduction by ln 2 (in two parts), a degree-7 Taylor polynomial on |r| <= ln2 / 2 (within
// an ulp or two of std::exp), scaled by 2^n through the exponent bits.
// Written with AVX2 + FMA intrinsics only, so that both kernels' builds (AVX-512 and AVX2) run the same
// instructions and give the same bits. libm's scalar exp was most of a position's cost outside the products:
// SiLU's 1,536 per layer and the softmax's one per key and head. Results below exp's normal range are 0.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.72283f), lo = _mm256_set1_ps(-87.33654f);
  const __m256 big = _mm256_cmp_ps(x, hi, _CMP_GT_OQ), small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  const float c[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
  for (float k : c) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k));
  __m256i bits = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  __m256 y = _mm256_castsi256_ps(bits);
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), small);
  return _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::infinity()), big);
}

// q . k in float32 for C (1..4) keys `stride` apart: sixteen partial sums per key (element i into sum i mod 16)
// run over d in order, then summed in a fixed tree, so a score never depends on which keys share the call. The
// AVX-512 build keeps the sixteen in one register, the AVX2 build in two (sums 0-7 and 8-15), by the same
// multiply-adds: both give the same bits. A last 8, 4 or 12 (d mod 16) continue the mod-16 assignment.
template <int C>
inline void dots(const float* q, const float* k, int64_t stride, int64_t d, float* out) {
  __m256 s[C], h[C];   // sums 0-7 and 8-15
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 a[C];
  for (int j = 0; j < C; ++j) a[j] = _mm512_setzero_ps();
  for (; i + 16 <= d; i += 16) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    for (int j = 0; j < C; ++j) a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + j * stride + i), a[j]);
  }
  for (int j = 0; j < C; ++j) {
    s[j] = _mm512_castps512_ps256(a[j]);
    h[j] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1));
  }
#else
  for (int j = 0; j < C; ++j) s[j] = h[j] = _mm256_setzero_ps();
  for (; i + 16 <= d; i += 16) {
    const __m256 ql = _mm256_loadu_ps(q + i), qh = _mm256_loadu_ps(q + i + 8);
    for (int j = 0; j < C; ++j) {
      s[j] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k + j * stride + i), s[j]);
      h[j] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k + j * stride + i + 8), h[j]);
    }
  }
#endif
  if (i + 8 <= d) {   // elements i..i+7 into sums 0-7
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < C; ++j) s[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * stride + i), s[j]);
    i += 8;
    if (i < d) {      // and the last 4 into sums 8-11
      const __m128 q4 = _mm_loadu_ps(q + i);
      for (int j = 0; j < C; ++j)
        h[j] = _mm256_insertf128_ps(h[j], _mm_fmadd_ps(q4, _mm_loadu_ps(k + j * stride + i), _mm256_castps256_ps128(h[j])), 0);
    }
  } else if (i < d) { // a last 4 into sums 0-3
    const __m128 q4 = _mm_loadu_ps(q + i);
    for (int j = 0; j < C; ++j)
      s[j] = _mm256_insertf128_ps(s[j], _mm_fmadd_ps(q4, _mm_loadu_ps(k + j * stride + i), _mm256_castps256_ps128(s[j])), 0);
  }
  alignas(32) float lanes[8];
  for (int j = 0; j < C; ++j) {
    _mm256_store_ps(lanes, _mm256_add_ps(s[j], h[j]));
    out[j] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
}

inline void dots(const float* q, const float* k, int64_t stride, int64_t d, int count, float* out) {
  switch (count) {
    case 4: dots<4>(q, k, stride, d, out); break;
    case 3: dots<3>(q, k, stride, d, out); break;
    case 2: dots<2>(q, k, stride, d, out); break;
    default: dots<1>(q, k, stride, d, out);
  }
}

// out[0 .. 8W) = sum over t of p[t] * v[t][0 .. 8W) (rows `stride` apart), summed over t in order in W registers
// (W / 2 in the AVX-512 build: each output takes the same multiply-adds). Columns with p = 0 (hidden, or
// underflowed) are skipped: they would add exact zeros.
template <int W>
inline void weigh(const float* p, const float* v, int64_t stride, int64_t end, float* out) {
#ifdef __AVX512F__
  if constexpr (W % 2 == 0) {
    __m512 acc[W / 2];
    for (int j = 0; j < W / 2; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < end; ++t) {
      if (p[t] == 0) continue;
      const __m512 pt = _mm512_set1_ps(p[t]);
      const float* vr = v + t * stride;
      for (int j = 0; j < W / 2; ++j) acc[j] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vr + 16 * j), acc[j]);
    }
    for (int j = 0; j < W / 2; ++j) _mm512_storeu_ps(out + 16 * j, acc[j]);
    return;
  }
#endif
  __m256 acc[W];
  for (int j = 0; j < W; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < end; ++t) {
    if (p[t] == 0) continue;
    const __m256 pt = _mm256_set1_ps(p[t]);
    const float* vr = v + t * stride;
    for (int j = 0; j < W; ++j) acc[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 8 * j), acc[j]);
  }
  for (int j = 0; j < W; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

// The same for the last 4 columns of a head whose size is 4 mod 8.
inline void weigh4(const float* p, const float* v, int64_t stride, int64_t end, float* out) {
  __m128 acc = _mm_setzero_ps();
  for (int64_t t = 0; t < end; ++t) {
    if (p[t] == 0) continue;
    acc = _mm_fmadd_ps(_mm_set1_ps(p[t]), _mm_loadu_ps(v + t * stride), acc);
  }
  _mm_storeu_ps(out, acc);
}

// out = g / (1 + exp(-g)) * u, 8 at a time (the last few through a padded copy, by the same instructions).
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  auto eight = [&](__m256 gv, __m256 uv) {
    return _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)))), uv);
  };
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) _mm256_storeu_ps(out + e, eight(_mm256_loadu_ps(g + e), _mm256_loadu_ps(u + e)));
  if (e == n) return;
  alignas(32) float gb[8] = {}, ub[8] = {}, ob[8];
  std::copy(g + e, g + n, gb);
  std::copy(u + e, u + n, ub);
  _mm256_store_ps(ob, eight(_mm256_load_ps(gb), _mm256_load_ps(ub)));
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
// scaled by 1/sqrt(d)), the chunk's k and v written into the caches at columns past.., and each query's softmax
// over the columns it may see (`hidden`: [b, 1, L * group, past + L], true where it may not) -> att [b*L, heads*d].
// All in float32, each query on its own in a fixed order (the scores' max, exp, sum and division 8 columns at a
// time, the sum in 8 lanes then a fixed tree), so a query's result depends on its own inputs only.
inline void attention(int64_t i, const float* qkv, const float* rope, const at::Tensor& kc, const at::Tensor& vc,
                      const bool* hidden, const Shape& s, float* att) {
  const int64_t heads = s.heads, kv = s.kv, d = s.d, group = heads / kv, end = s.past + s.length;
  const int64_t width = (heads + 2 * kv) * d, rows = s.b * s.length;
  std::vector<float> q(static_cast<size_t>(rows) * heads * d);   // the rotated queries
  float* kb = kc.data_ptr<float>();
  float* vb = vc.data_ptr<float>();
  const int64_t k0 = kc.stride(0), k1 = kc.stride(1), k2 = kc.stride(2), k3 = kc.stride(3);
  const int64_t v0 = vc.stride(0), v1 = vc.stride(1), v2 = vc.stride(2), v3 = vc.stride(3);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t bi = r / s.length, col = s.past + r % s.length;
    const float* row = qkv + r * width;
    const float* cs = rope + r * (heads + kv) * d;   // (cos, sin) per pair of each head
    for (int64_t h = 0; h < heads + kv; ++h)
      rotate(row + h * d, cs + h * d, d,
             h < heads ? q.data() + (r * heads + h) * d : kb + i * k0 + bi * k1 + (h - heads) * k2 + col * k3);
    for (int64_t g = 0; g < kv; ++g)
      std::copy_n(row + (heads + kv + g) * d, d, vb + i * v0 + bi * v1 + g * v2 + col * v3);
  }
  const int64_t padded = (end + 7) / 8 * 8;
  std::vector<float> score(padded);
  const float inf = std::numeric_limits<float>::infinity();
  const __m256 minus_inf = _mm256_set1_ps(-inf);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t bi = r / s.length, l = r % s.length;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t g = h / group;
      const float* qh = q.data() + (r * heads + h) * d;
      const float* kt = kb + i * k0 + bi * k1 + g * k2;
      const float* vt = vb + i * v0 + bi * v1 + g * v2;
      const bool* hid = hidden ? hidden + (bi * s.length * group + l * group + h % group) * end : nullptr;
      for (int64_t t = 0; t < end; t += 4) dots(qh, kt + t * k3, k3, d, static_cast<int>(std::min<int64_t>(4, end - t)),
                                                  score.data() + t);
      std::fill(score.begin() + end, score.end(), -inf);
      if (hid) {
        int64_t t = 0;
        for (; t + 8 <= end; t += 8) {
          const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hid + t)));
          const __m256 out = _mm256_castsi256_ps(_mm256_cmpgt_epi32(m, _mm256_setzero_si256()));
          _mm256_storeu_ps(score.data() + t, _mm256_blendv_ps(_mm256_loadu_ps(score.data() + t), minus_inf, out));
        }
        for (; t < end; ++t)
          if (hid[t]) score[t] = -inf;
      }
      __m256 top8 = minus_inf;
      for (int64_t t = 0; t < padded; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(score.data() + t));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, top8);
      const __m256 top = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
      __m256 sum8 = _mm256_setzero_ps();
      for (int64_t t = 0; t < padded; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(score.data() + t), top));   // hidden: exactly 0
        _mm256_storeu_ps(score.data() + t, e);
        sum8 = _mm256_add_ps(sum8, e);
      }
      _mm256_store_ps(lanes, sum8);
      const __m256 sum = _mm256_set1_ps(((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                                        ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
      for (int64_t t = 0; t < padded; t += 8)
        _mm256_storeu_ps(score.data() + t, _mm256_div_ps(_mm256_loadu_ps(score.data() + t), sum));
      float* out = att + r * heads * d + h * d;
      int64_t e = 0;
      for (; e + 64 <= d; e += 64) weigh<8>(score.data(), vt + e, v3, end, out + e);
      for (; e + 8 <= d; e += 8) weigh<1>(score.data(), vt + e, v3, end, out + e);
      if (e < d) weigh4(score.data(), vt + e, v3, end, out + e);
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
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                  k_cache.stride(4) == 1 && v_cache.stride(4) == 1 && k_cache.size(3) >= past + length,
              "layers: float32 caches [layers, batch, kv, columns, d] with room for the chunk are expected");
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
