// ai.tandem.cpu::NormRope: the keys' RMS norm per head and RoPE of an attention layer as one ONNX
// Runtime CPU kernel (export/cpu_kernel_lowering.py makes it from the exporter's nodes).
//
// Inputs   x [B, W, H, D]; norm_scale [D] (optional: "" for none); cos, sin [B, W, 1, D];
//          rotate_perm [D] int64
// Output   [B, W, H, D] = RoPE(RMSNorm(x) norm_scale): y = x' cos + x'[perm] sin (row_ops.h, NormRope)
// Attrs    epsilon (float, with norm_scale)
//
// Why: the graph ran them as five nodes (RMSNormalization, Gather, Mul, Mul, Add) per layer and
// graph. Every graph that makes a layer's keys runs this node (the lowering rewrites each such
// chain it finds: decode, verify, MTP heads and a unified round's re-anchored heads alike), so the
// keys a graph commits have the same bits wherever they are made. The attention kernel's own query
// prologue runs the same code (paged_attention.cc).

#include <vector>

#include "kernel_common.h"
#include "row_ops.h"

namespace tandem {
namespace {

constexpr const char* kOp = "NormRope";

struct Kernel {
  static constexpr const char* kName = kOp;
  static constexpr int kInputs[] = {kTensorFloat, kTensorFloat, kTensorFloat, kTensorFloat, kTensorInt64};
  static constexpr uint32_t kOptionalInputs = 1u << 1;      // norm_scale
  static constexpr size_t kOutputs = 1;
  static constexpr uint32_t kOptionalOutputs = 0;

  static Kernel* create(const OrtApiTable& api, const OrtKernelInfo* info) {
    float epsilon = 0.0f;
    if (OrtStatus* status = api.KernelInfoGetAttributeFloat(info, "epsilon", &epsilon)) {
      api.ReleaseStatus(status);       // a node without a norm has none
    }
    return new Kernel{NodeApi(api, info), epsilon, avx512f()};
  }

  NodeApi api;
  float epsilon;
  bool fast;

  void compute(OrtKernelContext* context) const {
    Dims xd;
    const float* x = input<float>(api, context, 0, &xd);
    expect(xd.size() == 4, kOp, "x must be [B, W, H, D]");
    const int64_t B = xd[0], W = xd[1], H = xd[2], D = xd[3];
    NormRope p = norm_rope_inputs(api, context, 1, B, W, D, kOp);
    p.epsilon = epsilon, p.fast = fast;
    p.apply(x, B * W * H, H, D, output(api, context, 0, xd));
  }
};

}  // namespace

NormRope norm_rope_inputs(const NodeApi& api, OrtKernelContext* context, size_t first, int64_t B, int64_t W,
                          int64_t D, const char* op) {
  Dims nd, cd, sd, pd;
  NormRope p;
  p.norm = optional_input<float>(api, context, first, &nd);
  p.cos = optional_input<float>(api, context, first + 1, &cd);
  p.sin = optional_input<float>(api, context, first + 2, &sd);
  p.perm = optional_input<int64_t>(api, context, first + 3, &pd);
  expect(p.norm == nullptr || numel(nd) == D, op, "the norm scale must be [D]");
  expect((p.cos == nullptr) == (p.sin == nullptr) && (p.cos == nullptr) == (p.perm == nullptr), op,
         "RoPE needs cos, sin and rotate_perm together");
  if (p.cos != nullptr) {
    expect(numel(cd) == B * W * D && sd == cd && numel(pd) == D, op, "cos, sin must be [B, W, 1, D], rotate_perm [D]");
    for (int64_t i = 0; i < D; ++i) expect(p.perm[i] >= 0 && p.perm[i] < D, op, "rotate_perm names a dim outside D");
  }
  return p;
}

const OrtCustomOp kNormRope = custom_op<Kernel>();

}  // namespace tandem
