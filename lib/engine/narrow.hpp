// fp32 values rounded to a parameter dtype on the host: how every optimizer state rounds its
// master into the values it publishes (Publisher), and how the device optimizer narrows a frozen
// run's master into its half copy where that copy alone holds it (DeviceOptimizer).
//
// Thread-safety: free functions on caller-owned memory.
#pragma once

#include <cstddef>

#include "zinf/dtype.hpp"

namespace zinf {

// dst (count elements of dtype) <- src floats, rounded to nearest even (kF32: copied).
void narrow(const float* src, std::size_t count, DType dtype, void* dst);

}  // namespace zinf
