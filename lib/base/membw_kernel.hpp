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
// is read or written exactly as the pattern says, once. The vector's elements are unsigned, so
// the addition wraps (on signed elements it overflows, which is undefined and which UBSan reports).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

namespace zinf::membw {

struct StreamView {
  std::byte* data;
  int elem_bytes;  // 2 or 4
};

constexpr std::size_t kGroupElements = 512;

// The general loop, for patterns with more streams than pass_range_fused() is instantiated for:
// runs the pattern over elements [begin, end). REQUIRES: the streams are 64-byte aligned.
template <typename V>
inline void pass_range_grouped(const StreamView* reads, int read_count, const StreamView* in_place,
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
    if (in_place_count == 0 && write_count == 0) asm volatile("" : : "m"(acc));
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

// The common case, the way an optimizer kernel streams: every kStep elements, each stream's
// next kStep elements (2 or 1 cache lines) are loaded or stored, all streams in one loop body.
// The stream counts are template parameters so the body is straight-line code; a generic loop
// over a runtime list of streams costs more instructions than the memory takes (it measured
// 30% below this on a Zen 5 core with groups of 32-64 elements).
constexpr std::size_t kStep = 32;
constexpr int kMaxReads = 3, kMaxInPlace = 4, kMaxWrites = 2;

template <typename V, int kReads, int kInPlace, int kWrites>
void pass_range_fused(const StreamView* reads, int, const StreamView* in_place, int,
                      const StreamView* writes, int, std::size_t begin, std::size_t end) {
  constexpr std::size_t kVecBytes = sizeof(V);
  std::byte* r_ptr[kReads + 1];
  std::byte* i_ptr[kInPlace + 1];
  std::byte* w_ptr[kWrites + 1];
  bool r_wide[kReads + 1], i_wide[kInPlace + 1], w_wide[kWrites + 1];
  for (int s = 0; s < kReads; ++s) {
    r_ptr[s] = reads[s].data;
    r_wide[s] = reads[s].elem_bytes == 4;
  }
  for (int s = 0; s < kInPlace; ++s) {
    i_ptr[s] = in_place[s].data;
    i_wide[s] = in_place[s].elem_bytes == 4;
  }
  for (int s = 0; s < kWrites; ++s) {
    w_ptr[s] = writes[s].data;
    w_wide[s] = writes[s].elem_bytes == 4;
  }
  // Bytes of one step of a 4-byte and of a 2-byte stream, in vectors.
  constexpr std::size_t kWideVecs = kStep * 4 / kVecBytes;
  constexpr std::size_t kNarrowVecs = kStep * 2 / kVecBytes;
  std::size_t e = begin;
  for (; e + kStep <= end; e += kStep) {
    V acc = {};
    for (int s = 0; s < kReads; ++s) {
      const std::byte* p = r_ptr[s] + e * (r_wide[s] ? 4 : 2);
      const std::size_t vecs = r_wide[s] ? kWideVecs : kNarrowVecs;
      for (std::size_t k = 0; k < vecs; ++k) {
        V x;
        std::memcpy(&x, p + k * kVecBytes, kVecBytes);
        acc ^= x;
      }
    }
    if constexpr (kInPlace == 0 && kWrites == 0) {
      // Nothing consumes the reads: make the accumulator observable so they are not elided.
      asm volatile("" : : "m"(acc));
    }
    for (int s = 0; s < kInPlace; ++s) {
      std::byte* p = i_ptr[s] + e * (i_wide[s] ? 4 : 2);
      const std::size_t vecs = i_wide[s] ? kWideVecs : kNarrowVecs;
      for (std::size_t k = 0; k < vecs; ++k) {
        V x;
        std::memcpy(&x, p + k * kVecBytes, kVecBytes);
        x += acc;
        std::memcpy(p + k * kVecBytes, &x, kVecBytes);
      }
    }
    for (int s = 0; s < kWrites; ++s) {
      std::byte* p = w_ptr[s] + e * (w_wide[s] ? 4 : 2);
      const std::size_t vecs = w_wide[s] ? kWideVecs : kNarrowVecs;
      for (std::size_t k = 0; k < vecs; ++k) std::memcpy(p + k * kVecBytes, &acc, kVecBytes);
    }
  }
  if (e < end) {
    pass_range_grouped<V>(reads, kReads, in_place, kInPlace, writes, kWrites, e, end);
  }
}

using FusedFn = void (*)(const StreamView*, int, const StreamView*, int, const StreamView*, int,
                         std::size_t, std::size_t);

template <typename V, std::size_t... K>
constexpr std::array<FusedFn, sizeof...(K)> make_fused_table(std::index_sequence<K...>) {
  return {&pass_range_fused<V, static_cast<int>(K / ((kMaxInPlace + 1) * (kMaxWrites + 1))),
                            static_cast<int>(K / (kMaxWrites + 1) % (kMaxInPlace + 1)),
                            static_cast<int>(K % (kMaxWrites + 1))>...};
}

// Runs the pattern over elements [begin, end), fused when the stream counts allow.
// REQUIRES: the streams are 64-byte aligned.
template <typename V>
inline void pass_range(const StreamView* reads, int read_count, const StreamView* in_place,
                       int in_place_count, const StreamView* writes, int write_count,
                       std::size_t begin, std::size_t end) {
  static constexpr auto kTable = make_fused_table<V>(
      std::make_index_sequence<(kMaxReads + 1) * (kMaxInPlace + 1) * (kMaxWrites + 1)>());
  if (read_count <= kMaxReads && in_place_count <= kMaxInPlace && write_count <= kMaxWrites) {
    kTable[static_cast<std::size_t>(
        (read_count * (kMaxInPlace + 1) + in_place_count) * (kMaxWrites + 1) + write_count)](
        reads, read_count, in_place, in_place_count, writes, write_count, begin, end);
  } else {
    pass_range_grouped<V>(reads, read_count, in_place, in_place_count, writes, write_count, begin,
                          end);
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
