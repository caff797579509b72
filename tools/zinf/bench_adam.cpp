// zinf bench adam: the CPU optimizer step beside the memory bandwidth of its own access pattern.
//
// The step is memory-bound, so its limit is what this machine moves for the same streams (the
// same number of 4- and 2-byte streams read, updated in place and written) with trivial
// arithmetic. Both are measured here, in the same process on the same number of threads,
// interleaved round by round so that drift on a shared machine hits both alike; the reported
// ratio is the median over rounds of (step GB/s) / (pattern GB/s).
//
// With --groups N > 1 the span is also stepped as N parameter groups (optimizer_step() over
// ranges): runs of 1Mi elements in group 0 (the decayed weight matrices) alternate with runs of
// 4Ki elements in each other group in turn (biases and norm weights, no weight decay, the lr
// scaled), the layout of a transformer's flat partition. Each round then times the one-group
// step, the N-group step and the pattern, in rotating order, and groups_ratio is the median over
// rounds of (N-group GB/s) / (one-group GB/s).
#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/aligned.hpp"
#include "base/cpu.hpp"
#include "base/membw.hpp"
#include "base/random.hpp"
#include "command.hpp"
#include "zinf/optim.hpp"
#include "zinf/trace.hpp"

namespace zinf::cli {
namespace {

struct BenchAdamOptions {
  std::string params = "256M";
  std::string threads = "1";
  std::string grad_dtype = "f32";
  std::string out_dtype = "none";
  std::string optimizer = "adamw";
  std::string simd = "auto";
  int steps = 10;
  int groups = 1;
  std::size_t tile_elements = 0;
  bool json = false;
};

// Fills `count` 16-bit gradients with random values of magnitude in [0.5, 1) and random sign:
// random sign and mantissa bits under a fixed exponent, so never zero, never inf or NaN.
void fill_half_grads(std::uint16_t* data, std::size_t count, DType dtype, std::uint64_t seed) {
  fill_random_bytes(data, count * 2, seed);
  const std::uint16_t keep = dtype == DType::kBF16 ? 0x807f : 0x83ff;
  const std::uint16_t half = dtype == DType::kBF16 ? 0x3f00 : 0x3800;  // 0.5
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, count, 1 << 20),
                    [&](const tbb::blocked_range<std::size_t>& r) {
                      for (std::size_t i = r.begin(); i != r.end(); ++i) {
                        data[i] = static_cast<std::uint16_t>((data[i] & keep) | half);
                      }
                    });
}

void run_bench_adam(const BenchAdamOptions& o) {
  std::size_t count = 0;
  if (!parse_size(o.params, &count, /*decimal=*/true) || count == 0) {
    fail(fmt::format("--params {}: not a count (e.g. 256M)", o.params));
    return;
  }
  int threads = 0;
  if (o.threads == "all") {
    threads = cpu_count();
  } else {
    try {
      threads = std::stoi(o.threads);
    } catch (...) {
      threads = 0;
    }
    if (threads < 1) {
      fail(fmt::format("--threads {}: expected a positive number or 'all'", o.threads));
      return;
    }
  }
  OptimizerParams hp;
  if (!parse_optimizer(o.optimizer, &hp.kind)) {
    fail(fmt::format("--optimizer {}: expected adamw, adam, adagrad or lion", o.optimizer));
    return;
  }
  const std::optional<DType> grad_dtype = parse_dtype(o.grad_dtype);
  if (!grad_dtype) {
    fail(fmt::format("--grad-dtype {}: expected f32, bf16 or f16", o.grad_dtype));
    return;
  }
  std::optional<DType> out_dtype;
  if (o.out_dtype != "none") {
    out_dtype = parse_dtype(o.out_dtype);
    if (!out_dtype || *out_dtype == DType::kF32) {
      fail(fmt::format("--out-dtype {}: expected none, bf16 or f16", o.out_dtype));
      return;
    }
  }
  Simd requested = Simd::kAuto;
  if (!parse_simd(o.simd, &requested)) {
    fail(fmt::format("--simd {}: expected auto, avx512, avx2 or scalar", o.simd));
    return;
  }
  const Result<Simd> simd = resolve_simd(requested);
  if (!simd.is_ok()) {
    fail(simd.status().to_string());
    return;
  }
  if (o.steps < 1) {
    fail("--steps: at least 1");
    return;
  }
  if (o.groups < 1 || static_cast<std::size_t>(o.groups) > kMaxOptimizerGroups) {
    fail(fmt::format("--groups {}: 1 to {}", o.groups, kMaxOptimizerGroups));
    return;
  }
  // The groups: group 0 as --optimizer's defaults, the others decay-free at a scaled lr.
  std::vector<OptimizerParams> group_params(static_cast<std::size_t>(o.groups), hp);
  for (std::size_t g = 1; g < group_params.size(); ++g) {
    group_params[g].weight_decay = 0.0;
    group_params[g].lr = hp.lr * (1.0 + 0.5 * static_cast<double>(g));
  }
  std::vector<OptimizerRange> ranges;
  {
    constexpr std::size_t kWeightRun = std::size_t{1} << 20, kBiasRun = std::size_t{4} << 10;
    std::size_t begin = 0;
    std::uint32_t next_small = 1;
    while (begin < count) {
      ranges.push_back({begin, 0});
      begin += kWeightRun;
      if (o.groups > 1 && begin < count) {
        ranges.push_back({begin, next_small});
        begin += kBiasRun;
        next_small = next_small + 1 < static_cast<std::uint32_t>(o.groups) ? next_small + 1 : 1;
      }
    }
  }

  // The streams this optimizer moves, and the same pattern for the bandwidth probe.
  const bool has_avg = hp.kind != OptimizerKind::kAdagrad;
  const bool has_avg_sq = hp.kind != OptimizerKind::kLion;
  StreamPattern pattern;
  pattern.read_only_bytes = {static_cast<int>(dtype_bytes(*grad_dtype))};
  pattern.in_place_bytes = {4};
  if (has_avg) pattern.in_place_bytes.push_back(4);
  if (has_avg_sq) pattern.in_place_bytes.push_back(4);
  if (out_dtype) pattern.write_only_bytes = {2};
  const std::size_t bytes_per_param = pattern.bytes_per_element();

  tbb::task_arena arena(threads);
  AlignedBuffer params(count * 4), exp_avg(has_avg ? count * 4 : 0),
      exp_avg_sq(has_avg_sq ? count * 4 : 0), grads(count * dtype_bytes(*grad_dtype)),
      half(out_dtype ? count * 2 : 0);
  arena.execute([&] {
    // Seeded random data, never zeros: the state as it is mid-training.
    fill_uniform(params.as<float>(), count, 1, -1.0f, 1.0f);
    if (has_avg) fill_uniform(exp_avg.as<float>(), count, 2, -0.1f, 0.1f);
    if (has_avg_sq) fill_uniform(exp_avg_sq.as<float>(), count, 3, 1e-4f, 1e-2f);
    if (*grad_dtype == DType::kF32) {
      fill_uniform(grads.as<float>(), count, 4, -1.0f, 1.0f);
    } else {
      fill_half_grads(grads.as<std::uint16_t>(), count, *grad_dtype, 4);
    }
    if (out_dtype) fill_random_bytes(half.data(), half.bytes(), 5);
  });
  OptimizerSpan span;
  span.params = params.as<float>();
  span.exp_avg = has_avg ? exp_avg.as<float>() : nullptr;
  span.exp_avg_sq = has_avg_sq ? exp_avg_sq.as<float>() : nullptr;
  span.grads = grads.data();
  span.grad_dtype = *grad_dtype;
  span.params_half = out_dtype ? half.data() : nullptr;
  span.half_dtype = out_dtype.value_or(DType::kBF16);
  span.count = count;
  StepOptions step_options;
  step_options.simd = *simd;
  step_options.threads = 0;  // run in `arena`, made once outside the timed region
  step_options.tile_elements = o.tile_elements;

  std::int64_t step = 0;
  Status status;
  auto time_step = [&](bool grouped) {
    step_options.step = ++step;
    const std::int64_t start = Trace::now_ns();
    arena.execute([&] {
      Result<StepResult> r = grouped ? optimizer_step(group_params, ranges, span, step_options)
                                     : optimizer_step(hp, span, step_options);
      if (!r.is_ok()) status = r.status();
    });
    return static_cast<double>(Trace::now_ns() - start);
  };

  const bool grouped = o.groups > 1;
  BandwidthProbe probe(pattern, count, threads);  // its constructor runs a warm-up pass
  time_step(false);                               // warm-up: pages faulted, caches in a state
  if (grouped) time_step(true);
  if (!status.is_ok()) {
    fail(status.to_string());
    return;
  }
  std::vector<double> step_ns, step_gbps, pattern_gbps, ratios, groups_gbps, groups_ratios;
  const double bytes = static_cast<double>(bytes_per_param * count);
  for (int r = 0; r < o.steps; ++r) {
    // Rotate which goes first, so none always follows another.
    double probe_gbps = 0, ns = 0, groups_ns = 0;
    const int kinds = grouped ? 3 : 2;
    for (int k = 0; k < kinds; ++k) {
      switch ((r + k) % kinds) {
        case 0:
          ns = time_step(false);
          break;
        case 1:
          probe_gbps = probe.run_once();
          break;
        default:
          groups_ns = time_step(true);
          break;
      }
    }
    const double gbps = bytes / ns;
    step_ns.push_back(ns);
    step_gbps.push_back(gbps);
    pattern_gbps.push_back(probe_gbps);
    ratios.push_back(gbps / probe_gbps);
    if (grouped) {
      groups_gbps.push_back(bytes / groups_ns);
      groups_ratios.push_back(ns / groups_ns);
    }
  }
  if (!status.is_ok()) {
    fail(status.to_string());
    return;
  }

  const double ms = median(step_ns) * 1e-6;
  nlohmann::json out;
  out["optimizer"] = std::string(optimizer_name(hp.kind));
  out["grad_dtype"] = std::string(dtype_name(*grad_dtype));
  out["out_dtype"] = out_dtype ? std::string(dtype_name(*out_dtype)) : "none";
  out["params"] = count;
  out["threads"] = threads;
  out["simd"] = std::string(simd_name(*simd));
  out["avx512bf16"] = cpu_features().avx512bf16;
  out["bytes_per_param"] = bytes_per_param;
  out["steps"] = o.steps;
  out["step_ms"] = ms;
  out["params_per_s"] = static_cast<double>(count) / (ms * 1e-3);
  out["gbps"] = median(step_gbps);
  out["pattern_gbps"] = median(pattern_gbps);
  out["ratio"] = median(ratios);
  out["ratio_min"] = *std::min_element(ratios.begin(), ratios.end());
  out["ratio_max"] = *std::max_element(ratios.begin(), ratios.end());
  out["round_ratios"] = ratios;  // in the order measured
  out["groups"] = o.groups;
  if (grouped) {
    out["ranges"] = ranges.size();
    out["groups_gbps"] = median(groups_gbps);
    out["groups_ratio"] = median(groups_ratios);
    out["groups_ratio_min"] = *std::min_element(groups_ratios.begin(), groups_ratios.end());
    out["groups_ratio_max"] = *std::max_element(groups_ratios.begin(), groups_ratios.end());
    out["round_groups_ratios"] = groups_ratios;
  }
  if (o.json) {
    print_json(out);
    return;
  }
  fmt::print("{} over {} params, grads {}, half copy {}, {} thread(s), simd {}, {} rounds\n",
             o.optimizer, count, o.grad_dtype, o.out_dtype, threads, simd_name(*simd), o.steps);
  Table table({"measure", "median", "unit"});
  table.add_row({"step time", fmt::format("{:.2f}", ms), "ms"});
  table.add_row({"params/s", fmt::format("{:.3g}", out["params_per_s"].get<double>()), "1/s"});
  table.add_row({fmt::format("step ({} B/param)", bytes_per_param),
                 fmt::format("{:.2f}", out["gbps"].get<double>()), "GB/s"});
  table.add_row({"same pattern, trivial arithmetic",
                 fmt::format("{:.2f}", out["pattern_gbps"].get<double>()), "GB/s"});
  table.add_row({"ratio (median of rounds)", fmt::format("{:.3f}", out["ratio"].get<double>()),
                 fmt::format("[{:.3f}, {:.3f}]", out["ratio_min"].get<double>(),
                             out["ratio_max"].get<double>())});
  if (grouped) {
    table.add_row({fmt::format("step, {} groups over {} ranges", o.groups, ranges.size()),
                   fmt::format("{:.2f}", out["groups_gbps"].get<double>()), "GB/s"});
    table.add_row({"groups / one group (median of rounds)",
                   fmt::format("{:.3f}", out["groups_ratio"].get<double>()),
                   fmt::format("[{:.3f}, {:.3f}]", out["groups_ratio_min"].get<double>(),
                               out["groups_ratio_max"].get<double>())});
  }
  table.print();
}

void setup_bench_adam(CLI::App& app) {
  auto options = std::make_shared<BenchAdamOptions>();
  CLI::App* bench = group(app, "bench", "Benchmarks of zinf's parts on this machine");
  CLI::App* sub = bench->add_subcommand(
      "adam", "CPU optimizer step beside the same-run bandwidth of its access pattern");
  sub->add_option("--params", options->params, "Parameters (decimal: 256M = 256e6)")
      ->capture_default_str();
  sub->add_option("--threads", options->threads, "Threads: a number or 'all'")
      ->capture_default_str();
  sub->add_option("--grad-dtype", options->grad_dtype, "f32, bf16 or f16")->capture_default_str();
  sub->add_option("--out-dtype", options->out_dtype, "Half copy of the params: none, bf16, f16")
      ->capture_default_str();
  sub->add_option("--optimizer", options->optimizer, "adamw, adam, adagrad or lion")
      ->capture_default_str();
  sub->add_option("--simd", options->simd, "auto (or ZINF_SIMD), avx512, avx2 or scalar")
      ->capture_default_str();
  sub->add_option("--steps", options->steps, "Timed rounds (median reported), after a warm-up")
      ->capture_default_str();
  sub->add_option("--groups", options->groups,
                  "Also step as N parameter groups, timed against one group")
      ->capture_default_str();
  sub->add_option("--tile", options->tile_elements, "Elements per tile (0 = default)")
      ->capture_default_str();
  sub->add_flag("--json", options->json, "Print one JSON object");
  sub->callback([options] { run_bench_adam(*options); });
}

}  // namespace

ZINF_COMMAND("bench adam", setup_bench_adam);

}  // namespace zinf::cli
