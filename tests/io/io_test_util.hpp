// Helpers shared by the io tests: scratch paths, seeded data, engines of each kind (and the
// fixture that runs a test on each), and a small filesystem mounted for full-disk and
// O_DIRECT-refusal tests when the process may mount.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "base/aligned.hpp"
#include "common/scratch_dir.hpp"
#include "io/io_engine.hpp"

namespace zinf::io_test {

// The swap-space tests' block: a SwapSpace's unit of striping and allocation.
inline constexpr std::size_t kSwapBlock = 64 << 10;

using test::ScratchDir;

// A small filesystem (`type`: tmpfs or ramfs, `options` e.g. "size=2m,ro") mounted under a
// scratch directory; ok() is false, with reason(), when mounting is not allowed here.
class ScratchMount {
 public:
  ScratchMount(const std::string& name, const std::string& type, const std::string& options);
  ~ScratchMount();
  bool ok() const { return mounted_; }
  const std::string& reason() const { return reason_; }
  const std::string& path() const { return dir_.path(); }

 private:
  ScratchDir dir_;
  bool mounted_ = false;
  std::string reason_;
};

// 4096-aligned random bytes from `seed`.
AlignedBuffer random_buffer(std::size_t bytes, std::uint64_t seed);

// Whether this kernel lets us create an io_uring; when not, `why` says why.
bool uring_available(std::string* why);

// The fixture of a test run once per engine kind (the parameter): skips the uring run, naming
// the reason, where the kernel refuses io_uring. Instantiate with
//   INSTANTIATE_TEST_SUITE_P(Kinds, MyTest, io_test::kAllEngineKinds, io_test::kind_name);
class EngineKindTest : public ::testing::TestWithParam<EngineKind> {
 protected:
  void SetUp() override;
};
inline const auto kAllEngineKinds = ::testing::Values(EngineKind::kUring, EngineKind::kThread);
// "uring" / "thread": the parameterized test's name suffix.
std::string kind_name(const ::testing::TestParamInfo<EngineKind>& info);

// Opens an engine of `kind` with `options` (kind overridden); fails the test on error.
std::unique_ptr<IoEngine> must_open(EngineKind kind, IoOptions options = {});

// Reads the whole file with plain pread (no engine): the independent reference.
std::string read_file_plain(const std::string& path);

}  // namespace zinf::io_test
