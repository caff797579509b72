// run_local (include/zinf/run_local.hpp) and Engine::scoped_gather (include/zinf/engine.hpp):
// a job trains and its ranks agree; the first error of any rank reaches the caller with its rank
// named while the other ranks are stopped, not left waiting; every thread is joined; a scoped
// gather releases at scope exit and its typed views refuse the wrong type.
#include "zinf/run_local.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "engine_test_util.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

// Counts the rank threads that have ended: a thread_local's destructor runs as its thread exits.
std::atomic<int> g_threads_ended{0};
struct ThreadEndCounter {
  bool armed = false;
  ~ThreadEndCounter() {
    if (armed) g_threads_ended.fetch_add(1);
  }
};
void count_this_thread_end() {
  thread_local ThreadEndCounter counter;
  counter.armed = true;
}

Config stage3_config() {
  Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
  config.zero.stage3_param_persistence_threshold = 0;  // every parameter sharded
  config.collective_timeout_ms = 30'000;
  return config;
}

// Registers "fc.w" (f32, 3 x 5) and "fc.b" (bf16, 5) in module "fc" with seeded values.
Status register_fc(Engine& engine, std::vector<float>& w, std::vector<float>& b) {
  w.resize(15);
  b.resize(5);
  fill_uniform(w.data(), w.size(), 41);
  fill_uniform(b.data(), b.size(), 42);
  ZINF_RETURN_IF_ERROR(engine.register_parameter(
      {.name = "fc.w", .module = "fc", .shape = {3, 5}, .initial_values = w.data()}));
  return engine.register_parameter({.name = "fc.b",
                                    .module = "fc",
                                    .shape = {5},
                                    .dtype = DType::kBF16,
                                    .initial_values = b.data()});
}

// LocalRunOptions::collective_timeout is the engines' zinf.collective_timeout_ms too: no warning
// that the communicator's timeout differs from the config's.
TEST(RunLocal, TheOptionsTimeoutIsTheEnginesToo) {
  LocalRunOptions options;
  options.collective_timeout = std::chrono::milliseconds(2'000);
  ::testing::internal::CaptureStderr();
  const Status status = run_local(
      2, stage3_config(),
      [&](Engine& engine, int) {
        EXPECT_EQ(engine.config().collective_timeout_ms, 2'000);
        return Status::ok();
      },
      options);
  const std::string said = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  EXPECT_EQ(said.find("collective_timeout_ms"), std::string::npos) << said;
}

TEST(RunLocal, RanksTrainTogetherAndEveryThreadIsJoined) {
  constexpr int kWorld = 3;
  g_threads_ended = 0;
  std::atomic<int> calls{0};
  std::mutex mutex;
  std::vector<std::vector<float>> after(kWorld);
  const Status status = run_local(kWorld, stage3_config(), [&](Engine& engine, int rank) {
    count_this_thread_end();
    calls.fetch_add(1);
    EXPECT_EQ(engine.rank(), rank);
    EXPECT_EQ(engine.world_size(), kWorld);
    std::vector<float> w, b;
    ZINF_RETURN_IF_ERROR(register_fc(engine, w, b));
    // A gradient that differs per rank, so the reduction is exercised.
    std::vector<float> gw(15, 0.1f * static_cast<float>(rank + 1));
    std::vector<std::uint16_t> gb(5, f32_to_bf16(0.5f));
    {
      ZINF_ASSIGN_OR_RETURN(ScopedGather fc, engine.scoped_gather("fc"));
      const GradientRef grads[] = {{"fc.w", gw.data(), gw.size(), DType::kF32},
                                   {"fc.b", gb.data(), gb.size(), DType::kBF16}};
      ZINF_RETURN_IF_ERROR(engine.reduce_gradients("fc", grads));
    }
    ZINF_ASSIGN_OR_RETURN(StepReport report, engine.step());
    EXPECT_EQ(report.step, 1);
    std::vector<float> values(15);
    ZINF_RETURN_IF_ERROR(engine.read_parameters("fc.w", values.data()));
    std::lock_guard lock(mutex);
    after[static_cast<std::size_t>(rank)] = values;
    return Status::ok();
  });
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  EXPECT_EQ(calls.load(), kWorld);
  EXPECT_EQ(g_threads_ended.load(), kWorld) << "run_local returned before its threads ended";
  for (int rank = 1; rank < kWorld; ++rank) EXPECT_EQ(after[rank], after[0]) << rank;
}

TEST(RunLocal, FirstErrorNamesItsRankAndStopsTheOthers) {
  constexpr int kWorld = 3;
  g_threads_ended = 0;
  std::mutex mutex;
  std::vector<Status> seen(kWorld);
  const auto start = std::chrono::steady_clock::now();
  const Status status = run_local(kWorld, stage3_config(), [&](Engine& engine, int rank) {
    count_this_thread_end();
    const Status s = [&]() -> Status {
      std::vector<float> w, b;
      ZINF_RETURN_IF_ERROR(register_fc(engine, w, b));
      ZINF_RETURN_IF_ERROR(engine.finalize());
      if (rank == 1) return Status::not_found("rank one's data file is missing");
      // The others go on into a collective that rank 1 never joins. (A rank still inside
      // finalize's last collective when rank 1 fails is aborted there instead.)
      return engine.gather("fc");
    }();
    std::lock_guard lock(mutex);
    seen[static_cast<std::size_t>(rank)] = s;
    return s;
  });
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(status.code(), Code::kNotFound) << status.to_string();
  EXPECT_EQ(status.message(), "rank 1: rank one's data file is missing");
  EXPECT_EQ(g_threads_ended.load(), kWorld);
  // Stopped by the abort, long before the 30 s collective timeout.
  EXPECT_LT(waited, std::chrono::seconds(10));
  for (int rank : {0, 2}) {
    EXPECT_EQ(seen[static_cast<std::size_t>(rank)].code(), Code::kAborted)
        << seen[static_cast<std::size_t>(rank)].to_string();
  }
}

// Ranks that gather different modules whose shards pad to the same size issue all-gathers of the
// same shape. Each must fail naming both groups and their modules instead of handing rank 1 rank
// 0's values as its module's parameters.
TEST(RunLocal, RanksThatGatherDifferentModulesFailNamingBoth) {
  std::vector<float> a(64), b(16);
  fill_uniform(a.data(), a.size(), 51);
  fill_uniform(b.data(), b.size(), 52);
  std::mutex mutex;
  std::vector<Status> seen(2);
  const Status status = run_local(2, stage3_config(), [&](Engine& engine, int rank) {
    const Status s = [&]() -> Status {
      ZINF_RETURN_IF_ERROR(engine.register_parameter(
          {.name = "a.w", .module = "a", .shape = {16, 4}, .initial_values = a.data()}));
      ZINF_RETURN_IF_ERROR(engine.register_parameter(
          {.name = "b.w", .module = "b", .shape = {1, 16}, .initial_values = b.data()}));
      ZINF_RETURN_IF_ERROR(engine.finalize());
      return engine.gather(rank == 0 ? "a" : "b");
    }();
    std::lock_guard lock(mutex);
    seen[static_cast<std::size_t>(rank)] = s;
    return s;
  });
  EXPECT_EQ(status.code(), Code::kCommError) << status.to_string();
  for (const Status& s : seen) {
    EXPECT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("ranks disagree"), std::string_view::npos) << s.to_string();
    EXPECT_NE(s.message().find("'params group 0 (module 'a')'"), std::string_view::npos)
        << s.to_string();
    EXPECT_NE(s.message().find("'params group 1 (module 'b')'"), std::string_view::npos)
        << s.to_string();
  }
}

TEST(RunLocal, ExceptionsAndOpenErrorsBecomeStatuses) {
  Status thrown = run_local(2, stage3_config(), [](Engine&, int rank) -> Status {
    if (rank == 0) throw std::runtime_error("boom");
    return Status::ok();
  });
  EXPECT_EQ(thrown.code(), Code::kInternal);
  EXPECT_EQ(thrown.message(), "rank 0: exception: boom");

  Config wrong_world = stage3_config();
  wrong_world.world_size = 4;
  std::atomic<int> calls{0};
  Status open = run_local(2, wrong_world, [&](Engine&, int) {
    calls.fetch_add(1);
    return Status::ok();
  });
  EXPECT_EQ(open.code(), Code::kInvalidArgument) << open.to_string();
  EXPECT_NE(open.message().find("world_size"), std::string_view::npos) << open.to_string();
  EXPECT_EQ(open.message().rfind("rank ", 0), 0u) << open.to_string();
  EXPECT_EQ(calls.load(), 0);

  EXPECT_EQ(run_local(0, stage3_config(), [](Engine&, int) { return Status::ok(); }).code(),
            Code::kInvalidArgument);
}

TEST(ScopedGather, TypedViewsAndReleaseAtScopeExit) {
  const Status status = run_local(2, stage3_config(), [](Engine& engine, int) -> Status {
    std::vector<float> w, b;
    ZINF_RETURN_IF_ERROR(register_fc(engine, w, b));
    {
      ZINF_ASSIGN_OR_RETURN(ScopedGather fc, engine.scoped_gather("fc"));
      EXPECT_EQ(fc.module(), "fc");
      Result<std::span<const float>> fw = fc.param<float>("fc.w");
      EXPECT_TRUE(fw.is_ok()) << fw.status().to_string();
      if (fw.is_ok()) {
        EXPECT_EQ(std::vector<float>(fw->begin(), fw->end()), w);
      }
      Result<std::span<const std::uint16_t>> fb = fc.param<std::uint16_t>("fc.b");
      EXPECT_TRUE(fb.is_ok()) << fb.status().to_string();
      if (fb.is_ok()) {
        EXPECT_EQ(fb->size(), 5u);
        for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ((*fb)[i], f32_to_bf16(b[i])) << i;
      }
      Result<std::span<const float>> wrong = fc.param<float>("fc.b");
      EXPECT_EQ(wrong.status().code(), Code::kInvalidArgument);
      EXPECT_EQ(wrong.status().message(), "parameter 'fc.b' is bf16, asked for as float (f32)");
      EXPECT_EQ(fc.param<std::uint16_t>("fc.w").status().code(), Code::kInvalidArgument);
      EXPECT_EQ(fc.param<float>("nope").status().code(), Code::kNotFound);
      // Gathered twice is refused, and the guard is not made.
      EXPECT_EQ(engine.scoped_gather("fc").status().code(), Code::kFailedPrecondition);
      EXPECT_EQ(engine.scoped_gather("nope").status().code(), Code::kNotFound);
    }
    // Released at scope exit (stage 3, nothing persistent).
    EXPECT_EQ(engine.parameter("fc.w").status().code(), Code::kFailedPrecondition);
    // An explicit release returns its status; the destructor then has nothing to do.
    ZINF_ASSIGN_OR_RETURN(ScopedGather again, engine.scoped_gather("fc"));
    EXPECT_TRUE(engine.release("fc").is_ok());  // behind the guard's back
    EXPECT_EQ(again.release().code(), Code::kFailedPrecondition);
    EXPECT_TRUE(again.release().is_ok());
    EXPECT_EQ(again.param<float>("fc.w").status().code(), Code::kFailedPrecondition);
    return Status::ok();
  });
  EXPECT_TRUE(status.is_ok()) << status.to_string();
}

}  // namespace
}  // namespace zinf
