#include <span>

#include "base/assert.hpp"
#include "comm/tcp_bootstrap.hpp"
#include "targets.hpp"

namespace zinf::fuzz {

int tcp_wire(const std::uint8_t* data, std::size_t bytes) {
  const std::span<const unsigned char> input(data, bytes);
  Result<TcpHello> hello = decode_tcp_hello(input);
  if (hello.is_ok()) {
    // A hello that decodes encodes back to the same bytes.
    const auto again = encode_tcp_hello(*hello);
    ZINF_ASSERT(bytes == again.size() && std::equal(again.begin(), again.end(), data));
  }
  // Every prefix a rank might have read so far, as a reply header.
  if (bytes >= kTcpReplyHeaderBytes) {
    Result<TcpReplyHeader> header = decode_tcp_reply_header(input.first(kTcpReplyHeaderBytes));
    if (header.is_ok()) ZINF_ASSERT(header->payload_bytes <= kTcpBootstrapMaxBlobBytes);
  }
  (void)decode_tcp_reply_header(input);
  return 0;
}

}  // namespace zinf::fuzz
