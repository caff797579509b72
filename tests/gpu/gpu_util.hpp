// Helpers for the GPU tests: the skip-without-device check and a small owning device buffer.
// Compiled only where the CUDA backend is built (ZINF_HAVE_CUDA).
#pragma once

#if defined(ZINF_HAVE_CUDA)

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace zinf::gpu_test {

// Empty when a CUDA device is usable; otherwise why not (no device, no driver, ...).
std::string no_device_reason();

// Skips the current test, printing the reason, when there is no usable CUDA device.
#define ZINF_REQUIRE_CUDA_DEVICE()                                                 \
  do {                                                                             \
    const std::string zinf_reason_ = ::zinf::gpu_test::no_device_reason();         \
    if (!zinf_reason_.empty()) GTEST_SKIP() << "no CUDA device: " << zinf_reason_; \
  } while (0)

#define ZINF_CUDA_OK(expr)                                                               \
  do {                                                                                   \
    const cudaError_t zinf_err_ = (expr);                                                \
    ASSERT_EQ(zinf_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(zinf_err_); \
  } while (0)

// Device memory of `bytes` (plus `slack_bytes` so tests may offset into it to misalign).
class DeviceMemory {
 public:
  explicit DeviceMemory(std::size_t bytes);
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory();

  template <typename T>
  T* as(std::size_t offset_bytes = 0) const {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(data_) + offset_bytes);
  }
  bool ok() const { return data_ != nullptr; }

 private:
  void* data_ = nullptr;
};

// Copies between host vectors and device pointers, synchronously (tests only).
template <typename T>
cudaError_t upload(T* device, const std::vector<T>& host) {
  return cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
}
template <typename T>
cudaError_t download(std::vector<T>& host, const T* device) {
  return cudaMemcpy(host.data(), device, host.size() * sizeof(T), cudaMemcpyDeviceToHost);
}

// A loopback TCP port that was free a moment ago (bind port 0, read it, close), for
// MASTER_PORT in bootstrap tests.
std::uint16_t free_tcp_port();

// Random floats that exercise rounding and special values: any bit pattern, values over a wide
// exponent range, exact 16-bit ties, zeros, infinities and NaNs.
std::vector<float> awkward_floats(std::size_t count, std::uint64_t seed);

}  // namespace zinf::gpu_test

#endif  // ZINF_HAVE_CUDA
