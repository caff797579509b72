// The offload path without a bounce buffer: a file read by the IoEngine lands in a PinnedPool
// block that the pool registered with both the engine and the CudaDevice, and that same block is
// the source of the host-to-device copy. The bytes that come back from the GPU must be the
// file's. Skips with the reason when there is no device.
#include <gtest/gtest.h>

#if defined(ZINF_HAVE_CUDA)

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "device/cuda_device.hpp"
#include "device/pinned_pool.hpp"
#include "gpu/gpu_util.hpp"
#include "io/io_engine.hpp"

namespace zinf {
namespace {

using std::chrono::milliseconds;

TEST(PinnedPath, FileReadIntoPinnedBlockIsTheHostToDeviceSource) {
  ZINF_REQUIRE_CUDA_DEVICE();
  const std::size_t bytes = std::size_t{8} << 20;
  const char* tmp = std::getenv("ZINF_TEST_TMPDIR");
  const std::string dir = tmp != nullptr && tmp[0] != '\0' ? tmp : "/tmp";
  // Made here too: nothing else in this binary may have run first (gtest runs the plain TESTs
  // before the TEST_P suites), and a bundle's test runs outside ctest's fixture.
  std::error_code ignored;
  std::filesystem::create_directories(dir, ignored);
  const std::string path = dir + "/zinf_pinned_path_" + std::to_string(::getpid());
  std::vector<unsigned char> file_bytes(bytes);
  fill_random_bytes(file_bytes.data(), bytes, 0xf11e);
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(file_bytes.data()),
              static_cast<std::streamsize>(bytes));
    ASSERT_TRUE(out.good()) << "cannot write " << path;
  }
  struct Remove {
    std::string path;
    ~Remove() { std::remove(path.c_str()); }
  } remove{path};

  Result<std::unique_ptr<Device>> device = make_cuda_device();
  ASSERT_TRUE(device.is_ok()) << device.status().to_string();
  Result<std::unique_ptr<IoEngine>> engine = open_engine({});
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  Result<std::unique_ptr<PinnedPool>> pool =
      PinnedPool::create({.block_bytes = bytes, .block_count = 2, .device = device->get()});
  ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  EXPECT_TRUE((*pool)->device_registered());
  ASSERT_TRUE((*pool)->register_with(**engine).is_ok());

  Result<PinnedPool::Lease> block = (*pool)->acquire(milliseconds(10000));
  ASSERT_TRUE(block.is_ok()) << block.status().to_string();
  // Not O_DIRECT: the scratch directory may be a filesystem that refuses it; the buffer is the
  // same registered block either way.
  Result<FileHandle> file =
      (*engine)->open_file(path, {.write = false, .create = false, .direct = false});
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  Result<Ticket> ticket = (*engine)->submit(
      {.op = IoOp::kRead, .file = *file, .offset = 0, .bytes = bytes, .data = block->data()});
  ASSERT_TRUE(ticket.is_ok()) << ticket.status().to_string();
  const Status read = (*engine)->wait(*ticket, milliseconds(30000));
  ASSERT_TRUE(read.is_ok()) << read.to_string();

  Device& dev = **device;
  Result<std::unique_ptr<Stream>> stream = dev.create_stream("h2d");
  Result<DeviceBuffer> on_gpu = DeviceBuffer::allocate(dev, bytes);
  ASSERT_TRUE(stream.is_ok() && on_gpu.is_ok());
  ASSERT_TRUE(dev.copy_h2d(on_gpu->data(), block->data(), bytes, **stream).is_ok());
  std::vector<unsigned char> back(bytes, 0);
  ASSERT_TRUE(dev.copy_d2h(back.data(), on_gpu->data(), bytes, **stream).is_ok());
  ASSERT_TRUE(dev.synchronize(**stream, milliseconds(30000)).is_ok());
  EXPECT_EQ(back, file_bytes);
  ASSERT_TRUE((*engine)->close_file(*file).is_ok());
}

}  // namespace
}  // namespace zinf

#else  // !ZINF_HAVE_CUDA

TEST(PinnedPath, NeedsCuda) { GTEST_SKIP() << "no CUDA device: zinf was built without CUDA"; }

#endif
