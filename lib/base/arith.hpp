// Integer rounding the library's sizes and offsets share: whole pages, whole blocks, whole chunks.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

namespace zinf {

// The page the swap files, the arenas and the checkpoint layout round to (O_DIRECT's unit).
inline constexpr std::uint64_t kPage = 4096;

// REQUIRES: unit > 0.
constexpr std::uint64_t ceil_div(std::uint64_t value, std::uint64_t unit) {
  return (value + unit - 1) / unit;
}
// The smallest multiple of unit at least value. REQUIRES: unit > 0.
constexpr std::uint64_t round_up(std::uint64_t value, std::uint64_t unit) {
  return ceil_div(value, unit) * unit;
}
constexpr std::uint64_t round_page(std::uint64_t bytes) { return round_up(bytes, kPage); }

}  // namespace zinf
