// Whether this test build runs under ThreadSanitizer (or AddressSanitizer), for the tests that
// cannot: those that race on purpose, and those that measure the process's resident memory (the
// sanitizer's shadow memory grows with every byte the program touches).
#pragma once

namespace zinf::test {

// GCC says -fsanitize=thread with __SANITIZE_THREAD__, clang with __has_feature.
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif
#else
inline constexpr bool kThreadSanitizer = false;
#endif

// Likewise AddressSanitizer (-fsanitize=address), whose shadow memory adds an eighth of every
// byte touched to the resident set and whose allocator keeps freed memory in quarantine.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

}  // namespace zinf::test
