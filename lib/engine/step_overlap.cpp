// OverlappedStep and run_optimizer(): see step_overlap.hpp.
#include "engine/step_overlap.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "base/assert.hpp"

namespace zinf {

Status run_optimizer(OptimizerState& state, const ZeroCounters& counters, Trace* trace, int track,
                     std::int64_t step, float grad_scale, std::int64_t start_ns, bool overlapped,
                     StepReport& rep, const PassGate* gate) {
  // Streaming the half output, the shards are written during the optimizer pass; only this pass
  // writes shards (and counts their bytes) until it is over.
  const std::uint64_t param_writes = counters.param_nvme_write_bytes;
  {
    Trace::Span span(trace, track, "step optimizer");
    ZINF_ASSIGN_OR_RETURN(StepStats stats, gate != nullptr
                                               ? state.step_gated(step, grad_scale, *gate)
                                               : state.step(step, grad_scale));
    rep.optimizer_nvme_read_bytes = stats.read_bytes;
    rep.optimizer_nvme_write_bytes = stats.write_bytes;
  }
  const std::int64_t t3 = Trace::now_ns();
  rep.optimizer_ns = t3 - start_ns;
  {
    Trace::Span span(trace, track, "step publish");
    const std::uint64_t master_reads = state.master_read_bytes();
    ZINF_RETURN_IF_ERROR(overlapped ? state.write_step() : state.publish_step());
    rep.param_nvme_write_bytes = counters.param_nvme_write_bytes - param_writes;
    rep.master_nvme_read_bytes = state.master_read_bytes() - master_reads;
  }
  rep.publish_ns = Trace::now_ns() - t3;
  return Status::ok();
}

OverlappedStep::OverlappedStep(const Parts& parts) : parts_(parts) {
  const ParameterLayout& layout = *parts_.layout;
  persistent_done_.assign(layout.group_count(), 1);
  grads_zeroed_.assign(layout.group_count(), 1);
  reduced_.assign(layout.group_count(), 0);
  final_ = std::make_unique<std::atomic<std::uint8_t>[]>(layout.group_count());
  if (parts_.trace != nullptr) {
    track_ = parts_.trace->track(fmt::format("rank{} step", parts_.rank));
  }
  parts_.coord->set_issue_hook(&OverlappedStep::issue_hook, &OverlappedStep::may_prefetch, this);
}

OverlappedStep::~OverlappedStep() {
  // An open pass waits for gradients that will not come now: it fails at its gate, and runner_
  // (destroyed first) waits for it.
  if (open_) cancel();
}

Status OverlappedStep::gather(std::size_t m) {
  // The coordinator is shared with the pass's shard writes (publisher.hpp).
  std::unique_lock<std::mutex> lock(parts_.publisher->mutex());
  gather_lock_ = &lock;
  Status st = await_module(m);
  if (st.is_ok()) st = parts_.coord->gather(m);
  gather_lock_ = nullptr;
  return st;
}

Status OverlappedStep::await_module(std::size_t m) {
  ZINF_ASSERT(gather_lock_ != nullptr);
  Publisher& pub = *parts_.publisher;
  const std::vector<std::uint32_t>& groups = parts_.layout->module_groups(m);
  auto in = [&] {
    return std::all_of(groups.begin(), groups.end(),
                       [&](std::uint32_t g) { return pub.written(g); });
  };
  // The backward of an open pass's step takes the shards as they are (see the file comment):
  // they hold the previous pass's values, whose persistent groups are still all-gathered below.
  if (!open_ && runner_.running() && !groups.empty() && !in()) {
    if (pub.in_pass()) {
      const std::int64_t t0 = Trace::now_ns();
      pub.written_cv().wait(*gather_lock_, [&] { return in() || !pub.in_pass(); });
      const std::int64_t waited = Trace::now_ns() - t0;
      gather_wait_ns_ += waited;
      pass_waited_ns_ += waited;
    }
    if (!in()) {
      // The pass failed before it wrote this module: its error is the gather's.
      return Status::aborted(fmt::format(
          "gather('{}'): the optimizer step failed before its parameters were written: {}",
          parts_.layout->module_names()[m], pub.pass_error().to_string()));
    }
  }
  // The persistent groups by the flags start() reset, which every rank's calls move alike (a
  // rank that finished the pass early, in a local call, still all-gathers here with the others).
  bool any = false;
  for (std::uint32_t g : parts_.layout->module_groups(m)) {
    if (persistent_done_[g] != 0) continue;
    // An open pass has not begun on g (the engine gathers no module with a final group then):
    // the shard still holds the previous pass's values.
    ZINF_ASSERT(!open_ || final_[g].load(std::memory_order_relaxed) == 0);
    ZINF_RETURN_IF_ERROR(parts_.coord->publish_group(g));
    mark_published(g);
    any = true;
  }
  return any ? parts_.coord->publish_wait() : Status::ok();
}

Status OverlappedStep::issue_hook(void* user, std::size_t module) {
  return static_cast<OverlappedStep*>(user)->await_module(module);
}

bool OverlappedStep::may_prefetch(void* user, std::size_t module) {
  // A module whose last reduction was issued in this backward (a recorded order that gathers it
  // again after its reduction): the open pass may be writing its shards as soon as that
  // reduction has run, and a prefetch's reads are not waited for before (the program's own
  // gather is, through its stream; the engine refuses it once the groups are final).
  auto* self = static_cast<OverlappedStep*>(user);
  if (!self->open_) return true;
  const std::vector<std::uint32_t>& groups = self->parts_.layout->module_groups(module);
  return std::none_of(groups.begin(), groups.end(),
                      [&](std::uint32_t g) { return self->reduced_[g] != 0; });
}

Status OverlappedStep::clear_grads(std::span<const std::uint32_t> groups) {
  ZINF_ASSERT(parts_.reducer->zeroes_groups());
  Publisher& pub = *parts_.publisher;
  // An open pass is this step's: the pass that read these groups is finished.
  const bool beside_pass = runner_.running() && !open_;
  for (std::uint32_t g : groups) {
    if (grads_zeroed_[g] != 0) continue;
    if (beside_pass) {
      std::unique_lock<std::mutex> lock(pub.mutex());
      if (!pub.written(g) && pub.in_pass()) {
        const std::int64_t t0 = Trace::now_ns();
        pub.written_cv().wait(lock, [&] { return pub.written(g) || !pub.in_pass(); });
        pass_waited_ns_ += Trace::now_ns() - t0;
      }
      if (!pub.written(g)) {
        return Status::aborted(fmt::format(
            "reduce_gradients: the optimizer step failed before it read group {}'s gradients: {}",
            g, pub.pass_error().to_string()));
      }
    }
    // The pass is past g: its gradients were read, and nothing else of the pass touches them.
    parts_.reducer->zero_group(g);
    grads_zeroed_[g] = 1;
  }
  return Status::ok();
}

void OverlappedStep::begin(std::int64_t step, float grad_scale) {
  pass_step_ = step;
  pass_scale_ = grad_scale;
  pass_report_ = StepReport{};
  pass_waited_ns_ = 0;
}

void OverlappedStep::arm_next_backward() {
  const ParameterLayout& layout = *parts_.layout;
  // A frozen group is not all-gathered again: no pass changes it (publisher.hpp).
  pending_count_ = 0;
  for (std::uint32_t g = 0; g < layout.group_count(); ++g) {
    persistent_done_[g] = layout.persistent()[g] && layout.republished(g) ? 0 : 1;
    pending_count_ += persistent_done_[g] == 0 ? 1 : 0;
  }
  std::fill(grads_zeroed_.begin(), grads_zeroed_.end(), 0);
}

void OverlappedStep::start(std::int64_t step, float grad_scale) {
  begin(step, grad_scale);
  pass_gated_ = false;
  reads_only_ = false;
  arm_next_backward();
  parts_.publisher->begin_pass();
  pass_start_ns_ = Trace::now_ns();
  runner_.start(&OverlappedStep::run_pass, this);
}

void OverlappedStep::open_pass(std::int64_t step, float grad_scale) {
  ZINF_ASSERT(parts_.in_backward && !runner_.running());
  begin(step, grad_scale);
  reads_only_ = false;
  open_gated();
}

void OverlappedStep::open_reads(std::int64_t step) {
  ZINF_ASSERT(parts_.in_backward && !runner_.running());
  begin(step, 1.0f);
  reads_only_ = true;
  decided_ = false;
  open_gated();
}

void OverlappedStep::decide(float grad_scale) {
  ZINF_ASSERT(reads_only());
  decided_scale_ = grad_scale;
  decided_ = true;
  decided_ns_ = Trace::now_ns();
  // After the scale: the pass's gate acquires these.
  final_all();
}

Status OverlappedStep::call_off() {
  ZINF_ASSERT(reads_only());
  cancel();
  Status st = runner_.finish();
  open_ = false;
  // The gate's call-off (kAborted); or the pass found nothing to gate (this rank's partition
  // is empty) and ended. Anything else failed before the call-off.
  if (st.is_ok() || st.code() == Code::kAborted) return Status::ok();
  return st;
}

void OverlappedStep::open_gated() {
  pass_gated_ = true;
  for (std::uint32_t g = 0; g < parts_.layout->group_count(); ++g) {
    final_[g].store(0, std::memory_order_relaxed);
  }
  std::fill(reduced_.begin(), reduced_.end(), 0);
  cancelled_.store(false, std::memory_order_relaxed);
  final_count_.store(0, std::memory_order_relaxed);
  open_ = true;
  parts_.publisher->begin_pass();
  pass_start_ns_ = Trace::now_ns();
  runner_.start(&OverlappedStep::run_pass, this);
}

void OverlappedStep::final(std::span<const std::uint32_t> groups) {
  for (std::uint32_t g : groups) mark_final(g);
}

void OverlappedStep::final_all() {
  for (std::uint32_t g = 0; g < parts_.layout->group_count(); ++g) mark_final(g);
}

void OverlappedStep::mark_final(std::uint32_t g) {
  if (final_[g].exchange(1, std::memory_order_acq_rel) == 0) {
    final_count_.fetch_add(1, std::memory_order_release);
  }
}

void OverlappedStep::abandon() {
  ZINF_ASSERT(open_);
  cancel();
  (void)runner_.finish();  // kAborted, or the pass's own error: the engine has its own
  open_ = false;
}

void OverlappedStep::commit() {
  ZINF_ASSERT(open_);
  open_ = false;
  arm_next_backward();
}

int OverlappedStep::range_final(void* user, std::size_t first, std::size_t count) {
  auto* self = static_cast<OverlappedStep*>(user);
  if (self->cancelled_.load(std::memory_order_acquire)) return -1;
  const ParameterLayout& layout = *self->parts_.layout;
  const std::size_t end = first + count;
  // The first group ending after `first`, then each group starting before `end`.
  for (std::uint32_t g = layout.first_group_ending_after(first);
       g < layout.group_count() && layout.offset(g) < end; ++g) {
    if (layout.group(g).shard_element_count == 0) continue;
    if (self->final_[g].load(std::memory_order_acquire) == 0) return 0;
  }
  return 1;
}

bool OverlappedStep::may_ascend(void* user, std::size_t end) {
  auto* self = static_cast<OverlappedStep*>(user);
  // Only once every group is final (the backward is over: the last reductions ran, or step()
  // made them final), and only where the publisher's stream can turn: at a group's start, or
  // inside a group whose shard is written in parts (not on NVMe).
  const ParameterLayout& layout = *self->parts_.layout;
  if (self->final_count_.load(std::memory_order_acquire) < layout.group_count()) return false;
  return self->parts_.publisher->can_turn_at(end);
}

// On the runner's thread.
Status OverlappedStep::run_pass(void* user) {
  auto* self = static_cast<OverlappedStep*>(user);
  const Parts& p = self->parts_;
  // pass_gated_ and reads_only_ were set before the runner started; the rank's thread leaves them
  // alone while the pass runs (open_ is the rank's thread's own and changes at commit()).
  PassGate gate;
  gate.ready = &OverlappedStep::range_final;
  gate.user = self;
  if (self->reads_only_) {
    // Ascending: the sub-groups read ahead are the first the next forward gathers.
    gate.grad_scale = &self->decided_scale_;
  } else {
    gate.descending = true;
    gate.ascend = &OverlappedStep::may_ascend;
  }
  Status st = run_optimizer(*p.state, *p.counters, p.trace, self->track_, self->pass_step_,
                            self->pass_scale_, self->pass_start_ns_, /*overlapped=*/true,
                            self->pass_report_, self->pass_gated_ ? &gate : nullptr);
  self->pass_end_ns_ = Trace::now_ns();
  p.publisher->end_pass(st);
  return st;
}

Status OverlappedStep::finish(bool collective) {
  ZINF_ASSERT(!open_);
  ParamCoordinator& coord = *parts_.coord;
  if (runner_.running()) {
    const std::int64_t t0 = Trace::now_ns();
    ZINF_RETURN_IF_ERROR(runner_.finish());
    pass_waited_ns_ += Trace::now_ns() - t0;
    {
      // Every shard write's copy done before the next pass refills the values.
      std::lock_guard<std::mutex> lock(parts_.publisher->mutex());
      ZINF_RETURN_IF_ERROR(coord.wait_writes());
    }
    // The groups a reduction of the next step has not zeroed count as never reduced; their
    // sums are zeroed by the first reduction into them (clear_grads()), or all here where the
    // accumulator cannot be zeroed by group.
    GradReducer& reducer = *parts_.reducer;
    if (reducer.zeroes_groups()) {
      for (std::uint32_t g = 0; g < grads_zeroed_.size(); ++g) {
        if (grads_zeroed_[g] == 0) reducer.forget_group(g);
      }
    } else {
      reducer.zero();
      std::fill(grads_zeroed_.begin(), grads_zeroed_.end(), 1);
    }
    last_pass_ = pass_report_;
    // A pass that read ahead waited at its gate from open_reads() to decide(): its time counts
    // from the decision (the reads before it are the part the backward hid).
    const std::int64_t begun = reads_only_ ? decided_ns_ : pass_start_ns_;
    last_pass_.optimizer_ns -= begun - pass_start_ns_;
    const std::int64_t pass_ns = pass_end_ns_ - begun;
    last_pass_.hidden_ns = std::max<std::int64_t>(0, pass_ns - pass_waited_ns_);
  }
  return collective ? publish_pending() : Status::ok();
}

void OverlappedStep::mark_published(std::uint32_t g) {
  ZINF_ASSERT(persistent_done_[g] == 0 && pending_count_ > 0);
  persistent_done_[g] = 1;
  --pending_count_;
}

Status OverlappedStep::publish_pending() {
  // Nothing left by the last pass (the gathers published it all, or an earlier call did): no
  // collective, and no walk over the groups.
  if (pending_count_ == 0) return Status::ok();
  ParamCoordinator& coord = *parts_.coord;
  std::lock_guard<std::mutex> lock(parts_.publisher->mutex());
  // In group order, up to the last pending group.
  for (std::uint32_t g = 0; pending_count_ > 0; ++g) {
    ZINF_ASSERT(g < parts_.layout->group_count());
    if (persistent_done_[g] != 0) continue;
    // Marked before the call: a failed all-gather is sticky, and no later call retries it.
    mark_published(g);
    ZINF_RETURN_IF_ERROR(coord.publish_group(g));
  }
  return coord.publish_wait();
}

void OverlappedStep::take_figures(StepReport& rep) {
  rep.optimizer_ns = last_pass_.optimizer_ns;
  rep.publish_ns = last_pass_.publish_ns;
  rep.hidden_ns = last_pass_.hidden_ns;
  rep.optimizer_nvme_read_bytes = last_pass_.optimizer_nvme_read_bytes;
  rep.optimizer_nvme_write_bytes = last_pass_.optimizer_nvme_write_bytes;
  rep.param_nvme_write_bytes = last_pass_.param_nvme_write_bytes;
  rep.master_nvme_read_bytes = last_pass_.master_nvme_read_bytes;
  rep.gather_wait_ns = std::exchange(gather_wait_ns_, 0);
  last_pass_ = StepReport{};
}

}  // namespace zinf
