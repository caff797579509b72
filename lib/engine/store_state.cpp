// StoreState: the optimizer state in a StateStore (offload_optimizer "cpu": host arrays;
// "nvme": extents of the swap space, read and written one sub-group at a time), stepped by the
// OptimizerPipeline over sub-groups with a bounded pinned pool. The gradients accumulate in the
// store's host array, or spill to NVMe (zinf.gradients_on_nvme, a SpillAccumulator).
//
// Where a step's new parameters come from is fixed at open, by the parameters' dtypes and where
// their shards live:
//   - streamed: the state on NVMe, every group of one half dtype, and the shards not in host
//     memory (on NVMe, or on the device): the pass hands each sub-group's half output from its
//     pool block to the publisher's one-group stage (Publisher::stage), so host memory stays
//     bounded by the pools;
//   - from the store: every group of one half dtype otherwise: the store keeps a host half
//     array, which has the publisher's layout (byte_offset(g) == 2 * offset(g)); the pass fills
//     it and the shards are written from it;
//   - narrowed: f32 groups or mixed half dtypes: the new values are narrowed from the master
//     (read back from NVMe, one sub-group at a time, when it lives there) into the publisher's
//     buffer.
//
// A frozen sub-group's master kept as its half copy alone: from the store (the state on the host
// tier), a frozen sub-group (settled: no step reads or writes it) whose master the half dtype
// holds exactly (every element's widen(narrow(x)) is x, bit for bit: a LoRA base weight loaded
// from bf16) keeps no fp32 master. load() leaves its part of the master array untouched zero
// pages (advised off transparent huge pages), so it takes 2 bytes an element of host memory
// instead of 6. Every read of the master (read_master, read_state, read_state_range,
// publish_master) widens its half copy, a bounded chunk at a time, and hands that over instead;
// a write of the master (a checkpoint load, write_parameters) fills each chunk of it in a
// scratch block, from its widened current values, and keeps it half-only while the new values
// are exact, narrowing them into the half copy; the first value that is not exact, or moments
// loaded into it that are not zero (the next step would update it), make its master
// (materialise()): the widened half copy, written into the master array, from then on kept as
// any other sub-group's.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "base/aligned.hpp"
#include "base/arith.hpp"
#include "base/assert.hpp"
#include "device/pinned_pool.hpp"
#include "engine/narrow.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/param_groups.hpp"
#include "zinf/dtype.hpp"
#include "zinf/optim.hpp"

namespace zinf {
namespace {

enum class Publish : std::uint8_t { kStreamed, kFromStore, kNarrowed };

// The sub-group that holds partition element `element` (the last one starting at or before it),
// found by bisection from sub-group `from` on (the firsts increase). REQUIRES: sub-group `from`
// starts at or before `element`.
std::size_t sub_group_holding(const StateStore& s, std::size_t element, std::size_t from = 0) {
  ZINF_ASSERT(from < s.sub_group_count() && s.sub_group_first(from) <= element);
  std::size_t lo = from, hi = s.sub_group_count();
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    (s.sub_group_first(mid) <= element ? lo : hi) = mid;
  }
  return lo;
}

// Calls advise(first, count) for each run of consecutive sub-groups whose flag is set, ascending;
// for none when there are more than AlignedBuffer::kMaxAdvisedStretches runs, since each advised
// run splits a mapping (the bound keeps far below the kernel's map count limit).
template <typename Advise>
void advise_runs(const std::vector<bool>& flags, Advise advise) {
  std::vector<std::pair<std::size_t, std::size_t>> runs;  // (first sub-group, count)
  for (std::size_t i = 0; i < flags.size();) {
    if (!flags[i]) {
      ++i;
      continue;
    }
    std::size_t end = i;
    while (end < flags.size() && flags[end]) ++end;
    runs.emplace_back(i, end - i);
    i = end;
  }
  if (runs.size() > AlignedBuffer::kMaxAdvisedStretches) return;
  for (const auto& [first, count] : runs) advise(first, count);
}

class StoreState final : public OptimizerState {
 public:
  StoreState(const StateContext& ctx, Publish publish)
      : ctx_(ctx), layout_(*ctx.layout), pub_(*ctx.publisher), publish_(publish) {}

  ~StoreState() override {
    // The pipeline and the spill use the store and the pool: they go first.
    spill_.reset();
    pipeline_.reset();
    pool_.reset();
    unregister_shared_half();
    store_.reset();
  }

  Status open() {
    const Config& config = *ctx_.config;
    const ZeroConfig& z = config.zero;
    const StateStoreOptions so = store_options(config, layout_, ctx_.rank);
    ZINF_ASSIGN_OR_RETURN(store_, StateStore::open(so, ctx_.swap));
    if (store_->block_bytes() > 0) {
      PinnedPoolOptions pool;
      pool.block_bytes = round_page(store_->block_bytes());
      pool.block_count = std::max<std::size_t>(2, z.offload_optimizer.buffer_count);
      pool.huge_pages =
          pool.block_bytes < (std::size_t{2} << 20) ? HugePages::kNone : HugePages::kAuto;
      pool.device = ctx_.device;
      ZINF_RETURN_IF_ERROR(check_pinned_limit(config, pool.block_bytes * pool.block_count,
                                              ctx_.param_staging_bytes));
      ZINF_ASSIGN_OR_RETURN(pool_, PinnedPool::create(pool));
      ZINF_RETURN_IF_ERROR(pool_->register_with(*ctx_.io));
    }
    PipelineOptions pipe;
    pipe.optimizer = config.optimizer;
    pipe.groups = context_groups(ctx_);
    pipe.ranges = context_ranges(ctx_);
    pipe.threads = config.cpu_threads;
    pipe.io_timeout = std::chrono::milliseconds(config.io_timeout_ms);
    pipe.io_timeouts_max = config.io_timeouts_max;
    pipe.trace = ctx_.trace;
    // Sub-groups of frozen parameters (and padding) only: once their moments are zero, the pass
    // passes over them (OptimizerPipeline's "Frozen sub-groups").
    pipe.frozen_sub_groups = frozen_runs(
        layout_, ctx_.rank, store_->sub_group_count(),
        [&](std::size_t i) { return store_->sub_group_first(i); },
        [&](std::size_t i) { return store_->sub_group_size(i); });
    frozen_ = pipe.frozen_sub_groups;
    half_only_.assign(store_->sub_group_count(), false);
    allocate_half_only_scratch();
    advise_frozen_off_huge_pages();
    if (publish_ == Publish::kStreamed) {
      // A step's stream drops the frozen groups' elements (Publisher::restart_stream): a passed
      // frozen sub-group that holds nothing else needs no half output, so not even its master
      // is read. One that holds a trainable group's padding still hands its half copy over.
      pipe.frozen_half_kept.assign(frozen_.size(), false);
      for (std::size_t i = 0; i < frozen_.size(); ++i) {
        pipe.frozen_half_kept[i] =
            frozen_[i] && frozen_groups_only(store_->sub_group_first(i), store_->sub_group_size(i));
      }
      // The pipeline hands each sub-group's half output over from its block.
      pipe.half_done = [this](std::size_t i, const std::byte* half) {
        return stream_half(i, half);
      };
      pub_.allocate_stage();
    } else if (publish_ == Publish::kNarrowed) {
      pub_.allocate_buffer();
    }
    if (publish_ != Publish::kStreamed) copied_runs_ = copied_runs();
    ZINF_ASSIGN_OR_RETURN(pipeline_, OptimizerPipeline::open(*store_, pool_.get(), pipe));
    ZINF_RETURN_IF_ERROR(load());
    // The moments are zero: the frozen sub-groups are settled from the first step on.
    for (std::size_t i = 0; i < frozen_.size(); ++i) {
      if (frozen_[i]) store_->set_settled(i, true);
    }
    if (store_->on_nvme(Piece::kGrads)) {
      SpillOptions spill;
      spill.buffer_count = config.gradient_spill_buffers;
      spill.timeout = ctx_.timeout;
      ZINF_ASSIGN_OR_RETURN(spill_, SpillAccumulator::create(*store_, spill, ctx_.counters));
    }
    return Status::ok();
  }

  // The store's host pieces are fresh zero pages.
  GradTarget grad_target() override {
    if (spill_ != nullptr) return {.custom = spill_.get(), .zeroed = true};
    return {.accumulator = reinterpret_cast<float*>(store_->host_data(Piece::kGrads)),
            .zeroed = true};
  }

  // Per sub-group (sum_of_squares over its elements) added in sub-group order, whether the
  // gradients are in the host array or spilled (the spill computed each sub-group's as it wrote
  // it), so both give the same bits.
  Result<double> local_sum_of_squares() override {
    const auto* host = spill_ != nullptr
                           ? nullptr
                           : reinterpret_cast<const float*>(store_->host_data(Piece::kGrads));
    double total = 0.0;
    for (std::size_t i = 0; i < store_->sub_group_count(); ++i) {
      total += host != nullptr
                   ? sum_of_squares(host + store_->sub_group_first(i), store_->sub_group_size(i))
                   : spill_->sum_of_squares(i);
    }
    return total;
  }

  // The pipeline holds no state of its own between steps (the store does): new
  // hyper-parameters are handed to it, with its pool, arena and threads left as they are.
  Status set_group_params(std::span<const OptimizerParams> groups) override {
    return pipeline_->set_group_params(groups);
  }

  Result<StepStats> step(std::int64_t step, float grad_scale) override {
    // Streamed, the pass writes the shards as it goes (stream_half()), but not the frozen groups'.
    pub_.restart_stream(/*descending=*/false, /*frozen_too=*/false);
    assert_half_only_settled();
    return pipeline_->step({.step = step, .grad_scale = grad_scale});
  }

  Result<StepStats> step_gated(std::int64_t step, float grad_scale, const PassGate& gate) override {
    ZINF_ASSERT(gates() && gate.ready != nullptr);
    gate_ = gate;
    pub_.restart_stream(gate.descending, /*frozen_too=*/false);
    assert_half_only_settled();
    return pipeline_->step({.step = step,
                            .grad_scale = grad_scale,
                            .late_grad_scale = gate.grad_scale,
                            .descending = gate.descending,
                            .ready = &StoreState::sub_group_ready,
                            .ready_user = this,
                            .ascend = gate.ascend != nullptr ? &StoreState::may_ascend : nullptr});
  }

  Status publish_step() override { return publish_pass(/*gather_persistent=*/true); }
  bool overlaps() const override { return true; }
  bool gates() const override { return spill_ == nullptr; }
  Status write_step() override { return publish_pass(/*gather_persistent=*/false); }

  // After the pass: every shard but the frozen groups' written (streamed, the pass did it), and
  // the persistent groups but the frozen ones all-gathered when `gather_persistent`. The step
  // left the frozen groups as they were (Publisher: "Frozen groups").
  Status publish_pass(bool gather_persistent) {
    if (publish_ == Publish::kStreamed) {
      // The pass wrote every trainable group's shard; the persistent groups' all-gather is left.
      ZINF_ASSERT(pub_.stream_complete());
      return gather_persistent ? pub_.publish(/*frozen_too=*/false) : Status::ok();
    }
    // From the store, the pass wrote every group's new values into the store's half array;
    // narrowed, the f32 groups (all groups, without a half piece) come from the master: of each
    // run of such groups that are not frozen, its master only, all runs in one walk, so that a
    // swap block two runs share is read once.
    std::size_t run = 0;  // the first run not wholly narrowed yet (the reads go up)
    ZINF_RETURN_IF_ERROR(read_master_spans(
        copied_runs_, [&](std::size_t first, std::size_t count, const float* src) {
          // A read may hold more than the runs (on the host tier the whole partition; between two
          // runs that share a swap block, the frozen elements there): only the runs' are narrowed.
          const std::size_t end = first + count;
          while (run < copied_runs_.size() && copied_runs_[run].end <= first) ++run;
          for (std::size_t r = run; r < copied_runs_.size() && copied_runs_[r].begin < end; ++r) {
            const std::size_t lo = std::max(first, copied_runs_[r].begin);
            const std::size_t hi = std::min(end, copied_runs_[r].end);
            pub_.narrow_groups(
                lo, hi - lo, src + (lo - first),
                [&](std::uint32_t h) { return needs_master_copy(layout_.group(h).dtype); },
                [&](std::uint32_t h) { return values(h); });
          }
          return Status::ok();
        }));
    return write_values(gather_persistent, /*frozen_too=*/false);
  }

  Status publish_master(bool gather_persistent) override {
    if (publish_ == Publish::kStreamed) {
      // The shards from the fp32 master, rounded group by group in the publisher's stage (each
      // write waited for, since the stage is refilled).
      pub_.restart_stream();
      Status st;
      const DType half = layout_.half_dtype();
      ZINF_RETURN_IF_ERROR(read_master(
          0, layout_.partition_elements(),
          [&](std::size_t first, std::size_t count, const float* src) {
            if (!st.is_ok()) return;
            st = pub_.stage(first, count, [&](std::size_t lo, std::size_t hi, std::byte* dst) {
              narrow(src + (lo - first), hi - lo, half, dst);
            });
          }));
      ZINF_RETURN_IF_ERROR(st);
      ZINF_ASSERT(pub_.stream_complete());
      master_read_ = AlignedBuffer();  // the read-back buffer is made again when needed
      return gather_persistent ? pub_.publish() : Status::ok();
    }
    ZINF_RETURN_IF_ERROR(read_master(0, layout_.partition_elements(),
                                     [&](std::size_t first, std::size_t count, const float* src) {
                                       narrow_all(first, count, src);
                                     }));
    return write_values_and_wait(gather_persistent);
  }

  // A checkpoint load or write_parameters rounds the master into the values run by run as it
  // writes it, so write_loaded() only writes the shards. Streamed, there is no partition-wide
  // array of values: each run is rounded into the publisher's stage, which writes each shard as
  // its group completes (both callers drop the prefetched modules before they write the master),
  // so the master is not read back to publish it. A failed shard write fails the load or the
  // pass, which the ranks agree on.
  // After update_master_range(), the same over its changed groups alone: the calls start at the
  // first group's slice, and write_loaded() writes the changed groups' shards; the others are
  // neither rounded nor written.
  Status master_loaded(std::size_t first, std::size_t count, const float* values) override {
    if (first == (ranged_ ? range_.begin : 0)) {
      loaded_elements_ = first;
      if (publish_ == Publish::kStreamed) {
        if (ranged_) {
          pub_.restart_stream_groups(range_.first_group, range_.end_group, changed_);
        } else {
          pub_.restart_stream();
        }
      }
    }
    if (first != loaded_elements_) {
      loaded_elements_ = kNotLoaded;  // not in order: write_loaded() narrows it all again
      return Status::ok();
    }
    if (publish_ == Publish::kStreamed) {
      const DType half = layout_.half_dtype();
      ZINF_RETURN_IF_ERROR(
          pub_.stage(first, count, [&](std::size_t lo, std::size_t hi, std::byte* dst) {
            narrow(values + (lo - first), hi - lo, half, dst);
          }));
    } else {
      narrow_all(first, count, values, ranged_ ? changed_ : std::span<const std::uint32_t>());
    }
    loaded_elements_ += count;
    return Status::ok();
  }
  Status write_loaded() override {
    const bool ranged = ranged_;
    const bool whole = loaded_elements_ == (ranged ? range_.end : layout_.partition_elements());
    loaded_elements_ = 0;
    ranged_ = false;
    if (!whole) return publish_master(/*gather_persistent=*/false);
    if (ranged && publish_ != Publish::kStreamed) {
      ZINF_RETURN_IF_ERROR(
          pub_.write_group_shards([&](std::uint32_t g) -> const std::byte* { return values(g); },
                                  range_.first_group, range_.end_group, changed_));
      return pub_.wait_writes();
    }
    if (publish_ != Publish::kStreamed) return write_values_and_wait(/*gather_persistent=*/false);
    // The stream wrote every shard, each waited for; the persistent groups' all-gather is left.
    ZINF_ASSERT(pub_.stream_complete());
    return Status::ok();
  }

  // load() rounded the initial master into the values as it wrote it: no read back.
  Status place_initial() override {
    if (publish_ == Publish::kStreamed) return publish_master(/*gather_persistent=*/true);
    return write_values();
  }

  // Of each sub-group that holds elements of [begin, end), only the swap blocks that do (one
  // parameter's master, Engine::read_parameters); on the host tier the whole partition at once.
  Status read_master(std::size_t begin, std::size_t end, MasterVisitor fn) override {
    const Span span{begin, std::min(end, layout_.partition_elements())};
    return read_master_spans({&span, span.begin < span.end ? 1u : 0u},
                             [&](std::size_t first, std::size_t count, const float* src) {
                               fn(first, count, src);
                               return Status::ok();
                             });
  }

  // Both with reads ahead: a checkpoint's save reads the NVMe state while it writes its file.
  Status read_state(Piece piece, StateVisitor fn) override {
    const Span all{0, layout_.partition_elements()};
    return read_spans(piece, {&all, 1}, /*read_ahead=*/true, fn);
  }
  Status read_state_range(Piece piece, std::size_t begin, std::size_t end,
                          StateVisitor fn) override {
    const std::size_t total = layout_.partition_elements();
    if (std::min(begin, total) >= std::min(end, total)) return Status::ok();
    const Span span{begin, std::min(end, total)};
    return read_spans(piece, {&span, 1}, /*read_ahead=*/true, fn);
  }

  // Loaded moments may be anything (a parameter saved trainable and loaded frozen keeps its
  // moments, which each step decays): a frozen sub-group stays settled only when it was (its
  // moments zero) and what is loaded into it is zero too; the others are stepped by the next
  // pass, which settles again those whose moments are zero. A new master leaves the moments as
  // they are, and the half copy is rounded from it when it is published (write_loaded()), so
  // it leaves the settled sub-groups settled. Settled frozen sub-groups kept so are never
  // written on the host tier: their moments stay the untouched zero pages they were. On NVMe,
  // zeros loaded into a settled sub-group's moment or into a released one (kZero: a frozen
  // sub-group whose other moment is not zero is not settled, yet its zero moment is a hole) are
  // not written: the moment stays (or becomes) released, so a load takes no disk blocks for it.
  Status write_state(Piece piece, StateFill fill) override {
    StateStore& s = *store_;
    ZINF_ASSERT(s.has(piece));
    if (piece == Piece::kParams) ranged_ = false;  // master_loaded() from element 0
    const std::vector<bool> settled = settled_frozen();
    std::vector<bool> zero(s.sub_group_count(), true);
    // Whether elements [first, first + count) just written are all zero, per sub-group. Only the
    // sub-groups the range overlaps are visited, from the last one starting at or before `first`
    // (found by bisection), so a load that fills sub-group by sub-group stays linear in them.
    auto note_zeros = [&](std::size_t first, std::size_t count, const float* values) {
      for (std::size_t i = sub_group_holding(s, first);
           i < s.sub_group_count() && s.sub_group_first(i) < first + count; ++i) {
        const std::size_t a = std::max(first, s.sub_group_first(i));
        const std::size_t b = std::min(first + count, s.sub_group_first(i) + s.sub_group_size(i));
        if (a >= b || !zero[i]) continue;
        zero[i] = all_zero(values + (a - first), b - a);
      }
    };
    Status st;
    if (piece == Piece::kParams) {
      st = s.tier(piece) == StoreMedium::kHost
               ? fill_host_master(0, layout_.partition_elements(), fill)
               : rewrite_pieces(piece, /*read_back=*/false, fill);
    } else if (s.tier(piece) == StoreMedium::kHost) {
      st = write_host_moments(piece, settled, fill, &zero);
    } else {
      std::vector<bool> unstored = settled;
      for (std::size_t i = 0; i < unstored.size(); ++i) {
        unstored[i] = unstored[i] || s.residency(piece, i) == Residency::kZero;
      }
      st = rewrite_pieces(
          piece, /*read_back=*/false,
          [&](std::size_t first, std::size_t count, float* out) -> Status {
            ZINF_RETURN_IF_ERROR(fill(first, count, out));
            note_zeros(first, count, out);
            return Status::ok();
          },
          &unstored);
    }
    s.clear_settled();
    for (std::size_t i = 0; i < settled.size(); ++i) {
      if (settled[i] && (piece == Piece::kParams || zero[i])) s.set_settled(i, true);
      // Moments that are not zero: the next step updates the sub-group, from its master.
      if (half_only_[i] && !s.settled(i)) materialise(i);
    }
    Status back = take_back_stepped_shards();
    return st.is_ok() ? back : st;
  }

  // Each sub-group of the master read into a block (the next one read ahead while `fill` changes
  // it), changed in place by `fill`, and written back from the same block.
  Status update_master(StateFill fill) override {
    return update_master_range(0, layout_.partition_elements(), {}, fill);
  }

  // The range widened to whole groups; on the host tier those elements in place, on NVMe only
  // the sub-groups that hold them, each read, changed and written back whole (fill is called
  // over the range's part of it, the unchanged groups' elements too). master_loaded() over the
  // range in order then lets write_loaded() write only its changed groups' shards.
  Status update_master_range(std::size_t begin, std::size_t end,
                             std::span<const std::uint32_t> changed, StateFill fill) override {
    StateStore& s = *store_;
    const std::size_t total = layout_.partition_elements();
    end = std::min(end, total);
    // master_loaded() streams the shards from the range's start on.
    loaded_elements_ = kNotLoaded;
    ranged_ = false;
    if (begin >= end) return Status::ok();
    // With a list of changed groups the update is ranged, even over the whole partition.
    ranged_ = widen_to_groups(layout_, &begin, &end, &range_) || !changed.empty();
    changed_.assign(changed.begin(), changed.end());
    // As write_state(kParams): the settled sub-groups stay settled.
    const std::vector<bool> settled = settled_frozen();
    struct Resettle {
      StateStore& s;
      const std::vector<bool>& settled;
      ~Resettle() {
        s.clear_settled();
        for (std::size_t i = 0; i < settled.size(); ++i) {
          if (settled[i]) s.set_settled(i, true);
        }
      }
    } resettle{s, settled};
    if (s.tier(Piece::kParams) == StoreMedium::kHost) return fill_host_master(begin, end, fill);
    // The sub-groups that hold elements [begin, end).
    const std::size_t first_sub = sub_group_holding(s, begin);
    return rewrite_pieces(
        Piece::kParams, /*read_back=*/true,
        [&](std::size_t first, std::size_t count, float* out) -> Status {
          const std::size_t a = std::max(first, begin);
          const std::size_t b = std::min(first + count, end);
          return fill(a, b - a, out + (a - first));
        },
        /*zeros_unstored=*/nullptr, first_sub, sub_group_holding(s, end - 1, first_sub) + 1);
  }

  // On NVMe, where a ranged update reads and rewrites whole sub-groups: whether one holds both.
  bool shares_rewrite(std::size_t end, std::size_t begin) const override {
    const StateStore& s = *store_;
    if (s.tier(Piece::kParams) == StoreMedium::kHost) return false;
    ZINF_ASSERT(0 < end && end <= begin && begin < layout_.partition_elements());
    return sub_group_holding(s, end - 1) == sub_group_holding(s, begin);
  }

  Result<bool> link_checkpoint(const void* header, const std::string& path,
                               const std::string& later_name,
                               std::vector<FileBlockSum>* sums) override {
    if (!store_->linkable()) return false;
    return store_->link_checkpoint(header, path, later_name, sums);
  }

  bool adoptable(const std::vector<FileBlockSum>& sums) const override {
    return store_->adoptable(sums);
  }
  Status adopt_checkpoint(const std::string& path, const std::string& later_name,
                          const std::vector<FileBlockSum>& sums) override {
    // The load's write_loaded() follows with no master_loaded(): what a failed write left here
    // must not pass for values rounded from the adopted master.
    loaded_elements_ = kNotLoaded;
    ranged_ = false;
    return store_->adopt_checkpoint(path, later_name, sums);
  }

  void restored(std::int64_t step) override {
    for (std::size_t i = 0; i < store_->sub_group_count(); ++i) store_->set_stored(i, step);
  }

  void add_memory(MemoryReport& report) const override {
    report.host_bytes += pinned_bytes();
    if (spill_ != nullptr) report.host_bytes += spill_->host_bytes();
    for (std::size_t p = 0; p < kPieceCount; ++p) {
      const auto piece = static_cast<Piece>(p);
      if (store_->has(piece) && store_->tier(piece) == StoreMedium::kHost) {
        report.host_bytes += layout_.partition_elements() * dtype_bytes(store_->dtype(piece));
      }
    }
    // Every host array and block allocated for the state counts, its pages touched or not (the
    // frozen moments' and gradients' zero pages too: a load or a step may write them), but a
    // half-only sub-group's master: no write is ever given those pages, and one that would be
    // makes the master first (materialise()), which counts it again.
    for (std::size_t i = 0; i < half_only_.size(); ++i) {
      if (half_only_[i]) report.host_bytes -= store_->sub_group_size(i) * sizeof(float);
    }
    report.host_bytes +=
        read_scratch_.bytes() + fill_scratch_.bytes() + half_scratch_.bytes() + round_trip_.bytes();
  }
  std::uint64_t pinned_bytes() const override { return pool_ != nullptr ? pool_->bytes() : 0; }
  std::uint64_t master_read_bytes() const override { return master_read_bytes_; }

 private:
  // Partition elements [begin, end).
  struct Span {
    std::size_t begin = 0;
    std::size_t end = 0;
  };
  // One read of read_spans(): elements `range` of sub-group i.
  struct SpanRead {
    std::size_t i = 0;
    StateStore::ElementRange range;
  };
  // The reads that cover `spans` (increasing, disjoint, none empty, inside the partition) of an
  // NVMe piece, in partition order: of each sub-group that holds elements of the spans, the swap
  // blocks that do (StateStore::read_range), none twice. Where the grown ranges of two spans in
  // one sub-group meet (a block holds the end of one and the start of the next), they are one
  // read, which holds the elements between them too.
  class SpanWalk {
   public:
    SpanWalk(const StateStore& s, Piece piece, std::span<const Span> spans)
        : s_(s), piece_(piece), spans_(spans) {}
    // The next read into *read; false after the last.
    bool next(SpanRead* read) {
      while (span_ < spans_.size() && spans_[span_].end <= done_) ++span_;
      if (span_ == spans_.size()) return false;
      const std::size_t from = std::max(done_, spans_[span_].begin);
      // The sub-group that holds `from`, from the last read's on.
      i_ = sub_group_holding(s_, from, i_);
      const std::size_t at = s_.sub_group_first(i_);
      const std::size_t stop = at + s_.sub_group_size(i_);
      StateStore::ElementRange r =
          s_.read_range(piece_, i_, from - at, std::min(spans_[span_].end, stop) - at);
      for (std::size_t k = span_ + 1; k < spans_.size() && spans_[k].begin < stop; ++k) {
        const StateStore::ElementRange more =
            s_.read_range(piece_, i_, spans_[k].begin - at, std::min(spans_[k].end, stop) - at);
        if (more.begin > r.end) break;
        r.end = std::max(r.end, more.end);
      }
      // A read ends on a block bound or at its sub-group's end, so the next one starts past it.
      done_ = at + r.end;
      *read = {i_, r};
      return true;
    }

   private:
    const StateStore& s_;
    const Piece piece_;
    const std::span<const Span> spans_;
    std::size_t span_ = 0;  // the first span not wholly read
    std::size_t done_ = 0;  // the partition elements below it are read or not wanted
    std::size_t i_ = 0;     // the last read's sub-group
  };

  // fn over `piece` (the master or a moment) in partition order, covering `spans` (as SpanWalk
  // takes them); on the host tier the whole array at once. On NVMe only the sub-groups that hold
  // elements of the spans are read, and of those only the swap blocks that do (SpanWalk), so one
  // parameter's moment costs its own bytes, not the partition's, and a block that two spans share
  // is read once; fn takes each read's elements. Each read goes through StateStore::read_piece,
  // which checks the blocks' checksums and reads a released (kZero) piece as zeros.
  // `read_ahead`: two blocks (the pool's where free, as rewrite_pieces() takes them), and the
  // next read on a thread of its own while `fn` takes the current one, so a checkpoint's save
  // reads the NVMe state while it writes its file. Otherwise one read at a time into
  // master_read_, which is kept: the step's read-back of the master allocates nothing after the
  // first.
  Status read_spans(Piece piece, std::span<const Span> spans, bool read_ahead, StateVisitor fn) {
    StateStore& s = *store_;
    ZINF_ASSERT(s.has(piece));
    if (s.tier(piece) == StoreMedium::kHost) {
      if (piece == Piece::kParams && any_half_only()) return read_host_master(spans, fn);
      return fn(0, layout_.partition_elements(),
                reinterpret_cast<const float*>(s.host_data(piece)));
    }
    SpanWalk walk(s, piece, spans);
    SpanRead at;
    if (!walk.next(&at)) return Status::ok();
    PieceBlocks blocks;
    if (read_ahead) {
      take_blocks(2, &blocks);
    } else {
      if (master_read_.bytes() == 0) {
        master_read_ = AlignedBuffer(round_page(s.sub_group_params() * sizeof(float)));
      }
      blocks.data = {master_read_.data(), master_read_.data(), nullptr};
    }
    auto block = [&blocks](std::size_t k) { return blocks.data[k % 2]; };
    auto read = [&s, piece](SpanRead r, std::byte* data) {
      return s.read_piece(piece, r.i, r.range, data);
    };
    std::future<Status> ahead;
    if (read_ahead) ahead = std::async(std::launch::async, read, at, block(0));
    for (std::size_t k = 0;; ++k) {
      ZINF_RETURN_IF_ERROR(read_ahead ? ahead.get() : read(at, block(k)));
      SpanRead next;
      const bool more = walk.next(&next);
      if (more && read_ahead) ahead = std::async(std::launch::async, read, next, block(k + 1));
      Status st = fn(s.sub_group_first(at.i) + at.range.begin, at.range.end - at.range.begin,
                     reinterpret_cast<const float*>(block(k)));
      if (!st.is_ok()) {
        if (ahead.valid()) (void)ahead.get();  // no read may still fill a block when it is freed
        return st;
      }
      if (!more) return Status::ok();
      at = next;
    }
  }

  // read_spans() of the master without reads ahead, counting the bytes read from NVMe
  // (master_read_bytes()).
  Status read_master_spans(std::span<const Span> spans, StateVisitor fn) {
    const bool nvme = store_->tier(Piece::kParams) == StoreMedium::kNvme;
    return read_spans(Piece::kParams, spans, /*read_ahead=*/false,
                      [&](std::size_t first, std::size_t count, const float* src) {
                        if (nvme) master_read_bytes_ += round_page(count * sizeof(float));
                        return fn(first, count, src);
                      });
  }

  // Blocks of one sub-group's piece for rewrite_pieces(): the pool's, registered with the I/O
  // engine (no page pinning per request) and mapped at open (no page faults), as many as are
  // free up to `wanted`; fresh ones only to make up two. Between steps the pool is idle.
  struct PieceBlocks {
    std::array<PinnedPool::Lease, 3> leases;
    std::array<AlignedBuffer, 3> fresh;
    std::array<std::byte*, 3> data{};
    std::size_t count = 0;
  };
  void take_blocks(std::size_t wanted, PieceBlocks* b) {
    ZINF_ASSERT(wanted >= 2 && wanted <= b->data.size());
    const std::size_t bytes = round_page(store_->sub_group_params() * sizeof(float));
    if (pool_ != nullptr && pool_->block_bytes() >= bytes) {
      while (b->count < wanted) {
        std::optional<PinnedPool::Lease> lease = pool_->try_acquire();
        if (!lease.has_value()) break;
        b->leases[b->count] = std::move(*lease);
        b->data[b->count] = b->leases[b->count].data();
        ++b->count;
      }
    }
    while (b->count < 2) {
      b->fresh[b->count] = AlignedBuffer(bytes);
      b->data[b->count] = b->fresh[b->count].data();
      ++b->count;
    }
  }

  // `piece` (on NVMe) rewritten sub-group by sub-group through `fill`: sub-group i - 1 is
  // written on a thread of its own while `fill` fills sub-group i, so a checkpoint's load writes
  // the NVMe state while it reads its file. With `read_back`, `fill` finds the sub-group's
  // stored values in the block, and sub-group i + 1 is read on another thread meanwhile when
  // there are three blocks (with two, it is read beside the write of sub-group i). The tail of a
  // block past the sub-group's elements is written as zeros, as load() wrote it. The sub-groups
  // flagged in `zeros_unstored` (for a moment: settled frozen ones, and those whose piece is
  // released) that `fill` leaves all zero are not written: their room is given back instead
  // (StateStore::release_piece), as load() left it; a piece released already is left as it is.
  // Only sub-groups [first_sub, end_sub) are rewritten.
  Status rewrite_pieces(Piece piece, bool read_back, StateFill fill,
                        const std::vector<bool>* zeros_unstored = nullptr,
                        std::size_t first_sub = 0, std::size_t end_sub = SIZE_MAX) {
    StateStore& s = *store_;
    PieceBlocks blocks;
    take_blocks(read_back ? 3 : 2, &blocks);
    const std::size_t n = blocks.count;
    const std::size_t count = std::min(end_sub, s.sub_group_count());
    auto block = [&](std::size_t i) { return blocks.data[i % n]; };
    auto read = [&s, piece, &block](std::size_t i) {
      return std::async(std::launch::async,
                        [&s, piece, i, data = block(i)] { return s.read_piece(piece, i, data); });
    };
    // Declared after the blocks: whatever returns, the futures wait for their I/O before the
    // blocks go back.
    std::future<Status> writing, reading;
    if (read_back && first_sub < count) reading = read(first_sub);
    for (std::size_t i = first_sub; i < count; ++i) {
      std::byte* data = block(i);  // its last write (i - n) was waited for below
      const std::size_t size = s.sub_group_size(i);
      const std::size_t tail = round_page(size * sizeof(float)) - size * sizeof(float);
      if (read_back) {
        ZINF_RETURN_IF_ERROR(reading.get());
        // Block (i + 1) % 3 last held sub-group i - 2, whose write was waited for.
        if (n >= 3 && i + 1 < count) reading = read(i + 1);
        std::memset(data + size * sizeof(float), 0, tail);
      } else {
        std::memset(data, 0, size * sizeof(float) + tail);
      }
      Status st = fill(s.sub_group_first(i), size, reinterpret_cast<float*>(data));
      Status written = writing.valid() ? writing.get() : Status::ok();
      ZINF_RETURN_IF_ERROR(written);
      ZINF_RETURN_IF_ERROR(st);
      if (zeros_unstored != nullptr && (*zeros_unstored)[i] &&
          all_zero(reinterpret_cast<const float*>(data), size) &&
          (s.residency(piece, i) == Residency::kZero || s.release_piece(piece, i).is_ok())) {
        continue;  // (not read back: update_master() passes no flags)
      }
      writing = std::async(std::launch::async,
                           [&s, piece, i, data] { return s.write_piece(piece, i, data); });
      // With two blocks, the other one is free once the write of i - 1 was waited for.
      if (read_back && n < 3 && i + 1 < count) reading = read(i + 1);
    }
    Status written = writing.valid() ? writing.get() : Status::ok();
    if (reading.valid()) (void)reading.get();
    return written;
  }

  // Which sub-groups are frozen and settled now (their moments zero).
  std::vector<bool> settled_frozen() const {
    std::vector<bool> out(store_->sub_group_count(), false);
    for (std::size_t i = 0; i < frozen_.size(); ++i) out[i] = frozen_[i] && store_->settled(i);
    return out;
  }

  // write_state() of a moment on the host tier: a sub-group that is settled (its moments zero) is
  // filled in a scratch block and copied only when what is loaded is not all zero, so a frozen
  // sub-group's moments that stay zero never take memory; each run of the others is filled in
  // place by one call (the whole partition when nothing is settled). Sets (*zero)[i] to whether
  // sub-group i's loaded values are zero.
  Status write_host_moments(Piece piece, const std::vector<bool>& settled, StateFill fill,
                            std::vector<bool>* zero) {
    StateStore& s = *store_;
    AlignedBuffer scratch;
    const std::size_t count = s.sub_group_count();
    for (std::size_t i = 0; i < count;) {
      const std::size_t first = s.sub_group_first(i);
      if (!settled[i]) {
        std::size_t end = i + 1;
        while (end < count && !settled[end]) ++end;
        const std::size_t elements = s.sub_group_first(end - 1) + s.sub_group_size(end - 1) - first;
        auto* dst = reinterpret_cast<float*>(s.host_data(piece, i));
        ZINF_RETURN_IF_ERROR(fill(first, elements, dst));
        for (std::size_t j = i; j < end; ++j) {
          (*zero)[j] = all_zero(dst + (s.sub_group_first(j) - first), s.sub_group_size(j));
        }
        i = end;
        continue;
      }
      const std::size_t size = s.sub_group_size(i);
      if (scratch.bytes() == 0) scratch = AlignedBuffer(s.sub_group_params() * sizeof(float));
      ZINF_RETURN_IF_ERROR(fill(first, size, scratch.as<float>()));
      (*zero)[i] = all_zero(scratch.as<const float>(), size);
      if (!(*zero)[i]) std::memcpy(s.host_data(piece, i), scratch.data(), size * sizeof(float));
      ++i;
    }
    return Status::ok();
  }

  // With transparent huge pages "always", the first write into a trainable sub-group would
  // fault in the 2 MiB pages around it, over its frozen neighbours' zeros too: the host arrays
  // of the moments and the gradients are advised off huge pages over each run of consecutive
  // frozen sub-groups (StateStore::advise_cold), bounded as advise_runs() bounds them.
  void advise_frozen_off_huge_pages() {
    advise_runs(frozen_,
                [&](std::size_t first, std::size_t count) { store_->advise_cold(first, count); });
  }

  // Whether a frozen sub-group may keep its master as its half copy alone: from the store's
  // half array, with the master in host memory (the store's header comment).
  bool keeps_half_only() const {
    return publish_ == Publish::kFromStore && store_->tier(Piece::kParams) == StoreMedium::kHost;
  }

  // Whether some sub-group is half-only: a scan of one bit a sub-group.
  bool any_half_only() const {
    return std::find(half_only_.begin(), half_only_.end(), true) != half_only_.end();
  }

  // Half-only sub-groups are settled: no step reads or writes their master.
  void assert_half_only_settled() const {
    for (std::size_t i = 0; i < half_only_.size(); ++i) {
      ZINF_ASSERT_MSG(!half_only_[i] || store_->settled(i), "a half-only sub-group is stepped");
    }
  }

  // The half copy of partition elements [first, first + count), widened into `out`.
  void widen_half(std::size_t first, std::size_t count, float* out) const {
    widen(store_->host_data(Piece::kParamsHalf) + first * sizeof(std::uint16_t), count,
          layout_.half_dtype(), out);
  }

  // The scratch blocks of the half-only sub-groups' reads and writes, made at open where a
  // frozen sub-group may keep no master, and kept (MemoryReport::host_bytes counts them): a
  // chunk of floats each, and a chunk of halves; a chunk is at most a sub-group, whose elements
  // the loops over them never pass.
  void allocate_half_only_scratch() {
    if (!keeps_half_only() || std::find(frozen_.begin(), frozen_.end(), true) == frozen_.end()) {
      return;
    }
    chunk_elements_ = std::min(kHalfOnlyChunkElements, store_->sub_group_params());
    read_scratch_ = AlignedBuffer(chunk_elements_ * sizeof(float));
    fill_scratch_ = AlignedBuffer(chunk_elements_ * sizeof(float));
    round_trip_ = AlignedBuffer(chunk_elements_ * sizeof(float));
    half_scratch_ = AlignedBuffer(chunk_elements_ * sizeof(std::uint16_t));
  }

  // Whether the half dtype holds `values` (at most chunk_elements_) exactly (narrow_checked():
  // narrowed into half_scratch_, widened back into round_trip_ the same bits).
  bool holds_exactly(const float* values, std::size_t count) {
    ZINF_ASSERT(count <= chunk_elements_);
    return narrow_checked(layout_.half_dtype(), values, count, half_scratch_.as<std::uint16_t>(),
                          round_trip_.as<float>()) == count;
  }

  // When the half dtype holds `values` (partition elements [first, first + count), at most
  // chunk_elements_) exactly: narrows them into the half copy and returns true; else leaves the
  // half copy as it is.
  bool narrow_exactly(std::size_t first, std::size_t count, const float* values) {
    if (!holds_exactly(values, count)) return false;
    std::memcpy(store_->host_data(Piece::kParamsHalf) + first * sizeof(std::uint16_t),
                half_scratch_.data(), count * sizeof(std::uint16_t));
    return true;
  }

  // Half-only sub-group i gets its master: its half copy, widened into the master array.
  void materialise(std::size_t i) {
    ZINF_ASSERT(half_only_[i]);
    const std::size_t first = store_->sub_group_first(i);
    widen_half(first, store_->sub_group_size(i),
               reinterpret_cast<float*>(store_->host_data(Piece::kParams)) + first);
    half_only_[i] = false;
  }

  // Master elements [begin, end) on the host tier through `fill`, which finds their current
  // values in `out`: each run of sub-groups with a master filled in place by one call (the whole
  // range when no sub-group is half-only); a half-only sub-group's elements a chunk at a time,
  // each widened into a scratch block, filled there, and narrowed into the half copy when it
  // holds them exactly (narrow_exactly()), else copied into the sub-group's master, made first
  // (materialise()), into which the rest of the sub-group is then filled in place. In
  // partition order, as master_loaded() takes the calls.
  Status fill_host_master(std::size_t begin, std::size_t end, StateFill fill) {
    const StateStore& s = *store_;
    auto* master = reinterpret_cast<float*>(s.host_data(Piece::kParams));
    if (begin >= end || !any_half_only()) return fill(begin, end - begin, master + begin);
    std::size_t at = begin;
    for (std::size_t i = sub_group_holding(s, begin); at < end; ++i) {
      const std::size_t stop = std::min(end, s.sub_group_first(i) + s.sub_group_size(i));
      if (!half_only_[i]) {
        // The run of sub-groups with a master from here on.
        std::size_t run_end = stop;
        while (run_end < end && !half_only_[i + 1]) {
          ++i;
          run_end = std::min(end, s.sub_group_first(i) + s.sub_group_size(i));
        }
        ZINF_RETURN_IF_ERROR(fill(at, run_end - at, master + at));
        at = run_end;
        continue;
      }
      float* scratch = fill_scratch_.as<float>();
      while (at < stop && half_only_[i]) {
        const std::size_t count = std::min(chunk_elements_, stop - at);
        widen_half(at, count, scratch);
        ZINF_RETURN_IF_ERROR(fill(at, count, scratch));
        if (!narrow_exactly(at, count, scratch)) {
          materialise(i);
          std::memcpy(master + at, scratch, count * sizeof(float));
        }
        at += count;
      }
      if (at < stop) {
        ZINF_RETURN_IF_ERROR(fill(at, stop - at, master + at));
        at = stop;
      }
    }
    return Status::ok();
  }

  // read_spans() of the master on the host tier with half-only sub-groups: each run of
  // sub-groups with a master handed over in place, whole; of a half-only sub-group, only its
  // elements inside `spans`, widened a chunk at a time into a scratch block.
  Status read_host_master(std::span<const Span> spans, StateVisitor fn) {
    const StateStore& s = *store_;
    const auto* master = reinterpret_cast<const float*>(s.host_data(Piece::kParams));
    const std::size_t total = layout_.partition_elements();
    std::size_t run = 0;  // the first element of the run with a master not yet handed over
    std::size_t k = 0;    // the first span that may reach into the sub-group
    for (std::size_t i = 0; i < s.sub_group_count(); ++i) {
      if (!half_only_[i]) continue;
      const std::size_t a = s.sub_group_first(i);
      const std::size_t b = a + s.sub_group_size(i);
      if (run < a) ZINF_RETURN_IF_ERROR(fn(run, a - run, master + run));
      run = b;
      while (k < spans.size() && spans[k].end <= a) ++k;
      for (std::size_t m = k; m < spans.size() && spans[m].begin < b; ++m) {
        const std::size_t hi = std::min(b, spans[m].end);
        for (std::size_t at = std::max(a, spans[m].begin); at < hi;) {
          const std::size_t count = std::min(chunk_elements_, hi - at);
          float* wide = read_scratch_.as<float>();
          widen_half(at, count, wide);
          ZINF_RETURN_IF_ERROR(fn(at, count, wide));
          at += count;
        }
      }
    }
    if (run < total) ZINF_RETURN_IF_ERROR(fn(run, total - run, master + run));
    return Status::ok();
  }

  // Every bit zero (a -0.0 moment is not the zero a settled sub-group holds).
  static bool all_zero(const float* values, std::size_t count) {
    return all_zero_bytes(values, count * sizeof(float));
  }

  // load()'s first pass, where a frozen sub-group may keep no master (keeps_half_only()): which
  // frozen sub-groups the half copy holds exactly. Each one's master is filled into `block` a
  // chunk at a time, up to the first chunk the half dtype does not hold exactly (load() fills
  // that sub-group again, whole: a base trained in fp32 stops at its first chunk); one held
  // throughout is narrowed into the half copy and becomes half-only. Decided before any master
  // is written, so that the half-only sub-groups' masters, which no write touches, are advised
  // off transparent huge pages (merged into runs, bounded by advise_runs())
  // before a neighbour's master is written: with THP "always" that write would otherwise fault
  // 2 MiB pages over them. The masters of the frozen sub-groups not held are left as they are,
  // since load() writes them in full.
  Status find_half_only(AlignedBuffer& block) {
    if (!keeps_half_only()) return Status::ok();
    const StateStore& s = *store_;
    float* master = block.as<float>();
    for (std::size_t i = 0; i < frozen_.size(); ++i) {
      if (!frozen_[i]) continue;
      const std::size_t first = s.sub_group_first(i);
      const std::size_t size = s.sub_group_size(i);
      bool held = true;
      for (std::size_t done = 0; done < size && held; done += chunk_elements_) {
        const std::size_t count = std::min(chunk_elements_, size - done);
        ZINF_RETURN_IF_ERROR(ctx_.layout->fill_master(first + done, count, master + done));
        held = holds_exactly(master + done, count);
      }
      if (!held) continue;
      narrow_all(first, size, master);
      half_only_[i] = true;
    }
    advise_runs(half_only_, [&](std::size_t first, std::size_t count) {
      store_->advise_master_cold(first, count);
    });
    return Status::ok();
  }

  // Writes the initial master and zero moments into the store, and rounds the master into the
  // publishing values from the same block, so the registered values are read once. On the host
  // tier the moments are not written: the store's arrays are fresh zero pages
  // (AlignedBuffer::zeroed_pages), which take memory only once a step writes them, so the
  // moments of the frozen sub-groups (settled from the first step, never written) take none. On
  // NVMe a frozen sub-group's moments are not written either: their room in the swap file is
  // given back (StateStore::release_piece, kZero), so they take no disk blocks (where the
  // filesystem cannot punch holes, zeros are written as for the others).
  Status load() {
    StateStore& s = *store_;
    ZINF_ASSERT(s.has(Piece::kParams));  // the master always lives in the store
    AlignedBuffer block(round_page(s.sub_group_params() * sizeof(float)));
    ZINF_RETURN_IF_ERROR(find_half_only(block));
    for (std::size_t i = 0; i < s.sub_group_count(); ++i) {
      const std::size_t first = s.sub_group_first(i);
      const std::size_t size = s.sub_group_size(i);
      for (Piece piece : {Piece::kParams, Piece::kExpAvg, Piece::kExpAvgSq}) {
        if (!s.has(piece)) continue;
        if (piece == Piece::kParams && half_only_[i]) continue;  // find_half_only() narrowed it
        if (piece != Piece::kParams && s.tier(piece) == StoreMedium::kHost) continue;
        if (piece != Piece::kParams && i < frozen_.size() && frozen_[i] &&
            s.release_piece(piece, i).is_ok()) {
          continue;
        }
        std::memset(block.data(), 0, block.bytes());
        if (piece == Piece::kParams) {
          ZINF_RETURN_IF_ERROR(ctx_.layout->fill_master(first, size, block.as<float>()));
          // Streamed, there is no partition-wide copy: place_initial() reads the master back.
          if (publish_ != Publish::kStreamed) narrow_all(first, size, block.as<const float>());
        }
        if (s.tier(piece) == StoreMedium::kHost) {
          std::memcpy(s.host_data(piece, i), block.data(), size * sizeof(float));
        } else {
          ZINF_RETURN_IF_ERROR(s.write_piece(piece, i, block.data()));
        }
      }
    }
    return Status::ok();
  }

  // The pipeline's gate during step_gated(): sub-group i's elements, asked of the engine's gate.
  static int sub_group_ready(void* user, std::size_t i) {
    auto* self = static_cast<StoreState*>(user);
    return self->gate_.ready(self->gate_.user, self->store_->sub_group_first(i),
                             self->store_->sub_group_size(i));
  }

  // Sub-groups [0, left) are not begun: the gate's answer for their elements.
  static bool may_ascend(void* user, std::size_t left) {
    auto* self = static_cast<StoreState*>(user);
    return self->gate_.ascend(self->gate_.user, self->store_->sub_group_first(left));
  }

  // The pipeline's half_done: sub-group i's new half values, from its pool block. Null for a
  // passed frozen sub-group of frozen groups only (PipelineOptions::frozen_half_kept): the
  // step's stream asks nothing of it, but the range keeps the stream in order.
  Status stream_half(std::size_t i, const std::byte* half) {
    const std::size_t first = store_->sub_group_first(i);
    const std::size_t bytes = dtype_bytes(layout_.half_dtype());
    return pub_.stage(first, store_->sub_group_size(i),
                      [&](std::size_t lo, std::size_t hi, std::byte* dst) {
                        ZINF_ASSERT_MSG(half != nullptr, "stream_half: a kept half copy asked for");
                        std::memcpy(dst, half + (lo - first) * bytes, (hi - lo) * bytes);
                      });
  }

  // The spans of the partition whose groups publish_pass() narrows from the master: runs of
  // groups that need_master_copy() and are not frozen (empty runs left out).
  std::vector<Span> copied_runs() const {
    std::vector<Span> runs;
    auto copied = [&](std::uint32_t g) {
      return needs_master_copy(layout_.group(g).dtype) && layout_.republished(g);
    };
    for (std::uint32_t g = 0; g < layout_.group_count();) {
      if (!copied(g)) {
        ++g;
        continue;
      }
      const std::size_t begin = layout_.offset(g);
      while (g < layout_.group_count() && copied(g)) ++g;
      const std::size_t end = layout_.offset(g - 1) + layout_.group(g - 1).shard_element_count;
      if (begin < end) runs.push_back({begin, end});
    }
    return runs;
  }

  // OptimizerState::share_host_shards: from the store, with the master on the host tier (as
  // keeps_half_only()), the frozen groups but the persistent ones whose elements lie in frozen
  // sub-groups alone. Those are settled from open on (their moments zero), so no pass writes their
  // half copy. A frozen group with elements in a sub-group that also holds trainable ones is left
  // out: every pass rewrites that sub-group's half copy (the same bits for the frozen elements,
  // but written while an overlapped step's next forward may be gathering them). The lent groups'
  // half copy is registered with the device here, once, a span of whole pages a run of them
  // (spans that share or touch a page made one), and unregistered when the state goes (after the
  // coordinator).
  Result<std::vector<const std::byte*>> share_host_shards(
      const std::vector<bool>& persistent) override {
    std::vector<const std::byte*> out(layout_.group_count(), nullptr);
    if (publish_ != Publish::kFromStore || !keeps_half_only()) return out;
    for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
      const std::size_t count = layout_.group(g).shard_element_count;
      if (!layout_.frozen_group(g) || count == 0) continue;
      if (g < persistent.size() && persistent[g]) continue;
      if (!in_sub_groups(layout_.offset(g), count, [&](std::size_t i) { return frozen_[i]; })) {
        continue;
      }
      ZINF_ASSERT(settled_over(layout_.offset(g), count));
      out[g] = values(g);
    }
    const std::vector<std::pair<std::uintptr_t, std::uintptr_t>> spans = shared_half_spans(out);
    for (const auto& [begin, end] : spans) {
      ZINF_RETURN_IF_ERROR(ctx_.device->register_host(reinterpret_cast<void*>(begin), end - begin));
      registered_half_.push_back(reinterpret_cast<void*>(begin));
    }
    return out;
  }
  // The spans of the half array that the lent groups (`lent[g]` not null) lie in, each widened to
  // whole pages (but not past the array's end), those that overlap or touch merged, ascending.
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> shared_half_spans(
      const std::vector<const std::byte*>& lent) const {
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> spans;
    const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    const auto base = reinterpret_cast<std::uintptr_t>(store_->host_data(Piece::kParamsHalf));
    const std::uintptr_t array_end = base + layout_.partition_elements() * 2;
    for (std::uint32_t g = 0; g < lent.size(); ++g) {
      if (lent[g] == nullptr) continue;
      const std::uintptr_t lo = reinterpret_cast<std::uintptr_t>(lent[g]);
      const std::uintptr_t hi = lo + layout_.group(g).shard_element_count * 2;
      const std::uintptr_t begin = lo / page * page;
      const std::uintptr_t end = std::min((hi + page - 1) / page * page, array_end);
      if (!spans.empty() && begin <= spans.back().second) {
        spans.back().second = std::max(spans.back().second, end);
      } else {
        spans.emplace_back(begin, end);
      }
    }
    return spans;
  }
  // Whether every sub-group that elements [first, first + count) overlap satisfies `pred`.
  template <typename Pred>
  bool in_sub_groups(std::size_t first, std::size_t count, Pred pred) const {
    const StateStore& s = *store_;
    for (std::size_t i = sub_group_holding(s, first);
         i < s.sub_group_count() && s.sub_group_first(i) < first + count; ++i) {
      if (!pred(i)) return false;
    }
    return true;
  }
  bool settled_over(std::size_t first, std::size_t count) const {
    return in_sub_groups(first, count, [&](std::size_t i) { return store_->settled(i); });
  }
  // After a load of the moments: a lent group over a sub-group that the next pass steps (moments
  // loaded that are not zero) gets its own host shard back before that pass rewrites the half
  // copy beside the next forward's gathers (an overlapped step does not wait for a frozen
  // group's writes). Nothing is gathered during a load. The lent groups are the coordinator's to
  // know (ParamCoordinator::shares_host_shard); none is when no span was registered. It is asked
  // only about a frozen group that the next pass steps (a trainable group is never lent): a
  // state opened without an engine has no coordinator to ask, and a load of zero moments into
  // the frozen sub-groups needs none.
  Status take_back_stepped_shards() {
    if (registered_half_.empty()) return Status::ok();
    for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
      if (!layout_.frozen_group(g)) continue;
      if (settled_over(layout_.offset(g), layout_.group(g).shard_element_count)) continue;
      ParamCoordinator& coordinator = pub_.coordinator();
      if (!coordinator.shares_host_shard(g)) continue;
      std::lock_guard<std::mutex> lock(pub_.mutex());
      ZINF_RETURN_IF_ERROR(coordinator.unshare_host_shard(g));
    }
    return Status::ok();
  }
  void unregister_shared_half() {
    for (void* p : registered_half_) (void)ctx_.device->unregister_host(p);
    registered_half_.clear();
  }

  // Partition elements [first, first + count) lie in groups that a step does not rewrite (frozen
  // groups) only.
  bool frozen_groups_only(std::size_t first, std::size_t count) const {
    const std::size_t end = first + count;
    for (std::uint32_t g = layout_.first_group_ending_after(first);
         g < layout_.group_count() && layout_.offset(g) < end; ++g) {
      if (layout_.group(g).shard_element_count > 0 && layout_.republished(g)) return false;
    }
    return true;
  }

  // The groups the pass does not produce in their dtype: f32 groups, or all of them when the
  // store has no half piece.
  bool needs_master_copy(DType dtype) const {
    return dtype == DType::kF32 || publish_ == Publish::kNarrowed;
  }

  // Group g's new device-dtype values: in the store's half array, else in the publisher's
  // buffer.
  std::byte* values(std::uint32_t g) {
    ZINF_ASSERT(publish_ != Publish::kStreamed);
    if (publish_ == Publish::kFromStore) {
      return store_->host_data(Piece::kParamsHalf) + layout_.offset(g) * 2;
    }
    return pub_.buffer(g);
  }
  // Of the groups `chosen` chooses (chosen_group(): empty, every group).
  void narrow_all(std::size_t first, std::size_t count, const float* src,
                  std::span<const std::uint32_t> chosen = {}) {
    pub_.narrow_groups(
        first, count, src, [&](std::uint32_t g) { return chosen_group(chosen, g); },
        [&](std::uint32_t g) { return values(g); });
  }
  Status write_values(bool gather_persistent = true, bool frozen_too = true) {
    return pub_.write_shards([&](std::uint32_t g) -> const std::byte* { return values(g); },
                             gather_persistent, frozen_too);
  }
  // write_values(), and where the persistent groups are left to the caller, the writes waited
  // for, so that a failed one shows here (publish_master()).
  Status write_values_and_wait(bool gather_persistent) {
    ZINF_RETURN_IF_ERROR(write_values(gather_persistent));
    return gather_persistent ? Status::ok() : pub_.wait_writes();
  }

  StateContext ctx_;
  const ParameterLayout& layout_;
  Publisher& pub_;
  const Publish publish_;
  // Per sub-group of the store: frozen parameters (and padding) only (PipelineOptions).
  std::vector<bool> frozen_;
  // Per sub-group: its master is its half copy alone (the header comment).
  // REQUIRES: a half-only sub-group is frozen and settled.
  std::vector<bool> half_only_;
  // The spans of the half array registered with the device for the groups share_host_shards()
  // lent the coordinator (shared_half_spans(): their starts).
  std::vector<void*> registered_half_;
  // Half-only sub-groups' scratch blocks (allocate_half_only_scratch()): a read's widened
  // values, a write's filled ones, the narrowed halves and their widened round trip, of
  // chunk_elements_ elements each (up to kHalfOnlyChunkElements), or none.
  std::size_t chunk_elements_ = 0;
  AlignedBuffer read_scratch_;
  AlignedBuffer fill_scratch_;
  AlignedBuffer half_scratch_;
  AlignedBuffer round_trip_;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<PinnedPool> pool_;
  std::unique_ptr<OptimizerPipeline> pipeline_;
  std::unique_ptr<SpillAccumulator> spill_;  // gradients_on_nvme
  PassGate gate_;                            // the running step_gated()'s
  AlignedBuffer master_read_;                // one sub-group of master read back from NVMe
  // Not streamed: the runs of groups whose new values publish_pass() narrows from the master
  // (needs_master_copy(), not frozen), each a span of the partition, in order.
  std::vector<Span> copied_runs_;
  std::uint64_t master_read_bytes_ = 0;
  // master_loaded(): the element up to which the master was rounded into the values, in order,
  // since element 0 (or since range_.begin after update_master_range()).
  static constexpr std::size_t kNotLoaded = SIZE_MAX;
  std::size_t loaded_elements_ = 0;
  // update_master_range() of less than the partition, or of some groups unchanged: its groups
  // and their span, and which of them it changes (empty: all), until write_loaded().
  bool ranged_ = false;
  GroupSpan range_;
  std::vector<std::uint32_t> changed_;
};

// Streamed when the state is on NVMe, every group is of one half dtype, and the shards are not
// in host memory; from the store when every group is of one half dtype otherwise.
Publish publish_way(const Config& config, const ParameterLayout& layout) {
  const ZeroConfig& z = config.zero;
  const bool shards_on_host = z.stage == 3 && z.offload_param.device == OffloadDevice::kHost;
  if (!layout.all_one_half()) return Publish::kNarrowed;
  if (z.offload_optimizer.device == OffloadDevice::kNvme && !shards_on_host) {
    return Publish::kStreamed;
  }
  return Publish::kFromStore;
}

}  // namespace

StateStoreOptions store_options(const Config& config, const ParameterLayout& layout, int rank) {
  const ZeroConfig& z = config.zero;
  StateStoreOptions so;
  so.param_count = layout.partition_elements();
  so.sub_group_params = std::min(z.sub_group_size, layout.partition_elements());
  so.optimizer = config.optimizer.kind;
  so.grad_dtype = DType::kF32;
  so.with_half = layout.all_one_half();
  so.half_dtype = layout.half_dtype();
  const StoreMedium state_tier =
      z.offload_optimizer.device == OffloadDevice::kNvme ? StoreMedium::kNvme : StoreMedium::kHost;
  // validate() allows gradients_on_nvme only with the optimizer state on NVMe.
  const StoreMedium grad_tier = config.gradients_on_nvme ? StoreMedium::kNvme : StoreMedium::kHost;
  const bool streamed = publish_way(config, layout) == Publish::kStreamed;
  so.tiers = {state_tier, state_tier, state_tier, grad_tier,
              streamed ? StoreMedium::kBlock : StoreMedium::kHost};
  so.key_prefix = fmt::format("rank{}/opt", rank);
  // Frozen parameters in sub-groups of their own, which the pass passes over (StoreState::open).
  so.cuts = frozen_cuts(layout, rank);
  return so;
}

Result<std::unique_ptr<OptimizerState>> open_store_state(const StateContext& ctx) {
  auto state = std::make_unique<StoreState>(ctx, publish_way(*ctx.config, *ctx.layout));
  ZINF_RETURN_IF_ERROR(state->open());
  return std::unique_ptr<OptimizerState>(std::move(state));
}

}  // namespace zinf
