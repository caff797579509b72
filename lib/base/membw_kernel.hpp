// The inner loop of the bandwidth probe (membw.cpp), written once over a GCC vector type so it
// can be compiled for SSE2 (membw.cpp), AVX2 (membw_avx2.cpp) and AVX-512 (membw_avx512.cpp):
// a probe built for a narrower ISA than the kernel it is compared with would measure the
// instruction rate, not the memory.
//
// All streams advance together, one group of kGroupElements elements at a time (2 KiB of each
// 4-byte stream), as an optimizer kernel's streams do. Much smaller groups make the loop over
// streams cost more than the memory (64 elements lost 10-20% on a Zen 5 core); much larger ones
// keep fewer streams in flight at a time. The old probe (separate passes over 8 KiB blocks
// through an L1 accumulator, SSE2) ran 25-40% below a fused AVX-512 optimizer kernel. The
// arithmetic is trivial and integer: the read streams are XOR-ed into one accumulator, each
// in-place stream gets it added, each write-only stream gets it stored. Every byte of every stream
// is read or written exactly as the pattern says, once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace zinf::membw {

struct StreamView {
  std::byte* data;
  int elem_bytes;  // 2 or 4
};

constexpr std::size_t kGroupElements = 512;

// Runs the pattern over elements [begin, end). REQUIRES: `begin` is a multiple of
// kGroupElements; the streams are at least 64-byte aligned.
template <typename V>
inline void pass_range(const StreamView* reads, int read_count, const StreamView* in_place,
                       int in_place_count, const StreamView* writes, int write_count,
                       std::size_t begin, std::size_t end) {
  constexpr std::size_t kVecBytes = sizeof(V);
  std::size_t e = begin;
  for (; e + kGroupElements <= end; e += kGroupElements) {
    V acc = {};
    for (int s = 0; s < read_count; ++s) {
      const std::size_t bytes = kGroupElements * static_cast<std::size_t>(reads[s].elem_bytes);
      const std::byte* p = reads[s].data + e * static_cast<std::size_t>(reads[s].elem_bytes);
      for (std::size_t off = 0; off < bytes; off += kVecBytes) {
        V x;
        std::memcpy(&x, p + off, kVecBytes);
        acc ^= x;
      }
    }
    for (int s = 0; s < in_place_count; ++s) {
      const std::size_t bytes = kGroupElements * static_cast<std::size_t>(in_place[s].elem_bytes);
      std::byte* p = in_place[s].data + e * static_cast<std::size_t>(in_place[s].elem_bytes);
      for (std::size_t off = 0; off < bytes; off += kVecBytes) {
        V x;
        std::memcpy(&x, p + off, kVecBytes);
        x += acc;
        std::memcpy(p + off, &x, kVecBytes);
      }
    }
    for (int s = 0; s < write_count; ++s) {
      const std::size_t bytes = kGroupElements * static_cast<std::size_t>(writes[s].elem_bytes);
      std::byte* p = writes[s].data + e * static_cast<std::size_t>(writes[s].elem_bytes);
      for (std::size_t off = 0; off < bytes; off += kVecBytes)
        std::memcpy(p + off, &acc, kVecBytes);
    }
  }
  // The tail, byte by byte.
  if (e == end) return;
  std::uint8_t acc = 0;
  for (int s = 0; s < read_count; ++s) {
    const std::size_t w = static_cast<std::size_t>(reads[s].elem_bytes);
    for (std::size_t b = e * w; b < end * w; ++b)
      acc ^= static_cast<std::uint8_t>(reads[s].data[b]);
  }
  for (int s = 0; s < in_place_count; ++s) {
    const std::size_t w = static_cast<std::size_t>(in_place[s].elem_bytes);
    for (std::size_t b = e * w; b < end * w; ++b) {
      in_place[s].data[b] =
          static_cast<std::byte>(static_cast<std::uint8_t>(in_place[s].data[b]) + acc);
    }
  }
  for (int s = 0; s < write_count; ++s) {
    const std::size_t w = static_cast<std::size_t>(writes[s].elem_bytes);
    for (std::size_t b = e * w; b < end * w; ++b) writes[s].data[b] = static_cast<std::byte>(acc);
  }
}

using PassRangeFn = void (*)(const StreamView* reads, int read_count, const StreamView* in_place,
                             int in_place_count, const StreamView* writes, int write_count,
                             std::size_t begin, std::size_t end);

// Compiled for AVX2 and AVX-512 in their own files; call only where cpu_features() says so.
void pass_range_avx2(const StreamView* reads, int read_count, const StreamView* in_place,
                     int in_place_count, const StreamView* writes, int write_count,
                     std::size_t begin, std::size_t end);
void pass_range_avx512(const StreamView* reads, int read_count, const StreamView* in_place,
                       int in_place_count, const StreamView* writes, int write_count,
                       std::size_t begin, std::size_t end);

}  // namespace zinf::membw
