// SwapSpace keeps a ticket per unit an op may move, for every op it can have in flight: sized by
// the space's own files when they are smaller than max_op_bytes, so that a small space with small
// blocks costs kilobytes, and an op over a whole extent still finds a ticket for every unit.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "common/resident_memory.hpp"
#include "common/sanitizer.hpp"
#include "io/swap_space.hpp"
#include "io_test_util.hpp"

namespace zinf {
namespace {

constexpr std::size_t kBlock = 64 << 10;
constexpr std::int64_t kMiB = std::int64_t{1} << 20;

std::unique_ptr<IoEngine> small_engine() {
  IoOptions options;
  options.block_bytes = 32 << 10;
  options.queue_depth = 8;
  options.max_requests = 2048;
  return io_test::must_open(EngineKind::kThread, options);
}

SwapOptions small_space(const io_test::ScratchDir& root, std::size_t dir_count) {
  SwapOptions options;
  for (std::size_t d = 0; d < dir_count; ++d) {
    options.dirs.push_back(fmt::format("{}/d{}", root.path(), d));
    std::filesystem::create_directories(options.dirs.back());
  }
  options.capacity_bytes = 2 * kMiB;
  options.block_bytes = kBlock;  // max_op_bytes and max_ops keep their defaults: 1 GiB, 256
  return options;
}

TEST(SwapSpaceTickets, ASmallSpaceOfSmallBlocksCostsKilobytesNotTheDefaultOpsTickets) {
  if (test::kThreadSanitizer || test::kAddressSanitizer) {
    GTEST_SKIP() << "a sanitizer's shadow memory grows with every byte touched";
  }
  if (test::resident_anon_bytes() == 0) GTEST_SKIP() << "the kernel reports no RssAnon";
  io_test::ScratchDir root("swap-tickets-small");
  std::unique_ptr<IoEngine> engine = small_engine();
  const std::uint64_t before = test::resident_anon_bytes();
  Result<std::unique_ptr<SwapSpace>> space = SwapSpace::open(*engine, small_space(root, 1));
  ASSERT_TRUE(space.is_ok()) << space.status().to_string();
  const auto growth =
      static_cast<std::int64_t>(test::resident_anon_bytes()) - static_cast<std::int64_t>(before);
  // 256 ops of 2 MiB / 64 KiB + 1 = 33 tickets of 8 bytes: 66 KiB. With tickets for 1 GiB ops
  // it was 256 * 16385 * 8 bytes = 32 MiB.
  EXPECT_LE(growth, 2 * kMiB);
}

// Ops over the whole of an extent that fills the space, in one directory and striped over three,
// take every ticket the bound allows and read back what they wrote.
TEST(SwapSpaceTickets, AnOpOverAWholeSpaceHasATicketForEveryUnit) {
  for (std::size_t dirs : {std::size_t{1}, std::size_t{3}}) {
    SCOPED_TRACE(fmt::format("{} directories", dirs));
    io_test::ScratchDir root(fmt::format("swap-tickets-whole-{}", dirs));
    std::unique_ptr<IoEngine> engine = small_engine();
    SwapOptions options = small_space(root, dirs);
    Result<std::unique_ptr<SwapSpace>> space = SwapSpace::open(*engine, options);
    ASSERT_TRUE(space.is_ok()) << space.status().to_string();
    const std::uint64_t bytes = options.capacity_bytes;  // whole blocks: no striping slack needed
    Result<ExtentId> id = (*space)->create("whole", bytes);
    ASSERT_TRUE(id.is_ok()) << id.status().to_string();
    AlignedBuffer out = io_test::random_buffer(bytes, 41 + dirs);
    AlignedBuffer back(bytes);
    ASSERT_TRUE((*space)->write_sync(*id, out.data()).is_ok());
    ASSERT_TRUE((*space)->read_sync(*id, back.data()).is_ok());
    EXPECT_EQ(0, std::memcmp(out.data(), back.data(), bytes));
  }
}

}  // namespace
}  // namespace zinf
