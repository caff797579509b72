// Replaces the global operator new and delete so that a test can count the heap allocations made
// on any thread while it arms the counter: the check behind "nothing is allocated on the hot path
// after warm-up" (STYLE.md). Include this in exactly one source file of a test binary: it defines
// the replacement functions, which a program may contain only once.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace zinf::test {
// While true, every operator new adds one to g_allocations.
inline std::atomic<bool> g_count_allocations{false};
inline std::atomic<std::uint64_t> g_allocations{0};
}  // namespace zinf::test

// The replacement pair is malloc / free throughout; GCC sees them through inlining and cannot
// tell they belong together, so it warns.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t bytes) {
  if (zinf::test::g_count_allocations.load(std::memory_order_relaxed)) {
    zinf::test::g_allocations.fetch_add(1);
  }
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new[](std::size_t bytes) { return operator new(bytes); }
// The nothrow forms too (std::stable_sort's temporary buffer uses them): left to the runtime,
// they allocate with its operator new, which free() must not release (AddressSanitizer reports
// the mismatch), and they would go uncounted.
void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept {
  if (zinf::test::g_count_allocations.load(std::memory_order_relaxed)) {
    zinf::test::g_allocations.fetch_add(1);
  }
  return std::malloc(bytes == 0 ? 1 : bytes);
}
void* operator new[](std::size_t bytes, const std::nothrow_t& tag) noexcept {
  return operator new(bytes, tag);
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
// Over-aligned types (alignas above 16) come through these; they count the same.
void* operator new(std::size_t bytes, std::align_val_t align) {
  if (zinf::test::g_count_allocations.load(std::memory_order_relaxed)) {
    zinf::test::g_allocations.fetch_add(1);
  }
  const auto alignment = static_cast<std::size_t>(align);
  const std::size_t rounded = ((bytes == 0 ? 1 : bytes) + alignment - 1) / alignment * alignment;
  void* p = std::aligned_alloc(alignment, rounded);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new[](std::size_t bytes, std::align_val_t align) {
  return operator new(bytes, align);
}
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop
