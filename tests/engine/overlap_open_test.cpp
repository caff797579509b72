// A pass opened during the backward (the overlapped step without clipping or loss scaling,
// docs/ENGINE.md "Updates during the backward"): what the caller sees between the last
// micro-batch's first reduction and step(). Calls that need the whole step are refused until
// step() and then work; a rate other than the pass's, and a gather of a module whose gradients
// were reduced, are refused; a micro-batch past
// gradient_accumulation_steps and a non-finite gradient fail the step, where the sequential step
// would take the micro-batch or skip the step; an engine closed with a pass open returns.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>

#include "base/random.hpp"
#include "engine_test_util.hpp"
#include "zinf/trace.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::ParamDef;

// gradient_accumulation_steps 1, declared: a pass that updates opens from the first step on.
Config open_config(const std::string& nvme, bool overlap) {
  Config config = engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNone, nvme);
  config.bf16_enabled = true;
  config.gradient_clipping = 0.0;
  config.overlap_step = overlap;
  config.gradient_accumulation_given = true;
  return config;
}

// `body` on one rank whose passes open in the backward (open_config), with its state on NVMe in
// a scratch directory named `name` and the bf16 test model of `seed`.
void on_one_rank(const std::string& name, std::uint64_t seed,
                 const std::function<Status(const Model&, Engine&)>& body) {
  engine_test::ScratchDir dir(name);
  const Model model = engine_test::make_model(DType::kBF16, seed);
  std::vector<Status> st =
      engine_test::with_engines(open_config(dir.path(), true), model, 1,
                                [&](int, Engine& engine) -> Status { return body(model, engine); });
  ASSERT_TRUE(st[0].is_ok()) << st[0].to_string();
}

// Module m's gradients for `step` on `rank`, with an inf in the first element when `poison`:
// from the initial values (no gather needed), or with `gathered` from the module's values as
// gathered (the caller gathers it).
Status reduce_module(Engine& engine, const Model& model, const std::string& m, int step,
                     bool poison = false, int rank = 0, bool gathered = false) {
  std::vector<std::vector<std::uint16_t>> grads;
  std::vector<GradientRef> refs;
  grads.reserve(model.params.size());
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    const ParamDef& d = model.params[p];
    if (d.module != m) continue;
    std::vector<float> w = model.initial[p];
    if (gathered) {
      ZINF_ASSIGN_OR_RETURN(TensorView view, engine.parameter(d.name));
      w = engine_test::widen_view(view);
    }
    std::vector<float> g = engine_test::make_grad(d, w, rank, step, 0, p);
    if (poison) g[0] = std::numeric_limits<float>::infinity();
    grads.push_back(engine_test::narrow_to_half(g, d.dtype));
    refs.push_back({d.name, grads.back().data(), d.element_count(), d.dtype});
  }
  return engine.reduce_gradients(m, refs);
}

// Every module's gradients for `step`, last module first, as a backward pass hands them.
Status backward(Engine& engine, const Model& model, int step) {
  for (auto it = model.modules.rbegin(); it != model.modules.rend(); ++it) {
    ZINF_RETURN_IF_ERROR(reduce_module(engine, model, *it, step));
  }
  return Status::ok();
}

// The masters of two runs (read_masters()) are the same bits, parameter by parameter.
void expect_same_masters(const Model& model, const std::vector<std::vector<float>>& a,
                         const std::vector<std::vector<float>>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t p = 0; p < a.size(); ++p) EXPECT_EQ(a[p], b[p]) << model.params[p].name;
}

TEST(OverlapOpen, CallsThatNeedTheWholeStepWaitForStepThenMatchTheSequentialRun) {
  engine_test::ScratchDir dir("overlap_open_calls");
  const Model model = engine_test::make_model(DType::kBF16, 2301);
  std::vector<std::vector<std::vector<float>>> result(2);
  for (bool overlap : {false, true}) {
    std::vector<Status> st = engine_test::with_engines(
        open_config(dir.path(), overlap), model, 1, [&](int, Engine& engine) -> Status {
          for (int step = 1; step <= 3; ++step) {
            ZINF_RETURN_IF_ERROR(backward(engine, model, step));
            if (overlap && step >= 2) {
              // The pass is open: these need all of it.
              std::vector<float> v(model.params[0].element_count());
              Status read = engine.read_parameters(model.params[0].name, v.data());
              EXPECT_EQ(read.code(), Code::kFailedPrecondition) << read.to_string();
              EXPECT_NE(read.message().find("call step() first"), std::string::npos)
                  << read.to_string();
              Status rate = engine.set_learning_rate(engine.learning_rate() * 2);
              EXPECT_EQ(rate.code(), Code::kFailedPrecondition) << rate.to_string();
              EXPECT_NE(rate.message().find("began during the backward"), std::string::npos)
                  << rate.to_string();
              (void)engine.counters();  // returns while the pass is open
              // A module whose gradients were reduced before the last reduction may be written by
              // the pass already (the last module: reduced first).
              Status again = engine.gather(model.modules.back());
              EXPECT_EQ(again.code(), Code::kFailedPrecondition) << again.to_string();
              EXPECT_NE(again.message().find("reduced before the last reduce_gradients()"),
                        std::string::npos)
                  << again.to_string();
            }
            ZINF_ASSIGN_OR_RETURN(StepReport rep, engine.step());
            EXPECT_EQ(rep.in_backward, overlap) << "step " << step;
          }
          ZINF_ASSIGN_OR_RETURN(result[overlap ? 1 : 0], engine_test::read_masters(engine, model));
          return Status::ok();
        });
    ASSERT_TRUE(st[0].is_ok()) << st[0].to_string();
  }
  expect_same_masters(model, result[0], result[1]);
}

// A pass updates in the backward only where gradient_accumulation_steps was declared (from the
// first step on); undeclared (no such key, the count 1 by default), a pass opens once a step had
// one micro-batch but only reads ahead, so a caller that hands more micro-batches in a later step
// (1, 1, then 2 here), or a gradient that is not finite, has the step taken or skipped as the
// sequential step would. The masters are the sequential run's in each case.
TEST(OverlapOpen, APassUpdatesInTheBackwardOnlyWhereTheCountIsDeclared) {
  engine_test::ScratchDir dir("overlap_open_first");
  const Model model = engine_test::make_model(DType::kBF16, 2304);
  enum Run { kSequential, kUndeclared, kDeclared };
  for (const bool varying : {false, true}) {
    SCOPED_TRACE(varying ? "micro-batches 1, 1, 2, 1 and an inf at step 5" : "one a step");
    std::vector<std::vector<std::vector<float>>> result(3);
    for (Run run : {kSequential, kUndeclared, kDeclared}) {
      if (varying && run == kDeclared) continue;  // a second micro-batch fails it (below)
      Config config = open_config(dir.path(), run != kSequential);
      config.gradient_accumulation_given = run == kDeclared;
      std::vector<Status> st =
          engine_test::with_engines(config, model, 1, [&](int, Engine& engine) -> Status {
            for (int step = 1; step <= 5; ++step) {
              // The first module's gradients (reduced last) carry an inf at step 5.
              const bool poison = varying && step == 5;
              for (std::size_t k = model.modules.size(); k-- > 0;) {
                ZINF_RETURN_IF_ERROR(
                    reduce_module(engine, model, model.modules[k], 10 * step, poison && k == 0));
              }
              if (varying && step == 3) ZINF_RETURN_IF_ERROR(backward(engine, model, 31));
              ZINF_ASSIGN_OR_RETURN(StepReport rep, engine.step());
              EXPECT_EQ(rep.in_backward, run == kDeclared) << "run " << run << " step " << step;
              EXPECT_EQ(rep.skipped, varying && step == 5) << "run " << run << " step " << step;
            }
            ZINF_ASSIGN_OR_RETURN(result[run], engine_test::read_masters(engine, model));
            return Status::ok();
          });
      ASSERT_TRUE(st[0].is_ok()) << "run " << run << ": " << st[0].to_string();
    }
    for (std::size_t p = 0; p < result[0].size(); ++p) {
      EXPECT_EQ(result[kSequential][p], result[kUndeclared][p]) << model.params[p].name;
      if (!varying) {
        EXPECT_EQ(result[kSequential][p], result[kDeclared][p]) << model.params[p].name;
      }
    }
  }
}

// The turn tests' model: a first module of six parameters of 32 x `embed_columns`, reduced last,
// so that its sub-groups are left to the turn; then a block of 2048 elements and a head of 1024.
Model turn_model(std::int64_t embed_columns) {
  Model model;
  model.modules = {"embed", "block", "head"};
  for (int k = 0; k < 6; ++k) {
    model.params.push_back(
        {fmt::format("embed.w{}", k), "embed", {32, embed_columns}, DType::kBF16});
  }
  model.params.push_back({"block.w", "block", {64, 32}, DType::kBF16});
  model.params.push_back({"head.w", "head", {32, 32}, DType::kBF16});
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    std::vector<float> v(model.params[p].element_count());
    fill_uniform(v.data(), v.size(), 2305 * 1000 + p, -1.0f, 1.0f);
    model.initial.push_back(std::move(v));
  }
  return model;
}

// Three steps of `model` with 1024-element sub-groups, sequential and overlapped, `group_max`
// zinf.group_max_elements and `persistence` stage3_param_persistence_threshold (shards in device
// memory; the half-precision stream writes them during the pass). Every pass opened in the backward
// updates each sub-group once, from the last down and, where it turned, from sub-group 0 up to
// where it turned (the trace's update spans); after every step, the parameters each module gathers
// are the sequential run's, bit for bit, and so are the masters at the end. *turns gets, per pass
// that turned, the partition element it turned at (the start of the last sub-group taken going
// down). Whether and where a pass turns depends on when its reads meet the end of the backward.
void run_turn(const std::string& name, const Model& model, std::size_t group_max,
              std::size_t persistence, std::vector<std::size_t>* turns) {
  engine_test::ScratchDir dir(name);
  std::size_t total = 0;
  for (const ParamDef& d : model.params) total += d.element_count();
  const std::size_t n = total / 1024;
  std::vector<std::vector<std::vector<float>>> result(2);
  // Per run: per step, per parameter, the gathered bf16 values.
  std::vector<std::vector<std::vector<std::uint16_t>>> published(2);
  std::vector<std::size_t> order;  // the three passes' updates, by sub-group
  for (bool overlap : {false, true}) {
    Config config = open_config(dir.path(), overlap);
    config.zero.sub_group_size = 1024;
    config.zero.offload_optimizer.buffer_count = 2;
    config.zero.stage3_param_persistence_threshold = persistence;
    config.zero.stage3_max_live_parameters = std::size_t{1} << 20;  // the first module gathered
    config.zero.group_max_elements = group_max;
    engine_test::Ranks ranks = engine_test::make_ranks(1);
    Trace trace;
    Env env;
    env.device = ranks.devices[0].get();
    env.comm = ranks.comms[0].get();
    env.trace = &trace;
    Result<std::unique_ptr<Engine>> opened = Engine::open(config, env);
    ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
    Engine& engine = **opened;
    ASSERT_TRUE(engine_test::register_model(engine, model).is_ok());
    ASSERT_TRUE(engine.finalize().is_ok());
    for (int step = 1; step <= 3; ++step) {
      ASSERT_TRUE(backward(engine, model, step).is_ok());
      Result<StepReport> rep = engine.step();
      ASSERT_TRUE(rep.is_ok()) << rep.status().to_string();
      // What the next forward reads: each module gathered (waiting for the pass to write it).
      for (const std::string& module : model.modules) {
        Status gathered = engine.gather(module);
        ASSERT_TRUE(gathered.is_ok()) << gathered.to_string();
        for (const ParamDef& d : model.params) {
          if (d.module != module) continue;
          Result<TensorView> view = engine.parameter(d.name);
          ASSERT_TRUE(view.is_ok()) << view.status().to_string();
          const auto* bits = static_cast<const std::uint16_t*>(view->data);
          published[overlap ? 1 : 0].emplace_back(bits, bits + view->element_count);
        }
        ASSERT_TRUE(engine.release(module).is_ok());
      }
    }
    Result<std::vector<std::vector<float>>> m = engine_test::read_masters(engine, model);
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    result[overlap ? 1 : 0] = std::move(*m);
    if (!overlap) continue;
    // Every pass updates each of the n sub-groups once, one pass after the other.
    const std::vector<std::string> tracks = trace.track_names();
    std::vector<std::pair<std::int64_t, std::size_t>> updates;
    for (const Trace::Event& e : trace.events()) {
      if (tracks[static_cast<std::size_t>(e.track)] != "update") continue;
      updates.emplace_back(e.start_ns, std::stoul(e.name.substr(e.name.find("sg") + 2)));
    }
    std::sort(updates.begin(), updates.end());
    for (const auto& u : updates) order.push_back(u.second);
  }
  // Pass 1 began at step() (the count is not declared), from sub-group 0 up; passes 2 and 3
  // in the backward: the head's and the block's first, going down.
  ASSERT_EQ(order.size(), 3 * n) << ::testing::PrintToString(order);
  for (std::size_t pass = 1; pass < 3; ++pass) {
    const auto first = order.begin() + static_cast<std::ptrdiff_t>(n * pass);
    const std::vector<std::size_t> seq(first, first + static_cast<std::ptrdiff_t>(n));
    ASSERT_EQ(seq[0], n - 1) << ::testing::PrintToString(seq);
    const auto zero = std::find(seq.begin(), seq.end(), std::size_t{0});
    ASSERT_NE(zero, seq.end()) << ::testing::PrintToString(seq);
    for (auto it = seq.begin(); it + 1 != zero; ++it) EXPECT_EQ(*it, *(it + 1) + 1);
    for (auto it = zero; it + 1 != seq.end(); ++it) EXPECT_EQ(*it + 1, *(it + 1));
    if (zero != seq.end() - 1) turns->push_back(*(zero - 1) * 1024);
  }
  ASSERT_EQ(published[0].size(), published[1].size());
  for (std::size_t k = 0; k < published[0].size(); ++k) {
    const std::size_t p = k % model.params.size();
    EXPECT_EQ(published[0][k], published[1][k])
        << model.params[p].name << " as gathered after step " << k / model.params.size() + 1;
  }
  for (std::size_t p = 0; p < result[0].size(); ++p) {
    EXPECT_EQ(result[0][p], result[1][p]) << model.params[p].name;
  }
}

// A group per parameter (zinf.group_max_elements 1024): the sub-group boundaries are group
// starts, but for the one inside the block's 2048-element weight. Partitioned shards.
TEST(OverlapOpen, ThePassTurnsToTheFirstSubGroupsOnceTheBackwardIsOver) {
  std::vector<std::size_t> turns;
  run_turn("overlap_open_turn", turn_model(32), 1024, 30, &turns);
  std::printf("passes that turned: %zu of 2\n", turns.size());
}

// A group per module (the default): the first module's group spans 9 sub-groups, so a turn in
// it comes inside the group, whose upper part the publisher writes at the turn and its lower
// part last. Every group persistent (the threshold above every parameter): the parts go into
// the rank's slice of the gathered buffer, all-gathered when the module is gathered.
TEST(OverlapOpen, ThePassTurnsInsideAGroupAndWritesItInTwoParts) {
  std::vector<std::size_t> turns;
  run_turn("overlap_open_turn_inside", turn_model(48), 0, std::size_t{1} << 20, &turns);
  // The groups start where the modules do: 0, 9216 (block) and 11264 (head).
  std::size_t inside = 0;
  for (std::size_t at : turns) inside += at != 0 && at != 9216 && at != 11264 ? 1 : 0;
  std::printf("passes that turned: %zu of 2, inside a group: %zu\n", turns.size(), inside);
}

// The groups the next backward has not reduced into yet keep the pass's gradients until the
// first reduction into them zeroes them; only their counts are reset when the pass finishes. So
// a step whose backward skipped the first module still fails, naming one of its parameters,
// instead of updating it with the previous step's gradients.
TEST(OverlapOpen, AModuleLeftOutOfTheNextBackwardFailsTheStep) {
  on_one_rank("overlap_open_left_out", 2306, [](const Model& model, Engine& engine) -> Status {
    ZINF_RETURN_IF_ERROR(backward(engine, model, 1));
    ZINF_RETURN_IF_ERROR(engine.step().status());
    ZINF_RETURN_IF_ERROR(backward(engine, model, 2));
    ZINF_RETURN_IF_ERROR(engine.step().status());
    // Step 3: every module but the first (the pass of step 2 read its gradients last).
    for (std::size_t k = model.modules.size(); k-- > 1;) {
      ZINF_RETURN_IF_ERROR(reduce_module(engine, model, model.modules[k], 3));
    }
    Status step = engine.step().status();
    EXPECT_EQ(step.code(), Code::kFailedPrecondition) << step.to_string();
    // embed.w, the first module's parameter.
    EXPECT_NE(step.message().find("'" + model.params.front().name +
                                  "' had 0 gradient(s) reduced since the last step"),
              std::string::npos)
        << step.to_string();
    return Status::ok();
  });
}

TEST(OverlapOpen, AMicroBatchPastTheConfiguredCountFailsTheStep) {
  on_one_rank("overlap_open_micro", 2302, [](const Model& model, Engine& engine) -> Status {
    ZINF_RETURN_IF_ERROR(backward(engine, model, 1));
    ZINF_RETURN_IF_ERROR(engine.step().status());
    ZINF_RETURN_IF_ERROR(backward(engine, model, 2));
    // gradient_accumulation_steps is 1: the pass took every module's gradients as final.
    Status again = reduce_module(engine, model, model.modules.back(), 2);
    EXPECT_EQ(again.code(), Code::kFailedPrecondition) << again.to_string();
    EXPECT_NE(again.message().find("more than gradient_accumulation_steps (1)"), std::string::npos)
        << again.to_string();
    Status step = engine.step().status();
    EXPECT_EQ(step.code(), Code::kFailedPrecondition) << "sticky: " << step.to_string();
    return Status::ok();
  });
}

TEST(OverlapOpen, ANonFiniteGradientFailsTheStepTheSequentialStepSkips) {
  engine_test::ScratchDir dir("overlap_open_inf");
  const Model model = engine_test::make_model(DType::kBF16, 2303);
  for (bool overlap : {false, true}) {
    std::vector<Status> st = engine_test::with_engines(
        open_config(dir.path(), overlap), model, 1, [&](int, Engine& engine) -> Status {
          ZINF_RETURN_IF_ERROR(backward(engine, model, 1));
          ZINF_RETURN_IF_ERROR(engine.step().status());
          // The first module's gradients (reduced last) carry an inf.
          for (std::size_t k = model.modules.size(); k-- > 0;) {
            ZINF_RETURN_IF_ERROR(reduce_module(engine, model, model.modules[k], 2, k == 0));
          }
          Result<StepReport> rep = engine.step();
          if (!overlap) {
            EXPECT_TRUE(rep.is_ok() && rep->skipped) << rep.status().to_string();
            return Status::ok();
          }
          EXPECT_EQ(rep.status().code(), Code::kAborted) << rep.status().to_string();
          EXPECT_NE(rep.status().message().find("gradients are not finite"), std::string::npos)
              << rep.status().to_string();
          EXPECT_EQ(engine.step().status().code(), Code::kAborted) << "sticky";
          return Status::ok();
        });
    ASSERT_TRUE(st[0].is_ok()) << "overlap " << overlap << ": " << st[0].to_string();
  }
}

// A backward that gathers each module (last first) and computes its gradients from the gathered
// values, with no forward pass in between, on two ranks: at stage 2 every group stays gathered, and
// the previous pass's new values reach it through the all-gather its first gather after the pass
// does. A pass opened at the first reduction (updating, without clipping; reading ahead, with
// it) must not skip that for the modules gathered after it opened, or their gradients are
// computed from the values of the step before. The masters equal the sequential run's.
TEST(OverlapOpen, GathersAfterThePassOpensStillAllGatherThePreviousPassesValues) {
  for (double clipping : {0.0, 1.0}) {
    engine_test::ScratchDir dir("overlap_open_gathers");
    const Model model = engine_test::make_model(DType::kBF16, 2308);
    std::vector<std::vector<std::vector<float>>> result(2);
    std::vector<std::vector<StepReport>> reports(2);
    for (bool overlap : {false, true}) {
      Config config = open_config(dir.path(), overlap);
      config.zero.stage = 2;
      config.gradient_clipping = clipping;
      const int run = overlap ? 1 : 0;
      std::vector<Status> st =
          engine_test::with_engines(config, model, 2, [&](int rank, Engine& engine) -> Status {
            for (int step = 1; step <= 3; ++step) {
              for (std::size_t k = model.modules.size(); k-- > 0;) {
                const std::string& m = model.modules[k];
                ZINF_RETURN_IF_ERROR(engine.gather(m));
                ZINF_RETURN_IF_ERROR(reduce_module(engine, model, m, step, /*poison=*/false, rank,
                                                   /*gathered=*/true));
                ZINF_RETURN_IF_ERROR(engine.release(m));
              }
              ZINF_ASSIGN_OR_RETURN(StepReport rep, engine.step());
              if (rank == 0) reports[run].push_back(rep);
            }
            Result<std::vector<std::vector<float>>> m = engine_test::read_masters(engine, model);
            ZINF_RETURN_IF_ERROR(m.status());
            if (rank == 0) result[run] = std::move(*m);
            return Status::ok();
          });
      for (const Status& s : st)
        ASSERT_TRUE(s.is_ok()) << "overlap " << overlap << ": " << s.to_string();
    }
    // Steps 2 and 3 open their pass in the backward (the first shows the micro-batch count).
    for (std::size_t s = 1; s < reports[1].size(); ++s) {
      EXPECT_EQ(reports[1][s].in_backward, clipping == 0.0) << "step " << s + 1;
      EXPECT_EQ(reports[1][s].read_ahead, clipping > 0.0) << "step " << s + 1;
    }
    SCOPED_TRACE(fmt::format("clipping {}", clipping));
    expect_same_masters(model, result[0], result[1]);
  }
}

// With clipping the pass opens at the same point but only reads ahead until step() decides the
// step (StepReport::read_ahead). The calls the pass that updates refuses or fails call it off
// instead, and the run goes on as the sequential one: a read-back between the backward and
// step(), a new schedule there (set_learning_rate() would keep every later pass from opening
// before step()), a second micro-batch where the count is 1, and a step skipped on a non-finite
// gradient (not sticky). The masters, every read-back and every report's skip are the
// sequential run's.
TEST(OverlapOpen, APassThatReadsAheadIsCalledOffWhereTheStepCannotBeDecidedYet) {
  engine_test::ScratchDir dir("overlap_open_reads");
  const Model model = engine_test::make_model(DType::kBF16, 2307);
  std::vector<std::vector<std::vector<float>>> result(2), read_back(2);
  std::vector<std::vector<StepReport>> reports(2);
  for (bool overlap : {false, true}) {
    Config config = open_config(dir.path(), overlap);
    config.gradient_clipping = 1.0;
    config.gradient_accumulation_given = false;  // the count learnt from the steps
    const int run = overlap ? 1 : 0;
    std::vector<Status> st =
        engine_test::with_engines(config, model, 1, [&](int, Engine& engine) -> Status {
          for (int step = 1; step <= 7; ++step) {
            for (std::size_t k = model.modules.size(); k-- > 0;) {
              // Step 4: the first module's gradients (reduced last) carry an inf.
              ZINF_RETURN_IF_ERROR(
                  reduce_module(engine, model, model.modules[k], step, step == 4 && k == 0));
            }
            if (step == 2) {
              std::vector<float> v(model.params[0].element_count());
              ZINF_RETURN_IF_ERROR(engine.read_parameters(model.params[0].name, v.data()));
              read_back[run].push_back(std::move(v));
            }
            if (step == 3) ZINF_RETURN_IF_ERROR(engine.set_lr_schedule(ScheduleConfig{}));
            if (step == 5) ZINF_RETURN_IF_ERROR(backward(engine, model, step + 100));
            ZINF_ASSIGN_OR_RETURN(StepReport rep, engine.step());
            reports[run].push_back(rep);
          }
          ZINF_ASSIGN_OR_RETURN(result[run], engine_test::read_masters(engine, model));
          return Status::ok();
        });
    ASSERT_TRUE(st[0].is_ok()) << "overlap " << overlap << ": " << st[0].to_string();
  }
  // Opened from step 2 (gradient_accumulation_steps is not declared: the first step shows the
  // count), called off at steps 2, 3 and 5 (a second micro-batch), and not opened at step 6 (the
  // last step had two micro-batches); the skipped step 4 read ahead too.
  const std::vector<bool> read_ahead = {false, false, false, true, false, false, true};
  for (std::size_t s = 0; s < reports[1].size(); ++s) {
    EXPECT_EQ(reports[1][s].read_ahead, read_ahead[s]) << "step " << s + 1;
    EXPECT_FALSE(reports[1][s].in_backward) << "step " << s + 1;
    EXPECT_FALSE(reports[0][s].read_ahead) << "step " << s + 1;
    EXPECT_EQ(reports[1][s].skipped, reports[0][s].skipped) << "step " << s + 1;
  }
  EXPECT_TRUE(reports[1][3].skipped);
  EXPECT_EQ(read_back[0], read_back[1]);
  expect_same_masters(model, result[0], result[1]);
}

// A local call (verify_swap(), not collective) between the backward and step() calls one rank's
// read-ahead pass off while the other rank's stays open: both must still issue the same
// collectives. At stage 2 with a backward that gathers nothing, every group's all-gather of the
// previous pass is still pending at step(); the rank whose pass was called off does it there
// (settle()), so the other does too. Two ranks, the same masters as the sequential run.
TEST(OverlapOpen, ALocalCallOffOnOneRankKeepsTheRanksCollectivesAlike) {
  engine_test::ScratchDir dir("overlap_open_local");
  const Model model = engine_test::make_model(DType::kBF16, 2309);
  std::vector<std::vector<std::vector<float>>> result(2);
  for (bool overlap : {false, true}) {
    Config config = open_config(dir.path(), overlap);
    config.zero.stage = 2;
    config.gradient_clipping = 1.0;
    const int run = overlap ? 1 : 0;
    std::vector<Status> st =
        engine_test::with_engines(config, model, 2, [&](int rank, Engine& engine) -> Status {
          for (int step = 1; step <= 3; ++step) {
            ZINF_RETURN_IF_ERROR(backward(engine, model, step));
            if (rank == 0 && step == 2) ZINF_RETURN_IF_ERROR(engine.verify_swap().status());
            ZINF_RETURN_IF_ERROR(engine.step().status());
          }
          Result<std::vector<std::vector<float>>> m = engine_test::read_masters(engine, model);
          ZINF_RETURN_IF_ERROR(m.status());
          if (rank == 0) result[run] = std::move(*m);
          return Status::ok();
        });
    for (const Status& s : st) {
      ASSERT_TRUE(s.is_ok()) << "overlap " << overlap << ": " << s.to_string();
    }
  }
  expect_same_masters(model, result[0], result[1]);
}

TEST(OverlapOpen, AnEngineClosedWithAPassOpenReturns) {
  on_one_rank("overlap_open_close", 2304, [](const Model& model, Engine& engine) -> Status {
    ZINF_RETURN_IF_ERROR(backward(engine, model, 1));
    ZINF_RETURN_IF_ERROR(engine.step().status());
    // Half a backward: the pass opens and waits for the first modules' gradients, which
    // never come; closing the engine calls it off.
    return reduce_module(engine, model, model.modules.back(), 2);
  });
}

}  // namespace
}  // namespace zinf

namespace zinf {
namespace {

// set_lr_schedule() in the middle of the last micro-batch's backward hands the rate back to the
// engine's schedule: the pass opens at the next reduction, after a module whose reduction came
// before it. step() makes every group final, so the pass ends and the run equals the sequential
// one (before that, the first module's groups were never final and step() left a pass waiting
// for them: the next gather hung).
TEST(OverlapOpen, AScheduleSetMidBackwardOpensThePassLateAndTheStepStillEnds) {
  engine_test::ScratchDir dir("overlap_open_schedule");
  const Model model = engine_test::make_model(DType::kBF16, 2305);
  std::vector<std::vector<std::vector<float>>> result(2);
  std::vector<std::vector<StepReport>> reports(2);
  for (bool overlap : {false, true}) {
    std::vector<Status> st = engine_test::with_engines(
        open_config(dir.path(), overlap), model, 1, [&](int, Engine& engine) -> Status {
          ZINF_RETURN_IF_ERROR(engine.set_learning_rate(engine.learning_rate()));
          for (int step = 1; step <= 3; ++step) {
            for (std::size_t k = model.modules.size(); k-- > 0;) {
              ZINF_RETURN_IF_ERROR(reduce_module(engine, model, model.modules[k], step));
              if (step == 2 && k + 1 == model.modules.size()) {
                ZINF_RETURN_IF_ERROR(engine.set_lr_schedule(ScheduleConfig{}));
              }
            }
            ZINF_ASSIGN_OR_RETURN(StepReport rep, engine.step());
            reports[overlap ? 1 : 0].push_back(rep);
            // Gathers the new values (the pass's last groups written).
            for (const std::string& m : model.modules) {
              ZINF_RETURN_IF_ERROR(engine.gather(m));
              ZINF_RETURN_IF_ERROR(engine.release(m));
            }
          }
          ZINF_ASSIGN_OR_RETURN(result[overlap ? 1 : 0], engine_test::read_masters(engine, model));
          return Status::ok();
        });
    ASSERT_TRUE(st[0].is_ok()) << "overlap " << overlap << ": " << st[0].to_string();
  }
  EXPECT_TRUE(reports[1][1].in_backward);  // opened late in step 2's backward
  expect_same_masters(model, result[0], result[1]);
}

// A recorded order that gathers a module again after its reduction (step 1 inspects the head
// after the backward): in a later step the pass may be writing that module once it is reduced,
// so the coordinator does not prefetch it (a prefetch's reads would race the pass's writes of its
// shards), and the program's own gather is refused by name. Step 1 opens no pass in its backward
// (set_learning_rate() keeps it to step() until set_lr_schedule() gives the rate back to the
// schedule), so its gather after the backward is allowed and recorded.
TEST(OverlapOpen, AModuleReducedAlreadyIsNotPrefetched) {
  on_one_rank("overlap_open_no_prefetch", 2307, [](const Model& model, Engine& engine) -> Status {
    const std::string& head = model.modules.back();
    ZINF_RETURN_IF_ERROR(engine.set_learning_rate(engine.learning_rate()));
    for (int step = 1; step <= 3; ++step) {
      if (step == 2) ZINF_RETURN_IF_ERROR(engine.set_lr_schedule(ScheduleConfig{}));
      for (auto it = model.modules.rbegin(); it != model.modules.rend(); ++it) {
        ZINF_RETURN_IF_ERROR(engine.gather(*it));
        ZINF_RETURN_IF_ERROR(reduce_module(engine, model, *it, step, false, 0, true));
        ZINF_RETURN_IF_ERROR(engine.release(*it));
      }
      Status again = engine.gather(head);
      if (step == 1) {
        ZINF_RETURN_IF_ERROR(again);
        ZINF_RETURN_IF_ERROR(engine.release(head));
      } else {
        EXPECT_EQ(again.code(), Code::kFailedPrecondition) << again.to_string();
        EXPECT_NE(again.message().find("reduced before the last reduce_gradients()"),
                  std::string::npos)
            << again.to_string();
      }
      ZINF_ASSIGN_OR_RETURN(StepReport rep, engine.step());
      EXPECT_EQ(rep.in_backward, step >= 2) << "step " << step;
      // Every prefetch was gathered: none went to the head (it would be dropped at step()).
      const EngineCounters c = engine.counters();
      if (step >= 2) {
        EXPECT_GT(c.prefetches_issued, 0u);  // the order is recorded in step 1
      }
      EXPECT_EQ(c.prefetches_dropped, 0u) << "step " << step;
      EXPECT_EQ(c.prefetch_hits, c.prefetches_issued) << "step " << step;
    }
    return Status::ok();
  });
}

}  // namespace
}  // namespace zinf
