// ai.tandem.cpu::GatedDeltaNet: the gated delta rule as one ONNX Runtime CPU kernel.
//
// Same inputs, outputs and semantics as the portable ai.tandem::GatedDeltaNet (its function body,
// export/ops/gated_deltanet.py). Per sequence b, value head h (key head h / (Hv / Hk)), row t:
//     S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = scale S^T q_t
// Rows at or past state_rows[b] leave S as it is (the body runs them with g = 0, beta = 0) and
// still produce o_t. S is [dk, dv] row-major; each row is two passes over it, in cache:
//     pass 1: S *= exp(g_t), kS += S[i] k_i            (kS = S^T k, over the decayed S)
//     pass 2: S[i] += k_i u, o += S[i] q_i             (o = S^T q, over the updated S)
// The final state may be bound to the pool's own rows (the runtime places state outputs there when
// the slots are consecutive, pipeline/model_runner.py): every element is read before it is written
// at the same index, so reading and writing one buffer is safe.
// Why a kernel: com.microsoft::LinearAttention took 50 us per 0.5 MiB state at batch 1 and
// 34-71 us per sequence at batch 8 on this project's 2-core machine (docs/performance.md). Every
// row runs the same code whatever the number of rows, so a verify row equals a decode step bit
// for bit (row invariance, tests/test_row_invariance.py).
//
// Inputs   query, key [B, W, Hk, dk]; value [B, W, Hv, dv]; decay, beta [B, W, Hv];
//          state_pool [P, Hv, dk, dv]; state_slots [B] int64; state_rows [B] int64
//          (sequence b starts from state_pool[state_slots[b]]: the pool is read in place, no gather)
// Outputs  output [B, W, Hv, dv]; final_state [B, Hv, dk, dv] (optional); row_states
//          [B, W, Hv, dk, dv] (optional: the state after each row)
// Attrs    scale (float); emit_output (int, default 1; 0: the output is not computed and rows at or
//          past state_rows are skipped: a replay that only wants the state after them)

#include <cmath>
#include <cstring>
#include <vector>

#include "gated_deltanet.h"

namespace tandem {
namespace {

void expect_gdn(bool ok, const char* what) { expect(ok, "GatedDeltaNet", what); }

// One row of one head: S' (updated when `update`, else S) into dst, o [dv] = scale S'^T q (none where
// o is null). src and dst are [dk, dv] row-major and may be the same buffer (every row after a
// sequence's first).
// DV > 0: the head dim known at compile time, so the accumulators stay in registers.
template <int64_t DV>
void row(const float* src, float* dst, const float* __restrict q, const float* __restrict k,
         const float* __restrict v, float decay, float beta, bool update, float scale, int64_t dk, int64_t dv_arg,
         float* __restrict o) {
  const int64_t dv = DV > 0 ? DV : dv_arg;
  float acc[DV > 0 ? DV : 1024];
  if (update) {
    for (int64_t j = 0; j < dv; ++j) acc[j] = 0.0f;              // S^T k over the decayed state
    for (int64_t i = 0; i < dk; ++i) {
      const float* si = src + i * dv;
      float* di = dst + i * dv;
      const float ki = k[i];
      for (int64_t j = 0; j < dv; ++j) {
        const float x = si[j] * decay;
        di[j] = x;
        acc[j] = std::fma(x, ki, acc[j]);
      }
    }
    float u[DV > 0 ? DV : 1024];
    for (int64_t j = 0; j < dv; ++j) u[j] = beta * (v[j] - acc[j]);
    if (o == nullptr) {                                            // the state only
      for (int64_t i = 0; i < dk; ++i) {
        float* di = dst + i * dv;
        const float ki = k[i];
        for (int64_t j = 0; j < dv; ++j) di[j] = std::fma(ki, u[j], di[j]);
      }
      return;
    }
    for (int64_t j = 0; j < dv; ++j) acc[j] = 0.0f;              // S'^T q
    for (int64_t i = 0; i < dk; ++i) {
      float* di = dst + i * dv;
      const float ki = k[i], qi = q[i];
      for (int64_t j = 0; j < dv; ++j) {
        const float x = std::fma(ki, u[j], di[j]);
        di[j] = x;
        acc[j] = std::fma(x, qi, acc[j]);
      }
    }
  } else {
    if (src != dst) std::memcpy(dst, src, sizeof(float) * dk * dv);
    if (o == nullptr) return;
    for (int64_t j = 0; j < dv; ++j) acc[j] = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
      const float* di = dst + i * dv;
      const float qi = q[i];
      for (int64_t j = 0; j < dv; ++j) acc[j] = std::fma(di[j], qi, acc[j]);
    }
  }
  for (int64_t j = 0; j < dv; ++j) o[j] = acc[j] * scale;
}

#ifdef TANDEM_AVX512F
// row<DV>'s AVX-512 form for DV a multiple of 16, operation for operation (the same fmas, explicit
// in both: the compiler may not contract the rest), so both give the same bits. The DV accumulators
// and u stay in registers; the portable loop, auto-vectorized, kept them in memory and took 28 us
// a 150M layer (8 heads of 128 x 128) with the states in cache.
template <int64_t DV>
TANDEM_AVX512F void row_avx512(const float* src, float* dst, const float* __restrict q, const float* __restrict k,
                               const float* __restrict v, float decay, float beta, bool update, float scale,
                               int64_t dk, int64_t, float* __restrict o) {
  constexpr int V = DV / 16;
  __m512 acc[V];
  for (int j = 0; j < V; ++j) acc[j] = _mm512_setzero_ps();
  if (update) {
    const __m512 d = _mm512_set1_ps(decay);
    for (int64_t i = 0; i < dk; ++i) {                              // S^T k over the decayed state
      const __m512 ki = _mm512_set1_ps(k[i]);
      for (int j = 0; j < V; ++j) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(src + i * DV + 16 * j), d);
        _mm512_storeu_ps(dst + i * DV + 16 * j, x);
        acc[j] = _mm512_fmadd_ps(x, ki, acc[j]);
      }
    }
    __m512 u[V];
    for (int j = 0; j < V; ++j) {
      u[j] = _mm512_mul_ps(_mm512_set1_ps(beta), _mm512_sub_ps(_mm512_loadu_ps(v + 16 * j), acc[j]));
      acc[j] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < dk; ++i) {                              // S' = S + k u^T, and S'^T q
      const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
      for (int j = 0; j < V; ++j) {
        float* di = dst + i * DV + 16 * j;
        const __m512 x = _mm512_fmadd_ps(ki, u[j], _mm512_loadu_ps(di));
        _mm512_storeu_ps(di, x);
        if (o != nullptr) acc[j] = _mm512_fmadd_ps(x, qi, acc[j]);
      }
    }
    if (o == nullptr) return;
  } else {
    if (src != dst) std::memcpy(dst, src, sizeof(float) * dk * DV);
    if (o == nullptr) return;
    for (int64_t i = 0; i < dk; ++i) {
      const __m512 qi = _mm512_set1_ps(q[i]);
      for (int j = 0; j < V; ++j) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(dst + i * DV + 16 * j), qi, acc[j]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int j = 0; j < V; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(acc[j], s));
}
#endif

using RowFn = void (*)(const float*, float*, const float*, const float*, const float*, float, float, bool, float,
                       int64_t, int64_t, float*);

RowFn row_for(int64_t dv, bool fast) {
#ifdef TANDEM_AVX512F
  if (fast) {
    switch (dv) {
      case 64: return row_avx512<64>;
      case 128: return row_avx512<128>;
      case 256: return row_avx512<256>;
      default: break;
    }
  }
#endif
  switch (dv) {
    case 64: return row<64>;
    case 128: return row<128>;
    case 256: return row<256>;
    default: return row<0>;
  }
}

}  // namespace

void delta_rule_outputs(const OrtApiTable& api, OrtKernelContext* context, const char* op, int64_t P,
                        DeltaRuleCall* c) {
  for (int64_t b = 0; b < c->B; ++b) {
    expect(c->slots[b] >= 0 && c->slots[b] < P, op, "a state slot is outside the pool");
  }
  expect(c->hk > 0 && c->hv % c->hk == 0, op, "value heads must be a multiple of key heads");
  expect(c->dv <= 1024, op, "value head dim above 1024");
  const size_t outputs = output_count(api, context);
  c->out = output(api, context, 0, {c->B, c->W, c->hv, c->dv});
  // an omitted final state (the verify's first pass: its picks replay the rows) is kept in scratch
  c->final_state = outputs > 1 ? output(api, context, 1, {c->B, c->hv, c->dk, c->dv}, /*optional=*/true) : nullptr;
  c->row_states = outputs > 2 ? output(api, context, 2, {c->B, c->W, c->hv, c->dk, c->dv}, true) : nullptr;
  expect(c->emit_output || c->final_state != nullptr, op, "a state-only call needs its final_state output");
}

void delta_rule(const OrtApiTable& api, OrtKernelContext* context, const DeltaRuleCall& c) {
  const int64_t ratio = c.hv / c.hk, state = c.dk * c.dv;
  const RowFn run_row = row_for(c.dv, c.fast);
  // (sequence, head) pairs are independent: ONNX Runtime's thread pool shares them out
  auto heads = [&](int64_t first, int64_t last) {
    thread_local std::vector<float> scratch;   // per pool thread, kept across calls: no allocation per task
    if (c.final_state == nullptr) scratch.resize(static_cast<size_t>(state));
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / c.hv, h = task % c.hv, n = c.rows[b];
      float* s = c.final_state != nullptr ? c.final_state + (b * c.hv + h) * state : scratch.data();
      const float* src = c.pool + (c.slots[b] * c.hv + h) * state;  // the first row reads the pool's row
      const int64_t last_row = c.emit_output ? c.W : std::min<int64_t>(c.W, std::max<int64_t>(n, 0));
      if (last_row == 0 && src != s) std::memcpy(s, src, sizeof(float) * state);
      for (int64_t t = 0; t < last_row; ++t, src = s) {
        const int64_t bt = b * c.W + t;
        const float* qt = c.q + (bt * c.hk + h / ratio) * c.dk;
        const float* kt = c.k + (bt * c.hk + h / ratio) * c.dk;
        const float* vt = c.v + (bt * c.hv + h) * c.dv;
        const bool update = t < n;
        run_row(src, s, qt, kt, vt, update ? std::exp(c.g[bt * c.hv + h]) : 1.0f, c.beta[bt * c.hv + h], update,
                c.scale, c.dk, c.dv, c.emit_output ? c.out + (bt * c.hv + h) * c.dv : nullptr);
        if (c.row_states != nullptr) std::memcpy(c.row_states + (bt * c.hv + h) * state, s, sizeof(float) * state);
      }
    }
  };
  // each row reads and writes every head's state
  parallel_for(api, context, c.B * c.hv, 8 * c.B * c.hv * c.W * state, heads);
}

namespace {

struct Kernel {
  static constexpr const char* kName = "GatedDeltaNet";
  static constexpr int kInputs[] = {kTensorFloat, kTensorFloat, kTensorFloat, kTensorFloat, kTensorFloat,
      kTensorFloat, kTensorInt64, kTensorInt64};
  static constexpr uint32_t kOptionalInputs = 0;
  static constexpr size_t kOutputs = 3;
  static constexpr uint32_t kOptionalOutputs = from_index(1);

  static Kernel* create(const OrtApiTable& api, const OrtKernelInfo* info) {
    float scale = 1.0f;
    check(api, api.KernelInfoGetAttributeFloat(info, "scale", &scale));
    return new Kernel{NodeApi(api, info), scale, optional_int(api, info, "emit_output", 1) != 0, avx512f()};
  }

  NodeApi api;
  float scale;
  bool emit_output;   // 0: a replay that only wants the state (rows past state_rows are skipped)
  bool fast;          // the AVX-512 rows (the same bits)

  void compute(OrtKernelContext* context) const {
    Dims qd, kd, vd, gd, bd, sd, rd, ld;
    DeltaRuleCall c;
    c.q = input<float>(api, context, 0, &qd);
    c.k = input<float>(api, context, 1, &kd);
    c.v = input<float>(api, context, 2, &vd);
    c.g = input<float>(api, context, 3, &gd);
    c.beta = input<float>(api, context, 4, &bd);
    c.pool = input<float>(api, context, 5, &sd);
    c.slots = input<int64_t>(api, context, 6, &ld);
    c.rows = input<int64_t>(api, context, 7, &rd);
    expect_gdn(qd.size() == 4 && kd == qd && vd.size() == 4 && sd.size() == 4 && rd.size() == 1 && ld == rd,
           "expected query, key [B, W, Hk, dk], value [B, W, Hv, dv], state_pool [P, Hv, dk, dv], "
           "state_slots and state_rows [B]");
    c.B = qd[0], c.W = qd[1], c.hk = qd[2], c.dk = qd[3], c.hv = vd[2], c.dv = vd[3];
    expect_gdn(vd[0] == c.B && vd[1] == c.W && sd[1] == c.hv && sd[2] == c.dk && sd[3] == c.dv && rd[0] == c.B,
           "inputs disagree on B, W, heads or head dims");
    expect_gdn(gd == Dims{c.B, c.W, c.hv} && bd == gd, "decay and beta must be [B, W, Hv]");
    c.scale = scale;
    c.emit_output = emit_output;
    c.fast = fast;
    delta_rule_outputs(api, context, "GatedDeltaNet", sd[0], &c);
    delta_rule(api, context, c);
  }
};

}  // namespace

const OrtCustomOp kGatedDeltaNet = custom_op<Kernel>();

}  // namespace tandem
