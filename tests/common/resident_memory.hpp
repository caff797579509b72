// The process's memory as the kernel reports it, for tests that check what an allocation really
// costs (fresh zero pages that nothing writes are allocated but never resident) and how it is
// mapped.
#pragma once

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

namespace zinf::test {

// The bytes of one "<field>: <n> kB" line of /proc/self/status (`format` is its sscanf format,
// e.g. "RssAnon: %llu kB"); 0 where the kernel does not report it.
inline std::uint64_t status_bytes(const char* format) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  unsigned long long kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, format, &kib) == 1) break;
  }
  std::fclose(f);
  return kib * 1024;
}

// This process's resident anonymous bytes now (RssAnon, kB): what the program allocates and
// touches, without the file-backed pages (the binary, its libraries) that statm's resident count
// also holds and that page in and out with no allocation. 0 where the kernel does not report it.
inline std::uint64_t resident_anon_bytes() { return status_bytes("RssAnon: %llu kB"); }

// This process's pages from the hugetlb reserve (HugetlbPages), which RssAnon does not count.
inline std::uint64_t hugetlb_bytes() { return status_bytes("HugetlbPages: %llu kB"); }

// The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps), with a
// space on each side of every flag; empty when no mapping holds it.
inline std::string vm_flags(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx ", &lo, &hi) == 2) {
      inside = lo <= at && at < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line.substr(8) + " ";
    }
  }
  return "";
}

}  // namespace zinf::test
