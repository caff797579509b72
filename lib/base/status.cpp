#include "zinf/status.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace zinf {

std::string_view code_name(Code code) {
  switch (code) {
    case Code::kOk:
      return "ok";
    case Code::kInvalidArgument:
      return "invalid_argument";
    case Code::kNotFound:
      return "not_found";
    case Code::kIoError:
      return "io_error";
    case Code::kCorruption:
      return "corruption";
    case Code::kNoSpace:
      return "no_space";
    case Code::kResourceExhausted:
      return "resource_exhausted";
    case Code::kTimeout:
      return "timeout";
    case Code::kUnsupported:
      return "unsupported";
    case Code::kFailedPrecondition:
      return "failed_precondition";
    case Code::kDeviceError:
      return "device_error";
    case Code::kCommError:
      return "comm_error";
    case Code::kAborted:
      return "aborted";
    case Code::kInternal:
      return "internal";
  }
  return "unknown";
}

Status::Status(Code code, int sys_code, std::string message) {
  if (code != Code::kOk) rep_ = std::make_unique<Rep>(Rep{code, sys_code, std::move(message)});
}

Status::Status(const Status& other)
    : rep_(other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) rep_ = other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr;
  return *this;
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  std::string out = fmt::format("{}: {}", code_name(rep_->code), rep_->message);
  // Only codes that come from the OS carry an errno; device and comm codes are printed raw.
  switch (rep_->code) {
    case Code::kIoError:
    case Code::kNoSpace:
    case Code::kUnsupported:
      if (rep_->sys_code != 0) out += fmt::format(" (errno {})", rep_->sys_code);
      break;
    case Code::kDeviceError:
    case Code::kCommError:
      if (rep_->sys_code != 0) out += fmt::format(" (code {})", rep_->sys_code);
      break;
    default:
      break;
  }
  return out;
}

Status Status::with_context(std::string_view context) const {
  if (is_ok()) return Status();
  return Status(rep_->code, rep_->sys_code, fmt::format("{}: {}", context, rep_->message));
}

Status status_from_errno(std::string_view context, int err) {
  char buffer[128];
  // GNU strerror_r returns a pointer that may or may not be `buffer`.
  const char* text = strerror_r(err, buffer, sizeof(buffer));
  std::string message = fmt::format("{}: {}", context, text);
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return Status(Code::kNoSpace, err, std::move(message));
    case ENOENT:
      return Status(Code::kNotFound, err, std::move(message));
    case ETIMEDOUT:
      return Status(Code::kTimeout, err, std::move(message));
    case ENOMEM:
      return Status(Code::kResourceExhausted, err, std::move(message));
    default:
      return Status(Code::kIoError, err, std::move(message));
  }
}

namespace detail {
void result_bad_access(const Status& status) {
  std::fprintf(stderr, "zinf: Result::value() called on an error: %s\n",
               status.to_string().c_str());
  std::abort();
}
}  // namespace detail

}  // namespace zinf
