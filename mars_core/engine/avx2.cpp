// w8a8's product on an AVX2 CPU, built by mars_core/engine/avx2.py; the Python side says why it exists.
//
// It computes, bitwise, what mars_core/vnni.cpp computes (and fbgemm computes on an AVX512-VNNI CPU): each row
// scaled to [-1, 1] by its largest magnitude and quantized as fbgemm quantizes it (round(fma(u, 1/scale, 128)),
// uint8, minus 128), exact int32 sums against the per-channel int8 weights, then fbgemm's rescale
// raw * (a_scale * w_scale) and W8A8Linear's fp32 epilogue (second pass, magnitude, bias) in that order. Built with
// -ffp-contract=off so the compiler fuses no multiply-add that the torch ops round twice.
//
// The sums use vpmaddwd on bytes widened to int16, whose pair sums cannot overflow; fbgemm's AVX2 path multiplies
// with vpmaddubsw, whose int16 pair sums saturate, so on these CPUs its sums are not exact. One pass over a block
// of 4 weight rows serves 3 activation rows (12 accumulators of the 16 ymm registers). A block is stored as one run
// of memory, the 4 rows' 16 inputs of each step side by side, so a product reads its weights as one stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <immintrin.h>

#include "w8a8_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// Built twice. Without MARS_WIDE: w8a8 (torch.ops.mars_avx2), the definition above. With MARS_WIDE: w8a16
// (torch.ops.mars_avx2w), where each row is quantized once to int16 levels instead of int8 plus a second pass for
// the rounding's remainder. vpmaddwd multiplies int16 by int16 anyway, so a row costs what an int8 row costs, and
// the rows that w8a8 multiplies twice (q/k/v and down, at every position a lossless step must keep exact) are
// multiplied once. The levels are capped so that no int32 sum can overflow (levels()).
#ifdef MARS_WIDE
constexpr bool WIDE = true;
#else
constexpr bool WIDE = false;
#endif

// w8a16's largest activation level for a product of kp (padded) inputs: 32767, or less where kp inputs of that
// level times weights of 127 could pass the int32 range (kp > 516). A function of the weight's shape only, so every
// row of every call quantizes alike.
int64_t levels(int64_t kp) {
  TORCH_CHECK(kp > 0, "levels: a product needs at least one input");
  return std::min<int64_t>(32767, std::numeric_limits<int32_t>::max() / (127 * kp));
}

namespace {

constexpr int64_t CH = 4;    // weight rows (output channels) per block
constexpr int64_t RW = 3;    // activation rows per pass over a block
constexpr int64_t KS = 16;   // inputs per step: one ymm of int16
// How far ahead of the step a block reads (bytes): one cache line a step, far enough that the line arrives before
// the step needs it (4 KB gave the same speed as 2 and 8 KB; docs/experiments.md, "The AVX2 kernel reads its
// weights as one stream").
constexpr int64_t AHEAD = 4096;

// w int8 [N, K] -> int8 [ceil(N / 4) * 4, Kp] with Kp = K rounded up to 16; padding is zero. Block b (rows 4b ..
// 4b + 3) fills rows 4b .. 4b + 3 of the result as [Kp / 16 steps][4 rows][16 inputs]: what block() reads, in order.
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "pack: an int8 [N, K] weight is expected");
  auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), kp = (k + KS - 1) / KS * KS, np = (n + CH - 1) / CH * CH;
  auto out = at::zeros({np, kp}, wc.options());
  int8_t* o = out.data_ptr<int8_t>();
  const int8_t* src = wc.data_ptr<int8_t>();
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < k; i += KS)
      std::memcpy(o + (j / CH) * CH * kp + i * CH + (j % CH) * KS, src + j * k + i, std::min(KS, k - i));
  return out;
}

float max_abs(const float* x, int64_t k) {
  float m = 0.f;
  for (int64_t i = 0; i < k; ++i) m = std::max(m, std::fabs(x[i]));
  return std::max(m, 1e-30f);   // torch: .abs().amax().clamp(min=1e-30)
}

// fbgemm's activation quantization for [-1, 1] (scale 2/255 in fp32, zero point 128), minus the zero point, as
// int16.
void quantize(const float* u, int16_t* q, int64_t k, float inverse) {
  for (int64_t i = 0; i < k; ++i) {
    const float t = std::nearbyint(std::fma(u[i], inverse, 128.f));   // one rounding, half to even, as fbgemm
    q[i] = static_cast<int16_t>(std::min(std::max(t, 0.f), 255.f)) - 128;
  }
}

// One row of the layer input -> its quantized row (and, at a `second` row index >= 0, the quantized remainder of
// the first rounding), as mars_core.engine.w8a8 does op for op: u = x / magnitude; r = u - round(u * inverse) * step.
void prepare(const float* x, int64_t k, int64_t kp, int64_t m, int64_t second, float inverse, float step,
             int16_t* a, float* mags, float* r_mags, std::vector<float>& u) {
  x += m * k;
  mags[m] = max_abs(x, k);
  for (int64_t i = 0; i < k; ++i) u[i] = x[i] / mags[m];
  quantize(u.data(), a + m * kp, k, inverse);
  if (second < 0) return;
  for (int64_t i = 0; i < k; ++i) {
    const float g = std::min(std::max(std::nearbyint(u[i] * inverse), -128.f), 127.f);
    u[i] = u[i] - g * step;
  }
  r_mags[m] = max_abs(u.data(), k);
  for (int64_t i = 0; i < k; ++i) u[i] = u[i] / r_mags[m];
  quantize(u.data(), a + second * kp, k, inverse);
}

// w8a16: one row of the layer input -> its int16 levels, round(x / magnitude * levels) (half to even); no second
// pass. The magnitude and the division are w8a8's (prepare), so the two formats differ only in the rounding.
void prepare_wide(const float* x, int64_t k, int64_t kp, int64_t m, int16_t* a, float* mags) {
  x += m * k;
  mags[m] = max_abs(x, k);
  const float top = static_cast<float>(levels(kp));
  int16_t* q = a + m * kp;
  for (int64_t i = 0; i < k; ++i) {
    const float t = std::nearbyint((x[i] / mags[m]) * top);
    q[i] = static_cast<int16_t>(std::min(std::max(t, -top), top));
  }
}

// The four channels' sums of one row: lanes of c0..c3 added within each accumulator, into out[0..3].
inline void reduce4(__m256i c0, __m256i c1, __m256i c2, __m256i c3, int32_t* out) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(c0, c1), _mm256_hadd_epi32(c2, c3));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

// Sums of R (1 or 2) activation rows (int16, kp apart) against one packed block of 4 weight rows: sums[r * 4 + c].
template <int R>
void block(const int16_t* a, const int8_t* w, int64_t kp, int32_t* sums) {
  static_assert(R == 1 || R == 2, "three rows go through block3");
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
  for (int64_t i = 0; i < kp; i += KS) {
    const int8_t* wi = w + i * CH;   // this step's 4 x 16 weights: one cache line
    _mm_prefetch(reinterpret_cast<const char*>(wi + AHEAD), _MM_HINT_T0);   // without it AR ran ~1.15x slower
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wi)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wi + KS)));
    const __m256i w2 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wi + 2 * KS)));
    const __m256i w3 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wi + 3 * KS)));
    const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i));
    c00 = _mm256_add_epi32(c00, _mm256_madd_epi16(w0, a0));
    c01 = _mm256_add_epi32(c01, _mm256_madd_epi16(w1, a0));
    c02 = _mm256_add_epi32(c02, _mm256_madd_epi16(w2, a0));
    c03 = _mm256_add_epi32(c03, _mm256_madd_epi16(w3, a0));
    if constexpr (R > 1) {
      const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + kp + i));
      c10 = _mm256_add_epi32(c10, _mm256_madd_epi16(w0, a1));
      c11 = _mm256_add_epi32(c11, _mm256_madd_epi16(w1, a1));
      c12 = _mm256_add_epi32(c12, _mm256_madd_epi16(w2, a1));
      c13 = _mm256_add_epi32(c13, _mm256_madd_epi16(w3, a1));
    }
  }
  reduce4(c00, c01, c02, c03, sums);
  if constexpr (R > 1) reduce4(c10, c11, c12, c13, sums + 4);
}

// block() for 3 rows, in assembly. Written with intrinsics, g++ kept 8 of the 12 accumulators in memory (a load and
// a store each a step), which made three rows cost 1.7x what this loop costs and a pass over the weights wait on
// arithmetic rather than memory. Here the accumulators stay in ymm4-15 for the whole loop (row r, channel c in
// ymm 4 + 4r + c); rows 1 and 2 of the step sit in ymm2-3, row 0 is read by each multiply from memory (L1), ymm0
// holds a weight row and ymm1 a product. The same integer sums as block(), so the same bits.
void block3(const int16_t* a, const int8_t* w, int64_t kp, int32_t* sums) {
  alignas(32) int32_t acc[12 * 8];
  const int16_t* a1 = a + kp;
  const int16_t* a2 = a + 2 * kp;
  int64_t i = 0;
#define MARS_W(off, c0, c1, c2)                                   \
  "vpmovsxbw " #off "(%[w]), %%ymm0\n\t"                           \
  "vpmaddwd (%[a0],%[i],2), %%ymm0, %%ymm1\n\t"                    \
  "vpaddd %%ymm1, %%ymm" #c0 ", %%ymm" #c0 "\n\t"                  \
  "vpmaddwd %%ymm2, %%ymm0, %%ymm1\n\t"                            \
  "vpaddd %%ymm1, %%ymm" #c1 ", %%ymm" #c1 "\n\t"                  \
  "vpmaddwd %%ymm3, %%ymm0, %%ymm0\n\t"                            \
  "vpaddd %%ymm0, %%ymm" #c2 ", %%ymm" #c2 "\n\t"
  asm volatile(
      "vpxor %%xmm4, %%xmm4, %%xmm4\n\t" "vpxor %%xmm5, %%xmm5, %%xmm5\n\t" "vpxor %%xmm6, %%xmm6, %%xmm6\n\t"
      "vpxor %%xmm7, %%xmm7, %%xmm7\n\t" "vpxor %%xmm8, %%xmm8, %%xmm8\n\t" "vpxor %%xmm9, %%xmm9, %%xmm9\n\t"
      "vpxor %%xmm10, %%xmm10, %%xmm10\n\t" "vpxor %%xmm11, %%xmm11, %%xmm11\n\t"
      "vpxor %%xmm12, %%xmm12, %%xmm12\n\t" "vpxor %%xmm13, %%xmm13, %%xmm13\n\t"
      "vpxor %%xmm14, %%xmm14, %%xmm14\n\t" "vpxor %%xmm15, %%xmm15, %%xmm15\n\t"
      "1:\n\t"
      "prefetcht0 %c[ahead](%[w])\n\t"
      "vmovdqu (%[a1],%[i],2), %%ymm2\n\t"
      "vmovdqu (%[a2],%[i],2), %%ymm3\n\t"
      MARS_W(0, 4, 8, 12) MARS_W(16, 5, 9, 13) MARS_W(32, 6, 10, 14) MARS_W(48, 7, 11, 15)
      "add $64, %[w]\n\t"
      "add $16, %[i]\n\t"
      "cmp %[kp], %[i]\n\t"
      "jl 1b\n\t"
      "vmovdqa %%ymm4, (%[acc])\n\t" "vmovdqa %%ymm5, 32(%[acc])\n\t" "vmovdqa %%ymm6, 64(%[acc])\n\t"
      "vmovdqa %%ymm7, 96(%[acc])\n\t" "vmovdqa %%ymm8, 128(%[acc])\n\t" "vmovdqa %%ymm9, 160(%[acc])\n\t"
      "vmovdqa %%ymm10, 192(%[acc])\n\t" "vmovdqa %%ymm11, 224(%[acc])\n\t" "vmovdqa %%ymm12, 256(%[acc])\n\t"
      "vmovdqa %%ymm13, 288(%[acc])\n\t" "vmovdqa %%ymm14, 320(%[acc])\n\t" "vmovdqa %%ymm15, 352(%[acc])\n\t"
      : [w] "+r"(w), [i] "+r"(i)
      : [a0] "r"(a), [a1] "r"(a1), [a2] "r"(a2), [kp] "r"(kp), [acc] "r"(acc), [ahead] "i"(AHEAD)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#undef MARS_W
  const __m256i* c = reinterpret_cast<const __m256i*>(acc);
  for (int r = 0; r < 3; ++r)
    reduce4(_mm256_load_si256(c + 4 * r), _mm256_load_si256(c + 4 * r + 1), _mm256_load_si256(c + 4 * r + 2),
            _mm256_load_si256(c + 4 * r + 3), sums + 4 * r);
}

// y [rows, n] = W8A8Linear(x) for fp32 x [rows, k]; `packed` from pack(), `scale` fp32(a_scale * w_scale) per
// channel, `bias` optional. With `two`, every row gets the second pass except, when `tail` > 0, the last `tail` of
// every `length` rows (a lossless step's masks; see mars_core/vnni.cpp). w8a16 (MARS_WIDE): `scale` is
// fp32(w_scale / levels(kp)), and `two`, `inverse` and `step` are not used.
at::Tensor linear_into(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, bool two, double inverse_d, double step_d,
                       int64_t length, int64_t tail, mars_w8a8::Top* top) {
  mars_w8a8::check_linear(x_in, length, tail);
  auto x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = scale.size(0), kp = packed.size(1);
  TORCH_CHECK(packed.dim() == 2 && kp == (k + KS - 1) / KS * KS && packed.size(0) == (n + CH - 1) / CH * CH,
              "linear: the packed weight does not match the input width");
  std::vector<int64_t> second;   // row -> the index of its second-pass row, or -1
  const int64_t all = mars_w8a8::second_rows(rows, length, tail, two && !WIDE, second);
  const float inverse = static_cast<float>(inverse_d), step = static_cast<float>(step_d);
  std::vector<int16_t> a(all * kp, 0);   // zero in the padding columns
  std::vector<float> mags(rows), r_mags(rows, 0.f), u(k);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m) {
    if constexpr (WIDE) prepare_wide(xp, k, kp, m, a.data(), mags.data());
    else prepare(xp, k, kp, m, second[m], inverse, step, a.data(), mags.data(), r_mags.data(), u);
  }
  auto y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sc = scale.data_ptr<float>();
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  std::vector<int32_t> sums(all * CH);
  // each row's top so far (strictly larger wins: the first column of a tie stays) and its first NaN column
  const bool tops = top != nullptr && top->wanted();
  if (tops && top->sum != nullptr) {   // this loop gathers no sums: NaN says so (the decoder then takes a softmax)
    for (int64_t m = 0; m < rows; ++m)
      if (top->sums(m)) top->sum[m] = std::numeric_limits<float>::quiet_NaN();
    top->conf_from = -1;
  }
  std::vector<float> best(rows, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> at(rows, 0), nan_at(rows, -1), skip;
  std::vector<char> track;   // unused here: this loop gathers no sums
  if (tops) top->per_row(rows, skip, track);
  for (int64_t j0 = 0; j0 < n; j0 += CH) {
    for (int64_t m0 = 0; m0 < all; m0 += RW) {
      const int64_t r = std::min(RW, all - m0);
      const int16_t* am = a.data() + m0 * kp;
      int32_t* s = sums.data() + m0 * CH;
      if (r == 3) block3(am, wp + j0 * kp, kp, s);
      else if (r == 2) block<2>(am, wp + j0 * kp, kp, s);
      else block<1>(am, wp + j0 * kp, kp, s);
    }
    const int64_t width = std::min(CH, n - j0);
    for (int64_t m = 0; m < rows; ++m) {
      float* out = yp + m * n + j0;
      if (width == CH) {   // the scalar loop's operations in its order, one channel a lane: the same bits
        const __m128 s4 = _mm_loadu_ps(sc + j0);
        const __m128i s1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sums.data() + m * CH));
        __m128 v = _mm_mul_ps(_mm_cvtepi32_ps(s1), s4);
        if (second[m] >= 0) {
          const __m128i s2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sums.data() + second[m] * CH));
          v = _mm_add_ps(v, _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(s2), s4), _mm_set1_ps(r_mags[m])));
        }
        v = _mm_mul_ps(v, _mm_set1_ps(mags[m]));
        if (bp) v = _mm_add_ps(v, _mm_loadu_ps(bp + j0));
        _mm_storeu_ps(out, v);
      } else {
        for (int64_t c = 0; c < width; ++c) {
          const int64_t j = j0 + c;
          float v = static_cast<float>(sums[m * CH + c]) * sc[j];
          if (second[m] >= 0) v = v + static_cast<float>(sums[second[m] * CH + c]) * sc[j] * r_mags[m];
          v = v * mags[m];
          if (bp) v = v + bp[j];
          out[c] = v;
        }
      }
      for (int64_t c = 0; tops && c < width; ++c) {
        const int64_t j = j0 + c;
        const float v = out[c];
        if (j == skip[m]) continue;
        if (v > best[m]) best[m] = v, at[m] = j;
        else if (std::isnan(v) && nan_at[m] < 0) nan_at[m] = j;
      }
    }
  }
  for (int64_t m = 0; tops && m < rows; ++m) {
    top->merge(m, best[m], at[m]);
    if (nan_at[m] >= 0) top->merge(m, std::numeric_limits<float>::quiet_NaN(), nan_at[m]);
  }
  return y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                  const c10::optional<at::Tensor>& bias, bool two, double inverse, double step, int64_t length,
                  int64_t tail) {
  return linear_into(x, packed, scale, bias, two, inverse, step, length, tail, nullptr);
}

}  // namespace

#ifdef MARS_WIDE
MARS_W8A8_OPS(mars_avx2w)
TORCH_LIBRARY_FRAGMENT(mars_avx2w, m) { m.def("levels(int kp) -> int", &levels); }
#else
MARS_W8A8_OPS(mars_avx2)
#endif
