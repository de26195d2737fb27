// The host's work between two target steps of a decode burst (pipeline/decode_burst.py), in one
// call through ctypes (pipeline/native_burst.py): the commit of the call's K/V rows (and states not
// written in place) into their pools, each row's greedy token, the token and context written into
// the next call's bound inputs, and the stop-id check.
//
// Why native: on a small model the Python of these steps (a dozen numpy calls, each a few µs after
// the engine call has pushed the interpreter's objects out of the core's caches) was a fifth of a
// step (tiny model, batch 8: 50 of 350 µs); here it is one call.
//
// The plan (int64, built once per bucket by pipeline/native_burst.py; addresses of arrays the
// burst keeps alive):
//   [0] n              rows of the call (the batch's sequences; padding rows are not touched)
//   [1] pairs          how many (pool, output) pairs follow the header
//   [2] logits         address of float32 logits, row b at logits + b * [4] floats
//   [3] vocab
//   [4] logits_stride  floats between rows
//   [5] tokens         address of int64 [steps, n]: step s's tokens at tokens + s * n
//   [6] ids            address of the next call's input ids, row b at ids + b * [7]
//   [7] ids_stride     int64s between rows
//   [8] context        address of the call's context lengths, int64 [n]: row b wrote position context[b]
//   [9] stops          address of int64 stop ids (any row's), [10] of them
//   [10] n_stops
//   [11] page_size
//   then per pair, 8 int64s: src, src_row_bytes, dst, dst_row_bytes, row_bytes, index, index_stride,
//   index_width: pool row r(b) <- output row b, where for a paged pool (index_width > 0: the block
//   table input, row b at index + b * index_stride, index_width pages wide)
//       r(b) = table_b[context[b] / page_size] * page_size + context[b] % page_size
//   and for a state pool (index_width 0: the slots input) r(b) = index[b * index_stride].
//
// tandem_burst_edited(plan, step, rows): tandem_burst_greedy for rows whose logits processors
// only edit (logit_bias, presence / frequency / repetition penalties: pipeline/logits_processors.py),
// each row's edit list applied to its logits first, in the verify graph's float32 order
//     x = logit + bias;  x = x > 0 ? x / scale : x * scale;  logit = x + post
// and, once the row's token t is chosen, its penalty state moved on as Processors.sync moves it:
// count(t) + 1, t seen, values[t] = (bias, rep or 1, -(freq * count + pres)), t appended to the
// edit list if it was not on it. rows: int64 [n, kRowFields] (pipeline/native_burst.py):
//   [0] edits (0: a plain row)  [1] penalised  [2] ids (int64 edit list)  [3] its length (an int64
//   cell)  [4] its capacity  [5] listed (uint8 [V])  [6] counts (int32 [V])  [7] seen (uint8 [V])
//   [8] values (float32 [V, 3])  [9..11] rep, freq, pres as float64 bit patterns; for a request
//   with logprobs (of the raw row, before its edits, as the host reports them): [12] scratch for the
//   raw row (float32 [V]; 0: no logprobs)  [13] N, the top entries kept  [14] token_lp (float32
//   [steps])  [15] top_ids (int64 [steps, N])  [16] top_lp (float32 [steps, N]): step s's written by
//   tandem_logprobs_rows (logprobs.cc), the numbers a host step's logprobs are.
// Returns as tandem_burst_greedy, or -2 (nothing done) where an edit list is full (the burst
// reserves room for its steps first).
//
// tandem_burst_commit(plan): the copies only (a burst with sampled rows draws them in Python, then
// advances the context). Returns 0, or -1 where a position lies past its block table (the copies
// stop there; the burst raises: the scheduler reserves a burst's pages, so this is a bug).
// tandem_burst_greedy(plan, step): the copies, then for every row t = the first index of its
// largest logit (numpy's argmax: a NaN counts as the largest, the first one wins), tokens[step][b]
// = ids[b] = t, context[b] += 1; returns 1 where some t is a stop id, else 0 (-1 as above).

#include <cstdint>
#include <cstring>

#include "row_ops.h"

extern "C" void tandem_logprobs_rows(const float* logits, int64_t rows, int64_t vocab, int64_t stride,
                                     const int64_t* tokens, int64_t n, float* token_lp, int64_t* top_ids,
                                     float* top_lp);   // (logprobs.cc)

namespace tandem {
namespace {

constexpr int64_t kHeader = 12, kPairFields = 8;

int64_t commit(const int64_t* plan) {
  const int64_t n = plan[0], page = plan[11];
  const auto* context = reinterpret_cast<const int64_t*>(plan[8]);
  const int64_t* pair = plan + kHeader;
  for (int64_t j = 0; j < plan[1]; ++j, pair += kPairFields) {
    const auto* src = reinterpret_cast<const char*>(pair[0]);
    auto* dst = reinterpret_cast<char*>(pair[2]);
    const auto* index = reinterpret_cast<const int64_t*>(pair[5]);
    const int64_t stride = pair[6], width = pair[7];
    for (int64_t b = 0; b < n; ++b) {
      int64_t row;
      if (width > 0) {
        const int64_t logical = context[b] / page;
        if (context[b] < 0 || logical >= width) return -1;
        row = index[b * stride + logical] * page + context[b] % page;
      } else {
        row = index[b * stride];
      }
      std::memcpy(dst + row * pair[3], src + b * pair[1], pair[4]);
    }
  }
  return 0;
}

// numpy's argmax of one row: the first NaN if any, else the first index of the maximum.
int64_t argmax_portable(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (x[j] != x[j]) return j;
    if (x[j] > x[best]) best = j;
  }
  return best;
}

#ifdef TANDEM_AVX512F
// The same index: a vector pass for the maximum (and whether any NaN), then the first lane equal.
TANDEM_AVX512F int64_t argmax_avx512(const float* x, int64_t n) {
  __m512 top = _mm512_set1_ps(-__builtin_inff());
  __mmask16 nan = 0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);
  }
  if (j < n) {
    const __mmask16 tail = first_lanes(n - j);
    const __m512 v = _mm512_maskz_loadu_ps(tail, x + j);
    nan |= _mm512_mask_cmp_ps_mask(tail, v, v, _CMP_UNORD_Q);
    top = _mm512_mask_max_ps(top, tail, top, v);
  }
  if (nan) return argmax_portable(x, n);
  const float m = _mm512_reduce_max_ps(top);
  const __m512 mv = _mm512_set1_ps(m);
  for (j = 0; j < n; j += 16) {
    const __mmask16 lanes = first_lanes(n - j);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, _mm512_maskz_loadu_ps(lanes, x + j), mv, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
  return 0;     // every logit is -inf: numpy's argmax is 0 too
}
#endif

// Where a step's chosen tokens go (the plan's [5]-[10]) and the argmax the CPU runs.
struct StepOut {
  int64_t n, vocab, ids_stride, n_stops;
  int64_t *tokens, *ids, *context;
  const int64_t* stops;
  int64_t (*argmax)(const float*, int64_t);

  StepOut(const int64_t* plan, int64_t step)
      : n(plan[0]), vocab(plan[3]), ids_stride(plan[7]), n_stops(plan[10]),
        tokens(reinterpret_cast<int64_t*>(plan[5]) + step * plan[0]), ids(reinterpret_cast<int64_t*>(plan[6])),
        context(reinterpret_cast<int64_t*>(plan[8])), stops(reinterpret_cast<const int64_t*>(plan[9])) {
#ifdef TANDEM_AVX512F
    argmax = avx512f() ? argmax_avx512 : argmax_portable;
#else
    argmax = argmax_portable;
#endif
  }

  // Row b's token t: into the step's tokens and the next call's ids, its context one longer; 1 if t stops.
  int64_t write(int64_t b, int64_t t) const {
    tokens[b] = ids[b * ids_stride] = t;
    context[b] += 1;
    int64_t stopped = 0;
    for (int64_t i = 0; i < n_stops; ++i) stopped |= stops[i] == t;
    return stopped;
  }
};

constexpr int64_t kRowFields = 17;

double field_double(const int64_t* row, int64_t i) {
  double x;
  std::memcpy(&x, row + i, sizeof x);
  return x;
}

// One row's edits, in place (ids are unique: the list never holds a token twice).
void apply_edits(float* logits, const int64_t* row) {
  const auto* ids = reinterpret_cast<const int64_t*>(row[2]);
  const int64_t len = *reinterpret_cast<const int64_t*>(row[3]);
  const auto* values = reinterpret_cast<const float*>(row[8]);
  for (int64_t i = 0; i < len; ++i) {
    const float* v = values + 3 * ids[i];
    float x = logits[ids[i]] + v[0];
    x = x > 0.0f ? x / v[1] : x * v[1];
    logits[ids[i]] = x + v[2];
  }
}

// Processors.sync for one new token (the caller checked the edit list has room for one more).
void count_token(const int64_t* row, int64_t t) {
  if (!row[1]) return;
  const float rep = static_cast<float>(field_double(row, 9)), freq = static_cast<float>(field_double(row, 10)),
              pres = static_cast<float>(field_double(row, 11));
  auto* counts = reinterpret_cast<int32_t*>(row[6]);
  auto* values = reinterpret_cast<float*>(row[8]);
  const int32_t count = ++counts[t];
  reinterpret_cast<uint8_t*>(row[7])[t] = 1;
  values[3 * t + 1] = rep != 1.0f ? rep : 1.0f;
  const float scaled = freq * static_cast<float>(count);
  values[3 * t + 2] = -(scaled + pres);
  auto* listed = reinterpret_cast<uint8_t*>(row[5]);
  if (!listed[t]) {
    auto* len = reinterpret_cast<int64_t*>(row[3]);
    listed[t] = 1;
    reinterpret_cast<int64_t*>(row[2])[(*len)++] = t;
  }
}

}  // namespace
}  // namespace tandem

extern "C" __attribute__((visibility("default"))) int64_t tandem_burst_commit(const int64_t* plan) {
  return tandem::commit(plan);
}

extern "C" __attribute__((visibility("default"))) int64_t tandem_burst_greedy(const int64_t* plan, int64_t step) {
  using namespace tandem;
  if (commit(plan) < 0) return -1;
  const StepOut out(plan, step);
  const auto* logits = reinterpret_cast<const float*>(plan[2]);
  int64_t stopped = 0;
  for (int64_t b = 0; b < out.n; ++b) stopped |= out.write(b, out.argmax(logits + b * plan[4], out.vocab));
  return stopped;
}

extern "C" __attribute__((visibility("default"))) int64_t tandem_burst_edited(const int64_t* plan, int64_t step,
                                                                             const int64_t* rows) {
  using namespace tandem;
  const int64_t n = plan[0], vocab = plan[3];
  for (int64_t b = 0; b < n; ++b) {   // room for this step's token in every list, before anything moves
    const int64_t* row = rows + b * kRowFields;
    if (row[0] && row[1] && *reinterpret_cast<const int64_t*>(row[3]) >= row[4]) return -2;
  }
  if (commit(plan) < 0) return -1;
  const StepOut out(plan, step);
  auto* logits = reinterpret_cast<float*>(plan[2]);
  int64_t stopped = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t* row = rows + b * kRowFields;
    float* x = logits + b * plan[4];
    auto* raw = reinterpret_cast<float*>(row[12]);
    if (raw) std::memcpy(raw, x, vocab * sizeof(float));
    if (row[0]) apply_edits(x, row);
    const int64_t t = out.argmax(x, vocab);
    if (raw) {
      const int64_t top = row[13];
      tandem_logprobs_rows(raw, 1, vocab, vocab, &t, top, reinterpret_cast<float*>(row[14]) + step,
                           reinterpret_cast<int64_t*>(row[15]) + step * top,
                           reinterpret_cast<float*>(row[16]) + step * top);
    }
    if (row[0]) count_token(row, t);
    stopped |= out.write(b, t);
  }
  return stopped;
}
