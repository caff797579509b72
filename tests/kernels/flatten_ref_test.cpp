// The flatten / unflatten / batched-copy references against byte loops written here, with odd
// sizes and offsets, and a round trip that leaves the padding untouched.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "base/random.hpp"
#include "kernels/flatten.h"

namespace zinf::kernels {
namespace {

TEST(FlattenRef, PacksTensorsAtOffsetsAndLeavesPaddingAlone) {
  // Sizes in bytes that are not multiples of 16, and a gap after each tensor (padding).
  const std::vector<std::size_t> sizes = {0, 1, 6, 4097, 30, 2, 100003, 16};
  std::vector<std::vector<unsigned char>> tensors;
  std::vector<const void*> srcs;
  std::vector<std::size_t> offsets;
  std::size_t at = 3;  // A misaligned start.
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    tensors.emplace_back(sizes[i]);
    fill_random_bytes(tensors.back().data(), sizes[i], 100 + i);
    srcs.push_back(tensors.back().data());
    offsets.push_back(at);
    at += sizes[i] + 5;
  }
  std::vector<unsigned char> flat(at), padding_check(at);
  fill_random_bytes(flat.data(), flat.size(), 7);
  padding_check = flat;
  flatten_ref(srcs.data(), sizes.data(), offsets.data(), sizes.size(), flat.data());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (std::size_t b = 0; b < sizes[i]; ++b) {
      ASSERT_EQ(flat[offsets[i] + b], tensors[i][b]) << "tensor " << i << " byte " << b;
      padding_check[offsets[i] + b] = tensors[i][b];
    }
  }
  EXPECT_EQ(flat, padding_check) << "bytes outside the tensors changed";

  std::vector<std::vector<unsigned char>> back;
  std::vector<void*> dsts;
  for (std::size_t s : sizes) back.emplace_back(s, 0xab);
  for (auto& b : back) dsts.push_back(b.data());
  unflatten_ref(flat.data(), offsets.data(), sizes.data(), sizes.size(), dsts.data());
  for (std::size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(back[i], tensors[i]) << "tensor " << i;
}

TEST(FlattenRef, BatchedCopyCopiesEverySegment) {
  std::vector<unsigned char> src(1 << 16), dst(1 << 16, 0);
  fill_random_bytes(src.data(), src.size(), 11);
  // A scatter in reverse order with odd lengths.
  std::vector<CopySegment> segs = {{src.data() + 1, dst.data() + 40000, 777},
                                   {src.data() + 9000, dst.data() + 3, 12345},
                                   {src.data() + 30000, dst.data() + 20000, 0}};
  batched_copy_ref(segs.data(), segs.size());
  for (std::size_t b = 0; b < 777; ++b) ASSERT_EQ(dst[40000 + b], src[1 + b]);
  for (std::size_t b = 0; b < 12345; ++b) ASSERT_EQ(dst[3 + b], src[9000 + b]);
  EXPECT_EQ(dst[2], 0);
  EXPECT_EQ(dst[3 + 12345], 0);
}

}  // namespace
}  // namespace zinf::kernels
