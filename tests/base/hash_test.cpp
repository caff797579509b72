// xxh3_64() (base/hash.hpp) against libxxhash's XXH3_64bits, on every path this CPU can run.
#include "base/hash.hpp"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "base/cpu.hpp"
#include "base/random.hpp"

namespace zinf {
namespace {

// Every length class XXH3 treats differently (0, 1-3, 4-8, 9-16, 17-128, 129-240, longer: a
// stripe, a block, many blocks with a tail), from aligned and unaligned starts, over seeded
// random bytes: each path gives the library's value, and the empty input the published one.
TEST(Hash, EveryXxh3PathMatchesTheLibrary) {
  using Hash = std::uint64_t (*)(const void*, std::size_t);
  std::vector<std::pair<const char*, Hash>> paths = {{"library", &hash_kernel::xxh3_64_library},
                                                     {"public", &xxh3_64}};
  if (cpu_features().has_avx2_path()) paths.push_back({"avx2", &hash_kernel::xxh3_64_avx2});
  if (cpu_features().has_avx512_path()) paths.push_back({"avx512", &hash_kernel::xxh3_64_avx512});
  SplitMix64 rng(0x3a5b);
  std::vector<std::uint8_t> bytes((std::size_t{1} << 20) + 64);
  for (std::uint8_t& b : bytes) b = static_cast<std::uint8_t>(rng.next());
  const std::size_t lengths[] = {0,
                                 1,
                                 3,
                                 4,
                                 8,
                                 9,
                                 16,
                                 17,
                                 128,
                                 129,
                                 240,
                                 241,
                                 1023,
                                 1024,
                                 4096,
                                 65536 + 7,
                                 (std::size_t{1} << 20)};
  for (const auto& [name, hash] : paths) {
    EXPECT_EQ(hash(bytes.data(), 0), 0x2D06800538D394C2ull) << name;
    for (std::size_t start : {std::size_t{0}, std::size_t{1}, std::size_t{37}}) {
      for (std::size_t length : lengths) {
        ASSERT_EQ(hash(bytes.data() + start, length), XXH3_64bits(bytes.data() + start, length))
            << name << ": " << length << " bytes from " << start;
      }
    }
  }
}

}  // namespace
}  // namespace zinf
