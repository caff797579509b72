// Headers precompiled once per test binary (tests/CMakeLists.txt): GoogleTest, fmt, nlohmann-json
// and the standard headers most test files include. Parsing them was a quarter to a third of a
// test file's compile time, and the test programs are built three times in CI (the suite, asan,
// tsan). Only third-party and standard headers belong here: a test file still includes what it
// uses, so it compiles the same without them (CMAKE_DISABLE_PRECOMPILE_HEADERS=ON).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>
