// ai.tandem.cpu::RotaryTables: the (cos, signed sin) tables of NeoX RoPE as one ONNX Runtime CPU
// kernel (export/cpu_kernel_lowering.py makes it from the exporter's 14 nodes, rotary_tables in
// export/layers.py).
//
// Inputs   positions [B, W] int64 (optional); inv_freq [rd / 2] float32; context_lens [B] int64 and
//          rows [B, W, ...] (any type: its shape only) where positions is omitted: position
//          context_lens[b] + w (the exporter's positions, made in the node)
// Outputs  cos, sin [B, W, 1, D]: over dims j < rd, a = float(position) inv_freq[j mod rd/2] (one
//          float32 product, as the graph's Cast and Mul), cos(a) and sin(a) negated on the first
//          half (rotate_half's sign); over rd <= j < D cos 1 and sin 0 (the dims RoPE passes through)
// Attrs    head_dim D
//
// Why: once per graph, but 14 nodes at every step. Every graph that uses the tables makes them with
// this node (the lowering rewrites each such subgraph), so the queries and keys they rotate have
// the same bits in every graph.

#include <cmath>
#include <vector>

#include "kernel_common.h"

namespace tandem {
namespace {

constexpr const char* kOp = "RotaryTables";

struct Kernel {
  static constexpr const char* kName = kOp;
  // rows (input 3): any element type (0), only its shape is read
  static constexpr int kInputs[] = {kTensorInt64, kTensorFloat, kTensorInt64, 0};
  static constexpr uint32_t kOptionalInputs = ~(1u << 1);   // all but inv_freq
  static constexpr size_t kOutputs = 2;
  static constexpr uint32_t kOptionalOutputs = 0;

  static Kernel* create(const OrtApiTable& api, const OrtKernelInfo* info) {
    int64_t D = 0;
    check(api, api.KernelInfoGetAttributeInt64(info, "head_dim", &D));
    expect(D > 0, kOp, "head_dim must be positive");
    return new Kernel{NodeApi(api, info), D};
  }

  NodeApi api;
  int64_t D;

  void compute(OrtKernelContext* context) const {
    Dims pd, fd, cd, rd_;
    const int64_t* positions = optional_input<int64_t>(api, context, 0, &pd);
    const float* inv_freq = input<float>(api, context, 1, &fd);
    const int64_t* context_lens = nullptr;
    if (positions == nullptr) {       // context_lens[b] + w for the W rows of input 3
      context_lens = optional_input<int64_t>(api, context, 2, &cd);
      const OrtValue* rows = nullptr;
      check(api, api.KernelContextGetInput(context, 3, &rows));
      expect(context_lens != nullptr && rows != nullptr, kOp, "without positions, context_lens and rows are needed");
      pd = dims_of(api, rows);
      expect(pd.size() >= 2 && cd == Dims{pd[0]}, kOp,
             "expected context_lens [B] and rows [B, W, ...]");
      pd = pd.first(2);
    }
    expect(pd.size() == 2 && fd.size() == 1, kOp, "expected positions [B, W] and inv_freq [rd / 2]");
    const int64_t half = fd[0], rd = 2 * half;
    expect(rd <= D, kOp, "the rotary dims are more than head_dim");
    const Dims dims = {pd[0], pd[1], 1, D};
    float* cos_out = output(api, context, 0, dims);
    float* sin_out = output(api, context, 1, dims);
    for (int64_t r = 0; r < pd[0] * pd[1]; ++r) {
      const float at = static_cast<float>(positions != nullptr ? positions[r] : context_lens[r / pd[1]] + r % pd[1]);
      float* c = cos_out + r * D;
      float* s = sin_out + r * D;
      for (int64_t j = 0; j < rd; ++j) {
        const float a = at * inv_freq[j % half];
        c[j] = std::cos(a);
        s[j] = j < half ? -std::sin(a) : std::sin(a);
      }
      for (int64_t j = rd; j < D; ++j) c[j] = 1.0f, s[j] = 0.0f;
    }
  }
};

}  // namespace

const OrtCustomOp kRotaryTables = custom_op<Kernel>();

}  // namespace tandem
