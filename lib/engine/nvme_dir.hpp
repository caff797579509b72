// The NVMe swap directories, made ready at Engine::open().
#pragma once

#include <string>

#include "zinf/status.hpp"

namespace zinf {

// Makes `dir` (and its parents) when it is missing, as DeepSpeed does, saying so in the log, then
// creates and removes a small file in it, so that an unusable directory fails at open() with a
// Status naming the config key `key` and the path, not at the first swap write.
// Also removes the swap files that processes of this machine left in `dir` when they were
// killed (stale_swap_file()), saying so in the log.
Status prepare_nvme_directory(const std::string& key, const std::string& dir, int rank);

// The name of a swap file of this process in an NVMe directory: "zinf-<kind>-<host>-{pid}-rank<r>
// .bin" ({pid} as SwapOptions::file_name takes it). The machine's name in it tells a swap file of
// this machine's processes from another machine's on a shared directory.
std::string swap_file_name(const std::string& kind, int rank);

// Whether `name` is the swap file of a process of this machine that is no longer running
// (kill(pid, 0) says ESRCH): a swap file outlives its process only when the process was killed,
// and nobody reads it after that. (The removal also takes an exclusive lock on it first: a
// process of another pid namespace holds a shared one while its swap file is open.)
bool stale_swap_file(const std::string& name);

}  // namespace zinf
