// HostState: the optimizer state in the memory of a host-accessible device (offload_optimizer
// "none" on HostDevice, where device memory is host memory), stepped in place by the CPU
// optimizer, one call per group, so each half group's new values are written in its own dtype
// into the publisher's buffer by the same pass; f32 groups' new values are the master itself.
//
// Frozen parameters: the moments and the gradient accumulator are fresh zero pages
// (AlignedBuffer::zeroed_pages), which take memory only where they are written. The frozen
// group's ranges (param_groups.hpp: lr 0, weight decay 0, a gradient that is always zero) are
// not stepped while their moments are zero, since a step would leave every bit there as it is
// (their half copy in the publisher's buffer was rounded from this master by publish_master()
// or master_loaded(), as the step rounds it), and a checkpoint's zeros are not written there; so
// the frozen moments, and the frozen share of the accumulator (no stage reduces a frozen
// group), never become resident. Non-zero moments loaded into a frozen range (saved trainable) are
// kept, and from then on every range is stepped.
//
// Memory: the zero pages are host memory the HostDevice does not allocate, but they stand for its
// memory (on a GPU they would be device allocations), so their bytes, mapped, are counted against
// its memory limit (HostDevice::reserve) and in the memory report; the limit has to hold what the
// state may grow to, whether or not a step has written those pages yet.
#include <fmt/format.h>

#include <cstring>
#include <string>

#include "base/aligned.hpp"
#include "device/host_device.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/param_groups.hpp"
#include "tier/state_store.hpp"
#include "zinf/optim.hpp"

namespace zinf {
namespace {

class HostState final : public InMemoryState {
 public:
  explicit HostState(const StateContext& ctx)
      : InMemoryState(ctx), host_device_(dynamic_cast<HostDevice*>(ctx.device)) {}
  ~HostState() override {
    if (host_device_ != nullptr) host_device_->unreserve(reserved_bytes_);
  }

  Status open() {
    Device& device = *ctx_.device;
    const std::size_t bytes = std::max<std::size_t>(partition_elements_, 1) * sizeof(float);
    ZINF_ASSIGN_OR_RETURN(master_, DeviceBuffer::allocate(device, bytes));
    ZINF_RETURN_IF_ERROR(map_zeroed(bytes, "exp_avg", &exp_avg_));
    ZINF_RETURN_IF_ERROR(map_zeroed(bytes, "exp_avg_sq", &exp_avg_sq_));
    ZINF_RETURN_IF_ERROR(map_zeroed(bytes, "gradients", &grads_));
    ZINF_RETURN_IF_ERROR(layout_.fill_master(0, partition_elements_, master_.as<float>()));
    pub_.allocate_buffer();
    const std::vector<OptimizerRange> ranges = context_ranges(ctx_);
    const std::vector<bool> frozen = frozen_ranges(ctx_, ranges);
    for (std::size_t r = 0; r < ranges.size(); ++r) {
      if (!frozen[r]) continue;
      const std::size_t end = r + 1 < ranges.size() ? ranges[r + 1].begin : partition_elements_;
      frozen_.push_back({ranges[r].begin, end});
    }
    settled_ = !frozen_.empty();
    // With transparent huge pages "always", the first write into a trainable run would fault in
    // the 2 MiB pages around it, over its frozen neighbours' zeros too: those are advised off
    // huge pages. Each advised range splits a mapping, so past AlignedBuffer::kMaxAdvisedStretches
    // (far below the kernel's map count limit) none is.
    if (frozen_.size() <= AlignedBuffer::kMaxAdvisedStretches) {
      for (const Stretch& f : frozen_) {
        for (AlignedBuffer* a : {&exp_avg_, &exp_avg_sq_, &grads_}) {
          (void)a->advise_no_huge_pages(f.begin * sizeof(float), (f.end - f.begin) * sizeof(float));
        }
      }
    }
    for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
      const std::size_t offset = layout_.offset(g);
      const std::size_t end = offset + layout_.group(g).shard_element_count;
      group_ranges_.push_back(slice_ranges(ranges, offset, end - offset));
      // The stretches of the group between frozen ranges, each with the group's ranges in it.
      std::vector<Trained> stretches;
      auto add = [&](std::size_t lo, std::size_t hi) {
        stretches.push_back({{lo, hi}, slice_ranges(group_ranges_.back(), lo - offset, hi - lo)});
      };
      std::size_t at = offset;
      for (const Stretch& f : frozen_) {
        const std::size_t lo = std::max(f.begin, offset), hi = std::min(f.end, end);
        if (lo >= hi) continue;
        if (lo > at) add(at, lo);
        at = hi;
      }
      if (at < end) add(at, end);
      trained_.push_back(std::move(stretches));
    }
    return Status::ok();
  }

  // Fresh zero pages: the reducer does not clear them, and never writes the frozen slices (at
  // any stage).
  GradTarget grad_target() override { return {.accumulator = grads_.as<float>(), .zeroed = true}; }
  Result<double> local_sum_of_squares() override {
    return sum_of_squares(grads_.as<const float>(), partition_elements_);
  }
  Result<StepStats> step(std::int64_t step, float grad_scale) override {
    StepOptions so;
    so.step = step;
    so.grad_scale = grad_scale;
    so.threads = ctx_.config->cpu_threads;
    for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
      const GroupInfo& info = layout_.group(g);
      const std::size_t offset = layout_.offset(g);
      if (!settled_) {
        ZINF_RETURN_IF_ERROR(
            step_stretch(g, offset, info.shard_element_count, group_ranges_[g], so));
        continue;
      }
      // The frozen ranges are passed over: the result is that of the whole group's call, bit for
      // bit (optimizer_step() over ranges equals one call per range).
      for (const Trained& t : trained_[g]) {
        ZINF_RETURN_IF_ERROR(
            step_stretch(g, t.stretch.begin, t.stretch.end - t.stretch.begin, t.ranges, so));
      }
    }
    return StepStats{};
  }
  // The step wrote the half groups; the trainable f32 groups are narrowed (copied) from the
  // master. The frozen groups are left as they are, in the buffer and in their shards: no step
  // changes their master (publisher.hpp), and publish_master() or master_loaded() put it in the
  // buffer after each write of it.
  Status publish_step() override {
    for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
      if (layout_.group(g).dtype != DType::kF32 || !layout_.republished(g)) continue;
      const std::size_t offset = layout_.offset(g);
      zinf::narrow(master_.as<const float>() + offset, layout_.group(g).shard_element_count,
                   DType::kF32, pub_.buffer(g));
    }
    return write_buffer(/*gather_persistent=*/true, /*frozen_too=*/false);
  }
  Status publish_master(bool gather_persistent) override {
    narrow([](std::uint32_t) { return true; });
    return write_buffer(gather_persistent);
  }
  // A checkpoint load rounds the master into the buffer run by run as it arrives, so
  // write_loaded() only writes the shards; after update_master_range(), the same over its
  // changed groups alone, and write_loaded() writes only those groups' shards.
  Status master_loaded(std::size_t first, std::size_t count, const float* values) override {
    if (first == (ranged_ ? range_.begin : 0)) loaded_elements_ = first;
    if (first != loaded_elements_) {
      loaded_elements_ = kNotLoaded;  // not in order: write_loaded() narrows it all again
      return Status::ok();
    }
    pub_.narrow_groups(
        first, count, values,
        [&](std::uint32_t g) { return !ranged_ || chosen_group(changed_, g); },
        [&](std::uint32_t g) { return pub_.buffer(g); });
    loaded_elements_ += count;
    return Status::ok();
  }
  Status write_loaded() override {
    const bool ranged = ranged_;
    const bool whole = loaded_elements_ == (ranged ? range_.end : partition_elements_);
    loaded_elements_ = 0;
    ranged_ = false;
    if (!whole) return publish_master(/*gather_persistent=*/false);
    if (!ranged) return write_buffer(/*gather_persistent=*/false);
    ZINF_RETURN_IF_ERROR(
        pub_.write_group_shards([&](std::uint32_t g) -> const std::byte* { return pub_.buffer(g); },
                                range_.first_group, range_.end_group, changed_));
    return pub_.wait_writes();
  }
  // The range widened to whole groups, changed in place.
  Status update_master_range(std::size_t begin, std::size_t end,
                             std::span<const std::uint32_t> changed, StateFill fill) override {
    end = std::min(end, partition_elements_);
    loaded_elements_ = kNotLoaded;
    ranged_ = false;
    if (begin >= end) return Status::ok();
    // With a list of changed groups the update is ranged, even over the whole partition.
    ranged_ = widen_to_groups(layout_, &begin, &end, &range_) || !changed.empty();
    changed_.assign(changed.begin(), changed.end());
    return fill(begin, end - begin, master_.as<float>() + begin);
  }
  Status update_master(StateFill fill) override {
    return update_master_range(0, partition_elements_, {}, fill);
  }

  Status read_master(std::size_t, std::size_t, MasterVisitor fn) override {
    fn(0, partition_elements_, master_.as<const float>());
    return Status::ok();
  }
  Status read_state(Piece piece, StateVisitor fn) override {
    return fn(0, partition_elements_, buffer(piece));
  }
  // While the frozen moments are zero, a moment's frozen ranges are filled into a bounded
  // scratch block and copied only when what is loaded there is not all zero (then every range
  // is stepped from now on); the rest is filled in place.
  Status write_state(Piece piece, StateFill fill) override {
    if (piece == Piece::kParams) ranged_ = false;  // master_loaded() from element 0
    float* dst = buffer(piece);
    if (piece == Piece::kParams || !settled_) return fill(0, partition_elements_, dst);
    constexpr std::size_t kScratchElements = std::size_t{1} << 20;
    std::vector<float> scratch;
    std::size_t at = 0;
    for (const Stretch& f : frozen_) {
      if (f.begin > at) ZINF_RETURN_IF_ERROR(fill(at, f.begin - at, dst + at));
      for (std::size_t b = f.begin; b < f.end; b += kScratchElements) {
        const std::size_t count = std::min(kScratchElements, f.end - b);
        if (!settled_) {  // every range is stepped now: filled in place
          ZINF_RETURN_IF_ERROR(fill(b, count, dst + b));
          continue;
        }
        if (scratch.size() < count) scratch.resize(count);
        ZINF_RETURN_IF_ERROR(fill(b, count, scratch.data()));
        if (all_zero_bytes(scratch.data(), count * sizeof(float))) continue;
        settled_ = false;
        std::memcpy(dst + b, scratch.data(), count * sizeof(float));
      }
      at = f.end;
    }
    if (at < partition_elements_)
      ZINF_RETURN_IF_ERROR(fill(at, partition_elements_ - at, dst + at));
    return Status::ok();
  }

  // The moments and the accumulator are counted whole, as mapped (what the host device's limit
  // counts, what they may grow to): the report has no resident figure, and the pages of them
  // never written (a frozen parameter's) take no memory.
  void add_memory(MemoryReport& report) const override {
    report.device_bytes +=
        master_.bytes() + exp_avg_.bytes() + exp_avg_sq_.bytes() + grads_.bytes();
  }

 private:
  // Elements [begin, end) of the partition.
  struct Stretch {
    std::size_t begin = 0, end = 0;
  };
  // A stretch of a dtype group that is stepped while the frozen moments are zero, and the
  // group's ranges in it (relative to its first element).
  struct Trained {
    Stretch stretch;
    std::vector<OptimizerRange> ranges;
  };

  // `bytes` of fresh zero pages into *out, counted against the host device's memory limit.
  // kResourceExhausted naming the tensor and the bytes when the limit or the kernel refuses them.
  Status map_zeroed(std::size_t bytes, const char* tensor, AlignedBuffer* out) {
    const std::string what = fmt::format("optimizer state {} in host device memory", tensor);
    if (host_device_ != nullptr) ZINF_RETURN_IF_ERROR(host_device_->reserve(bytes, what));
    Status st = AlignedBuffer::zeroed_pages(bytes, what, out);
    if (!st.is_ok()) {
      if (host_device_ != nullptr) host_device_->unreserve(bytes);
      return st;
    }
    if (host_device_ != nullptr) reserved_bytes_ += bytes;
    return Status::ok();
  }
  float* buffer(Piece piece) {
    return piece == Piece::kParams   ? master_.as<float>()
           : piece == Piece::kExpAvg ? exp_avg_.as<float>()
                                     : exp_avg_sq_.as<float>();
  }
  // Elements [first, first + count) of dtype group g (`ranges` relative to `first`) stepped.
  Status step_stretch(std::uint32_t g, std::size_t first, std::size_t count,
                      const std::vector<OptimizerRange>& ranges, const StepOptions& so) {
    const GroupInfo& info = layout_.group(g);
    OptimizerSpan span;
    span.params = master_.as<float>() + first;
    span.exp_avg = exp_avg_.as<float>() + first;
    span.exp_avg_sq = exp_avg_sq_.as<float>() + first;
    span.grads = grads_.as<float>() + first;
    span.grad_dtype = DType::kF32;
    if (info.dtype != DType::kF32) {
      span.params_half = pub_.buffer(g) + (first - layout_.offset(g)) * dtype_bytes(info.dtype);
      span.half_dtype = info.dtype;
    }
    span.count = count;
    ZINF_ASSIGN_OR_RETURN(StepResult r, optimizer_step(groups_, ranges, span, so));
    (void)r;
    return Status::ok();
  }
  void narrow(FunctionRef<bool(std::uint32_t)> want) {
    pub_.narrow_groups(0, partition_elements_, master_.as<const float>(), want,
                       [&](std::uint32_t g) { return pub_.buffer(g); });
  }

  // Per dtype group: the parameter groups' runs in it, relative to its offset.
  std::vector<std::vector<OptimizerRange>> group_ranges_;
  // The frozen group's ranges, in order; per dtype group, its stretches between them.
  std::vector<Stretch> frozen_;
  std::vector<std::vector<Trained>> trained_;
  // The frozen ranges' moments are zero (nothing non-zero was written there): they are not
  // stepped.
  bool settled_ = false;
  // The device when it is a HostDevice (the only host-accessible one zinf has), which counts the
  // zero pages' bytes (reserved_bytes_) against its limit.
  HostDevice* host_device_ = nullptr;
  std::size_t reserved_bytes_ = 0;
  DeviceBuffer master_;
  AlignedBuffer exp_avg_, exp_avg_sq_, grads_;
  // update_master_range() of less than the partition, or of some groups unchanged: its groups
  // and their span, and which of them it changes (empty: all), until write_loaded().
  bool ranged_ = false;
  GroupSpan range_;
  std::vector<std::uint32_t> changed_;
  // master_loaded(): the element up to which the master was rounded into the buffer, in order,
  // since element 0 (or since range_.begin after update_master_range()).
  static constexpr std::size_t kNotLoaded = SIZE_MAX;
  std::size_t loaded_elements_ = 0;
};

}  // namespace

Result<std::unique_ptr<OptimizerState>> open_host_state(const StateContext& ctx) {
  auto state = std::make_unique<HostState>(ctx);
  ZINF_RETURN_IF_ERROR(state->open());
  return std::unique_ptr<OptimizerState>(std::move(state));
}

}  // namespace zinf
