// Runs the zinf binary of the same build from a test: found as bin/zinf in a directory above the
// test binary, so the tests need no install step and never pick up another build's zinf.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

namespace zinf::plan {

// The path of bin/zinf beside this build's tests, or "" when it has not been built.
inline std::string zinf_binary() {
  namespace fs = std::filesystem;
  const fs::path exe = fs::read_symlink("/proc/self/exe");
  for (fs::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path();
       dir = dir.parent_path()) {
    if (fs::exists(dir / "bin" / "zinf")) return (dir / "bin" / "zinf").string();
  }
  return "";
}

// Runs `cmd` through the shell; returns its exit code (-1 when it could not run or did not exit)
// and leaves its stdout in `out`.
inline int run_command(const std::string& cmd, std::string* out) {
  out->clear();
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return -1;
  std::array<char, 4096> chunk;
  while (std::fgets(chunk.data(), chunk.size(), pipe) != nullptr) *out += chunk.data();
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace zinf::plan
