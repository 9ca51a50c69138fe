// What mars_core/vnni.cpp and mars_core/avx2.cpp share: the checks of a linear call, which rows get a second pass,
// the layer stack around a file's `linear` (mars_core/w8a8_layers.h), and the three ops' schemas. Built into each
// by mars_core/native.py, whose cache key includes this file.
#pragma once
#include <ATen/core/Tensor.h>

#include "w8a8_layers.h"

#include <cstdint>
#include <vector>

namespace mars_w8a8 {

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

}  // namespace mars_w8a8

#define MARS_W8A8_OPS(ns)                                                                                 \
  TORCH_LIBRARY(ns, m) {                                                                                  \
    m.def("pack(Tensor w) -> Tensor", &pack);                                                             \
    m.def("linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, bool two, float inverse, "         \
          "float step, int length=1, int tail=0) -> Tensor", &linear);                                   \
    m.def("layers(Tensor x, Tensor[] packs, Tensor[] scales, Tensor?[] biases, bool[] two, Tensor[] norms, "   \
          "Tensor(a!) k_cache, Tensor(b!) v_cache, int past, int b, int length, int heads, int kv, int d, "      \
          "Tensor rope, Tensor? hidden, float eps, float inverse, float step, int tail, Tensor? lora_rows, "     \
          "Tensor[] lora_a, Tensor[] lora_a_scale, Tensor[] lora_b, Tensor[] lora_b_scale, Tensor? lora_index) "  \
          "-> Tensor",                                                                                      \
          &mars_w8a8::layers<&linear>);                                                                   \
  }
