#include "base/heap.hpp"

// Any C or C++ library header defines __GLIBC__ where the C library is glibc (through
// <features.h>); heap.hpp includes none, so one comes before the test below.
#include <cstdlib>
#include <mutex>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace zinf {

void release_freed_memory() {
#if defined(__GLIBC__)
  // Where glibc's malloc is not the program's allocator (a sanitizer's runtime, or jemalloc or
  // tcmalloc put in front of it with LD_PRELOAD), nothing has set glibc's heaps up when the
  // first call comes, and malloc_trim sets them up unlocked: two threads' first calls at once
  // both take the main heap as their own, and glibc aborts when the second of them exits
  // ("malloc assertion failure in __malloc_arena_thread_freeres") or crashes before. One call
  // at a time makes the first one set them up alone.
  static std::mutex one_at_a_time;
  const std::lock_guard<std::mutex> lock(one_at_a_time);
  // Its result says only whether any memory was released; there is no failure to report.
  (void)::malloc_trim(0);
#endif
}

}  // namespace zinf
