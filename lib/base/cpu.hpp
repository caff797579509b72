// What the CPU can do, read once at run time (the library is built for baseline x86-64 and
// dispatches to AVX2 or AVX-512 code only where these say so).
#pragma once

#include <string>
#include <vector>

namespace zinf {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512bf16 = false;

  // AVX2 + FMA + F16C: what *_avx2.cpp files are compiled for.
  bool has_avx2_path() const { return avx2 && fma && f16c; }
  // AVX-512 F/BW/VL/DQ (+ the AVX2 path): what *_avx512.cpp files are compiled for, except the
  // BF16 instructions, which such code must check avx512bf16 for separately.
  bool has_avx512_path() const {
    return has_avx2_path() && avx512f && avx512bw && avx512vl && avx512dq;
  }
  // Names of the features present, e.g. {"avx2", "fma", ...}.
  std::vector<std::string> names() const;
};

const CpuFeatures& cpu_features();
// The CPU's model name from /proc/cpuinfo, or "unknown".
std::string cpu_model_name();
// Logical cores this process may run on (sched_getaffinity).
int cpu_count();

}  // namespace zinf
