// zinf bench step: the pipelined optimizer step over state on NVMe (or in host memory), beside the
// same run's I/O alone and update alone.
//
// The step's floor is max(I/O time, update time): the step is as good as it can be when it
// takes no longer than the slower of the two. Both are measured here, in the same process, on
// the same files, blocks and threads, interleaved round by round (the order rotates so none
// always follows another): io_alone is the pipeline with the update switched off (the identical
// reads and writes), update_alone the identical updates sub-group by sub-group on the pool's
// blocks with no I/O (sub-group i updates block i mod blocks, so memory stays bounded however
// many parameters there are). overlap_efficiency = max(io_alone, update_alone) / step, the median
// of the per-round ratios.
#include <fmt/format.h>
#include <sys/statvfs.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "base/cpu.hpp"
#include "base/random.hpp"
#include "command.hpp"
#include "device/pinned_pool.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "tier/optimizer_pipeline.hpp"
#include "tier/state_store.hpp"
#include "zinf/optim.hpp"
#include "zinf/trace.hpp"

namespace zinf::cli {
namespace {

struct BenchStepOptions {
  std::string params = "256M";
  std::string tier = "nvme";
  std::string path;
  std::string sub_group = "64MiB";
  std::string pool = "1GiB";
  int steps = 3;
  std::string trace;
  bool json = false;
  int threads = 0;
  std::string grad_dtype = "f32";
  std::string half = "bf16";
  std::string engine = "auto";
  std::string io_block = "1MiB";
  std::uint32_t queue_depth = 32;
  std::string pages = "auto";
};

// Peak resident set (VmHWM) of this process, in bytes; 0 if unreadable.
std::uint64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

std::uint64_t mix(std::uint64_t a, std::uint64_t b) {
  SplitMix64 r(a * 0x9e3779b97f4a7c15ull ^ b);
  return r.next();
}

// Seeded random contents for `count` elements of `piece`, as they are mid-training: never
// zeros, never inf or NaN. Chunked in parallel on the caller's arena.
void fill_piece(std::byte* data, Piece piece, DType dtype, std::size_t count, std::uint64_t seed) {
  constexpr std::size_t kChunk = std::size_t{1} << 18;
  const std::size_t chunks = (count + kChunk - 1) / kChunk;
  tbb::parallel_for(std::size_t{0}, chunks, [&](std::size_t c) {
    const std::size_t first = c * kChunk;
    const std::size_t n = std::min(kChunk, count - first);
    const std::uint64_t s = mix(seed, c);
    if (dtype == DType::kF32) {
      float* f = reinterpret_cast<float*>(data) + first;
      switch (piece) {
        case Piece::kExpAvg:
          fill_uniform(f, n, s, -0.1f, 0.1f);
          break;
        case Piece::kExpAvgSq:
          fill_uniform(f, n, s, 1e-4f, 1e-2f);
          break;
        default:
          fill_uniform(f, n, s, -1.0f, 1.0f);
          break;
      }
      return;
    }
    // 16-bit: random sign and mantissa under the exponent of 0.5, so magnitudes in [0.5, 1).
    auto* h = reinterpret_cast<std::uint16_t*>(data) + first;
    fill_random_bytes(h, n * 2, s);
    const std::uint16_t keep = dtype == DType::kBF16 ? 0x807f : 0x83ff;
    const std::uint16_t half = dtype == DType::kBF16 ? 0x3f00 : 0x3800;
    for (std::size_t i = 0; i < n; ++i) h[i] = static_cast<std::uint16_t>((h[i] & keep) | half);
  });
}

// Writes seeded random state into every piece the step reads, sub-group by sub-group, through
// the pool's blocks with several writes in flight (so the bench's memory is the pool's).
Status load_random_state(StateStore& store, PinnedPool* pool, tbb::task_arena& arena) {
  std::vector<Piece> pieces;
  for (Piece p : {Piece::kParams, Piece::kExpAvg, Piece::kExpAvgSq, Piece::kGrads}) {
    if (store.has(p)) pieces.push_back(p);
  }
  if (store.block_bytes() == 0) {
    arena.execute([&] {
      for (Piece p : pieces) {
        fill_piece(store.host_data(p), p, store.dtype(p), store.param_count(),
                   mix(0x5eed, static_cast<std::uint64_t>(p)));
      }
    });
    return Status::ok();
  }
  struct Pending {
    std::size_t sub_group;
    PinnedPool::Lease lease;
    std::vector<std::pair<Piece, SwapTicket>> tickets;
  };
  std::deque<Pending> in_flight;
  Status first;
  auto finish_oldest = [&] {
    Pending& p = in_flight.front();
    for (auto& [piece, ticket] : p.tickets) {
      Status s = store.swap()->wait(ticket, std::chrono::minutes(5));
      store.end_write(piece, p.sub_group, s.is_ok());
      if (!s.is_ok() && first.is_ok()) first = s;
    }
    in_flight.pop_front();
  };
  for (std::size_t i = 0; i < store.sub_group_count() && first.is_ok(); ++i) {
    std::optional<PinnedPool::Lease> lease = pool->try_acquire();
    while (!lease) {
      finish_oldest();
      lease = pool->try_acquire();
    }
    Pending p{i, std::move(*lease), {}};
    for (Piece piece : pieces) {
      std::byte* at = p.lease.data() + (store.on_nvme(piece) ? store.slot_offset(piece) : 0);
      std::byte* dst = store.on_nvme(piece) ? at : store.host_data(piece, i);
      arena.execute([&] {
        fill_piece(dst, piece, store.dtype(piece), store.sub_group_size(i),
                   mix(i, static_cast<std::uint64_t>(piece)));
      });
      if (!store.on_nvme(piece)) continue;
      store.begin_write(piece, i);
      Result<SwapTicket> ticket = store.swap()->write(store.extent(piece, i), at);
      if (!ticket.is_ok()) {
        store.end_write(piece, i, false);
        first = ticket.status();
        break;
      }
      p.tickets.emplace_back(piece, *ticket);
    }
    in_flight.push_back(std::move(p));
  }
  while (!in_flight.empty()) finish_oldest();
  return first;
}

void run_bench_step(const BenchStepOptions& o) {
  std::size_t count = 0, sub_group_bytes = 0, pool_bytes = 0, io_block = 0;
  if (!parse_size(o.params, &count, /*decimal=*/true) || count == 0) {
    return fail(fmt::format("--params {}: not a count (e.g. 2G)", o.params));
  }
  if (!parse_size(o.sub_group, &sub_group_bytes) || sub_group_bytes == 0) {
    return fail(fmt::format("--sub-group {}: not a size (e.g. 64MiB)", o.sub_group));
  }
  if (!parse_size(o.pool, &pool_bytes) || pool_bytes == 0) {
    return fail(fmt::format("--pool {}: not a size (e.g. 1GiB)", o.pool));
  }
  if (!parse_size(o.io_block, &io_block) || io_block == 0 || io_block % 4096 != 0) {
    return fail(fmt::format("--io-block {}: a multiple of 4 KiB (e.g. 1MiB)", o.io_block));
  }
  StoreMedium tier = StoreMedium::kNvme;
  if (!parse_store_medium(o.tier, &tier))
    return fail(fmt::format("--tier {}: nvme or host", o.tier));
  if (tier == StoreMedium::kNvme && o.path.empty())
    return fail("--path: a directory for the swap file");
  if (o.steps < 1) return fail("--steps: at least 1");
  const std::optional<DType> grad_dtype = parse_dtype(o.grad_dtype);
  if (!grad_dtype) return fail(fmt::format("--grad-dtype {}: f32, bf16 or f16", o.grad_dtype));
  std::optional<DType> half;
  if (o.half != "none") {
    half = parse_dtype(o.half);
    if (!half || *half == DType::kF32) {
      return fail(fmt::format("--half {}: none, bf16 or f16", o.half));
    }
  }
  HugePages pages = HugePages::kAuto;
  if (o.pages == "thp") {
    pages = HugePages::kThpOnly;
  } else if (o.pages == "hugetlb") {
    pages = HugePages::kHugeTlbOnly;
  } else if (o.pages == "normal") {
    pages = HugePages::kNone;
  } else if (o.pages != "auto") {
    return fail(fmt::format("--pages {}: auto, hugetlb, thp or normal", o.pages));
  }
  EngineKind engine_kind = EngineKind::kAuto;
  if (!parse_engine_kind(o.engine, &engine_kind)) {
    return fail(fmt::format("--engine {}: auto, uring or thread", o.engine));
  }
  const int threads = o.threads > 0 ? o.threads : cpu_count();

  StateStoreOptions so;
  so.param_count = count;
  so.sub_group_bytes = sub_group_bytes;
  so.optimizer = OptimizerKind::kAdamW;
  so.grad_dtype = *grad_dtype;
  so.with_half = half.has_value();
  so.half_dtype = half.value_or(DType::kBF16);
  so.tiers.fill(tier);
  Result<StoreLayout> layout = StateStore::layout(so);
  if (!layout.is_ok()) return fail(layout.status().to_string());

  // Open everything in order; all of it is sized here, nothing later.
  std::unique_ptr<IoEngine> engine;
  std::unique_ptr<SwapSpace> swap;
  std::unique_ptr<PinnedPool> pool;
  std::size_t block_count = 0;
  if (tier == StoreMedium::kNvme) {
    block_count = pool_bytes / layout->block_bytes;
    if (block_count < 2) {
      return fail(fmt::format("--pool {}: holds {} sub-group(s) of {} bytes; the step needs 2",
                              o.pool, block_count, layout->block_bytes));
    }
    struct statvfs vfs {};
    if (::statvfs(o.path.c_str(), &vfs) == 0) {
      const std::uint64_t free_bytes = std::uint64_t{vfs.f_bavail} * vfs.f_frsize;
      if (free_bytes < layout->nvme_bytes + (std::uint64_t{1} << 30)) {
        return fail(fmt::format("--path {}: {} free, the state needs {} (plus 1 GiB of margin)",
                                o.path, format_bytes(static_cast<double>(free_bytes)),
                                format_bytes(static_cast<double>(layout->nvme_bytes))));
      }
    }
    IoOptions io;
    io.kind = engine_kind;
    io.block_bytes = io_block;
    io.queue_depth = o.queue_depth;
    Result<std::unique_ptr<IoEngine>> e = open_engine(io);
    if (!e.is_ok()) return fail(e.status().to_string());
    engine = std::move(e).value();
    SwapOptions sw;
    sw.dirs = {o.path};
    sw.capacity_bytes = layout->nvme_bytes;
    sw.block_bytes = io_block;
    sw.max_extents = static_cast<std::uint32_t>(layout->nvme_extents + 16);
    sw.max_ops = static_cast<std::uint32_t>(block_count * kPieceCount + 16);
    sw.max_op_bytes = std::max<std::uint64_t>(layout->largest_piece_bytes, io_block);
    sw.file_name = "zinf-bench-step-{pid}.bin";
    Result<std::unique_ptr<SwapSpace>> s = SwapSpace::open(*engine, sw);
    if (!s.is_ok()) return fail(s.status().to_string());
    swap = std::move(s).value();
    PinnedPoolOptions po;
    po.block_bytes = layout->block_bytes;
    po.block_count = block_count;
    po.huge_pages = pages;
    Result<std::unique_ptr<PinnedPool>> p = PinnedPool::create(po);
    if (!p.is_ok()) return fail(p.status().to_string());
    pool = std::move(p).value();
    if (Status st = pool->register_with(*engine); !st.is_ok()) return fail(st.to_string());
  }
  Result<std::unique_ptr<StateStore>> store_r = StateStore::open(so, swap.get());
  if (!store_r.is_ok()) return fail(store_r.status().to_string());
  StateStore& store = **store_r;
  std::unique_ptr<Trace> trace = o.trace.empty() ? nullptr : std::make_unique<Trace>();
  PipelineOptions pipeline_options;
  pipeline_options.optimizer.kind = OptimizerKind::kAdamW;
  pipeline_options.threads = threads;
  pipeline_options.trace = trace.get();
  Result<std::unique_ptr<OptimizerPipeline>> pipeline_r =
      OptimizerPipeline::open(store, pool.get(), pipeline_options);
  if (!pipeline_r.is_ok()) return fail(pipeline_r.status().to_string());
  OptimizerPipeline& pipeline = **pipeline_r;

  tbb::task_arena arena(threads);
  const std::int64_t load_start = Trace::now_ns();
  if (Status st = load_random_state(store, pool.get(), arena); !st.is_ok()) {
    return fail(st.to_string());
  }
  const double load_s = static_cast<double>(Trace::now_ns() - load_start) * 1e-9;
  if (!o.json) {
    fmt::print(stderr,
               "zinf bench step: {} params, {} sub-groups of {}, state loaded in {:.1f} s\n", count,
               store.sub_group_count(), store.sub_group_params(), load_s);
  }

  // Rounds: each runs the step, io alone and update alone, in an order that rotates by round.
  std::vector<double> step_s, io_s, update_s, ratios, read_gbps, write_gbps, io_gbps, wait_s,
      step_update_s;
  std::size_t blocks_peak = 0;
  for (int r = 0; r < o.steps; ++r) {
    double round_step = 0, round_io = 0, round_update = 0;
    for (int k = 0; k < 3; ++k) {
      const int which = (k + r) % 3;
      StepArgs args;
      args.step = r + 1;
      args.mode = which == 0   ? StepMode::kFull
                  : which == 1 ? StepMode::kIoOnly
                               : StepMode::kUpdateOnly;
      Result<StepStats> stats = pipeline.step(args);
      if (!stats.is_ok()) return fail(stats.status().to_string());
      const double wall = static_cast<double>(stats->wall_ns) * 1e-9;
      if (which == 0) {
        round_step = wall;
        read_gbps.push_back(static_cast<double>(stats->read_bytes) / wall * 1e-9);
        write_gbps.push_back(static_cast<double>(stats->write_bytes) / wall * 1e-9);
        wait_s.push_back(static_cast<double>(stats->io_wait_ns) * 1e-9);
        step_update_s.push_back(static_cast<double>(stats->update_ns) * 1e-9);
        blocks_peak = std::max(blocks_peak, stats->blocks_peak);
      } else if (which == 1) {
        round_io = wall;
        io_gbps.push_back(static_cast<double>(stats->read_bytes + stats->write_bytes) / wall *
                          1e-9);
      } else {
        round_update = wall;
      }
    }
    step_s.push_back(round_step);
    io_s.push_back(round_io);
    update_s.push_back(round_update);
    ratios.push_back(std::max(round_io, round_update) / round_step);
    if (!o.json) {
      fmt::print(stderr, "round {}: step {:.3f} s, io alone {:.3f} s, update alone {:.3f} s\n",
                 r + 1, round_step, round_io, round_update);
    }
  }
  if (trace != nullptr) {
    if (Status st = trace->write_json(o.trace); !st.is_ok()) return fail(st.to_string());
  }

  nlohmann::json out;
  out["params"] = count;
  out["tier"] = o.tier;
  out["steps"] = o.steps;
  out["threads"] = threads;
  out["grad_dtype"] = o.grad_dtype;
  out["half_dtype"] = o.half;
  out["sub_group_params"] = store.sub_group_params();
  out["sub_groups"] = store.sub_group_count();
  out["sub_group_bytes"] = store.sub_group_params() * store.bytes_per_param();
  out["nvme_bytes"] = layout->nvme_bytes;
  out["pool_bytes"] = pool ? pool->bytes() : 0;
  out["pool_blocks"] = block_count;
  out["pool_pages"] = pool ? std::string(page_kind_name(pool->page_kind())) : "none";
  out["pool_locked"] = pool ? pool->locked() : false;
  out["blocks_peak"] = blocks_peak;
  out["engine"] = engine ? std::string(engine_kind_name(engine->kind())) : "none";
  out["load_s"] = load_s;
  out["step_s"] = median(step_s);
  out["io_alone_s"] = median(io_s);
  out["update_alone_s"] = median(update_s);
  out["overlap_efficiency"] = median(ratios);
  out["overlap_efficiency_min"] = *std::min_element(ratios.begin(), ratios.end());
  out["read_gbps"] = median(read_gbps);
  out["write_gbps"] = median(write_gbps);
  out["io_alone_gbps"] = median(io_gbps);
  out["step_io_wait_s"] = median(wait_s);
  out["step_update_s"] = median(step_update_s);
  out["peak_rss_bytes"] = peak_rss_bytes();
  out["rounds"] = {{"step_s", step_s}, {"io_alone_s", io_s}, {"update_alone_s", update_s}};
  if (o.json) {
    print_json(out);
    return;
  }
  fmt::print(
      "optimizer step over {} params on {}, {} sub-groups of {} params, pool {} ({} x {}, "
      "{}), {} thread(s), {} rounds\n",
      count, o.tier, store.sub_group_count(), store.sub_group_params(),
      format_bytes(static_cast<double>(pool ? pool->bytes() : 0)), block_count,
      format_bytes(static_cast<double>(store.block_bytes())), out["pool_pages"].get<std::string>(),
      threads, o.steps);
  Table table({"measure", "median", "unit"});
  table.add_row({"step", fmt::format("{:.3f}", median(step_s)), "s"});
  table.add_row({"io alone", fmt::format("{:.3f}", median(io_s)), "s"});
  table.add_row({"update alone", fmt::format("{:.3f}", median(update_s)), "s"});
  table.add_row(
      {"overlap efficiency", fmt::format("{:.3f}", median(ratios)), "max(io,update)/step"});
  table.add_row({"step read", fmt::format("{:.2f}", median(read_gbps)), "GB/s"});
  table.add_row({"step write", fmt::format("{:.2f}", median(write_gbps)), "GB/s"});
  table.add_row({"io alone read+write", fmt::format("{:.2f}", median(io_gbps)), "GB/s"});
  table.add_row({"step: waiting for io", fmt::format("{:.3f}", median(wait_s)), "s"});
  table.add_row({"step: updating", fmt::format("{:.3f}", median(step_update_s)), "s"});
  table.add_row({"peak RSS",
                 format_bytes(static_cast<double>(out["peak_rss_bytes"].get<std::uint64_t>())),
                 ""});
  table.print();
}

void setup_bench_step(CLI::App& app) {
  auto options = std::make_shared<BenchStepOptions>();
  CLI::App* bench = group(app, "bench", "Benchmarks of zinf's parts on this machine");
  CLI::App* sub = bench->add_subcommand(
      "step", "Pipelined optimizer step over NVMe or host state, beside its I/O and update alone");
  sub->add_option("--params", options->params, "Parameters (decimal: 2G = 2e9)")
      ->capture_default_str();
  sub->add_option("--tier", options->tier, "Where all the state lives: nvme or host")
      ->capture_default_str();
  sub->add_option("--path", options->path, "Directory for the swap file (nvme)");
  sub->add_option("--sub-group", options->sub_group,
                  "Bytes of one sub-group's state, gradient and half params")
      ->capture_default_str();
  sub->add_option("--pool", options->pool, "Pinned pool bytes (the step's host memory)")
      ->capture_default_str();
  sub->add_option("--steps", options->steps, "Rounds (step, io alone, update alone each)")
      ->capture_default_str();
  sub->add_option("--trace", options->trace, "Write a Perfetto/Chrome trace JSON here");
  sub->add_option("--threads", options->threads, "Update threads (0 = every core)")
      ->capture_default_str();
  sub->add_option("--grad-dtype", options->grad_dtype, "f32, bf16 or f16")->capture_default_str();
  sub->add_option("--half", options->half, "Half-precision params produced: bf16, f16 or none")
      ->capture_default_str();
  sub->add_option("--engine", options->engine, "auto, uring or thread")->capture_default_str();
  sub->add_option("--io-block", options->io_block, "I/O piece and checksum block")
      ->capture_default_str();
  sub->add_option("--queue-depth", options->queue_depth, "I/O pieces in flight")
      ->capture_default_str();
  sub->add_option("--pages", options->pages, "Pool pages: auto, hugetlb, thp or normal")
      ->capture_default_str();
  sub->add_flag("--json", options->json, "Print one JSON object");
  sub->callback([options] { run_bench_step(*options); });
}

}  // namespace

ZINF_COMMAND("bench step", setup_bench_step);

}  // namespace zinf::cli
