// HostState: the optimizer state in the memory of a host-accessible device (offload_optimizer
// "none" on HostDevice, where device memory is host memory), stepped in place by the CPU
// optimizer, one call per group, so each half group's new values are written in its own dtype
// into the publisher's buffer by the same pass; f32 groups' new values are the master itself.
#include <cstring>

#include "engine/optimizer_state.hpp"
#include "engine/param_groups.hpp"
#include "zinf/optim.hpp"

namespace zinf {
namespace {

class HostState final : public InMemoryState {
 public:
  explicit HostState(const StateContext& ctx) : InMemoryState(ctx) {}

  Status open() {
    Device& device = *ctx_.device;
    const std::size_t bytes = std::max<std::size_t>(partition_elements_, 1) * sizeof(float);
    ZINF_ASSIGN_OR_RETURN(master_, DeviceBuffer::allocate(device, bytes));
    ZINF_ASSIGN_OR_RETURN(exp_avg_, DeviceBuffer::allocate(device, bytes));
    ZINF_ASSIGN_OR_RETURN(exp_avg_sq_, DeviceBuffer::allocate(device, bytes));
    ZINF_ASSIGN_OR_RETURN(grads_, DeviceBuffer::allocate(device, bytes));
    ZINF_RETURN_IF_ERROR(layout_.fill_master(0, partition_elements_, master_.as<float>()));
    std::memset(exp_avg_.data(), 0, bytes);
    std::memset(exp_avg_sq_.data(), 0, bytes);
    pub_.allocate_buffer();
    const std::vector<OptimizerRange> ranges = context_ranges(ctx_);
    for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
      group_ranges_.push_back(
          slice_ranges(ranges, layout_.offset(g), layout_.group(g).shard_element_count));
    }
    return Status::ok();
  }

  // The device buffer is not fresh zero pages; the reducer never reads a group's slice before
  // its first reduction since the last step has overwritten it.
  GradTarget grad_target() override { return {.accumulator = grads_.as<float>()}; }
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
      OptimizerSpan span;
      span.params = master_.as<float>() + offset;
      span.exp_avg = exp_avg_.as<float>() + offset;
      span.exp_avg_sq = exp_avg_sq_.as<float>() + offset;
      span.grads = grads_.as<float>() + offset;
      span.grad_dtype = DType::kF32;
      if (info.dtype != DType::kF32) {
        span.params_half = pub_.buffer(g);
        span.half_dtype = info.dtype;
      }
      span.count = info.shard_element_count;
      ZINF_ASSIGN_OR_RETURN(StepResult r, optimizer_step(groups_, group_ranges_[g], span, so));
      (void)r;
    }
    return StepStats{};
  }
  // The step wrote the half groups; the f32 groups are narrowed (copied) from the master.
  Status publish_step() override {
    narrow([](DType dtype) { return dtype == DType::kF32; });
    return write_buffer();
  }
  Status publish_master(bool gather_persistent) override {
    narrow([](DType) { return true; });
    return write_buffer(gather_persistent);
  }
  // A checkpoint load rounds the master into the buffer run by run as it arrives, so
  // write_loaded() only writes the shards.
  Status master_loaded(std::size_t first, std::size_t count, const float* values) override {
    if (first == 0) loaded_elements_ = 0;
    if (first != loaded_elements_) {
      loaded_elements_ = kNotLoaded;  // not in order: write_loaded() narrows it all again
      return Status::ok();
    }
    pub_.narrow_groups(
        first, count, values, [](DType) { return true; },
        [&](std::uint32_t g) { return pub_.buffer(g); });
    loaded_elements_ += count;
    return Status::ok();
  }
  Status write_loaded() override {
    const bool whole = loaded_elements_ == partition_elements_;
    loaded_elements_ = 0;
    return whole ? write_buffer(/*gather_persistent=*/false)
                 : publish_master(/*gather_persistent=*/false);
  }

  Status read_master(std::size_t, std::size_t, MasterVisitor fn) override {
    fn(0, partition_elements_, master_.as<const float>());
    return Status::ok();
  }
  Status read_state(Piece piece, StateVisitor fn) override {
    return fn(0, partition_elements_, buffer(piece).as<const float>());
  }
  Status write_state(Piece piece, StateFill fill) override {
    return fill(0, partition_elements_, buffer(piece).as<float>());
  }

  void add_memory(MemoryReport& report) const override {
    report.device_bytes +=
        master_.bytes() + exp_avg_.bytes() + exp_avg_sq_.bytes() + grads_.bytes();
  }

 private:
  DeviceBuffer& buffer(Piece piece) {
    return piece == Piece::kParams ? master_ : piece == Piece::kExpAvg ? exp_avg_ : exp_avg_sq_;
  }
  void narrow(FunctionRef<bool(DType)> want) {
    pub_.narrow_groups(0, partition_elements_, master_.as<const float>(), want,
                       [&](std::uint32_t g) { return pub_.buffer(g); });
  }

  // Per dtype group: the parameter groups' runs in it, relative to its offset.
  std::vector<std::vector<OptimizerRange>> group_ranges_;
  DeviceBuffer master_, exp_avg_, exp_avg_sq_, grads_;
  // master_loaded(): the elements rounded into the buffer since element 0, in order.
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
