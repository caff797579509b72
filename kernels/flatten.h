// Flatten / unflatten: copies between a module's separate tensors and one flat buffer (a flat
// shard, a gradient bucket), many tensors in one launch.
//
// flatten:   flat[offsets[i] .. offsets[i] + bytes[i])  <- tensors[i][0 .. bytes[i])
// unflatten: tensors[i][0 .. bytes[i])                  <- flat[offsets[i] .. + bytes[i])
// Both are a batched copy of (src, dst, bytes) segments; a segment list may describe any
// gather or scatter (padding is left untouched). One launch carries up to
// kCopySegmentsPerLaunch segments by value in the kernel's parameters, so no segment table has
// to be uploaded first; longer lists take ceil(n / kCopySegmentsPerLaunch) launches.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/launch.h"

namespace zinf::kernels {

struct CopySegment {
  const void* src;
  void* dst;
  std::size_t bytes;
};

constexpr std::size_t kCopySegmentsPerLaunch = 64;

// Enqueues every copy in `segments` (a host array of `segment_count`) on `stream`. Each segment
// is copied 16 bytes at a time when its src and dst are both 16-byte aligned, otherwise with
// the widest of 8, 4, 2 or 1 bytes that both allow; the bytes % width tail byte by byte.
// REQUIRES: no segment's dst overlaps any segment's src or dst. Returns 0 or the first launch
// error (later launches are not enqueued after an error).
LaunchError batched_copy(const CopySegment* segments, std::size_t segment_count, Stream stream);

// flatten / unflatten as defined above: `tensors`, `offsets_bytes` and `tensor_bytes` are host
// arrays of `tensor_count`; `flat` and the tensors are device memory.
LaunchError flatten(const void* const* tensors, const std::size_t* tensor_bytes,
                    const std::size_t* offsets_bytes, std::size_t tensor_count, void* flat,
                    Stream stream);
LaunchError unflatten(const void* flat, const std::size_t* offsets_bytes,
                      const std::size_t* tensor_bytes, std::size_t tensor_count,
                      void* const* tensors, Stream stream);

// The scalar references on host memory (one memcpy per segment).
void batched_copy_ref(const CopySegment* segments, std::size_t segment_count);
void flatten_ref(const void* const* tensors, const std::size_t* tensor_bytes,
                 const std::size_t* offsets_bytes, std::size_t tensor_count, void* flat);
void unflatten_ref(const void* flat, const std::size_t* offsets_bytes,
                   const std::size_t* tensor_bytes, std::size_t tensor_count, void* const* tensors);

}  // namespace zinf::kernels
