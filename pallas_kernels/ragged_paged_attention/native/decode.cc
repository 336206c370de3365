// Decode attention on the CPU straight from the paged KV cache: native.py says why.
//
// One query token per sequence, f32 queries and caches [num_blocks, block_size, Hkv, D] with D a
// multiple of 16. Each sequence is one work item: its query heads' scores against its live keys,
// read in place through its block table (no gathered copy), a two-pass softmax (softmax_row),
// then the value sum, each head's accumulators kept in registers.
#include "common.h"

namespace ffi = xla::ffi;

namespace {

using namespace vlax;

struct Scratch {
  std::vector<float> scores, factors;
};

// The 16 lanes' sum as a tree of halves (a chain of 15 adds was the decode step's bottleneck).
inline float lane_sum(vf x) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 lo, hi;
  std::memcpy(&lo, &x, sizeof(v8));
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(v8), sizeof(v8));
  const v8 eight = lo + hi;
  v4 a, b;
  std::memcpy(&a, &eight, sizeof(v4));
  std::memcpy(&b, reinterpret_cast<const char*>(&eight) + sizeof(v4), sizeof(v4));
  const v4 four = a + b;
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// Sequence i's query (token cu_q_lens[i]) against its keys: out [Hq, D] for that token.
template <int C, typename T>
void attend(const Step& st, int64_t i, Scratch& sc) {
  constexpr int D = C * 16;
  const int64_t kv_len = st.kv_lens[i];
  const int64_t token = st.cu_q_lens[i];
  float* out = st.out + token * st.hq * D;
  const float* q = st.q + token * st.hq * D;
  const int32_t* table = st.tables + i * st.width;
  const int64_t first = st.window > 0 ? std::max<int64_t>(0, kv_len - st.window) : 0;
  const int64_t n = kv_len - first;
  const int64_t bs = st.block_size, hq = st.hq, g = st.hq / st.hkv;
  const int64_t row = st.hkv * D, block = bs * row;
  if (n <= 0) return;
  // A block id outside the cache, or a context wider than the table, reads nothing: NaN.
  if (kv_len > st.width * bs) {
    std::fill(out, out + hq * D, kNaN);
    return;
  }
  for (int64_t b = first / bs; b <= (kv_len - 1) / bs; ++b)
    if (table[b] < 0 || table[b] >= st.num_blocks) {
      std::fill(out, out + hq * D, kNaN);
      return;
    }
  auto at = [&](const void* cache, int64_t pos) {
    return static_cast<const T*>(cache) + table[pos / bs] * block + (pos % bs) * row;
  };
  sc.scores.resize(hq * n);
  for (int64_t l = 0; l < n; ++l) {
    const T* key = at(st.k, first + l);
    for (int64_t a = 0; a < hq; ++a) {
      const float* qa = q + a * D;
      const T* kh = key + (a / g) * D;
      vf acc = load(qa) * load(kh);
#pragma GCC unroll 16
      for (int c = 1; c < C; ++c) acc += load(qa + 16 * c) * load(kh + 16 * c);
      float s = lane_sum(acc) * st.scale;
      if (st.soft_cap > 0) s = st.soft_cap * std::tanh(s / st.soft_cap);
      sc.scores[a * n + l] = s;
    }
  }
  const int64_t rb = st.round_block;
  const int64_t first_block = rb ? first / rb : 0;
  const int64_t blocks = rb ? (kv_len - 1) / rb - first_block + 1 : 1;
  sc.factors.resize(blocks);
  for (int64_t a = 0; a < hq; ++a) {
    float* s = sc.scores.data() + a * n;
    const float total = softmax_row(s, 0, n - 1, first, rb, first_block, blocks, sc.factors.data());
    const int64_t h = a / g;
    vf o[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) o[c] = vf{};
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t from = rb ? std::max<int64_t>(0, (first_block + b) * rb - first) : 0;
      const int64_t to = rb ? std::min<int64_t>(n - 1, (first_block + b + 1) * rb - first - 1) : n - 1;
      vf part[C];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) part[c] = vf{};
      for (int64_t l = from; l <= to; ++l) {
        const T* value = at(st.v, first + l) + h * D;
        const float p = s[l];
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) part[c] += p * load(value + 16 * c);
      }
      const float f = sc.factors[b];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) o[c] += f * part[c];
    }
    bool finite = true;
    for (int c = 0; c < C; ++c) finite = finite && all_finite(o[c]);
    if (!finite) {
      // masked_values.py's rule: a head that attends a non-finite value row is NaN; otherwise
      // the plain sum stands (an overflow stays inf, as in the reference).
      for (int64_t l = 0; l < n; ++l) {
        const T* value = at(st.v, first + l) + h * D;
        bool bad = false;
        for (int c = 0; c < C; ++c) bad = bad || !all_finite(load(value + 16 * c));
        if (bad) {
          for (int c = 0; c < C; ++c) o[c] = vf{} + kNaN;
          break;
        }
      }
    }
    const float inv = 1.0f / total;
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) store(out + a * D + 16 * c, o[c] * inv);
  }
}

template <int C, typename T>
struct Kernel {
  static void run(const Step& st, int64_t item, Scratch& sc) { attend<C, T>(st, item, sc); }
};

using Attend = decltype(&Kernel<1, float>::run);

struct Sequence {
  using Scratch = ::Scratch;
  Step step;
  Attend attend;
  void operator()(int32_t i, Scratch& scratch) const { attend(step, i, scratch); }
};

ffi::Error Decode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                  ffi::AnyBuffer v, ffi::Buffer<ffi::S32> kv_lens,
                  ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> cu_q_lens,
                  ffi::Buffer<ffi::S32> num_seqs, float sm_scale, int64_t window, float soft_cap,
                  int64_t round_block, ffi::ResultBuffer<ffi::F32> out) {
  ffi::Error error = ffi::Error::Success();
  const Attend fn = for_call<Kernel>("native decode", q, k, v, &error);
  if (fn == nullptr) return error;
  const auto qd = q.dimensions(), kd = k.dimensions();
  const int64_t total = qd[0] * qd[1] * qd[2];
  float* o = out->typed_data();
  std::fill(o, o + total, 0.0f);
  const int64_t seqs = std::min<int64_t>(num_seqs.typed_data()[0], kv_lens.dimensions()[0]);
  const int32_t* cu = cu_q_lens.typed_data();
  for (int64_t i = 0; i < seqs; ++i) {
    if (cu[i + 1] - cu[i] > 1 || cu[i] < 0 || (cu[i + 1] > cu[i] && cu[i] >= qd[0])) {
      // Not a decode step (or rows outside q): all NaN, as decode.py answers a broken promise.
      std::fill(o, o + total, kNaN);
      return ffi::Error::Success();
    }
  }
  const Step step{q.typed_data(), k.untyped_data(), v.untyped_data(), kv_lens.typed_data(),
                  tables.typed_data(), cu, o, kd[0], kd[1], kd[2], qd[1], tables.dimensions()[1],
                  sm_scale, soft_cap, window, round_block};
  auto work = std::make_shared<Work<int32_t, Sequence>>();
  work->fn = Sequence{step, fn};
  for (int64_t i = 0; i < seqs; ++i)  // only sequences with a query token are work items
    if (cu[i + 1] > cu[i]) work->items.push_back(static_cast<int32_t>(i));
  run_on(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VlaxPagedDecode, Decode, vlax::attention_binding());
