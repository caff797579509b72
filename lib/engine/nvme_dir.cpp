#include "engine/nvme_dir.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <system_error>

#include "zinf/log.hpp"

namespace zinf {

Status prepare_nvme_directory(const std::string& key, const std::string& dir, int rank) {
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) {
    if (std::filesystem::create_directories(dir, ec)) {
      log_warn("{}: created the missing directory '{}'", key, dir);
    } else if (ec) {
      // The cause (a read-only or unwritable parent), not the probe's later ENOENT.
      return status_from_errno(fmt::format("{}: cannot create the directory '{}'", key, dir),
                               ec.value());
    }
  }
  const std::string path = fmt::format("{}/.zinf-probe-{}-{}", dir, ::getpid(), rank);
  const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0) {
    return status_from_errno(fmt::format("{}: cannot create a file in '{}'", key, dir), errno);
  }
  ::close(fd);
  ::unlink(path.c_str());
  return Status::ok();
}

}  // namespace zinf
