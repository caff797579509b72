#include "io/io_engine.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>

#include "io/engine_core.hpp"
#include "zinf/log.hpp"

namespace zinf {

std::string_view engine_kind_name(EngineKind kind) {
  switch (kind) {
    case EngineKind::kAuto:
      return "auto";
    case EngineKind::kUring:
      return "uring";
    case EngineKind::kThread:
      return "thread";
  }
  return "unknown";
}

bool parse_engine_kind(std::string_view text, EngineKind* kind) {
  if (text == "auto") {
    *kind = EngineKind::kAuto;
  } else if (text == "uring" || text == "io_uring") {
    *kind = EngineKind::kUring;
  } else if (text == "thread") {
    *kind = EngineKind::kThread;
  } else {
    return false;
  }
  return true;
}

std::string_view io_op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

Status IoEngine::read_sync(FileHandle file, std::uint64_t offset, std::size_t bytes, void* dst,
                           std::chrono::milliseconds timeout) {
  ZINF_ASSIGN_OR_RETURN(Ticket ticket, read(file, offset, bytes, dst));
  return wait(ticket, timeout);
}

Status IoEngine::write_sync(FileHandle file, std::uint64_t offset, std::size_t bytes,
                            const void* src, std::chrono::milliseconds timeout) {
  ZINF_ASSIGN_OR_RETURN(Ticket ticket, write(file, offset, bytes, src));
  return wait(ticket, timeout);
}

namespace {

Status validate(const IoOptions& o) {
  if (o.block_bytes == 0 || o.block_bytes % kDirectAlignment != 0 ||
      o.block_bytes > (std::size_t{1} << 30)) {
    return Status::invalid_argument(
        fmt::format("IoOptions::block_bytes = {}: must be a multiple of 4096 and at most 1 GiB",
                    o.block_bytes));
  }
  if (o.queue_depth == 0 || o.queue_depth > 4096) {
    return Status::invalid_argument(
        fmt::format("IoOptions::queue_depth = {}: must be in 1..4096", o.queue_depth));
  }
  if (o.rings == 0 || o.rings > 16) {
    return Status::invalid_argument(
        fmt::format("IoOptions::rings = {}: must be in 1..16", o.rings));
  }
  if (o.max_requests == 0 || o.max_requests > (1u << 20)) {
    return Status::invalid_argument(
        fmt::format("IoOptions::max_requests = {}: must be in 1..1048576", o.max_requests));
  }
  if (o.max_files == 0 || o.max_files > 65536) {
    return Status::invalid_argument(
        fmt::format("IoOptions::max_files = {}: must be in 1..65536", o.max_files));
  }
  return Status::ok();
}

bool uring_disabled_by_env() {
  const char* value = std::getenv("ZINF_IO_DISABLE_URING");
  return value != nullptr && std::strcmp(value, "0") != 0 && value[0] != '\0';
}

}  // namespace

Result<std::unique_ptr<IoEngine>> open_engine(const IoOptions& options) {
  ZINF_RETURN_IF_ERROR(validate(options));
  switch (options.kind) {
    case EngineKind::kThread:
      return io_detail::make_thread_engine(options);
    case EngineKind::kUring:
      if (uring_disabled_by_env()) {
        return Status::unsupported("io_uring is disabled by ZINF_IO_DISABLE_URING");
      }
      return io_detail::make_uring_engine(options);
    case EngineKind::kAuto:
      break;
  }
  if (!uring_disabled_by_env()) {
    Result<std::unique_ptr<IoEngine>> uring = io_detail::make_uring_engine(options);
    if (uring.is_ok() || uring.status().code() != Code::kUnsupported) return uring;
    log_warn("io: {}; using the thread engine (pread/pwrite)", uring.status().message());
  } else {
    log_warn("io: io_uring disabled by ZINF_IO_DISABLE_URING; using the thread engine");
  }
  return io_detail::make_thread_engine(options);
}

}  // namespace zinf
