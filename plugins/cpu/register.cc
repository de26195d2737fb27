// The entry point ONNX Runtime calls when a session loads the library
// (SessionOptions.register_custom_ops_library): the domain ai.tandem.cpu with every op of it.

#include "kernel_common.h"

extern "C" __attribute__((visibility("default")))
OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const void* table = base->GetApi(kOrtApiVersion);
  if (table == nullptr) {   // an ONNX Runtime older than 1.24: say so through the oldest table
    const tandem::OrtApiTable oldest(base->GetApi(1));
    return oldest.CreateStatus(kOrtFail, "tandem's CPU kernels need ONNX Runtime >= 1.24");
  }
  tandem::OrtApiTable api(table);
  // made once and kept for the process (sessions point at it; they open in several threads at
  // once: a function-local static is initialised once, thread-safely)
  static OrtStatus* failed = nullptr;
  static OrtCustomOpDomain* domain = [&]() -> OrtCustomOpDomain* {
    OrtCustomOpDomain* made = nullptr;
    failed = api.CreateCustomOpDomain("ai.tandem.cpu", &made);
    for (const OrtCustomOp* op : {&tandem::kGatedDeltaNet, &tandem::kConvGatedDeltaNet, &tandem::kPagedAttention,
                                  &tandem::kNormRope, &tandem::kRotaryTables, &tandem::kMatMulNBits,
                                  &tandem::kMatMul}) {
      if (failed == nullptr) failed = api.CustomOpDomainAdd(made, op);
    }
    return made;
  }();
  if (failed != nullptr) return api.CreateStatus(kOrtFail, api.GetErrorMessage(failed));
  return api.AddCustomOpDomain(options, domain);
}
