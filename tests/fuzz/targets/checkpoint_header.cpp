#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "base/assert.hpp"
#include "engine/checkpoint.hpp"
#include "targets.hpp"

namespace zinf::fuzz {

int checkpoint_header(const std::uint8_t* data, std::size_t bytes) {
  // Short inputs are the header's fields with zero padding after them, so that the fuzzer
  // reaches past the magic and version checks.
  std::vector<std::byte> head(kCheckpointHeaderBytes);
  std::memcpy(head.data(), data, std::min(bytes, head.size()));
  Result<CheckpointHeader> decoded = decode_checkpoint_header(head);
  if (decoded.is_ok()) {
    std::vector<std::byte> again(kCheckpointHeaderBytes);
    encode_checkpoint_header(
        *decoded, std::span<std::byte, kCheckpointHeaderBytes>(again.data(), again.size()));
    ZINF_ASSERT_MSG(again == head, "a checkpoint header does not encode back to its bytes");
  }
  // Any length as it comes.
  (void)decode_checkpoint_header(std::span(reinterpret_cast<const std::byte*>(data), bytes));
  return 0;
}

}  // namespace zinf::fuzz
