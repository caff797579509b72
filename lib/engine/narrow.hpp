// fp32 values to and from a parameter dtype on the host: how the host's optimizer states round
// their master into the values they publish (HostState, StoreState and the Publisher call
// narrow(); DeviceState rounds on the device, through DeviceOps), and the check of whether a half
// dtype holds fp32 values exactly, with which the states that keep a frozen master as its half
// copy alone (DeviceOptimizer, StoreState) decide where it may, narrowing it into that copy.
//
// Thread-safety: free functions on caller-owned memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "zinf/dtype.hpp"

namespace zinf {

// dst (count elements of dtype) <- src floats, rounded to nearest even (kF32: copied).
void narrow(const float* src, std::size_t count, DType dtype, void* dst);
// dst floats <- src (count elements of dtype), exactly (every bf16/f16 value is an fp32 one).
void widen(const void* src, std::size_t count, DType dtype, float* dst);

// Narrows values[0, count) into `half` (`dtype` kBF16 or kF16, rounded as narrow() rounds) and
// widens them back into `wide`: returns the first element whose round trip does not give its own
// bits (widen(narrow(x)) is not x: a value `dtype` does not hold exactly, a NaN whose payload it
// drops among them), or count when it holds them all. `half` holds every element narrowed.
// REQUIRES: `half` and `wide` have room for count elements each.
std::size_t narrow_checked(DType dtype, const float* values, std::size_t count, std::uint16_t* half,
                           float* wide);

}  // namespace zinf
