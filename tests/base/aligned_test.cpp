// AlignedBuffer (lib/base/aligned.hpp): zeroed_pages() maps zeros, a mapping the kernel refuses
// is a Status naming what was asked for, not the end of the process, and
// advise_no_huge_pages() marks the whole pages of a range off transparent huge pages.
#include "base/aligned.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <random>
#include <string>

#include "common/resident_memory.hpp"

namespace zinf {
namespace {

using test::vm_flags;

TEST(ZeroedPages, MapsZerosThatCanBeWritten) {
  AlignedBuffer buffer;
  const std::size_t bytes = (std::size_t{3} << 20) + 100;
  ASSERT_TRUE(AlignedBuffer::zeroed_pages(bytes, "test array", &buffer).is_ok());
  ASSERT_EQ(buffer.bytes(), bytes);
  ASSERT_EQ(reinterpret_cast<std::uintptr_t>(buffer.data()) % 4096, 0u);
  for (std::size_t i = 0; i < bytes; ++i) ASSERT_EQ(buffer.data()[i], std::byte{0}) << i;
  // Written anywhere, and inside the first 4096 bytes, which the second map below covers.
  std::mt19937_64 rng(5);
  const std::size_t at = rng() % bytes;
  const std::size_t first_page_at = rng() % 4096;
  buffer.data()[at] = std::byte{0x5a};
  buffer.data()[first_page_at] = std::byte{0xa5};
  EXPECT_EQ(buffer.data()[at], std::byte{0x5a});
  EXPECT_EQ(buffer.data()[first_page_at], std::byte{0xa5});
  // A second map into the same buffer replaces the first with fresh zeros: none of the bytes
  // written above shows through, wherever the kernel places the new mapping.
  ASSERT_TRUE(AlignedBuffer::zeroed_pages(4096, "test array", &buffer).is_ok());
  EXPECT_EQ(buffer.bytes(), 4096u);
  for (std::size_t i = 0; i < 4096; ++i) ASSERT_EQ(buffer.data()[i], std::byte{0}) << i;
  ASSERT_TRUE(AlignedBuffer::zeroed_pages(0, "test array", &buffer).is_ok());
  EXPECT_EQ(buffer.bytes(), 0u);
  EXPECT_EQ(buffer.data(), nullptr);
}

// More than any address space holds (2^62 bytes; user space is 2^47 on x86-64 and AArch64).
TEST(ZeroedPages, AMappingTheKernelRefusesIsResourceExhaustedNamingWhatAndTheBytes) {
  AlignedBuffer buffer;
  ASSERT_TRUE(AlignedBuffer::zeroed_pages(4096, "earlier", &buffer).is_ok());
  const std::size_t bytes = std::size_t{1} << 62;
  const Status st = AlignedBuffer::zeroed_pages(bytes, "the moments of layer 7", &buffer);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.to_string();
  EXPECT_NE(st.sys_code(), 0);
  const std::string message(st.message());
  EXPECT_NE(message.find("the moments of layer 7"), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(bytes) + " bytes"), std::string::npos) << message;
  EXPECT_EQ(buffer.bytes(), 0u);
  EXPECT_EQ(buffer.data(), nullptr);
}

// The whole pages inside the range are marked "nh" (MADV_NOHUGEPAGE); the pages around it, and
// the page the range begins inside of, are not.
TEST(ZeroedPages, AdviseNoHugePagesMarksTheWholePagesInsideTheRange) {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  AlignedBuffer buffer;
  ASSERT_TRUE(AlignedBuffer::zeroed_pages(8 * kMiB, "test array", &buffer).is_ok());
  EXPECT_FALSE(buffer.advise_no_huge_pages(100, 200)) << "no whole page inside";
  if (!buffer.advise_no_huge_pages(kMiB + 100, 4 * kMiB)) {
    GTEST_SKIP() << "the kernel refuses MADV_NOHUGEPAGE (built without transparent huge pages)";
  }
  const std::byte* p = buffer.data();
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  EXPECT_NE(vm_flags(p + 3 * kMiB).find(" nh "), std::string::npos) << vm_flags(p + 3 * kMiB);
  EXPECT_NE(vm_flags(p + kMiB + page).find(" nh "), std::string::npos);
  EXPECT_NE(vm_flags(p + 5 * kMiB - 1).find(" nh "), std::string::npos);
  for (std::size_t at : {std::size_t{0}, kMiB, kMiB + page - 1, 5 * kMiB, 8 * kMiB - 1}) {
    const std::string flags = vm_flags(p + at);
    ASSERT_FALSE(flags.empty()) << at;
    EXPECT_EQ(flags.find(" nh "), std::string::npos) << at << ": " << flags;
  }
  // Still zeros, and writable on both sides.
  buffer.data()[3 * kMiB] = std::byte{1};
  buffer.data()[6 * kMiB] = std::byte{2};
  EXPECT_EQ(buffer.data()[3 * kMiB + 1], std::byte{0});
}

}  // namespace
}  // namespace zinf
