// Shared pieces of the GradReducer tests: seeded gradients for every rank and micro-batch, one
// HostDevice and LocalComm a rank, one thread a rank, and the end of a step (the accumulated
// gradients reduced, the micro-batch count checked).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/random.hpp"
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
struct HostRanks {
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<std::unique_ptr<Communicator>> comms;
};

inline HostRanks make_host_ranks(int world, std::uint64_t seed, bool opaque) {
  HostRanks ranks;
  std::vector<Device*> raw;
  for (int r = 0; r < world; ++r) {
    HostDeviceOptions o;
    o.ordinal = r;
    o.jitter_max_us = 30;
    o.jitter_seed = seed + static_cast<std::uint64_t>(r);
    o.opaque = opaque;
    ranks.devices.push_back(std::move(make_host_device(o)).value());
    raw.push_back(ranks.devices.back().get());
  }
  ranks.comms = std::move(make_local_comm_group(raw)).value();
  return ranks;
}

// body(rank) on a thread a rank; the statuses in rank order.
template <typename Body>
std::vector<Status> run_ranks(int world, Body body) {
  std::vector<Status> st(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] { st[static_cast<std::size_t>(rank)] = body(rank); });
  }
  for (std::thread& t : threads) t.join();
  return st;
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
