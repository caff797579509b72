// ParameterSpec::initializer against ParameterSpec::initial_values: the same model registered both
// ways, on world sizes 1, 2 and 4, stages 1-3 and optimizer state on the device, in host memory
// and on NVMe, gives the same fp32 masters (equal to the initial values), the same gathered device
// copies (the initial values rounded to the dtype), and the same masters after two training
// steps, bit for bit. Every initializer call is recorded: none outside its parameter or outside
// finalize(), and over all ranks every element of every parameter is asked for exactly once.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine_test_util.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::ParamDef;

struct InitCase {
  int world;
  int stage;
  OffloadDevice optimizer;
  OffloadDevice params = OffloadDevice::kNone;
  DType dtype = DType::kF32;
  bool opaque = false;
};

std::string init_case_name(const InitCase& c) {
  return fmt::format("w{}_s{}_opt_{}_param_{}_{}{}", c.world, c.stage,
                     offload_device_name(c.optimizer), offload_device_name(c.params),
                     dtype_name(c.dtype), c.opaque ? "_opaque" : "");
}

// One initializer call.
struct Call {
  std::size_t param;
  std::size_t first_element;
  std::size_t element_count;
  bool during_finalize;
};

// Registers `model` on `engine` with initializers that serve model.initial and record each call
// in `calls` (the rank's own: an engine calls its initializers on its rank's thread). Each
// initializer holds a copy of `token`, so the caller can see when the engine drops them.
Status register_with_initializers(Engine& engine, const Model& model, std::vector<Call>* calls,
                                  const bool* finalizing, const std::shared_ptr<int>& token) {
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    const ParamDef& d = model.params[p];
    ParameterSpec spec;
    spec.name = d.name;
    spec.module = d.module;
    spec.shape = d.shape;
    spec.dtype = d.dtype;
    const std::vector<float>* values = &model.initial[p];
    spec.initializer = [p, values, calls, finalizing, token](
                           std::size_t first_element, std::size_t element_count, float* out) {
      calls->push_back({p, first_element, element_count, *finalizing});
      // Served only inside the parameter; a range outside is recorded and refused.
      if (first_element + element_count > values->size()) {
        return Status::internal(fmt::format("asked for [{}, {}) of {} elements", first_element,
                                            first_element + element_count, values->size()));
      }
      std::memcpy(out, values->data() + first_element, element_count * sizeof(float));
      return Status::ok();
    };
    ZINF_RETURN_IF_ERROR(engine.register_parameter(spec));
  }
  return Status::ok();
}

// The bytes of a gathered device copy (through a device-to-host copy when the device is opaque).
Result<std::vector<std::byte>> view_bytes(Device& device, Stream& stream, const TensorView& view) {
  std::vector<std::byte> out(view.element_count * dtype_bytes(view.dtype));
  if (device.host_accessible()) {
    std::memcpy(out.data(), view.data, out.size());
    return out;
  }
  ZINF_RETURN_IF_ERROR(device.copy_d2h(out.data(), view.data, out.size(), stream));
  ZINF_RETURN_IF_ERROR(device.synchronize(stream, std::chrono::seconds(30)));
  return out;
}

// The initial values rounded to `dtype`, as bytes: what a gathered copy must hold.
std::vector<std::byte> rounded(const std::vector<float>& values, DType dtype) {
  std::vector<std::byte> out(values.size() * dtype_bytes(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
      continue;
    }
    const std::uint16_t bits =
        dtype == DType::kBF16 ? f32_to_bf16(values[i]) : f32_to_f16(values[i]);
    std::memcpy(out.data() + 2 * i, &bits, 2);
  }
  return out;
}

// What one rank saw through one engine.
struct Seen {
  std::vector<std::vector<float>> masters;              // after finalize
  std::vector<std::vector<std::byte>> gathered;         // after finalize
  std::vector<std::vector<float>> masters_after_steps;  // after two steps
};

Status look(Engine& engine, Device& device, const Model& model, Seen* seen) {
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.create_stream("initializer test"));
  seen->gathered.resize(model.params.size());
  for (const std::string& m : model.modules) {
    ZINF_RETURN_IF_ERROR(engine.gather(m));
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      if (model.params[p].module != m) continue;
      ZINF_ASSIGN_OR_RETURN(TensorView view, engine.parameter(model.params[p].name));
      ZINF_ASSIGN_OR_RETURN(seen->gathered[p], view_bytes(device, *stream, view));
    }
    ZINF_RETURN_IF_ERROR(engine.release(m));
  }
  for (const ParamDef& d : model.params) {
    std::vector<float> out(d.element_count());
    ZINF_RETURN_IF_ERROR(engine.read_parameters(d.name, out.data()));
    seen->masters.push_back(std::move(out));
  }
  return Status::ok();
}

Status train_two_steps(Engine& engine, Device& device, const Model& model, int rank, Seen* seen) {
  engine_test::TrainOptions options;
  options.steps = 2;
  options.check_gathered = false;
  options.device = &device;
  std::vector<StepReport> reports;
  ZINF_RETURN_IF_ERROR(engine_test::train_rank(engine, model, rank, options, nullptr, &reports));
  for (const ParamDef& d : model.params) {
    std::vector<float> out(d.element_count());
    ZINF_RETURN_IF_ERROR(engine.read_parameters(d.name, out.data()));
    seen->masters_after_steps.push_back(std::move(out));
  }
  return Status::ok();
}

void run_init_case(const InitCase& c) {
  const std::uint64_t seed =
      4321 + static_cast<std::uint64_t>(c.world) * 10 + static_cast<std::uint64_t>(c.stage);
  std::printf("case %s seed %llu\n", init_case_name(c).c_str(),
              static_cast<unsigned long long>(seed));
  engine_test::ScratchDir dir_values(init_case_name(c) + "_values");
  engine_test::ScratchDir dir_init(init_case_name(c) + "_init");
  const Model model = engine_test::make_model(c.dtype, seed);
  const auto world = static_cast<std::size_t>(c.world);
  // Separate ranks (devices and communicators) for the two engines of each rank, so that their
  // collectives never meet.
  engine_test::Ranks ranks_values =
      engine_test::make_ranks(c.world, std::chrono::seconds(30), 0, c.opaque);
  engine_test::Ranks ranks_init =
      engine_test::make_ranks(c.world, std::chrono::seconds(30), 0, c.opaque);
  std::vector<Seen> by_values(world), by_init(world);
  std::vector<std::vector<Call>> calls(world);
  std::vector<long> token_uses_after_finalize(world, -1);

  std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    Env env_values;
    env_values.device = ranks_values.devices[r].get();
    env_values.comm = ranks_values.comms[r].get();
    ZINF_ASSIGN_OR_RETURN(
        auto values_engine,
        Engine::open(engine_test::small_config(c.stage, c.optimizer, c.params, dir_values.path()),
                     env_values));
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*values_engine, model));
    ZINF_RETURN_IF_ERROR(values_engine->finalize());

    Env env_init;
    env_init.device = ranks_init.devices[r].get();
    env_init.comm = ranks_init.comms[r].get();
    ZINF_ASSIGN_OR_RETURN(
        auto init_engine,
        Engine::open(engine_test::small_config(c.stage, c.optimizer, c.params, dir_init.path()),
                     env_init));
    bool finalizing = false;
    {
      auto token = std::make_shared<int>(0);
      ZINF_RETURN_IF_ERROR(
          register_with_initializers(*init_engine, model, &calls[r], &finalizing, token));
      finalizing = true;
      ZINF_RETURN_IF_ERROR(init_engine->finalize());
      finalizing = false;
      token_uses_after_finalize[r] = token.use_count();
    }

    ZINF_RETURN_IF_ERROR(look(*values_engine, *env_values.device, model, &by_values[r]));
    ZINF_RETURN_IF_ERROR(look(*init_engine, *env_init.device, model, &by_init[r]));
    ZINF_RETURN_IF_ERROR(
        train_two_steps(*values_engine, *env_values.device, model, rank, &by_values[r]));
    ZINF_RETURN_IF_ERROR(train_two_steps(*init_engine, *env_init.device, model, rank, &by_init[r]));
    return Status::ok();
  });
  for (std::size_t r = 0; r < world; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
  }

  for (std::size_t r = 0; r < world; ++r) {
    EXPECT_EQ(token_uses_after_finalize[r], 1) << "rank " << r << " kept its initializers";
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      const std::string& name = model.params[p].name;
      const std::vector<float>& initial = model.initial[p];
      ASSERT_EQ(by_init[r].masters[p].size(), initial.size());
      EXPECT_EQ(std::memcmp(by_init[r].masters[p].data(), initial.data(), initial.size() * 4), 0)
          << "rank " << r << " " << name << ": the master is not the initial values";
      EXPECT_EQ(by_values[r].masters[p], by_init[r].masters[p]) << "rank " << r << " " << name;
      const std::vector<std::byte> want = rounded(initial, model.params[p].dtype);
      EXPECT_EQ(by_init[r].gathered[p], want)
          << "rank " << r << " " << name << ": gathered copy is not the rounded initial values";
      EXPECT_EQ(by_values[r].gathered[p], by_init[r].gathered[p]) << "rank " << r << " " << name;
      // Training moved the masters, the same way for both.
      const std::vector<float>& a = by_values[r].masters_after_steps[p];
      const std::vector<float>& b = by_init[r].masters_after_steps[p];
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0)
          << "rank " << r << " " << name << ": masters after two steps differ";
      EXPECT_NE(std::memcmp(b.data(), initial.data(), b.size() * 4), 0) << name << " never moved";
    }
  }

  // Every element asked for exactly once over all ranks, nothing outside a parameter, nothing
  // outside finalize().
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    std::vector<int> asked(model.params[p].element_count(), 0);
    std::size_t ranks_asked = 0;
    for (std::size_t r = 0; r < world; ++r) {
      bool this_rank = false;
      for (const Call& call : calls[r]) {
        if (call.param != p) continue;
        this_rank = true;
        EXPECT_TRUE(call.during_finalize) << model.params[p].name;
        EXPECT_GT(call.element_count, 0u) << model.params[p].name;
        ASSERT_LE(call.first_element + call.element_count, asked.size())
            << "rank " << r << " asked for [" << call.first_element << ", "
            << call.first_element + call.element_count << ") of " << model.params[p].name;
        for (std::size_t i = 0; i < call.element_count; ++i) ++asked[call.first_element + i];
      }
      ranks_asked += this_rank ? 1 : 0;
    }
    for (std::size_t i = 0; i < asked.size(); ++i) {
      ASSERT_EQ(asked[i], 1) << model.params[p].name << " element " << i;
    }
    // Ranks share the work: the largest parameters (hundreds of elements) are split.
    if (asked.size() >= 400) {
      EXPECT_EQ(ranks_asked, world) << model.params[p].name;
    }
  }
}

// gtest prints a case by its name rather than its bytes.
void PrintTo(const InitCase& c, std::ostream* os) { *os << init_case_name(c); }

class InitializerCases : public ::testing::TestWithParam<InitCase> {};

TEST_P(InitializerCases, SameMastersAndGatheredValuesAsInitialValues) { run_init_case(GetParam()); }

std::vector<InitCase> all_cases() {
  std::vector<InitCase> cases;
  for (int world : {1, 2, 4}) {
    for (int stage : {1, 2, 3}) {
      for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
        cases.push_back({world, stage, opt});
      }
    }
  }
  // Half-precision device copies, parameter shards offloaded, and a device that is not
  // host-accessible (the device optimizer builds the master from the initializers).
  cases.push_back({2, 3, OffloadDevice::kNvme, OffloadDevice::kHost, DType::kBF16});
  cases.push_back({4, 3, OffloadDevice::kHost, OffloadDevice::kNvme, DType::kBF16});
  cases.push_back({2, 2, OffloadDevice::kNone, OffloadDevice::kNone, DType::kBF16});
  cases.push_back({2, 3, OffloadDevice::kNone, OffloadDevice::kNone, DType::kF32, true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, InitializerCases, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<InitCase>& info) {
                           return init_case_name(info.param);
                         });

// --- Errors
// ---------------------------------------------------------------------------------------

TEST(Initializer, RegistrationNeedsExactlyOneSource) {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  Env env;
  env.device = ranks.devices[0].get();
  env.comm = ranks.comms[0].get();
  auto engine = Engine::open(
      engine_test::small_config(2, OffloadDevice::kNone, OffloadDevice::kNone, ""), env);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  const std::vector<float> values = {0.5f, -0.25f, 2.0f};
  ParameterSpec spec;
  spec.name = "layer.w";
  spec.module = "layer";
  spec.shape = {3};
  Status st = (*engine)->register_parameter(spec);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("layer.w"), std::string_view::npos) << st.to_string();
  EXPECT_NE(st.message().find("neither"), std::string_view::npos) << st.to_string();

  spec.initial_values = values.data();
  spec.initializer = [](std::size_t, std::size_t, float*) { return Status::ok(); };
  st = (*engine)->register_parameter(spec);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("layer.w"), std::string_view::npos) << st.to_string();
  EXPECT_NE(st.message().find("both"), std::string_view::npos) << st.to_string();

  // Nothing was registered by the refused calls: the name is free, and either source works.
  spec.initializer = nullptr;
  EXPECT_TRUE((*engine)->register_parameter(spec).is_ok());
  spec.name = "layer.b";
  spec.initial_values = nullptr;
  spec.initializer = [&values](std::size_t first, std::size_t count, float* out) {
    std::memcpy(out, values.data() + first, count * sizeof(float));
    return Status::ok();
  };
  EXPECT_TRUE((*engine)->register_parameter(spec).is_ok());
  ASSERT_TRUE((*engine)->finalize().is_ok());
  std::vector<float> out(3, -1.0f);
  ASSERT_TRUE((*engine)->read_parameters("layer.b", out.data()).is_ok());
  EXPECT_EQ(out, values);
}

// An initializer's error fails finalize() with its code, naming the parameter and the elements,
// and stays: every later call returns it. Over each path that fills the master.
TEST(Initializer, ErrorFailsFinalizeNamingTheParameter) {
  for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
    SCOPED_TRACE(offload_device_name(opt));
    engine_test::ScratchDir dir(fmt::format("initializer_error_{}", offload_device_name(opt)));
    engine_test::Ranks ranks = engine_test::make_ranks(1);
    Env env;
    env.device = ranks.devices[0].get();
    env.comm = ranks.comms[0].get();
    auto engine =
        Engine::open(engine_test::small_config(3, opt, OffloadDevice::kNone, dir.path()), env);
    ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
    const Model model = engine_test::make_model(DType::kBF16, 99);
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      const ParamDef& d = model.params[p];
      ParameterSpec spec{d.name, d.module, d.shape, d.dtype, nullptr, nullptr};
      const std::vector<float>* values = &model.initial[p];
      const bool fails = d.name == "block1.w";
      spec.initializer = [values, fails](std::size_t first, std::size_t count, float* out) {
        if (fails) return Status::io_error("checkpoint shard unreadable", EIO);
        std::memcpy(out, values->data() + first, count * sizeof(float));
        return Status::ok();
      };
      ASSERT_TRUE((*engine)->register_parameter(spec).is_ok());
    }
    const Status st = (*engine)->finalize();
    EXPECT_EQ(st.code(), Code::kIoError) << st.to_string();
    EXPECT_EQ(st.sys_code(), EIO);
    EXPECT_NE(st.message().find("'block1.w'"), std::string_view::npos) << st.to_string();
    EXPECT_NE(st.message().find("elements [0, "), std::string_view::npos) << st.to_string();
    EXPECT_NE(st.message().find("checkpoint shard unreadable"), std::string_view::npos)
        << st.to_string();
    const Status again = (*engine)->gather("block1");
    EXPECT_EQ(again.code(), Code::kIoError);
    EXPECT_EQ(again.message(), st.message());
    EXPECT_FALSE((*engine)->finalized());
  }
}

// An initializer that fails on one rank only (its shard of the file unreadable): the other ranks,
// already waiting in the next collective, fail at once naming that rank and the error, not at the
// collective timeout.
TEST(Initializer, AnErrorOnOneRankFailsTheOthersAtOnce) {
  const int world = 2;
  const Model model = engine_test::make_model(DType::kF32, 98);
  const Config config =
      engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
  engine_test::Ranks ranks = engine_test::make_ranks(world, std::chrono::seconds(30));
  std::vector<Status> errors(world);
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    Env env;
    env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
    env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::open(config, env));
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      const ParamDef& d = model.params[p];
      ParameterSpec spec{d.name, d.module, d.shape, d.dtype, nullptr, nullptr};
      const std::vector<float>* values = &model.initial[p];
      const bool fails = rank == 1 && d.name == "block1.w";
      spec.initializer = [values, fails](std::size_t first, std::size_t count, float* out) {
        if (fails) return Status::io_error("shard unreadable", EIO);
        std::memcpy(out, values->data() + first, count * sizeof(float));
        return Status::ok();
      };
      ZINF_RETURN_IF_ERROR(engine->register_parameter(spec));
    }
    errors[static_cast<std::size_t>(rank)] = engine->finalize();
    return Status::ok();
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(errors[1].code(), Code::kIoError) << errors[1].to_string();
  // The collective in flight fails with the abort's reason (its code), a later one kAborted.
  EXPECT_TRUE(errors[0].code() == Code::kAborted || errors[0].code() == Code::kIoError)
      << errors[0].to_string();
  EXPECT_NE(errors[0].message().find("rank 1 of 2: finalize: the initializer of parameter "
                                     "'block1.w'"),
            std::string_view::npos)
      << errors[0].to_string();
  EXPECT_NE(errors[0].message().find("shard unreadable"), std::string_view::npos)
      << errors[0].to_string();
  EXPECT_LT(seconds, 15.0) << "the collective timeout is 30 s";
}

}  // namespace
}  // namespace zinf
