// Parameter groups through the C API: a parameter registered in a "no decay" group
// (zinf_engine_add_param_group + zinf_engine_register_parameter_in_group) moves exactly as
// decay-free Adam, and one in the default group as AdamW with the optimizer's decay, each against
// a double-precision reference written from torch.optim.AdamW's documented update; a group name
// that was never defined fails finalize naming it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "zinf/zinf.h"

namespace {

constexpr double kLr = 1e-2, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kDecay = 0.1;
constexpr int kSteps = 4;
constexpr std::size_t kElements = 64;

// Stage 3, optimizer state on the host (the SIMD CPU Adam with per-range hyper-parameters).
constexpr const char* kConfig = R"({
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8,
                                            "weight_decay": 0.1}},
  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                        "offload_optimizer": {"device": "cpu"}},
  "zinf": {"cpu_threads": 1}})";

// Seeded values in [-1, 1): x_{k+1} = a x_k + c (mod 2^64), top 53 bits.
std::vector<float> seeded(std::uint64_t seed, std::size_t count) {
  std::vector<float> out(count);
  std::uint64_t x = seed;
  for (float& v : out) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<float>(2.0 * static_cast<double>(x >> 11) / 9007199254740992.0 - 1.0);
  }
  return out;
}

// torch.optim.AdamW, in double: p *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
std::vector<double> adamw_reference(const std::vector<float>& init,
                                    const std::vector<std::vector<float>>& grads, double decay) {
  std::vector<double> p(init.begin(), init.end()), m(p.size(), 0.0), v(p.size(), 0.0);
  for (int t = 1; t <= static_cast<int>(grads.size()); ++t) {
    const std::vector<float>& g = grads[static_cast<std::size_t>(t - 1)];
    for (std::size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1.0 - kLr * decay;
      m[i] = kBeta1 * m[i] + (1.0 - kBeta1) * g[i];
      v[i] = kBeta2 * v[i] + (1.0 - kBeta2) * static_cast<double>(g[i]) * g[i];
      const double m_hat = m[i] / (1.0 - std::pow(kBeta1, t));
      const double v_hat = v[i] / (1.0 - std::pow(kBeta2, t));
      p[i] -= kLr * m_hat / (std::sqrt(v_hat) + kEps);
    }
  }
  return p;
}

double max_rel_diff(const std::vector<float>& got, const std::vector<double>& want) {
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::fabs(got[i] - want[i]) / std::max(1e-2, std::fabs(want[i])));
  }
  return worst;
}

// One rank on a host device, torn down in order.
struct OneRank {
  zinf_config_t* config = nullptr;
  zinf_device_t* device = nullptr;
  zinf_comm_group_t* group = nullptr;
  zinf_engine_t* engine = nullptr;

  OneRank() {
    const std::string json = kConfig;
    EXPECT_EQ(zinf_config_from_json(json.data(), json.size(), &config), ZINF_OK)
        << zinf_last_error_message();
    EXPECT_EQ(zinf_host_device_create(0, 0, &device), ZINF_OK);
    EXPECT_EQ(zinf_local_comm_group_create(&device, 1, 5000, &group), ZINF_OK);
    zinf_comm_t* comm = nullptr;
    EXPECT_EQ(zinf_comm_group_get(group, 0, &comm), ZINF_OK);
    zinf_env_t env{};
    env.struct_size = sizeof env;
    env.device = device;
    env.comm = comm;
    EXPECT_EQ(zinf_engine_open(config, &env, &engine), ZINF_OK) << zinf_last_error_message();
  }
  ~OneRank() {
    zinf_engine_close(engine);
    EXPECT_EQ(zinf_comm_group_destroy(group), ZINF_OK);
    EXPECT_EQ(zinf_device_destroy(device), ZINF_OK);
    zinf_config_destroy(config);
  }
};

TEST(CApiGroups, NoDecayGroupMovesAsDecayFreeAdam) {
  const std::vector<float> w0 = seeded(11, kElements), b0 = seeded(12, kElements);
  std::vector<std::vector<float>> grads;
  for (int t = 0; t < kSteps; ++t)
    grads.push_back(seeded(100 + static_cast<std::uint64_t>(t), kElements));
  OneRank one;
  ASSERT_NE(one.engine, nullptr);
  const std::int64_t shape[] = {static_cast<std::int64_t>(kElements)};
  ASSERT_EQ(zinf_engine_add_param_group(one.engine, "no_decay", 0.0, 1.0), ZINF_OK)
      << zinf_last_error_message();
  ASSERT_EQ(
      zinf_engine_register_parameter(one.engine, "fc.w", "fc", shape, 1, ZINF_DTYPE_F32, w0.data()),
      ZINF_OK)
      << zinf_last_error_message();
  ASSERT_EQ(
      zinf_engine_register_parameter_in_group(one.engine, "fc.b", "fc", shape, 1, ZINF_DTYPE_F32,
                                              "no_decay", b0.data(), nullptr, nullptr),
      ZINF_OK)
      << zinf_last_error_message();
  ASSERT_EQ(zinf_engine_finalize(one.engine), ZINF_OK) << zinf_last_error_message();
  for (int t = 0; t < kSteps; ++t) {
    const std::vector<float>& g = grads[static_cast<std::size_t>(t)];
    ASSERT_EQ(zinf_engine_gather(one.engine, "fc"), ZINF_OK) << zinf_last_error_message();
    const zinf_gradient_t refs[] = {{"fc.w", g.data(), kElements, ZINF_DTYPE_F32},
                                    {"fc.b", g.data(), kElements, ZINF_DTYPE_F32}};
    ASSERT_EQ(zinf_engine_reduce_gradients(one.engine, "fc", refs, 2), ZINF_OK)
        << zinf_last_error_message();
    ASSERT_EQ(zinf_engine_release(one.engine, "fc"), ZINF_OK);
    ASSERT_EQ(zinf_engine_step(one.engine, nullptr), ZINF_OK) << zinf_last_error_message();
  }
  std::vector<float> w(kElements), b(kElements);
  ASSERT_EQ(zinf_engine_read_parameters(one.engine, "fc.w", w.data(), kElements), ZINF_OK);
  ASSERT_EQ(zinf_engine_read_parameters(one.engine, "fc.b", b.data(), kElements), ZINF_OK);
  const std::vector<double> w_want = adamw_reference(w0, grads, kDecay);
  const std::vector<double> b_want = adamw_reference(b0, grads, 0.0);
  EXPECT_LT(max_rel_diff(w, w_want), 1e-6);
  EXPECT_LT(max_rel_diff(b, b_want), 1e-6);
  // The two references differ by far more than the tolerance, so a group that was ignored (or
  // applied to the wrong parameter) fails above.
  EXPECT_GT(max_rel_diff(b, adamw_reference(b0, grads, kDecay)), 1e-4);
}

TEST(CApiGroups, UnknownGroupIsAnErrorNamingIt) {
  OneRank one;
  ASSERT_NE(one.engine, nullptr);
  const std::int64_t shape[] = {8};
  const std::vector<float> values = seeded(5, 8);
  ASSERT_EQ(zinf_engine_add_param_group(one.engine, "no_decay", 0.0, 1.0), ZINF_OK);
  EXPECT_EQ(zinf_engine_add_param_group(one.engine, "no_decay", 0.0, 1.0), ZINF_INVALID_ARGUMENT);
  EXPECT_NE(std::string(zinf_last_error_message()).find("no_decay"), std::string::npos)
      << zinf_last_error_message();
  EXPECT_EQ(zinf_engine_add_param_group(one.engine, "x", 0.0, -1.0), ZINF_INVALID_ARGUMENT);
  EXPECT_EQ(zinf_engine_add_param_group(one.engine, nullptr, 0.0, 1.0), ZINF_INVALID_ARGUMENT);
  EXPECT_EQ(
      zinf_engine_register_parameter_in_group(one.engine, "m.w", "m", shape, 1, ZINF_DTYPE_F32,
                                              "no_decay", nullptr, nullptr, nullptr),
      ZINF_INVALID_ARGUMENT);
  EXPECT_NE(std::string(zinf_last_error_message()).find("exactly one of"), std::string::npos)
      << zinf_last_error_message();
  ASSERT_EQ(
      zinf_engine_register_parameter_in_group(one.engine, "m.w", "m", shape, 1, ZINF_DTYPE_F32,
                                              "no_decy", values.data(), nullptr, nullptr),
      ZINF_OK)
      << zinf_last_error_message();
  EXPECT_EQ(zinf_engine_finalize(one.engine), ZINF_INVALID_ARGUMENT);
  const std::string message = zinf_last_error_message();
  EXPECT_NE(message.find("'no_decy'"), std::string::npos) << message;
  EXPECT_NE(message.find("'m.w'"), std::string::npos) << message;
}

}  // namespace
