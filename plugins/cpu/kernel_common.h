// What tandem's ONNX Runtime CPU kernels share: reading inputs and making outputs through the C
// ABI (ort_abi.h), errors that fail the call with a message, and the thread pool.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "ort_abi.h"

namespace tandem {

// Fails the node's call: ONNX Runtime turns the exception into the run's error status.
inline void fail(const char* op, const std::string& what) {
  throw std::runtime_error(std::string("ai.tandem.cpu::") + op + ": " + what);
}

inline void expect(bool ok, const char* op, const char* what) {
  if (!ok) fail(op, what);
}

// A tensor's dims, held inline: reading a node's inputs and making its outputs allocates nothing
// (a std::vector per input, output and shape check was a dozen heap allocations a call)
class Dims {
 public:
  static constexpr size_t kMaxRank = 8;
  Dims() = default;
  Dims(std::initializer_list<int64_t> dims) : Dims(dims.begin(), dims.size()) {}
  Dims(const int64_t* dims, size_t rank) : rank_(rank) {
    expect(rank <= kMaxRank, "kernel", "a tensor of rank above 8");
    std::copy(dims, dims + rank, dims_);
  }
  size_t size() const { return rank_; }
  bool empty() const { return rank_ == 0; }
  int64_t operator[](size_t i) const { return dims_[i]; }
  int64_t back() const { return dims_[rank_ - 1]; }
  const int64_t* data() const { return dims_; }
  const int64_t* begin() const { return dims_; }
  const int64_t* end() const { return dims_ + rank_; }
  Dims first(size_t n) const { return Dims(dims_, n); }    // the leading n
  void push_back(int64_t d) {
    expect(rank_ < kMaxRank, "kernel", "a tensor of rank above 8");
    dims_[rank_++] = d;
  }
  bool operator==(const Dims& o) const { return rank_ == o.rank_ && std::equal(begin(), end(), o.begin()); }
  bool operator!=(const Dims& o) const { return !(*this == o); }

 private:
  int64_t dims_[kMaxRank] = {};
  size_t rank_ = 0;
};

inline void check(const OrtApiTable& api, OrtStatus* status) {
  if (status != nullptr) {
    std::string msg = api.GetErrorMessage(status);
    api.ReleaseStatus(status);
    fail("kernel", msg);
  }
}

// A tensor's dims, read in place (one ABI call: a type-and-shape object made and released per input
// took four more, and a heap allocation inside ONNX Runtime, on every node's call)
inline Dims dims_of(const OrtApiTable& api, const OrtValue* value) {
  int type = 0;
  const int64_t* shape = nullptr;
  size_t rank = 0;
  check(api, api.GetTensorElementTypeAndShapeDataReference(value, &type, &shape, &rank));
  return Dims(shape, rank);
}

// The ABI table, with the node's constant inputs (initializers: the build writes every weight as
// one) read once, when its kernel is made: their data and dims. Kernels read their inputs with
// input() / optional_input() on it, and a constant one then costs no call into ONNX Runtime: read
// through the kernel context, an input is five ABI calls and a shape object on the heap. With the
// caches cold from the weight stream, an int4 matmul node of the 150M model spent 1.3 us of its 34 us
// reading inputs (docs/performance.md, "Per-node costs").
class NodeApi : public OrtApiTable {
 public:
  NodeApi(const OrtApiTable& api, const OrtKernelInfo* info) : OrtApiTable(api) {
    size_t n = 0;
    check(api, api.KernelInfoGetInputCount(info, &n));
    constants_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      int is_constant = 0;
      const OrtValue* value = nullptr;
      check(api, api.KernelInfoGetConstantInput(info, i, &is_constant, &value));
      if (!is_constant || value == nullptr) continue;
      constants_[i].dims = dims_of(api, value);
      check(api, api.GetTensorMutableData(const_cast<OrtValue*>(value), &constants_[i].data));
    }
  }

  // input `index`'s data and dims where it is a constant initializer; else null
  const void* constant(size_t index, Dims* dims) const {
    if (index >= constants_.size() || constants_[index].data == nullptr) return nullptr;
    *dims = constants_[index].dims;
    return constants_[index].data;
  }

 private:
  struct Constant {
    void* data = nullptr;        // the session's initializer: it outlives the kernel
    Dims dims;
  };
  std::vector<Constant> constants_;   // by input index
};

template <typename T>
T* input(const NodeApi& api, OrtKernelContext* context, size_t index, Dims* dims) {
  if (const void* data = api.constant(index, dims)) return static_cast<T*>(const_cast<void*>(data));
  const OrtValue* value = nullptr;
  check(api, api.KernelContextGetInput(context, index, &value));
  *dims = dims_of(api, value);
  void* data = nullptr;
  check(api, api.GetTensorMutableData(const_cast<OrtValue*>(value), &data));
  return static_cast<T*>(data);
}

// An optional input's data, or null where the node omits it.
template <typename T>
T* optional_input(const NodeApi& api, OrtKernelContext* context, size_t index, Dims* dims) {
  if (const void* data = api.constant(index, dims)) return static_cast<T*>(const_cast<void*>(data));
  size_t n = 0;
  check(api, api.KernelContextGetInputCount(context, &n));
  const OrtValue* value = nullptr;
  if (index < n) check(api, api.KernelContextGetInput(context, index, &value));
  return value == nullptr ? nullptr : input<T>(api, context, index, dims);
}

inline int64_t numel(const Dims& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

// The output's buffer; null for an optional output the node omits ("" as its name).
inline float* output(const OrtApiTable& api, OrtKernelContext* context, size_t index,
                     const Dims& dims, bool optional = false) {
  OrtValue* value = nullptr;
  check(api, api.KernelContextGetOutput(context, index, dims.data(), dims.size(), &value));
  if (value == nullptr && optional) return nullptr;
  void* data = nullptr;
  check(api, api.GetTensorMutableData(value, &data));
  return static_cast<float*>(data);
}

// An int attribute, or `fallback` where the node has none.
inline int64_t optional_int(const OrtApiTable& api, const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t value = fallback;
  if (OrtStatus* status = api.KernelInfoGetAttributeInt64(info, name, &value)) {
    api.ReleaseStatus(status);
    return fallback;
  }
  return value;
}

// What a matmul node takes around its product (export/cpu_matmul_lowering.py): the attributes
// rms_norm and norm_group (one or neither), epsilon (with either) and swiglu.
struct MatMulFusions {
  bool rms_norm = false, swiglu = false;
  int64_t norm_group = 0;
  float epsilon = 0.0f;
};

inline MatMulFusions matmul_fusions(const OrtApiTable& api, const OrtKernelInfo* info, const char* op) {
  MatMulFusions f;
  f.rms_norm = optional_int(api, info, "rms_norm", 0) != 0;
  f.norm_group = optional_int(api, info, "norm_group", 0);
  f.swiglu = optional_int(api, info, "swiglu", 0) != 0;
  expect(!(f.rms_norm && f.norm_group), op, "rms_norm and norm_group exclude each other");
  if (f.rms_norm || f.norm_group) check(api, api.KernelInfoGetAttributeFloat(info, "epsilon", &f.epsilon));
  return f;
}

inline size_t output_count(const OrtApiTable& api, OrtKernelContext* context) {
  size_t n = 0;
  check(api, api.KernelContextGetOutputCount(context, &n));
  return n;
}

constexpr size_t kMaxSplits = 4;   // outputs of a split matmul node

// A matmul node's column split (export/cpu_matmul_lowering.py takes the Split after its product,
// and the Reshapes to heads after that, into it): input `index`, widths [n] int64 summing to N, one
// per output; input index + 1 (optional), heads [n]: output i is [..., heads[i], widths[i] /
// heads[i]] where heads[i] > 0, else [..., widths[i]]. No widths: no split.
struct ColumnSplit {
  std::vector<int64_t> widths, heads;
  bool empty() const { return widths.empty(); }
};

inline ColumnSplit column_split(const NodeApi& api, OrtKernelContext* context, size_t index, int64_t N,
                                const char* op) {
  Dims sd, hd;
  const int64_t* split = optional_input<int64_t>(api, context, index, &sd);
  if (split == nullptr) return {};
  ColumnSplit c{std::vector<int64_t>(split, split + numel(sd)), std::vector<int64_t>(numel(sd), 0)};
  int64_t total = 0;
  for (int64_t w : c.widths) {
    expect(w >= 0, op, "a split width is negative");
    total += w;
  }
  expect(total == N && c.widths.size() == output_count(api, context), op, "split widths must sum to N, one per output");
  if (const int64_t* heads = optional_input<int64_t>(api, context, index + 1, &hd)) {
    expect(numel(hd) == numel(sd), op, "split heads must be one per output");
    for (size_t i = 0; i < c.widths.size(); ++i) {
      expect(heads[i] >= 0 && (heads[i] == 0 || c.widths[i] % heads[i] == 0), op,
             "split heads must divide their widths");
      c.heads[i] = heads[i];
    }
  }
  return c;
}

// A split's outputs, made before the product is: each pool task copies its own columns of the
// product into them (copy), from its own cache; a copy of the whole product after the tasks read
// half of it from the other core's (150M int4 in_proj, 4 outputs: 2.6 us a call).
struct SplitOutputs {
  float* out[kMaxSplits] = {};
  int64_t start[kMaxSplits + 1] = {};    // output i holds product columns [start[i], start[i + 1])
  size_t n = 0;
  int64_t M = 0, N = 0;

  // product [M, N]'s columns [c0, c1) into the outputs they belong to
  void copy(const float* product, int64_t c0, int64_t c1) const {
    for (size_t i = 0; i < n; ++i) {
      const int64_t a = std::max(c0, start[i]), b = std::min(c1, start[i + 1]), w = start[i + 1] - start[i];
      for (int64_t m = 0; a < b && m < M; ++m) {
        std::memcpy(out[i] + m * w + (a - start[i]), product + m * N + a, sizeof(float) * (b - a));
      }
    }
  }
};

// The split's outputs for a product of dims yd [..., N] (none where the node has no split).
inline SplitOutputs split_outputs(const OrtApiTable& api, OrtKernelContext* context, const Dims& yd,
                                  const ColumnSplit& split) {
  SplitOutputs s;
  s.n = split.widths.size();
  s.N = yd.back();
  s.M = s.N > 0 ? numel(yd) / s.N : 0;
  for (size_t i = 0; i < s.n; ++i) {
    const int64_t w = split.widths[i], h = split.heads[i];
    Dims dims = yd.first(yd.size() - 1);
    if (h > 0) {
      dims.push_back(h);
      dims.push_back(w / h);
    } else {
      dims.push_back(w);
    }
    s.out[i] = output(api, context, i, dims);
    s.start[i + 1] = s.start[i] + w;
  }
  return s;
}

// A node whose tasks together touch fewer bytes than this (weights, cache rows, states; counted
// once per pass over them) runs on the calling thread: handing tasks to the pool and waiting for
// its threads costs more than the node's whole work. 2-core Xeon, target step against every node
// on the pool: the tiny model (26 nodes of 1-100 KB) 1.11-1.34x faster at batch 1, 1.07-1.20x at batch 8;
// the shipped and 150M models (nodes of 0.1-10 MB) the same. Every node inline instead: the
// shipped model 0.68x. 256 KB measured like 128 KB; 512 KB cost the shipped model 2-4%.
#ifndef TANDEM_INLINE_BYTES
#define TANDEM_INLINE_BYTES (128 << 10)
#endif
constexpr int64_t kInlineBytes = TANDEM_INLINE_BYTES;

// fn(first, last) over [0, tasks) on ONNX Runtime's intra-op thread pool (the session's, or the
// process-wide one tandem uses): its threads spin between nodes, so they pick work up at once,
// where threads of the library's own slept between calls and woke late for 50-100 us kernels.
// `bytes`: what the tasks touch in all (kInlineBytes).
inline void parallel_for(const OrtApiTable& api, OrtKernelContext* context, int64_t tasks, int64_t bytes,
                         const std::function<void(int64_t, int64_t)>& fn) {
  if (tasks <= 1 || bytes < kInlineBytes) {
    fn(0, tasks);
    return;
  }
  auto call = [](void* data, size_t i) {
    (*static_cast<const std::function<void(int64_t, int64_t)>*>(data))(static_cast<int64_t>(i),
                                                                       static_cast<int64_t>(i) + 1);
  };
  check(api, api.KernelContextParallelFor(context, call, static_cast<size_t>(tasks), 0,
                                          const_cast<std::function<void(int64_t, int64_t)>*>(&fn)));
}

// The OrtCustomOp ONNX Runtime reads for an op, from its kernel type K, which declares:
//   static constexpr const char* kName;
//   static constexpr int kInputs[];           the element type of each input (0: any)
//   static constexpr uint32_t kOptionalInputs; bit i set: input i may be omitted
//   static constexpr size_t kOutputs;          float32 outputs
//   static constexpr uint32_t kOptionalOutputs;
//   static K* create(const OrtApiTable&, const OrtKernelInfo*);  and  void compute(OrtKernelContext*)
constexpr uint32_t from_index(int i) { return ~0u << i; }    // bits i and up: every input from i on

// Per-op wall times, unprofiled, when TANDEM_CPU_KERNEL_TIMES=1 (kernel_times.cc; read with the
// library's tandem_kernel_times)
bool kernel_times_on();
double kernel_clock_us();
void kernel_time(const char* name, double start_us, double end_us);

template <typename K>
struct OpCallbacks {
  static void* create(const OrtCustomOp*, const void* api, const OrtKernelInfo* info) {
    return K::create(OrtApiTable(api), info);
  }
  static const char* name(const OrtCustomOp*) { return K::kName; }
  static const char* provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
  static int input_type(const OrtCustomOp*, size_t i) { return K::kInputs[i]; }
  static size_t input_count(const OrtCustomOp*) { return sizeof(K::kInputs) / sizeof(K::kInputs[0]); }
  static int output_type(const OrtCustomOp*, size_t) { return kTensorFloat; }
  static size_t output_count(const OrtCustomOp*) { return K::kOutputs; }
  static void compute(void* kernel, OrtKernelContext* context) {
    if (!kernel_times_on()) return static_cast<K*>(kernel)->compute(context);
    const double start = kernel_clock_us();
    static_cast<K*>(kernel)->compute(context);
    kernel_time(K::kName, start, kernel_clock_us());
  }
  static void destroy(void* kernel) { delete static_cast<K*>(kernel); }
  static int input_characteristic(const OrtCustomOp*, size_t i) {
    return (K::kOptionalInputs >> i) & 1u ? kInputOutputOptional : kInputOutputRequired;
  }
  static int output_characteristic(const OrtCustomOp*, size_t i) {
    return (K::kOptionalOutputs >> i) & 1u ? kInputOutputOptional : kInputOutputRequired;
  }
  static int memory(const OrtCustomOp*, size_t) { return 0; }   // OrtMemTypeDefault
};

template <typename K>
constexpr OrtCustomOp custom_op() {
  using C = OpCallbacks<K>;
  return {kOrtCustomOpVersion, C::create, C::name, C::provider, C::input_type, C::input_count, C::output_type,
          C::output_count, C::compute, C::destroy, C::input_characteristic, C::output_characteristic, C::memory};
}

// The ops of the library (one file each), registered by register.cc.
extern const OrtCustomOp kGatedDeltaNet;
extern const OrtCustomOp kConvGatedDeltaNet;
extern const OrtCustomOp kPagedAttention;
extern const OrtCustomOp kNormRope;
extern const OrtCustomOp kRotaryTables;
extern const OrtCustomOp kMatMulNBits;
extern const OrtCustomOp kMatMul;

}  // namespace tandem
