// Batched copy kernel behind flatten / unflatten (see kernels/flatten.h).
#include "kernels/common.cuh"
#include "kernels/flatten.h"

namespace zinf::kernels {
namespace {

// The segments of one launch, passed by value: 64 * 24 bytes + 8 fits the 4 KiB parameter space
// of every architecture.
struct CopyBatch {
  CopySegment segments[kCopySegmentsPerLaunch];
  unsigned count;
};

template <typename Word>
__device__ inline void copy_words(const unsigned char* src, unsigned char* dst, std::size_t words,
                                  std::size_t first, std::size_t stride) {
  const Word* s = reinterpret_cast<const Word*>(src);
  Word* d = reinterpret_cast<Word*>(dst);
  for (std::size_t i = first; i < words; i += stride) d[i] = s[i];
}

// blockIdx.y picks the segment; the blocks along x and their threads stride over its words.
__global__ void batched_copy_kernel(CopyBatch batch) {
  const CopySegment seg = batch.segments[blockIdx.y];
  const auto* src = static_cast<const unsigned char*>(seg.src);
  auto* dst = static_cast<unsigned char*>(seg.dst);
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::uintptr_t misalign =
      reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst);
  // The widest word both ends are aligned to copies all whole words; the bytes after the last
  // whole word (or every byte, where an end is at an odd address) go one at a time.
  std::size_t done = 0;
  if ((misalign & 15u) == 0) {
    copy_words<uint4>(src, dst, seg.bytes / 16, first, stride);
    done = seg.bytes / 16 * 16;
  } else if ((misalign & 7u) == 0) {
    copy_words<std::uint64_t>(src, dst, seg.bytes / 8, first, stride);
    done = seg.bytes / 8 * 8;
  } else if ((misalign & 3u) == 0) {
    copy_words<std::uint32_t>(src, dst, seg.bytes / 4, first, stride);
    done = seg.bytes / 4 * 4;
  } else if ((misalign & 1u) == 0) {
    copy_words<std::uint16_t>(src, dst, seg.bytes / 2, first, stride);
    done = seg.bytes / 2 * 2;
  }
  for (std::size_t i = done + first; i < seg.bytes; i += stride) dst[i] = src[i];
}

}  // namespace

LaunchError batched_copy(const CopySegment* segments, std::size_t segment_count, Stream stream) {
  auto* s = static_cast<cudaStream_t>(stream);
  std::size_t i = 0;
  while (i < segment_count) {
    // The next (up to) kCopySegmentsPerLaunch non-empty segments.
    CopyBatch batch{};
    std::size_t max_words = 0;
    for (; i < segment_count && batch.count < kCopySegmentsPerLaunch; ++i) {
      if (segments[i].bytes == 0) continue;
      batch.segments[batch.count++] = segments[i];
      const std::size_t words = (segments[i].bytes + 15) / 16;
      if (words > max_words) max_words = words;
    }
    if (batch.count == 0) continue;
    // Enough blocks along x for the longest segment at one 16-byte word a thread, capped so that
    // the whole grid stays modest; grid-stride loops cover the rest.
    std::size_t blocks_x = (max_words + detail::kThreads - 1) / detail::kThreads;
    const std::size_t cap = std::size_t{4096} / batch.count + 1;
    if (blocks_x > cap) blocks_x = cap;
    const dim3 grid(static_cast<unsigned>(blocks_x), batch.count);
    const cudaError_t err = detail::launch(batched_copy_kernel, grid, detail::kThreads, s, batch);
    if (err != cudaSuccess) return static_cast<LaunchError>(err);
  }
  return 0;
}

LaunchError flatten(const void* const* tensors, const std::size_t* tensor_bytes,
                    const std::size_t* offsets_bytes, std::size_t tensor_count, void* flat,
                    Stream stream) {
  auto* out = static_cast<unsigned char*>(flat);
  CopySegment chunk[kCopySegmentsPerLaunch];
  for (std::size_t begin = 0; begin < tensor_count; begin += kCopySegmentsPerLaunch) {
    std::size_t n = 0;
    for (std::size_t i = begin; i < tensor_count && n < kCopySegmentsPerLaunch; ++i) {
      chunk[n++] = CopySegment{tensors[i], out + offsets_bytes[i], tensor_bytes[i]};
    }
    const LaunchError err = batched_copy(chunk, n, stream);
    if (err != 0) return err;
  }
  return 0;
}

LaunchError unflatten(const void* flat, const std::size_t* offsets_bytes,
                      const std::size_t* tensor_bytes, std::size_t tensor_count,
                      void* const* tensors, Stream stream) {
  const auto* in = static_cast<const unsigned char*>(flat);
  CopySegment chunk[kCopySegmentsPerLaunch];
  for (std::size_t begin = 0; begin < tensor_count; begin += kCopySegmentsPerLaunch) {
    std::size_t n = 0;
    for (std::size_t i = begin; i < tensor_count && n < kCopySegmentsPerLaunch; ++i) {
      chunk[n++] = CopySegment{in + offsets_bytes[i], tensors[i], tensor_bytes[i]};
    }
    const LaunchError err = batched_copy(chunk, n, stream);
    if (err != 0) return err;
  }
  return 0;
}

}  // namespace zinf::kernels
