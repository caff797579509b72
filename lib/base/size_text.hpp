// Sizes and counts as people write them on a command line: "4GiB", "48GB", "1.5G", "7B", "350k".
// `zinf`'s options (plan, bench, io, probe) and the planner's --trainable read them here, so one
// grammar holds for all of them.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace zinf {

// The value of `text`: digits with at most one decimal point ("350", "1.5", ".5"), then a unit
// (case-insensitive), times the unit's multiple:
//
//   unit                 a size (decimal false)     a count (decimal true)
//   none                 1                          1
//   b                    1 (bytes)                  1e9 (a billion, as model names write it)
//   k, m, g, t           2^10, 2^20, 2^30, 2^40     1e3, 1e6, 1e9, 1e12
//   kb, mb, gb, tb       1e3, 1e6, 1e9, 1e12        1e3, 1e6, 1e9, 1e12
//   kib, mib, gib, tib   2^10, 2^20, 2^30, 2^40     2^10, 2^20, 2^30, 2^40
//
// The digits are read as strtod reads them (the nearest double); digits past a double's range
// give infinity, and a fraction below its smallest value 0. nullopt for anything else: no digit,
// a sign, a second decimal point, spaces, another unit.
std::optional<double> parse_scaled(std::string_view text, bool decimal);

// parse_scaled() rounded to the nearest whole number into *out. False, *out untouched, where
// parse_scaled() fails or the value is 2^64 or more (converting it would be undefined behaviour).
bool parse_size(std::string_view text, std::uint64_t* out, bool decimal = false);

}  // namespace zinf
