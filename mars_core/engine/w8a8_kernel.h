// What mars_core/vnni.cpp and mars_core/avx2.cpp share: the checks of a linear call, which rows get a second pass,
// the layer stack around a file's `linear` (mars_core/w8a8_layers.h), an LM head's top (Top), and the four ops'
// schemas. Built into each by mars_core/native.py, whose cache key includes this file.
#pragma once
#include <ATen/core/Tensor.h>

#include "w8a8_layers.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <tuple>
#include <vector>

namespace mars_w8a8 {

// Each row's largest output and the first column that holds it, gathered while an LM head writes its outputs: read
// again after the call, a vocabulary-wide row comes back from far memory (the head's weights went through the
// caches since), which cost a decoding step more than the rest of its work outside the forward. Column `exclude`
// does not count at rows whose place in their group of `period` rows is `first` or later (the decoder's mask rows
// never propose the mask token). A NaN makes its row's value NaN (the decoder then stops with its error).
// With `sum`, the rows whose place in their group is `conf_from` or later also get the sum over their counted
// columns of exp(v - largest): 1 / sum is the softmax probability of the top column, the decoder's confidence.
struct Top {
  int64_t exclude = -1, period = 1, first = 0, conf_from = -1;
  float* value = nullptr;     // [rows]; null: no top wanted
  int64_t* index = nullptr;   // [rows]
  float* sum = nullptr;       // [rows], or null: no sums (a kernel that does not gather them leaves NaN)
  std::mutex lock;            // parallel chunks merge their rows' results one at a time

  bool wanted() const { return value != nullptr; }
  bool excludes(int64_t m) const { return exclude >= 0 && m % period >= first; }
  bool sums(int64_t m) const { return sum != nullptr && conf_from >= 0 && m % period >= conf_from; }
  // Per row, once per call (not per block of outputs): the column it leaves out (-1: none), and whether it sums.
  void per_row(int64_t rows, std::vector<int64_t>& skip, std::vector<char>& track) const {
    skip.assign(rows, -1);
    track.assign(rows, 0);
    for (int64_t m = 0; wanted() && m < rows; ++m) skip[m] = excludes(m) ? exclude : -1, track[m] = sums(m);
  }
  // Row m's result so far and (v, j, s) of some columns, s their sum of exp(. - v): the larger value wins, the
  // smaller column on a tie; a NaN beats every number, the first NaN every later one. The column does not depend
  // on how the columns were split between chunks (the sum does, by rounding only).
  void merge(int64_t m, float v, int64_t j, float s = 0.f) {
    float& b = value[m];
    int64_t& i = index[m];
    if (std::isnan(b)) {
      if (std::isnan(v) && j < i) i = j;
      return;
    }
    const bool track = sums(m);
    if (std::isnan(v) || v > b) {
      if (track) sum[m] = (sum[m] > 0.f ? sum[m] * std::exp(b - v) : 0.f) + s;
      b = v;
      i = j;
    } else {
      if (track && s > 0.f) sum[m] += s * std::exp(v - b);
      if (v == b && j < i) i = j;
    }
  }
};

inline void start_top(Top& top, float* value, int64_t* index, float* sum, int64_t rows, int64_t exclude,
                      int64_t period, int64_t first, int64_t conf_from) {
  TORCH_CHECK(period >= 1 && first >= 0 && rows % period == 0,
              "linear_top: rows must be whole groups of `period` rows, and first >= 0");
  top.exclude = exclude, top.period = period, top.first = first, top.conf_from = conf_from;
  top.value = value, top.index = index, top.sum = sum;
  for (int64_t m = 0; m < rows; ++m) {
    value[m] = -std::numeric_limits<float>::infinity(), index[m] = 0;
    sum[m] = top.sums(m) ? 0.f : std::numeric_limits<float>::quiet_NaN();
  }
}

inline void check_linear(const at::Tensor& x, int64_t length, int64_t tail) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear: a float32 [rows, k] input is expected");
  TORCH_CHECK(length >= 1 && tail >= 0 && tail <= length, "linear: 0 <= tail <= length is expected");
}

// Row m's second-pass row index (after the `rows` first-pass rows), or -1 where it has none: every row with `two`,
// except the last `tail` of every `length` rows (a lossless step's masks). Returns how many rows there are in all.
inline int64_t second_rows(int64_t rows, int64_t length, int64_t tail, bool two, std::vector<int64_t>& second) {
  second.assign(rows, -1);
  int64_t all = rows;
  for (int64_t m = 0; m < rows && two; ++m)
    if (m % length < length - tail) second[m] = all++;
  return all;
}

// A file's product with its rows' top gathered on the way (`top` null: none): its `linear_into`.
using LinearInto = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const c10::optional<at::Tensor>&, bool, double, double, int64_t, int64_t, Top*);

// (y, each row's largest output, its column, the sums): the `linear` op's y, bitwise, the argmax of y after the
// exclusion that Top describes, and Top's sums where the kernel gathers them (NaN elsewhere).
template <LinearInto into>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_top(
    const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
    bool two, double inverse, double step, int64_t length, int64_t tail, int64_t exclude, int64_t period,
    int64_t first, int64_t conf_from) {
  check_linear(x, length, tail);
  const int64_t rows = x.size(0);
  auto value = at::empty({rows}, x.options());
  auto index = at::empty({rows}, x.options().dtype(at::kLong));
  auto sum = at::empty({rows}, x.options());
  Top top;
  start_top(top, value.data_ptr<float>(), index.data_ptr<int64_t>(), sum.data_ptr<float>(), rows, exclude, period,
            first, conf_from);
  auto y = into(x, packed, scale, bias, two, inverse, step, length, tail, &top);
  return {y, value, index, sum};
}

}  // namespace mars_w8a8

#define MARS_W8A8_OPS(ns)                                                                                 \
  TORCH_LIBRARY(ns, m) {                                                                                  \
    m.def("pack(Tensor w) -> Tensor", &pack);                                                             \
    m.def("linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, bool two, float inverse, "         \
          "float step, int length=1, int tail=0) -> Tensor", &linear);                                   \
    m.def("linear_top(Tensor x, Tensor packed, Tensor scale, Tensor? bias, bool two, float inverse, "     \
          "float step, int length, int tail, int exclude, int period, int first, int conf_from) "              \
          "-> (Tensor, Tensor, Tensor, Tensor)",                                                            \
          &mars_w8a8::linear_top<&linear_into>);                                                          \
    m.def("layers(Tensor x, Tensor[] packs, Tensor[] scales, Tensor?[] biases, bool[] two, Tensor[] norms, "   \
          "Tensor(a!) k_cache, Tensor(b!) v_cache, int past, int b, int length, int heads, int kv, int d, "      \
          "Tensor rope, Tensor? hidden, float eps, float inverse, float step, int tail, Tensor? lora_rows, "     \
          "Tensor[] lora_a, Tensor[] lora_a_scale, Tensor[] lora_b, Tensor[] lora_b_scale, Tensor? lora_index) "  \
          "-> Tensor",                                                                                      \
          &mars_w8a8::layers<&linear>);                                                                   \
  }
