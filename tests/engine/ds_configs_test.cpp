// Real DeepSpeed configs (tests/data/ds_configs, sources in SOURCES.md): each is either accepted,
// and an engine opens with it and takes a step, or refused with one message that names the first
// key zinf does not support. The outcome of every file is pinned here.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "engine_test_util.hpp"
#include "zinf/config.hpp"
#include "zinf/engine.hpp"
#include "zinf/schedule.hpp"

namespace zinf {
namespace {

namespace fs = std::filesystem;

fs::path data_dir() { return fs::path(ZINF_TEST_DATA_DIR) / "ds_configs"; }

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

struct Outcome {
  const char* file;
  // Empty: accepted. Else the message starts with "<key>: " and contains `why`.
  const char* refused_key;
  const char* why;
};

const Outcome kOutcomes[] = {
    {"accelerate_tests_zero2.json", "fp16.enabled", "Hugging Face"},
    {"accelerate_tests_zero3.json", "fp16.enabled", "Hugging Face"},
    {"accelerate_zero2_offload.json", "optimizer.params.lr", "Hugging Face"},
    {"accelerate_zero3_offload.json", "optimizer.params.lr", "Hugging Face"},
    {"alpaca_lora_zero3.json", "", ""},
    {"autotuning_template_zero3.json", "", ""},
    {"axolotl_zero3_bf16_cpuoffload_all.json", "gradient_accumulation_steps", "Hugging Face"},
    {"bing_bert_squad_bsz24.json", "optimizer.params.max_grad_norm", "gradient_clipping"},
    {"cifar_zero2_cpu_offload.json", "fp16.fp16_master_weights_and_grads", "fp32 master"},
    // DeepSpeed's older boolean form of the section: the message names the object to write.
    {"docs_getting_started.json", "zero_optimization",
     "older form of {\"stage\": 1}; write the section as an object"},
    {"docs_zero_infinity_cpu.json", "", ""},
    {"ds_megatron_gpt2_bs4_zero2_offload.json", "", ""},
    {"ds_megatron_gpt2_bs8_zero2_offload.json", "", ""},
    {"expert_parallel_zero3_leaf.json", "zero_optimization.leaf_module", "unknown key"},
    {"hf_examples_zero2_offload.json", "", ""},
    {"hf_examples_zero3_offload.json", "", ""},
    {"hf_transformers_zero2_auto.json", "fp16.enabled", "Hugging Face"},
    // Its scheduler section is used; reduce_bucket_size 0 is not (validate()).
    {"hf_transformers_zero3.json", "zero_optimization.reduce_bucket_size", "0 is below 1"},
    {"llama_factory_zero3_fp8.json", "train_micro_batch_size_per_gpu",
     "neither train_batch_size nor train_micro_batch_size_per_gpu written"},
    {"megatron_model_size_1b.json", "zero_optimization.comm_overlap", "unknown key"},
    {"megatron_model_size_acc_13b.json", "zero_optimization.comm_overlap", "unknown key"},
    {"megatron_zero2.json", "", ""},
    {"megatron_zero2_cpu_offload.json", "", ""},
    {"megatron_zero2_offload_10b.json", "zero_optimization.comm_overlap", "unknown key"},
    {"megatron_zero3.json", "zero_optimization.stage3_param_persitence_threshold", "unknown key"},
    {"megatron_zero3_adam_lr.json", "", ""},
    {"megatron_zero3_infinity.json", "zero_optimization.stage3_param_persitance_threshold",
     "unknown key"},
    {"megatron_zero3_release.json", "zero_optimization.stage3_param_persitance_threshold",
     "unknown key"},
    {"megatron_zero_offload.json", "optimizer.type",
     "\"Adam\", \"AdamW\", \"Adagrad\" or \"Lion\""},
    {"megatron_zerodual.json", "", ""},
    {"qanet_onecycle.json", "", ""},
    {"sdma_allgather_zero3.json", "zero_optimization.sdma_allgather", "unknown key"},
    {"stanford_alpaca_offload.json", "bf16.enabled", "Hugging Face"},
    {"zenflow_finetuning.json", "zero_optimization.zenflow", "unknown key"},
};

// Opens an engine with `config` on one rank (HostDevice + LocalComm), registers two parameters of
// the dtype the config asks for, and takes one step.
Status open_and_step(const Config& config, const std::string& nvme_dir) {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  Env env;
  env.device = ranks.devices[0].get();
  env.comm = ranks.comms[0].get();
  env.nvme_paths = {nvme_dir};
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::open(config, env));
  const DType dtype = config.bf16_enabled   ? DType::kBF16
                      : config.fp16.enabled ? DType::kF16
                                            : DType::kF32;
  std::vector<float> init(300);
  for (std::size_t i = 0; i < init.size(); ++i) init[i] = 0.01f * static_cast<float>(i % 17);
  for (const char* name : {"w", "b"}) {
    ParameterSpec spec;
    spec.name = name;
    spec.module = "layer";
    spec.shape = {name[0] == 'w' ? 200 : 100};
    spec.dtype = dtype;
    spec.initial_values = init.data();
    ZINF_RETURN_IF_ERROR(engine->register_parameter(spec));
  }
  ZINF_RETURN_IF_ERROR(engine->finalize());
  ZINF_RETURN_IF_ERROR(engine->gather("layer"));
  std::vector<float> g32(200, 0.5f);
  std::vector<std::uint16_t> g16(200);
  const void* grads = g32.data();
  if (dtype == DType::kBF16) {
    convert_f32_to_bf16(g32.data(), g16.data(), g16.size());
    grads = g16.data();
  } else if (dtype == DType::kF16) {
    convert_f32_to_f16(g32.data(), g16.data(), g16.size());
    grads = g16.data();
  }
  const GradientRef refs[] = {{"w", grads, 200, dtype}, {"b", grads, 100, dtype}};
  ZINF_RETURN_IF_ERROR(engine->reduce_gradients("layer", refs));
  ZINF_RETURN_IF_ERROR(engine->release("layer"));
  ZINF_ASSIGN_OR_RETURN(StepReport report, engine->step());
  if (report.step != 1) return Status::internal("the step was not applied");
  return Status::ok();
}

TEST(DsConfigs, EveryFileIsPinned) {
  std::set<std::string> on_disk;
  for (const fs::directory_entry& e : fs::directory_iterator(data_dir())) {
    if (e.path().extension() == ".json") on_disk.insert(e.path().filename().string());
  }
  std::set<std::string> pinned;
  for (const Outcome& o : kOutcomes) pinned.insert(o.file);
  EXPECT_EQ(on_disk, pinned);
  EXPECT_GE(on_disk.size(), 20u);
}

TEST(DsConfigs, EachIsAcceptedAndOpensOrRefusedNamingOneKey) {
  int accepted = 0;
  for (const Outcome& o : kOutcomes) {
    SCOPED_TRACE(o.file);
    const std::string text = read_text(data_dir() / o.file);
    ASSERT_FALSE(text.empty());
    Result<Config> config = parse_config(text);
    Result<std::vector<KeyReport>> reports = check_config(text);
    ASSERT_TRUE(reports.is_ok()) << reports.status().to_string();
    int refused = 0;
    std::string first_refused;
    for (const KeyReport& r : *reports) {
      if (r.use != KeyUse::kRefused) continue;
      if (refused++ == 0) first_refused = r.key;
    }
    if (o.refused_key[0] == '\0') {
      ASSERT_TRUE(config.is_ok()) << config.status().to_string();
      EXPECT_EQ(refused, 0);
      engine_test::ScratchDir dir(fmt::format("ds_configs_{}", o.file));
      const Status s = open_and_step(*config, dir.path());
      EXPECT_TRUE(s.is_ok()) << s.to_string();
      ++accepted;
      continue;
    }
    ASSERT_FALSE(config.is_ok());
    EXPECT_EQ(config.status().code(), Code::kInvalidArgument);
    const std::string message(config.status().message());
    EXPECT_EQ(message.rfind(fmt::format("{}: ", o.refused_key), 0), 0u) << message;
    EXPECT_NE(message.find(o.why), std::string::npos) << message;
    // `zinf config check` names the same key first.
    EXPECT_EQ(first_refused, o.refused_key);
  }
  EXPECT_GE(accepted, 12);
}

// What the accepted files mean: the keys DeepSpeed acts on, read with DeepSpeed's meaning.
TEST(DsConfigs, AcceptedFilesMeanWhatDeepSpeedMeans) {
  Result<Config> alpaca = parse_config(read_text(data_dir() / "alpaca_lora_zero3.json"));
  ASSERT_TRUE(alpaca.is_ok()) << alpaca.status().to_string();
  EXPECT_EQ(alpaca->zero.stage, 3);
  EXPECT_EQ(alpaca->zero.offload_optimizer.device, OffloadDevice::kHost);
  EXPECT_EQ(alpaca->zero.offload_param.device, OffloadDevice::kHost);
  EXPECT_EQ(alpaca->zero.sub_group_size, 100'000'000u);
  EXPECT_EQ(alpaca->zero.reduce_bucket_size, 10'000'000u);
  EXPECT_TRUE(alpaca->fp16.enabled);
  EXPECT_EQ(alpaca->fp16.initial_scale_power, 8);
  // "Adam" without adam_w_mode is AdamW in DeepSpeed; weight_decay defaults to 0.
  EXPECT_EQ(alpaca->optimizer.kind, OptimizerKind::kAdamW);
  EXPECT_EQ(alpaca->optimizer.lr, 1e-4);
  EXPECT_EQ(alpaca->optimizer.weight_decay, 0.0);
  EXPECT_EQ(alpaca->gradient_clipping, 1.0);

  // The deprecated zero_optimization.cpu_offload: true is offload_optimizer "cpu".
  Result<Config> offload = parse_config(read_text(data_dir() / "megatron_zero2_cpu_offload.json"));
  ASSERT_TRUE(offload.is_ok()) << offload.status().to_string();
  EXPECT_EQ(offload->zero.stage, 2);
  EXPECT_EQ(offload->zero.offload_optimizer.device, OffloadDevice::kHost);
  EXPECT_EQ(offload->fp16.loss_scale, 0.0);
  EXPECT_EQ(offload->optimizer.lr, 0.00015);

  // The scheduler section is DeepSpeed's WarmupLR, and the engine opened with the file runs it:
  // the first step at warmup_min_lr (0), the k-th at 3e-5 * log(k - 1) / log(500) during warm-up.
  Result<Config> hf = parse_config(read_text(data_dir() / "hf_examples_zero3_offload.json"));
  ASSERT_TRUE(hf.is_ok()) << hf.status().to_string();
  EXPECT_EQ(hf->zero.stage, 3);
  EXPECT_EQ(hf->zero.offload_optimizer.device, OffloadDevice::kHost);  // cpu_offload
  EXPECT_EQ(hf->zero.offload_param.device, OffloadDevice::kHost);      // cpu_offload_params
  EXPECT_EQ(hf->zero.stage3_prefetch_bucket_size, 940'000u);           // 0.94e6
  EXPECT_EQ(hf->scheduler.kind, ScheduleKind::kWarmupLR);
  EXPECT_EQ(hf->scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(hf->scheduler.warmup_max_lr, 3e-5);
  EXPECT_EQ(hf->scheduler.warmup_num_steps, 500);
  EXPECT_FALSE(hf->scheduler.warmup_linear);
  Result<LrSchedule> schedule = LrSchedule::create(hf->scheduler, hf->optimizer.lr);
  ASSERT_TRUE(schedule.is_ok());
  EXPECT_EQ(schedule->lr_at(-1), 0.0);
  EXPECT_NEAR(schedule->lr_at(99), 3e-5 * std::log(100.0) / std::log(500.0), 1e-19);
  EXPECT_EQ(schedule->lr_at(600), 3e-5);
}

// Megatron's stage-3 script config names only the lr of "Adam" and the fp16 keys other than
// initial_scale_power: the rest is DeepSpeed's defaults (FusedAdam / DeepSpeedCPUAdam with
// adam_w_mode; precision_config.py, DeepSpeedFP16Config), and the batch arithmetic derives the
// micro-batch from train_batch_size as _set_batch_related_parameters does.
TEST(DsConfigs, MegatronZero3AdamTakesDeepSpeedsDefaults) {
  Result<Config> c = parse_config(read_text(data_dir() / "megatron_zero3_adam_lr.json"));
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->zero.stage, 3);
  EXPECT_EQ(c->zero.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_EQ(c->optimizer.kind, OptimizerKind::kAdamW);
  EXPECT_EQ(c->optimizer.lr, 0.00015);
  EXPECT_EQ(c->optimizer.beta1, 0.9);
  EXPECT_EQ(c->optimizer.beta2, 0.999);
  EXPECT_EQ(c->optimizer.eps, 1e-8);
  EXPECT_EQ(c->optimizer.weight_decay, 0.0);
  EXPECT_TRUE(c->optimizer.bias_correction);
  EXPECT_TRUE(c->fp16.enabled);
  EXPECT_EQ(c->fp16.loss_scale, 0.0);
  EXPECT_EQ(c->fp16.initial_scale_power, 16);
  EXPECT_EQ(c->fp16.loss_scale_window, 1000);
  EXPECT_EQ(c->fp16.hysteresis, 2);
  EXPECT_EQ(c->fp16.min_loss_scale, 1.0);
  EXPECT_EQ(c->gradient_clipping, 1.0);
  // 16 = micro x 1 x world: 8 a rank on two ranks, 16 on one; three ranks do not divide it.
  Config two = *c;
  ASSERT_TRUE(resolve_batch_sizes(2, &two).is_ok());
  EXPECT_EQ(two.train_micro_batch_size_per_gpu, 8u);
  EXPECT_EQ(two.gradient_accumulation_steps, 1u);
  Config three = *c;
  EXPECT_FALSE(resolve_batch_sizes(3, &three).is_ok());
}

// QANet's OneCycle config: DeepSpeed's OneCycle cycles the momentum by default (cycle_momentum
// true, cycle_min_mom 0.8, cycle_max_mom 0.9) and sets Adam's betas to (momentum, 0.99), so the
// file's betas [0.8, 0.999] hold for no step. The first step runs at cycle_min_lr and
// (cycle_min_mom, 0.99), as its constructor sets them; the k-th after it at the cycle's point
// (deepspeed/runtime/lr_schedules.py, OneCycle). The figures below are that formula worked by
// hand: cycle of 1000 + 100 iterations, 100 stairs in each half.
TEST(DsConfigs, QanetOneCycleCyclesLrAndMomentumAsDeepSpeed) {
  Result<Config> c = parse_config(read_text(data_dir() / "qanet_onecycle.json"));
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->optimizer.kind, OptimizerKind::kAdamW);  // "Adam", adam_w_mode by default
  EXPECT_EQ(c->optimizer.weight_decay, 3e-7);
  EXPECT_EQ(c->scheduler.kind, ScheduleKind::kOneCycle);
  EXPECT_TRUE(c->scheduler.cycle_momentum);
  Result<LrSchedule> s = LrSchedule::create(c->scheduler, c->optimizer.lr);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_EQ(s->lr_at(-1), 0.004);
  EXPECT_EQ(s->betas_at(-1).beta1, 0.8);
  EXPECT_EQ(s->betas_at(-1).beta2, 0.99);
  // Iteration 499: batch 500 of the 1000-iteration rise, stair floor(500 * 100 / 1000) = 50 of
  // 100: scale 0.5, lr 0.004 + 0.011 * 0.5, beta1 0.9 - 0.1 * 0.5.
  EXPECT_NEAR(s->lr_at(499), 0.0095, 1e-15);
  EXPECT_NEAR(s->betas_at(499).beta1, 0.85, 1e-15);
  // Iteration 1049: batch 1050, 50 into the 100-iteration fall, stair floor(50 * 100 / 100) =
  // 50 of 100: scale 0.5 again.
  EXPECT_NEAR(s->lr_at(1049), 0.0095, 1e-15);
  // After the cycle (iteration 1100 onwards): cycle_min_lr / (1 + 0.01 * d / 1000), d = 1, 2, ...
  EXPECT_NEAR(s->lr_at(1100), 0.004 / (1.0 + 0.01 * 1.0 / 1000.0), 1e-18);
  EXPECT_NEAR(s->lr_at(3099), 0.004 / (1.0 + 0.01 * 2000.0 / 1000.0), 1e-18);
  // train_batch_size 512 with micro-batches of 32: 512 // 32 // world accumulation steps.
  Config two = *c;
  ASSERT_TRUE(resolve_batch_sizes(2, &two).is_ok());
  EXPECT_EQ(two.gradient_accumulation_steps, 8u);
  Config three = *c;
  EXPECT_FALSE(resolve_batch_sizes(3, &three).is_ok());  // 32 x 5 x 3 = 480
}

}  // namespace
}  // namespace zinf
