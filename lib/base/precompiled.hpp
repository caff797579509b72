// The library's precompiled header (lib/CMakeLists.txt): the standard headers, fmt and the public
// headers, which most of its files include. Parsing is about half of a library file's compile
// time (its code at -O3 the rest), and the library is built three times in CI (the suite, asan,
// tsan). A file still includes what it uses, so it compiles the same without this
// (CMAKE_DISABLE_PRECOMPILE_HEADERS=ON); the *_avx2 and *_avx512 files, compiled with other
// instruction-set flags, never use it.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"
#include "zinf/engine.hpp"
#include "zinf/log.hpp"
#include "zinf/optim.hpp"
#include "zinf/run_local.hpp"
#include "zinf/schedule.hpp"
#include "zinf/status.hpp"
#include "zinf/trace.hpp"
#include "zinf/version.hpp"
