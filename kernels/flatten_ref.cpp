// Scalar references of kernels/flatten.cu.
#include <cstring>

#include "kernels/flatten.h"

namespace zinf::kernels {

void batched_copy_ref(const CopySegment* segments, std::size_t segment_count) {
  for (std::size_t i = 0; i < segment_count; ++i) {
    if (segments[i].bytes > 0) std::memcpy(segments[i].dst, segments[i].src, segments[i].bytes);
  }
}

void flatten_ref(const void* const* tensors, const std::size_t* tensor_bytes,
                 const std::size_t* offsets_bytes, std::size_t tensor_count, void* flat) {
  auto* out = static_cast<unsigned char*>(flat);
  for (std::size_t i = 0; i < tensor_count; ++i) {
    if (tensor_bytes[i] > 0) std::memcpy(out + offsets_bytes[i], tensors[i], tensor_bytes[i]);
  }
}

void unflatten_ref(const void* flat, const std::size_t* offsets_bytes,
                   const std::size_t* tensor_bytes, std::size_t tensor_count,
                   void* const* tensors) {
  const auto* in = static_cast<const unsigned char*>(flat);
  for (std::size_t i = 0; i < tensor_count; ++i) {
    if (tensor_bytes[i] > 0) std::memcpy(tensors[i], in + offsets_bytes[i], tensor_bytes[i]);
  }
}

}  // namespace zinf::kernels
