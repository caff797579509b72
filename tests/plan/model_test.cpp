// Presets: parameter counts from layer shapes against the published counts, and against sums of
// the released checkpoints' tensor shapes written out by hand.
#include "plan/model.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <future>
#include <memory>
#include <numeric>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

namespace zinf::plan {
namespace {

TEST(ModelPresets, EveryPresetCountsExactlyItsReleasedTensors) {
  // The parameter count of each released checkpoint, written here independently of the preset
  // table (the Hugging Face hub's safetensors metadata of each repository named in
  // lib/plan/model.cpp). A wrong shape in a preset (a hidden size, a KV-head count, a missing
  // bias or an untied head) changes the count computed from it, so it cannot pass; nor can a
  // preset whose own published figure was mistyped.
  const std::pair<const char*, std::uint64_t> released[] = {
      {"gpt2", 124'439'808},           {"gpt2-medium", 354'823'168},
      {"gpt2-large", 774'030'080},     {"gpt2-xl", 1'557'611'200},
      {"llama-2-7b", 6'738'415'616},   {"llama-2-13b", 13'015'864'320},
      {"llama-2-70b", 68'976'648'192}, {"llama-3-8b", 8'030'261'248},
      {"llama-3-70b", 70'553'706'496}, {"mistral-7b", 7'241'732'096}};
  ASSERT_EQ(model_presets().size(), std::size(released)) << "a preset without a count here";
  for (const auto& [name, count] : released) {
    const std::optional<ModelShape> m = find_model_preset(name);
    ASSERT_TRUE(m.has_value()) << name;
    EXPECT_EQ(param_count(*m), count) << name << ": count from the preset's shapes";
    EXPECT_EQ(m->published_param_count, count) << name << ": the preset's published figure";
  }
}

TEST(ModelPresets, NominalSizesAreRoughlyRight) {
  // The names promise sizes; a wrong shape (e.g. hidden and intermediate swapped) would be far
  // off these even if a published figure were mistyped too.
  const std::pair<const char*, double> nominal[] = {
      {"gpt2", 0.124e9},     {"gpt2-medium", 0.355e9}, {"gpt2-large", 0.774e9}, {"gpt2-xl", 1.5e9},
      {"llama-2-7b", 7e9},   {"llama-2-13b", 13e9},    {"llama-2-70b", 70e9},   {"llama-3-8b", 8e9},
      {"llama-3-70b", 70e9}, {"mistral-7b", 7.2e9}};
  for (const auto& [name, size] : nominal) {
    auto m = find_model_preset(name);
    ASSERT_TRUE(m.has_value()) << name;
    EXPECT_LT(std::abs(static_cast<double>(param_count(*m)) - size) / size, 0.05) << name;
  }
}

std::uint64_t sum_of_shapes(const std::vector<std::vector<std::uint64_t>>& shapes) {
  std::uint64_t total = 0;
  for (const auto& shape : shapes) {
    total += std::accumulate(shape.begin(), shape.end(), std::uint64_t{1},
                             std::multiplies<std::uint64_t>());
  }
  return total;
}

TEST(ModelPresets, Gpt2MatchesItsStateDictTensorShapes) {
  // openai-community/gpt2: the tensors of the checkpoint (Conv1D weights are [in, out]).
  std::vector<std::vector<std::uint64_t>> shapes = {{50257, 768}, {1024, 768}};
  for (int layer = 0; layer < 12; ++layer) {
    shapes.insert(shapes.end(), {{768},
                                 {768},  // ln_1
                                 {768, 2304},
                                 {2304},  // attn.c_attn
                                 {768, 768},
                                 {768},  // attn.c_proj
                                 {768},
                                 {768},  // ln_2
                                 {768, 3072},
                                 {3072},  // mlp.c_fc
                                 {3072, 768},
                                 {768}});  // mlp.c_proj
  }
  shapes.insert(shapes.end(), {{768}, {768}});  // ln_f; lm_head is tied to wte
  EXPECT_EQ(param_count(*find_model_preset("gpt2")), sum_of_shapes(shapes));
  EXPECT_EQ(sum_of_shapes(shapes), 124'439'808u);
}

TEST(ModelPresets, LlamaWithGroupedQueryAttentionMatchesTensorShapes) {
  // meta-llama/Meta-Llama-3-8B: 8 KV heads of width 128, so k_proj and v_proj are 1024 x 4096.
  std::vector<std::vector<std::uint64_t>> shapes = {{128256, 4096}};
  for (int layer = 0; layer < 32; ++layer) {
    shapes.insert(shapes.end(), {{4096, 4096},
                                 {1024, 4096},
                                 {1024, 4096},
                                 {4096, 4096},
                                 {14336, 4096},
                                 {14336, 4096},
                                 {4096, 14336},
                                 {4096},
                                 {4096}});
  }
  shapes.insert(shapes.end(), {{4096}, {128256, 4096}});  // norm, untied lm_head
  EXPECT_EQ(param_count(*find_model_preset("llama-3-8b")), sum_of_shapes(shapes));
}

TEST(ModelPresets, LookupIgnoresCaseAndSeparators) {
  for (const char* name : {"Llama-2-7B", "llama2_7b", "llama27b", "LLAMA-2-7b"}) {
    auto m = find_model_preset(name);
    ASSERT_TRUE(m.has_value()) << name;
    EXPECT_EQ(m->name, "llama-2-7b");
  }
  EXPECT_FALSE(find_model_preset("llama-9-1t").has_value());
}

TEST(ModelShapes, CustomModelUsesTheGivenCount) {
  const ModelShape m = custom_model(1'000'000'000, 24, 2048);
  EXPECT_EQ(param_count(m), 1'000'000'000u);
  // (count - 2·V·h) / L with the default vocab 32000.
  EXPECT_EQ(layer_params(m), (1'000'000'000u - 2u * 32000u * 2048u) / 24u);
}

// Found by the plan_input fuzz target: a prime hidden size near 2^61 made custom_model count
// heads down one by one from hidden / 128, about 1.8e16 tries.
TEST(ModelShapes, CustomModelOfAHugePrimeHiddenSizeReturnsAtOnce) {
  auto done = std::make_shared<std::promise<ModelShape>>();
  std::future<ModelShape> result = done->get_future();
  std::thread([done]() {
    done->set_value(custom_model(1'000'000'000, 4, 2'305'843'009'213'693'951ull));  // 2^61 - 1
  }).detach();
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready)
      << "custom_model still searching for heads after 20 s";
  const ModelShape m = result.get();
  EXPECT_EQ(m.heads, 1u);
  EXPECT_EQ(m.hidden % m.heads, 0u);
  // Sizes of real models keep heads of 128.
  EXPECT_EQ(custom_model(1'000'000'000, 24, 2048).heads, 16u);
  EXPECT_EQ(custom_model(1'000'000'000, 4, 1029).heads, 7u);
}

TEST(ModelShapes, LargestTensorIsTheEmbeddingOrAnMlpMatrix) {
  const ModelShape l3 = *find_model_preset("llama-3-70b");
  EXPECT_EQ(largest_tensor_params(l3), 128256u * 8192u);
  ModelShape narrow_vocab = l3;
  narrow_vocab.vocab = 1000;
  EXPECT_EQ(largest_tensor_params(narrow_vocab), 8192u * 28672u);
}

// The count zinf plan prints: "0.000e9" said nothing of a 60k-parameter train_lm model.
TEST(ModelShapes, ParamCountReadsAsPeopleWriteIt) {
  const std::pair<std::uint64_t, const char*> cases[] = {{0, "0"},
                                                         {950, "950"},
                                                         {1'000, "1.0k"},
                                                         {54'240, "54.2k"},
                                                         {60'000, "60.0k"},
                                                         {999'949, "999.9k"},
                                                         {999'950, "1.00M"},  // not "1000.0k"
                                                         {1'200'000, "1.20M"},
                                                         {999'994'999, "999.99M"},
                                                         {999'995'000, "1.00B"},  // not "1000.00M"
                                                         {1'000'000'000, "1.00B"},
                                                         {6'738'415'616, "6.74B"},
                                                         {68'976'648'192, "68.98B"}};
  for (const auto& [count, text] : cases) EXPECT_EQ(format_param_count(count), text) << count;
}

}  // namespace
}  // namespace zinf::plan
