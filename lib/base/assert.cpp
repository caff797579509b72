#include "base/assert.hpp"

#include <cstdio>
#include <cstdlib>

namespace zinf::detail {

void assert_fail(const char* expr, const char* file, int line, const char* message) {
  std::fprintf(stderr, "zinf: assertion failed at %s:%d: %s%s%s\n", file, line, expr,
               message ? ": " : "", message ? message : "");
  std::fflush(stderr);
  std::abort();
}

}  // namespace zinf::detail
