// The checkpoint header's byte layout (see checkpoint.hpp), in a file of its own so that the fuzz
// build can link it without the rest of the checkpoint code.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <type_traits>

#include "engine/checkpoint.hpp"

namespace zinf {

namespace {

template <typename T>
void put_le(std::byte* out, T value) {
  std::uint64_t bits = 0;
  if constexpr (std::is_same_v<T, double>) {
    bits = std::bit_cast<std::uint64_t>(value);
  } else {
    bits = static_cast<std::uint64_t>(static_cast<std::make_unsigned_t<T>>(value));
  }
  for (std::size_t i = 0; i < sizeof(T); ++i) out[i] = static_cast<std::byte>(bits >> (8 * i));
}

template <typename T>
T get_le(const std::byte* in) {
  std::uint64_t bits = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    bits |= static_cast<std::uint64_t>(in[i]) << (8 * i);
  }
  if constexpr (std::is_same_v<T, double>) {
    return std::bit_cast<double>(bits);
  } else {
    return static_cast<T>(static_cast<std::make_unsigned_t<T>>(bits));
  }
}

constexpr std::size_t kHeaderFieldBytes = 80;  // the fields; zeros after them

}  // namespace

void encode_checkpoint_header(const CheckpointHeader& h,
                              std::span<std::byte, kCheckpointHeaderBytes> out) {
  std::fill(out.begin(), out.end(), std::byte{0});
  std::byte* p = out.data();
  put_le(p + 0, h.magic);
  put_le(p + 8, h.version);
  put_le(p + 12, h.rank);
  put_le(p + 16, h.world_size);
  put_le(p + 20, h.stage);
  put_le(p + 24, h.optimizer);
  put_le(p + 28, h.piece_mask);
  put_le(p + 32, h.partition_elements);
  put_le(p + 40, h.fingerprint);
  put_le(p + 48, h.step);
  put_le(p + 56, h.loss_scale);
  put_le(p + 64, h.loss_scale_good_steps);
  put_le(p + 72, h.loss_scale_hysteresis_left);
  put_le(p + 76, h.reserved);
}

Result<CheckpointHeader> decode_checkpoint_header(std::span<const std::byte> bytes) {
  if (bytes.size() != kCheckpointHeaderBytes) {
    return Status::corruption(fmt::format("a checkpoint header is {} bytes, not {}",
                                          kCheckpointHeaderBytes, bytes.size()));
  }
  const std::byte* p = bytes.data();
  CheckpointHeader h;
  h.magic = get_le<std::uint64_t>(p + 0);
  if (h.magic != kCheckpointMagic) {
    return Status::corruption(fmt::format("not a zinf checkpoint (magic {:016x})", h.magic));
  }
  h.version = get_le<std::uint32_t>(p + 8);
  if (h.version != kCheckpointVersion) {
    return Status::invalid_argument(fmt::format(
        "checkpoint format version {}; this build reads version {}", h.version,
        kCheckpointVersion));
  }
  h.rank = get_le<std::uint32_t>(p + 12);
  h.world_size = get_le<std::uint32_t>(p + 16);
  h.stage = get_le<std::uint32_t>(p + 20);
  h.optimizer = get_le<std::uint32_t>(p + 24);
  h.piece_mask = get_le<std::uint32_t>(p + 28);
  h.partition_elements = get_le<std::uint64_t>(p + 32);
  h.fingerprint = get_le<std::uint64_t>(p + 40);
  h.step = get_le<std::int64_t>(p + 48);
  h.loss_scale = get_le<double>(p + 56);
  h.loss_scale_good_steps = get_le<std::int64_t>(p + 64);
  h.loss_scale_hysteresis_left = get_le<std::int32_t>(p + 72);
  h.reserved = get_le<std::uint32_t>(p + 76);
  for (std::size_t i = kHeaderFieldBytes; i < bytes.size(); ++i) {
    if (bytes[i] != std::byte{0}) {
      return Status::corruption(fmt::format("checkpoint header byte {} is not zero padding", i));
    }
  }
  return h;
}

}  // namespace zinf
