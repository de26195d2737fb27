// The pipeline's host sampler in native code (pipeline/native_sampler.py calls it through ctypes):
// the same steps as pipeline/sampler.py's numpy form (temperature, top-k, top-p over what top-k kept,
// then inverse-CDF over the kept tokens in id order, never past the last one with non-zero
// probability), with this file's own arithmetic: row_ops.h's exp, and every sum in an order defined
// here. So a token is numpy's except where the uniform falls within rounding of the boundary between
// two tokens' cumulative probabilities; tests/test_native_sampler.py holds the two to that.
//
// Per row of V logits, in passes over the row (no sort of the vocabulary):
//   1. s = logits / T (float32), top = max s
//   2. e = exp(s - top) in float32 (0 below exp's range: masked logits), M = sum(e)
//   3. the threshold, the least s kept: a top-k's k-th largest, a nucleus's last token (the leading
//      tokens in descending order whose mass before them is below top_p of the top-k's, at least
//      one). Its candidates are the tokens in the top buckets of a histogram of e's float bits (a
//      bucket is an eighth of an octave; e is monotone in s, so they are the top m by s), sorted.
//   4. e zeroed below the threshold; Z = sum(e); the token is the first whose running sum of e
//      exceeds u Z (blocks of 64 skipped by their sums, then token by token).
// Sums are float64: a block's in 8 lanes (lane j % 8, in j order, then lanes 0..7), blocks in order;
// a nucleus's running sums in descending order. The AVX-512 forms do the same operations in the
// same order as the portable ones, so the tokens are the same bits on every x86 CPU.

#include <algorithm>
#include <functional>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "row_ops.h"

namespace tandem {
namespace {

constexpr int64_t kBlock = 64;
// buckets of e in [0, 1] by its float bits >> 17 (exponent and 6 mantissa bits: a 64th of an
// octave), 0 .. 8128; the ones at or above a floor's bucket are counted
constexpr int kShift = 17, kTopBucket = 0x3F800000 >> kShift;

struct Scratch {
  std::vector<float> s, e;
  std::vector<double> blocks;
  std::vector<int64_t> count;
  std::vector<double> mass;
  std::vector<float> least, sorted;
  std::vector<std::pair<float, float>> candidates;   // (s, e)
  std::vector<int32_t> ids;
};
thread_local Scratch scratch;

inline int bucket(float e) {
  uint32_t bits;
  std::memcpy(&bits, &e, sizeof bits);
  return std::min(static_cast<int>(bits >> kShift), kTopBucket);
}

inline float exp_or_zero(float x) { return x >= kExpMin ? exp_clamped(x) : 0.0f; }

// sum of e[0 .. n) (n <= kBlock) in float64: lane j % 8 in j order, then lanes 0..7
double block_sum(const float* e, int64_t n) {
  double lanes[8] = {};
  for (int64_t j = 0; j < n; ++j) lanes[j % 8] += static_cast<double>(e[j]);
  double sum = 0.0;
  for (double v : lanes) sum += v;
  return sum;
}

// s = x / t and its maximum (NaN never counts as the maximum)
float scale_row(const float* x, int64_t V, float t, float* s) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < V; ++j) {
    s[j] = x[j] / t;
    if (s[j] > top) top = s[j];
  }
  return top;
}

// e[j] = value(j) for every token, and the block sums
template <typename Value>
void fill_blocks(int64_t V, float* e, double* blocks, const Value& value) {
  for (int64_t b = 0; b * kBlock < V; ++b) {
    const int64_t first = b * kBlock, n = std::min(kBlock, V - first);
    for (int64_t j = first; j < first + n; ++j) e[j] = value(j);
    blocks[b] = block_sum(e + first, n);
  }
}

// e = exp(s - top) and the block sums
void exps_and_blocks(const float* s, int64_t V, float top, float* e, double* blocks) {
  fill_blocks(V, e, blocks, [&](int64_t j) { return exp_or_zero(s[j] - top); });
}

// e zeroed where s < keep_from, and the block sums again
void keep_and_blocks(const float* s, int64_t V, float keep_from, float* e, double* blocks) {
  fill_blocks(V, e, blocks, [&](int64_t j) { return s[j] >= keep_from ? e[j] : 0.0f; });
}

// the sum of the block sums, in order
double total(const double* blocks, int64_t V) {
  double sum = 0.0;
  for (int64_t b = 0; b * kBlock < V; ++b) sum += blocks[b];
  return sum;
}

#ifdef TANDEM_AVX512F
// the 8 float64 lanes of a block's sum after adding y's 16 floats (lanes j % 8: the low 8, then the high 8)
TANDEM_AVX512F inline __m512d add_lanes(__m512d lanes, __m512 y) {
  lanes = _mm512_add_pd(lanes, _mm512_cvtps_pd(_mm512_castps512_ps256(y)));
  return _mm512_add_pd(lanes, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1))));
}

TANDEM_AVX512F inline double lanes_total(__m512d lanes) {
  double l[8];
  _mm512_storeu_pd(l, lanes);
  double sum = 0.0;
  for (double v : l) sum += v;
  return sum;
}

TANDEM_AVX512F float scale_row_avx512(const float* x, int64_t V, float t, float* s) {
  const __m512 tv = _mm512_set1_ps(t);
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 m = first_lanes(V - j);
    const __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + j), tv);
    _mm512_mask_storeu_ps(s + j, m, v);
    top = _mm512_mask_max_ps(top, _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ) & m, v, top);
  }
  return _mm512_reduce_max_ps(top);
}

// fill_blocks' AVX-512 form: 16 tokens at a time, value(j, lanes) -> e[j .. j + 16) (a masked
// tail gives zeros), the lanes j % 8 widened to float64 as the portable form adds them
template <typename Value>
TANDEM_AVX512F void fill_blocks_avx512(int64_t V, float* e, double* blocks, const Value& value) {
  for (int64_t b = 0; b * kBlock < V; ++b) {
    const int64_t first = b * kBlock, n = std::min(kBlock, V - first);
    __m512d lanes = _mm512_setzero_pd();
    for (int64_t j = first; j < first + n; j += 16) {
      const __mmask16 m = first_lanes(first + n - j);
      const __m512 y = value(j, m);
      _mm512_mask_storeu_ps(e + j, m, y);
      lanes = add_lanes(lanes, y);
    }
    blocks[b] = lanes_total(lanes);
  }
}

TANDEM_AVX512F void exps_and_blocks_avx512(const float* s, int64_t V, float top, float* e, double* blocks) {
  const __m512 topv = _mm512_set1_ps(top), low = _mm512_set1_ps(kExpMin);
  fill_blocks_avx512(V, e, blocks, [&](int64_t j, __mmask16 m) TANDEM_AVX512F {
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), topv);
    return _mm512_maskz_mov_ps(m & _mm512_cmp_ps_mask(x, low, _CMP_GE_OQ), exp_avx512(x));
  });
}

TANDEM_AVX512F void keep_and_blocks_avx512(const float* s, int64_t V, float keep_from, float* e, double* blocks) {
  const __m512 keep = _mm512_set1_ps(keep_from);
  fill_blocks_avx512(V, e, blocks, [&](int64_t j, __mmask16 m) TANDEM_AVX512F {
    return _mm512_maskz_loadu_ps(m & _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(m, s + j), keep, _CMP_GE_OQ), e + j);
  });
}
#endif

// ids[0 .. n) = the tokens with e >= floor, in id order; n returned
int64_t collect(const float* e, int64_t V, float floor, int32_t* ids) {
  int64_t n = 0;
  for (int64_t j = 0; j < V; ++j) {
    if (e[j] >= floor) ids[n++] = static_cast<int32_t>(j);
  }
  return n;
}

#ifdef TANDEM_AVX512F
TANDEM_AVX512F int64_t collect_avx512(const float* e, int64_t V, float floor, int32_t* ids) {
  const __m512 f = _mm512_set1_ps(floor);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t n = 0;
  for (int64_t j = 0; j < V; j += 16, at = _mm512_add_epi32(at, step)) {
    const __mmask16 m = first_lanes(V - j) & _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(first_lanes(V - j), e + j), f,
                                                                _CMP_GE_OQ);
    if (m != 0) {                 // most vectors hold none (a compress store costs several cycles)
      _mm512_mask_compressstoreu_epi32(ids + n, m, at);
      n += __builtin_popcount(m);
    }
  }
  return n;
}
#endif

using Candidate = std::pair<float, float>;      // (s, e)

// A top-k's threshold among the tokens ids[0 .. n) (the row's largest e, or all V of them; k < V):
// the k-th largest s, with top-p the nucleus of those k. False where they are fewer than k.
bool top_k_threshold(const float* s, const float* e, const int32_t* ids, int64_t n, int64_t V, int64_t k,
                     double top_p, int base, Scratch& w, float* out) {
  if (n < k) return false;
  w.count.assign(kTopBucket + 1 - base, 0);     // bucket b at b - base
  for (int64_t i = 0; i < n; ++i) ++w.count[bucket(e[ids[i]]) - base];
  int lowest = kTopBucket;              // the candidates: the top buckets that hold k tokens
  for (int64_t seen = w.count[lowest - base]; seen < k;) seen += w.count[--lowest - base];
  auto& c = w.candidates;
  c.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (bucket(e[ids[i]]) >= lowest) c.emplace_back(s[ids[i]], e[ids[i]]);
  }
  const auto larger = [](const Candidate& a, const Candidate& b) { return a.first > b.first; };
  std::nth_element(c.begin(), c.begin() + (k - 1), c.end(), larger);
  if (top_p >= 1.0) {
    *out = c[k - 1].first;
    return true;
  }
  std::sort(c.begin(), c.begin() + k, larger);
  double mass = 0.0;
  for (int64_t i = 0; i < k; ++i) mass += static_cast<double>(c[i].second);
  const double target = top_p * mass;     // the leading tokens whose mass before them is below it
  double before = 0.0;
  int64_t keep = k;
  for (int64_t i = 1; i < k && keep == k; ++i) {
    before += static_cast<double>(c[i - 1].second);
    if (before >= target) keep = i;
  }
  *out = c[keep - 1].first;
  return true;
}

// A nucleus of the whole row among the tokens ids[0 .. n): the leading tokens in descending order
// whose mass before them is below top_p M, at least one. The mass before a token is the masses of
// the buckets above it (each summed in id order) and the running sum of its own bucket's tokens
// above it, in descending order; a bucket whose mass does not reach top_p M with those above is
// taken whole, so only the bucket where the nucleus ends is sorted (a flat row's nucleus holds most
// of the vocabulary). False where the tokens do not hold the nucleus (their buckets' mass falls
// short) and are not all the row.
bool nucleus_threshold(const float* s, const float* e, const int32_t* ids, int64_t n, int64_t V, double top_p,
                       double M, float top, int base, Scratch& w, float* out) {
  const int buckets = kTopBucket + 1 - base;     // bucket b at b - base
  w.count.assign(buckets, 0);
  w.mass.assign(buckets, 0.0);
  w.least.assign(buckets, std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; ++i) {
    const int32_t j = ids[i];
    const int b = bucket(e[j]) - base;
    ++w.count[b];
    w.mass[b] += static_cast<double>(e[j]);
    w.least[b] = std::min(w.least[b], s[j]);
  }
  const double target = top_p * M;
  double before = 0.0;
  float least_above = top;              // the least s of the tokens taken so far
  for (int b = buckets - 1; b >= 0; --b) {
    if (w.count[b] == 0) continue;
    if (before >= target) {             // the tokens above are the nucleus
      *out = least_above;
      return true;
    }
    if (before + w.mass[b] >= target) {     // it ends in this bucket: its tokens in descending order
      auto& sorted = w.sorted;
      sorted.clear();
      for (int64_t i = 0; i < n; ++i) {
        if (bucket(e[ids[i]]) - base == b) sorted.push_back(s[ids[i]]);
      }
      std::sort(sorted.begin(), sorted.end(), std::greater<float>());
      double run = before;
      for (size_t i = 0; i < sorted.size(); ++i) {
        if (run >= target) {
          *out = i == 0 ? least_above : sorted[i - 1];
          return true;
        }
        run += static_cast<double>(exp_or_zero(sorted[i] - top));    // e's bits: the same exp
      }
    }
    before += w.mass[b];
    least_above = w.least[b];
  }
  *out = least_above;                   // every token
  return n == V;
}

// the tokens looked at for a threshold: e >= 2^-8 (within 5.5 of the top logit / T), else 2^-16,
// 2^-32, 2^-64 (a collect is one vector pass; a histogram of the whole row costs several)
constexpr float kFloors[4] = {0x1p-8f, 0x1p-16f, 0x1p-32f, 0x1p-64f};

// The least s the row keeps under top-k (k < V: the k-th largest) and top-p (top_p < 1: the
// nucleus of the top-k): among the tokens with e >= 2^-8, 2^-16, ... where they hold it, else among all.
float threshold(const float* s, const float* e, int64_t V, int64_t k, double top_p, double M, float top, bool fast,
                Scratch& w) {
  w.ids.resize(V);
#ifdef TANDEM_AVX512F
  const auto gather = fast ? collect_avx512 : collect;
#else
  const auto gather = collect;
#endif
  const auto among = [&](int64_t n, int base, float* out) {
    return k < V ? top_k_threshold(s, e, w.ids.data(), n, V, k, top_p, base, w, out)
                 : nucleus_threshold(s, e, w.ids.data(), n, V, top_p, M, top, base, w, out);
  };
  float out = 0.0f;
  for (float floor : kFloors) {       // a power of 2: its tokens are whole buckets
    if (among(gather(e, V, floor, w.ids.data()), bucket(floor), &out)) return out;
  }
  for (int64_t j = 0; j < V; ++j) w.ids[j] = static_cast<int32_t>(j);
  among(V, 0, &out);
  return out;
}

// the first token whose running sum of e exceeds u Z, never past the last with e > 0
int64_t inverse_cdf(const float* e, const double* blocks, int64_t V, double u, double* Z_out) {
  const int64_t nb = (V + kBlock - 1) / kBlock;
  const double Z = total(blocks, V);
  *Z_out = Z;
  const double target = u * Z;
  double c = 0.0;
  int64_t b = 0;
  for (; b < nb && c + blocks[b] <= target; ++b) c += blocks[b];
  for (int64_t j = b * kBlock; j < V; ++j) {
    c += static_cast<double>(e[j]);
    if (e[j] > 0.0f && c > target) return j;
  }
  for (int64_t j = V - 1; j > 0; --j) {    // rounding left u Z past the last sum
    if (e[j] > 0.0f) return j;
  }
  return 0;
}

}  // namespace
}  // namespace tandem

// Tokens for `rows` rows of logits [rows, vocab] (float32, contiguous), row i by settings[i] =
// (temperature > 0 and finite, top_k: 0 or >= vocab is off, top_p in (0, 1]: 1 is off, the uniform
// u in [0, 1)) as float64. probs (optional, [rows, vocab] float64): each row's kept probabilities,
// zeros elsewhere.
extern "C" __attribute__((visibility("default")))
void tandem_sample_rows(const float* logits, int64_t rows, int64_t vocab, const double* settings, int64_t* tokens,
                        double* probs) {
  using namespace tandem;
  Scratch& w = scratch;
  w.s.resize(vocab);
  w.e.resize(vocab);
  w.blocks.resize((vocab + kBlock - 1) / kBlock);
  const bool fast = avx512f();
#ifdef TANDEM_AVX512F
  const auto scale = fast ? scale_row_avx512 : scale_row;
  const auto exps = fast ? exps_and_blocks_avx512 : exps_and_blocks;
  const auto keep = fast ? keep_and_blocks_avx512 : keep_and_blocks;
#else
  const auto scale = scale_row;
  const auto exps = exps_and_blocks;
  const auto keep = keep_and_blocks;
#endif
  const float all = -std::numeric_limits<float>::infinity();
  float* s = w.s.data();
  float* e = w.e.data();
  double* blocks = w.blocks.data();
  for (int64_t i = 0; i < rows; ++i) {
    const double* setting = settings + 4 * i;
    const double top_p = setting[2];
    const int64_t k = setting[1] > 0 && setting[1] < static_cast<double>(vocab) ? static_cast<int64_t>(setting[1]) : vocab;
    const float top = scale(logits + i * vocab, vocab, static_cast<float>(setting[0]), s);
    double Z = 0.0;
    if (top == all) {               // nothing finite to draw from: the first token
      tokens[i] = 0;
    } else {
      exps(s, vocab, top, e, blocks);
      if (k < vocab || top_p < 1.0) {
        keep(s, vocab, threshold(s, e, vocab, k, top_p, total(blocks, vocab), top, fast, w), e, blocks);
      }
      tokens[i] = inverse_cdf(e, blocks, vocab, setting[3], &Z);
    }
    if (probs != nullptr) {
      double* p = probs + i * vocab;
      for (int64_t j = 0; j < vocab; ++j) p[j] = Z > 0.0 ? static_cast<double>(e[j]) / Z : (j == tokens[i] ? 1.0 : 0.0);
    }
  }
}
