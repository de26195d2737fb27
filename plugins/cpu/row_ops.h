// Row-wise operations the matmul kernels apply before or after their product (matmul_f32.cc,
// matmul_nbits.cc; defined in row_ops.cc): silu, RMS row scales, the MLP's gate and the gated norm
// after Gated DeltaNet. Each has a portable form and an AVX-512 form (`fast`) with the same
// operations in the same order, so both give the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernel_common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TANDEM_AVX512F __attribute__((target("avx512f")))
#endif

namespace tandem {

// e^x for x clamped to [-87.3, 88.3] (normal results): 2^n e^t, n = round(x log2 e), t = x - n ln 2
// in two steps, e^t by Cephes expf's polynomial, then an exact scaling by 2^n; silu(x) = x / (1 +
// e^-x). Both in a portable and an AVX-512 form with the same operations (fma, mul, add, div), so
// both give the same bits (silu, and the attention kernel's softmax).
constexpr float kExpMin = -87.3f, kExpMax = 88.3f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f,
                kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_clamped(float x) {
  const float v = std::min(std::max(x, kExpMin), kExpMax);
  const float n = std::nearbyint(v * kLog2e);
  float t = std::fma(n, -kLn2Hi, v);
  t = std::fma(n, -kLn2Lo, t);
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, t, kExpPoly[i]);
  return std::ldexp(std::fma(p, t * t, t) + 1.0f, static_cast<int>(n));
}

inline float silu(float x) { return x / (1.0f + exp_clamped(-x)); }

// x sigmoid(z), sigmoid(z) = 1 / (1 + e^-z): the attention's output gate
inline float sigmoid_gated(float x, float z) { return x * (1.0f / (1.0f + exp_clamped(-z))); }

#ifdef TANDEM_AVX512F
// exp_clamped's AVX-512 form, operation for operation
TANDEM_AVX512F inline __m512 exp_avx512(__m512 x) {
  const __m512 v = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 t = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), v);
  t = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), t);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_scalef_ps(_mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(t, t), t), _mm512_set1_ps(1.0f)), n);
}

// lanes 0 .. min(n, 16) - 1 set: a vector's masked tail of n (>= 0) elements
TANDEM_AVX512F inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}

// silu's AVX-512 form
TANDEM_AVX512F inline __m512 silu_avx512(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

// sigmoid_gated's AVX-512 form
TANDEM_AVX512F inline __m512 sigmoid_gated_avx512(__m512 x, __m512 z) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_mul_ps(x, _mm512_div_ps(one, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), z)))));
}
#endif

// Whether the AVX-512 forms run here: the CPU has AVX-512F and TANDEM_CPU_KERNELS_PORTABLE is not 1.
bool avx512f();

// x[i] = silu(x[i]) for n elements, in place.
void silu_in_place(float* x, int64_t n, bool fast);

// out[i] = x[i] sigmoid(z[i]) for n elements (sigmoid_gated).
void sigmoid_gate(const float* x, const float* z, int64_t n, bool fast, float* out);

// r[m] = 1 / sqrt(mean_k A[m, k]^2 + epsilon) for the rows of A [M, K], the squares summed in 16
// lanes (lane k % 16, fma in k order), the lanes added 0..15.
void rms_row_scales(const float* A, int64_t M, int64_t K, float epsilon, bool fast, float* r);

// y [M, I] = silu(gate) * up for rows [gate | up] of product [M, 2 I].
void swiglu_rows(const float* product, int64_t M, int64_t I, bool fast, float* y);

// out[i] = X[i] (r[i / G] scale[i % G]) silu(Z[i]) for X, Z of n elements (n a multiple of G),
// r = rms_row_scales over each group of G: Gated DeltaNet's output norm (per head, a scale of G)
// times silu of its gate, the input of out_proj.
void gated_group_norm(const float* X, const float* Z, const float* scale, int64_t n, int64_t G, float epsilon,
                      bool fast, float* out);

// An RMS norm per head (scale [D], optional) and then RoPE as the exporter writes it (x cos + x[perm]
// sin; cos, sin [M / H, D], optional) over rows [M, D] of x, H rows (heads) per position: y [M, D].
// The attention kernel's query (paged_attention.cc) and the keys' ai.tandem.cpu::NormRope.
struct NormRope {
  const float *norm = nullptr, *cos = nullptr, *sin = nullptr;
  const int64_t* perm = nullptr;
  float epsilon = 0.0f;
  bool fast = false;

  bool any() const { return norm != nullptr || cos != nullptr; }
  void apply(const float* x, int64_t M, int64_t H, int64_t D, float* y) const;
};

// A node's norm and RoPE inputs at first .. first + 3 (norm scale [D], cos and sin [B, W, 1, D],
// rotate_perm [D]; each may be omitted, RoPE's three together) for a call of B W rows of head dim D,
// checked (`op` names the node's op in errors); epsilon and fast are the caller's (norm_rope.cc).
NormRope norm_rope_inputs(const NodeApi& api, OrtKernelContext* context, size_t first, int64_t B, int64_t W,
                          int64_t D, const char* op);

// The output dims of a matmul over K into N columns for A's dims `ad`: [..., K] -> [..., N]; with a
// group norm of G (G > 0) also [..., K / G, G] -> [..., N]. False where A is neither.
bool product_dims(const Dims& ad, int64_t K, int64_t N, int64_t G, Dims* yd);

}  // namespace tandem
