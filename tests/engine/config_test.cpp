// Config: reads what `zinf plan --out` writes and hand-written DeepSpeed configs; every error
// names the key and the reason; config_to_json round-trips.
#include "zinf/config.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <map>
#include <span>
#include <string>

#include "engine_test_util.hpp"
#include "plan/config.hpp"

namespace zinf {
namespace {

// The planner's example from docs/PLAN.md, verbatim.
constexpr const char* kPlanExample = R"({
  "train_micro_batch_size_per_gpu": 1,
  "gradient_accumulation_steps": 1,
  "bf16": {"enabled": true},
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                          "buffer_count": 3},
    "offload_param": {"device": "cpu", "pin_memory": true},
    "sub_group_size": 4194304,
    "reduce_bucket_size": 67108864,
    "stage3_prefetch_bucket_size": 60397977,
    "stage3_max_live_parameters": 1711308800,
    "stage3_param_persistence_threshold": 81920,
    "overlap_comm": true, "contiguous_gradients": true
  },
  "aio": {"block_size": 1048576, "queue_depth": 32},
  "zinf": {"world_size": 4, "ranks_per_machine": 4, "pinned_pool_bytes": 201326592,
           "gradients_on_nvme": true, "device_reserved_bytes": 1073741824}
})";

TEST(Config, ReadsThePlannersExample) {
  Result<Config> c = parse_config(kPlanExample);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->zero.stage, 3);
  EXPECT_EQ(c->zero.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(c->zero.offload_optimizer.nvme_path, "/local_nvme");
  EXPECT_EQ(c->zero.offload_optimizer.buffer_count, 3u);
  EXPECT_EQ(c->zero.offload_param.device, OffloadDevice::kHost);
  EXPECT_EQ(c->zero.sub_group_size, 4194304u);
  EXPECT_EQ(c->zero.reduce_bucket_size, 67108864u);
  EXPECT_EQ(c->zero.stage3_prefetch_bucket_size, 60397977u);
  EXPECT_EQ(c->zero.stage3_max_live_parameters, 1711308800u);
  EXPECT_EQ(c->zero.stage3_param_persistence_threshold, 81920u);
  EXPECT_EQ(c->aio_block_bytes, 1048576u);
  EXPECT_EQ(c->aio_queue_depth, 32u);
  EXPECT_EQ(c->world_size, 4);
  EXPECT_EQ(c->ranks_per_machine, 4);
  EXPECT_EQ(c->pinned_pool_bytes, 201326592u);
  EXPECT_TRUE(c->gradients_on_nvme);
  EXPECT_EQ(c->device_reserved_bytes, 1073741824u);
  EXPECT_TRUE(c->bf16_enabled);
}

// Whatever the planner's writer produces, the engine reads, for every placement it can choose.
TEST(Config, ReadsEveryPlanWriterOutput) {
  for (int stage = 1; stage <= 3; ++stage) {
    for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
      for (OffloadDevice param :
           {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
        if (stage != 3 && param != OffloadDevice::kNone) continue;
        plan::PlanConfig pc;
        pc.setup.stage = stage;
        pc.setup.optimizer = opt;
        pc.setup.params = param;
        pc.setup.world_size = 8;
        pc.setup.ranks_per_machine = 4;
        pc.setup.sub_group_params = 1 << 22;
        pc.nvme_path = "/nvme0";
        const std::string text = plan::config_to_json(pc);
        Result<Config> c = parse_config(text);
        ASSERT_TRUE(c.is_ok()) << c.status().to_string() << "\n" << text;
        EXPECT_EQ(c->zero.stage, stage);
        EXPECT_EQ(static_cast<int>(c->zero.offload_optimizer.device), static_cast<int>(opt));
        EXPECT_EQ(static_cast<int>(c->zero.offload_param.device), static_cast<int>(param));
        EXPECT_EQ(c->zero.sub_group_size, std::size_t{1} << 22);
        EXPECT_EQ(c->world_size, 8);
        if (opt == OffloadDevice::kNvme) {
          EXPECT_EQ(c->zero.offload_optimizer.nvme_path, "/nvme0");
        }
      }
    }
  }
}

TEST(Config, ReadsDeepSpeedOptimizerFp16AndFloatCounts) {
  Result<Config> c = parse_config(R"({
    "gradient_clipping": 1.0,
    "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12,
             "loss_scale_window": 500, "hysteresis": 1, "min_loss_scale": 0.5},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                             "weight_decay": 0.1}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}
  })");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->gradient_clipping, 1.0);
  EXPECT_TRUE(c->fp16.enabled);
  EXPECT_EQ(c->fp16.initial_scale_power, 12);
  EXPECT_EQ(c->fp16.loss_scale_window, 500);
  EXPECT_EQ(c->fp16.hysteresis, 1);
  EXPECT_EQ(c->fp16.min_loss_scale, 0.5);
  EXPECT_EQ(c->optimizer.kind, OptimizerKind::kAdamW);
  EXPECT_EQ(c->optimizer.lr, 3e-4);
  EXPECT_EQ(c->optimizer.beta1, 0.8);
  EXPECT_EQ(c->optimizer.beta2, 0.95);
  EXPECT_EQ(c->optimizer.eps, 1e-6);
  EXPECT_EQ(c->optimizer.weight_decay, 0.1);
  EXPECT_EQ(c->zero.stage, 2);
  EXPECT_EQ(c->zero.reduce_bucket_size, 500'000'000u);
}

// Values real DeepSpeed configs carry (LLaMA-Factory's, axolotl's, DeepSpeed-Chat's examples)
// that DeepSpeed reads with a meaning zinf can give them too: "auto" inside zero_optimization
// is the field's default (DeepSpeed's ZeRO config model drops "auto"); stage 0 runs as stage 1,
// the same numbers; sub_group_size 0 keeps the default and max_live_parameters 0 turns
// prefetching off; keys DeepSpeed ignores or that change nothing are accepted with no effect.
TEST(Config, ReadsWhatRealDeepSpeedConfigsCarryWithDeepSpeedsMeaning) {
  const char* text = R"({
    "zero_optimization": {"stage": 0, "sub_group_size": 0, "max_live_parameters": 0,
                          "prefetch_bucket_size": "auto", "param_persistence_threshold": "auto",
                          "reduce_bucket_size": "auto"},
    "bf16": {"enabled": true, "loss_scale": 0, "hysteresis": 2, "min_loss_scale": 1},
    "comms_config": {"verbose": false},
    "monitor_config": {"enabled": true, "tag": "DeepSpeedMonitor"},
    "hybrid_engine": {"enabled": false, "max_out_tokens": 512},
    "compile": {"disable": false, "backend": "inductor"},
    "disable_allgather": false
  })";
  Result<Config> c = parse_config(text);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  const Config defaults;
  EXPECT_EQ(c->zero.stage, 1);
  EXPECT_EQ(c->zero.sub_group_size, defaults.zero.sub_group_size);
  EXPECT_EQ(c->zero.stage3_max_live_parameters, 0u);
  EXPECT_EQ(c->zero.stage3_prefetch_bucket_size, 50'000'000u);
  EXPECT_EQ(c->zero.stage3_param_persistence_threshold, 100'000u);
  EXPECT_EQ(c->zero.reduce_bucket_size, 500'000'000u);
  EXPECT_TRUE(c->bf16_enabled);

  Result<std::vector<KeyReport>> r = check_config(text);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  std::map<std::string, KeyReport> by_key;
  for (const KeyReport& k : *r) by_key[k.key] = k;
  const auto why_of = [&](const std::string& key) {
    EXPECT_TRUE(by_key.contains(key)) << key;
    return by_key[key].why;
  };
  EXPECT_EQ(by_key["zero_optimization.stage"].use, KeyUse::kUsed);
  EXPECT_NE(why_of("zero_optimization.stage").find("runs as stage 1"), std::string::npos);
  EXPECT_EQ(by_key["zero_optimization.sub_group_size"].use, KeyUse::kUsed);
  EXPECT_NE(why_of("zero_optimization.sub_group_size").find("keeps zinf's default, 1000000000"),
            std::string::npos);
  // Read (0 would turn prefetching off), but this config runs stage 1, where it changes nothing.
  EXPECT_EQ(by_key["zero_optimization.max_live_parameters"].use, KeyUse::kNoEffect);
  EXPECT_NE(why_of("zero_optimization.max_live_parameters").find("read at stage 3 only"),
            std::string::npos);
  for (const char* key :
       {"zero_optimization.prefetch_bucket_size", "zero_optimization.param_persistence_threshold",
        "zero_optimization.reduce_bucket_size"}) {
    EXPECT_EQ(by_key[key].use, KeyUse::kNoEffect) << key;
    EXPECT_NE(why_of(key).find("\"auto\": the field's default"), std::string::npos) << key;
  }
  for (const char* key :
       {"bf16.loss_scale", "bf16.hysteresis", "bf16.min_loss_scale", "comms_config",
        "monitor_config", "hybrid_engine", "compile", "disable_allgather"}) {
    EXPECT_EQ(by_key[key].use, KeyUse::kNoEffect) << key;
  }
  // Outside zero_optimization "auto" stays refused: DeepSpeed would read the string itself.
  Result<Config> clip = parse_config(R"({"gradient_clipping": "auto"})");
  ASSERT_FALSE(clip.is_ok());
  EXPECT_EQ(clip.status().message().rfind("gradient_clipping: ", 0), 0u)
      << clip.status().to_string();
}

// Sections of DeepSpeed features zinf does not have, which DeepSpeed turns on with their
// "enabled" (false by default): written disabled, as configs copied around carry them, they are
// accepted with no effect; enabled, refused naming the section.
TEST(Config, DisabledSectionsOfFeaturesZinfLacksAreAcceptedAndEnabledOnesRefused) {
  for (const char* section :
       {"amp", "elasticity", "data_efficiency", "curriculum_learning", "autotuning"}) {
    SCOPED_TRACE(section);
    for (const char* body : {R"({"enabled": false, "opt_level": "O1"})", R"({"fast": true})"}) {
      const std::string text = fmt::format(R"({{"{}": {}}})", section, body);
      Result<Config> c = parse_config(text);
      ASSERT_TRUE(c.is_ok()) << text << ": " << c.status().to_string();
      Result<std::vector<KeyReport>> r = check_config(text);
      ASSERT_TRUE(r.is_ok()) << r.status().to_string();
      bool reported = false;
      for (const KeyReport& k : *r) {
        if (k.key != section) continue;
        reported = true;
        EXPECT_EQ(k.use, KeyUse::kNoEffect);
        EXPECT_NE(k.why.find("disabled"), std::string::npos) << k.why;
      }
      EXPECT_TRUE(reported);
    }
    const std::string on = fmt::format(R"({{"{}": {{"enabled": true}}}})", section);
    Result<Config> refused = parse_config(on);
    ASSERT_FALSE(refused.is_ok());
    EXPECT_EQ(refused.status().message().rfind(std::string(section) + ": enabled: ", 0), 0u)
        << refused.status().to_string();
    EXPECT_NE(refused.status().message().find("not supported"), std::string::npos)
        << refused.status().to_string();
  }
  // Sections with no "enabled" of their own stay refused whatever they hold.
  EXPECT_FALSE(parse_config(R"({"pipeline": {"enabled": false}})").is_ok());
}

// zinf config check against a stage-2 config carrying stage-3 keys (as configs copied between
// stages do): they change nothing at stage 2, in zinf as in DeepSpeed, and the report says so;
// at stage 3 they are used.
TEST(Config, StageThreeKeysAreReportedWithNoEffectBelowStageThree) {
  for (int stage : {2, 3}) {
    SCOPED_TRACE(stage);
    const std::string text = fmt::format(
        R"({{"zero_optimization": {{"stage": {}, "stage3_max_live_parameters": 1e9,
            "prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
            "reduce_bucket_size": 5e8}}}})",
        stage);
    Result<std::vector<KeyReport>> r = check_config(text);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    std::map<std::string, KeyReport> by_key;
    for (const KeyReport& k : *r) by_key[k.key] = k;
    for (const char* key :
         {"zero_optimization.stage3_max_live_parameters", "zero_optimization.prefetch_bucket_size",
          "zero_optimization.stage3_param_persistence_threshold"}) {
      ASSERT_TRUE(by_key.contains(key)) << key;
      if (stage == 2) {
        EXPECT_EQ(by_key[key].use, KeyUse::kNoEffect) << key;
        EXPECT_NE(by_key[key].why.find("read at stage 3 only"), std::string::npos) << key;
        EXPECT_NE(by_key[key].why.find("runs stage 2"), std::string::npos) << key;
      } else {
        EXPECT_EQ(by_key[key].use, KeyUse::kUsed) << key;
      }
    }
    EXPECT_EQ(by_key["zero_optimization.reduce_bucket_size"].use, KeyUse::kUsed);
  }
}

struct BadCase {
  const char* json;
  const char* key;  // the message must start with this
  const char* why;  // and contain this
};

TEST(Config, ErrorsNameTheKeyAndTheReason) {
  const BadCase cases[] = {
      {R"({"zero_optimization": {"stage": 4}})", "zero_optimization.stage", "not 1, 2 or 3"},
      {R"({"zero_optimization": {"stage": "3"}})", "zero_optimization.stage", "whole number"},
      {R"({"zero_optimization": {"stage": -1}})", "zero_optimization.stage", "non-negative"},
      {R"({"zero_optimization": {"stage": 2.5}})", "zero_optimization.stage", "whole number"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})",
       "zero_optimization.offload_optimizer.device", "\"none\", \"cpu\" or \"nvme\""},
      {R"({"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}})",
       "zero_optimization.offload_optimizer.devcie", "unknown key"},
      {R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})",
       "zero_optimization.offload_param.device", "needs stage 3"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "buffer_count": 1}}})",
       "zero_optimization.offload_optimizer.buffer_count", "below 2"},
      {R"({"zero_optimization": {"reduce_bucket_size": 0}})",
       "zero_optimization.reduce_bucket_size", "DeepSpeed's default is 5e8"},
      {R"({"hybrid_engine": {"enabled": true, "max_out_tokens": 512}})", "hybrid_engine",
       "hybrid engine (RLHF generation) is not supported"},
      {R"({"zero_optimization": {"stage3_max_live_paramters": 5}})",
       "zero_optimization.stage3_max_live_paramters", "unknown key"},
      {R"({"zero_optimization": 3})", "zero_optimization", "not an object"},
      {R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", "fp16.enabled", "both"},
      {R"({"fp16": {"enabled": "yes"}})", "fp16.enabled", "true or false"},
      {R"({"fp16": {"hysteresis": 0}})", "fp16.hysteresis", "below 1"},
      {R"({"gradient_clipping": -1})", "gradient_clipping", ">= 0"},
      {R"({"optimizer": {"type": "SGD"}})", "optimizer.type", "\"Adam\""},
      {R"({"optimizer": {"params": {"betas": [0.9]}}})", "optimizer.params.betas", "pair"},
      {R"({"optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}}})",
       "optimizer.params.betas", "not a parameter of DeepSpeed's Adagrad"},
      {R"({"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}})", "optimizer.params.eps",
       "not a parameter of DeepSpeed's Lion"},
      {R"({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})",
       "optimizer.params.max_grad_norm", "gradient_clipping"},
      {R"({"optimizer": {"type": "Adam", "params": {"torch_adam": true, "bias_correction": false}}})",
       "optimizer.params.bias_correction", "torch.optim.Adam"},
      {R"({"optimizer": {"type": "Adam", "params": {"lr": "auto"}}})", "optimizer.params.lr",
       "Hugging Face"},
      {R"({"zero_optimization": {"stage": "auto"}})", "zero_optimization.stage", "Hugging Face"},
      {R"({"scheduler": {"type": "LRRangeTest"}})", "scheduler.type", "not supported by zinf"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_LR": 1e-3}}})",
       "scheduler.params.warmup_max_LR", "unknown key for WarmupLR"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}})",
       "scheduler.params.total_num_steps", "unknown key for WarmupLR"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}})",
       "scheduler.params.warmup_num_steps", "Hugging Face"},
      {R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})",
       "scheduler.params.total_num_steps", "needs total_num_steps"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})",
       "scheduler.params.warmup_num_steps", "positive"},
      {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1e-3}}})",
       "scheduler.params.cycle_min_lr", "needs cycle_min_lr"},
      {R"({"scheduler": {"typ": "WarmupLR"}})", "scheduler.typ", "unknown key"},
      {R"({"scheduler": "WarmupLR"})", "scheduler", "not an object"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "CPU"}}})",
       "zero_optimization.offload_optimizer.device", "\"none\", \"cpu\" or \"nvme\""},
      {R"({"zero_optimization": {"offload_optimizer": {"ratio": 0.3}}})",
       "zero_optimization.offload_optimizer.ratio", "all of the optimizer state"},
      {R"({"fp16": {"consecutive_hysteresis": true}})", "fp16.consecutive_hysteresis",
       "not supported"},
      {R"({"aio": {"use_gds": true}})", "aio.use_gds", "GPUDirect"},
      {R"({"zinf": {"world_size": 6, "ranks_per_machine": 4}})", "zinf.ranks_per_machine",
       "does not divide"},
      {R"({"some_new_section": {}})", "some_new_section", "unknown key"},
      {R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})", "optimizer.params.betas", "[0, 1)"},
      {R"({"optimizer": {"params": {"amsgrad": true}}})", "optimizer.params.amsgrad",
       "not supported"},
      {R"({"aio": {"block_size": 1000}})", "aio.block_size", "multiple of 4096"},
      {R"({"zinf": {"world_sise": 4}})", "zinf.world_sise", "unknown key"},
      {R"({"zinf": {"collective_timeout_ms": 0}})", "zinf.collective_timeout_ms", "below 1"},
      {R"({"zinf": {"io_timeout_ms": 0}})", "zinf.io_timeout_ms", "below 1"},
      {R"({"zinf": {"io_timeouts_max": -2}})", "zinf.io_timeouts_max", "non-negative"},
      {R"([1, 2])", "config", "not a JSON object"},
      {R"({"zero_optimization": {)", "config", "not valid JSON"},
      // Where the text stops being JSON: line and column.
      {"{\n  \"train_batch_size\": 8,\n  \"bf16\": {\"enabled\": ture}\n}", "config",
       "not valid JSON: parse error at line 3, column 24"},
      // A number past a double's range (the reader threw out_of_range through the message).
      {R"({"gradient_clipping": 1e400})", "config", "not valid JSON: number overflow parsing"},
  };
  for (const BadCase& c : cases) {
    Result<Config> r = parse_config(c.json);
    ASSERT_FALSE(r.is_ok()) << c.json;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << c.json;
    const std::string message(r.status().message());
    EXPECT_EQ(message.rfind(c.key, 0), 0u) << message;
    EXPECT_NE(message.find(c.why), std::string::npos) << message;
  }
}

// Keys are case-sensitive (DeepSpeed's are); a key that differs from a known one only in case is
// refused with the right spelling in the message.
TEST(Config, MisCasedKeysAreRefusedWithTheRightSpelling) {
  const BadCase cases[] = {
      {R"({"Zero_Optimization": {"stage": 3}})", "Zero_Optimization", "\"zero_optimization\""},
      {R"({"zero_optimization": {"Stage": 3}})", "zero_optimization.Stage", "\"stage\""},
      {R"({"zero_optimization": {"offload_optimizer": {"Device": "cpu"}}})",
       "zero_optimization.offload_optimizer.Device", "\"device\""},
      {R"({"optimizer": {"Type": "Adam"}})", "optimizer.Type", "\"type\""},
      {R"({"zinf": {"World_Size": 2}})", "zinf.World_Size", "\"world_size\""},
  };
  for (const BadCase& c : cases) {
    Result<Config> r = parse_config(c.json);
    ASSERT_FALSE(r.is_ok()) << c.json;
    const std::string message(r.status().message());
    EXPECT_EQ(message.rfind(c.key, 0), 0u) << message;
    EXPECT_NE(message.find("case-sensitive"), std::string::npos) << message;
    EXPECT_NE(message.find(c.why), std::string::npos) << message;
  }
}

// A config parse_config() refuses, and the whole message it must give.
struct RefusedConfig {
  const char* json;
  const char* message;
};

void expect_refused(std::span<const RefusedConfig> cases) {
  for (const RefusedConfig& c : cases) {
    Result<Config> r = parse_config(c.json);
    ASSERT_FALSE(r.is_ok()) << c.json;
    EXPECT_EQ(std::string(r.status().message()), c.message) << c.json;
  }
}

// An unknown key that is a slip of a known key of its own section (Damerau-Levenshtein distance
// at most 2; 1 for a key of 3 to 5 characters, one in ten characters for a long one) is refused
// naming that key; one near nothing is refused as before. The messages are what
// `zinf config check` and zinf.torch show.
TEST(Config, UnknownKeysSuggestTheNearestKeyOfTheirSection) {
  const RefusedConfig cases[] = {
      {R"({"zero_optimization": {"stage3_param_persitance_threshold": 1e5}})",
       "zero_optimization.stage3_param_persitance_threshold: unknown key (did you mean "
       "\"stage3_param_persistence_threshold\"?)"},
      {R"({"gradient_acumulation_steps": 4})",
       "gradient_acumulation_steps: unknown key (did you mean \"gradient_accumulation_steps\"?)"},
      {R"({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}})",
       "optimizer.params.weight_decy: unknown key (not a parameter of DeepSpeed's AdamW; did you "
       "mean \"weight_decay\"?)"},
      // A transposition is one edit.
      {R"({"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}})",
       "zero_optimization.offload_optimizer.devcie: unknown key (did you mean \"device\"?)"},
      {R"({"zinf": {"world_sise": 4}})",
       "zinf.world_sise: unknown key (did you mean \"world_size\"?)"},
      {R"({"optimizer": {"typ": "Adam"}})", "optimizer.typ: unknown key (did you mean \"type\"?)"},
      {R"({"fp16": {"loss_scale_windows": 100}})",
       "fp16.loss_scale_windows: unknown key (did you mean \"loss_scale_window\"?)"},
      // The suggestion comes from the key's own section: "stage" is a key of zero_optimization,
      // not of the root.
      {R"({"stag": 3})", "stag: unknown key (misspelt, or not supported by zinf)"},
      // Nothing near: no suggestion.
      {R"({"some_new_section": {}})",
       "some_new_section: unknown key (misspelt, or not supported by zinf)"},
      {R"({"zero_optimization": {"comm_overlap": true}})",
       "zero_optimization.comm_overlap: unknown key (misspelt, or not supported by zinf)"},
      {R"({"zinf": {"x": 1}})", "zinf.x: unknown key (misspelt, or not supported by zinf)"},
      // Short keys: one slip ("aoi"), not two ("comp" is not "comet").
      {R"({"aoi": {}})", "aoi: unknown key (did you mean \"aio\"?)"},
      {R"({"comp": {}})", "comp: unknown key (misspelt, or not supported by zinf)"},
      // A DeepSpeed key zinf does not read, a word away from one it does: not taken for a slip.
      {R"({"zero_optimization": {"offload_optimizer_states": true}})",
       "zero_optimization.offload_optimizer_states: unknown key (misspelt, or not supported by "
       "zinf)"},
      // Three slips in a key of 30 characters are still one in ten.
      {R"({"trian_micro_bach_size_per_gpus": 1})",
       "trian_micro_bach_size_per_gpus: unknown key (did you mean "
       "\"train_micro_batch_size_per_gpu\"?)"},
      // A parameter of another optimizer type is not a slip: no suggestion.
      {R"({"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}})",
       "optimizer.params.eps: unknown key (not a parameter of DeepSpeed's Lion)"},
      // Case first: a key that differs only in case keeps its own hint.
      {R"({"zero_optimization": {"Stage": 3}})",
       "zero_optimization.Stage: unknown key (keys are case-sensitive: \"stage\")"},
  };
  expect_refused(cases);
  // check_config, which `zinf config check` prints, gives the same reason against the key.
  Result<std::vector<KeyReport>> report =
      check_config(R"({"train_batch_size": 8, "gradient_acumulation_steps": 4})");
  ASSERT_TRUE(report.is_ok()) << report.status().to_string();
  ASSERT_EQ(report->size(), 2u);
  EXPECT_EQ((*report)[1].key, "gradient_acumulation_steps");
  EXPECT_EQ((*report)[1].use, KeyUse::kRefused);
  EXPECT_EQ((*report)[1].why, "unknown key (did you mean \"gradient_accumulation_steps\"?)");
}

// A key written under the wrong parent is refused naming the section it belongs to. DeepSpeed
// reads no such key: it ignores unknown top-level keys, reads the optimizer's settings from
// "params" only (config.py, get_optimizer_params: an "lr" beside "type" leaves DeepSpeed's
// default, 1e-3) and its ZeRO sections refuse keys they do not declare; so the value never
// reaches the setting it was written for.
TEST(Config, KeysUnderTheWrongParentNameTheSectionTheyBelongTo) {
  const RefusedConfig cases[] = {
      {R"({"stage3_max_live_parameters": 1e9, "zero_optimization": {"stage": 3}})",
       "stage3_max_live_parameters: unknown key here (a key of zero_optimization, not of the top "
       "level: move it there)"},
      {R"({"optimizer": {"type": "AdamW", "lr": 1e-4}})",
       "optimizer.lr: unknown key here (a key of optimizer.params, not of optimizer: move it "
       "there)"},
      {R"({"zero_optimization": {"stage": 3, "pin_memory": true}})",
       "zero_optimization.pin_memory: unknown key here (a key of "
       "zero_optimization.offload_optimizer or zero_optimization.offload_param, not of "
       "zero_optimization: move it there)"},
      {R"({"zero_optimization": {"stage": 3, "gradient_clipping": 1.0}})",
       "zero_optimization.gradient_clipping: unknown key here (a key of the top level, not of "
       "zero_optimization: move it there)"},
      // bf16 and its older name bfloat16 share their keys: the section is named once.
      {R"({"zero_optimization": {"enabled": true}})",
       "zero_optimization.enabled: unknown key here (a key of fp16 or bf16, not of "
       "zero_optimization: move it there)"},
      {R"({"offload_optimizer": {"device": "cpu"}})",
       "offload_optimizer: unknown key here (a key of zero_optimization, not of the top level: "
       "move it there)"},
      // A key of the parameter offload only, under the optimizer's.
      {R"({"zero_optimization": {"offload_optimizer": {"max_in_cpu": 1e9}}})",
       "zero_optimization.offload_optimizer.max_in_cpu: unknown key here (a key of "
       "zero_optimization.offload_param, not of zero_optimization.offload_optimizer: move it "
       "there)"},
  };
  expect_refused(cases);
}

// A scheduler parameter that is a slip of one the schedule type takes is refused naming it, by
// the same rule as the other sections; the suggestion comes from that type's own parameters.
TEST(Config, UnknownSchedulerParamsSuggestTheNearestParamOfTheirType) {
  const RefusedConfig cases[] = {
      {R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100,
           "warmup_num_step": 10}}})",
       "scheduler.params.warmup_num_step: unknown key for WarmupDecayLR (did you mean "
       "\"warmup_num_steps\"?)"},
      {R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_step": 100}}})",
       "scheduler.params.total_num_step: unknown key for WarmupDecayLR (did you mean "
       "\"total_num_steps\"?)"},
      {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0,
           "cycle_max_lrr": 1e-3}}})",
       "scheduler.params.cycle_max_lrr: unknown key for OneCycle (did you mean \"cycle_max_lr\"?)"},
      {R"({"scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ration": 0.1}}})",
       "scheduler.params.cos_min_ration: unknown key for WarmupCosineLR (did you mean "
       "\"cos_min_ratio\"?)"},
      // A parameter of another type is not a slip of one of this type's: no suggestion.
      {R"({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 100}}})",
       "scheduler.params.total_num_steps: unknown key for WarmupLR (misspelt, or not supported "
       "by zinf)"},
      // WarmupLR takes no total_num_steps, so a slip of it is no slip of a WarmupLR parameter.
      {R"({"scheduler": {"type": "WarmupLR", "params": {"total_num_step": 100}}})",
       "scheduler.params.total_num_step: unknown key for WarmupLR (misspelt, or not supported by "
       "zinf)"},
      // Case first, as elsewhere.
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_LR": 1e-3}}})",
       "scheduler.params.warmup_max_LR: unknown key for WarmupLR (keys are case-sensitive: "
       "\"warmup_max_lr\")"},
  };
  expect_refused(cases);
  // `zinf config check` shows the same reason against the key.
  Result<std::vector<KeyReport>> report = check_config(
      R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_step": 10}}})");
  ASSERT_TRUE(report.is_ok()) << report.status().to_string();
  bool found = false;
  for (const KeyReport& r : *report) {
    if (r.key != "scheduler.params.warmup_num_step") continue;
    found = true;
    EXPECT_EQ(r.use, KeyUse::kRefused);
    EXPECT_EQ(r.why, "unknown key for WarmupDecayLR (did you mean \"warmup_num_steps\"?)");
  }
  EXPECT_TRUE(found);
}

// A count beyond what its field holds is refused as too large, naming the largest allowed; a
// fraction or a negative number is still "not a non-negative whole number".
TEST(Config, CountsBeyondTheirRangeAreRefusedAsTooLarge) {
  const RefusedConfig cases[] = {
      {R"({"zero_optimization": {"sub_group_size": 1e30}})",
       "zero_optimization.sub_group_size: 1e+30 is larger than the largest allowed, "
       "18446744073709551615"},
      // One past 2^64 - 1, which JSON readers hold as a double.
      {R"({"zero_optimization": {"reduce_bucket_size": 18446744073709551616}})",
       "zero_optimization.reduce_bucket_size: 1.8446744073709552e+19 is larger than the largest "
       "allowed, 18446744073709551615"},
      // A narrower field: its own largest.
      {R"({"zinf": {"world_size": 3000000000}})",
       "zinf.world_size: 3000000000 is larger than the largest allowed, 2147483647"},
      {R"({"zinf": {"io_timeouts_max": 1e10}})",
       "zinf.io_timeouts_max: 10000000000.0 is larger than the largest allowed, 4294967295"},
      {R"({"zero_optimization": {"sub_group_size": -1e30}})",
       "zero_optimization.sub_group_size: -1e+30 is not a non-negative whole number"},
      {R"({"zero_optimization": {"sub_group_size": 2.5}})",
       "zero_optimization.sub_group_size: 2.5 is not a non-negative whole number"},
      {R"({"zero_optimization": {"sub_group_size": -3}})",
       "zero_optimization.sub_group_size: -3 is not a non-negative whole number"},
  };
  expect_refused(cases);
  // The largest is accepted, written as an integer or as a float just below 2^64.
  Result<Config> largest = parse_config(
      R"({"zero_optimization": {"stage3_max_live_parameters": 18446744073709551615}})");
  ASSERT_TRUE(largest.is_ok()) << largest.status().to_string();
  EXPECT_EQ(largest->zero.stage3_max_live_parameters, 18446744073709551615u);
  Result<Config> below = parse_config(
      R"({"zero_optimization": {"stage3_max_live_parameters": 1.8446744073709550e19}})");
  ASSERT_TRUE(below.is_ok()) << below.status().to_string();
  EXPECT_EQ(below->zero.stage3_max_live_parameters, 18446744073709549568u);
}

// The first refused key in file order is the one named, and check_config reports every key.
TEST(Config, CheckReportsEveryKeyInFileOrder) {
  const char* text = R"({
    "train_batch_size": 32,
    "steps_per_print": 10,
    "zero_optimization": {"stage": 3, "overlap_comm": true,
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/n",
                                                "pin_memory": true}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    "optimizer": {"type": "ADAMW", "params": {"lr": 1e-4, "amsgrad": true}}
  })";
  Result<std::vector<KeyReport>> r = check_config(text);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  std::vector<std::string> lines;
  for (const KeyReport& k : *r) {
    lines.push_back(fmt::format("{} {}", k.key, key_use_name(k.use)));
  }
  const std::vector<std::string> want = {
      "train_batch_size used",
      "steps_per_print accepted, no effect in zinf",
      "zero_optimization.stage used",
      "zero_optimization.overlap_comm accepted, no effect in zinf",
      "zero_optimization.offload_optimizer.device used",
      "zero_optimization.offload_optimizer.nvme_path used",
      "zero_optimization.offload_optimizer.pin_memory accepted, no effect in zinf",
      "scheduler.type used",
      "scheduler.params.warmup_num_steps used",
      "optimizer.type used",
      "optimizer.params.lr used",
      "optimizer.params.amsgrad refused",
  };
  EXPECT_EQ(lines, want);
  for (const KeyReport& k : *r) {
    EXPECT_EQ(k.why.empty(), k.use == KeyUse::kUsed) << k.key;
  }
  Result<Config> c = parse_config(text);
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().message().rfind("optimizer.params.amsgrad: ", 0), 0u)
      << c.status().to_string();
}

// Values validate() refuses are all reported at once, each against its key (validate() stops at
// the first, which parse_config() names; check_config() reads the file again without it).
TEST(Config, CheckReportsEveryValueRefusalAtOnce) {
  const char* text = R"({
    "gradient_clipping": -1,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 0,
                          "offload_optimizer": {"device": "nvme", "buffer_count": 1}},
    "fp16": {"enabled": true, "hysteresis": 0}
  })";
  Result<std::vector<KeyReport>> r = check_config(text);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  std::vector<std::string> refused;
  for (const KeyReport& k : *r) {
    if (k.use == KeyUse::kRefused) refused.push_back(k.key);
  }
  const std::vector<std::string> want = {
      "gradient_clipping", "zero_optimization.reduce_bucket_size",
      "zero_optimization.offload_optimizer.buffer_count", "fp16.hysteresis"};
  EXPECT_EQ(refused, want);
  Result<Config> c = parse_config(text);
  ASSERT_FALSE(c.is_ok());
  const std::string message(c.status().message());
  const std::string first = message.substr(0, message.find(':'));
  EXPECT_NE(std::find(want.begin(), want.end(), first), want.end()) << c.status().to_string();
}

// What each optimizer section becomes: DeepSpeed's type names in any case, "Adam" as AdamW
// unless adam_w_mode is false, and DeepSpeed's defaults per type (docs/ENGINE.md).
TEST(Config, OptimizerTypesAndDefaultsAreDeepSpeeds) {
  struct Want {
    const char* json;
    OptimizerKind kind;
    double lr, eps, weight_decay, beta2;
  };
  const Want cases[] = {
      {R"({"type": "Adam"})", OptimizerKind::kAdamW, 1e-3, 1e-8, 0.0, 0.999},
      {R"({"type": "adam", "params": {"adam_w_mode": false}})", OptimizerKind::kAdam, 1e-3, 1e-8,
       0.0, 0.999},
      {R"({"type": "AdamW"})", OptimizerKind::kAdamW, 1e-3, 1e-8, 0.0, 0.999},
      {R"({"type": "AdamW", "params": {"adam_w_mode": false}})", OptimizerKind::kAdamW, 1e-3, 1e-8,
       0.0, 0.999},
      {R"({"type": "AdamW", "params": {"torch_adam": true}})", OptimizerKind::kAdamW, 1e-3, 1e-8,
       0.01, 0.999},
      {R"({"type": "Adam", "params": {"torch_adam": true, "adam_w_mode": false}})",
       OptimizerKind::kAdam, 1e-3, 1e-8, 0.0, 0.999},
      // Type "Adam" with torch_adam and adam_w_mode left at true builds torch.optim.AdamW, whose
      // weight_decay defaults to 0.01 (deepspeed/runtime/engine.py, _configure_basic_optimizer:
      // effective_adam_w_mode, then torch.optim.AdamW(**params)).
      {R"({"type": "Adam", "params": {"torch_adam": true}})", OptimizerKind::kAdamW, 1e-3, 1e-8,
       0.01, 0.999},
      {R"({"type": "ADAGRAD"})", OptimizerKind::kAdagrad, 1e-2, 1e-10, 0.0, 0.999},
      {R"({"type": "Lion"})", OptimizerKind::kLion, 1e-3, 1e-8, 0.0, 0.999},
      {R"({"type": "lion", "params": {"betas": [0.95, 0.98], "weight_decay": 0.1}})",
       OptimizerKind::kLion, 1e-3, 1e-8, 0.1, 0.98},
  };
  for (const Want& w : cases) {
    Result<Config> c = parse_config(fmt::format(R"({{"optimizer": {}}})", w.json));
    ASSERT_TRUE(c.is_ok()) << w.json << ": " << c.status().to_string();
    EXPECT_EQ(c->optimizer.kind, w.kind) << w.json;
    EXPECT_EQ(c->optimizer.lr, w.lr) << w.json;
    EXPECT_EQ(c->optimizer.eps, w.eps) << w.json;
    EXPECT_EQ(c->optimizer.weight_decay, w.weight_decay) << w.json;
    EXPECT_EQ(c->optimizer.beta2, w.beta2) << w.json;
    // The writer keeps the meaning: read back, the same optimizer.
    Result<Config> back = parse_config(config_to_json(*c));
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(back->optimizer.kind, w.kind) << w.json;
    EXPECT_EQ(back->optimizer.weight_decay, w.weight_decay) << w.json;
  }
}

TEST(Config, RoundTripsThroughJson) {
  Config c = engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kHost, "/x/y");
  c.fp16.enabled = true;
  c.fp16.hysteresis = 3;
  c.gradient_clipping = 0.75;
  c.optimizer.kind = OptimizerKind::kLion;
  c.optimizer.beta2 = 0.99;
  c.io_timeout_ms = 1234;
  c.io_timeouts_max = 0;
  c.pinned_pool_bytes = 1 << 30;
  c.world_size = 2;
  c.zero.group_max_elements = 12345;
  Result<Config> back = parse_config(config_to_json(c));
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(config_to_json(*back), config_to_json(c));
  EXPECT_EQ(back->optimizer.kind, OptimizerKind::kLion);
  EXPECT_EQ(back->zero.offload_param.device, OffloadDevice::kHost);
  EXPECT_EQ(back->zero.group_max_elements, 12345u);
  EXPECT_EQ(back->io_timeout_ms, 1234);
  EXPECT_EQ(back->io_timeouts_max, 0u);
  EXPECT_EQ(back->pinned_pool_bytes, std::uint64_t{1} << 30);
}

// The scheduler section is read with DeepSpeed's names and defaults, and written back with the
// same meaning.
TEST(Config, SchedulerSectionIsReadAndRoundTrips) {
  Result<Config> none = parse_config("{}");
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(none->scheduler.kind, ScheduleKind::kNone);
  EXPECT_EQ(config_to_json(*none).find("scheduler"), std::string::npos);

  Result<Config> decay = parse_config(R"({"optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 900,
                    "warmup_min_lr": 1e-6, "warmup_num_steps": 30, "warmup_type": "linear"}}})");
  ASSERT_TRUE(decay.is_ok()) << decay.status().to_string();
  const ScheduleConfig& d = decay->scheduler;
  EXPECT_EQ(d.kind, ScheduleKind::kWarmupDecayLR);
  EXPECT_EQ(d.total_num_steps, 900);
  EXPECT_EQ(d.warmup_min_lr, 1e-6);
  EXPECT_LT(d.warmup_max_lr, 0);  // not given: DeepSpeed's 0.001
  EXPECT_EQ(d.warmup_num_steps, 30);
  EXPECT_TRUE(d.warmup_linear);
  EXPECT_EQ(d.last_batch_iteration, -1);

  const char* sections[] = {
      R"({"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
          "warmup_num_steps": 500}})",
      R"({"type": "WarmupDecayLR", "params": {"total_num_steps": 900, "warmup_num_steps": 30}})",
      R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 1000, "warmup_min_ratio": 0.1,
          "warmup_num_steps": 100, "cos_min_ratio": 0.001, "warmup_type": "linear"}})",
      R"({"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3,
          "cycle_first_step_size": 100, "cycle_second_stair_count": 4, "decay_lr_rate": 0.1,
          "decay_step_size": 10, "cycle_min_mom": 0.85, "last_batch_iteration": 20}})",
  };
  for (const char* section : sections) {
    Result<Config> c = parse_config(fmt::format(R"({{"scheduler": {}}})", section));
    ASSERT_TRUE(c.is_ok()) << section << ": " << c.status().to_string();
    EXPECT_NE(c->scheduler.kind, ScheduleKind::kNone);
    Result<Config> back = parse_config(config_to_json(*c));
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(config_to_json(*back), config_to_json(*c)) << section;
    // The same curve, read back: the lr of every iteration of interest is equal.
    Result<LrSchedule> a = LrSchedule::create(c->scheduler, c->optimizer.lr);
    Result<LrSchedule> b = LrSchedule::create(back->scheduler, back->optimizer.lr);
    ASSERT_TRUE(a.is_ok() && b.is_ok()) << section;
    for (std::int64_t n : {-1, 0, 1, 29, 99, 150, 450, 899, 2000}) {
      EXPECT_EQ(a->lr_at(n), b->lr_at(n)) << section << " at " << n;
      EXPECT_EQ(a->betas_at(n).beta1, b->betas_at(n).beta1) << section << " at " << n;
    }
  }
  Result<Config> cycle = parse_config(fmt::format(R"({{"scheduler": {}}})", sections[3]));
  ASSERT_TRUE(cycle.is_ok());
  EXPECT_EQ(cycle->scheduler.cycle_second_step_size, -1);  // not given: the first's
  EXPECT_EQ(cycle->scheduler.cycle_second_stair_count, 4);
  EXPECT_EQ(cycle->scheduler.last_batch_iteration, 20);
  EXPECT_EQ(cycle->scheduler.cycle_min_mom, 0.85);
}

TEST(Config, LoadConfigNamesTheFile) {
  Result<Config> missing = load_config("/nonexistent/zinf.json");
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/zinf.json"), std::string::npos);
  engine_test::ScratchDir dir("config");
  const std::string path = dir.path() + "/bad.json";
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(R"({"zero_optimization": {"stage": 4}})", f);
  std::fclose(f);
  Result<Config> bad = load_config(path);
  ASSERT_FALSE(bad.is_ok());
  const std::string message(bad.status().message());
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("zero_optimization.stage"), std::string::npos) << message;
  // A directory is an I/O error saying so, not JSON that ends early.
  Result<Config> directory = load_config(dir.path());
  ASSERT_FALSE(directory.is_ok());
  EXPECT_EQ(directory.status().code(), Code::kIoError) << directory.status().to_string();
  EXPECT_EQ(directory.status().sys_code(), EISDIR);
  EXPECT_EQ(directory.status().message(), "config " + dir.path() + ": Is a directory");
}

// offload_param.buffer_count defaults to 5 and offload_optimizer.buffer_count to 4, in a config
// and in a Config built in code (deepspeed/runtime/zero/offload_config.py:33,
// DeepSpeedZeroOffloadParamConfig.buffer_count = Field(5); :58, the optimizer's Field(4)).
TEST(Config, OffloadBufferCountsDefaultToDeepSpeeds) {
  Result<Config> c = parse_config(R"({"zero_optimization": {
    "offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
    "offload_param": {"device": "nvme", "nvme_path": "/x"}}})");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->zero.offload_param.buffer_count, 5u);
  EXPECT_EQ(c->zero.offload_optimizer.buffer_count, 4u);
  EXPECT_EQ(Config{}.zero.offload_param.buffer_count, 5u);
  EXPECT_EQ(Config{}.zero.offload_optimizer.buffer_count, 4u);
}

// The deprecated parameter-offload switch is "cpu_offload_param" in DeepSpeed's pydantic config
// (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig.cpu_offload_param) and was
// "cpu_offload_params" before it (deepspeed/runtime/zero/constants.py,
// ZERO_OPTIMIZATION_CPU_OFFLOAD_PARAMS); both mean offload_param.device "cpu".
TEST(Config, CpuOffloadParamIsReadInBothDeepSpeedSpellings) {
  for (const char* key : {"cpu_offload_param", "cpu_offload_params"}) {
    Result<Config> on =
        parse_config(fmt::format(R"({{"zero_optimization": {{"{}": true}}}})", key));
    ASSERT_TRUE(on.is_ok()) << key << ": " << on.status().to_string();
    EXPECT_EQ(on->zero.offload_param.device, OffloadDevice::kHost) << key;
    Result<Config> off =
        parse_config(fmt::format(R"({{"zero_optimization": {{"{}": false}}}})", key));
    ASSERT_TRUE(off.is_ok()) << key << ": " << off.status().to_string();
    EXPECT_EQ(off->zero.offload_param.device, OffloadDevice::kNone) << key;
  }
}

// DeepSpeed completes train_batch_size = train_micro_batch_size_per_gpu x
// gradient_accumulation_steps x world size from whichever of the three are given, and refuses
// three that disagree (deepspeed/runtime/config.py, DeepSpeedConfig._set_batch_related_parameters
// and _batch_assertion). The world size is zinf.world_size when the config sets it, else the
// communicator's at Engine::open().
TEST(Config, BatchSizesFollowDeepSpeedsArithmetic) {
  struct Want {
    const char* json;
    std::size_t micro, accumulation;
  };
  const Want cases[] = {
      {R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
           "zinf": {"world_size": 4}})",
       4, 4},
      {R"({"train_batch_size": 64, "gradient_accumulation_steps": 2, "zinf": {"world_size": 4}})",
       8, 2},
      {R"({"train_batch_size": 32, "zinf": {"world_size": 4}})", 8, 1},
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
           "gradient_accumulation_steps": 4, "zinf": {"world_size": 4}})",
       2, 4},
      // "auto" (the Hugging Face Trainer's) is a value the Trainer computes from the other two.
      {R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
           "gradient_accumulation_steps": 3, "zinf": {"world_size": 4}})",
       2, 3},
  };
  for (const Want& w : cases) {
    Result<Config> c = parse_config(w.json);
    ASSERT_TRUE(c.is_ok()) << w.json << ": " << c.status().to_string();
    EXPECT_EQ(c->train_micro_batch_size_per_gpu, w.micro) << w.json;
    EXPECT_EQ(c->gradient_accumulation_steps, w.accumulation) << w.json;
    EXPECT_TRUE(c->gradient_accumulation_given) << w.json;
  }
  const BadCase bad[] = {
      {R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
           "gradient_accumulation_steps": 2, "zinf": {"world_size": 4}})",
       "train_batch_size",
       "64 is not train_micro_batch_size_per_gpu 4 x "
       "gradient_accumulation_steps 2 x 4 ranks"},
      {R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
           "zinf": {"world_size": 4}})",
       "train_batch_size",
       "30 is not train_micro_batch_size_per_gpu 4 x "
       "gradient_accumulation_steps 1 x 4 ranks (16); gradient_accumulation_steps was derived "
       "from the others, rounded down as DeepSpeed does"},
      {R"({"train_batch_size": 2, "zinf": {"world_size": 4}})", "train_batch_size",
       "2 is not train_micro_batch_size_per_gpu 0"},
  };
  for (const BadCase& b : bad) {
    Result<Config> r = parse_config(b.json);
    ASSERT_FALSE(r.is_ok()) << b.json;
    const std::string message(r.status().message());
    EXPECT_EQ(message.rfind(b.key, 0), 0u) << message;
    EXPECT_NE(message.find(b.why), std::string::npos) << message;
  }
  // Without zinf.world_size the engine completes it with its communicator's 2 ranks.
  Result<Config> open_config =
      parse_config(R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4})");
  ASSERT_TRUE(open_config.is_ok()) << open_config.status().to_string();
  engine_test::Ranks ranks = engine_test::make_ranks(2);
  for (const Status& s :
       engine_test::run_engines(*open_config, ranks, [](int, Engine& engine) -> Status {
         EXPECT_EQ(engine.config().gradient_accumulation_steps, 2u);
         EXPECT_TRUE(engine.config().gradient_accumulation_given);
         return Status::ok();
       })) {
    EXPECT_TRUE(s.is_ok()) << s.to_string();
  }
  Result<Config> disagree = parse_config(
      R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 1})");
  ASSERT_TRUE(disagree.is_ok()) << disagree.status().to_string();
  for (const Status& s :
       engine_test::run_engines(*disagree, ranks, [](int, Engine&) { return Status::ok(); })) {
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_EQ(s.message().rfind("train_batch_size: 16 is not", 0), 0u) << s.to_string();
  }
}

// "auto" for train_batch_size or train_micro_batch_size_per_gpu is what the Hugging Face Trainer
// writes over; zinf takes it as not given. Where neither key has a number, nothing gives the
// micro-batch size (DeepSpeed refuses a config without either), so each "auto" of the two is
// refused, naming both keys; a config without any batch key keeps the micro-batch of 1.
TEST(Config, AutoBatchSizesWithNothingToDeriveFromAreRefused) {
  const std::string why =
      "\"auto\" is a placeholder that the Hugging Face Trainer fills in before DeepSpeed reads "
      "the config, and with neither train_batch_size nor train_micro_batch_size_per_gpu written "
      "nothing gives the micro-batch size: write the value of one of them (DeepSpeed refuses a "
      "config with neither)";
  struct Refused {
    const char* json;
    const char* key;  // the first refused, which parse_config() names
  };
  const Refused refused[] = {
      {R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})",
       "train_batch_size"},
      {R"({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"})",
       "train_micro_batch_size_per_gpu"},
      {R"({"train_batch_size": "auto"})", "train_batch_size"},
      {R"({"train_micro_batch_size_per_gpu": "auto"})", "train_micro_batch_size_per_gpu"},
      // The steps alone do not give the micro-batch size, nor does the world size.
      {R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": 2, "zinf": {"world_size": 4}})",
       "train_batch_size"},
  };
  for (const Refused& c : refused) {
    Result<Config> r = parse_config(c.json);
    ASSERT_FALSE(r.is_ok()) << c.json;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_EQ(std::string(r.status().message()), fmt::format("{}: {}", c.key, why)) << c.json;
  }
  // `zinf config check` refuses each "auto" of the two with the same reason; the other keys keep
  // their verdicts.
  Result<std::vector<KeyReport>> report = check_config(refused[0].json);
  ASSERT_TRUE(report.is_ok()) << report.status().to_string();
  ASSERT_EQ(report->size(), 4u);
  for (std::size_t i : {0u, 1u}) {
    EXPECT_EQ((*report)[i].use, KeyUse::kRefused) << (*report)[i].key;
    EXPECT_EQ((*report)[i].why, why) << (*report)[i].key;
  }
  EXPECT_EQ((*report)[2].use, KeyUse::kUsed);
  EXPECT_EQ((*report)[3].use, KeyUse::kUsed);

  // Where one has a number, "auto" stays "not given", and the other is derived as before.
  struct Accepted {
    const char* json;
    std::size_t micro;
  };
  const Accepted accepted[] = {
      {R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2})", 2},
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto",
           "zinf": {"world_size": 4}})",
       8},
      // No batch key at all: DeepSpeed would refuse it; zinf keeps its micro-batch of 1.
      {R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})", 1},
      {R"({"gradient_accumulation_steps": 4})", 1},
  };
  for (const Accepted& c : accepted) {
    Result<Config> r = parse_config(c.json);
    ASSERT_TRUE(r.is_ok()) << c.json << ": " << r.status().to_string();
    EXPECT_EQ(r->train_micro_batch_size_per_gpu, c.micro) << c.json;
  }
  // The configs of the Hugging Face integrations have both "auto" (the Trainer fills them in);
  // one whose other "auto" keys are written out is refused for the batch keys alone.
  const char* hf = R"({"fp16": {"enabled": false}, "gradient_accumulation_steps": 1,
      "gradient_clipping": 1.0, "steps_per_print": 2000, "train_batch_size": "auto",
      "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": false})";
  Result<Config> r = parse_config(hf);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(std::string(r.status().message()), fmt::format("train_batch_size: {}", why));
}

}  // namespace
}  // namespace zinf
