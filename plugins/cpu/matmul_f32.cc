// ai.tandem.cpu::MatMul: y = A W for float32 A [..., K] and a constant W [K, N], stored as column
// panels, read where they lie (the engine dir's mapped optimized.bin), as one ONNX Runtime CPU kernel.
//
// Inputs   A [..., K] float32; B [ceil(N / 16), K, 16] float32: panel p holds columns 16p..16p+15 of
//          W, row after row (columns past N are zeros): B[p, k, j] = W[k, 16 p + j]; with bf16 = 1
//          the same panels as bfloat16 bit patterns (uint16): half the bytes a token reads, each
//          weight widened to float32 exactly (bits << 16) before its fma, so the products are those
//          of a float32 B holding the same (bfloat16-valued) weights, bit for bit;
//          residual (optional) [..., N] float32, added to the product
// Output   [..., N]
//          norm_scale (optional) [G], gate (optional) [like A]: with norm_group G, A (Gated
//          DeltaNet's output, [..., K / G, G] or [..., K]) becomes A (r norm_scale) silu(gate), r per
//          group of G (row_ops.h, gated_group_norm): the norm, gate and reshape before out_proj;
//          split (optional, input 5) [n <= 4] int64: the product's columns go to outputs 0..n-1,
//          [..., split[i]] each (the Split after a fused projection, in the node); split_heads
//          (optional, input 6) [n]: output i as [..., heads, split[i] / heads] where heads > 0
// Attrs    N; norm_group (0: none); swiglu (0 or 1): B holds the gate and up projections' panels in turns (gate panel q,
//          then up panel q: 2 ceil(N / 16) panels) and y = silu(gate) * up, N columns, where
//          silu(x) = x / (1 + exp(-x)) (the MLP's Split, sigmoid-gate and Mul in the node);
//          rms_norm (0 or 1), epsilon: with rms_norm each row of A is RMS-normalized first, its
//          scale folded into W by the build (W = diag(scale) W0): y = r A W + residual with
//          r = 1 / sqrt(sum_k A[m, k]^2 / K + epsilon): the RMSNormalization before a matmul and the
//          residual Add after it, as one node (export/cpu_kernel_lowering.py fuses them); where the
//          folded W would not be bfloat16 (bf16 panels), the scale comes as input 3 instead (norm_scale
//          [K], norm_group 0) and multiplies A's columns: y = r (A diag(scale)) W0 + residual
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
// Tiles: R rows x V panels in registers, each k loading row k of the V panels once for the R rows:
// up to 8 rows, R * V <= 16 accumulators; past 8 rows, blocks of up to 12 rows x 2 panels (24).
// Chunks of 4 panels are shared out on ONNX Runtime's pool. Past 8 rows a chunk goes 2 panels and
// 128 rows of k (a slice) at a time, every block over the slice, the tiles' sums kept in memory
// between slices (`sliced`).

#include <cmath>
#include <vector>

#include "kernel_common.h"
#include "row_ops.h"


namespace tandem {
namespace {

constexpr int64_t kLanes = 16;          // columns per panel
constexpr int64_t kChunkPanels = 4;     // panels per task of the pool
constexpr int64_t kAhead = 64;          // rows of a panel a prefetching tile reads ahead
constexpr int64_t kSlice = 128;         // rows of k per slice past 8 rows (2 panels' slice: 16 KB float32)
constexpr int64_t kBlockRows = 12;      // rows per tile past 8 rows: 12 x 2 panels, 24 accumulators

template <typename W>     // float (float32 panels) or uint16_t (bfloat16 bit patterns)
struct Call {
  const float* A;          // [M, K]
  const W* B;              // [P, K, 16]
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

inline float widen(float w) { return w; }
inline float widen(uint16_t w) {      // bfloat16 -> float32, exact
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Panels [p0, p1) of every row, lane by lane: the chains the AVX-512 kernel runs, in its order
// (swiglu: p0 even, a gate panel and its up panel together).
template <typename W>
void panels_portable(const Call<W>& c, int64_t p0, int64_t p1) {
  for (int64_t m = 0; m < c.M; ++m) {
    const float* a = c.A + m * c.K;
    for (int64_t p = p0; p < p1; p += c.swiglu ? 2 : 1) {
      float acc[2][kLanes] = {};
      for (int64_t v = 0; v < (c.swiglu ? 2 : 1); ++v) {
        const W* b = c.B + (p + v) * c.K * kLanes;
        for (int64_t k = 0; k < c.K; ++k) {
          for (int64_t j = 0; j < kLanes; ++j) acc[v][j] = std::fma(a[k], widen(b[k * kLanes + j]), acc[v][j]);
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

TANDEM_AVX512F inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
TANDEM_AVX512F inline __m512 load16(const uint16_t* w) {   // 16 bfloat16 -> float32, exact
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// y[m0 .. m0 + R] for panels [p0, p0 + V) (swiglu: V / 2 gate and up pairs), stores masked to N.
// PF: prefetch each panel `ahead` rows ahead into L1 (see panels_avx512).
// Over k in [k0, k1) only where `part` is given ([R, V, 16] sums of the tile's rows and panels):
// the sums start from it (k0 > 0) and go back to it unless k1 = K, where the epilogue writes y; a
// stored float32 comes back the same, so each element is still one fma chain over k in order.
template <int R, int V, bool PF = false, typename W>
TANDEM_AVX512F void tile(const Call<W>& c, int64_t m0, int64_t p0, int64_t k0 = 0, int64_t k1 = -1,
                         float* part = nullptr, int64_t ahead = kAhead) {
  if (k1 < 0) k1 = c.K;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(part + (r * V + v) * kLanes);
  }
  const int64_t panel = c.K * kLanes;
  const W* b = c.B + p0 * panel + k0 * kLanes;
  const float* a = c.A + m0 * c.K;
  for (int64_t k = k0; k < k1; ++k, b += kLanes) {
    __m512 w[V];
    if (PF) {
      for (int v = 0; v < V; ++v) {
        _mm_prefetch(reinterpret_cast<const char*>(b + v * panel + ahead * kLanes), _MM_HINT_T0);
      }
    }
    for (int v = 0; v < V; ++v) w[v] = load16(b + v * panel);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * c.K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(x, w[v], acc[r][v]);
    }
  }
  if (k1 < c.K) {
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(part + (r * V + v) * kLanes, acc[r][v]);
    }
    return;
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

// rows [m0, m0 + R) of panels [p0, p1), V at a time (fewer for the last ones: the same chains;
// swiglu: an even count, the panels come in pairs)
template <int R, int V, bool PF = false, typename W>
TANDEM_AVX512F void rows_of(const Call<W>& c, int64_t m0, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; p += V) {
    switch (std::min<int64_t>(V, p1 - p)) {
      case 1: tile<R, 1, PF>(c, m0, p); break;
      case 2: tile<R, (V >= 2 ? 2 : V), PF>(c, m0, p); break;
      case 3: tile<R, (V >= 3 ? 3 : V), PF>(c, m0, p); break;
      default: tile<R, V, PF>(c, m0, p); break;
    }
  }
}

// One block of `rows` rows (1..kBlockRows) over panels [p, p + V) and a slice of k
template <int V, bool PF, typename W>
TANDEM_AVX512F void block_rows(const Call<W>& c, int64_t rows, int64_t m, int64_t p, int64_t k0, int64_t k1,
                               float* part) {
  switch (rows) {
    case 12: return tile<12, V, PF>(c, m, p, k0, k1, part, kSlice);
    case 11: return tile<11, V, PF>(c, m, p, k0, k1, part, kSlice);
    case 10: return tile<10, V, PF>(c, m, p, k0, k1, part, kSlice);
    case 9: return tile<9, V, PF>(c, m, p, k0, k1, part, kSlice);
    case 8: return tile<8, V, PF>(c, m, p, k0, k1, part, kSlice);
    case 7: return tile<7, V, PF>(c, m, p, k0, k1, part, kSlice);
    case 6: return tile<6, V, PF>(c, m, p, k0, k1, part, kSlice);
    case 5: return tile<5, V, PF>(c, m, p, k0, k1, part, kSlice);
    case 4: return tile<4, V, PF>(c, m, p, k0, k1, part, kSlice);
    case 3: return tile<3, V, PF>(c, m, p, k0, k1, part, kSlice);
    case 2: return tile<2, V, PF>(c, m, p, k0, k1, part, kSlice);
    default: return tile<1, V, PF>(c, m, p, k0, k1, part, kSlice);
  }
}

// A slice of k for every row, in blocks of as even a size as kBlockRows allows (16 rows: 8 and 8;
// 32: 11, 11 and 10), each from the slice's sums before (part: [rows, V, 16]); the first block
// fetches the next slice, the rest read this one from L1
template <int V, typename W>
TANDEM_AVX512F void slice_rows(const Call<W>& c, int64_t p, int64_t k0, int64_t k1, float* part) {
  const int64_t blocks = (c.M + kBlockRows - 1) / kBlockRows, rows = (c.M + blocks - 1) / blocks;
  for (int64_t m = 0; m < c.M; m += rows) {
    const int64_t r = std::min(rows, c.M - m);
    float* at = part + m * V * kLanes;
    m == 0 ? block_rows<V, true>(c, r, m, p, k0, k1, at) : block_rows<V, false>(c, r, m, p, k0, k1, at);
  }
}

// More than 8 rows (a wide verify, a batch's verify, prefill): the panels go V = 2 at a time and k
// in slices of kSlice, every block of rows over a slice before the next slice, while the first
// block prefetches the next slice: the panels stream from memory as the blocks after the first
// compute on this slice from L1. Blocks of 8 rows over whole chunks, unprefetched, left memory idle
// while the later blocks computed: against them, on the 147M model (Intel Xeon, 2 cores), its verify
// of 16 / 32 rows takes 0.75x / 0.76x the time and its 64-row prefill chunk 0.83x; without the
// prefetch, slices alone were no faster. Blocks of 12 rows (24 accumulators) rather than 8: the
// 32-row verify 0.88x, the prefill chunk 0.93x.
template <typename W>
TANDEM_AVX512F void sliced(const Call<W>& c, int64_t p0, int64_t p1) {
  thread_local std::vector<float> part;      // [M, V, 16] sums over the slices before
  part.resize(static_cast<size_t>(c.M * 2 * kLanes));
  for (int64_t p = p0; p < p1; p += 2) {
    for (int64_t k0 = 0; k0 < c.K; k0 += kSlice) {
      const int64_t k1 = std::min(c.K, k0 + kSlice);
      p + 1 < p1 ? slice_rows<2>(c, p, k0, k1, part.data()) : slice_rows<1>(c, p, k0, k1, part.data());
    }
  }
}

// A call of 5-8 rows (batch 8 decode) runs one block of tiles of 8-16 fmas per weight line: the
// hardware prefetchers fall behind those, so they prefetch 64 rows ahead, into L1 (T0). 150M
// target step at batch 8, AMD Zen 4: 1.08-1.19x with NTA, 1.05-1.13x with T0 (16 rows ahead 0.99x,
// 128 1.09x, 256 1.04x); Intel Xeon (Sapphire Rapids class): T0 1.2x none and 1.18x NTA, so T0 on
// both. The same at 4 rows measured 0.92-0.97x and at 1 row 0.96-1.00x, so those do not. Past 8
// rows the first block of each slice prefetches the next slice (`sliced`).
template <typename W>
TANDEM_AVX512F void panels_avx512(const Call<W>& c, int64_t p0, int64_t p1) {
  switch (c.M) {
    case 8: return rows_of<8, 2, true>(c, 0, p0, p1);
    case 7: return rows_of<7, 2, true>(c, 0, p0, p1);
    case 6: return rows_of<6, 2, true>(c, 0, p0, p1);
    case 5: return rows_of<5, 2, true>(c, 0, p0, p1);
    default: break;
  }
  if (c.M > 8) return sliced(c, p0, p1);
  switch (c.M) {
    case 4: return rows_of<4, 4>(c, 0, p0, p1);
    case 3: return rows_of<3, 4>(c, 0, p0, p1);
    case 2: return rows_of<2, 4>(c, 0, p0, p1);
    case 1: return rows_of<1, 4>(c, 0, p0, p1);
    default: break;
  }
}

#else

template <typename W>
void panels_avx512(const Call<W>& c, int64_t p0, int64_t p1) { panels_portable(c, p0, p1); }

#endif

struct Kernel {
  static constexpr const char* kName = "MatMul";
  static constexpr int kInputs[] = {kTensorFloat, 0, kTensorFloat, kTensorFloat, kTensorFloat,
      kTensorInt64, kTensorInt64};     // B: float32, or uint16 (bf16 = 1)
  static constexpr uint32_t kOptionalInputs = from_index(2);
  static constexpr size_t kOutputs = kMaxSplits;
  static constexpr uint32_t kOptionalOutputs = from_index(1);

  static Kernel* create(const OrtApiTable& api, const OrtKernelInfo* info) {
    int64_t N = 0;
    check(api, api.KernelInfoGetAttributeInt64(info, "N", &N));
    expect(N > 0, "MatMul", "N must be positive");
    const MatMulFusions f = matmul_fusions(api, info, "MatMul");
    const bool bf16 = optional_int(api, info, "bf16", 0) != 0;
    return new Kernel{NodeApi(api, info), N, f.norm_group, f.swiglu, f.rms_norm, f.epsilon, avx512f(), bf16};
  }

  NodeApi api;

  // A (r norm_scale) silu(gate) per group of norm_group (inputs 3 and 4), in the calling thread's
  // scratch
  const float* normed_input(OrtKernelContext* context, const float* A, int64_t n, int64_t K) const {
    Dims sd, gd;
    const float* scale = optional_input<float>(api, context, 3, &sd);
    const float* gate = optional_input<float>(api, context, 4, &gd);
    expect(scale != nullptr && numel(sd) == norm_group && K % norm_group == 0, "MatMul",
           "norm_group needs norm_scale [G], G dividing K");
    expect(gate != nullptr && numel(gd) == n, "MatMul", "norm_group needs a gate of A's size");
    thread_local std::vector<float> normed;
    normed.resize(static_cast<size_t>(n));
    gated_group_norm(A, gate, scale, n, norm_group, epsilon, fast, normed.data());
    return normed.data();
  }

  int64_t N, norm_group;
  bool swiglu, rms_norm;
  float epsilon;
  bool fast, bf16;

  // A diag(scale), scale input 3 ([K]: an RMS norm's, where the build could not fold it into bf16
  // panels), in the calling thread's scratch; A itself where the node has no such input
  const float* scaled_input(OrtKernelContext* context, const float* A, int64_t n, int64_t K) const {
    Dims sd;
    const float* scale = optional_input<float>(api, context, 3, &sd);
    if (scale == nullptr) return A;
    expect(numel(sd) == K, "MatMul", "the norm scale (input 3) is not [K]");
    thread_local std::vector<float> scaled;
    scaled.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) scaled[i] = A[i] * scale[i % K];
    return scaled.data();
  }

  void compute(OrtKernelContext* context) const {
    Dims ad, bd, rd;
    const float* A = input<float>(api, context, 0, &ad);
    const void* B = input<void>(api, context, 1, &bd);
    const float* residual = optional_input<float>(api, context, 2, &rd);
    const int64_t P = (N + kLanes - 1) / kLanes * (swiglu ? 2 : 1);
    expect(bd.size() == 3 && bd[0] == P && bd[2] == kLanes, "MatMul",
           swiglu ? "B is not gate and up panels [2 ceil(N / 16), K, 16]" : "B is not panels [ceil(N / 16), K, 16]");
    Dims yd;
    expect(product_dims(ad, bd[1], N, norm_group, &yd), "MatMul", "A's last dimension is not B's K");
    if (norm_group > 0) A = normed_input(context, A, numel(ad), bd[1]);
    expect(residual == nullptr || rd == yd, "MatMul", "the residual's shape is not the output's [..., N]");
    expect(residual == nullptr || !swiglu, "MatMul", "a swiglu node takes no residual");
    const ColumnSplit split = column_split(api, context, 5, N, "MatMul");
    expect(split.empty() || (!swiglu && residual == nullptr), "MatMul", "a split node takes no residual or swiglu");
    thread_local std::vector<float> whole;     // the product before a split (the calling thread's)
    if (!split.empty()) whole.resize(static_cast<size_t>(numel(yd)));
    float* y = split.empty() ? output(api, context, 0, yd) : whole.data();
    const SplitOutputs outputs = split_outputs(api, context, yd, split);
    const int64_t M = numel(yd) / N;
    thread_local std::vector<float> scales;    // the calling thread's, kept across calls
    if (rms_norm) {
      scales.resize(static_cast<size_t>(M));
      rms_row_scales(A, M, bd[1], epsilon, fast, scales.data());
    }
    if (rms_norm) A = scaled_input(context, A, numel(ad), bd[1]);      // (after the row scales: of A)
    const float* r = rms_norm ? scales.data() : nullptr;
    const Call<float> f32{A, static_cast<const float*>(B), residual, r, y, M, bd[1], N, swiglu};
    const Call<uint16_t> half{A, static_cast<const uint16_t*>(B), residual, r, y, M, bd[1], N, swiglu};
    if (numel(yd) == 0) return;
    auto chunk = [&](int64_t first, int64_t last) {
      const int64_t p0 = first * kChunkPanels, p1 = std::min(P, last * kChunkPanels);
      if (bf16) {
        fast ? panels_avx512(half, p0, p1) : panels_portable(half, p0, p1);
      } else {
        fast ? panels_avx512(f32, p0, p1) : panels_portable(f32, p0, p1);
      }
      outputs.copy(y, p0 * kLanes, std::min(N, p1 * kLanes));   // a split's columns (y: the product), while in cache
    };
    // the panels stream once per block of 8 rows
    const int64_t bytes = (bf16 ? 2 : 4) * P * bd[1] * kLanes * ((M + 7) / 8);
    parallel_for(api, context, (P + kChunkPanels - 1) / kChunkPanels, bytes, chunk);
  }
};

}  // namespace

const OrtCustomOp kMatMul = custom_op<Kernel>();

}  // namespace tandem
