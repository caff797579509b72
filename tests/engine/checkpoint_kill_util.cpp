// The checkpoint kill test's processes (checkpoint_kill_util.hpp). This test binary re-executes
// itself (/proc/self/exe) with ZINF_CKPT_KILL_ROLE set; a static initializer here runs that role
// before gtest's main and exits, so the child is a plain process with the real filesystem.
//
//   child     opens an engine (NVMe optimizer state), loads `latest` if there is one (and writes
//             "<step> <hash of masters>" of what it loaded to <work>/loaded: this fresh process
//             is the one that judges the previous trial's killed save), applies one step with
//             gradients drawn from the step number, writes "<step> <hash of masters>" to
//             <work>/expect, writes one byte to the pipe (the save starts), saves the default
//             tag, writes another byte (the save ended) and exits.
//   verify    after the last trial, a fresh process: loads `latest`, prints "<step> <hash>",
//             applies the next step and prints its hash (the moments, step count and lr moved
//             it), exits 0; any error exits 2 with the message.
#include "checkpoint_kill_util.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/random.hpp"
#include "common/scratch_dir.hpp"
#include "engine_test_util.hpp"

extern char** environ;

namespace zinf::engine_test {
namespace {

constexpr int kTensors = 4;

Config kill_config(const std::string& nvme) {
  Config c;
  c.optimizer.kind = OptimizerKind::kAdamW;
  c.optimizer.lr = 1e-3;
  c.zero.stage = 2;
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_optimizer.nvme_path = nvme;
  c.zero.offload_optimizer.buffer_count = 2;
  c.zero.sub_group_size = std::size_t{1} << 22;
  c.cpu_threads = 2;
  c.keep_last = 2;
  return c;
}

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

// Runs `fn` on a one-rank engine of `params` elements (kTensors parameters, seeded values).
Status with_engine(std::size_t params, const std::string& nvme,
                   const std::function<Status(Engine&)>& fn) {
  Ranks ranks = make_ranks(1, std::chrono::seconds(120));
  Env env;
  env.device = ranks.devices[0].get();
  env.comm = ranks.comms[0].get();
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::open(kill_config(nvme), env));
  for (int i = 0; i < kTensors; ++i) {
    ParameterSpec spec;
    spec.name = fmt::format("w{}", i);
    spec.module = fmt::format("m{}", i);
    spec.shape = {static_cast<std::int64_t>(params / kTensors)};
    spec.initializer = [i](std::size_t first, std::size_t count, float* out) {
      for (std::size_t k = 0; k < count; ++k) {
        out[k] =
            static_cast<float>((((first + k) * 2654435761u) ^ (i * 97u)) % 2001) * 1e-3f - 1.0f;
      }
      return Status::ok();
    };
    ZINF_RETURN_IF_ERROR(engine->register_parameter(spec));
  }
  ZINF_RETURN_IF_ERROR(engine->finalize());
  return fn(*engine);
}

// One step with gradients drawn from (step, tensor).
Status one_step(Engine& engine, std::size_t params, std::int64_t step) {
  const std::size_t each = params / kTensors;
  std::vector<float> grad(each);
  for (int i = 0; i < kTensors; ++i) {
    SplitMix64 random(static_cast<std::uint64_t>(step) * 1000 + static_cast<std::uint64_t>(i));
    for (float& g : grad) {
      g = static_cast<float>(static_cast<double>(random.next() >> 11) * 0x1.0p-53 - 0.5);
    }
    const std::string name = fmt::format("w{}", i);
    const GradientRef ref{name, grad.data(), each, DType::kF32};
    ZINF_RETURN_IF_ERROR(engine.reduce_gradients(fmt::format("m{}", i), {&ref, 1}));
  }
  ZINF_ASSIGN_OR_RETURN(StepReport report, engine.step());
  if (report.step != step) {
    return Status::internal(fmt::format("stepped to {}, expected {}", report.step, step));
  }
  return Status::ok();
}

Result<std::uint64_t> masters_hash(Engine& engine, std::size_t params) {
  std::vector<float> values(params / kTensors);
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (int i = 0; i < kTensors; ++i) {
    Status st = engine.read_parameters(fmt::format("w{}", i), values.data());
    if (!st.is_ok()) {
      XXH3_freeState(state);
      return st;
    }
    XXH3_64bits_update(state, values.data(), values.size() * sizeof(float));
  }
  const std::uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
}

int run_child() {
  const std::string ckpt = env_or("ZINF_CKPT_KILL_DIR", "");
  const std::string work = env_or("ZINF_CKPT_KILL_WORK", "");
  const std::size_t params = std::stoull(env_or("ZINF_CKPT_KILL_PARAMS", "0"));
  const int fd = std::atoi(env_or("ZINF_CKPT_KILL_FD", "-1").c_str());
  Status st = with_engine(params, work + "/nvme", [&](Engine& e) -> Status {
    std::int64_t step = 0;
    if (std::filesystem::exists(ckpt + "/latest")) {
      ZINF_RETURN_IF_ERROR(e.load_checkpoint(ckpt));
      // The step the checkpoint holds: the tag latest names is global_step<N>.
      std::ifstream f(ckpt + "/latest");
      std::string tag;
      f >> tag;
      step = std::stoll(tag.substr(std::string("global_step").size()));
      // What this fresh process loaded, for the parent to judge the previous trial by.
      ZINF_ASSIGN_OR_RETURN(std::uint64_t loaded, masters_hash(e, params));
      std::ofstream out(work + "/loaded", std::ios::trunc);
      out << step << " " << loaded << "\n";
    }
    ZINF_RETURN_IF_ERROR(one_step(e, params, step + 1));
    ZINF_ASSIGN_OR_RETURN(std::uint64_t h, masters_hash(e, params));
    {
      std::ofstream out(work + "/expect", std::ios::trunc);
      out << (step + 1) << " " << h << "\n";
    }
    const char go = 's';
    if (::write(fd, &go, 1) != 1) return Status::internal("pipe");
    ZINF_RETURN_IF_ERROR(e.save_checkpoint(ckpt));
    const char done = 'd';
    if (::write(fd, &done, 1) != 1) return Status::internal("pipe");
    return Status::ok();
  });
  if (!st.is_ok()) {
    std::fprintf(stderr, "child: %s\n", st.to_string().c_str());
    return 2;
  }
  return 0;
}

int run_verify() {
  const std::string ckpt = env_or("ZINF_CKPT_KILL_DIR", "");
  const std::string work = env_or("ZINF_CKPT_KILL_WORK", "");
  const std::size_t params = std::stoull(env_or("ZINF_CKPT_KILL_PARAMS", "0"));
  Status st = with_engine(params, work + "/nvme-verify", [&](Engine& e) -> Status {
    ZINF_RETURN_IF_ERROR(e.load_checkpoint(ckpt));
    std::ifstream f(ckpt + "/latest");
    std::string tag;
    f >> tag;
    const std::int64_t step = std::stoll(tag.substr(std::string("global_step").size()));
    ZINF_ASSIGN_OR_RETURN(std::uint64_t h, masters_hash(e, params));
    ZINF_RETURN_IF_ERROR(one_step(e, params, step + 1));
    ZINF_ASSIGN_OR_RETURN(std::uint64_t after, masters_hash(e, params));
    std::ofstream out(work + "/verified", std::ios::trunc);
    out << step << " " << h << " " << after << "\n";
    return Status::ok();
  });
  if (!st.is_ok()) {
    std::fprintf(stderr, "verify: %s\n", st.to_string().c_str());
    return 2;
  }
  return 0;
}

// Runs the role named by ZINF_CKPT_KILL_ROLE, before gtest's main, and exits.
const int kRole = [] {
  const char* role = std::getenv("ZINF_CKPT_KILL_ROLE");
  if (role == nullptr) return 0;
  const std::string r = role;
  std::_Exit(r == "child" ? run_child() : r == "verify" ? run_verify() : 3);
}();

pid_t spawn(const std::string& role, const std::string& ckpt, const std::string& work,
            std::size_t params, int fd) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  env_strings.push_back("ZINF_CKPT_KILL_ROLE=" + role);
  env_strings.push_back("ZINF_CKPT_KILL_DIR=" + ckpt);
  env_strings.push_back("ZINF_CKPT_KILL_WORK=" + work);
  env_strings.push_back(fmt::format("ZINF_CKPT_KILL_PARAMS={}", params));
  env_strings.push_back(fmt::format("ZINF_CKPT_KILL_FD={}", fd));
  std::vector<char*> envp;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe";
  char* argv[] = {exe.data(), nullptr};
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data());
  return rc == 0 ? pid : -1;
}

int wait_exit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

}  // namespace

void run_kill_trials(std::size_t params, int trials, std::uint64_t seed) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each trial's line as it happens
  ScratchDir scratch(fmt::format("ckpt-kill-{}", params));
  const std::string ckpt = scratch.path() + "/ckpt";
  const std::string work = scratch.path();
  std::printf("kill test: %zu parameters, NVMe state, %d trials, seed %llu, in %s\n", params,
              trials, static_cast<unsigned long long>(seed), ckpt.c_str());
  SplitMix64 random(seed);
  // Each step's master hash, as the process that computed it recorded it, and the hash after
  // the following step as the process that loaded the checkpoint computed it.
  std::map<std::int64_t, std::uint64_t> hash_at, hash_after;
  int previous = 0, fresh = 0, finished = 0;
  double save_s = 0;
  // The trial whose outcome the next fresh process decides: each trial's child is the fresh
  // process that loads what the previous trial's killed save left (and a verifier process
  // loads what the last one left), so every kill is followed by a load in a new process.
  struct Pending {
    int trial = -1;
    double delay_s = -1;
    double fraction = 0;
    bool saved = false;
    std::int64_t new_step = 0;
    std::uint64_t new_hash = 0;
  } pending;
  // Judges `pending` by what a fresh process loaded: `step` and the masters' `hash`, and `after`,
  // the masters' hash after it applied the next step (the moments and step count decide it).
  auto judge = [&](std::int64_t step, std::uint64_t hash, std::uint64_t after) {
    const char* outcome = "?";
    if (step == pending.new_step) {
      EXPECT_EQ(hash, pending.new_hash)
          << "trial " << pending.trial << ": the new checkpoint's state differs";
      outcome = "new";
      if (pending.trial > 0) ++fresh;
    } else {
      EXPECT_EQ(step, pending.new_step - 1)
          << "trial " << pending.trial << ": neither the previous nor the new";
      ASSERT_EQ(hash_at.count(step), 1u);
      EXPECT_EQ(hash, hash_at[step])
          << "trial " << pending.trial << ": the previous checkpoint differs";
      outcome = "previous";
      ++previous;
      ASSERT_GT(pending.trial, 0);
    }
    if (hash_after.count(step) != 0) {
      EXPECT_EQ(hash_after[step], after) << "the step after step " << step << " differs";
    }
    hash_after[step] = after;
    if (hash_at.count(step + 1) != 0) {
      EXPECT_EQ(hash_at[step + 1], after) << "the step after step " << step << " differs";
    }
    if (pending.trial == 0) {
      std::printf("trial  0: not killed -> loads %s (step %lld)\n", outcome,
                  static_cast<long long>(step));
    } else {
      std::printf("trial %2d: killed %.3f s into the save (%.2f of it)%s -> loads %s (step %lld)\n",
                  pending.trial, pending.delay_s, pending.fraction,
                  pending.saved ? ", after it ended" : "", outcome, static_cast<long long>(step));
    }
  };
  for (int trial = 0; trial <= trials; ++trial) {
    std::filesystem::remove_all(work + "/nvme");
    std::filesystem::create_directories(work + "/nvme");
    std::filesystem::remove(work + "/expect");
    std::filesystem::remove(work + "/loaded");
    int pipe_fds[2];
    ASSERT_EQ(::pipe(pipe_fds), 0);
    const pid_t child = spawn("child", ckpt, work, params, pipe_fds[1]);
    ASSERT_GT(child, 0);
    ::close(pipe_fds[1]);
    char byte = 0;
    const bool saving = ::read(pipe_fds[0], &byte, 1) == 1;
    const auto save_start = std::chrono::steady_clock::now();
    double delay_s = -1;
    if (saving && trial > 0) {
      // Trial 0 runs to the end and times the save; each later one is killed at a uniformly
      // random instant after the save starts: odd trials in [0, 1.2 x that time], even ones in
      // [0.9, 1.1 x], where the save commits (manifest, renames, `latest`, pruning) and a wrong
      // order of those steps would show.
      const double u = static_cast<double>(random.next() >> 11) * 0x1.0p-53;
      delay_s = (trial % 2 == 1 ? 1.2 * u : 0.9 + 0.2 * u) * save_s;
      // Wait for the instant, or for the save to end first: then its time is the window for the
      // next trials (a machine whose load changes changes how long a save takes).
      pollfd done{pipe_fds[0], POLLIN, 0};
      if (::poll(&done, 1, static_cast<int>(delay_s * 1000)) == 1) {
        save_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - save_start).count();
      }
      ::kill(child, SIGKILL);
    }
    const bool saved = ::read(pipe_fds[0], &byte, 1) == 1;
    if (trial == 0) {
      save_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - save_start).count();
    }
    ::close(pipe_fds[0]);
    const int child_rc = wait_exit(child);
    // A child that did not reach its save could not load what the previous trial left.
    ASSERT_TRUE(saving) << "trial " << trial << ": a fresh process could not load latest, or "
                        << "failed before saving (exit " << child_rc << ")";
    if (trial == 0) {
      ASSERT_EQ(child_rc, 0) << "the first save failed";
      std::printf("trial 0: save took %.3f s\n", save_s);
    }
    std::int64_t new_step = 0;
    std::uint64_t new_hash = 0;
    std::istringstream(engine_test::read_file(work + "/expect")) >> new_step >> new_hash;
    ASSERT_GT(new_step, 0);
    if (trial > 0) {
      // This child loaded what the previous trial left, then stepped to new_step.
      std::int64_t step = -1;
      std::uint64_t hash = 0;
      std::istringstream(engine_test::read_file(work + "/loaded")) >> step >> hash;
      ASSERT_EQ(step + 1, new_step) << "trial " << trial << ": the loaded step";
      judge(step, hash, new_hash);
      if (::testing::Test::HasFatalFailure()) return;
    }
    if (hash_at.count(new_step) != 0) {
      EXPECT_EQ(hash_at[new_step], new_hash) << "step " << new_step << " computed differently";
    }
    hash_at[new_step] = new_hash;
    pending = Pending{trial,    delay_s, trial > 0 ? delay_s / save_s : 0, saved && trial > 0,
                      new_step, new_hash};
    if (trial > 0 && saved) ++finished;
  }
  // The last trial's outcome, from a process that only loads and steps.
  std::filesystem::remove_all(work + "/nvme-verify");
  std::filesystem::create_directories(work + "/nvme-verify");
  const pid_t verifier = spawn("verify", ckpt, work, params, -1);
  ASSERT_GT(verifier, 0);
  const int verify_rc = wait_exit(verifier);
  ASSERT_EQ(verify_rc, 0) << "trial " << pending.trial << ": a fresh process could not load latest";
  std::int64_t step = 0;
  std::uint64_t hash = 0, after = 0;
  std::istringstream(engine_test::read_file(work + "/verified")) >> step >> hash >> after;
  judge(step, hash, after);
  std::printf(
      "kill test distribution over %d killed trials: %d loaded the previous checkpoint, %d the "
      "new one (%d of the kills came after the save had returned); 0 failed to load, 0 mixed\n",
      trials, previous, fresh, finished);
  EXPECT_EQ(previous + fresh, trials);
}

}  // namespace zinf::engine_test
