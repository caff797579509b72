// Engine: wires the Partitioner, the ParamCoordinator, the GradReducer, the optimizer state
// (in device memory, or a StateStore + OptimizerPipeline on host or NVMe) and the LossScaler
// into the calls of include/zinf/engine.hpp.
//
// This rank's optimizer partition is its slice of every group, end to end (GradReducer's
// partition offsets); the fp32 master, moments and fp32 gradient accumulator all use that
// layout, so a step is one pass over the partition whatever the stage.
#include "zinf/engine.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "base/aligned.hpp"
#include "base/assert.hpp"
#include "device/device_ops.hpp"
#include "device/pinned_pool.hpp"
#include "engine/checkpoint.hpp"
#include "engine/device_optimizer.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "tier/optimizer_pipeline.hpp"
#include "tier/state_store.hpp"
#include "zero/grad_accumulator.hpp"
#include "zero/grad_reducer.hpp"
#include "zero/loss_scaler.hpp"
#include "zero/param_coordinator.hpp"
#include "zero/partitioner.hpp"
#include "zinf/log.hpp"

namespace zinf {
namespace {

constexpr std::size_t kPage = 4096;

constexpr std::string_view kPersistentSuffix = "#persistent";

std::size_t round_page(std::size_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }

// Creates and removes a small file in `dir`, so that an unwritable directory fails at open()
// naming the key, not at the first swap write.
Status probe_directory(const std::string& key, const std::string& dir, int rank) {
  const std::string path = fmt::format("{}/.zinf-probe-{}-{}", dir, ::getpid(), rank);
  const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0) {
    return status_from_errno(fmt::format("{}: cannot create a file in '{}'", key, dir), errno);
  }
  ::close(fd);
  ::unlink(path.c_str());
  return Status::ok();
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// dst (count elements of dtype) <- src floats.
void narrow(const float* src, std::size_t count, DType dtype, void* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * sizeof(float));
      break;
    case DType::kBF16:
      convert_f32_to_bf16(src, static_cast<std::uint16_t*>(dst), count);
      break;
    case DType::kF16:
      convert_f32_to_f16(src, static_cast<std::uint16_t*>(dst), count);
      break;
  }
}

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
        timeout_(std::chrono::milliseconds(config.collective_timeout_ms)) {}

  ~Impl() {
    // The coordinator and reducer wait for their streams; then the optimizer side goes, then the
    // swap space, then its engine.
    coord_.reset();
    reducer_.reset();
    spill_.reset();
    device_opt_.reset();
    pipeline_.reset();
    opt_pool_.reset();
    store_.reset();
    swap_.reset();
    io_.reset();
    if (stream_ != nullptr) (void)device_.synchronize(*stream_, timeout_);
  }

  Status init() {
    if (env_.trace != nullptr) track_ = env_.trace->track(fmt::format("rank{} engine", rank_));
    const ZeroConfig& z = config_.zero;
    LossScalerOptions ls;
    ls.dynamic = config_.fp16.enabled && config_.fp16.loss_scale == 0.0;
    ls.initial_scale = !config_.fp16.enabled ? 1.0
                       : ls.dynamic          ? std::ldexp(1.0, config_.fp16.initial_scale_power)
                                             : config_.fp16.loss_scale;
    ls.window = config_.fp16.loss_scale_window;
    ls.hysteresis = config_.fp16.hysteresis;
    ls.min_scale = config_.fp16.min_loss_scale;
    scaler_ = LossScaler(ls);
    // The swap directories, and a probe of each.
    const bool opt_nvme = z.offload_optimizer.device == OffloadDevice::kNvme;
    const bool param_nvme = z.offload_param.device == OffloadDevice::kNvme;
    if (opt_nvme || param_nvme) {
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
        ZINF_RETURN_IF_ERROR(probe_directory(key, dir, rank_));
      }
    }
    ZINF_ASSIGN_OR_RETURN(stream_, device_.create_stream("engine"));
    ZINF_ASSIGN_OR_RETURN(event_, device_.create_event());
    // The norm exchange: this rank's double, then every rank's.
    ZINF_ASSIGN_OR_RETURN(
        scratch_, DeviceBuffer::allocate(device_, (1 + static_cast<std::size_t>(world_)) * 8));
    ZINF_ASSIGN_OR_RETURN(norm_host_, RegisteredBuffer::allocate(device_, scratch_.bytes()));
    return Status::ok();
  }

  // --- Registration --------------------------------------------------------------------------
  Status register_parameter(const ParameterSpec& spec) {
    const std::string what = fmt::format("register_parameter('{}')", spec.name);
    if (finalized_ || !finalize_error_.is_ok()) {
      return Status::failed_precondition(fmt::format(
          "{}: registration is closed (the engine was finalized by finalize() or by the first "
          "gather, reduce_gradients or step)",
          what));
    }
    if (spec.name.empty()) return Status::invalid_argument("register_parameter: empty name");
    if (by_name_.count(spec.name) != 0) {
      return Status::invalid_argument(fmt::format("{}: registered already", what));
    }
    if (spec.module.empty()) {
      return Status::invalid_argument(fmt::format("{}: empty module name", what));
    }
    if (spec.module.ends_with(kPersistentSuffix)) {
      return Status::invalid_argument(
          fmt::format("{}: module names may not end in '{}'", what, kPersistentSuffix));
    }
    std::size_t count = 1;
    for (std::int64_t d : spec.shape) {
      if (d <= 0) {
        return Status::invalid_argument(
            fmt::format("{}: shape {} has a dimension <= 0", what, shape_text(spec.shape)));
      }
      if (count > (std::size_t{1} << 48) / static_cast<std::size_t>(d)) {
        return Status::invalid_argument(
            fmt::format("{}: shape {} is too large", what, shape_text(spec.shape)));
      }
      count *= static_cast<std::size_t>(d);
    }
    if ((spec.initial_values == nullptr) == (spec.initializer == nullptr)) {
      return Status::invalid_argument(
          fmt::format("{}: {} of initial_values and initializer are set (exactly one must be)",
                      what, spec.initial_values == nullptr ? "neither" : "both"));
    }
    if (config_.bf16_enabled && spec.dtype != DType::kBF16) {
      return Status::invalid_argument(
          fmt::format("{}: dtype {}, but bf16.enabled is true (every parameter is bf16 then)",
                      what, dtype_name(spec.dtype)));
    }
    Registered r;
    r.spec = spec;
    r.spec.initial_values = nullptr;
    r.element_count = count;
    if (spec.initial_values != nullptr) {
      r.values.assign(spec.initial_values, spec.initial_values + count);
    }
    by_name_[spec.name] = regs_.size();
    if (module_index_.count(spec.module) == 0) {
      module_index_[spec.module] = module_names_.size();
      module_names_.push_back(spec.module);
      module_params_.emplace_back();
    }
    module_params_[module_index_[spec.module]].push_back(regs_.size());
    regs_.push_back(std::move(r));
    return Status::ok();
  }

  // --- Finalize --------------------------------------------------------------------------------
  Status finalize() {
    if (finalized_) return Status::ok();
    ZINF_RETURN_IF_ERROR(finalize_error_);
    Status st = finalize_impl();
    // The initial values are placed (or will never be): drop the copies and the initializers.
    for (Registered& r : regs_) {
      std::vector<float>().swap(r.values);
      r.spec.initializer = nullptr;
    }
    if (!st.is_ok()) {
      finalize_error_ = st;
      // Give back what was built, so the engine holds nothing half made.
      coord_.reset();
      reducer_.reset();
      spill_.reset();
      device_opt_.reset();
      pipeline_.reset();
      opt_pool_.reset();
      store_.reset();
      swap_.reset();
      io_.reset();
    }
    return st;
  }

  Status finalize_impl() {
    if (regs_.empty()) return Status::failed_precondition("finalize: no parameters registered");
    const ZeroConfig& z = config_.zero;
    PartitionerOptions po;
    po.world_size = world_;
    po.stage = static_cast<ZeroStage>(z.stage);
    if (z.group_max_elements != 0) po.group_max_elements = z.group_max_elements;
    ZINF_ASSIGN_OR_RETURN(Partitioner p, Partitioner::create(po));
    part_.emplace(std::move(p));
    const bool stage3 = z.stage == 3;
    for (const Registered& r : regs_) {
      ParamSpec spec;
      spec.name = r.spec.name;
      spec.module = r.spec.module;
      // Small parameters get groups of their own at stage 3, which stay gathered.
      if (stage3 && r.element_count <= z.stage3_param_persistence_threshold) {
        spec.module += kPersistentSuffix;
      }
      spec.shape = r.spec.shape;
      spec.dtype = r.spec.dtype;
      ZINF_ASSIGN_OR_RETURN(ParamId id, part_->add(std::move(spec)));
      ZINF_ASSERT(id + 1 == part_->param_count());
    }
    ZINF_RETURN_IF_ERROR(part_->finalize());
    ZINF_RETURN_IF_ERROR(check_ranks_agree());

    // Groups per module, and which stay gathered.
    const std::uint32_t groups = part_->group_count();
    std::vector<bool> persistent(groups, !stage3);
    std::vector<CoordinatorModule> modules;
    for (const std::string& name : module_names_) {
      CoordinatorModule m;
      m.name = name;
      for (const std::string& key : {name, name + std::string(kPersistentSuffix)}) {
        Result<std::vector<std::uint32_t>> gs = part_->module_groups(key);
        if (!gs.is_ok()) continue;
        for (std::uint32_t g : *gs) {
          m.groups.push_back(g);
          if (key != name) persistent[g] = true;
        }
      }
      module_groups_.push_back(m.groups);
      modules.push_back(std::move(m));
    }
    partition_elements_ = GradReducer::partition_element_count(*part_);
    std::size_t offset = 0, byte_offset = 0;
    bool all_same_half = true;
    std::optional<DType> half;
    for (std::uint32_t g = 0; g < groups; ++g) {
      const GroupInfo& info = part_->group(g);
      offsets_.push_back(offset);
      byte_offsets_.push_back(byte_offset);
      offset += info.shard_element_count;
      byte_offset += info.shard_element_count * dtype_bytes(info.dtype);
      if (info.dtype == DType::kF32) {
        all_same_half = false;
      } else if (!half.has_value()) {
        half = info.dtype;
      } else if (*half != info.dtype) {
        all_same_half = false;
      }
    }
    with_half_ = all_same_half && half.has_value();
    half_dtype_ = half.value_or(DType::kBF16);
    const OffloadDevice opt = z.offload_optimizer.device;
    // With the optimizer state on NVMe and the shards not in host memory (on NVMe, or on the
    // device), the step's half output streams from the pool blocks into the shards, one group at
    // a time through half_stage_ (stream_half()): host memory stays bounded by the pools. With
    // the shards in host memory (offload_param cpu) or the state on the host, the store keeps a
    // host half array instead, which has new_params_'s layout when every group is half of one
    // dtype (byte_offsets_[g] == 2 * offsets_[g]); the step fills it and publish reads it.
    const bool shards_on_host = stage3 && z.offload_param.device == OffloadDevice::kHost;
    half_stream_ = opt == OffloadDevice::kNvme && with_half_ && !shards_on_host;
    publish_from_store_ = opt != OffloadDevice::kNone && with_half_ && !half_stream_;
    if (half_stream_) {
      std::size_t largest = 0;
      for (std::uint32_t g = 0; g < groups; ++g) {
        largest = std::max(largest, part_->group(g).shard_element_count * dtype_bytes(half_dtype_));
      }
      half_stage_ = AlignedBuffer(std::max<std::size_t>(largest, 64));
    } else if (!publish_from_store_) {
      new_params_ = AlignedBuffer(std::max<std::size_t>(byte_offset, 64));
    }
    device_copy_bytes_ = byte_offset;

    // Swap space for everything on NVMe.
    const bool param_nvme = stage3 && z.offload_param.device == OffloadDevice::kNvme;
    StateStoreOptions so;
    if (opt != OffloadDevice::kNone) {
      so.param_count = partition_elements_;
      so.sub_group_params = std::min(z.sub_group_size, partition_elements_);
      so.optimizer = config_.optimizer.kind;
      so.grad_dtype = DType::kF32;
      so.with_half = with_half_;
      so.half_dtype = half_dtype_;
      const Tier state_tier = opt == OffloadDevice::kNvme ? Tier::kNvme : Tier::kHost;
      // validate() allows gradients_on_nvme only with the optimizer state on NVMe.
      const Tier grad_tier = config_.gradients_on_nvme ? Tier::kNvme : Tier::kHost;
      so.tiers = {state_tier, state_tier, state_tier, grad_tier,
                  half_stream_ ? Tier::kBlock : Tier::kHost};
      so.key_prefix = fmt::format("rank{}/opt", rank_);
    }
    if (opt == OffloadDevice::kNvme || param_nvme) {
      std::uint64_t capacity = 0;
      std::uint32_t extents = 0;
      if (opt == OffloadDevice::kNvme) {
        ZINF_ASSIGN_OR_RETURN(StoreLayout layout, StateStore::layout(so));
        capacity += layout.nvme_bytes;
        extents += static_cast<std::uint32_t>(layout.nvme_extents);
      }
      if (param_nvme) {
        std::size_t largest = 0;
        for (std::uint32_t g = 0; g < groups; ++g) {
          if (persistent[g]) continue;
          const GroupInfo& info = part_->group(g);
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
    }

    // The initial fp32 master of this rank's partition is never held whole in host memory: it
    // is built from the registered values or initializers one sub-group at a time (fill_master),
    // so setting up a model whose state lives on NVMe costs no more host memory than its
    // registered values (nothing, with initializers, beyond what they hold).
    for (std::uint32_t g = 0; g < groups; ++g) {
      for (const ParamPiece& piece : part_->shard_pieces(g, rank_)) {
        master_pieces_.push_back({offsets_[g] + piece.shard_offset, piece.param, piece.param_offset,
                                  piece.element_count});
      }
    }
    std::sort(master_pieces_.begin(), master_pieces_.end(),
              [](const MasterPiece& a, const MasterPiece& b) { return a.first < b.first; });

    // Optimizer state.
    float* accumulator = nullptr;
    if (opt == OffloadDevice::kNone && !device_.host_accessible()) {
      ZINF_RETURN_IF_ERROR(open_device_optimizer());
      accumulator = device_opt_->grads();
    } else if (opt == OffloadDevice::kNone) {
      const std::size_t bytes = std::max<std::size_t>(partition_elements_, 1) * sizeof(float);
      ZINF_ASSIGN_OR_RETURN(master_, DeviceBuffer::allocate(device_, bytes));
      ZINF_ASSIGN_OR_RETURN(exp_avg_, DeviceBuffer::allocate(device_, bytes));
      ZINF_ASSIGN_OR_RETURN(exp_avg_sq_, DeviceBuffer::allocate(device_, bytes));
      ZINF_ASSIGN_OR_RETURN(grads_, DeviceBuffer::allocate(device_, bytes));
      ZINF_RETURN_IF_ERROR(fill_master(0, partition_elements_, master_.as<float>()));
      std::memset(exp_avg_.data(), 0, bytes);
      std::memset(exp_avg_sq_.data(), 0, bytes);
      accumulator = grads_.as<float>();
    } else {
      ZINF_ASSIGN_OR_RETURN(store_, StateStore::open(so, swap_.get()));
      if (store_->block_bytes() > 0) {
        PinnedPoolOptions pool;
        pool.block_bytes = round_page(store_->block_bytes());
        pool.block_count = std::max<std::size_t>(2, z.offload_optimizer.buffer_count);
        pool.huge_pages =
            pool.block_bytes < (std::size_t{2} << 20) ? HugePages::kNone : HugePages::kAuto;
        pool.device = &device_;
        ZINF_RETURN_IF_ERROR(
            check_pinned_limit(pool.block_bytes * pool.block_count, param_staging_bytes_));
        ZINF_ASSIGN_OR_RETURN(opt_pool_, PinnedPool::create(pool));
        ZINF_RETURN_IF_ERROR(opt_pool_->register_with(*io_));
      }
      ZINF_ASSIGN_OR_RETURN(pipeline_,
                            OptimizerPipeline::open(*store_, opt_pool_.get(), pipeline_options()));
      ZINF_RETURN_IF_ERROR(load_store());
      if (store_->on_nvme(Piece::kGrads)) {
        SpillOptions spill;
        spill.buffer_count = config_.gradient_spill_buffers;
        spill.timeout = timeout_;
        ZINF_ASSIGN_OR_RETURN(spill_, SpillAccumulator::create(*store_, spill, &counters_));
      } else {
        accumulator = reinterpret_cast<float*>(store_->host_data(Piece::kGrads));
      }
    }

    GradReducerOptions ro;
    ro.bucket_elements = z.reduce_bucket_size;
    ro.timeout = timeout_;
    ro.trace = env_.trace;
    ro.trace_track = track_;
    // The store's host pieces are fresh zero pages (the kNone path's device buffer is not).
    ro.accumulator_zeroed = store_ != nullptr;
    ro.accumulator = spill_.get();
    ro.accumulator_on_device = device_opt_ != nullptr;
    ZINF_ASSIGN_OR_RETURN(
        reducer_, GradReducer::create(*part_, rank_, device_, comm_, accumulator, ro, &counters_));

    ParamCoordinatorOptions co;
    co.shard_tier = stage3 ? z.offload_param.device : OffloadDevice::kNone;
    co.prefetch_elements = z.stage3_prefetch_bucket_size;
    co.max_live_elements = z.stage3_max_live_parameters;
    co.staging_blocks = z.offload_param.buffer_count;
    co.timeout = timeout_;
    co.trace = env_.trace;
    co.trace_track = track_;
    ZINF_ASSIGN_OR_RETURN(
        coord_, ParamCoordinator::create(*part_, rank_, device_, comm_, std::move(modules),
                                         persistent, co, swap_.get(), io_.get(), &counters_));
    // Only the staging blocks are left to check when there is no optimizer pool.
    if (opt_pool_ == nullptr) ZINF_RETURN_IF_ERROR(check_pinned_limit(0, param_staging_bytes_));
    ZINF_ASSERT(coord_->staging_bytes() == param_staging_bytes_);
    // The device copies: every group's shard is the master rounded to the group's dtype
    // (load_store() did it sub-group by sub-group when the state is in the store).
    if (master_.bytes() > 0) {
      narrow_master(0, partition_elements_, master_.as<const float>(), /*all_groups=*/true);
    }
    ZINF_RETURN_IF_ERROR(write_shards());
    std::vector<MasterPiece>().swap(master_pieces_);
    // A GPU-resident optimizer publishes from device memory (write_shard_from_device): the host
    // copy served the initial placement only.
    if (device_opt_ != nullptr) new_params_ = AlignedBuffer();
    finalized_ = true;
    return Status::ok();
  }

  // Every rank must have registered the same parameters (names, modules, shapes, dtypes, in
  // order). Ranks exchange (count, fingerprint); when they differ, per-parameter hashes, so the
  // error names the first parameter that differs. Every rank computes the same error.
  Status check_ranks_agree() {
    const std::uint64_t fingerprint = part_->fingerprint();
    const std::uint64_t count = part_->param_count();
    std::uint64_t mine[2] = {count, fingerprint};
    ZINF_ASSIGN_OR_RETURN(std::vector<std::uint64_t> all, exchange(mine, 2));
    int differs = -1;
    for (int r = 0; r < world_ && differs < 0; ++r) {
      if (all[2 * r] != count || all[2 * r + 1] != fingerprint) differs = r;
    }
    if (differs < 0) return Status::ok();
    for (int r = 1; r < world_; ++r) {
      if (all[2 * r] != all[0]) {
        return Status::invalid_argument(
            fmt::format("finalize: ranks registered different parameters: rank 0 registered {} "
                        "parameters, rank {} registered {}",
                        all[0], r, all[2 * r]));
      }
    }
    std::vector<std::uint64_t> hashes(count);
    for (ParamId id = 0; id < count; ++id) {
      const ParamSpec& s = part_->spec(id);
      std::string text =
          fmt::format("{}\n{}\n{}\n{}", s.name, s.module, shape_text(s.shape), dtype_name(s.dtype));
      hashes[id] = XXH3_64bits(text.data(), text.size());
    }
    ZINF_ASSIGN_OR_RETURN(std::vector<std::uint64_t> every, exchange(hashes.data(), count));
    for (ParamId id = 0; id < count; ++id) {
      for (int r = 1; r < world_; ++r) {
        if (every[r * count + id] != every[id]) {
          const ParamSpec& s = part_->spec(id);
          return Status::invalid_argument(fmt::format(
              "finalize: ranks registered different parameters: parameter {} differs between "
              "rank 0 and rank {} (name, module, shape or dtype); this rank ({}) has '{}' in "
              "module '{}', shape {}, {}",
              id, r, rank_, s.name, regs_[id].spec.module, shape_text(s.shape),
              dtype_name(s.dtype)));
        }
      }
    }
    return Status::invalid_argument(
        "finalize: ranks registered different partitioner options (world size, stage)");
  }

  // All-gathers `count` 64-bit words from every rank (as f32 pairs, which all_gather copies bit
  // for bit).
  Result<std::vector<std::uint64_t>> exchange(const std::uint64_t* words, std::size_t count) {
    const std::size_t bytes = count * 8;
    ZINF_ASSIGN_OR_RETURN(DeviceBuffer send, DeviceBuffer::allocate(device_, bytes));
    ZINF_ASSIGN_OR_RETURN(
        DeviceBuffer recv,
        DeviceBuffer::allocate(device_, bytes * static_cast<std::size_t>(world_)));
    ZINF_RETURN_IF_ERROR(device_.copy_h2d(send.data(), words, bytes, *stream_));
    ZINF_RETURN_IF_ERROR(comm_.all_gather(send.data(), recv.data(), count * 2, DType::kF32,
                                          *stream_, "parameter fingerprints"));
    std::vector<std::uint64_t> out(count * static_cast<std::size_t>(world_));
    ZINF_RETURN_IF_ERROR(device_.copy_d2h(out.data(), recv.data(), out.size() * 8, *stream_));
    ZINF_RETURN_IF_ERROR(device_.record(*event_, *stream_));
    ZINF_RETURN_IF_ERROR(comm_.wait(*event_, timeout_));
    return out;
  }

  // zinf.pinned_pool_bytes, when set, bounds the pinned blocks the engine maps: the optimizer
  // step's pool and the NVMe parameter shards' staging blocks. Checked before each is mapped.
  Status check_pinned_limit(std::uint64_t optimizer_pool, std::uint64_t param_staging) const {
    const std::uint64_t limit = config_.pinned_pool_bytes;
    const std::uint64_t need = optimizer_pool + param_staging;
    if (limit == 0 || need <= limit) return Status::ok();
    return Status::resource_exhausted(fmt::format(
        "zinf.pinned_pool_bytes: {} bytes, but this rank's pinned blocks need {} (optimizer "
        "pool {} = offload_optimizer.buffer_count x one sub-group's NVMe pieces; parameter "
        "staging {}); lower zero_optimization.sub_group_size or the buffer counts, or raise the "
        "limit",
        limit, need, optimizer_pool, param_staging));
  }

  PipelineOptions pipeline_options() const {
    PipelineOptions pipe;
    pipe.optimizer = config_.optimizer;
    pipe.threads = config_.cpu_threads;
    pipe.io_timeout = std::chrono::milliseconds(config_.io_timeout_ms);
    pipe.io_timeouts_max = config_.io_timeouts_max;
    pipe.trace = env_.trace;
    if (half_stream_) {
      // The pipeline hands each sub-group's half output over from its block (stream_half()).
      pipe.half_done = [self = const_cast<Impl*>(this)](std::size_t i, const std::byte* half) {
        return self->stream_half(i, half);
      };
    }
    return pipe;
  }

  // offload_optimizer "none" on a device that is not host-accessible: the state in device memory
  // (DeviceOptimizer), the initial master built on the host once, uploaded and rounded into the
  // device copies (new_params_).
  Status open_device_optimizer() {
    std::vector<DeviceOptimizer::Group> groups;
    for (std::uint32_t g = 0; g < part_->group_count(); ++g) {
      const GroupInfo& info = part_->group(g);
      groups.push_back({offsets_[g], info.shard_element_count, byte_offsets_[g], info.dtype});
    }
    AlignedBuffer master(std::max<std::size_t>(partition_elements_, 1) * sizeof(float));
    ZINF_RETURN_IF_ERROR(fill_master(0, partition_elements_, master.as<float>()));
    narrow_master(0, partition_elements_, master.as<const float>(), /*all_groups=*/true);
    ZINF_ASSIGN_OR_RETURN(device_opt_,
                          DeviceOptimizer::create(device_, std::move(groups), partition_elements_,
                                                  master.as<const float>(), timeout_));
    return Status::ok();
  }

  // Writes the initial master and zero moments into the store, and rounds the master into the
  // device copies (new_params_) from the same block, so the registered values are read once.
  Status load_store() {
    StateStore& s = *store_;
    ZINF_ASSERT(s.has(Piece::kParams));  // the master always lives in the store
    AlignedBuffer block(round_page(s.sub_group_params() * sizeof(float)));
    for (std::size_t i = 0; i < s.sub_group_count(); ++i) {
      const std::size_t first = s.sub_group_first(i);
      const std::size_t size = s.sub_group_size(i);
      for (Piece piece : {Piece::kParams, Piece::kExpAvg, Piece::kExpAvgSq}) {
        if (!s.has(piece)) continue;
        std::memset(block.data(), 0, block.bytes());
        if (piece == Piece::kParams) {
          ZINF_RETURN_IF_ERROR(fill_master(first, size, block.as<float>()));
          narrow_master(first, size, block.as<const float>(), /*all_groups=*/true);
        }
        if (s.tier(piece) == Tier::kHost) {
          std::memcpy(s.host_data(piece, i), block.data(), size * sizeof(float));
        } else {
          ZINF_RETURN_IF_ERROR(s.write_piece(piece, i, block.data()));
        }
      }
    }
    return Status::ok();
  }

  // One registered parameter's run of elements inside this rank's partition.
  struct MasterPiece {
    std::size_t first;  // partition element where the run starts
    std::size_t param;  // index into regs_
    std::size_t param_offset;
    std::size_t element_count;
  };

  // out[0, count) <- the initial master of partition elements [first, first + count), from the
  // registered values or initializers; padding is zero. An initializer's error names the
  // parameter and its elements. REQUIRES: before the registered values are dropped.
  Status fill_master(std::size_t first, std::size_t count, float* out) const {
    std::memset(out, 0, count * sizeof(float));
    const std::size_t end = first + count;
    auto it =
        std::upper_bound(master_pieces_.begin(), master_pieces_.end(), first,
                         [](std::size_t value, const MasterPiece& p) { return value < p.first; });
    if (it != master_pieces_.begin()) --it;
    for (; it != master_pieces_.end() && it->first < end; ++it) {
      const std::size_t lo = std::max(first, it->first);
      const std::size_t hi = std::min(end, it->first + it->element_count);
      if (lo >= hi) continue;
      const Registered& r = regs_[it->param];
      const std::size_t param_first = it->param_offset + (lo - it->first);
      ZINF_ASSERT(param_first + (hi - lo) <= r.element_count);
      if (r.spec.initializer == nullptr) {
        std::memcpy(out + (lo - first), r.values.data() + param_first, (hi - lo) * sizeof(float));
        continue;
      }
      Status st = r.spec.initializer(param_first, hi - lo, out + (lo - first));
      if (!st.is_ok()) {
        return st.with_context(
            fmt::format("finalize: the initializer of parameter '{}' failed for elements [{}, {})",
                        r.spec.name, param_first, param_first + (hi - lo)));
      }
    }
    return Status::ok();
  }

  // new_params_ of the groups overlapping partition elements [first, first + count) <- src
  // rounded to each group's dtype. With all_groups false only the groups the step does not
  // already produce in their dtype (f32 groups, or all when the store has no half piece).
  void narrow_master(std::size_t first, std::size_t count, const float* src, bool all_groups) {
    // Streaming, there is no partition-wide copy: finalize's write_shards() narrows the master
    // group by group through half_stage_, and each step streams its own output.
    if (half_stream_) return;
    const std::size_t end = first + count;
    for (std::uint32_t g = 0; g < part_->group_count(); ++g) {
      const GroupInfo& info = part_->group(g);
      if (!all_groups && !needs_master_copy(info.dtype)) continue;
      const std::size_t lo = std::max(first, offsets_[g]);
      const std::size_t hi = std::min(end, offsets_[g] + info.shard_element_count);
      if (lo >= hi) continue;
      narrow(src + (lo - first), hi - lo, info.dtype,
             new_values(g) + (lo - offsets_[g]) * dtype_bytes(info.dtype));
    }
  }

  // Group g's new device-dtype values: in the store's half array (publish_from_store_), else in
  // new_params_.
  std::byte* new_values(std::uint32_t g) {
    ZINF_ASSERT(!half_stream_);
    if (publish_from_store_) return store_->host_data(Piece::kParamsHalf) + offsets_[g] * 2;
    return new_params_.data() + byte_offsets_[g];
  }

  bool needs_master_copy(DType dtype) const {
    // DeviceOptimizer hands over every group's new values in its dtype.
    if (device_opt_ != nullptr) return false;
    if (dtype == DType::kF32) return true;
    // The in-memory step writes every half group's copy itself; the store only when it has one
    // half dtype.
    if (store_ == nullptr) return false;
    return !with_half_;
  }

  Status write_shards() {
    if (half_stream_) {
      // The shards from the fp32 master (finalize), rounded group by group in half_stage_.
      restart_half_stream();
      Status st;
      ZINF_RETURN_IF_ERROR(
          for_each_master([&](std::size_t first, std::size_t count, const float* src) {
            if (!st.is_ok()) return;
            st = stage_half(first, count, [&](std::size_t lo, std::size_t hi, std::byte* dst) {
              narrow(src + (lo - first), hi - lo, half_dtype_, dst);
            });
          }));
      ZINF_RETURN_IF_ERROR(st);
      ZINF_ASSERT(half_group_ == part_->group_count());
      master_read_ = AlignedBuffer();  // the read-back buffer is made again when needed
      return coord_->publish();
    }
    for (std::uint32_t g = 0; g < part_->group_count(); ++g) {
      ZINF_RETURN_IF_ERROR(coord_->write_shard(g, new_values(g)));
    }
    return coord_->publish();
  }

  // --- The half output streamed into the shards (half_stream_) ------------------------------
  // A step's (or finalize's) new half values arrive in partition order, in ranges that need not
  // match the groups (sub-groups); each group is assembled in half_stage_ (the largest group's
  // shard) and written with write_shard() once its last element is in. A group is written only
  // when every one of its elements was filled in this pass, so no shard is ever written from a
  // half-filled buffer; a pass that fails part way leaves the groups before it new and the rest
  // old, and the engine is sticky-failed.
  void restart_half_stream() {
    half_next_ = 0;
    half_group_ = 0;
    half_filled_ = 0;
  }

  // Partition elements [first, first + count): fill(lo, hi, dst) writes elements [lo, hi) at dst.
  // REQUIRES: first is where the previous range ended (0 after restart_half_stream()).
  template <typename Fill>
  Status stage_half(std::size_t first, std::size_t count, Fill fill) {
    ZINF_ASSERT_MSG(first == half_next_, "stage_half: ranges out of partition order");
    const std::size_t end = first + count;
    const std::size_t bytes = dtype_bytes(half_dtype_);
    while (half_group_ < part_->group_count()) {
      const std::uint32_t g = half_group_;
      const std::size_t group_first = offsets_[g];
      const std::size_t group_count = part_->group(g).shard_element_count;
      const std::size_t lo = std::max(first, group_first);
      const std::size_t hi = std::min(end, group_first + group_count);
      if (lo < hi) {
        fill(lo, hi, half_stage_.data() + (lo - group_first) * bytes);
        half_filled_ += hi - lo;
      }
      if (group_first + group_count > end) break;  // it goes on in the next range
      ZINF_ASSERT_MSG(half_filled_ == group_count, "stage_half: a group written half filled");
      ZINF_RETURN_IF_ERROR(coord_->write_shard(g, half_stage_.data()));
      // half_stage_ is refilled by the next group: the copy up must have read it.
      ZINF_RETURN_IF_ERROR(coord_->wait_writes());
      half_filled_ = 0;
      ++half_group_;
    }
    half_next_ = end;
    return Status::ok();
  }

  // The pipeline's half_done: sub-group i's new half values, from its pool block.
  Status stream_half(std::size_t i, const std::byte* half) {
    const std::size_t first = store_->sub_group_first(i);
    const std::size_t bytes = dtype_bytes(half_dtype_);
    return stage_half(first, store_->sub_group_size(i),
                      [&](std::size_t lo, std::size_t hi, std::byte* dst) {
                        std::memcpy(dst, half + (lo - first) * bytes, (hi - lo) * bytes);
                      });
  }

  // Calls fn(first, count, master) over the partition's fp32 master, in pieces, covering at
  // least elements [begin, end) (NVMe sub-groups outside it are not read).
  template <typename Fn>
  Status for_each_master(Fn fn, std::size_t begin = 0,
                         std::size_t end = std::numeric_limits<std::size_t>::max()) {
    if (device_opt_ != nullptr) {
      // Only the elements asked for come down, in bounded chunks.
      const std::size_t lo = std::min(begin, partition_elements_);
      const std::size_t hi = std::min(end, partition_elements_);
      std::vector<float> values(std::min(hi - lo, state_chunk_elements()));
      for (std::size_t first = lo; first < hi; first += values.size()) {
        const std::size_t count = std::min(values.size(), hi - first);
        ZINF_RETURN_IF_ERROR(device_opt_->read_master(first, count, values.data()));
        fn(first, count, static_cast<const float*>(values.data()));
      }
      return Status::ok();
    }
    if (store_ == nullptr) {
      fn(std::size_t{0}, partition_elements_, master_.as<const float>());
      return Status::ok();
    }
    StateStore& s = *store_;
    if (s.tier(Piece::kParams) == Tier::kHost) {
      fn(std::size_t{0}, partition_elements_,
         reinterpret_cast<const float*>(s.host_data(Piece::kParams)));
      return Status::ok();
    }
    if (master_read_.bytes() == 0) {
      master_read_ = AlignedBuffer(round_page(s.sub_group_params() * sizeof(float)));
    }
    for (std::size_t i = 0; i < s.sub_group_count(); ++i) {
      const std::size_t first = s.sub_group_first(i);
      if (first >= end || first + s.sub_group_size(i) <= begin) continue;
      ZINF_RETURN_IF_ERROR(s.read_piece(Piece::kParams, i, master_read_.data()));
      master_read_bytes_ += round_page(s.piece_bytes(Piece::kParams, i));
      fn(s.sub_group_first(i), s.sub_group_size(i), master_read_.as<const float>());
    }
    return Status::ok();
  }

  Status ensure_finalized() {
    ZINF_RETURN_IF_ERROR(sticky_);
    return finalize();
  }

  Status fail(Status st) {
    if (!st.is_ok() && sticky_.is_ok()) sticky_ = st;
    return st;
  }

  Result<std::size_t> find_module(std::string_view call, std::string_view module) const {
    auto it = module_index_.find(std::string(module));
    if (it == module_index_.end()) {
      return Status::not_found(fmt::format("{}('{}'): unknown module (registered: {})", call,
                                           module, fmt::join(module_names_, ", ")));
    }
    return it->second;
  }

  // --- Gather / release ------------------------------------------------------------------------
  Status gather(std::string_view module) {
    ZINF_RETURN_IF_ERROR(ensure_finalized());
    ZINF_ASSIGN_OR_RETURN(std::size_t m, find_module("gather", module));
    Status st = coord_->gather(m);
    if (!st.is_ok() && st.code() != Code::kFailedPrecondition &&
        st.code() != Code::kResourceExhausted) {
      return fail(st);
    }
    return st;
  }

  Status release(std::string_view module) {
    ZINF_RETURN_IF_ERROR(ensure_finalized());
    ZINF_ASSIGN_OR_RETURN(std::size_t m, find_module("release", module));
    return coord_->release(m);
  }

  Result<TensorView> parameter(std::string_view name) const {
    auto it = by_name_.find(std::string(name));
    if (it == by_name_.end()) {
      return Status::not_found(fmt::format("parameter('{}'): unknown parameter", name));
    }
    const Registered& r = regs_[it->second];
    if (!finalized_) {
      return Status::failed_precondition(fmt::format(
          "parameter('{}'): the engine is not finalized (gather its module first)", name));
    }
    const std::size_t m = module_index_.at(r.spec.module);
    if (!coord_->gathered(m)) {
      return Status::failed_precondition(
          fmt::format("parameter('{}'): its module '{}' is not gathered", name, r.spec.module));
    }
    const ParamLocation& loc = part_->location(static_cast<ParamId>(it->second));
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
    ZINF_RETURN_IF_ERROR(ensure_finalized());
    ZINF_ASSIGN_OR_RETURN(std::size_t m, find_module("reduce_gradients", module));
    // Validate everything before anything moves.
    std::vector<GradSource> sources(part_->param_count());
    for (const GradientRef& g : gradients) {
      auto it = by_name_.find(std::string(g.name));
      if (it == by_name_.end()) {
        return Status::not_found(
            fmt::format("reduce_gradients('{}'): unknown parameter '{}'", module, g.name));
      }
      const Registered& r = regs_[it->second];
      if (r.spec.module != module) {
        return Status::invalid_argument(
            fmt::format("reduce_gradients('{}'): parameter '{}' belongs to module '{}'", module,
                        g.name, r.spec.module));
      }
      if (sources[it->second].data != nullptr) {
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
      sources[it->second] = {g.data, g.dtype};
    }
    for (std::size_t id : module_params_[m]) {
      if (sources[id].data == nullptr) {
        return Status::invalid_argument(fmt::format(
            "reduce_gradients('{}'): no gradient for '{}' (every parameter of the module needs "
            "one)",
            module, regs_[id].spec.name));
      }
    }
    Trace::Span span(env_.trace, track_, fmt::format("reduce {}", module));
    grads_pending_ = true;
    return fail(reducer_->reduce(module_groups_[m], sources));
  }

  // --- Step ------------------------------------------------------------------------------------
  Result<StepReport> step() {
    ZINF_RETURN_IF_ERROR(ensure_finalized());
    const std::int64_t start = Trace::now_ns();
    const long in_use = coord_->first_in_use();
    if (in_use >= 0) {
      return Status::failed_precondition(
          fmt::format("step: module '{}' is still gathered (release it first)",
                      module_names_[static_cast<std::size_t>(in_use)]));
    }
    ZINF_ASSIGN_OR_RETURN(int micro, reducer_->micro_batches());
    coord_->freeze_order();
    Status st = step_impl(micro, start);
    if (!st.is_ok()) return fail(st);
    return report_;
  }

  Status step_impl(int micro, std::int64_t start) {
    StepReport& rep = report_;
    rep = StepReport{};
    rep.micro_batches = micro;
    rep.loss_scale = scaler_.scale();
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

    // The global norm and the overflow flag, before any state changes. The local sum of squares
    // is of the gradients as the optimizer will see them (mean over micro-batches, unscaled).
    const double unscale = 1.0 / (static_cast<double>(micro) * scaler_.scale());
    double sumsq = 0.0;
    if (device_opt_ != nullptr) {
      ZINF_ASSIGN_OR_RETURN(sumsq, device_opt_->sum_of_squares());
    } else {
      sumsq = local_sum_of_squares();
    }
    // An inf or NaN anywhere makes the sum inf or NaN (the square of a finite float never
    // overflows a double), so the sum is the overflow check too.
    bool overflow = !std::isfinite(sumsq);
    sumsq *= unscale * unscale;
    {
      // Each rank's sum of squares travels as a double (all-gathered bit for bit) and every rank
      // adds them in rank order in double, so the norm carries no f32 rounding of the reduction
      // and is the same bits everywhere. An overflow travels as an infinity.
      Trace::Span span(env_.trace, track_, "step norm");
      // Through host staging and copies: device memory may not be host-accessible.
      double* buf = norm_host_.as<double>();
      double* dev = scratch_.as<double>();
      const std::size_t all_bytes = static_cast<std::size_t>(world_) * sizeof(double);
      buf[0] = overflow ? std::numeric_limits<double>::infinity() : sumsq;
      ZINF_RETURN_IF_ERROR(device_.copy_h2d(dev, buf, sizeof(double), *stream_));
      ZINF_RETURN_IF_ERROR(comm_.all_gather(dev, dev + 1, 2, DType::kF32, *stream_, "grad norm"));
      ZINF_RETURN_IF_ERROR(device_.copy_d2h(buf + 1, dev + 1, all_bytes, *stream_));
      ZINF_RETURN_IF_ERROR(device_.record(*event_, *stream_));
      ZINF_RETURN_IF_ERROR(comm_.wait(*event_, timeout_));
      double total = 0.0;
      for (int r = 0; r < world_; ++r) total += buf[1 + r];
      overflow = !std::isfinite(total);
      rep.grad_norm = overflow ? std::numeric_limits<double>::infinity() : std::sqrt(total);
    }
    std::int64_t t2 = Trace::now_ns();
    rep.norm_ns = t2 - t1;

    if (overflow) {
      scaler_.update(true);
      reducer_->zero();
      grads_pending_ = false;
      rep.skipped = true;
      rep.step = t_;
      rep.next_loss_scale = scaler_.scale();
      rep.wall_ns = Trace::now_ns() - start;
      ++counters_.steps;
      ++counters_.skipped_steps;
      return Status::ok();
    }
    double coef = 1.0;
    if (config_.gradient_clipping > 0.0 && rep.grad_norm > config_.gradient_clipping) {
      coef = config_.gradient_clipping / (rep.grad_norm + 1e-6);
    }
    rep.clip_coef = coef;
    const float grad_scale = static_cast<float>(coef * unscale);
    ++t_;
    // Streaming (half_stream_), the shards are written during the optimizer pass.
    const std::uint64_t param_writes = counters_.param_nvme_write_bytes;
    {
      Trace::Span span(env_.trace, track_, "step optimizer");
      if (store_ == nullptr) {
        ZINF_RETURN_IF_ERROR(step_in_memory(grad_scale));
      } else {
        if (lr_changed_) {
          // The pipeline copies its hyper-parameters at open and holds no state of its own
          // between steps (the store does), so a new learning rate is a new pipeline.
          pipeline_.reset();
          ZINF_ASSIGN_OR_RETURN(
              pipeline_, OptimizerPipeline::open(*store_, opt_pool_.get(), pipeline_options()));
          lr_changed_ = false;
        }
        // With half_stream_ the pass writes the shards as it goes (stream_half()).
        restart_half_stream();
        ZINF_ASSIGN_OR_RETURN(StepStats stats,
                              pipeline_->step({.step = t_, .grad_scale = grad_scale}));
        rep.optimizer_nvme_read_bytes = stats.read_bytes;
        rep.optimizer_nvme_write_bytes = stats.write_bytes;
      }
    }
    std::int64_t t3 = Trace::now_ns();
    rep.optimizer_ns = t3 - t2;
    {
      Trace::Span span(env_.trace, track_, "step publish");
      const std::uint64_t master_reads = master_read_bytes_;
      // With publish_from_store_ the pass wrote every group's new values into the store's half
      // array, which is where write_shards() reads them.
      bool any = false;
      for (std::uint32_t g = 0; g < part_->group_count(); ++g) {
        any = any || needs_master_copy(part_->group(g).dtype);
      }
      if (any) {
        ZINF_RETURN_IF_ERROR(
            for_each_master([&](std::size_t first, std::size_t count, const float* src) {
              narrow_master(first, count, src, /*all_groups=*/false);
            }));
      }
      if (device_opt_ != nullptr) {
        // The new values go from the device optimizer's buffers straight into the shards.
        for (std::uint32_t g = 0; g < part_->group_count(); ++g) {
          ZINF_RETURN_IF_ERROR(coord_->write_shard_from_device(g, device_opt_->values(g)));
        }
        ZINF_RETURN_IF_ERROR(coord_->publish());
      } else if (half_stream_) {
        // The pass wrote every shard; the persistent groups' all-gather is left.
        ZINF_ASSERT(half_group_ == part_->group_count());
        ZINF_RETURN_IF_ERROR(coord_->publish());
      } else {
        ZINF_RETURN_IF_ERROR(write_shards());
      }
      rep.param_nvme_write_bytes = counters_.param_nvme_write_bytes - param_writes;
      rep.master_nvme_read_bytes = master_read_bytes_ - master_reads;
    }
    rep.publish_ns = Trace::now_ns() - t3;
    reducer_->zero();
    grads_pending_ = false;
    scaler_.update(false);
    rep.step = t_;
    rep.next_loss_scale = scaler_.scale();
    rep.wall_ns = Trace::now_ns() - start;
    ++counters_.steps;
    return Status::ok();
  }

  // offload_optimizer "none": the optimizer over the partition in device memory, one call per
  // group so each half group's copy is written in its own dtype by the same pass.
  Status step_in_memory(float grad_scale) {
    if (device_opt_ != nullptr) return device_opt_->step(t_, grad_scale, config_.optimizer);
    StepOptions so;
    so.step = t_;
    so.grad_scale = grad_scale;
    so.threads = config_.cpu_threads;
    for (std::uint32_t g = 0; g < part_->group_count(); ++g) {
      const GroupInfo& info = part_->group(g);
      OptimizerSpan span;
      span.params = master_.as<float>() + offsets_[g];
      span.exp_avg = exp_avg_.as<float>() + offsets_[g];
      span.exp_avg_sq = exp_avg_sq_.as<float>() + offsets_[g];
      span.grads = grads_.as<float>() + offsets_[g];
      span.grad_dtype = DType::kF32;
      if (info.dtype != DType::kF32) {
        span.params_half = new_params_.data() + byte_offsets_[g];
        span.half_dtype = info.dtype;
      }
      span.count = info.shard_element_count;
      ZINF_ASSIGN_OR_RETURN(StepResult r, optimizer_step(config_.optimizer, span, so));
      (void)r;
    }
    return Status::ok();
  }

  // This rank's sum of squares of the accumulated gradients. With a store, per sub-group
  // (sum_of_squares over its elements) added in sub-group order, whether the gradients are in the
  // host array or spilled (the spill computed each sub-group's as it wrote it), so both give the
  // same bits; without one, over the whole partition.
  double local_sum_of_squares() const {
    if (store_ == nullptr) return sum_of_squares(grads_.as<const float>(), partition_elements_);
    const auto* host = store_->on_nvme(Piece::kGrads)
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

  // --- Checkpoints -----------------------------------------------------------------------------
  // The pieces a checkpoint holds: the master and the moments the optimizer has (as StateStore
  // keeps them), whatever tier they are on.
  std::vector<Piece> checkpoint_pieces() const {
    switch (config_.optimizer.kind) {
      case OptimizerKind::kAdam:
      case OptimizerKind::kAdamW:
        return {Piece::kParams, Piece::kExpAvg, Piece::kExpAvgSq};
      case OptimizerKind::kAdagrad:
        return {Piece::kParams, Piece::kExpAvgSq};
      case OptimizerKind::kLion:
        return {Piece::kParams, Piece::kExpAvg};
    }
    return {Piece::kParams};
  }

  static int piece_index(Piece piece) {
    return piece == Piece::kParams ? 0 : piece == Piece::kExpAvg ? 1 : 2;
  }

  // The buffer that holds `piece` when neither a device optimizer nor a store keeps the state.
  DeviceBuffer& host_state(Piece piece) {
    return piece == Piece::kParams ? master_ : piece == Piece::kExpAvg ? exp_avg_ : exp_avg_sq_;
  }

  // read_state() and write_state() move device-resident state through a host chunk of at most
  // 4 Mi elements (16 MiB), never more than the partition holds.
  std::size_t state_chunk_elements() const {
    constexpr std::size_t kChunkElements = std::size_t{4} << 20;
    return std::min(kChunkElements, std::max<std::size_t>(partition_elements_, 1));
  }

  // Calls fn(first, count, values) -> Status over `piece` of the partition, in pieces: device
  // memory comes down in bounded chunks, NVMe one sub-group at a time.
  template <typename Fn>
  Status read_state(Piece piece, Fn fn) {
    if (device_opt_ != nullptr) {
      std::vector<float> chunk(state_chunk_elements());
      for (std::size_t first = 0; first < partition_elements_; first += chunk.size()) {
        const std::size_t count = std::min(chunk.size(), partition_elements_ - first);
        ZINF_RETURN_IF_ERROR(
            device_opt_->read_state(piece_index(piece), first, count, chunk.data()));
        ZINF_RETURN_IF_ERROR(fn(first, count, static_cast<const float*>(chunk.data())));
      }
      return Status::ok();
    }
    if (store_ == nullptr) {
      return fn(std::size_t{0}, partition_elements_, host_state(piece).as<const float>());
    }
    StateStore& s = *store_;
    ZINF_ASSERT(s.has(piece));
    if (s.tier(piece) == Tier::kHost) {
      return fn(std::size_t{0}, partition_elements_,
                reinterpret_cast<const float*>(s.host_data(piece)));
    }
    AlignedBuffer block(round_page(s.sub_group_params() * sizeof(float)));
    for (std::size_t i = 0; i < s.sub_group_count(); ++i) {
      ZINF_RETURN_IF_ERROR(s.read_piece(piece, i, block.data()));
      ZINF_RETURN_IF_ERROR(fn(s.sub_group_first(i), s.sub_group_size(i), block.as<const float>()));
    }
    return Status::ok();
  }

  // The reverse: fill(first, count, out) -> Status writes elements [first, first + count) of
  // `piece`, in partition order, and they are put where the config keeps them.
  template <typename Fill>
  Status write_state(Piece piece, Fill fill) {
    if (device_opt_ != nullptr) {
      std::vector<float> chunk(state_chunk_elements());
      for (std::size_t first = 0; first < partition_elements_; first += chunk.size()) {
        const std::size_t count = std::min(chunk.size(), partition_elements_ - first);
        ZINF_RETURN_IF_ERROR(fill(first, count, chunk.data()));
        ZINF_RETURN_IF_ERROR(
            device_opt_->write_state(piece_index(piece), first, count, chunk.data()));
      }
      return Status::ok();
    }
    if (store_ == nullptr) {
      return fill(std::size_t{0}, partition_elements_, host_state(piece).as<float>());
    }
    StateStore& s = *store_;
    ZINF_ASSERT(s.has(piece));
    if (s.tier(piece) == Tier::kHost) {
      return fill(std::size_t{0}, partition_elements_,
                  reinterpret_cast<float*>(s.host_data(piece)));
    }
    AlignedBuffer block(round_page(s.sub_group_params() * sizeof(float)));
    for (std::size_t i = 0; i < s.sub_group_count(); ++i) {
      std::memset(block.data(), 0, block.bytes());
      ZINF_RETURN_IF_ERROR(fill(s.sub_group_first(i), s.sub_group_size(i), block.as<float>()));
      ZINF_RETURN_IF_ERROR(s.write_piece(piece, i, block.data()));
    }
    return Status::ok();
  }

  // A checkpoint is taken between steps: nothing gathered, no gradients reduced since the last
  // step.
  Status checkpoint_precondition(std::string_view call) const {
    const long in_use = coord_->first_in_use();
    if (in_use >= 0) {
      return Status::failed_precondition(
          fmt::format("{}: module '{}' is gathered (release it first)", call,
                      module_names_[static_cast<std::size_t>(in_use)]));
    }
    if (grads_pending_) {
      return Status::failed_precondition(fmt::format(
          "{}: gradients were reduced since the last step (a checkpoint is taken between steps; "
          "call step() first)",
          call));
    }
    return Status::ok();
  }

  // Every rank's outcome of a local phase: this rank's error, else kAborted naming the first
  // rank that failed, so no rank goes on into a collective the others left.
  Status agree(std::string_view call, Status local) {
    const std::uint64_t mine = static_cast<std::uint64_t>(local.code());
    Result<std::vector<std::uint64_t>> all = exchange(&mine, 1);
    if (!all.is_ok()) return fail(all.status());
    if (!local.is_ok()) return local;
    for (int r = 0; r < world_; ++r) {
      if ((*all)[r] != 0) {
        return Status::aborted(fmt::format("{}: rank {} failed ({}); see its error", call, r,
                                           code_name(static_cast<Code>((*all)[r]))));
      }
    }
    return Status::ok();
  }

  CheckpointHeader checkpoint_header() const {
    CheckpointHeader h;
    h.rank = static_cast<std::uint32_t>(rank_);
    h.world_size = static_cast<std::uint32_t>(world_);
    h.stage = static_cast<std::uint32_t>(config_.zero.stage);
    h.optimizer = static_cast<std::uint32_t>(config_.optimizer.kind);
    for (Piece p : checkpoint_pieces()) h.piece_mask |= 1u << static_cast<unsigned>(p);
    h.partition_elements = partition_elements_;
    h.fingerprint = part_->fingerprint();
    h.step = t_;
    h.loss_scale = scaler_.scale();
    h.loss_scale_good_steps = scaler_.good_steps();
    h.loss_scale_hysteresis_left = scaler_.hysteresis_left();
    return h;
  }

  Status save_checkpoint(std::string_view dir_view) {
    const std::string call = fmt::format("save_checkpoint('{}')", dir_view);
    ZINF_RETURN_IF_ERROR(ensure_finalized());
    const std::string dir(dir_view);
    Status local = checkpoint_precondition(call);
    if (local.is_ok() && rank_ == 0) {
      // The directory, and no manifest in it until every rank file of this save is in place.
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec) {
        local = status_from_errno(fmt::format("{}: cannot create the directory", call), ec.value());
      } else if (::unlink(fmt::format("{}/{}", dir, kCheckpointManifest).c_str()) != 0 &&
                 errno != ENOENT) {
        local = status_from_errno(fmt::format("{}: cannot remove the old manifest", call), errno);
      }
    }
    ZINF_RETURN_IF_ERROR(agree(call, local));

    // This rank's file.
    std::uint64_t file[2] = {0, 0};
    local = [&]() -> Status {
      ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> w,
                            CheckpointWriter::create(checkpoint_rank_path(dir, rank_)));
      std::vector<std::byte> head(kCheckpointHeaderBytes);
      const CheckpointHeader h = checkpoint_header();
      std::memcpy(head.data(), &h, sizeof(h));
      ZINF_RETURN_IF_ERROR(w->append(head.data(), head.size()));
      for (Piece piece : checkpoint_pieces()) {
        ZINF_RETURN_IF_ERROR(
            read_state(piece, [&](std::size_t, std::size_t count, const float* values) {
              return w->append(values, count * sizeof(float));
            }));
      }
      ZINF_RETURN_IF_ERROR(w->commit());
      file[0] = w->bytes();
      file[1] = w->digest();
      return Status::ok();
    }();
    ZINF_RETURN_IF_ERROR(agree(call, local));
    Result<std::vector<std::uint64_t>> files = exchange(file, 2);
    if (!files.is_ok()) return fail(files.status());

    // Rank 0's manifest, written last: its presence says the checkpoint is complete.
    local = Status::ok();
    if (rank_ == 0) {
      nlohmann::json m;
      m["format"] = "zinf-checkpoint";
      m["version"] = kCheckpointVersion;
      m["world_size"] = world_;
      m["stage"] = config_.zero.stage;
      m["optimizer"] = std::string(optimizer_name(config_.optimizer.kind));
      m["fingerprint"] = fmt::format("{:016x}", part_->fingerprint());
      m["partition_elements"] = partition_elements_;
      m["step"] = t_;
      nlohmann::json ranks = nlohmann::json::array();
      for (int r = 0; r < world_; ++r) {
        ranks.push_back({{"file", fmt::format("rank{}.zinfckpt", r)},
                         {"bytes", (*files)[2 * r]},
                         {"xxh3", fmt::format("{:016x}", (*files)[2 * r + 1])}});
      }
      m["ranks"] = ranks;
      local = write_file_atomically(fmt::format("{}/{}", dir, kCheckpointManifest), m.dump(2));
    }
    return agree(call, local);
  }

  // Checks the manifest against this engine and this rank's file against the manifest; on
  // success `reader` is positioned after the header.
  Status check_checkpoint(const std::string& call, const std::string& dir,
                          std::unique_ptr<CheckpointReader>* reader, CheckpointHeader* header) {
    const std::string manifest_path = fmt::format("{}/{}", dir, kCheckpointManifest);
    Result<std::string> text = read_text_file(manifest_path);
    if (!text.is_ok()) {
      return text.status().with_context(
          fmt::format("{}: no complete checkpoint (the manifest is written last)", call));
    }
    nlohmann::json m = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    const auto bad_manifest = [&](std::string_view what) {
      return Status::corruption(fmt::format("{}: '{}': {}", call, manifest_path, what));
    };
    if (m.is_discarded() || !m.is_object()) return bad_manifest("not a JSON object");
    for (const char* key : {"format", "version", "world_size", "stage", "optimizer", "fingerprint",
                            "partition_elements", "step", "ranks"}) {
      if (!m.contains(key)) return bad_manifest(fmt::format("no key '{}'", key));
    }
    if (!m["format"].is_string() || m["format"].get<std::string>() != "zinf-checkpoint" ||
        !m["version"].is_number_unsigned() ||
        m["version"].get<std::uint32_t>() != kCheckpointVersion) {
      return bad_manifest(fmt::format("not a zinf checkpoint of version {}", kCheckpointVersion));
    }
    const auto differs = [&](std::string_view what, const auto& theirs, const auto& ours) {
      return Status::invalid_argument(
          fmt::format("{}: the checkpoint was saved with {} {}, this engine has {} {}", call, what,
                      theirs, what, ours));
    };
    try {
      const int world = m["world_size"].get<int>();
      if (world != world_) return differs("world_size", world, world_);
      const int stage = m["stage"].get<int>();
      if (stage != config_.zero.stage)
        return differs("zero_optimization.stage", stage, config_.zero.stage);
      const std::string opt = m["optimizer"].get<std::string>();
      if (opt != optimizer_name(config_.optimizer.kind)) {
        return differs("optimizer.type", opt, optimizer_name(config_.optimizer.kind));
      }
      const std::string fp = m["fingerprint"].get<std::string>();
      const std::string ours = fmt::format("{:016x}", part_->fingerprint());
      if (fp != ours) {
        return differs("parameter layout fingerprint (names, modules, shapes, dtypes)", fp, ours);
      }
      const std::size_t elements = m["partition_elements"].get<std::size_t>();
      if (elements != partition_elements_) {
        return differs("partition element count", elements, partition_elements_);
      }
      const nlohmann::json& ranks = m["ranks"];
      if (!ranks.is_array() || ranks.size() != static_cast<std::size_t>(world_)) {
        return bad_manifest(fmt::format("'ranks' is not an array of {} entries", world_));
      }
      const nlohmann::json& entry = ranks[static_cast<std::size_t>(rank_)];
      const std::string path = fmt::format("{}/{}", dir, entry.at("file").get<std::string>());
      const std::uint64_t bytes = entry.at("bytes").get<std::uint64_t>();
      const std::string digest = entry.at("xxh3").get<std::string>();
      ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> r, CheckpointReader::open(path));
      if (r->file_bytes() != bytes) {
        return Status::corruption(fmt::format("{}: '{}' has {} bytes; the manifest says {}", call,
                                              path, r->file_bytes(), bytes));
      }
      ZINF_ASSIGN_OR_RETURN(std::uint64_t sum, r->checksum());
      if (fmt::format("{:016x}", sum) != digest) {
        return Status::corruption(
            fmt::format("{}: '{}' does not match its checksum (xxh3 {:016x}, the manifest says {})",
                        call, path, sum, digest));
      }
      std::vector<std::byte> head(kCheckpointHeaderBytes);
      ZINF_RETURN_IF_ERROR(r->read(head.data(), head.size()));
      CheckpointHeader h;
      std::memcpy(&h, head.data(), sizeof(h));
      const CheckpointHeader want = checkpoint_header();
      if (h.magic != kCheckpointMagic || h.version != kCheckpointVersion || h.rank != want.rank ||
          h.world_size != want.world_size || h.stage != want.stage ||
          h.optimizer != want.optimizer || h.piece_mask != want.piece_mask ||
          h.partition_elements != want.partition_elements || h.fingerprint != want.fingerprint) {
        return Status::corruption(fmt::format(
            "{}: '{}': its header does not match the manifest or this rank", call, path));
      }
      const std::uint64_t expect =
          kCheckpointHeaderBytes + checkpoint_pieces().size() * partition_elements_ * sizeof(float);
      if (bytes != expect) {
        return Status::corruption(
            fmt::format("{}: '{}' has {} bytes, the layout needs {}", call, path, bytes, expect));
      }
      *reader = std::move(r);
      *header = h;
    } catch (const nlohmann::json::exception& e) {
      return bad_manifest(e.what());
    }
    return Status::ok();
  }

  Status load_checkpoint(std::string_view dir_view) {
    const std::string call = fmt::format("load_checkpoint('{}')", dir_view);
    ZINF_RETURN_IF_ERROR(ensure_finalized());
    const std::string dir(dir_view);
    std::unique_ptr<CheckpointReader> reader;
    CheckpointHeader h;
    Status local = checkpoint_precondition(call);
    if (local.is_ok()) local = check_checkpoint(call, dir, &reader, &h);
    ZINF_RETURN_IF_ERROR(agree(call, local));
    // From here on the state is being replaced: an error leaves it mixed, so it is sticky.
    for (Piece piece : checkpoint_pieces()) {
      ZINF_RETURN_IF_ERROR(fail(write_state(piece, [&](std::size_t, std::size_t count, float* out) {
        return reader->read(out, count * sizeof(float));
      })));
    }
    t_ = h.step;
    scaler_.restore(h.loss_scale, h.loss_scale_good_steps, h.loss_scale_hysteresis_left);
    if (store_ != nullptr) {
      for (std::size_t i = 0; i < store_->sub_group_count(); ++i) store_->set_stored(i, t_);
    }
    return fail(republish());
  }

  // The device copies / shards from the master, as finalize() places them.
  Status republish() {
    ZINF_RETURN_IF_ERROR(coord_->drop_prefetched());
    if (device_opt_ != nullptr) {
      // finalize()'s path: the master rounded on the host into new_params_, freed again after.
      new_params_ = AlignedBuffer(std::max<std::size_t>(device_copy_bytes_, 64));
    }
    // Streaming, write_shards() reads the master back and rounds it group by group itself.
    if (!half_stream_) {
      ZINF_RETURN_IF_ERROR(
          for_each_master([&](std::size_t first, std::size_t count, const float* src) {
            narrow_master(first, count, src, /*all_groups=*/true);
          }));
    }
    Status st = write_shards();
    if (device_opt_ != nullptr) new_params_ = AlignedBuffer();
    return st;
  }

  // --- Read back -------------------------------------------------------------------------------
  Status read_parameters(std::string_view name, float* out) {
    ZINF_RETURN_IF_ERROR(ensure_finalized());
    auto it = by_name_.find(std::string(name));
    if (it == by_name_.end()) {
      return Status::not_found(fmt::format("read_parameters('{}'): unknown parameter", name));
    }
    if (out == nullptr) {
      return Status::invalid_argument(fmt::format("read_parameters('{}'): out is null", name));
    }
    const ParamLocation& loc = part_->location(static_cast<ParamId>(it->second));
    const GroupInfo& info = part_->group(loc.group);
    const std::size_t shard = info.shard_element_count;
    // This rank's master slice of the group, then an all-gather of the whole group in f32.
    std::vector<float> slice(shard);
    const std::size_t first = offsets_[loc.group];
    ZINF_RETURN_IF_ERROR(fail(for_each_master(
        [&](std::size_t f, std::size_t count, const float* src) {
          const std::size_t lo = std::max(f, first);
          const std::size_t hi = std::min(f + count, first + shard);
          if (lo < hi) std::memcpy(slice.data() + (lo - first), src + (lo - f), (hi - lo) * 4);
        },
        first, first + shard)));
    Result<DeviceBuffer> full = DeviceBuffer::allocate(device_, info.padded_element_count * 4);
    if (!full.is_ok()) return full.status();
    float* own = full->as<float>() + part_->shard_offset(loc.group, rank_);
    Status st = device_.copy_h2d(own, slice.data(), shard * 4, *stream_);
    if (st.is_ok()) {
      st = comm_.all_gather(own, full->data(), shard, DType::kF32, *stream_, "read_parameters");
    }
    if (st.is_ok()) {
      st = device_.copy_d2h(out, full->as<float>() + loc.group_offset, loc.element_count * 4,
                            *stream_);
    }
    if (st.is_ok()) st = device_.record(*event_, *stream_);
    if (st.is_ok()) st = comm_.wait(*event_, timeout_);
    return fail(st);
  }

  MemoryReport memory() const {
    MemoryReport m;
    m.device_bytes = coord_->device_bytes() + master_.bytes() + exp_avg_.bytes() +
                     exp_avg_sq_.bytes() + grads_.bytes() +
                     (device_opt_ != nullptr ? device_opt_->device_bytes() : 0);
    if (!part_->partitions(StateKind::kGradients)) {
      for (std::uint32_t g = 0; g < part_->group_count(); ++g) {
        m.device_bytes += part_->group(g).padded_element_count * 4;  // stage 1's full gradients
      }
    }
    m.host_bytes = coord_->host_bytes() + (opt_pool_ != nullptr ? opt_pool_->bytes() : 0);
    if (spill_ != nullptr) m.host_bytes += spill_->host_bytes();
    // The publish copy of the new values, when the store's half array cannot serve (f32 or
    // mixed dtypes, or no store), or the one-group staging buffer of the streamed half output.
    m.host_bytes += new_params_.bytes() + half_stage_.bytes();
    if (store_ != nullptr) {
      for (std::size_t p = 0; p < kPieceCount; ++p) {
        const auto piece = static_cast<Piece>(p);
        if (store_->has(piece) && store_->tier(piece) == Tier::kHost) {
          m.host_bytes += partition_elements_ * dtype_bytes(store_->dtype(piece));
        }
      }
    }
    // The swap space holds the optimizer's extents and the parameter shards' alike.
    m.nvme_bytes = swap_ != nullptr ? swap_->used_bytes() : 0;
    return m;
  }

  struct Registered {
    ParameterSpec spec;
    std::size_t element_count = 0;
    std::vector<float> values;  // until finalize(); empty with spec.initializer
  };

  Config config_;
  Env env_;
  Device& device_;
  Communicator& comm_;
  const int rank_;
  const int world_;
  const std::chrono::milliseconds timeout_;
  int track_ = 0;
  Status sticky_;
  Status finalize_error_;
  bool finalized_ = false;

  std::vector<Registered> regs_;
  std::map<std::string, std::size_t, std::less<>> by_name_;
  std::map<std::string, std::size_t, std::less<>> module_index_;
  std::vector<std::string> module_names_;
  std::vector<std::vector<std::size_t>> module_params_;
  std::vector<std::vector<std::uint32_t>> module_groups_;
  std::vector<std::string> nvme_dirs_;

  std::optional<Partitioner> part_;
  std::size_t partition_elements_ = 0;
  std::vector<std::size_t> offsets_;       // per group: first element in the partition
  std::vector<std::size_t> byte_offsets_;  // per group: first byte in new_params_
  AlignedBuffer new_params_;           // the partition's new device-dtype values, group after group
  std::size_t device_copy_bytes_ = 0;  // new_params_'s size when it has one
  bool publish_from_store_ = false;    // new_params_ unused: the store's half array serves
  // The step's half output streams into the shards through half_stage_ (see stage_half()).
  bool half_stream_ = false;
  AlignedBuffer half_stage_;      // one group's new shard, the largest group's size
  std::size_t half_next_ = 0;     // the partition element the next range starts at
  std::uint32_t half_group_ = 0;  // the group being assembled
  std::size_t half_filled_ = 0;   // its elements filled so far
  bool with_half_ = false;
  DType half_dtype_ = DType::kBF16;

  std::unique_ptr<IoEngine> io_;
  std::unique_ptr<SwapSpace> swap_;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<PinnedPool> opt_pool_;
  std::uint64_t param_staging_bytes_ = 0;  // the coordinator's staging blocks, known before
  std::unique_ptr<OptimizerPipeline> pipeline_;
  AlignedBuffer master_read_;
  std::vector<MasterPiece> master_pieces_;  // sorted by first; until finalize() ends
  std::uint64_t master_read_bytes_ = 0;
  DeviceBuffer master_, exp_avg_, exp_avg_sq_, grads_;
  std::unique_ptr<SpillAccumulator> spill_;      // gradients_on_nvme
  std::unique_ptr<DeviceOptimizer> device_opt_;  // "none" on a device not host-accessible
  std::unique_ptr<GradReducer> reducer_;
  std::unique_ptr<ParamCoordinator> coord_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> event_;
  DeviceBuffer scratch_;
  RegisteredBuffer norm_host_;  // host side of scratch_

  LossScaler scaler_;
  bool lr_changed_ = false;
  bool grads_pending_ = false;  // reduce_gradients() was called since the last step
  std::int64_t t_ = 0;
  EngineCounters counters_;
  StepReport report_;
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
Status Engine::reduce_gradients(std::string_view module, std::span<const GradientRef> gradients) {
  return impl_->reduce_gradients(module, gradients);
}
Result<StepReport> Engine::step() { return impl_->step(); }
Status Engine::save_checkpoint(std::string_view dir) { return impl_->save_checkpoint(dir); }
Status Engine::load_checkpoint(std::string_view dir) { return impl_->load_checkpoint(dir); }
Status Engine::read_parameters(std::string_view name, float* out) {
  return impl_->read_parameters(name, out);
}
double Engine::loss_scale() const { return impl_->scaler_.scale(); }
void Engine::set_learning_rate(double lr) {
  impl_->config_.optimizer.lr = lr;
  impl_->lr_changed_ = true;
}
int Engine::rank() const { return impl_->rank_; }
int Engine::world_size() const { return impl_->world_; }
const Config& Engine::config() const { return impl_->config_; }
std::vector<std::string> Engine::modules() const { return impl_->module_names_; }
std::vector<std::string> Engine::recorded_order() const {
  std::vector<std::string> out;
  if (impl_->coord_ == nullptr || !impl_->coord_->order_frozen()) return out;
  for (std::size_t m : impl_->coord_->order()) out.push_back(impl_->module_names_[m]);
  return out;
}
const EngineCounters& Engine::counters() const { return impl_->counters_; }
MemoryReport Engine::memory() const {
  ZINF_ASSERT(impl_->finalized_);
  return impl_->memory();
}

}  // namespace zinf
