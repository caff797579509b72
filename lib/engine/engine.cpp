// Engine: the wiring of the parts behind include/zinf/engine.hpp, and its public calls.
//
//   layout.hpp           registration and layout (the partitioner, modules, the partition)
//   optimizer_state.hpp  the optimizer state, one implementation per home (device, host, store)
//   publisher.hpp        new parameters into the device copies / shards
//   step.hpp             the step's numerics (norm, clipping, overflow, loss scale)
//   step_overlap.hpp     the overlapped step: the optimizer pass on its own thread
//   checkpoint.hpp       checkpoint save and load
//   rank_exchange.hpp    the ranks' small agreements, and the sticky error
//   engine_swap.hpp      the NVMe directories and the swap space
// and from lib/zero the ParamCoordinator (gather, release, prefetch) and the GradReducer.
#include "zinf/engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <utility>

#include "base/assert.hpp"
#include "engine/activation_store.hpp"
#include "engine/checkpoint.hpp"
#include "engine/device_optimizer.hpp"
#include "engine/engine_counters.hpp"
#include "engine/engine_swap.hpp"
#include "engine/layout.hpp"
#include "engine/master_write.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/param_groups.hpp"
#include "engine/publisher.hpp"
#include "engine/rank_exchange.hpp"
#include "engine/step.hpp"
#include "engine/step_overlap.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "zero/caller_stream.hpp"
#include "zero/grad_reducer.hpp"
#include "zero/param_coordinator.hpp"
#include "zero/zero_counters.hpp"
#include "zinf/log.hpp"

namespace zinf {

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
    overlap_.reset();
    publisher_.set_coordinator(nullptr);
    coord_.reset();
    reducer_.reset();
    state_.reset();
    swap_.reset();
    io_.reset();
  }

  Status init() {
    if (env_.trace != nullptr) track_ = env_.trace->track(fmt::format("rank{} engine", rank_));
    ZINF_ASSIGN_OR_RETURN(nvme_dirs_, find_nvme_dirs(config_, env_, rank_));
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

  // --- Registration and finalize ---------------------------------------------------------------
  Status register_parameter(const ParameterSpec& spec) {
    if (!finalize_error_.is_ok()) {
      return Status::failed_precondition(
          fmt::format("register_parameter('{}'): registration is closed: finalize failed ({}); "
                      "open a new engine",
                      spec.name, finalize_error_.to_string()));
    }
    if (finalized_) {
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
    if (!spec.trainable && config_.gradients_on_nvme) {
      // A spilled gradient sub-group is complete once every element of it was added; a frozen
      // parameter's elements never are, so the spill's bookkeeping does not hold there.
      return Status::invalid_argument(fmt::format(
          "register_parameter('{}'): a frozen parameter (trainable false) with "
          "zinf.gradients_on_nvme true, which does not support frozen parameters; set it false",
          spec.name));
    }
    return layout_.add(spec);
  }

  Status finalize() {
    if (finalized_) return Status::ok();
    ZINF_RETURN_IF_ERROR(finalize_error_);
    if (layout_.empty()) {
      // Nothing is built or dropped, so registration stays open.
      return Status::failed_precondition(
          "finalize (itself, or by the first gather, reduce_gradients, step or checkpoint): no "
          "parameters registered; register_parameter them first");
    }
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

  // Lays the parameters out (where the ranks check that they agree: every rank computes the same
  // error), then builds the state. A failure of this rank's own in the second part (an
  // initializer, the swap files) aborts the communicator, so that the other ranks, waiting in
  // their next collective, fail at once naming this rank instead of at the timeout.
  Status finalize_impl() {
    ZINF_RETURN_IF_ERROR(finalize_context(layout_.lay_out(config_, rank_, world_, *exchange_),
                                          "laying out the parameters", ""));
    Status st = build_state();
    if (!st.is_ok() && world_ > 1 && st.code() != Code::kTimeout && st.code() != Code::kAborted) {
      comm_.abort(st.with_context(fmt::format("rank {} of {}", rank_, world_)));
    }
    return st;
  }

  // `st`, an error of finalize while it built `what`, as "finalize: <what>: <message>"; when the
  // device or host ran out of memory (kResourceExhausted), `settings` follows: the config keys
  // that make `what` smaller. The code and the raw error stay those of `st`. A message that
  // begins "finalize:" already says what failed (the layout's: the ranks disagreeing, an
  // initializer failing, also when the optimizer state calls it) and is kept as it is.
  static Status finalize_context(const Status& st, std::string_view what,
                                 std::string_view settings) {
    if (st.is_ok() || st.message().starts_with("finalize:")) return st;
    const Status named = st.with_context(fmt::format("finalize: {}", what));
    if (st.code() != Code::kResourceExhausted || settings.empty()) return named;
    return Status(st.code(), st.sys_code(),
                  fmt::format("{}; to need less memory for it, {}", named.message(), settings));
  }

  // `result`'s value moved into `*out`, or its error with finalize_context()'s.
  template <typename T>
  static Status take_or_context(Result<T> result, T* out, std::string_view what,
                                std::string_view settings) {
    if (!result.is_ok()) return finalize_context(result.status(), what, settings);
    *out = std::move(result).value();
    return Status();
  }

  // What open_optimizer_state() builds, and what makes it smaller, for finalize_context().
  std::string optimizer_state_what() const {
    const OffloadDevice tier = config_.zero.offload_optimizer.device;
    if (tier == OffloadDevice::kNone) {
      return "the optimizer state in device memory (this rank's partition of the fp32 masters, "
             "the optimizer moments and the gradients; zero_optimization.offload_optimizer.device "
             "none)";
    }
    return fmt::format(
        "the optimizer state offloaded to {} (zero_optimization.offload_optimizer.device {}) and "
        "its pinned blocks",
        tier == OffloadDevice::kHost ? "host memory" : "NVMe", offload_device_name(tier));
  }
  std::string optimizer_state_settings() const {
    const ZeroConfig& z = config_.zero;
    if (z.offload_optimizer.device == OffloadDevice::kNone) {
      return "set zero_optimization.offload_optimizer.device to cpu or nvme, or train on more "
             "ranks (each holds 1/world of the state)";
    }
    if (z.offload_optimizer.device == OffloadDevice::kHost) {
      return "set zero_optimization.offload_optimizer.device to nvme, or train on more ranks "
             "(each holds 1/world of the state)";
    }
    return fmt::format(
        "lower zero_optimization.sub_group_size ({} parameters) or "
        "zero_optimization.offload_optimizer.buffer_count ({})",
        z.sub_group_size, z.offload_optimizer.buffer_count);
  }

  Status build_state() {
    const ZeroConfig& z = config_.zero;
    const bool stage3 = z.stage == 3;
    ZINF_RETURN_IF_ERROR(
        finalize_context(open_swap(), "opening the NVMe swap space and its I/O engine", ""));

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
    group_params_.resize(param_groups_.size() + 2);  // and the frozen parameters' group
    set_step_params(t_ + 1);
    sc.group_ranges = group_ranges_;
    sc.groups = group_params_;
    ZINF_RETURN_IF_ERROR(take_or_context(open_optimizer_state(sc), &state_, optimizer_state_what(),
                                         optimizer_state_settings()));

    const GradTarget target = state_->grad_target();
    GradReducerOptions ro;
    ro.bucket_elements = z.reduce_bucket_size;
    ro.timeout = timeout_;
    ro.trace = env_.trace;
    ro.trace_track = track_;
    ro.accumulator_zeroed = target.zeroed;
    ro.accumulator = target.custom;
    ro.accumulator_on_device = target.on_device;
    ro.group_offsets = target.group_offsets;
    ro.frozen.resize(layout_.partitioner().param_count());
    for (std::size_t id = 0; id < ro.frozen.size(); ++id) {
      ro.frozen[id] = !layout_.param(id).spec.trainable;
    }
    ZINF_RETURN_IF_ERROR(take_or_context(
        GradReducer::create(layout_.partitioner(), rank_, device_, comm_, target.accumulator, ro,
                            &counters_),
        &reducer_,
        z.stage >= 2 ? "the gradient reduce buckets"
                     : "the gradient reduce buckets and the full gradient copy of every group",
        fmt::format("lower zero_optimization.reduce_bucket_size ({} elements){}",
                    z.reduce_bucket_size,
                    z.stage >= 2 ? "" : ", or set zero_optimization.stage to 2 or 3")));

    ParamCoordinatorOptions co;
    co.shard_tier = stage3 ? z.offload_param.device : OffloadDevice::kNone;
    co.prefetch_elements = z.stage3_prefetch_bucket_size;
    co.max_live_elements = z.stage3_max_live_parameters;
    co.staging_blocks = z.offload_param.buffer_count;
    co.timeout = timeout_;
    co.trace = env_.trace;
    co.trace_track = track_;
    if (co.shard_tier == OffloadDevice::kHost) {
      // A frozen group's shard the optimizer state already holds as published is not copied.
      ZINF_ASSIGN_OR_RETURN(co.shared_host_shards, state_->share_host_shards(layout_.persistent()));
    }
    ZINF_RETURN_IF_ERROR(take_or_context(
        ParamCoordinator::create(layout_.partitioner(), rank_, device_, comm_,
                                 layout_.take_coordinator_modules(), layout_.persistent(), co,
                                 swap_.get(), io_.get(), &counters_),
        &coord_,
        stage3 ? "the parameter shards and the gather buffers"
               : "the parameters (whole on every rank below stage 3)",
        stage3 ? fmt::format("lower zero_optimization.stage3_prefetch_bucket_size ({} elements) "
                             "or zero_optimization.stage3_max_live_parameters ({}){}",
                             z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters,
                             z.offload_param.device == OffloadDevice::kNone
                                 ? ", or set zero_optimization.offload_param.device to cpu or nvme"
                                 : "")
               : "set zero_optimization.stage to 3 (the parameters partitioned)"));
    // Its message names zinf.pinned_pool_bytes and what to lower already.
    ZINF_RETURN_IF_ERROR(
        finalize_context(check_pinned_limit(config_, state_->pinned_bytes(), param_staging_bytes_),
                         "the pinned pool", ""));
    ZINF_ASSERT(coord_->staging_bytes() == param_staging_bytes_);
    publisher_.set_coordinator(coord_.get());
    attach_caller();
    sources_.resize(layout_.partitioner().param_count());
    for (const std::string& name : layout_.module_names()) {
      reduce_span_names_.push_back(fmt::format("reduce {}", name));
    }
    // The device copies: every group's shard is the master rounded to the group's dtype.
    ZINF_RETURN_IF_ERROR(
        finalize_context(state_->place_initial(), "placing the initial parameter values", ""));
    if (config_.overlap_step && state_->overlaps()) {
      // Updates during the backward where nothing global decides the step first: no clipping (or
      // zinf.clip_from_previous_step) and no loss scaling (the step's own norm and overflow
      // check need every gradient), gradients in
      // host memory and reduce-scattered as they come (stages 2 and 3; stage 1 reduces at the
      // step). See step_overlap.hpp.
      // With clipping or loss scaling the pass still opens there, but only reads ahead until
      // step() has decided the step (OverlappedStep::open_reads()).
      opens_in_backward_ = state_->gates() && reducer_->zeroes_groups() && config_.zero.stage >= 2;
      in_backward_ = opens_in_backward_ &&
                     (config_.gradient_clipping <= 0.0 || config_.clip_from_previous_step) &&
                     !config_.fp16.enabled;
      pending_final_.reserve(layout_.group_count());
      OverlappedStep::Parts parts;
      parts.layout = &layout_;
      parts.publisher = &publisher_;
      parts.coord = coord_.get();
      parts.state = state_.get();
      parts.reducer = reducer_.get();
      parts.counters = &counters_;
      parts.trace = env_.trace;
      parts.rank = rank_;
      parts.in_backward = opens_in_backward_;
      overlap_ = std::make_unique<OverlappedStep>(parts);
    }
    finalized_ = true;
    return Status::ok();
  }

  // Swap space for everything on NVMe: the optimizer's extents and the parameter shards.
  Status open_swap() {
    ZINF_ASSIGN_OR_RETURN(EngineSwap swap,
                          open_engine_swap(config_, env_, layout_, rank_, nvme_dirs_));
    // The swap space uses the I/O engine: swap_ goes first in teardown().
    io_ = std::move(swap.io);
    swap_ = std::move(swap.swap);
    param_staging_bytes_ = swap.param_staging_bytes;
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

  // The engine's error becomes sticky; a pass open in the backward is called off and waited for
  // (its gradients will not come now).
  Status fail(Status st) {
    if (!st.is_ok() && overlap_ != nullptr && overlap_->open()) overlap_->abandon();
    return sticky_.fail(std::move(st));
  }

  // --- Gather / release ------------------------------------------------------------------------
  Status gather(std::string_view module) {
    ZINF_RETURN_IF_ERROR(ensure_finalized());
    ZINF_ASSIGN_OR_RETURN(std::size_t m, layout_.find_module("gather", module));
    if (overlap_ != nullptr && overlap_->open() && overlap_->any_final(layout_.module_groups(m))) {
      // The pass may be writing its new values already: the gather would mix steps. (Right after
      // the module's own reduction, until the next reduce_gradients() or step(), it may still.)
      return Status::failed_precondition(fmt::format(
          "gather('{}'): the module's gradients of step {} were reduced before the last "
          "reduce_gradients(), and the step's optimizer pass may be writing its parameters "
          "(zinf.overlap_step: docs/ENGINE.md \"Updates during the backward\"); gather a module "
          "again only before the next module's reduction",
          module, overlap_->pass_step()));
    }
    Status st;
    if (overlap_ != nullptr) {
      st = overlap_->gather(m);
    } else {
      std::lock_guard<std::mutex> lock(publisher_.mutex());
      st = coord_->gather(m);
    }
    // A pass that failed is the cause of a gather that found it failed: its error first.
    if (!st.is_ok() && overlap_ != nullptr && overlap_->running() && !overlap_->open()) {
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
    bool done_with = false;
    {
      std::lock_guard<std::mutex> lock(publisher_.mutex());
      ZINF_RETURN_IF_ERROR(coord_->release(m));
      done_with = !coord_->gathered(m);
    }
    // A module reduced before it was released (its weights' gradients before its input's, as
    // train_lm's backward does) is done with: its groups become final for the open pass now
    // instead of at the next reduction. Not with a caller's stream, whose queued work
    // confirm_final() would wait for here, in the middle of the backward's issue.
    if (done_with && caller_ == nullptr && pending_module_ == m && overlap_ != nullptr &&
        overlap_->open()) {
      ZINF_RETURN_IF_ERROR(confirm_final());
    }
    return Status::ok();
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
    // An overlapped pass reads the accumulator this adds into: with an accumulator that can be
    // zeroed by group, each of m's groups waits only until the pass has read it and is zeroed
    // then (below); else the whole pass is finished first. A pass opened in this backward
    // (step_overlap.hpp) reads only groups whose reductions are over: nothing waits for it.
    const bool open = overlap_ != nullptr && overlap_->open();
    const bool by_group = overlap_ != nullptr && reducer_->zeroes_groups();
    const bool beside_pass = !open && by_group && overlap_->running();
    Result<std::size_t> found = layout_.find_module("reduce_gradients", module);
    if (found.is_ok()) {
      const ParameterSpec& first = layout_.param(layout_.module_params(*found).front()).spec;
      if (!first.trainable) {
        return Status::invalid_argument(
            fmt::format("reduce_gradients('{}'): the module's parameters are frozen "
                        "(ParameterSpec::trainable false, '{}'): it takes no gradients",
                        module, first.name));
      }
    }
    // After a pass that read ahead was called off, as while it was open: the collective part of
    // settle() (the persistent groups) waits for step(), where the ranks whose pass is still open
    // do it too (commit_step()).
    ZINF_RETURN_IF_ERROR(open || beside_pass || called_off_ ? ensure_finalized() : settle());
    ZINF_ASSIGN_OR_RETURN(std::size_t m, std::move(found));
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
      if (!dtype_valid(g.dtype)) {
        return Status::invalid_argument(
            fmt::format("reduce_gradients('{}'): gradient of '{}' has dtype {}, not f32, f16 or "
                        "bf16",
                        module, g.name, static_cast<int>(g.dtype)));
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
    if (by_group) {
      Status st = overlap_->clear_grads(layout_.module_groups(m));
      // A pass that failed is the cause: its error first.
      if (!st.is_ok()) ZINF_RETURN_IF_ERROR(finish_step(/*collective=*/false));
      ZINF_RETURN_IF_ERROR(fail(st));
    }
    if (open) {
      const std::size_t first = layout_.module_params(m).front();
      const bool extra =
          reducer_->reduced(static_cast<ParamId>(first)) >= config_.gradient_accumulation_steps;
      if (extra && overlap_->reads_only()) {
        // A pass that only reads ahead is called off: the step runs at step() as it would have.
        ZINF_RETURN_IF_ERROR(call_off_reads());
      } else if (extra) {
        // The pass has taken this module's gradients as final already.
        overlap_->cancel();
        return fail(Status::failed_precondition(fmt::format(
            "reduce_gradients('{}'): more than gradient_accumulation_steps ({}) micro-batches "
            "since the last step; the optimizer step {} began updating in the backward of "
            "micro-batch {} of {} (zinf.overlap_step: docs/ENGINE.md \"Updates during the "
            "backward\"): call step() after every gradient_accumulation_steps micro-batches",
            module, config_.gradient_accumulation_steps, overlap_->pass_step(),
            config_.gradient_accumulation_steps, config_.gradient_accumulation_steps)));
      } else {
        // The reductions before this one have run (the backward's compute in between hid them).
        ZINF_RETURN_IF_ERROR(confirm_final());
      }
    }
    {
      Trace::Span span(env_.trace, track_, reduce_span_names_[m]);
      grads_pending_ = true;
      ZINF_RETURN_IF_ERROR(fail(reducer_->reduce(layout_.module_groups(m), sources)));
    }
    return opens_in_backward_ ? after_reduce(m) : Status::ok();
  }

  // With a pass that opens during the backward: module m's last micro-batch of the step is
  // reduced (or being reduced), so its groups become final for the pass once the reduction has
  // run; the first such module of a step opens the pass. Where step() must decide the scale
  // first (clipping, loss scaling, or the first step of zinf.clip_from_previous_step) the pass
  // only reads ahead, and nothing is final before step().
  Status after_reduce(std::size_t m) {
    const std::vector<std::size_t>& params = layout_.module_params(m);
    if (params.empty() || reducer_->reduced(static_cast<ParamId>(params.front())) <
                              config_.gradient_accumulation_steps) {
      return Status::ok();
    }
    if (!overlap_->open()) {
      // set_learning_rate() sets the rate until step(): the pass starts there. And only where
      // gradient_accumulation_steps was declared or the last step had that many micro-batches.
      // A pass that updates opens only where it was declared: a caller who never declared it
      // (its default is 1) may still reduce more micro-batches in a later step (or a gradient
      // that is not finite, which a pass that updated could no longer skip), so for it the pass
      // only reads ahead, and an extra micro-batch calls that off.
      const bool declared =
          config_.gradient_accumulation_given || config_.gradient_accumulation_steps > 1;
      if (lr_override_ || called_off_ || !(micro_matched_ || declared)) return Status::ok();
      // Hyper-parameters the optimizer cannot take: step() refuses them, and no pass opens
      // before the next step(), as after a call-off (a further micro-batch, once a new schedule
      // is set, would open one with more micro-batches than the pass takes).
      if (!check_step_params(t_ + 1).is_ok()) {
        called_off_ = true;
        return Status::ok();
      }
      // With zinf.clip_from_previous_step, the first step's scale needs its own norm.
      const std::optional<float> scale =
          in_backward_ && declared
              ? numerics_->scale_before_norm(static_cast<int>(config_.gradient_accumulation_steps))
              : std::nullopt;
      // The previous step's pass; the backward's reductions waited for its groups already.
      if (overlap_->running()) ZINF_RETURN_IF_ERROR(finish_step(/*collective=*/false));
      set_step_params(t_ + 1);
      ZINF_RETURN_IF_ERROR(fail(state_->set_group_params(group_params_)));
      if (scale.has_value()) {
        overlap_->open_pass(t_ + 1, *scale);
      } else {
        overlap_->open_reads(t_ + 1);
      }
    }
    if (overlap_->reads_only()) return Status::ok();
    overlap_->note_reduced(layout_.module_groups(m));
    for (std::uint32_t g : layout_.module_groups(m)) pending_final_.push_back(g);
    pending_module_ = m;
    return Status::ok();
  }

  // The reductions issued so far have run: their groups are final for the open pass.
  Status confirm_final() {
    if (pending_final_.empty()) return Status::ok();
    // The caller's work queued after those reductions (it may still read their modules'
    // parameters) is done before the pass may rewrite their shards.
    if (caller_ != nullptr) ZINF_RETURN_IF_ERROR(fail(caller_->host_wait(timeout_)));
    ZINF_RETURN_IF_ERROR(fail(reducer_->wait()));
    {
      // A prefetch of the module issued before its reduction (it was reduced without being
      // gathered) has read its shards before the pass may rewrite them.
      std::lock_guard<std::mutex> lock(publisher_.mutex());
      if (pending_module_ != SIZE_MAX) {
        ZINF_RETURN_IF_ERROR(fail(coord_->settle_prefetch(pending_module_)));
      }
    }
    overlap_->final(pending_final_);
    pending_final_.clear();
    pending_module_ = SIZE_MAX;
    return Status::ok();
  }

  // --- Step ------------------------------------------------------------------------------------
  Result<StepReport> step(int average_over) {
    if (average_over < 0) {
      return Status::invalid_argument(fmt::format(
          "step: average_over {} (0, or at least the micro-batches reduced)", average_over));
    }
    // Before anything of the step changes, so not sticky: a new schedule lets it go on.
    ZINF_RETURN_IF_ERROR(check_step_params(t_ + 1));
    if (overlap_ != nullptr && overlap_->open()) {
      const int micro = static_cast<int>(config_.gradient_accumulation_steps);
      if (average_over != 0 && average_over != micro) {
        return Status::invalid_argument(fmt::format(
            "step: average_over {}, but the step's pass opened during the backward "
            "(zinf.overlap_step) after its gradient_accumulation_steps ({}) micro-batches",
            average_over, micro));
      }
      called_off_ = false;
      ZINF_RETURN_IF_ERROR(commit_step());
      return report_;
    }
    const bool was_called_off = called_off_;
    called_off_ = false;
    ZINF_RETURN_IF_ERROR(settle());
    const std::int64_t start = Trace::now_ns();
    ZINF_RETURN_IF_ERROR(none_gathered());
    ZINF_ASSIGN_OR_RETURN(int micro, reducer_->micro_batches());
    if (average_over != 0 && average_over < micro) {
      called_off_ = was_called_off;  // refused: as if not called
      return Status::invalid_argument(
          fmt::format("step: average_over {} is below the {} micro-batches reduced since the "
                      "last step",
                      average_over, micro));
    }
    micro_matched_ = static_cast<std::size_t>(micro) == config_.gradient_accumulation_steps;
    // The step overwrites parameters the caller's queued work may still read.
    if (caller_ != nullptr) ZINF_RETURN_IF_ERROR(fail(caller_->host_wait(timeout_)));
    coord_->freeze_order();
    report_.skipped = false;
    Status st = step_impl(micro, average_over != 0 ? average_over : micro, start);
    // An overflow at the loss scale's floor is reported, not sticky (skipped()).
    if (!st.is_ok()) return report_.skipped ? st : fail(st);
    return report_;
  }

  // step() needs every module released: the step overwrites what they hold.
  Status none_gathered() const {
    const long in_use = coord_->first_in_use();
    if (in_use < 0) return Status::ok();
    return Status::failed_precondition(
        fmt::format("step: module '{}' is still gathered (release it first)",
                    layout_.module_names()[static_cast<std::size_t>(in_use)]));
  }

  // step() of a pass opened during the backward: the same checks and figures as step_impl(),
  // and the pass goes on behind the next forward as a pass start() began would.
  Status commit_step() {
    ZINF_RETURN_IF_ERROR(ensure_finalized());
    const std::int64_t start = Trace::now_ns();
    // The coordinator is shared with the pass's shard writes: under the publisher's mutex.
    std::unique_lock<std::mutex> coord_lock(publisher_.mutex());
    ZINF_RETURN_IF_ERROR(none_gathered());
    ZINF_ASSIGN_OR_RETURN(int micro, reducer_->micro_batches());
    ZINF_ASSERT(static_cast<std::size_t>(micro) == config_.gradient_accumulation_steps);
    micro_matched_ = true;
    coord_->freeze_order();
    Status dropped = coord_->drop_prefetched();
    coord_lock.unlock();
    ZINF_RETURN_IF_ERROR(fail(dropped));
    if (caller_ != nullptr) ZINF_RETURN_IF_ERROR(fail(caller_->host_wait(timeout_)));
    // Where a rank called its pass off (a local call can), step() all-gathers the persistent
    // groups pending from the previous pass (settle()): so does a pass that reads ahead, whose
    // shards still hold those values, so that every rank issues the same collectives.
    if (overlap_->reads_only()) ZINF_RETURN_IF_ERROR(fail(overlap_->publish_pending()));
    std::int64_t decided_ns = 0;
    Result<StepDecision> decision = reduce_and_decide(micro, micro, &decided_ns);
    ZINF_RETURN_IF_ERROR(fail(decision.status()));
    const StepDecision& d = *decision;
    StepReport& rep = report_;
    if (overlap_->reads_only()) {
      // Nothing is updated yet: a skipped step calls the pass off, an applied one lets it
      // update with the scale decided now.
      rep.read_ahead = true;
      if (d.overflow) {
        ZINF_RETURN_IF_ERROR(fail(overlap_->call_off()));
        return skipped(rep, start);
      }
      overlap_->decide(d.grad_scale);
    } else if (d.overflow) {
      // The sequential step would skip it; here parts of the state are updated already (the
      // last reductions' groups are not final yet: the pass stops before them at the latest).
      return fail(Status::aborted(fmt::format(
          "step {}: the gradients are not finite (norm {}), and the optimizer step had already "
          "updated part of the state during the backward (zinf.overlap_step: docs/ENGINE.md "
          "\"Updates during the backward\"), so it cannot be skipped: this engine cannot go on; "
          "open a new one and load a checkpoint. With zinf.overlap_step false such a step is "
          "skipped",
          overlap_->pass_step(), d.grad_norm)));
    } else {
      ZINF_ASSERT_MSG(d.grad_scale == overlap_->pass_scale(),
                      "step: the pass opened during the backward has another gradient scale");
      rep.in_backward = true;
    }
    // The last reductions' groups, and every other group (every module was reduced
    // gradient_accumulation_steps times; a module whose reduction came before the pass opened,
    // when set_lr_schedule() made it open later in the backward, is final too).
    pending_final_.clear();
    pending_module_ = SIZE_MAX;
    overlap_->final_all();
    rep.clip_coef = d.clip_coef;
    ++t_;
    ZINF_ASSERT(t_ == overlap_->pass_step());
    rep.overlapped = true;
    overlap_->take_figures(rep);
    overlap_->commit();
    return applied(rep, start);
  }

  // The end of an applied step (sequential, or handed to the overlapped pass): the report's
  // last figures and the counts.
  Status applied(StepReport& rep, std::int64_t start) {
    grads_pending_ = false;
    LossScaler& scaler = numerics_->scaler();
    scaler.update(false);
    rep.step = t_;
    rep.next_loss_scale = scaler.scale();
    rep.wall_ns = Trace::now_ns() - start;
    ++steps_;
    return Status::ok();
  }

  // A step skipped on overflow: nothing changes but the loss scale, and the gradients are zeroed.
  // An overflow with the scale already at fp16.min_loss_scale is skipped the same way and then
  // reported (kAborted, not sticky: the next step may run), where DeepSpeed raises an error.
  Status skipped(StepReport& rep, std::int64_t start) {
    rep.overlapped = overlap_ != nullptr;
    if (rep.overlapped) overlap_->take_figures(rep);
    LossScaler& scaler = numerics_->scaler();
    const bool at_floor = scaler.at_floor();
    scaler.update(true);
    reducer_->zero();
    grads_pending_ = false;
    rep.skipped = true;
    rep.step = t_;
    rep.next_loss_scale = scaler.scale();
    rep.wall_ns = Trace::now_ns() - start;
    ++steps_;
    ++skipped_steps_;
    if (rank_ == 0 && config_.fp16.enabled) {
      // Expected while dynamic loss scaling finds its scale (DeepSpeed logs each one too).
      log_info("step() call {}: gradients not finite at loss scale {}: step skipped, scale now {}",
               steps_, rep.loss_scale, rep.next_loss_scale);
    } else if (rank_ == 0 && std::has_single_bit(static_cast<std::uint64_t>(skipped_steps_))) {
      // Without loss scaling a non-finite gradient is the model's or the data's: said at the
      // 1st, 2nd, 4th, 8th, ... such step, so that a run that stalls on it is not silent.
      log_warn(
          "step() call {}: the gradients are not finite (NaN or inf): the step was skipped and "
          "the parameters left as they were ({} step(s) skipped so far; StepReport::skipped)",
          steps_, skipped_steps_);
    }
    if (at_floor) {
      return Status::aborted(fmt::format(
          "step() call {}: the gradients are not finite with the loss scale already at "
          "fp16.min_loss_scale ({}); the step was skipped, and scaling cannot avoid the next "
          "overflow: lower fp16.min_loss_scale, or look for what makes the loss or the "
          "gradients non-finite (DeepSpeed stops here with an error)",
          steps_, scaler.scale()));
    }
    return Status::ok();
  }

  // A new report for the step and its decision: the backward's last reductions (and stage 1's
  // reduce-scatter), then the norm, overflow and clipping (StepNumerics) of the accumulated
  // gradients of `micro` micro-batches divided by `divisor`; *decided_ns: when.
  Result<StepDecision> reduce_and_decide(int micro, int divisor, std::int64_t* decided_ns) {
    StepReport& rep = report_;
    rep = StepReport{};
    rep.micro_batches = micro;
    rep.loss_scale = numerics_->scaler().scale();
    const std::int64_t t0 = Trace::now_ns();
    {
      Trace::Span span(env_.trace, track_, "step reduce");
      // The last buckets of the backward pass may still be reducing.
      ZINF_RETURN_IF_ERROR(reducer_->wait());
      ZINF_RETURN_IF_ERROR(reducer_->reduce_accumulated());
    }
    const std::int64_t t1 = Trace::now_ns();
    rep.reduce_ns = t1 - t0;
    StepDecision d;
    {
      // The local sum of squares is of the gradients as accumulated; decide() unscales it.
      ZINF_ASSIGN_OR_RETURN(double sumsq, state_->local_sum_of_squares());
      Trace::Span span(env_.trace, track_, "step norm");
      ZINF_ASSIGN_OR_RETURN(d, numerics_->decide(sumsq, divisor, *stream_, *event_));
    }
    rep.grad_norm = d.grad_norm;
    *decided_ns = Trace::now_ns();
    rep.norm_ns = *decided_ns - t1;
    return d;
  }

  // Reduce, decide (norm, overflow, clipping: before any state changes, so a skipped step
  // changes nothing but the loss scale), update, publish.
  Status step_impl(int micro, int divisor, std::int64_t start) {
    ZINF_RETURN_IF_ERROR(coord_->drop_prefetched());
    std::int64_t t2 = 0;
    ZINF_ASSIGN_OR_RETURN(const StepDecision d, reduce_and_decide(micro, divisor, &t2));
    StepReport& rep = report_;
    if (d.overflow) return skipped(rep, start);
    rep.clip_coef = d.clip_coef;
    ++t_;
    // The schedule's (or set_learning_rate()'s) hyper-parameters for this step.
    set_step_params(t_);
    ZINF_RETURN_IF_ERROR(state_->set_group_params(group_params_));
    if (overlap_ != nullptr) {
      // Overlapped: the pass runs on; this report carries the previous pass's figures.
      rep.overlapped = true;
      overlap_->take_figures(rep);
      overlap_->start(t_, d.grad_scale);
      return applied(rep, start);
    }
    ZINF_RETURN_IF_ERROR(run_optimizer(*state_, counters_, env_.trace, track_, t_, d.grad_scale, t2,
                                       /*overlapped=*/false, rep));
    reducer_->zero();
    return applied(rep, start);
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
    // Beside the default group and the frozen parameters' (param_groups.hpp).
    if (param_groups_.size() + 2 >= kMaxOptimizerGroups) {
      return Status::invalid_argument(fmt::format("add_param_group('{}'): at most {} groups",
                                                  group.name, kMaxOptimizerGroups - 2));
    }
    param_groups_.push_back(group);
    return Status::ok();
  }

  // Whether applied step `step` (from 1) runs with the optimizer's own lr and betas, the
  // schedule's not yet applied. DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR and OneCycle
  // (deepspeed/runtime/lr_schedules.py) write the group's lr (and OneCycle its betas) when they
  // are built only where last_batch_iteration is -1; from a start L >= 0 they leave the
  // optimizer's values, the first step runs with them, and the scheduler's step() after it sets
  // lr_at(L + 1) for the second. A checkpoint saved after k >= 1 steps holds the optimizer's lr
  // of the scheduler's last step(), lr_at(L + k), which DeepSpeed's load restores: step k + 1
  // runs at lr_at(L + k), as below. (One saved before any step holds the optimizer's own lr, so
  // step 1 after its load is this case too.)
  bool step_before_schedule(std::int64_t step) const {
    return step == 1 && schedule_.config().kind != ScheduleKind::kNone &&
           schedule_.config().last_batch_iteration >= 0;
  }

  // The default group's lr for applied step `step` (from 1), DeepSpeed's: the k-th applied step
  // runs with the schedule's lr_at(L + k - 1), L its last_batch_iteration (-1 unless given), except
  // the first from L >= 0 (step_before_schedule), which runs with the optimizer's lr.
  double lr_for_step(std::int64_t step) const {
    if (lr_override_ || step_before_schedule(step)) return config_.optimizer.lr;
    return schedule_.lr_at(schedule_.config().last_batch_iteration + step - 1);
  }

  // The optimizer's hyper-parameters for applied step `step`, the schedule's betas in them (the
  // optimizer's own where step_before_schedule).
  OptimizerParams params_for_step(std::int64_t step) const {
    OptimizerParams base = config_.optimizer;
    if (step_before_schedule(step)) return base;
    const ScheduledBetas betas =
        schedule_.betas_at(schedule_.config().last_batch_iteration + step - 1);
    if (betas.set) {
      base.beta1 = betas.beta1;
      base.beta2 = betas.beta2;
    }
    return base;
  }

  // Whether the optimizer can take the schedule's hyper-parameters for applied step `step`
  // (LrSchedule::check_at: OneCycle's momentum after its cycle may leave [0, 1)).
  Status check_step_params(std::int64_t step) const {
    if (step_before_schedule(step)) return Status::ok();
    Status st = schedule_.check_at(schedule_.config().last_batch_iteration + step - 1);
    return st.is_ok() ? st : st.with_context(fmt::format("step {}", step));
  }

  // group_params_ for applied step `step`. Allocates nothing.
  void set_step_params(std::int64_t step) {
    group_params(params_for_step(step), lr_for_step(step), param_groups_, &group_params_);
  }

  Status set_lr_schedule(const ScheduleConfig& config) {
    ZINF_RETURN_IF_ERROR(call_off_reads());
    if (overlap_ != nullptr && overlap_->open()) {
      return Status::failed_precondition(fmt::format(
          "set_lr_schedule: the optimizer step {} began during the backward with the current "
          "schedule (zinf.overlap_step); set the schedule before the step's last micro-batch",
          overlap_->pass_step()));
    }
    ZINF_ASSIGN_OR_RETURN(schedule_, LrSchedule::create(config, config_.optimizer.lr));
    config_.scheduler = config;
    lr_override_ = false;
    return Status::ok();
  }

  // The learning rate after a load: resumed_schedule() (checkpoint.hpp) chooses between the
  // checkpoint's schedule and lr and the engine's own, as the load checked it.
  void restore_schedule(std::string_view call, const ResumeState& r) {
    const ResumedSchedule resumed = resumed_schedule(schedule_.config(), config_.optimizer.lr, r);
    if (resumed.own_kept && rank_ == 0 &&
        (resumed.schedule != r.schedule || config_.optimizer.lr != r.lr)) {
      log_info(
          "{}: the config's {} schedule (and lr {}) replaces the checkpoint's {} (lr {}) from "
          "step {} on, as DeepSpeed resumes a schedule",
          call, schedule_name(resumed.schedule.kind), config_.optimizer.lr,
          schedule_name(r.schedule.kind), r.lr, t_);
    }
    config_.optimizer.lr = resumed.lr;
    Result<LrSchedule> loaded = LrSchedule::create(resumed.schedule, config_.optimizer.lr);
    if (loaded.is_ok()) {
      schedule_ = std::move(*loaded);
      config_.scheduler = resumed.schedule;
    }
    lr_override_ = r.lr_override;
  }

  Status set_learning_rate(double lr) {
    if (overlap_ != nullptr && overlap_->reads_only() && lr != lr_for_step(overlap_->pass_step())) {
      ZINF_RETURN_IF_ERROR(call_off_reads());
    }
    if (overlap_ != nullptr && overlap_->open() && lr != lr_for_step(overlap_->pass_step())) {
      return Status::failed_precondition(fmt::format(
          "set_learning_rate({}): the optimizer step {} began during the backward with the "
          "schedule's learning rate {} (zinf.overlap_step: docs/ENGINE.md \"Updates during the "
          "backward\"); set the rate before the step's last micro-batch, or set "
          "zinf.overlap_step to false",
          lr, overlap_->pass_step(), lr_for_step(overlap_->pass_step())));
    }
    config_.optimizer.lr = lr;
    lr_override_ = true;
    return Status::ok();
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
    ZINF_RETURN_IF_ERROR(collective_call(call, settle()));
    ResumeState r{t_, numerics_->scaler(), config_.optimizer.lr, lr_override_, schedule_.config()};
    if (coord_->order_frozen()) r.gather_order = gather_order_names(layout_, coord_->order());
    r.client_state = client_state_;
    r.previous_clip_coef = numerics_->previous_clip_coef();
    return collective_call(
        call, zinf::save_checkpoint(checkpoint_context(), call, std::string(dir), std::string(tag),
                                    checkpoint_precondition(call), r));
  }

  // A collective call's timeout says that every rank makes the call (a save on rank 0 alone is
  // a common mistake), before the collective that ran out.
  Status collective_call(std::string_view call, Status st) const {
    if (st.code() != Code::kTimeout || world_ == 1) return st;
    return st.with_context(
        fmt::format("{} is collective: every rank calls it, and one of them did not", call));
  }

  Status load_checkpoint(std::string_view dir, std::string_view tag) {
    const std::string call =
        fmt::format("load_checkpoint('{}'{})", dir, tag.empty() ? "" : fmt::format(", '{}'", tag));
    ZINF_RETURN_IF_ERROR(collective_call(call, settle()));
    // The load writes the shards (OptimizerState::master_loaded, write_loaded), so the
    // prefetched modules go first and the caller's work on the device copies is waited for. The
    // outcome is agreed with the other ranks' checks: a rank that fails here fails every rank at
    // once, where after the load it failed alone and left the others waiting in the republish's
    // all-gather.
    Status pre = checkpoint_precondition(call);
    if (pre.is_ok()) pre = fail(coord_->drop_prefetched());
    if (pre.is_ok() && caller_ != nullptr) pre = fail(caller_->host_wait(timeout_));
    ResumeState r;
    ZINF_RETURN_IF_ERROR(
        collective_call(call, load_checkpoint_state(checkpoint_context(), call, std::string(dir),
                                                    std::string(tag), std::move(pre), &r)));
    t_ = r.step;
    // The saved scaler only where both are dynamic (restores_loss_scaler); otherwise this
    // engine's own, as it started, whatever it did before the load.
    LossScaler& scaler = numerics_->scaler();
    if (restores_loss_scaler(scaler.dynamic(), r.loss_scaler_mode)) {
      scaler.restore(r.loss_scale, r.loss_scale_good_steps, r.loss_scale_hysteresis_left);
    } else {
      scaler.reset();
    }
    restore_schedule(call, r);
    numerics_->set_previous_clip_coef(r.previous_clip_coef);
    // The gather order, when every module in it is one of ours (else the next step records it).
    std::vector<std::size_t> order = gather_order_indices(layout_, r.gather_order);
    if (!order.empty()) coord_->restore_order(std::move(order));
    client_state_ = std::move(r.client_state);
    state_->restored(t_);
    // The load wrote the shards from the loaded master, as finalize() places them, and every
    // rank agreed that every rank's writes succeeded: the persistent groups are all-gathered.
    return fail(publisher_.publish());
  }

  Result<SwapCheckReport> verify_swap() {
    if (swap_ == nullptr) return SwapCheckReport{};
    // Local: the pass's writes landed; the persistent groups wait for a collective call. A pass
    // that failed (a peer gone mid-step) is already this rank's sticky error; the swap is read
    // back all the same, since checking it after a failure is what this call is for.
    if (finalized_ && overlap_ != nullptr && overlap_->open() && !overlap_->reads_only()) {
      return finish_step(/*collective=*/false);  // refused: the pass writes the swap
    }
    if (finalized_) (void)finish_step(/*collective=*/false);
    ZINF_ASSIGN_OR_RETURN(SwapVerifyReport r, swap_->verify(timeout_));
    return SwapCheckReport{r.blocks, r.bytes, r.skipped_blocks};
  }

  // --- Read back -------------------------------------------------------------------------------
  MasterAccess master_access() {
    return {state_.get(),  coord_.get(), &publisher_, &layout_, &device_, &comm_,
            stream_.get(), event_.get(), timeout_,    rank_,    &sticky_, &*exchange_};
  }
  Status read_parameters(std::string_view name, float* out) {
    ZINF_RETURN_IF_ERROR(settle());
    return read_master_values(master_access(), name, out);
  }
  Status read_optimizer_state(std::string_view name, std::string_view state, float* out) {
    ZINF_RETURN_IF_ERROR(settle());
    return read_moment_values(master_access(), config_.optimizer.kind, name, state, out);
  }

  Status write_parameters(std::string_view name, const float* values, int root) {
    ZINF_RETURN_IF_ERROR(settle());
    Status pre = write_precondition(fmt::format("write_parameters('{}')", name));
    return write_master_values(master_access(), name, values, root, std::move(pre));
  }
  Status write_parameters(std::span<const std::string_view> names, const ParameterValues& values,
                          int root) {
    ZINF_RETURN_IF_ERROR(settle());
    Status pre = write_precondition(write_parameters_call(names));
    return write_master_values(master_access(), names, values, root, std::move(pre));
  }
  // write_parameters' precondition, agreed with the ranks' checks: a checkpoint's, and the
  // caller's work queued on the compute stream done, as step() and load_checkpoint() wait for
  // it: the call rewrites the device copies, the persistent groups' gathered values themselves,
  // which that work may still be reading.
  Status write_precondition(std::string_view call) {
    Status pre = checkpoint_precondition(call);
    if (pre.is_ok() && caller_ != nullptr) pre = fail(caller_->host_wait(timeout_));
    return pre;
  }

  MemoryReport memory() const {
    MemoryReport m;
    m.device_bytes = coord_->device_bytes();
    // Stage 1's full gradients (none for a frozen group).
    m.device_bytes += reducer_->full_bytes();
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
  bool grads_pending_ = false;      // reduce_gradients() was called since the last step
  bool opens_in_backward_ = false;  // the overlapped step's pass may open during the backward
  bool in_backward_ = false;        // ... and update there (else it reads ahead only)
  // A pass reading ahead was called off since step(), or the step's hyper-parameters were
  // refused (check_step_params): no pass opens before step().
  bool called_off_ = false;
  bool micro_matched_ = false;  // the last step had gradient_accumulation_steps micro-batches
  std::vector<std::uint32_t> pending_final_;  // groups reduced, not yet final for the open pass
  std::size_t pending_module_ = SIZE_MAX;     // the module whose groups are pending_final_
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

  // The overlapped step (zinf.overlap_step), when the state overlaps; null: the sequential step.
  std::unique_ptr<OverlappedStep> overlap_;

  // Calls off a pass that only reads ahead (OverlappedStep::call_off()): the step then runs at
  // step() as a sequential decision would start it, and no pass opens again before step().
  Status call_off_reads() {
    if (overlap_ == nullptr || !overlap_->reads_only()) return Status::ok();
    called_off_ = true;
    return fail(overlap_->call_off());
  }

  // Waits for an overlapped pass (see OverlappedStep::finish()); its error is sticky. A pass
  // that only reads ahead is called off. A pass updating during the backward needs the rest of
  // the backward and step(): refused, not sticky.
  Status finish_step(bool collective) {
    if (overlap_ == nullptr) return Status::ok();
    ZINF_RETURN_IF_ERROR(call_off_reads());
    if (overlap_->open()) {
      return Status::failed_precondition(fmt::format(
          "the optimizer step {} is updating the state beside the backward (zinf.overlap_step: "
          "docs/ENGINE.md \"Updates during the backward\"): call step() first",
          overlap_->pass_step()));
    }
    return fail(overlap_->finish(collective));
  }
};

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
  // The communicator bounds each collective by its own timeout, the engine its waits by the
  // config's: with two values the smaller decides where a rank stalls, and only the
  // communicator's names the collective and the ranks missing.
  const std::chrono::milliseconds comm_timeout = env.comm->collective_timeout();
  if (env.comm->rank() == 0 && comm_timeout != kWaitForever &&
      comm_timeout.count() != config.collective_timeout_ms) {
    log_warn(
        "zinf.collective_timeout_ms is {} ms, but the communicator ({}) was made with a "
        "collective timeout of {} ms (MpiCommOptions / LocalCommOptions::timeout; in the C API "
        "the timeout_ms of zinf_mpi_comm_group_create / zinf_local_comm_group_create): a "
        "stalled rank fails the job after the smaller; give both the same value",
        config.collective_timeout_ms, env.comm->name(), comm_timeout.count());
  }
  // DeepSpeed's batch arithmetic at the communicator's world size (a no-op where parse_config()
  // resolved it at zinf.world_size, or without train_batch_size).
  Config resolved = config;
  ZINF_RETURN_IF_ERROR(resolve_batch_sizes(env.comm->world_size(), &resolved));
  auto impl = std::make_unique<Impl>(resolved, env);
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
Result<StepReport> Engine::step() { return impl_->step(0); }
Result<StepReport> Engine::step(int average_over) { return impl_->step(average_over); }
Status Engine::save_checkpoint(std::string_view dir, std::string_view tag) {
  return impl_->save_checkpoint(dir, tag);
}
Status Engine::save_checkpoint(std::string_view dir) {
  return impl_->save_checkpoint(dir, fmt::format("global_step{}", impl_->t_));
}
Status Engine::load_checkpoint(std::string_view dir, std::string_view tag) {
  return impl_->load_checkpoint(dir, tag);
}
std::int64_t Engine::applied_steps() const { return impl_->t_; }
void Engine::set_client_state(std::string_view blob) { impl_->client_state_ = blob; }
const std::string& Engine::client_state() const { return impl_->client_state_; }
Result<SwapCheckReport> Engine::verify_swap() { return impl_->verify_swap(); }
Status Engine::read_parameters(std::string_view name, float* out) {
  return impl_->read_parameters(name, out);
}
Status Engine::read_optimizer_state(std::string_view name, std::string_view state, float* out) {
  return impl_->read_optimizer_state(name, state, out);
}
Status Engine::write_parameters(std::string_view name, const float* values, int root) {
  return impl_->write_parameters(name, values, root);
}
Status Engine::write_parameters(std::span<const std::string_view> names,
                                const ParameterValues& values, int root) {
  return impl_->write_parameters(names, values, root);
}
double Engine::loss_scale() const { return impl_->numerics_->scaler().scale(); }
Status Engine::set_learning_rate(double lr) {
  if (!std::isfinite(lr) || lr < 0) {
    return Status::invalid_argument(
        fmt::format("set_learning_rate: {} is not a finite number >= 0", lr));
  }
  // The state takes it (every group at lr times its lr_scale) at the next step.
  return impl_->set_learning_rate(lr);
}
double Engine::learning_rate() const { return impl_->lr_for_step(impl_->t_ + 1); }
std::pair<double, double> Engine::betas() const {
  const OptimizerParams next = impl_->params_for_step(impl_->t_ + 1);
  return {next.beta1, next.beta2};
}
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
  // The counters of an overlapped pass are final once it is (an error there is sticky). A pass
  // opened during the backward runs until after step(): the figures stay those of the last call.
  if (impl_->overlap_ != nullptr && impl_->overlap_->open()) return impl_->counters_out_;
  if (impl_->finalized_) (void)impl_->finish_step(/*collective=*/false);
  copy_engine_counters(impl_->counters_, impl_->steps_, impl_->skipped_steps_,
                       impl_->counters_out_);
  return impl_->counters_out_;
}
MemoryReport Engine::memory() const {
  ZINF_ASSERT_MSG(impl_->finalized_,
                  "Engine::memory() before finalize(): the buffers are sized at finalize() (or "
                  "the first gather, reduce_gradients or step); check finalized() first");
  return impl_->memory();
}

}  // namespace zinf
