// Assertions for broken invariants (programmer errors, not operating errors).
//
// ZINF_ASSERT stays on in release builds: a broken invariant in an engine that owns a user's
// training state must stop the process before it writes wrong data, not after. ZINF_DASSERT is
// for per-element loops and compiles away unless ZINF_DEBUG_ASSERTS is defined (debug builds).
#pragma once

namespace zinf::detail {
[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const char* message);
}  // namespace zinf::detail

#define ZINF_ASSERT(cond)                                              \
  do {                                                                 \
    if (__builtin_expect(!(cond), 0))                                  \
      ::zinf::detail::assert_fail(#cond, __FILE__, __LINE__, nullptr); \
  } while (0)

#define ZINF_ASSERT_MSG(cond, message)                                   \
  do {                                                                   \
    if (__builtin_expect(!(cond), 0))                                    \
      ::zinf::detail::assert_fail(#cond, __FILE__, __LINE__, (message)); \
  } while (0)

#if defined(ZINF_DEBUG_ASSERTS) || !defined(NDEBUG)
#define ZINF_DASSERT(cond) ZINF_ASSERT(cond)
#else
#define ZINF_DASSERT(cond) \
  do {                     \
  } while (0)
#endif
