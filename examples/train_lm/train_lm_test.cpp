// Tests of train_lm's parts: the backward pass against finite differences, the data split and
// batches, the option parsing, the CSV and SVG files, and the program's errors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <tbb/info.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "data.hpp"
#include "gemm.hpp"
#include "model.hpp"
#include "options.hpp"
#include "report.hpp"
#include "rng.hpp"
#include "trainer.hpp"

namespace train_lm {
namespace {

namespace fs = std::filesystem;

// All parameters of a model in one vector, handed to the model module by module.
class FlatParams final : public ParamAccess {
 public:
  FlatParams(const ModelShape& shape, std::uint64_t seed) : specs_(module_specs(shape)) {
    for (const ModuleSpec& spec : specs_) {
      offsets_.push_back(params_.size());
      params_.resize(params_.size() + spec.param_count());
    }
    grads_.assign(params_.size(), 0.0f);
    for (std::size_t m = 0; m < specs_.size(); ++m)
      init_module(shape, m, seed, &params_[offsets_[m]]);
  }
  const float* acquire(std::size_t m) override {
    EXPECT_FALSE(held_ || writing_) << "module " << m;  // one thing at a time (see ParamAccess)
    held_ = true;
    ++acquired_;
    return &params_[offsets_[m]];
  }
  void release(std::size_t) override {
    held_ = false;
    ++released_;
  }
  float* gradient_buffer(std::size_t m) override {
    EXPECT_FALSE(held_ || writing_) << "module " << m;
    writing_ = true;
    return &grads_[offsets_[m]];
  }
  void gradient_ready(std::size_t m) override {
    writing_ = false;
    ready_order_.push_back(m);
  }
  bool held_ = false, writing_ = false;

  std::vector<float> params_, grads_;
  std::vector<std::size_t> offsets_;
  std::vector<std::size_t> ready_order_;
  int acquired_ = 0, released_ = 0;

 private:
  std::vector<ModuleSpec> specs_;
};

// A linear layer's operands, seeded normal values: x [rows][in], w [in][out], b [out] and
// dy [rows][out].
struct Operands {
  std::vector<float> x, w, b, dy;
};
Operands random_operands(std::uint64_t seed, std::size_t rows, std::size_t in, std::size_t out) {
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  Rng rng(seed);
  Operands o{std::vector<float>(rows * in), std::vector<float>(in * out), std::vector<float>(out),
             std::vector<float>(rows * out)};
  for (std::vector<float>* v : {&o.x, &o.w, &o.b, &o.dy}) {
    for (float& e : *v) e = rng.normal();
  }
  return o;
}

TEST(Gemm, MatchesNaiveProductsOnRandomData) {
  // Odd sizes, so every remainder path runs.
  const std::size_t rows = 37, in = 29, out = 301;
  const auto [x, w, b, dy] = random_operands(11, rows, in, out);
  std::vector<float> y(rows * out), dx(rows * in), dw(in * out, 7.0f), db(out, 7.0f);
  linear_forward(x.data(), w.data(), b.data(), y.data(), rows, in, out);
  linear_backward_input(dy.data(), w.data(), dx.data(), rows, in, out);
  linear_backward_weight(x.data(), dy.data(), dw.data(), db.data(), rows, in, out);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t o = 0; o < out; ++o) {
      double ref = b[o];
      for (std::size_t i = 0; i < in; ++i) ref += double(x[r * in + i]) * w[i * out + o];
      ASSERT_NEAR(y[r * out + o], ref, 1e-4 + 1e-5 * std::fabs(ref)) << r << "," << o;
    }
    for (std::size_t i = 0; i < in; ++i) {
      double ref = 0;
      for (std::size_t o = 0; o < out; ++o) ref += double(dy[r * out + o]) * w[i * out + o];
      ASSERT_NEAR(dx[r * in + i], ref, 1e-3 + 1e-5 * std::fabs(ref)) << r << "," << i;
    }
  }
  for (std::size_t i = 0; i < in; ++i) {
    for (std::size_t o = 0; o < out; ++o) {
      double ref = 0;
      for (std::size_t r = 0; r < rows; ++r) ref += double(x[r * in + i]) * dy[r * out + o];
      ASSERT_NEAR(dw[i * out + o], ref, 1e-3 + 1e-5 * std::fabs(ref)) << i << "," << o;
    }
  }
  for (std::size_t o = 0; o < out; ++o) {
    double ref = 0;
    for (std::size_t r = 0; r < rows; ++r) ref += dy[r * out + o];
    ASSERT_NEAR(db[o], ref, 1e-4 + 1e-5 * std::fabs(ref));
  }
}

// Every output element is summed by one task in a fixed order, so one thread and two give the
// same bits (two runs of train_lm with the same seed train the same model whatever the number of
// threads, on machines that pick the same build of the kernels: AVX2 with FMA, or the baseline).
TEST(Gemm, OneThreadAndTwoGiveTheSameBits) {
  if (tbb::info::default_concurrency() < 2) GTEST_SKIP() << "one CPU: no second thread to compare";
  // Several tasks' worth of columns and rows (the kernels split W's columns or rows), with
  // remainders past the register tiles.
  const std::size_t rows = 131, in = 83, out = 1043;
  const auto [x, w, b, dy] = random_operands(12, rows, in, out);
  struct Out {
    std::vector<float> y, dx, dw, db;
  };
  const auto run = [&](int threads) {
    Out o{std::vector<float>(rows * out), std::vector<float>(rows * in),
          std::vector<float>(in * out), std::vector<float>(out)};
    tbb::task_arena arena(threads);
    arena.execute([&] {
      linear_forward(x.data(), w.data(), b.data(), o.y.data(), rows, in, out);
      linear_backward_input(dy.data(), w.data(), o.dx.data(), rows, in, out);
      linear_backward_weight(x.data(), dy.data(), o.dw.data(), o.db.data(), rows, in, out);
    });
    return o;
  };
  const Out one = run(1), two = run(2);
  const auto same = [](const std::vector<float>& a, const std::vector<float>& c) {
    return std::memcmp(a.data(), c.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same(one.y, two.y));
  EXPECT_TRUE(same(one.dx, two.dx));
  EXPECT_TRUE(same(one.dw, two.dw));
  EXPECT_TRUE(same(one.db, two.db));
}

// Central differences in double around fp32 parameters: d loss / d p ~ (L(p+h) - L(p-h)) / 2h.
TEST(Model, BackwardMatchesFiniteDifferences) {
  const std::uint64_t seed = 5;
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  ModelShape shape;
  shape.context_bytes = 3;
  shape.embed_dim = 4;
  shape.hidden = 16;
  shape.ffn = 24;
  shape.blocks = 2;
  const std::size_t tokens = 6;
  Rng rng(seed);
  std::vector<std::uint8_t> contexts(tokens * shape.context_bytes), targets(tokens);
  for (auto& c : contexts) c = std::uint8_t(rng.below(8));  // few bytes: embedding rows repeat
  for (auto& t : targets) t = std::uint8_t(rng.below(256));
  FlatParams params(shape, seed);
  // Biases start at 0 and the output weights small; perturb everything so every path carries
  // gradient (a zero bias would hide a wrong sign in its gradient's use downstream).
  for (float& p : params.params_) p += 0.3f * rng.normal();

  Model model(shape, tokens);
  const float scale = 1.0f / float(tokens);
  model.forward(contexts.data(), targets.data(), tokens, params);
  model.backward(scale, params);
  const std::size_t modules = module_specs(shape).size();
  // Gradients arrive in reverse module order, once each.
  ASSERT_EQ(params.ready_order_.size(), modules);
  for (std::size_t i = 0; i < modules; ++i) EXPECT_EQ(params.ready_order_[i], modules - 1 - i);
  EXPECT_EQ(params.acquired_, params.released_);

  auto loss_at = [&](std::size_t index, float value) {
    const float saved = params.params_[index];
    params.params_[index] = value;
    const double loss = model.forward(contexts.data(), targets.data(), tokens, params) * scale;
    params.params_[index] = saved;
    return loss;
  };
  // Every parameter of the small modules and a random sample of the rest.
  int checked = 0;
  double worst = 0;
  for (std::size_t index = 0; index < params.params_.size(); ++index) {
    if (params.params_.size() > 2000 && rng.below(4) != 0) continue;
    const float p = params.params_[index];
    const float h = 1e-2f * std::max(1.0f, std::fabs(p));
    const double numeric = (loss_at(index, p + h) - loss_at(index, p - h)) / (2.0 * double(h));
    const double analytic = params.grads_[index];
    const double err =
        std::fabs(numeric - analytic) / std::max(1e-2, std::fabs(numeric) + std::fabs(analytic));
    worst = std::max(worst, err);
    ASSERT_LT(err, 2e-2) << "parameter " << index << " numeric " << numeric << " analytic "
                         << analytic;
    ++checked;
  }
  std::printf("checked %d parameters, worst relative error %.2e\n", checked, worst);
  EXPECT_GT(checked, 500);
}

TEST(Model, FirstLossIsCloseToUniform) {
  ModelShape shape;
  Rng rng(3);
  const std::size_t tokens = 256;
  std::vector<std::uint8_t> contexts(tokens * shape.context_bytes), targets(tokens);
  for (auto& c : contexts) c = std::uint8_t(rng.below(256));
  for (auto& t : targets) t = std::uint8_t(rng.below(256));
  FlatParams params(shape, 3);
  Model model(shape, tokens);
  const double loss = model.forward(contexts.data(), targets.data(), tokens, params) / tokens;
  EXPECT_NEAR(loss, std::log(256.0), 0.3);
}

TEST(Model, ShapeForParamsLandsNearTheTarget) {
  ModelShape base;
  for (std::uint64_t target : {1'000'000ull, 10'000'000ull, 1'000'000'000ull}) {
    const ModelShape shape = shape_for_params(target, base);
    const double ratio = double(param_count(shape)) / double(target);
    EXPECT_NEAR(ratio, 1.0, 0.1) << target;
    EXPECT_EQ(shape.hidden % 16, 0u);
    EXPECT_EQ(shape.ffn, 4 * shape.hidden);
  }
}

// --gradients-on-nvme puts each rank's f32 gradient accumulators in its swap file beside the
// master and moments, so the disk check asks for their 4 bytes a parameter of the rank's slice
// too (each sub-group's page-rounded, each file rounded up to an aio block); the activations'
// files are unchanged.
// docs/BENCHMARKS.md has the estimate against the file the engine makes.
TEST(Footprint, GradientsOnNvmeAddTheirBytesToTheSwapFiles) {
  const ModelShape shape = shape_for_params(10'000'000, ModelShape{});
  for (const int world : {1, 4}) {
    SCOPED_TRACE(world);
    // Stage 3, the optimizer's state on NVMe (the defaults), as train_lm parses them.
    std::vector<std::string> args = {"train_lm", "--world-size", std::to_string(world)};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    Options o;
    std::string error;
    ASSERT_EQ(parse_options(int(argv.size()), argv.data(), &o, &error), 0) << error;
    const Footprint without = estimate_footprint(o, shape);
    o.gradients_on_nvme = true;
    const Footprint with = estimate_footprint(o, shape);
    const std::uint64_t ranks = std::uint64_t(world);
    const std::uint64_t slice = (param_count(shape) + ranks - 1) / ranks;
    const std::uint64_t block = std::uint64_t{1} << 20;
    // 12 bytes a parameter without (the master and two moments), 16 with.
    EXPECT_GE(without.swap_bytes, ranks * 12 * slice);
    EXPECT_LE(without.swap_bytes, ranks * (12 * slice + 2 * block));
    EXPECT_GE(with.swap_bytes, ranks * 16 * slice);
    EXPECT_LE(with.swap_bytes, ranks * (16 * slice + 2 * block));
    EXPECT_EQ(with.nvme_bytes - with.swap_bytes, without.nvme_bytes - without.swap_bytes);
  }
}

TEST(Data, SplitsTrainAndValidationAndBatchesAreSeeded) {
  std::string text(100000, ' ');
  Rng fill(9);
  for (char& c : text) c = char('a' + fill.below(26));
  Corpus corpus;
  corpus.assign(text);
  EXPECT_EQ(corpus.split_offset(), 90000u);
  TokenBatch a, b;
  Rng r1(4), r2(4);
  corpus.sample_train(r1, 8, 32, 5, &a);
  corpus.sample_train(r2, 8, 32, 5, &b);
  EXPECT_EQ(a.contexts, b.contexts);
  EXPECT_EQ(a.targets, b.targets);
  ASSERT_EQ(a.token_count(), 8u * 32u);
  // Each target's context is the 5 bytes before it in the text, all in the train split.
  for (std::size_t t = 0; t < a.token_count(); ++t) {
    const std::string ctx(a.contexts.begin() + long(t * 5), a.contexts.begin() + long(t * 5 + 5));
    const std::string window = ctx + char(a.targets[t]);
    const std::size_t at = text.find(window);
    ASSERT_NE(at, std::string::npos);
    EXPECT_LT(at + 5, corpus.split_offset());
  }
  TokenBatch val;
  corpus.validation_batch(1000, 5, &val);
  ASSERT_EQ(val.token_count(), 1000u);
  // Validation targets come from the validation split.
  for (std::size_t t = 0; t < val.token_count(); t += 97) {
    const std::string window =
        std::string(val.contexts.begin() + long(t * 5), val.contexts.begin() + long(t * 5 + 5)) +
        char(val.targets[t]);
    EXPECT_GE(text.rfind(window) + 5, corpus.split_offset());
  }
}

TEST(Options, ParsesSizesAndRejectsBadValues) {
  std::uint64_t value = 0;
  EXPECT_TRUE(parse_count("10M", &value));
  EXPECT_EQ(value, 10'000'000u);
  EXPECT_TRUE(parse_count("1B", &value));
  EXPECT_EQ(value, 1'000'000'000u);
  EXPECT_TRUE(parse_count("1.5k", &value));
  EXPECT_EQ(value, 1500u);
  EXPECT_FALSE(parse_count("ten", &value));
  EXPECT_FALSE(parse_count("10X", &value));
  EXPECT_TRUE(parse_bytes("4GiB", &value));
  EXPECT_EQ(value, std::uint64_t{4} << 30);
  EXPECT_TRUE(parse_bytes("512M", &value));
  EXPECT_EQ(value, std::uint64_t{512} << 20);

  auto parse = [](std::vector<std::string> args, Options* o, std::string* error) {
    args.insert(args.begin(), "train_lm");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return parse_options(int(argv.size()), argv.data(), o, error);
  };
  Options o;
  std::string error;
  ASSERT_EQ(
      parse({"--params", "10M", "--world-size", "4", "--stage", "3", "--offload-param", "cpu"}, &o,
            &error),
      0)
      << error;
  EXPECT_EQ(o.params, 10'000'000u);
  EXPECT_EQ(o.world_size, 4);
  EXPECT_EQ(o.offload_param, "cpu");
  for (const auto& bad :
       std::vector<std::vector<std::string>>{{"--bogus"},
                                             {"--params", "lots"},
                                             {"--stage", "4"},
                                             {"--offload-optimizer", "tape"},
                                             {"--batch", "30", "--world-size", "4"},
                                             {"--stage", "2", "--offload-param", "cpu"},
                                             {"--device", "tpu"},
                                             {"--device", "opaque", "--engine", "off"},
                                             {"--device", "cuda", "--world-size", "2"},
                                             {"--comm", "tcp"},
                                             {"--comm", "nccl", "--device", "host"},
                                             {"--comm", "mpi", "--engine", "off"}}) {
    Options fresh;
    error.clear();
    EXPECT_EQ(parse(bad, &fresh, &error), 2) << bad[0];
    EXPECT_FALSE(error.empty());
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
    // The error names the option at fault.
    EXPECT_NE(error.find(bad[0]), std::string::npos) << error;
  }
  // More than one GPU rank is refused naming both options.
  Options cuda;
  ASSERT_EQ(parse({"--device", "cuda", "--world-size", "2"}, &cuda, &error), 2);
  EXPECT_NE(error.find("--device cuda"), std::string::npos) << error;
  EXPECT_NE(error.find("--world-size 2"), std::string::npos) << error;
  Options opaque;
  ASSERT_EQ(parse({"--device", "opaque"}, &opaque, &error), 0) << error;
  EXPECT_EQ(opaque.device, "opaque");
  Options defaults;
  EXPECT_EQ(defaults.device, "host");
  EXPECT_EQ(defaults.comm, "local");
  // One process per rank takes the launcher's world size (1 outside a launcher); a different
  // --world-size is refused naming both.
  if (launcher_world_size("mpi") == 1) {
    Options mpi;
    ASSERT_EQ(parse({"--comm", "mpi"}, &mpi, &error), 0) << error;
    EXPECT_EQ(mpi.world_size, 1);
    ASSERT_EQ(parse({"--comm", "mpi", "--world-size", "2"}, &mpi, &error), 2);
    EXPECT_NE(error.find("--world-size 2 but the launcher started 1"), std::string::npos) << error;
  }
}

// With --comm mpi the launcher's variables give the world size, but an explicit --world-size wins
// over them (one left from another launch, PMI_SIZE around a program started without a launcher,
// is a guess, not the job): the communicator checks the figure when it opens. A batch
// allocation's SLURM_NTASKS is no launcher's: without srun (SLURM_STEP_NUM_TASKS) the program is
// one process.
TEST(Options, WorldSizeGivenWinsOverTheLaunchersVariables) {
  for (const char* name :
       {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS"}) {
    if (std::getenv(name) != nullptr) GTEST_SKIP() << name << " is set: run under a launcher";
  }
  // A batch job's own SLURM_NTASKS (sbatch without srun: the case at hand) is set back after.
  const char* allocation_tasks = std::getenv("SLURM_NTASKS");
  const std::optional<std::string> saved_tasks =
      allocation_tasks != nullptr ? std::optional<std::string>(allocation_tasks) : std::nullopt;
  auto parse = [](std::vector<std::string> args, Options* o, std::string* error) {
    args.insert(args.begin(), "train_lm");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return parse_options(int(argv.size()), argv.data(), o, error);
  };
  // Parses `args` in the environment as it is now: the world size and where it came from.
  struct Parsed {
    int rc = 0;
    std::string error;
    Options options;
  };
  auto parse_now = [&](std::vector<std::string> args) {
    Parsed p;
    p.rc = parse(std::move(args), &p.options, &p.error);
    return p;
  };
  setenv("PMI_SIZE", "4", 1);
  const Parsed given = parse_now({"--comm", "mpi", "--world-size", "1"});
  const Parsed guessed = parse_now({"--comm", "mpi"});
  unsetenv("PMI_SIZE");
  setenv("SLURM_NTASKS", "4", 1);
  const Parsed allocation = parse_now({"--comm", "mpi"});
  setenv("SLURM_STEP_NUM_TASKS", "4", 1);
  const Parsed stepped = parse_now({"--comm", "mpi"});
  unsetenv("SLURM_STEP_NUM_TASKS");
  if (saved_tasks.has_value()) {
    setenv("SLURM_NTASKS", saved_tasks->c_str(), 1);
  } else {
    unsetenv("SLURM_NTASKS");
  }
  const std::pair<const Parsed*, std::pair<int, const char*>> expected[] = {
      {&given, {1, "--world-size"}},
      {&guessed, {4, "PMI_SIZE=4"}},
      {&allocation, {1, ""}},
      {&stepped, {4, "SLURM_STEP_NUM_TASKS=4"}},
  };
  for (const auto& [parsed, want] : expected) {
    SCOPED_TRACE(want.second);
    ASSERT_EQ(parsed->rc, 0) << parsed->error;
    EXPECT_EQ(parsed->options.world_size, want.first);
    EXPECT_EQ(parsed->options.world_size_from, want.second);
  }
}

// mpirun -np 2 train_lm without --comm mpi would run two separate one-rank jobs: refused, naming
// the launcher's variable and --comm mpi. Set by hand here, as mpirun sets it.
TEST(Options, SeveralProcessesOfALauncherWithLocalCommAreRefused) {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"}) {
    if (std::getenv(name) != nullptr) GTEST_SKIP() << name << " is set: run under a launcher";
  }
  auto parse = [](std::vector<std::string> args, Options* o, std::string* error) {
    args.insert(args.begin(), "train_lm");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return parse_options(int(argv.size()), argv.data(), o, error);
  };
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    SCOPED_TRACE(name);
    setenv(name, "2", 1);
    Options local, explicit_local, one_process, mpi;
    std::string local_error, explicit_error, one_error, mpi_error;
    const int local_rc = parse({}, &local, &local_error);
    const int explicit_rc =
        parse({"--comm", "local", "--world-size", "2"}, &explicit_local, &explicit_error);
    const int mpi_rc = parse({"--comm", "mpi"}, &mpi, &mpi_error);
    // Without the engine the advice names it too (--comm mpi needs --engine on).
    Options no_engine;
    std::string no_engine_error;
    const int no_engine_rc = parse({"--engine", "off"}, &no_engine, &no_engine_error);
    setenv(name, "1", 1);
    const int one_rc = parse({}, &one_process, &one_error);
    unsetenv(name);
    EXPECT_EQ(local_rc, 2);
    EXPECT_NE(local_error.find(std::string("started as one of 2 processes by a launcher (") + name +
                               "=2)"),
              std::string::npos)
        << local_error;
    EXPECT_NE(local_error.find("pass --comm mpi for one rank per process"), std::string::npos)
        << local_error;
    EXPECT_EQ(no_engine_rc, 2);
    EXPECT_NE(no_engine_error.find("pass --comm mpi and --engine on for one rank per process"),
              std::string::npos)
        << no_engine_error;
    EXPECT_EQ(explicit_rc, 2) << explicit_error;
    EXPECT_EQ(explicit_error, local_error);
    // One rank per process is what the launcher asked for; a launcher of one process is no job
    // of several.
    ASSERT_EQ(mpi_rc, 0) << mpi_error;
    EXPECT_EQ(mpi.world_size, 2);
    EXPECT_EQ(one_rc, 0) << one_error;
  }
}

// Sets (or, given null, unsets) an environment variable for a scope, restoring what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

// srun -n 2 train_lm (SLURM_STEP_NUM_TASKS=2, no MPI variables without an MPI plugin) and
// torchrun --nproc_per_node 2 train_lm (WORLD_SIZE=2 and RANK only) with --comm local would each
// run separate one-rank jobs: refused, naming the variables and what to pass instead. torchrun's
// own mode, --device cuda, runs --comm nccl and is not refused; one process of either is no job
// of several, and a batch allocation's SLURM_NTASKS alone is no srun.
TEST(Options, SrunOrTorchrunProcessesWithLocalCommAreRefused) {
  std::vector<std::unique_ptr<ScopedEnv>> clean;
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS",
                           "SLURM_STEP_NUM_TASKS", "WORLD_SIZE", "RANK"}) {
    clean.push_back(std::make_unique<ScopedEnv>(name, nullptr));
  }
  auto parse = [](std::vector<std::string> args, Options* o, std::string* error) {
    args.insert(args.begin(), "train_lm");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return parse_options(int(argv.size()), argv.data(), o, error);
  };
  Options o;
  std::string error;
  {
    ScopedEnv tasks("SLURM_STEP_NUM_TASKS", "2");
    EXPECT_EQ(parse({}, &o, &error), 2);
    EXPECT_NE(error.find("started as one of 2 processes by a launcher (SLURM_STEP_NUM_TASKS=2) "
                         "with --comm local"),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("pass --comm mpi"), std::string::npos) << error;
    EXPECT_EQ(parse({"--comm", "local", "--world-size", "2"}, &o, &error), 2) << error;
  }
  {
    ScopedEnv tasks("SLURM_STEP_NUM_TASKS", "1");
    ScopedEnv allocation("SLURM_NTASKS", "4");
    EXPECT_EQ(parse({}, &o, &error), 0) << error;
  }
  {
    ScopedEnv world("WORLD_SIZE", "2");
    ScopedEnv rank("RANK", "1");
    EXPECT_EQ(parse({}, &o, &error), 2);
    EXPECT_NE(error.find("started as one of 2 processes by torchrun (WORLD_SIZE=2, RANK=1) with "
                         "--comm local"),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("pass --device cuda (--comm nccl"), std::string::npos) << error;
    EXPECT_NE(error.find("mpirun and --comm mpi"), std::string::npos) << error;
    EXPECT_EQ(parse({"--comm", "local", "--world-size", "2"}, &o, &error), 2) << error;
    // The GPU mode torchrun starts: one NCCL rank per process, the world torchrun's.
    Options gpu;
    ASSERT_EQ(parse({"--device", "cuda"}, &gpu, &error), 0) << error;
    EXPECT_EQ(gpu.comm, "nccl");
    EXPECT_EQ(gpu.world_size, 2);
    EXPECT_EQ(gpu.world_size_from, "WORLD_SIZE=2");
  }
  {
    ScopedEnv world("WORLD_SIZE", "1");
    ScopedEnv rank("RANK", "0");
    EXPECT_EQ(parse({}, &o, &error), 0) << error;
  }
  {
    // WORLD_SIZE without RANK is not torchrun's.
    ScopedEnv world("WORLD_SIZE", "2");
    EXPECT_EQ(parse({}, &o, &error), 0) << error;
  }
}

// The options every rank of a job must share: those that shape the training are in the text, a
// rank's own paths and budgets are not, and the first that differs is named with both values.
TEST(Options, RanksCompareTheOptionsThatShapeTheTraining) {
  Options a;
  Options b = a;
  b.nvme_path = "/local/nvme";
  b.out_dir = "elsewhere";
  b.data_path = "/copy/of/the/text";
  b.host_memory_bytes = 1 << 30;
  b.collective_timeout_ms = 5000;
  b.quiet = true;
  EXPECT_EQ(options_every_rank_shares(a), options_every_rank_shares(b));
  EXPECT_EQ(
      first_option_ranks_disagree_on({options_every_rank_shares(a), options_every_rank_shares(b)}),
      "");
  b.seed = 2;
  b.steps = 10;  // --steps comes first in the usage text, so it is the one named
  const std::string message = first_option_ranks_disagree_on(
      {options_every_rank_shares(a), options_every_rank_shares(a), options_every_rank_shares(b)});
  EXPECT_EQ(message,
            "--steps differs between the ranks: rank 0 has 400, rank 2 has 10 (every rank of a "
            "job must be given the same --steps)");
  Options c = a;
  c.lr = 0.001;
  EXPECT_NE(
      first_option_ranks_disagree_on({options_every_rank_shares(a), options_every_rank_shares(c)})
          .find("--lr differs between the ranks: rank 0 has 0.003, rank 1 has 0.001"),
      std::string::npos);
  // Lines a caller adds (the training text's fingerprint) are compared as well.
  EXPECT_NE(first_option_ranks_disagree_on({"--seed 1\n--data x\n", "--seed 1\n--data y\n"})
                .find("--data differs"),
            std::string::npos);
}

// The schedule: --lr/--warmup/--steps as DeepSpeed's WarmupCosineLR built at iteration -1 (step k
// at iteration k - 2: linear warm-up from 0, cosine towards 10%), or a --config file's scheduler
// section in its place.
TEST(Options, ScheduleComesFromTheFlagsOrTheConfigsSchedulerSection) {
  auto parse = [](std::vector<std::string> args, Options* o, std::string* error) {
    args.insert(args.begin(), "train_lm");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return parse_options(int(argv.size()), argv.data(), o, error);
  };
  // The rate train_lm runs step k at (without the engine; the engine's own indexing is tested
  // in tests/engine/config_schedule_test.cpp).
  auto lr_of_step = [](const Options& o, std::int64_t k) { return plain_learning_rate(o, k); };
  Options flags;
  std::string error;
  ASSERT_EQ(parse({"--lr", "2e-3", "--warmup", "10", "--steps", "110"}, &flags, &error), 0)
      << error;
  EXPECT_EQ(flags.schedule.kind, zinf::ScheduleKind::kWarmupCosineLR);
  EXPECT_EQ(flags.schedule.last_batch_iteration, -1);
  EXPECT_EQ(lr_of_step(flags, 1), 0.0);
  EXPECT_EQ(lr_of_step(flags, 2), 0.0);
  EXPECT_NEAR(lr_of_step(flags, 7), 2e-3 * 5.0 / 10.0, 1e-18);
  // The cosine's middle, iteration 60: p = (60 - 10 + 1) / 100 = 0.51.
  EXPECT_NEAR(lr_of_step(flags, 62),
              2e-3 * (0.1 + 0.9 * (1.0 + std::cos(3.141592653589793 * 0.51)) / 2.0), 1e-17);
  EXPECT_NEAR(lr_of_step(flags, 112), 2e-3 * 0.1, 1e-18);

  const fs::path dir =
      fs::path(std::getenv("ZINF_TEST_TMPDIR") ? std::getenv("ZINF_TEST_TMPDIR") : "/tmp") /
      "train_lm_schedule";
  fs::create_directories(dir);
  auto write = [&](const char* name, const char* text) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  const std::string decay = write("decay.json", R"({"scheduler": {"type": "WarmupDecayLR",
      "params": {"total_num_steps": 100, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
                 "warmup_type": "linear"}}})");
  Options from_config;
  ASSERT_EQ(parse({"--config", decay, "--lr", "2e-3"}, &from_config, &error), 0) << error;
  EXPECT_EQ(from_config.schedule.kind, zinf::ScheduleKind::kWarmupDecayLR);
  // DeepSpeed's indexing: steps 1 and 2 at warmup_min_lr (0), step k at 1e-3 * (k - 2) / 10.
  EXPECT_EQ(lr_of_step(from_config, 1), 0.0);
  EXPECT_NEAR(lr_of_step(from_config, 7), 1e-3 * 5.0 / 10.0, 1e-18);
  EXPECT_NEAR(lr_of_step(from_config, 57), 1e-3 * (100.0 - 55.0) / 90.0, 1e-18);

  // A schedule resumed at last_batch_iteration 4: step 1 at the optimizer's own lr (--lr),
  // step k at lr_at(4 + k - 1), as DeepSpeed's schedulers built at an iteration >= 0 do.
  const std::string resumed = write("resumed.json", R"({"scheduler": {"type": "WarmupLR",
      "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
                 "warmup_type": "linear", "last_batch_iteration": 4}}})");
  Options from_resumed;
  ASSERT_EQ(parse({"--config", resumed, "--lr", "2e-3"}, &from_resumed, &error), 0) << error;
  EXPECT_EQ(lr_of_step(from_resumed, 1), 2e-3);
  EXPECT_NEAR(lr_of_step(from_resumed, 2), 1e-3 * 5.0 / 10.0, 1e-18);
  EXPECT_NEAR(lr_of_step(from_resumed, 4), 1e-3 * 7.0 / 10.0, 1e-18);

  // A config without a scheduler section keeps the flags' schedule.
  const std::string none = write("none.json", R"({"zero_optimization": {"stage": 3}})");
  Options no_section;
  ASSERT_EQ(parse({"--config", none}, &no_section, &error), 0) << error;
  EXPECT_EQ(no_section.schedule.kind, zinf::ScheduleKind::kWarmupCosineLR);

  // A type zinf does not have, and a missing file: one line naming --config and the key or path.
  const std::string range = write("range.json", R"({"scheduler": {"type": "LRRangeTest"}})");
  Options bad;
  ASSERT_EQ(parse({"--config", range}, &bad, &error), 2);
  EXPECT_NE(error.find("--config: "), std::string::npos) << error;
  EXPECT_NE(error.find("scheduler.type"), std::string::npos) << error;
  ASSERT_EQ(parse({"--config", (dir / "missing.json").string()}, &bad, &error), 2);
  EXPECT_NE(error.find("missing.json"), std::string::npos) << error;
}

TEST(Report, CsvHasTheHeaderAndEmptyValidationCells) {
  const fs::path dir =
      fs::path(std::getenv("ZINF_TEST_TMPDIR") ? std::getenv("ZINF_TEST_TMPDIR") : "/tmp") /
      "train_lm_report";
  fs::create_directories(dir);
  std::vector<CurvePoint> points = {{1, 5.5, std::nullopt, 1000}, {2, 4.25, 4.5, 1200.5}};
  std::string error;
  ASSERT_TRUE(write_curve_csv((dir / "loss.csv").string(), points, &error)) << error;
  std::ifstream csv(dir / "loss.csv");
  std::string header, first, second;
  std::getline(csv, header);
  std::getline(csv, first);
  std::getline(csv, second);
  EXPECT_EQ(header, "step,train_loss,val_loss,tokens_per_s");
  EXPECT_EQ(first, "1,5.500000,,1000.0");
  EXPECT_EQ(second, "2,4.250000,4.500000,1200.5");
  ASSERT_TRUE(write_curve_svg((dir / "loss.svg").string(), points, "t", &error)) << error;
  std::ifstream svg(dir / "loss.svg");
  std::stringstream text;
  text << svg.rdbuf();
  EXPECT_NE(text.str().find("<svg"), std::string::npos);
  EXPECT_NE(text.str().find("</svg>"), std::string::npos);
  EXPECT_NE(text.str().find("<circle"), std::string::npos);  // the validation point
  fs::remove_all(dir);
}

std::string read_all(const fs::path& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

fs::path scratch_dir(const std::string& name) {
  const char* root = std::getenv("ZINF_TEST_TMPDIR");
  const fs::path dir = fs::path(root != nullptr ? root : "/tmp") / name;
  fs::remove_all(dir);
  fs::create_directories(dir.parent_path());
  return dir;
}

// Runs `program` with `args`; returns its exit code, its stderr and (when `out` is given) its
// stdout.
int run_command(const std::string& program, const std::string& args, std::string* err,
                std::string* out = nullptr) {
  const std::string stem = fs::temp_directory_path() / ("train_lm_" + std::to_string(getpid()));
  const std::string command = program + " " + args + " >" + stem + ".out 2>" + stem + ".err";
  const int status = std::system(command.c_str());
  *err = read_all(stem + ".err");
  if (out != nullptr) *out = read_all(stem + ".out");
  fs::remove(stem + ".err");
  fs::remove(stem + ".out");
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Runs train_lm.
int run_program(const std::string& args, std::string* err, std::string* out = nullptr) {
  return run_command(TRAIN_LM_BIN, args, err, out);
}

// The device activation peak train_lm prints in its summary (0 when missing).
double activation_peak(const std::string& out) {
  const std::size_t at = out.rfind("activation_device_bytes_peak=");
  return at == std::string::npos ? 0.0 : std::stod(out.substr(at + 29));
}

double final_val_loss(const std::string& out) {
  const std::size_t at = out.rfind("final_val_loss=");
  return at == std::string::npos ? -1.0 : std::stod(out.substr(at + 15));
}

// The validation loss loss.csv in `out_dir` holds for `step` (NaN when that row has none).
double csv_val_loss(const fs::path& out_dir, std::int64_t step) {
  std::istringstream lines(read_all(out_dir / "loss.csv"));
  std::string line;
  while (std::getline(lines, line)) {
    const std::size_t c1 = line.find(','), c2 = line.find(',', c1 + 1);
    if (line.substr(0, c1) != std::to_string(step)) continue;
    const std::string cell = line.substr(c2 + 1, line.find(',', c2 + 1) - c2 - 1);
    return cell.empty() ? std::nan("") : std::stod(cell);
  }
  return std::nan("");
}

// A small model for a few steps, through the engine with the optimizer state on NVMe: the loss
// falls and the curve files are written as documented.
TEST(Program, TrainsThroughTheEngineAndWritesTheCurve) {
  const fs::path dir = scratch_dir("train_lm_run");
  std::string err, out;
  ASSERT_EQ(run_program("--params 60k --steps 40 --batch 8 --seq-len 32 --eval-every 20 --lr 1e-2 "
                        "--no-progress --out " +
                            (dir / "out").string() + " --nvme-path " + (dir / "nvme").string(),
                        &err, &out),
            0)
      << err;
  const double final_loss = final_val_loss(out);
  EXPECT_GT(final_loss, 0.5) << out;
  EXPECT_LT(final_loss, 4.0) << out;  // from ln 256 = 5.55
  std::istringstream lines(read_all(dir / "out" / "loss.csv"));
  std::string line;
  std::getline(lines, line);
  EXPECT_EQ(line, "step,train_loss,val_loss,tokens_per_s");
  int rows = 0, with_val = 0;
  while (std::getline(lines, line)) {
    ++rows;
    // step,train,val,tok/s: the val cell is empty unless the step validated (20 and 40).
    const std::size_t c1 = line.find(','), c2 = line.find(',', c1 + 1);
    const bool has_val = line.find(',', c2 + 1) != c2 + 1;
    with_val += has_val ? 1 : 0;
    EXPECT_EQ(has_val, std::stoi(line.substr(0, c1)) % 20 == 0) << line;
  }
  EXPECT_EQ(rows, 40);
  EXPECT_EQ(with_val, 2);
  // --no-progress: no bar, and a line for each validation, with the loss.csv value.
  for (int step : {20, 40}) {
    const std::string prefix = "step " + std::to_string(step) + ": validation loss ";
    const std::size_t at = err.find(prefix);
    ASSERT_NE(at, std::string::npos) << prefix << "\n" << err;
    EXPECT_NEAR(std::stod(err.substr(at + prefix.size())), csv_val_loss(dir / "out", step), 5e-4);
  }
  EXPECT_NE(err.find("step 0: validation loss "), std::string::npos) << err;
  std::size_t lines_count = 0;
  for (std::size_t at = err.find(": validation loss "); at != std::string::npos;
       at = err.find(": validation loss ", at + 1)) {
    ++lines_count;
  }
  EXPECT_EQ(lines_count, 3u) << "a line for each validation (steps 0, 20 and 40):\n" << err;
  EXPECT_EQ(err.find("] step "), std::string::npos) << "a progress bar line:\n" << err;
  EXPECT_NE(read_all(dir / "out" / "loss.svg").find("</svg>"), std::string::npos);
  // The swap files were scratch: gone with the run, and the directory the run made for them.
  EXPECT_FALSE(fs::exists(dir / "nvme")) << "swap directory left behind";
  fs::remove_all(dir);
}

// The acceptance check at a small size: one rank with everything on the device, and four ranks
// at stage 3 with the optimizer state on NVMe and the parameters in host memory, end at the same
// loss (the same 4 gradient slices are added in the same order either way).
TEST(Program, OneRankAndFourRanksEndAtTheSameLoss) {
  const fs::path dir = scratch_dir("train_lm_equal");
  const std::string common =
      "--params 60k --steps 25 --batch 8 --seq-len 32 --eval-every 25 --seed 7 --no-progress ";
  std::string err, out1, out4;
  ASSERT_EQ(run_program(common + "--world-size 1 --stage 3 --offload-optimizer none --out " +
                            (dir / "one").string(),
                        &err, &out1),
            0)
      << err;
  ASSERT_EQ(run_program(common +
                            "--world-size 4 --stage 3 --offload-optimizer nvme --offload-param "
                            "cpu --out " +
                            (dir / "four").string() + " --nvme-path " + (dir / "nvme").string(),
                        &err, &out4),
            0)
      << err;
  const double one = final_val_loss(out1), four = final_val_loss(out4);
  std::printf("seed 7: world 1 %.6f, world 4 %.6f\n", one, four);
  EXPECT_GT(one, 0);
  EXPECT_NEAR(one, four, 1e-4);
  fs::remove_all(dir);
}

// The engine (fp32 parameters, stage 3, optimizer state on NVMe) against the program's own plain
// fp32 AdamW loop: the same training, so the same loss up to rounding (the engine's kernel uses
// fused multiply-adds).
TEST(Program, EngineMatchesThePlainLoop) {
  const fs::path dir = scratch_dir("train_lm_plain");
  const std::string common =
      "--params 60k --steps 20 --batch 8 --seq-len 32 --eval-every 20 --seed 3 --no-progress ";
  std::string err, plain, engine;
  ASSERT_EQ(run_program(common + "--engine off --out " + (dir / "plain").string(), &err, &plain), 0)
      << err;
  ASSERT_EQ(run_program(common + "--param-dtype f32 --offload-optimizer nvme --out " +
                            (dir / "engine").string() + " --nvme-path " + (dir / "nvme").string(),
                        &err, &engine),
            0)
      << err;
  std::printf("seed 3: plain %.6f, engine %.6f\n", final_val_loss(plain), final_val_loss(engine));
  EXPECT_NEAR(final_val_loss(plain), final_val_loss(engine), 1e-3);
  fs::remove_all(dir);
}

// The loss columns of a loss.csv (step, train_loss, val_loss), without the tokens/s column,
// which is a measured time.
std::vector<std::string> loss_rows(const fs::path& csv) {
  std::istringstream lines(read_all(csv));
  std::vector<std::string> rows;
  std::string line;
  while (std::getline(lines, line)) rows.push_back(line.substr(0, line.rfind(',')));
  return rows;
}

// Runs train_lm with `args` and --out `out_dir`, and returns its loss.csv rows: empty, with a
// failure naming the arguments and the program's stderr, when it does not exit 0. `out` (when
// given) gets its stdout.
std::vector<std::string> run_loss_rows(const std::string& args, const fs::path& out_dir,
                                       std::string* out = nullptr) {
  std::string err;
  const int rc = run_program(args + " --out " + out_dir.string(), &err, out);
  EXPECT_EQ(rc, 0) << args << ": " << err;
  return rc == 0 ? loss_rows(out_dir / "loss.csv") : std::vector<std::string>{};
}

// --save-every and --resume: a run stopped after step 120 (as if killed there) resumes from its
// step-100 checkpoint (keep_last 2 kept global_step50 and global_step100) and writes a loss.csv
// whose losses equal the uninterrupted run's, row for row (tokens/s is a measured time).
// A run that fails after a checkpoint (its next save finds the disk full) removes the --out
// directory it made, but not when that holds the checkpoint (the default --save-dir is inside it):
// the step-2 checkpoint is still there, whole, and loads; the run warned at its start that the
// checkpoints it keeps would not fit. Needs an 8 MiB tmpfs (root); skips without one.
TEST(Program, AFailedRunKeepsTheCheckpointsItSaved) {
  const fs::path dir = scratch_dir("train_lm_keep_ckpt");
  const fs::path small = dir / "small";
  fs::create_directories(small);
  const std::string mount = "mount -t tmpfs -o size=8m tmpfs " + small.string() + " 2>/dev/null";
  if (std::system(mount.c_str()) != 0) {
    GTEST_SKIP() << "cannot mount an 8 MiB tmpfs at " << small << " (needs root)";
  }
  const fs::path out = small / "o";
  std::string err, out_text;
  const int code = run_program(
      "--params 500k --steps 10 --batch 4 --seq-len 16 --eval-every 5 "
      "--eval-tokens 256 --no-progress --save-every 2 --out " +
          out.string() + " --nvme-path " + (dir / "nvme").string(),
      &err, &out_text);
  // A model whose one checkpoint does not fit is refused before anything is made.
  std::string big_err;
  const int big =
      run_program("--params 1M --steps 10 --batch 4 --seq-len 16 --save-every 2 --out " +
                      (small / "big").string(),
                  &big_err);
  const bool big_made = fs::exists(small / "big");
  const bool kept = fs::exists(out / "checkpoints" / "global_step2" / "manifest.json");
  const std::string latest = read_all(out / "checkpoints" / "latest");
  std::string resume_err;
  const int resumed =
      kept ? run_program(
                 "--params 500k --steps 3 --batch 4 --seq-len 16 "
                 "--eval-every 5 --eval-tokens 256 --no-progress "
                 "--resume " +
                     (out / "checkpoints").string() + " --out " + (dir / "resumed").string() +
                     " --nvme-path " + (dir / "nvme").string(),
                 &resume_err)
           : -1;
  (void)std::system(("umount " + small.string()).c_str());
  EXPECT_EQ(big, 1) << big_err;
  EXPECT_EQ(big_err.rfind("train_lm: error: --save-dir " +
                              (small / "big" / "checkpoints").string() + ": needs ",
                          0),
            0u)
      << big_err;
  EXPECT_NE(big_err.find(" of a checkpoint but " + small.string() + " has "), std::string::npos)
      << big_err;
  EXPECT_FALSE(big_made);
  EXPECT_EQ(code, 1) << err;
  // One checkpoint fits (the check before the run passes); the three kept at once do not.
  EXPECT_NE(
      err.find("train_lm: warning: --save-dir " + (out / "checkpoints").string() + ": needs "),
      std::string::npos)
      << err;
  EXPECT_NE(
      err.find(" of 3 checkpoints but " + small.string() + " has 8.0 MiB free: a save will fail"),
      std::string::npos)
      << err;
  EXPECT_NE(err.find("No space left on device"), std::string::npos) << err;
  EXPECT_TRUE(kept) << err;
  EXPECT_EQ(latest, "global_step2");
  EXPECT_NE(err.find("kept " + out.string()), std::string::npos) << err;
  EXPECT_EQ(resumed, 0) << resume_err;
}

TEST(Program, ResumedRunContinuesTheLossCurveExactly) {
  const fs::path dir = scratch_dir("train_lm_resume");
  const std::string common =
      "--params 20k --steps 130 --batch 4 --seq-len 16 --eval-every 25 --eval-tokens 256 "
      "--seed 5 --no-progress --offload-optimizer nvme --nvme-path " +
      (dir / "nvme").string() + " ";
  std::string err, whole_err;
  ASSERT_EQ(run_program(common + "--out " + (dir / "whole").string(), &whole_err), 0) << whole_err;
  ASSERT_EQ(run_program(common + "--save-every 50 --stop-after 120 --save-dir " +
                            (dir / "ckpt").string() + " --out " + (dir / "cut").string(),
                        &err),
            0)
      << err;
  EXPECT_EQ(read_all(dir / "ckpt" / "latest"), "global_step100");
  EXPECT_TRUE(fs::exists(dir / "ckpt" / "global_step50"));
  std::string out;
  ASSERT_EQ(run_program(common + "--resume " + (dir / "ckpt").string() + " --out " +
                            (dir / "resumed").string(),
                        &err, &out),
            0)
      << err;
  // The summary's per-step figures are this run's 30 steps.
  EXPECT_NE(out.find("30 (steps 101-130, resumed after step 100)"), std::string::npos) << out;
  EXPECT_NE(err.find("resumed from " + (dir / "ckpt").string() + "/global_step100 at step 100"),
            std::string::npos)
      << err;
  // The validation before the resumed run's first step is at step 100, and says so, with the
  // uninterrupted run's step-100 validation loss; no step 0 is shown, in the lines or the picture
  // (the original run's step-0 validation is not in the checkpoint; x of step 0 is 64.0).
  auto line_of = [](const std::string& text, const std::string& prefix) {
    const std::size_t at = text.find(prefix);
    return at == std::string::npos ? std::string() : text.substr(at, text.find('\n', at) - at);
  };
  EXPECT_NE(line_of(err, "step 100: validation loss "), "") << err;
  EXPECT_EQ(line_of(err, "step 100: validation loss "),
            line_of(whole_err, "step 100: validation loss "))
      << err << whole_err;
  EXPECT_EQ(err.find("step 0:"), std::string::npos) << err;
  EXPECT_EQ(read_all(dir / "resumed" / "loss.svg").find("<circle cx=\"64.0\""), std::string::npos);
  EXPECT_NE(read_all(dir / "whole" / "loss.svg").find("<circle cx=\"64.0\""), std::string::npos);
  const std::vector<std::string> whole = loss_rows(dir / "whole" / "loss.csv");
  const std::vector<std::string> resumed = loss_rows(dir / "resumed" / "loss.csv");
  ASSERT_EQ(whole.size(), 131u);  // the header and 130 steps
  ASSERT_EQ(resumed.size(), whole.size());
  int differ = 0;
  for (std::size_t i = 0; i < whole.size(); ++i) {
    if (whole[i] != resumed[i] && ++differ <= 3) {
      ADD_FAILURE() << "row " << i << ": " << whole[i] << " vs resumed " << resumed[i];
    }
  }
  EXPECT_EQ(differ, 0);
  std::printf("resumed at step 101; %d rows differ; the last row: %s\n", differ,
              resumed.back().c_str());
  // latest pointed back at step 50 while global_step100 is there, as a save cut short between
  // its tag's rename and `latest`'s leaves it: the engine saves that tag again, and the run says
  // so before it trains (stopped here before that save). The same tag in another --save-dir,
  // whose `latest` names it, is another run's: refused before the run trains.
  {
    std::ofstream(dir / "ckpt" / "latest", std::ios::trunc) << "global_step50";
    const std::string manifest = read_all(dir / "ckpt" / "global_step100" / "manifest.json");
    std::string back_err;
    EXPECT_EQ(run_program(common + "--save-every 50 --stop-after 60 --resume " +
                              (dir / "ckpt").string() + " --save-dir " + (dir / "ckpt").string() +
                              " --out " + (dir / "back").string(),
                          &back_err),
              0)
        << back_err;
    EXPECT_NE(back_err.find("train_lm: note: " + (dir / "ckpt" / "global_step100").string() +
                            " is newer than the tag `latest` names (a save cut short before it "
                            "moved `latest`): this run saves it again"),
              std::string::npos)
        << back_err;
    EXPECT_EQ(read_all(dir / "ckpt" / "global_step100" / "manifest.json"), manifest);
    fs::copy(dir / "ckpt", dir / "other", fs::copy_options::recursive);
    std::ofstream(dir / "other" / "latest", std::ios::trunc) << "global_step100";
    EXPECT_EQ(run_program(common + "--save-every 50 --resume " + (dir / "ckpt").string() +
                              " --save-dir " + (dir / "other").string() + " --out " +
                              (dir / "back2").string(),
                          &back_err),
              1)
        << back_err;
    EXPECT_NE(back_err.find((dir / "other" / "global_step100").string() +
                            " exists already, and this run would save that tag again"),
              std::string::npos)
        << back_err;
    EXPECT_FALSE(fs::exists(dir / "back2"));
    std::ofstream(dir / "ckpt" / "latest", std::ios::trunc) << "global_step100";
  }
  // Resuming at or past --steps has nothing to train: exit 1 saying so, not a run of no steps.
  std::string past_err;
  const std::string past =
      "--params 20k --steps 100 --batch 4 --seq-len 16 --eval-every 25 "
      "--eval-tokens 256 --seed 5 --no-progress --offload-optimizer nvme "
      "--nvme-path " +
      (dir / "nvme").string() + " --resume " + (dir / "ckpt").string() + " --out " +
      (dir / "past").string();
  EXPECT_EQ(run_program(past, &past_err), 1) << past_err;
  EXPECT_NE(past_err.find("the checkpoint is at step 100, and --steps is 100: nothing to train"),
            std::string::npos)
      << past_err;
  fs::remove_all(dir);
}

// A run started without --resume into a --save-dir that holds an earlier run's checkpoints is
// refused before it trains, naming the directory and its latest tag, and leaves those tags as
// they were (it trained beside them, and --keep-last deleted them). Without `latest` (a first
// save cut short after its tag's rename) the run and --resume both say that the tags are there.
TEST(Program, FreshRunIntoASaveDirWithCheckpointsIsRefused) {
  const fs::path dir = scratch_dir("train_lm_fresh_save_dir");
  const fs::path ckpt = dir / "ckpt";
  const std::string common =
      "--params 20k --batch 4 --seq-len 16 --eval-every 2 --eval-tokens 256 --no-progress "
      "--save-every 2 --keep-last 1 --offload-optimizer nvme --nvme-path " +
      (dir / "nvme").string() + " --save-dir " + ckpt.string() + " ";
  std::string err;
  ASSERT_EQ(run_program(common + "--steps 4 --out " + (dir / "first").string(), &err), 0) << err;
  auto listing = [&] {
    std::string text;
    std::vector<fs::path> paths;
    for (const auto& entry : fs::recursive_directory_iterator(ckpt)) paths.push_back(entry.path());
    std::sort(paths.begin(), paths.end());
    for (const fs::path& p : paths) {
      text += p.string();
      if (fs::is_regular_file(p)) {
        text += ' ';
        text += read_all(p);
      }
      text += '\n';
    }
    return text;
  };
  const std::string before = listing();
  ASSERT_NE(before.find("global_step4/manifest.json"), std::string::npos) << before;
  EXPECT_EQ(run_program(common + "--steps 10 --out " + (dir / "second").string(), &err), 1) << err;
  EXPECT_EQ(err, "train_lm: error: --save-dir " + ckpt.string() +
                     " holds the checkpoints of an earlier run (latest global_step4, step 4): "
                     "pass --resume " +
                     ckpt.string() + " to continue that run, or give another --save-dir\n");
  EXPECT_EQ(listing(), before);
  EXPECT_FALSE(fs::exists(dir / "second"));
  // No `latest`: the complete tag is named, both without --resume and with it.
  fs::remove(ckpt / "latest");
  EXPECT_EQ(run_program(common + "--steps 10 --out " + (dir / "second").string(), &err), 1) << err;
  EXPECT_NE(err.find("--save-dir " + ckpt.string() +
                     " holds the checkpoint tags of an earlier run (global_step4) but no "
                     "`latest`"),
            std::string::npos)
      << err;
  EXPECT_EQ(run_program(common + "--steps 10 --resume " + ckpt.string() + " --out " +
                            (dir / "second").string(),
                        &err),
            1)
      << err;
  EXPECT_NE(err.find("--resume " + ckpt.string() +
                     ": it holds complete checkpoint tags (global_step4) but no `latest`, which "
                     "--resume loads (a first save cut short before it wrote `latest`): write "
                     "the tag to resume from into " +
                     (ckpt / "latest").string() + " (echo global_step4 > "),
            std::string::npos)
      << err;
  EXPECT_FALSE(fs::exists(dir / "second"));
  // Written back, --resume continues that run into the same directory.
  std::ofstream(ckpt / "latest") << "global_step4";
  EXPECT_EQ(run_program(common + "--steps 6 --resume " + ckpt.string() + " --out " +
                            (dir / "second").string(),
                        &err),
            0)
      << err;
  EXPECT_EQ(read_all(ckpt / "latest"), "global_step6");
  fs::remove_all(dir);
}

// The overlapped step (--overlap-step on, zinf.overlap_step, the default) against the sequential
// one: the same loss.csv (losses row for row) and the same final masters, byte for byte in the
// checkpoint each run saves after its last step, over world 1, 2 and 4, stages 1-3, the optimizer
// state on NVMe and in host memory, with and without clipping, and clipping by the previous
// step's coefficient (--clip-previous) (bf16; train_lm has no fp16:
// tests/engine/overlap_test.cpp covers fp16 loss scaling and a skipped step). 40 steps each;
// ZINF_OVERLAP_STEPS sets another count (200 for the acceptance run).
TEST(Program, OverlappedStepWritesTheSameLossesAndMastersAsSequential) {
  const char* steps_env = std::getenv("ZINF_OVERLAP_STEPS");
  const int steps = steps_env != nullptr ? std::atoi(steps_env) : 40;
  const fs::path dir = scratch_dir("train_lm_overlap");
  const std::vector<std::string> cases = {
      "--world-size 1 --stage 3 --offload-optimizer nvme",
      "--world-size 4 --stage 3 --offload-optimizer nvme --offload-param nvme --grad-clip 0",
      "--world-size 4 --stage 2 --offload-optimizer cpu",
      "--world-size 1 --stage 1 --offload-optimizer cpu --grad-clip 0",
      "--world-size 4 --stage 1 --offload-optimizer nvme",
      "--world-size 1 --stage 2 --offload-optimizer nvme --grad-clip 0",
      "--world-size 2 --stage 3 --offload-optimizer nvme --clip-previous",
  };
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const std::string common =
        "--params 20k --steps " + std::to_string(steps) + " --batch 4 --seq-len 16 --eval-every " +
        std::to_string(std::max(steps / 2, 1)) + " --eval-tokens 256 --seed 11 --lr 1e-2 " +
        "--no-progress --save-every " + std::to_string(steps) + " " + cases[k] + " ";
    std::map<std::string, std::vector<std::string>> rows;
    std::map<std::string, std::string> masters;
    for (const std::string mode : {"off", "on"}) {
      const fs::path run = dir / (std::to_string(k) + mode);
      std::string err;
      ASSERT_EQ(run_program(common + "--overlap-step " + mode + " --out " + (run / "out").string() +
                                " --save-dir " + (run / "ckpt").string() + " --nvme-path " +
                                (run / "nvme").string(),
                            &err),
                0)
          << cases[k] << ": " << err;
      rows[mode] = loss_rows(run / "out" / "loss.csv");
      // Every rank's fp32 master and moments, as the checkpoint of the last step holds them
      // (rank<r>.zinfckpt; the manifest beside them has the run's timings in its client state).
      const fs::path tag = run / "ckpt" / ("global_step" + std::to_string(steps));
      std::vector<fs::path> files;
      for (const auto& entry : fs::recursive_directory_iterator(tag)) {
        const std::string name = entry.path().filename().string();
        if (entry.is_regular_file() && name.size() > 9 &&
            name.compare(name.size() - 9, 9, ".zinfckpt") == 0) {
          files.push_back(entry.path());
        }
      }
      std::sort(files.begin(), files.end());
      ASSERT_FALSE(files.empty()) << "no rank files under " << tag;
      for (const fs::path& f : files) masters[mode] += read_all(f);
    }
    ASSERT_EQ(rows["on"].size(), std::size_t(steps) + 1) << cases[k];
    EXPECT_EQ(rows["on"], rows["off"]) << cases[k];
    EXPECT_TRUE(masters["on"] == masters["off"]) << cases[k] << ": the final masters differ";
    std::printf("%s: %zu loss rows and %zu bytes of masters equal; the last row: %s\n",
                cases[k].c_str(), rows["on"].size(), masters["on"].size(),
                rows["on"].back().c_str());
  }
  fs::remove_all(dir);
}

// A Perfetto trace of overlapped steps (train_lm --trace) shows the overlap itself: spans of the
// optimizer pass's read / update / write tracks run at the same time as the next step's forward
// spans. With --overlap-step off no pass span meets a forward span (the pass runs inside step()).
// Without clipping ("noclip": --grad-clip 0, at stage 3) the pass begins during the backward:
// update spans run inside backward spans, which with clipping (the pass updates from step(),
// after the backward, and the next backward waits for each group it reduces into) they do in
// none of the first steps here. With clipping ("on") the pass still begins during the backward,
// but only reads ahead: reads of step k's pass begin inside the backward of step k (the pass of
// step k - 1 may read there too; never with --overlap-step off).
TEST(Program, TraceShowsTheOptimizerPassBesideTheNextForwardPass) {
  const fs::path dir = scratch_dir("train_lm_overlap_trace");
  std::map<std::string, double> overlap_ms;
  std::map<std::string, double> update_in_backward_ms;
  std::map<std::string, int> reads_in_own_backward;
  for (const std::string mode : {"on", "off", "noclip"}) {
    const fs::path trace = dir / ("trace_" + mode + ".json");
    std::string err;
    // Without clipping the pass begins in the backward from the second step on: more steps.
    const std::string steps = mode == "noclip" ? "6" : "3";
    ASSERT_EQ(run_program(
                  "--params 2M --steps " + steps + " --batch 2 --seq-len 16 --eval-every " + steps +
                      " "
                      "--eval-tokens 64 --seed 3 --no-progress --offload-optimizer nvme "
                      "--sub-group-size 65536 --overlap-step " +
                      (mode == "noclip" ? std::string("on --grad-clip 0") : mode) + " --trace " +
                      trace.string() + " --out " + (dir / ("out_" + mode)).string() +
                      " --nvme-path " + (dir / "nvme").string(),
                  &err),
              0)
        << err;
    std::ifstream in(trace);
    const nlohmann::json root = nlohmann::json::parse(in);
    const nlohmann::json& events = root.is_array() ? root : root.at("traceEvents");
    std::vector<std::pair<double, double>> forward, backward, pass, update;
    std::vector<std::pair<double, std::int64_t>> read_starts;  // (start, the pass's step)
    int pass_spans = 0;
    for (const nlohmann::json& e : events) {
      if (e.value("ph", "") != "X") continue;
      const std::string name = e.value("name", "");
      const double ts = e.value("ts", 0.0), dur = e.value("dur", 0.0);
      if (name == "forward") forward.push_back({ts, ts + dur});
      if (name == "backward") backward.push_back({ts, ts + dur});
      if (name.rfind("update sg", 0) == 0) update.push_back({ts, ts + dur});
      if (name.rfind("read sg", 0) == 0) {
        read_starts.push_back({ts, e.at("args").value("step", std::int64_t{0})});
      }
      if (name.rfind("read sg", 0) == 0 || name.rfind("update sg", 0) == 0 ||
          name.rfind("write sg", 0) == 0) {
        pass.push_back({ts, ts + dur});
        ++pass_spans;
      }
    }
    ASSERT_GE(forward.size(), 3u) << mode;
    ASSERT_GT(pass_spans, 0) << mode;
    auto inside_ms = [](const std::vector<std::pair<double, double>>& outer,
                        const std::vector<std::pair<double, double>>& inner) {
      double both_us = 0;
      for (const auto& o : outer) {
        for (const auto& i : inner) {
          both_us += std::max(0.0, std::min(o.second, i.second) - std::max(o.first, i.first));
        }
      }
      return both_us / 1e3;
    };
    overlap_ms[mode] = inside_ms(forward, pass);
    update_in_backward_ms[mode] = inside_ms(backward, update);
    // One micro-batch a step here: the k-th backward span is step k's.
    ASSERT_EQ(backward.size(), static_cast<std::size_t>(std::stoi(steps))) << mode;
    std::sort(backward.begin(), backward.end());
    int own = 0;
    for (const auto& [ts, step] : read_starts) {
      if (step < 1 || static_cast<std::size_t>(step) > backward.size()) continue;
      const auto& b = backward[static_cast<std::size_t>(step) - 1];
      if (ts >= b.first && ts < b.second) ++own;
    }
    reads_in_own_backward[mode] = own;
    std::printf(
        "mode %s: %zu forward spans, %zu backward spans, %d pass spans, %.3f ms of pass spans "
        "inside forward spans, %.3f ms of update spans inside backward spans, %d reads begun "
        "inside their own step's backward\n",
        mode.c_str(), forward.size(), backward.size(), pass_spans, overlap_ms[mode],
        update_in_backward_ms[mode], reads_in_own_backward[mode]);
  }
  EXPECT_GT(overlap_ms["on"], 0.0);
  EXPECT_EQ(overlap_ms["off"], 0.0);
  EXPECT_EQ(update_in_backward_ms["off"], 0.0);
  EXPECT_GT(update_in_backward_ms["noclip"], 0.0);
  EXPECT_EQ(reads_in_own_backward["off"], 0);
  EXPECT_GT(reads_in_own_backward["on"], 0);
  fs::remove_all(dir);
}

// On an opaque HostDevice (whose pointers host code cannot dereference, as a GPU's) the program
// reads every parameter through a device-to-host copy and hands every gradient over from device
// memory, and the engine takes its GPU path; the training is the same, so the losses are the same
// bits as on a plain HostDevice, row by row, with one rank and with two.
TEST(Program, OpaqueDeviceGivesTheSameLossesAsHost) {
  const fs::path dir = scratch_dir("train_lm_opaque");
  const std::string common =
      "--params 60k --steps 12 --batch 8 --seq-len 32 --eval-every 6 --seed 5 --lr 1e-2 --warmup 2 "
      "--no-progress "
      "--stage 3 --offload-optimizer nvme --nvme-path " +
      (dir / "nvme").string();
  for (const std::string& ranks :
       {std::string("--world-size 1"), std::string("--world-size 2 --offload-param cpu")}) {
    std::string host_out, opaque_out;
    const std::vector<std::string> host =
        run_loss_rows(common + " " + ranks, dir / "host", &host_out);
    const std::vector<std::string> opaque =
        run_loss_rows(common + " " + ranks + " --device opaque", dir / "opaque", &opaque_out);
    std::printf("seed 5, %s: host %.6f, opaque %.6f\n", ranks.c_str(), final_val_loss(host_out),
                final_val_loss(opaque_out));
    ASSERT_EQ(host.size(), 13u) << ranks;  // the header and 12 steps
    EXPECT_EQ(host, opaque) << ranks;
    // The run trained: the loss fell from ln 256 = 5.55.
    EXPECT_LT(final_val_loss(host_out), 5.0) << host_out;
    EXPECT_EQ(final_val_loss(host_out), final_val_loss(opaque_out));
    EXPECT_NE(opaque_out.find("device (HostDevice)"), std::string::npos) << opaque_out;
    fs::remove_all(dir / "host");
    fs::remove_all(dir / "opaque");
  }
  fs::remove_all(dir);
}

// --checkpoint-activations (each block's input kept, the block recomputed in the backward pass)
// through the engine's activation store on the device, in pinned host memory and on NVMe: the
// loss.csv equals the run without checkpointing row for row (the recomputation runs the same
// products on the same values), and the device's peak activation bytes fall as documented.
TEST(Program, CheckpointedActivationsGiveTheSameLossCurve) {
  const fs::path dir = scratch_dir("train_lm_checkpoint");
  const std::string common =
      "--params 120k --layers 8 --steps 6 --batch 4 --seq-len 64 --eval-every 3 "
      "--eval-tokens 512 --seed 9 --lr 1e-2 --warmup 2 --no-progress --offload-optimizer cpu "
      "--nvme-path " +
      (dir / "nvme").string() + " ";
  const auto peak = activation_peak;
  std::string base_out;
  const std::vector<std::string> base = run_loss_rows(common, dir / "base", &base_out);
  ASSERT_EQ(base.size(), 7u);  // the header and 6 steps
  EXPECT_GT(peak(base_out), 0.0) << base_out;
  for (const std::string& variant :
       {std::string("--checkpoint-activations"),
        std::string("--checkpoint-activations --offload-activations cpu"),
        std::string("--checkpoint-activations --offload-activations nvme")}) {
    std::string out;
    EXPECT_EQ(run_loss_rows(common + variant, dir / "ckpt", &out), base) << variant;
    std::printf("%s: device activation peak %.0f of %.0f bytes\n", variant.c_str(), peak(out),
                peak(base_out));
    if (variant.find("offload") != std::string::npos) {
      EXPECT_LT(peak(out), 0.2 * peak(base_out)) << variant;
    } else {
      EXPECT_LT(peak(out), 0.7 * peak(base_out)) << variant;
    }
    fs::remove_all(dir / "ckpt");
  }
  // The plain fp32 loop (--engine off) keeps its checkpoints itself: the same curve as its own
  // run without checkpointing.
  const std::vector<std::string> plain = run_loss_rows(common + "--engine off", dir / "plain");
  ASSERT_EQ(plain.size(), 7u);
  EXPECT_EQ(run_loss_rows(common + "--engine off --checkpoint-activations", dir / "plain_ckpt"),
            plain);
  EXPECT_FALSE(fs::exists(dir / "nvme")) << "swap directory left behind";
  fs::remove_all(dir);
}

// `zinf plan --arch train_lm --checkpoint-activations` predicts the device activation bytes
// train_lm's memory report measures, within 10%, at two sequence lengths (the activations grow
// with the tokens of a micro-batch), without checkpointing, with it, and with the checkpoints
// offloaded to host memory. The planner's formula is written from what
// examples/train_lm/model.cpp allocates (lib/plan/estimate.hpp); the measured figure is the
// engine's MemoryReport::activation_device_bytes_peak: what the model says it holds plus the
// checkpoints the engine keeps on the device.
TEST(Program, PlannerPredictsTheActivationBytesItStores) {
#ifndef ZINF_BIN
  GTEST_SKIP() << "the zinf command line is not built (ZINF_BUILD_TOOLS=OFF)";
#else
  const fs::path dir = scratch_dir("train_lm_plan_activations");
  for (const int seq_len : {64, 256}) {
    for (const std::string& variant :
         {std::string(""), std::string("--checkpoint-activations"),
          std::string("--checkpoint-activations --offload-activations cpu")}) {
      const std::string shape = "--layers 4 --context 16 --embed 16 ";
      std::string err, out;
      ASSERT_EQ(run_program("--params 120k " + shape + "--steps 2 --batch 2 --seq-len " +
                                std::to_string(seq_len) +
                                " --eval-every 2 --eval-tokens 256 --no-progress "
                                "--offload-optimizer cpu " +
                                variant + " --out " + (dir / "run").string(),
                            &err, &out),
                0)
          << variant << ": " << err;
      // "train_lm: 103.7k parameters (4 blocks, hidden 48, context 16 bytes), ..." (stderr)
      const std::size_t at = err.find(", hidden ");
      ASSERT_NE(at, std::string::npos) << err;
      const int hidden = std::stoi(err.substr(at + 9));
      const double measured = activation_peak(out);
      ASSERT_GT(measured, 0.0) << out;
      std::string plan_out;
      const std::string plan_variant = variant.find("offload") != std::string::npos
                                           ? "--checkpoint-activations "
                                             "--offload-activations"
                                           : variant;
      // The micro-batch is the run's 2 sequences of seq_len targets.
      ASSERT_EQ(
          run_command(ZINF_BIN,
                      "plan --arch train_lm " + shape + "--hidden " + std::to_string(hidden) +
                          " --seq " + std::to_string(seq_len) + " --micro-batch 2 " + plan_variant +
                          " --gpu-mem 8GB --host-mem 8GB --mem-adam-gbps 10 --json",
                      &err, &plan_out),
          0)
          << err;
      const nlohmann::json plan = nlohmann::json::parse(plan_out);
      const double predicted =
          plan["bytes_per_state_per_rank"]["activations"]["device"].get<double>();
      std::printf("seq %d %s: measured %.0f, planned %.0f bytes (%+.2f%%)\n", seq_len,
                  variant.empty() ? "no checkpointing" : variant.c_str(), measured, predicted,
                  100.0 * (predicted - measured) / measured);
      EXPECT_NEAR(predicted, measured, 0.1 * measured) << "seq " << seq_len << " " << variant;
      fs::remove_all(dir / "run");
    }
  }
  fs::remove_all(dir);
#endif
}

// --device cuda without a GPU (or in a build without CUDA) fails before anything is created, in
// one line naming the device error. Where a GPU is present the run succeeds instead, and
// scripts/gpu-check is what checks it.
TEST(Program, CudaWithoutAGpuFailsCleanly) {
  const fs::path base = scratch_dir("train_lm_cuda");
  fs::create_directories(base);
  std::string err, out;
  const int rc = run_program(
      "--device cuda --params 60k --steps 2 --batch 8 --seq-len 32 "
      "--eval-every 2 --no-progress --out " +
          (base / "out").string() + " --nvme-path " + (base / "nvme").string(),
      &err, &out);
#if defined(ZINF_HAVE_CUDA)
  if (rc == 0) {
    fs::remove_all(base);
    GTEST_SKIP() << "a CUDA device is present: --device cuda trained (scripts/gpu-check checks it)";
  }
#endif
  EXPECT_NE(rc, 0);
  EXPECT_EQ(err.rfind("train_lm: error: --device cuda: ", 0), 0u) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
#if !defined(ZINF_HAVE_CUDA)
  EXPECT_NE(err.find("built without CUDA"), std::string::npos) << err;
#endif
  std::printf("%s", err.c_str());
  EXPECT_FALSE(fs::exists(base / "out"));
  EXPECT_FALSE(fs::exists(base / "nvme"));
  fs::remove_all(base);
}

// --quiet prints what its help says: nothing while training, and the report at the end (the
// tables, which scripts and docs/DEMO.md read from a --quiet run, and the key=value lines).
TEST(Program, QuietPrintsTheReportItsHelpDescribes) {
  std::string err, help;
  ASSERT_EQ(run_program("--help", &err, &help), 0) << err;
  const std::size_t at = help.find("  --quiet ");
  ASSERT_NE(at, std::string::npos) << help;
  const std::string quiet_help = help.substr(at, help.find('\n', at) - at);
  EXPECT_NE(quiet_help.find("print nothing while training"), std::string::npos) << quiet_help;
  EXPECT_NE(quiet_help.find("the time, state and summary tables"), std::string::npos) << quiet_help;
  const fs::path dir = scratch_dir("train_lm_quiet");
  std::string out;
  ASSERT_EQ(run_program("--params 20k --steps 4 --batch 4 --seq-len 16 --eval-every 2 "
                        "--eval-tokens 256 --quiet --step-times --out " +
                            (dir / "out").string() + " --nvme-path " + (dir / "nvme").string(),
                        &err, &out),
            0)
      << err;
  EXPECT_EQ(err, "");
  for (const char* part :
       {"where the time went", "where the state lived", "\nsummary\n", "final_val_loss="}) {
    EXPECT_NE(out.find(part), std::string::npos) << part << "\n" << out;
  }
  fs::remove_all(dir);
}

TEST(Program, BadArgumentsGiveOneLineAndLeaveNothingBehind) {
  const fs::path base =
      fs::path(std::getenv("ZINF_TEST_TMPDIR") ? std::getenv("ZINF_TEST_TMPDIR") : "/tmp") /
      "train_lm_bad_args";
  fs::remove_all(base);
  fs::create_directories(base);
  const std::string where =
      " --out " + (base / "out").string() + " --nvme-path " + (base / "nvme").string();
  for (const std::string& args : {
           std::string("--no-such-option"),
           std::string("--params 1B --device-memory 1GiB"),
           std::string("--params 1B --host-memory 2GiB --device-memory 64GiB"),
           std::string("--params 100B"),
       }) {
    std::string err;
    EXPECT_NE(run_program(args + where, &err), 0) << args;
    ASSERT_FALSE(err.empty()) << args;
    // One line, the error; nothing else.
    EXPECT_EQ(err.rfind("train_lm: error: ", 0), 0u) << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << args << ": " << err;
    EXPECT_FALSE(fs::exists(base / "out")) << args;
    EXPECT_FALSE(fs::exists(base / "nvme")) << args;
  }
  // NVMe paths that cannot take the swap files: too small a filesystem for 100B parameters'
  // optimizer state (1.2 TB), and a place where no directory can be made (procfs, which refuses
  // even root). The --out directory made before the failure is removed again.
  for (const std::string& args : {
           std::string("--params 100B --device-memory 1000TiB --host-memory 1000TiB --nvme-path ") +
               (base / "nvme").string(),
           std::string("--steps 1 --nvme-path /proc/train_lm_nvme"),
       }) {
    std::string err;
    EXPECT_NE(run_program(args + " --out " + (base / "out").string(), &err), 0) << args;
    EXPECT_EQ(err.rfind("train_lm: error: --nvme-path", 0), 0u) << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << args << ": " << err;
    EXPECT_FALSE(fs::exists(base / "out")) << args;
    EXPECT_FALSE(fs::exists(base / "nvme")) << args;
  }
  // A read-only place for the swap files (skipped as root, who may write anywhere).
  if (geteuid() != 0) {
    fs::create_directories(base / "ro");
    fs::permissions(base / "ro", fs::perms::owner_read | fs::perms::owner_exec);
    std::string err;
    EXPECT_NE(run_program("--steps 1 --out " + (base / "out").string() + " --nvme-path " +
                              (base / "ro" / "nvme").string(),
                          &err),
              0);
    EXPECT_NE(err.find("--nvme-path"), std::string::npos) << err;
    EXPECT_FALSE(fs::exists(base / "out"));
    fs::permissions(base / "ro", fs::perms::owner_all);
  }
  fs::remove_all(base);
}

// --- One process per rank under mpirun (--comm mpi) ---------------------------------------------

#if defined(__SANITIZE_ADDRESS__)
#define TRAIN_LM_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TRAIN_LM_TEST_ASAN 1
#endif
#endif

// The environment a process that opens MPI runs in: under AddressSanitizer, what the MPI tests'
// ctest entries add to ASAN_OPTIONS (ZINF_MPI_TEST_ENVIRONMENT_MODIFICATION in the top
// CMakeLists.txt), since Open MPI's allocations are suppressed by whole stacks, which libmpi's
// frames without frame pointers need the slow unwinder for. Empty otherwise.
std::string mpi_environment() {
#if defined(TRAIN_LM_TEST_ASAN)
  const char* options = std::getenv("ASAN_OPTIONS");
  return "ASAN_OPTIONS='" + (options != nullptr ? std::string(options) + ":" : std::string()) +
         "fast_unwind_on_malloc=0' ";
#else
  return "";
#endif
}

// mpirun with the options the MPI tests give it, or empty when this build has no MPI or no
// mpirun is on the PATH.
std::string mpirun_command() {
#if defined(ZINF_HAVE_MPI)
  std::string err, out;
  if (run_command("command", "-v mpirun", &err, &out) != 0) return "";
  out.erase(out.find_last_not_of(" \n") + 1);
  return out.empty()
             ? ""
             : mpi_environment() + out + " --allow-run-as-root --oversubscribe --bind-to none";
#else
  return "";
#endif
}

// A small run for the MPI tests: a few steps, the optimizer state on NVMe.
const std::string kMpiRun =
    std::string(TRAIN_LM_BIN) +
    " --params 60k --layers 2 --batch 8 --seq-len 16 --steps 6 --eval-every 3 --eval-tokens 512 "
    "--no-progress --quiet --comm mpi ";

// What one rank of an MPI job said and how it ended.
struct RankEnd {
  int exit_code = -1;  // -1: it never ended
  std::string err;
};

// Runs an MPI job of one process per entry of `rank_args`, rank r running train_lm with
// rank_args[r] under a shell that keeps its stderr and exit code in `dir` and then ends
// normally: mpirun neither ends the job when a rank fails (each rank must end by itself) nor
// spends its seconds reporting the failure. Returns every rank's end, and in `took_s` the job's
// wall time.
std::vector<RankEnd> run_mpi_ranks(const std::string& mpirun, const fs::path& dir,
                                   const std::vector<std::string>& rank_args, double* took_s) {
  fs::create_directories(dir);
  {
    std::ofstream script(dir / "rank.sh");
    script << "#!/bin/sh\n"
              "work=$1\n"
              "shift\n"
              "\"$@\" >/dev/null 2>\"$work/err.$OMPI_COMM_WORLD_RANK\"\n"
              "echo $? >\"$work/exit.$OMPI_COMM_WORLD_RANK\"\n";
  }
  fs::permissions(dir / "rank.sh", fs::perms::owner_all);
  // orte_allowed_exit_without_sync: a rank that ends without MPI_Finalize (it skips it after an
  // abort) does not make mpirun end the job.
  std::string args = "--mca orte_allowed_exit_without_sync 1";
  for (std::size_t r = 0; r < rank_args.size(); ++r) {
    args += std::string(r == 0 ? "" : " :") + " -np 1 " + (dir / "rank.sh").string() + " " +
            dir.string() + " " + kMpiRun + rank_args[r];
  }
  const auto start = std::chrono::steady_clock::now();
  std::string err;
  run_command("timeout 120 env " + mpirun, args, &err);
  *took_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::vector<RankEnd> ends(rank_args.size());
  for (std::size_t r = 0; r < ends.size(); ++r) {
    const std::string code = read_all(dir / ("exit." + std::to_string(r)));
    if (!code.empty()) ends[r].exit_code = std::stoi(code);
    ends[r].err = read_all(dir / ("err." + std::to_string(r)));
    std::printf("rank %zu: exit %d: %s", r, ends[r].exit_code, ends[r].err.c_str());
  }
  return ends;
}

// One rank failing a check of its own (an --nvme-path it cannot make) after the communicator is
// open: it exits 1 at once, and so does the other rank, whose error names it and quotes its
// message, long before the collective timeout (30 s). Before, the failed rank waited in
// MPI_Finalize and the other in its collective until the timeout.
TEST(Program, MpiRankFailingAloneEndsEveryRankAtOnce) {
  const std::string mpirun = mpirun_command();
  if (mpirun.empty()) GTEST_SKIP() << "no MPI in this build, or no mpirun on the PATH";
  const fs::path dir = scratch_dir("train_lm_mpi_one_fails");
  const std::string common = "--collective-timeout-ms 30000 --out " + (dir / "out").string();
  double took_s = 0;
  const std::vector<RankEnd> ends = run_mpi_ranks(
      mpirun, dir / "job",
      {common + " --nvme-path " + (dir / "nvme").string(), common + " --nvme-path /dev/null/x"},
      &took_s);
  std::printf("%.1f s\n", took_s);
  EXPECT_LT(took_s, 15.0) << "a rank waited for the collective timeout";
  EXPECT_EQ(ends[1].exit_code, 1);
  EXPECT_EQ(ends[0].exit_code, 1);
  EXPECT_EQ(ends[1].err,
            "train_lm: error: rank 1: --nvme-path /dev/null/x: cannot create it: "
            "Not a directory\n");
  EXPECT_EQ(ends[0].err.rfind("train_lm: error: rank 0: ", 0), 0u) << ends[0].err;
  EXPECT_NE(ends[0].err.find("rank 1 failed: --nvme-path /dev/null/x"), std::string::npos)
      << ends[0].err;
  // What rank 0 made (its --out and --nvme-path directories) went with the failure.
  EXPECT_FALSE(fs::exists(dir / "out"));
  EXPECT_FALSE(fs::exists(dir / "nvme"));
  fs::remove_all(dir);
}

// The summary of an MPI job counts every rank's activations, as the threads' run at the same
// world size does, and says that its peak resident set is the processes' sum.
TEST(Program, MpiSummaryCountsEveryRanksActivations) {
  const std::string mpirun = mpirun_command();
  if (mpirun.empty()) GTEST_SKIP() << "no MPI in this build, or no mpirun on the PATH";
  const fs::path dir = scratch_dir("train_lm_mpi_activations");
  const std::string args = "--checkpoint-activations --offload-activations cpu --nvme-path " +
                           (dir / "nvme").string() + " --out " + (dir / "out").string();
  std::string err, mpi_out, local_out;
  ASSERT_EQ(run_command(mpirun, "-np 2 " + kMpiRun + args, &err, &mpi_out), 0) << err;
  ASSERT_EQ(run_program(args + " --params 60k --layers 2 --batch 8 --seq-len 16 --steps 6 "
                               "--eval-every 3 --eval-tokens 512 --no-progress --quiet "
                               "--world-size 2",
                        &err, &local_out),
            0)
      << err;
  EXPECT_GT(activation_peak(mpi_out), 0.0) << mpi_out;
  EXPECT_EQ(activation_peak(mpi_out), activation_peak(local_out)) << mpi_out << local_out;
  // The host row: what the ranks' checkpoints took in pinned host memory, all ranks together.
  auto host_row = [](const std::string& out) {
    const std::size_t at = out.find("activations off the device: host / NVMe written");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  EXPECT_EQ(host_row(mpi_out), host_row(local_out));
  EXPECT_EQ(host_row(mpi_out).find(" 0 B / "), std::string::npos) << host_row(mpi_out);
  EXPECT_NE(mpi_out.find("peak RSS, training steps (sum of 2 processes)"), std::string::npos)
      << mpi_out;
  fs::remove_all(dir);
}

// An MPI job leaves no --nvme-path directory it made, as a run of threads does not: the ranks
// share it, and the last one done removes it (here two levels, both made by the run), and only
// what the run made.
TEST(Program, MpiRunRemovesTheNvmeDirectoryItMade) {
  const std::string mpirun = mpirun_command();
  if (mpirun.empty()) GTEST_SKIP() << "no MPI in this build, or no mpirun on the PATH";
  const fs::path dir = scratch_dir("train_lm_mpi_nvme");
  fs::create_directories(dir);
  std::string err, out;
  ASSERT_EQ(run_command(mpirun,
                        "-np 2 " + kMpiRun + "--nvme-path " + (dir / "nvme" / "swap").string() +
                            " --out " + (dir / "out").string(),
                        &err, &out),
            0)
      << err;
  EXPECT_FALSE(fs::exists(dir / "nvme")) << "the NVMe directory the run made is left behind";
  EXPECT_TRUE(fs::exists(dir / "out" / "loss.csv"));
  // A directory that was there before stays, empty.
  fs::create_directories(dir / "kept");
  ASSERT_EQ(run_command(mpirun,
                        "-np 2 " + kMpiRun + "--nvme-path " + (dir / "kept").string() + " --out " +
                            (dir / "out").string(),
                        &err, &out),
            0)
      << err;
  EXPECT_TRUE(fs::exists(dir / "kept"));
  EXPECT_TRUE(fs::is_empty(dir / "kept"));
  fs::remove_all(dir);
}

// The NVMe path inside a new --out directory (`--out run --nvme-path run/nvme`): the NVMe
// directory the run made goes with the run, and the --out directory it is in stays for the
// outputs (it was removed with it, empty, and the run failed at its very end writing loss.csv).
TEST(Program, NvmePathInsideANewOutDirectoryLeavesTheOutputs) {
  const fs::path dir = scratch_dir("train_lm_nvme_in_out");
  fs::create_directories(dir);
  const fs::path out = dir / "run";
  std::string err;
  ASSERT_EQ(run_program("--params 20k --steps 4 --batch 4 --seq-len 16 --eval-every 2 "
                        "--eval-tokens 256 --no-progress --offload-optimizer nvme --out " +
                            out.string() + " --nvme-path " + (out / "nvme").string(),
                        &err),
            0)
      << err;
  EXPECT_TRUE(fs::exists(out / "loss.csv"));
  EXPECT_TRUE(fs::exists(out / "summary.txt"));
  EXPECT_FALSE(fs::exists(out / "nvme")) << "the NVMe directory the run made is left behind";
  // The same, with --out reached through a symbolic link and --nvme-path by the real path.
  const fs::path real = dir / "real";
  fs::create_directories(real);
  fs::create_directory_symlink(real, dir / "link");
  ASSERT_EQ(run_program("--params 20k --steps 4 --batch 4 --seq-len 16 --eval-every 2 "
                        "--eval-tokens 256 --no-progress --offload-optimizer nvme --out " +
                            (dir / "link" / "run").string() + " --nvme-path " +
                            (real / "run" / "nvme").string(),
                        &err),
            0)
      << err;
  EXPECT_TRUE(fs::exists(real / "run" / "loss.csv"));
  EXPECT_FALSE(fs::exists(real / "run" / "nvme"));
  fs::remove_all(dir);
}

// Two jobs given one --nvme-path share its swap directory (train_lm.swap): each removes only its
// own swap files when it ends, and the directory only when it made it and nothing else is left
// in it (the first to end deleted the other's live swap file with the directory). The other job
// is a file of another host's name, put in the directory while this run trains (one the run made)
// and before it starts (one it did not make); it stays, and so does the directory. The run trains
// for 4 s (--time-limit): long enough that the file goes in while it runs on a loaded machine.
TEST(Program, JobsSharingAnNvmePathRemoveOnlyTheirOwnSwapFiles) {
  const fs::path dir = scratch_dir("train_lm_shared_nvme");
  const fs::path nvme = dir / "nvme";
  const fs::path swap = nvme / "train_lm.swap";
  const std::string other = "zinf-swap-otherhost-1-rank0.bin";
  const std::string common =
      "--params 20k --batch 4 --seq-len 16 --eval-every 100 --eval-tokens 256 --no-progress "
      "--quiet --offload-optimizer nvme --nvme-path " +
      nvme.string() + " ";
  fs::create_directories(dir);
  const fs::path rc_file = dir / "rc";
  const std::string background = "(" + std::string(TRAIN_LM_BIN) + " " + common +
                                 "--steps 1000000 --time-limit 4 --out " + (dir / "long").string() +
                                 " >" + (dir / "long.log").string() + " 2>&1; echo $? >" +
                                 rc_file.string() + ") &";
  ASSERT_EQ(std::system(background.c_str()), 0);
  // Its swap file, once the engine made it (not the engine's O_DIRECT probe, .zinf-probe-*,
  // which comes and goes first).
  auto own_swap_file = [&] {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(swap, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.starts_with("zinf-swap-") && name != other) return true;
    }
    return false;
  };
  const auto start = std::chrono::steady_clock::now();
  while (!own_swap_file() && !fs::exists(rc_file) &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(own_swap_file()) << "the run made no swap file in " << swap << ": "
                               << read_all(dir / "long.log");
  std::ofstream(swap / other) << "another job's swap file";
  const bool put_in_time = !fs::exists(rc_file);
  while (!fs::exists(rc_file) || read_all(rc_file).empty()) {
    ASSERT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(300));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(read_all(rc_file), "0\n") << read_all(dir / "long.log");
  EXPECT_TRUE(put_in_time) << "the run ended before the other job's file was put in";
  auto names = [&] {
    std::vector<std::string> found;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(swap, ec)) {
      found.push_back(entry.path().filename().string());
    }
    return found;
  };
  EXPECT_EQ(names(), std::vector<std::string>{other});
  EXPECT_EQ(read_all(swap / other), "another job's swap file");
  // The directory was there before this run: it stays with the other job's file, without this
  // run's, and so it does when the run fails (no checkpoint to resume from).
  std::string err;
  EXPECT_EQ(run_program(common + "--steps 4 --out " + (dir / "short").string(), &err), 0) << err;
  EXPECT_EQ(names(), std::vector<std::string>{other});
  fs::create_directories(dir / "empty");
  EXPECT_EQ(run_program(common + "--steps 4 --resume " + (dir / "empty").string() + " --out " +
                            (dir / "failed").string(),
                        &err),
            1)
      << err;
  EXPECT_EQ(names(), std::vector<std::string>{other});
  EXPECT_EQ(read_all(swap / other), "another job's swap file");
  fs::remove_all(dir);
}

// Ranks of one job given different options that must agree fail at the start, every rank naming
// the option and both values (before, a different --seed trained silently and a different --steps
// failed only as "ranks disagree: rank 0 sent 12544 bytes where this rank expected 40"). A rank's
// own --nvme-path may differ.
TEST(Program, MpiRanksGivenDifferentOptionsFailNamingTheOption) {
  const std::string mpirun = mpirun_command();
  if (mpirun.empty()) GTEST_SKIP() << "no MPI in this build, or no mpirun on the PATH";
  const fs::path dir = scratch_dir("train_lm_mpi_options");
  const std::string rank =
      "--out " + (dir / "out").string() + " --nvme-path " + (dir / "nvme").string();
  double took_s = 0;
  for (const auto& [option, values] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"--seed", {"1", "2"}}, {"--micro-batches", {"1", "2"}}}) {
    const std::vector<RankEnd> ends = run_mpi_ranks(
        mpirun, dir / "job",
        {rank + "0 " + option + " " + values[0], rank + "1 " + option + " " + values[1]}, &took_s);
    for (std::size_t r = 0; r < ends.size(); ++r) {
      EXPECT_EQ(ends[r].exit_code, 2) << option;
      EXPECT_EQ(ends[r].err, "train_lm: error: rank " + std::to_string(r) + ": " + option +
                                 " differs between the ranks: rank 0 has " + values[0] +
                                 ", rank 1 has " + values[1] +
                                 " (every rank of a job must be given the same " + option + ")\n");
    }
    fs::remove_all(dir / "job");
  }
  EXPECT_FALSE(fs::exists(dir / "out"));
  EXPECT_FALSE(fs::exists(dir / "nvme0"));
  fs::remove_all(dir);
}

// A launcher variable left in the environment (PMI_SIZE=4 around a program started without a
// launcher) is named in the error, with the --world-size that overrides it; given, the run trains.
TEST(Program, StrayLauncherVariableIsNamedAndWorldSizeOverridesIt) {
#if !defined(ZINF_HAVE_MPI)
  GTEST_SKIP() << "no MPI in this build";
#else
  for (const char* name :
       {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS"}) {
    if (std::getenv(name) != nullptr) GTEST_SKIP() << name << " is set: run under a launcher";
  }
  const fs::path dir = scratch_dir("train_lm_stray_ntasks");
  const std::string args =
      kMpiRun + "--out " + (dir / "out").string() + " --nvme-path " + (dir / "nvme").string();
  std::string err, out;
  EXPECT_EQ(run_command(mpi_environment() + "PMI_SIZE=4", args, &err), 1);
  EXPECT_NE(err.find("the communicator has 1 rank but the launcher's environment says 4 "
                     "(PMI_SIZE=4)"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("--world-size 1 overrides it"), std::string::npos) << err;
  EXPECT_EQ(run_command(mpi_environment() + "PMI_SIZE=4", args + " --world-size 1", &err, &out), 0)
      << err;
  EXPECT_GT(final_val_loss(out), 0) << out;
  fs::remove_all(dir);
#endif
}

}  // namespace
}  // namespace train_lm
