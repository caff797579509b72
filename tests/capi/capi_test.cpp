// The C API (include/zinf/zinf.h): a model trained through it from C (capi_c_part.c, compiled as
// C99) on 1 and 2 ranks ends with the same bits in every fp32 master as the same run through
// zinf::Engine in C++ (also when C registers through a C initializer function instead of
// initial values); errors come back with the right code and a message naming the key,
// module or parameter; nothing is thrown across the boundary; versioned structs are written
// only as far as the caller's struct_size.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "capi/capi_internal.hpp"
#include "capi_c_part.h"
#include "common/scratch_dir.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"
#include "zinf/version.hpp"
#include "zinf/zinf.h"

namespace zinf {
namespace {

using test::ScratchDir;

struct Case {
  const char* name;
  int world;
  int stage;
  const char* optimizer;  // offload_optimizer.device
  const char* params;     // offload_param.device
  int micro_batches;
  bool fp16;
  double clipping;
  // The C run registers through zinf_engine_register_parameter_with_initializer (the C++ run
  // always through initial values).
  bool initializer = false;
};

// gtest prints a case by its name rather than its bytes.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::string case_json(const Case& c, const std::string& nvme_dir) {
  return fmt::format(
      R"({{
  "gradient_clipping": {},
  "fp16": {{"enabled": {}, "initial_scale_power": 4}},
  "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.01}}}},
  "zero_optimization": {{
    "stage": {},
    "offload_optimizer": {{"device": "{}", "nvme_path": "{}", "buffer_count": 3}},
    "offload_param": {{"device": "{}", "nvme_path": "{}", "buffer_count": 2}},
    "sub_group_size": 200, "reduce_bucket_size": 128,
    "stage3_prefetch_bucket_size": 600, "stage3_max_live_parameters": 100000,
    "stage3_param_persistence_threshold": 16
  }},
  "aio": {{"block_size": 4096, "queue_depth": 8}},
  "zinf": {{"cpu_threads": 1, "collective_timeout_ms": 20000}}
}})",
      c.clipping, c.fp16 ? "true" : "false", c.stage, c.optimizer, nvme_dir, c.params, nvme_dir);
}

constexpr std::uint64_t kSeed = 20261130;
constexpr int kSteps = 6;
constexpr int kLrChangeStep = 4;
constexpr double kLrChangeValue = 0.004;

// The same training loop as capi_c_part.c's train_rank(), through zinf::Engine directly.
Status train_cpp_rank(const Config& config, Device& device, Communicator& comm,
                      const std::string& nvme_dir, const Case& c,
                      std::vector<std::vector<float>>* finals, StepReport* last,
                      StepReport* before_lr_change, EngineCounters* counters) {
  Env env;
  env.device = &device;
  env.comm = &comm;
  if (!nvme_dir.empty()) env.nvme_paths = {nvme_dir};
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::open(config, env));
  const std::size_t param_count = capi_model_param_count();
  std::vector<std::vector<float>> grads(param_count);
  for (std::size_t p = 0; p < param_count; ++p) {
    const capi_param_def_t* d = capi_model_param(p);
    std::vector<float> initial(capi_model_element_count(p));
    capi_model_initial(p, kSeed, initial.data());
    ZINF_RETURN_IF_ERROR(engine->register_parameter(
        {d->name, d->module, std::vector<std::int64_t>(d->shape, d->shape + d->ndim),
         static_cast<DType>(d->dtype), initial.data()}));
    grads[p].resize(initial.size());
  }
  ZINF_RETURN_IF_ERROR(engine->finalize());
  const std::size_t module_count = capi_model_module_count();
  for (int step = 1; step <= kSteps; ++step) {
    if (step == kLrChangeStep) ZINF_RETURN_IF_ERROR(engine->set_learning_rate(kLrChangeValue));
    for (int micro = 0; micro < c.micro_batches; ++micro) {
      const double loss_scale = engine->loss_scale();
      for (std::size_t m = 0; m < module_count; ++m) {
        ZINF_RETURN_IF_ERROR(engine->gather(capi_model_module(m)));
        ZINF_RETURN_IF_ERROR(engine->release(capi_model_module(m)));
      }
      for (std::size_t m = module_count; m-- > 0;) {
        const std::string module = capi_model_module(m);
        ZINF_RETURN_IF_ERROR(engine->gather(module));
        std::vector<GradientRef> refs;
        for (std::size_t p = 0; p < param_count; ++p) {
          const capi_param_def_t* d = capi_model_param(p);
          if (module != d->module) continue;
          ZINF_ASSIGN_OR_RETURN(TensorView view, engine->parameter(d->name));
          capi_model_grad(p, view.data, comm.rank(), step, micro, loss_scale, grads[p].data());
          refs.push_back({d->name, grads[p].data(), view.element_count, view.dtype});
        }
        ZINF_RETURN_IF_ERROR(engine->reduce_gradients(module, refs));
        ZINF_RETURN_IF_ERROR(engine->release(module));
      }
    }
    ZINF_ASSIGN_OR_RETURN(*last, engine->step());
    if (step + 1 == kLrChangeStep) *before_lr_change = *last;
  }
  for (std::size_t p = 0; p < param_count; ++p) {
    std::vector<float> out(capi_model_element_count(p));
    ZINF_RETURN_IF_ERROR(engine->read_parameters(capi_model_param(p)->name, out.data()));
    finals->push_back(std::move(out));
  }
  *counters = engine->counters();
  return Status::ok();
}

class CApiTraining : public ::testing::TestWithParam<Case> {};

TEST_P(CApiTraining, MastersEqualTheCppEngineRun) {
  const Case& c = GetParam();
  std::printf("case %s seed %llu\n", c.name, static_cast<unsigned long long>(kSeed));
  ScratchDir dir(c.name);
  const std::string json = case_json(c, dir.path());
  const std::size_t param_count = capi_model_param_count();
  const auto world = static_cast<std::size_t>(c.world);

  // Through C.
  std::vector<std::vector<float>> c_finals(world * param_count);
  std::vector<float*> c_final_ptrs;
  for (std::size_t i = 0; i < c_finals.size(); ++i) {
    c_finals[i].assign(capi_model_element_count(i % param_count), std::nanf(""));
    c_final_ptrs.push_back(c_finals[i].data());
  }
  std::vector<zinf_step_report_t> c_reports(world), c_before_change(world);
  std::vector<zinf_engine_counters_t> c_counters(world);
  zinf_trace_t* trace = nullptr;
  ASSERT_EQ(zinf_trace_create(0, &trace), ZINF_OK);
  capi_run_t run{};
  run.trace = trace;
  run.counters = c_counters.data();
  run.config_json = json.c_str();
  run.nvme_dir = dir.path().c_str();
  run.world_size = c.world;
  run.steps = kSteps;
  run.micro_batches = c.micro_batches;
  run.seed = kSeed;
  run.lr_change_step = kLrChangeStep;
  run.lr_change_value = kLrChangeValue;
  run.finals = c_final_ptrs.data();
  run.reports = c_reports.data();
  run.reports_before_lr_change = c_before_change.data();
  run.use_initializer = c.initializer ? 1 : 0;
  std::vector<std::vector<std::uint32_t>> asked(world * param_count);
  std::vector<std::uint32_t*> asked_ptrs;
  for (std::size_t i = 0; i < asked.size(); ++i) {
    asked[i].assign(capi_model_element_count(i % param_count), 0);
    asked_ptrs.push_back(asked[i].data());
  }
  run.asked = asked_ptrs.data();
  char error[2048] = {0};
  ASSERT_EQ(capi_c_train(&run, error, sizeof error), 0) << error;
  if (c.initializer) {
    // Over all ranks, every element of every parameter was asked for exactly once.
    for (std::size_t p = 0; p < param_count; ++p) {
      for (std::size_t i = 0; i < capi_model_element_count(p); ++i) {
        std::uint32_t total = 0;
        for (std::size_t r = 0; r < world; ++r) total += asked[r * param_count + p][i];
        ASSERT_EQ(total, 1u) << capi_model_param(p)->name << " element " << i;
      }
    }
  }
  // The engines' spans and the C ranks' own, in one Chrome trace file.
  std::size_t kept = 0, dropped = 0;
  ASSERT_EQ(zinf_trace_event_count(trace, &kept, &dropped), ZINF_OK);
  EXPECT_EQ(dropped, 0u);
  const std::string trace_path = dir.path() + "/trace.json";
  ASSERT_EQ(zinf_trace_write_json(trace, trace_path.c_str()), ZINF_OK) << zinf_last_error_message();
  ASSERT_EQ(zinf_trace_destroy(trace), ZINF_OK) << zinf_last_error_message();
  {
    std::ifstream in(trace_path);
    const nlohmann::json doc = nlohmann::json::parse(in);
    std::set<std::string> tracks;
    std::map<int, std::string> track_of_tid;
    std::map<std::string, int> user_spans;  // rank tracks' spans by name
    std::size_t spans = 0;
    for (const nlohmann::json& ev : doc.at("traceEvents")) {
      if (ev.at("ph") == "M" && ev.at("name") == "thread_name") {
        const std::string name = ev.at("args").at("name").get<std::string>();
        tracks.insert(name);
        track_of_tid[ev.at("tid").get<int>()] = name;
      }
    }
    for (const nlohmann::json& ev : doc.at("traceEvents")) {
      if (ev.at("ph") != "X") continue;
      ++spans;
      if (track_of_tid[ev.at("tid").get<int>()].rfind("rank ", 0) == 0) {
        ++user_spans[ev.at("name").get<std::string>()];
      }
    }
    EXPECT_EQ(spans, kept);
    for (int r = 0; r < c.world; ++r) {
      EXPECT_TRUE(tracks.count(fmt::format("rank{} engine", r))) << "no engine track of " << r;
    }
    for (int r = 0; r < c.world; ++r) EXPECT_TRUE(tracks.count(fmt::format("rank {}", r)));
    EXPECT_EQ(user_spans["forward"], c.world * kSteps * c.micro_batches);
    EXPECT_EQ(user_spans["backward"], c.world * kSteps * c.micro_batches);
  }

  // Through C++.
  Result<Config> config = parse_config(json);
  ASSERT_TRUE(config.is_ok()) << config.status().to_string();
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> raw;
  for (int r = 0; r < c.world; ++r) {
    HostDeviceOptions o;
    o.ordinal = r;
    devices.push_back(std::move(make_host_device(o)).value());
    raw.push_back(devices.back().get());
  }
  LocalCommOptions co;
  co.timeout = std::chrono::seconds(20);
  std::vector<std::unique_ptr<Communicator>> comms =
      std::move(make_local_comm_group(raw, co)).value();
  std::vector<std::vector<std::vector<float>>> cpp_finals(world);
  std::vector<StepReport> cpp_reports(world), cpp_before_change(world);
  std::vector<EngineCounters> cpp_counters(world);
  std::vector<Status> statuses(world);
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      statuses[r] = train_cpp_rank(*config, *devices[r], *comms[r], dir.path(), c, &cpp_finals[r],
                                   &cpp_reports[r], &cpp_before_change[r], &cpp_counters[r]);
    });
  }
  for (std::thread& t : threads) t.join();
  for (std::size_t r = 0; r < world; ++r) {
    ASSERT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
  }

  for (std::size_t r = 0; r < world; ++r) {
    for (std::size_t p = 0; p < param_count; ++p) {
      const std::vector<float>& got = c_finals[r * param_count + p];
      const std::vector<float>& want = cpp_finals[r][p];
      ASSERT_EQ(got.size(), want.size());
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
          << "rank " << r << " parameter " << capi_model_param(p)->name;
      // The run trained something: the masters left their initial values.
      std::vector<float> initial(got.size());
      capi_model_initial(p, kSeed, initial.data());
      double moved = 0.0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(std::isfinite(got[i]));
        moved = std::max(moved, static_cast<double>(std::fabs(got[i] - initial[i])));
      }
      EXPECT_GT(moved, 1e-3) << capi_model_param(p)->name;
    }
    const zinf_step_report_t& cr = c_reports[r];
    const StepReport& pr = cpp_reports[r];
    EXPECT_EQ(cr.struct_size, sizeof(zinf_step_report_t));
    EXPECT_EQ(cr.step, pr.step);
    EXPECT_EQ(cr.step, kSteps);
    EXPECT_EQ(cr.skipped, pr.skipped ? 1 : 0);
    EXPECT_EQ(cr.micro_batches, c.micro_batches);
    EXPECT_EQ(cr.grad_norm, pr.grad_norm);
    EXPECT_GT(cr.grad_norm, 0.0);
    EXPECT_EQ(cr.clip_coef, pr.clip_coef);
    EXPECT_EQ(cr.loss_scale, pr.loss_scale);
    EXPECT_EQ(cr.next_loss_scale, pr.next_loss_scale);
    if (c.fp16) {
      EXPECT_EQ(cr.loss_scale, 16.0);
    }
    if (c.clipping > 0) {
      EXPECT_LT(cr.clip_coef, 1.0);
    }
    if (std::string(c.optimizer) == "nvme") {
      EXPECT_GT(cr.optimizer_nvme_read_bytes, 0u);
      EXPECT_EQ(cr.optimizer_nvme_read_bytes, pr.optimizer_nvme_read_bytes);
    }
    EXPECT_GE(cr.wall_ns, 0);
    EXPECT_EQ(cr.overlapped, pr.overlapped ? 1 : 0);
    EXPECT_EQ(cr.in_backward, pr.in_backward ? 1 : 0);
    EXPECT_EQ(cr.read_ahead, pr.read_ahead ? 1 : 0);
    // The state in a store: the step is overlapped. The run sets the learning rate
    // (kLrChangeStep), after which no pass begins during the backward.
    EXPECT_EQ(cr.overlapped, std::string(c.optimizer) != "none" ? 1 : 0);
    EXPECT_EQ(cr.in_backward, 0);
    EXPECT_EQ(cr.read_ahead, 0);
    // The step before: its pass opened during the backward where the state is in a store at
    // stages 2-3 and each step has one micro-batch (the count the config leaves at 1), and only
    // read ahead there: the config does not declare gradient_accumulation_steps, so a later step
    // could still bring more micro-batches.
    const zinf_step_report_t& cb = c_before_change[r];
    const bool opens = c.stage >= 2 && std::string(c.optimizer) != "none" && c.micro_batches == 1;
    EXPECT_EQ(cb.in_backward, 0);
    EXPECT_EQ(cb.read_ahead, opens ? 1 : 0);
    EXPECT_EQ(cb.in_backward, cpp_before_change[r].in_backward ? 1 : 0);
    EXPECT_EQ(cb.read_ahead, cpp_before_change[r].read_ahead ? 1 : 0);
    EXPECT_GE(cr.hidden_ns, 0);
    EXPECT_GE(cr.gather_wait_ns, 0);
    // Counters that do not depend on timing: the calls made and the bytes reduced.
    const zinf_engine_counters_t& cc = c_counters[r];
    const EngineCounters& pc = cpp_counters[r];
    EXPECT_EQ(cc.struct_size, sizeof(zinf_engine_counters_t));
    EXPECT_EQ(cc.gathers,
              static_cast<std::uint64_t>(kSteps * c.micro_batches * 2) * capi_model_module_count());
    EXPECT_EQ(cc.gathers, pc.gathers);
    EXPECT_EQ(cc.steps, static_cast<std::uint64_t>(kSteps));
    EXPECT_EQ(cc.steps, pc.steps);
    EXPECT_EQ(cc.skipped_steps, pc.skipped_steps);
    EXPECT_EQ(cc.reduce_scatter_bytes, pc.reduce_scatter_bytes);
    EXPECT_EQ(cc.buckets_reduced, pc.buckets_reduced);
    EXPECT_EQ(cc.persistent_elements, pc.persistent_elements);
    EXPECT_EQ(cc.live_elements, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CApiTraining,
    ::testing::Values(Case{"w1_s2_none_mb2", 1, 2, "none", "none", 2, false, 0.0},
                      Case{"w1_s3_nvme_opt", 1, 3, "nvme", "cpu", 1, false, 0.0},
                      Case{"w2_s3_cpu_cpu_fp16_clip", 2, 3, "cpu", "cpu", 1, true, 0.05},
                      Case{"w2_s1_nvme", 2, 1, "nvme", "none", 2, false, 0.0},
                      Case{"w2_s3_none_nvme_params", 2, 3, "none", "nvme", 1, false, 0.0},
                      Case{"w1_s2_none_initializer", 1, 2, "none", "none", 1, false, 0.0, true},
                      Case{"w2_s3_nvme_initializer", 2, 3, "nvme", "cpu", 2, false, 0.0, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST(CApi, ErrorPathsFromC) {
  char error[2048] = {0};
  EXPECT_EQ(capi_c_error_paths(error, sizeof error), 0) << error;
}

TEST(CApi, CodesAndDtypesMapOneForOne) {
  for (int code = 0; code <= 13; ++code) {
    EXPECT_EQ(std::string(zinf_code_name(static_cast<zinf_code_t>(code))),
              std::string(code_name(static_cast<Code>(code))));
  }
  EXPECT_STREQ(zinf_code_name(static_cast<zinf_code_t>(14)), "unknown");
  EXPECT_STREQ(zinf_code_name(ZINF_CODE_MAX_ENUM), "unknown");
  static_assert(sizeof(zinf_code_t) == sizeof(int) && sizeof(zinf_dtype_t) == sizeof(int));
  EXPECT_STREQ(zinf_code_name(ZINF_FAILED_PRECONDITION), "failed_precondition");
  EXPECT_STREQ(zinf_version(), version());
  EXPECT_EQ(zinf_c_abi_version(), ZINF_C_ABI_VERSION);
}

// Runs a C call and checks its code and that the message contains `part`.
#define EXPECT_CODE(call, code, part)                                                      \
  do {                                                                                     \
    const zinf_code_t got_ = (call);                                                       \
    EXPECT_EQ(got_, code) << #call << ": " << zinf_code_name(got_) << ": "                 \
                          << zinf_last_error_message();                                    \
    EXPECT_EQ(zinf_last_error_code(), code);                                               \
    EXPECT_NE(std::string(zinf_last_error_message()).find(part), std::string::npos)        \
        << #call << ": message \"" << zinf_last_error_message() << "\" lacks \"" << (part) \
        << "\"";                                                                           \
  } while (0)

TEST(CApi, ConfigErrorsNameTheKeyAndFile) {
  zinf_config_t* config = nullptr;
  const std::string unknown_key = R"({"zero_optimization": {"stage": 2, "bogus_knob": 1}})";
  EXPECT_CODE(zinf_config_from_json(unknown_key.data(), unknown_key.size(), &config),
              ZINF_INVALID_ARGUMENT, "zero_optimization.bogus_knob");
  EXPECT_EQ(config, nullptr);
  const std::string bad_type = R"({"optimizer": {"params": {"lr": "fast"}}})";
  EXPECT_CODE(zinf_config_from_json(bad_type.data(), bad_type.size(), &config),
              ZINF_INVALID_ARGUMENT, "optimizer.params.lr");
  const std::string malformed = R"({"zero_optimization": )";
  EXPECT_CODE(zinf_config_from_json(malformed.data(), malformed.size(), &config),
              ZINF_INVALID_ARGUMENT, "");
  EXPECT_NE(std::string(zinf_last_error_message()), "");
  // Only json_bytes bytes are read: a valid prefix of a longer buffer parses.
  const std::string padded = R"({"zero_optimization": {"stage": 1}}garbage)";
  ASSERT_EQ(zinf_config_from_json(padded.data(), padded.size() - 7, &config), ZINF_OK)
      << zinf_last_error_message();
  EXPECT_CODE(zinf_config_from_json(nullptr, 0, &config), ZINF_INVALID_ARGUMENT, "json is null");

  zinf_config_t* missing = nullptr;
  EXPECT_CODE(zinf_config_load("/nonexistent/capi/ds_config.json", &missing), ZINF_NOT_FOUND,
              "/nonexistent/capi/ds_config.json");
  EXPECT_EQ(missing, nullptr);
  // A directory given as the config's path: ZINF_IO_ERROR naming it, as zinf.h promises.
  {
    ScratchDir not_a_file("config_dir");
    EXPECT_CODE(zinf_config_load(not_a_file.path().c_str(), &missing), ZINF_IO_ERROR,
                not_a_file.path() + ": Is a directory");
    EXPECT_EQ(zinf_last_error_sys_code(), EISDIR);
    EXPECT_EQ(missing, nullptr);
  }

  // to_json: ask the size, then write; a small buffer is refused whole.
  std::size_t needed = 0;
  EXPECT_CODE(zinf_config_to_json(config, nullptr, 0, &needed), ZINF_RESOURCE_EXHAUSTED, "bytes");
  ASSERT_GT(needed, 1u);
  std::string small(needed - 1, 'x');
  EXPECT_EQ(zinf_config_to_json(config, small.data(), small.size(), nullptr),
            ZINF_RESOURCE_EXHAUSTED);
  EXPECT_EQ(small, std::string(needed - 1, 'x'));
  std::vector<char> buffer(needed);
  ASSERT_EQ(zinf_config_to_json(config, buffer.data(), buffer.size(), nullptr), ZINF_OK);
  Result<Config> back = parse_config(buffer.data());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->zero.stage, 1);

  // A file written from it loads back.
  ScratchDir dir("config");
  const std::string path = dir.path() + "/ds_config.json";
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(buffer.data(), f);
  std::fclose(f);
  zinf_config_t* loaded = nullptr;
  ASSERT_EQ(zinf_config_load(path.c_str(), &loaded), ZINF_OK) << zinf_last_error_message();
  std::vector<char> again(needed);
  ASSERT_EQ(zinf_config_to_json(loaded, again.data(), again.size(), nullptr), ZINF_OK);
  EXPECT_STREQ(again.data(), buffer.data());
  zinf_config_destroy(loaded);
  zinf_config_destroy(config);
  zinf_config_destroy(nullptr);
}

// One rank's engine on a fresh device and group, closed in the right order by the destructor.
class OneRank {
 public:
  explicit OneRank(const std::string& json) {
    EXPECT_EQ(zinf_config_from_json(json.data(), json.size(), &config_), ZINF_OK)
        << zinf_last_error_message();
    EXPECT_EQ(zinf_host_device_create(0, 0, &device_), ZINF_OK);
    EXPECT_EQ(zinf_local_comm_group_create(&device_, 1, 5000, &group_), ZINF_OK);
    EXPECT_EQ(zinf_comm_group_get(group_, 0, &comm_), ZINF_OK);
    env_.struct_size = sizeof env_;
    env_.device = device_;
    env_.comm = comm_;
  }
  ~OneRank() {
    zinf_engine_close(engine_);
    EXPECT_EQ(zinf_comm_group_destroy(group_), ZINF_OK) << zinf_last_error_message();
    EXPECT_EQ(zinf_device_destroy(device_), ZINF_OK) << zinf_last_error_message();
    zinf_config_destroy(config_);
  }
  zinf_code_t open() { return zinf_engine_open(config_, &env_, &engine_); }

  zinf_config_t* config_ = nullptr;
  zinf_device_t* device_ = nullptr;
  zinf_comm_group_t* group_ = nullptr;
  zinf_comm_t* comm_ = nullptr;
  zinf_env_t env_{};
  zinf_engine_t* engine_ = nullptr;
};

constexpr const char* kStage2 =
    R"({"zero_optimization": {"stage": 2}, "zinf": {"cpu_threads": 1}})";

TEST(CApi, EngineErrorsNameWhatWasWrongAndChangeNothing) {
  OneRank one(kStage2);
  zinf_env_t bad_env = one.env_;
  bad_env.struct_size = 0;
  zinf_engine_t* engine = nullptr;
  EXPECT_CODE(zinf_engine_open(one.config_, &bad_env, &engine), ZINF_INVALID_ARGUMENT,
              "struct_size");
  bad_env = one.env_;
  bad_env.comm = nullptr;
  EXPECT_CODE(zinf_engine_open(one.config_, &bad_env, &engine), ZINF_INVALID_ARGUMENT,
              "env->comm is null");
  EXPECT_EQ(engine, nullptr);
  ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
  zinf_engine_t* e = one.engine_;

  const std::int64_t shape[2] = {3, 4};
  std::vector<float> values(12);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.1f * static_cast<float>(i) - 0.5f;
  EXPECT_CODE(
      zinf_engine_register_parameter(e, nullptr, "m", shape, 2, ZINF_DTYPE_F32, values.data()),
      ZINF_INVALID_ARGUMENT, "name is null");
  EXPECT_CODE(zinf_engine_register_parameter(e, "m.w", "m", shape, 2, static_cast<zinf_dtype_t>(7),
                                             values.data()),
              ZINF_INVALID_ARGUMENT, "m.w");
  EXPECT_CODE(
      zinf_engine_register_parameter(e, "m.w", "m", nullptr, 2, ZINF_DTYPE_F32, values.data()),
      ZINF_INVALID_ARGUMENT, "shape is null");
  const std::int64_t bad_shape[2] = {3, -4};
  EXPECT_CODE(
      zinf_engine_register_parameter(e, "m.w", "m", bad_shape, 2, ZINF_DTYPE_F32, values.data()),
      ZINF_INVALID_ARGUMENT, "m.w");
  ASSERT_EQ(zinf_engine_register_parameter(e, "m.w", "m", shape, 2, ZINF_DTYPE_F32, values.data()),
            ZINF_OK);
  EXPECT_EQ(zinf_last_error_code(), ZINF_OK);
  EXPECT_STREQ(zinf_last_error_message(), "");
  EXPECT_CODE(
      zinf_engine_register_parameter(e, "m.w", "m", shape, 2, ZINF_DTYPE_F32, values.data()),
      ZINF_INVALID_ARGUMENT, "m.w");
  const float scalar = 2.0f;
  ASSERT_EQ(zinf_engine_register_parameter(e, "m.s", "m", nullptr, 0, ZINF_DTYPE_F32, &scalar),
            ZINF_OK);

  zinf_memory_report_t memory{};
  memory.struct_size = sizeof memory;
  EXPECT_CODE(zinf_engine_memory(e, &memory), ZINF_FAILED_PRECONDITION, "finalized");
  ASSERT_EQ(zinf_engine_finalize(e), ZINF_OK) << zinf_last_error_message();
  EXPECT_CODE(
      zinf_engine_register_parameter(e, "m.late", "m", shape, 2, ZINF_DTYPE_F32, values.data()),
      ZINF_FAILED_PRECONDITION, "");
  ASSERT_EQ(zinf_engine_memory(e, &memory), ZINF_OK);
  // Stage 2, optimizer on the device: all state is device memory (the 13 parameters' f32 copy,
  // master, moments and accumulator at least); the host holds only the engine's publish copy of
  // the new f32 values (this rank's partition, 4 B a parameter).
  EXPECT_GE(memory.device_bytes, 13u * 16u);
  EXPECT_GE(memory.host_bytes, 13u * 4u);
  EXPECT_LE(memory.host_bytes, 13u * 64u);
  EXPECT_EQ(memory.nvme_bytes, 0u);

  EXPECT_CODE(zinf_engine_gather(e, "no_such_module"), ZINF_NOT_FOUND, "no_such_module");
  void* data = reinterpret_cast<void*>(0x1);
  EXPECT_CODE(zinf_engine_parameter(e, "no_such_param", &data, nullptr, nullptr), ZINF_NOT_FOUND,
              "no_such_param");
  EXPECT_EQ(data, reinterpret_cast<void*>(0x1));  // untouched on failure

  // Gradients: wrong size, missing one, unknown module, null name. Nothing is reduced by any.
  std::vector<float> grad(12, 0.25f);
  zinf_gradient_t refs[2] = {{"m.w", grad.data(), 11, ZINF_DTYPE_F32},
                             {"m.s", grad.data(), 1, ZINF_DTYPE_F32}};
  EXPECT_CODE(zinf_engine_reduce_gradients(e, "m", refs, 2), ZINF_INVALID_ARGUMENT, "m.w");
  refs[0].element_count = 12;
  EXPECT_CODE(zinf_engine_reduce_gradients(e, "m", refs, 1), ZINF_INVALID_ARGUMENT, "m.s");
  EXPECT_CODE(zinf_engine_reduce_gradients(e, "nope", refs, 2), ZINF_NOT_FOUND, "nope");
  refs[1].name = nullptr;
  EXPECT_CODE(zinf_engine_reduce_gradients(e, "m", refs, 2), ZINF_INVALID_ARGUMENT,
              "gradients[1].name is null");
  refs[1].name = "m.s";
  EXPECT_CODE(zinf_engine_reduce_gradients(e, "m", nullptr, 2), ZINF_INVALID_ARGUMENT,
              "gradients is null");
  // A step before any gradient: refused, naming a parameter.
  zinf_step_report_t report{};
  report.struct_size = sizeof report;
  EXPECT_CODE(zinf_engine_step(e, &report), ZINF_FAILED_PRECONDITION, "m.");
  report.struct_size = 0;
  EXPECT_CODE(zinf_engine_step(e, &report), ZINF_INVALID_ARGUMENT, "struct_size");
  EXPECT_CODE(zinf_engine_set_learning_rate(e, std::nan("")), ZINF_INVALID_ARGUMENT,
              "learning_rate");
  EXPECT_CODE(zinf_engine_set_learning_rate(e, -1.0), ZINF_INVALID_ARGUMENT, "learning_rate");

  // Still usable: the good calls go through, and the step sees exactly one micro-batch.
  ASSERT_EQ(zinf_engine_reduce_gradients(e, "m", refs, 2), ZINF_OK) << zinf_last_error_message();
  report.struct_size = sizeof report;
  ASSERT_EQ(zinf_engine_step(e, &report), ZINF_OK) << zinf_last_error_message();
  EXPECT_EQ(report.step, 1);
  EXPECT_EQ(report.micro_batches, 1);
  // The gradient norm of a constant 0.25 over 13 elements.
  EXPECT_NEAR(report.grad_norm, 0.25 * std::sqrt(13.0), 1e-6);

  std::vector<float> out(12, -7.0f);
  EXPECT_CODE(zinf_engine_read_parameters(e, "m.w", out.data(), 11), ZINF_INVALID_ARGUMENT,
              "12 elements");
  EXPECT_EQ(out[0], -7.0f);
  EXPECT_CODE(zinf_engine_read_parameters(e, "m.zzz", out.data(), 12), ZINF_NOT_FOUND, "m.zzz");
  ASSERT_EQ(zinf_engine_read_parameters(e, "m.w", out.data(), 12), ZINF_OK);
  // AdamW's first step moves each weight by lr (1e-3 by default) against the gradient's sign,
  // plus the decay lr * wd * w.
  for (std::size_t i = 0; i < out.size(); ++i) {
    EXPECT_NEAR(out[i], values[i] - 1e-3f - 1e-3f * 0.01f * values[i], 1e-6f) << i;
  }
  double scale = 0.0;
  ASSERT_EQ(zinf_engine_loss_scale(e, &scale), ZINF_OK);
  EXPECT_EQ(scale, 1.0);

  // zinf_engine_step_average: one micro-batch divided by 4 has a quarter of its norm; a count
  // below the micro-batches reduced is refused and changes nothing.
  ASSERT_EQ(zinf_engine_reduce_gradients(e, "m", refs, 2), ZINF_OK) << zinf_last_error_message();
  EXPECT_CODE(zinf_engine_step_average(e, -1, &report), ZINF_INVALID_ARGUMENT, "average_over");
  ASSERT_EQ(zinf_engine_reduce_gradients(e, "m", refs, 2), ZINF_OK) << zinf_last_error_message();
  EXPECT_CODE(zinf_engine_step_average(e, 1, &report), ZINF_INVALID_ARGUMENT,
              "below the 2 micro-batches");
  ASSERT_EQ(zinf_engine_step_average(e, 8, &report), ZINF_OK) << zinf_last_error_message();
  EXPECT_EQ(report.step, 2);
  EXPECT_EQ(report.micro_batches, 2);
  EXPECT_DOUBLE_EQ(report.grad_norm, 0.25 * std::sqrt(13.0) / 4);
}

// A C initializer: user points at the parameter's values, or at nothing to fail with
// ZINF_IO_ERROR.
zinf_code_t initializer_from(void* user, size_t first_element, size_t element_count, float* out) {
  if (user == nullptr) return ZINF_IO_ERROR;
  std::memcpy(out, static_cast<const float*>(user) + first_element, element_count * sizeof(float));
  return ZINF_OK;
}

TEST(CApi, InitializerGivesTheSameMastersAndItsErrorsAreNamed) {
  const int64_t shape[] = {3, 4};
  std::vector<float> values(12);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.37f * float(i) - 1.9f;
  {
    OneRank one(kStage2);
    ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
    EXPECT_CODE(zinf_engine_register_parameter_with_initializer(one.engine_, "m.w", "m", shape, 2,
                                                                ZINF_DTYPE_BF16, nullptr, nullptr),
                ZINF_INVALID_ARGUMENT, "\"m.w\": initializer is null");
    EXPECT_CODE(
        zinf_engine_register_parameter_with_initializer(
            one.engine_, "m.w", "", shape, 2, ZINF_DTYPE_BF16, initializer_from, values.data()),
        ZINF_INVALID_ARGUMENT, "m.w");
    ASSERT_EQ(
        zinf_engine_register_parameter_with_initializer(
            one.engine_, "m.w", "m", shape, 2, ZINF_DTYPE_BF16, initializer_from, values.data()),
        ZINF_OK)
        << zinf_last_error_message();
    ASSERT_EQ(zinf_engine_register_parameter(one.engine_, "m.v", "m", shape, 2, ZINF_DTYPE_BF16,
                                             values.data()),
              ZINF_OK);
    ASSERT_EQ(zinf_engine_finalize(one.engine_), ZINF_OK) << zinf_last_error_message();
    // The master is the initial values, bit for bit, the same as through initial_values.
    std::vector<float> from_init(12, -7.0f), from_values(12, -7.0f);
    ASSERT_EQ(zinf_engine_read_parameters(one.engine_, "m.w", from_init.data(), 12), ZINF_OK);
    ASSERT_EQ(zinf_engine_read_parameters(one.engine_, "m.v", from_values.data(), 12), ZINF_OK);
    EXPECT_EQ(std::memcmp(from_init.data(), values.data(), 12 * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(from_init.data(), from_values.data(), 12 * sizeof(float)), 0);
    // So is the device copy: the values rounded to bf16.
    ASSERT_EQ(zinf_engine_gather(one.engine_, "m"), ZINF_OK);
    void* w = nullptr;
    void* v = nullptr;
    ASSERT_EQ(zinf_engine_parameter(one.engine_, "m.w", &w, nullptr, nullptr), ZINF_OK);
    ASSERT_EQ(zinf_engine_parameter(one.engine_, "m.v", &v, nullptr, nullptr), ZINF_OK);
    for (std::size_t i = 0; i < 12; ++i) {
      EXPECT_EQ(static_cast<const std::uint16_t*>(w)[i], f32_to_bf16(values[i])) << i;
    }
    EXPECT_EQ(std::memcmp(w, v, 12 * 2), 0);
  }
  {
    OneRank one(kStage2);
    ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
    ASSERT_EQ(zinf_engine_register_parameter_with_initializer(
                  one.engine_, "m.bad", "m", shape, 2, ZINF_DTYPE_F32, initializer_from, nullptr),
              ZINF_OK);
    EXPECT_CODE(zinf_engine_finalize(one.engine_), ZINF_IO_ERROR,
                "initializer of parameter 'm.bad' failed for elements [0, 12): the C initializer "
                "returned code 3");
    // Sticky, as any finalize error.
    EXPECT_CODE(zinf_engine_gather(one.engine_, "m"), ZINF_IO_ERROR, "m.bad");
  }
}

TEST(CApi, OpenChecksTheWorldSizeKey) {
  OneRank one(R"({"zero_optimization": {"stage": 3}, "zinf": {"world_size": 2}})");
  EXPECT_CODE(one.open(), ZINF_INVALID_ARGUMENT, "zinf.world_size");
  EXPECT_EQ(one.engine_, nullptr);
}

// A cudaStream_t is a CudaDevice's: on a HostDevice engine it is refused (kUnsupported in a
// build without CUDA, kInvalidArgument naming the device with it), and NULL clears the stream.
TEST(CApi, ComputeStreamIsACudaStreamOfTheEnginesDevice) {
  OneRank one(kStage2);
  ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
  int fake_stream = 0;
#if defined(ZINF_HAVE_CUDA)
  EXPECT_CODE(zinf_engine_set_cuda_stream(one.engine_, &fake_stream), ZINF_INVALID_ARGUMENT,
              "host:0");
#else
  EXPECT_CODE(zinf_engine_set_cuda_stream(one.engine_, &fake_stream), ZINF_UNSUPPORTED,
              "ZINF_WITH_CUDA");
#endif
  EXPECT_EQ(zinf_engine_set_cuda_stream(one.engine_, nullptr), ZINF_OK)
      << zinf_last_error_message();
  EXPECT_CODE(zinf_engine_set_cuda_stream(nullptr, nullptr), ZINF_INVALID_ARGUMENT, "engine");
}

// The group constructors of one process per rank name the null argument, with the backends or
// without them.
TEST(CApi, ProcessGroupsNameTheNullArgument) {
  zinf_device_t* device = nullptr;
  ASSERT_EQ(zinf_host_device_create(0, 0, &device), ZINF_OK);
  zinf_comm_group_t* group = nullptr;
  EXPECT_CODE(zinf_nccl_comm_group_create(nullptr, nullptr, 0, 0, &group), ZINF_INVALID_ARGUMENT,
              "zinf_nccl_comm_group_create: device is null");
  EXPECT_CODE(zinf_nccl_comm_group_create(device, nullptr, 0, 0, nullptr), ZINF_INVALID_ARGUMENT,
              "zinf_nccl_comm_group_create: out is null");
  EXPECT_CODE(zinf_mpi_comm_group_create(nullptr, nullptr, 0, &group), ZINF_INVALID_ARGUMENT,
              "zinf_mpi_comm_group_create: device is null");
  EXPECT_CODE(zinf_mpi_comm_group_create(device, nullptr, 0, nullptr), ZINF_INVALID_ARGUMENT,
              "zinf_mpi_comm_group_create: out is null");
  EXPECT_CODE(zinf_cuda_device_create(0, 0, nullptr), ZINF_INVALID_ARGUMENT,
              "zinf_cuda_device_create: out is null");
  EXPECT_EQ(group, nullptr);
  EXPECT_EQ(zinf_device_destroy(device), ZINF_OK);
}

// A communicator timeout other than the config's is warned about in the C API's words too: the
// C caller gave the group's timeout_ms, not MpiCommOptions / LocalCommOptions::timeout.
TEST(CApi, ATimeoutMismatchIsWarnedInTheCApisWords) {
  const std::string json = kStage2;
  zinf_config_t* config = nullptr;
  ASSERT_EQ(zinf_config_from_json(json.data(), json.size(), &config), ZINF_OK);
  zinf_device_t* device = nullptr;
  ASSERT_EQ(zinf_host_device_create(0, 0, &device), ZINF_OK);
  zinf_comm_group_t* group = nullptr;
  ASSERT_EQ(zinf_local_comm_group_create(&device, 1, 7000, &group), ZINF_OK);
  zinf_comm_t* comm = nullptr;
  ASSERT_EQ(zinf_comm_group_get(group, 0, &comm), ZINF_OK);
  zinf_env_t env{};
  env.struct_size = sizeof env;
  env.device = device;
  env.comm = comm;
  zinf_engine_t* engine = nullptr;
  ::testing::internal::CaptureStderr();
  const zinf_code_t opened = zinf_engine_open(config, &env, &engine);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(opened, ZINF_OK) << zinf_last_error_message();
  EXPECT_NE(log.find("was made with a collective timeout of 7000 ms"), std::string::npos) << log;
  EXPECT_NE(log.find("the timeout_ms of zinf_mpi_comm_group_create / "
                     "zinf_local_comm_group_create"),
            std::string::npos)
      << log;
  zinf_engine_close(engine);
  EXPECT_EQ(zinf_comm_group_destroy(group), ZINF_OK);
  EXPECT_EQ(zinf_device_destroy(device), ZINF_OK);
  zinf_config_destroy(config);
}

TEST(CApi, HandlesRefuseToGoWhileUsed) {
  zinf_device_t* devices[2] = {nullptr, nullptr};
  ASSERT_EQ(zinf_host_device_create(0, 0, &devices[0]), ZINF_OK);
  ASSERT_EQ(zinf_host_device_create(1, 0, &devices[1]), ZINF_OK);
  zinf_comm_group_t* group = nullptr;
  EXPECT_CODE(zinf_local_comm_group_create(devices, 0, 0, &group), ZINF_INVALID_ARGUMENT,
              "world_size");
  zinf_device_t* with_null[2] = {devices[0], nullptr};
  EXPECT_CODE(zinf_local_comm_group_create(with_null, 2, 0, &group), ZINF_INVALID_ARGUMENT,
              "devices[1]");
  EXPECT_EQ(group, nullptr);
  ASSERT_EQ(zinf_local_comm_group_create(devices, 2, 0, &group), ZINF_OK);
  int world = 0;
  ASSERT_EQ(zinf_comm_group_world_size(group, &world), ZINF_OK);
  EXPECT_EQ(world, 2);
  zinf_comm_t* comm = nullptr;
  EXPECT_CODE(zinf_comm_group_get(group, 2, &comm), ZINF_INVALID_ARGUMENT, "rank 2");
  // "This process's rank" has no one answer in a group of every rank as threads.
  EXPECT_CODE(zinf_comm_group_get(group, ZINF_RANK_OF_THIS_PROCESS, &comm), ZINF_INVALID_ARGUMENT,
              "rank -1 (ZINF_RANK_OF_THIS_PROCESS) asks for this process's rank in a group of one "
              "process per rank");
  EXPECT_CODE(zinf_comm_group_get(group, -2, &comm), ZINF_INVALID_ARGUMENT, "rank -2");
  EXPECT_EQ(comm, nullptr);
  ASSERT_EQ(zinf_comm_group_get(group, 1, &comm), ZINF_OK);
  EXPECT_CODE(zinf_device_destroy(devices[1]), ZINF_FAILED_PRECONDITION, "host:1");

  // An env whose communicator runs on another device.
  zinf_config_t* config = nullptr;
  const std::string json = kStage2;
  ASSERT_EQ(zinf_config_from_json(json.data(), json.size(), &config), ZINF_OK);
  zinf_env_t env{};
  env.struct_size = sizeof env;
  env.device = devices[0];
  env.comm = comm;
  zinf_engine_t* engine = nullptr;
  EXPECT_CODE(zinf_engine_open(config, &env, &engine), ZINF_INVALID_ARGUMENT, "host:1");
  // A second engine on a communicator an open engine uses is refused (their collectives would
  // interleave); once the first is closed the communicator takes another.
  env.device = devices[1];
  ASSERT_EQ(zinf_engine_open(config, &env, &engine), ZINF_OK);
  zinf_engine_t* second = nullptr;
  EXPECT_CODE(zinf_engine_open(config, &env, &second), ZINF_FAILED_PRECONDITION,
              "env->comm (local rank 1 of 2) is used by another open engine");
  EXPECT_EQ(second, nullptr);
  zinf_engine_close(engine);
  ASSERT_EQ(zinf_engine_open(config, &env, &second), ZINF_OK);
  zinf_engine_close(second);
  zinf_config_destroy(config);

  ASSERT_EQ(zinf_comm_group_destroy(group), ZINF_OK);
  EXPECT_EQ(zinf_device_destroy(devices[0]), ZINF_OK);
  EXPECT_EQ(zinf_device_destroy(devices[1]), ZINF_OK);
  EXPECT_EQ(zinf_device_destroy(nullptr), ZINF_OK);
  EXPECT_EQ(zinf_comm_group_destroy(nullptr), ZINF_OK);
  zinf_engine_close(nullptr);
}

// Keeps the engine handle zinf_run_local lends to rank 0, for use after the job; only rank 0
// writes, so the rank threads do not race on *user.
zinf_code_t keep_lent_engine(void* user, zinf_engine_t* engine, int rank) {
  if (rank == 0) *static_cast<zinf_engine_t**>(user) = engine;
  return ZINF_OK;
}

// A handle used after zinf_engine_close (or closed twice) is refused by its address; nothing of
// the freed engine is read. So is a lent one after zinf_run_local returned.
TEST(CApi, AClosedEngineIsRefusedNotRead) {
  OneRank one(kStage2);
  ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
  zinf_engine_t* closed = one.engine_;
  const std::int64_t shape[1] = {8};
  std::vector<float> values(8);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i) - 1.0f;
  ASSERT_EQ(
      zinf_engine_register_parameter(closed, "m.w", "m", shape, 1, ZINF_DTYPE_F32, values.data()),
      ZINF_OK);
  zinf_engine_close(closed);
  one.engine_ = nullptr;
  EXPECT_CODE(zinf_engine_gather(closed, "m"), ZINF_INVALID_ARGUMENT,
              "zinf_engine_gather: engine ");
  EXPECT_CODE(zinf_engine_gather(closed, "m"), ZINF_INVALID_ARGUMENT, "is not open");
  zinf_step_report_t report{};
  report.struct_size = sizeof report;
  EXPECT_CODE(zinf_engine_step(closed, &report), ZINF_INVALID_ARGUMENT, "is not open");
  int rank = -1;
  EXPECT_CODE(zinf_engine_rank(closed, &rank), ZINF_INVALID_ARGUMENT, "is not open");
  EXPECT_EQ(rank, -1);
  // A second close does nothing: the group and the device count the engine as gone once, so
  // OneRank's destructor destroys them.
  zinf_engine_close(closed);

  zinf_engine_t* lent = nullptr;
  ASSERT_EQ(zinf_run_local(2, one.config_, &keep_lent_engine, &lent), ZINF_OK)
      << zinf_last_error_message();
  ASSERT_NE(lent, nullptr);
  EXPECT_CODE(zinf_engine_world_size(lent, &rank), ZINF_INVALID_ARGUMENT, "is not open");
}

// Two closes of one handle racing on two threads: one closes it, the other finds it gone and
// does nothing, so the engine is freed once and the device and group count it out once.
TEST(CApi, RacingClosesOfOneEngineCloseItOnce) {
  constexpr int kRounds = 40;
  for (int round = 0; round < kRounds; ++round) {
    OneRank one(kStage2);
    const int group_users = one.group_->users.load();
    const int device_users = one.device_->users.load();  // the group's communicator counts too
    ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
    ASSERT_EQ(one.group_->users.load(), group_users + 1);
    zinf_engine_t* engine = one.engine_;
    std::atomic<int> ready{0};
    const auto close = [&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      zinf_engine_close(engine);
    };
    std::thread first(close);
    std::thread second(close);
    first.join();
    second.join();
    one.engine_ = nullptr;
    ASSERT_EQ(one.group_->users.load(), group_users) << "round " << round;
    ASSERT_EQ(one.device_->users.load(), device_users) << "round " << round;
    ASSERT_FALSE(one.comm_->in_use) << "round " << round;
  }
}

TEST(CApi, TraceRecordsTheEngineAndRefusesToGoWhileUsed) {
  zinf_trace_t* trace = nullptr;
  ASSERT_EQ(zinf_trace_create(4, &trace), ZINF_OK);
  EXPECT_CODE(zinf_trace_add(trace, "mine", "backwards", 10, 5), ZINF_INVALID_ARGUMENT,
              "backwards");
  EXPECT_CODE(zinf_trace_add(trace, nullptr, "x", 0, 1), ZINF_INVALID_ARGUMENT, "track is null");
  {
    OneRank one(kStage2);
    one.env_.trace = trace;
    ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
    EXPECT_CODE(zinf_trace_destroy(trace), ZINF_FAILED_PRECONDITION, "engine");
    const float values[2] = {1.0f, 2.0f};
    const std::int64_t shape[1] = {2};
    ASSERT_EQ(
        zinf_engine_register_parameter(one.engine_, "w", "m", shape, 1, ZINF_DTYPE_F32, values),
        ZINF_OK);
    const zinf_gradient_t g = {"w", values, 2, ZINF_DTYPE_F32};
    for (int step = 0; step < 3; ++step) {
      ASSERT_EQ(zinf_engine_reduce_gradients(one.engine_, "m", &g, 1), ZINF_OK);
      ASSERT_EQ(zinf_engine_step(one.engine_, nullptr), ZINF_OK);
    }
    zinf_engine_counters_t counters{};
    counters.struct_size = sizeof counters;
    ASSERT_EQ(zinf_engine_counters(one.engine_, &counters), ZINF_OK);
    EXPECT_EQ(counters.steps, 3u);
    counters.struct_size = 0;
    EXPECT_CODE(zinf_engine_counters(one.engine_, &counters), ZINF_INVALID_ARGUMENT, "struct_size");
  }
  // Only 4 spans are kept; the rest are counted.
  std::size_t kept = 0, dropped = 0;
  ASSERT_EQ(zinf_trace_event_count(trace, &kept, &dropped), ZINF_OK);
  EXPECT_EQ(kept, 4u);
  EXPECT_GT(dropped, 0u);
  EXPECT_CODE(zinf_trace_write_json(trace, "/nonexistent/capi/trace.json"), ZINF_NOT_FOUND,
              "/nonexistent/capi/trace.json");
  EXPECT_EQ(zinf_trace_destroy(trace), ZINF_OK) << zinf_last_error_message();
  EXPECT_EQ(zinf_trace_destroy(nullptr), ZINF_OK);
  EXPECT_GT(zinf_trace_now_ns(), 0);
}

TEST(CApi, LastErrorBelongsToTheThread) {
  const std::string bad = R"({"zero_optimization": {"stage": 9}})";
  zinf_config_t* config = nullptr;
  ASSERT_EQ(zinf_config_from_json(bad.data(), bad.size(), &config), ZINF_INVALID_ARGUMENT);
  std::string other_message = "unset";
  zinf_code_t other_code = ZINF_INTERNAL;
  std::thread([&] {
    other_code = zinf_last_error_code();
    other_message = zinf_last_error_message();
  }).join();
  EXPECT_EQ(other_code, ZINF_OK);
  EXPECT_EQ(other_message, "");
  EXPECT_EQ(zinf_last_error_code(), ZINF_INVALID_ARGUMENT);
  EXPECT_NE(std::string(zinf_last_error_message()).find("zero_optimization.stage"),
            std::string::npos);
}

TEST(CApi, ExceptionsBecomeCodesAtTheBoundary) {
  EXPECT_EQ(capi::guard("f", []() -> Status { throw std::bad_alloc(); }), ZINF_RESOURCE_EXHAUSTED);
  EXPECT_EQ(zinf_last_error_code(), ZINF_RESOURCE_EXHAUSTED);
  EXPECT_NE(std::string(zinf_last_error_message()).find("f: out of memory"), std::string::npos);
  EXPECT_EQ(capi::guard("g", []() -> Status { throw std::runtime_error("boom"); }), ZINF_INTERNAL);
  EXPECT_STREQ(zinf_last_error_message(), "g: unexpected exception: boom");
  EXPECT_EQ(capi::guard("h", []() -> Status { throw 42; }), ZINF_INTERNAL);
  EXPECT_NE(std::string(zinf_last_error_message()).find("h: unexpected exception"),
            std::string::npos);
  EXPECT_EQ(capi::guard("i", []() -> Status { return Status::io_error("disk gone", 5); }),
            ZINF_IO_ERROR);
  EXPECT_EQ(zinf_last_error_sys_code(), 5);
  EXPECT_STREQ(zinf_last_error_message(), "disk gone");
}

TEST(CApi, StepReportIsWrittenOnlyAsFarAsTheCallersStruct) {
  OneRank one(kStage2);
  ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
  const float values[3] = {1.0f, -2.0f, 0.5f};
  const std::int64_t shape[1] = {3};
  ASSERT_EQ(zinf_engine_register_parameter(one.engine_, "w", "m", shape, 1, ZINF_DTYPE_F32, values),
            ZINF_OK);
  const float grad[3] = {0.5f, 0.25f, -1.0f};
  const zinf_gradient_t ref = {"w", grad, 3, ZINF_DTYPE_F32};
  ASSERT_EQ(zinf_engine_reduce_gradients(one.engine_, "m", &ref, 1), ZINF_OK)
      << zinf_last_error_message();
  // An "older" caller whose struct ends before loss_scale.
  zinf_step_report_t report;
  std::memset(&report, 0xab, sizeof report);
  report.struct_size = offsetof(zinf_step_report_t, loss_scale);
  ASSERT_EQ(zinf_engine_step(one.engine_, &report), ZINF_OK) << zinf_last_error_message();
  EXPECT_EQ(report.struct_size, offsetof(zinf_step_report_t, loss_scale));
  EXPECT_EQ(report.step, 1);
  EXPECT_EQ(report.skipped, 0);
  EXPECT_EQ(report.micro_batches, 1);
  const auto* bytes = reinterpret_cast<const unsigned char*>(&report);
  for (std::size_t i = offsetof(zinf_step_report_t, loss_scale); i < sizeof report; ++i) {
    ASSERT_EQ(bytes[i], 0xab) << "byte " << i << " written past the caller's struct";
  }
  // A null report is allowed.
  ASSERT_EQ(zinf_engine_reduce_gradients(one.engine_, "m", &ref, 1), ZINF_OK);
  ASSERT_EQ(zinf_engine_step(one.engine_, nullptr), ZINF_OK) << zinf_last_error_message();
}

// A checkpoint through the C API: 2 steps, save, 1 more; a new engine registers the same
// parameter, loads and takes the same step: the same bits. And the errors a C caller meets.
TEST(CApi, CheckpointResumesToTheSameBits) {
  ScratchDir scratch("checkpoint");
  const std::string dir = scratch.path() + "/ckpt";
  const float values[5] = {1.0f, -2.0f, 0.5f, 0.125f, 3.0f};
  const std::int64_t shape[1] = {5};
  const float grads[3][5] = {{0.5f, 0.25f, -1.0f, 2.0f, -0.75f},
                             {-0.5f, 1.25f, 0.5f, -2.0f, 0.375f},
                             {0.125f, -0.25f, 1.5f, 0.0625f, -1.0f}};
  const auto step = [&](zinf_engine_t* engine, int i) {
    const zinf_gradient_t ref = {"w", grads[i], 5, ZINF_DTYPE_F32};
    EXPECT_EQ(zinf_engine_reduce_gradients(engine, "m", &ref, 1), ZINF_OK)
        << zinf_last_error_message();
    EXPECT_EQ(zinf_engine_step(engine, nullptr), ZINF_OK) << zinf_last_error_message();
  };
  float a[5] = {}, b[5] = {};
  {
    OneRank one(kStage2);
    ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
    ASSERT_EQ(
        zinf_engine_register_parameter(one.engine_, "w", "m", shape, 1, ZINF_DTYPE_F32, values),
        ZINF_OK);
    step(one.engine_, 0);
    // Gradients reduced since the last step: refused, nothing written.
    const zinf_gradient_t ref = {"w", grads[1], 5, ZINF_DTYPE_F32};
    ASSERT_EQ(zinf_engine_reduce_gradients(one.engine_, "m", &ref, 1), ZINF_OK);
    EXPECT_CODE(zinf_engine_save_checkpoint(one.engine_, dir.c_str()), ZINF_FAILED_PRECONDITION,
                "gradients were reduced");
    ASSERT_EQ(zinf_engine_step(one.engine_, nullptr), ZINF_OK) << zinf_last_error_message();
    EXPECT_CODE(zinf_engine_save_checkpoint(one.engine_, nullptr), ZINF_INVALID_ARGUMENT, "dir");
    EXPECT_CODE(zinf_engine_save_checkpoint_tag(one.engine_, dir.c_str(), "../up"),
                ZINF_INVALID_ARGUMENT, "checkpoint tag '../up'");
    ASSERT_EQ(zinf_engine_save_checkpoint_tag(one.engine_, dir.c_str(), "first"), ZINF_OK)
        << zinf_last_error_message();
    // A tag saved again is replaced.
    ASSERT_EQ(zinf_engine_save_checkpoint_tag(one.engine_, dir.c_str(), "first"), ZINF_OK)
        << zinf_last_error_message();
    ASSERT_EQ(zinf_engine_save_checkpoint(one.engine_, dir.c_str()), ZINF_OK)
        << zinf_last_error_message();
    step(one.engine_, 2);
    ASSERT_EQ(zinf_engine_read_parameters(one.engine_, "w", a, 5), ZINF_OK);
  }
  {
    OneRank one(kStage2);
    ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
    ASSERT_EQ(
        zinf_engine_register_parameter(one.engine_, "w", "m", shape, 1, ZINF_DTYPE_F32, values),
        ZINF_OK);
    const std::string missing = scratch.path() + "/none";
    EXPECT_CODE(zinf_engine_load_checkpoint(one.engine_, missing.c_str()), ZINF_NOT_FOUND,
                missing + "/latest");
    EXPECT_CODE(zinf_engine_load_checkpoint_tag(one.engine_, dir.c_str(), "second"), ZINF_NOT_FOUND,
                dir + "/second/manifest.json");
    // `latest` names the default tag of the last save (global_step1), the same state as "first".
    ASSERT_EQ(zinf_engine_load_checkpoint(one.engine_, dir.c_str()), ZINF_OK)
        << zinf_last_error_message();
    step(one.engine_, 2);
    ASSERT_EQ(zinf_engine_read_parameters(one.engine_, "w", b, 5), ZINF_OK);
  }
  EXPECT_EQ(std::memcmp(a, b, sizeof a), 0);
  EXPECT_NE(std::memcmp(a, values, sizeof a), 0);
}

// A C program resuming from a checkpoint learns the step it resumes at and gets back the client
// state (a data loader's position) it saved: the engine's applied steps (not the counters' calls
// since open) and the blob's bytes, NUL bytes included, which are also client_state.bin on disk.
TEST(CApi, ResumedEngineKnowsItsStepAndClientState) {
  ScratchDir scratch("client_state");
  const std::string dir = scratch.path() + "/ckpt";
  std::mt19937 rng(20261205);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  float values[7];
  for (float& v : values) v = uniform(rng);
  const std::int64_t shape[1] = {7};
  std::string blob(61, '\0');
  for (char& c : blob) c = static_cast<char>(rng() & 0xff);
  blob[5] = '\0';  // a blob, not a C string
  const auto step = [&](zinf_engine_t* engine, std::int64_t expected_step) {
    float grads[7];
    for (float& g : grads) g = uniform(rng);
    const zinf_gradient_t ref = {"w", grads, 7, ZINF_DTYPE_F32};
    ASSERT_EQ(zinf_engine_reduce_gradients(engine, "m", &ref, 1), ZINF_OK)
        << zinf_last_error_message();
    zinf_step_report_t report{};
    report.struct_size = sizeof report;
    ASSERT_EQ(zinf_engine_step(engine, &report), ZINF_OK) << zinf_last_error_message();
    EXPECT_EQ(report.step, expected_step);
    std::int64_t applied = -1;
    ASSERT_EQ(zinf_engine_applied_steps(engine, &applied), ZINF_OK) << zinf_last_error_message();
    EXPECT_EQ(applied, expected_step);
  };
  {
    OneRank one(kStage2);
    ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
    ASSERT_EQ(
        zinf_engine_register_parameter(one.engine_, "w", "m", shape, 1, ZINF_DTYPE_F32, values),
        ZINF_OK);
    EXPECT_CODE(zinf_engine_applied_steps(one.engine_, nullptr), ZINF_INVALID_ARGUMENT,
                "applied_steps is null");
    EXPECT_CODE(zinf_engine_set_client_state(one.engine_, nullptr, 3), ZINF_INVALID_ARGUMENT,
                "data is null");
    for (std::int64_t i = 1; i <= 3; ++i) step(one.engine_, i);
    ASSERT_EQ(zinf_engine_set_client_state(one.engine_, blob.data(), blob.size()), ZINF_OK);
    ASSERT_EQ(zinf_engine_save_checkpoint(one.engine_, dir.c_str()), ZINF_OK)
        << zinf_last_error_message();
    std::ifstream saved(dir + "/global_step3/client_state.bin", std::ios::binary);
    ASSERT_TRUE(saved.good()) << dir << "/global_step3/client_state.bin";
    const std::string on_disk((std::istreambuf_iterator<char>(saved)),
                              std::istreambuf_iterator<char>());
    EXPECT_EQ(on_disk, blob);
  }
  OneRank one(kStage2);
  ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
  ASSERT_EQ(zinf_engine_register_parameter(one.engine_, "w", "m", shape, 1, ZINF_DTYPE_F32, values),
            ZINF_OK);
  std::int64_t applied = -1;
  ASSERT_EQ(zinf_engine_applied_steps(one.engine_, &applied), ZINF_OK);
  EXPECT_EQ(applied, 0);
  const void* data = &applied;
  std::size_t bytes = 99;
  ASSERT_EQ(zinf_engine_client_state(one.engine_, &data, &bytes), ZINF_OK);
  EXPECT_EQ(bytes, 0u);
  // Set before the load: the checkpoint's blob replaces it.
  ASSERT_EQ(zinf_engine_set_client_state(one.engine_, "other", 5), ZINF_OK);
  ASSERT_EQ(zinf_engine_load_checkpoint(one.engine_, dir.c_str()), ZINF_OK)
      << zinf_last_error_message();
  ASSERT_EQ(zinf_engine_applied_steps(one.engine_, &applied), ZINF_OK);
  EXPECT_EQ(applied, 3);
  ASSERT_EQ(zinf_engine_client_state(one.engine_, &data, &bytes), ZINF_OK);
  ASSERT_EQ(bytes, blob.size());
  EXPECT_EQ(std::memcmp(data, blob.data(), bytes), 0);
  // The counters count this engine's calls; the step goes on from the checkpoint's.
  zinf_engine_counters_t counters{};
  counters.struct_size = sizeof counters;
  ASSERT_EQ(zinf_engine_counters(one.engine_, &counters), ZINF_OK);
  EXPECT_EQ(counters.steps, 0u);
  step(one.engine_, 4);
  // An empty blob clears it.
  ASSERT_EQ(zinf_engine_set_client_state(one.engine_, nullptr, 0), ZINF_OK)
      << zinf_last_error_message();
  ASSERT_EQ(zinf_engine_client_state(one.engine_, nullptr, &bytes), ZINF_OK);
  EXPECT_EQ(bytes, 0u);
}

// A rank refused for bad input leaves the other waiting in its next collective until the
// collective timeout; that rank's error is an operating error, sticky from then on.
TEST(CApi, ARankLeftWaitingTimesOutAndStaysFailed) {
  const std::string json =
      R"({"zero_optimization": {"stage": 2}, "zinf": {"cpu_threads": 1, "collective_timeout_ms": 300}})";
  zinf_config_t* config = nullptr;
  ASSERT_EQ(zinf_config_from_json(json.data(), json.size(), &config), ZINF_OK);
  zinf_device_t* devices[2] = {nullptr, nullptr};
  ASSERT_EQ(zinf_host_device_create(0, 0, &devices[0]), ZINF_OK);
  ASSERT_EQ(zinf_host_device_create(1, 0, &devices[1]), ZINF_OK);
  zinf_comm_group_t* group = nullptr;
  ASSERT_EQ(zinf_local_comm_group_create(devices, 2, 2000, &group), ZINF_OK);
  zinf_code_t codes[2][3] = {};
  std::string messages[2];
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      zinf_comm_t* comm = nullptr;
      zinf_engine_t* engine = nullptr;
      zinf_env_t env{};
      env.struct_size = sizeof env;
      env.device = devices[r];
      ASSERT_EQ(zinf_comm_group_get(group, r, &comm), ZINF_OK);
      env.comm = comm;
      ASSERT_EQ(zinf_engine_open(config, &env, &engine), ZINF_OK) << zinf_last_error_message();
      const float values[6] = {0.5f, -1.0f, 0.25f, 2.0f, -0.75f, 1.5f};
      const std::int64_t shape[1] = {6};
      ASSERT_EQ(zinf_engine_register_parameter(engine, "w", "m", shape, 1, ZINF_DTYPE_F32, values),
                ZINF_OK);
      ASSERT_EQ(zinf_engine_finalize(engine), ZINF_OK) << zinf_last_error_message();
      // Rank 1 hands a gradient of the wrong size and is refused; rank 0 goes on to the step.
      const zinf_gradient_t ref = {"w", values, r == 1 ? 5u : 6u, ZINF_DTYPE_F32};
      const auto i = static_cast<std::size_t>(r);
      codes[i][0] = zinf_engine_reduce_gradients(engine, "m", &ref, 1);
      if (r == 0) {
        codes[i][1] = zinf_engine_step(engine, nullptr);
        messages[i] = zinf_last_error_message();
        codes[i][2] = zinf_engine_step(engine, nullptr);
      }
      zinf_engine_close(engine);
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(codes[1][0], ZINF_INVALID_ARGUMENT);
  EXPECT_EQ(codes[0][0], ZINF_OK);
  EXPECT_EQ(codes[0][1], ZINF_TIMEOUT) << zinf_code_name(codes[0][1]) << ": " << messages[0];
  EXPECT_NE(messages[0], "");
  EXPECT_EQ(codes[0][2], codes[0][1]) << "the error is sticky";
  EXPECT_EQ(zinf_comm_group_destroy(group), ZINF_OK) << zinf_last_error_message();
  EXPECT_EQ(zinf_device_destroy(devices[0]), ZINF_OK);
  EXPECT_EQ(zinf_device_destroy(devices[1]), ZINF_OK);
  zinf_config_destroy(config);
}

// Seeded random bytes: what a checkpoint holds in the activation tests.
std::vector<unsigned char> random_bytes(std::size_t bytes, std::uint64_t seed) {
  std::vector<unsigned char> out(bytes);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (unsigned char& b : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<unsigned char>(x >> 24);
  }
  return out;
}

// Activation checkpoints through the C API: six of 64 KiB saved with no host arena go to NVMe
// through the four staging blocks and come back the same bytes, in reverse order; the memory
// report counts the NVMe traffic; the errors name the key. Then a checkpoint whose blocks on the
// drive were overwritten comes back as ZINF_CORRUPTION naming it, and the error is sticky.
TEST(CApi, ActivationsRoundTripThroughNvmeAndErrorsNameTheKey) {
  ScratchDir scratch("capi_activations");
  const std::string json = fmt::format(
      R"({{"zero_optimization": {{"stage": 2}},
          "activation_checkpointing": {{"cpu_checkpointing": true}},
          "zinf": {{"cpu_threads": 1, "activation_host_bytes": 0,
                   "activation_nvme_path": "{}", "activation_nvme_bytes": 4194304}}}})",
      scratch.path());
  OneRank one(json);
  ASSERT_EQ(one.open(), ZINF_OK) << zinf_last_error_message();
  zinf_engine_t* e = one.engine_;
  const float values[3] = {1.0f, -2.0f, 0.5f};
  const std::int64_t shape[1] = {3};
  ASSERT_EQ(zinf_engine_register_parameter(e, "w", "m", shape, 1, ZINF_DTYPE_F32, values), ZINF_OK);
  ASSERT_EQ(zinf_engine_finalize(e), ZINF_OK) << zinf_last_error_message();

  constexpr std::size_t kBytes = 64 << 10;
  constexpr int kCount = 6;
  // Checkpoints are device memory (the host device's memory is host-accessible).
  Result<Device*> device = capi::device_of(e, "test");
  ASSERT_TRUE(device.is_ok()) << device.status().to_string();
  Result<DeviceBuffer> allocated = DeviceBuffer::allocate(**device, kBytes);
  ASSERT_TRUE(allocated.is_ok()) << allocated.status().to_string();
  DeviceBuffer device_buffer = std::move(allocated).value();
  auto* dev = static_cast<unsigned char*>(device_buffer.data());
  std::vector<unsigned char> buffer(kBytes);
  const auto fill = [&](std::uint64_t seed) {
    buffer = random_bytes(kBytes, seed);
    std::memcpy(dev, buffer.data(), kBytes);
  };
  const auto load = [&](const std::string& key) {
    // The last save reads `dev` until the store's next call returns: flush before reusing it.
    EXPECT_EQ(zinf_engine_flush_activations(e), ZINF_OK) << zinf_last_error_message();
    std::memset(dev, 0, kBytes);
    const zinf_code_t code = zinf_engine_load_activation(e, key.c_str(), dev, kBytes);
    std::memcpy(buffer.data(), dev, kBytes);
    return code;
  };
  const auto key = [](int i) { return fmt::format("block{}.input", i); };
  for (int step = 0; step < 2; ++step) {
    for (int i = 0; i < kCount; ++i) {
      ASSERT_EQ(zinf_engine_flush_activations(e), ZINF_OK) << zinf_last_error_message();
      fill(kSeed + std::uint64_t(10 * step + i));
      ASSERT_EQ(zinf_engine_save_activation(e, key(i).c_str(), dev, kBytes), ZINF_OK)
          << zinf_last_error_message();
    }
    if (step == 0) {
      EXPECT_CODE(zinf_engine_save_activation(e, "block2.input", dev, kBytes),
                  ZINF_FAILED_PRECONDITION, "block2.input");
      EXPECT_CODE(zinf_engine_save_activation(e, "block9.input", nullptr, kBytes),
                  ZINF_INVALID_ARGUMENT, "block9.input");
      EXPECT_CODE(zinf_engine_save_activation(e, nullptr, dev, kBytes), ZINF_INVALID_ARGUMENT,
                  "key is null");
      EXPECT_CODE(zinf_engine_load_activation(e, "block9.input", dev, kBytes), ZINF_NOT_FOUND,
                  "block9.input");
      EXPECT_CODE(zinf_engine_load_activation(e, "block5.input", dev, kBytes - 1),
                  ZINF_INVALID_ARGUMENT, "block5.input");
    }
    for (int i = kCount - 1; i >= 0; --i) {
      ASSERT_EQ(load(key(i)), ZINF_OK) << zinf_last_error_message();
      ASSERT_EQ(buffer, random_bytes(kBytes, kSeed + std::uint64_t(10 * step + i)))
          << key(i) << " step " << step;
    }
    EXPECT_CODE(zinf_engine_load_activation(e, "block0.input", dev, kBytes), ZINF_NOT_FOUND,
                "block0.input");
  }
  ASSERT_EQ(zinf_engine_set_activation_bytes(e, 3 * kBytes), ZINF_OK);
  zinf_memory_report_t memory{};
  memory.struct_size = sizeof memory;
  ASSERT_EQ(zinf_engine_memory(e, &memory), ZINF_OK) << zinf_last_error_message();
  // Every checkpoint went to NVMe (no arena): 2 steps x 6 x 64 KiB written; the first two of each
  // step left their staging blocks before the loads and were read back from the drive.
  EXPECT_EQ(memory.activation_nvme_write_bytes, 2u * kCount * kBytes);
  EXPECT_GE(memory.activation_nvme_read_bytes, 2u * 2u * kBytes);
  EXPECT_LE(memory.activation_nvme_read_bytes, 2u * kCount * kBytes);
  EXPECT_EQ(memory.activation_nvme_bytes, 4u << 20);
  EXPECT_GE(memory.activation_host_bytes, 4u * (8u << 20));     // the staging blocks
  EXPECT_EQ(memory.activation_device_bytes_peak, 3u * kBytes);  // the caller's figure only

  // The drive's copy of block0.input (the swap file's first extent) overwritten with other bytes.
  for (int i = 0; i < kCount; ++i) {
    ASSERT_EQ(zinf_engine_flush_activations(e), ZINF_OK);
    fill(kSeed + std::uint64_t(100 + i));
    ASSERT_EQ(zinf_engine_save_activation(e, key(i).c_str(), dev, kBytes), ZINF_OK)
        << zinf_last_error_message();
  }
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(scratch.path())) {
    if (entry.is_regular_file()) files.push_back(entry.path().string());
  }
  ASSERT_EQ(files.size(), 1u) << "the activation swap file";
  {
    std::fstream f(files[0], std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good()) << files[0];
    const std::vector<unsigned char> garbage = random_bytes(kBytes, 7);
    f.seekp(0);
    f.write(reinterpret_cast<const char*>(garbage.data()), std::streamsize(kBytes));
    ASSERT_TRUE(f.good()) << files[0];
  }
  EXPECT_CODE(zinf_engine_load_activation(e, "block0.input", dev, kBytes), ZINF_CORRUPTION,
              "block0.input");
  EXPECT_CODE(zinf_engine_load_activation(e, "block1.input", dev, kBytes), ZINF_CORRUPTION,
              "block0.input");
}

}  // namespace
}  // namespace zinf
