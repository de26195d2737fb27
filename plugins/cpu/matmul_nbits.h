// What ai.tandem.cpu::MatMulNBits' two kernels share (matmul_nbits.cc: the op and the portable
// kernel; matmul_nbits_avx512.cc: the AVX-512 VNNI one): one call's operands, the column-tile
// layout of its weights, and its rows of A quantized to int8 per group of 32 inputs.
//
// Column tiles (written by the build: export/nbits_tiles.py). Columns go in tiles of 16; a tile
// holds, for every 4 bytes of a column's packed inputs, those 4 bytes of its 16 columns side by
// side, so one 64-byte load is the next inputs of 16 columns (one vpdpbusd lane each):
//     B       [T, K * bits / 32, 16, 4] uint8   T = ceil(N / 16); 8 bits: 4 inputs a dword;
//                                               4 bits: 8, byte i = inputs 2i (low nibble), 2i + 1
//     scales  [T, blocks, 16] float16 (half the bytes of float32: the quantizer's scales are
//             float16 values, export/quantize.py half_scales)
//     zeros   [T, blocks, 16] uint8 (8 bits); [T, ceil(blocks / 2), 16] (4 bits: block 2p in the
//             low nibble, 2p + 1 in the high one); absent: 2^(bits-1)
// Columns past N (the last tile's padding) hold zeros and are never written out.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace tandem {

constexpr int kGroup = 32;   // inputs per activation scale (and per weight group)
constexpr int kTile = 16;    // columns per tile

struct MatMulNBitsCall {
  const float* A;              // [M, K]
  const uint8_t* B;            // [T, K * bits / 32, 16, 4]
  const uint16_t* scales;      // [T, blocks, 16] float16 bits
  const uint8_t* zeros;        // see above; null: 2^(bits-1)
  float* y;                    // [M, N]
  int64_t M, K, N, bits, block_size, blocks;

  // tiles of N columns; rows of 16 zero-point bytes per tile (4 bits: two blocks a byte)
  static int64_t tiles(int64_t N) { return (N + kTile - 1) / kTile; }
  static int64_t zero_rows(int64_t bits, int64_t blocks) { return bits == 8 ? blocks : (blocks + 1) / 2; }
  int64_t tile_bytes() const { return K * bits / 8 * kTile; }
  int64_t zero_rows() const { return zero_rows(bits, blocks); }

  // zero point of column n's block b
  float zero(int64_t n, int64_t b) const {
    if (zeros == nullptr) return static_cast<float>(1 << (bits - 1));
    const uint8_t* tile = zeros + n / kTile * zero_rows() * kTile;
    if (bits == 8) return tile[b * kTile + n % kTile];
    return static_cast<float>((tile[b / 2 * kTile + n % kTile] >> (4 * (b & 1))) & 15);
  }
};

// A float16's value (every one: zeros, subnormals, infinities, NaN), for the portable kernel; the
// AVX-512 one converts 16 at a time (vcvtph2ps), to the same floats.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);                  // zero, subnormal
  } else if (exponent == 31) {
    magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof(bits));
  bits |= sign;
  std::memcpy(&magnitude, &bits, sizeof(bits));
  return magnitude;
}

// A's rows quantized per group of 32: xq (4 bits: each 8 inputs as their 4 even then their 4 odd
// ones, the order of a dword's low then high nibbles; 8 bits: in order), the scale sx per group,
// and per group sum(xq_g) (for the zero points: dot(q - z, xq) = dot(q, xq) - z sum(xq)).
struct QuantizedRows {
  int64_t groups = 0;
  std::vector<int8_t> q;           // [M, K]
  std::vector<float> sx;           // [M, groups]
  std::vector<int32_t> sums;       // [M, groups]: sum(xq_g)

  void shape(const MatMulNBitsCall& call);      // sizes the buffers (kept across calls: no allocation)
};

// the position in a quantized row of input k (4 bits: evens, then odds, per 8 inputs)
inline int64_t activation_slot(int64_t k, int64_t bits) {
  if (bits == 8) return k;
  const int64_t i = k % 8;
  return k - i + (i % 2) * 4 + i / 2;
}

void quantize_portable(const MatMulNBitsCall& call, QuantizedRows* rows);
void quantize_avx512(const MatMulNBitsCall& call, QuantizedRows* rows);     // the same bytes, faster
void tiles_avx512(const MatMulNBitsCall& call, const QuantizedRows& rows, int64_t t0, int64_t t1);
bool avx512_vnni();   // the AVX-512 VNNI kernel runs here (and TANDEM_CPU_KERNELS_PORTABLE is not 1)

}  // namespace tandem
