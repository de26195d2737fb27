// ai.tandem.cpu::MatMulNBits' AVX-512 VNNI kernel (the op and its math: matmul_nbits.cc).
//
// The kernel works in steps of 4 groups (128 inputs). vpdpbusd multiplies unsigned weights by the
// row's signed activations and sums each 4 adjacent products into one of 16 int32 lanes; two of
// them put group g's products in lanes 4g..4g+3, whose float conversion times (weight scale x
// activation scale) of the group goes into a float accumulator per (row, column). A step's two
// weight vectors, in 16-byte lanes:
//     4 bits   64 bytes [g0 | g1 | g2 | g3] split into low nibbles (even inputs) and high nibbles
//              (odd inputs); activations [evens of g0..g3 | odds of g0..g3] (128 bytes)
//     8 bits   128 bytes [g0 | g1 | g2 | g3] (32 each) recombined, a qword permute each, into their
//              first and second halves; activations [first 16 of g0..g3 | last 16 of g0..g3]
// so weights move only in registers; activations are reordered once per row instead.
// Four columns go together (one activation load, four independent accumulations) over up to 4
// rows (verify rows reuse the weights from registers). Compiled for AVX-512 with function
// attributes and chosen at run time (avx512_vnni()), so the library still loads, and runs the
// portable kernel, on a CPU without it.

#include <cstdlib>
#include <cstring>

#include "matmul_nbits.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

// GCC 12 warns on the undefined pass-through operand inside its own AVX-512 intrinsics
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define TANDEM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

namespace tandem {

bool avx512_vnni() {
  const char* portable = std::getenv("TANDEM_CPU_KERNELS_PORTABLE");   // A/B and tests
  if (portable != nullptr && std::strcmp(portable, "1") == 0) return false;
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

namespace {

// step j's weights of one column as the two vectors vpdpbusd takes (`left`: groups left, < 4 in
// the last step, whose missing groups read as zeros and nothing past the column)
template <int BITS>
TANDEM_AVX512 inline void step_weights(const uint8_t* column, int64_t j, int64_t left, __m512i* lo, __m512i* hi) {
  if (BITS == 4) {
    const uint8_t* w = column + j * 64;
    const __m512i bytes = left >= 4 ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi8((1ull << (left * 16)) - 1, w);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    *lo = _mm512_and_si512(bytes, nibble);
    *hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    return;
  }
  const uint8_t* w = column + j * 128;
  const auto bytes = [](int64_t groups) { return groups >= 2 ? ~0ull : groups == 1 ? 0xFFFFFFFFull : 0ull; };
  const __m512i g01 = left >= 4 ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi8(bytes(left), w);
  const __m512i g23 = left >= 4 ? _mm512_loadu_si512(w + 64) : _mm512_maskz_loadu_epi8(bytes(left - 2), w + 64);
  // qwords 0-7 of g01, 8-15 of g23: first halves of g0..g3, then their second halves
  *lo = _mm512_permutex2var_epi64(g01, _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), g23);
  *hi = _mm512_permutex2var_epi64(g01, _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15), g23);
}

// the zero points of blocks [b, b + 16) of column n (lanes past the last block: anything finite)
TANDEM_AVX512 inline __m512 block_zeros(const MatMulNBitsCall& c, int64_t n, int64_t b, __mmask16 valid) {
  if (c.zeros == nullptr) return _mm512_set1_ps(static_cast<float>(1 << (c.bits - 1)));
  if (c.bits == 8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(valid, c.zeros + n * c.blocks + b)));
  }
  const __mmask16 bytes = static_cast<__mmask16>((1u << ((__builtin_popcount(valid) + 1) / 2)) - 1);
  const __m128i packed = _mm_cvtepu8_epi16(_mm_maskz_loadu_epi8(bytes, c.zeros + n * ((c.blocks + 1) / 2) + b / 2));
  // per 16-bit lane (one byte): low nibble stays in byte 0, high nibble moves to byte 1 -> blocks in order
  const __m128i nibbles = _mm_or_si128(_mm_and_si128(packed, _mm_set1_epi16(0x0F)),
                                       _mm_slli_epi16(_mm_srli_epi16(packed, 4), 8));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles));
}

// Software prefetch, into L2 (_MM_HINT_T1), of the weights, scales and zero points 32 columns (8
// tiles) ahead. Into L1 (T0) the 2048 x 768 layers streamed at 0.6-0.8x MLAS on one thread, into L2
// at 1.2-1.5x; 8 and 16 columns ahead were 1.14-1.20x and 1.03x slower at batch 1 in the engine,
// 64 1.02x slower; the scales' own prefetch gave 1.09x (bench/matmul_nbits.py, bench/engine_ab.py).
constexpr int64_t kPrefetchColumns = 32;

inline __mmask16 first16(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// the sums of four accumulators' lanes, in one order for each: pairs of lanes, then 128-bit blocks
TANDEM_AVX512 inline __m128 sums4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));   // per block: a0..a3
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(t), upper);
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// y[m0 .. m0 + R, n0 .. n0 + C]: every (row, column) runs the same arithmetic in the same order
// whatever R (and a column the same whatever the rows), so a row's result does not depend on the
// call's other rows. One row with a scale per group multiplies the 16 groups' weight and activation
// scales once per window (the same products the other rows take lane by lane).
template <int BITS, int C, int R>
TANDEM_AVX512 void tile(const MatMulNBitsCall& c, const QuantizedRows& a, int64_t n0, int64_t m0) {
  constexpr int64_t kStepGroups = 4, kWindowSteps = 16 / kStepGroups;
  const int64_t per_block = c.block_size / kGroup, column_bytes = c.blocks * c.block_size * BITS / 8;
  const bool fused = R == 1 && per_block == 1;
  __m512 acc[C][R];
  for (int col = 0; col < C; ++col) {
    for (int r = 0; r < R; ++r) acc[col][r] = _mm512_setzero_ps();
  }
  __m512 window[C];
  {   // the scales and zero points of the tiles ahead: streams of their own
    const char* ahead = reinterpret_cast<const char*>(c.scales + (n0 + kPrefetchColumns) * c.blocks);
    for (int64_t at = 0; at < C * c.blocks * 4; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T1);
    if (c.zeros != nullptr) {
      const int64_t row = BITS == 8 ? c.blocks : (c.blocks + 1) / 2;
      const char* zeros = reinterpret_cast<const char*>(c.zeros + (n0 + kPrefetchColumns) * row);
      for (int64_t at = 0; at < C * row; at += 64) _mm_prefetch(zeros + at, _MM_HINT_T1);
    }
  }
  for (int64_t j = 0; j < a.steps; ++j) {
    const int64_t w = j % kWindowSteps, left = a.groups - j * kStepGroups;
    if (w == 0) {   // the block scales of the next 16 groups
      const int64_t block = j * kStepGroups / per_block;
      const __m512 sx = fused ? _mm512_maskz_loadu_ps(first16(left), a.sx.data() + m0 * a.groups + j * kStepGroups)
                              : _mm512_set1_ps(1.0f);
      for (int col = 0; col < C; ++col) {
        window[col] = _mm512_maskz_loadu_ps(first16(c.blocks - block), c.scales + (n0 + col) * c.blocks + block);
        if (fused) window[col] = _mm512_mul_ps(window[col], sx);
      }
    }
    const __m512i lanes = _mm512_loadu_si512(a.lane_block.data() + w * 16);
    __m512i lo[C], hi[C];
    __m512 ws[C];
    for (int col = 0; col < C; ++col) {
      const uint8_t* column = c.B + (n0 + col) * column_bytes;
      // DRAM latency is hidden by asking now for the weights of the tiles ahead (the hardware
      // prefetcher alone left the loads and the arithmetic nearly one after the other)
      const char* ahead = reinterpret_cast<const char*>(column + kPrefetchColumns * column_bytes + j * 2 * BITS * 8);
      _mm_prefetch(ahead, _MM_HINT_T1);
      if (BITS == 8) _mm_prefetch(ahead + 64, _MM_HINT_T1);
      step_weights<BITS>(column, j, left, &lo[col], &hi[col]);
      ws[col] = _mm512_permutexvar_ps(lanes, window[col]);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.q.data() + (m0 + r) * a.row_bytes + j * kStepGroups * kGroup;
      const __m512i x0 = _mm512_loadu_si512(x);
      const __m512 sx = fused ? _mm512_setzero_ps()       // (unused: the window holds the products)
                              : _mm512_loadu_ps(a.sx_lanes.data() + ((m0 + r) * a.steps + j) * 16);
      for (int col = 0; col < C; ++col) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[col], x0), hi[col],
                                                _mm512_loadu_si512(x + 64));
        const __m512 scale = fused ? ws[col] : _mm512_mul_ps(ws[col], sx);
        acc[col][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[col][r]);
      }
    }
  }
  for (int64_t b = 0; b < c.blocks; b += 16) {   // - sum_b scale zero C_b, into the same accumulators
    for (int col = 0; col < C; ++col) {
      const __mmask16 valid = first16(c.blocks - b);
      const __m512 wz = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, c.scales + (n0 + col) * c.blocks + b),
                                      block_zeros(c, n0 + col, b, valid));
      for (int r = 0; r < R; ++r) {
        acc[col][r] = _mm512_fnmadd_ps(wz, _mm512_loadu_ps(a.c.data() + (m0 + r) * a.blocks_padded + b), acc[col][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = c.y + (m0 + r) * c.N + n0;
    if constexpr (C == 4) {
      _mm_storeu_ps(y, sums4(acc[0][r], acc[1][r], acc[2][r], acc[3][r]));
    } else {
      for (int col = 0; col < C; ++col) y[col] = _mm512_reduce_add_ps(acc[col][r]);
    }
  }
}

template <int BITS, int C>
TANDEM_AVX512 void column_tiles(const MatMulNBitsCall& c, const QuantizedRows& a, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= c.M; m += 4) tile<BITS, C, 4>(c, a, n, m);
  switch (c.M - m) {
    case 3: tile<BITS, C, 3>(c, a, n, m); break;
    case 2: tile<BITS, C, 2>(c, a, n, m); break;
    case 1: tile<BITS, C, 1>(c, a, n, m); break;
    default: break;
  }
}

template <int BITS>
TANDEM_AVX512 void columns(const MatMulNBitsCall& c, const QuantizedRows& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) column_tiles<BITS, 4>(c, a, n);
  for (; n < n1; ++n) column_tiles<BITS, 1>(c, a, n);
}

}  // namespace

TANDEM_AVX512 void quantize_avx512(const MatMulNBitsCall& call, QuantizedRows* rows) {
  rows->shape(call);
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  for (int64_t m = 0; m < call.M; ++m) {
    for (int64_t g = 0; g < rows->groups; ++g) {
      const float* x = call.A + m * call.K + g * kGroup;
      const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      // step g / 4 holds the group's 16 inputs of the first weight vector at (g % 4) * 16 and its
      // 16 of the second 64 bytes further: 4 bits the even and the odd inputs, 8 bits the first
      // and the last 16
      int8_t* step = rows->q.data() + m * rows->row_bytes + (g / 4) * 4 * kGroup + (g % 4) * 16;
      const __m512i first = call.bits == 8 ? qlo : _mm512_permutex2var_epi32(qlo, evens, qhi);
      const __m512i second = call.bits == 8 ? qhi : _mm512_permutex2var_epi32(qlo, odds, qhi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(step), _mm512_cvtsepi32_epi8(first));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(step + 64), _mm512_cvtsepi32_epi8(second));
      rows->sx[m * rows->groups + g] = amax / 127.0f;
      rows->sums[m * rows->groups + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
  }
  rows->finish(call, true);
}

void columns_avx512(const MatMulNBitsCall& call, const QuantizedRows& rows, int64_t n0, int64_t n1) {
  call.bits == 8 ? columns<8>(call, rows, n0, n1) : columns<4>(call, rows, n0, n1);
}

}  // namespace tandem

#else   // not x86-64: the portable kernel only

namespace tandem {
bool avx512_vnni() { return false; }
void quantize_avx512(const MatMulNBitsCall&, QuantizedRows*) {}
void columns_avx512(const MatMulNBitsCall&, const QuantizedRows&, int64_t, int64_t) {}
}  // namespace tandem

#endif
