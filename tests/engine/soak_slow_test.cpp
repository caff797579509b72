// Soak: training with seeded random faults in every NVMe transfer, for as long as
// ZINF_SOAK_SECONDS says (default 60; ZINF_SOAK_FIRST_ROUND replays from that round on). Faults:
// EIO on 1 in 10^4 pieces, short transfers on 1 in 100, EINTR / EAGAIN on 1 in 200 each, 2 ms
// delays on 1 in 1000. Short transfers, EINTR and EAGAIN are the I/O layer's to retry
// (IoOptions::retry_max, 8 in a row); EIO is not retried (docs/RELIABILITY.md): the step fails with
// a Status naming the extent, the engine's error is sticky, and the run resumes from its last
// checkpoint (saved every kCheckpointEvery steps) in a new engine, as a training job would. Each
// round trains kSoakSteps steps that way and must end with exactly the fp32 masters of the same
// steps run without faults. Prints the counts of every fault and outcome (docs/BENCHMARKS.md has a
// long run's).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine_test_util.hpp"
#include "io/fault.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::TrainOptions;

constexpr int kSoakSteps = 24;
constexpr int kCheckpointEvery = 4;

struct Tally {
  FaultCounts faults;
  std::uint64_t rounds = 0, steps_ok = 0, steps_failed = 0, param_reads_failed = 0, resumes = 0,
                checkpoints = 0, saves_failed = 0, resumes_failed = 0;
  std::string last_error;
};

// One engine (one rank) on `config`, the model registered; faults from `faults` when set.
Result<std::unique_ptr<Engine>> open_engine(const Config& config, const Model& model,
                                            engine_test::Ranks& ranks,
                                            std::shared_ptr<FaultInjector> faults) {
  Env env;
  env.device = ranks.devices[0].get();
  env.comm = ranks.comms[0].get();
  env.io_faults = std::move(faults);
  ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
  ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
  ZINF_RETURN_IF_ERROR(engine->finalize());
  return engine;
}

void add(FaultCounts* to, const FaultCounts& c) {
  to->eio += c.eio;
  to->short_io += c.short_io;
  to->eintr += c.eintr;
  to->eagain += c.eagain;
  to->latency += c.latency;
}

TEST(Soak, TrainingUnderRandomNvmeFaultsEndsWithTheFaultFreeMasters) {
  const char* env_seconds = std::getenv("ZINF_SOAK_SECONDS");
  const double budget_s = env_seconds != nullptr ? std::atof(env_seconds) : 60.0;
  engine_test::ScratchDir scratch("soak");
  const Model model = engine_test::make_model(DType::kBF16, 2605);
  Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNvme, scratch.path());
  config.zero.sub_group_size = 8192;  // pieces of several 4 KiB blocks, so transfers can be short

  // The fault-free run, once.
  std::vector<std::vector<float>> expected;
  {
    engine_test::Ranks ranks = engine_test::make_ranks(1);
    Result<std::unique_ptr<Engine>> engine = open_engine(config, model, ranks, nullptr);
    ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
    TrainOptions options;
    options.steps = kSoakSteps;
    options.check_gathered = false;
    const Status trained = engine_test::train_rank(**engine, model, 0, options, nullptr, nullptr);
    ASSERT_TRUE(trained.is_ok()) << trained.to_string();
    Result<std::vector<std::vector<float>>> m = engine_test::read_masters(**engine, model);
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    expected = std::move(*m);
  }

  Tally tally;
  const auto start = std::chrono::steady_clock::now();
  // ZINF_SOAK_FIRST_ROUND: start at that round (its fault seed), to replay one that failed.
  const char* env_first = std::getenv("ZINF_SOAK_FIRST_ROUND");
  const std::uint64_t first_round =
      env_first != nullptr ? std::strtoull(env_first, nullptr, 10) : 1;
  for (std::uint64_t seed = std::max<std::uint64_t>(1, first_round);; ++seed) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >=
        budget_s) {
      break;
    }
    FaultSpec spec;
    spec.seed = 0x50a4 + seed;
    spec.eio_rate = 1e-4;
    spec.short_rate = 1e-2;
    spec.eintr_rate = 5e-3;
    spec.eagain_rate = 5e-3;
    spec.latency_rate = 1e-3;
    spec.latency = std::chrono::microseconds(2000);
    std::printf("soak round %llu: fault seed %llu\n", static_cast<unsigned long long>(seed),
                static_cast<unsigned long long>(spec.seed));
    // Saves alternate between two directories, as a job keeps its last two checkpoints: a save
    // that fails (its reads of the state on NVMe meet an EIO too) leaves the other one whole.
    const std::string ckpt_dirs[2] = {scratch.path() + "/ckpt-" + std::to_string(seed) + "a",
                                      scratch.path() + "/ckpt-" + std::to_string(seed) + "b"};
    std::string ckpt;  // the last checkpoint saved whole
    int saves = 0;
    std::unique_ptr<engine_test::Ranks> ranks;
    std::unique_ptr<Engine> engine;
    std::shared_ptr<FaultInjector> faults;
    int saved_step = 0;  // the step of the last checkpoint; 0: none yet
    int step = 1;
    int resumes_this_round = 0;
    while (step <= kSoakSteps) {
      if (engine == nullptr) {
        // A new engine (and injector: its counters are kept per engine), from the checkpoint.
        if (faults) add(&tally.faults, faults->counts());
        faults = std::make_shared<FaultInjector>(spec);
        spec.seed += 1000;  // the resumed run draws other faults
        // And a new communicator and device: a failed parameter read fails the all-gather it
        // feeds, which aborts the communicator, as a failed rank ends a job's collectives.
        ranks = std::make_unique<engine_test::Ranks>(engine_test::make_ranks(1));
        // Opening (finalize writes the initial state) and loading (it writes the checkpoint's
        // state) write to NVMe too: an EIO there fails them with a Status, and the job starts
        // again, as after a failed step.
        Result<std::unique_ptr<Engine>> opened = open_engine(config, model, *ranks, faults);
        Status resumed = opened.status();
        if (resumed.is_ok()) {
          engine = std::move(*opened);
          if (saved_step > 0) resumed = engine->load_checkpoint(ckpt);
        }
        if (!resumed.is_ok()) {
          ++tally.resumes_failed;
          tally.last_error = resumed.to_string();
          EXPECT_NE(resumed.to_string().find("(errno 5)"), std::string::npos)
              << resumed.to_string();
          EXPECT_NE(resumed.message().find("swap extent"), std::string::npos)
              << resumed.to_string();
          engine.reset();
          ASSERT_LT(++resumes_this_round, 50) << "no progress: " << tally.last_error;
          continue;
        }
        step = saved_step + 1;
      }
      TrainOptions options;
      options.first_step = step;
      options.steps = step;
      options.check_gathered = false;
      const Status s = engine_test::train_rank(*engine, model, 0, options, nullptr, nullptr);
      if (!s.is_ok()) {
        // Only EIO is not retried below the engine; the error must say so, and name the extent
        // (a failed parameter read may come back as the all-gather it fed, kAborted, naming it).
        ++tally.steps_failed;
        if (s.message().find("/param/") != std::string::npos) ++tally.param_reads_failed;
        tally.last_error = s.to_string();
        EXPECT_NE(s.to_string().find("(errno 5)"), std::string::npos) << s.to_string();
        EXPECT_NE(s.message().find("swap extent"), std::string::npos) << s.to_string();
        engine.reset();
        ++tally.resumes;
        ASSERT_LT(++resumes_this_round, 50) << "no progress: " << tally.last_error;
        continue;
      }
      ++tally.steps_ok;
      if (step % kCheckpointEvery == 0) {
        const std::string& dir = ckpt_dirs[saves++ % 2];
        const Status saved = engine->save_checkpoint(dir);
        if (!saved.is_ok()) {
          // As a failed step: EIO naming the swap extent it read, or the checkpoint file it
          // wrote; resume from the last whole checkpoint.
          ++tally.saves_failed;
          tally.last_error = saved.to_string();
          EXPECT_NE(saved.to_string().find("(errno 5)"), std::string::npos) << saved.to_string();
          EXPECT_TRUE(saved.message().find("swap extent") != std::string::npos ||
                      saved.message().find("write of " + dir + "/") != std::string::npos)
              << saved.to_string();
          engine.reset();
          ++tally.resumes;
          ASSERT_LT(++resumes_this_round, 50) << "no progress: " << tally.last_error;
          continue;
        }
        ckpt = dir;
        saved_step = step;
        ++tally.checkpoints;
      }
      ++step;
    }
    // The comparison reads the state back without faults: it checks what training left on
    // NVMe, not the read (a read that meets an EIO fails with a Status, as above).
    faults->set_enabled(false);
    Result<std::vector<std::vector<float>>> got = engine_test::read_masters(*engine, model);
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      ASSERT_EQ(std::memcmp((*got)[p].data(), expected[p].data(), expected[p].size() * 4), 0)
          << "round " << seed << ": the master of " << model.params[p].name
          << " differs from the fault-free run";
    }
    add(&tally.faults, faults->counts());
    faults.reset();
    ++tally.rounds;
  }
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "soak: %.0f s, %llu rounds of %d steps, every round ended with the fault-free masters\n"
      "  faults injected: eio %llu, short %llu, eintr %llu, eagain %llu, delay %llu\n"
      "  steps ok %llu, steps failed with a Status %llu (a parameter read in %llu), checkpoints "
      "saved %llu, saves failed with a Status %llu, resumed from a checkpoint %llu (opening or "
      "loading failed with a Status %llu more times)\n"
      "  last error: %s\n",
      took, static_cast<unsigned long long>(tally.rounds), kSoakSteps,
      static_cast<unsigned long long>(tally.faults.eio),
      static_cast<unsigned long long>(tally.faults.short_io),
      static_cast<unsigned long long>(tally.faults.eintr),
      static_cast<unsigned long long>(tally.faults.eagain),
      static_cast<unsigned long long>(tally.faults.latency),
      static_cast<unsigned long long>(tally.steps_ok),
      static_cast<unsigned long long>(tally.steps_failed),
      static_cast<unsigned long long>(tally.param_reads_failed),
      static_cast<unsigned long long>(tally.checkpoints),
      static_cast<unsigned long long>(tally.saves_failed),
      static_cast<unsigned long long>(tally.resumes),
      static_cast<unsigned long long>(tally.resumes_failed), tally.last_error.c_str());
  EXPECT_GT(tally.rounds, 0u);
  EXPECT_GT(tally.faults.short_io + tally.faults.eintr + tally.faults.eagain, 0u);
}

}  // namespace
}  // namespace zinf
