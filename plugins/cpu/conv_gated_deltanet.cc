// ai.tandem.cpu::ConvGatedDeltaNet: a Gated DeltaNet layer from its in_proj outputs to the delta
// rule's output, as one ONNX Runtime CPU kernel (export/cpu_prologues.py fuses the nodes).
//
// Per sequence b and row t, with the conv window [K-1 rows of conv_pool[slots[b]]; qkv[b]]:
//     mixed = silu(sum_k window[t + k] * taps[k])                    (depthwise causal conv, [C])
//     q, k  = mixed[0 : Hk dk], mixed[Hk dk : 2 Hk dk] per key head: x (r norm_scale),
//             r = 1 / sqrt(mean(x^2) + norm_epsilon)                  (the L2 norm as an RMS norm)
//     v     = mixed[2 Hk dk : C]
//     beta  = sigmoid(beta_logits);  g = neg_a * softplus(decay_logits + dt_bias)     ([Hv])
// then the delta rule of ai.tandem.cpu::GatedDeltaNet over (q, k, v, g, beta) (gated_deltanet.h).
// Why: the graph ran these as 16 nodes per layer (Concat, Gather, Mul, ReduceSum, QuickGelu, Split,
// 3 Reshape, 2 RMSNormalization, Add, Softplus, Mul, Sigmoid and the pool's Gather), each costing
// more in ONNX Runtime's per-node work than its arithmetic at decode (docs/performance.md).
// Every row runs the same code whatever the call's rows, so a verify row equals a decode step bit
// for bit; silu and the norms' sums have portable and AVX-512 forms with the same bits (row_ops.h).
//
// Inputs   qkv [B, W, C]; beta_logits, decay_logits [B, W, Hv]; conv_pool [P, K-1, C];
//          conv_taps [K, C]; neg_a, dt_bias [Hv]; state_pool [P, Hv, dk, dv]; state_slots [B] int64;
//          state_rows [B] int64 (both pools are read at state_slots, in place); conv_rows [B] int64
//          (optional: where each sequence's new conv state starts in its window, 0..W)
// Outputs  output [B, W, Hv, dv]; final_state [B, Hv, dk, dv] (optional); row_states
//          [B, W, Hv, dk, dv] (optional); conv_window [B, K-1+W, C] (optional: the window and this
//          call's rows, from which a graph picks the new conv state); new_conv_state [B, K-1, C]
//          (optional, with conv_rows: window rows conv_rows[b] .. conv_rows[b] + K-2)
// Attrs    scale, norm_epsilon, norm_scale (floats); emit_output (int, default 1; as GatedDeltaNet's)
// Key heads: Hk = (C - Hv dv) / (2 dk), from the pools' dims.

#include <cmath>
#include <cstring>
#include <vector>

#include "gated_deltanet.h"
#include "row_ops.h"

namespace tandem {
namespace {

constexpr const char* kOp = "ConvGatedDeltaNet";

// ONNX's Softplus, log(1 + e^x), written as ONNX Runtime's CPU kernel does to keep large x exact
float softplus(float x) { return x > 0.0f ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }

struct Prologue {
  const float *qkv, *beta_logits, *decay_logits, *conv_pool, *taps, *neg_a, *dt_bias;
  const int64_t* slots;
  int64_t W, C, K, hk, hv, dk, dv;
  float norm_epsilon, norm_scale;
  bool fast;
  float *q, *k, *v, *g, *beta;       // [B, W, Hk, dk] twice, [B, W, Hv, dv], [B, W, Hv] twice

  // row t of sequence b: q, k, v, g and beta at row index bt = b W + t
  void row(int64_t b, int64_t t, float* mixed, float* scales) const {
    const int64_t bt = b * W + t;
    for (int64_t c = 0; c < C; ++c) mixed[c] = 0.0f;
    for (int64_t j = 0; j < K; ++j) {                     // window row t + j: the pool's, then the call's
      const int64_t at = t + j;
      const float* x = at < K - 1 ? conv_pool + (slots[b] * (K - 1) + at) * C : qkv + (b * W + at - (K - 1)) * C;
      const float* tap = taps + j * C;
      for (int64_t c = 0; c < C; ++c) mixed[c] += x[c] * tap[c];
    }
    silu_in_place(mixed, C, fast);
    const int64_t kd = hk * dk;
    for (int part = 0; part < 2; ++part) {                // q, then k: per key head x (r norm_scale)
      const float* x = mixed + part * kd;
      float* dst = (part == 0 ? q : k) + bt * kd;
      rms_row_scales(x, hk, dk, norm_epsilon, fast, scales);
      for (int64_t h = 0; h < hk; ++h) {
        const float s = scales[h] * norm_scale;
        for (int64_t i = 0; i < dk; ++i) dst[h * dk + i] = x[h * dk + i] * s;
      }
    }
    std::memcpy(v + bt * hv * dv, mixed + 2 * kd, sizeof(float) * hv * dv);
    for (int64_t h = 0; h < hv; ++h) {
      beta[bt * hv + h] = 1.0f / (1.0f + std::exp(-beta_logits[bt * hv + h]));
      g[bt * hv + h] = neg_a[h] * softplus(decay_logits[bt * hv + h] + dt_bias[h]);
    }
  }
};

struct Kernel {
  static constexpr const char* kName = kOp;
  static constexpr int kInputs[] = {kTensorFloat, kTensorFloat, kTensorFloat, kTensorFloat, kTensorFloat,
      kTensorFloat, kTensorFloat, kTensorFloat, kTensorInt64, kTensorInt64, kTensorInt64};
  static constexpr uint32_t kOptionalInputs = from_index(10);
  static constexpr size_t kOutputs = 5;
  static constexpr uint32_t kOptionalOutputs = from_index(1);

  static Kernel* create(const OrtApiTable& api, const OrtKernelInfo* info) {
    float scale = 1.0f, norm_epsilon = 0.0f, norm_scale = 1.0f;
    check(api, api.KernelInfoGetAttributeFloat(info, "scale", &scale));
    check(api, api.KernelInfoGetAttributeFloat(info, "norm_epsilon", &norm_epsilon));
    check(api, api.KernelInfoGetAttributeFloat(info, "norm_scale", &norm_scale));
    return new Kernel{NodeApi(api, info), scale, norm_epsilon, norm_scale, optional_int(api, info, "emit_output", 1) != 0,
                      avx512f()};
  }

  NodeApi api;
  float scale, norm_epsilon, norm_scale;
  bool emit_output, fast;

  void compute(OrtKernelContext* context) const {
    Dims xd, bd, ad, cd, td, nd, dd, sd, ld, rd;
    Prologue p{};
    p.qkv = input<float>(api, context, 0, &xd);
    p.beta_logits = input<float>(api, context, 1, &bd);
    p.decay_logits = input<float>(api, context, 2, &ad);
    p.conv_pool = input<float>(api, context, 3, &cd);
    p.taps = input<float>(api, context, 4, &td);
    p.neg_a = input<float>(api, context, 5, &nd);
    p.dt_bias = input<float>(api, context, 6, &dd);
    DeltaRuleCall c;
    c.pool = input<float>(api, context, 7, &sd);
    c.slots = p.slots = input<int64_t>(api, context, 8, &ld);
    c.rows = input<int64_t>(api, context, 9, &rd);
    expect(xd.size() == 3 && bd.size() == 3 && cd.size() == 3 && td.size() == 2 && sd.size() == 4 && ld.size() == 1,
           kOp, "expected qkv [B, W, C], beta and decay logits [B, W, Hv], conv_pool [P, K-1, C], conv_taps [K, C], "
                "state_pool [P, Hv, dk, dv] and state_slots, state_rows [B]");
    const int64_t B = xd[0];
    p.W = xd[1], p.C = xd[2], p.K = td[0], p.hv = sd[1], p.dk = sd[2], p.dv = sd[3];
    expect(bd == Dims{B, p.W, p.hv} && ad == bd, kOp, "beta and decay logits must be [B, W, Hv]");
    expect(nd == Dims{p.hv} && dd == nd, kOp, "neg_a and dt_bias must be [Hv]");
    expect(td[1] == p.C && cd[1] == p.K - 1 && cd[2] == p.C && cd[0] == sd[0], kOp,
           "conv_taps [K, C] and conv_pool [P, K-1, C] disagree with qkv or the state pool");
    expect(ld[0] == B && rd == ld, kOp, "state_slots and state_rows must be [B]");
    const int64_t rest = p.C - p.hv * p.dv;
    expect(p.dk > 0 && rest > 0 && rest % (2 * p.dk) == 0, kOp, "C is not 2 Hk dk + Hv dv");
    p.hk = rest / (2 * p.dk);
    p.norm_epsilon = norm_epsilon, p.norm_scale = norm_scale, p.fast = fast;

    c.B = B, c.W = p.W, c.hk = p.hk, c.hv = p.hv, c.dk = p.dk, c.dv = p.dv;
    c.scale = scale, c.emit_output = emit_output, c.fast = fast;
    delta_rule_outputs(api, context, kOp, sd[0], &c);    // checks the slots before the pools are read

    thread_local std::vector<float> qk, values, gates;    // the calling thread's, kept across calls
    const int64_t rows = B * p.W, kd = p.hk * p.dk;
    qk.resize(static_cast<size_t>(2 * rows * kd));
    values.resize(static_cast<size_t>(rows * p.hv * p.dv));
    gates.resize(static_cast<size_t>(2 * rows * p.hv));
    p.q = qk.data(), p.k = qk.data() + rows * kd, p.v = values.data(), p.g = gates.data();
    p.beta = gates.data() + rows * p.hv;
    auto prologue = [&](int64_t first, int64_t last) {
      thread_local std::vector<float> mixed, scales;
      mixed.resize(static_cast<size_t>(p.C));
      scales.resize(static_cast<size_t>(p.hk));
      for (int64_t r = first; r < last; ++r) p.row(r / p.W, r % p.W, mixed.data(), scales.data());
    };
    parallel_for(api, context, rows, 4 * rows * p.C * (p.K + 2), prologue);   // the taps, the row in and out
    // after the conv has read the pool: the runtime may bind new_conv_state to the pool's own rows
    const size_t outputs = output_count(api, context);
    if (outputs > 3) window_output(context, p, B);
    if (outputs > 4) new_conv_state_output(context, p, B);
    c.q = p.q, c.k = p.k, c.v = p.v, c.g = p.g, c.beta = p.beta;
    delta_rule(api, context, c);
  }

  // row j of sequence b's window: the pool's K-1 rows, then the call's W rows of qkv
  static const float* window_row(const Prologue& p, int64_t b, int64_t j) {
    return j < p.K - 1 ? p.conv_pool + (p.slots[b] * (p.K - 1) + j) * p.C : p.qkv + (b * p.W + j - (p.K - 1)) * p.C;
  }

  // conv_window [B, K-1+W, C]: each sequence's K-1 pool rows, then its W rows of qkv
  void window_output(OrtKernelContext* context, const Prologue& p, int64_t B) const {
    float* window = output(api, context, 3, {B, p.K - 1 + p.W, p.C}, /*optional=*/true);
    if (window == nullptr) return;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < p.K - 1 + p.W; ++j) {
        std::memcpy(window + (b * (p.K - 1 + p.W) + j) * p.C, window_row(p, b, j), sizeof(float) * p.C);
      }
    }
  }

  // new_conv_state [B, K-1, C]: window rows conv_rows[b] .. conv_rows[b] + K-2 (the graph's
  // GatherND of the window, in the node: the state after the rows the sequence keeps). It may be
  // the pool's own rows: row j is written after every row it reads (pool rows conv_rows[b] + j >= j)
  // is read, in ascending j.
  void new_conv_state_output(OrtKernelContext* context, const Prologue& p, int64_t B) const {
    float* state = output(api, context, 4, {B, p.K - 1, p.C}, /*optional=*/true);
    if (state == nullptr) return;
    Dims nd;
    const int64_t* conv_rows = optional_input<int64_t>(api, context, 10, &nd);
    expect(conv_rows != nullptr && nd == Dims{B}, kOp, "new_conv_state needs conv_rows [B]");
    for (int64_t b = 0; b < B; ++b) {
      expect(conv_rows[b] >= 0 && conv_rows[b] <= p.W, kOp, "a conv row is outside the call's rows");
      for (int64_t j = 0; j < p.K - 1; ++j) {
        std::memmove(state + (b * (p.K - 1) + j) * p.C, window_row(p, b, conv_rows[b] + j), sizeof(float) * p.C);
      }
    }
  }
};

}  // namespace

const OrtCustomOp kConvGatedDeltaNet = custom_op<Kernel>();

}  // namespace tandem
