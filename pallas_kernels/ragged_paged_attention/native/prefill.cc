// Causal (or prefix-LM) attention of a step's query rows on the CPU, read in place from the
// paged cache: native.py says why and what it serves.
//
// f32 queries and caches [num_blocks, block_size, Hkv, D] (f32 or bf16), D a multiple of 16. A
// work item is a tile of one sequence's query tokens and one kv head: its rows (tokens x the kv
// head's query heads) score the keys up to the tile's last key, 16 keys at a time against
// a copy of those keys transposed in registers (each row's 16 scores one vector), take a softmax
// (softmax_row, its probabilities relative to the row's maximum), then sum the values four
// rows at a time with their accumulators in registers.
#include "common.h"

namespace ffi = xla::ffi;

namespace {

using namespace vlax;

constexpr int kRowTarget = 64;  // rows (tokens x grouped heads) of a work item

struct Item {
  int32_t seq, head, first_token, tokens;  // tokens of the tile: [first_token, + tokens)
};

struct Scratch {
  std::vector<float> scores, keys, q, factors, total, values;
  std::vector<int64_t> lo, hi;
  std::vector<const float*> value_rows;
};

typedef int32_t vi __attribute__((vector_size(64)));

// One round of `transpose`: rows i and i + S swap their off-diagonal blocks of S lanes.
template <int S>
inline void transpose_round(vf* x, vi lo, vi hi) {
  for (int i = 0; i < kLanes; ++i)
    if (!(i & S)) {
      const vf a = x[i], b = x[i + S];
      x[i] = __builtin_shuffle(a, b, lo);
      x[i + S] = __builtin_shuffle(a, b, hi);
    }
}

// x[i][j] <-> x[j][i] in registers: four rounds, each swapping the off-diagonal blocks of half
// the size within each pair of rows (a scalar copy of each element cost more than the scores).
inline void transpose(vf* x) {
  transpose_round<8>(x, vi{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                     vi{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  transpose_round<4>(x, vi{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                     vi{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  transpose_round<2>(x, vi{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                     vi{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  transpose_round<1>(x, vi{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
                     vi{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
}

// Rows r..r+R-1's scores against the 16 transposed keys of chunk k0 (sc.keys, [D][16]).
template <int D, int R>
inline void score_rows(Scratch& sc, int64_t r, int64_t padded, int64_t k0) {
  vf acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = vf{};
  const float* q = sc.q.data() + r * D;
  for (int64_t d = 0; d < D; ++d) {
    const vf kd = load(sc.keys.data() + d * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[i] += q[i * D + d] * kd;
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) store(sc.scores.data() + (r + i) * padded + k0, acc[i]);
}

// o[i] += sum over keys l in [from, to] of p[i * stride + l] * value row l, for R rows at once.
template <int C, int R>
inline void sum_values(const float* const* vrows, const float* p, int64_t stride, int64_t from,
                       int64_t to, vf (*o)[C]) {
  vf acc[R][C];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[i][c] = o[i][c];
  for (int64_t l = from; l <= to; ++l) {
    const float* value = vrows[l];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const vf x = load(value + 16 * c);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) acc[i][c] += p[i * stride + l] * x;
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) o[i][c] = acc[i][c];
}

// One tile: row r is token r / G of the tile and query head r % G of the kv head; its keys are
// the offsets [lo[r], hi[r]] from the tile's first key position.
template <int C, typename T>
void attend(const Step& st, const Item& it, Scratch& sc) {
  constexpr int D = C * 16;
  const int64_t g = st.hq / st.hkv, bs = st.block_size;
  const int64_t row_floats = st.hkv * D, block_floats = bs * row_floats;
  const int64_t kv_len = st.kv_lens[it.seq];
  const int64_t q_len = st.cu_q_lens[it.seq + 1] - st.cu_q_lens[it.seq];
  const int64_t rows = it.tokens * g;
  const int32_t* table = st.tables + it.seq * st.width;
  // Token j of the tile sits at position base + j.
  const int64_t base = kv_len - q_len + (it.first_token - st.cu_q_lens[it.seq]);
  const int64_t last = base + it.tokens - 1;
  // A prefix LM's token sees every key up to max(its position, prefix - 1) (reference.py).
  const int64_t prefix_end = std::min<int64_t>(st.prefix_lens[it.seq], kv_len) - 1;
  const int64_t reach = std::max(last, prefix_end);  // the tile's last key
  auto first_key = [&](int64_t pos) {
    return st.window > 0 ? std::max<int64_t>(0, pos - st.window + 1) : 0;
  };
  const int64_t pos0 = first_key(base);  // the tile's first key position: offset 0
  auto out_row = [&](int64_t r) {
    return st.out + ((it.first_token + r / g) * st.hq + it.head * g + r % g) * D;
  };
  auto fail = [&] {
    for (int64_t r = 0; r < rows; ++r) std::fill(out_row(r), out_row(r) + D, kNaN);
  };
  if (base < 0 || kv_len > st.width * bs) return fail();
  for (int64_t b = pos0 / bs; b <= reach / bs; ++b)
    if (table[b] < 0 || table[b] >= st.num_blocks) return fail();
  auto at = [&](const void* cache, int64_t pos) {
    return static_cast<const T*>(cache) + table[pos / bs] * block_floats +
           (pos % bs) * row_floats + it.head * D;
  };
  const int64_t span = reach - pos0 + 1;
  const int64_t padded = (span + kLanes - 1) / kLanes * kLanes;
  sc.scores.resize(rows * padded);
  sc.keys.resize(D * kLanes);
  sc.q.resize(rows * D);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = st.q + ((it.first_token + r / g) * st.hq + it.head * g + r % g) * D;
    std::copy(src, src + D, sc.q.data() + r * D);
  }
  // Scores: 16 keys at a time, transposed once to [D][16] and read by every row, eight rows
  // at a time (eight accumulators keep both FMA ports busy; four left half of them idle).
  for (int64_t k0 = 0; k0 < padded; k0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, span - k0);
    const T* keys[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) keys[i] = i < count ? at(st.k, pos0 + k0 + i) : nullptr;
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      vf block[kLanes];
      for (int i = 0; i < kLanes; ++i) block[i] = keys[i] ? load(keys[i] + 16 * c) : vf{};
      transpose(block);
      for (int i = 0; i < kLanes; ++i) store(sc.keys.data() + (16 * c + i) * kLanes, block[i]);
    }
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8) score_rows<D, 8>(sc, r, padded, k0);
    for (; r + 4 <= rows; r += 4) score_rows<D, 4>(sc, r, padded, k0);
    for (; r < rows; ++r) score_rows<D, 1>(sc, r, padded, k0);
  }
  // Each row's softmax over its own keys (the others' scores are never read).
  const int64_t rb = st.round_block;
  const int64_t first_block = rb ? pos0 / rb : 0;
  const int64_t blocks = rb ? reach / rb - first_block + 1 : 1;
  sc.lo.resize(rows);
  sc.hi.resize(rows);
  sc.total.resize(rows);
  sc.factors.resize(blocks);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = base + r / g;
    const int64_t lo = first_key(pos) - pos0, hi = std::max(pos, prefix_end) - pos0;
    sc.lo[r] = lo;
    sc.hi[r] = hi;
    float* s = sc.scores.data() + r * padded;
    if (st.soft_cap > 0) {
      for (int64_t l = lo; l <= hi; ++l) s[l] = st.soft_cap * std::tanh(s[l] * st.scale / st.soft_cap);
    } else {
      for (int64_t l = lo; l <= hi; ++l) s[l] *= st.scale;
    }
    sc.total[r] = softmax_row(s, lo, hi, pos0, rb, first_block, blocks, sc.factors.data());
  }
  // Values: each row of the span widened once (bf16) or read in place (f32), then summed four
  // rows at a time over the keys all four attend, and each row's own rest alone.
  sc.value_rows.resize(span);
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t l = 0; l < span; ++l) sc.value_rows[l] = at(st.v, pos0 + l);
  } else {
    sc.values.resize(span * D);
    for (int64_t l = 0; l < span; ++l) {
      const T* value = at(st.v, pos0 + l);
      float* dst = sc.values.data() + l * D;
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) store(dst + 16 * c, load(value + 16 * c));
      sc.value_rows[l] = dst;
    }
  }
  const float* const* vrows = sc.value_rows.data();
  auto finish = [&](int64_t r, vf* o) {
    mask_non_finite<C>(o, sc.lo[r], sc.hi[r], [&](int64_t l) { return vrows[l]; });
    const float inv = 1.0f / sc.total[r];
    for (int c = 0; c < C; ++c) store(out_row(r) + 16 * c, o[c] * inv);
  };
  constexpr int kGroup = C <= 4 ? 4 : C <= 8 ? 2 : 1;  // rows summed together, in registers
  for (int64_t r = 0; r < rows; r += kGroup) {
    const int64_t n = std::min<int64_t>(kGroup, rows - r);
    vf o[kGroup][C];
    for (int i = 0; i < kGroup; ++i)
      for (int c = 0; c < C; ++c) o[i][c] = vf{};
    int64_t from = 0, to = span - 1;
    for (int64_t i = 0; i < n; ++i) {
      from = std::max(from, sc.lo[r + i]);
      to = std::min(to, sc.hi[r + i]);
    }
    if (n == kGroup && from <= to) {
      sum_values<C, kGroup>(vrows, sc.scores.data() + r * padded, padded, from, to, o);
    } else {
      from = to + 1;  // no common range: each row alone over its own keys
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* p = sc.scores.data() + (r + i) * padded;
      sum_values<C, 1>(vrows, p, padded, sc.lo[r + i], std::min(from - 1, sc.hi[r + i]), &o[i]);
      sum_values<C, 1>(vrows, p, padded, std::max(to + 1, sc.lo[r + i]), sc.hi[r + i], &o[i]);
      finish(r + i, o[i]);
    }
  }
}

template <int C, typename T>
struct Kernel {
  static void run(const Step& st, const Item& item, Scratch& sc) { attend<C, T>(st, item, sc); }
};

using Attend = decltype(&Kernel<1, float>::run);

struct Tile {
  using Scratch = ::Scratch;
  Step step;
  Attend attend;
  void operator()(const Item& it, Scratch& scratch) const { attend(step, it, scratch); }
};

ffi::Error Prefill(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::Buffer<ffi::S32> kv_lens,
                   ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> cu_q_lens,
                   ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> prefix_lens,
                   float sm_scale, int64_t window, float soft_cap,
                   int64_t round_block, ffi::ResultBuffer<ffi::F32> out) {
  ffi::Error error = ffi::Error::Success();
  const Attend fn = for_call<Kernel>("native prefill", q, k, v, &error);
  if (fn == nullptr) return error;
  const auto qd = q.dimensions(), kd = k.dimensions();
  const int64_t t = qd[0], total = qd[0] * qd[1] * qd[2];
  float* o = out->typed_data();
  std::fill(o, o + total, 0.0f);
  const int64_t seqs = std::min<int64_t>(num_seqs.typed_data()[0], kv_lens.dimensions()[0]);
  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  if (prefix_lens.dimensions()[0] < seqs)
    return ffi::Error::InvalidArgument("native prefill: prefix_lens [S] shorter than the sequences");
  const int64_t g = qd[1] / kd[2];
  const int64_t tile = std::max<int64_t>(1, kRowTarget / g);
  auto work = std::make_shared<Work<Item, Tile>>();
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t q_len = cu[i + 1] - cu[i];
    if (q_len < 0 || cu[i] < 0 || cu[i + 1] > t || q_len > lens[i]) {
      // Rows outside q, or more query tokens than context: not a causal step. All NaN.
      std::fill(o, o + total, kNaN);
      return ffi::Error::Success();
    }
    for (int64_t start = 0; start < q_len; start += tile)
      for (int64_t h = 0; h < kd[2]; ++h)
        work->items.push_back(Item{static_cast<int32_t>(i), static_cast<int32_t>(h),
                                   static_cast<int32_t>(cu[i] + start),
                                   static_cast<int32_t>(std::min(tile, q_len - start))});
  }
  // Costliest tiles (tokens x their last key) first: the last items claimed are short.
  auto cost = [&](const Item& a) {
    const int64_t reach = std::max<int64_t>(lens[a.seq] - (cu[a.seq + 1] - a.first_token - a.tokens),
                                            std::min(prefix_lens.typed_data()[a.seq], lens[a.seq]));
    return reach * int64_t{a.tokens};
  };
  std::stable_sort(work->items.begin(), work->items.end(),
                   [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  work->fn = Tile{Step{q.typed_data(), k.untyped_data(), v.untyped_data(), lens, tables.typed_data(),
                       cu, prefix_lens.typed_data(), o, kd[0], kd[1], kd[2], qd[1],
                       tables.dimensions()[1], sm_scale, soft_cap, window, round_block},
                  fn};
  run_on(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VlaxPagedPrefill, Prefill, vlax::attention_binding());
