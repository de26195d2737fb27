// Host logprobs in native code (pipeline/native_sampler.py calls it through ctypes): for rows of a
// target step's logits, the log-softmax at each row's token and at its top n tokens, the numbers
// pipeline/logprobs.py's numpy form gives to float32 rounding (its exp and sums differ in order).
//
// Per row of V logits, one pass for the max and the top n, one for the sum:
//   top      the n largest logits, most likely first, the lower id first among equals (as ONNX TopK):
//            a sorted array of n, a logit entering only if larger than its last
//   lse      max + log(sum exp(x - max)), the sum in float64 (portable: 8 lanes, j % 8, then lanes
//            0..7; AVX-512: 16 lanes, j % 16, then lanes 0..15: the two may differ in the last bits)
//   out      token_lp[i] = x[token] - lse; top_lp[i, j] = x[top_ids[i, j]] - lse (float32)

#include <cmath>
#include <cstdint>
#include <limits>

#include "row_ops.h"

namespace {

// the n largest of x[0 .. vocab) into ids / values (descending, lower id first among equals)
void top_n(const float* x, int64_t vocab, int64_t n, int64_t* ids, float* values) {
  int64_t filled = 0;
  for (int64_t j = 0; j < vocab; ++j) {
    const float v = x[j];
    if (filled == n && !(v > values[n - 1])) continue;
    int64_t at = filled < n ? filled++ : n - 1;
    while (at > 0 && v > values[at - 1]) {    // after every equal one: the lower id stays first
      values[at] = values[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    values[at] = v;
    ids[at] = j;
  }
}

// max + log(sum exp(x - max)) over x[0 .. vocab)
float log_sum_exp(const float* x, int64_t vocab) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < vocab; ++j) top = x[j] > top ? x[j] : top;
  double lanes[8] = {};
  for (int64_t j = 0; j < vocab; ++j) {
    const float d = x[j] - top;     // below exp's range (a -inf logit): 0, as numpy's exp gives
    lanes[j % 8] += d >= tandem::kExpMin ? static_cast<double>(tandem::exp_clamped(d)) : 0.0;
  }
  double sum = 0.0;
  for (double lane : lanes) sum += lane;
  return top + static_cast<float>(std::log(sum));
}

#ifdef TANDEM_AVX512F
TANDEM_AVX512F float log_sum_exp_avx512(const float* x, int64_t vocab) {
  __m512 topv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < vocab; j += 16) {
    const __mmask16 m = tandem::first_lanes(vocab - j);
    topv = _mm512_mask_max_ps(topv, m, topv, _mm512_maskz_loadu_ps(m, x + j));
  }
  const float top = _mm512_reduce_max_ps(topv);
  const __m512 t = _mm512_set1_ps(top), low = _mm512_set1_ps(tandem::kExpMin);
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  for (int64_t j = 0; j < vocab; j += 16) {
    const __mmask16 m = tandem::first_lanes(vocab - j);
    const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), t);
    const __m512 e = _mm512_maskz_mov_ps(m & _mm512_cmp_ps_mask(d, low, _CMP_GE_OQ), tandem::exp_avx512(d));
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  }
  alignas(64) double lanes[16];
  _mm512_store_pd(lanes, lo);
  _mm512_store_pd(lanes + 8, hi);
  double sum = 0.0;
  for (double lane : lanes) sum += lane;
  return top + static_cast<float>(std::log(sum));
}
#endif

}  // namespace

// rows of logits [rows, vocab] float32, row i starting at logits + i * stride; tokens [rows] int64;
// n in [0, vocab]: token_lp [rows] float32, top_ids [rows, n] int64 and top_lp [rows, n] float32.
extern "C" __attribute__((visibility("default")))
void tandem_logprobs_rows(const float* logits, int64_t rows, int64_t vocab, int64_t stride, const int64_t* tokens,
                          int64_t n, float* token_lp, int64_t* top_ids, float* top_lp) {
#ifdef TANDEM_AVX512F
  const auto lse_of = tandem::avx512f() ? log_sum_exp_avx512 : log_sum_exp;
#else
  const auto lse_of = log_sum_exp;
#endif
  for (int64_t i = 0; i < rows; ++i) {
    const float* x = logits + i * stride;
    const float lse = lse_of(x, vocab);
    token_lp[i] = x[tokens[i]] - lse;
    if (n > 0) {
      int64_t* ids = top_ids + i * n;
      float* values = top_lp + i * n;
      top_n(x, vocab, n, ids, values);
      for (int64_t j = 0; j < n; ++j) values[j] -= lse;
    }
  }
}
