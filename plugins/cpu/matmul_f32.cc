// ai.tandem.cpu::MatMul: y = A W for float32 A [..., K] and a constant W [K, N], stored as column
// panels, read where they lie (the engine dir's mapped optimized.bin), as one ONNX Runtime CPU kernel.
//
// Inputs   A [..., K] float32; B [ceil(N / 16), K, 16] float32: panel p holds columns 16p..16p+15 of
//          W, row after row (columns past N are zeros): B[p, k, j] = W[k, 16 p + j];
//          residual (optional) [..., N] float32, added to the product
// Output   [..., N]
// Attrs    N; swiglu (0 or 1): B holds the gate and up projections' panels in turns (gate panel q,
//          then up panel q: 2 ceil(N / 16) panels) and y = silu(gate) * up, N columns, where
//          silu(x) = x / (1 + exp(-x)) (the MLP's Split, sigmoid-gate and Mul in the node);
//          rms_norm (0 or 1), epsilon: with rms_norm each row of A is RMS-normalized first, its
//          scale folded into W by the build (W = diag(scale) W0): y = r A W + residual with
//          r = 1 / sqrt(sum_k A[m, k]^2 / K + epsilon): the RMSNormalization before a matmul and the
//          residual Add after it, as one node (export/cpu_kernel_lowering.py fuses them)
//
// Why: ONNX Runtime's MatMul packs its own copy of every constant W per session at load (MLAS's
// panels: 0.83 s and +461 MiB per 150M float target-step session). The build writes the panels
// once instead (export/cpu_matmul_lowering.py), so sessions share the mapped
// file; each panel is one contiguous stream, which the hardware prefetchers follow (software
// prefetch 16 or 32 rows ahead measured no better), and the kernel streamed the 150M model's layer
// shapes 1.0-1.5x faster than MLAS at 1-8 rows and even with it at 128 (bench/matmul_nbits.py
// --bits 32; docs/performance.md).
//
// Math, per output element: one fma chain over k = 0..K-1 in order, from 0:
//     acc = fma(A[m, k], W[k, n], acc);   y[m, n] = acc  (rms_norm: acc r; residual: + res, as
//     fma(acc, r, res) with both)
// and per row, with rms_norm, the sum of squares in 16 lanes (lane k % 16, fma in k order), the lanes
// added 0..15, r = 1 / sqrt(sum / K + epsilon).
// The same chain whatever the call's rows or the tile the element falls in, so a verify row equals
// a decode step bit for bit, and the portable loop (std::fma, same order) equals the AVX-512 kernel
// bit for bit.
//
// Tiles: R rows (up to 8) x V panels, R * V <= 16 accumulators in registers; each k loads row k of
// the V panels once for the R rows. Chunks of 4 panels are shared out on ONNX Runtime's pool; rows go
// in blocks of 8 inside a chunk (its panels come from L2 again for each block).

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernel_common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TANDEM_AVX512F __attribute__((target("avx512f")))
#endif

namespace tandem {
namespace {

constexpr int64_t kLanes = 16;          // columns per panel
constexpr int64_t kChunkPanels = 4;     // panels per task of the pool

// e^x for x clamped to [-87.3, 88.3] (normal results): 2^n e^t, n = round(x log2 e), t = x - n ln 2
// in two steps, e^t by Cephes expf's polynomial; silu(x) = x / (1 + e^-x). Written once per kernel
// with the same operations in the same order (fma, mul, add, div, exact scaling by 2^n), so the
// portable loop and the AVX-512 kernel agree bit for bit.
constexpr float kExpMin = -87.3f, kExpMax = 88.3f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f,
                kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};

float silu(float x) {
  const float v = std::min(std::max(-x, kExpMin), kExpMax);
  const float n = std::nearbyint(v * kLog2e);
  float t = std::fma(n, -kLn2Hi, v);
  t = std::fma(n, -kLn2Lo, t);
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, t, kExpPoly[i]);
  const float e = std::ldexp(std::fma(p, t * t, t) + 1.0f, static_cast<int>(n));
  return x / (1.0f + e);
}

struct Call {
  const float* A;          // [M, K]
  const float* B;          // [P, K, 16]
  const float* residual;   // [M, N] or null
  const float* r;          // [M] row scales (rms_norm) or null
  float* y;                // [M, N]
  int64_t M, K, N;
  bool swiglu;

  // the epilogue of both kernels, element by element
  float finish(float acc, int64_t m, int64_t n) const {
    if (r != nullptr) return residual != nullptr ? std::fma(acc, r[m], residual[m * N + n]) : acc * r[m];
    return residual != nullptr ? acc + residual[m * N + n] : acc;
  }
  float gated(float gate, float up, int64_t m) const {
    return r != nullptr ? silu(gate * r[m]) * (up * r[m]) : silu(gate) * up;
  }
};

}  // namespace

void rms_row_scales(const float* A, int64_t M, int64_t K, float epsilon, bool fast, float* r);

namespace {

// Row scales 1 / sqrt(mean(A[m]^2) + epsilon) (the sums in 16 lanes: the same order as the AVX-512 one).
void row_scales(const float* A, int64_t M, int64_t K, float epsilon, float* r) {
  for (int64_t m = 0; m < M; ++m) {
    float lanes[16] = {};
    for (int64_t k = 0; k < K; ++k) lanes[k % 16] = std::fma(A[m * K + k], A[m * K + k], lanes[k % 16]);
    float sum = 0.0f;
    for (float v : lanes) sum += v;
    r[m] = 1.0f / std::sqrt(sum / static_cast<float>(K) + epsilon);
  }
}

// Panels [p0, p1) of every row, lane by lane: the chains the AVX-512 kernel runs, in its order
// (swiglu: p0 even, a gate panel and its up panel together).
void panels_portable(const Call& c, int64_t p0, int64_t p1) {
  for (int64_t m = 0; m < c.M; ++m) {
    const float* a = c.A + m * c.K;
    for (int64_t p = p0; p < p1; p += c.swiglu ? 2 : 1) {
      float acc[2][kLanes] = {};
      for (int64_t v = 0; v < (c.swiglu ? 2 : 1); ++v) {
        const float* b = c.B + (p + v) * c.K * kLanes;
        for (int64_t k = 0; k < c.K; ++k) {
          for (int64_t j = 0; j < kLanes; ++j) acc[v][j] = std::fma(a[k], b[k * kLanes + j], acc[v][j]);
        }
      }
      const int64_t n0 = (c.swiglu ? p / 2 : p) * kLanes, lanes = std::min(kLanes, c.N - n0);
      for (int64_t j = 0; j < lanes; ++j) {
        c.y[m * c.N + n0 + j] = c.swiglu ? c.gated(acc[0][j], acc[1][j], m) : c.finish(acc[0][j], m, n0 + j);
      }
    }
  }
}

#ifdef TANDEM_AVX512F

inline __mmask16 first_lanes(int64_t n) { return n >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// silu's AVX-512 form, operation for operation
TANDEM_AVX512F __m512 silu_avx512(__m512 x) {
  const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(kExpMin)),
                                 _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 t = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), v);
  t = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), t);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(kExpPoly[i]));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = _mm512_scalef_ps(_mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(t, t), t), one), n);
  return _mm512_div_ps(x, _mm512_add_ps(one, e));
}

// y[m0 .. m0 + R] for panels [p0, p0 + V) (swiglu: V / 2 gate and up pairs), stores masked to N
template <int R, int V>
TANDEM_AVX512F void tile(const Call& c, int64_t m0, int64_t p0) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  const int64_t panel = c.K * kLanes;
  const float* b = c.B + p0 * panel;
  const float* a = c.A + m0 * c.K;
  for (int64_t k = 0; k < c.K; ++k, b += kLanes) {
    __m512 w[V];
    for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_ps(b + v * panel);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * c.K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(x, w[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 scale = _mm512_set1_ps(c.r != nullptr ? c.r[m0 + r] : 1.0f);
    if (c.swiglu) {
      for (int v = 0; v + 1 < V; v += 2) {
        const int64_t n0 = (p0 + v) / 2 * kLanes;
        __m512 gate = acc[r][v], up = acc[r][v + 1];
        if (c.r != nullptr) {
          gate = _mm512_mul_ps(gate, scale);
          up = _mm512_mul_ps(up, scale);
        }
        _mm512_mask_storeu_ps(c.y + (m0 + r) * c.N + n0, first_lanes(c.N - n0), _mm512_mul_ps(silu_avx512(gate), up));
      }
      continue;
    }
    const int64_t at = (m0 + r) * c.N + p0 * kLanes;
    for (int v = 0; v < V; ++v) {
      const __mmask16 mask = first_lanes(c.N - (p0 + v) * kLanes);
      __m512 out = acc[r][v];
      if (c.r != nullptr && c.residual != nullptr) {
        out = _mm512_fmadd_ps(out, scale, _mm512_maskz_loadu_ps(mask, c.residual + at + v * kLanes));
      } else if (c.r != nullptr) {
        out = _mm512_mul_ps(out, scale);
      } else if (c.residual != nullptr) {
        out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, c.residual + at + v * kLanes));
      }
      _mm512_mask_storeu_ps(c.y + at + v * kLanes, mask, out);
    }
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

// row_scales' AVX-512 form: lane k % 16 of a vector fma in k order (a masked tail adds exact zeros)
TANDEM_AVX512F void row_scales_avx512(const float* A, int64_t M, int64_t K, float epsilon, float* r) {
  for (int64_t m = 0; m < M; ++m) {
    __m512 sq = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(mask, A + m * K + k);
      sq = _mm512_fmadd_ps(x, x, sq);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, sq);
    float sum = 0.0f;
    for (float v : lanes) sum += v;
    r[m] = 1.0f / std::sqrt(sum / static_cast<float>(K) + epsilon);
  }
}

// rows [m0, m0 + R) of panels [p0, p1), V at a time (fewer for the last ones: the same chains;
// swiglu: an even count, the panels come in pairs)
template <int R, int V>
TANDEM_AVX512F void rows_of(const Call& c, int64_t m0, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; p += V) {
    switch (std::min<int64_t>(V, p1 - p)) {
      case 1: tile<R, 1>(c, m0, p); break;
      case 2: tile<R, (V >= 2 ? 2 : V)>(c, m0, p); break;
      case 3: tile<R, (V >= 3 ? 3 : V)>(c, m0, p); break;
      default: tile<R, V>(c, m0, p); break;
    }
  }
}

TANDEM_AVX512F void panels_avx512(const Call& c, int64_t p0, int64_t p1) {
  int64_t m = 0;
  for (; m + 8 <= c.M; m += 8) rows_of<8, 2>(c, m, p0, p1);
  switch (c.M - m) {
    case 7: rows_of<7, 2>(c, m, p0, p1); break;
    case 6: rows_of<6, 2>(c, m, p0, p1); break;
    case 5: rows_of<5, 2>(c, m, p0, p1); break;
    case 4: rows_of<4, 4>(c, m, p0, p1); break;
    case 3: rows_of<3, 4>(c, m, p0, p1); break;
    case 2: rows_of<2, 4>(c, m, p0, p1); break;
    case 1: rows_of<1, 4>(c, m, p0, p1); break;
    default: break;
  }
}

// the AVX-512 kernel runs here (and TANDEM_CPU_KERNELS_PORTABLE is not 1)
bool avx512f() {
  const char* portable = std::getenv("TANDEM_CPU_KERNELS_PORTABLE");
  if (portable != nullptr && std::strcmp(portable, "1") == 0) return false;
  return __builtin_cpu_supports("avx512f");
}

#else

void panels_avx512(const Call& c, int64_t p0, int64_t p1) { panels_portable(c, p0, p1); }
void row_scales_avx512(const float* A, int64_t M, int64_t K, float epsilon, float* r) {
  row_scales(A, M, K, epsilon, r);
}
bool avx512f() { return false; }

#endif

struct Kernel {
  OrtApiTable api;
  int64_t N;
  bool swiglu, rms_norm;
  float epsilon;
  bool fast;

  void compute(OrtKernelContext* context) const {
    std::vector<int64_t> ad, bd, rd;
    const float* A = input<float>(api, context, 0, &ad);
    const float* B = input<float>(api, context, 1, &bd);
    const float* residual = optional_input<float>(api, context, 2, &rd);
    const int64_t P = (N + kLanes - 1) / kLanes * (swiglu ? 2 : 1);
    expect(bd.size() == 3 && bd[0] == P && bd[2] == kLanes, "MatMul",
           swiglu ? "B is not gate and up panels [2 ceil(N / 16), K, 16]" : "B is not panels [ceil(N / 16), K, 16]");
    expect(!ad.empty() && ad.back() == bd[1], "MatMul", "A's last dimension is not B's K");
    std::vector<int64_t> yd(ad);
    yd.back() = N;
    expect(residual == nullptr || rd == yd, "MatMul", "the residual's shape is not the output's [..., N]");
    expect(residual == nullptr || !swiglu, "MatMul", "a swiglu node takes no residual");
    float* y = output(api, context, 0, yd);
    const int64_t M = numel(yd) / N;
    thread_local std::vector<float> scales;    // the calling thread's, kept across calls
    if (rms_norm) {
      scales.resize(static_cast<size_t>(M));
      rms_row_scales(A, M, bd[1], epsilon, fast, scales.data());
    }
    const Call call{A, B, residual, rms_norm ? scales.data() : nullptr, y, M, bd[1], N, swiglu};
    if (numel(yd) == 0) return;
    auto chunk = [&](int64_t first, int64_t last) {
      const int64_t p0 = first * kChunkPanels, p1 = std::min(P, last * kChunkPanels);
      fast ? panels_avx512(call, p0, p1) : panels_portable(call, p0, p1);
    };
    parallel_for(api, context, (P + kChunkPanels - 1) / kChunkPanels, chunk);
  }
};

const char* op_name(const OrtCustomOp*) { return "MatMul"; }
int op_type(const OrtCustomOp*, size_t) { return kTensorFloat; }
size_t op_input_count(const OrtCustomOp*) { return 3; }
size_t op_output_count(const OrtCustomOp*) { return 1; }
int op_input_characteristic(const OrtCustomOp*, size_t index) {
  return index == 2 ? kInputOutputOptional : kInputOutputRequired;
}
int op_output_characteristic(const OrtCustomOp*, size_t) { return kInputOutputRequired; }

void* op_create(const OrtCustomOp*, const void* api, const OrtKernelInfo* info) {
  OrtApiTable table(api);
  int64_t N = 0;
  check(table, table.KernelInfoGetAttributeInt64(info, "N", &N));
  expect(N > 0, "MatMul", "N must be positive");
  float epsilon = 0.0f;
  const bool rms_norm = optional_int(table, info, "rms_norm", 0) != 0;
  if (rms_norm) check(table, table.KernelInfoGetAttributeFloat(info, "epsilon", &epsilon));
  const bool swiglu = optional_int(table, info, "swiglu", 0) != 0;
  return new Kernel{table, N, swiglu, rms_norm, epsilon, avx512f()};
}

}  // namespace

void rms_row_scales(const float* A, int64_t M, int64_t K, float epsilon, bool fast, float* r) {
  fast ? row_scales_avx512(A, M, K, epsilon, r) : row_scales(A, M, K, epsilon, r);
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

const OrtCustomOp kMatMul = {
    kOrtCustomOpVersion, op_create, op_name, cpu_provider,
    op_type, op_input_count, op_type, op_output_count,
    kernel_compute<Kernel>, kernel_destroy<Kernel>,
    op_input_characteristic, op_output_characteristic, default_memory,
};

}  // namespace tandem
