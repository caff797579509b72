// The checkpoint header's bytes are pinned: a header of chosen values encodes to exactly the bytes
// written out below by hand from the layout in lib/engine/checkpoint.hpp (little-endian fields,
// zero padding to 4096), decodes back to the same values, a header of version 2 (the oldest this
// build reads) still decodes, and a header of another version, a foreign magic or dirty padding is
// refused naming what is wrong.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstring>
#include <vector>

#include "engine/checkpoint.hpp"

namespace zinf {
namespace {

CheckpointHeader sample() {
  CheckpointHeader h;
  h.rank = 3;
  h.world_size = 8;
  h.stage = 2;
  h.optimizer = 1;
  h.piece_mask = 0x7;
  h.partition_elements = 0x0102030405ULL;
  h.fingerprint = 0xfedcba9876543210ULL;
  h.step = 1234;
  h.loss_scale = 65536.0;  // 0x40f0000000000000
  h.loss_scale_good_steps = -2;
  h.loss_scale_hysteresis_left = 5;
  return h;
}

// The first 80 bytes, by hand.
constexpr std::array<unsigned char, 80> kPinned = {
    'Z',  'I',  'N',  'F',  'C',  'K',  'T',  '1',   // magic "ZINFCKT1"
    3,    0,    0,    0,                             // version 3
    3,    0,    0,    0,                             // rank 3
    8,    0,    0,    0,                             // world_size 8
    2,    0,    0,    0,                             // stage 2
    1,    0,    0,    0,                             // optimizer 1
    7,    0,    0,    0,                             // piece_mask 0b111
    0x05, 0x04, 0x03, 0x02, 0x01, 0,    0,    0,     // partition_elements
    0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe,  // fingerprint
    0xd2, 0x04, 0,    0,    0,    0,    0,    0,     // step 1234
    0,    0,    0,    0,    0,    0,    0xf0, 0x40,  // loss_scale 65536.0
    0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,  // good steps -2
    5,    0,    0,    0,                             // hysteresis left 5
    0,    0,    0,    0,                             // reserved
};

TEST(CheckpointFormat, HeaderBytesArePinnedLittleEndian) {
  std::vector<std::byte> bytes(kCheckpointHeaderBytes, std::byte{0xaa});
  encode_checkpoint_header(
      sample(), std::span<std::byte, kCheckpointHeaderBytes>(bytes.data(), bytes.size()));
  EXPECT_EQ(std::memcmp(bytes.data(), kPinned.data(), kPinned.size()), 0);
  for (std::size_t i = kPinned.size(); i < bytes.size(); ++i) {
    ASSERT_EQ(bytes[i], std::byte{0}) << "padding byte " << i;
  }
  Result<CheckpointHeader> back = decode_checkpoint_header(bytes);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  const CheckpointHeader want = sample();
  EXPECT_EQ(back->magic, kCheckpointMagic);
  EXPECT_EQ(back->version, 3u);
  EXPECT_EQ(back->rank, want.rank);
  EXPECT_EQ(back->world_size, want.world_size);
  EXPECT_EQ(back->stage, want.stage);
  EXPECT_EQ(back->optimizer, want.optimizer);
  EXPECT_EQ(back->piece_mask, want.piece_mask);
  EXPECT_EQ(back->partition_elements, want.partition_elements);
  EXPECT_EQ(back->fingerprint, want.fingerprint);
  EXPECT_EQ(back->step, want.step);
  EXPECT_EQ(back->loss_scale, want.loss_scale);
  EXPECT_EQ(back->loss_scale_good_steps, want.loss_scale_good_steps);
  EXPECT_EQ(back->loss_scale_hysteresis_left, want.loss_scale_hysteresis_left);
}

TEST(CheckpointFormat, OtherVersionsForeignBytesAndDirtyPaddingAreRefused) {
  std::vector<std::byte> bytes(kCheckpointHeaderBytes);
  encode_checkpoint_header(
      sample(), std::span<std::byte, kCheckpointHeaderBytes>(bytes.data(), bytes.size()));
  // Version 2 (before linked rank files) is read; version 1 (no tags, no padding to 4096) and 4
  // (a later build's) are not, and the message names the header's version and this build's.
  std::vector<std::byte> v2 = bytes;
  v2[8] = std::byte{2};
  Result<CheckpointHeader> old = decode_checkpoint_header(v2);
  ASSERT_TRUE(old.is_ok()) << old.status().to_string();
  EXPECT_EQ(old->version, 2u);
  EXPECT_EQ(old->step, sample().step);
  for (const unsigned char other : {1, 4}) {
    std::vector<std::byte> v = bytes;
    v[8] = std::byte{other};
    const Status version = decode_checkpoint_header(v).status();
    EXPECT_EQ(version.code(), Code::kInvalidArgument) << version.to_string();
    EXPECT_NE(version.message().find(fmt::format("version {};", other)), std::string::npos)
        << version.to_string();
    EXPECT_NE(version.message().find("reads versions 2 to 3"), std::string::npos)
        << version.to_string();
  }
  std::vector<std::byte> foreign = bytes;
  foreign[0] = std::byte{'X'};
  EXPECT_EQ(decode_checkpoint_header(foreign).status().code(), Code::kCorruption);
  std::vector<std::byte> dirty = bytes;
  dirty[100] = std::byte{1};
  const Status padding = decode_checkpoint_header(dirty).status();
  EXPECT_EQ(padding.code(), Code::kCorruption);
  EXPECT_NE(padding.message().find("byte 100"), std::string::npos) << padding.to_string();
  EXPECT_EQ(decode_checkpoint_header(std::span(bytes).first(4095)).status().code(),
            Code::kCorruption);
}

}  // namespace
}  // namespace zinf
