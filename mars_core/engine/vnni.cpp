// w8a8's product on an AVX512-VNNI CPU, built by mars_core/engine/vnni.py; the Python side says why it exists.
//
// It computes, bitwise, what mars_core.engine.w8a8.W8A8Linear.forward computes through fbgemm: each row scaled to
// [-1, 1] by its largest magnitude and quantized as fbgemm quantizes it (round(fma(u, 1/scale, 128)), uint8),
// exact int32 sums against the per-channel int8 weights, then fbgemm's float rescale raw * (a_scale * w_scale)
// and the same fp32 epilogue (second pass, magnitude, bias) in the same order. Built with -ffp-contract=off so
// the compiler fuses no multiply-add that the torch ops round twice.
//
// The weights are read once per call whatever the number of rows (up to ROWS rows per pass over them), which is
// what keeps a 7- or 16-position forward close to a 1-position one: fbgemm's cost grows with the rows.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include "w8a8_kernel.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

namespace {

constexpr int LANES = 16;   // output channels per block: one zmm of int32 sums
// Bytes of weights fetched ahead while the rows' products run: into L1 a little ahead, and into L2 far enough ahead
// to cover the memory's latency. Without the far one, 5-7 rows (compute-bound stretches) did not overlap their
// weight reads with their products and cost the sum of both (docs/experiments.md, "The VNNI kernel").
constexpr int PREFETCH = 1024;
constexpr int FAR = 8192;
constexpr int ROWS = 24;    // activation rows per pass over the weights: 24 accumulators + weights + broadcast

// w int8 [N, K] -> uint8 w + 128, laid out [ceil(N / 16)][ceil(K / 4)][16][4]: a block's 16 channels x 4 inputs are
// the 64 bytes that one vpdpbusd (unsigned x signed bytes) multiplies by 4 activation bytes broadcast to every lane.
// The weights are the unsigned side so that the activations, the signed side, can be broadcast straight from
// memory inside the instruction. The +128 comes back out as 128 x the row's activation sum. Padding meets zero
// activations.
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "pack: an int8 [N, K] weight is expected");
  auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), k4 = (k + 3) / 4, blocks = (n + LANES - 1) / LANES;
  auto out = at::empty({blocks * k4 * LANES * 4}, wc.options());
  int8_t* dst = out.data_ptr<int8_t>();
  std::memset(dst, 0, out.numel());
  const int8_t* src = wc.data_ptr<int8_t>();
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < k; ++i)
      dst[((j / LANES) * k4 + i / 4) * LANES * 4 + (j % LANES) * 4 + i % 4] =
          static_cast<int8_t>(static_cast<uint8_t>(src[j * k + i] + 128));
  return out;
}

inline __mmask16 head(int64_t left) {   // the lanes of a 16-float step that are inside the row
  return left >= LANES ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

inline __m512 round_even(__m512 v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// fbgemm's activation quantization for the range [-1, 1] (scale 2/255 in fp32, zero point 128): one fused
// multiply-add, rounded half to even, clamped to uint8; stored minus the zero point, as int8. Returns the row's sum.
inline int32_t quantize(const float* u, int8_t* q, int64_t k, float inverse) {
  const __m512 inv = _mm512_set1_ps(inverse), zero = _mm512_set1_ps(128.f);
  const __m512 lo = _mm512_set1_ps(0.f), hi = _mm512_set1_ps(255.f);
  const __m512i centre = _mm512_set1_epi32(128);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t i = 0; i < k; i += LANES) {
    const __mmask16 in = head(k - i);
    const __m512 t = round_even(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(in, u + i), inv, zero));
    const __m512i v = _mm512_maskz_sub_epi32(in, _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(t, lo), hi)), centre);
    sum = _mm512_add_epi32(sum, v);
    _mm_mask_storeu_epi8(q + i, in, _mm512_cvtepi32_epi8(v));
  }
  return _mm512_reduce_add_epi32(sum);
}

inline float max_abs(const float* x, int64_t k) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += LANES) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_maskz_loadu_ps(head(k - i), x + i)));
  return std::max(_mm512_reduce_max_ps(m), 1e-30f);   // torch: .abs().amax().clamp(min=1e-30)
}

// x / d for a row, in place or into `out`.
inline void divide(const float* x, float d, float* out, int64_t k) {
  const __m512 dv = _mm512_set1_ps(d);
  for (int64_t i = 0; i < k; i += LANES) {
    const __mmask16 in = head(k - i);
    _mm512_mask_storeu_ps(out + i, in, _mm512_div_ps(_mm512_maskz_loadu_ps(in, x + i), dv));
  }
}

// One row of the layer input -> its quantized row (and, at a `second` row index >= 0, the quantized remainder of the
// first rounding), as mars_core.engine.w8a8 does op for op: u = x / magnitude; r = u - round(u * inverse) * step.
void prepare(const float* x, int64_t m, int64_t second, int64_t k, int64_t kp, float inverse, float step,
             int8_t* a, int32_t* sums, float* mags, float* r_mags, float* u) {
  x += m * k;
  mags[m] = max_abs(x, k);
  divide(x, mags[m], u, k);
  sums[m] = quantize(u, a + m * kp, k, inverse);
  if (second < 0) return;
  const __m512 inv = _mm512_set1_ps(inverse), st = _mm512_set1_ps(step);
  const __m512 lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  for (int64_t i = 0; i < k; i += LANES) {
    const __mmask16 in = head(k - i);
    const __m512 v = _mm512_maskz_loadu_ps(in, u + i);
    const __m512 g = _mm512_min_ps(_mm512_max_ps(round_even(_mm512_mul_ps(v, inv)), lo), hi);
    _mm512_mask_storeu_ps(u + i, in, _mm512_sub_ps(v, _mm512_mul_ps(g, st)));
  }
  r_mags[m] = max_abs(u, k);
  divide(u, r_mags[m], u, k);
  sums[second] = quantize(u, a + second * kp, k, inverse);
}

// acc += 4-byte dot products of the weights' unsigned bytes with 4 signed activation bytes broadcast from memory
// ({1to16}). Written as asm because gcc's intrinsic neither folds the broadcast into the instruction nor keeps the
// accumulator in place (it copied every accumulator each step).
inline void dpbusd(__m512i& acc, __m512i w, const int8_t* four) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(four)));
}

// Sums of R activation rows (int8, kp bytes apart) against one block of 16 channels, into sums[r][16]. The
// accumulators are named variables, not an array: gcc kept an array of them on the stack.
#define MARS_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15) \
  X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
template <int R>
void block(const int8_t* a, int64_t kp, const int8_t* w, int64_t k4, int32_t* sums) {
#define MARS_ZERO(r) __m512i c##r = _mm512_setzero_si512();
  MARS_ROWS(MARS_ZERO)
  for (int64_t i = 0; i < k4; ++i) {
    const __m512i b = _mm512_loadu_si512(w + i * LANES * 4);
    _mm_prefetch(reinterpret_cast<const char*>(w + i * LANES * 4 + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + i * LANES * 4 + FAR), _MM_HINT_T1);
#define MARS_DOT(r) if constexpr (R > r) dpbusd(c##r, b, a + r * kp + 4 * i);
    MARS_ROWS(MARS_DOT)
  }
#define MARS_STORE(r) if constexpr (R > r) _mm512_storeu_si512(sums + r * LANES, c##r);
  MARS_ROWS(MARS_STORE)
}

// 16 outputs of one row from its int32 sums: the exact sum of (q - 128) x w (fbgemm's acc - 128 x column sum,
// here acc - 128 x the row's sum), fbgemm's rescale float(raw) * (a_scale * w_scale), then W8A8Linear's epilogue
// in its order: + second pass x its magnitude, x the row's magnitude, + bias.
inline void finish(const int32_t* s1, int32_t z1, const int32_t* s2, int32_t z2, float r_mag, float mag,
                   const float* scale, const float* bias, float* out, __mmask16 keep, bool two) {
  const __m512 sc = _mm512_maskz_loadu_ps(keep, scale);
  __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(s1), _mm512_set1_epi32(128 * z1))), sc);
  if (two) {
    __m512 second = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(s2),
                                                                      _mm512_set1_epi32(128 * z2))), sc);
    v = _mm512_add_ps(v, _mm512_mul_ps(second, _mm512_set1_ps(r_mag)));
  }
  v = _mm512_mul_ps(v, _mm512_set1_ps(mag));
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias));
  _mm512_mask_storeu_ps(out, keep, v);
}

// The same for R <= 4 rows with four accumulator chains per row (steps i, i+1, i+2, i+3), summed at the end. One
// chain per row would wait on vpdpbusd's latency at every step: with one or two rows (AR) the product was bound by
// that latency, not by reading the weights. The sums are integers, so the order changes nothing.
#define MARS_FEW(X) X(0) X(1) X(2) X(3)
template <int R>
void few(const int8_t* a, int64_t kp, const int8_t* w, int64_t k4, int32_t* sums) {
#define MARS_ZERO4(r) __m512i c##r##0 = _mm512_setzero_si512(), c##r##1 = c##r##0, c##r##2 = c##r##0, c##r##3 = c##r##0;
  MARS_FEW(MARS_ZERO4)
  int64_t i = 0;
  for (; i + 4 <= k4; i += 4) {
    const int8_t* wi = w + i * LANES * 4;
    const __m512i b0 = _mm512_loadu_si512(wi), b1 = _mm512_loadu_si512(wi + 64);
    const __m512i b2 = _mm512_loadu_si512(wi + 128), b3 = _mm512_loadu_si512(wi + 192);
#define MARS_DOT4(r) if constexpr (R > r) { const int8_t* ar = a + r * kp + 4 * i; dpbusd(c##r##0, b0, ar); \
    dpbusd(c##r##1, b1, ar + 4); dpbusd(c##r##2, b2, ar + 8); dpbusd(c##r##3, b3, ar + 12); }
    MARS_FEW(MARS_DOT4)
  }
  for (; i < k4; ++i) {
    const __m512i b = _mm512_loadu_si512(w + i * LANES * 4);
#define MARS_DOT1(r) if constexpr (R > r) dpbusd(c##r##0, b, a + r * kp + 4 * i);
    MARS_FEW(MARS_DOT1)
  }
#define MARS_STORE4(r) if constexpr (R > r) _mm512_storeu_si512(sums + r * LANES, \
    _mm512_add_epi32(_mm512_add_epi32(c##r##0, c##r##1), _mm512_add_epi32(c##r##2, c##r##3)));
  MARS_FEW(MARS_STORE4)
}

using BlockFn = void (*)(const int8_t*, int64_t, const int8_t*, int64_t, int32_t*);

template <int... R>
constexpr std::array<BlockFn, sizeof...(R)> table(std::integer_sequence<int, R...>) {
  return {&block<R + 1>...};
}
const auto BLOCKS = table(std::make_integer_sequence<int, ROWS>{});
constexpr std::array<BlockFn, 4> FEW = {&few<1>, &few<2>, &few<3>, &few<4>};

// ----------------------------------------------------------------------------------------------------------------
// AMX, Intel's tile unit: the same int32 sums, so the results stay bitwise the VNNI loop's (and fbgemm's).
// TDPBSUD multiplies up to 16 rows of 64 signed activation bytes by 64 inputs x 16 channels of unsigned weight bytes
// in the layout pack() already writes (16 rows of 16 channels x 4 inputs), so one tile load takes 1 KB of a channel
// block. Where the CPU has it, every product uses it, one row included: the tiles take about one row's time up to
// 8 rows and read the weights faster than the VNNI loop even for one (docs/experiments.md, "AMX tiles in the VNNI
// kernel").
constexpr int TILE_ROWS = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

std::atomic<int> amx_state{-1};   // -1: not yet asked, 0: off, 1: on

bool amx_detect() {   // the CPU has AMX-TILE and AMX-INT8, and Linux lets this process use the tile registers
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

bool amx_on() {
  int state = amx_state.load();
  if (state < 0) amx_state = state = amx_detect() ? 1 : 0;
  return state == 1;
}

// want 1: use AMX where it is available; 0: never; -1: leave as is. Returns whether AMX is used.
bool use_amx(int64_t want) {
  if (want >= 0) amx_state = want > 0 && amx_detect() ? 1 : 0;
  return amx_on();
}

// Sums of the configured rows (tiles 0-3: G blocks' int32 sums, 4: activations, 5 and 6: weights) over `chunks` x 64
// inputs, for G consecutive channel blocks `stride` bytes apart, stored 16 int32 per row into out + g * out_stride.
template <int G>
__attribute__((target("amx-tile,amx-int8"))) void amx_group(const int8_t* a, int64_t kp, const int8_t* w,
                                                             int64_t stride, int64_t chunks, int32_t* out,
                                                             int64_t out_stride) {
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    const int8_t* wc = w + c * TILE_ROWS * LANES * 4;
    _tile_loadd(4, a + c * 64, kp);
    _tile_loadd(5, wc, LANES * 4);
    _tile_dpbsud(0, 4, 5);
    if constexpr (G > 1) { _tile_loadd(6, wc + stride, LANES * 4); _tile_dpbsud(1, 4, 6); }
    if constexpr (G > 2) { _tile_loadd(5, wc + 2 * stride, LANES * 4); _tile_dpbsud(2, 4, 5); }
    if constexpr (G > 3) { _tile_loadd(6, wc + 3 * stride, LANES * 4); _tile_dpbsud(3, 4, 6); }
  }
  _tile_stored(0, out, LANES * 4);
  if constexpr (G > 1) _tile_stored(1, out + out_stride, LANES * 4);
  if constexpr (G > 2) _tile_stored(2, out + 2 * out_stride, LANES * 4);
  if constexpr (G > 3) _tile_stored(3, out + 3 * out_stride, LANES * 4);
}

// ldtilecfg written out: gcc's _tile_loadconfig tells the compiler it reads only a pointer's worth of the
// configuration, so the stores of the rows and widths were dropped as dead and the tiles stayed unconfigured.
void amx_configure(int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t < 5 ? rows : TILE_ROWS);   // sums and activations: the rows; weights: 16
  }
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

void amx_release() { asm volatile("tilerelease" ::: "memory"); }

// The int32 sums of all `all` rows against channel blocks first .. first + g - 1 (g <= 4), into sums[g][all][16]:
// tiles for the 64-input chunks, the VNNI loop for the last k4 % 16 groups of 4 inputs. `configured`: the rows the
// tiles are configured for (0: none), kept across calls so that a product configures them once, not per block.
void amx_sums(const int8_t* a, int64_t all, int64_t kp, const int8_t* w, int64_t k4, int64_t first, int64_t g,
              int32_t* sums, int32_t* rest, int64_t& configured) {
  const int64_t chunks = k4 / TILE_ROWS, left = k4 % TILE_ROWS, stride = k4 * LANES * 4;
  for (int64_t m0 = 0; m0 < all; m0 += TILE_ROWS) {
    const int64_t r = std::min<int64_t>(TILE_ROWS, all - m0);
    int32_t* out = sums + m0 * LANES;
    const int8_t* w0 = w + first * stride;
    if (chunks > 0) {
      if (r != configured) amx_configure(configured = r);
      switch (g) {
        case 1: amx_group<1>(a + m0 * kp, kp, w0, stride, chunks, out, all * LANES); break;
        case 2: amx_group<2>(a + m0 * kp, kp, w0, stride, chunks, out, all * LANES); break;
        case 3: amx_group<3>(a + m0 * kp, kp, w0, stride, chunks, out, all * LANES); break;
        default: amx_group<4>(a + m0 * kp, kp, w0, stride, chunks, out, all * LANES);
      }
    } else {
      for (int64_t j = 0; j < g; ++j) std::fill_n(out + j * all * LANES, r * LANES, 0);
    }
    if (left == 0) continue;
    const BlockFn fn = r <= 4 ? FEW[r - 1] : BLOCKS[r - 1];
    for (int64_t j = 0; j < g; ++j) {
      fn(a + m0 * kp + chunks * 64, kp, w0 + j * stride + chunks * TILE_ROWS * LANES * 4, left, rest);
      int32_t* o = out + j * all * LANES;
      for (int64_t i = 0; i < r * LANES; ++i) o[i] += rest[i];
    }
  }
}

// exp of 16 floats: the layer stack's exp8 on each half
inline __m512 exp16(__m512 x) {
  const __m256 lo = mars_w8a8::exp8(_mm512_castps512_ps256(x));
  const __m256 hi = mars_w8a8::exp8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

// y [rows, n] = W8A8Linear(x) for fp32 x [rows, k]; `packed` from pack(), `scale` fp32(a_scale * w_scale) per
// channel, `bias` optional. With `two`, every row gets the second pass except, when `tail` > 0, the last `tail` of
// every `length` rows: a lossless step's mask positions, whose outputs only propose drafts that the next step
// checks, so their precision cannot change the answer and their second pass would be spent for nothing.
at::Tensor linear_into(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, bool two, double inverse_d, double step_d,
                       int64_t length, int64_t tail, mars_w8a8::Top* top) {
  mars_w8a8::check_linear(x_in, length, tail);
  auto x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = scale.size(0), k4 = (k + 3) / 4, kp = k4 * 4;
  const int64_t blocks = (n + LANES - 1) / LANES;
  TORCH_CHECK(packed.numel() == blocks * k4 * LANES * 4, "linear: the packed weight does not match the input width");
  std::vector<int64_t> second;   // row -> the index of its second-pass row, or -1
  const int64_t all = mars_w8a8::second_rows(rows, length, tail, two, second);
  const float inverse = static_cast<float>(inverse_d), step = static_cast<float>(step_d);
  std::vector<int8_t> a(all * kp, 0);   // zero in the padding columns
  std::vector<int32_t> a_sums(all);
  std::vector<float> mags(rows), r_mags(rows), u(k);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m)
    prepare(xp, m, second[m], k, kp, inverse, step, a.data(), a_sums.data(), mags.data(), r_mags.data(), u.data());
  auto y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sc = scale.data_ptr<float>();
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  const bool amx = amx_on();
  const int64_t group = amx ? 4 : 1;   // channel blocks whose sums are ready before their outputs are finished
  const bool tops = top != nullptr && top->wanted();
  std::vector<int64_t> skip;   // per row: the column its top leaves out (-1: none)
  std::vector<char> track;     // per row: whether it gathers Top's sum
  if (tops) top->per_row(rows, skip, track);
  at::parallel_for(0, blocks, 8, [&](int64_t first, int64_t last) {
    std::vector<int32_t> sums(group * all * LANES), rest(TILE_ROWS * LANES);
    int64_t configured = 0;
    // each row's top in this chunk, per lane: the largest output so far (strictly larger wins, so a lane keeps the
    // first column of a tie) and the block it came from; and the row's first NaN column
    std::vector<__m512> best(tops ? rows : 0, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
    std::vector<__m512i> from(tops ? rows : 0, _mm512_setzero_si512());
    std::vector<int64_t> nan_at(tops ? rows : 0, -1);
    // and, for the rows that want Top's sum, each lane's sum of exp(v - that lane's largest so far)
    std::vector<__m512> lane_sum(tops ? rows : 0, _mm512_setzero_ps());
    const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t nb0 = first; nb0 < last; nb0 += group) {
      const int64_t g = std::min<int64_t>(group, last - nb0);
      if (amx) {
        amx_sums(a.data(), all, kp, wp, k4, nb0, g, sums.data(), rest.data(), configured);
      } else {
        for (int64_t m0 = 0; m0 < all; m0 += ROWS) {
          const int64_t r = std::min<int64_t>(ROWS, all - m0);
          const BlockFn fn = r <= 4 ? FEW[r - 1] : BLOCKS[r - 1];
          fn(a.data() + m0 * kp, kp, wp + nb0 * k4 * LANES * 4, k4, sums.data() + m0 * LANES);
        }
      }
      for (int64_t nb = nb0; nb < nb0 + g; ++nb) {
        const int32_t* bs = sums.data() + (nb - nb0) * all * LANES;
        const int64_t j0 = nb * LANES, width = std::min<int64_t>(LANES, n - j0);
        const __mmask16 keep = width == LANES ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t s = std::max<int64_t>(second[m], 0);
          finish(bs + m * LANES, a_sums[m], bs + s * LANES, a_sums[s], second[m] >= 0 ? r_mags[m] : 0.f, mags[m],
                 sc + j0, bp ? bp + j0 : nullptr, yp + m * n + j0, keep, second[m] >= 0);
          if (tops) {   // the 16 outputs just written, still in L1
            __mmask16 lanes = keep;
            if (skip[m] >= j0 && skip[m] < j0 + LANES) lanes &= static_cast<__mmask16>(~(1u << (skip[m] - j0)));
            const __m512 v = _mm512_maskz_loadu_ps(lanes, yp + m * n + j0);
            const __mmask16 gt = _mm512_mask_cmp_ps_mask(lanes, v, best[m], _CMP_GT_OQ);
            if (track[m]) {   // a lane's new largest value rescales its sum (exp(-inf) = 0 for a first one)
              const __m512 now = _mm512_mask_mov_ps(best[m], gt, v);
              if (gt) lane_sum[m] = _mm512_mask_mul_ps(lane_sum[m], gt, lane_sum[m], exp16(_mm512_sub_ps(best[m], now)));
              const __mmask16 finite = _mm512_mask_cmp_ps_mask(lanes, v, minus_inf, _CMP_GT_OQ);
              lane_sum[m] = _mm512_mask_add_ps(lane_sum[m], finite, lane_sum[m], exp16(_mm512_sub_ps(v, now)));
            }
            best[m] = _mm512_mask_mov_ps(best[m], gt, v);
            from[m] = _mm512_mask_mov_epi32(from[m], gt, _mm512_set1_epi32(static_cast<int32_t>(j0)));
            if (nan_at[m] < 0) {
              const __mmask16 nan = _mm512_mask_cmp_ps_mask(lanes, v, v, _CMP_UNORD_Q);
              if (nan) nan_at[m] = j0 + __builtin_ctz(nan);
            }
          }
        }
      }
    }
    if (configured) amx_release();
    for (int64_t m = 0; tops && m < rows; ++m) {
      alignas(64) float value[LANES];
      alignas(64) int32_t block[LANES];
      _mm512_store_ps(value, best[m]);
      _mm512_store_si512(block, from[m]);
      float b = -std::numeric_limits<float>::infinity();
      int64_t at = std::numeric_limits<int64_t>::max();
      for (int l = 0; l < LANES; ++l) {
        const int64_t c = block[l] + l;
        if (value[l] > b || (value[l] == b && c < at)) b = value[l], at = c;
      }
      float s = 0.f;   // this chunk's sum of exp(v - b) over the lanes
      if (track[m] && b > -std::numeric_limits<float>::infinity()) {
        alignas(64) float lane[LANES];
        _mm512_store_ps(lane, lane_sum[m]);
        for (int l = 0; l < LANES; ++l)
          if (lane[l] > 0.f) s += lane[l] * std::exp(value[l] - b);
      }
      std::lock_guard<std::mutex> hold(top->lock);
      top->merge(m, b, at, s);
      if (nan_at[m] >= 0) top->merge(m, std::numeric_limits<float>::quiet_NaN(), nan_at[m]);
    }
  });
  return y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                  const c10::optional<at::Tensor>& bias, bool two, double inverse, double step, int64_t length,
                  int64_t tail) {
  return linear_into(x, packed, scale, bias, two, inverse, step, length, tail, nullptr);
}

}  // namespace

MARS_W8A8_OPS(mars_vnni)

TORCH_LIBRARY_FRAGMENT(mars_vnni, m) {
  m.def("use_amx(int want) -> bool", &use_amx);
}
