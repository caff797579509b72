// Learning-rate schedules (include/zinf/schedule.hpp): DeepSpeed's formulas, evaluated in double
// from the iteration number alone, so a schedule restored from a checkpoint continues the same
// curve bit for bit.
#include "zinf/schedule.hpp"

#include <fmt/format.h>

#include <cmath>
#include <numbers>
#include <optional>
#include <span>
#include <string>

#include "engine/config_names.hpp"
#include "engine/schedule.hpp"

namespace zinf {

std::string_view schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kNone:
      return "none";
    case ScheduleKind::kWarmupLR:
      return "WarmupLR";
    case ScheduleKind::kWarmupDecayLR:
      return "WarmupDecayLR";
    case ScheduleKind::kWarmupCosineLR:
      return "WarmupCosineLR";
    case ScheduleKind::kOneCycle:
      return "OneCycle";
  }
  return "unknown";
}

namespace {

using json = nlohmann::ordered_json;

Status bad_value(std::string_view key, std::string_view why) {
  return Status::invalid_argument(fmt::format("scheduler.params.{}: {}", key, why));
}

Status read_double(const json& params, const char* key, double* out) {
  if (!params.contains(key)) return Status::ok();
  const json& v = params.at(key);
  if (!v.is_number()) return bad_value(key, fmt::format("{} is not a number", v.dump()));
  *out = v.get<double>();
  if (!std::isfinite(*out)) return bad_value(key, "is not finite");
  return Status::ok();
}

// A whole number; DeepSpeed configs sometimes write them as floats (1e5).
Status read_int(const json& params, const char* key, std::int64_t* out) {
  if (!params.contains(key)) return Status::ok();
  const json& v = params.at(key);
  if (v.is_number_integer()) {
    *out = v.get<std::int64_t>();
  } else if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() &&
             std::fabs(v.get<double>()) < 9e15) {
    *out = static_cast<std::int64_t>(v.get<double>());
  } else {
    return bad_value(key, fmt::format("{} is not a whole number", v.dump()));
  }
  return Status::ok();
}

Status read_warmup_type(const json& params, bool* linear) {
  if (!params.contains("warmup_type")) return Status::ok();
  const json& v = params.at("warmup_type");
  if (v.is_string() && v.get<std::string>() == "log") {
    *linear = false;
  } else if (v.is_string() && v.get<std::string>() == "linear") {
    *linear = true;
  } else {
    // DeepSpeed logs a warning and falls back to "log"; a misspelt type is refused here instead.
    return bad_value("warmup_type", fmt::format("{} is not \"log\" or \"linear\"", v.dump()));
  }
  return Status::ok();
}

}  // namespace

Status parse_scheduler_section(const json& section, ScheduleConfig* out) {
  if (!section.is_object()) {
    return Status::invalid_argument(fmt::format("scheduler: {} is not an object", section.dump()));
  }
  for (auto it = section.begin(); it != section.end(); ++it) {
    if (it.key() != "type" && it.key() != "params") {
      return Status::invalid_argument(fmt::format(
          "scheduler.{}: unknown key (the section takes \"type\" and \"params\")", it.key()));
    }
  }
  if (!section.contains("type") || !section.at("type").is_string()) {
    return Status::invalid_argument(
        "scheduler.type: missing or not a string (WarmupLR, WarmupDecayLR, WarmupCosineLR or "
        "OneCycle)");
  }
  const std::string type = section.at("type").get<std::string>();
  ScheduleConfig c;
  for (ScheduleKind k : {ScheduleKind::kWarmupLR, ScheduleKind::kWarmupDecayLR,
                         ScheduleKind::kWarmupCosineLR, ScheduleKind::kOneCycle}) {
    if (type == schedule_name(k)) c.kind = k;
  }
  if (c.kind == ScheduleKind::kNone) {
    return Status::invalid_argument(
        fmt::format("scheduler.type: \"{}\" is not supported by zinf (WarmupLR, WarmupDecayLR, "
                    "WarmupCosineLR or OneCycle)",
                    type));
  }
  const json empty = json::object();
  const json& params = section.contains("params") ? section.at("params") : empty;
  if (!params.is_object()) {
    return Status::invalid_argument(
        fmt::format("scheduler.params: {} is not an object", params.dump()));
  }
  // The keys each type's constructor takes in DeepSpeed, and nothing else.
  static constexpr std::string_view kWarmupKeys[] = {
      "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"};
  static constexpr std::string_view kWarmupDecayKeys[] = {
      "total_num_steps",  "warmup_min_lr", "warmup_max_lr",
      "warmup_num_steps", "warmup_type",   "last_batch_iteration"};
  static constexpr std::string_view kWarmupCosineKeys[] = {
      "total_num_steps", "warmup_min_ratio", "warmup_num_steps",
      "cos_min_ratio",   "warmup_type",      "last_batch_iteration"};
  static constexpr std::string_view kOneCycleKeys[] = {"cycle_min_lr",
                                                       "cycle_max_lr",
                                                       "decay_lr_rate",
                                                       "cycle_first_step_size",
                                                       "cycle_second_step_size",
                                                       "cycle_first_stair_count",
                                                       "cycle_second_stair_count",
                                                       "decay_step_size",
                                                       "cycle_momentum",
                                                       "cycle_min_mom",
                                                       "cycle_max_mom",
                                                       "decay_mom_rate",
                                                       "last_batch_iteration"};
  std::span<const std::string_view> known;
  switch (c.kind) {
    case ScheduleKind::kWarmupLR:
      known = kWarmupKeys;
      break;
    case ScheduleKind::kWarmupDecayLR:
      known = kWarmupDecayKeys;
      break;
    case ScheduleKind::kWarmupCosineLR:
      known = kWarmupCosineKeys;
      break;
    default:
      known = kOneCycleKeys;
      break;
  }
  for (auto it = params.begin(); it != params.end(); ++it) {
    bool found = false;
    for (std::string_view k : known) found = found || it.key() == k;
    if (!found) {
      // A slip is named from this type's own parameters, as the other sections' are from their
      // keys; a parameter of another type is no slip of one of these.
      const std::optional<std::string> hint = misspelling_hint(known, it.key());
      return Status::invalid_argument(
          fmt::format("scheduler.params.{}: unknown key for {} ({})", it.key(), type,
                      hint ? *hint : "misspelt, or not supported by zinf"));
    }
  }
  ZINF_RETURN_IF_ERROR(read_int(params, "warmup_num_steps", &c.warmup_num_steps));
  ZINF_RETURN_IF_ERROR(read_warmup_type(params, &c.warmup_linear));
  ZINF_RETURN_IF_ERROR(read_double(params, "warmup_min_lr", &c.warmup_min_lr));
  ZINF_RETURN_IF_ERROR(read_double(params, "warmup_max_lr", &c.warmup_max_lr));
  if (params.contains("warmup_max_lr") && c.warmup_max_lr < 0) {
    return bad_value("warmup_max_lr", fmt::format("{} is negative", c.warmup_max_lr));
  }
  ZINF_RETURN_IF_ERROR(read_int(params, "total_num_steps", &c.total_num_steps));
  ZINF_RETURN_IF_ERROR(read_double(params, "warmup_min_ratio", &c.warmup_min_ratio));
  ZINF_RETURN_IF_ERROR(read_double(params, "cos_min_ratio", &c.cos_min_ratio));
  ZINF_RETURN_IF_ERROR(read_double(params, "cycle_min_lr", &c.cycle_min_lr));
  ZINF_RETURN_IF_ERROR(read_double(params, "cycle_max_lr", &c.cycle_max_lr));
  ZINF_RETURN_IF_ERROR(read_double(params, "decay_lr_rate", &c.decay_lr_rate));
  ZINF_RETURN_IF_ERROR(read_int(params, "cycle_first_step_size", &c.cycle_first_step_size));
  if (params.contains("cycle_second_step_size") && !params.at("cycle_second_step_size").is_null()) {
    ZINF_RETURN_IF_ERROR(read_int(params, "cycle_second_step_size", &c.cycle_second_step_size));
  }
  ZINF_RETURN_IF_ERROR(read_int(params, "cycle_first_stair_count", &c.cycle_first_stair_count));
  if (params.contains("cycle_second_stair_count") &&
      !params.at("cycle_second_stair_count").is_null()) {
    ZINF_RETURN_IF_ERROR(read_int(params, "cycle_second_stair_count", &c.cycle_second_stair_count));
  }
  ZINF_RETURN_IF_ERROR(read_int(params, "decay_step_size", &c.decay_step_size));
  if (params.contains("cycle_momentum")) {
    const json& v = params.at("cycle_momentum");
    if (!v.is_boolean()) return bad_value("cycle_momentum", v.dump() + " is not true or false");
    c.cycle_momentum = v.get<bool>();
  }
  ZINF_RETURN_IF_ERROR(read_double(params, "cycle_min_mom", &c.cycle_min_mom));
  ZINF_RETURN_IF_ERROR(read_double(params, "cycle_max_mom", &c.cycle_max_mom));
  ZINF_RETURN_IF_ERROR(read_double(params, "decay_mom_rate", &c.decay_mom_rate));
  ZINF_RETURN_IF_ERROR(read_int(params, "last_batch_iteration", &c.last_batch_iteration));
  *out = c;
  return Status::ok();
}

Result<LrSchedule> LrSchedule::create(const ScheduleConfig& config, double base_lr) {
  LrSchedule s;
  s.config_ = config;
  s.base_lr_ = base_lr;
  const ScheduleConfig& c = config;
  if (!(std::isfinite(base_lr) && base_lr >= 0)) {
    return Status::invalid_argument(
        fmt::format("optimizer.params.lr: {} is not a finite number >= 0", base_lr));
  }
  if (c.last_batch_iteration < -1) {
    return bad_value("last_batch_iteration", fmt::format("{} is below -1", c.last_batch_iteration));
  }
  s.last_batch_iteration_ = c.last_batch_iteration;
  switch (c.kind) {
    case ScheduleKind::kNone:
      return s;
    case ScheduleKind::kWarmupLR:
    case ScheduleKind::kWarmupDecayLR:
    case ScheduleKind::kWarmupCosineLR:
      if (c.warmup_num_steps <= 0) {
        return bad_value("warmup_num_steps",
                         fmt::format("{} is not a positive whole number", c.warmup_num_steps));
      }
      s.warmup_steps_ = std::max<std::int64_t>(2, c.warmup_num_steps);
      if (c.kind != ScheduleKind::kWarmupLR && c.total_num_steps < 0) {
        return bad_value(
            "total_num_steps",
            fmt::format("{} needs total_num_steps (a whole number >= 0)", schedule_name(c.kind)));
      }
      if (c.kind == ScheduleKind::kWarmupCosineLR) {
        if (c.warmup_min_ratio < 0 || c.warmup_min_ratio > 1) {
          return bad_value("warmup_min_ratio",
                           fmt::format("{} is not in [0, 1]", c.warmup_min_ratio));
        }
        if (c.cos_min_ratio < 0 || c.cos_min_ratio > 1) {
          return bad_value("cos_min_ratio", fmt::format("{} is not in [0, 1]", c.cos_min_ratio));
        }
      } else {
        if (c.warmup_min_lr < 0) {
          return bad_value("warmup_min_lr", fmt::format("{} is negative", c.warmup_min_lr));
        }
        s.warmup_max_lr_ = c.warmup_max_lr >= 0                ? c.warmup_max_lr
                           : c.kind == ScheduleKind::kWarmupLR ? base_lr
                                                               : 0.001;
      }
      return s;
    case ScheduleKind::kOneCycle:
      if (c.cycle_min_lr < 0) {
        return bad_value("cycle_min_lr", "OneCycle needs cycle_min_lr (a number >= 0)");
      }
      if (c.cycle_max_lr < 0) {
        return bad_value("cycle_max_lr", "OneCycle needs cycle_max_lr (a number >= 0)");
      }
      if (c.cycle_first_step_size <= 0) {
        return bad_value("cycle_first_step_size",
                         fmt::format("{} is not a positive whole number", c.cycle_first_step_size));
      }
      if (c.cycle_second_step_size == 0 || c.cycle_second_step_size < -1) {
        return bad_value("cycle_second_step_size", fmt::format("{} is not a positive whole number",
                                                               c.cycle_second_step_size));
      }
      if (c.cycle_first_stair_count < 0) {
        return bad_value("cycle_first_stair_count", "is negative");
      }
      if (c.cycle_second_stair_count < -1) {
        return bad_value("cycle_second_stair_count", "is negative");
      }
      if (c.decay_step_size < 0) return bad_value("decay_step_size", "is negative");
      if (c.decay_lr_rate < 0) {
        return bad_value("decay_lr_rate",
                         fmt::format("{} is negative (the lr after the cycle, cycle_min_lr / (1 + "
                                     "decay_lr_rate x iterations / decay_step_size), would grow "
                                     "past any bound)",
                                     c.decay_lr_rate));
      }
      if (c.cycle_momentum) {
        for (double mom : {c.cycle_min_mom, c.cycle_max_mom}) {
          if (!(mom >= 0 && mom < 1)) {
            return bad_value(mom == c.cycle_min_mom ? "cycle_min_mom" : "cycle_max_mom",
                             fmt::format("{} is not in [0, 1) (it becomes Adam's beta1)", mom));
          }
        }
      }
      return s;
  }
  return Status::invalid_argument("scheduler.type: unknown schedule kind");
}

Status LrSchedule::set_last_batch_iteration(std::int64_t iteration) {
  if (iteration < -1) {
    return Status::invalid_argument(
        fmt::format("scheduler last_batch_iteration {} is below -1", iteration));
  }
  last_batch_iteration_ = iteration;
  return Status::ok();
}

double LrSchedule::warmup_gamma(std::int64_t n) const {
  const ScheduleConfig& c = config_;
  if (n < warmup_steps_) {
    if (c.warmup_linear) return static_cast<double>(n) / static_cast<double>(warmup_steps_);
    return std::log(static_cast<double>(n + 1)) / std::log(static_cast<double>(warmup_steps_));
  }
  if (c.kind == ScheduleKind::kWarmupDecayLR) {
    return std::max(0.0, static_cast<double>(c.total_num_steps - n) /
                             std::max(1.0, static_cast<double>(c.total_num_steps - warmup_steps_)));
  }
  return 1.0;
}

double LrSchedule::one_cycle_scale(std::int64_t n) const {
  const ScheduleConfig& c = config_;
  const double first = static_cast<double>(c.cycle_first_step_size);
  const double second =
      c.cycle_second_step_size < 0 ? first : static_cast<double>(c.cycle_second_step_size);
  const double total = first + second;
  const double ratio = first / total;
  const double b = static_cast<double>(n + 1);
  const double cycle = std::floor(1.0 + b / total);
  const double x = 1.0 + b / total - cycle;
  double scale = 0;
  std::int64_t stairs = 0;
  if (x <= ratio) {
    scale = x / ratio;
    stairs = c.cycle_first_stair_count;
  } else {
    scale = (x - 1.0) / (ratio - 1.0);
    stairs =
        c.cycle_second_stair_count < 0 ? c.cycle_first_stair_count : c.cycle_second_stair_count;
  }
  if (stairs > 0) {
    // Quantised from the integer position in the cycle, as DeepSpeed does, so a stair edge that
    // lands exactly on a whole number is not lost to rounding.
    const double in_cycle = std::fmod(b, total);
    const double position = in_cycle <= first
                                ? in_cycle * static_cast<double>(stairs) / first
                                : (total - in_cycle) * static_cast<double>(stairs) / second;
    scale = std::floor(position) / static_cast<double>(stairs);
  }
  return scale;
}

double LrSchedule::lr_at(std::int64_t n) const {
  const ScheduleConfig& c = config_;
  switch (c.kind) {
    case ScheduleKind::kNone:
      return base_lr_;
    case ScheduleKind::kWarmupLR:
    case ScheduleKind::kWarmupDecayLR:
      if (n < 0) return c.warmup_min_lr;
      return c.warmup_min_lr + (warmup_max_lr_ - c.warmup_min_lr) * warmup_gamma(n);
    case ScheduleKind::kWarmupCosineLR: {
      if (n < 0) return 0.0;
      double ratio = 0;
      if (n < warmup_steps_) {
        const double gamma = c.warmup_linear
                                 ? static_cast<double>(n) / static_cast<double>(warmup_steps_)
                                 : std::log(static_cast<double>(n + 1)) /
                                       std::log(static_cast<double>(warmup_steps_));
        ratio = c.warmup_min_ratio + gamma * (1.0 - c.warmup_min_ratio);
      } else {
        const double done = static_cast<double>(n - warmup_steps_ + 1);
        const double span = std::max(1.0, static_cast<double>(c.total_num_steps - warmup_steps_));
        const double progress = std::min(1.0, done / span);
        ratio = std::max(0.0, c.cos_min_ratio + (1.0 - c.cos_min_ratio) *
                                                    (1.0 + std::cos(std::numbers::pi * progress)) /
                                                    2.0);
      }
      return base_lr_ * ratio;
    }
    case ScheduleKind::kOneCycle: {
      const double first = static_cast<double>(c.cycle_first_step_size);
      const double second =
          c.cycle_second_step_size < 0 ? first : static_cast<double>(c.cycle_second_step_size);
      if (static_cast<double>(n) < first + second) {
        return c.cycle_min_lr + (c.cycle_max_lr - c.cycle_min_lr) * one_cycle_scale(n);
      }
      if (c.decay_step_size == 0 || c.decay_lr_rate == 0) return c.cycle_min_lr;
      const double d = static_cast<double>(n) - (first + second) + 1.0;
      return c.cycle_min_lr /
             (1.0 + c.decay_lr_rate * (d / static_cast<double>(c.decay_step_size)));
    }
  }
  return base_lr_;
}

Status LrSchedule::check_at(std::int64_t n) const {
  const double lr = lr_at(n);
  if (!(std::isfinite(lr) && lr >= 0)) {
    return Status::invalid_argument(fmt::format(
        "scheduler: {}'s lr at iteration {} is {} (the optimizer needs a finite lr >= 0)",
        schedule_name(config_.kind), n, lr));
  }
  const ScheduledBetas b = betas_at(n);
  if (b.set && !(b.beta1 >= 0 && b.beta1 < 1)) {
    const ScheduleConfig& c = config_;
    return bad_value(
        "decay_mom_rate",
        fmt::format("OneCycle's momentum at iteration {} is cycle_max_mom {} x (1 + "
                    "decay_mom_rate {} x iterations past the cycle / decay_step_size {}) = {}, "
                    "outside [0, 1) (it is Adam's beta1); a schedule whose momentum stays in it "
                    "for the run (set_lr_schedule) lets the step go on",
                    n, c.cycle_max_mom, c.decay_mom_rate, c.decay_step_size, b.beta1));
  }
  return Status::ok();
}

ScheduledBetas LrSchedule::betas_at(std::int64_t n) const {
  const ScheduleConfig& c = config_;
  ScheduledBetas b;
  if (c.kind != ScheduleKind::kOneCycle || !c.cycle_momentum) return b;
  b.set = true;
  b.beta2 = 0.99;
  if (n < 0) {
    // DeepSpeed's constructor sets the betas to (cycle_min_mom, 0.99) for the first step, where
    // the cycle formula would give cycle_max_mom.
    b.beta1 = c.cycle_min_mom;
    return b;
  }
  const double first = static_cast<double>(c.cycle_first_step_size);
  const double second =
      c.cycle_second_step_size < 0 ? first : static_cast<double>(c.cycle_second_step_size);
  if (static_cast<double>(n) < first + second) {
    b.beta1 = c.cycle_max_mom - (c.cycle_max_mom - c.cycle_min_mom) * one_cycle_scale(n);
  } else if (c.decay_step_size == 0 || c.decay_mom_rate == 0) {
    b.beta1 = c.cycle_max_mom;
  } else {
    const double d = static_cast<double>(n) - (first + second) + 1.0;
    b.beta1 =
        c.cycle_max_mom * (1.0 + c.decay_mom_rate * (d / static_cast<double>(c.decay_step_size)));
  }
  return b;
}

}  // namespace zinf
