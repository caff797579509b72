// Partitioner: the layout against an independent serial construction, coverage (every element of
// every parameter owned by exactly one rank, padding zero), group rules, stage semantics,
// determinism across ranks, and every bad input naming what was wrong.
#include "zero/partitioner.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/random.hpp"

namespace zinf {
namespace {

Partitioner make(const PartitionerOptions& options) {
  Result<Partitioner> p = Partitioner::create(options);
  EXPECT_TRUE(p.is_ok()) << p.status().to_string();
  return std::move(p).value();
}

// A model of `module_count` modules with 1..3 parameters each, shapes drawn from a seed so that
// no world size divides them; a few are scalars or vectors.
std::vector<ParamSpec> random_model(std::uint64_t seed, int module_count, DType dtype) {
  SplitMix64 rng(seed);
  std::vector<ParamSpec> specs;
  for (int m = 0; m < module_count; ++m) {
    const int params = 1 + static_cast<int>(rng.next() % 3);
    for (int p = 0; p < params; ++p) {
      ParamSpec spec;
      spec.module = fmt::format("layers.{}", m);
      spec.name = fmt::format("layers.{}.p{}", m, p);
      spec.dtype = dtype;
      switch (rng.next() % 4) {
        case 0:
          spec.shape = {};
          break;
        case 1:
          spec.shape = {static_cast<std::int64_t>(1 + rng.next() % 300)};
          break;
        default:
          spec.shape = {static_cast<std::int64_t>(1 + rng.next() % 60),
                        static_cast<std::int64_t>(1 + rng.next() % 70)};
      }
      specs.push_back(spec);
    }
  }
  return specs;
}

std::size_t numel(const std::vector<std::int64_t>& shape) {
  std::size_t count = 1;
  for (auto d : shape) count *= static_cast<std::size_t>(d);
  return count;
}

std::size_t round_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// The layout rules of the header, written out independently: (group, offset) of every parameter
// and each group's padded size.
struct ExpectedLayout {
  std::vector<std::pair<std::uint32_t, std::size_t>> locations;
  std::vector<std::size_t> padded;
};

ExpectedLayout expected_layout(const std::vector<ParamSpec>& specs,
                               const PartitionerOptions& options) {
  ExpectedLayout layout;
  std::size_t used = 0;
  std::uint32_t group = 0;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const std::size_t count = numel(specs[i].shape);
    if (i > 0) {
      const std::size_t start = round_up(used, options.param_alignment_elements);
      const bool split = specs[i].dtype != specs[i - 1].dtype ||
                         (options.group_by_module && specs[i].module != specs[i - 1].module) ||
                         start + count > options.group_max_elements;
      if (split) {
        layout.padded.push_back(round_up(
            used, options.alignment_elements * static_cast<std::size_t>(options.world_size)));
        ++group;
        used = 0;
      }
    }
    const std::size_t start = round_up(used, options.param_alignment_elements);
    layout.locations.emplace_back(group, start);
    used = start + count;
  }
  layout.padded.push_back(
      round_up(used, options.alignment_elements * static_cast<std::size_t>(options.world_size)));
  return layout;
}

TEST(Partitioner, LayoutMatchesAnIndependentConstructionAndCoversEveryElementOnce) {
  for (int world_size : {1, 2, 3, 4, 5, 7, 8}) {
    for (bool by_module : {true, false}) {
      for (std::size_t group_max : {std::size_t{1} << 28, std::size_t{3000}}) {
        const std::uint64_t seed = 100 + static_cast<std::uint64_t>(world_size);
        SCOPED_TRACE(testing::Message()
                     << "seed " << seed << " world " << world_size << " by_module " << by_module
                     << " group_max " << group_max);
        PartitionerOptions options;
        options.world_size = world_size;
        options.group_by_module = by_module;
        options.group_max_elements = group_max;
        Partitioner p = make(options);
        const std::vector<ParamSpec> specs = random_model(seed, 9, DType::kBF16);
        for (const ParamSpec& spec : specs) ASSERT_TRUE(p.add(spec).is_ok());
        ASSERT_TRUE(p.finalize().is_ok());

        const ExpectedLayout expected = expected_layout(specs, options);
        ASSERT_EQ(p.group_count(), expected.padded.size());
        for (ParamId id = 0; id < p.param_count(); ++id) {
          EXPECT_EQ(p.location(id).group, expected.locations[id].first) << specs[id].name;
          EXPECT_EQ(p.location(id).group_offset, expected.locations[id].second) << specs[id].name;
          EXPECT_EQ(p.location(id).element_count, numel(specs[id].shape));
          EXPECT_EQ(*p.find(specs[id].name), id);
        }

        for (std::uint32_t g = 0; g < p.group_count(); ++g) {
          const GroupInfo& info = p.group(g);
          EXPECT_EQ(info.padded_element_count, expected.padded[g]);
          EXPECT_EQ(info.shard_element_count * static_cast<std::size_t>(world_size),
                    info.padded_element_count);
          EXPECT_EQ(info.shard_element_count % options.alignment_elements, 0u);
          EXPECT_GE(info.padded_element_count, info.used_element_count);
          // Owner of each element of the padded group: -1 padding, else the parameter id; and
          // how many ranks claim it.
          std::vector<int> owner(info.padded_element_count, -1);
          std::vector<int> claims(info.padded_element_count, 0);
          for (ParamId id = info.first_param; id < info.first_param + info.param_count; ++id) {
            const ParamLocation& loc = p.location(id);
            for (std::size_t i = 0; i < loc.element_count; ++i) {
              ASSERT_EQ(owner[loc.group_offset + i], -1) << "parameters overlap";
              owner[loc.group_offset + i] = static_cast<int>(id);
            }
          }
          for (int rank = 0; rank < world_size; ++rank) {
            const std::size_t base = p.shard_offset(g, rank);
            EXPECT_EQ(base, info.shard_element_count * static_cast<std::size_t>(rank));
            for (const ParamPiece& piece : p.shard_pieces(g, rank)) {
              ASSERT_LE(piece.shard_offset + piece.element_count, info.shard_element_count);
              const ParamLocation& loc = p.location(piece.param);
              for (std::size_t i = 0; i < piece.element_count; ++i) {
                const std::size_t element = base + piece.shard_offset + i;
                ASSERT_EQ(owner[element], static_cast<int>(piece.param));
                ASSERT_EQ(element - loc.group_offset, piece.param_offset + i);
                ++claims[element];
              }
            }
          }
          for (std::size_t e = 0; e < info.padded_element_count; ++e) {
            ASSERT_EQ(claims[e], owner[e] >= 0 ? 1 : 0) << "element " << e << " of group " << g;
          }
        }
        // param_piece and param_owners agree with the pieces.
        for (ParamId id = 0; id < p.param_count(); ++id) {
          const auto [first, last] = p.param_owners(id);
          std::size_t covered = 0;
          for (int rank = 0; rank < world_size; ++rank) {
            auto piece = p.param_piece(id, rank);
            EXPECT_EQ(piece.has_value(), rank >= first && rank <= last) << specs[id].name;
            if (piece) covered += piece->element_count;
          }
          EXPECT_EQ(covered, p.location(id).element_count);
        }
      }
    }
  }
}

TEST(Partitioner, FillShardPlacesValuesAndZeroesPadding) {
  const std::uint64_t seed = 4242;
  for (int world_size : {1, 3, 4}) {
    SCOPED_TRACE(testing::Message() << "seed " << seed << " world " << world_size);
    PartitionerOptions options;
    options.world_size = world_size;
    Partitioner p = make(options);
    const std::vector<ParamSpec> specs = random_model(seed, 6, DType::kF32);
    std::vector<std::vector<float>> values;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      ASSERT_TRUE(p.add(specs[i]).is_ok());
      values.emplace_back(numel(specs[i].shape));
      fill_uniform(values.back().data(), values.back().size(), seed + i, 0.5f, 2.0f);
    }
    ASSERT_TRUE(p.finalize().is_ok());
    std::vector<const void*> data;
    for (const auto& v : values) data.push_back(v.data());
    for (std::uint32_t g = 0; g < p.group_count(); ++g) {
      const GroupInfo& info = p.group(g);
      // Concatenating every rank's shard gives the padded group: the parameters at their
      // offsets, zero everywhere else.
      std::vector<float> whole(info.padded_element_count, -7.0f);
      for (int rank = 0; rank < world_size; ++rank) {
        p.fill_shard(g, rank, data, whole.data() + p.shard_offset(g, rank));
      }
      std::vector<char> is_param(info.padded_element_count, 0);
      for (ParamId id = info.first_param; id < info.first_param + info.param_count; ++id) {
        const ParamLocation& loc = p.location(id);
        ASSERT_EQ(
            std::memcmp(whole.data() + loc.group_offset, values[id].data(), loc.element_count * 4),
            0)
            << specs[id].name;
        std::fill_n(is_param.begin() + static_cast<std::ptrdiff_t>(loc.group_offset),
                    loc.element_count, 1);
      }
      for (std::size_t e = 0; e < whole.size(); ++e) {
        if (!is_param[e]) {
          ASSERT_EQ(whole[e], 0.0f) << "padding element " << e;
        }
      }
    }
  }
}

TEST(Partitioner, GroupsSplitAtDtypeModuleAndSizeLimits) {
  PartitionerOptions options;
  options.world_size = 2;
  options.group_max_elements = 1000;
  Partitioner p = make(options);
  ASSERT_TRUE(p.add({"a.w", "a", {10, 10}, DType::kBF16}).is_ok());
  ASSERT_TRUE(p.add({"a.b", "a", {10}, DType::kBF16}).is_ok());
  ASSERT_TRUE(p.add({"a.scale", "a", {3}, DType::kF32}).is_ok());   // dtype change
  ASSERT_TRUE(p.add({"b.w", "b", {7}, DType::kF32}).is_ok());       // module change
  ASSERT_TRUE(p.add({"b.big", "b", {5000}, DType::kF32}).is_ok());  // over the limit: alone
  ASSERT_TRUE(p.add({"b.c", "b", {3}, DType::kF32}).is_ok());
  ASSERT_TRUE(p.finalize().is_ok());
  ASSERT_EQ(p.group_count(), 5u);
  EXPECT_EQ(p.location(0).group, 0u);
  EXPECT_EQ(p.location(1).group, 0u);
  EXPECT_EQ(p.location(1).group_offset, 112u);  // 100 rounded up to 16
  EXPECT_EQ(p.location(2).group, 1u);
  EXPECT_EQ(p.location(3).group, 2u);
  EXPECT_EQ(p.location(4).group, 3u);
  EXPECT_EQ(p.group(3).padded_element_count, 5120u);  // 5000 up to 2 * 128
  EXPECT_EQ(p.location(5).group, 4u);
  EXPECT_EQ(p.group(0).dtype, DType::kBF16);
  EXPECT_EQ(p.group(0).param_element_count, 110u);
  EXPECT_EQ(p.group(0).used_element_count, 122u);
  EXPECT_EQ(*p.module_groups("a"), (std::vector<std::uint32_t>{0, 1}));
  EXPECT_EQ(*p.module_groups("b"), (std::vector<std::uint32_t>{2, 3, 4}));
  EXPECT_EQ(p.modules(), (std::vector<std::string>{"a", "b"}));
  Result<std::vector<std::uint32_t>> missing = p.module_groups("c");
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_NE(missing.status().message().find("'c'"), std::string_view::npos);
}

// The collectives' names say which module a group belongs to; a stage-3 persistent group (whose
// module the engine suffixes with kPersistentSuffix) names the module the user registered.
TEST(Partitioner, GroupLabelsNameTheUsersModule) {
  PartitionerOptions options;
  options.world_size = 2;
  options.stage = ZeroStage::kStage3;
  Partitioner p = make(options);
  const std::string persistent = "ln" + std::string(kPersistentSuffix);
  const std::string last_persistent = "head" + std::string(kPersistentSuffix);
  ASSERT_TRUE(p.add({"attn.w", "attn", {12, 9}, DType::kF32}).is_ok());
  ASSERT_TRUE(p.add({"ln.g", persistent, {9}, DType::kF32}).is_ok());
  ASSERT_TRUE(p.add({"head.b", last_persistent, {5}, DType::kF32}).is_ok());
  ASSERT_TRUE(p.finalize().is_ok());
  ASSERT_EQ(p.group_count(), 3u);
  EXPECT_EQ(group_label(p, 0, "params"), "params group 0 (module 'attn')");
  EXPECT_EQ(group_label(p, 1, "params"), "params group 1 (module 'ln')");
  EXPECT_EQ(group_label(p, 2, "grads"), "grads group 2 (module 'head')");

  // Without group_by_module one group spans the modules; both ends drop the suffix.
  options.group_by_module = false;
  Partitioner spanning = make(options);
  ASSERT_TRUE(spanning.add({"ln.g", persistent, {9}, DType::kF32}).is_ok());
  ASSERT_TRUE(spanning.add({"head.b", last_persistent, {5}, DType::kF32}).is_ok());
  ASSERT_TRUE(spanning.finalize().is_ok());
  ASSERT_EQ(spanning.group_count(), 1u);
  EXPECT_EQ(group_label(spanning, 0, "params"), "params group 0 (modules 'ln' to 'head')");
}

TEST(Partitioner, StagesPartitionMoreKindsOfState) {
  EXPECT_TRUE(stage_partitions(ZeroStage::kStage1, StateKind::kOptimizerState));
  EXPECT_FALSE(stage_partitions(ZeroStage::kStage1, StateKind::kGradients));
  EXPECT_FALSE(stage_partitions(ZeroStage::kStage1, StateKind::kParameters));
  EXPECT_TRUE(stage_partitions(ZeroStage::kStage2, StateKind::kGradients));
  EXPECT_FALSE(stage_partitions(ZeroStage::kStage2, StateKind::kParameters));
  EXPECT_TRUE(stage_partitions(ZeroStage::kStage3, StateKind::kParameters));
  EXPECT_EQ(state_kind_name(StateKind::kGradients), "gradients");

  for (ZeroStage stage : {ZeroStage::kStage1, ZeroStage::kStage2, ZeroStage::kStage3}) {
    PartitionerOptions options;
    options.world_size = 4;
    options.stage = stage;
    Partitioner p = make(options);
    ASSERT_TRUE(p.add({"w", "m", {1000}, DType::kF32}).is_ok());
    ASSERT_TRUE(p.finalize().is_ok());
    // 1000 elements pad to 1024 = 4 ranks * 256.
    EXPECT_EQ(p.rank_element_count(StateKind::kOptimizerState), 256u);
    EXPECT_EQ(p.rank_element_count(StateKind::kGradients),
              stage >= ZeroStage::kStage2 ? 256u : 1024u);
    EXPECT_EQ(p.rank_element_count(StateKind::kParameters),
              stage == ZeroStage::kStage3 ? 256u : 1024u);
  }
}

TEST(Partitioner, LayoutIsDeterministicAndTheFingerprintTellsLayoutsApart) {
  auto build = [](const std::vector<ParamSpec>& specs, int world_size) {
    PartitionerOptions options;
    options.world_size = world_size;
    Partitioner p = make(options);
    for (const ParamSpec& spec : specs) EXPECT_TRUE(p.add(spec).is_ok());
    EXPECT_TRUE(p.finalize().is_ok());
    return p;
  };
  const std::vector<ParamSpec> specs = random_model(77, 8, DType::kBF16);
  Partitioner a = build(specs, 4);
  Partitioner b = build(specs, 4);
  EXPECT_EQ(a.fingerprint(), b.fingerprint());
  for (ParamId id = 0; id < a.param_count(); ++id) {
    EXPECT_EQ(a.location(id).group, b.location(id).group);
    EXPECT_EQ(a.location(id).group_offset, b.location(id).group_offset);
  }
  std::vector<ParamSpec> reshaped = specs;
  reshaped[3].shape.push_back(2);  // one rank registered a different shape
  EXPECT_NE(build(reshaped, 4).fingerprint(), a.fingerprint());
  std::vector<ParamSpec> reordered = specs;
  std::swap(reordered[0], reordered[1]);
  EXPECT_NE(build(reordered, 4).fingerprint(), a.fingerprint());
  EXPECT_NE(build(specs, 3).fingerprint(), a.fingerprint());
}

TEST(Partitioner, BadInputIsAClearStatusNamingTheParameter) {
  Partitioner p = make({});
  ASSERT_TRUE(p.add({"layer.w", "layer", {4, 4}, DType::kF32}).is_ok());

  Result<ParamId> duplicate = p.add({"layer.w", "layer", {4}, DType::kF32});
  EXPECT_EQ(duplicate.status().code(), Code::kInvalidArgument);
  EXPECT_NE(duplicate.status().message().find("'layer.w' is registered twice"),
            std::string_view::npos);
  Result<ParamId> zero_dim = p.add({"layer.b", "layer", {3, 0}, DType::kF32});
  EXPECT_EQ(zero_dim.status().code(), Code::kInvalidArgument);
  EXPECT_NE(zero_dim.status().message().find("'layer.b' has shape [3, 0]"), std::string_view::npos)
      << zero_dim.status().to_string();
  EXPECT_EQ(p.add({"layer.n", "layer", {-1}, DType::kF32}).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(p.add({"", "layer", {1}, DType::kF32}).status().code(), Code::kInvalidArgument);
  Result<ParamId> huge = p.add({"huge", "", {1 << 30, 1 << 30, 1 << 30}, DType::kF32});
  EXPECT_EQ(huge.status().code(), Code::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("too many elements"), std::string_view::npos);

  Result<ParamId> scalar = p.add({"layer.scale", "layer", {}, DType::kF32});
  ASSERT_TRUE(scalar.is_ok());
  ASSERT_TRUE(p.finalize().is_ok());
  EXPECT_EQ(p.location(*scalar).element_count, 1u);
  // The rejected registrations left no trace.
  EXPECT_EQ(p.param_count(), 2u);

  Result<ParamId> late = p.add({"late.w", "late", {2}, DType::kF32});
  EXPECT_EQ(late.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(late.status().message().find("'late.w' registered after"), std::string_view::npos);
  EXPECT_EQ(p.finalize().code(), Code::kFailedPrecondition);
  Result<ParamId> unknown = p.find("layer.q");
  EXPECT_EQ(unknown.status().code(), Code::kNotFound);
  EXPECT_NE(unknown.status().message().find("'layer.q'"), std::string_view::npos);

  Partitioner empty = make({});
  EXPECT_EQ(empty.finalize().code(), Code::kFailedPrecondition);
}

TEST(Partitioner, RejectsOptionsOutOfRange) {
  auto code_of = [](PartitionerOptions options) {
    return Partitioner::create(options).status().code();
  };
  PartitionerOptions options;
  options.world_size = 0;
  EXPECT_EQ(code_of(options), Code::kInvalidArgument);
  options = {};
  options.stage = static_cast<ZeroStage>(4);
  Result<Partitioner> stage4 = Partitioner::create(options);
  EXPECT_NE(stage4.status().message().find("zero stage 4"), std::string_view::npos);
  options = {};
  options.alignment_elements = 100;
  EXPECT_EQ(code_of(options), Code::kInvalidArgument);
  options = {};
  options.param_alignment_elements = 256;  // more than alignment_elements
  EXPECT_EQ(code_of(options), Code::kInvalidArgument);
  options = {};
  options.group_max_elements = 0;
  EXPECT_EQ(code_of(options), Code::kInvalidArgument);
}

}  // namespace
}  // namespace zinf
