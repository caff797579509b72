// OptimizerPipeline (see optimizer_pipeline.hpp, which describes the schedule, the threads and the
// error rules). Just over 800 lines: the driver loop, its error path and the update thread are one
// state machine over the in-flight records, kept in one file so that every transition is read
// beside the others.
#include "tier/optimizer_pipeline.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <thread>

#include "base/arith.hpp"
#include "base/assert.hpp"
#include "base/cpu.hpp"
#include "zinf/log.hpp"

namespace zinf {

namespace {

constexpr auto kPollInterval = std::chrono::microseconds(100);

}  // namespace

// One sub-group in flight: its block, and the swap tickets of its pieces' reads or writes.
struct OptimizerPipeline::Entry {
  enum class Phase : std::uint8_t { kIdle, kReading, kInBlock, kWriting };
  Phase phase = Phase::kIdle;
  std::size_t position = 0;   // in the step's order
  std::size_t sub_group = 0;  // sub_group_at(position)
  PinnedPool::Lease lease;
  std::array<SwapTicket, kPieceCount> tickets{};
  std::array<bool, kPieceCount> pending{};  // ticket not yet redeemed
  bool write_failed = false;                // some write of this sub-group failed
  bool wrote_any = false;                   // some write was submitted
  bool pass = false;     // a settled frozen sub-group the step passes over (see the header)
  bool settles = false;  // its update left a frozen sub-group's moments zero
  // A transfer of this sub-group was abandoned (SwapSpace::abandon): the device may still write
  // into the block, so it goes to quarantine_ instead of back to the pool.
  bool quarantined = false;
  std::int64_t start_ns = 0;  // submission of the reads / writes
  std::int64_t done_ns = 0;   // when a poll first saw them all complete; 0: not yet
};

OptimizerPipeline::OptimizerPipeline(StateStore& store, PinnedPool* pool,
                                     const PipelineOptions& options)
    : store_(store), pool_(pool), options_(options) {}

OptimizerPipeline::~OptimizerPipeline() {
  if (!quarantine_.empty()) {
    // The pool refuses to be destroyed with blocks still leased, so they go back now: whoever
    // destroys the pipeline after such an error should close the pool and the engine with it.
    log_error("tier: returning {} pool block(s) whose I/O never completed to the pool",
              quarantine_.size());
  }
  if (updater_.joinable()) {
    {
      std::lock_guard lock(update_mutex_);
      updater_stop_ = true;
    }
    update_wake_.notify_one();
    updater_.join();
  }
}

void OptimizerPipeline::updater_main() {
  std::unique_lock lock(update_mutex_);
  for (;;) {
    update_wake_.wait(lock, [&] { return update_pending_ || updater_stop_; });
    if (updater_stop_) return;
    const std::size_t i = update_sub_group_;
    std::byte* block = update_block_;
    const StepArgs args = update_args_;
    const bool pass = update_pass_;
    lock.unlock();
    std::int64_t ns = 0;
    bool settles = false;
    Status status = update(i, block, args, pass, &ns, &settles);
    lock.lock();
    update_status_ = std::move(status);
    update_ns_ = ns;
    update_settles_ = settles;
    update_pending_ = false;
    update_finished_ = true;
    update_done_.notify_one();
  }
}

void OptimizerPipeline::start_update(std::size_t i, std::byte* block, const StepArgs& args,
                                     bool pass) {
  {
    std::lock_guard lock(update_mutex_);
    ZINF_ASSERT(!update_pending_ && !update_finished_);
    update_sub_group_ = i;
    update_block_ = block;
    update_args_ = args;
    update_pass_ = pass;
    update_pending_ = true;
  }
  update_wake_.notify_one();
}

bool OptimizerPipeline::update_done() {
  std::lock_guard lock(update_mutex_);
  return update_finished_;
}

bool OptimizerPipeline::wait_update(std::chrono::microseconds timeout) {
  std::unique_lock lock(update_mutex_);
  return update_done_.wait_for(lock, timeout, [&] { return update_finished_; });
}

Status OptimizerPipeline::finish_update() {
  {
    std::unique_lock lock(update_mutex_);
    update_done_.wait(lock, [&] { return update_finished_; });
  }
  return take_update_result();
}

Status OptimizerPipeline::take_update_result() {
  std::lock_guard lock(update_mutex_);
  ZINF_ASSERT(update_finished_);
  update_finished_ = false;
  stats_.update_ns += update_ns_;
  taken_settles_ = update_settles_;
  return std::move(update_status_);
}

Result<std::unique_ptr<OptimizerPipeline>> OptimizerPipeline::open(StateStore& store,
                                                                   PinnedPool* pool,
                                                                   const PipelineOptions& options) {
  if (options.optimizer.kind != store.options().optimizer) {
    return Status::invalid_argument(fmt::format(
        "OptimizerPipeline: optimizer {} but the store holds the state of {}",
        optimizer_name(options.optimizer.kind), optimizer_name(store.options().optimizer)));
  }
  if (!options.groups.empty()) {
    if (options.groups.size() > kMaxOptimizerGroups) {
      return Status::invalid_argument(
          fmt::format("OptimizerPipeline: {} parameter groups (at most {})", options.groups.size(),
                      kMaxOptimizerGroups));
    }
    for (const OptimizerParams& g : options.groups) {
      if (g.kind != store.options().optimizer) {
        return Status::invalid_argument(fmt::format(
            "OptimizerPipeline: a parameter group of {} but the store holds the state of {}",
            optimizer_name(g.kind), optimizer_name(store.options().optimizer)));
      }
    }
    const std::vector<OptimizerRange>& ranges = options.ranges;
    if (ranges.empty() || ranges[0].begin != 0) {
      return Status::invalid_argument(
          "OptimizerPipeline: parameter group ranges must start with one at element 0");
    }
    for (std::size_t r = 0; r < ranges.size(); ++r) {
      if (ranges[r].group >= options.groups.size() ||
          (r > 0 &&
           !(ranges[r].begin > ranges[r - 1].begin && ranges[r].begin < store.param_count()))) {
        return Status::invalid_argument(fmt::format(
            "OptimizerPipeline: parameter group range {} (element {}, group {}) is out of order, "
            "past the partition's {} elements or names a group that is not there",
            r, ranges[r].begin, ranges[r].group, store.param_count()));
      }
    }
  }
  if (!options.frozen_half_kept.empty() &&
      options.frozen_half_kept.size() != store.sub_group_count()) {
    return Status::invalid_argument(
        fmt::format("OptimizerPipeline: {} frozen_half_kept flags for a store of {} sub-groups",
                    options.frozen_half_kept.size(), store.sub_group_count()));
  }
  if (!options.frozen_sub_groups.empty() &&
      options.frozen_sub_groups.size() != store.sub_group_count()) {
    return Status::invalid_argument(
        fmt::format("OptimizerPipeline: {} frozen_sub_groups flags for a store of {} sub-groups",
                    options.frozen_sub_groups.size(), store.sub_group_count()));
  }
  std::unique_ptr<OptimizerPipeline> p(new OptimizerPipeline(store, pool, options));
  if (!options.groups.empty()) {
    // Each sub-group's ranges, relative to its first element, made once here.
    const std::vector<OptimizerRange>& ranges = options.ranges;
    std::size_t r = 0;
    for (std::size_t i = 0; i < store.sub_group_count(); ++i) {
      p->sub_range_first_.push_back(p->sub_ranges_.size());
      const std::size_t first = store.sub_group_first(i);
      const std::size_t end = first + store.sub_group_size(i);
      while (r + 1 < ranges.size() && ranges[r + 1].begin <= first) ++r;
      for (std::size_t k = r; k < ranges.size() && ranges[k].begin < end; ++k) {
        p->sub_ranges_.push_back({std::max(ranges[k].begin, first) - first, ranges[k].group});
      }
    }
    p->sub_range_first_.push_back(p->sub_ranges_.size());
  }
  for (std::size_t k = 0; k < kPieceCount; ++k) {
    const auto piece = static_cast<Piece>(k);
    if (!store.on_nvme(piece)) continue;
    if (piece != Piece::kParamsHalf) p->read_pieces_.push_back(piece);
    if (piece != Piece::kGrads) p->write_pieces_.push_back(piece);
  }
  p->any_nvme_ = !p->read_pieces_.empty() || !p->write_pieces_.empty();
  if (store.streams_half() && !options.half_done) {
    return Status::invalid_argument(
        "OptimizerPipeline: the store's params_half is on the block tier but "
        "PipelineOptions::half_done is not set");
  }
  if (store.block_bytes() > 0 && !p->any_nvme_) {
    // Only the half output's slot: one block, for the host-only step.
    if (pool == nullptr || pool->block_bytes() < store.block_bytes()) {
      return Status::invalid_argument(fmt::format(
          "OptimizerPipeline: the half output on the block tier needs a PinnedPool with blocks of "
          "at least {} bytes",
          store.block_bytes()));
    }
    p->block_limit_ = 1;
    p->entries_.resize(1);
  } else if (store.block_bytes() > 0) {
    if (pool == nullptr) {
      return Status::invalid_argument("OptimizerPipeline: state on nvme needs a PinnedPool");
    }
    if (pool->block_bytes() < store.block_bytes()) {
      return Status::invalid_argument(fmt::format(
          "OptimizerPipeline: pool blocks of {} bytes cannot hold a sub-group's nvme pieces ({} "
          "bytes); raise the pool's block_bytes or lower sub_group_bytes",
          pool->block_bytes(), store.block_bytes()));
    }
    p->block_limit_ = options.max_blocks == 0 ? pool->block_count()
                                              : std::min(options.max_blocks, pool->block_count());
    if (p->block_limit_ < 2) {
      return Status::invalid_argument(
          "OptimizerPipeline: the step needs at least 2 pool blocks (one updated while another "
          "reads or writes)");
    }
    const std::size_t ops_needed = p->block_limit_ * (kPieceCount - 1);
    if (store.swap()->options().max_ops < ops_needed) {
      return Status::invalid_argument(
          fmt::format("OptimizerPipeline: {} blocks may have {} swap ops in flight, above the swap "
                      "space's max_ops {}",
                      p->block_limit_, ops_needed, store.swap()->options().max_ops));
    }
    // Each op holds its engine requests until it is waited for: with the swap space striped over
    // several directories, a few per directory (SwapSpace::op_requests).
    std::uint32_t op_requests = 0;
    for (std::size_t k = 0; k < kPieceCount; ++k) {
      const auto piece = static_cast<Piece>(k);
      if (!store.on_nvme(piece)) continue;
      for (std::size_t i = 0; i < store.sub_group_count(); ++i) {
        op_requests = std::max(op_requests, store.swap()->op_requests(store.piece_bytes(piece, i)));
      }
    }
    const std::uint64_t requests_needed = std::uint64_t{ops_needed} * op_requests;
    const std::uint32_t max_requests = store.swap()->engine().options().max_requests;
    if (requests_needed > max_requests) {
      // The training engine leaves max_requests at its default (no config key sets it), so the
      // message names the keys that lower the requests per op: a deeper aio.queue_depth makes
      // each request move a longer chunk of a directory's share, a larger aio.block_size or a
      // smaller sub_group_size leaves fewer blocks per op, and fewer buffers fewer ops.
      return Status::invalid_argument(fmt::format(
          "OptimizerPipeline: {} blocks may have {} swap ops in flight of up to {} I/O requests "
          "each ({} swap directories, aio.queue_depth {}), above the I/O engine's max_requests "
          "{} (zinf's training engine fixes IoOptions::max_requests at {}; no config key sets it); "
          "raise aio.queue_depth (longer requests) or aio.block_size, or lower "
          "zero_optimization.sub_group_size or zero_optimization.offload_optimizer.buffer_count",
          p->block_limit_, ops_needed, op_requests, store.swap()->options().dirs.size(),
          store.swap()->engine().options().queue_depth, max_requests, IoOptions{}.max_requests));
    }
    p->entries_.resize(p->block_limit_);
    p->quarantine_.reserve(p->block_limit_);
  }
  p->arena_ =
      std::make_unique<tbb::task_arena>(options.threads > 0 ? options.threads : cpu_count());
  if (p->any_nvme_) {
    p->updater_ = std::thread([raw = p.get()] { raw->updater_main(); });
  }
  if (options.trace != nullptr) {
    p->read_track_ = options.trace->track("read");
    p->update_track_ = options.trace->track("update");
    p->write_track_ = options.trace->track("write");
  }
  return p;
}

Status OptimizerPipeline::set_optimizer_params(const OptimizerParams& params) {
  if (params.kind != store_.options().optimizer) {
    return Status::invalid_argument(
        fmt::format("OptimizerPipeline: optimizer {} but the store holds the state of {}",
                    optimizer_name(params.kind), optimizer_name(store_.options().optimizer)));
  }
  options_.optimizer = params;
  return Status::ok();
}

Status OptimizerPipeline::set_group_params(std::span<const OptimizerParams> groups) {
  if (groups.size() != options_.groups.size()) {
    return Status::invalid_argument(
        fmt::format("OptimizerPipeline: {} parameter groups given, {} at open()", groups.size(),
                    options_.groups.size()));
  }
  for (const OptimizerParams& g : groups) {
    if (g.kind != store_.options().optimizer) {
      return Status::invalid_argument(fmt::format(
          "OptimizerPipeline: a parameter group of {} but the store holds the state of {}",
          optimizer_name(g.kind), optimizer_name(store_.options().optimizer)));
    }
  }
  std::copy(groups.begin(), groups.end(), options_.groups.begin());
  return Status::ok();
}

OptimizerPipeline::Entry& OptimizerPipeline::entry(std::size_t p) {
  Entry& e = entries_[p % entries_.size()];
  ZINF_DASSERT(e.position == p || e.phase == Entry::Phase::kIdle);
  return e;
}

Status OptimizerPipeline::called_off(std::size_t p, const StepArgs& args) {
  called_off_at_ = p;
  return Status::aborted(
      fmt::format("optimizer step {}: called off before sub-group {}'s gradients were final "
                  "({} of {} sub-groups updated)",
                  args.step, sub_group_at(p), p, store_.sub_group_count()));
}

std::size_t OptimizerPipeline::first_not_holding(std::int64_t step) const {
  std::size_t i = 0;
  while (i < store_.sub_group_count() && !store_.torn(i) && store_.stored_step(i) == step) ++i;
  return i;
}

void OptimizerPipeline::trace_span(int track, const char* what, std::size_t i,
                                   std::int64_t start_ns, std::int64_t end_ns) {
  if (options_.trace == nullptr) return;
  // Benchmark modes are marked so they are not mistaken for the step's spans.
  const char* mode = mode_ == StepMode::kIoOnly       ? " (io alone)"
                     : mode_ == StepMode::kUpdateOnly ? " (update alone)"
                                                      : "";
  options_.trace->add(track, fmt::format("{} sg{}{}", what, i, mode), start_ns, end_ns,
                      fmt::format("{{\"sub_group\":{},\"step\":{}}}", i, stats_.step));
}

Result<StepStats> OptimizerPipeline::step(const StepArgs& args) {
  if (!error_.is_ok()) return error_;
  if (args.step < 1) {
    return Status::invalid_argument(fmt::format("OptimizerPipeline: step {} < 1", args.step));
  }
  if (args.mode == StepMode::kFull) {
    const std::size_t i = first_not_holding(args.step - 1);
    if (i < store_.sub_group_count()) {
      return Status::failed_precondition(fmt::format(
          "optimizer step {}: sub-group {} holds {} step {}, not step {}", args.step, i,
          store_.torn(i) ? "a torn" : "the state of", store_.stored_step(i), args.step - 1));
    }
  }
  if (args.ready != nullptr && args.mode != StepMode::kFull) {
    return Status::invalid_argument("OptimizerPipeline: a gate needs a full step");
  }
  if (args.ascend != nullptr && !args.descending) {
    return Status::invalid_argument("OptimizerPipeline: only a descending step can turn");
  }
  stats_ = StepStats{};
  stats_.step = args.step;
  mode_ = args.mode;
  descending_ = args.descending;
  turn_ = static_cast<std::size_t>(-1);
  called_off_at_ = static_cast<std::size_t>(-1);
  stats_.sub_groups = store_.sub_group_count();
  const std::int64_t start = Trace::now_ns();
  Status status;
  if (args.mode == StepMode::kUpdateOnly) {
    status = run_update_only(args);
  } else if (!any_nvme_) {
    status = args.mode == StepMode::kIoOnly ? Status::ok() : run_host_only(args);
  } else {
    status = run_pipelined(args);
  }
  stats_.wall_ns = Trace::now_ns() - start;
  if (!status.is_ok()) {
    // Called off before any update: every sub-group holds the previous step (drain() recorded
    // none new or torn), so the next step() may run.
    const bool untouched =
        called_off_at_ == 0 && first_not_holding(args.step - 1) == store_.sub_group_count();
    if (!untouched) error_ = status;
    return status;
  }
  return stats_;
}

Status OptimizerPipeline::update(std::size_t i, std::byte* block, const StepArgs& args, bool pass,
                                 std::int64_t* ns, bool* settles) {
  auto where = [&](Piece piece) -> std::byte* {
    if (!store_.has(piece)) return nullptr;
    if (store_.tier(piece) == StoreMedium::kHost) return store_.host_data(piece, i);
    return block + store_.slot_offset(piece);
  };
  *ns = 0;
  *settles = false;
  if (pass) {
    // Passed over: the master is as the last step left it, and its half copy is what the update
    // would give (optimizer_step rounds the new master exactly so), narrowed as the update runs:
    // on the arena's threads, with the same SIMD path. Not made where the caller keeps it.
    if (!store_.streams_half() || half_kept(i)) return Status::ok();
    const auto* master = reinterpret_cast<const float*>(where(Piece::kParams));
    auto* half = reinterpret_cast<std::uint16_t*>(where(Piece::kParamsHalf));
    StepOptions narrow_options;
    narrow_options.simd = options_.simd;
    narrow_options.threads = 0;  // in arena_
    narrow_options.tile_elements = options_.tile_elements;
    Status status;
    arena_->execute([&] {
      status = narrow_to_half(master, half, store_.options().half_dtype, store_.sub_group_size(i),
                              narrow_options);
    });
    if (!status.is_ok()) {
      return status.with_context(
          fmt::format("optimizer step {}: sub-group {}: half copy", args.step, i));
    }
    return Status::ok();
  }
  OptimizerSpan span;
  span.params = reinterpret_cast<float*>(where(Piece::kParams));
  span.exp_avg = reinterpret_cast<float*>(where(Piece::kExpAvg));
  span.exp_avg_sq = reinterpret_cast<float*>(where(Piece::kExpAvgSq));
  span.grads = where(Piece::kGrads);
  span.grad_dtype = store_.dtype(Piece::kGrads);
  span.params_half = where(Piece::kParamsHalf);
  span.half_dtype = store_.options().half_dtype;
  span.count = store_.sub_group_size(i);
  StepOptions step_options;
  step_options.step = args.step;
  step_options.grad_scale =
      args.late_grad_scale != nullptr ? *args.late_grad_scale : args.grad_scale;
  step_options.check_overflow = false;
  step_options.simd = options_.simd;
  step_options.threads = 0;  // in arena_
  step_options.tile_elements = options_.tile_elements;
  const std::int64_t start = Trace::now_ns();
  Status status;
  arena_->execute([&] {
    Result<StepResult> r =
        options_.groups.empty()
            ? optimizer_step(options_.optimizer, span, step_options)
            : optimizer_step(
                  options_.groups,
                  std::span<const OptimizerRange>(sub_ranges_)
                      .subspan(sub_range_first_[i], sub_range_first_[i + 1] - sub_range_first_[i]),
                  span, step_options);
    if (!r.is_ok()) status = r.status();
  });
  const std::int64_t end = Trace::now_ns();
  *ns = end - start;
  trace_span(update_track_, "update", i, start, end);
  if (!status.is_ok()) {
    return status.with_context(
        fmt::format("optimizer step {}: sub-group {}: update", args.step, i));
  }
  if (frozen(i) && args.mode == StepMode::kFull) {
    *settles = true;
    for (Piece piece : {Piece::kExpAvg, Piece::kExpAvgSq}) {
      if (!store_.has(piece)) continue;
      *settles = *settles && all_zero_bytes(where(piece), store_.piece_bytes(piece, i));
    }
  }
  return Status::ok();
}

Status OptimizerPipeline::run_host_only(const StepArgs& args) {
  // A block only for the half output's slot, when it streams.
  std::byte* block = nullptr;
  if (store_.block_bytes() > 0) {
    const std::int64_t wait_start = Trace::now_ns();
    Result<PinnedPool::Lease> lease = pool_->acquire(options_.io_timeout);
    stats_.io_wait_ns += Trace::now_ns() - wait_start;
    if (!lease.is_ok()) {
      return lease.status().with_context(
          fmt::format("optimizer step {}: waiting for a block", args.step));
    }
    entries_[0].lease = std::move(*lease);
    block = entries_[0].lease.data();
    stats_.blocks_peak = 1;
  }
  Status status;
  for (std::size_t p = 0; status.is_ok() && p < store_.sub_group_count(); ++p) {
    // Host pieces: nothing to read ahead, so the gate is waited at here.
    maybe_turn(p, args);
    int ready = gate(p, args);
    while (ready == 0) {
      std::this_thread::sleep_for(kPollInterval);
      ready = gate(p, args);
    }
    if (ready < 0) {
      status = called_off(p, args);
      break;
    }
    const std::size_t i = sub_group_at(p);
    const bool pass = passes(i);
    std::int64_t ns = 0;
    bool settles = false;
    status = update(i, block, args, pass, &ns, &settles);
    stats_.update_ns += ns;
    if (!status.is_ok()) break;
    store_.set_stored(i, args.step);
    if (pass) {
      ++stats_.sub_groups_passed;
    } else if (frozen(i)) {
      store_.set_settled(i, settles);
    }
    status = hand_half(i, block, pass, args);
  }
  if (block != nullptr) entries_[0].lease.release();
  return status;
}

Status OptimizerPipeline::hand_half(std::size_t i, const std::byte* block, bool pass,
                                    const StepArgs& args) {
  if (!store_.streams_half()) return Status::ok();
  const std::byte* half =
      pass && half_kept(i) ? nullptr : block + store_.slot_offset(Piece::kParamsHalf);
  Status status = options_.half_done(i, half);
  if (!status.is_ok()) {
    return status.with_context(
        fmt::format("optimizer step {}: sub-group {}: handing over the half output", args.step, i));
  }
  return Status::ok();
}

Status OptimizerPipeline::run_update_only(const StepArgs& args) {
  // Benchmark mode: the same updates on the blocks as they are, sub-group i in block i mod B.
  if (store_.block_bytes() == 0) {
    for (std::size_t i = 0; i < store_.sub_group_count(); ++i) {
      std::int64_t ns = 0;
      bool settles = false;
      Status status = update(i, nullptr, args, /*pass=*/false, &ns, &settles);
      stats_.update_ns += ns;
      ZINF_RETURN_IF_ERROR(status);
    }
    return Status::ok();
  }
  for (Entry& e : entries_) {
    std::optional<PinnedPool::Lease> lease = pool_->try_acquire();
    if (!lease) break;
    e.lease = std::move(*lease);
  }
  std::size_t leased = 0;
  while (leased < entries_.size() && entries_[leased].lease.valid()) ++leased;
  stats_.blocks_peak = leased;
  Status status = leased == 0 ? Status::resource_exhausted("OptimizerPipeline: no free pool block")
                              : Status::ok();
  // On the update thread, as in the step, so the two are timed the same way.
  for (std::size_t i = 0; status.is_ok() && i < store_.sub_group_count(); ++i) {
    start_update(i, entries_[i % leased].lease.data(), args, /*pass=*/false);
    status = finish_update();
  }
  for (Entry& e : entries_) e.lease.release();
  return status;
}

Status OptimizerPipeline::start_read(std::size_t p, PinnedPool::Lease lease, const StepArgs& args) {
  Entry& e = entry(p);
  ZINF_ASSERT(e.phase == Entry::Phase::kIdle && !e.lease.valid());
  maybe_turn(p, args);
  const std::size_t i = sub_group_at(p);
  e.phase = Entry::Phase::kReading;
  e.position = p;
  e.sub_group = i;
  e.lease = std::move(lease);
  e.pending.fill(false);
  e.write_failed = false;
  e.wrote_any = false;
  e.pass = passes(i);
  e.settles = false;
  e.quarantined = false;
  e.start_ns = Trace::now_ns();
  e.done_ns = 0;
  ++held_;
  stats_.blocks_peak = std::max(stats_.blocks_peak, held_);
  if (e.pass) ++stats_.sub_groups_passed;
  for (Piece piece : read_pieces_) {
    // Passed over, only the master is read, and only to hand its half copy over (not where the
    // caller keeps it).
    if (e.pass && !(piece == Piece::kParams && store_.streams_half() && !half_kept(i))) continue;
    const auto k = static_cast<std::size_t>(piece);
    if (store_.residency(piece, i) == Residency::kZero) {
      // Zeros not stored (StateStore::release_piece): nothing to read.
      std::memset(e.lease.data() + store_.slot_offset(piece), 0,
                  round_up(store_.piece_bytes(piece, i), kPage));
      continue;
    }
    store_.begin_read(piece, i);
    Result<SwapTicket> ticket =
        store_.swap()->read(store_.extent(piece, i), e.lease.data() + store_.slot_offset(piece));
    if (!ticket.is_ok()) {
      store_.end_read(piece, i, false);
      return ticket.status().with_context(
          fmt::format("optimizer step {}: sub-group {}: starting the read of {}", args.step, i,
                      piece_name(piece)));
    }
    e.tickets[k] = *ticket;
    e.pending[k] = true;
  }
  return Status::ok();
}

bool OptimizerPipeline::reads_done(std::size_t p) { return pieces_done(p, read_pieces_); }

bool OptimizerPipeline::pieces_done(std::size_t p, const std::vector<Piece>& pieces) {
  Entry& e = entry(p);
  if (e.done_ns != 0) return true;
  for (Piece piece : pieces) {
    const auto k = static_cast<std::size_t>(piece);
    if (e.pending[k] && !store_.swap()->poll(e.tickets[k])) return false;
  }
  e.done_ns = Trace::now_ns();
  return true;
}

Status OptimizerPipeline::wait_landed(std::size_t p, Piece piece, const char* what,
                                      const StepArgs& args, Status* first) {
  Entry& e = entry(p);
  const std::size_t i = e.sub_group;
  const SwapTicket ticket = e.tickets[static_cast<std::size_t>(piece)];
  SwapSpace& swap = *store_.swap();
  Status status = swap.wait(ticket, options_.io_timeout);
  std::uint32_t timeouts = 0;
  bool named_here = false;  // *first is this transfer's timeout
  while (status.code() == Code::kTimeout) {
    // The transfer may still land in the block: keep waiting before anything reuses it, up to
    // io_timeouts_max waits.
    status = status.with_context(fmt::format("optimizer step {}: sub-group {}: {} {}", args.step, i,
                                             what, piece_name(piece)));
    if (first->is_ok()) {
      *first = status;
      named_here = true;
    }
    log_warn("tier: {}", status.to_string());
    if (options_.io_timeouts_max == 0 || ++timeouts < options_.io_timeouts_max) {
      status = swap.wait(ticket, options_.io_timeout);
      continue;
    }
    // Give up: ask the engine to cancel it, and wait once more for the cancellation to land.
    swap.cancel(ticket);
    status = swap.wait(ticket, options_.io_timeout);
    const bool landed = status.code() != Code::kTimeout;
    if (!landed) {
      // Not even a cancel ends it: the device may still write into the block at any time, so
      // the block never goes back to the pool (see Entry::quarantined); a write's blocks are
      // lost on disk.
      swap.abandon(ticket);
      e.quarantined = true;
      status = Status::timeout(
          fmt::format("optimizer step {}: sub-group {}: {} {}: abandoned after a cancel", args.step,
                      i, what, piece_name(piece)));
    }
    if (named_here) {
      *first = Status::timeout(fmt::format(
          "{}; gave up after {} waits of {} ms: {}", first->message(), timeouts,
          options_.io_timeout.count(),
          landed ? "cancelled" : "a cancel did not end it either; its block is quarantined"));
    }
    return status;
  }
  return status;
}

void OptimizerPipeline::return_block(Entry& e) {
  if (e.quarantined) {
    ZINF_ASSERT(quarantine_.size() < quarantine_.capacity());  // reserved at open: no allocation
    quarantine_.push_back(std::move(e.lease));
    e.quarantined = false;
  } else {
    e.lease.release();
  }
}

Status OptimizerPipeline::finish_read(std::size_t p, const StepArgs& args) {
  Entry& e = entry(p);
  ZINF_ASSERT(e.phase == Entry::Phase::kReading);
  const std::size_t i = e.sub_group;
  Status first;
  for (Piece piece : read_pieces_) {
    const auto k = static_cast<std::size_t>(piece);
    if (!e.pending[k]) continue;
    const Status status = wait_landed(p, piece, "reading", args, &first);
    e.pending[k] = false;
    store_.end_read(piece, i, status.is_ok());
    if (status.is_ok()) {
      stats_.read_bytes += store_.piece_bytes(piece, i);
    } else if (first.is_ok()) {
      first = status.with_context(fmt::format("optimizer step {}: sub-group {}: reading {}",
                                              args.step, i, piece_name(piece)));
    }
  }
  if (e.done_ns == 0) e.done_ns = Trace::now_ns();
  trace_span(read_track_, "read", i, e.start_ns, e.done_ns);
  e.phase = Entry::Phase::kInBlock;
  return first;
}

Status OptimizerPipeline::start_write(std::size_t p, const StepArgs& args) {
  Entry& e = entry(p);
  ZINF_ASSERT(e.phase == Entry::Phase::kInBlock);
  const std::size_t i = e.sub_group;
  e.phase = Entry::Phase::kWriting;
  e.start_ns = Trace::now_ns();
  e.done_ns = 0;
  if (e.pass) {
    // Nothing changed: what was read (the master, for its half copy) stands on disk, and the
    // entry is released in its turn with no write pending.
    for (Piece piece : read_pieces_) {
      if (store_.residency(piece, i) == Residency::kInBlock) store_.drop_block(piece, i);
    }
    return Status::ok();
  }
  for (Piece piece : read_pieces_) {
    if (piece == Piece::kGrads) store_.drop_block(piece, i);  // read-only: the disk copy stands
  }
  for (Piece piece : write_pieces_) {
    const auto k = static_cast<std::size_t>(piece);
    const bool moment = piece == Piece::kExpAvg || piece == Piece::kExpAvgSq;
    if (store_.residency(piece, i) == Residency::kZero &&
        ((e.settles && moment) || all_zero_bytes(e.lease.data() + store_.slot_offset(piece),
                                                 store_.piece_bytes(piece, i)))) {
      // Released zeros that are still zeros stay released, whether or not the sub-group
      // settles: a frozen sub-group's exp_avg released while its exp_avg_sq still decays, or any
      // released piece in io-only mode (which writes back what it read). Writing them would fill
      // the hole with zeros, taking new disk blocks, which a full disk refuses mid-step.
      continue;
    }
    if (e.settles && moment) {
      // A frozen sub-group's moments left zero: not written, their room given back
      // (StateStore::release_piece); where the filesystem cannot, they are written as before.
      if (store_.release_piece(piece, i).is_ok()) continue;
    }
    store_.begin_write(piece, i);
    e.wrote_any = true;
    Result<SwapTicket> ticket =
        store_.swap()->write(store_.extent(piece, i), e.lease.data() + store_.slot_offset(piece));
    if (!ticket.is_ok()) {
      // The swap space marks the blocks of a write it could not submit as lost.
      store_.end_write(piece, i, false);
      e.write_failed = true;
      // Pieces not yet submitted keep their old value on disk.
      for (Piece rest : write_pieces_) {
        if (store_.residency(rest, i) == Residency::kInBlock) store_.drop_block(rest, i);
      }
      return ticket.status().with_context(
          fmt::format("optimizer step {}: sub-group {}: starting the write of {}", args.step, i,
                      piece_name(piece)));
    }
    e.tickets[k] = *ticket;
    e.pending[k] = true;
  }
  return Status::ok();
}

bool OptimizerPipeline::writes_done(std::size_t p) { return pieces_done(p, write_pieces_); }

Status OptimizerPipeline::finish_write(std::size_t p, const StepArgs& args) {
  Entry& e = entry(p);
  ZINF_ASSERT(e.phase == Entry::Phase::kWriting);
  const std::size_t i = e.sub_group;
  Status first;
  for (Piece piece : write_pieces_) {
    const auto k = static_cast<std::size_t>(piece);
    if (!e.pending[k]) continue;
    const Status status = wait_landed(p, piece, "writing", args, &first);
    e.pending[k] = false;
    store_.end_write(piece, i, status.is_ok());
    if (status.is_ok()) {
      stats_.write_bytes += store_.piece_bytes(piece, i);
    } else {
      e.write_failed = true;
      if (first.is_ok()) {
        first = status.with_context(fmt::format("optimizer step {}: sub-group {}: writing {}",
                                                args.step, i, piece_name(piece)));
      }
    }
  }
  if (e.done_ns == 0) e.done_ns = Trace::now_ns();
  trace_span(write_track_, "write", i, e.start_ns, e.done_ns);
  // What the sub-group now holds. In io-only mode the values written are the ones read, so a
  // successful write leaves the version as it was.
  if (e.write_failed) {
    store_.set_torn(i);
  } else if (args.mode == StepMode::kFull) {
    store_.set_stored(i, args.step);
    if (!e.pass && frozen(i)) store_.set_settled(i, e.settles);
  }
  e.phase = Entry::Phase::kIdle;
  return_block(e);
  --held_;
  return first;
}

Status OptimizerPipeline::pump(const StepArgs& args) {
  // Writes land roughly in submission order; return blocks from the oldest on.
  for (std::size_t p = released_; p < updated_; ++p) {
    if (!writes_done(p)) continue;
    if (p == released_) {
      ZINF_RETURN_IF_ERROR(finish_write(p, args));
      ++released_;
    }
  }
  for (std::size_t p = verified_; p < read_; ++p) (void)reads_done(p);
  while (read_ < store_.sub_group_count() && read_ - released_ < block_limit_) {
    std::optional<PinnedPool::Lease> lease = pool_->try_acquire();
    if (!lease) break;
    const std::size_t p = read_++;
    ZINF_RETURN_IF_ERROR(start_read(p, std::move(*lease), args));
  }
  return Status::ok();
}

Status OptimizerPipeline::run_pipelined(const StepArgs& args) {
  released_ = updated_ = verified_ = read_ = 0;
  held_ = 0;
  const std::size_t n = store_.sub_group_count();
  const bool full = args.mode == StepMode::kFull;
  bool updating = false;
  Status status;
  bool stalled = false;  // the driver waited io_timeout for reads
  auto last_progress = std::chrono::steady_clock::now();
  // Sub-group i's update is over (or there was none): write back what it changed.
  // With `hand_over`, its half output goes to half_done once its writes are submitted (the slot
  // is not among them), while the block is still held.
  auto written_back = [&](std::size_t p, bool hand_over) {
    ++updated_;  // from here on p is among the writing sub-groups, even if a write fails
    Status s = start_write(p, args);
    if (s.is_ok() && hand_over) {
      s = hand_half(sub_group_at(p), entry(p).lease.data(), entry(p).pass, args);
    }
    if (s.is_ok() && write_pieces_.empty()) {
      // Nothing to write back (only gradients on nvme): the sub-group is done.
      s = finish_write(p, args);
      ++released_;
    }
    return s;
  };
  bool gated = false;  // the next update waits at the gate (not for I/O)
  while (status.is_ok() && updated_ < n) {
    status = pump(args);
    if (!status.is_ok()) break;
    bool progressed = false;
    if (updating && update_done()) {
      updating = false;
      progressed = true;
      status = take_update_result();
      if (!status.is_ok()) break;
      entry(updated_).settles = taken_settles_;
      status = written_back(updated_, /*hand_over=*/true);
      if (!status.is_ok()) break;
    }
    // Check finished reads in order (checksums) while the update runs.
    while (verified_ < read_ && reads_done(verified_)) {
      status = finish_read(verified_, args);
      ++verified_;
      progressed = true;
      if (!status.is_ok()) break;
    }
    if (!status.is_ok()) break;
    gated = false;
    if (!updating && updated_ < verified_) {
      const int ready = full ? gate(updated_, args) : 1;
      if (ready < 0) {
        status = called_off(updated_, args);
        break;
      }
      gated = ready == 0;
    }
    if (!updating && updated_ < verified_ && !gated) {
      progressed = true;
      if (full) {
        start_update(sub_group_at(updated_), entry(updated_).lease.data(), args,
                     entry(updated_).pass);
        updating = true;
      } else {
        status = written_back(updated_, /*hand_over=*/false);
        if (!status.is_ok()) break;
      }
    }
    if (progressed) {
      last_progress = std::chrono::steady_clock::now();
      continue;
    }
    const std::int64_t wait_start = Trace::now_ns();
    if (gated) {
      // The next sub-group's gradients are not final yet: the reads ahead go on (pump()), and
      // this is not an I/O stall.
      std::this_thread::sleep_for(kPollInterval);
      last_progress = std::chrono::steady_clock::now();
      continue;
    }
    if (!updating && read_ == updated_) {
      // No block to read the next sub-group into: every block the step may hold is waiting for
      // a write, so wait for the oldest; or blocks are held by another user of the pool.
      if (released_ < updated_) {
        status = finish_write(released_, args);
        ++released_;
      } else {
        Result<PinnedPool::Lease> lease = pool_->acquire(options_.io_timeout);
        if (!lease.is_ok()) {
          status = lease.status().with_context(
              fmt::format("optimizer step {}: sub-group {}: waiting for a block", args.step,
                          sub_group_at(updated_)));
        } else {
          const std::size_t p = read_++;
          status = start_read(p, std::move(*lease), args);
        }
      }
      stats_.io_wait_ns += Trace::now_ns() - wait_start;
      last_progress = std::chrono::steady_clock::now();
      continue;
    }
    if (updating) {
      (void)wait_update(kPollInterval);
      last_progress = std::chrono::steady_clock::now();
      continue;
    }
    // Nothing to update until the next sub-group's reads land.
    if (std::chrono::steady_clock::now() - last_progress > options_.io_timeout) {
      status = stalled_read(verified_, args);
      stalled = true;
      break;
    }
    std::this_thread::sleep_for(kPollInterval);
    stats_.io_wait_ns += Trace::now_ns() - wait_start;
  }
  if (updating) {
    // Failed elsewhere while an update ran: let it end (it is using a block), then write it back
    // so that it is new rather than half-there (its host pieces may already be updated).
    Status s = finish_update();
    if (s.is_ok()) {
      entry(updated_).settles = taken_settles_;
      s = written_back(updated_, /*hand_over=*/false);
    }
    if (status.is_ok()) status = s;
  }
  if (status.is_ok()) {
    // The last writes.
    const std::int64_t wait_start = Trace::now_ns();
    while (status.is_ok() && released_ < updated_) {
      status = finish_write(released_, args);
      ++released_;
    }
    stats_.io_wait_ns += Trace::now_ns() - wait_start;
  }
  if (!status.is_ok()) {
    const Status drained = drain(args);
    // The drain waited the stalled read out (or gave up on it): its timeout names the extent,
    // file and offset, and how the transfer ended.
    if (stalled && drained.code() == Code::kTimeout) status = drained;
  }
  ZINF_ASSERT(held_ == 0);
  return status;
}

Status OptimizerPipeline::stalled_read(std::size_t p, const StepArgs& args) {
  // Name the first piece still in flight (and its extent), as a timeout of wait() would.
  Entry& e = entry(p);
  const std::size_t i = e.sub_group;
  std::string which = "reads";
  for (Piece piece : read_pieces_) {
    const auto k = static_cast<std::size_t>(piece);
    if (e.pending[k] && !store_.swap()->poll(e.tickets[k])) {
      which = fmt::format("reading {} (swap extent {})", piece_name(piece),
                          store_.swap()->info(store_.extent(piece, i)).key);
      break;
    }
  }
  return Status::timeout(fmt::format("optimizer step {}: sub-group {}: {} not done within {} ms",
                                     args.step, i, which, options_.io_timeout.count()));
}

Status OptimizerPipeline::drain(const StepArgs& args) {
  Status first;
  auto note = [&](Status s) {
    if (first.is_ok()) first = std::move(s);
  };
  // Every I/O still in flight is waited for before its block goes back; writes decide versions,
  // reads are discarded.
  for (std::size_t p = released_; p < read_; ++p) {
    Entry& e = entry(p);
    switch (e.phase) {
      case Entry::Phase::kWriting:
        note(finish_write(p, args));
        break;
      case Entry::Phase::kReading:
        note(finish_read(p, args));
        [[fallthrough]];
      case Entry::Phase::kInBlock:
        // Read but not updated (or its update failed, which writes nothing): the disk and the
        // host pieces still hold the old step.
        for (Piece piece : read_pieces_) {
          if (store_.residency(piece, e.sub_group) == Residency::kInBlock) {
            store_.drop_block(piece, e.sub_group);
          }
        }
        e.phase = Entry::Phase::kIdle;
        return_block(e);
        --held_;
        break;
      case Entry::Phase::kIdle:
        break;
    }
  }
  released_ = updated_ = verified_ = read_;
  return first;
}

}  // namespace zinf
