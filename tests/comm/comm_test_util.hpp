// Helpers shared by the comm tests (LocalComm's, and MpiComm's program under mpirun): seeded
// inputs of any dtype and the collectives' contract written out serially, the reference every
// backend is checked against.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "zinf/comm.hpp"
#include "zinf/dtype.hpp"

namespace zinf::comm_test {

// `count` uniform values in [-4, 4) from `seed` (never zeros), as raw bytes of `dtype` (f32, bf16
// or f16; the halves rounded to nearest even).
std::vector<std::byte> random_data(std::size_t count, DType dtype, std::uint64_t seed);

// Element `index` of `data` (of `dtype`), widened to f32.
float element(const std::vector<std::byte>& data, DType dtype, std::size_t index);

// Stores `value` as element `index` of `data`, rounded to `dtype`.
void set_element(std::vector<std::byte>& data, DType dtype, std::size_t index, float value);

// The reduction contract written out serially: for elements [first, first + count) of every
// rank's input, ranks in order, f32 accumulation, one rounding to `dtype` at the end; max and min
// propagate NaN; average divides the f32 sum by the world size.
std::vector<std::byte> serial_reduce(const std::vector<std::vector<std::byte>>& inputs,
                                     std::size_t first, std::size_t count, DType dtype,
                                     ReduceOp op);

}  // namespace zinf::comm_test
