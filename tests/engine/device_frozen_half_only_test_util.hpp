// What the tests of DeviceOptimizer's frozen runs kept as their half copy alone share, on an
// opaque HostDevice (tests/engine/device_frozen_half_only_test.cpp) and on a GPU
// (tests/gpu/device_optimizer_gpu_test.cpp): a master rounded to a half dtype, a bitwise
// comparison that names the first element that differs, and DeviceOptimizerFrozen
// (device_optimizer_test_util.hpp) with steps and writes of both its optimizers at once.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "engine/device_optimizer.hpp"
#include "engine/device_optimizer_test_util.hpp"
#include "zinf/dtype.hpp"

namespace zinf::device_optimizer_test {

// `values` rounded to `half` (kBF16 or kF16) and widened back: each x then equals
// widen(narrow(x)), as a weight loaded from that dtype does.
inline std::vector<float> rounded_to_half(std::vector<float> values, DType half) {
  std::vector<std::uint16_t> bits(values.size());
  if (half == DType::kBF16) {
    convert_f32_to_bf16(values.data(), bits.data(), values.size());
    convert_bf16_to_f32(bits.data(), values.data(), values.size());
  } else {
    convert_f32_to_f16(values.data(), bits.data(), values.size());
    convert_f16_to_f32(bits.data(), values.data(), values.size());
  }
  return values;
}

// An optimizer on `device` told of the frozen runs of `p`, its gradients packed (as
// DeviceOptimizerFrozen's packed_), over `master`.
inline Result<std::unique_ptr<DeviceOptimizer>> make_packed(Device& device, const Partition& p,
                                                            const std::vector<float>& master) {
  return DeviceOptimizer::create(device, p.groups, p.elements, master.data(), kTimeout, p.ranges,
                                 frozen_flags(p), /*pack_grads=*/true);
}

// Fails at the first element of `got` whose bits are not `want`'s, naming it.
inline void expect_bits(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t e = 0; e < got.size(); ++e) {
    ASSERT_EQ(std::memcmp(&got[e], &want[e], sizeof(float)), 0) << "element " << e;
  }
}

// DeviceOptimizerFrozen with steps and master writes of packed_ and full_ together.
class DeviceOptimizerFrozenSteps : public DeviceOptimizerFrozen {
 protected:
  // Steps `first` .. `last` of both optimizers, each after set_grads(grad_seed + step); none after
  // a fatal failure of the test (in a helper too, where it did not end the test).
  void train_both(std::uint64_t grad_seed, std::int64_t first, std::int64_t last) {
    for (std::int64_t step = first; step <= last && !HasFatalFailure(); ++step) {
      set_grads(grad_seed + static_cast<std::uint64_t>(step));
      step_both(step);
    }
  }
  // Writes elements [first, first + count) of `master` into both optimizers' masters.
  void write_both(const std::vector<float>& master, std::size_t first, std::size_t count) {
    for (DeviceOptimizer* o : {packed_.get(), full_.get()}) {
      ASSERT_TRUE(o->write_state(0, first, count, master.data() + first).is_ok())
          << "[" << first << ", " << first + count << ")";
    }
  }
  // Sets element `element` of `master` to `value`, one the half dtype does not hold, and writes it
  // alone into both optimizers: every half-only run of packed_ gets its master back, and every
  // element reads back `master`'s bits.
  void write_inexact(std::vector<float>& master, std::size_t element, float value) {
    master[element] = value;
    ASSERT_NO_FATAL_FAILURE(write_both(master, element, 1));
    EXPECT_EQ(packed_->half_only_elements(), 0u);
    expect_bits(read(*packed_, 0), master);
  }
};

}  // namespace zinf::device_optimizer_test
