// Causal attention of a step's query rows on the CPU, read in place from the paged cache:
// native.py says why and what it serves.
//
// f32 queries and caches [num_blocks, block_size, Hkv, D], D a multiple of 16. A work item is a
// tile of one sequence's query tokens and one kv head: its rows (tokens x the kv head's query
// heads) score the keys up to the tile's last position, 16 keys at a time against a transposed
// copy of those keys (each row's 16 scores one vector), take a two-pass softmax (softmax_row),
// then sum the values four rows at a time with their accumulators in registers.
#include "common.h"

namespace ffi = xla::ffi;

namespace {

using namespace vlax;

constexpr int kRowTarget = 64;  // rows (tokens x grouped heads) of a work item

struct Item {
  int32_t seq, head, first_token, tokens;  // tokens of the tile: [first_token, + tokens)
};

struct Scratch {
  std::vector<float> scores, keys, q, factors, total;
  std::vector<int64_t> lo, hi;
};

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
  for (int64_t b = pos0 / bs; b <= last / bs; ++b)
    if (table[b] < 0 || table[b] >= st.num_blocks) return fail();
  auto at = [&](const void* cache, int64_t pos) {
    return static_cast<const T*>(cache) + table[pos / bs] * block_floats +
           (pos % bs) * row_floats + it.head * D;
  };
  const int64_t span = last - pos0 + 1;
  const int64_t padded = (span + kLanes - 1) / kLanes * kLanes;
  sc.scores.resize(rows * padded);
  sc.keys.resize(D * kLanes);
  sc.q.resize(rows * D);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = st.q + ((it.first_token + r / g) * st.hq + it.head * g + r % g) * D;
    std::copy(src, src + D, sc.q.data() + r * D);
  }
  // Scores: 16 keys at a time, transposed once to [D][16] and read by every row.
  for (int64_t k0 = 0; k0 < padded; k0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, span - k0);
    for (int64_t i = 0; i < kLanes; ++i) {
      const T* key = i < count ? at(st.k, pos0 + k0 + i) : nullptr;
      for (int64_t d = 0; d < D; ++d) sc.keys[d * kLanes + i] = key ? widen(key[d]) : 0.0f;
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      vf a0{}, a1{}, a2{}, a3{};
      const float* q0 = sc.q.data() + r * D;
      for (int64_t d = 0; d < D; ++d) {
        const vf kd = load(sc.keys.data() + d * kLanes);
        a0 += q0[d] * kd;
        a1 += q0[D + d] * kd;
        a2 += q0[2 * D + d] * kd;
        a3 += q0[3 * D + d] * kd;
      }
      store(sc.scores.data() + r * padded + k0, a0);
      store(sc.scores.data() + (r + 1) * padded + k0, a1);
      store(sc.scores.data() + (r + 2) * padded + k0, a2);
      store(sc.scores.data() + (r + 3) * padded + k0, a3);
    }
    for (; r < rows; ++r) {
      vf a{};
      const float* qr = sc.q.data() + r * D;
      for (int64_t d = 0; d < D; ++d) a += qr[d] * load(sc.keys.data() + d * kLanes);
      store(sc.scores.data() + r * padded + k0, a);
    }
  }
  // Each row's softmax over its own keys; the others' scores are never read.
  const int64_t rb = st.round_block;
  const int64_t first_block = rb ? pos0 / rb : 0;
  const int64_t blocks = rb ? last / rb - first_block + 1 : 1;
  sc.lo.resize(rows);
  sc.hi.resize(rows);
  sc.total.resize(rows);
  sc.factors.resize(rows * blocks);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = base + r / g;
    sc.lo[r] = first_key(pos) - pos0;
    sc.hi[r] = pos - pos0;
    float* s = sc.scores.data() + r * padded;
    for (int64_t l = sc.lo[r]; l <= sc.hi[r]; ++l) {
      float x = s[l] * st.scale;
      if (st.soft_cap > 0) x = st.soft_cap * std::tanh(x / st.soft_cap);
      s[l] = x;
    }
    sc.total[r] = softmax_row(s, sc.lo[r], sc.hi[r], pos0, rb, first_block, blocks,
                              sc.factors.data() + r * blocks);
  }
  // Values, block by block (one block unless rounding): four rows at a time over the keys of
  // the block all four attend, then each row's own rest, each row's part scaled by its factor.
  auto row_sum = [&](int64_t r, int64_t from, int64_t to, vf* o) {
    const float* s = sc.scores.data() + r * padded;
    for (int64_t l = from; l <= to; ++l) {
      const T* value = at(st.v, pos0 + l);
      const float p = s[l];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) o[c] += p * load(value + 16 * c);
    }
  };
  auto finish = [&](int64_t r, vf* o) {
    bool finite = true;
    for (int c = 0; c < C; ++c) finite = finite && all_finite(o[c]);
    if (!finite) {  // masked_values.py: an attended non-finite value row makes the row NaN
      for (int64_t l = sc.lo[r]; l <= sc.hi[r]; ++l) {
        const T* value = at(st.v, pos0 + l);
        bool bad = false;
        for (int c = 0; c < C; ++c) bad = bad || !all_finite(load(value + 16 * c));
        if (bad) {
          for (int c = 0; c < C; ++c) o[c] = vf{} + kNaN;
          break;
        }
      }
    }
    const float inv = 1.0f / sc.total[r];
    for (int c = 0; c < C; ++c) store(out_row(r) + 16 * c, o[c] * inv);
  };
  for (int64_t r = 0; r < rows; r += 4) {
    const int64_t n = std::min<int64_t>(4, rows - r);
    vf o[4][C], part[4][C];
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < C; ++c) o[i][c] = vf{};
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t b_from = rb ? std::max<int64_t>(0, (first_block + b) * rb - pos0) : 0;
      const int64_t b_to = rb ? std::min(span - 1, (first_block + b + 1) * rb - pos0 - 1) : span - 1;
      int64_t from = b_from, to = b_to;
      for (int64_t i = 0; i < n; ++i) {
        from = std::max(from, sc.lo[r + i]);
        to = std::min(to, sc.hi[r + i]);
      }
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < C; ++c) part[i][c] = vf{};
      if (n == 4) {
        const float* s0 = sc.scores.data() + r * padded;
        for (int64_t l = from; l <= to; ++l) {
          const T* value = at(st.v, pos0 + l);
          const float p0 = s0[l], p1 = s0[padded + l], p2 = s0[2 * padded + l];
          const float p3 = s0[3 * padded + l];
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c) {
            const vf x = load(value + 16 * c);
            part[0][c] += p0 * x;
            part[1][c] += p1 * x;
            part[2][c] += p2 * x;
            part[3][c] += p3 * x;
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t lo = std::max(b_from, sc.lo[r + i]), hi = std::min(b_to, sc.hi[r + i]);
        if (n < 4 || from > to) {
          row_sum(r + i, lo, hi, part[i]);
        } else {
          row_sum(r + i, lo, from - 1, part[i]);
          row_sum(r + i, to + 1, hi, part[i]);
        }
        const float f = sc.factors[(r + i) * blocks + b];
        for (int c = 0; c < C; ++c) o[i][c] += f * part[i][c];
      }
    }
    for (int64_t i = 0; i < n; ++i) finish(r + i, o[i]);
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
                   ffi::Buffer<ffi::S32> num_seqs, float sm_scale, int64_t window, float soft_cap,
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
  // Costliest tiles (tokens x their last position) first: the last items claimed are short.
  auto cost = [&](const Item& a) {
    return (lens[a.seq] - (cu[a.seq + 1] - a.first_token - a.tokens)) * int64_t{a.tokens};
  };
  std::stable_sort(work->items.begin(), work->items.end(),
                   [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  work->fn = Tile{Step{q.typed_data(), k.untyped_data(), v.untyped_data(), lens, tables.typed_data(),
                       cu, o, kd[0], kd[1], kd[2], qd[1], tables.dimensions()[1], sm_scale,
                       soft_cap, window, round_block},
                  fn};
  run_on(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VlaxPagedPrefill, Prefill, vlax::attention_binding());
