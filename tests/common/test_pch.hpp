// The test programs' precompiled header, made once by the target zinf_test_pch and reused by every
// test binary (tests/CMakeLists.txt, which adds the engine tests' helpers,
// engine/engine_test_util.hpp, after these): GoogleTest, fmt, nlohmann-json and the standard
// headers most test files include. Over the whole build it took the test files' compile time
// from 879 to 530 s (docs/RELIABILITY.md), and the test programs are built three times in CI
// (the suite, asan, tsan). A test file still includes what it uses, so it compiles the same
// without it (CMAKE_DISABLE_PRECOMPILE_HEADERS=ON).
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
