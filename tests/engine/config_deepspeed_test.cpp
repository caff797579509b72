// Config against DeepSpeed's own reader: each case cites the DeepSpeed source whose behaviour it
// pins (deepspeed/runtime/config.py, config_utils.py, precision_config.py, zero/config.py,
// zero/offload_config.py). A key is used with DeepSpeed's meaning, accepted with no effect, or
// refused naming it; never read with another meaning.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <span>
#include <string>
#include <vector>

#include "zinf/config.hpp"

namespace zinf {
namespace {

// The report of `key` in check_config's answer for `text`.
KeyReport report_of(const std::string& text, const std::string& key) {
  Result<std::vector<KeyReport>> reports = check_config(text);
  EXPECT_TRUE(reports.is_ok()) << reports.status().to_string();
  if (!reports.is_ok()) return {};
  for (const KeyReport& r : *reports) {
    if (r.key == key) return r;
  }
  ADD_FAILURE() << key << " is not reported for " << text;
  return {};
}

// The message of parse_config's refusal of `text`; fails the test when it is accepted.
std::string refusal(const std::string& text) {
  Result<Config> c = parse_config(text);
  EXPECT_FALSE(c.is_ok()) << text;
  if (c.is_ok()) return "";
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument) << text;
  return std::string(c.status().message());
}

// DeepSpeed loads a config file with object_pairs_hook=dict_raise_error_on_duplicate_keys
// (config.py, DeepSpeedConfig.__init__; config_utils.py): a key given twice in one object is an
// error, not "the last one wins".
TEST(ConfigDeepSpeed, DuplicateKeysAreRefusedNamingTheKey) {
  const std::string message = refusal(R"({"zero_optimization": {"stage": 1, "stage": 3}})");
  EXPECT_EQ(message.rfind("zero_optimization.stage: ", 0), 0u) << message;
  EXPECT_NE(message.find("twice"), std::string::npos) << message;
  // At the root too.
  EXPECT_EQ(refusal(R"({"gradient_clipping": 1.0, "steps_per_print": 1, "gradient_clipping": 0})")
                .rfind("gradient_clipping: ", 0),
            0u);
  // The same key in two different objects is no duplicate.
  Result<Config> c = parse_config(
      R"({"fp16": {"enabled": false}, "bf16": {"enabled": true}, "zero_optimization": {}})");
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
}

// DeepSpeedZeroConfig's stage-3 fields are declared under their short names with the "stage3_"
// spellings as aliases, and its model allows population by field name (zero/config.py,
// prefetch_bucket_size = Field(..., alias="stage3_prefetch_bucket_size"); config_utils.py,
// DeepSpeedConfigModel: populate_by_name): both spellings mean the same field.
TEST(ConfigDeepSpeed, Stage3FieldNamesAreReadAsTheirAliases) {
  Result<Config> c = parse_config(R"({"zero_optimization": {
    "prefetch_bucket_size": 1234, "param_persistence_threshold": 55,
    "max_live_parameters": 7e8, "max_reuse_distance": 1e9,
    "gather_16bit_weights_on_model_save": true}})");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->zero.stage3_prefetch_bucket_size, 1234u);
  EXPECT_EQ(c->zero.stage3_param_persistence_threshold, 55u);
  EXPECT_EQ(c->zero.stage3_max_live_parameters, 700'000'000u);
  EXPECT_EQ(report_of(R"({"zero_optimization": {"prefetch_bucket_size": 1}})",
                      "zero_optimization.prefetch_bucket_size")
                .use,
            KeyUse::kUsed);
  // One field under both of its names is refused, naming the second.
  const std::string message = refusal(
      R"({"zero_optimization": {"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}})");
  EXPECT_EQ(message.rfind("zero_optimization.prefetch_bucket_size: ", 0), 0u) << message;
  EXPECT_NE(message.find("stage3_prefetch_bucket_size"), std::string::npos) << message;
}

// A deprecated key and the key that replaces it may not be given together (config_utils.py,
// _process_deprecated_field: "Cannot provide deprecated parameter ... and replacing parameter
// ... together"); zinf refused neither, and the later one in the file won.
TEST(ConfigDeepSpeed, DeprecatedKeyWithItsReplacementIsRefused) {
  const struct {
    const char* json;
    const char* key;
  } cases[] = {
      {R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
                                 "cpu_offload": true}})",
       "zero_optimization.cpu_offload"},
      {R"({"zero_optimization": {"cpu_offload": false, "offload_optimizer": {"device": "cpu"}}})",
       "zero_optimization.offload_optimizer"},
      {R"({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/x"},
                                 "cpu_offload_param": true}})",
       "zero_optimization.cpu_offload_param"},
      {R"({"zero_optimization": {"cpu_offload_params": true, "offload_param": {"device": "cpu"}}})",
       "zero_optimization.offload_param"},
      {R"({"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true,
                                 "stage3_gather_fp16_weights_on_model_save": true}})",
       "zero_optimization.stage3_gather_fp16_weights_on_model_save"},
  };
  for (const auto& c : cases) {
    const std::string message = refusal(c.json);
    EXPECT_EQ(message.rfind(fmt::format("{}: ", c.key), 0), 0u) << message;
    EXPECT_NE(message.find("together"), std::string::npos) << message;
  }
}

// "bfloat16" is DeepSpeed's older name of the bf16 section, still read when "bf16" is absent
// (precision_config.py, get_bfloat16_config: BFLOAT16_OLD).
TEST(ConfigDeepSpeed, Bfloat16IsTheBf16Section) {
  Result<Config> c = parse_config(R"({"bfloat16": {"enabled": true}})");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_TRUE(c->bf16_enabled);
  EXPECT_EQ(report_of(R"({"bfloat16": {"enabled": true}})", "bfloat16.enabled").use, KeyUse::kUsed);
  // DeepSpeed reads "bf16" and ignores "bfloat16" when both are there: refused, not guessed.
  const std::string message =
      refusal(R"({"bf16": {"enabled": false}, "bfloat16": {"enabled": true}})");
  EXPECT_EQ(message.rfind("bfloat16: ", 0), 0u) << message;
  // fp16 and bf16 under its old name are still both enabled.
  EXPECT_EQ(refusal(R"({"fp16": {"enabled": true}, "bfloat16": {"enabled": true}})")
                .rfind("fp16.enabled: ", 0),
            0u);
}

// DeepSpeedBF16Config's switches whose default (false) is what zinf does (precision_config.py),
// and check_grad_overflow, which zinf does whatever it says: every step's gradients are checked
// for inf and NaN, and such a step is skipped.
TEST(ConfigDeepSpeed, Bf16SwitchesAtTheirDefaultHaveNoEffect) {
  for (const char* key : {"bf16_master_weights_and_grads", "bf16_optimizer_states"}) {
    const std::string off = fmt::format(R"({{"bf16": {{"enabled": true, "{}": false}}}})", key);
    EXPECT_EQ(report_of(off, fmt::format("bf16.{}", key)).use, KeyUse::kNoEffect) << key;
    EXPECT_TRUE(parse_config(off).is_ok()) << key;
    const std::string on = fmt::format(R"({{"bf16": {{"enabled": true, "{}": true}}}})", key);
    EXPECT_EQ(refusal(on).rfind(fmt::format("bf16.{}: true is not supported", key), 0), 0u)
        << refusal(on);
  }
  for (const char* value : {"true", "false"}) {
    const std::string text =
        fmt::format(R"({{"bf16": {{"enabled": true, "check_grad_overflow": {}}}}})", value);
    const KeyReport r = report_of(text, "bf16.check_grad_overflow");
    EXPECT_EQ(r.use, KeyUse::kNoEffect) << value;
    EXPECT_NE(r.why.find("inf and NaN"), std::string::npos) << r.why;
  }
}

// DeepSpeed asserts both counts are above 0 (config.py, _batch_assertion and _do_error_check).
TEST(ConfigDeepSpeed, ZeroMicroBatchOrAccumulationStepsAreRefused) {
  EXPECT_EQ(refusal(R"({"gradient_accumulation_steps": 0})")
                .rfind("gradient_accumulation_steps: 0 is below 1", 0),
            0u);
  EXPECT_EQ(refusal(R"({"train_micro_batch_size_per_gpu": 0})")
                .rfind("train_micro_batch_size_per_gpu: 0 is below 1", 0),
            0u);
}

// DeepSpeed passes offload_param only to its stage-3 optimizer (runtime/engine.py,
// _configure_zero_optimizer; zero/offload_config.py: "Valid only with stage 3"), so at stages 1
// and 2 it silently asks for nothing. zinf refuses it there, and the message says so.
TEST(ConfigDeepSpeed, OffloadParamBelowStage3IsRefusedSayingDeepSpeedIgnoresIt) {
  const std::string message = refusal(R"({"zero_optimization": {"stage": 2,
      "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}})");
  EXPECT_EQ(message.rfind("zero_optimization.offload_param.device: \"cpu\" needs stage 3", 0), 0u)
      << message;
  EXPECT_NE(message.find("DeepSpeed ignores offload_param below stage 3"), std::string::npos)
      << message;
  Result<Config> none =
      parse_config(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "none"}}})");
  EXPECT_TRUE(none.is_ok()) << none.status().to_string();
}

// DeepSpeed still reads zero_optimization written as a boolean, the form of its Getting Started
// tutorial's sample config (zero/config.py, read_zero_config_deprecated: true is stage 1, false
// stage 0). zinf refuses it naming the key and the object that means the same, and that object
// reads as that stage.
TEST(ConfigDeepSpeed, BooleanZeroOptimizationIsRefusedNamingTheObjectThatMeansTheSame) {
  const std::string on = refusal(R"({"train_batch_size": 8, "zero_optimization": true})");
  EXPECT_EQ(on.rfind("zero_optimization: true is DeepSpeed's older form of {\"stage\": 1}", 0), 0u)
      << on;
  EXPECT_NE(on.find("write the section as an object: \"zero_optimization\": {\"stage\": 1}"),
            std::string::npos)
      << on;
  const std::string off = refusal(R"({"zero_optimization": false})");
  EXPECT_EQ(off.rfind("zero_optimization: false is DeepSpeed's older form of {\"stage\": 0} "
                      "(ZeRO off)",
                      0),
            0u)
      << off;
  EXPECT_EQ(report_of(R"({"zero_optimization": true})", "zero_optimization").use, KeyUse::kRefused);
  // What the message says to write: stage 1, and stage 0 (ZeRO off), which runs as stage 1.
  for (const char* text :
       {R"({"zero_optimization": {"stage": 1}})", R"({"zero_optimization": {"stage": 0}})"}) {
    Result<Config> c = parse_config(text);
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    EXPECT_EQ(c->zero.stage, 1) << text;
  }
  // Another section given as a value that is no object keeps the plain refusal.
  EXPECT_EQ(refusal(R"({"fp16": true})"), "fp16: true is not an object");
  EXPECT_EQ(refusal(R"({"zero_optimization": 1})"), "zero_optimization: 1 is not an object");
}

// nvme_path is Optional[Path] in DeepSpeed (zero/offload_config.py): null is "not given", which
// is what `accelerate config` writes for a cpu offload.
TEST(ConfigDeepSpeed, NullNvmePathIsNotGiven) {
  Result<Config> c = parse_config(R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "nvme_path": null},
      "offload_param": {"device": "cpu", "nvme_path": null}}})");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->zero.offload_optimizer.nvme_path, "");
  EXPECT_EQ(c->zero.offload_param.nvme_path, "");
  EXPECT_NE(refusal(R"({"zero_optimization": {"offload_optimizer": {"nvme_path": 3}}})")
                .find("a string or null"),
            std::string::npos);
}

// zinf reduce-scatters and accumulates gradients in fp32 whatever the parameters' dtype, so
// communication_data_type "fp32" (and null, DeepSpeed's "not set") changes nothing, and a 16-bit
// reduction is refused with that reason (config.py, get_communication_data_type).
TEST(ConfigDeepSpeed, CommunicationDataTypeFp32HasNoEffect) {
  for (const char* value : {R"("fp32")", R"("FP32")", "null"}) {
    const std::string text = fmt::format(R"({{"communication_data_type": {}}})", value);
    EXPECT_EQ(report_of(text, "communication_data_type").use, KeyUse::kNoEffect) << value;
  }
  for (const char* value : {R"("fp16")", R"("bf16")"}) {
    const std::string message = refusal(fmt::format(R"({{"communication_data_type": {}}})", value));
    EXPECT_EQ(message.rfind("communication_data_type: ", 0), 0u) << message;
    EXPECT_NE(message.find("fp32"), std::string::npos) << message;
  }
  EXPECT_EQ(
      report_of(R"({"data_types": {"grad_accum_dtype": "fp32"}})", "data_types.grad_accum_dtype")
          .use,
      KeyUse::kNoEffect);
  EXPECT_EQ(refusal(R"({"data_types": {"grad_accum_dtype": "bf16"}})")
                .rfind("data_types.grad_accum_dtype: ", 0),
            0u);
}

// Keys of current DeepSpeed releases whose only effect is speed or logging, or whose default is
// zinf's behaviour (zero/config.py, zero/offload_config.py).
TEST(ConfigDeepSpeed, NewerSpeedOnlyKeysHaveNoEffect) {
  const char* no_effect[] = {
      R"({"zero_optimization": {"use_multi_rank_bucket_allreduce": true}})",
      R"({"zero_optimization": {"stage3_module_granularity_threshold": 100}})",
      R"({"zero_optimization": {"module_granularity_threshold": 100}})",
      R"({"zero_optimization": {"stage3_use_all_reduce_for_fetch_params": true}})",
      R"({"zero_optimization": {"stage3_allgather_sequential": true}})",
      R"({"zero_optimization": {"log_trace_cache_warnings": true}})",
      R"({"zero_optimization": {"stage3_model_persistence_threshold": 9223372036854775807}})",
      R"({"zero_optimization": {"zero_quantized_nontrainable_weights": false}})",
      R"({"zero_optimization": {"mics_shard_size": -1}})",
      R"({"zero_optimization": {"offload_optimizer": {"super_offload": false}}})",
      R"({"zero_optimization": {"offload_optimizer": {"cpuadam_cores_perc": 0.5}}})",
  };
  for (const char* text : no_effect) {
    Result<std::vector<KeyReport>> r = check_config(text);
    ASSERT_TRUE(r.is_ok());
    ASSERT_FALSE(r->empty()) << text;
    EXPECT_EQ(r->back().use, KeyUse::kNoEffect) << text << ": " << r->back().why;
  }
  const struct {
    const char* json;
    const char* key;
  } refused[] = {
      {R"({"zero_optimization": {"stage3_model_persistence_threshold": 1000}})",
       "zero_optimization.stage3_model_persistence_threshold"},
      {R"({"zero_optimization": {"mics_shard_size": 8}})", "zero_optimization.mics_shard_size"},
      {R"({"zero_optimization": {"offload_optimizer": {"super_offload": true}}})",
       "zero_optimization.offload_optimizer.super_offload"},
  };
  for (const auto& c : refused) {
    EXPECT_EQ(refusal(c.json).rfind(fmt::format("{}: ", c.key), 0), 0u) << refusal(c.json);
  }
}

// DeepSpeed reads a config file with hjson (config.py, DeepSpeedConfig.__init__), so files carry
// comments and trailing commas: they read as the plain JSON does. A '#' or "//" inside a string
// stays, and an error after a comment names its own line and column.
TEST(ConfigDeepSpeed, CommentsAndTrailingCommasReadAsDeepSpeedReadsThem) {
  const std::string commented = R"(# ZeRO-3 with the optimizer on NVMe
{
  // the batch
  "train_micro_batch_size_per_gpu": 2,  # per GPU
  /* two lines
     of comment */
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/a#b//c", "buffer_count": 5,},
  },
  "optimizer": {"type": "AdamW", "params": {"betas": [0.8, 0.95,], "lr": 3e-4}},
}
)";
  const std::string plain = R"({"train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
      "nvme_path": "/mnt/a#b//c", "buffer_count": 5}},
    "optimizer": {"type": "AdamW", "params": {"betas": [0.8, 0.95], "lr": 3e-4}}})";
  Result<Config> a = parse_config(commented);
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  Result<Config> b = parse_config(plain);
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  EXPECT_EQ(config_to_json(*a), config_to_json(*b));
  EXPECT_EQ(a->zero.offload_optimizer.nvme_path, "/mnt/a#b//c");
  EXPECT_EQ(a->optimizer.beta1, 0.8);
  EXPECT_EQ(a->zero.offload_optimizer.buffer_count, 5u);
  Result<std::vector<KeyReport>> reports = check_config(commented);
  ASSERT_TRUE(reports.is_ok()) << reports.status().to_string();
  // A comment between a trailing comma and its bracket; CRLF line ends.
  Result<Config> c =
      parse_config("{\"zero_optimization\": {\"stage\": 2, // two\r\n /* end */ },\r\n}");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->zero.stage, 2);
  // A comma with no value before it stays, and is refused as JSON.
  for (const char* empty : {"{\"x\": [,]}", "{,}", "{\"x\": [1,,]}"}) {
    EXPECT_NE(refusal(empty).find("not valid JSON"), std::string::npos) << empty;
  }
  // Line 4: the missing colon after the comments above it.
  const std::string broken =
      "// a\n{\n  // b\n  \"zero_optimization\": {\"stage\": 3}, \"x\" 1, \"y\": 2\n}";
  const std::string why = refusal(broken);
  EXPECT_NE(why.find("line 4, column "), std::string::npos) << why;
  // What is not comments or trailing commas stays refused: a quoteless string.
  EXPECT_NE(refusal(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": cpu}}})")
                .find("not valid JSON"),
            std::string::npos);
}

// Each case: a config that is accepted with the key reported as having no effect, and why
// contains `why`.
struct NoEffectCase {
  const char* json;
  const char* key;
  const char* why;
};

void expect_no_effect(std::span<const NoEffectCase> cases) {
  for (const NoEffectCase& c : cases) {
    SCOPED_TRACE(c.json);
    Result<Config> config = parse_config(c.json);
    EXPECT_TRUE(config.is_ok()) << config.status().to_string();
    const KeyReport r = report_of(c.json, c.key);
    EXPECT_EQ(r.use, KeyUse::kNoEffect) << r.why;
    EXPECT_NE(r.why.find(c.why), std::string::npos) << r.why;
  }
}

// Each case: a config refused with exactly `message`, which `zinf config check` reports against
// the key.
struct RefusedCase {
  const char* json;
  const char* key;
  std::string message;
};

void expect_refused_exactly(std::span<const RefusedCase> cases) {
  for (const RefusedCase& c : cases) {
    SCOPED_TRACE(c.json);
    EXPECT_EQ(refusal(c.json), c.message);
    Result<std::vector<KeyReport>> reports = check_config(c.json);
    ASSERT_TRUE(reports.is_ok()) << reports.status().to_string();
    bool seen = false;
    for (const KeyReport& r : *reports) {
      if (r.key != c.key) continue;
      seen = true;
      EXPECT_EQ(r.use, KeyUse::kRefused);
      EXPECT_EQ(fmt::format("{}: {}", r.key, r.why), c.message);
    }
    EXPECT_TRUE(seen) << c.key;
  }
}

// DeepSpeed's checkpoint section (runtime/constants.py, CHECKPOINT; runtime/config.py,
// get_checkpoint_tag_validation_mode uppercases tag_validation and knows WARN, IGNORE and FAIL;
// model_checkpointing/config.py, the writer). zinf always refuses differing tags, reads no
// universal checkpoint and saves one shared directory: the values that say so are accepted, and
// those asking for more are refused naming what to write.
TEST(ConfigDeepSpeed, CheckpointSectionAtWhatZinfDoesHasNoEffect) {
  const NoEffectCase accepted[] = {
      {R"({"checkpoint": {"tag_validation": "Warn"}})", "checkpoint.tag_validation",
       "zinf always refuses a save whose ranks pass different tags"},
      {R"({"checkpoint": {"tag_validation": "ignore"}})", "checkpoint.tag_validation",
       "zinf always refuses a save whose ranks pass different tags"},
      {R"({"checkpoint": {"tag_validation": "WARN"}})", "checkpoint.tag_validation",
       "only logs a mismatch"},
      {R"({"checkpoint": {"tag_validation": "Fail"}})", "checkpoint.tag_validation",
       "\"Fail\" does the same"},
      {R"({"checkpoint": {"load_universal": false}})", "checkpoint.load_universal",
       "false: zinf loads its own checkpoints"},
      {R"({"checkpoint": {"use_node_local_storage": false}})", "checkpoint.use_node_local_storage",
       "false: one checkpoint directory that every rank reaches"},
      {R"({"checkpoint": {"parallel_write": {"pipeline_stage": true}}})",
       "checkpoint.parallel_write.pipeline_stage", "no pipeline parallelism"},
      {R"({"checkpoint": {"parallel_write": {"pipeline_stage": false}}})",
       "checkpoint.parallel_write.pipeline_stage", "no pipeline parallelism"},
      {R"({"checkpoint": {"writer": {"type": "fast", "decoupled": true, "io_buffer_size": 1e9}}})",
       "checkpoint.writer", "how DeepSpeed writes its checkpoint files"},
  };
  expect_no_effect(accepted);

  const RefusedCase refused[] = {
      {R"({"checkpoint": {"tag_validation": "Strict"}})", "checkpoint.tag_validation",
       "checkpoint.tag_validation: \"Strict\" is not \"Warn\", \"Ignore\" or \"Fail\""},
      {R"({"checkpoint": {"tag_validation": true}})", "checkpoint.tag_validation",
       "checkpoint.tag_validation: true is not \"Warn\", \"Ignore\" or \"Fail\""},
      {R"({"checkpoint": {"load_universal": true}})", "checkpoint.load_universal",
       "checkpoint.load_universal: true is not supported: zinf cannot read DeepSpeed's universal "
       "checkpoints (ds_to_universal.py's output); its own checkpoints load at any world size "
       "without a conversion: write false"},
      {R"({"checkpoint": {"use_node_local_storage": true}})", "checkpoint.use_node_local_storage",
       "checkpoint.use_node_local_storage: true is not supported: zinf saves one checkpoint "
       "directory that every rank reaches (rank 0 creates the tag and writes its manifest): give "
       "save_checkpoint a directory every machine shares and write false"},
      {R"({"checkpoint": {"parallel_write": {"pipeline_stage": "yes"}}})",
       "checkpoint.parallel_write.pipeline_stage",
       "checkpoint.parallel_write.pipeline_stage: \"yes\" is not true or false"},
  };
  expect_refused_exactly(refused);
}

// Top-level switches of DeepSpeed's (runtime/constants.py, runtime/config.py): sparse_gradients
// (false by default) and torch_autocast (enabled false by default) accepted at their defaults;
// the modes they turn on, which zinf does not run, refused naming what zinf offers.
TEST(ConfigDeepSpeed, SparseGradientsAndTorchAutocastOffHaveNoEffect) {
  const NoEffectCase accepted[] = {
      {R"({"sparse_gradients": false})", "sparse_gradients", "false: every gradient reduced dense"},
      {R"({"torch_autocast": {"enabled": false, "dtype": "bfloat16",
           "lower_precision_safe_modules": ["torch.nn.Linear"]}})",
       "torch_autocast", "disabled (\"enabled\" is false)"},
      {R"({"torch_autocast": {}})", "torch_autocast", "disabled (\"enabled\" is absent)"},
  };
  expect_no_effect(accepted);

  const std::string autocast_why =
      "DeepSpeed's torch.autocast mode is not supported; zinf's mixed precision is its bf16 or "
      "fp16 section (16-bit parameters, an fp32 master): enable one of those";
  const RefusedCase refused[] = {
      {R"({"sparse_gradients": true})", "sparse_gradients",
       "sparse_gradients: true is not supported: DeepSpeed then reduces the gradients of the "
       "embedding modules as sparse tensors; zinf reduces every gradient dense: write false"},
      {R"({"sparse_gradients": 0})", "sparse_gradients",
       "sparse_gradients: 0 is not true or false"},
      {R"({"torch_autocast": {"enabled": true, "dtype": "bfloat16"}})", "torch_autocast",
       fmt::format("torch_autocast: enabled: {}; \"enabled\": false has no effect", autocast_why)},
      {R"({"torch_autocast": true})", "torch_autocast",
       fmt::format("torch_autocast: {}", autocast_why)},
  };
  expect_refused_exactly(refused);
}

// DeepSpeed reads the accumulation dtype as data_types.grad_accum_dtype (runtime/config.py,
// get_data_types_params) and no key "gradient_accumulation_dtype", which configs write meaning
// the same; the sequence-parallel reduction's dtype as "seq_parallel_comm_data_type"
// (runtime/constants.py, SEQ_PARALLEL_COMMUNICATION_DATA_TYPE, fp32 by default), which its
// docstring spells "seq_parallel_communication_data_type". zinf accumulates and reduces in fp32 and
// has no sequence parallelism: fp32 (and null, "not set") has no effect, a 16-bit dtype is refused.
TEST(ConfigDeepSpeed, AccumulationAndSequenceParallelDtypesAtFp32HaveNoEffect) {
  const NoEffectCase accepted[] = {
      {R"({"gradient_accumulation_dtype": "fp32"})", "gradient_accumulation_dtype",
       "DeepSpeed reads no key of this name"},
      {R"({"gradient_accumulation_dtype": "torch.float32"})", "gradient_accumulation_dtype",
       "data_types.grad_accum_dtype"},
      {R"({"gradient_accumulation_dtype": null})", "gradient_accumulation_dtype",
       "fp32 is what zinf accumulates gradients in"},
      {R"({"seq_parallel_comm_data_type": "fp32"})", "seq_parallel_comm_data_type",
       "zinf has no sequence parallelism"},
      {R"({"seq_parallel_comm_data_type": "FP32"})", "seq_parallel_comm_data_type",
       "fp32 (DeepSpeed's default)"},
      {R"({"seq_parallel_comm_data_type": null})", "seq_parallel_comm_data_type",
       "zinf has no sequence parallelism"},
      {R"({"seq_parallel_communication_data_type": "fp32"})",
       "seq_parallel_communication_data_type", "zinf has no sequence parallelism"},
  };
  expect_no_effect(accepted);

  const std::string no_sp =
      "is not supported: zinf has no sequence parallelism, so no gradient is reduced over a "
      "sequence-parallel group; write \"fp32\" (DeepSpeed's default) or remove the key";
  const RefusedCase refused[] = {
      {R"({"gradient_accumulation_dtype": "bf16"})", "gradient_accumulation_dtype",
       "gradient_accumulation_dtype: \"bf16\" is not supported: zinf accumulates gradients in "
       "fp32 (DeepSpeed reads no key of this name: its accumulation dtype is "
       "data_types.grad_accum_dtype)"},
      {R"({"gradient_accumulation_dtype": "fp16"})", "gradient_accumulation_dtype",
       "gradient_accumulation_dtype: \"fp16\" is not supported: zinf accumulates gradients in "
       "fp32 (DeepSpeed reads no key of this name: its accumulation dtype is "
       "data_types.grad_accum_dtype)"},
      {R"({"seq_parallel_comm_data_type": "bf16"})", "seq_parallel_comm_data_type",
       fmt::format("seq_parallel_comm_data_type: \"bf16\" {}", no_sp)},
      {R"({"seq_parallel_communication_data_type": "fp16"})",
       "seq_parallel_communication_data_type",
       fmt::format("seq_parallel_communication_data_type: \"fp16\" {}", no_sp)},
      {R"({"seq_parallel_comm_data_type": 32})", "seq_parallel_comm_data_type",
       "seq_parallel_comm_data_type: 32 is not \"fp16\", \"bf16\" or \"fp32\""},
  };
  expect_refused_exactly(refused);
}

}  // namespace
}  // namespace zinf
