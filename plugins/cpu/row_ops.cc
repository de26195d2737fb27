// Row-wise operations of the matmul kernels (row_ops.h): portable and AVX-512 forms, bit-identical.

#include "row_ops.h"

#include <cstdlib>
#include <cstring>
#include <vector>

namespace tandem {
namespace {

constexpr int64_t kLanes = 16;

void row_scales(const float* A, int64_t M, int64_t K, float epsilon, float* r) {
  for (int64_t m = 0; m < M; ++m) {
    float lanes[kLanes] = {};
    for (int64_t k = 0; k < K; ++k) lanes[k % kLanes] = std::fma(A[m * K + k], A[m * K + k], lanes[k % kLanes]);
    float sum = 0.0f;
    for (float v : lanes) sum += v;
    r[m] = 1.0f / std::sqrt(sum / static_cast<float>(K) + epsilon);
  }
}

#ifdef TANDEM_AVX512F

// row_scales' AVX-512 form: lane k % 16 of a vector fma in k order (a masked tail adds exact zeros)
TANDEM_AVX512F void row_scales_avx512(const float* A, int64_t M, int64_t K, float epsilon, float* r) {
  for (int64_t m = 0; m < M; ++m) {
    __m512 sq = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += kLanes) {
      const __mmask16 mask = first_lanes(K - k);
      const __m512 x = _mm512_maskz_loadu_ps(mask, A + m * K + k);
      sq = _mm512_fmadd_ps(x, x, sq);
    }
    float lanes[kLanes];
    _mm512_storeu_ps(lanes, sq);
    float sum = 0.0f;
    for (float v : lanes) sum += v;
    r[m] = 1.0f / std::sqrt(sum / static_cast<float>(K) + epsilon);
  }
}

// swiglu_rows' AVX-512 form for one row: the columns it did (all but a last part vector)
TANDEM_AVX512F int64_t swiglu_row_avx512(const float* gate, int64_t I, float* y) {
  int64_t j = 0;
  for (; j + kLanes <= I; j += kLanes) {
    _mm512_storeu_ps(y + j, _mm512_mul_ps(silu_avx512(_mm512_loadu_ps(gate + j)), _mm512_loadu_ps(gate + I + j)));
  }
  return j;
}

// silu_in_place's AVX-512 form: the elements it did (all but a last part vector)
TANDEM_AVX512F int64_t silu_avx512_in_place(float* x, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) _mm512_storeu_ps(x + j, silu_avx512(_mm512_loadu_ps(x + j)));
  return j;
}

// sigmoid_gate's AVX-512 form: the elements it did (all but a last part vector)
TANDEM_AVX512F int64_t sigmoid_gate_avx512(const float* x, const float* z, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    _mm512_storeu_ps(out + j, sigmoid_gated_avx512(_mm512_loadu_ps(x + j), _mm512_loadu_ps(z + j)));
  }
  return j;
}

// gated_group_norm's AVX-512 form for one group of G: the elements it did
TANDEM_AVX512F int64_t gated_group_avx512(const float* x, const float* z, const float* scale, float r, int64_t G,
                                          float* out) {
  int64_t j = 0;
  const __m512 rv = _mm512_set1_ps(r);
  for (; j + kLanes <= G; j += kLanes) {
    const __m512 normed = _mm512_mul_ps(_mm512_loadu_ps(x + j), _mm512_mul_ps(rv, _mm512_loadu_ps(scale + j)));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(normed, silu_avx512(_mm512_loadu_ps(z + j))));
  }
  return j;
}

#endif

}  // namespace

bool avx512f() {
#ifdef TANDEM_AVX512F
  const char* portable = std::getenv("TANDEM_CPU_KERNELS_PORTABLE");
  if (portable != nullptr && std::strcmp(portable, "1") == 0) return false;
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

void silu_in_place(float* x, int64_t n, bool fast) {
  int64_t j = 0;
#ifdef TANDEM_AVX512F
  if (fast) j = silu_avx512_in_place(x, n);
#endif
  for (; j < n; ++j) x[j] = silu(x[j]);
}

void sigmoid_gate(const float* x, const float* z, int64_t n, bool fast, float* out) {
  int64_t j = 0;
#ifdef TANDEM_AVX512F
  if (fast) j = sigmoid_gate_avx512(x, z, n, out);
#endif
  for (; j < n; ++j) out[j] = sigmoid_gated(x[j], z[j]);
}

void rms_row_scales(const float* A, int64_t M, int64_t K, float epsilon, bool fast, float* r) {
#ifdef TANDEM_AVX512F
  if (fast) return row_scales_avx512(A, M, K, epsilon, r);
#endif
  row_scales(A, M, K, epsilon, r);
}

void swiglu_rows(const float* product, int64_t M, int64_t I, bool fast, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* gate = product + m * 2 * I;
    int64_t j = 0;
#ifdef TANDEM_AVX512F
    if (fast) j = swiglu_row_avx512(gate, I, y + m * I);
#endif
    for (; j < I; ++j) y[m * I + j] = silu(gate[j]) * gate[I + j];
  }
}

bool product_dims(const Dims& ad, int64_t K, int64_t N, int64_t G, Dims* yd) {
  const size_t rank = ad.size();
  if (rank >= 1 && ad.back() == K) {
    *yd = ad.first(rank - 1);
  } else if (G > 0 && rank >= 2 && ad.back() == G && ad[rank - 2] * G == K) {
    *yd = ad.first(rank - 2);
  } else {
    return false;
  }
  yd->push_back(N);
  return true;
}

void gated_group_norm(const float* X, const float* Z, const float* scale, int64_t n, int64_t G, float epsilon,
                      bool fast, float* out) {
  thread_local std::vector<float> r;    // the calling thread's, kept across calls
  const int64_t groups = n / G;
  r.resize(static_cast<size_t>(groups));
  rms_row_scales(X, groups, G, epsilon, fast, r.data());
  for (int64_t g = 0; g < groups; ++g) {
    const float *x = X + g * G, *z = Z + g * G;
    float* o = out + g * G;
    int64_t j = 0;
#ifdef TANDEM_AVX512F
    if (fast) j = gated_group_avx512(x, z, scale, r[g], G, o);
#endif
    for (; j < G; ++j) o[j] = x[j] * (r[g] * scale[j]) * silu(z[j]);
  }
}

void NormRope::apply(const float* x, int64_t M, int64_t H, int64_t D, float* y) const {
  thread_local std::vector<float> r, normed;
  const float* src = x;
  if (norm != nullptr) {
    r.resize(static_cast<size_t>(M));
    rms_row_scales(x, M, D, epsilon, fast, r.data());
    normed.resize(static_cast<size_t>(M * D));
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t i = 0; i < D; ++i) normed[m * D + i] = x[m * D + i] * r[m] * norm[i];
    }
    src = normed.data();
  }
  if (cos == nullptr) {
    std::copy(src, src + M * D, y);
    return;
  }
  for (int64_t m = 0; m < M; ++m) {
    const float *row = src + m * D, *c = cos + (m / H) * D, *s = sin + (m / H) * D;
    for (int64_t i = 0; i < D; ++i) y[m * D + i] = row[i] * c[i] + row[perm[i]] * s[i];
  }
}

}  // namespace tandem
