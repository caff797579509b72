// A DeepSpeed optimizer section trains as DeepSpeed documents it: type "Adam" is AdamW unless
// adam_w_mode is false, and a parameter the config leaves out takes DeepSpeed's default for the
// type. Each case runs through the engine at stage 3 with the optimizer state on NVMe (2 ranks,
// HostDevice + LocalComm) and is compared with a scalar double-precision reference written here
// from torch's documented update rules (torch.optim.Adam, AdamW, Adagrad).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "engine_test_util.hpp"
#include "zinf/config.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

using engine_test::ScratchDir;

constexpr int kConfigWorld = 2;
constexpr int kConfigSteps = 6;
// Sizes that 2 does not divide and sub-groups (sub_group_size 700) that split a parameter.
const std::vector<std::size_t> kConfigSizes = {1031, 17, 513};

// Parameters of magnitude 0.5..1.5 with a random sign, so that a relative error is meaningful.
std::vector<std::vector<float>> initial_values(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> mag(0.5f, 1.5f);
  std::vector<std::vector<float>> out;
  for (std::size_t n : kConfigSizes) {
    std::vector<float> v(n);
    for (float& x : v) x = (rng() & 1) ? mag(rng) : -mag(rng);
    out.push_back(std::move(v));
  }
  return out;
}

// The gradient of parameter p at step t: the same on every rank (so the average is exact),
// seeded, independent of the parameters. Parameter 1's gradients are of order 1e-9, near the
// optimizers' eps, so that a wrong eps default shows.
std::vector<float> gradient(std::size_t p, int step) {
  std::mt19937_64 rng(1000 * static_cast<std::uint64_t>(step) + p);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const float scale = p == 1 ? 1e-9f : 1.0f;
  std::vector<float> g(kConfigSizes[p]);
  for (float& x : g) x = u(rng) * scale;
  return g;
}

enum class Rule { kAdamL2, kAdamW, kAdagrad };

struct Hyper {
  Rule rule;
  double lr, beta1 = 0.9, beta2 = 0.999, eps, weight_decay;
};

// torch.optim.Adam (L2: g += wd * p), torch.optim.AdamW (p *= 1 - lr * wd first) and
// torch.optim.Adagrad (lr_decay 0: clr = lr; g += wd * p; s += g^2; p -= clr * g / (sqrt(s) +
// eps)), as their documentation writes the algorithms, in double.
std::vector<std::vector<double>> reference(const Hyper& h,
                                           const std::vector<std::vector<float>>& init) {
  std::vector<std::vector<double>> p(init.size()), m(init.size()), v(init.size());
  for (std::size_t i = 0; i < init.size(); ++i) {
    p[i].assign(init[i].begin(), init[i].end());
    m[i].assign(init[i].size(), 0.0);
    v[i].assign(init[i].size(), 0.0);
  }
  for (int t = 1; t <= kConfigSteps; ++t) {
    for (std::size_t i = 0; i < init.size(); ++i) {
      const std::vector<float> g32 = gradient(i, t);
      for (std::size_t k = 0; k < g32.size(); ++k) {
        double g = g32[k];
        double& x = p[i][k];
        if (h.rule == Rule::kAdagrad) {
          g += h.weight_decay * x;
          v[i][k] += g * g;
          x -= h.lr * g / (std::sqrt(v[i][k]) + h.eps);
          continue;
        }
        if (h.rule == Rule::kAdamW) x *= 1.0 - h.lr * h.weight_decay;
        if (h.rule == Rule::kAdamL2) g += h.weight_decay * x;
        m[i][k] = h.beta1 * m[i][k] + (1.0 - h.beta1) * g;
        v[i][k] = h.beta2 * v[i][k] + (1.0 - h.beta2) * g * g;
        const double m_hat = m[i][k] / (1.0 - std::pow(h.beta1, t));
        const double v_hat = v[i][k] / (1.0 - std::pow(h.beta2, t));
        x -= h.lr * m_hat / (std::sqrt(v_hat) + h.eps);
      }
    }
  }
  return p;
}

// Trains through the engine with `optimizer_json` as the config's optimizer section, stage 3,
// optimizer state on NVMe; returns the fp32 masters rank 0 reads back.
std::vector<std::vector<float>> train(const std::string& optimizer_json,
                                      const std::vector<std::vector<float>>& init,
                                      const std::string& dir, OptimizerParams* parsed) {
  const std::string text = fmt::format(R"({{"optimizer": {},
    "zero_optimization": {{"stage": 3,
      "offload_optimizer": {{"device": "nvme", "nvme_path": "{}", "buffer_count": 3}},
      "sub_group_size": 700, "reduce_bucket_size": 600,
      "stage3_param_persistence_threshold": 10}},
    "aio": {{"block_size": 65536, "queue_depth": 8}},
    "zinf": {{"cpu_threads": 1, "collective_timeout_ms": 30000}}}})",
                                       optimizer_json, dir);
  Result<Config> config = parse_config(text);
  EXPECT_TRUE(config.is_ok()) << config.status().to_string() << "\n" << text;
  if (!config.is_ok()) return {};
  *parsed = config->optimizer;
  engine_test::Ranks ranks = engine_test::make_ranks(kConfigWorld);
  std::vector<std::vector<float>> out(init.size());
  const std::vector<Status> statuses =
      engine_test::run_ranks(kConfigWorld, [&](int rank) -> Status {
        Env env;
        env.device = ranks.devices[rank].get();
        env.comm = ranks.comms[rank].get();
        ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::open(*config, env));
        for (std::size_t p = 0; p < init.size(); ++p) {
          ParameterSpec spec;
          spec.name = fmt::format("p{}", p);
          spec.module = fmt::format("m{}", p);
          spec.shape = {static_cast<std::int64_t>(kConfigSizes[p])};
          spec.dtype = DType::kF32;
          spec.initial_values = init[p].data();
          ZINF_RETURN_IF_ERROR(engine->register_parameter(spec));
        }
        for (int t = 1; t <= kConfigSteps; ++t) {
          for (std::size_t p = init.size(); p-- > 0;) {
            const std::string module = fmt::format("m{}", p);
            ZINF_RETURN_IF_ERROR(engine->gather(module));
            const std::vector<float> g = gradient(p, t);
            const std::string name = fmt::format("p{}", p);
            const GradientRef ref{name, g.data(), g.size(), DType::kF32};
            ZINF_RETURN_IF_ERROR(engine->reduce_gradients(module, {&ref, 1}));
            ZINF_RETURN_IF_ERROR(engine->release(module));
          }
          ZINF_ASSIGN_OR_RETURN(StepReport report, engine->step());
          if (report.skipped) return Status::internal("a step was skipped");
        }
        for (std::size_t p = 0; p < init.size(); ++p) {
          std::vector<float> values(kConfigSizes[p]);
          ZINF_RETURN_IF_ERROR(engine->read_parameters(fmt::format("p{}", p), values.data()));
          if (rank == 0) out[p] = std::move(values);
        }
        return Status::ok();
      });
  for (int r = 0; r < kConfigWorld; ++r) {
    EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
  }
  return out;
}

// max |engine - reference| / |reference| over every element (every |reference| is near 0.5 or
// more).
double max_rel(const std::vector<std::vector<float>>& got,
               const std::vector<std::vector<double>>& want) {
  double worst = 0;
  for (std::size_t p = 0; p < want.size(); ++p) {
    if (got[p].size() != want[p].size()) return INFINITY;
    for (std::size_t k = 0; k < want[p].size(); ++k) {
      worst = std::max(worst, std::abs(got[p][k] - want[p][k]) / std::abs(want[p][k]));
    }
  }
  return worst;
}

struct ConfigCase {
  const char* name;
  const char* optimizer_json;
  Hyper expected;
};

TEST(OptimizerConfig, DeepSpeedSectionsTrainAsTorchAtStage3WithNvmeState) {
  const ConfigCase cases[] = {
      // DeepSpeed: type Adam with adam_w_mode left out is AdamW (decoupled decay).
      {"adam_is_adamw",
       R"({"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01}})",
       {Rule::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01}},
      // adam_w_mode false: L2 decay added to the gradient.
      {"adam_l2",
       R"({"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01, "adam_w_mode": false}})",
       {Rule::kAdamL2, 1e-3, 0.9, 0.999, 1e-8, 0.01}},
      // weight_decay left out: DeepSpeed's Adam default 0, no decay at all.
      {"adam_no_decay",
       R"({"type": "Adam", "params": {"lr": 1e-3}})",
       {Rule::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.0}},
      // Adagrad with every default: lr 1e-2, eps 1e-10, weight_decay 0 (torch and DeepSpeed).
      {"adagrad_defaults", R"({"type": "Adagrad"})", {Rule::kAdagrad, 1e-2, 0, 0, 1e-10, 0.0}},
  };
  const std::vector<std::vector<float>> init = initial_values(20261201);
  for (const ConfigCase& c : cases) {
    SCOPED_TRACE(c.name);
    ScratchDir dir(fmt::format("optimizer_config_{}", c.name));
    OptimizerParams parsed;
    const std::vector<std::vector<float>> got = train(c.optimizer_json, init, dir.path(), &parsed);
    ASSERT_EQ(got.size(), init.size());
    const std::vector<std::vector<double>> want = reference(c.expected, init);
    const double rel = max_rel(got, want);
    EXPECT_LE(rel, 1e-6) << "parsed as " << optimizer_name(parsed.kind) << " lr " << parsed.lr
                         << " eps " << parsed.eps << " weight_decay " << parsed.weight_decay;
    // The rules differ by far more than the tolerance, so the check above tells them apart.
    if (c.expected.rule != Rule::kAdagrad) {
      Hyper other = c.expected;
      other.rule = c.expected.rule == Rule::kAdamW ? Rule::kAdamL2 : Rule::kAdamW;
      if (c.expected.weight_decay == 0) other.weight_decay = 0.01;
      EXPECT_GT(max_rel(got, reference(other, init)), 1e-5);
    }
  }
}

}  // namespace
}  // namespace zinf
