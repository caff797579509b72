// Engine: the wiring of the parts behind include/zinf/engine.hpp, and its public calls.
//
//   layout.hpp           registration and layout (the partitioner, modules, the partition)
//   optimizer_state.hpp  the optimizer state, one implementation per home (device, host, store)
//   publisher.hpp        new parameters into the device copies / shards
//   step.hpp             the step's numerics (norm, clipping, overflow, loss scale)
//   checkpoint.hpp       checkpoint save and load
//   rank_exchange.hpp    the ranks' small agreements, and the sticky error
// and from lib/zero the ParamCoordinator (gather, release, prefetch) and the GradReducer.
#include "zinf/engine.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

#include "base/assert.hpp"
#include "engine/activation_store.hpp"
#include "engine/checkpoint.hpp"
#include "engine/device_optimizer.hpp"
#include "engine/engine_counters.hpp"
#include "engine/layout.hpp"
#include "engine/master_write.hpp"
#include "engine/nvme_dir.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/param_groups.hpp"
#include "engine/publisher.hpp"
#include "engine/rank_exchange.hpp"
#include "engine/step.hpp"
#include "engine/step_runner.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "zero/caller_stream.hpp"
#include "zero/grad_reducer.hpp"
#include "zero/param_coordinator.hpp"
#include "zero/zero_counters.hpp"
#include "zinf/log.hpp"

namespace zinf {
namespace {

constexpr std::size_t kPage = 4096;

std::size_t round_page(std::size_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }

}  // namespace

class Engine::Impl {
 public:
  Impl(const Config& config, const Env& env)
      : config_(config),
        env_(env),
        device_(*env.device),
        comm_(*env.comm),
        rank_(env.comm->rank()),
        world_(env.comm->world_size()),
        timeout_(std::chrono::milliseconds(config.collective_timeout_ms)),
        publisher_(layout_),
        activations_(config_, device_, comm_, env.nvme_paths, env.io_faults, sticky_) {}

  ~Impl() {
    if (caller_ != nullptr) (void)caller_->host_wait(timeout_);
    teardown();
    if (stream_ != nullptr) (void)device_.synchronize(*stream_, timeout_);
  }

  // The coordinator and reducer wait for their streams; then the optimizer state goes, then
  // the swap space, then its engine.
  void teardown() {
    // An overlapped pass still running uses the state and the coordinator.
    runner_.reset();
    publisher_.set_coordinator(nullptr);
    coord_.reset();
    reducer_.reset();
    state_.reset();
    swap_.reset();
    io_.reset();
  }

  Status init() {
    if (env_.trace != nullptr) track_ = env_.trace->track(fmt::format("rank{} engine", rank_));
    ZINF_RETURN_IF_ERROR(find_nvme_dirs());
    ZINF_ASSIGN_OR_RETURN(stream_, device_.create_stream("engine"));
    ZINF_ASSIGN_OR_RETURN(event_, device_.create_event());
    ZINF_ASSIGN_OR_RETURN(RankExchange exchange, RankExchange::create(device_, comm_, *stream_,
                                                                      *event_, timeout_, sticky_));
    exchange_.emplace(std::move(exchange));
    ZINF_ASSIGN_OR_RETURN(StepNumerics numerics,
                          StepNumerics::create(config_, device_, comm_, timeout_));
    numerics_.emplace(std::move(numerics));
    // The config's scheduler section (kind kNone without one: the optimizer's lr).
    ZINF_ASSIGN_OR_RETURN(schedule_, LrSchedule::create(config_.scheduler, config_.optimizer.lr));
    return Status::ok();
  }

  // The swap directories, and a probe of each.
  Status find_nvme_dirs() {
    const ZeroConfig& z = config_.zero;
    const bool opt_nvme = z.offload_optimizer.device == OffloadDevice::kNvme;
    const bool param_nvme = z.offload_param.device == OffloadDevice::kNvme;
    if (!opt_nvme && !param_nvme) return Status::ok();
    std::string key = opt_nvme ? "zero_optimization.offload_optimizer.nvme_path"
                               : "zero_optimization.offload_param.nvme_path";
    if (!env_.nvme_paths.empty()) {
      key = "Env::nvme_paths";
      nvme_dirs_ = env_.nvme_paths;
    } else {
      std::set<std::string> dirs;
      if (opt_nvme) {
        if (z.offload_optimizer.nvme_path.empty()) {
          return Status::invalid_argument(
              fmt::format("{}: empty, and the optimizer state is offloaded to nvme", key));
        }
        dirs.insert(z.offload_optimizer.nvme_path);
      }
      if (param_nvme) {
        const std::string& p = z.offload_param.nvme_path.empty() ? z.offload_optimizer.nvme_path
                                                                 : z.offload_param.nvme_path;
        if (p.empty()) {
          return Status::invalid_argument(
              "zero_optimization.offload_param.nvme_path: empty, and the parameters are "
              "offloaded to nvme");
        }
        dirs.insert(p);
      }
      nvme_dirs_.assign(dirs.begin(), dirs.end());
    }
    for (const std::string& dir : nvme_dirs_) {
      ZINF_RETURN_IF_ERROR(prepare_nvme_directory(key, dir, rank_));
    }
    return Status::ok();
  }

  // --- Registration and finalize ---------------------------------------------------------------
  Status register_parameter(const ParameterSpec& spec) {
    if (finalized_ || !finalize_error_.is_ok()) {
      return Status::failed_precondition(fmt::format(
          "register_parameter('{}'): registration is closed (the engine was finalized by "
          "finalize() or by the first gather, reduce_gradients or step)",
          spec.name));
    }
    if (config_.bf16_enabled && spec.dtype != DType::kBF16) {
      return Status::invalid_argument(fmt::format(
          "register_parameter('{}'): dtype {}, but bf16.enabled is true (every parameter is bf16 "
          "then)",
          spec.name, dtype_name(spec.dtype)));
    }
    return layout_.add(spec);
  }

  Status finalize() {
    if (finalized_) return Status::ok();
    ZINF_RETURN_IF_ERROR(finalize_error_);
    Status st = finalize_impl();
    // The initial values are placed (or will never be): drop the copies and the initializers.
    layout_.drop_initial_values();
    if (!st.is_ok()) {
      finalize_error_ = st;
      // Give back what was built, so the engine holds nothing half made.
      teardown();
    }
    return st;
  }

  Status finalize_impl() {
    ZINF_RETURN_IF_ERROR(layout_.lay_out(config_, rank_, world_, *exchange_));
    const ZeroConfig& z = config_.zero;
    const bool stage3 = z.stage == 3;
    ZINF_RETURN_IF_ERROR(open_swap());

    StateContext sc;
    sc.config = &config_;
    sc.device = &device_;
    sc.layout = &layout_;
    sc.publisher = &publisher_;
    sc.rank = rank_;
    sc.timeout = timeout_;
    sc.counters = &counters_;
    sc.trace = env_.trace;
    sc.io = io_.get();
    sc.swap = swap_.get();
    sc.param_staging_bytes = param_staging_bytes_;
    ZINF_ASSIGN_OR_RETURN(group_ranges_, partition_group_ranges(layout_, rank_, param_groups_));
    group_params_.resize(param_groups_.size() + 1);
    set_step_params(t_ + 1);
    sc.group_ranges = group_ranges_;
    sc.groups = group_params_;
    ZINF_ASSIGN_OR_RETURN(state_, open_optimizer_state(sc));

    const GradTarget target = state_->grad_target();
    GradReducerOptions ro;
    ro.bucket_elements = z.reduce_bucket_size;
    ro.timeout = timeout_;
    ro.trace = env_.trace;
    ro.trace_track = track_;
    ro.accumulator_zeroed = target.zeroed;
    ro.accumulator = target.custom;
    ro.accumulator_on_device = target.on_device;
    ZINF_ASSIGN_OR_RETURN(reducer_, GradReducer::create(layout_.partitioner(), rank_, device_,
                                                        comm_, target.accumulator, ro, &counters_));

    ParamCoordinatorOptions co;
    co.shard_tier = stage3 ? z.offload_param.device : OffloadDevice::kNone;
    co.prefetch_elements = z.stage3_prefetch_bucket_size;
    co.max_live_elements = z.stage3_max_live_parameters;
    co.staging_blocks = z.offload_param.buffer_count;
    co.timeout = timeout_;
    co.trace = env_.trace;
    co.trace_track = track_;
    ZINF_ASSIGN_OR_RETURN(
        coord_, ParamCoordinator::create(layout_.partitioner(), rank_, device_, comm_,
                                         layout_.take_coordinator_modules(), layout_.persistent(),
                                         co, swap_.get(), io_.get(), &counters_));
    ZINF_RETURN_IF_ERROR(check_pinned_limit(config_, state_->pinned_bytes(), param_staging_bytes_));
    ZINF_ASSERT(coord_->staging_bytes() == param_staging_bytes_);
    publisher_.set_coordinator(coord_.get());
    attach_caller();
    sources_.resize(layout_.partitioner().param_count());
    for (const std::string& name : layout_.module_names()) {
      reduce_span_names_.push_back(fmt::format("reduce {}", name));
    }
    // The device copies: every group's shard is the master rounded to the group's dtype.
    ZINF_RETURN_IF_ERROR(state_->place_initial());
    if (config_.overlap_step && state_->overlaps()) open_overlap();
    finalized_ = true;
    return Status::ok();
  }

  // Swap space for everything on NVMe: the optimizer's extents and the parameter shards.
  Status open_swap() {
    const ZeroConfig& z = config_.zero;
    const bool opt_nvme = z.offload_optimizer.device == OffloadDevice::kNvme;
    const bool param_nvme = z.stage == 3 && z.offload_param.device == OffloadDevice::kNvme;
    if (!opt_nvme && !param_nvme) return Status::ok();
    std::uint64_t capacity = 0;
    std::uint32_t extents = 0;
    if (opt_nvme) {
      ZINF_ASSIGN_OR_RETURN(StoreLayout layout,
                            StateStore::layout(store_options(config_, layout_, rank_)));
      capacity += layout.nvme_bytes;
      extents += static_cast<std::uint32_t>(layout.nvme_extents);
    }
    if (param_nvme) {
      std::size_t largest = 0;
      for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
        if (layout_.persistent()[g]) continue;
        const GroupInfo& info = layout_.group(g);
        const std::size_t bytes = round_page(info.shard_element_count * dtype_bytes(info.dtype));
        capacity += bytes;
        largest = std::max(largest, bytes);
        ++extents;
      }
      // The coordinator's staging blocks: one shard of the largest group each.
      if (largest > 0) {
        param_staging_bytes_ = largest * std::max<std::size_t>(1, z.offload_param.buffer_count);
      }
    }
    IoOptions io;
    io.block_bytes = config_.aio_block_bytes;
    io.queue_depth = static_cast<std::uint32_t>(config_.aio_queue_depth);
    io.faults = env_.io_faults;
    ZINF_ASSIGN_OR_RETURN(io_, open_engine(io));
    SwapOptions swap;
    swap.dirs = nvme_dirs_;
    swap.block_bytes = config_.aio_block_bytes;
    // Striping rounds each extent's share of each directory up to a block.
    swap.capacity_bytes =
        capacity + std::uint64_t{extents + 4} * config_.aio_block_bytes * nvme_dirs_.size();
    swap.max_extents = extents + 16;
    swap.file_name = fmt::format("zinf-swap-{{pid}}-rank{}.bin", rank_);
    Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(*io_, swap);
    if (!opened.is_ok()) {
      return opened.status().with_context(
          fmt::format("swap space in {}", fmt::join(nvme_dirs_, ", ")));
    }
    swap_ = std::move(opened).value();
    return Status::ok();
  }

  Status ensure_finalized() {
    ZINF_RETURN_IF_ERROR(sticky_.status());
    return finalize();
  }
  // Finalized, and the overlapped step (if one runs) finished: for the calls that need all of it.
  // Collective: every rank calls it at the same point (see finish_step()).
  Status settle() {
    ZINF_RETURN_IF_ERROR(ensure_finalized());
    return finish_step(/*collective=*/true);
  }

  Status fail(Status st) { return sticky_.fail(std::move(st)); }

  // --- Gather / release ------------------------------------------------------------------------
  Status gather(std::string_view module) {
    ZINF_RETURN_IF_ERROR(ensure_finalized());
    ZINF_ASSIGN_OR_RETURN(std::size_t m, layout_.find_module("gather", module));
    // The coordinator is shared with an overlapped pass's shard writes (publisher.hpp).
    std::unique_lock<std::mutex> lock(publisher_.mutex());
    gather_lock_ = &lock;
    Status st = await_module(m);
    if (st.is_ok()) st = coord_->gather(m);
    gather_lock_ = nullptr;
    lock.unlock();
    // A pass that failed is the cause of a gather that found it failed: its error first.
    if (!st.is_ok() && runner_ != nullptr && runner_->running()) {
      ZINF_RETURN_IF_ERROR(finish_step(/*collective=*/false));
    }
    if (!st.is_ok() && st.code() != Code::kFailedPrecondition &&
        st.code() != Code::kResourceExhausted) {
      return fail(st);
    }
    return st;
  }

  Status set_compute_stream(Stream* stream) {
    if (finalized_) ZINF_RETURN_IF_ERROR(finish_step(/*collective=*/false));
    if (finalized_ && coord_->first_in_use() >= 0) {
      return Status::failed_precondition(
          fmt::format("set_compute_stream: module '{}' is gathered (release it first)",
                      layout_.module_names()[static_cast<std::size_t>(coord_->first_in_use())]));
    }
    ZINF_RETURN_IF_ERROR(fail(CallerStream::replace(&caller_, device_, stream, timeout_)));
    attach_caller();
    return Status::ok();
  }
  void attach_caller() {
    if (coord_ != nullptr) coord_->set_caller_stream(caller_.get());
    if (reducer_ != nullptr) reducer_->set_caller_stream(caller_.get());
  }

  Status release(std::string_view module) {
    ZINF_RETURN_IF_ERROR(ensure_finalized());
    ZINF_ASSIGN_OR_RETURN(std::size_t m, layout_.find_module("release", module));
    std::lock_guard<std::mutex> lock(publisher_.mutex());
    return coord_->release(m);
  }

  Result<TensorView> parameter(std::string_view name) const {
    const std::optional<std::size_t> id = layout_.find_param(name);
    if (!id.has_value()) {
      return Status::not_found(fmt::format("parameter('{}'): unknown parameter", name));
    }
    const ParameterLayout::Registered& r = layout_.param(*id);
    if (!finalized_) {
      return Status::failed_precondition(fmt::format(
          "parameter('{}'): the engine is not finalized (gather its module first)", name));
    }
    if (!coord_->gathered(layout_.module_of(*id))) {
      return Status::failed_precondition(
          fmt::format("parameter('{}'): its module '{}' is not gathered", name, r.spec.module));
    }
    const ParamLocation& loc = layout_.partitioner().location(static_cast<ParamId>(*id));
    TensorView view;
    view.data = static_cast<std::byte*>(coord_->group_data(loc.group)) +
                loc.group_offset * dtype_bytes(r.spec.dtype);
    view.dtype = r.spec.dtype;
    view.element_count = r.element_count;
    view.shape = r.spec.shape;
    return view;
  }

  // --- Gradients -------------------------------------------------------------------------------
  Status reduce_gradients(std::string_view module, std::span<const GradientRef> gradients) {
    // The overlapped step reads the accumulator this adds into.
    ZINF_RETURN_IF_ERROR(settle());
    ZINF_ASSIGN_OR_RETURN(std::size_t m, layout_.find_module("reduce_gradients", module));
    // Validate everything before anything moves. sources_ (one entry per parameter, made at
    // finalize) is cleared first, so the call allocates nothing.
    std::vector<GradSource>& sources = sources_;
    std::fill(sources.begin(), sources.end(), GradSource{});
    for (const GradientRef& g : gradients) {
      const std::optional<std::size_t> id = layout_.find_param(g.name);
      if (!id.has_value()) {
        return Status::not_found(
            fmt::format("reduce_gradients('{}'): unknown parameter '{}'", module, g.name));
      }
      const ParameterLayout::Registered& r = layout_.param(*id);
      if (r.spec.module != module) {
        return Status::invalid_argument(
            fmt::format("reduce_gradients('{}'): parameter '{}' belongs to module '{}'", module,
                        g.name, r.spec.module));
      }
      if (sources[*id].data != nullptr) {
        return Status::invalid_argument(
            fmt::format("reduce_gradients('{}'): gradient of '{}' given twice", module, g.name));
      }
      if (g.element_count != r.element_count) {
        return Status::invalid_argument(fmt::format(
            "reduce_gradients('{}'): gradient of '{}' has {} elements; the parameter has {} "
            "(shape {})",
            module, g.name, g.element_count, r.element_count, shape_text(r.spec.shape)));
      }
      if (g.data == nullptr) {
        return Status::invalid_argument(
            fmt::format("reduce_gradients('{}'): gradient of '{}' is null", module, g.name));
      }
      sources[*id] = {g.data, g.dtype};
    }
    for (std::size_t id : layout_.module_params(m)) {
      if (sources[id].data == nullptr) {
        return Status::invalid_argument(fmt::format(
            "reduce_gradients('{}'): no gradient for '{}' (every parameter of the module needs "
            "one)",
            module, layout_.param(id).spec.name));
      }
    }
    Trace::Span span(env_.trace, track_, reduce_span_names_[m]);
    grads_pending_ = true;
    return fail(reducer_->reduce(layout_.module_groups(m), sources));
  }

  // --- Step ------------------------------------------------------------------------------------
  Result<StepReport> step() {
    ZINF_RETURN_IF_ERROR(settle());
    const std::int64_t start = Trace::now_ns();
    const long in_use = coord_->first_in_use();
    if (in_use >= 0) {
      return Status::failed_precondition(
          fmt::format("step: module '{}' is still gathered (release it first)",
                      layout_.module_names()[static_cast<std::size_t>(in_use)]));
    }
    ZINF_ASSIGN_OR_RETURN(int micro, reducer_->micro_batches());
    // The step overwrites parameters the caller's queued work may still read.
    if (caller_ != nullptr) ZINF_RETURN_IF_ERROR(fail(caller_->host_wait(timeout_)));
    coord_->freeze_order();
    Status st = step_impl(micro, start);
    if (!st.is_ok()) return fail(st);
    return report_;
  }

  // Reduce, decide (norm, overflow, clipping: before any state changes, so a skipped step
  // changes nothing but the loss scale), update, publish.
  Status step_impl(int micro, std::int64_t start) {
    StepReport& rep = report_;
    rep = StepReport{};
    rep.micro_batches = micro;
    LossScaler& scaler = numerics_->scaler();
    rep.loss_scale = scaler.scale();
    ZINF_RETURN_IF_ERROR(coord_->drop_prefetched());

    std::int64_t t0 = Trace::now_ns();
    {
      Trace::Span span(env_.trace, track_, "step reduce");
      // The last buckets of the backward pass may still be reducing.
      ZINF_RETURN_IF_ERROR(reducer_->wait());
      ZINF_RETURN_IF_ERROR(reducer_->reduce_accumulated());
    }
    std::int64_t t1 = Trace::now_ns();
    rep.reduce_ns = t1 - t0;

    StepDecision d;
    {
      // The local sum of squares is of the gradients as accumulated; decide() unscales it.
      ZINF_ASSIGN_OR_RETURN(double sumsq, state_->local_sum_of_squares());
      Trace::Span span(env_.trace, track_, "step norm");
      ZINF_ASSIGN_OR_RETURN(d, numerics_->decide(sumsq, micro, *stream_, *event_));
    }
    rep.grad_norm = d.grad_norm;
    std::int64_t t2 = Trace::now_ns();
    rep.norm_ns = t2 - t1;

    if (d.overflow) {
      rep.overlapped = runner_ != nullptr;
      if (rep.overlapped) take_pass_figures(rep);
      scaler.update(true);
      reducer_->zero();
      grads_pending_ = false;
      rep.skipped = true;
      rep.step = t_;
      rep.next_loss_scale = scaler.scale();
      rep.wall_ns = Trace::now_ns() - start;
      ++steps_;
      ++skipped_steps_;
      return Status::ok();
    }
    rep.clip_coef = d.clip_coef;
    ++t_;
    // The schedule's (or set_learning_rate()'s) hyper-parameters for this step.
    set_step_params(t_);
    ZINF_RETURN_IF_ERROR(state_->set_group_params(group_params_));
    if (runner_ != nullptr) {
      // Overlapped: the pass runs on; this report carries the previous pass's figures.
      rep.overlapped = true;
      take_pass_figures(rep);
      start_pass(t_, d.grad_scale);
      grads_pending_ = false;
      scaler.update(false);
      rep.step = t_;
      rep.next_loss_scale = scaler.scale();
      rep.wall_ns = Trace::now_ns() - start;
      ++steps_;
      return Status::ok();
    }
    // Streaming the half output, the shards are written during the optimizer pass.
    const std::uint64_t param_writes = counters_.param_nvme_write_bytes;
    {
      Trace::Span span(env_.trace, track_, "step optimizer");
      ZINF_ASSIGN_OR_RETURN(StepStats stats, state_->step(t_, d.grad_scale));
      rep.optimizer_nvme_read_bytes = stats.read_bytes;
      rep.optimizer_nvme_write_bytes = stats.write_bytes;
    }
    std::int64_t t3 = Trace::now_ns();
    rep.optimizer_ns = t3 - t2;
    {
      Trace::Span span(env_.trace, track_, "step publish");
      const std::uint64_t master_reads = state_->master_read_bytes();
      ZINF_RETURN_IF_ERROR(state_->publish_step());
      rep.param_nvme_write_bytes = counters_.param_nvme_write_bytes - param_writes;
      rep.master_nvme_read_bytes = state_->master_read_bytes() - master_reads;
    }
    rep.publish_ns = Trace::now_ns() - t3;
    rep.gather_wait_ns = std::exchange(gather_wait_ns_, 0);
    reducer_->zero();
    grads_pending_ = false;
    scaler.update(false);
    rep.step = t_;
    rep.next_loss_scale = scaler.scale();
    rep.wall_ns = Trace::now_ns() - start;
    ++steps_;
    return Status::ok();
  }

  // --- Parameter groups and the schedule ------------------------------------------------------
  Status add_param_group(const ParamGroup& group) {
    if (finalized_ || !finalize_error_.is_ok()) {
      return Status::failed_precondition(fmt::format(
          "add_param_group('{}'): the engine is finalized (define groups before)", group.name));
    }
    if (group.name.empty()) return Status::invalid_argument("add_param_group: empty name");
    for (const ParamGroup& g : param_groups_) {
      if (g.name == group.name) {
        return Status::invalid_argument(
            fmt::format("add_param_group('{}'): defined already", group.name));
      }
    }
    if (!std::isfinite(group.weight_decay)) {
      return Status::invalid_argument(
          fmt::format("add_param_group('{}'): weight_decay {}", group.name, group.weight_decay));
    }
    if (!(std::isfinite(group.lr_scale) && group.lr_scale >= 0)) {
      return Status::invalid_argument(fmt::format(
          "add_param_group('{}'): lr_scale {} (finite, >= 0)", group.name, group.lr_scale));
    }
    if (param_groups_.size() + 1 >= kMaxOptimizerGroups) {
      return Status::invalid_argument(fmt::format("add_param_group('{}'): at most {} groups",
                                                  group.name, kMaxOptimizerGroups - 1));
    }
    param_groups_.push_back(group);
    return Status::ok();
  }

  // The default group's lr for applied step `step` (from 1): DeepSpeed's, the k-th applied step
  // runs with the schedule's lr_at(start + k - 1) (start = its last_batch_iteration, -1).
  double lr_for_step(std::int64_t step) const {
    if (lr_override_) return config_.optimizer.lr;
    return schedule_.lr_at(schedule_.config().last_batch_iteration + step - 1);
  }

  // group_params_ for applied step `step`. Allocates nothing.
  void set_step_params(std::int64_t step) {
    OptimizerParams base = config_.optimizer;
    const ScheduledBetas betas =
        schedule_.betas_at(schedule_.config().last_batch_iteration + step - 1);
    if (betas.set) {
      base.beta1 = betas.beta1;
      base.beta2 = betas.beta2;
    }
    group_params(base, lr_for_step(step), param_groups_, &group_params_);
  }

  Status set_lr_schedule(const ScheduleConfig& config) {
    ZINF_ASSIGN_OR_RETURN(schedule_, LrSchedule::create(config, config_.optimizer.lr));
    config_.scheduler = config;
    lr_override_ = false;
    return Status::ok();
  }

  void set_learning_rate(double lr) {
    config_.optimizer.lr = lr;
    lr_override_ = true;
  }

  // --- Checkpoints -----------------------------------------------------------------------------
  CheckpointContext checkpoint_context() {
    CheckpointContext c;
    c.rank = rank_;
    c.world_size = world_;
    c.config = &config_;
    c.layout = &layout_;
    c.state = state_.get();
    c.exchange = &*exchange_;
    c.sticky = &sticky_;
    c.io_faults = env_.io_faults;
    return c;
  }

  Status checkpoint_precondition(std::string_view call) const {
    return zinf::checkpoint_precondition(call, layout_, coord_->first_in_use(), grads_pending_);
  }

  Status save_checkpoint(std::string_view dir, std::string_view tag) {
    const std::string call = fmt::format("save_checkpoint('{}', '{}')", dir, tag);
    ZINF_RETURN_IF_ERROR(settle());
    ResumeState r{t_, numerics_->scaler(), config_.optimizer.lr, lr_override_, schedule_.config()};
    if (coord_->order_frozen()) r.gather_order = gather_order_names(layout_, coord_->order());
    r.client_state = client_state_;
    return zinf::save_checkpoint(checkpoint_context(), call, std::string(dir), std::string(tag),
                                 checkpoint_precondition(call), r);
  }

  Status load_checkpoint(std::string_view dir, std::string_view tag) {
    const std::string call =
        fmt::format("load_checkpoint('{}'{})", dir, tag.empty() ? "" : fmt::format(", '{}'", tag));
    ZINF_RETURN_IF_ERROR(settle());
    ResumeState r;
    ZINF_RETURN_IF_ERROR(load_checkpoint_state(checkpoint_context(), call, std::string(dir),
                                               std::string(tag), checkpoint_precondition(call),
                                               &r));
    t_ = r.step;
    numerics_->scaler().restore(r.loss_scale, r.loss_scale_good_steps,
                                r.loss_scale_hysteresis_left);
    config_.optimizer.lr = r.lr;
    Result<LrSchedule> schedule = LrSchedule::create(r.schedule, r.lr);
    if (schedule.is_ok()) schedule_ = std::move(*schedule);
    lr_override_ = r.lr_override;
    // The gather order, when every module in it is one of ours (else the next step records it).
    std::vector<std::size_t> order = gather_order_indices(layout_, r.gather_order);
    if (!order.empty()) coord_->restore_order(std::move(order));
    client_state_ = std::move(r.client_state);
    state_->restored(t_);
    // The device copies / shards from the loaded master, as finalize() places them.
    ZINF_RETURN_IF_ERROR(fail(coord_->drop_prefetched()));
    if (caller_ != nullptr) ZINF_RETURN_IF_ERROR(fail(caller_->host_wait(timeout_)));
    return fail(state_->publish_master());
  }

  Result<SwapCheckReport> verify_swap() {
    if (swap_ == nullptr) return SwapCheckReport{};
    // Local: the pass's writes landed; the persistent groups wait for a collective call. A pass
    // that failed (a peer gone mid-step) is already this rank's sticky error; the swap is read
    // back all the same, since checking it after a failure is what this call is for.
    if (finalized_) (void)finish_step(/*collective=*/false);
    ZINF_ASSIGN_OR_RETURN(SwapVerifyReport r, swap_->verify(timeout_));
    return SwapCheckReport{r.blocks, r.bytes, r.skipped_blocks};
  }

  // --- Read back -------------------------------------------------------------------------------
  MasterAccess master_access() {
    return {state_.get(), coord_.get(), &layout_, &device_, &comm_,     stream_.get(),
            event_.get(), timeout_,     rank_,    &sticky_, &*exchange_};
  }
  Status read_parameters(std::string_view name, float* out) {
    ZINF_RETURN_IF_ERROR(settle());
    return read_master_values(master_access(), name, out);
  }

  Status write_parameters(std::string_view name, const float* values, int root) {
    ZINF_RETURN_IF_ERROR(settle());
    Status pre = checkpoint_precondition(fmt::format("write_parameters('{}')", name));
    return write_master_values(master_access(), name, values, root, std::move(pre));
  }

  MemoryReport memory() const {
    MemoryReport m;
    m.device_bytes = coord_->device_bytes();
    const Partitioner& part = layout_.partitioner();
    if (!part.partitions(StateKind::kGradients)) {
      for (std::uint32_t g = 0; g < part.group_count(); ++g) {
        m.device_bytes += part.group(g).padded_element_count * 4;  // stage 1's full gradients
      }
    }
    m.host_bytes = coord_->host_bytes();
    // The publish copy of the new values, or the one-group stage of the streamed half output.
    m.host_bytes += publisher_.buffer_bytes() + publisher_.stage_bytes();
    state_->add_memory(m);
    // The swap space holds the optimizer's extents and the parameter shards' alike.
    m.nvme_bytes = swap_ != nullptr ? swap_->used_bytes() : 0;
    activations_.add_memory(m);
    return m;
  }

  Config config_;
  Env env_;
  Device& device_;
  Communicator& comm_;
  const int rank_;
  const int world_;
  const std::chrono::milliseconds timeout_;
  int track_ = 0;
  StickyError sticky_;
  Status finalize_error_;
  bool finalized_ = false;
  std::vector<std::string> nvme_dirs_;

  ParameterLayout layout_;
  Publisher publisher_;
  EngineActivations activations_;  // save_activation(), load_activation()
  std::unique_ptr<IoEngine> io_;
  std::unique_ptr<SwapSpace> swap_;
  std::uint64_t param_staging_bytes_ = 0;  // the coordinator's staging blocks, known before
  std::unique_ptr<OptimizerState> state_;
  std::unique_ptr<CallerStream> caller_;  // set_compute_stream(); outlives coord_, reducer_
  std::unique_ptr<GradReducer> reducer_;
  std::unique_ptr<ParamCoordinator> coord_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> event_;
  std::optional<RankExchange> exchange_;
  std::optional<StepNumerics> numerics_;

  // reduce_gradients()'s per-parameter sources and its span names (per module), made at finalize.
  std::vector<GradSource> sources_;
  std::vector<std::string> reduce_span_names_;
  bool grads_pending_ = false;  // reduce_gradients() was called since the last step
  std::int64_t t_ = 0;
  // Parameter groups: as defined, this rank's partition runs, and each group's
  // hyper-parameters for the next step (sized at finalize).
  std::vector<ParamGroup> param_groups_;
  std::vector<OptimizerRange> group_ranges_;
  std::vector<OptimizerParams> group_params_;
  LrSchedule schedule_;
  bool lr_override_ = false;  // set_learning_rate() was called: it replaces the schedule
  std::string client_state_;  // set_client_state(), saved with checkpoints
  ZeroCounters counters_;     // the zero layer's; counters() copies them out
  std::uint64_t steps_ = 0;
  std::uint64_t skipped_steps_ = 0;
  mutable EngineCounters counters_out_;
  StepReport report_;

  // The overlapped step (zinf.overlap_step; step_overlap.cpp): the runner, the pass's arguments
  // and figures, and what the rank's thread waited for it.
  std::unique_ptr<StepRunner> runner_;
  int runner_track_ = 0;
  std::vector<std::uint32_t> module_last_group_;  // per module; kNoGroup: none
  std::vector<std::uint8_t> persistent_done_;     // per group: all-gathered since the pass began
  std::unique_lock<std::mutex>* gather_lock_ = nullptr;  // gather()'s, for the issue hook
  std::int64_t pass_step_ = 0;
  float pass_scale_ = 1.0f;
  StepReport pass_report_;  // the running pass's optimizer and publish figures
  std::int64_t pass_start_ns_ = 0;
  std::int64_t pass_end_ns_ = 0;
  std::int64_t pass_waited_ns_ = 0;  // the rank's thread waiting for the running pass
  StepReport last_pass_;             // the finished pass's figures, for the next report
  std::int64_t gather_wait_ns_ = 0;  // gathers waiting for new values since the last step()

  static constexpr std::uint32_t kNoGroup = ~std::uint32_t{0};
  void open_overlap();
  Status await_module(std::size_t m);
  static Status issue_hook(void* user, std::size_t module);
  void start_pass(std::int64_t step, float grad_scale);
  static Status run_pass(void* user);
  Status pass_body();
  Status finish_step(bool collective);
  void take_pass_figures(StepReport& rep);
};

// --- The overlapped step ------------------------------------------------------------------------
// step() decides on the rank's thread and hands the optimizer pass and the shard writes to the
// runner's thread; the publisher counts the groups written, in group order. gather(m) (and the
// coordinator's prefetch of m, through the issue hook) waits until m's last group is written,
// then all-gathers m's persistent groups itself, so every collective is still issued by the
// rank's thread in the same order on every rank. The next call that needs the whole step
// (reduce_gradients(), step(), checkpoints, read-back) finishes it: the persistent groups no
// gather asked for are all-gathered in group order and the gradient accumulator is zeroed.

void Engine::Impl::open_overlap() {
  module_last_group_.assign(layout_.module_names().size(), kNoGroup);
  for (std::size_t m = 0; m < module_last_group_.size(); ++m) {
    for (std::uint32_t g : layout_.module_groups(m)) {
      if (module_last_group_[m] == kNoGroup || g > module_last_group_[m]) {
        module_last_group_[m] = g;
      }
    }
  }
  persistent_done_.assign(layout_.group_count(), 1);
  if (env_.trace != nullptr) runner_track_ = env_.trace->track(fmt::format("rank{} step", rank_));
  coord_->set_issue_hook(&Impl::issue_hook, this);
  runner_ = std::make_unique<StepRunner>();
}

// With gather_lock_ held (the publisher's mutex), on the rank's thread.
Status Engine::Impl::await_module(std::size_t m) {
  if (runner_ == nullptr) return Status::ok();
  ZINF_ASSERT(gather_lock_ != nullptr);
  const std::uint32_t last = module_last_group_[m];
  if (runner_->running() && last != kNoGroup && !publisher_.written(last)) {
    if (publisher_.in_pass()) {
      const std::int64_t t0 = Trace::now_ns();
      publisher_.written_cv().wait(
          *gather_lock_, [&] { return publisher_.written(last) || !publisher_.in_pass(); });
      const std::int64_t waited = Trace::now_ns() - t0;
      gather_wait_ns_ += waited;
      pass_waited_ns_ += waited;
    }
    if (!publisher_.written(last)) {
      // The pass failed before it wrote this module: its error is the gather's.
      return Status::aborted(
          fmt::format("gather('{}'): the optimizer step failed before its "
                      "parameters were written",
                      layout_.module_names()[m]));
    }
  }
  // The persistent groups by the flags step() reset, which every rank's calls move alike (a
  // rank that finished the pass early, in a local call, still all-gathers here with the others).
  bool any = false;
  for (std::uint32_t g : layout_.module_groups(m)) {
    if (persistent_done_[g] != 0) continue;
    ZINF_RETURN_IF_ERROR(coord_->publish_group(g));
    persistent_done_[g] = 1;
    any = true;
  }
  return any ? coord_->publish_wait() : Status::ok();
}

Status Engine::Impl::issue_hook(void* user, std::size_t module) {
  return static_cast<Impl*>(user)->await_module(module);
}

void Engine::Impl::start_pass(std::int64_t step, float grad_scale) {
  pass_step_ = step;
  pass_scale_ = grad_scale;
  pass_report_ = StepReport{};
  pass_waited_ns_ = 0;
  for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
    persistent_done_[g] = layout_.persistent()[g] ? 0 : 1;
  }
  publisher_.begin_pass();
  pass_start_ns_ = Trace::now_ns();
  runner_->start(&Impl::run_pass, this);
}

// On the runner's thread.
Status Engine::Impl::run_pass(void* user) {
  auto* self = static_cast<Impl*>(user);
  Status st = self->pass_body();
  self->pass_end_ns_ = Trace::now_ns();
  self->publisher_.end_pass(st.is_ok());
  return st;
}

Status Engine::Impl::pass_body() {
  StepReport& rep = pass_report_;
  // Only this pass writes shards (and counts their bytes) until it is finished.
  const std::uint64_t param_writes = counters_.param_nvme_write_bytes;
  {
    Trace::Span span(env_.trace, runner_track_, "step optimizer");
    ZINF_ASSIGN_OR_RETURN(StepStats stats, state_->step(pass_step_, pass_scale_));
    rep.optimizer_nvme_read_bytes = stats.read_bytes;
    rep.optimizer_nvme_write_bytes = stats.write_bytes;
  }
  const std::int64_t t3 = Trace::now_ns();
  rep.optimizer_ns = t3 - pass_start_ns_;
  {
    Trace::Span span(env_.trace, runner_track_, "step publish");
    const std::uint64_t master_reads = state_->master_read_bytes();
    ZINF_RETURN_IF_ERROR(state_->write_step());
    rep.param_nvme_write_bytes = counters_.param_nvme_write_bytes - param_writes;
    rep.master_nvme_read_bytes = state_->master_read_bytes() - master_reads;
  }
  rep.publish_ns = Trace::now_ns() - t3;
  return Status::ok();
}

// Waits for the pass. `collective`: every rank calls this at the same point, so the persistent
// groups no gather published are all-gathered too, in group order; local calls (verify_swap(),
// counters(), errors) leave them for the next collective one.
Status Engine::Impl::finish_step(bool collective) {
  if (runner_ == nullptr) return Status::ok();
  Status st;
  if (runner_->running()) {
    const std::int64_t t0 = Trace::now_ns();
    st = runner_->finish();
    pass_waited_ns_ += Trace::now_ns() - t0;
    if (!st.is_ok()) return fail(st);
    {
      // Every shard write's copy done before the next pass refills the values.
      std::lock_guard<std::mutex> lock(publisher_.mutex());
      st = coord_->wait_writes();
    }
    if (!st.is_ok()) return fail(st);
    reducer_->zero();
    last_pass_ = pass_report_;
    const std::int64_t pass_ns = pass_end_ns_ - pass_start_ns_;
    last_pass_.hidden_ns = std::max<std::int64_t>(0, pass_ns - pass_waited_ns_);
  }
  if (!collective) return Status::ok();
  std::lock_guard<std::mutex> lock(publisher_.mutex());
  bool any = false;
  for (std::uint32_t g = 0; g < layout_.group_count() && st.is_ok(); ++g) {
    if (persistent_done_[g] != 0) continue;
    st = coord_->publish_group(g);
    persistent_done_[g] = 1;
    any = true;
  }
  if (st.is_ok() && any) st = coord_->publish_wait();
  return st.is_ok() ? Status::ok() : fail(st);
}

// The last finished pass's figures into an overlapped step's report (zero before the first).
void Engine::Impl::take_pass_figures(StepReport& rep) {
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

// --- Engine -------------------------------------------------------------------------------------

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

Result<std::unique_ptr<Engine>> Engine::open(const Config& config, const Env& env) {
  ZINF_RETURN_IF_ERROR(validate(config));
  if (env.device == nullptr) return Status::invalid_argument("Env::device: null");
  if (env.comm == nullptr) return Status::invalid_argument("Env::comm: null");
  if (&env.comm->device() != env.device) {
    return Status::invalid_argument("Env::comm: runs on another device than Env::device");
  }
  if (!env.device->host_accessible() &&
      config.zero.offload_optimizer.device == OffloadDevice::kNone) {
    ZINF_RETURN_IF_ERROR(DeviceOptimizer::check(config.optimizer, *env.device));
  }
  if (config.world_size != 0 && config.world_size != env.comm->world_size()) {
    return Status::invalid_argument(
        fmt::format("zinf.world_size: {} but the communicator has {} ranks", config.world_size,
                    env.comm->world_size()));
  }
  auto impl = std::make_unique<Impl>(config, env);
  ZINF_RETURN_IF_ERROR(impl->init());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Status Engine::register_parameter(const ParameterSpec& spec) {
  return impl_->register_parameter(spec);
}
Status Engine::finalize() { return impl_->finalize(); }
bool Engine::finalized() const { return impl_->finalized_; }
Status Engine::gather(std::string_view module) { return impl_->gather(module); }
Result<TensorView> Engine::parameter(std::string_view name) const { return impl_->parameter(name); }
Status Engine::release(std::string_view module) { return impl_->release(module); }
Status Engine::save_activation(std::string_view key, const void* data, std::size_t bytes) {
  return impl_->activations_.save(key, data, bytes);
}
Status Engine::load_activation(std::string_view key, void* data) {
  return impl_->activations_.load(key, data);
}
Status Engine::flush_activations() { return impl_->activations_.flush(); }
void Engine::set_activation_bytes(std::uint64_t device_bytes) {
  impl_->activations_.set_caller_bytes(device_bytes);
}
Status Engine::set_compute_stream(Stream* stream) { return impl_->set_compute_stream(stream); }
Status Engine::reduce_gradients(std::string_view module, std::span<const GradientRef> gradients) {
  return impl_->reduce_gradients(module, gradients);
}
Result<StepReport> Engine::step() { return impl_->step(); }
Status Engine::save_checkpoint(std::string_view dir, std::string_view tag) {
  return impl_->save_checkpoint(dir, tag);
}
Status Engine::save_checkpoint(std::string_view dir) {
  return impl_->save_checkpoint(dir, fmt::format("global_step{}", impl_->t_));
}
Status Engine::load_checkpoint(std::string_view dir, std::string_view tag) {
  return impl_->load_checkpoint(dir, tag);
}
void Engine::set_client_state(std::string_view blob) { impl_->client_state_ = blob; }
const std::string& Engine::client_state() const { return impl_->client_state_; }
Result<SwapCheckReport> Engine::verify_swap() { return impl_->verify_swap(); }
Status Engine::read_parameters(std::string_view name, float* out) {
  return impl_->read_parameters(name, out);
}
Status Engine::write_parameters(std::string_view name, const float* values, int root) {
  return impl_->write_parameters(name, values, root);
}
double Engine::loss_scale() const { return impl_->numerics_->scaler().scale(); }
Status Engine::set_learning_rate(double lr) {
  if (!std::isfinite(lr) || lr < 0) {
    return Status::invalid_argument(
        fmt::format("set_learning_rate: {} is not a finite number >= 0", lr));
  }
  // The state takes it (every group at lr times its lr_scale) at the next step.
  impl_->set_learning_rate(lr);
  return Status::ok();
}
double Engine::learning_rate() const { return impl_->lr_for_step(impl_->t_ + 1); }
Status Engine::add_param_group(const ParamGroup& group) { return impl_->add_param_group(group); }
Status Engine::set_lr_schedule(const ScheduleConfig& schedule) {
  return impl_->set_lr_schedule(schedule);
}
int Engine::rank() const { return impl_->rank_; }
int Engine::world_size() const { return impl_->world_; }
const Config& Engine::config() const { return impl_->config_; }
std::vector<std::string> Engine::modules() const { return impl_->layout_.module_names(); }
std::vector<std::string> Engine::recorded_order() const {
  std::vector<std::string> out;
  if (impl_->coord_ == nullptr || !impl_->coord_->order_frozen()) return out;
  for (std::size_t m : impl_->coord_->order()) out.push_back(impl_->layout_.module_names()[m]);
  return out;
}
const EngineCounters& Engine::counters() const {
  // The counters of an overlapped pass are final once it is (an error there is sticky).
  if (impl_->finalized_) (void)impl_->finish_step(/*collective=*/false);
  copy_engine_counters(impl_->counters_, impl_->steps_, impl_->skipped_steps_,
                       impl_->counters_out_);
  return impl_->counters_out_;
}
MemoryReport Engine::memory() const {
  ZINF_ASSERT(impl_->finalized_);
  return impl_->memory();
}

}  // namespace zinf
