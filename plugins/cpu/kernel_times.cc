// Wall time per op of tandem's kernels, unprofiled (bench/where_time_goes.py, table (e)): off
// unless TANDEM_CPU_KERNEL_TIMES=1 when the process first runs a kernel.
//
// Why: ONNX Runtime's profiler adds about 10 us to every node it times (150M model, bfloat16
// weights: model_run 9.0 ms profiled, 7.4 ms not), the size of the step's small nodes themselves,
// so its shares overstate them. Here each kernel call costs two clock reads and a short locked
// update when on, one load and a branch when off.
//
// Per op name: calls, busy us (the kernel's compute, its pool tasks included) and the gap before
// it: the time since the previous tandem kernel call ended, where that is under 1 ms (what ONNX
// Runtime's executor and its own nodes took between them; before a step's first kernel, also the
// host's work since the last step; longer pauses are not counted).

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "kernel_common.h"

namespace tandem {
namespace {

constexpr int kSlots = 16;              // more than the library's ops
constexpr double kStepGapUs = 1000.0;   // a longer pause between kernel calls is not counted as a gap

struct Slot {
  const char* name = nullptr;           // the op's kName (a literal: compared by address)
  int64_t calls = 0, gaps = 0;
  double busy_us = 0.0, gap_us = 0.0;
};

struct Table {
  std::mutex mu;
  Slot slots[kSlots];
  double last_end_us = -1.0;
};

Table& table() {
  static Table* t = new Table;          // never destroyed: kernels may still run at exit
  return *t;
}

}  // namespace

double kernel_clock_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool kernel_times_on() {
  static const bool on = [] {
    const char* v = std::getenv("TANDEM_CPU_KERNEL_TIMES");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

void kernel_time(const char* name, double start_us, double end_us) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  for (Slot& s : t.slots) {
    if (s.name == nullptr) s.name = name;
    if (s.name != name) continue;
    ++s.calls;
    s.busy_us += end_us - start_us;
    if (t.last_end_us >= 0.0 && start_us - t.last_end_us < kStepGapUs) {
      ++s.gaps;
      s.gap_us += start_us - t.last_end_us;
    }
    break;
  }
  t.last_end_us = end_us;
}

}  // namespace tandem

// The table as text, a line per op: "name calls busy_us gaps gap_us"; written into out (cap bytes,
// NUL-terminated where it fits); returns the length of the whole text (so a caller can retry with
// a larger buffer). reset != 0 zeroes the table after reading it.
extern "C" __attribute__((visibility("default")))
int64_t tandem_kernel_times(char* out, int64_t cap, int reset) {
  tandem::Table& t = tandem::table();
  std::lock_guard<std::mutex> lock(t.mu);
  std::string text;
  char line[160];
  for (tandem::Slot& s : t.slots) {
    if (s.name == nullptr) continue;
    std::snprintf(line, sizeof(line), "%s %lld %.3f %lld %.3f\n", s.name, static_cast<long long>(s.calls), s.busy_us,
                  static_cast<long long>(s.gaps), s.gap_us);
    text += line;
    if (reset != 0) s = tandem::Slot{s.name};
  }
  if (reset != 0) t.last_end_us = -1.0;
  if (out != nullptr && cap > 0) {
    const size_t n = std::min(text.size(), static_cast<size_t>(cap - 1));
    std::memcpy(out, text.data(), n);
    out[n] = '\0';
  }
  return static_cast<int64_t>(text.size());
}
