// ai.tandem.cpu::MatMulNBits: weight-only int4 / int8 matmul with int8 activations, the op
// com.microsoft::MatMulNBits computes at accuracy level 4, as one ONNX Runtime CPU kernel.
//
// Inputs   A [..., K] float32; B, scales, zero_points (optional): the weights in column tiles of 16
//          (matmul_nbits.h; the build writes them from com.microsoft::MatMulNBits' inputs with
//          export/nbits_tiles.py); nb = K / bs blocks of bs inputs per column; no zero points: 2^(bits-1)
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
// Weight w[n, k] = scale[n, b] (q[n, k] - zero[n, b]), b = k / bs. Each row of A is
// quantized per group of 32 inputs, as llama.cpp's Q8_0 and MLAS's int8 compute do:
//     a = max |x|;  sx = a / 127;  xq = round_half_even(x * (127 / a)) in [-127, 127]
// and with dot_g the exact integer sum of (q - zero) xq over group g, made as dot(q, xq) - zero sum(xq):
//     y[n] = sum_g scale[n, b(g)] sx_g dot_g      (float, in group order)
// Why a kernel: MLAS's MatMulNBits is compute-bound on int4 / int8 engines, most of all with the
// few rows of a verify, and cannot take the norm, residual, gate or split fused into this node.
// On column tiles (matmul_nbits.h) the AVX-512 VNNI kernel (matmul_nbits_avx512.cc) runs the 150M
// model's layer shapes 1.3x faster than MLAS at 1 row, 1.7-2.1x at 4 and 1.7-2.2x at 32
// (bench/matmul_nbits.py; docs/performance.md, "The int4 / int8 kernel on column tiles"). Every row
// runs the same instructions in the same order whatever the call's rows, so a verify row equals a
// decode step bit for bit. CPUs without AVX-512 VNNI run the portable loop (the same quantized
// activations, float sums in another order); tandem lowers to this op only where the fast path runs.

#include <cmath>
#include <vector>

#include "kernel_common.h"
#include "matmul_nbits.h"
#include "row_ops.h"

namespace tandem {
namespace {

void expect_mm(bool ok, const char* what) { expect(ok, "MatMulNBits", what); }

constexpr int64_t kTaskBytes = 65536;   // weights per task of the pool (32-128 KB measured alike)

}  // namespace

void QuantizedRows::shape(const MatMulNBitsCall& call) {
  groups = call.K / kGroup;
  q.resize(static_cast<size_t>(call.M * call.K));
  sx.resize(static_cast<size_t>(call.M * groups));
  sums.resize(sx.size());
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
        const int32_t v = std::clamp(static_cast<int32_t>(std::nearbyint(x[i] * inv)), -127, 127);   // half to even
        rows->q[m * call.K + activation_slot(g * kGroup + i, call.bits)] = static_cast<int8_t>(v);
        sum += v;
      }
      rows->sx[m * rows->groups + g] = amax / 127.0f;
      rows->sums[m * rows->groups + g] = sum;
    }
  }
}

namespace {

// The portable kernel: tiles [t0, t1) of every row, sums in group order.
void tiles_portable(const MatMulNBitsCall& c, const QuantizedRows& a, int64_t t0, int64_t t1) {
  const int64_t per_block = c.block_size / kGroup;
  for (int64_t n = t0 * kTile; n < std::min(c.N, t1 * kTile); ++n) {
    const uint8_t* tile = c.B + n / kTile * c.tile_bytes();
    const uint16_t* sw = c.scales + n / kTile * c.blocks * kTile;
    // input k of column n: in dword k * bits / 32 of the column, byte (k % per dword) * bits / 8
    const auto weight = [&](int64_t k) {
      const int64_t per_dword = 32 / c.bits, i = k % per_dword;
      const uint8_t byte = tile[((k / per_dword) * kTile + n % kTile) * 4 + i * c.bits / 8];
      return c.bits == 8 ? byte : (byte >> (4 * (i & 1))) & 15;
    };
    for (int64_t m = 0; m < c.M; ++m) {
      const int8_t* xq = a.q.data() + m * c.K;
      float acc = 0.0f;
      for (int64_t g = 0; g < a.groups; ++g) {
        int32_t dot = 0;
        for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) dot += weight(k) * xq[activation_slot(k, c.bits)];
        dot -= static_cast<int32_t>(c.zero(n, g / per_block)) * a.sums[m * a.groups + g];
        acc += static_cast<float>(dot) * (half_to_float(sw[g / per_block * kTile + n % kTile]) * a.sx[m * a.groups + g]);
      }
      c.y[m * c.N + n] = acc;
    }
  }
}

struct Kernel {
  static constexpr const char* kName = "MatMulNBits";
  static constexpr int kInputs[] = {kTensorFloat, kTensorUInt8, kTensorFloat16, kTensorUInt8, kTensorFloat,
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
    return new Kernel{NodeApi(api, info), K, N, bits, block_size, avx512_vnni(), f.rms_norm, f.swiglu, f.norm_group, f.epsilon};
  }

  NodeApi api;
  int64_t K, N, bits, block_size;
  bool fast;     // AVX-512 VNNI here
  bool rms_norm, swiglu;
  int64_t norm_group;
  float epsilon;

  void compute(OrtKernelContext* context) const {
    Dims ad, bd, sd, zd;
    const float* A = input<float>(api, context, 0, &ad);
    const uint8_t* B = input<uint8_t>(api, context, 1, &bd);
    const uint16_t* scales = input<uint16_t>(api, context, 2, &sd);
    const uint8_t* zeros = optional_input<uint8_t>(api, context, 3, &zd);
    Dims rd, wd, gd;
    const float* residual = optional_input<float>(api, context, 4, &rd);
    const float* norm_scale = optional_input<float>(api, context, 5, &wd);
    const float* gate = optional_input<float>(api, context, 6, &gd);
    const int64_t blocks = K / block_size;
    Dims yd;
    expect_mm(product_dims(ad, K, swiglu ? N / 2 : N, norm_group, &yd), "A's last dimension is not the node's K");
    const int64_t tiles = MatMulNBitsCall::tiles(N), zero_rows = MatMulNBitsCall::zero_rows(bits, blocks);
    expect_mm(bd == Dims{tiles, K * bits / 32, kTile, 4},
              "B is not [ceil(N / 16), K * bits / 32, 16, 4] (column tiles: export/nbits_tiles.py)");
    expect_mm(sd == Dims{tiles, blocks, kTile}, "scales are not float16 [ceil(N / 16), K / block_size, 16]");
    expect_mm(zeros == nullptr || zd == Dims{tiles, zero_rows, kTile},
              "zero_points are not [ceil(N / 16), blocks (8 bits) or ceil(blocks / 2) (4 bits), 16]");
    expect_mm(!rms_norm || (norm_scale != nullptr && numel(wd) == K), "rms_norm needs norm_scale [K]");
    expect_mm(!norm_group || (norm_scale != nullptr && numel(wd) == norm_group && K % norm_group == 0),
              "norm_group needs norm_scale [G], G dividing K");
    expect_mm(!norm_group || (gate != nullptr && numel(gd) == numel(ad)), "norm_group needs a gate of A's size");
    expect_mm(residual == nullptr || rd == yd, "the residual's shape is not the output's [..., N]");
    expect_mm(residual == nullptr || !swiglu, "a swiglu node takes no residual");
    const ColumnSplit split = column_split(api, context, 7, N, "MatMulNBits");
    expect_mm(split.empty() || (!swiglu && residual == nullptr), "a split node takes no residual or swiglu");
    thread_local std::vector<float> product;    // swiglu: the whole product, gated after; a split's, copied out
    if (swiglu || !split.empty()) product.resize(static_cast<size_t>(numel(ad) / K * N));
    float* y = split.empty() ? output(api, context, 0, yd) : product.data();
    const SplitOutputs outputs = split_outputs(api, context, yd, split);
    MatMulNBitsCall call{A, B, scales, zeros, swiglu ? product.data() : y, numel(ad) / K, K, N, bits, block_size,
                         blocks};
    if (call.M == 0) return;
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
    // tiles are independent: ONNX Runtime's pool shares them out, a few at a time (each task streams
    // its weights; a tile is only 3-16 KB, too little to pay for a task of its own)
    const int64_t per_task = std::max<int64_t>(1, kTaskBytes / call.tile_bytes());
    auto chunk = [&](int64_t first, int64_t last) {
      const int64_t t0 = first * per_task, t1 = std::min(tiles, last * per_task);
      if (fast) {
        tiles_avx512(call, rows, t0, t1);
      } else {
        tiles_portable(call, rows, t0, t1);
      }
      outputs.copy(y, t0 * kTile, std::min(N, t1 * kTile));   // a split's columns (y: the product), while in cache
    };
    // the tiles stream once per block of 8 rows
    const int64_t bytes = tiles * call.tile_bytes() * ((call.M + 7) / 8);
    parallel_for(api, context, (tiles + per_task - 1) / per_task, bytes, chunk);
    if (residual != nullptr) {   // the residual Add after the projection, in the node
      for (int64_t i = 0; i < call.M * N; ++i) y[i] += residual[i];
    }
    if (swiglu) swiglu_rows(product.data(), call.M, N / 2, fast, y);
  }
};

}  // namespace

const OrtCustomOp kMatMulNBits = custom_op<Kernel>();

}  // namespace tandem
