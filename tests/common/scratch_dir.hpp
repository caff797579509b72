// A fresh directory for one test's files: $ZINF_TEST_TMPDIR/<name>-<pid> (or under /tmp when the
// variable is unset), emptied when created and removed with its files when destroyed. The pid
// keeps tests that ctest runs in parallel processes apart.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace zinf::test {

class ScratchDir {
 public:
  explicit ScratchDir(const std::string& name) {
    const char* root = std::getenv("ZINF_TEST_TMPDIR");
    const std::string base = root != nullptr && root[0] != '\0' ? root : "/tmp";
    path_ = base + "/" + name + "-" + std::to_string(::getpid());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace zinf::test
