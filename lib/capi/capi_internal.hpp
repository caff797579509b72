// The boundary of the C API (include/zinf/zinf.h): every exported function runs its body through
// guard(), which records the outcome as the calling thread's last error and turns any exception
// into a code, so that nothing is thrown across the ABI. Exposed here for the tests.
//
// Thread-safety: the last error is thread-local; guard() may run on any thread.
#pragma once

#include <exception>
#include <new>
#include <utility>

#include "zinf/status.hpp"
#include "zinf/zinf.h"

namespace zinf {
class Engine;
}  // namespace zinf

namespace zinf::capi {

// Stores `status` as this thread's last error and returns its code. Never throws: when the
// message cannot be stored (out of memory) a fixed message takes its place.
zinf_code_t record(const Status& status) noexcept;
// Stores an exception that reached the boundary: std::bad_alloc as ZINF_RESOURCE_EXHAUSTED,
// anything else as ZINF_INTERNAL, with `where` and the exception's what() in the message.
zinf_code_t record_exception(const char* where, std::exception_ptr error) noexcept;

// The Engine a C handle wraps (for tests that time the same engine through both APIs).
Engine* engine_of(zinf_engine_t* engine) noexcept;

// Runs `body` (returning a Status) and records its outcome; `where` is the C function's name.
template <typename Body>
zinf_code_t guard(const char* where, Body&& body) noexcept {
  try {
    return record(std::forward<Body>(body)());
  } catch (...) {
    return record_exception(where, std::current_exception());
  }
}

}  // namespace zinf::capi
