// The model of the write_parameters / publish tests: many small f32 parameters, each alone in a
// module, so that each is a group of its own; and a device copy read back through the device.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "engine_test_util.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"
#include "zinf/status.hpp"

namespace zinf::engine_test {

// `param_count` f32 parameters "w<i>" of `element_count` elements, parameter i alone in module
// "m<i>", in that order; initial values seeded(element_count, seed + i, lo, hi). Register it
// with register_model().
inline Model one_param_modules(std::size_t param_count, std::size_t element_count,
                               std::uint64_t seed, float lo, float hi) {
  Model model;
  for (std::size_t i = 0; i < param_count; ++i) {
    model.modules.push_back(fmt::format("m{}", i));
    model.params.push_back(
        {fmt::format("w{}", i), model.modules.back(), {static_cast<std::int64_t>(element_count)}});
    model.initial.push_back(seeded(element_count, seed + i, lo, hi));
  }
  return model;
}

// `element_count` f32 values at `device_data`, copied to the host through `device` on a stream
// of its own (an opaque device's memory is not the host's).
inline Result<std::vector<float>> copy_to_host(Device& device, const void* device_data,
                                               std::size_t element_count) {
  std::vector<float> out(element_count);
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.create_stream("copy"));
  ZINF_RETURN_IF_ERROR(
      device.copy_d2h(out.data(), device_data, element_count * sizeof(float), *stream));
  ZINF_RETURN_IF_ERROR(device.synchronize(*stream));
  return out;
}

}  // namespace zinf::engine_test
