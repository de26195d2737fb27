// ai.tandem.cpu::MatMulNBits: weight-only int4 / int8 matmul with int8 activations, the op
// com.microsoft::MatMulNBits computes at accuracy level 4, as one ONNX Runtime CPU kernel.
//
// Inputs   A [..., K] float32; B [N, nb, bs * bits / 8] uint8 (nb = K / bs blocks of bs inputs per
//          output column); scales [N * nb] float32; zero_points (optional) uint8, 4 bits:
//          [N * ceil(nb / 2)] two per byte (block 2i low nibble), 8 bits: [N * nb]; absent: 2^(bits-1)
//          residual (optional) [..., N]: added to the product; norm_scale (optional) [K]: with
//          rms_norm, A's rows are RMS-normalized and scaled by it first (the RMSNormalization before
//          the projection, in the node: A' = A (r scale), r = 1 / sqrt(mean(A^2) + epsilon))
// Output   [..., N]
//          gate (optional, input 6) [like A]: with norm_group G, A (Gated DeltaNet's output,
//          [..., K / G, G] or [..., K]) becomes A (r norm_scale) silu(gate), r per group of G and
//          norm_scale [G] (row_ops.h, gated_group_norm); split (optional, input 7) [n <= 4] int64:
//          the product's columns go to outputs 0..n-1, [..., split[i]] each (the Split after it);
//          split_heads (optional, input 8) [n]: output i as [..., heads, split[i] / heads] where > 0
// Attrs    K, N, bits (4 or 8), block_size (a power of two >= 32); rms_norm (0 or 1), norm_group
//          (0: none), epsilon;
//          swiglu (0 or 1): the output is silu(gate) * up of the product's halves [gate | up],
//          [..., N / 2] (the MLP's Split, sigmoid gate and Mul in the node)
//
// 4-bit blocks hold input 2j in byte j's low nibble and 2j + 1 in its high one; 8-bit ones a byte
// per input. Weight w[n, k] = scale[n, b] (q[n, k] - zero[n, b]), b = k / bs. Each row of A is
// quantized per group of 32 inputs, as llama.cpp's Q8_0 and MLAS's int8 compute do:
//     a = max |x|;  sx = a / 127;  xq = round_half_even(x * (127 / a)) in [-127, 127]
// and with dot_g the exact integer sum of q xq over group g, and C_b = sum_{g in b} sx_g sum(xq_g):
//     y[n] = sum_g scale[n, b(g)] sx_g dot_g  -  sum_b scale[n, b] zero[n, b] C_b
// Why a kernel: on int4 engines MLAS's MatMulNBits is compute-bound (the 150M model's 49 matmuls
// read at 18.7 GB/s where float ones read at 27), most of all with the few rows of a verify. This
// one (AVX-512 VNNI, matmul_nbits_avx512.cc) made the 150M int4 target step 1.20x faster at batch 1
// and 1.10x at batch 8, its verify 1.09-1.15x (docs/performance.md). Its int8 path alone was even
// with MLAS's on the step and slower on the batch-8 verify (32 rows); with the norm, residual and
// gate fused into the node (which MLAS's node cannot take) the 150M int8 step is 1.15-1.17x and
// plain decode 1.13x, so 8-bit nodes are lowered too (export/cpu_kernel_lowering.py). Every row runs
// the same instructions in the same order whatever the call's rows, so a verify row equals a decode
// step bit for bit. CPUs without AVX-512 VNNI run the portable loop (the same quantized activations,
// float sums in another order); tandem lowers to this op only where the fast path runs.

#include <cmath>
#include <vector>

#include "kernel_common.h"
#include "matmul_nbits.h"
#include "row_ops.h"

namespace tandem {
namespace {

void expect_mm(bool ok, const char* what) { expect(ok, "MatMulNBits", what); }

}  // namespace

void QuantizedRows::shape(const MatMulNBitsCall& call) {
  groups = call.K / kGroup;
  step_groups = 4;
  steps = (groups + step_groups - 1) / step_groups;
  row_bytes = steps * step_groups * kGroup;
  blocks_padded = (call.blocks + 15) / 16 * 16;
  q.assign(static_cast<size_t>(call.M * row_bytes), 0);
  sx.resize(static_cast<size_t>(call.M * groups));
  sums.resize(sx.size());
  sx_lanes.resize(static_cast<size_t>(call.M * steps * 16));
  c.assign(static_cast<size_t>(call.M * blocks_padded), 0.0f);
  const int64_t window_steps = 16 / step_groups, per_block = call.block_size / kGroup;
  if (lane_block_steps == step_groups && lane_block_per_block == per_block) return;   // as the last call's
  lane_block_steps = step_groups;
  lane_block_per_block = per_block;
  lane_block.resize(static_cast<size_t>(window_steps * 16));
  for (int64_t j = 0; j < window_steps; ++j) {
    for (int i = 0; i < 16; ++i) {
      lane_block[j * 16 + i] = static_cast<int32_t>((j * step_groups + i / (16 / step_groups)) / per_block);
    }
  }
}

// C_b and the lane scales: the same scalar code behind both kernels
void QuantizedRows::finish(const MatMulNBitsCall& call, bool lanes) {
  const int64_t per_block = call.block_size / kGroup;
  for (int64_t m = 0; m < call.M; ++m) {
    const float* s = sx.data() + m * groups;
    for (int64_t g = 0; g < groups; ++g) {
      c[m * blocks_padded + g / per_block] += s[g] * static_cast<float>(sums[m * groups + g]);
    }
    if (!lanes) continue;
    for (int64_t j = 0; j < steps; ++j) {
      float* l = sx_lanes.data() + (m * steps + j) * 16;
      for (int i = 0; i < 16; ++i) {   // lane i sums group j * step_groups + i / (16 / step_groups)
        const int64_t g = j * step_groups + i / (16 / step_groups);
        l[i] = g < groups ? s[g] : 0.0f;
      }
    }
  }
}

void quantize_portable(const MatMulNBitsCall& call, QuantizedRows* rows) {
  rows->shape(call);
  for (int64_t m = 0; m < call.M; ++m) {
    for (int64_t g = 0; g < rows->groups; ++g) {
      const float* x = call.A + m * call.K + g * kGroup;
      float amax = 0.0f;
      for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int i = 0; i < kGroup; ++i) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * inv));   // half to even, as vcvtps2dq
        rows->q[m * rows->row_bytes + g * kGroup + i] = static_cast<int8_t>(std::clamp(v, -127, 127));
        sum += std::clamp(v, -127, 127);
      }
      rows->sx[m * rows->groups + g] = amax / 127.0f;
      rows->sums[m * rows->groups + g] = sum;
    }
  }
  rows->finish(call, false);
}

namespace {

// The portable kernel: columns [n0, n1) of every row, sums in group order.
void columns_portable(const MatMulNBitsCall& c, const QuantizedRows& a, int64_t n0, int64_t n1) {
  const int64_t G = c.K / kGroup, per_block = c.block_size / kGroup, blob = c.block_size * c.bits / 8;
  for (int64_t n = n0; n < n1; ++n) {
    const float* sw = c.scales + n * c.blocks;
    for (int64_t m = 0; m < c.M; ++m) {
      const int8_t* xq = a.q.data() + m * a.row_bytes;
      float acc = 0.0f, corr = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t b = g / per_block;
        const uint8_t* w = c.B + (n * c.blocks + b) * blob + (g % per_block) * kGroup * c.bits / 8;
        int32_t dot = 0;
        for (int i = 0; i < kGroup; ++i) {
          const int q = c.bits == 8 ? w[i] : (i % 2 == 0 ? w[i / 2] & 15 : w[i / 2] >> 4);
          dot += q * xq[g * kGroup + i];      // natural order: quantize_portable writes it so
        }
        acc += static_cast<float>(dot) * (sw[b] * a.sx[m * a.groups + g]);
      }
      for (int64_t b = 0; b < c.blocks; ++b) corr += sw[b] * c.zero(n, b) * a.c[m * a.blocks_padded + b];
      c.y[m * c.N + n] = acc - corr;
    }
  }
}

struct Kernel {
  static constexpr const char* kName = "MatMulNBits";
  static constexpr int kInputs[] = {kTensorFloat, kTensorUInt8, kTensorFloat, kTensorUInt8, kTensorFloat,
      kTensorFloat, kTensorFloat, kTensorInt64, kTensorInt64};
  static constexpr uint32_t kOptionalInputs = from_index(3);
  static constexpr size_t kOutputs = kMaxSplits;
  static constexpr uint32_t kOptionalOutputs = from_index(1);

  static Kernel* create(const OrtApiTable& api, const OrtKernelInfo* info) {
    int64_t K = 0, N = 0, bits = 0, block_size = 0;
    check(api, api.KernelInfoGetAttributeInt64(info, "K", &K));
    check(api, api.KernelInfoGetAttributeInt64(info, "N", &N));
    check(api, api.KernelInfoGetAttributeInt64(info, "bits", &bits));
    check(api, api.KernelInfoGetAttributeInt64(info, "block_size", &block_size));
    expect_mm(bits == 4 || bits == 8, "bits must be 4 or 8");
    expect_mm(block_size >= kGroup && (block_size & (block_size - 1)) == 0, "block_size must be a power of two >= 32");
    expect_mm(K > 0 && N > 0 && K % block_size == 0, "K must be a positive multiple of block_size");
    const MatMulFusions f = matmul_fusions(api, info, "MatMulNBits");
    expect_mm(!f.swiglu || N % 2 == 0, "a swiglu node needs an even N (gate and up halves)");
    return new Kernel{api, K, N, bits, block_size, avx512_vnni(), f.rms_norm, f.swiglu, f.norm_group, f.epsilon};
  }

  OrtApiTable api;
  int64_t K, N, bits, block_size;
  bool fast;     // AVX-512 VNNI here
  bool rms_norm, swiglu;
  int64_t norm_group;
  float epsilon;

  void compute(OrtKernelContext* context) const {
    std::vector<int64_t> ad, bd, sd, zd;
    const float* A = input<float>(api, context, 0, &ad);
    const uint8_t* B = input<uint8_t>(api, context, 1, &bd);
    const float* scales = input<float>(api, context, 2, &sd);
    const uint8_t* zeros = optional_input<uint8_t>(api, context, 3, &zd);
    std::vector<int64_t> rd, wd, gd;
    const float* residual = optional_input<float>(api, context, 4, &rd);
    const float* norm_scale = optional_input<float>(api, context, 5, &wd);
    const float* gate = optional_input<float>(api, context, 6, &gd);
    const int64_t blocks = K / block_size, blob = block_size * bits / 8;
    std::vector<int64_t> yd;
    expect_mm(product_dims(ad, K, swiglu ? N / 2 : N, norm_group, &yd), "A's last dimension is not the node's K");
    expect_mm(bd == std::vector<int64_t>({N, blocks, blob}), "B is not [N, K / block_size, block_size * bits / 8]");
    expect_mm(numel(sd) == N * blocks, "scales do not hold N * K / block_size values");
    const int64_t zero_bytes = bits == 4 ? N * ((blocks + 1) / 2) : N * blocks;
    expect_mm(zeros == nullptr || numel(zd) == zero_bytes, "zero_points do not hold one per block");
    expect_mm(!rms_norm || (norm_scale != nullptr && numel(wd) == K), "rms_norm needs norm_scale [K]");
    expect_mm(!norm_group || (norm_scale != nullptr && numel(wd) == norm_group && K % norm_group == 0),
              "norm_group needs norm_scale [G], G dividing K");
    expect_mm(!norm_group || (gate != nullptr && numel(gd) == numel(ad)), "norm_group needs a gate of A's size");
    expect_mm(residual == nullptr || rd == yd, "the residual's shape is not the output's [..., N]");
    expect_mm(residual == nullptr || !swiglu, "a swiglu node takes no residual");
    const ColumnSplit split = column_split(api, context, 7, N, "MatMulNBits");
    expect_mm(split.empty() || (!swiglu && residual == nullptr), "a split node takes no residual or swiglu");
    thread_local std::vector<float> product;    // swiglu: the whole product, gated after; a split's, split after
    if (swiglu || !split.empty()) product.resize(static_cast<size_t>(numel(ad) / K * N));
    float* y = split.empty() ? output(api, context, 0, yd) : product.data();
    MatMulNBitsCall call{A, B, scales, zeros, swiglu ? product.data() : y, numel(ad) / K, K, N, bits, block_size,
                         blocks};
    if (call.M == 0) {
      if (!split.empty()) split_columns(api, context, y, yd, split);
      return;
    }
    thread_local std::vector<float> normed, r;    // the calling thread's, kept across calls
    if (norm_group) {
      normed.resize(static_cast<size_t>(call.M * K));
      gated_group_norm(A, gate, norm_scale, call.M * K, norm_group, epsilon, fast, normed.data());
      call.A = normed.data();
    }
    if (rms_norm) {   // A' = A (r scale), one rounding per element: the same in both kernels
      normed.resize(static_cast<size_t>(call.M * K));
      r.resize(static_cast<size_t>(call.M));
      rms_row_scales(A, call.M, K, epsilon, fast, r.data());
      for (int64_t m = 0; m < call.M; ++m) {
        for (int64_t k = 0; k < K; ++k) normed[m * K + k] = A[m * K + k] * (r[m] * norm_scale[k]);
      }
      call.A = normed.data();
    }
    thread_local QuantizedRows scratch;        // the calling thread's, kept across calls
    QuantizedRows& rows = scratch;             // (the pool threads see this one, not their own)
    if (fast) {
      quantize_avx512(call, &rows);
    } else {
      quantize_portable(call, &rows);
    }
    // column chunks are independent: ONNX Runtime's pool shares them out (each streams its weights)
    constexpr int64_t kColumns = 16;
    auto chunk = [&](int64_t first, int64_t last) {
      const int64_t n0 = first * kColumns, n1 = std::min(N, last * kColumns);
      if (fast) {
        columns_avx512(call, rows, n0, n1);
      } else {
        columns_portable(call, rows, n0, n1);
      }
    };
    parallel_for(api, context, (N + kColumns - 1) / kColumns, chunk);
    if (residual != nullptr) {   // the residual Add after the projection, in the node
      for (int64_t i = 0; i < call.M * N; ++i) y[i] += residual[i];
    }
    if (swiglu) swiglu_rows(product.data(), call.M, N / 2, fast, y);
    if (!split.empty()) split_columns(api, context, y, yd, split);
  }
};

}  // namespace

const OrtCustomOp kMatMulNBits = custom_op<Kernel>();

}  // namespace tandem
