// The process's resident memory, for tests that check what an allocation really costs (fresh zero
// pages that nothing writes are allocated but never resident).
#pragma once

#include <cstdint>
#include <cstdio>

namespace zinf::test {

// This process's resident anonymous bytes now (RssAnon in /proc/self/status, kB): what the
// program allocates and touches, without the file-backed pages (the binary, its libraries) that
// statm's resident count also holds and that page in and out with no allocation. 0 where the
// kernel does not report it.
inline std::uint64_t resident_anon_bytes() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  unsigned long long kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "RssAnon: %llu kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib * 1024;
}

}  // namespace zinf::test
