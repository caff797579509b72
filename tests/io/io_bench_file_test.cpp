// The bench on an existing file (`zinf io bench --path FILE`) keeps to the file as it is: a write
// of more bytes than the file holds wraps within it and leaves its size alone, and a file shorter
// than one request is refused naming it and both sizes.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "base/random.hpp"
#include "io/buffer_pool.hpp"
#include "io/io_bench.hpp"
#include "io_test_util.hpp"

namespace zinf {
namespace {

using io_test::must_open;
using io_test::read_file_plain;
using io_test::ScratchDir;

class IoBenchFileTest : public io_test::EngineKindTest {};

TEST_P(IoBenchFileTest, WriteBenchOnAFileLeavesItsSize) {
  const std::uint64_t seed = 0xbe1;
  std::printf("bench file: seed %llu\n", static_cast<unsigned long long>(seed));
  ScratchDir dir("iobench-file");
  const std::string path = dir.file("existing.bin");
  constexpr std::size_t kFileBytes = 1 << 20;
  {
    std::string old(kFileBytes, '\0');
    fill_random_bytes(old.data(), old.size(), seed);
    std::ofstream(path, std::ios::binary).write(old.data(), static_cast<long>(old.size()));
  }
  IoOptions options;
  options.block_bytes = 64 << 10;
  options.queue_depth = 4;
  options.max_requests = 64;
  auto engine = must_open(GetParam(), options);
  ASSERT_TRUE(engine);
  const std::size_t request = 2 * options.block_bytes;
  Result<std::unique_ptr<BufferPool>> pool = BufferPool::create(
      {.block_bytes = request, .block_count = io_bench_pool_blocks(options, request)});
  ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  ASSERT_TRUE((*pool)->register_with(*engine).is_ok());
  fill_random_bytes((*pool)->block(0), request, seed + 1);
  for (std::size_t b = 1; b < (*pool)->block_count(); ++b) {
    std::memcpy((*pool)->block(b), (*pool)->block(0), request);
  }
  Result<FileHandle> file = engine->open_file(path, {.write = true, .create = false});
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();

  // 4 MiB written over a 1 MiB file: four times round it, the size unchanged.
  Result<IoBenchConfig> config =
      io_bench_file_config(IoOp::kWrite, 4 << 20, kFileBytes, request, path);
  ASSERT_TRUE(config.is_ok()) << config.status().to_string();
  Result<IoBenchResult> written = run_io_bench(*engine, *file, **pool, *config);
  ASSERT_TRUE(written.is_ok()) << written.status().to_string();
  EXPECT_EQ(written->bytes, 4u << 20);
  EXPECT_EQ(std::filesystem::file_size(path), kFileBytes);
  const std::string on_disk = read_file_plain(path);
  ASSERT_EQ(on_disk.size(), kFileBytes);
  for (std::size_t at = 0; at < on_disk.size(); at += request) {
    ASSERT_EQ(std::memcmp(on_disk.data() + at, (*pool)->block(0), request), 0) << at;
  }

  // A read moves at most the file.
  config = io_bench_file_config(IoOp::kRead, 4 << 20, kFileBytes, request, path);
  ASSERT_TRUE(config.is_ok()) << config.status().to_string();
  Result<IoBenchResult> read = run_io_bench(*engine, *file, **pool, *config);
  ASSERT_TRUE(read.is_ok()) << read.status().to_string();
  EXPECT_EQ(read->bytes, kFileBytes);
}

TEST(IoBenchFile, AFileShorterThanOneRequestIsRefusedNamingIt) {
  for (IoOp op : {IoOp::kRead, IoOp::kWrite}) {
    Result<IoBenchConfig> config =
        io_bench_file_config(op, 4 << 20, 64 << 10, 128 << 10, "/scratch/small.bin");
    ASSERT_EQ(config.status().code(), Code::kInvalidArgument) << config.status().to_string();
    const std::string message(config.status().message());
    EXPECT_NE(message.find("/scratch/small.bin"), std::string::npos) << message;
    EXPECT_NE(message.find("65536"), std::string::npos) << message;
    EXPECT_NE(message.find("131072"), std::string::npos) << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, IoBenchFileTest, io_test::kAllEngineKinds, io_test::kind_name);

}  // namespace
}  // namespace zinf
