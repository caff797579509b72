// Status and Result<T>: how every zinf call reports failure.
//
// zinf never throws across its API. An operating error (I/O, CUDA, NCCL, bad config, bad input)
// comes back as a Status carrying a code, the raw errno / cudaError_t / ncclResult_t that caused
// it (0 when none), and a message that names the file, offset, tensor or config key involved.
// Broken invariants are not Statuses: they are ZINF_ASSERT failures (lib/base/assert.hpp).
//
// Thread-safety: Status and Result are values; distinct objects may be used from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace zinf {

enum class Code : std::uint8_t {
  kOk = 0,
  kInvalidArgument = 1,     // a caller-supplied value is wrong (config key, shape, option)
  kNotFound = 2,            // a named thing (file, key, module, tensor) does not exist
  kIoError = 3,             // a read, write, open or sync failed; sys_code() holds errno
  kCorruption = 4,          // data read back does not match its checksum or format
  kNoSpace = 5,             // a filesystem or device ran out of space (ENOSPC)
  kResourceExhausted = 6,   // a bounded pool, queue or memory budget is used up
  kTimeout = 7,             // a wait ran out; nothing hung
  kUnsupported = 8,         // the platform refuses a feature (io_uring, O_DIRECT, a CPU feature)
  kFailedPrecondition = 9,  // the call is not allowed in the object's current state
  kDeviceError = 10,        // a CUDA call failed; sys_code() holds cudaError_t
  kCommError = 11,          // a collective failed; sys_code() holds ncclResult_t when from NCCL
  kAborted = 12,            // stopped because an earlier (sticky) error happened elsewhere
  kInternal = 13,           // a bug in zinf that could be reported rather than asserted
};

// Returns the stable lowercase name of `code`, for example "io_error".
std::string_view code_name(Code code);

class [[nodiscard]] Status {
 public:
  // An OK status. Cheap: no allocation.
  Status() = default;

  static Status ok() { return Status(); }
  static Status invalid_argument(std::string message) {
    return Status(Code::kInvalidArgument, 0, std::move(message));
  }
  static Status not_found(std::string message) {
    return Status(Code::kNotFound, 0, std::move(message));
  }
  static Status io_error(std::string message, int err = 0) {
    return Status(Code::kIoError, err, std::move(message));
  }
  static Status corruption(std::string message) {
    return Status(Code::kCorruption, 0, std::move(message));
  }
  static Status no_space(std::string message, int err = 0) {
    return Status(Code::kNoSpace, err, std::move(message));
  }
  static Status resource_exhausted(std::string message) {
    return Status(Code::kResourceExhausted, 0, std::move(message));
  }
  static Status timeout(std::string message) {
    return Status(Code::kTimeout, 0, std::move(message));
  }
  static Status unsupported(std::string message, int err = 0) {
    return Status(Code::kUnsupported, err, std::move(message));
  }
  static Status failed_precondition(std::string message) {
    return Status(Code::kFailedPrecondition, 0, std::move(message));
  }
  static Status device_error(std::string message, int err = 0) {
    return Status(Code::kDeviceError, err, std::move(message));
  }
  static Status comm_error(std::string message, int err = 0) {
    return Status(Code::kCommError, err, std::move(message));
  }
  static Status aborted(std::string message) {
    return Status(Code::kAborted, 0, std::move(message));
  }
  static Status internal(std::string message) {
    return Status(Code::kInternal, 0, std::move(message));
  }

  // REQUIRES: code != Code::kOk, or message is empty.
  Status(Code code, int sys_code, std::string message);

  bool is_ok() const { return rep_ == nullptr; }
  explicit operator bool() const { return is_ok(); }
  Code code() const { return rep_ ? rep_->code : Code::kOk; }
  // The raw errno, cudaError_t or ncclResult_t behind this status; 0 when there is none.
  int sys_code() const { return rep_ ? rep_->sys_code : 0; }
  // The message alone, without the code name; empty for OK.
  std::string_view message() const { return rep_ ? std::string_view(rep_->message) : ""; }
  // "ok", or "<code name>: <message>" with " (errno N: text)" when sys_code() is an errno.
  std::string to_string() const;

  // Returns a copy whose message is "<context>: <message>"; OK stays OK.
  Status with_context(std::string_view context) const;

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

 private:
  struct Rep {
    Code code;
    int sys_code;
    std::string message;
  };
  std::unique_ptr<Rep> rep_;
};

// Builds a Status from an errno value: ENOSPC/EDQUOT become kNoSpace, ENOENT kNotFound,
// EPERM/ENOSYS/EOPNOTSUPP/EINVAL-on-open stay kIoError unless the caller maps them; the message
// is "<context>: <strerror text>" and sys_code() is `err`.
Status status_from_errno(std::string_view context, int err);

// Result<T>: either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  // REQUIRES: !status.is_ok().
  Result(Status status) : status_(std::move(status)), has_value_(false) {}     // NOLINT
  Result(T value) : has_value_(true) { new (&storage_) T(std::move(value)); }  // NOLINT
  template <typename U, typename = std::enable_if_t<std::is_convertible_v<U&&, T> &&
                                                    !std::is_same_v<std::decay_t<U>, Status> &&
                                                    !std::is_same_v<std::decay_t<U>, T>>>
  Result(U&& value) : has_value_(true) {  // NOLINT
    new (&storage_) T(std::forward<U>(value));
  }

  Result(Result&& other) noexcept
      : status_(std::move(other.status_)), has_value_(other.has_value_) {
    if (has_value_) new (&storage_) T(std::move(*other.ptr()));
  }
  Result& operator=(Result&& other) noexcept {
    if (this != &other) {
      destroy();
      status_ = std::move(other.status_);
      has_value_ = other.has_value_;
      if (has_value_) new (&storage_) T(std::move(*other.ptr()));
    }
    return *this;
  }
  Result(const Result&) = delete;
  Result& operator=(const Result&) = delete;
  ~Result() { destroy(); }

  bool is_ok() const { return has_value_; }
  explicit operator bool() const { return has_value_; }
  // OK when a value is held.
  const Status& status() const { return status_; }
  // REQUIRES: is_ok().
  T& value() & { return *checked(); }
  const T& value() const& { return *checked(); }
  T&& value() && { return std::move(*checked()); }
  T& operator*() & { return *checked(); }
  const T& operator*() const& { return *checked(); }
  T* operator->() { return checked(); }
  const T* operator->() const { return checked(); }

 private:
  T* ptr() { return std::launder(reinterpret_cast<T*>(&storage_)); }
  const T* ptr() const { return std::launder(reinterpret_cast<const T*>(&storage_)); }
  T* checked() {
    if (!has_value_) bad_access(status_);
    return ptr();
  }
  const T* checked() const {
    if (!has_value_) bad_access(status_);
    return ptr();
  }
  void destroy() {
    if (has_value_) ptr()->~T();
    has_value_ = false;
  }
  [[noreturn]] static void bad_access(const Status& status);

  Status status_;
  bool has_value_;
  alignas(T) unsigned char storage_[sizeof(T)];
};

namespace detail {
[[noreturn]] void result_bad_access(const Status& status);
}  // namespace detail

template <typename T>
void Result<T>::bad_access(const Status& status) {
  detail::result_bad_access(status);
}

}  // namespace zinf

// Returns early from the enclosing function when `expr` (a Status) is not OK.
#define ZINF_RETURN_IF_ERROR(expr)                  \
  do {                                              \
    ::zinf::Status zinf_status_ = (expr);           \
    if (!zinf_status_.is_ok()) return zinf_status_; \
  } while (0)

#define ZINF_CONCAT_INNER_(a, b) a##b
#define ZINF_CONCAT_(a, b) ZINF_CONCAT_INNER_(a, b)
// `ZINF_ASSIGN_OR_RETURN(auto x, make_x());` declares x from a Result, or returns its Status.
#define ZINF_ASSIGN_OR_RETURN(lhs, expr) \
  ZINF_ASSIGN_OR_RETURN_IMPL_(ZINF_CONCAT_(zinf_result_, __COUNTER__), lhs, expr)
#define ZINF_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.is_ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
