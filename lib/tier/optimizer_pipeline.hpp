// OptimizerPipeline: the optimizer step over a StateStore, sub-group by sub-group, in the fixed
// memory of a PinnedPool:
//
//   read sub-group i+1, i+2, ...  ||  update i  ||  write i-1, i-2, ...
//
// Each sub-group's NVMe pieces (StateStore) are read into one pool block, updated there by
// optimizer_step() (host pieces are updated in place, gradients read from wherever they are),
// and the pieces the step changes (fp32 master, moments, half-precision parameters) are written
// back from the same block; the block returns to the pool when its writes have landed, and is
// then used for the next sub-group's reads. Reads run ahead by as many sub-groups as there are
// free blocks, so with B blocks up to B - 1 sub-groups are being read or written while one is
// updated. Nothing is allocated per step: the in-flight records are sized at open() to the
// pool's block count, leases come from the pool, tickets from the swap space's fixed table.
//
// Threads: the caller's thread drives the I/O (submits reads and writes, which checksums them,
// verifies reads, reaps finished writes and starts reads in the blocks they free); an update
// thread, started at open() when anything is on NVMe (else the caller updates in place), runs each
// sub-group's update in a oneTBB arena of `threads` threads. So the I/O queue is fed while an
// update runs, not only between updates. When the driver has nothing to do it waits at most 100 us
// (or until the update ends) before polling again, so a block freed by a write starts its next read
// within about that long.
//
// Errors: a failure anywhere (a read or write's Status, a checksum mismatch, a timeout, the
// update itself) stops the step: no new I/O is started, an update already running is let finish
// and its sub-group written back, every I/O in flight is waited for (never is a block reused
// while I/O into it may still land), and the step returns a Status naming the
// step, the sub-group and what failed. The error is sticky: every later step() returns it, so
// training cannot continue on half-updated state (the one exception: a step its gate calls off
// before it updated anything, GradsReady). The store then says, for every sub-group,
// whether it holds the old step, the new step, or is torn (some of its writes failed): a sub-group
// is new only when all of its writes landed, old when none was submitted.
//
// A transfer that never completes. A read or write that has not landed after io_timeout fails
// the step with Status::timeout, but its block may still be under DMA, so the pipeline keeps
// waiting, at most io_timeouts_max waits of io_timeout in all; then it cancels the transfer
// (SwapSpace::cancel, IORING_OP_ASYNC_CANCEL on uring) and waits io_timeout once more. A
// cancelled write fails, so its pieces are lost and its sub-group torn; a cancelled read leaves
// the sub-group old. If even the cancel does not end it, the transfer is abandoned
// (SwapSpace::abandon: a write's pieces are lost, the sub-group torn) and its block is kept out
// of the pool (quarantined) for the pipeline's life, never reused while the device may write
// into it. The sticky error is then a timeout naming the step, sub-group, piece, swap extent
// key, file and offset, and how it ended ("cancelled" or "its block is quarantined"). So one
// stuck transfer holds the step for at most (io_timeouts_max + 1) * io_timeout (plus
// io_timeout when it is a read the driver was polling for); the drain after the error waits for
// each other transfer in flight under the same bound.
//
// The half-precision output on the block tier (StateStore::streams_half()): the update writes
// sub-group i's new bf16/f16 parameters into the block's params_half slot, which is never written
// to disk; the driver hands the slot to PipelineOptions::half_done (on the thread that called
// step(), in the step's order of sub-groups, once per sub-group of a full step) after submitting
// the sub-group's writes and before its block can go back to the pool. So the partition's half
// copy never exists whole: the caller (the engine) streams it into the parameter shards. A
// half_done error fails the step like an update error; a sub-group whose update finished only
// because the step was already failing is written back but not handed over.
//
// Frozen sub-groups (PipelineOptions::frozen_sub_groups): sub-groups that the caller says no step
// changes once their moments are zero (frozen parameters: a zero gradient, learning rate and
// weight decay 0; padding: zeros). A full update of such a sub-group checks its moments; when
// they are all zero (every byte) and its writes land, the store marks it settled
// (StateStore::settled()), and later steps pass over it: no read, no update, no write. It still
// goes through the step in its place, in order and behind the gate like any other, and is
// recorded as holding the step once those before it have been released. On the block tier only
// its master is read, to hand the half-precision copy of it (f32_to_bf16 / f32_to_f16, the bits
// the update gives) to half_done; on the host tier nothing at all. Where the caller keeps that
// half copy itself (PipelineOptions::frozen_half_kept: it did not change), not even the master
// is read, and half_done gets a null pointer for the sub-group, in its place in the order.
// kUpdateOnly passes over nothing. On NVMe, the moments of a frozen sub-group that a full update
// leaves zero are not written: their room is given back (StateStore::release_piece, kZero), and a
// later read of them fills the block with zeros without I/O. A released piece whose new value is
// still all zero bytes is never written back, in any mode and whether or not its sub-group settles
// (a frozen sub-group's exp_avg released while its exp_avg_sq still decays): it stays kZero, so a
// step takes no new disk blocks for it.
//
// Telemetry per step (StepStats) and, with a Trace, one span per sub-group for each read (from
// submission to the poll that saw it complete), update and write, on tracks "read", "update" and
// "write", named "read sg<i>" etc. ("... (io alone)" / "(update alone)" in the benchmark modes).
// Tracing formats a span name per span, so it allocates; leave it off for timing runs that care.
//
// Thread-safety: one thread calls step() at a time; the pipeline runs its own update threads.
#pragma once

#include <tbb/task_arena.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "device/pinned_pool.hpp"
#include "tier/state_store.hpp"
#include "zinf/optim.hpp"
#include "zinf/status.hpp"
#include "zinf/trace.hpp"

namespace zinf {

struct PipelineOptions {
  OptimizerParams optimizer;  // its kind must match StateStoreOptions::optimizer
  // Parameter groups. Empty: every element steps with `optimizer`. Else elements of the
  // partition from ranges[r].begin (to the next range's begin, the last to param_count) step
  // with groups[ranges[r].group]: each sub-group carries the pieces of the ranges it holds, and
  // its update is one optimizer_step() over them (include/zinf/optim.hpp). Every group must be
  // of the store's kind; ranges[0].begin is 0, the begins increase, and at most
  // kMaxOptimizerGroups groups.
  std::vector<OptimizerParams> groups;
  std::vector<OptimizerRange> ranges;
  // Threads of the update arena; 0: every core.
  int threads = 0;
  Simd simd = Simd::kAuto;
  std::size_t tile_elements = 0;  // 0: optimizer_step's default
  // Longest wait for one sub-group's I/O before the step fails with Status::timeout.
  std::chrono::milliseconds io_timeout = std::chrono::seconds(120);
  // Waits of io_timeout that one read or write may run out before the pipeline gives up on it:
  // it asks the engine to cancel the transfer and waits io_timeout once more. 0: wait forever
  // (warning after each io_timeout). See "A transfer that never completes" above.
  std::uint32_t io_timeouts_max = 3;
  // Blocks of the pool the step may hold at once; 0: all of them. At least 2.
  std::size_t max_blocks = 0;
  // Spans for every read, update and write when set; must outlive the pipeline.
  Trace* trace = nullptr;
  // Required when the store's half piece is on the block tier (see the file comment): takes
  // sub-group i's new half-precision parameters (store.sub_group_size(i) elements), valid only
  // during the call. Called on the step()'s thread; must not allocate if steps are to stay
  // allocation-free. An error fails the step.
  std::function<Status(std::size_t sub_group, const std::byte* half)> half_done;
  // Empty, or one flag per sub-group of the store: true for a sub-group every element of which a
  // step leaves as it is while its moments are zero (see "Frozen sub-groups" above). REQUIRES:
  // the caller keeps such a sub-group's gradients zero and steps its elements with learning rate
  // and weight decay 0 (or they are zero padding).
  std::vector<bool> frozen_sub_groups;
  // Empty, or one flag per sub-group of the store: true for a frozen sub-group whose half output
  // the caller does not need when the step passes over it (it keeps the half copy, which a
  // passed-over sub-group leaves as it was). Passed over, such a sub-group reads nothing, and
  // half_done is called with a null `half` for it. Only with the half piece on the block tier.
  std::vector<bool> frozen_half_kept;
};

enum class StepMode : std::uint8_t {
  kFull = 0,  // read, update, write: the optimizer step
  // Benchmarks only. kIoOnly: the identical reads and writes with no update (the values written
  // are those read, and the half-precision piece gets whatever the block held; a released piece,
  // kZero, is neither read nor written, as in a full step). kUpdateOnly: the identical updates,
  // sub-group by sub-group, on the pool's blocks as they are (sub-group i in block i mod blocks)
  // on the update thread, with no I/O; host pieces are updated in place.
  // Neither changes the versions the store records.
  kIoOnly = 1,
  kUpdateOnly = 2,
};

// Whether sub-group i's gradients are final, asked by a step with a gate before it updates i:
// > 0 yes, 0 not yet (asked again within about 100 us; the reads run ahead meanwhile), < 0 the
// step is called off (it fails with kAborted; sub-groups updated before it are new, the rest
// old). The error is sticky like any other, unless no sub-group was updated yet: then the store
// holds the previous step everywhere, nothing is lost, and the next step() may run (the
// overlapped step's reads ahead of a step that is then skipped). Called on the step()'s thread;
// must not block.
using GradsReady = int (*)(void* user, std::size_t sub_group);

// Whether a descending step may take the sub-groups not yet begun, [0, left), from the first up
// instead. Asked before the read of each such sub-group until it says yes; on the step()'s
// thread; must not block.
using MayAscend = bool (*)(void* user, std::size_t left);

struct StepArgs {
  std::int64_t step = 1;  // t, counting from 1 (see StepOptions::step)
  // 1 / loss scale times the clipping coefficient, decided before the step (the overflow check
  // and the gradient norm happen before any state is touched).
  float grad_scale = 1.0f;
  // With a gate: when set, each update reads the scale here instead of grad_scale, so a step
  // can begin (read ahead) before the scale is decided. Written before the gate first says yes;
  // the gate's answer must be an acquire of what the writer released after writing it.
  const float* late_grad_scale = nullptr;
  StepMode mode = StepMode::kFull;
  // The sub-groups from the last to the first (the order a backward pass finishes them in when
  // the partition follows the forward order), instead of first to last. The update is the same
  // either way; only the order of the reads, updates, writes and half_done calls changes.
  bool descending = false;
  // With a gate (kFull only), each sub-group is updated only once ready(ready_user, i) > 0: the
  // step can start while the gradients are still being reduced (the overlapped step's updates
  // during the backward pass). Reads run ahead into free blocks as always, so the pool still
  // bounds memory; a wait at the gate is not an I/O stall (io_timeout does not apply to it).
  GradsReady ready = nullptr;
  void* ready_user = nullptr;
  // Descending only: once ascend(ready_user, left) says yes, the step turns and takes the
  // sub-groups it has not begun from the first up (the overlapped step's pass, once the
  // backward is over: the next forward needs the first sub-groups first). The reads, updates,
  // writes and half_done calls of the sub-groups begun before go on in the descending order
  // first.
  MayAscend ascend = nullptr;
};

struct StepStats {
  std::int64_t step = 0;
  std::size_t sub_groups = 0;
  std::size_t sub_groups_passed = 0;  // settled frozen sub-groups the step passed over
  std::uint64_t read_bytes = 0;       // bytes read from NVMe
  std::uint64_t write_bytes = 0;      // bytes written to NVMe
  std::int64_t io_wait_ns = 0;  // the driver waiting for reads, for a block, or the last writes
  std::int64_t update_ns = 0;   // inside optimizer_step
  std::int64_t wall_ns = 0;
  std::size_t blocks_peak = 0;  // most pool blocks held at once
};

class OptimizerPipeline {
 public:
  // Checks that the pool fits the store (block_bytes >= store.block_bytes(), at least 2 blocks
  // when anything is on NVMe, enough swap ops for every block's pieces, and enough engine
  // requests for those ops: SwapSpace::op_requests against IoOptions::max_requests) and makes the
  // update arena. The store and pool must outlive the pipeline; the pool should be registered with
  // the swap space's engine. Errors: invalid_argument naming the mismatch.
  static Result<std::unique_ptr<OptimizerPipeline>> open(StateStore& store, PinnedPool* pool,
                                                         const PipelineOptions& options);
  ~OptimizerPipeline();
  OptimizerPipeline(const OptimizerPipeline&) = delete;
  OptimizerPipeline& operator=(const OptimizerPipeline&) = delete;

  // One step over every sub-group (see the file comment). REQUIRES (kFull): every NVMe piece the
  // step reads is on disk (written by write_piece or an earlier step) and every sub-group holds
  // step args.step - 1. Returns the stats, or the step's error (then sticky).
  Result<StepStats> step(const StepArgs& args);

  // Replaces the hyper-parameters for the following steps (a learning-rate schedule), without
  // re-opening: the pool, arena and update thread stay. REQUIRES: no step() is running.
  // Errors: invalid_argument when params.kind differs from the store's optimizer.
  Status set_optimizer_params(const OptimizerParams& params);
  // The same for parameter groups: `groups` replaces PipelineOptions::groups (the ranges stay).
  // Allocates nothing. Errors: invalid_argument when the count differs from the groups given at
  // open(), or a kind from the store's optimizer.
  Status set_group_params(std::span<const OptimizerParams> groups);

  // The sticky error (OK until a step fails).
  const Status& error() const { return error_; }
  const StepStats& last_stats() const { return stats_; }

  struct Entry;

 private:
  OptimizerPipeline(StateStore& store, PinnedPool* pool, const PipelineOptions& options);
  Status run_host_only(const StepArgs& args);
  Status run_update_only(const StepArgs& args);
  Status run_pipelined(const StepArgs& args);
  // Runs sub-group i's update (on the calling thread, in arena_); returns its duration in ns
  // through `ns`. `pass`: the sub-group is passed over (only its half output is made, when it
  // streams). *settles: a frozen sub-group's moments are all zero after the update.
  Status update(std::size_t i, std::byte* block, const StepArgs& args, bool pass, std::int64_t* ns,
                bool* settles);
  // Sub-group i is one of PipelineOptions::frozen_sub_groups.
  bool frozen(std::size_t i) const {
    return !options_.frozen_sub_groups.empty() && options_.frozen_sub_groups[i];
  }
  // Whether the step passes over sub-group i (frozen and settled; not in kUpdateOnly).
  bool passes(std::size_t i) const {
    return frozen(i) && store_.settled(i) && mode_ != StepMode::kUpdateOnly;
  }
  // Passed over, sub-group i's half output is not made: nothing of it is read, and half_done
  // gets a null pointer (PipelineOptions::frozen_half_kept).
  bool half_kept(std::size_t i) const {
    return !options_.frozen_half_kept.empty() && options_.frozen_half_kept[i];
  }
  // The update thread: hands one update over, and takes its result when it is done.
  void updater_main();
  void start_update(std::size_t i, std::byte* block, const StepArgs& args, bool pass);
  bool update_done();
  // Waits until the update ends or `timeout` passes; true when it ended.
  bool wait_update(std::chrono::microseconds timeout);
  Status take_update_result();
  // Waits for the update to end and takes its result.
  Status finish_update();
  // The non-blocking part of the loop: notes finished I/O, returns the blocks of sub-groups
  // whose writes landed, starts reads into free blocks.
  Status pump(const StepArgs& args);
  Status start_read(std::size_t p, PinnedPool::Lease lease, const StepArgs& args);
  bool reads_done(std::size_t p);
  Status finish_read(std::size_t p, const StepArgs& args);
  Status start_write(std::size_t p, const StepArgs& args);
  bool writes_done(std::size_t p);
  // Hands sub-group i's half output in `block` to options_.half_done (when it streams); a null
  // pointer when the step passed over it (`pass`) and the caller keeps its half copy.
  Status hand_half(std::size_t i, const std::byte* block, bool pass, const StepArgs& args);
  // True once every pending ticket of `pieces` at position p has finished.
  bool pieces_done(std::size_t p, const std::vector<Piece>& pieces);
  // Waits for position p's transfer of `piece` (`what`: "reading" / "writing") until it has
  // really ended, or gives up on it after io_timeouts_max timeouts (see the file comment); a
  // timeout is noted in *first, named, once. Returns the transfer's Status.
  Status wait_landed(std::size_t p, Piece piece, const char* what, const StepArgs& args,
                     Status* first);
  // Returns the entry's block to the pool, or to quarantine_ when a transfer into it was
  // abandoned.
  void return_block(Entry& e);
  // The timeout of a step whose driver waited io_timeout for position p's reads.
  Status stalled_read(std::size_t p, const StepArgs& args);
  // Redeems position p's write tickets, records its version, returns its block. Blocks for at most
  // io_timeout per ticket when `block` (then a timeout is an error, and the wait goes on).
  Status finish_write(std::size_t p, const StepArgs& args);
  // After a failure: waits for every I/O in flight, records versions, returns every block (or
  // quarantines it). Returns the first error seen.
  Status drain(const StepArgs& args);
  // The sub-group at position p of the running step's order: descending, from the last down
  // until the turn (StepArgs::ascend), then from the first up.
  std::size_t sub_group_at(std::size_t p) const {
    if (!descending_) return p;
    return p < turn_ ? store_.sub_group_count() - 1 - p : p - turn_;
  }
  // Before position p is begun: whether the step turns there (StepArgs::ascend).
  void maybe_turn(std::size_t p, const StepArgs& args) {
    const std::size_t n = store_.sub_group_count();
    if (!descending_ || args.ascend == nullptr || turn_ <= p || p == 0 || p >= n) return;
    if (args.ascend(args.ready_user, n - p)) turn_ = p;
  }
  // Whether the sub-group at position p may be updated (see StepArgs::ready): > 0 yes, 0 not
  // yet, < 0 called off.
  int gate(std::size_t p, const StepArgs& args) const {
    return args.ready == nullptr ? 1 : args.ready(args.ready_user, sub_group_at(p));
  }
  // The step's error when the gate calls it off before position p; notes p.
  Status called_off(std::size_t p, const StepArgs& args);
  // The first sub-group that is torn or does not hold step `step` (sub_group_count(): none).
  std::size_t first_not_holding(std::int64_t step) const;
  Entry& entry(std::size_t p);
  void trace_span(int track, const char* what, std::size_t i, std::int64_t start_ns,
                  std::int64_t end_ns);

  StateStore& store_;
  PinnedPool* pool_;
  PipelineOptions options_;
  std::unique_ptr<tbb::task_arena> arena_;
  std::size_t block_limit_ = 0;
  bool any_nvme_ = false;  // some piece is on NVMe: the pipelined step (else the host-only one)
  std::vector<Entry> entries_;  // ring of block_limit_ records; sub-group i uses i % size
  // Blocks into which an abandoned transfer may still land: never reused; returned to the pool
  // only when the pipeline is destroyed (a PinnedPool cannot be destroyed with leases out).
  std::vector<PinnedPool::Lease> quarantine_;
  std::vector<Piece> read_pieces_;   // NVMe pieces the step reads
  std::vector<Piece> write_pieces_;  // NVMe pieces the step writes
  // Positions in the step's order (sub_group_at()): [released_, updated_) are writing (or
  // written, not yet reaped), [updated_, read_) reading or read; below released_ done; from
  // read_ on untouched. [updated_, verified_) are read and checked, waiting for (or in) their
  // update. The private functions below that take a sub-group index `i` take a position when
  // they work on an Entry (entry(), the reads, the writes, the drain): each Entry records its
  // sub-group.
  std::size_t released_ = 0, updated_ = 0, verified_ = 0, read_ = 0;
  bool descending_ = false;  // the running step's order
  // Descending, the first position taken in ascending order (none: SIZE_MAX).
  std::size_t turn_ = static_cast<std::size_t>(-1);
  // The position before which the gate called the running step off (none: SIZE_MAX).
  std::size_t called_off_at_ = static_cast<std::size_t>(-1);
  std::size_t held_ = 0;
  // Update thread state, guarded by update_mutex_.
  std::thread updater_;
  std::mutex update_mutex_;
  std::condition_variable update_wake_, update_done_;
  bool update_pending_ = false, update_finished_ = false, updater_stop_ = false;
  std::size_t update_sub_group_ = 0;
  std::byte* update_block_ = nullptr;
  StepArgs update_args_;
  bool update_pass_ = false;
  Status update_status_;
  std::int64_t update_ns_ = 0;
  bool update_settles_ = false;
  // The driver's copy of update_settles_ for the update take_update_result() took.
  bool taken_settles_ = false;

  // The ranges each sub-group holds, relative to its first element: sub-group i's are
  // sub_ranges_[sub_range_first_[i], sub_range_first_[i + 1]). Empty without groups.
  std::vector<OptimizerRange> sub_ranges_;
  std::vector<std::size_t> sub_range_first_;

  Status error_;
  StepStats stats_;
  StepMode mode_ = StepMode::kFull;
  int read_track_ = -1, update_track_ = -1, write_track_ = -1;
};

}  // namespace zinf
