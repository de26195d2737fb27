// The gated delta rule's driver, shared by ai.tandem.cpu::GatedDeltaNet (gated_deltanet.cc: its
// inputs ready made) and ai.tandem.cpu::ConvGatedDeltaNet (conv_gated_deltanet.cc: the layer's
// causal conv, norms and gates before it, in the same node).
#pragma once

#include <cstdint>

#include "kernel_common.h"
#include "row_ops.h"

namespace tandem {

// One call's tensors, all contiguous: q, k [B, W, Hk, dk]; v [B, W, Hv, dv]; g (log decay), beta
// [B, W, Hv]; pool [P, Hv, dk, dv] read at slots [B]; rows [B] (rows at or past rows[b] leave the
// state as it is). Outputs: out [B, W, Hv, dv] (when emit_output), final_state [B, Hv, dk, dv] and
// row_states [B, W, Hv, dk, dv] (either may be null).
struct DeltaRuleCall {
  const float *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr, *pool = nullptr;
  const int64_t *slots = nullptr, *rows = nullptr;
  int64_t B = 0, W = 0, hk = 0, hv = 0, dk = 0, dv = 0;
  float scale = 1.0f;
  bool emit_output = true;
  bool fast = false;        // the AVX-512 rows (row_ops.h avx512f(); the same bits as the portable ones)
  float *out = nullptr, *final_state = nullptr, *row_states = nullptr;
};

// Checks the slots (pool of P rows) and heads, and makes outputs 0-2 of the node (`op` names it in
// errors) into c's out, final_state and row_states.
void delta_rule_outputs(const OrtApiTable& api, OrtKernelContext* context, const char* op, int64_t P,
                        DeltaRuleCall* c);

// S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = scale S^T q_t, per sequence,
// value head and row, on ONNX Runtime's pool (gated_deltanet.cc).
void delta_rule(const OrtApiTable& api, OrtKernelContext* context, const DeltaRuleCall& c);

}  // namespace tandem
