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
  OrtApiTable api;
  float epsilon;
  bool fast;

  void compute(OrtKernelContext* context) const {
    std::vector<int64_t> xd, nd, cd, sd, pd;
    const float* x = input<float>(api, context, 0, &xd);
    NormRope p;
    p.norm = optional_input<float>(api, context, 1, &nd);
    p.cos = input<float>(api, context, 2, &cd);
    p.sin = input<float>(api, context, 3, &sd);
    p.perm = input<int64_t>(api, context, 4, &pd);
    p.epsilon = epsilon, p.fast = fast;
    expect(xd.size() == 4, kOp, "x must be [B, W, H, D]");
    const int64_t B = xd[0], W = xd[1], H = xd[2], D = xd[3];
    expect(p.norm == nullptr || numel(nd) == D, kOp, "norm_scale must be [D]");
    expect(numel(cd) == B * W * D && sd == cd && numel(pd) == D, kOp, "cos, sin must be [B, W, 1, D], rotate_perm [D]");
    for (int64_t i = 0; i < D; ++i) expect(p.perm[i] >= 0 && p.perm[i] < D, kOp, "rotate_perm names a dim outside D");
    p.apply(x, B * W * H, H, D, output(api, context, 0, xd));
  }
};

const char* op_name(const OrtCustomOp*) { return kOp; }
int op_input_type(const OrtCustomOp*, size_t index) { return index == 4 ? kTensorInt64 : kTensorFloat; }
size_t op_input_count(const OrtCustomOp*) { return 5; }
int op_output_type(const OrtCustomOp*, size_t) { return kTensorFloat; }
size_t op_output_count(const OrtCustomOp*) { return 1; }
int op_input_characteristic(const OrtCustomOp*, size_t index) {
  return index == 1 ? kInputOutputOptional : kInputOutputRequired;
}
int op_output_characteristic(const OrtCustomOp*, size_t) { return kInputOutputRequired; }

void* op_create(const OrtCustomOp*, const void* api, const OrtKernelInfo* info) {
  OrtApiTable table(api);
  float epsilon = 0.0f;
  if (OrtStatus* status = table.KernelInfoGetAttributeFloat(info, "epsilon", &epsilon)) {
    table.ReleaseStatus(status);       // a node without a norm has none
  }
  return new Kernel{table, epsilon, avx512f()};
}

}  // namespace

const OrtCustomOp kNormRope = {
    kOrtCustomOpVersion, op_create, op_name, cpu_provider,
    op_input_type, op_input_count, op_output_type, op_output_count,
    kernel_compute<Kernel>, kernel_destroy<Kernel>,
    op_input_characteristic, op_output_characteristic, default_memory,
};

}  // namespace tandem
