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

#include "kernel_common.h"

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
        acc[j] += x * ki;
      }
    }
    float u[DV > 0 ? DV : 1024];
    for (int64_t j = 0; j < dv; ++j) u[j] = beta * (v[j] - acc[j]);
    if (o == nullptr) {                                            // the state only
      for (int64_t i = 0; i < dk; ++i) {
        float* di = dst + i * dv;
        const float ki = k[i];
        for (int64_t j = 0; j < dv; ++j) di[j] += ki * u[j];
      }
      return;
    }
    for (int64_t j = 0; j < dv; ++j) acc[j] = 0.0f;              // S'^T q
    for (int64_t i = 0; i < dk; ++i) {
      float* di = dst + i * dv;
      const float ki = k[i], qi = q[i];
      for (int64_t j = 0; j < dv; ++j) {
        const float x = di[j] + ki * u[j];
        di[j] = x;
        acc[j] += x * qi;
      }
    }
  } else {
    if (src != dst) std::memcpy(dst, src, sizeof(float) * dk * dv);
    if (o == nullptr) return;
    for (int64_t j = 0; j < dv; ++j) acc[j] = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
      const float* di = dst + i * dv;
      const float qi = q[i];
      for (int64_t j = 0; j < dv; ++j) acc[j] += di[j] * qi;
    }
  }
  for (int64_t j = 0; j < dv; ++j) o[j] = acc[j] * scale;
}

using RowFn = void (*)(const float*, float*, const float*, const float*, const float*, float, float, bool, float,
                       int64_t, int64_t, float*);

RowFn row_for(int64_t dv) {
  switch (dv) {
    case 64: return row<64>;
    case 128: return row<128>;
    case 256: return row<256>;
    default: return row<0>;
  }
}

struct Kernel {
  OrtApiTable api;
  float scale;
  bool emit_output;   // 0: a replay that only wants the state (rows past state_rows are skipped)

  void compute(OrtKernelContext* context) const {
    std::vector<int64_t> qd, kd, vd, gd, bd, sd, rd;
    const float* q = input<float>(api, context, 0, &qd);
    const float* k = input<float>(api, context, 1, &kd);
    const float* v = input<float>(api, context, 2, &vd);
    const float* g = input<float>(api, context, 3, &gd);
    const float* beta = input<float>(api, context, 4, &bd);
    std::vector<int64_t> ld;
    const float* pool = input<float>(api, context, 5, &sd);
    const int64_t* slots = input<int64_t>(api, context, 6, &ld);
    const int64_t* rows = input<int64_t>(api, context, 7, &rd);
    expect_gdn(qd.size() == 4 && kd == qd && vd.size() == 4 && sd.size() == 4 && rd.size() == 1 && ld == rd,
           "expected query, key [B, W, Hk, dk], value [B, W, Hv, dv], state_pool [P, Hv, dk, dv], "
           "state_slots and state_rows [B]");
    const int64_t B = qd[0], W = qd[1], hk = qd[2], dk = qd[3], hv = vd[2], dv = vd[3];
    expect_gdn(vd[0] == B && vd[1] == W && sd[1] == hv && sd[2] == dk && sd[3] == dv && rd[0] == B,
           "inputs disagree on B, W, heads or head dims");
    for (int64_t b = 0; b < B; ++b) expect_gdn(slots[b] >= 0 && slots[b] < sd[0], "a state slot is outside the pool");
    expect_gdn(hk > 0 && hv % hk == 0, "value heads must be a multiple of key heads");
    expect_gdn(gd == std::vector<int64_t>({B, W, hv}) && bd == gd, "decay and beta must be [B, W, Hv]");
    const size_t outputs = output_count(api, context);
    float* out = output(api, context, 0, {B, W, hv, dv});
    // an omitted final state (the verify's first pass: its picks replay the rows) is kept in scratch
    float* final_state = outputs > 1 ? output(api, context, 1, {B, hv, dk, dv}, /*optional=*/true) : nullptr;
    float* row_states = outputs > 2 ? output(api, context, 2, {B, W, hv, dk, dv}, true) : nullptr;
    expect_gdn(emit_output || final_state != nullptr, "a state-only call needs its final_state output");
    expect_gdn(dv <= 1024, "value head dim above 1024");
    const int64_t ratio = hv / hk, state = dk * dv;
    const RowFn run_row = row_for(dv);
    // (sequence, head) pairs are independent: ONNX Runtime's thread pool shares them out
    auto heads = [&](int64_t first, int64_t last) {
      thread_local std::vector<float> scratch;   // per pool thread, kept across calls: no allocation per task
      if (final_state == nullptr) scratch.resize(static_cast<size_t>(state));
      for (int64_t task = first; task < last; ++task) {
        const int64_t b = task / hv, h = task % hv, n = rows[b];
        float* s = final_state != nullptr ? final_state + (b * hv + h) * state : scratch.data();
        const float* src = pool + (slots[b] * hv + h) * state;  // the first row reads the pool's row
        const int64_t last_row = emit_output ? W : std::min<int64_t>(W, std::max<int64_t>(n, 0));
        if (last_row == 0 && src != s) std::memcpy(s, src, sizeof(float) * state);
        for (int64_t t = 0; t < last_row; ++t, src = s) {
          const int64_t bt = b * W + t;
          const float* qt = q + (bt * hk + h / ratio) * dk;
          const float* kt = k + (bt * hk + h / ratio) * dk;
          const float* vt = v + (bt * hv + h) * dv;
          const bool update = t < n;
          run_row(src, s, qt, kt, vt, update ? std::exp(g[bt * hv + h]) : 1.0f, beta[bt * hv + h], update, scale,
                  dk, dv, emit_output ? out + (bt * hv + h) * dv : nullptr);
          if (row_states != nullptr) std::memcpy(row_states + (bt * hv + h) * state, s, sizeof(float) * state);
        }
      }
    };
    parallel_for(api, context, B * hv, heads);
  }
};

const char* op_name(const OrtCustomOp*) { return "GatedDeltaNet"; }
int op_input_type(const OrtCustomOp*, size_t index) { return index >= 6 ? kTensorInt64 : kTensorFloat; }
size_t op_input_count(const OrtCustomOp*) { return 8; }
int op_output_type(const OrtCustomOp*, size_t) { return kTensorFloat; }
size_t op_output_count(const OrtCustomOp*) { return 3; }
int op_input_characteristic(const OrtCustomOp*, size_t) { return kInputOutputRequired; }
int op_output_characteristic(const OrtCustomOp*, size_t index) {
  return index == 0 ? kInputOutputRequired : kInputOutputOptional;
}

void* op_create(const OrtCustomOp*, const void* api, const OrtKernelInfo* info) {
  OrtApiTable table(api);
  float scale = 1.0f;
  check(table, table.KernelInfoGetAttributeFloat(info, "scale", &scale));
  return new Kernel{table, scale, optional_int(table, info, "emit_output", 1) != 0};
}

}  // namespace

const OrtCustomOp kGatedDeltaNet = {
    kOrtCustomOpVersion, op_create, op_name, cpu_provider,
    op_input_type, op_input_count, op_output_type, op_output_count,
    kernel_compute<Kernel>, kernel_destroy<Kernel>,
    op_input_characteristic, op_output_characteristic, default_memory,
};

}  // namespace tandem
