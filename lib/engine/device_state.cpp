// DeviceState: the optimizer state in device memory (offload_optimizer "none" on a device that
// is not host-accessible), stepped by DeviceOptimizer. The host sees only what it asks for: the
// norm, and the master or moments read back in bounded chunks; the new values go from the device
// optimizer's buffers straight into the shards. The frozen parameters' runs (the frozen group's,
// param_groups.hpp) are the device optimizer's frozen runs: their moments take no device memory,
// nor do the gradients of a frozen group (the reducer is given no room for it), nor, where their
// bf16/f16 copy holds it exactly, their fp32 master (device_optimizer.hpp: half-only runs; every
// read of the master below widens that copy).
#include <algorithm>
#include <vector>

#include "base/aligned.hpp"
#include "engine/device_optimizer.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/param_groups.hpp"
#include "zero/grad_reducer.hpp"

namespace zinf {
namespace {

// Which state DeviceOptimizer::read_state and write_state mean by `piece`.
int piece_index(Piece piece) {
  return piece == Piece::kParams ? 0 : piece == Piece::kExpAvg ? 1 : 2;
}

class DeviceState final : public InMemoryState {
 public:
  explicit DeviceState(const StateContext& ctx) : InMemoryState(ctx) {}

  // The initial master built on the host once, uploaded, and rounded into the publisher's
  // buffer for the first placement.
  Status open() {
    std::vector<DeviceOptimizer::Group> groups;
    for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
      const GroupInfo& info = layout_.group(g);
      groups.push_back(
          {layout_.offset(g), info.shard_element_count, layout_.byte_offset(g), info.dtype});
    }
    AlignedBuffer master(std::max<std::size_t>(partition_elements_, 1) * sizeof(float));
    ZINF_RETURN_IF_ERROR(layout_.fill_master(0, partition_elements_, master.as<float>()));
    pub_.allocate_buffer();
    narrow_all(0, partition_elements_, master.as<const float>());
    std::vector<OptimizerRange> ranges = context_ranges(ctx_);
    std::vector<bool> frozen = frozen_ranges(ctx_, ranges);
    ZINF_ASSIGN_OR_RETURN(
        opt_, DeviceOptimizer::create(*ctx_.device, std::move(groups), partition_elements_,
                                      master.as<const float>(), ctx_.timeout, std::move(ranges),
                                      std::move(frozen), /*pack_grads=*/true));
    return Status::ok();
  }

  // The device optimizer's groups are the partitioner's: a frozen group of frozen runs only has
  // no room in the accumulator, which the reducer never writes.
  GradTarget grad_target() override {
    static_assert(DeviceOptimizer::kNoGrad == GradReducerOptions::kNoRoom);
    return {.accumulator = opt_->grads(), .on_device = true, .group_offsets = opt_->grad_offsets()};
  }
  Result<double> local_sum_of_squares() override { return opt_->sum_of_squares(); }
  Result<StepStats> step(std::int64_t step, float grad_scale) override {
    ZINF_RETURN_IF_ERROR(opt_->step(step, grad_scale, groups_));
    return StepStats{};
  }
  // The frozen groups' shards are left as they are: the step did not change them
  // (publisher.hpp).
  Status publish_step() override {
    ParamCoordinator& coord = pub_.coordinator();
    for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
      if (!layout_.republished(g)) continue;
      ZINF_RETURN_IF_ERROR(coord.write_shard_from_device(g, opt_->values(g)));
    }
    return pub_.publish(/*frozen_too=*/false);
  }
  // The master rounded on the host into the publisher's buffer, which is freed again after:
  // the device optimizer publishes from device memory. (A buffer kept after a failed write,
  // free_buffer_after(), is reused rather than freed under copies that may still read it.)
  Status publish_master(bool gather_persistent) override {
    if (pub_.buffer_bytes() == 0) pub_.allocate_buffer();
    Status st = read_master(0, partition_elements_,
                            [&](std::size_t first, std::size_t count, const float* src) {
                              narrow_all(first, count, src);
                            });
    if (st.is_ok()) st = write_buffer(gather_persistent);
    free_buffer_after(st);
    return st;
  }
  // After update_master_range(): only its changed groups' values come down, are rounded into
  // the publisher's buffer and written to their shards.
  Status write_loaded() override {
    if (!ranged_) return publish_master(/*gather_persistent=*/false);
    ranged_ = false;
    if (pub_.buffer_bytes() == 0) pub_.allocate_buffer();
    // Each run of changed groups read in one go.
    Status st;
    for (std::uint32_t g = range_.first_group; g < range_.end_group && st.is_ok();) {
      if (!chosen_group(changed_, g)) {
        ++g;
        continue;
      }
      std::uint32_t end_group = g + 1;
      while (end_group < range_.end_group && chosen_group(changed_, end_group)) ++end_group;
      const GroupSpan run = group_run(layout_, g, end_group);
      st = read_master(run.begin, run.end,
                       [&](std::size_t first, std::size_t count, const float* src) {
                         narrow_all(first, count, src);
                       });
      g = end_group;
    }
    if (st.is_ok()) {
      st = pub_.write_group_shards(
          [&](std::uint32_t g) -> const std::byte* { return pub_.buffer(g); }, range_.first_group,
          range_.end_group, changed_);
    }
    if (st.is_ok()) st = pub_.wait_writes();
    free_buffer_after(st);
    return st;
  }
  // The range widened to whole groups, through the host chunk: read, changed, written back.
  Status update_master_range(std::size_t begin, std::size_t end,
                             std::span<const std::uint32_t> changed, StateFill fill) override {
    end = std::min(end, partition_elements_);
    ranged_ = false;
    if (begin >= end) return Status::ok();
    // With a list of changed groups the update is ranged, even over the whole partition.
    ranged_ = widen_to_groups(layout_, &begin, &end, &range_) || !changed.empty();
    changed_.assign(changed.begin(), changed.end());
    std::vector<float> chunk(std::min(end - begin, chunk_elements()));
    for (std::size_t first = begin; first < end; first += chunk.size()) {
      const std::size_t count = std::min(chunk.size(), end - first);
      ZINF_RETURN_IF_ERROR(opt_->read_master(first, count, chunk.data()));
      ZINF_RETURN_IF_ERROR(fill(first, count, chunk.data()));
      // An inexact value gives a master back to the half-only runs of [begin, end) only: a write
      // of one frozen tensor leaves the rest of the frozen base half-only.
      ZINF_RETURN_IF_ERROR(
          opt_->write_state(piece_index(Piece::kParams), first, count, chunk.data(), begin, end));
    }
    return Status::ok();
  }
  Status place_initial() override {
    Status st = write_buffer();
    free_buffer_after(st);
    return st;
  }

  // Only the elements asked for come down, in bounded chunks.
  Status read_master(std::size_t begin, std::size_t end, MasterVisitor fn) override {
    const std::size_t lo = std::min(begin, partition_elements_);
    const std::size_t hi = std::min(end, partition_elements_);
    std::vector<float> values(std::min(hi - lo, chunk_elements()));
    for (std::size_t first = lo; first < hi; first += values.size()) {
      const std::size_t count = std::min(values.size(), hi - first);
      ZINF_RETURN_IF_ERROR(opt_->read_master(first, count, values.data()));
      fn(first, count, values.data());
    }
    return Status::ok();
  }
  Status read_state(Piece piece, StateVisitor fn) override {
    return read_state_range(piece, 0, partition_elements_, fn);
  }
  // Only the elements asked for come down, as read_master's.
  Status read_state_range(Piece piece, std::size_t begin, std::size_t end,
                          StateVisitor fn) override {
    const std::size_t lo = std::min(begin, partition_elements_);
    const std::size_t hi = std::min(end, partition_elements_);
    std::vector<float> chunk(std::min(hi - lo, chunk_elements()));
    for (std::size_t first = lo; first < hi; first += chunk.size()) {
      const std::size_t count = std::min(chunk.size(), hi - first);
      ZINF_RETURN_IF_ERROR(opt_->read_state(piece_index(piece), first, count, chunk.data()));
      ZINF_RETURN_IF_ERROR(fn(first, count, chunk.data()));
    }
    return Status::ok();
  }
  // A checkpoint load of the whole partition: an inexact master value gives every half-only run
  // its master at once (one reallocation, however many chunks).
  Status write_state(Piece piece, StateFill fill) override {
    if (piece == Piece::kParams) ranged_ = false;
    std::vector<float> chunk(chunk_elements());
    for (std::size_t first = 0; first < partition_elements_; first += chunk.size()) {
      const std::size_t count = std::min(chunk.size(), partition_elements_ - first);
      ZINF_RETURN_IF_ERROR(fill(first, count, chunk.data()));
      ZINF_RETURN_IF_ERROR(opt_->write_state(piece_index(piece), first, count, chunk.data()));
    }
    return Status::ok();
  }

  void add_memory(MemoryReport& report) const override {
    report.device_bytes += opt_->device_bytes();
  }

 private:
  // Device-resident state moves through a host chunk of at most 4 Mi elements (16 MiB), never
  // more than the partition holds.
  std::size_t chunk_elements() const {
    constexpr std::size_t kChunkElements = std::size_t{4} << 20;
    return std::min(kChunkElements, std::max<std::size_t>(partition_elements_, 1));
  }
  // Frees the publisher's buffer once no copy queued from it can still read it; `st` is what
  // the publish returned. After a publish that succeeded every copy from the buffer was waited
  // for (publish(), or wait_writes() in write_buffer()). One that failed part way returned
  // without waiting: a copy up queued before the failure (a persistent group's, into its
  // gathered buffer on the coordinator's stream) may still be running, and on the opaque
  // HostDevice it does run later, on the stream's worker thread (CUDA stages a pageable source
  // before copy_async() returns), so freeing the buffer then is a use after free. The copies are
  // waited for (drain_writes(): the wait's own status, not the coordinator's sticky error), and
  // `st` stays the result. Where that wait cannot vouch for them (it runs out, or the stream
  // failed), the buffer is kept instead: such a failure leaves the engine failed for good (a
  // load or write_parameters is sticky, a finalize is refused), and the engine's teardown waits
  // for the coordinator's stream before the publisher, which owns the buffer, goes.
  void free_buffer_after(const Status& st) {
    if (st.is_ok() || pub_.drain_writes().is_ok()) pub_.free_buffer();
  }

  void narrow_all(std::size_t first, std::size_t count, const float* src) {
    pub_.narrow_groups(
        first, count, src, [](std::uint32_t) { return true; },
        [&](std::uint32_t g) { return pub_.buffer(g); });
  }

  std::unique_ptr<DeviceOptimizer> opt_;
  // update_master_range() of less than the partition, or of some groups unchanged: its groups
  // and their span, and which of them it changes (empty: all), until write_loaded().
  bool ranged_ = false;
  GroupSpan range_;
  std::vector<std::uint32_t> changed_;
};

}  // namespace

Result<std::unique_ptr<OptimizerState>> open_device_state(const StateContext& ctx) {
  auto state = std::make_unique<DeviceState>(ctx);
  ZINF_RETURN_IF_ERROR(state->open());
  return std::unique_ptr<OptimizerState>(std::move(state));
}

}  // namespace zinf
