// What the native attention kernels share: 16-lane vectors, their exp, the softmax of one row
// (with a bf16 model's rounding), and the work queue over XLA's intra-op threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace vlax {

typedef float vf __attribute__((vector_size(64)));  // 16 lanes: one zmm, two ymm on AVX2

constexpr int kLanes = 16;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

inline vf load(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(vf));
  return x;
}

inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof(vf)); }

// Caches hold f32, or bf16 as its bits (uint16_t): 16 of them widen to one vector exactly.
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));

inline vf load(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof(vh));
  const vu w = __builtin_convertvector(h, vu) << 16;
  vf x;
  std::memcpy(&x, &w, sizeof(vf));
  return x;
}

inline float widen(float x) { return x; }

inline float widen(uint16_t bits) {
  const uint32_t w = uint32_t{bits} << 16;
  float x;
  std::memcpy(&x, &w, 4);
  return x;
}

inline bool all_finite(vf x) {
  for (int i = 0; i < kLanes; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

// masked_values.py's rule for one head's output `o` ([C] vectors), summed over the value rows
// row(l) for l in [lo, hi]: where the sum is not finite and one of those rows holds a non-finite
// value, the head is NaN; otherwise the plain sum stands (an overflow stays inf, as in the
// reference). The rows are searched only when the sum says one may be bad.
template <int C, typename Row>
inline void mask_non_finite(vf* o, int64_t lo, int64_t hi, const Row& row) {
  bool finite = true;
  for (int c = 0; c < C; ++c) finite = finite && all_finite(o[c]);
  if (finite) return;
  for (int64_t l = lo; l <= hi; ++l) {
    bool bad = false;
    for (int c = 0; c < C; ++c) bad = bad || !all_finite(load(row(l) + 16 * c));
    if (bad) {
      for (int c = 0; c < C; ++c) o[c] = vf{} + kNaN;
      return;
    }
  }
}

typedef int32_t vi __attribute__((vector_size(64)));

// e^x for x <= 0 on 16 lanes as 2^n e^r, r = x - n ln2 in [-ln2/2, ln2/2] (Cody-Waite split,
// Cephes' expf polynomial), written as vector operations: a scalar form vectorized only 8 lanes
// wide, and not inside a loop that also sums. Below kExpFloor the result is 0: e^x is then under
// 2^-125, and every caller takes it relative to a term of 1 (the row's maximum), so what it
// drops is below f32's resolution of that sum; above it 2^n is one normal float. NaN stays NaN.
constexpr float kExpFloor = -87.0f;

inline vf exp_nonpositive(vf x) {
  const vf zero{}, floor = zero + kExpFloor;
  const vf xc = x > floor ? (x < zero ? x : zero) : floor;
  // n = xc log2 e rounded to an integer by adding and taking away 1.5 * 2^23 (|xc log2 e| < 2^22);
  // r takes up whatever n is off by.
  const vf magic = zero + 12582912.0f;
  const vf n = (xc * 1.44269504088896341f + magic) - magic;
  const vf r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  vf p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n, n in [-126, 0]
  vf scale;
  std::memcpy(&scale, &bits, sizeof(vf));
  const vf y = p * scale;
  return x != x ? x : (x < floor ? zero : y);
}

// The sum and the largest of x's 16 lanes, folded in halves (four vector steps, where a lane at
// a time was fifteen dependent scalar ones).
template <typename Op>
inline vf fold(vf x, Op op) {
  x = op(x, __builtin_shuffle(x, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  x = op(x, __builtin_shuffle(x, vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  x = op(x, __builtin_shuffle(x, vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  return op(x, __builtin_shuffle(x, vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
}

inline float lane_sum(vf x) {
  return fold(x, [](vf a, vf b) { return a + b; })[0];
}

// NaN passed over, as std::max does: a NaN lane loses to any number.
inline float lane_max(vf x) {
  return fold(x, [](vf a, vf b) { return a > b || b != b ? a : b; })[0];
}

// x rounded to the nearest bfloat16 (ties to even), as floats; NaN stays NaN.
inline vf round_bf16(vf x) {
  typedef uint32_t vu32 __attribute__((vector_size(64)));
  vu32 bits;
  std::memcpy(&bits, &x, sizeof(vf));
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  vf y;
  std::memcpy(&y, &bits, sizeof(vf));
  return x != x ? x : y;
}

// One attention step's arguments, as the kernels read them.
struct Step {
  const float* q;
  const void* k;  // T: float or uint16_t (bf16 bits), the caches' element
  const void* v;
  const int32_t* kv_lens;
  const int32_t* tables;
  const int32_t* cu_q_lens;
  const int32_t* prefix_lens;  // [S]: a prefix LM's two-way prefix (0: causal)
  float* out;
  int64_t num_blocks, block_size, hkv, hq, width;
  float scale, soft_cap;  // soft_cap 0: none
  int64_t window;         // 0: none
  int64_t round_block;    // 0: f32 probabilities; else bf16 ones per block of keys (softmax_row)
};

// Kernel<C, T>::run for head dim 16 C and cache element T: a library serves the one head dim
// it was built for (VLAX_HEAD_DIM, native.py: compiling every head dim cost ~9 s per kernel on
// a first run, one ~3 s, mostly XLA's FFI headers); nullptr for another.
#ifndef VLAX_HEAD_DIM
#error "build with -DVLAX_HEAD_DIM=<a multiple of 16> (native.py)"
#endif
static_assert(VLAX_HEAD_DIM > 0 && VLAX_HEAD_DIM % 16 == 0, "VLAX_HEAD_DIM: a multiple of 16");

template <template <int, typename> class Kernel, typename T>
auto for_head_dim(int64_t d) -> decltype(&Kernel<1, T>::run) {
  return d == VLAX_HEAD_DIM ? &Kernel<VLAX_HEAD_DIM / 16, T>::run : nullptr;
}

// The attention kernels' entry: Kernel's run for these shapes and cache dtype, or the error
// naming what does not fit (`what`: the kernel's name).
template <template <int, typename> class Kernel>
auto for_call(const char* what, xla::ffi::Buffer<xla::ffi::F32>& q, xla::ffi::AnyBuffer& k,
              xla::ffi::AnyBuffer& v, xla::ffi::Error* error) -> decltype(&Kernel<1, float>::run) {
  namespace ffi = xla::ffi;
  const auto qd = q.dimensions(), kd = k.dimensions();
  const std::string name(what);
  if (qd.size() != 3 || kd.size() != 4 || kd[3] != qd[2] || qd[1] % kd[2] != 0 ||
      v.dimensions().size() != 4) {
    *error = ffi::Error::InvalidArgument(name + ": q [T, Hq, D], caches [N, bs, Hkv, D]");
    return nullptr;
  }
  if (k.element_type() != v.element_type() ||
      (k.element_type() != ffi::F32 && k.element_type() != ffi::BF16)) {
    *error = ffi::Error::InvalidArgument(name + ": caches must both be f32 or bf16");
    return nullptr;
  }
  auto fn = k.element_type() == ffi::F32 ? for_head_dim<Kernel, float>(qd[2])
                                         : for_head_dim<Kernel, uint16_t>(qd[2]);
  if (fn == nullptr)
    *error = ffi::Error::InvalidArgument(name + ": head dim " + std::to_string(qd[2]) +
                                         ", this library serves " +
                                         std::to_string(VLAX_HEAD_DIM));
  return fn;
}

inline float finite_or_zero(float x) { return std::isfinite(x) ? x : 0.0f; }

// The largest of s[from..to] (NaN passed over, as std::max does), 16 lanes at a time: a float
// reduction the compiler must not reorder runs one element per latency of its op.
inline float max_of(const float* s, int64_t from, int64_t to) {
  vf m = vf{} + kMinusInf;
  int64_t l = from;
  for (; l + kLanes <= to + 1; l += kLanes) {
    const vf x = load(s + l);
    m = x > m ? x : m;
  }
  if (l <= to) {  // the tail as one vector, padded with -inf
    vf x = vf{} + kMinusInf;
    std::memcpy(&x, s + l, (to + 1 - l) * sizeof(float));
    m = x > m ? x : m;
  }
  return lane_max(m);
}

// s[l] = e^(s[l] - ref) for l in [from, to], rounded to bf16 if `round`; returns the sum of
// the unrounded values. One pass, 16 lanes at a time (a float sum the compiler must not reorder
// runs one element per latency of its add).
inline float exp_sum(float* s, int64_t from, int64_t to, float ref, bool round) {
  vf acc{};
  int64_t l = from;
  for (; l + kLanes <= to + 1; l += kLanes) {
    const vf e = exp_nonpositive(load(s + l) - ref);
    acc += e;
    store(s + l, round ? round_bf16(e) : e);
  }
  if (l <= to) {  // the tail as one vector, padded with -inf: e^-inf adds 0
    const int64_t n = to + 1 - l;
    vf x = vf{} + kMinusInf;
    std::memcpy(&x, s + l, n * sizeof(float));
    const vf e = exp_nonpositive(x - ref);
    acc += e;
    const vf kept = round ? round_bf16(e) : e;
    std::memcpy(s + l, &kept, n * sizeof(float));
  }
  return lane_sum(acc);
}

// One row's softmax over its keys at offsets [lo, hi] of `s` (scaled scores; offset l is key
// position pos0 + l), in place: s[l] becomes the key's probability before normalisation,
// relative to the row's maximum, so that the value sum is one pass; returns the row's sum.
// `factor` is scratch for one float per block (of `block` positions, from block first_block).
// block 0: one block, nothing rounded. Otherwise, as HF's bf16 attention through torch's CPU
// flash kernel (rounding.py): a key's probability is taken relative to the running maximum over
// its row's blocks up to its own and rounded to bf16, then scaled by that block's factor to the
// row's maximum.
inline float softmax_row(float* s, int64_t lo, int64_t hi, int64_t pos0, int64_t block,
                         int64_t first_block, int64_t blocks, float* factor) {
  auto block_of = [&](int64_t l) { return block ? (pos0 + l) / block - first_block : 0; };
  std::fill(factor, factor + blocks, 0.0f);
  if (lo > hi) return 0.0f;
  // factor[] holds each block's running maximum first.
  const int64_t b_lo = block_of(lo), b_hi = block_of(hi);
  float running = kMinusInf;
  for (int64_t b = b_lo; b <= b_hi; ++b) {
    const int64_t from = std::max(lo, block ? (first_block + b) * block - pos0 : lo);
    const int64_t to = std::min(hi, block ? (first_block + b + 1) * block - pos0 - 1 : hi);
    running = std::max(running, max_of(s, from, to));
    factor[b] = running;
  }
  const float top = finite_or_zero(running);
  float total = 0;
  for (int64_t b = b_lo; b <= b_hi; ++b) {
    const int64_t from = std::max(lo, block ? (first_block + b) * block - pos0 : lo);
    const int64_t to = std::min(hi, block ? (first_block + b + 1) * block - pos0 - 1 : hi);
    const float ref = finite_or_zero(factor[b]);
    const float sum = block ? exp_sum(s, from, to, ref, true) : exp_sum(s, from, to, ref, false);
    // The block holding the maximum (and a single block) needs no factor: e^0 is 1.
    const float f = ref == top ? 1.0f : exp_nonpositive(vf{} + (ref - top))[0];
    if (f != 1.0f)
      for (int64_t l = from; l <= to; ++l) s[l] *= f;
    total += f * sum;
  }
  return total;
}

// The arguments of both attention handlers (decode.cc, prefill.cc), in native.py's order.
inline auto attention_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()  // q
      .Arg<ffi::AnyBuffer>()         // k_cache: f32 or bf16
      .Arg<ffi::AnyBuffer>()         // v_cache: as k_cache
      .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
      .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
      .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
      .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
      .Arg<ffi::Buffer<ffi::S32>>()  // prefix_lens [S] (prefill; decode reads none)
      .Attr<float>("sm_scale")
      .Attr<int64_t>("window")
      .Attr<float>("soft_cap")
      .Attr<int64_t>("round_block")
      .Ret<ffi::Buffer<ffi::F32>>();
}

// A step's work items, claimed one at a time by whichever thread is free. Shared with the
// tasks scheduled on XLA's pool, so one that starts after the last item is done touches only
// this (kept alive by its shared_ptr).
template <typename Item, typename Fn>
struct Work {
  std::vector<Item> items;
  Fn fn;
  std::atomic<int64_t> next{0}, done{0};

  void operator()() {
    typename Fn::Scratch scratch;
    const int64_t count = static_cast<int64_t>(items.size());
    for (int64_t i; (i = next.fetch_add(1)) < count; done.fetch_add(1)) fn(items[i], scratch);
  }
};

template <typename W>
void run_on(xla::ffi::ThreadPool& pool, const std::shared_ptr<W>& work) {
  const int64_t count = static_cast<int64_t>(work->items.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { (*work)(); });
  (*work)();
  while (work->done.load() < count) std::this_thread::yield();
}

}  // namespace vlax
