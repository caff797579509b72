// A safetensors file as the checkpoint export tests read it back (checkpoint_export_test.cpp,
// checkpoint_aside_test.cpp, checkpoint_wide_test.cpp): the 8-byte little-endian header length,
// the JSON header it spans, and the bytes, whose tensors start after the header; and one f32
// tensor read out of it.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine_test_util.hpp"

namespace zinf::engine_test {

struct SafetensorsFile {
  std::string bytes;               // the whole file
  std::uint64_t header_bytes = 0;  // the JSON header's length, from the file's first 8 bytes
  nlohmann::json header;
};

// Reads the file at `path` into `out`: fails unless it holds the 8-byte length and the header
// that length spans.
inline void read_safetensors(const std::string& path, SafetensorsFile& out) {
  out.bytes = read_file(path);
  ASSERT_GE(out.bytes.size(), 8u);
  out.header_bytes = 0;
  for (int i = 0; i < 8; ++i) {
    out.header_bytes |= static_cast<std::uint64_t>(static_cast<unsigned char>(out.bytes[i]))
                        << (8 * i);
  }
  ASSERT_LE(8 + out.header_bytes, out.bytes.size());
  out.header = nlohmann::json::parse(out.bytes.substr(8, out.header_bytes));
}

// The f32 tensor `name` of `file` into `got`: fails unless the header names it and its
// data_offsets span `elements` floats inside the file.
inline void read_f32_tensor(const SafetensorsFile& file, const std::string& name,
                            std::size_t elements, std::vector<float>& got) {
  ASSERT_TRUE(file.header.contains(name)) << name;
  const std::uint64_t begin = file.header[name]["data_offsets"][0];
  const std::uint64_t end = file.header[name]["data_offsets"][1];
  ASSERT_EQ(end - begin, elements * sizeof(float)) << name;
  ASSERT_LE(8 + file.header_bytes + end, file.bytes.size()) << name;
  got.resize(elements);
  std::memcpy(got.data(), file.bytes.data() + 8 + file.header_bytes + begin, end - begin);
}

}  // namespace zinf::engine_test
