#include "plan/planner.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "base/arith.hpp"
#include "base/assert.hpp"

namespace zinf::plan {
namespace {

std::string gib(double bytes) { return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024 * 1024)); }

std::uint64_t usable(std::uint64_t budget, double headroom) {
  return static_cast<std::uint64_t>(static_cast<double>(budget) * (1.0 - headroom));
}

// What of a device's fixed part to shrink when that part alone is `short_bytes` too much: the
// activations and the runtime reserve, each when it is the larger of the two or could close the
// gap alone, the larger first.
std::string device_fixed_hint(std::uint64_t activation_bytes, std::uint64_t reserved_bytes,
                              std::uint64_t short_bytes) {
  const std::string activations =
      "activations take " + gib(static_cast<double>(activation_bytes)) +
      " of it (--checkpoint-activations or a smaller --micro-batch / --seq shrink them)";
  const std::string reserve =
      "the runtime reserve takes " + gib(static_cast<double>(reserved_bytes)) +
      " of it (zinf.device_reserved_bytes, zinf plan --device-reserved: lower it where the CUDA "
      "context and workspaces need less)";
  const bool name_activations =
      activation_bytes >= short_bytes || activation_bytes > reserved_bytes;
  const bool name_reserve = reserved_bytes >= short_bytes || reserved_bytes >= activation_bytes;
  if (name_activations && name_reserve) {
    return activation_bytes > reserved_bytes ? activations + "; " + reserve
                                             : reserve + "; " + activations;
  }
  return name_activations ? activations : reserve;
}

// How much a candidate offloads: the tie-breaker between candidates of equal time.
int offload_score(const EngineSetup& s) {
  return static_cast<int>(s.optimizer) + static_cast<int>(s.params) + (s.gradients_on_nvme ? 1 : 0);
}

// Sum over short tiers of shortfall / usable: how far a candidate is from fitting.
double distance(const Candidate& c) {
  double d = 0;
  for (const TierUse& u : c.use) {
    if (u.fits()) continue;
    d += static_cast<double>(u.shortfall_bytes()) /
         static_cast<double>(std::max<std::uint64_t>(u.usable_bytes, std::uint64_t{1} << 30));
  }
  return d;
}

// True when `a` is the better of two fitting candidates.
bool better(const Candidate& a, const Candidate& b) {
  const double ta = a.time.step_s;
  const double tb = b.time.step_s;
  if (std::abs(ta - tb) > 0.01 * std::min(ta, tb)) return ta < tb;
  const int oa = offload_score(a.setup);
  const int ob = offload_score(b.setup);
  if (oa != ob) return oa < ob;
  if (a.setup.stage != b.setup.stage) return a.setup.stage < b.setup.stage;
  return pinned_pool_bytes(a.setup) < pinned_pool_bytes(b.setup);
}

}  // namespace

bool Candidate::fits() const {
  return std::all_of(use.begin(), use.end(), [](const TierUse& u) { return u.fits(); });
}

void size_buckets(const ModelShape& model, EngineSetup* s) {
  const std::uint64_t h = model.hidden;
  s->reduce_bucket_params = h * h;
  s->prefetch_bucket_params = h * h * 9 / 10;
  s->persistence_threshold_params = 10 * h;
  s->max_live_params = std::max(2 * layer_params(model), largest_tensor_params(model));
  // DeepSpeed's param staging buffers must hold the largest tensor; the engine's hold one shard
  // of the largest module (a layer, or the embedding).
  s->param_buffer_params = std::max<std::uint64_t>(100'000'000, largest_tensor_params(model));
  const std::uint64_t largest_module = std::max(layer_params(model), largest_tensor_params(model));
  s->param_staging_params = (largest_module + s->world_size - 1) / s->world_size;
}

Candidate evaluate(const ModelShape& model, const TrainingShape& training, const EngineSetup& setup,
                   const Budgets& budgets, const MachineProfile& profile) {
  Candidate c;
  c.setup = setup;
  c.memory = estimate_memory(model, training, setup);
  c.time = predict_step(model, training, setup, profile);
  const std::uint64_t budget[kMemoryTierCount] = {budgets.gpu_mem_bytes, budgets.host_mem_bytes,
                                                  budgets.nvme_bytes};
  for (int t = 0; t < kMemoryTierCount; ++t) {
    const MemoryTier tier = static_cast<MemoryTier>(t);
    TierUse& u = c.use[t];
    u.tier = tier;
    u.need_bytes = tier == MemoryTier::kDevice ? c.memory.rank_tier_bytes(tier)
                                               : c.memory.machine_tier_bytes(tier);
    u.budget_bytes = budget[t];
    u.usable_bytes = usable(budget[t], budgets.headroom);
  }
  return c;
}

NoOffloadComparison no_offload_gpus(const ModelShape& model, const TrainingShape& training,
                                    const Budgets& budgets, std::uint64_t device_reserved_bytes) {
  NoOffloadComparison out;
  EngineSetup s;
  s.device_reserved_bytes = device_reserved_bytes;
  s.stage = 3;
  s.world_size = 1;
  s.ranks_per_machine = 1;
  size_buckets(model, &s);
  const MemoryEstimate e = estimate_memory(model, training, s);
  const std::uint64_t p = param_count(model);
  const std::uint64_t frozen = frozen_param_count(model);
  // DeepSpeed keeps a frozen parameter's 16-bit weight only: it has no fp32 master, optimizer
  // state or gradient (the ZeRO optimizer takes the parameters with requires_grad).
  out.state_bytes = 18 * (p - frozen) + 2 * frozen;
  out.usable_bytes = usable(budgets.gpu_mem_bytes, budgets.headroom);
  out.activation_bytes = e.bytes(MemoryUse::kActivations, MemoryTier::kDevice);
  out.gathered_bytes = e.bytes(MemoryUse::kGatheredParams, MemoryTier::kDevice);
  out.bucket_bytes = e.bytes(MemoryUse::kCommBuckets, MemoryTier::kDevice);
  out.reserved_bytes = e.bytes(MemoryUse::kReserved, MemoryTier::kDevice);
  out.fixed_bytes =
      out.activation_bytes + out.gathered_bytes + out.bucket_bytes + out.reserved_bytes;
  const std::string fixed_parts = fmt::format(
      "activations {} + gathered params {} + comm buckets {} + reserved {}",
      gib(static_cast<double>(out.activation_bytes)), gib(static_cast<double>(out.gathered_bytes)),
      gib(static_cast<double>(out.bucket_bytes)), gib(static_cast<double>(out.reserved_bytes)));
  const std::string state =
      frozen == 0
          ? fmt::format("18 B/param x {} params = {} of model state", format_param_count(p),
                        gib(static_cast<double>(out.state_bytes)))
          : fmt::format(
                "18 B/param x {} trainable + 2 B/param x {} frozen params = {} of model state",
                format_param_count(p - frozen), format_param_count(frozen),
                gib(static_cast<double>(out.state_bytes)));
  if (out.fixed_bytes >= out.usable_bytes) {
    out.gpus_needed = 0;
    out.arithmetic = fmt::format(
        "{}; but per GPU the fixed part alone, {} ({}), exceeds the {} usable: no GPU count "
        "fits without offload; {}",
        state, gib(static_cast<double>(out.fixed_bytes)), fixed_parts,
        gib(static_cast<double>(out.usable_bytes)),
        device_fixed_hint(out.activation_bytes, out.reserved_bytes,
                          out.fixed_bytes - out.usable_bytes));
    return out;
  }
  const std::uint64_t for_state = out.usable_bytes - out.fixed_bytes;
  out.gpus_needed = ceil_div(out.state_bytes, for_state);
  out.arithmetic = fmt::format(
      "{}; per GPU {} usable ({} less {:.0f}% headroom) - {} fixed ({}) = {} for state; "
      "ceil({} / {}) = {} {}",
      state, gib(static_cast<double>(out.usable_bytes)),
      gib(static_cast<double>(budgets.gpu_mem_bytes)), budgets.headroom * 100,
      gib(static_cast<double>(out.fixed_bytes)), fixed_parts, gib(static_cast<double>(for_state)),
      gib(static_cast<double>(out.state_bytes)), gib(static_cast<double>(for_state)),
      out.gpus_needed, out.gpus_needed == 1 ? "GPU" : "GPUs");
  return out;
}

Result<PlanResult> make_plan(const ModelShape& model, const TrainingShape& training,
                             const Budgets& budgets, const MachineProfile& profile,
                             const PlanConstraints& constraints) {
  if (budgets.gpus == 0) return Status::invalid_argument("--gpus: must be at least 1");
  if (budgets.gpu_mem_bytes == 0) return Status::invalid_argument("--gpu-mem: must be positive");
  const std::uint64_t per_machine =
      budgets.gpus_per_machine == 0 ? budgets.gpus : budgets.gpus_per_machine;
  if (budgets.gpus % per_machine != 0) {
    return Status::invalid_argument(fmt::format(
        "--gpus {} is not a multiple of --gpus-per-machine {}", budgets.gpus, per_machine));
  }
  if (!(budgets.headroom >= 0 && budgets.headroom < 1)) {
    return Status::invalid_argument(
        fmt::format("--headroom {}: must be in [0, 1)", budgets.headroom));
  }
  if (profile.mem_adam_gbps <= 0) {
    return Status::invalid_argument("machine profile: mem_adam_pattern_gbps is missing");
  }
  const bool nvme_usable =
      budgets.nvme_bytes > 0 && profile.nvme_read_gbps > 0 && profile.nvme_write_gbps > 0;
  auto nvme_wanted = [&](std::optional<OffloadDevice> o) {
    return o && *o == OffloadDevice::kNvme;
  };
  if ((nvme_wanted(constraints.optimizer) || nvme_wanted(constraints.params)) && !nvme_usable) {
    return Status::invalid_argument(
        "offload to nvme asked for, but there is no --nvme-capacity or no NVMe rates in the "
        "machine profile");
  }
  if (constraints.stage && (*constraints.stage < 1 || *constraints.stage > 3)) {
    return Status::invalid_argument(
        fmt::format("--stage {}: must be 1, 2 or 3", *constraints.stage));
  }
  if (constraints.params && *constraints.params != OffloadDevice::kNone && constraints.stage &&
      *constraints.stage != 3) {
    return Status::invalid_argument("--offload-param needs --stage 3");
  }

  std::vector<int> stages = {1, 2, 3};
  if (constraints.stage) stages = {*constraints.stage};
  std::vector<OffloadDevice> offloads = {OffloadDevice::kNone, OffloadDevice::kHost};
  if (nvme_usable) offloads.push_back(OffloadDevice::kNvme);
  std::vector<std::uint64_t> sub_groups;
  for (int shift = 22; shift <= 28; ++shift) sub_groups.push_back(std::uint64_t{1} << shift);
  if (constraints.sub_group_params) sub_groups = {*constraints.sub_group_params};
  std::vector<std::uint64_t> buffer_counts = {3, 4, 6, 8};
  if (constraints.buffer_count) buffer_counts = {*constraints.buffer_count};

  EngineSetup base;
  base.world_size = budgets.gpus;
  base.ranks_per_machine = per_machine;
  size_buckets(model, &base);
  base.overlap_step = constraints.overlap_step;
  base.overlap_compute_fraction = constraints.overlap_compute_fraction;
  base.exact_clipping_or_loss_scaling = constraints.exact_clipping_or_loss_scaling;
  base.device_reserved_bytes = constraints.device_reserved_bytes;
  if (profile.nvme_block_bytes > 0 && profile.nvme_queue_depth > 0) {
    base.io_block_bytes = profile.nvme_block_bytes;
    base.io_queue_depth = profile.nvme_queue_depth;
  }
  const std::uint64_t shard = ceil_div(param_count(model), budgets.gpus);

  PlanResult result;
  // Per tier: the least need over all candidates, and over candidates fitting the other tiers.
  std::array<std::uint64_t, kMemoryTierCount> least_any;
  std::array<std::uint64_t, kMemoryTierCount> least_others_fit;
  least_any.fill(UINT64_MAX);
  least_others_fit.fill(UINT64_MAX);
  std::array<TierUse, kMemoryTierCount> budget_use{};
  bool have_best = false;
  bool have_closest = false;
  Candidate closest;
  auto consider = [&](const EngineSetup& s) {
    if (!validate_setup(s).is_ok()) return;
    Candidate c = evaluate(model, training, s, budgets, profile);
    ++result.candidates_considered;
    budget_use = c.use;
    for (int t = 0; t < kMemoryTierCount; ++t) {
      least_any[t] = std::min(least_any[t], c.use[t].need_bytes);
      bool others_fit = true;
      for (int o = 0; o < kMemoryTierCount; ++o)
        others_fit = others_fit && (o == t || c.use[o].fits());
      if (others_fit) least_others_fit[t] = std::min(least_others_fit[t], c.use[t].need_bytes);
    }
    if (c.fits()) {
      ++result.candidates_fitting;
      if (!have_best || better(c, result.best)) {
        result.best = std::move(c);
        have_best = true;
      }
    } else if (!have_closest || distance(c) < distance(closest)) {
      closest = std::move(c);
      have_closest = true;
    }
  };
  // The engine refuses gradients_on_nvme with a frozen parameter.
  const bool may_spill = constraints.allow_gradient_spill && frozen_param_count(model) == 0;
  for (int stage : stages) {
    for (OffloadDevice optimizer : offloads) {
      if (constraints.optimizer && *constraints.optimizer != optimizer) continue;
      for (OffloadDevice params : offloads) {
        if (constraints.params && *constraints.params != params) continue;
        if (params != OffloadDevice::kNone && stage != 3) continue;
        EngineSetup s = base;
        s.stage = stage;
        s.optimizer = optimizer;
        s.params = params;
        if (optimizer != OffloadDevice::kNvme) {
          // Host or device state needs no staging; one sub-group bounds the update's working
          // set, as DeepSpeed's default does.
          s.sub_group_params = std::min<std::uint64_t>(1'000'000'000, shard);
          consider(s);
          continue;
        }
        for (bool spill : {false, true}) {
          if (spill && !may_spill) continue;
          s.gradients_on_nvme = spill;
          bool whole_shard_done = false;
          for (std::uint64_t sub_group : sub_groups) {
            // The engine never makes a sub-group larger than the shard.
            if (sub_group >= shard) {
              if (whole_shard_done) continue;
              whole_shard_done = true;
            }
            s.sub_group_params = std::min(sub_group, shard);
            for (std::uint64_t buffers : buffer_counts) {
              s.buffer_count = buffers;
              consider(s);
            }
          }
        }
      }
    }
  }
  result.fits = have_best;
  if (!have_best) {
    ZINF_ASSERT(have_closest);
    result.best = std::move(closest);
    auto add_shortfalls = [&](const std::array<std::uint64_t, kMemoryTierCount>& least,
                              bool every) {
      for (int t = 0; t < kMemoryTierCount; ++t) {
        if (least[t] == UINT64_MAX || least[t] <= budget_use[t].usable_bytes) continue;
        Shortfall f;
        f.tier = static_cast<MemoryTier>(t);
        f.need_bytes = least[t];
        f.usable_bytes = budget_use[t].usable_bytes;
        f.budget_bytes = budget_use[t].budget_bytes;
        f.every_placement = every;
        result.shortfalls.push_back(f);
      }
    };
    add_shortfalls(least_any, true);
    if (result.shortfalls.empty()) add_shortfalls(least_others_fit, false);
    std::sort(result.shortfalls.begin(), result.shortfalls.end(),
              [](const Shortfall& a, const Shortfall& b) {
                return a.shortfall_bytes() < b.shortfall_bytes();
              });
  }
  result.no_offload = no_offload_gpus(model, training, budgets, base.device_reserved_bytes);
  return result;
}

std::string shortfall_message(const PlanResult& result) {
  if (result.fits) return "";
  auto unit = [](MemoryTier tier) {
    return tier == MemoryTier::kDevice ? "per GPU" : "per machine";
  };
  std::string out = "nothing fits the budgets:";
  for (const Shortfall& f : result.shortfalls) {
    std::string others;
    for (int t = 0; t < kMemoryTierCount; ++t) {
      if (static_cast<MemoryTier>(t) == f.tier) continue;
      others += others.empty() ? "" : " and ";
      others += memory_tier_name(static_cast<MemoryTier>(t));
    }
    out += fmt::format(
        "\n  {} is short by {}: {} needs at least {} {} there, {} usable ({} budget "
        "less headroom)",
        memory_tier_name(f.tier), gib(static_cast<double>(f.shortfall_bytes())),
        f.every_placement ? "every placement" : fmt::format("a placement that fits {}", others),
        gib(static_cast<double>(f.need_bytes)), unit(f.tier),
        gib(static_cast<double>(f.usable_bytes)), gib(static_cast<double>(f.budget_bytes)));
    if (f.tier == MemoryTier::kDevice && f.every_placement) {
      // The activations and the reserve are the same in every placement.
      const MemoryEstimate& m = result.best.memory;
      out += "; " + device_fixed_hint(m.bytes(MemoryUse::kActivations, MemoryTier::kDevice),
                                      m.bytes(MemoryUse::kReserved, MemoryTier::kDevice),
                                      f.shortfall_bytes());
    }
  }
  if (result.shortfalls.empty()) {
    // Each tier fits some placement, but none fits two of them at once: show the closest.
    const Candidate& c = result.best;
    out += fmt::format(
        "\n  the closest placement (stage {}, optimizer state on {}, params on {}{}) "
        "is short on",
        c.setup.stage, memory_tier_name(memory_tier(c.setup.optimizer)),
        memory_tier_name(memory_tier(c.setup.params)),
        c.setup.gradients_on_nvme ? ", gradients on nvme" : "");
    for (const TierUse& u : c.use) {
      if (u.fits()) continue;
      out += fmt::format("\n    {} by {}: needs {} {} of {} usable", memory_tier_name(u.tier),
                         gib(static_cast<double>(u.shortfall_bytes())),
                         gib(static_cast<double>(u.need_bytes)), unit(u.tier),
                         gib(static_cast<double>(u.usable_bytes)));
    }
  }
  return out;
}

}  // namespace zinf::plan
