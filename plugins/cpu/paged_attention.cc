// ai.tandem.cpu::PagedAttention: dense paged attention (ai.tandem::PagedSparseAttention where no
// row selects) as one ONNX Runtime CPU kernel, float32.
//
// Inputs   query [B, W, Hq, D]; key [B, W, Hkv, D], value [B, W, Hkv, Dv] (the call's new rows);
//          key_cache [N, S, Hkv, D], value_cache [N, S, Hkv, Dv]; block_tables [B, P] int64;
//          context_lens [B] int64
//          and, optional, what the layer does to the query before and the output after
//          (export/cpu_kernel_lowering.py fuses it where the graph is the exporter's): q_norm [D] (an
//          RMS norm per head, attribute norm_epsilon); cos, sin [B, W, 1, D] and rotate_perm [D] int64
//          (RoPE as the exporter writes it: x cos + x[perm] sin); gate [B, W, Hq Dv] (the output
//          times sigmoid(gate)). The keys come normed and rotated: the graph commits them, and a
//          unified round's re-anchored heads make them without attention, so the same nodes make
//          them everywhere (the same bits in every graph).
// Output   [B, W, Hq, Dv] ([B, W, Hq Dv] with a gate)
// Attrs    scale (float), sliding_window (int, 0: none), norm_epsilon (float, with q_norm),
//          packed_gate (int, default 0; 1: the query input is [B, W, Hq, 2 D], each head's query then
//          its output gate, as the q projection makes them: no gate input)
//
// Row w of sequence b sits at position p = context_lens[b] + w and sees positions j <= p with
// p - j < window (if any): committed ones (j < context_lens[b]) in the pool, at page
// block_tables[b][j / S], slot j % S, and the call's own rows w' = j - context_lens[b] <= w.
// Per KV head, its G = Hq / Hkv query heads read each key once:
//     s_g[j] = scale q_g . K_j;  P_g = softmax_j(s_g);  out_g = sum_j P_g[j] V_j     (float32)
// in the fixed order attend_portable spells out, which its AVX-512 form (D and Dv multiples of 16)
// follows operation for operation: the same bits in both. The AVX-512 form (16-lane dots, the
// softmax's exp as silu's polynomial, 16 positions a vector) ran an MTP head over 64 rows 1.2-1.3x
// faster than the auto-vectorized loops with a scalar std::exp before it (docs/performance.md).
// Why a kernel: the graph lowering (export/attention_lowering.py) gathers every page of the table,
// transposes, scatters the new rows into the copy and pads the spare slots before the products; at
// batch 8 and 1,000 tokens those copies took 3x the products (docs/performance.md). Here nothing is
// copied. Every row loops over its positions in the same order whatever the call's rows, so a
// verify row equals the decode step at its position bit for bit.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernel_common.h"
#include "row_ops.h"

namespace tandem {
namespace {

void expect_pa(bool ok, const char* what) { expect(ok, "PagedAttention", what); }

// The sum of 16 lanes in one fixed tree: [i] + [i + 8], then [i] + [i + 4], [i] + [i + 2], [0] + [1]
// (the order of the AVX-512 form's halvings).
inline float tree16(const float* lanes) {
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) q[i] = h[i] + h[i + 4];
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// One query row's attention for the G query heads of one KV head over positions lo..p, in either
// form (the same operations in the same order, so the same bits):
//     s_g[j] = scale tree16(lanes: fma over d, lane d % 16);  e = exp(s - max s) (row_ops.h's exp);
//     sum = tree16(lanes: e_j into lane (j - lo) % 16, in j order);  P = e / sum;
//     out_g = fma chain over j of P_g[j] V_j, from 0
// scores [G, n] scratch (n = p - lo + 1); out [G, dv].
template <class Key, class Value>
void attend_portable(const float* q, int64_t G, int64_t D, int64_t dv, int64_t lo, int64_t p, float scale,
                     const Key& key_at, const Value& value_at, float* scores, float* out) {
  const int64_t n = p - lo + 1;
  for (int64_t j = 0; j < n; ++j) {
    const float* key = key_at(lo + j);
    for (int64_t g = 0; g < G; ++g) {
      float lanes[16] = {};
      for (int64_t i = 0; i < D; ++i) lanes[i % 16] = std::fma(q[g * D + i], key[i], lanes[i % 16]);
      scores[g * n + j] = scale * tree16(lanes);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    const float top = *std::max_element(s, s + n);
    float lanes[16] = {};
    for (int64_t j = 0; j < n; ++j) lanes[j % 16] += (s[j] = exp_clamped(s[j] - top));
    const float sum = tree16(lanes);
    for (int64_t j = 0; j < n; ++j) s[j] /= sum;
    float* o = out + g * dv;
    std::fill(o, o + dv, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const float* value = value_at(lo + j);
      for (int64_t e = 0; e < dv; ++e) o[e] = std::fma(s[j], value[e], o[e]);
    }
  }
}

#ifdef TANDEM_AVX512F
TANDEM_AVX512F inline float tree16_avx512(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 r = _mm_add_ps(q, _mm_movehl_ps(q, q));                 // [0] + [2], [1] + [3]
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)));
}

// Rows kAhead positions ahead are asked for while this one is read: pages lie scattered in the pool,
// so the hardware prefetchers, which stop at page boundaries, start cold on every page.
constexpr int64_t kAhead = 16;

TANDEM_AVX512F inline void prefetch_row(const float* row, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) _mm_prefetch(reinterpret_cast<const char*>(row + i), _MM_HINT_T0);
}

// scale (q_g . key) for NG heads (q_g = q + g D), D a multiple of 16: each key chunk loaded once
template <int NG>
TANDEM_AVX512F inline void dots_avx512(const float* q, const float* key, int64_t D, float scale, float* out,
                                       int64_t stride) {
  __m512 acc[NG];
  for (int g = 0; g < NG; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 k = _mm512_loadu_ps(key + i);
    for (int g = 0; g < NG; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + i), k, acc[g]);
  }
  for (int g = 0; g < NG; ++g) out[g * stride] = scale * tree16_avx512(acc[g]);
}

// tree16_avx512 of 16 vectors at once: lane t of the result is tree16(a[t]), made by the same
// additions of the same pairs (so the same bits), four halvings shared by the 16 instead of a
// horizontal sum each (which made the scores of a long context compute-bound: 12.7 GB/s of keys).
TANDEM_AVX512F inline __m512 tree16x16_avx512(const __m512* a) {
  __m512 x[8], y[4], z[2];
  for (int m = 0; m < 8; ++m) {     // [i] + [i + 8]: a[2m]'s in 128-bit chunks 0-1, a[2m + 1]'s in 2-3
    x[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  }
  for (int t = 0; t < 4; ++t) {     // [i] + [i + 4]: chunk c holds a[4t + c]'s four
    y[t] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * t], x[2 * t + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * t], x[2 * t + 1], 0xDD));
  }
  for (int u = 0; u < 2; ++u) {     // [0] + [2], [1] + [3]: chunk c holds a[8u + c]'s two, then a[8u + 4 + c]'s
    z[u] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * u], y[2 * u + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(y[2 * u], y[2 * u + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // [0] + [1]: lane 4c + m holds a[4m + c]'s sum; put a[t]'s in lane t
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w);
}

// scale (q . keys[t]) for 16 keys (D a multiple of 16): dots_avx512<1>'s fma chains, reduced together
TANDEM_AVX512F inline void dots16_avx512(const float* q, const float* const* keys, int64_t D, float scale,
                                         float* out) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 qi = _mm512_loadu_ps(q + i);
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(keys[t] + i), acc[t]);
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_set1_ps(scale), tree16x16_avx512(acc)));
}

// attend_portable's AVX-512 form, for D and dv multiples of 16
template <class Key, class Value>
TANDEM_AVX512F void attend_avx512(const float* q, int64_t G, int64_t D, int64_t dv, int64_t lo, int64_t p,
                                  float scale, const Key& key_at, const Value& value_at, float* scores, float* out) {
  const int64_t n = p - lo + 1;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {    // 16 positions at a time, each head's 16 scores reduced together
    const float* keys[16];
    for (int t = 0; t < 16; ++t) {
      keys[t] = key_at(lo + j + t);
      if (j + t + kAhead < n) prefetch_row(key_at(lo + j + t + kAhead), D);
    }
    for (int64_t g = 0; g < G; ++g) dots16_avx512(q + g * D, keys, D, scale, scores + g * n + j);
  }
  for (; j < n; ++j) {
    const float* key = key_at(lo + j);
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) dots_avx512<4>(q + g * D, key, D, scale, scores + g * n + j, n);
    for (; g < G; ++g) dots_avx512<1>(q + g * D, key, D, scale, scores + g * n + j, n);
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    __m512 top = _mm512_set1_ps(s[0]);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = first_lanes(n - j);
      top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, s + j));
    }
    const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));      // (a max: any order is exact)
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = first_lanes(n - j);
      const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), peak));
      _mm512_mask_storeu_ps(s + j, m, e);
      lanes = _mm512_mask_add_ps(lanes, m, lanes, e);
    }
    const __m512 sum = _mm512_set1_ps(tree16_avx512(lanes));
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = first_lanes(n - j);
      _mm512_mask_storeu_ps(s + j, m, _mm512_div_ps(_mm512_maskz_loadu_ps(m, s + j), sum));
    }
  }
  // P V, 4 heads x 64 values at a time (16 accumulators) with positions in order, so each value
  // line is read once per 4 heads, not once per head (a long context's values outgrow L2)
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t ng = std::min<int64_t>(4, G - g0);
    for (int64_t e0 = 0; e0 < dv; e0 += 64) {
      const int64_t chunks = std::min<int64_t>(4, (dv - e0) / 16);
      __m512 acc[4][4];
      for (int g = 0; g < 4; ++g) {
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
      }
      for (int64_t j = 0; j < n; ++j) {
        const float* value = value_at(lo + j) + e0;
        if (j + kAhead < n) prefetch_row(value_at(lo + j + kAhead) + e0, chunks * 16);
        __m512 v[4];
        for (int c = 0; c < 4; ++c) v[c] = c < chunks ? _mm512_loadu_ps(value + 16 * c) : _mm512_setzero_ps();
        for (int g = 0; g < 4; ++g) {
          if (g >= ng) break;
          const __m512 w = _mm512_set1_ps(scores[(g0 + g) * n + j]);
          for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
      }
      for (int64_t g = 0; g < ng; ++g) {
        for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + (g0 + g) * dv + e0 + 16 * c, acc[g][c]);
      }
    }
  }
}
#else
template <class Key, class Value>
void attend_avx512(const float* q, int64_t G, int64_t D, int64_t dv, int64_t lo, int64_t p, float scale,
                   const Key& key_at, const Value& value_at, float* scores, float* out) {
  attend_portable(q, G, D, dv, lo, p, scale, key_at, value_at, scores, out);
}
#endif

struct Kernel {
  static constexpr const char* kName = "PagedAttention";
  static constexpr int kInputs[] = {kTensorFloat, kTensorFloat, kTensorFloat, kTensorFloat, kTensorFloat,
      kTensorInt64, kTensorInt64, kTensorFloat, kTensorFloat, kTensorFloat, kTensorInt64, kTensorFloat};
  static constexpr uint32_t kOptionalInputs = from_index(7);
  static constexpr size_t kOutputs = 1;
  static constexpr uint32_t kOptionalOutputs = 0;

  static Kernel* create(const OrtApiTable& api, const OrtKernelInfo* info) {
    float scale = 1.0f, norm_epsilon = 0.0f;
    int64_t window = 0;
    check(api, api.KernelInfoGetAttributeFloat(info, "scale", &scale));
    check(api, api.KernelInfoGetAttributeInt64(info, "sliding_window", &window));
    if (OrtStatus* status = api.KernelInfoGetAttributeFloat(info, "norm_epsilon", &norm_epsilon)) {
      api.ReleaseStatus(status);       // a node without q_norm has none
    }
    return new Kernel{NodeApi(api, info), scale, window, norm_epsilon, avx512f(), optional_int(api, info, "packed_gate", 0) != 0};
  }

  NodeApi api;
  float scale;
  int64_t window;
  float norm_epsilon;
  bool fast, packed_gate;

  void compute(OrtKernelContext* context) const {
    Dims qd, kd, vd, kcd, vcd, td, cd;
    const float* q = input<float>(api, context, 0, &qd);
    const float* k = input<float>(api, context, 1, &kd);
    const float* v = input<float>(api, context, 2, &vd);
    const float* kc = input<float>(api, context, 3, &kcd);
    const float* vc = input<float>(api, context, 4, &vcd);
    const int64_t* tables = input<int64_t>(api, context, 5, &td);
    const int64_t* ctx = input<int64_t>(api, context, 6, &cd);
    expect_pa(qd.size() == 4 && kd.size() == 4 && vd.size() == 4 && kcd.size() == 4 && vcd.size() == 4 &&
                  td.size() == 2 && cd.size() == 1,
              "expected query [B, W, Hq, D], key / value [B, W, Hkv, D], caches [N, S, Hkv, D], "
              "block_tables [B, P], context_lens [B]");
    const int64_t B = qd[0], W = qd[1], hq = qd[2], D = packed_gate ? qd[3] / 2 : qd[3], hkv = kd[2], dv = vd[3];
    expect_pa(!packed_gate || (qd[3] % 2 == 0 && dv == D), "a packed query and gate must be [B, W, Hq, 2 D], D = Dv");
    const int64_t pages = kcd[0], S = kcd[1], P = td[1];
    expect_pa(kd[0] == B && kd[1] == W && kd[3] == D && vd[0] == B && vd[1] == W && vd[2] == hkv,
              "the new rows disagree with the query on B, W or heads");
    expect_pa(kcd[2] == hkv && kcd[3] == D && vcd[0] == pages && vcd[1] == S && vcd[2] == hkv && vcd[3] == dv,
              "the caches disagree with the new rows on heads or head dims");
    expect_pa(td[0] == B && cd[0] == B && hkv > 0 && hq % hkv == 0, "block_tables / context_lens / heads");
    for (int64_t b = 0; b < B; ++b) {
      expect_pa(ctx[b] >= 0 && ctx[b] <= P * S, "a context length is longer than its block table");
      for (int64_t page = 0; page < (ctx[b] + S - 1) / S; ++page) {
        const int64_t id = tables[b * P + page];
        expect_pa(id >= 0 && id < pages, "a block table names a page outside the cache");
      }
    }
    // the output gate: head h's elements at gate + (row Hq + h) gate_row, a tensor of its own or each
    // head's second half of a packed query
    const float* gate = nullptr;
    int64_t gate_row = dv;
    thread_local std::vector<float> q_rows, q_buffer;    // the calling thread's, kept across calls
    if (packed_gate) {
      q_rows.resize(static_cast<size_t>(B * W * hq * D));
      for (int64_t m = 0; m < B * W * hq; ++m) std::memcpy(q_rows.data() + m * D, q + m * 2 * D, sizeof(float) * D);
      gate = q + D, gate_row = 2 * D, q = q_rows.data();
    } else {
      Dims gd;
      gate = optional_input<float>(api, context, 11, &gd);
      expect_pa(gate == nullptr || numel(gd) == B * W * hq * dv, "the gate must be [B, W, Hq Dv]");
    }
    NormRope query = norm_rope_inputs(api, context, 7, B, W, D, "PagedAttention");   // q_norm, cos, sin, perm
    query.epsilon = norm_epsilon, query.fast = fast;
    if (query.any()) {
      q_buffer.resize(static_cast<size_t>(B * W * hq * D));
      query.apply(q, B * W * hq, hq, D, q_buffer.data());
      q = q_buffer.data();
    }
    float* out = gate != nullptr ? output(api, context, 0, {B, W, hq * dv}) : output(api, context, 0, {B, W, hq, dv});
    const int64_t G = hq / hkv;
    const bool vector_rows = fast && D % 16 == 0 && dv % 16 == 0;   // (else the portable form: other shapes)
    const int page_shift = S > 0 && (S & (S - 1)) == 0 ? __builtin_ctzll(static_cast<uint64_t>(S)) : -1;
    auto heads = [&](int64_t first, int64_t last) {
      thread_local std::vector<float> scores, acc;   // per pool thread, kept across calls
      acc.resize(static_cast<size_t>(G * dv));
      for (int64_t task = first; task < last; ++task) {
        const int64_t b = task / hkv, h = task % hkv, n_ctx = ctx[b];
        // pool row of committed position j: page tables[j / S], slot j % S (a shift and a mask for the
        // usual power-of-two S: an integer division per key and value was a cost at long contexts)
        auto pool_row = [&](int64_t j) {
          return page_shift >= 0 ? (tables[b * P + (j >> page_shift)] << page_shift) + (j & (S - 1))
                                 : tables[b * P + j / S] * S + j % S;
        };
        auto key_at = [&](int64_t j) {
          return j < n_ctx ? kc + (pool_row(j) * hkv + h) * D : k + ((b * W + (j - n_ctx)) * hkv + h) * D;
        };
        auto value_at = [&](int64_t j) {
          return j < n_ctx ? vc + (pool_row(j) * hkv + h) * dv : v + ((b * W + (j - n_ctx)) * hkv + h) * dv;
        };
        for (int64_t w = 0; w < W; ++w) {
          const int64_t p = n_ctx + w, lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
          scores.resize(static_cast<size_t>(G * (p - lo + 1)));     // [g][j]
          const float* qrow = q + ((b * W + w) * hq + h * G) * D;
          if (vector_rows) {
            attend_avx512(qrow, G, D, dv, lo, p, scale, key_at, value_at, scores.data(), acc.data());
          } else {
            attend_portable(qrow, G, D, dv, lo, p, scale, key_at, value_at, scores.data(), acc.data());
          }
          const int64_t at = ((b * W + w) * hq + h * G) * dv;
          float* o = out + at;
          if (gate == nullptr) {
            for (int64_t e = 0; e < G * dv; ++e) o[e] = acc[e];
          } else {      // the output gate: o sigmoid(gate), vectorized (std::exp a lane cost 2.5 us a head)
            for (int64_t g = 0; g < G; ++g) {
              sigmoid_gate(acc.data() + g * dv, gate + ((b * W + w) * hq + h * G + g) * gate_row, dv, fast, o + g * dv);
            }
          }
        }
      }
    };
    // each query row reads its context's keys and values
    int64_t bytes = 0;
    for (int64_t b = 0; b < B; ++b) bytes += 4 * W * (ctx[b] + W) * hkv * (D + dv);
    parallel_for(api, context, B * hkv, bytes, heads);
  }
};

}  // namespace

const OrtCustomOp kPagedAttention = custom_op<Kernel>();

}  // namespace tandem
