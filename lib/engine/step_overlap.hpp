// OverlappedStep: the engine's side of the overlapped optimizer step (zinf.overlap_step). It owns
// the step runner's thread and what the rank's thread and the pass share: which groups of the
// running pass are written (through the publisher), which persistent groups are all-gathered,
// and the pass's figures for the next StepReport.
//
// step() decides the step on the rank's thread and calls start(); the runner's thread then runs
// the optimizer pass and the shard writes (run_optimizer() below, as the sequential step does),
// and the publisher counts the groups written, in group order. gather(m) (and the coordinator's
// prefetch of m, through the issue hook) waits until m's last group is written, then all-gathers
// m's persistent groups itself, so every collective is still issued by the rank's thread in the
// same order on every rank. The backward of the next step runs beside the pass too: before
// reduce_gradients(m) adds into a group, clear_grads() waits until the pass has written that
// group (so it has read the group's gradients: the pass reads sub-groups in partition order and
// writes a group only after its last sub-group is updated) and zeroes the group's slice of the
// accumulator, once per pass. finish() is called by whatever needs the whole step (step(),
// checkpoints, read-back, and reduce_gradients() when the accumulator cannot be zeroed by group):
// it waits for the pass and all-gathers the persistent groups no gather asked for (in group
// order). The groups no reduction zeroed yet keep the pass's gradients until the first
// reduction into them (clear_grads() again, then without waiting): finish() only resets their
// counts (GradReducer::forget_group), so a pass opened in the next backward does not first
// zero the whole accumulator on the rank's thread.
//
// Updates during the backward (Parts::in_backward: no clipping, no loss scaling, gradients in
// host memory, stage 2 or 3). The engine opens the pass of step t (open_pass()) as soon as the
// last micro-batch's first reduction is in, instead of at step(): the pass runs from the last
// sub-group to the first (the order the backward finishes them in), and updates each sub-group
// once final() was called for every group it overlaps (the reductions into them have run); its
// reads run ahead into the pool as always. Until step() commits the pass (commit()), the
// backward's gathers take the shards as they are (a module's shards change only once its
// gradients are final, and the backward gathers no module after its reduction) and its
// reductions add into groups the pass does not read yet, so nothing waits for the pass; after
// commit() everything is as for a pass started by start(). finish() cannot end an open pass (it
// needs the rest of the backward): the engine refuses calls that need the whole step while one
// is open; cancel() calls it off (the pass then fails, and the engine's error is sticky).
//
// Reads ahead during the backward (the same runs but with gradient_clipping, or loss scaling:
// step() must see every gradient before it knows the scale, or whether the step is skipped).
// The engine opens the pass at the same point with open_reads(): no group is final, so the
// pass only reads its first sub-groups' state into the pool (as many as the pool holds; nothing
// with the state in host memory), ascending, the order the next forward gathers them in, and
// waits. step() decides the step: on decide(scale) every group is final and the pass updates
// with that scale (read at each update), from the sub-groups it read ahead on; then commit(). A
// skipped step, or a call the updating pass refuses (one that needs the whole state, a new rate
// or schedule, more micro-batches than declared), calls it off instead (call_off()): the pass
// has updated nothing, the state is as it was, and the engine goes on as if no pass had opened.
// The pass's figures count from decide().
//
// Nothing is allocated per step: the thread and the per-module and per-group tables are made at
// construction.
//
// Thread-safety: every call from the rank's thread; the pass runs on the runner's.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "engine/layout.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/publisher.hpp"
#include "engine/step_runner.hpp"
#include "zero/grad_reducer.hpp"
#include "zero/param_coordinator.hpp"
#include "zero/zero_counters.hpp"
#include "zinf/engine.hpp"
#include "zinf/trace.hpp"

namespace zinf {

// The optimizer pass of step `step` (gradients times grad_scale) and the new values into the
// shards, timed on `track` as "step optimizer" and "step publish": rep.optimizer_ns counts from
// `start_ns` (the sequential step's norm end, the overlapped pass's start), and the NVMe byte
// figures are those of this pass. `overlapped`: write_step() (the shards only; the persistent
// groups are left to the rank's thread) instead of publish_step().
// `gate`: the pass updates each sub-group only when the gate says its gradients are final
// (OptimizerState::step_gated()); null: step().
Status run_optimizer(OptimizerState& state, const ZeroCounters& counters, Trace* trace, int track,
                     std::int64_t step, float grad_scale, std::int64_t start_ns, bool overlapped,
                     StepReport& rep, const PassGate* gate = nullptr);

class OverlappedStep {
 public:
  // What the pass works on; everything must outlive this object.
  struct Parts {
    const ParameterLayout* layout = nullptr;
    Publisher* publisher = nullptr;
    ParamCoordinator* coord = nullptr;
    OptimizerState* state = nullptr;
    GradReducer* reducer = nullptr;
    const ZeroCounters* counters = nullptr;
    Trace* trace = nullptr;
    int rank = 0;
    bool in_backward = false;  // open_pass() may be used (see the file comment)
  };

  // Makes the runner's thread and sets the coordinator's issue hook (so its prefetch of a module
  // waits for the module's new values too).
  explicit OverlappedStep(const Parts& parts);
  // Calls off an open pass, then waits for a pass in flight.
  ~OverlappedStep();
  OverlappedStep(const OverlappedStep&) = delete;
  OverlappedStep& operator=(const OverlappedStep&) = delete;

  // The engine's gather of module m: waits for m's new values, all-gathers its persistent groups
  // the pass left, then gathers m; under the publisher's mutex. Collective, as gather() is.
  Status gather(std::size_t m);
  // Before a reduction into `groups`: zeroes each group's gradients that a pass has read (or is
  // still to read) once per pass, first waiting, while that pass runs, until it has written
  // the group (and so read its gradients). Local: no collective. An error when the pass failed
  // first (finish() returns its own). REQUIRES: the reducer's zeroes_groups().
  Status clear_grads(std::span<const std::uint32_t> groups);
  // Hands step `step` (gradients times grad_scale) to the runner. REQUIRES: !running().
  void start(std::int64_t step, float grad_scale);
  // Starts step `step`'s pass during its backward: each sub-group is updated once every group it
  // overlaps is final(). REQUIRES: Parts::in_backward, !running().
  void open_pass(std::int64_t step, float grad_scale);
  // Starts step `step`'s pass during its backward, reading ahead only: nothing is updated until
  // decide(). REQUIRES: Parts::in_backward, !running().
  void open_reads(std::int64_t step);
  // The open pass reads ahead only (open_reads(), not yet decide()d).
  bool reads_only() const { return open_ && reads_only_ && !decided_; }
  // step() decided the step: the pass may update every sub-group, with `grad_scale`.
  // REQUIRES: reads_only().
  void decide(float grad_scale);
  // Ends a pass that reads ahead only: it updated nothing, and nothing is open or running after
  // it. The pass's kAborted (the gate's call-off) is expected; another error (a read that failed
  // before the call-off) comes back. REQUIRES: reads_only().
  Status call_off();
  // The last micro-batch's reductions into `groups` were issued: final() follows once they have
  // run, and from now the coordinator prefetches none of their modules (may_prefetch()).
  void note_reduced(std::span<const std::uint32_t> groups) {
    for (std::uint32_t g : groups) reduced_[g] = 1;
  }
  // The reductions into `groups` have run: the open pass may update them.
  void final(std::span<const std::uint32_t> groups);
  // Some of `groups` is final() for the open pass: its shard may be new already.
  bool any_final(std::span<const std::uint32_t> groups) const {
    for (std::uint32_t g : groups) {
      if (final_[g].load(std::memory_order_relaxed) != 0) return true;
    }
    return false;
  }
  // step() takes the open pass as the step's (see the file comment). REQUIRES: open().
  void commit();
  // Calls an open pass off: it fails at its next sub-group not yet updated. REQUIRES: open().
  void cancel() { cancelled_.store(true, std::memory_order_release); }
  // cancel(), then waits for the pass to end (its drain is bounded by the I/O timeouts): nothing
  // is open or running after it. For an engine that failed with a pass open.
  void abandon();
  // Every group is final for the open pass.
  void final_all();
  // open_pass() or open_reads() was called, and neither commit(), call_off() nor abandon() since.
  bool open() const { return open_; }
  // The open pass's step and grad_scale (open_pass()'s).
  std::int64_t pass_step() const { return pass_step_; }
  float pass_scale() const { return pass_scale_; }
  // A pass was started and not finished.
  bool running() const { return runner_.running(); }
  // Waits for the pass; its error comes back here (the engine makes it sticky). `collective`:
  // every rank calls this at the same point, so the persistent groups no gather published are
  // all-gathered too, in group order; local calls (verify_swap(), counters(), errors) leave them
  // for the next collective one.
  Status finish(bool collective);
  // All-gathers the persistent groups no gather published since the last pass (in group order),
  // as finish(true) does. Collective. For step() of a pass that reads ahead, so that its
  // collectives are those of a rank whose pass was called off (which finishes at step()).
  // With none left it returns at once: no walk over the groups, no collective (a count of them is
  // kept). REQUIRES: no pass updating (none running, or one that reads ahead only).
  Status publish_pending();
  // The last finished pass's figures, and the gathers' waits since the last call, into an
  // overlapped step's report (zero before the first pass).
  void take_figures(StepReport& rep);

 private:
  // With gather_lock_ held (the publisher's mutex), on the rank's thread.
  Status await_module(std::size_t m);
  static Status issue_hook(void* user, std::size_t module);
  static bool may_prefetch(void* user, std::size_t module);
  static Status run_pass(void* user);
  // The open pass's gate (PassGate::ready): every group overlapping the elements is final.
  static int range_final(void* user, std::size_t first, std::size_t count);
  // The open pass's turn (PassGate::ascend): once every group is final, where the publisher's
  // stream can turn (Publisher::can_turn_at), the pass takes the sub-groups below `end` from the
  // first up, the order the next forward gathers them in.
  static bool may_ascend(void* user, std::size_t end);
  void mark_final(std::uint32_t g);  // final_[g], counted once
  void begin(std::int64_t step, float grad_scale);
  // open_pass() and open_reads(): a gated pass on the runner, open until commit().
  void open_gated();
  // Per pass (start() or commit()): the persistent groups to all-gather, the groups whose
  // gradients the next backward must wait for.
  void arm_next_backward();
  // persistent_done_[g] set, pending_count_ kept: the persistent group g is all-gathered (or its
  // all-gather was tried) since the pass began.
  void mark_published(std::uint32_t g);

  Parts parts_;
  int track_ = 0;                              // the trace track of the runner's spans
  std::vector<std::uint8_t> persistent_done_;  // per group: all-gathered since the pass began
  // The groups whose persistent_done_ is 0, so that publish_pending() with none (every settle()
  // of a write_parameters() loop) costs nothing, not a walk over every group.
  std::uint32_t pending_count_ = 0;
  std::vector<std::uint8_t> grads_zeroed_;  // per group: zeroed since a pass read it
  std::vector<std::uint8_t> reduced_;       // per group: note_reduced() since the pass opened
  std::unique_lock<std::mutex>* gather_lock_ = nullptr;  // gather()'s, for the issue hook
  std::int64_t pass_step_ = 0;
  float pass_scale_ = 1.0f;
  StepReport pass_report_;   // the running pass's optimizer and publish figures
  bool open_ = false;        // an open pass, not yet committed
  bool pass_gated_ = false;  // the running pass was opened by open_pass() or open_reads()
  bool reads_only_ = false;  // ... by open_reads()
  bool decided_ = false;     // decide() was called for it
  // decide()'s scale: written by the rank's thread before the groups become final, read by the
  // pass's updates after its gate saw them final.
  float decided_scale_ = 1.0f;
  std::int64_t decided_ns_ = 0;  // when decide() was called (the rank's thread's own)
  // Per group: its gradients are final for the open pass (written by the rank's thread, read by
  // the pass's gate).
  std::unique_ptr<std::atomic<std::uint8_t>[]> final_;
  std::atomic<bool> cancelled_{false};
  std::atomic<std::uint32_t> final_count_{0};  // groups final for the open pass
  std::int64_t pass_start_ns_ = 0;
  std::int64_t pass_end_ns_ = 0;
  std::int64_t pass_waited_ns_ = 0;  // the rank's thread waiting for the running pass
  StepReport last_pass_;             // the finished pass's figures, for the next report
  std::int64_t gather_wait_ns_ = 0;  // gathers waiting for new values since the last step()
  // Last: its destructor waits for a pass in flight, which uses everything above.
  StepRunner runner_;
};

}  // namespace zinf
