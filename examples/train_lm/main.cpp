// train_lm: trains a byte-level language model through zinf's Engine, as a user's program would,
// and shows where time and memory went. scripts/demo runs it; docs/DEMO.md shows its output.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include "model.hpp"
#include "options.hpp"
#include "report.hpp"
#include "trainer.hpp"

namespace {

using namespace train_lm;

std::string ms(double seconds, std::int64_t steps) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.1f",
                1e3 * seconds / double(std::max<std::int64_t>(steps, 1)));
  return buffer;
}
std::string pct(double part, double whole) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.0f%%", whole > 0 ? 100.0 * part / whole : 0.0);
  return buffer;
}
std::string num(double value, int digits) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.*f", digits, value);
  return buffer;
}

std::string describe_run(const Options& o, const ModelShape& s, std::uint64_t params) {
  std::string text = "train_lm: " + format_count(double(params)) + " parameters (" +
                     std::to_string(s.blocks) + " blocks, hidden " + std::to_string(s.hidden) +
                     ", context " + std::to_string(s.context_bytes) + " bytes), " +
                     std::to_string(o.steps) + " steps of " + std::to_string(o.batch) + " x " +
                     std::to_string(o.seq_len) + " bytes (" + std::to_string(o.micro_batches) +
                     " micro-batch" + (o.micro_batches == 1 ? "" : "es") + " a rank), seed " +
                     std::to_string(o.seed) + "\n";
  if (!o.use_engine) return text + "  plain fp32 AdamW loop in this process (--engine off)\n";
  const std::string processes = o.comm == "mpi"    ? "one process per rank (MpiComm) on "
                                : o.comm == "nccl" ? "one process per rank (NcclComm) on "
                                                   : "LocalComm threads on ";
  const std::string where =
      o.device == "cuda"     ? processes + "GPUs (CudaDevice); the model computes on the CPU"
      : o.device == "opaque" ? processes + "opaque HostDevices, read through copies"
                             : processes + "HostDevice";
  text += "  zinf: ZeRO-" + std::to_string(o.stage) + " over " + std::to_string(o.world_size) +
          (o.world_size == 1 ? " rank" : " ranks") + " (" + where + "), " + o.param_dtype +
          " parameters" +
          (o.stage == 3 && o.offload_param != "none"
               ? " offloaded to " + std::string(o.offload_param == "cpu" ? "host memory" : "NVMe")
               : " on the device") +
          ", AdamW state " +
          (o.offload_optimizer == "nvme"  ? "on NVMe (" + o.nvme_path + ")"
           : o.offload_optimizer == "cpu" ? std::string("in host memory")
                                          : std::string("on the device")) +
          "\n";
  return text;
}

std::string summary_text(const Options& o, const RunSummary& r) {
  const TimeSplit& t = r.time;
  const std::int64_t n = r.steps_done;
  const double parts = t.forward_s + t.backward_s + t.gather_s + t.reduce_s + t.step_s + t.eval_s;
  const double other = std::max(0.0, t.total_s - parts);
  std::vector<std::vector<std::string>> rows = {
      {"forward compute", ms(t.forward_s, n), pct(t.forward_s, t.total_s)},
      {"backward compute", ms(t.backward_s, n), pct(t.backward_s, t.total_s)},
      {"gather + cast (ZeRO-3)", ms(t.gather_s, n), pct(t.gather_s, t.total_s)},
      {"gradient reduction", ms(t.reduce_s, n), pct(t.reduce_s, t.total_s)},
      {"optimizer step", ms(t.step_s, n), pct(t.step_s, t.total_s)},
      {"  of which AdamW + NVMe I/O", ms(t.optimizer_s, n), pct(t.optimizer_s, t.total_s)},
      {"    of which I/O wait", std::isnan(t.io_wait_s) ? "n/a" : ms(t.io_wait_s, n),
       std::isnan(t.io_wait_s) ? "" : pct(t.io_wait_s, t.total_s)},
      {"validation", ms(t.eval_s, n), pct(t.eval_s, t.total_s)},
      {"other (batches, sync)", ms(other, n), pct(other, t.total_s)},
      {"total", ms(t.total_s, n), "100%"},
  };
  // Overlapped, step() only starts the pass, which runs on behind the next forward: its time is
  // not a part of the step's, so it is shown apart, with how much of it the compute hid.
  if (o.use_engine && o.overlap_step && o.offload_optimizer != "none") {
    rows[4][0] = "optimizer step (waited for)";
    rows[5] = {"  AdamW + NVMe I/O, behind compute", ms(t.optimizer_s, n), "-"};
    rows[6] = {"    of which hidden", ms(t.hidden_s, n), "-"};
    rows.insert(rows.begin() + 7, {"    of which I/O wait",
                                   std::isnan(t.io_wait_s) ? "n/a" : ms(t.io_wait_s, n), "-"});
    rows.insert(rows.begin() + 3, {"  of which waiting for the optimizer", ms(t.gather_wait_s, n),
                                   pct(t.gather_wait_s, t.total_s)});
  }
  std::string text = "\nwhere the time went (rank 0, per step)\n" +
                     format_table({"phase", "ms/step", "share"}, rows);
  const double state_fp32 = 12.0 * double(r.param_count);
  // One process per rank: every process's peak, summed (the peaks need not fall together).
  const std::string rss_of = o.comm != "local" && o.world_size > 1
                                 ? " (sum of " + std::to_string(o.world_size) + " processes)"
                                 : "";
  std::vector<std::vector<std::string>> tiers = {
      {o.device == "cuda" ? "device (GPU)" : "device (HostDevice)",
       format_bytes(double(r.device_bytes))},
      {"host (pinned pool, host tier)", format_bytes(double(r.host_bytes))},
      {"NVMe (swap files)", format_bytes(double(r.nvme_bytes))},
      {"NVMe read / written",
       format_bytes(double(r.nvme_read_bytes)) + " / " + format_bytes(double(r.nvme_write_bytes))},
      {"activations on the device (peak)", format_bytes(double(r.activation_device_bytes_peak))},
      {"activations off the device: host / NVMe written",
       format_bytes(double(r.activation_host_bytes)) + " / " +
           format_bytes(double(r.activation_nvme_write_bytes))},
      {"peak RSS, setting up" + rss_of, format_bytes(double(r.setup_peak_rss_bytes))},
      {"peak RSS, training steps" + rss_of, format_bytes(double(r.peak_rss_bytes))},
      {"fp32 master + Adam moments", format_bytes(state_fp32)},
  };
  text += "\nwhere the state lived (all ranks)\n" + format_table({"tier", "bytes"}, tiers);
  const double tokens_per_s = double(r.tokens_seen) / std::max(t.total_s, 1e-9);
  std::vector<std::vector<std::string>> results = {
      {"validation loss",
       num(r.first_val_loss, 3) + " -> " + num(r.final_val_loss, 3) + " nats/byte"},
      {"train loss (last step)", num(r.final_train_loss, 3)},
      {"steps", r.first_step > 1
                    ? std::to_string(r.steps_done) + " (steps " + std::to_string(r.first_step) +
                          "-" + std::to_string(r.first_step + r.steps_done - 1) +
                          ", resumed after step " + std::to_string(r.first_step - 1) + ")"
                    : std::to_string(r.steps_done)},
      {"tokens/s", num(tokens_per_s, tokens_per_s < 100 ? 1 : 0)},
      {"wall time", num(r.wall_s, 1) + " s"},
      {"outputs", o.out_dir + "/loss.csv, " + o.out_dir + "/loss.svg" +
                      (o.trace_path.empty() ? "" : ", " + o.trace_path)},
  };
  text += "\nsummary\n" + format_table({"", ""}, results);
  return text;
}

// The curve with the validation before the first step this run trained, for the picture: at
// step 0, or at the checkpoint's step in a resumed run, whose curve holds the steps before it.
std::vector<CurvePoint> with_start(const RunSummary& r) {
  CurvePoint start;
  start.step = r.first_step - 1;
  start.train_loss = std::nan("");
  start.val_loss = r.first_val_loss;
  std::vector<CurvePoint> points = r.curve;
  const auto after = std::find_if(points.begin(), points.end(),
                                  [&](const CurvePoint& p) { return p.step > start.step; });
  points.insert(after, start);
  return points;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  std::string error;
  const int parsed = parse_options(argc, argv, &options, &error);
  if (parsed < 0) return 0;
  if (parsed != 0) {
    std::fprintf(stderr, "train_lm: error: %s\n", error.c_str());
    return 2;
  }
  ModelShape base;
  base.blocks = options.layers;
  base.context_bytes = options.context_bytes;
  base.embed_dim = options.embed_dim;
  const ModelShape shape = shape_for_params(options.params, base);
  const std::uint64_t params = param_count(shape);
  RunSummary summary;
  const int failed =
      run_training(options, shape, describe_run(options, shape, params), &summary, &error);
  if (failed != 0) {
    // One process per rank: every process's error names its rank.
    const std::string rank = "rank " + std::to_string(launcher_rank(options.comm)) + ": ";
    const bool named =
        options.comm == "local" || options.world_size == 1 || error.rfind("rank ", 0) == 0;
    std::fprintf(stderr, "train_lm: error: %s%s\n", named ? "" : rank.c_str(), error.c_str());
    return failed;
  }
  // Only rank 0's process writes the outputs and prints the summary.
  if (!summary.writes_outputs) return 0;
  const std::string csv = options.out_dir + "/loss.csv";
  const std::string svg = options.out_dir + "/loss.svg";
  const std::string title =
      "train_lm " + format_count(double(params)) + " params, " +
      (options.use_engine ? "zinf ZeRO-" + std::to_string(options.stage) + ", " +
                                std::to_string(options.world_size) + " rank(s), optimizer " +
                                options.offload_optimizer
                          : std::string("plain fp32 loop"));
  if (!write_curve_csv(csv, summary.curve, &error) ||
      !write_curve_svg(svg, with_start(summary), title, &error)) {
    std::fprintf(stderr, "train_lm: error: %s\n", error.c_str());
    return 1;
  }
  const std::string text = summary_text(options, summary);
  std::fputs(text.c_str(), stdout);
  std::string ignored;
  FILE* file = std::fopen((options.out_dir + "/summary.txt").c_str(), "w");
  if (file != nullptr) {
    std::fputs(describe_run(options, shape, params).c_str(), file);
    std::fputs(text.c_str(), file);
    std::fclose(file);
  }
  std::printf("activation_device_bytes_peak=%llu activation_nvme_read_bytes=%llu\n",
              static_cast<unsigned long long>(summary.activation_device_bytes_peak),
              static_cast<unsigned long long>(summary.activation_nvme_read_bytes));
  // A machine-readable last line, for scripts and the equality checks.
  std::printf("final_val_loss=%.6f final_train_loss=%.6f\n", summary.final_val_loss,
              summary.final_train_loss);
  return 0;
}
