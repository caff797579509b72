// Shared pieces of the GradReducer tests: seeded gradients for every rank and micro-batch, one
// HostDevice and LocalComm a rank, one thread a rank, and the end of a step (the accumulated
// gradients reduced, the micro-batch count checked). The ranks run on common/run_ranks.hpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/random.hpp"
#include "common/run_ranks.hpp"
#include "zero/grad_reducer.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"

namespace zinf::test {

// grads[rank][micro][param].
using RankGrads = std::vector<std::vector<std::vector<std::vector<float>>>>;

// Uniform in [-1, 1), seeded by `seed`, rank, micro-batch and parameter; empty for a parameter
// `frozen` marks (it takes none; an empty `frozen` marks none). With `dtype` bf16 the values are
// rounded to it.
inline RankGrads seeded_grads(const Partitioner& p, int world, int micro_batches,
                              std::uint64_t seed, const std::vector<bool>& frozen = {},
                              DType dtype = DType::kF32) {
  RankGrads grads(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    for (int k = 0; k < micro_batches; ++k) {
      std::vector<std::vector<float>> per(p.param_count());
      for (ParamId id = 0; id < p.param_count(); ++id) {
        if (!frozen.empty() && frozen[id]) continue;
        std::vector<float>& g = per[id];
        g.resize(p.location(id).element_count);
        fill_uniform(g.data(), g.size(), seed * 7919 + r * 131 + k * 17 + id, -1.0f, 1.0f);
        if (dtype == DType::kBF16) {
          for (float& x : g) x = bf16_to_f32(f32_to_bf16(x));
        }
      }
      grads[static_cast<std::size_t>(r)].push_back(std::move(per));
    }
  }
  return grads;
}

// One HostDevice a rank, jittered by seed + rank (a missing wait between a bucket's fill and its
// reduce shows up), and a LocalComm group over them.
inline HostRanks make_host_ranks(int world, std::uint64_t seed, bool opaque) {
  HostRanksOptions o;
  o.timeout = std::chrono::seconds(60);  // LocalCommOptions' default
  o.jitter_max_us = 30;
  o.jitter_seed = seed;
  o.opaque = opaque;
  return make_host_ranks(world, o);
}

// One micro-batch's gradients reduced module by module, in the order given.
inline Status reduce_modules(const Partitioner& p, GradReducer& reducer,
                             const std::vector<std::string>& modules,
                             const std::vector<GradSource>& sources) {
  for (const std::string& m : modules) {
    ZINF_ASSIGN_OR_RETURN(auto groups, p.module_groups(m));
    ZINF_RETURN_IF_ERROR(reducer.reduce(groups, sources));
  }
  return Status::ok();
}

// The end of a step: the accumulated gradients reduced, and `micro_batches` counted.
inline Status finish_step(GradReducer& reducer, int micro_batches) {
  ZINF_RETURN_IF_ERROR(reducer.reduce_accumulated());
  ZINF_RETURN_IF_ERROR(reducer.wait());
  ZINF_ASSIGN_OR_RETURN(int micro, reducer.micro_batches());
  if (micro != micro_batches) return Status::internal("micro-batch count");
  return Status::ok();
}

// The stage-1 reference for element `i` of parameter `param`: each rank sums its micro-batches
// (f32, in order), then the mean over ranks in rank order.
inline float stage1_mean(const RankGrads& grads, int world, int micro_batches, ParamId param,
                         std::size_t i) {
  std::vector<float> full(static_cast<std::size_t>(world), 0.0f);
  for (int q = 0; q < world; ++q) {
    for (int k = 0; k < micro_batches; ++k) {
      full[static_cast<std::size_t>(q)] +=
          grads[static_cast<std::size_t>(q)][static_cast<std::size_t>(k)][param][i];
    }
  }
  float s = full[0];
  for (int q = 1; q < world; ++q) s += full[static_cast<std::size_t>(q)];
  return s / static_cast<float>(world);
}

}  // namespace zinf::test
