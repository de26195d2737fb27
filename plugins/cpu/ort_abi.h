// The part of ONNX Runtime's C ABI that a custom-op library uses.
//
// ONNX Runtime's Python wheel ships libonnxruntime but not its C headers, so this file declares
// what tandem's CPU kernels call, written from the published API (onnxruntime_c_api.h). The ABI is
// stable: the function table only ever grows at its end, so a library that asks for API version 24
// (ONNX Runtime 1.24, for GetTensorElementTypeAndShapeDataReference; tandem needs >= 1.31) runs on
// every later runtime. Function-table entries are named by their slot (their order in the header); the custom
// op description keeps its version-13 layout, which later runtimes still read.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

struct OrtStatus;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtSessionOptions;
struct OrtCustomOpDomain;

constexpr uint32_t kOrtApiVersion = 24;        // the function table asked for
constexpr uint32_t kOrtCustomOpVersion = 13;    // the OrtCustomOp layout below

struct OrtApiBase {
  const void* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// ONNXTensorElementDataType values used here
constexpr int kTensorFloat = 1;
constexpr int kTensorUInt8 = 2;
constexpr int kTensorInt64 = 7;
constexpr int kTensorFloat16 = 10;
constexpr int kOrtFail = 1;
constexpr int kInputOutputRequired = 0;
constexpr int kInputOutputOptional = 1;

// The custom-op description ONNX Runtime reads, in its version-13 layout (enums are ints).
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const void* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);
  int (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  int (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);
};

}  // extern "C"

namespace tandem {

// The OrtApi function table, called by slot number (its order in onnxruntime_c_api.h).
class OrtApiTable {
 public:
  explicit OrtApiTable(const void* table) : slots_(static_cast<const void* const*>(table)) {}

  OrtStatus* CreateStatus(int code, const char* msg) const {
    return at<OrtStatus* (*)(int, const char*)>(0)(code, msg);
  }
  OrtStatus* CreateCustomOpDomain(const char* name, OrtCustomOpDomain** out) const {
    return at<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(26)(name, out);
  }
  OrtStatus* CustomOpDomainAdd(OrtCustomOpDomain* domain, const OrtCustomOp* op) const {
    return at<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(27)(domain, op);
  }
  OrtStatus* AddCustomOpDomain(OrtSessionOptions* options, OrtCustomOpDomain* domain) const {
    return at<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(28)(options, domain);
  }
  OrtStatus* GetTensorMutableData(OrtValue* value, void** out) const {
    return at<OrtStatus* (*)(OrtValue*, void**)>(51)(value, out);
  }
  OrtStatus* KernelInfoGetAttributeFloat(const OrtKernelInfo* info, const char* name, float* out) const {
    return at<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(85)(info, name, out);
  }
  OrtStatus* KernelInfoGetAttributeInt64(const OrtKernelInfo* info, const char* name, int64_t* out) const {
    return at<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(86)(info, name, out);
  }
  OrtStatus* KernelContextGetInputCount(const OrtKernelContext* context, size_t* out) const {
    return at<OrtStatus* (*)(const OrtKernelContext*, size_t*)>(88)(context, out);
  }
  OrtStatus* KernelContextGetOutputCount(const OrtKernelContext* context, size_t* out) const {
    return at<OrtStatus* (*)(const OrtKernelContext*, size_t*)>(89)(context, out);
  }
  OrtStatus* KernelContextGetInput(const OrtKernelContext* context, size_t index, const OrtValue** out) const {
    return at<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(90)(context, index, out);
  }
  OrtStatus* KernelContextGetOutput(OrtKernelContext* context, size_t index, const int64_t* dims, size_t n,
                                    OrtValue** out) const {
    return at<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(91)(
        context, index, dims, n, out);
  }
  OrtStatus* KernelInfoGetInputCount(const OrtKernelInfo* info, size_t* out) const {
    return at<OrtStatus* (*)(const OrtKernelInfo*, size_t*)>(230)(info, out);
  }
  // *is_constant: whether input `index` is a constant initializer; *out: its value (the session's)
  OrtStatus* KernelInfoGetConstantInput(const OrtKernelInfo* info, size_t index, int* is_constant,
                                        const OrtValue** out) const {
    return at<OrtStatus* (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**)>(249)(info, index, is_constant, out);
  }
  const char* GetErrorMessage(const OrtStatus* status) const {
    return at<const char* (*)(const OrtStatus*)>(2)(status);
  }
  void ReleaseStatus(OrtStatus* status) const { at<void (*)(OrtStatus*)>(93)(status); }
  // fn(data, i) for i in [0, total) on the session's intra-op thread pool, in batches
  OrtStatus* KernelContextParallelFor(const OrtKernelContext* context, void (*fn)(void*, size_t), size_t total,
                                      size_t batches, void* data) const {
    return at<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(274)(
        context, fn, total, batches, data);
  }
  // a tensor's element type and its shape, read in place: the shape is the value's own (valid while
  // the value is), no OrtTensorTypeAndShapeInfo made and released
  OrtStatus* GetTensorElementTypeAndShapeDataReference(const OrtValue* value, int* type, const int64_t** shape,
                                                       size_t* rank) const {
    return at<OrtStatus* (*)(const OrtValue*, int*, const int64_t**, size_t*)>(414)(value, type, shape, rank);
  }

 private:
  template <typename F>
  F at(int slot) const { return reinterpret_cast<F>(const_cast<void*>(slots_[slot])); }
  const void* const* slots_;
};

}  // namespace tandem
