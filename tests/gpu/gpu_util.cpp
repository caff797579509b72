#include "gpu/gpu_util.hpp"

#if defined(ZINF_HAVE_CUDA)

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <limits>

#include "base/random.hpp"

namespace zinf::gpu_test {

std::string no_device_reason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(err) + " (" +
           cudaGetErrorString(err) + ")";
  }
  if (count == 0) return "cudaGetDeviceCount returned 0 devices";
  return {};
}

DeviceMemory::DeviceMemory(std::size_t bytes) {
  if (cudaMalloc(&data_, bytes + 64) != cudaSuccess) data_ = nullptr;
}

DeviceMemory::~DeviceMemory() {
  if (data_ != nullptr) (void)cudaFree(data_);
}

std::uint16_t free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  std::uint16_t port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

std::vector<float> awkward_floats(std::size_t count, std::uint64_t seed) {
  std::vector<float> out(count);
  SplitMix64 rng(seed);
  const float specials[] = {0.0f,
                            -0.0f,
                            65504.0f,
                            65520.0f,
                            -65536.0f,
                            2.98e-08f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::bit_cast<float>(0x7fc00001u),
                            std::bit_cast<float>(0xff800001u),
                            std::numeric_limits<float>::denorm_min()};
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint64_t r = rng.next();
    if (i < std::size(specials) && (seed & 1) == 0) {
      out[i] = specials[i];
    } else if (r % 4 == 0) {
      out[i] = std::bit_cast<float>(static_cast<std::uint32_t>(r >> 32));
    } else if (r % 4 == 1) {
      out[i] = std::bit_cast<float>((static_cast<std::uint32_t>(r >> 32) & 0xffff8000u) | 0x8000u);
    } else {
      out[i] = static_cast<float>(
          std::ldexp(rng.uniform() * 2.0 - 1.0, static_cast<int>((r >> 8) % 48) - 30));
    }
  }
  return out;
}

}  // namespace zinf::gpu_test

#endif  // ZINF_HAVE_CUDA
