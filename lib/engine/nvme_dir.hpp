// The NVMe swap directories, made ready at Engine::open().
#pragma once

#include <string>

#include "zinf/status.hpp"

namespace zinf {

// Makes `dir` (and its parents) when it is missing, as DeepSpeed does, saying so in the log, then
// creates and removes a small file in it, so that an unusable directory fails at open() with a
// Status naming the config key `key` and the path, not at the first swap write.
Status prepare_nvme_directory(const std::string& key, const std::string& dir, int rank);

}  // namespace zinf
