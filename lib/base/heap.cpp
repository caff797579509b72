#include "base/heap.hpp"

// Any C or C++ library header defines __GLIBC__ where the C library is glibc (through
// <features.h>); heap.hpp includes none, so one comes before the test below.
#include <cstdlib>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace zinf {

void release_freed_memory() {
#if defined(__GLIBC__)
  // Its result says only whether any memory was released; there is no failure to report.
  (void)::malloc_trim(0);
#endif
}

}  // namespace zinf
