// Tagged checkpoints (DeepSpeed's layout) and what a save that fails leaves behind. A user saves
// tags a, b, c with keep_last 2: b and c remain, `latest` names c, each loads the masters it was
// saved with; a tag saved again is replaced. Faults injected into the checkpoint's own I/O
// (lib/io's FaultInjector: EIO, ENOSPC, short writes) fail the save with a Status naming the file,
// or (short writes) are resumed, and the previous checkpoint still loads bit for bit. A flipped bit
// in any file of a tag, or a truncated (torn) rank file, is kCorruption naming the file. And the
// state a resume needs beside the optimizer's: the learning-rate schedule, the gather order, the
// client state.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine_test_util.hpp"
#include "io/fault.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::TrainOptions;

bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t p = 0; p < a.size(); ++p) {
    if (a[p].size() != b[p].size() ||
        std::memcmp(a[p].data(), b[p].data(), a[p].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

// What most cases share: a scratch directory named after the case holding the checkpoint
// directory dir_, a small model, and the stage-2 config (zinf.keep_last at its default).
class CheckpointTags : public ::testing::Test {
 protected:
  engine_test::ScratchDir scratch_{std::string("ckpt-") +
                                   ::testing::UnitTest::GetInstance()->current_test_info()->name()};
  const std::string dir_ = scratch_.path() + "/ckpt";
  const Model model_ = engine_test::make_model(DType::kF32, 21);
  Config config_ = engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, "");
};

// One rank's engine, registered and finalized.
struct OneEngine {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  std::unique_ptr<Engine> engine;

  OneEngine(const Config& config, const Model& model,
            std::shared_ptr<FaultInjector> faults = nullptr) {
    Env env;
    env.device = ranks.devices[0].get();
    env.comm = ranks.comms[0].get();
    env.io_faults = std::move(faults);
    Result<std::unique_ptr<Engine>> opened = Engine::open(config, env);
    EXPECT_TRUE(opened.is_ok()) << opened.status().to_string();
    if (!opened.is_ok()) return;
    engine = std::move(*opened);
    EXPECT_TRUE(engine_test::register_model(*engine, model).is_ok());
    EXPECT_TRUE(engine->finalize().is_ok());
  }
  Status train(const Model& model, int first, int last) {
    TrainOptions options;
    options.first_step = first;
    options.steps = last;
    return engine_test::train_rank(*engine, model, 0, options, nullptr, nullptr);
  }
};

// zinf.keep_last's default (0) deletes nothing, as DeepSpeed deletes no tag.
TEST_F(CheckpointTags, TheDefaultKeepsEveryTag) {
  ASSERT_EQ(config_.keep_last, 0);
  OneEngine one(config_, model_);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(one.train(model_, i + 1, i + 1).is_ok());
    const Status st = one.engine->save_checkpoint(dir_);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  for (int step = 1; step <= 3; ++step) {
    EXPECT_TRUE(std::filesystem::exists(fmt::format("{}/global_step{}/manifest.json", dir_, step)))
        << "global_step" << step;
  }
  EXPECT_EQ(engine_test::read_file(dir_ + "/latest"), "global_step3");
}

TEST_F(CheckpointTags, KeepLastLatestAndEachTagLoadsItsState) {
  config_.keep_last = 2;
  std::vector<std::vector<std::vector<float>>> saved;
  {
    OneEngine one(config_, model_);
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(one.train(model_, i + 1, i + 1).is_ok());
      const std::string tag(1, static_cast<char>('a' + i));
      const Status st = one.engine->save_checkpoint(dir_, tag);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      Result<std::vector<std::vector<float>>> m = engine_test::read_masters(*one.engine, model_);
      ASSERT_TRUE(m.is_ok());
      saved.push_back(std::move(*m));
    }
    // Saving a tag again replaces it (checkpoint_replace_test.cpp): the same state here.
    const Status again = one.engine->save_checkpoint(dir_, "c");
    EXPECT_TRUE(again.is_ok()) << again.to_string();
    const Status bad = one.engine->save_checkpoint(dir_, "../c");
    EXPECT_EQ(bad.code(), Code::kInvalidArgument) << bad.to_string();
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/a")) << "keep_last 2 keeps b and c";
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/b/manifest.json"));
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/c/manifest.json"));
  EXPECT_EQ(engine_test::read_file(dir_ + "/latest"), "c");
  // Nothing of the saves is left behind but the lock file every save takes.
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    if (entry.path().filename() == kCheckpointSaveLock) continue;
    EXPECT_NE(entry.path().filename().string()[0], '.') << "left behind: " << entry.path();
  }
  // Every file of a tag is a whole number of 4096-byte blocks except the small text ones.
  EXPECT_EQ(std::filesystem::file_size(dir_ + "/c/rank0.zinfckpt") % 4096, 0u);

  for (const auto& [tag, want] :
       std::vector<std::pair<std::string, std::size_t>>{{"", 2}, {"b", 1}, {"c", 2}}) {
    OneEngine fresh(config_, model_);
    const Status st = fresh.engine->load_checkpoint(dir_, tag);
    ASSERT_TRUE(st.is_ok()) << "tag '" << tag << "': " << st.to_string();
    Result<std::vector<std::vector<float>>> m = engine_test::read_masters(*fresh.engine, model_);
    ASSERT_TRUE(m.is_ok());
    EXPECT_TRUE(same_bits(*m, saved[want])) << "tag '" << tag << "'";
  }
  OneEngine fresh(config_, model_);
  const Status gone = fresh.engine->load_checkpoint(dir_, "a");
  EXPECT_EQ(gone.code(), Code::kNotFound) << gone.to_string();
  EXPECT_NE(gone.message().find(dir_ + "/a/manifest.json"), std::string::npos) << gone.to_string();
}

// A save cut short between its tag's rename and `latest`'s (kill -9 there) leaves a complete
// tag newer than the one `latest` names, and latest.tmp naming it. The run restarted from
// `latest` trains to that step again and saves that tag again: the save replaces the leftover
// instead of refusing it, so a restart loop goes on, and the tag then holds the
// new save. The state is built by hand: two saves, then `latest` rewritten to name the first and
// latest.tmp left naming the second.
TEST_F(CheckpointTags, ATagLeftByASaveCutShortBeforeLatestMovedIsSavedAgain) {
  config_.keep_last = 2;
  {
    OneEngine one(config_, model_);
    ASSERT_TRUE(one.train(model_, 1, 2).is_ok());
    ASSERT_TRUE(one.engine->save_checkpoint(dir_).is_ok());
    ASSERT_TRUE(one.train(model_, 3, 4).is_ok());
    one.engine->set_client_state("the run that was killed");
    ASSERT_TRUE(one.engine->save_checkpoint(dir_).is_ok());
  }
  std::ofstream(dir_ + "/latest", std::ios::trunc) << "global_step2";
  std::ofstream(dir_ + "/latest.tmp", std::ios::trunc) << "global_step4";

  // inspect says what each leftover is and what happens to it.
  Result<nlohmann::json> info = inspect_checkpoints(dir_, false);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  EXPECT_TRUE((*info)["problems"].empty()) << (*info)["problems"].dump();
  const std::string notes = (*info)["notes"].dump();
  EXPECT_EQ((*info)["notes"].size(), 2u) << notes;
  EXPECT_NE(notes.find("latest.tmp' (naming 'global_step4'): left by a save cut short"),
            std::string::npos)
      << notes;
  EXPECT_NE(notes.find("tag 'global_step4' is complete and of a later step than 'global_step2', "
                       "the tag 'latest' names"),
            std::string::npos)
      << notes;
  EXPECT_NE(notes.find("the next save of tag 'global_step4' replaces it"), std::string::npos)
      << notes;

  // The restarted run: loads `latest` (step 2), trains steps 3 and 4 at another learning rate
  // (so its masters differ from the killed run's), saves global_step4.
  std::vector<std::vector<float>> killed;
  std::vector<std::vector<float>> resumed;
  {
    OneEngine tag4(config_, model_);
    ASSERT_TRUE(tag4.engine->load_checkpoint(dir_, "global_step4").is_ok());
    killed = *engine_test::read_masters(*tag4.engine, model_);
  }
  {
    OneEngine again(config_, model_);
    ASSERT_TRUE(again.engine->load_checkpoint(dir_).is_ok());
    EXPECT_EQ(again.engine->client_state(), "");
    ASSERT_TRUE(again.engine->set_learning_rate(config_.optimizer.lr * 3).is_ok());
    ASSERT_TRUE(again.train(model_, 3, 4).is_ok());
    again.engine->set_client_state("the restarted run");
    const Status st = again.engine->save_checkpoint(dir_);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    resumed = *engine_test::read_masters(*again.engine, model_);
    ASSERT_FALSE(same_bits(resumed, killed));
    EXPECT_EQ(engine_test::read_file(dir_ + "/latest"), "global_step4");
    EXPECT_FALSE(std::filesystem::exists(dir_ + "/latest.tmp"));
    EXPECT_FALSE(std::filesystem::exists(dir_ + "/.global_step4.old"));
    EXPECT_FALSE(std::filesystem::exists(dir_ + "/.global_step4.tmp"));
  }
  OneEngine fresh(config_, model_);
  ASSERT_TRUE(fresh.engine->load_checkpoint(dir_).is_ok());
  EXPECT_EQ(fresh.engine->client_state(), "the restarted run");
  EXPECT_TRUE(same_bits(*engine_test::read_masters(*fresh.engine, model_), resumed));
  info = inspect_checkpoints(dir_, true);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  EXPECT_TRUE((*info)["problems"].empty()) << (*info)["problems"].dump();
  EXPECT_TRUE((*info)["notes"].empty()) << (*info)["notes"].dump();
}

// The same cut at the very first save: a complete tag and no `latest`. A run started again from
// scratch saves that tag again, replacing it.
TEST_F(CheckpointTags, ATagLeftByAFirstSaveCutShortIsSavedAgain) {
  {
    OneEngine one(config_, model_);
    ASSERT_TRUE(one.train(model_, 1, 2).is_ok());
    one.engine->set_client_state("killed");
    ASSERT_TRUE(one.engine->save_checkpoint(dir_).is_ok());
  }
  std::filesystem::rename(dir_ + "/latest", dir_ + "/latest.tmp");
  Result<nlohmann::json> info = inspect_checkpoints(dir_, false);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  const std::string notes = (*info)["notes"].dump();
  EXPECT_NE(notes.find("tag 'global_step2' is complete, but there is no '" + dir_ + "/latest'"),
            std::string::npos)
      << notes;

  OneEngine again(config_, model_);
  ASSERT_TRUE(again.train(model_, 1, 2).is_ok());
  again.engine->set_client_state("started again");
  const Status st = again.engine->save_checkpoint(dir_);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(engine_test::read_file(dir_ + "/latest"), "global_step2");
  OneEngine fresh(config_, model_);
  ASSERT_TRUE(fresh.engine->load_checkpoint(dir_).is_ok());
  EXPECT_EQ(fresh.engine->client_state(), "started again");
}

// keep_last never deletes a tag of a later step than the one just saved: a run started afresh
// in a directory that holds another run's tags (steps 290 and 300) keeps them, and prunes only
// its own.
TEST_F(CheckpointTags, KeepLastNeverPrunesATagOfALaterStep) {
  config_.keep_last = 2;
  {
    OneEngine earlier(config_, model_);
    ASSERT_TRUE(earlier.train(model_, 1, 290).is_ok());
    ASSERT_TRUE(earlier.engine->save_checkpoint(dir_).is_ok());
    ASSERT_TRUE(earlier.train(model_, 291, 300).is_ok());
    ASSERT_TRUE(earlier.engine->save_checkpoint(dir_).is_ok());
  }
  OneEngine fresh(config_, model_);
  for (int step = 1; step <= 3; ++step) {
    ASSERT_TRUE(fresh.train(model_, step, step).is_ok());
    const Status st = fresh.engine->save_checkpoint(dir_);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  // The fresh run's own tags beyond keep_last go; the earlier run's stay.
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/global_step1"));
  for (int step : {2, 3, 290, 300}) {
    EXPECT_TRUE(std::filesystem::exists(fmt::format("{}/global_step{}/manifest.json", dir_, step)))
        << "global_step" << step;
  }
  EXPECT_EQ(engine_test::read_file(dir_ + "/latest"), "global_step3");
}

// A save takes an exclusive lock on <dir_>/.zinf-save.lock: while another process (here a
// descriptor of the test's own; flock locks belong to an open file, so one process can hold two
// that conflict) holds it, a save is refused naming the directory and the holder, and leaves
// the directory as it was. The lock file is not a tag, a problem or a note for inspect.
TEST_F(CheckpointTags, ASaveIntoADirectoryAnotherSaveHoldsIsRefusedNamingTheHolder) {
  OneEngine one(config_, model_);
  ASSERT_TRUE(one.train(model_, 1, 1).is_ok());
  ASSERT_TRUE(one.engine->save_checkpoint(dir_).is_ok());
  const std::string lock_path = dir_ + "/.zinf-save.lock";
  ASSERT_TRUE(std::filesystem::exists(lock_path));
  EXPECT_EQ(std::filesystem::file_size(lock_path), 0u) << "no holder named once released";
  {
    const int fd = ::open(lock_path.c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
    const std::string holder = "pid 4242 host other-node\n";
    ASSERT_EQ(::pwrite(fd, holder.data(), holder.size(), 0), static_cast<ssize_t>(holder.size()));
    // A save cut short by the other job is its save in progress, not this one's to remove.
    std::filesystem::create_directories(dir_ + "/.global_step9.tmp");
    ASSERT_TRUE(one.train(model_, 2, 2).is_ok());
    const Status st = one.engine->save_checkpoint(dir_);
    EXPECT_EQ(st.code(), Code::kFailedPrecondition) << st.to_string();
    EXPECT_NE(st.message().find("the checkpoint directory '" + dir_ +
                                "' is being saved into by another process (pid 4242 host "
                                "other-node; it holds '" +
                                lock_path + "')"),
              std::string::npos)
        << st.to_string();
    EXPECT_FALSE(std::filesystem::exists(dir_ + "/global_step2"));
    EXPECT_FALSE(std::filesystem::exists(dir_ + "/.global_step2.tmp"));
    EXPECT_TRUE(std::filesystem::exists(dir_ + "/.global_step9.tmp"));
    EXPECT_EQ(engine_test::read_file(dir_ + "/latest"), "global_step1");
    ::close(fd);
  }
  // Released: the save goes ahead (and clears what the other job's cut-short save left).
  const Status st = one.engine->save_checkpoint(dir_);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(engine_test::read_file(dir_ + "/latest"), "global_step2");
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/.global_step9.tmp"));
  Result<std::unique_ptr<IoEngine>> io = open_checkpoint_io(nullptr);
  ASSERT_TRUE(io.is_ok());
  RefusedCheckpointTags refused;
  EXPECT_EQ(list_checkpoint_tags(**io, dir_, &refused).size(), 2u);
  EXPECT_TRUE(refused.tags.empty() && refused.temp_dirs.empty() && refused.old_dirs.empty());
  Result<nlohmann::json> info = inspect_checkpoints(dir_, false);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  EXPECT_TRUE((*info)["problems"].empty()) << (*info)["problems"].dump();
  EXPECT_TRUE((*info)["notes"].empty()) << (*info)["notes"].dump();
}

// Two engines saving into one directory at once, as two jobs given one save directory do: each
// save either completes or is refused naming the lock, never fails halfway on a file the other
// removed, and every tag in the directory loads.
TEST_F(CheckpointTags, TwoEnginesSavingIntoOneDirectoryNeverBreakEachOthersSaves) {
  config_.keep_last = 2;
  constexpr int kSaves = 12;
  int refused[2] = {0, 0};
  std::vector<std::thread> jobs;
  std::vector<std::string> failures[2];
  for (int job = 0; job < 2; ++job) {
    jobs.emplace_back([&, job] {
      OneEngine one(config_, model_);
      if (one.engine == nullptr) return;
      for (int i = 0; i < kSaves; ++i) {
        if (!one.train(model_, i + 1, i + 1).is_ok()) return;
        const Status st = one.engine->save_checkpoint(dir_, fmt::format("job{}-{}", job, i));
        if (st.code() == Code::kFailedPrecondition &&
            st.message().find("is being saved into by another process") != std::string::npos) {
          ++refused[job];
        } else if (!st.is_ok()) {
          failures[job].push_back(st.to_string());
        }
      }
    });
  }
  for (std::thread& t : jobs) t.join();
  std::printf("refused saves: job0 %d, job1 %d of %d each\n", refused[0], refused[1], kSaves);
  for (int job = 0; job < 2; ++job) {
    EXPECT_TRUE(failures[job].empty()) << "job " << job << ": " << failures[job].front();
  }
  Result<nlohmann::json> info = inspect_checkpoints(dir_, true);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  EXPECT_TRUE((*info)["problems"].empty()) << (*info)["problems"].dump();
  EXPECT_FALSE((*info)["tags"].empty());
}

// tmpfs refused O_DIRECT before Linux 6.6: the files then go through the page cache, padded the
// same way, so a checkpoint saved on tmpfs loads (and one copied to another filesystem would
// too). On a kernel whose tmpfs takes O_DIRECT this runs the direct path.
TEST_F(CheckpointTags, SavesAndLoadsOnTmpfs) {
  if (!std::filesystem::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm here";
  const std::string shm_dir = fmt::format("/dev/shm/zinf-ckpt-tmpfs-{}", ::getpid());
  std::filesystem::remove_all(shm_dir);
  std::vector<std::vector<float>> saved;
  {
    OneEngine one(config_, model_);
    ASSERT_TRUE(one.train(model_, 1, 2).is_ok());
    const Status st = one.engine->save_checkpoint(shm_dir);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    saved = *engine_test::read_masters(*one.engine, model_);
  }
  EXPECT_EQ(std::filesystem::file_size(shm_dir + "/global_step2/rank0.zinfckpt") % 4096, 0u);
  OneEngine fresh(config_, model_);
  const Status st = fresh.engine->load_checkpoint(shm_dir);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_TRUE(same_bits(*engine_test::read_masters(*fresh.engine, model_), saved));
  std::filesystem::remove_all(shm_dir);
}

TEST_F(CheckpointTags, ResumeStateScheduleGatherOrderAndClientStateComeBack) {
  config_ = engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, "");
  ScheduleConfig schedule;
  schedule.kind = ScheduleKind::kWarmupCosineLR;
  schedule.warmup_num_steps = 3;
  schedule.total_num_steps = 20;
  std::string blob(300, '\0');
  for (std::size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<char>(i * 7 + 1);
  std::vector<std::string> order;
  double next_lr = 0;
  {
    OneEngine one(config_, model_);
    ASSERT_TRUE(one.engine->set_lr_schedule(schedule).is_ok());
    ASSERT_TRUE(one.train(model_, 1, 4).is_ok());
    one.engine->set_client_state(blob);
    ASSERT_TRUE(one.engine->save_checkpoint(dir_).is_ok());
    order = one.engine->recorded_order();
    next_lr = one.engine->learning_rate();
  }
  ASSERT_FALSE(order.empty());
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/global_step4/client_state.bin"));
  OneEngine fresh(config_, model_);  // no schedule set: the checkpoint's comes back
  EXPECT_TRUE(fresh.engine->recorded_order().empty());
  const Status st = fresh.engine->load_checkpoint(dir_);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(fresh.engine->client_state(), blob);
  EXPECT_EQ(fresh.engine->recorded_order(), order);
  EXPECT_EQ(fresh.engine->learning_rate(), next_lr);
  EXPECT_NE(next_lr, config_.optimizer.lr) << "the schedule moved the rate";
}

// An engine with a schedule of its own keeps it on load, at the checkpoint's step, as a DeepSpeed
// run resumed with a longer total_num_steps follows the new curve: WarmupDecayLR (linear warm-up
// from 0 to 0.01 over 2 iterations, then linear decay to 0 at total_num_steps) in double.
TEST_F(CheckpointTags, AnEngineWithItsOwnScheduleKeepsItAtTheCheckpointsStep) {
  auto decay = [](std::int64_t total) {
    ScheduleConfig s;
    s.kind = ScheduleKind::kWarmupDecayLR;
    s.warmup_num_steps = 2;
    s.warmup_linear = true;
    s.warmup_max_lr = 0.01;
    s.total_num_steps = total;
    return s;
  };
  // The rate of iteration n (0.01 n / 2 in the warm-up, then 0.01 (total - n) / (total - 2));
  // after k applied steps the next one runs at iteration k - 1 (DeepSpeed's indexing, from -1).
  auto expected = [](std::int64_t n, double total) {
    return n < 2 ? 0.01 * static_cast<double>(n) / 2.0 : 0.01 * (total - n) / (total - 2.0);
  };
  {
    OneEngine one(config_, model_);
    ASSERT_TRUE(one.engine->set_lr_schedule(decay(10)).is_ok());
    ASSERT_TRUE(one.train(model_, 1, 4).is_ok());
    EXPECT_DOUBLE_EQ(one.engine->learning_rate(), expected(3, 10));
    ASSERT_TRUE(one.engine->save_checkpoint(dir_).is_ok());
  }
  OneEngine longer(config_, model_);
  ASSERT_TRUE(longer.engine->set_lr_schedule(decay(40)).is_ok());
  ASSERT_TRUE(longer.engine->load_checkpoint(dir_).is_ok());
  EXPECT_DOUBLE_EQ(longer.engine->learning_rate(), expected(3, 40));
  ASSERT_TRUE(longer.train(model_, 5, 6).is_ok());
  EXPECT_DOUBLE_EQ(longer.engine->learning_rate(), expected(5, 40));
  // Without a schedule of its own the engine takes the checkpoint's.
  OneEngine plain(config_, model_);
  ASSERT_TRUE(plain.engine->load_checkpoint(dir_).is_ok());
  EXPECT_DOUBLE_EQ(plain.engine->learning_rate(), expected(3, 10));
}

// A save on one rank only (a common mistake: saving "on rank 0") fails at the collective timeout
// with an error that says the call is collective, before the collective that ran out.
TEST_F(CheckpointTags, ASaveOnOneRankSaysEveryRankCallsIt) {
  config_.collective_timeout_ms = 2000;  // room for a slow rank (sanitizers) before the save
  engine_test::Ranks ranks = engine_test::make_ranks(2, std::chrono::milliseconds(2000));
  Status saved;
  std::atomic<bool> save_returned{false};
  std::vector<Status> st = engine_test::run_ranks(2, [&](int rank) -> Status {
    // Rank 0 lets rank 1 go however it returns (a failure before the save too).
    struct Done {
      std::atomic<bool>* flag;
      ~Done() {
        if (flag != nullptr) *flag = true;
      }
    } done{rank == 0 ? &save_returned : nullptr};
    Env env;
    env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
    env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::open(config_, env));
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model_));
    ZINF_RETURN_IF_ERROR(engine->finalize());
    TrainOptions options;
    options.steps = 1;
    ZINF_RETURN_IF_ERROR(engine_test::train_rank(*engine, model_, rank, options, nullptr, nullptr));
    if (rank == 0) {
      saved = engine->save_checkpoint(dir_, "t");
    } else {
      // Not saving, and keeping its engine open until rank 0's save has returned.
      while (!save_returned) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return Status::ok();
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(saved.code(), Code::kTimeout) << saved.to_string();
  EXPECT_NE(saved.message().find("save_checkpoint('" + dir_ +
                                 "', 't') is collective: every rank calls it"),
            std::string::npos)
      << saved.to_string();
}

// Faults in the checkpoint's own I/O, one kind per case: the save fails naming the file it was
// writing (or, for short writes, completes), and the checkpoint saved before loads bit for bit.
struct FaultCase {
  const char* name;
  FaultSpec spec;
  Code code;  // kOk: the save succeeds
  int sys_code;
};

TEST(CheckpointFaults, SaveFaultsNameTheFileAndKeepThePreviousCheckpoint) {
  const Model model = engine_test::make_model(DType::kF32, 23);
  const Config config =
      engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, "");
  std::vector<FaultCase> cases;
  {
    FaultSpec eio;
    eio.seed = 101;
    eio.eio_rate = 0.25;
    eio.reads = false;
    cases.push_back({"eio", eio, Code::kIoError, EIO});
    FaultSpec enospc;
    enospc.seed = 102;
    enospc.enospc_rate = 0.25;
    cases.push_back({"enospc", enospc, Code::kNoSpace, ENOSPC});
    FaultSpec shorts;
    shorts.seed = 103;
    shorts.short_rate = 0.5;
    cases.push_back({"short", shorts, Code::kOk, 0});
  }
  for (FaultCase c : cases) {
    // Several seeds each: the faults land in different files (a rank file, the manifest, the
    // client state, `latest`).
    for (int round = 0; round < 4; ++round) {
      c.spec.seed += 1;
      SCOPED_TRACE(fmt::format("{} (seed {})", c.name, c.spec.seed));
      engine_test::ScratchDir scratch(fmt::format("ckpt-fault-{}-{}", c.name, round));
      const std::string dir = scratch.path() + "/ckpt";
      auto faults = std::make_shared<FaultInjector>(c.spec);
      faults->set_enabled(false);
      OneEngine one(config, model, faults);
      ASSERT_TRUE(one.train(model, 1, 2).is_ok());
      ASSERT_TRUE(one.engine->save_checkpoint(dir, "good").is_ok());
      Result<std::vector<std::vector<float>>> good = engine_test::read_masters(*one.engine, model);
      ASSERT_TRUE(good.is_ok());
      ASSERT_TRUE(one.train(model, 3, 3).is_ok());
      Result<std::vector<std::vector<float>>> next = engine_test::read_masters(*one.engine, model);
      one.engine->set_client_state("client state");
      faults->set_enabled(true);
      const Status st = one.engine->save_checkpoint(dir, "next");
      faults->set_enabled(false);
      const FaultCounts n = faults->counts();
      std::printf("%s seed %llu: eio %llu enospc %llu short %llu -> %s\n", c.name,
                  static_cast<unsigned long long>(c.spec.seed),
                  static_cast<unsigned long long>(n.eio), static_cast<unsigned long long>(n.enospc),
                  static_cast<unsigned long long>(n.short_io), st.to_string().c_str());
      const bool faulted = c.code == Code::kOk ? false : (n.eio + n.enospc) > 0;
      if (faulted) {
        EXPECT_EQ(st.code(), c.code) << st.to_string();
        EXPECT_EQ(st.sys_code(), c.sys_code) << st.to_string();
        // The file being written: a rank file or the manifest in the temporary tag, or latest.
        const bool names_file = st.message().find(dir + "/.next.tmp/") != std::string::npos ||
                                st.message().find(dir + "/latest.tmp") != std::string::npos;
        EXPECT_TRUE(names_file) << st.to_string();
        EXPECT_EQ(engine_test::read_file(dir + "/latest"), "good");
        EXPECT_FALSE(std::filesystem::exists(dir + "/next"));
        EXPECT_FALSE(std::filesystem::exists(dir + "/.next.tmp"));
      } else {
        EXPECT_TRUE(st.is_ok()) << st.to_string();
        EXPECT_EQ(engine_test::read_file(dir + "/latest"), "next");
      }
      OneEngine fresh(config, model);
      const Status loaded = fresh.engine->load_checkpoint(dir);
      ASSERT_TRUE(loaded.is_ok()) << loaded.to_string();
      Result<std::vector<std::vector<float>>> back =
          engine_test::read_masters(*fresh.engine, model);
      ASSERT_TRUE(back.is_ok());
      EXPECT_TRUE(same_bits(*back, faulted ? *good : *next));
      if (faulted) {
        // The same tag saves once the faults are gone.
        const Status retry = one.engine->save_checkpoint(dir, "next");
        EXPECT_TRUE(retry.is_ok()) << retry.to_string();
      }
    }
  }
}

// A flipped bit in any file of a tag, and a rank file cut short (a torn write), are kCorruption
// naming the file, and leave the engine as it was.
TEST(CheckpointFaults, FlippedBitInAnyFileOrTornFileIsCorruptionNamingIt) {
  engine_test::ScratchDir scratch("ckpt-bitflip");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 24);
  const Config config =
      engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, "");
  std::vector<std::vector<float>> before;
  {
    engine_test::Ranks ranks = engine_test::make_ranks(2);
    std::vector<Status> st = engine_test::run_ranks(2, [&](int rank) -> Status {
      Env env;
      env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
      env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
      ZINF_ASSIGN_OR_RETURN(auto e, Engine::open(config, env));
      TrainOptions options;
      options.steps = 2;
      ZINF_RETURN_IF_ERROR(engine_test::train_rank(*e, model, rank, options, nullptr, nullptr));
      e->set_client_state("epoch 3, batch 17");
      return e->save_checkpoint(dir, "t");
    });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  }
  const std::string tag = dir + "/t";
  const std::vector<std::string> files = {"rank0.zinfckpt", "rank1.zinfckpt", "manifest.json",
                                          "client_state.bin"};
  SplitMix64 random(2024);
  std::printf("seed 2024\n");
  for (const std::string& name : files) {
    const std::string path = tag + "/" + name;
    const std::string original = engine_test::read_file(path);
    ASSERT_FALSE(original.empty()) << path;
    for (int trial = 0; trial < 3; ++trial) {
      std::string flipped = original;
      const std::size_t bit = random.next() % (flipped.size() * 8);
      flipped[bit / 8] = static_cast<char>(flipped[bit / 8] ^ (1 << (bit % 8)));
      std::ofstream(path, std::ios::binary | std::ios::trunc) << flipped;
      OneEngine fresh(config, model);
      ASSERT_TRUE(fresh.engine != nullptr);
      // A one-rank engine loads the two-rank checkpoint (resharding reads both rank files).
      const Status st = fresh.engine->load_checkpoint(dir);
      EXPECT_EQ(st.code(), Code::kCorruption) << name << " bit " << bit << ": " << st.to_string();
      EXPECT_NE(st.message().find(path), std::string::npos) << st.to_string();
      // Refused before the state was touched: the engine trains on.
      EXPECT_TRUE(fresh.train(model, 1, 1).is_ok());
    }
    std::ofstream(path, std::ios::binary | std::ios::trunc) << original;
  }
  // A rank file cut at a random 4096-byte boundary, as a write torn by a power cut leaves it.
  const std::string victim = tag + "/rank1.zinfckpt";
  std::filesystem::resize_file(victim, std::filesystem::file_size(victim) / 2 / 4096 * 4096);
  OneEngine fresh(config, model);
  const Status torn = fresh.engine->load_checkpoint(dir);
  EXPECT_EQ(torn.code(), Code::kCorruption) << torn.to_string();
  EXPECT_NE(torn.message().find(victim), std::string::npos) << torn.to_string();
}

}  // namespace
}  // namespace zinf
