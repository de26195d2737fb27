// ai.tandem.cpu::MatMulNBits' AVX-512 VNNI kernel (the op and its math: matmul_nbits.cc; the
// weights' column tiles: matmul_nbits.h).
//
// One 64-byte load of a tile is the next 4 inputs (8 bits) or 8 inputs (4 bits, low and high
// nibbles) of 16 columns, a dword per column, so vpdpbusd multiplies it by one dword of the row's
// activations broadcast to every lane (from memory) and each lane sums its own column: no shuffle
// of weights or scales. Per group of 32 inputs, 8 such vpdpbusd (4 loads and 4 nibble splits for
// 4 bits) make the exact int32 dots of 16 columns. Each group then adds to a float accumulator per
// row: (dot - z sum(xq_g)) x (the 16 columns' block scales x the row's sx), the zero points' share
// taken off in float32 by one fma, exact (every value is an integer under 2^22). Taking it off per
// group beat a pass over the blocks after the dots (one-row tiles 1.09-1.17x faster at int4, 1.07x
// at int8, Zen 4), and the fma an integer multiply and subtract (1.05-1.1x at 8-32 rows, Intel
// Xeon). ONNX Runtime's layout (a column's bytes in a row, 4 columns a step) needs two permutes of
// the weights and one of the scales per 128 bytes, 7 vector operations where this needs 2.75 for int8:
// docs/performance.md has the figures. A tile runs up to 4 rows at once, 8 for int8 (verify rows
// reuse each load). Compiled for AVX-512 with function attributes and chosen at run time
// (avx512_vnni()), so the library still loads, and runs the portable kernel, on a CPU without it.

#include <cstdlib>
#include <cstring>

#include "matmul_nbits.h"
#include "row_ops.h"

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

// Software prefetch into L1 (T0) of the weights this many bytes ahead in the tiles' stream (tiles
// follow each other in memory), and of the next tile's scales and zero points (streams of their
// own). Not non-temporal: on Intel Xeon (Sapphire Rapids class) NTA prefetches of this stream made
// the kernel 1.35-1.6x slower than T0 (they fill L1 only, past the L2 streamer), and no prefetch
// 1.25x slower; T0 or T1 4-16 KB ahead are within 2% of each other there. On AMD Zen 4 the one-row
// tile streams faster with no weight prefetch at all (its hardware prefetchers alone): the int8
// 768 x 4096 and 768 x 32000 shapes 1.22x and 1.16x, the 150M int8 decode 1.08-1.10x (and 1.09x
// against T0 8 KB ahead with both dirs on the same weight pages); int4 with T0 0.5-8 KB ahead:
// 0.94-0.99x of none on the same pages. So there one row goes without. docs/performance.md.
constexpr int64_t kPrefetchBytes = 8192;

// whether the one-row tile prefetches the weights itself: not on AMD (above)
bool one_row_prefetch() {
  static const bool prefetch = [] {
    __builtin_cpu_init();
    return !__builtin_cpu_is("amd");
  }();
  return prefetch;
}

using dword_t = int32_t __attribute__((may_alias, aligned(1)));

// the 16 columns' scales of a block (float16) as floats
TANDEM_AVX512 inline __m512 block_scales(const uint16_t* at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// the 16 columns' zero points of block b of tile t, as int32
template <int BITS>
TANDEM_AVX512 inline __m512i block_zeros_int(const MatMulNBitsCall& c, int64_t t, int64_t b) {
  if (c.zeros == nullptr) return _mm512_set1_epi32(1 << (BITS - 1));
  const uint8_t* row = c.zeros + (t * c.zero_rows() + (BITS == 8 ? b : b / 2)) * kTile;
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
  if (BITS == 4) bytes = _mm_and_si128(_mm_srli_epi16(bytes, 4 * static_cast<int>(b & 1)), _mm_set1_epi8(0x0F));
  return _mm512_cvtepu8_epi32(bytes);
}

// y[m0 .. m0 + R, 16 t .. 16 t + 16): every (row, column) runs the same arithmetic in the same
// order whatever R, so a row's result does not depend on the call's other rows.
// PF: prefetch the weights kPrefetchBytes ahead (above)
template <int BITS, int R, bool PF = true>
TANDEM_AVX512 void tile(const MatMulNBitsCall& c, const QuantizedRows& a, int64_t t, int64_t m0) {
  constexpr int kLoads = BITS == 8 ? 8 : 4;                // 64-byte loads per group of 32 inputs
  // independent sums per row: 4 for one row; 2 (even and odd loads) for more, which are R chains
  // already; at 8 rows one (int8: 16 sums and 8 accumulators measured 0.6x a 4-row tile)
  constexpr int kChains = R == 1 ? 4 : (R >= 8 ? 1 : 2);
  const int block_shift = __builtin_ctzll(static_cast<uint64_t>(c.block_size / kGroup));   // a power of two
  const uint8_t* w = c.B + t * c.tile_bytes();
  const uint16_t* scales = c.scales + t * c.blocks * kTile;
  {   // the next tile's scales and zero points (streams of their own)
    const char* ahead = reinterpret_cast<const char*>(scales + c.blocks * kTile);
    for (int64_t at = 0; at < c.blocks * kTile * 2; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T0);
    if (c.zeros != nullptr) {
      const char* zeros = reinterpret_cast<const char*>(c.zeros + (t + 1) * c.zero_rows() * kTile);
      for (int64_t at = 0; at < c.zero_rows() * kTile; at += 64) _mm_prefetch(zeros + at, _MM_HINT_T0);
    }
  }
  const int8_t* x[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    x[r] = a.q.data() + (m0 + r) * c.K;
    acc[r] = _mm512_setzero_ps();
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < a.groups; ++g) {
    // a row's 8 vpdpbusd of a group go into kChains independent sums (one chain of 8 is bound by
    // their latency: 2x slower with the weights in cache), added after: integers, exact
    __m512i dot[R][kChains];
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < kChains; ++i) dot[r][i] = _mm512_setzero_si512();
    }
    for (int l = 0; l < kLoads; ++l) {
      const uint8_t* at = w + (g * kLoads + l) * 64;
      if (PF) _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchBytes), _MM_HINT_T0);
      const __m512i bytes = _mm512_loadu_si512(at);
      if constexpr (BITS == 8) {
        for (int r = 0; r < R; ++r) {
          const int8_t* xd = x[r] + g * kGroup + l * 4;
          __m512i& sum = dot[r][l % kChains];
          sum = _mm512_dpbusd_epi32(sum, bytes, _mm512_set1_epi32(*reinterpret_cast<const dword_t*>(xd)));
        }
      } else {
        // low nibbles as they are. High nibbles: with separate odd sums left in place (16 q), so
        // those sum 16 x their dots, shifted back once per group (exact: multiples of 16), one shift
        // fewer a load; with one sum per row (8 rows) shifted down here, as both go into it.
        const __m512i lo = _mm512_and_si512(bytes, nibble);
        const __m512i high = kChains == 1 ? _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble)
                                          : _mm512_andnot_si512(nibble, bytes);
        for (int r = 0; r < R; ++r) {   // the dword's 4 even inputs, then its 4 odd ones (activation_slot)
          const int8_t* xd = x[r] + g * kGroup + l * 8;
          __m512i& even = dot[r][(2 * l) % kChains];
          __m512i& odd = dot[r][(2 * l + 1) % kChains];
          even = _mm512_dpbusd_epi32(even, lo, _mm512_set1_epi32(*reinterpret_cast<const dword_t*>(xd)));
          odd = _mm512_dpbusd_epi32(odd, high, _mm512_set1_epi32(*reinterpret_cast<const dword_t*>(xd + 4)));
        }
      }
    }
    const __m512 sw = block_scales(scales + (g >> block_shift) * kTile);
    const __m512 zeros = _mm512_cvtepi32_ps(block_zeros_int<BITS>(c, t, g >> block_shift));
    for (int r = 0; r < R; ++r) {
      __m512i total = dot[r][0];
      if constexpr (kChains > 1) {
        __m512i odd = dot[r][1];
        for (int i = 2; i < kChains; i += 2) {
          total = _mm512_add_epi32(total, dot[r][i]);
          odd = _mm512_add_epi32(odd, dot[r][i + 1]);
        }
        total = _mm512_add_epi32(total, BITS == 4 ? _mm512_srai_epi32(odd, 4) : odd);
      }
      // less the zero points' share: dot(q - z, xq) = dot(q, xq) - z sum(xq), exact in float32 (one
      // fma where an integer multiply took two uops and a subtract): |dot| and |z sum| are at most
      // 32 * 255 * 127 < 2^21, their difference under 2^22, so every value is an integer float32 holds
      const __m512 sum = _mm512_set1_ps(static_cast<float>(a.sums[(m0 + r) * a.groups + g]));
      const __m512 exact = _mm512_fnmadd_ps(zeros, sum, _mm512_cvtepi32_ps(total));
      const __m512 scale = _mm512_mul_ps(sw, _mm512_set1_ps(a.sx[(m0 + r) * a.groups + g]));
      acc[r] = _mm512_fmadd_ps(exact, scale, acc[r]);
    }
  }
  const int64_t n0 = t * kTile, left = c.N - n0;
  const __mmask16 valid = first_lanes(left);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(c.y + (m0 + r) * c.N + n0, valid, acc[r]);
}

template <int BITS>
TANDEM_AVX512 void tiles(const MatMulNBitsCall& c, const QuantizedRows& a, int64_t t0, int64_t t1) {
  const bool prefetch = one_row_prefetch();
  for (int64_t t = t0; t < t1; ++t) {
    int64_t m = 0;
    for (; m + 8 <= c.M; m += 8) tile<BITS, 8>(c, a, t, m);   // each weight load feeds 8 rows
    for (; m + 4 <= c.M; m += 4) tile<BITS, 4>(c, a, t, m);
    switch (c.M - m) {
      case 3: tile<BITS, 3>(c, a, t, m); break;
      case 2: tile<BITS, 2>(c, a, t, m); break;
      case 1: prefetch ? tile<BITS, 1>(c, a, t, m) : tile<BITS, 1, false>(c, a, t, m); break;
      default: break;
    }
  }
}

}  // namespace

TANDEM_AVX512 void quantize_avx512(const MatMulNBitsCall& call, QuantizedRows* rows) {
  rows->shape(call);
  // 4 bits: each 8 inputs as their evens then their odds (activation_slot)
  const __m512i order = call.bits == 8 ? _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                       : _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t m = 0; m < call.M; ++m) {
    for (int64_t g = 0; g < rows->groups; ++g) {
      const float* x = call.A + m * call.K + g * kGroup;
      const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      int8_t* q = rows->q.data() + m * call.K + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_permutexvar_epi32(order, qlo)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(_mm512_permutexvar_epi32(order, qhi)));
      rows->sx[m * rows->groups + g] = amax / 127.0f;
      rows->sums[m * rows->groups + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
  }
}

void tiles_avx512(const MatMulNBitsCall& call, const QuantizedRows& rows, int64_t t0, int64_t t1) {
  call.bits == 8 ? tiles<8>(call, rows, t0, t1) : tiles<4>(call, rows, t0, t1);
}

}  // namespace tandem

#else   // not x86-64: the portable kernel only

namespace tandem {
bool avx512_vnni() { return false; }
void quantize_avx512(const MatMulNBitsCall&, QuantizedRows*) {}
void tiles_avx512(const MatMulNBitsCall&, const QuantizedRows&, int64_t, int64_t) {}
}  // namespace tandem

#endif
