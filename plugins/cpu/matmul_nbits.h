// What ai.tandem.cpu::MatMulNBits' two kernels share (matmul_nbits.cc: the op and the portable
// kernel; matmul_nbits_avx512.cc: the AVX-512 VNNI one): one call's operands and its rows of A
// quantized to int8 per group of 32 inputs.
#pragma once

#include <cstdint>
#include <vector>

namespace tandem {

constexpr int kGroup = 32;   // inputs per activation scale (and per weight group)

struct MatMulNBitsCall {
  const float* A;              // [M, K]
  const uint8_t* B;            // [N, blocks, block_size * bits / 8]
  const float* scales;         // [N, blocks]
  const uint8_t* zeros;        // see matmul_nbits.cc; null: 2^(bits-1)
  float* y;                    // [M, N]
  int64_t M, K, N, bits, block_size, blocks;

  // zero point of column n's block b
  float zero(int64_t n, int64_t b) const {
    if (zeros == nullptr) return static_cast<float>(1 << (bits - 1));
    if (bits == 8) return zeros[n * blocks + b];
    return static_cast<float>((zeros[n * ((blocks + 1) / 2) + b / 2] >> (4 * (b & 1))) & 15);
  }
};

// A's rows quantized per group of 32: xq in the layout the kernel reads, the scale sx per group,
// and per block C_b = sum over its groups of sx_g * sum(xq_g), zero past the last block.
// The AVX-512 kernel works in steps of 4 groups (64 bytes of 4-bit weights, 128 of 8-bit ones).
struct QuantizedRows {
  int64_t groups = 0, step_groups = 0, steps = 0, row_bytes = 0, blocks_padded = 0;
  std::vector<int8_t> q;           // [M, row_bytes]: steps * step_groups * 32 (missing last groups: zeros)
  std::vector<float> sx;           // [M, groups]
  std::vector<int32_t> sums;       // [M, groups]: sum(xq_g)
  std::vector<float> sx_lanes;     // [M, steps, 16]: sx of the group each vpdpbusd lane sums (AVX-512)
  std::vector<float> c;            // [M, blocks_padded]: blocks_padded a multiple of 16
  // [16 / step_groups, 16]: the block (within a window of 16 groups) of the group each lane of a
  // window's step sums: indices into that window's block scales (AVX-512)
  std::vector<int32_t> lane_block;
  int64_t lane_block_steps = 0, lane_block_per_block = 0;   // what lane_block was made for

  void shape(const MatMulNBitsCall& call);      // sizes the buffers (kept across calls: no allocation)
  void finish(const MatMulNBitsCall& call, bool lanes);   // c (and sx_lanes) from sx and sums
};

void quantize_portable(const MatMulNBitsCall& call, QuantizedRows* rows);   // natural order
void quantize_avx512(const MatMulNBitsCall& call, QuantizedRows* rows);     // vpdpbusd's order
void columns_avx512(const MatMulNBitsCall& call, const QuantizedRows& rows, int64_t n0, int64_t n1);
bool avx512_vnni();   // the AVX-512 VNNI kernel runs here (and TANDEM_CPU_KERNELS_PORTABLE is not 1)

}  // namespace tandem
