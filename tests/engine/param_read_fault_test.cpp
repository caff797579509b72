// A parameter shard's read from NVMe that fails while the next modules' reads are in flight
// (prefetched): the gather fails with io_error naming the extent, and the staging blocks of the
// reads still in flight stay out of the pool until those reads are done. Before, the stream
// skipped their closures after the failure and so returned their blocks at once: destroying the
// engine then freed the blocks while the reads still wrote into them (a heap corruption, which
// the soak once hit as glibc's "malloc(): unsorted double linked list corrupted"). The thread
// engine's pread is what AddressSanitizer sees (scripts/test --sanitize asan reports the write
// into freed memory there); the kernel's io_uring writes it cannot.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "engine_test_util.hpp"
#include "io/fault.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::TrainOptions;

// ZINF_IO_DISABLE_URING=1 for the life of the object (the engine opens the thread engine).
class ThreadEngineOnly {
 public:
  ThreadEngineOnly() {
    const char* old = std::getenv("ZINF_IO_DISABLE_URING");
    if (old != nullptr) saved_ = old;
    had_ = old != nullptr;
    ::setenv("ZINF_IO_DISABLE_URING", "1", 1);
  }
  ~ThreadEngineOnly() {
    if (had_) {
      ::setenv("ZINF_IO_DISABLE_URING", saved_.c_str(), 1);
    } else {
      ::unsetenv("ZINF_IO_DISABLE_URING");
    }
  }

 private:
  bool had_ = false;
  std::string saved_;
};

TEST(EngineParamReadFault, AFailedShardReadKeepsTheBlocksOfReadsInFlightUntilTheyLand) {
  ThreadEngineOnly thread_engine;
  const Model model = engine_test::make_model(DType::kBF16, 5150);
  int failed = 0;
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    engine_test::ScratchDir dir("param_read_fault");
    Config config =
        engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNvme, dir.path());
    config.collective_timeout_ms = 5000;
    // Every read piece is held 20 ms and then fails: with EIO, or with EINTR and is read
    // again (into its block) up to retry_max times, so the reads prefetched behind the first
    // failed one are still writing into their blocks when the gather fails.
    FaultSpec spec;
    spec.seed = seed;
    spec.writes = false;
    spec.latency_rate = 1.0;
    spec.latency = std::chrono::microseconds(20'000);
    spec.eio_rate = 0.3;
    spec.eintr_rate = 0.7;
    auto faults = std::make_shared<FaultInjector>(spec);
    faults->set_enabled(false);
    engine_test::Ranks ranks = engine_test::make_ranks(1);
    Env env;
    env.device = ranks.devices[0].get();
    env.comm = ranks.comms[0].get();
    env.io_faults = faults;
    Result<std::unique_ptr<Engine>> engine = Engine::open(config, env);
    ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
    ASSERT_TRUE(engine_test::register_model(**engine, model).is_ok());
    ASSERT_TRUE((*engine)->finalize().is_ok());
    TrainOptions options;
    options.check_gathered = false;
    options.steps = 1;
    const Status first = engine_test::train_rank(**engine, model, 0, options, nullptr, nullptr);
    ASSERT_TRUE(first.is_ok()) << first.to_string();
    faults->set_enabled(true);
    options.first_step = 2;
    options.steps = 2;
    const Status st = engine_test::train_rank(**engine, model, 0, options, nullptr, nullptr);
    std::printf("seed %llu: %s\n", static_cast<unsigned long long>(seed), st.to_string().c_str());
    ASSERT_FALSE(st.is_ok());
    EXPECT_EQ(st.code(), Code::kIoError) << st.to_string();
    EXPECT_NE(st.message().find("rank0/param/group"), std::string::npos) << st.to_string();
    ++failed;
    // At once, while the reads behind the failed one may still be in flight.
    (*engine).reset();
  }
  EXPECT_EQ(failed, 6);
}

}  // namespace
}  // namespace zinf
