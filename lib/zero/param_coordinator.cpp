#include "zero/param_coordinator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#include "base/arith.hpp"
#include "base/assert.hpp"

namespace zinf {

ParamCoordinator::ParamCoordinator(const Partitioner& partitioner, int rank, Device& device,
                                   Communicator& comm, const ParamCoordinatorOptions& options,
                                   SwapSpace* swap, ZeroCounters* counters)
    : partitioner_(partitioner),
      rank_(rank),
      device_(device),
      comm_(comm),
      options_(options),
      swap_(swap),
      counters_(counters),
      spare_bytes_max_(options.max_live_elements * 4) {}

ParamCoordinator::~ParamCoordinator() {
  if (stream_ != nullptr) (void)device_.synchronize(*stream_, options_.timeout);
}

Result<std::unique_ptr<ParamCoordinator>> ParamCoordinator::create(
    const Partitioner& partitioner, int rank, Device& device, Communicator& comm,
    std::vector<CoordinatorModule> modules, std::vector<bool> persistent,
    const ParamCoordinatorOptions& options, SwapSpace* swap, IoEngine* io, ZeroCounters* counters) {
  ZINF_ASSERT(partitioner.finalized());
  ZINF_ASSERT(persistent.size() == partitioner.group_count());
  std::unique_ptr<ParamCoordinator> c(
      new ParamCoordinator(partitioner, rank, device, comm, options, swap, counters));
  c->persistent_ = std::move(persistent);
  const std::uint32_t groups = partitioner.group_count();
  c->full_.resize(groups);
  c->device_shard_.resize(groups);
  c->host_shard_.resize(groups);
  c->shared_.assign(groups, nullptr);
  ZINF_ASSERT(options.shared_host_shards.empty() || options.shared_host_shards.size() == groups);
  c->extent_.resize(groups);
  std::size_t largest_shard_bytes = 0;
  bool any_nvme = false;
  for (std::uint32_t g = 0; g < groups; ++g) {
    const GroupInfo& info = partitioner.group(g);
    const std::size_t bytes = dtype_bytes(info.dtype);
    if (c->persistent_[g]) {
      ZINF_ASSIGN_OR_RETURN(c->full_[g],
                            DeviceBuffer::allocate(device, info.padded_element_count * bytes));
      continue;
    }
    const std::size_t shard_bytes = info.shard_element_count * bytes;
    switch (options.shard_tier) {
      case OffloadDevice::kNone: {
        ZINF_ASSIGN_OR_RETURN(c->device_shard_[g], DeviceBuffer::allocate(device, shard_bytes));
        break;
      }
      case OffloadDevice::kHost: {
        if (!options.shared_host_shards.empty() && options.shared_host_shards[g] != nullptr) {
          c->shared_[g] = options.shared_host_shards[g];
          break;
        }
        // Registered, so that the gather's host-to-device copy is asynchronous on a GPU.
        ZINF_ASSIGN_OR_RETURN(c->host_shard_[g], RegisteredBuffer::allocate(device, shard_bytes));
        break;
      }
      case OffloadDevice::kNvme: {
        if (swap == nullptr) return Status::internal("ParamCoordinator: NVMe shards, no swap");
        ZINF_ASSIGN_OR_RETURN(
            c->extent_[g], swap->create(fmt::format("rank{}/param/group{}", rank, g), shard_bytes));
        largest_shard_bytes = std::max(largest_shard_bytes, shard_bytes);
        any_nvme = true;
        break;
      }
    }
  }
  if (any_nvme) {
    PinnedPoolOptions pool;
    pool.block_bytes = round_page(largest_shard_bytes);
    pool.block_count = std::max<std::size_t>(1, options.staging_blocks);
    // Small staging blocks do not need huge pages; leave those to the optimizer's pool.
    pool.huge_pages =
        pool.block_bytes < (std::size_t{2} << 20) ? HugePages::kNone : HugePages::kAuto;
    pool.device = &device;
    ZINF_ASSIGN_OR_RETURN(c->staging_, PinnedPool::create(pool));
    if (io != nullptr) ZINF_RETURN_IF_ERROR(c->staging_->register_with(*io));
    c->reads_.resize(c->staging_->block_count());
  }
  std::size_t partitioned_groups = 0;
  for (std::uint32_t g = 0; g < groups; ++g) {
    if (!c->persistent_[g]) ++partitioned_groups;
    c->group_names_.push_back(group_label(partitioner, g, "params"));
  }
  c->spare_.reserve(partitioned_groups);
  for (CoordinatorModule& m : modules) {
    Module mod;
    mod.name = std::move(m.name);
    mod.groups = std::move(m.groups);
    for (std::uint32_t g : mod.groups) {
      if (!c->persistent_[g]) {
        mod.partitioned.push_back(g);
        mod.elements += partitioner.group(g).padded_element_count;
      }
    }
    ZINF_ASSIGN_OR_RETURN(mod.ready, device.create_event());
    // A module larger than max_live_elements is gathered all the same: its buffers are kept as
    // spares too, so that its gathers do not allocate each time.
    c->spare_bytes_max_ = std::max(c->spare_bytes_max_, mod.elements * 4);
    c->modules_.push_back(std::move(mod));
  }
  c->prefetched_.reserve(c->modules_.size());
  c->order_.reserve(c->modules_.size());
  ZINF_ASSIGN_OR_RETURN(c->stream_, device.create_stream("param_gather"));
  ZINF_ASSIGN_OR_RETURN(c->done_, device.create_event());
  ZINF_ASSIGN_OR_RETURN(c->written_, device.create_event());
  if (counters != nullptr) {
    for (std::uint32_t g = 0; g < groups; ++g) {
      if (c->persistent_[g] && partitioner.partitions(StateKind::kParameters)) {
        counters->persistent_elements += partitioner.group(g).padded_element_count;
      }
    }
  }
  return c;
}

void ParamCoordinator::instant(const char* what, const std::string& module_name) {
  // The name is built only when tracing: gather() and release() run every micro-batch.
  if (options_.trace == nullptr) return;
  const std::int64_t now = Trace::now_ns();
  options_.trace->add(options_.trace_track, what + module_name, now, now);
}

void ParamCoordinator::note_live() {
  if (counters_ == nullptr) return;
  counters_->live_elements = live_elements_;
  counters_->live_elements_peak =
      std::max<std::uint64_t>(counters_->live_elements_peak, live_elements_);
}

Status ParamCoordinator::write_shard(std::uint32_t g, const void* shard) {
  ZINF_RETURN_IF_ERROR(error_);
  const GroupInfo& info = partitioner_.group(g);
  const std::size_t bytes = dtype_bytes(info.dtype);
  const std::size_t shard_bytes = info.shard_element_count * bytes;
  if (persistent_[g]) {
    std::byte* own = full_[g].as<std::byte>() + partitioner_.shard_offset(g, rank_) * bytes;
    return device_.copy_h2d(own, shard, shard_bytes, *stream_);
  }
  switch (options_.shard_tier) {
    case OffloadDevice::kNone:
      return device_.copy_h2d(device_shard_[g].data(), shard, shard_bytes, *stream_);
    case OffloadDevice::kHost:
      if (shared_[g] != nullptr) return check_shared(g, 0, shard);
      std::memcpy(host_shard_[g].data(), shard, shard_bytes);
      return Status::ok();
    case OffloadDevice::kNvme: {
      ZINF_ASSIGN_OR_RETURN(PinnedPool::Lease lease, staging_->acquire(options_.timeout));
      std::memcpy(lease.data(), shard, shard_bytes);
      std::memset(lease.data() + shard_bytes, 0, round_page(shard_bytes) - shard_bytes);
      ZINF_ASSIGN_OR_RETURN(SwapTicket ticket, swap_->write(extent_[g], lease.data()));
      Status st = swap_->wait(ticket, options_.timeout);
      if (!st.is_ok()) {
        error_ = st;
        return st;
      }
      if (counters_ != nullptr) counters_->param_nvme_write_bytes += round_page(shard_bytes);
      return Status::ok();
    }
  }
  return Status::ok();
}

Status ParamCoordinator::write_shard_part(std::uint32_t g, std::size_t first, std::size_t count,
                                          const void* values) {
  ZINF_RETURN_IF_ERROR(error_);
  const GroupInfo& info = partitioner_.group(g);
  ZINF_ASSERT(first + count <= info.shard_element_count);
  if (!writes_shard_parts(g)) {
    return Status::unsupported(
        fmt::format("ParamCoordinator: group {}'s shard is on NVMe and is written whole", g));
  }
  const std::size_t bytes = dtype_bytes(info.dtype);
  if (persistent_[g]) {
    std::byte* own =
        full_[g].as<std::byte>() + (partitioner_.shard_offset(g, rank_) + first) * bytes;
    return device_.copy_h2d(own, values, count * bytes, *stream_);
  }
  if (options_.shard_tier == OffloadDevice::kNone) {
    return device_.copy_h2d(device_shard_[g].as<std::byte>() + first * bytes, values, count * bytes,
                            *stream_);
  }
  if (shared_[g] != nullptr) return check_shared(g, first, values);
  std::memcpy(host_shard_[g].as<std::byte>() + first * bytes, values, count * bytes);
  return Status::ok();
}

Status ParamCoordinator::check_shared(std::uint32_t g, std::size_t first, const void* values) {
  // The lent memory already holds what is written: only a write of those very bytes is expected.
  const std::byte* expected = shared_[g] + first * dtype_bytes(partitioner_.group(g).dtype);
  if (values == expected) return Status::ok();
  return Status::internal(fmt::format(
      "ParamCoordinator: group {}'s host shard is lent memory, written from other memory", g));
}

Status ParamCoordinator::unshare_host_shard(std::uint32_t g) {
  ZINF_RETURN_IF_ERROR(error_);
  if (shared_[g] == nullptr) return Status::ok();
  const GroupInfo& info = partitioner_.group(g);
  const std::size_t shard_bytes = info.shard_element_count * dtype_bytes(info.dtype);
  ZINF_ASSIGN_OR_RETURN(host_shard_[g], RegisteredBuffer::allocate(device_, shard_bytes));
  std::memcpy(host_shard_[g].data(), shared_[g], shard_bytes);
  shared_[g] = nullptr;
  return Status::ok();
}

Status ParamCoordinator::drain_writes() {
  // Copies up to device shards and persistent groups are on the stream; host and NVMe shards
  // were copied (or staged) before write_shard() returned. The stream is waited for after an
  // earlier failure too: its copies still read the caller's memory until they have run (a
  // stream runs, or skips, the work queued behind a failure), and the caller frees it next.
  Status st = wait_stream_for_writes();
  if (error_.is_ok()) error_ = st;
  return st;
}

Status ParamCoordinator::wait_stream_for_writes() {
  // Through the communicator, not a bare stream synchronize: the stream also carries all-gathers,
  // and when a peer is gone the all-gather's own deadline fails it naming the collective and the
  // silent rank, at about the moment this wait would run out with only the stream's name.
  Status st = device_.record(*written_, *stream_);
  if (st.is_ok()) st = comm_.wait(*written_, options_.timeout);
  return st;
}

Status ParamCoordinator::write_shard_from_device(std::uint32_t g, const void* device_shard) {
  ZINF_RETURN_IF_ERROR(error_);
  const GroupInfo& info = partitioner_.group(g);
  const std::size_t bytes = dtype_bytes(info.dtype);
  const std::size_t shard_bytes = info.shard_element_count * bytes;
  Status st;
  if (persistent_[g]) {
    std::byte* own = full_[g].as<std::byte>() + partitioner_.shard_offset(g, rank_) * bytes;
    st = device_.copy_d2d(own, device_shard, shard_bytes, *stream_);
  } else if (options_.shard_tier == OffloadDevice::kNone) {
    st = device_.copy_d2d(device_shard_[g].data(), device_shard, shard_bytes, *stream_);
  } else if (options_.shard_tier == OffloadDevice::kHost && shared_[g] != nullptr) {
    st = Status::internal(fmt::format(
        "ParamCoordinator: group {}'s host shard is lent memory, written from the device", g));
  } else if (options_.shard_tier == OffloadDevice::kHost) {
    // On the stream: a later gather's copy up from the same host shard comes after it.
    st = device_.copy_d2h(host_shard_[g].data(), device_shard, shard_bytes, *stream_);
  } else {
    ZINF_ASSIGN_OR_RETURN(PinnedPool::Lease lease, staging_->acquire(options_.timeout));
    std::memset(lease.data() + shard_bytes, 0, round_page(shard_bytes) - shard_bytes);
    st = device_.copy_d2h(lease.data(), device_shard, shard_bytes, *stream_);
    if (st.is_ok()) st = wait_stream_for_writes();
    if (!st.is_ok()) {
      error_ = st;
      return st;
    }
    // The host half of write_shard: the staged block goes to the swap file.
    ZINF_ASSIGN_OR_RETURN(SwapTicket ticket, swap_->write(extent_[g], lease.data()));
    st = swap_->wait(ticket, options_.timeout);
    if (st.is_ok() && counters_ != nullptr) {
      counters_->param_nvme_write_bytes += round_page(shard_bytes);
    }
  }
  if (!st.is_ok()) error_ = st;
  return st;
}

Status ParamCoordinator::publish_group(std::uint32_t g) {
  ZINF_RETURN_IF_ERROR(error_);
  ZINF_ASSERT(persistent_[g]);
  const GroupInfo& info = partitioner_.group(g);
  const std::size_t bytes = dtype_bytes(info.dtype);
  std::byte* full = full_[g].as<std::byte>();
  Status st = comm_.all_gather(full + partitioner_.shard_offset(g, rank_) * bytes, full,
                               info.shard_element_count, info.dtype, *stream_, group_names_[g]);
  if (!st.is_ok()) {
    error_ = st;
    return st;
  }
  if (counters_ != nullptr) counters_->all_gather_bytes += info.padded_element_count * bytes;
  return Status::ok();
}

Status ParamCoordinator::publish(std::span<const std::uint32_t> groups) {
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const std::uint32_t g = groups[i];
    ZINF_ASSERT(g < partitioner_.group_count() && (i == 0 || groups[i - 1] < g));
    if (persistent_[g]) ZINF_RETURN_IF_ERROR(publish_group(g));
  }
  return publish_wait();
}

Status ParamCoordinator::publish_wait() {
  ZINF_RETURN_IF_ERROR(error_);
  Status st = device_.record(*done_, *stream_);
  if (st.is_ok()) st = comm_.wait(*done_, options_.timeout);
  if (!st.is_ok()) error_ = st;
  return st;
}

Status ParamCoordinator::issue(std::size_t m, bool prefetch) {
  Module& mod = modules_[m];
  if (dry_run_) {
    for (std::uint32_t g : mod.partitioned) {
      const GroupInfo& info = partitioner_.group(g);
      ZINF_ASSIGN_OR_RETURN(full_[g],
                            take_buffer(info.padded_element_count * dtype_bytes(info.dtype)));
    }
    live_elements_ += mod.elements;
    return Status::ok();
  }
  if (issue_hook_ != nullptr) ZINF_RETURN_IF_ERROR(issue_hook_(issue_hook_user_, m));
  for (std::uint32_t g : mod.partitioned) {
    const GroupInfo& info = partitioner_.group(g);
    const std::size_t bytes = dtype_bytes(info.dtype);
    const std::size_t shard_bytes = info.shard_element_count * bytes;
    ZINF_ASSIGN_OR_RETURN(full_[g], take_buffer(info.padded_element_count * bytes));
    std::byte* full = full_[g].as<std::byte>();
    std::byte* own = full + partitioner_.shard_offset(g, rank_) * bytes;
    switch (options_.shard_tier) {
      case OffloadDevice::kNone:
        ZINF_RETURN_IF_ERROR(device_.copy_d2d(own, device_shard_[g].data(), shard_bytes, *stream_));
        break;
      case OffloadDevice::kHost:
        ZINF_RETURN_IF_ERROR(
            device_.copy_h2d(own, shared_[g] != nullptr ? shared_[g] : host_shard_[g].data(),
                             shard_bytes, *stream_));
        break;
      case OffloadDevice::kNvme: {
        // The read starts now; the stream waits for it, copies the block up and returns it, so
        // the block is busy only while its shard moves.
        // The block's record holds the lease until release_shard_block has run; a block is
        // leased once at a time, so its record is free whenever the block is.
        ZINF_ASSIGN_OR_RETURN(PinnedPool::Lease lease, staging_->acquire(options_.timeout));
        ShardRead& read = reads_[lease.index()];
        ZINF_ASSERT(!read.lease.valid() && !read.abandoned);
        ZINF_ASSIGN_OR_RETURN(read.ticket, swap_->read(extent_[g], lease.data()));
        read.swap = swap_;
        read.timeout = options_.timeout;
        read.lease = std::move(lease);
        Status st = device_.launch_host_func(*stream_, &wait_shard_read, &read);
        if (!st.is_ok()) {
          // Nothing on the stream holds the block: wait for the read here, then return it.
          (void)redeem_shard_read(read);
          if (!read.abandoned) read.lease.release();
          return st;
        }
        ZINF_RETURN_IF_ERROR(device_.copy_h2d(own, read.lease.data(), shard_bytes, *stream_));
        ZINF_RETURN_IF_ERROR(device_.launch_host_func(*stream_, &release_shard_block, &read));
        if (counters_ != nullptr) counters_->param_nvme_read_bytes += round_page(shard_bytes);
        break;
      }
    }
    ZINF_RETURN_IF_ERROR(comm_.all_gather(own, full, info.shard_element_count, info.dtype, *stream_,
                                          group_names_[g]));
    if (counters_ != nullptr) counters_->all_gather_bytes += info.padded_element_count * bytes;
  }
  ZINF_RETURN_IF_ERROR(device_.record(*mod.ready, *stream_));
  live_elements_ += mod.elements;
  note_live();
  if (counters_ != nullptr) {
    ++counters_->gathers_issued;
    if (prefetch) ++counters_->prefetches_issued;
  }
  instant("issue ", mod.name);
  return Status::ok();
}

Status ParamCoordinator::redeem_shard_read(ShardRead& read) {
  Status st = read.swap->wait(read.ticket, read.timeout);
  if (st.code() != Code::kTimeout) return st;
  // Past the timeout the read is cancelled and waited for once more; one the cancel does not
  // end either is given up, and its block, which the device may still write, never goes back.
  read.swap->cancel(read.ticket);
  if (read.swap->wait(read.ticket, read.timeout).code() != Code::kTimeout) return st;
  read.swap->abandon(read.ticket);
  read.abandoned = true;
  return Status::timeout(fmt::format("{}; a cancel did not end it either", st.message()));
}

Status ParamCoordinator::wait_shard_read(void* user, const Status& upstream) {
  // Waited for even after an upstream failure, so that the block is quiet when it is returned.
  Status st = redeem_shard_read(*static_cast<ShardRead*>(user));
  return upstream.is_ok() ? st : upstream;
}

Status ParamCoordinator::release_shard_block(void* user, const Status& /*upstream*/) {
  auto* read = static_cast<ShardRead*>(user);
  if (!read->abandoned) read->lease.release();
  return Status::ok();
}

Status ParamCoordinator::settle_prefetch(std::size_t m) {
  if (modules_[m].state != State::kPrefetched) return Status::ok();
  return wait_ready(m);
}

Status ParamCoordinator::wait_ready(std::size_t m) {
  if (dry_run_) return Status::ok();
  // The span's name is built only when tracing: gather() runs every micro-batch.
  std::optional<Trace::Span> span;
  if (options_.trace != nullptr) {
    span.emplace(options_.trace, options_.trace_track, "wait " + modules_[m].name);
  }
  Status st = comm_.wait(*modules_[m].ready, options_.timeout);
  if (!st.is_ok()) error_ = st;
  return st;
}

Result<DeviceBuffer> ParamCoordinator::take_buffer(std::size_t bytes) {
  auto it = std::find_if(spare_.begin(), spare_.end(),
                         [bytes](const SpareBuffer& s) { return s.bytes == bytes; });
  if (it == spare_.end()) return DeviceBuffer::allocate(device_, bytes);
  DeviceBuffer buffer = std::move(it->buffer);
  *it = std::move(spare_.back());
  spare_.pop_back();
  spare_bytes_ -= bytes;
  return buffer;
}

void ParamCoordinator::free_module(std::size_t m, const char* what) {
  Module& mod = modules_[m];
  for (std::uint32_t g : mod.partitioned) {
    const std::size_t bytes = full_[g].bytes();
    if (bytes != 0 && spare_bytes_ + bytes <= spare_bytes_max_) {
      ZINF_ASSERT(spare_.size() < spare_.capacity());  // see spare_
      spare_bytes_ += bytes;
      spare_.push_back({bytes, std::move(full_[g])});
    }
    if (full_[g].data() != nullptr && caller_pending_) {
      // Freed, not kept: the caller's work on it must have run (set_caller_stream).
      caller_pending_ = false;
      if (Status st = caller_->host_wait(options_.timeout); !st.is_ok() && error_.is_ok()) {
        error_ = st;
      }
    }
    full_[g].reset();
  }
  caller_pending_ = false;
  if (mod.state != State::kIdle) live_elements_ -= mod.elements;
  set_state(mod, State::kIdle);
  note_live();
  instant(what, mod.name);
}

void ParamCoordinator::set_state(Module& mod, State state) {
  if (mod.state == State::kInUse) --in_use_count_;
  if (state == State::kInUse) ++in_use_count_;
  mod.state = state;
  ZINF_ASSERT(in_use_count_ <= modules_.size());
}

void ParamCoordinator::prefetch_after(std::size_t position) {
  if (!frozen_) return;
  for (std::size_t k = position; k < order_.size() && error_.is_ok(); ++k) {
    const std::size_t p = order_[k];
    Module& mod = modules_[p];
    if (mod.state != State::kIdle || mod.elements == 0) continue;
    if (may_prefetch_ != nullptr && !may_prefetch_(issue_hook_user_, p)) continue;
    if (prefetched_elements_ + mod.elements > options_.prefetch_elements) break;
    if (live_elements_ + mod.elements > options_.max_live_elements) break;
    Status st = issue(p, /*prefetch=*/true);
    if (!st.is_ok()) {
      error_ = st;
      return;
    }
    set_state(mod, State::kPrefetched);
    prefetched_.push_back(p);
    prefetched_elements_ += mod.elements;
  }
}

Status ParamCoordinator::gather(std::size_t m) {
  ZINF_RETURN_IF_ERROR(error_);
  Module& mod = modules_[m];
  if (mod.state == State::kInUse) {
    return Status::failed_precondition(
        fmt::format("gather('{}'): the module is gathered already (release it first)", mod.name));
  }
  if (counters_ != nullptr) ++counters_->gathers;
  if (!frozen_) {
    order_.push_back(m);
    calls_.push_back({m, /*gather=*/true});
  } else if (cursor_ < order_.size() && order_[cursor_] == m) {
    ++cursor_;
  } else {
    // Off the recorded order: look further on, then from the start (a new micro-batch).
    auto it = std::find(order_.begin() + static_cast<std::ptrdiff_t>(cursor_), order_.end(), m);
    if (it == order_.end()) it = std::find(order_.begin(), order_.end(), m);
    if (it != order_.end()) {
      cursor_ = static_cast<std::size_t>(it - order_.begin()) + 1;
    }
    const bool restart = it != order_.end() && it == order_.begin();
    if (!restart && counters_ != nullptr) ++counters_->order_misses;
  }
  if (mod.state == State::kPrefetched) {
    if (counters_ != nullptr) ++counters_->prefetch_hits;
    prefetched_.erase(std::find(prefetched_.begin(), prefetched_.end(), m));
    prefetched_elements_ -= mod.elements;
    set_state(mod, State::kInUse);
  } else {
    // Room for it: prefetched modules are dropped, the furthest first, while it does not fit.
    // A module in use is never refused (DeepSpeed's limit bounds only what is fetched ahead), so
    // the live elements exceed max_live_elements only by the modules in use.
    while (live_elements_ + mod.elements > options_.max_live_elements && !prefetched_.empty()) {
      const std::size_t p = prefetched_.back();
      prefetched_.pop_back();
      prefetched_elements_ -= modules_[p].elements;
      ZINF_RETURN_IF_ERROR(wait_ready(p));
      free_module(p, "drop ");
      if (counters_ != nullptr) ++counters_->prefetches_dropped;
    }
    if (mod.elements > 0) {
      Status st = issue(m, /*prefetch=*/false);
      if (!st.is_ok()) {
        error_ = st;
        return st;
      }
    }
    set_state(mod, State::kInUse);
  }
  prefetch_after(cursor_);
  if (caller_ != nullptr && !dry_run_) {
    // Ready on the caller's stream: it waits for the all-gather, the host does not.
    Status st = caller_->wait_for(*mod.ready);
    if (!st.is_ok()) error_ = st;
    return st;
  }
  return wait_ready(m);
}

Status ParamCoordinator::release(std::size_t m) {
  ZINF_RETURN_IF_ERROR(error_);
  Module& mod = modules_[m];
  if (mod.state != State::kInUse) {
    return Status::failed_precondition(
        fmt::format("release('{}'): the module is not gathered", mod.name));
  }
  if (!frozen_) calls_.push_back({m, /*gather=*/false});
  if (caller_ != nullptr && !dry_run_ && mod.elements > 0) {
    // A later gather into these buffers (spares) runs on stream_ after the caller's reads.
    Status st = caller_->order_after_caller(*stream_, /*before_read=*/false);
    if (!st.is_ok()) {
      error_ = st;
      return st;
    }
    caller_pending_ = true;
  }
  free_module(m, "release ");
  return Status::ok();
}

bool ParamCoordinator::gathered(std::size_t module) const {
  return modules_[module].state == State::kInUse;
}

void* ParamCoordinator::group_data(std::uint32_t g) const { return full_[g].data(); }

Status ParamCoordinator::drop_prefetched() {
  Status first;
  for (std::size_t p : prefetched_) {
    Status st = wait_ready(p);
    if (first.is_ok() && !st.is_ok()) first = st;
    free_module(p, "drop ");
    if (counters_ != nullptr) ++counters_->prefetches_dropped;
  }
  prefetched_.clear();
  prefetched_elements_ = 0;
  cursor_ = 0;
  return first;
}

void ParamCoordinator::freeze_order() {
  if (!frozen_) {
    frozen_ = true;
    warm_up();
  }
  cursor_ = 0;
}

void ParamCoordinator::warm_up() {
  std::vector<Call> calls = std::move(calls_);
  calls_ = {};
  const bool idle = std::all_of(modules_.begin(), modules_.end(),
                                [](const Module& mod) { return mod.state == State::kIdle; });
  if (!idle || !prefetched_.empty() || !error_.is_ok()) return;
  // Nothing counted, nothing traced, nothing moved: only the buffers' comings and goings.
  ZeroCounters* counters = std::exchange(counters_, nullptr);
  Trace* trace = std::exchange(options_.trace, nullptr);
  dry_run_ = true;
  const std::size_t spare_bytes_max = std::exchange(spare_bytes_max_, SIZE_MAX);
  cursor_ = 0;
  for (const Call& call : calls) {
    const Status st = call.gather ? gather(call.module) : release(call.module);
    if (!st.is_ok()) break;
  }
  for (std::size_t m = 0; m < modules_.size(); ++m) {
    if (modules_[m].state != State::kIdle) free_module(m, "");
  }
  prefetched_.clear();
  prefetched_elements_ = 0;
  ZINF_ASSERT(live_elements_ == 0);
  spare_bytes_max_ = std::max(spare_bytes_max, spare_bytes_);
  error_ = Status::ok();  // a buffer that could not be made here is the real gather's error
  dry_run_ = false;
  options_.trace = trace;
  counters_ = counters;
}

void ParamCoordinator::restore_order(std::vector<std::size_t> order) {
  for (std::size_t m : order) ZINF_ASSERT(m < modules_.size());
  order_ = std::move(order);
  freeze_order();
}

long ParamCoordinator::first_in_use() const {
  if (in_use_count_ == 0) return -1;
  for (std::size_t m = 0; m < modules_.size(); ++m) {
    if (modules_[m].state == State::kInUse) return static_cast<long>(m);
  }
  ZINF_ASSERT_MSG(false, "in_use_count_ counts a module that is not in use");
  return -1;
}

std::uint64_t ParamCoordinator::device_bytes() const {
  std::uint64_t total = 0;
  for (std::uint32_t g = 0; g < partitioner_.group_count(); ++g) {
    if (persistent_[g]) total += full_[g].bytes();
    total += device_shard_[g].bytes();
  }
  return total;
}

std::uint64_t ParamCoordinator::staging_bytes() const {
  return staging_ != nullptr ? staging_->bytes() : 0;
}

std::uint64_t ParamCoordinator::host_bytes() const {
  std::uint64_t total = staging_bytes();
  for (const RegisteredBuffer& b : host_shard_) total += b.bytes();
  return total;
}

std::uint64_t ParamCoordinator::nvme_bytes() const {
  std::uint64_t total = 0;
  for (const ExtentId& e : extent_) {
    if (e.valid()) total += swap_->info(e).disk_bytes;
  }
  return total;
}

}  // namespace zinf
