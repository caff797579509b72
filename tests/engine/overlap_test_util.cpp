// See overlap_test_util.hpp.
#include "overlap_test_util.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace zinf::overlap_test {

using engine_test::Model;
using engine_test::ParamDef;

std::string case_name(const OverlapCase& c) {
  auto tier = [](OffloadDevice d) {
    return d == OffloadDevice::kNvme ? "nvme" : d == OffloadDevice::kHost ? "cpu" : "none";
  };
  return fmt::format(
      "world{}_stage{}_opt{}_param{}_{}_{}{}", c.world, c.stage, tier(c.optimizer), tier(c.params),
      c.clip_previous ? "clipprev"
      : c.clip        ? "clip"
                      : "noclip",
      c.dtype == DType::kF16 ? "fp16" : "bf16", c.backward_only ? "_backward_only" : "");
}

namespace {

Config case_config(const OverlapCase& c, bool overlap, const std::string& nvme_dir) {
  Config config = engine_test::small_config(c.stage, c.optimizer, c.params, nvme_dir);
  config.overlap_step = overlap;
  config.gradient_clipping = c.clip ? 0.05 : 0.0;
  config.clip_from_previous_step = c.clip_previous;
  // Each step has 2 micro-batches (train()): the step's pass may open in the second's backward.
  config.gradient_accumulation_steps = 2;
  if (c.dtype == DType::kF16) {
    config.fp16.enabled = true;
    config.fp16.initial_scale_power = 8;
    config.fp16.hysteresis = 1;
    config.fp16.loss_scale_window = 4;  // the scale grows again within the run
  } else {
    config.bf16_enabled = true;
  }
  return config;
}

Status train(Engine& engine, const Model& model, const OverlapCase& c, int rank, int steps,
             int inf_step, OverlapRun& out) {
  const auto r = static_cast<std::size_t>(rank);
  const std::size_t count = model.params.size();
  auto read = [&](const ParamDef& d) -> Result<std::vector<float>> {
    ZINF_ASSIGN_OR_RETURN(TensorView view, engine.parameter(d.name));
    return engine_test::widen_view(view);
  };
  for (int step = 1; step <= steps; ++step) {
    std::vector<float> seen;
    for (int micro = 0; micro < 2; ++micro) {
      for (const std::string& m : model.modules) {
        if (c.backward_only) break;
        ZINF_RETURN_IF_ERROR(engine.gather(m));
        for (const ParamDef& d : model.params) {
          if (d.module != m) continue;
          ZINF_ASSIGN_OR_RETURN(std::vector<float> w, read(d));
          seen.insert(seen.end(), w.begin(), w.end());
        }
        ZINF_RETURN_IF_ERROR(engine.release(m));
      }
      const float scale = static_cast<float>(engine.loss_scale());
      for (auto it = model.modules.rbegin(); it != model.modules.rend(); ++it) {
        if (!c.backward_only) ZINF_RETURN_IF_ERROR(engine.gather(*it));
        std::vector<std::vector<std::uint16_t>> grads;
        std::vector<GradientRef> refs;
        grads.reserve(count);
        for (std::size_t p = 0; p < count; ++p) {
          const ParamDef& d = model.params[p];
          if (d.module != *it) continue;
          std::vector<float> w = model.initial[p];
          if (!c.backward_only) {
            ZINF_ASSIGN_OR_RETURN(w, read(d));
          }
          std::vector<float> g = engine_test::make_grad(d, w, rank, step, micro, p);
          if (d.dtype == DType::kF16) {
            for (float& v : g) v *= scale;
            if (step == inf_step && rank == 0 && micro == 1) {
              g[0] = std::numeric_limits<float>::infinity();
            }
          }
          grads.push_back(engine_test::narrow_to_half(g, d.dtype));
          refs.push_back({d.name, grads.back().data(), d.element_count(), d.dtype});
        }
        ZINF_RETURN_IF_ERROR(engine.reduce_gradients(*it, refs));
        if (!c.backward_only) ZINF_RETURN_IF_ERROR(engine.release(*it));
      }
    }
    out.forward[r].push_back(std::move(seen));
    ZINF_ASSIGN_OR_RETURN(StepReport report, engine.step());
    out.reports[r].push_back(report);
  }
  for (const ParamDef& d : model.params) {
    std::vector<float> v(d.element_count());
    ZINF_RETURN_IF_ERROR(engine.read_parameters(d.name, v.data()));
    out.masters[r].push_back(std::move(v));
  }
  return Status::ok();
}

using engine_test::same_bits;

}  // namespace

Result<OverlapRun> run_case(const OverlapCase& c, bool overlap, int steps, int inf_step,
                            std::uint64_t seed, const std::string& nvme_dir) {
  const Config config = case_config(c, overlap, nvme_dir);
  const Model model = engine_test::make_model(c.dtype, seed);
  engine_test::Ranks ranks = engine_test::make_ranks(c.world);
  OverlapRun run;
  const auto world = static_cast<std::size_t>(c.world);
  run.forward.resize(world);
  run.reports.resize(world);
  run.masters.resize(world);
  std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
        return train(engine, model, c, rank, steps, inf_step, run);
      });
  for (std::size_t r = 0; r < st.size(); ++r) {
    if (!st[r].is_ok()) return st[r].with_context(fmt::format("rank {}", r));
  }
  return run;
}

std::string first_difference(const OverlapRun& a, const OverlapRun& b) {
  for (std::size_t r = 0; r < a.forward.size(); ++r) {
    for (std::size_t s = 0; s < a.forward[r].size(); ++s) {
      if (!same_bits(a.forward[r][s], b.forward[r][s])) {
        return fmt::format("rank {} step {}: the forward pass gathered other values", r, s + 1);
      }
      const StepReport& x = a.reports[r][s];
      const StepReport& y = b.reports[r][s];
      if (x.skipped != y.skipped || x.step != y.step ||
          std::memcmp(&x.grad_norm, &y.grad_norm, sizeof(double)) != 0 ||
          x.loss_scale != y.loss_scale || x.next_loss_scale != y.next_loss_scale ||
          x.clip_coef != y.clip_coef) {
        return fmt::format(
            "rank {} step {}: reports differ (skipped {}/{}, norm {}/{}, scale {}/{}, clip {}/{})",
            r, s + 1, x.skipped, y.skipped, x.grad_norm, y.grad_norm, x.loss_scale, y.loss_scale,
            x.clip_coef, y.clip_coef);
      }
    }
    for (std::size_t p = 0; p < a.masters[r].size(); ++p) {
      if (!same_bits(a.masters[r][p], b.masters[r][p])) {
        return fmt::format("rank {}: final master of parameter {} differs", r, p);
      }
    }
  }
  return "";
}

}  // namespace zinf::overlap_test
