// fp32 products for the lean forward's float32 loop, built by mars_core/engine/fp32.py; the Python side says why.
//
// y[m, j] = bias[j] + sum_k x[m, k] * w[k, j], every row computed in one fixed order: two chains of fused
// multiply-adds over even and odd k, then even + odd, then the bias. A row's result is the same
// bits whatever other rows share the call, so one position equals the same position among seven, and a batch row
// equals the row alone.
//
// The weight is packed once into panels of 16 output columns, k-major (a panel's row k is two ymm), so a row
// streams through a panel with two loads per k; up to three rows share those loads, and the rest of a call's rows
// reuse the panel from L1.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t PANEL = 16;   // output columns per panel
constexpr int64_t RW = 3;       // rows sharing each weight load: 12 accumulators of the 16 ymm

// w^T fp32 [K, N] (the lean forward's row-major layout) -> [ceil(N / 16), K, 16], zero past column N.
at::Tensor pack(const at::Tensor& w_t) {
  TORCH_CHECK(w_t.dim() == 2 && w_t.scalar_type() == at::kFloat, "pack: an fp32 [in, out] weight is expected");
  auto w = w_t.contiguous();
  const int64_t k = w.size(0), n = w.size(1), panels = (n + PANEL - 1) / PANEL;
  auto out = at::zeros({panels, k, PANEL}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t cols = std::min(PANEL, n - p * PANEL);
    for (int64_t i = 0; i < k; ++i)
      std::memcpy(dst + (p * k + i) * PANEL, src + i * n + p * PANEL, cols * sizeof(float));
  }
  return out;
}

// R rows (k floats apart) against one panel: out[r * 16 + c] = that row's sum in the fixed order above (no bias).
// R rows share each weight load; each row's arithmetic is the same whatever R is.
template <int R>
inline void rows_panel(const float* x, const float* panel, int64_t k, float* out) {
  __m256 e[R][2], o[R][2];   // even-k and odd-k chains, columns 0-7 and 8-15
  for (int r = 0; r < R; ++r) e[r][0] = e[r][1] = o[r][0] = o[r][1] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 2 <= k; i += 2) {
    const float* w = panel + i * PANEL;
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    const __m256 w2 = _mm256_loadu_ps(w + 16), w3 = _mm256_loadu_ps(w + 24);
    for (int r = 0; r < R; ++r) {
      const __m256 x0 = _mm256_broadcast_ss(x + r * k + i), x1 = _mm256_broadcast_ss(x + r * k + i + 1);
      e[r][0] = _mm256_fmadd_ps(x0, w0, e[r][0]);
      e[r][1] = _mm256_fmadd_ps(x0, w1, e[r][1]);
      o[r][0] = _mm256_fmadd_ps(x1, w2, o[r][0]);
      o[r][1] = _mm256_fmadd_ps(x1, w3, o[r][1]);
    }
  }
  if (i < k) {   // odd k: the last input joins the even chain
    const float* w = panel + i * PANEL;
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xi = _mm256_broadcast_ss(x + r * k + i);
      e[r][0] = _mm256_fmadd_ps(xi, w0, e[r][0]);
      e[r][1] = _mm256_fmadd_ps(xi, w1, e[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * PANEL, _mm256_add_ps(e[r][0], o[r][0]));
    _mm256_storeu_ps(out + r * PANEL + 8, _mm256_add_ps(e[r][1], o[r][1]));
  }
}

// y [rows, n] = x [rows, k] @ w + bias, `packed` from pack(w) with n output columns.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "linear: a 2D fp32 input is expected");
  auto x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == k && packed.size(2) == PANEL && panels * PANEL >= n &&
              (panels - 1) * PANEL < n, "linear: the packed weight does not match the input width or n");
  const float* bp = bias.has_value() && bias->defined() ? bias->contiguous().data_ptr<float>() : nullptr;
  auto y = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  alignas(32) float sums[RW * PANEL];
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t j0 = p * PANEL, cols = std::min(PANEL, n - j0);
    const float* panel = wp + p * k * PANEL;
    for (int64_t m0 = 0; m0 < rows; m0 += RW) {
      const int64_t r = std::min(RW, rows - m0);
      if (r == 3) rows_panel<3>(xp + m0 * k, panel, k, sums);
      else if (r == 2) rows_panel<2>(xp + m0 * k, panel, k, sums);
      else rows_panel<1>(xp + m0 * k, panel, k, sums);
      for (int64_t m = 0; m < r; ++m) {
        float* out = yp + (m0 + m) * n + j0;
        if (bp) for (int64_t c = 0; c < cols; ++c) out[c] = sums[m * PANEL + c] + bp[j0 + c];
        else std::memcpy(out, sums + m * PANEL, cols * sizeof(float));
      }
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(mars_fp32, m) {
  m.def("pack(Tensor w_t) -> Tensor", &pack);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &linear);
}
