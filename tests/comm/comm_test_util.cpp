#include "comm_test_util.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/random.hpp"

namespace zinf::comm_test {

std::vector<std::byte> random_data(std::size_t count, DType dtype, std::uint64_t seed) {
  std::vector<float> values(count);
  fill_uniform(values.data(), count, seed, -4.0f, 4.0f);
  std::vector<std::byte> bytes(count * dtype_bytes(dtype));
  for (std::size_t i = 0; i < count; ++i) set_element(bytes, dtype, i, values[i]);
  return bytes;
}

float element(const std::vector<std::byte>& data, DType dtype, std::size_t index) {
  if (dtype == DType::kF32) {
    float value;
    std::memcpy(&value, data.data() + index * 4, 4);
    return value;
  }
  std::uint16_t half;
  std::memcpy(&half, data.data() + index * 2, 2);
  return dtype == DType::kBF16 ? bf16_to_f32(half) : f16_to_f32(half);
}

void set_element(std::vector<std::byte>& data, DType dtype, std::size_t index, float value) {
  if (dtype == DType::kF32) {
    std::memcpy(data.data() + index * 4, &value, 4);
    return;
  }
  const std::uint16_t half = dtype == DType::kBF16 ? f32_to_bf16(value) : f32_to_f16(value);
  std::memcpy(data.data() + index * 2, &half, 2);
}

std::vector<std::byte> serial_reduce(const std::vector<std::vector<std::byte>>& inputs,
                                     std::size_t first, std::size_t count, DType dtype,
                                     ReduceOp op) {
  std::vector<std::byte> out(count * dtype_bytes(dtype));
  for (std::size_t i = 0; i < count; ++i) {
    float acc = element(inputs[0], dtype, first + i);
    for (std::size_t r = 1; r < inputs.size(); ++r) {
      const float x = element(inputs[r], dtype, first + i);
      if (op == ReduceOp::kSum || op == ReduceOp::kAverage) acc = acc + x;
      if (op == ReduceOp::kMax) acc = (std::isnan(acc) || std::isnan(x)) ? NAN : std::max(acc, x);
      if (op == ReduceOp::kMin) acc = (std::isnan(acc) || std::isnan(x)) ? NAN : std::min(acc, x);
    }
    if (op == ReduceOp::kAverage) acc = acc / static_cast<float>(inputs.size());
    set_element(out, dtype, i, acc);
  }
  return out;
}

}  // namespace zinf::comm_test
