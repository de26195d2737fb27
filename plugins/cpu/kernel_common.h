// What tandem's ONNX Runtime CPU kernels share: reading inputs and making outputs through the C
// ABI (ort_abi.h), errors that fail the call with a message, and helper threads.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
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

inline void check(const OrtApiTable& api, OrtStatus* status) {
  if (status != nullptr) {
    std::string msg = api.GetErrorMessage(status);
    api.ReleaseStatus(status);
    fail("kernel", msg);
  }
}

inline std::vector<int64_t> dims_of(const OrtApiTable& api, const OrtValue* value) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(api, api.GetTensorTypeAndShape(value, &info));
  size_t n = 0;
  OrtStatus* status = api.GetDimensionsCount(info, &n);
  std::vector<int64_t> dims(n);
  if (status == nullptr) status = api.GetDimensions(info, dims.data(), n);
  api.ReleaseTensorTypeAndShapeInfo(info);
  check(api, status);
  return dims;
}

template <typename T>
T* input(const OrtApiTable& api, OrtKernelContext* context, size_t index, std::vector<int64_t>* dims) {
  const OrtValue* value = nullptr;
  check(api, api.KernelContextGetInput(context, index, &value));
  *dims = dims_of(api, value);
  void* data = nullptr;
  check(api, api.GetTensorMutableData(const_cast<OrtValue*>(value), &data));
  return static_cast<T*>(data);
}

// The output's buffer; null for an optional output the node omits ("" as its name).
inline float* output(const OrtApiTable& api, OrtKernelContext* context, size_t index,
                     const std::vector<int64_t>& dims, bool optional = false) {
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

inline size_t output_count(const OrtApiTable& api, OrtKernelContext* context) {
  size_t n = 0;
  check(api, api.KernelContextGetOutputCount(context, &n));
  return n;
}

// Helper threads for a kernel's independent (sequence, head) pairs: one fewer than the cores, so
// with the calling thread every core takes a share. They sleep between calls; a call made while
// another holds them (sessions run from several threads) runs on its own thread.
class Helpers {
 public:
  Helpers() {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned i = 1; i < cores; ++i) threads_.emplace_back([this, i] { loop(i); });
  }
  ~Helpers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  // fn(first, last) over [0, tasks) in len(threads) + 1 contiguous shares
  void run(int64_t tasks, const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    const int64_t parts = static_cast<int64_t>(threads_.size()) + 1;
    if (!busy.owns_lock() || parts == 1 || tasks < 2) {
      fn(0, tasks);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn, tasks_ = tasks, parts_ = parts, pending_ = parts - 1, ++round_;
    }
    wake_.notify_all();
    fn(0, tasks / parts);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  void loop(unsigned index) {
    uint64_t seen = 0;
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || round_ != seen; });
      if (stop_) return;
      seen = round_;
      const auto* fn = fn_;
      const int64_t first = tasks_ * index / parts_, last = tasks_ * (index + 1) / parts_;
      lock.unlock();
      (*fn)(first, last);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_, busy_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t tasks_ = 0, parts_ = 1, pending_ = 0;
  uint64_t round_ = 0;
  bool stop_ = false;
};

inline Helpers& helpers() {
  static Helpers instance;
  return instance;
}

// The ops of the library (one file each), registered by register.cc.
extern const OrtCustomOp kGatedDeltaNet;
extern const OrtCustomOp kPagedAttention;

}  // namespace tandem
