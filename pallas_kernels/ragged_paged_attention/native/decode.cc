// Decode attention on the CPU straight from the paged KV cache: native.py says why.
//
// One query token per sequence, f32 queries and caches [num_blocks, block_size, Hkv, D] (f32 or
// bf16) with D a multiple of 16. Each sequence is one work item, read in place through its block
// table (no gathered copy) with the next rows prefetched (its blocks lie anywhere in the cache):
// per kv head, 16 keys at a time are widened once and scored by each of its query heads, the 16
// dots summed together (`sums`); a two-pass softmax per head (softmax_row); then the value sum,
// each value row widened once for up to four query heads, their accumulators in registers.
#include "common.h"

namespace ffi = xla::ffi;

namespace {

using namespace vlax;

struct Scratch {
  std::vector<float> scores, keys, totals, factors, zeros;
};

// Two vectors' lanes folded pairwise: lane i of the result is xy[lo[i]] + xy[hi[i]], xy being
// x's 16 lanes then y's.
inline vf fold(vf x, vf y, vi lo, vi hi) {
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

// Lane i of `sums`: the sum of the 16 lanes of acc[kReversed[i]] (the folds hand lanes back in
// bit-reversed order, so the score loop puts key kReversed[t] in acc[t] and gets key i in lane
// i): four rounds of pairwise folds, 45 vector ops for 16 sums where one lane sum each cost 8
// (the score loop's cost when each key's dot was summed alone).
constexpr int kReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline vf sums(const vf* acc) {
  const vi lo1{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi hi1 = lo1 + 8;
  const vi lo2{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const vi hi2 = lo2 + 4;
  const vi lo3{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const vi hi3 = lo3 + 2;
  const vi lo4{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const vi hi4 = lo4 + 1;
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = fold(acc[2 * i], acc[2 * i + 1], lo1, hi1);
  for (int i = 0; i < 4; ++i) b[i] = fold(a[2 * i], a[2 * i + 1], lo2, hi2);
  for (int i = 0; i < 2; ++i) c[i] = fold(b[2 * i], b[2 * i + 1], lo3, hi3);
  return fold(c[0], c[1], lo4, hi4);
}

constexpr int64_t kAhead = 8;  // value rows prefetched ahead

// The cache lines of one head's row of D values, asked for ahead of their use: blocks lie
// anywhere in the cache, where the hardware prefetcher does not follow.
template <int D, typename T>
inline void prefetch(const T* row) {
  for (int64_t byte = 0; byte < D * int64_t{sizeof(T)}; byte += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + byte);
}

// Values of one kv head for `NT` of its query heads at once (from head `a0`), each value row
// widened once for all of them; `p` holds their probabilities (already scaled to the row's
// maximum), `stride` apart.
template <int C, typename T, int NT, typename At>
void sum_values(const Step& st, const At& at, int64_t first, int64_t n, int64_t h, int64_t a0,
                const float* p, int64_t stride, const float* totals, float* out) {
  constexpr int D = C * 16;
  vf o[NT][C];
#pragma GCC unroll 16
  for (int j = 0; j < NT; ++j)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) o[j][c] = vf{};
  for (int64_t l = 0; l < n; ++l) {
    const T* value = at(st.v, first + l) + h * D;
    if (l + kAhead < n) prefetch<D, T>(at(st.v, first + l + kAhead) + h * D);
    vf x[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) x[c] = load(value + 16 * c);
#pragma GCC unroll 16
    for (int j = 0; j < NT; ++j) {
      const float pj = p[j * stride + l];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) o[j][c] += pj * x[c];
    }
  }
  for (int j = 0; j < NT; ++j) {
    mask_non_finite<C>(o[j], 0, n - 1, [&](int64_t l) { return at(st.v, first + l) + h * D; });
    const float inv = 1.0f / totals[a0 + j];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) store(out + (a0 + j) * D + 16 * c, o[j][c] * inv);
  }
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
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  sc.scores.resize(hq * padded);
  sc.keys.resize(kLanes * D);
  sc.zeros.assign(D, 0.0f);
  sc.totals.resize(hq);
  // Scores: 16 keys of one kv head at a time, widened once into `keys` (key kReversed[t] in row
  // t, so that `sums` hands back key t in lane t), then each of its query heads' 16 dots.
  for (int64_t h = 0; h < st.hkv; ++h) {
    for (int64_t l0 = 0; l0 < n; l0 += kLanes) {
      const int64_t count = std::min<int64_t>(kLanes, n - l0);
      for (int64_t t = l0 + kLanes; t < std::min<int64_t>(n, l0 + 2 * kLanes); ++t)
        prefetch<D, T>(at(st.k, first + t) + h * D);
      const float* rows[kLanes];
      for (int t = 0; t < kLanes; ++t) {
        if (kReversed[t] >= count) {
          rows[t] = sc.zeros.data();
        } else if constexpr (std::is_same_v<T, float>) {
          rows[t] = at(st.k, first + l0 + kReversed[t]) + h * D;
        } else {  // widened once here for all the kv head's query heads
          const T* key = at(st.k, first + l0 + kReversed[t]) + h * D;
          float* dst = sc.keys.data() + t * D;
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c) store(dst + 16 * c, load(key + 16 * c));
          rows[t] = dst;
        }
      }
      for (int64_t a = h * g; a < (h + 1) * g; ++a) {
        vf qa[C];
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) qa[c] = load(q + a * D + 16 * c);
        vf acc[kLanes];
#pragma GCC unroll 16
        for (int t = 0; t < kLanes; ++t) {
          vf dot = qa[0] * load(rows[t]);
#pragma GCC unroll 16
          for (int c = 1; c < C; ++c) dot += qa[c] * load(rows[t] + 16 * c);
          acc[t] = dot;
        }
        float* s = sc.scores.data() + a * padded + l0;
        store(s, sums(acc) * st.scale);
        if (st.soft_cap > 0)
          for (int64_t t = 0; t < count; ++t) s[t] = st.soft_cap * std::tanh(s[t] / st.soft_cap);
      }
    }
  }
  const int64_t rb = st.round_block;
  const int64_t first_block = rb ? first / rb : 0;
  const int64_t blocks = rb ? (kv_len - 1) / rb - first_block + 1 : 1;
  sc.factors.resize(blocks);
  for (int64_t a = 0; a < hq; ++a) {
    float* s = sc.scores.data() + a * padded;
    sc.totals[a] = softmax_row(s, 0, n - 1, first, rb, first_block, blocks, sc.factors.data());
  }
  // Values: up to four query heads per pass over a kv head's rows (tiles may overlap: a head
  // summed twice gets the same result twice).
  const int64_t tile = g >= 4 && C <= 4 ? 4 : g >= 2 && C <= 8 ? 2 : 1;
  for (int64_t h = 0; h < st.hkv; ++h)
    for (int64_t j = 0; j < g; j += tile) {
      const int64_t a0 = h * g + std::min(j, g - tile);
      const float* p = sc.scores.data() + a0 * padded;
      if (tile == 4)
        sum_values<C, T, 4>(st, at, first, n, h, a0, p, padded, sc.totals.data(), out);
      else if (tile == 2)
        sum_values<C, T, 2>(st, at, first, n, h, a0, p, padded, sc.totals.data(), out);
      else
        sum_values<C, T, 1>(st, at, first, n, h, a0, p, padded, sc.totals.data(), out);
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
                  ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> prefix_lens,
                  float sm_scale, int64_t window, float soft_cap,
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
  (void)prefix_lens;  // a decode row's one query is its last position: causal either way
  const Step step{q.typed_data(), k.untyped_data(), v.untyped_data(), kv_lens.typed_data(),
                  tables.typed_data(), cu, nullptr, o, kd[0], kd[1], kd[2], qd[1],
                  tables.dimensions()[1], sm_scale, soft_cap, window, round_block};
  auto work = std::make_shared<Work<int32_t, Sequence>>();
  work->fn = Sequence{step, fn};
  for (int64_t i = 0; i < seqs; ++i)  // only sequences with a query token are work items
    if (cu[i + 1] > cu[i]) work->items.push_back(static_cast<int32_t>(i));
  run_on(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VlaxPagedDecode, Decode, vlax::attention_binding());
