#include "engine/nvme_dir.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "zinf/log.hpp"

namespace zinf {
namespace {

// This machine's name as it goes into file names: [A-Za-z0-9._] kept, anything else '_'.
std::string host_for_file_names() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') return "host";
  std::string out(host);
  for (char& c : out) {
    const bool keep = std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '.' || c == '_';
    if (!keep) c = '_';
  }
  return out;
}

// Process `pid` has ended: there is none, or it is a zombie (exited, not yet reaped by its
// parent: its files are closed, as mpirun leaves a killed rank for a moment after it returns)
// with no thread left running.
bool process_ended(long pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  std::string line;
  if (!std::getline(stat, line)) return false;
  // "<pid> (<comm>) <state> ...": comm may hold spaces and parentheses, the state follows the
  // last ')'.
  const std::size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  const char state = line[close + 2];
  if (state != 'Z' && state != 'X') return false;
  // A thread-group leader that exited while other threads of its process run on shows Z too;
  // the process has ended only when the leader is the last of its threads.
  // Read without exceptions: the directory goes when the parent reaps the process meanwhile.
  std::error_code ec;
  std::size_t threads = 0;
  for (std::filesystem::directory_iterator it(fmt::format("/proc/{}/task", pid), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++threads;
  }
  return !ec && threads <= 1;
}

// Removes this machine's stale swap files in `dir`; a file another process removes first is
// fine.
void remove_stale_swap_files(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!stale_swap_file(name)) continue;
    // A process of another pid namespace on this machine (a container sharing the host's name)
    // may still hold it: its swap space keeps a shared lock on the file while it is open.
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    const bool unused = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    std::error_code size_ec;
    const std::uintmax_t bytes = entry.file_size(size_ec);
    const bool removed = unused && ::unlink(entry.path().c_str()) == 0;
    ::close(fd);
    if (removed) {
      log_warn(
          "removed '{}' ({} bytes): the swap file of a process of this machine that ended "
          "without removing it (killed)",
          entry.path().string(), size_ec ? 0 : bytes);
    }
  }
}

}  // namespace

std::string swap_file_name(const std::string& kind, int rank) {
  return fmt::format("zinf-{}-{}-{{pid}}-rank{}.bin", kind, host_for_file_names(), rank);
}

bool stale_swap_file(const std::string& name) {
  // zinf-<kind>-<host>-<pid>-rank<r>.bin, kind swap or activations.
  const std::string host = host_for_file_names();
  for (const char* kind : {"swap", "activations"}) {
    const std::string prefix = fmt::format("zinf-{}-{}-", kind, host);
    if (!name.starts_with(prefix) || !name.ends_with(".bin")) continue;
    const std::size_t dash = name.find("-rank", prefix.size());
    if (dash == std::string::npos || dash == prefix.size()) return false;
    // -rank<digits>.bin and nothing else after the pid.
    const std::size_t rank_end = name.size() - 4;
    if (rank_end <= dash + 5) return false;
    for (std::size_t i = dash + 5; i < rank_end; ++i) {
      if (!std::isdigit(static_cast<unsigned char>(name[i]))) return false;
    }
    long pid = 0;
    for (std::size_t i = prefix.size(); i < dash; ++i) {
      if (!std::isdigit(static_cast<unsigned char>(name[i])) || pid > 1'000'000'000) return false;
      pid = pid * 10 + (name[i] - '0');
    }
    if (pid <= 0 || pid == static_cast<long>(::getpid())) return false;
    return process_ended(pid);
  }
  return false;
}

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
  remove_stale_swap_files(dir);
  return Status::ok();
}

}  // namespace zinf
