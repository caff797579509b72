// Parameter groups through the engine: a model whose biases and LayerNorm-like weights are in a
// "no_decay" group (weight_decay 0) and whose head runs at half the learning rate. After a few
// steps on 2 ranks, every parameter must equal a double-precision Adam/AdamW written out here
// from torch's formulas, with its own group's hyper-parameters, at stages 1-3 and with the
// optimizer state on the device (in host memory on a HostDevice, in device memory through the
// device Adam on an opaque one), in host memory ("cpu") and on NVMe. And a learning-rate
// schedule stepped by step(), resumed from a checkpoint mid-warm-up, continues the same curve.
// And partition_group_ranges() gives the padding of a frozen partitioner group to the frozen
// group, a trainable group's to the default group, at world 3, against ranges worked by hand.
#include "engine/param_groups.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "engine/layout.hpp"
#include "engine/rank_exchange.hpp"
#include "engine_test_util.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

struct Param {
  std::string name, module, group;
  std::vector<std::int64_t> shape;
  std::size_t count() const {
    std::size_t n = 1;
    for (std::int64_t d : shape) n *= static_cast<std::size_t>(d);
    return n;
  }
};

std::vector<Param> model() {
  std::vector<Param> m;
  for (int l = 0; l < 3; ++l) {
    const std::string mod = fmt::format("layer{}", l);
    m.push_back({mod + ".w", mod, "", {23, 17 + l}});
    m.push_back({mod + ".b", mod, "no_decay", {17 + l}});
    m.push_back({mod + ".ln", mod, "no_decay", {17 + l}});
  }
  m.push_back({"head.w", "head", "head", {11, 7}});
  m.push_back({"head.b", "head", "no_decay", {7}});
  return m;
}

// A value in [0, 1) that depends only on (seed, index).
double uniform_at(std::uint64_t seed, std::size_t index) {
  SplitMix64 rng(seed * 0x100000001b3ull + index);
  return rng.uniform();
}

float initial(std::size_t p, std::size_t i) {
  return static_cast<float>(uniform_at(0x5eed + p, i) * 2.0 - 1.0);
}
// Rank r's gradient at step t (from 1): seeded, independent of the parameters.
float grad(int rank, int t, std::size_t p, std::size_t i) {
  return static_cast<float>(uniform_at(0x9a0000 + static_cast<std::uint64_t>(rank) * 1000 +
                                           static_cast<std::uint64_t>(t) * 50 + p,
                                       i) *
                                2.0 -
                            1.0);
}

constexpr double kLr = 1e-2, kWd = 0.1, kHeadScale = 0.5;
constexpr int kGroupsWorld = 2;

// torch.optim.AdamW (weight_decay 0 is plain Adam), in double, on the mean gradient over ranks.
std::vector<std::vector<double>> reference(const std::vector<Param>& m, int steps,
                                           const std::vector<double>& lr_per_step) {
  std::vector<std::vector<double>> out(m.size());
  for (std::size_t p = 0; p < m.size(); ++p) {
    const double wd = m[p].group == "no_decay" ? 0.0 : kWd;
    const double scale = m[p].group == "head" ? kHeadScale : 1.0;
    out[p].resize(m[p].count());
    for (std::size_t i = 0; i < m[p].count(); ++i) {
      double x = initial(p, i), mo = 0, v = 0;
      for (int t = 1; t <= steps; ++t) {
        double g = 0;
        for (int r = 0; r < kGroupsWorld; ++r) g += grad(r, t, p, i);
        g /= kGroupsWorld;
        const double lr = lr_per_step[static_cast<std::size_t>(t - 1)] * scale;
        x *= 1.0 - lr * wd;
        mo = 0.9 * mo + 0.1 * g;
        v = 0.999 * v + 0.001 * g * g;
        const double mhat = mo / (1.0 - std::pow(0.9, t));
        const double vhat = v / (1.0 - std::pow(0.999, t));
        x -= lr * mhat / (std::sqrt(vhat) + 1e-8);
      }
      out[p][i] = x;
    }
  }
  return out;
}

// Uploads host gradients for a device that is not host-accessible.
class Uploads {
 public:
  explicit Uploads(Device& device) : device_(device) {}
  Result<const void*> put(const std::vector<float>& g) {
    if (device_.host_accessible()) return static_cast<const void*>(g.data());
    if (stream_ == nullptr) {
      ZINF_ASSIGN_OR_RETURN(stream_, device_.create_stream("test"));
    }
    ZINF_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::allocate(device_, g.size() * 4));
    ZINF_RETURN_IF_ERROR(device_.copy_h2d(b.data(), g.data(), g.size() * 4, *stream_));
    ZINF_RETURN_IF_ERROR(device_.synchronize(*stream_, std::chrono::seconds(30)));
    buffers_.push_back(std::move(b));
    return static_cast<const void*>(buffers_.back().data());
  }
  void clear() { buffers_.clear(); }

 private:
  Device& device_;
  std::unique_ptr<Stream> stream_;
  std::vector<DeviceBuffer> buffers_;
};

Status open_and_register(Engine& e, const std::vector<Param>& m,
                         std::vector<std::vector<float>>& init) {
  ZINF_RETURN_IF_ERROR(e.add_param_group({"no_decay", 0.0, 1.0}));
  ZINF_RETURN_IF_ERROR(e.add_param_group({"head", -1.0, kHeadScale}));
  for (std::size_t p = 0; p < m.size(); ++p) {
    ParameterSpec s;
    s.name = m[p].name;
    s.module = m[p].module;
    s.shape = m[p].shape;
    s.group = m[p].group;
    s.initial_values = init[p].data();
    ZINF_RETURN_IF_ERROR(e.register_parameter(s));
  }
  return Status::ok();
}

// Steps first..last on one rank: every module's gradients each step, modules in reverse. Records
// the learning rate each step ran with (learning_rate() before it) in *lrs when given.
Status train(Engine& e, Device& device, const std::vector<Param>& m, int rank, int first, int last,
             std::vector<double>* lrs) {
  Uploads up(device);
  const std::vector<std::string> modules = {"layer0", "layer1", "layer2", "head"};
  for (int t = first; t <= last; ++t) {
    if (lrs != nullptr) lrs->push_back(e.learning_rate());
    for (auto it = modules.rbegin(); it != modules.rend(); ++it) {
      ZINF_RETURN_IF_ERROR(e.gather(*it));
      std::vector<std::vector<float>> g;
      std::vector<std::size_t> ids;
      for (std::size_t p = 0; p < m.size(); ++p) {
        if (m[p].module != *it) continue;
        std::vector<float> v(m[p].count());
        for (std::size_t i = 0; i < v.size(); ++i) v[i] = grad(rank, t, p, i);
        g.push_back(std::move(v));
        ids.push_back(p);
      }
      std::vector<GradientRef> refs;
      for (std::size_t k = 0; k < ids.size(); ++k) {
        ZINF_ASSIGN_OR_RETURN(const void* data, up.put(g[k]));
        refs.push_back({m[ids[k]].name, data, g[k].size(), DType::kF32});
      }
      ZINF_RETURN_IF_ERROR(e.reduce_gradients(*it, refs));
      ZINF_RETURN_IF_ERROR(e.release(*it));
      up.clear();
    }
    ZINF_ASSIGN_OR_RETURN(StepReport r, e.step());
    if (r.skipped) return Status::internal(fmt::format("step {} skipped", t));
  }
  return Status::ok();
}

struct GroupsCase {
  int stage;
  OffloadDevice opt;
  bool opaque;
};

std::string case_name(const GroupsCase& c) {
  const char* home = c.opt == OffloadDevice::kNone   ? (c.opaque ? "device" : "none")
                     : c.opt == OffloadDevice::kHost ? "cpu"
                                                     : "nvme";
  return fmt::format("stage{}_{}", c.stage, home);
}

class ParamGroups : public ::testing::TestWithParam<GroupsCase> {};

TEST_P(ParamGroups, NoDecayGroupMovesAsAdamOthersAsAdamW) {
  const GroupsCase c = GetParam();
  const std::vector<Param> m = model();
  std::vector<std::vector<float>> init(m.size());
  for (std::size_t p = 0; p < m.size(); ++p) {
    for (std::size_t i = 0; i < m[p].count(); ++i) init[p].push_back(initial(p, i));
  }
  constexpr int kSteps = 6;
  engine_test::ScratchDir dir("param_groups_" + case_name(c));
  Config config = engine_test::small_config(c.stage, c.opt, OffloadDevice::kNone, dir.path());
  config.optimizer.lr = kLr;
  config.optimizer.weight_decay = kWd;
  engine_test::Ranks ranks =
      engine_test::make_ranks(kGroupsWorld, std::chrono::seconds(30), 0, c.opaque);
  std::vector<std::vector<float>> got(m.size());
  std::vector<Status> st = engine_test::run_ranks(kGroupsWorld, [&](int rank) -> Status {
    Env env;
    env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
    env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::open(config, env));
    ZINF_RETURN_IF_ERROR(open_and_register(*e, m, init));
    ZINF_RETURN_IF_ERROR(train(*e, *env.device, m, rank, 1, kSteps, nullptr));
    for (std::size_t p = 0; p < m.size(); ++p) {
      std::vector<float> out(m[p].count());
      ZINF_RETURN_IF_ERROR(e->read_parameters(m[p].name, out.data()));
      if (rank == 0) got[p] = std::move(out);
    }
    return Status::ok();
  });
  for (int r = 0; r < kGroupsWorld; ++r) ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
  const std::vector<double> lrs(kSteps, kLr);
  const std::vector<std::vector<double>> want = reference(m, kSteps, lrs);
  // 1e-6 relative on the size of the update-moved value: the engine is float, the reference
  // double. (A group's decay applied to the wrong parameters moves them by lr * wd * steps =
  // 6e-3 relative.)
  for (std::size_t p = 0; p < m.size(); ++p) {
    double worst = 0;
    for (std::size_t i = 0; i < want[p].size(); ++i) {
      worst = std::max(worst,
                       std::fabs(got[p][i] - want[p][i]) / std::max(1e-2, std::fabs(want[p][i])));
    }
    EXPECT_LT(worst, 1e-5) << m[p].name << " (group '" << m[p].group << "')";
  }
}

std::vector<GroupsCase> groups_cases() {
  std::vector<GroupsCase> out;
  for (int stage = 1; stage <= 3; ++stage) {
    for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
      out.push_back({stage, opt, false});
    }
    out.push_back({stage, OffloadDevice::kNone, true});  // the device Adam
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Homes, ParamGroups, ::testing::ValuesIn(groups_cases()),
                         [](const ::testing::TestParamInfo<GroupsCase>& info) {
                           return case_name(info.param);
                         });

// A parameter naming a group nobody defined fails finalize, naming both; groups are defined
// before finalize only.
TEST(ParamGroupsErrors, UnknownGroupAndLateDefinition) {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
  Env env;
  env.device = ranks.devices[0].get();
  env.comm = ranks.comms[0].get();
  Result<std::unique_ptr<Engine>> e = Engine::open(config, env);
  ASSERT_TRUE(e.is_ok());
  std::vector<float> v(4, 1.0f);
  ParameterSpec s;
  s.name = "x.b";
  s.module = "x";
  s.shape = {4};
  s.group = "nodecay";
  s.initial_values = v.data();
  ASSERT_TRUE((*e)->register_parameter(s).is_ok());
  EXPECT_EQ((*e)->add_param_group({"", 0.0, 1.0}).code(), Code::kInvalidArgument);
  ASSERT_TRUE((*e)->add_param_group({"no_decay", 0.0, 1.0}).is_ok());
  EXPECT_EQ((*e)->add_param_group({"no_decay", 0.0, 1.0}).code(), Code::kInvalidArgument);
  EXPECT_EQ((*e)->add_param_group({"neg", 0.0, -1.0}).code(), Code::kInvalidArgument);
  const Status f = (*e)->finalize();
  EXPECT_EQ(f.code(), Code::kInvalidArgument);
  EXPECT_NE(f.message().find("'x.b'"), std::string::npos) << f.to_string();
  EXPECT_NE(f.message().find("'nodecay'"), std::string::npos) << f.to_string();
  EXPECT_EQ((*e)->add_param_group({"late", 0.0, 1.0}).code(), Code::kFailedPrecondition);
}

// A WarmupLR schedule stepped by step(): the rates the steps run with are DeepSpeed's
// (lr_at(k - 2) for the k-th step), the parameters follow the reference on those rates, and a
// run resumed from a checkpoint after step 3 of an 8-step warm-up continues the same curve to
// the same parameters.
TEST(ParamGroupsSchedule, WarmupStepsAndResumesMidWarmup) {
  const std::vector<Param> m = model();
  std::vector<std::vector<float>> init(m.size());
  for (std::size_t p = 0; p < m.size(); ++p) {
    for (std::size_t i = 0; i < m[p].count(); ++i) init[p].push_back(initial(p, i));
  }
  constexpr int kSteps = 6;
  ScheduleConfig sched;
  sched.kind = ScheduleKind::kWarmupLR;
  sched.warmup_min_lr = 1e-3;
  sched.warmup_max_lr = 2e-2;
  sched.warmup_num_steps = 8;
  sched.warmup_linear = true;
  // DeepSpeed's curve: step k runs with min + (max - min) * (k - 2) / 8, min at k = 1 and 2.
  std::vector<double> want_lrs;
  for (int k = 1; k <= kSteps; ++k) {
    want_lrs.push_back(k <= 2 ? 1e-3 : 1e-3 + (2e-2 - 1e-3) * (k - 2) / 8.0);
  }
  engine_test::ScratchDir dir("param_groups_schedule");
  Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
  config.optimizer.lr = kLr;
  config.optimizer.weight_decay = kWd;
  const std::string ckpt = dir.path() + "/ckpt";
  for (bool resume : {false, true}) {
    engine_test::Ranks ranks = engine_test::make_ranks(kGroupsWorld);
    std::vector<std::vector<float>> got(m.size());
    std::vector<double> lrs;
    std::vector<Status> st = engine_test::run_ranks(kGroupsWorld, [&](int rank) -> Status {
      Env env;
      env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
      env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
      std::vector<double> my_lrs;
      {
        ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::open(config, env));
        ZINF_RETURN_IF_ERROR(open_and_register(*e, m, init));
        ZINF_RETURN_IF_ERROR(e->set_lr_schedule(sched));
        ZINF_RETURN_IF_ERROR(train(*e, *env.device, m, rank, 1, resume ? 3 : kSteps, &my_lrs));
        if (resume) ZINF_RETURN_IF_ERROR(e->save_checkpoint(ckpt));
        if (!resume) {
          for (std::size_t p = 0; p < m.size(); ++p) {
            std::vector<float> out(m[p].count());
            ZINF_RETURN_IF_ERROR(e->read_parameters(m[p].name, out.data()));
            if (rank == 0) got[p] = std::move(out);
          }
        }
      }
      if (resume) {
        // A fresh engine, as a restarted job: same schedule, the checkpoint's step count.
        ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::open(config, env));
        ZINF_RETURN_IF_ERROR(open_and_register(*e, m, init));
        ZINF_RETURN_IF_ERROR(e->set_lr_schedule(sched));
        ZINF_RETURN_IF_ERROR(e->load_checkpoint(ckpt));
        ZINF_RETURN_IF_ERROR(train(*e, *env.device, m, rank, 4, kSteps, &my_lrs));
        for (std::size_t p = 0; p < m.size(); ++p) {
          std::vector<float> out(m[p].count());
          ZINF_RETURN_IF_ERROR(e->read_parameters(m[p].name, out.data()));
          if (rank == 0) got[p] = std::move(out);
        }
      }
      if (rank == 0) lrs = my_lrs;
      return Status::ok();
    });
    for (int r = 0; r < kGroupsWorld; ++r) ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
    ASSERT_EQ(lrs.size(), want_lrs.size());
    for (std::size_t k = 0; k < lrs.size(); ++k) {
      EXPECT_NEAR(lrs[k], want_lrs[k], 1e-15) << "step " << k + 1 << (resume ? " (resumed)" : "");
    }
    const std::vector<std::vector<double>> want = reference(m, kSteps, want_lrs);
    for (std::size_t p = 0; p < m.size(); ++p) {
      double worst = 0;
      for (std::size_t i = 0; i < want[p].size(); ++i) {
        worst = std::max(worst,
                         std::fabs(got[p][i] - want[p][i]) / std::max(1e-2, std::fabs(want[p][i])));
      }
      EXPECT_LT(worst, 1e-5) << m[p].name << (resume ? " (resumed)" : "");
    }
  }
}

// partition_group_ranges at world 3 (stage 2, one partitioner group a module, each padded to a
// multiple of 3 * 128 elements): "base" (500 elements, frozen) is padded to 768, shards of 256;
// "full" (768, frozen) has no padding; "lora" (100, trainable, in group "lora", index 1) is padded
// to 384, shards of 128. Each rank's partition: base's shard at 0, full's at 256, lora's at 512,
// 640 elements; the frozen group is 2. By hand:
//   rank 0: base [0, 256) and full [256, 512) frozen; lora [512, 612) group 1, its padding
//           [612, 640) group 0.
//   rank 1: base [0, 244) and its padding [244, 256) frozen (the padding of a frozen group goes
//           with it), full frozen; lora's shard, padding alone, group 0 (the reducer writes it).
//   rank 2: base's shard, padding alone, frozen; full frozen; lora's, padding alone, group 0.
TEST(PartitionGroupRanges, AFrozenGroupsPaddingIsFrozenATrainableGroupsStaysInTheDefault) {
  constexpr int kRanks = 3;
  const std::vector<ParamGroup> groups = {{"lora", -1.0, 1.0}};
  const std::vector<float> base(500, 0.25f), full(768, -0.5f), lora(100, 0.75f);
  engine_test::Ranks ranks = engine_test::make_ranks(kRanks);
  std::vector<std::vector<OptimizerRange>> got(kRanks);
  std::vector<Status> st = engine_test::run_ranks(kRanks, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    Config config;
    config.zero.stage = 2;
    ParameterLayout layout;
    struct Def {
      const char* name;
      const std::vector<float>* values;
      bool trainable;
      const char* group;
    };
    for (const Def& d : {Def{"base", &base, false, ""}, Def{"full", &full, false, ""},
                         Def{"lora", &lora, true, "lora"}}) {
      ParameterSpec spec;
      spec.name = std::string(d.name) + ".w";
      spec.module = d.name;
      spec.shape = {static_cast<std::int64_t>(d.values->size())};
      spec.initial_values = d.values->data();
      spec.trainable = d.trainable;
      spec.group = d.group;
      ZINF_RETURN_IF_ERROR(layout.add(spec));
    }
    Device& device = *ranks.devices[r];
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.create_stream("test"));
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Event> event, device.create_event());
    StickyError sticky;
    ZINF_ASSIGN_OR_RETURN(RankExchange exchange,
                          RankExchange::create(device, *ranks.comms[r], *stream, *event,
                                               std::chrono::seconds(30), sticky));
    ZINF_RETURN_IF_ERROR(layout.lay_out(config, rank, kRanks, exchange));
    EXPECT_EQ(frozen_group(groups), 2u);
    EXPECT_EQ(layout.partition_elements(), 640u);
    ZINF_ASSIGN_OR_RETURN(got[r], partition_group_ranges(layout, rank, groups));
    return Status::ok();
  });
  for (int rank = 0; rank < kRanks; ++rank) {
    ASSERT_TRUE(st[static_cast<std::size_t>(rank)].is_ok())
        << st[static_cast<std::size_t>(rank)].to_string();
  }
  auto print = [](const std::vector<OptimizerRange>& ranges) {
    std::string s;
    for (const OptimizerRange& r : ranges) s += fmt::format(" [{}: {}]", r.begin, r.group);
    return s;
  };
  const std::vector<std::vector<std::pair<std::size_t, std::uint32_t>>> want = {
      {{0, 2}, {512, 1}, {612, 0}},
      {{0, 2}, {512, 0}},
      {{0, 2}, {512, 0}},
  };
  for (std::size_t rank = 0; rank < kRanks; ++rank) {
    std::vector<std::pair<std::size_t, std::uint32_t>> ranges;
    for (const OptimizerRange& r : got[rank]) ranges.emplace_back(r.begin, r.group);
    EXPECT_EQ(ranges, want[rank]) << "rank " << rank << ":" << print(got[rank]);
  }
}

}  // namespace
}  // namespace zinf
