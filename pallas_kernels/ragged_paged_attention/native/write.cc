// This step's keys or values written into a paged cache in place: native.py says why.
//
// The cache [num_blocks, block_size, H, D] is the call's output and aliases its input, so XLA
// hands over the donated buffer and each token's row is one copy to its slot; slot -1 (padding)
// and slots past the cache write nothing, as write_rows drops them.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Write(ffi::AnyBuffer cache, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> slot_mapping,
                 ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = cache.dimensions(), rd = rows.dimensions();
  if (cd.size() != 4 || rd.size() != 3 || rd[1] != cd[2] || rd[2] != cd[3] ||
      rows.element_type() != cache.element_type() || slot_mapping.dimensions()[0] != rd[0])
    return ffi::Error::InvalidArgument(
        "native write: rows [T, H, D] of the cache's dtype into [N, bs, H, D], slots [T]");
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != cache.untyped_data())  // XLA could not alias: start from the input's contents
    std::memcpy(dst, cache.untyped_data(), cache.size_bytes());
  const int64_t row_bytes = rows.size_bytes() / (rd[0] ? rd[0] : 1);
  const int64_t slots = cd[0] * cd[1];
  const char* src = static_cast<const char*>(rows.untyped_data());
  const int32_t* slot = slot_mapping.typed_data();
  for (int64_t t = 0; t < rd[0]; ++t)
    if (slot[t] >= 0 && slot[t] < slots)
      std::memcpy(dst + slot[t] * row_bytes, src + t * row_bytes, row_bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VlaxPagedWrite, Write,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // cache
                                  .Arg<ffi::AnyBuffer>()          // rows, the cache's dtype
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot_mapping
                                  .Ret<ffi::AnyBuffer>());        // the cache, aliased
