#include "io_test_util.hpp"

#include <gtest/gtest.h>
#include <liburing.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "base/random.hpp"

namespace zinf::io_test {

ScratchMount::ScratchMount(const std::string& name, const std::string& type,
                           const std::string& options)
    : dir_(name) {
  if (::mount(type.c_str(), dir_.path().c_str(), type.c_str(), 0, options.c_str()) == 0) {
    mounted_ = true;
  } else {
    reason_ = "cannot mount " + type + " here (" + std::strerror(errno) + ")";
  }
}

ScratchMount::~ScratchMount() {
  if (mounted_) ::umount2(dir_.path().c_str(), MNT_DETACH);
}

AlignedBuffer random_buffer(std::size_t bytes, std::uint64_t seed) {
  AlignedBuffer buffer(bytes == 0 ? 4096 : bytes, 4096);
  fill_random_bytes(buffer.data(), bytes, seed);
  return buffer;
}

bool uring_available(std::string* why) {
  if (const char* v = std::getenv("ZINF_IO_DISABLE_URING"); v != nullptr && v[0] == '1') {
    *why = "ZINF_IO_DISABLE_URING=1";
    return false;
  }
  io_uring ring;
  const int rc = io_uring_queue_init(4, &ring, 0);
  if (rc < 0) {
    *why = std::string("io_uring_queue_init: ") + std::strerror(-rc);
    return false;
  }
  io_uring_queue_exit(&ring);
  return true;
}

void EngineKindTest::SetUp() {
  std::string why;
  if (GetParam() == EngineKind::kUring && !uring_available(&why)) {
    GTEST_SKIP() << "io_uring unavailable here: " << why;
  }
}

std::string kind_name(const ::testing::TestParamInfo<EngineKind>& info) {
  return std::string(engine_kind_name(info.param));
}

std::unique_ptr<IoEngine> must_open(EngineKind kind, IoOptions options) {
  options.kind = kind;
  Result<std::unique_ptr<IoEngine>> engine = open_engine(options);
  EXPECT_TRUE(engine.is_ok()) << engine.status().to_string();
  if (!engine.is_ok()) return nullptr;
  return std::move(engine).value();
}

std::string read_file_plain(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace zinf::io_test
