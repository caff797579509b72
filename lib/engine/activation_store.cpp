// ActivationStore (activation_store.hpp): device copies, a pinned host arena used as a stack, and
// NVMe extents moved through pinned staging blocks.
#include "engine/activation_store.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>

#include "base/arith.hpp"
#include "base/assert.hpp"
#include "device/pinned_pool.hpp"
#include "engine/nvme_dir.hpp"
#include "engine/rank_exchange.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

constexpr std::uint32_t kNoEntry = std::numeric_limits<std::uint32_t>::max();

enum class Where : std::uint8_t { kNone, kDevice, kHost, kNvme };

struct Entry {
  std::string key;
  std::uint64_t bytes = 0;  // saved now; 0: not saved
  Where where = Where::kNone;
  void* device = nullptr;            // kDevice
  std::uint64_t host_offset = 0;     // kHost: in the arena
  ExtentId extent;                   // its NVMe extent, once it went there
  std::uint64_t extent_bytes = 0;    // the extent's size (a multiple of the swap block)
  std::size_t order_pos = SIZE_MAX;  // in the reverse save order, once recorded
};

}  // namespace

// A staging block in use: a chunk being written (the write submitted from the stream once the
// device-to-host copy is done), read (a load's or a prefetch), or copied to the device.
struct Slot {
  ActivationStore::Impl* impl = nullptr;
  PinnedPool::Lease lease;
  std::uint32_t entry = kNoEntry;
  std::uint32_t chunk = 0;
  std::uint64_t io_bytes = 0;  // bytes written or read (whole swap blocks)
  bool writing = false;        // a write ticket to redeem
  bool reading = false;        // a read ticket to redeem
  bool consumed = false;       // a copy to the device was issued from it
  SwapTicket ticket;
  Status submit;  // the write's submit status, set on the stream
  std::uint64_t seq = 0;
};

struct ActivationStore::Impl {
  Device& device;
  ActivationStoreOptions options;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<Event> saved;  // after the last save's copies
  bool save_pending = false;
  Status sticky;

  std::vector<Entry> entries;
  std::map<std::string, std::uint32_t, std::less<>> index;
  std::vector<std::uint32_t> order;  // save order of the first forward pass
  bool recorded = false;

  std::unique_ptr<PinnedPool> arena;  // one block of host_bytes
  std::uint64_t arena_top = 0;
  std::vector<std::uint32_t> arena_stack;

  std::unique_ptr<IoEngine> io;
  std::unique_ptr<SwapSpace> swap;
  std::unique_ptr<PinnedPool> staging;
  std::vector<Slot> slots;  // by lease index
  std::uint64_t seq = 0;

  ActivationStoreReport report;

  Impl(Device& d, const ActivationStoreOptions& o) : device(d), options(o) {}

  ~Impl() {
    if (stream != nullptr) (void)device.synchronize(*stream, options.timeout);
    for (Slot& s : slots) (void)retire(s);
    for (Entry& e : entries) {
      if (e.device != nullptr) (void)device.free(e.device);
    }
  }

  Status fail(Status st) {
    if (!st.is_ok() && sticky.is_ok()) sticky = st;
    return st;
  }

  // Whether the device refused a copy for its arguments (a pointer that is not inside memory it
  // allocated): both devices check that before they issue anything, so nothing was copied and
  // the call that asked for it can be undone and refused without becoming sticky.
  static bool refused(const Status& copied) { return copied.code() == Code::kInvalidArgument; }

  std::string_view key_of(std::uint32_t e) const { return entries[e].key; }

  // The previous save's copies: the caller may reuse that memory once this returns.
  Status finish_save() {
    if (!save_pending) return Status::ok();
    save_pending = false;
    return device.synchronize(*saved, options.timeout);
  }

  Status open_nvme() {
    if (swap != nullptr) return Status::ok();
    IoOptions io_options;
    io_options.block_bytes = options.aio_block_bytes;
    io_options.queue_depth = options.aio_queue_depth;
    io_options.faults = options.io_faults;
    ZINF_ASSIGN_OR_RETURN(io, open_engine(io_options));
    SwapOptions so;
    so.dirs = {options.nvme_dir};
    so.block_bytes = options.aio_block_bytes;
    so.capacity_bytes =
        round_up(std::max<std::uint64_t>(options.nvme_bytes, 1), options.aio_block_bytes);
    so.max_op_bytes = options.staging_bytes;
    so.file_name = swap_file_name("activations", options.rank);
    Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(*io, so);
    if (!opened.is_ok()) {
      return opened.status().with_context(
          fmt::format("activation swap space in {} (zinf.activation_nvme_path)", options.nvme_dir));
    }
    swap = std::move(opened).value();
    PinnedPoolOptions po;
    po.block_bytes = options.staging_bytes;
    po.block_count = options.staging_count;
    po.huge_pages = HugePages::kNone;
    po.device = &device;
    ZINF_ASSIGN_OR_RETURN(staging, PinnedPool::create(po));
    ZINF_RETURN_IF_ERROR(staging->register_with(*io));
    slots.resize(staging->block_count());
    for (Slot& s : slots) s.impl = this;
    report.nvme_bytes = so.capacity_bytes;
    report.host_bytes += staging->bytes();
    return Status::ok();
  }

  Slot* find_slot(std::uint32_t e, std::uint32_t chunk) {
    for (Slot& s : slots) {
      if (s.lease.valid() && s.entry == e && s.chunk == chunk) return &s;
    }
    return nullptr;
  }

  // Gives a slot's block back once what it does is over.
  Status retire(Slot& s) {
    if (!s.lease.valid()) return Status::ok();
    Status st;
    if (s.consumed || s.writing) st = device.synchronize(*stream, options.timeout);
    if (s.writing) {
      if (st.is_ok()) st = s.submit;
      if (st.is_ok() && s.ticket.valid()) st = swap->wait(s.ticket, options.timeout);
      if (st.is_ok()) report.nvme_write_bytes += s.io_bytes;
    } else if (s.reading) {
      st = swap->wait(s.ticket, options.timeout);
    }
    const std::uint32_t e = s.entry;
    s.writing = s.reading = s.consumed = false;
    s.ticket = {};
    s.submit = Status::ok();
    s.entry = kNoEntry;
    s.lease.release();
    if (!st.is_ok()) {
      return fail(st.with_context(fmt::format("activation '{}'", e == kNoEntry ? "" : key_of(e))));
    }
    return Status::ok();
  }

  // A free staging block: a free one, else the oldest slot not being read is retired (a write
  // completes), else the oldest read-ahead.
  Result<Slot*> acquire_slot() {
    for (;;) {
      if (std::optional<PinnedPool::Lease> lease = staging->try_acquire()) {
        Slot& s = slots[lease->index()];
        s.lease = std::move(*lease);
        s.seq = ++seq;
        return &s;
      }
      Slot* oldest = nullptr;
      for (int pass = 0; pass < 2 && oldest == nullptr; ++pass) {
        for (Slot& s : slots) {
          if (!s.lease.valid() || (pass == 0 && s.reading)) continue;
          if (oldest == nullptr || s.seq < oldest->seq) oldest = &s;
        }
      }
      ZINF_ASSERT(oldest != nullptr);
      ZINF_RETURN_IF_ERROR(retire(*oldest));
    }
  }

  static Status submit_write(void* user, const Status& upstream) {
    Slot& s = *static_cast<Slot*>(user);
    if (!upstream.is_ok()) {
      s.submit = upstream;
      return upstream;
    }
    Impl& impl = *s.impl;
    const Entry& e = impl.entries[s.entry];
    Result<SwapTicket> ticket = impl.swap->write(
        e.extent, std::uint64_t{s.chunk} * impl.options.staging_bytes, s.io_bytes, s.lease.data());
    if (!ticket.is_ok()) {
      s.submit = ticket.status();
      return s.submit;
    }
    s.ticket = *ticket;
    return Status::ok();
  }

  std::uint32_t chunk_count(const Entry& e) const {
    return static_cast<std::uint32_t>((e.bytes + options.staging_bytes - 1) /
                                      options.staging_bytes);
  }
  std::uint64_t chunk_bytes(const Entry& e, std::uint32_t c) const {
    return std::min<std::uint64_t>(options.staging_bytes,
                                   e.bytes - std::uint64_t{c} * options.staging_bytes);
  }
  // The bytes a chunk's write or read moves: whole swap blocks, or up to the end of the extent
  // (which SwapSpace requires), never beyond the staging block.
  std::uint64_t io_bytes(const Entry& e, std::uint32_t c) const {
    const std::uint64_t offset = std::uint64_t{c} * options.staging_bytes;
    return std::min(round_up(chunk_bytes(e, c), options.aio_block_bytes), e.extent_bytes - offset);
  }

  Status save_nvme(std::uint32_t ei, const void* data) {
    ZINF_RETURN_IF_ERROR(open_nvme());
    Entry& e = entries[ei];
    // A read-ahead of this key's previous checkpoint (never loaded) is stale now.
    for (Slot& s : slots) {
      if (s.lease.valid() && s.entry == ei) ZINF_RETURN_IF_ERROR(retire(s));
    }
    const std::uint64_t need = round_up(e.bytes, 4096);
    if (!e.extent.valid()) {
      ZINF_ASSIGN_OR_RETURN(e.extent, swap->create(e.key, need));
      e.extent_bytes = need;
    } else if (need > e.extent_bytes) {
      return Status::invalid_argument(fmt::format(
          "save_activation('{}'): {} bytes, but its NVMe extent holds {} (the key was saved with "
          "that size before; use a new key for a larger tensor)",
          e.key, e.bytes, e.extent_bytes));
    }
    e.where = Where::kNvme;
    const auto* src = static_cast<const std::byte*>(data);
    for (std::uint32_t c = 0; c < chunk_count(e); ++c) {
      ZINF_ASSIGN_OR_RETURN(Slot * s, acquire_slot());
      const std::uint64_t bytes = chunk_bytes(e, c);
      s->entry = ei;
      s->chunk = c;
      s->io_bytes = io_bytes(e, c);
      s->writing = true;
      Status copied = device.copy_d2h(
          s->lease.data(), src + std::uint64_t{c} * options.staging_bytes, bytes, *stream);
      if (refused(copied)) {
        // This block goes back unused; the chunks issued before it finish (their blocks would
        // otherwise be reused under a key that is not saved), and the key keeps its extent, as
        // after a load. An error of those writes is sticky, as any write's.
        s->writing = false;
        s->entry = kNoEntry;
        s->lease.release();
        for (Slot& o : slots) {
          if (o.lease.valid() && o.entry == ei) ZINF_RETURN_IF_ERROR(retire(o));
        }
        e.where = Where::kNone;
        return copied.with_context(fmt::format("save_activation('{}')", e.key));
      }
      ZINF_RETURN_IF_ERROR(copied);
      ZINF_RETURN_IF_ERROR(device.launch_host_func(*stream, &Impl::submit_write, s));
    }
    return Status::ok();
  }

  // Undoes what save() reserved for entry `ei` before it was refused, so that the entry is as it
  // was before the call: not saved, out of the save order when the call put it there, and
  // forgotten when the call created it (unless it got an NVMe extent, which stays the key's).
  void unsave(std::uint32_t ei, bool created, bool ordered) {
    Entry& e = entries[ei];
    ZINF_ASSERT(e.device == nullptr);
    e.bytes = 0;
    e.where = Where::kNone;
    if (ordered) {
      ZINF_ASSERT(!order.empty() && order.back() == ei);
      order.pop_back();
      e.order_pos = SIZE_MAX;
    }
    if (created && !e.extent.valid()) {
      ZINF_ASSERT(ei + 1 == entries.size());
      index.erase(e.key);
      entries.pop_back();
    }
  }

  Status save(std::string_view key, const void* data, std::size_t bytes) {
    ZINF_RETURN_IF_ERROR(sticky);
    ZINF_RETURN_IF_ERROR(fail(finish_save()));
    if (key.empty() || data == nullptr || bytes == 0) {
      return Status::invalid_argument(fmt::format(
          "save_activation('{}'): needs a key, a device pointer and bytes > 0 (got {} bytes)", key,
          bytes));
    }
    auto it = index.find(key);
    const bool created = it == index.end();
    std::uint32_t ei = 0;
    if (created) {
      ei = static_cast<std::uint32_t>(entries.size());
      entries.push_back({});
      entries.back().key = std::string(key);
      index.emplace(std::string(key), ei);
    } else {
      ei = it->second;
    }
    Entry& e = entries[ei];
    if (e.bytes != 0) {
      return Status::failed_precondition(
          fmt::format("save_activation('{}'): saved already and not loaded since", key));
    }
    bool ordered = false;
    if (!recorded && e.order_pos == SIZE_MAX) {
      e.order_pos = order.size();  // provisional: made the reverse position at the first load
      order.push_back(ei);
      ordered = true;
    }
    e.bytes = bytes;
    e.where = Where::kNone;
    Status st;
    if (!options.offload) {
      Result<void*> copy = device.allocate(bytes);
      if (!copy.is_ok()) {
        unsave(ei, created, ordered);
        return copy.status().with_context(fmt::format("save_activation('{}') on the device", key));
      }
      e.device = *copy;
      e.where = Where::kDevice;
      const std::uint64_t peak_before = report.device_bytes_peak;
      report.device_bytes += bytes;
      report.device_bytes_peak = std::max(report.device_bytes_peak, report.device_bytes);
      st = device.copy_d2d(e.device, data, bytes, *stream);
      if (refused(st)) {
        const Status freed = device.free(e.device);
        e.device = nullptr;
        report.device_bytes -= bytes;
        report.device_bytes_peak = peak_before;
        unsave(ei, created, ordered);
        if (!freed.is_ok()) {
          return fail(freed.with_context(fmt::format("save_activation('{}')", key)));
        }
        return st.with_context(fmt::format("save_activation('{}')", key));
      }
    } else if (arena != nullptr && arena_top + round_up(bytes, 256) <= arena->bytes()) {
      e.where = Where::kHost;
      e.host_offset = arena_top;
      const std::uint64_t peak_before = report.host_used_bytes_peak;
      arena_top += round_up(bytes, 256);
      arena_stack.push_back(ei);
      report.host_used_bytes_peak = std::max(report.host_used_bytes_peak, arena_top);
      st = device.copy_d2h(arena->block(0) + e.host_offset, data, bytes, *stream);
      if (refused(st)) {
        arena_top = e.host_offset;
        arena_stack.pop_back();
        report.host_used_bytes_peak = peak_before;
        unsave(ei, created, ordered);
        return st.with_context(fmt::format("save_activation('{}')", key));
      }
    } else if (!options.nvme_dir.empty()) {
      st = save_nvme(ei, data);
      if (!st.is_ok() && e.where == Where::kNone) {
        // Refused before anything was copied, or the copy was refused and the chunks issued
        // before it finished: nothing is saved.
        unsave(ei, created, ordered);
        return st;
      }
    } else {
      const std::uint64_t left_bytes = arena == nullptr ? 0 : arena->bytes() - arena_top;
      unsave(ei, created, ordered);
      return Status::resource_exhausted(
          fmt::format("save_activation('{}'): {} bytes do not fit the {} bytes left of "
                      "zinf.activation_host_bytes ({}), and zinf.activation_nvme_path is not set",
                      key, bytes, left_bytes, options.host_bytes));
    }
    if (st.is_ok()) st = device.record(*saved, *stream);
    if (!st.is_ok()) return fail(st.with_context(fmt::format("save_activation('{}')", key)));
    save_pending = true;
    ++report.saves;
    return Status::ok();
  }

  // Freezes the recorded order at the first load: positions in the reverse save order.
  void record_order() {
    if (recorded) return;
    recorded = true;
    for (std::size_t i = 0; i < order.size(); ++i) {
      entries[order[i]].order_pos = order.size() - 1 - i;
    }
    std::reverse(order.begin(), order.end());
  }

  // Undoes record_order(): the provisional positions of the saves so far, which later saves of
  // the first forward pass extend.
  void unrecord_order() {
    ZINF_ASSERT(recorded);
    recorded = false;
    std::reverse(order.begin(), order.end());
    for (std::size_t i = 0; i < order.size(); ++i) entries[order[i]].order_pos = i;
  }

  // Starts reads of the NVMe chunks that follow (entry at reverse position `pos`, chunk
  // `chunk`) into free staging blocks.
  Status prefetch(std::size_t pos, std::uint32_t chunk) {
    if (swap == nullptr) return Status::ok();
    for (; pos < order.size(); ++pos, chunk = 0) {
      const std::uint32_t ei = order[pos];
      const Entry& e = entries[ei];
      if (e.bytes == 0 || e.where != Where::kNvme) continue;
      for (std::uint32_t c = chunk; c < chunk_count(e); ++c) {
        if (find_slot(ei, c) != nullptr) continue;
        std::optional<PinnedPool::Lease> lease = staging->try_acquire();
        if (!lease.has_value()) return Status::ok();
        Slot& s = slots[lease->index()];
        s.lease = std::move(*lease);
        s.seq = ++seq;
        s.entry = ei;
        s.chunk = c;
        s.io_bytes = io_bytes(e, c);
        Result<SwapTicket> t = swap->read(e.extent, std::uint64_t{c} * options.staging_bytes,
                                          s.io_bytes, s.lease.data());
        if (!t.is_ok()) {
          s.entry = kNoEntry;
          s.lease.release();
          return fail(t.status().with_context(fmt::format("activation '{}'", e.key)));
        }
        s.ticket = *t;
        s.reading = true;
      }
    }
    return Status::ok();
  }

  // Sets `copy_refused` when the device refused a chunk's copy into `data`: the chunks stay in
  // their staging blocks (a later load copies them from there) and the entry stays saved.
  Status load_nvme(std::uint32_t ei, void* data, bool& copy_refused) {
    Entry& e = entries[ei];
    auto* dst = static_cast<std::byte*>(data);
    for (std::uint32_t c = 0; c < chunk_count(e); ++c) {
      Slot* s = find_slot(ei, c);
      if (s != nullptr) {
        ++report.prefetch_hits;
      } else {
        ZINF_ASSIGN_OR_RETURN(s, acquire_slot());
        s->entry = ei;
        s->chunk = c;
        s->io_bytes = io_bytes(e, c);
        ZINF_ASSIGN_OR_RETURN(
            s->ticket, swap->read(e.extent, std::uint64_t{c} * options.staging_bytes, s->io_bytes,
                                  s->lease.data()));
        s->reading = true;
      }
      if (s->reading) {
        Status st = swap->wait(s->ticket, options.timeout);
        s->reading = false;
        s->ticket = {};
        if (!st.is_ok()) {
          (void)retire(*s);
          return st;
        }
        report.nvme_read_bytes += s->io_bytes;
      }
      Status copied = device.copy_h2d(dst + std::uint64_t{c} * options.staging_bytes,
                                      s->lease.data(), chunk_bytes(e, c), *stream);
      if (refused(copied)) {
        // The chunks copied before it are in the caller's memory once this returns, so that no
        // copy into it is left running after the refusal.
        ZINF_RETURN_IF_ERROR(device.synchronize(*stream, options.timeout));
        copy_refused = true;
        return copied;
      }
      ZINF_RETURN_IF_ERROR(copied);
      s->consumed = true;
      ZINF_RETURN_IF_ERROR(prefetch(e.order_pos, c + 1));
    }
    ZINF_RETURN_IF_ERROR(device.synchronize(*stream, options.timeout));
    for (Slot& s : slots) {
      if (s.lease.valid() && s.entry == ei) ZINF_RETURN_IF_ERROR(retire(s));
    }
    // The blocks just freed read ahead.
    return prefetch(e.order_pos + 1, 0);
  }

  Status load(std::string_view key, void* data) {
    ZINF_RETURN_IF_ERROR(sticky);
    ZINF_RETURN_IF_ERROR(fail(finish_save()));
    auto it = index.find(key);
    if (it == index.end() || entries[it->second].bytes == 0) {
      return Status::not_found(fmt::format("load_activation('{}'): not saved", key));
    }
    if (data == nullptr) {
      return Status::invalid_argument(fmt::format("load_activation('{}'): null pointer", key));
    }
    const bool recording = !recorded;
    record_order();
    const std::uint32_t ei = it->second;
    Entry& e = entries[ei];
    // A copy the device refused leaves the checkpoint saved where it is (and the save order
    // unrecorded when this load would have recorded it).
    auto refuse = [&](const Status& copied) {
      if (recording) unrecord_order();
      return copied.with_context(fmt::format("load_activation('{}')", key));
    };
    Status st;
    bool copy_refused = false;
    switch (e.where) {
      case Where::kDevice:
        st = device.copy_d2d(data, e.device, e.bytes, *stream);
        if (refused(st)) return refuse(st);
        if (st.is_ok()) st = device.synchronize(*stream, options.timeout);
        if (st.is_ok()) st = device.free(e.device);
        e.device = nullptr;
        report.device_bytes -= e.bytes;
        break;
      case Where::kHost:
        st = device.copy_h2d(data, arena->block(0) + e.host_offset, e.bytes, *stream);
        if (refused(st)) return refuse(st);
        if (st.is_ok()) st = device.synchronize(*stream, options.timeout);
        break;
      case Where::kNvme:
        st = load_nvme(ei, data, copy_refused);
        if (copy_refused) return refuse(st);
        break;
      case Where::kNone:
        ZINF_ASSERT(false);
    }
    e.bytes = 0;
    if (e.where == Where::kHost) {
      while (!arena_stack.empty() && entries[arena_stack.back()].bytes == 0) {
        arena_top = entries[arena_stack.back()].host_offset;
        arena_stack.pop_back();
      }
    }
    if (!st.is_ok()) return fail(st.with_context(fmt::format("load_activation('{}')", key)));
    ++report.loads;
    return Status::ok();
  }
};

ActivationStore::ActivationStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ActivationStore::~ActivationStore() = default;

Result<std::unique_ptr<ActivationStore>> ActivationStore::create(
    Device& device, const ActivationStoreOptions& options) {
  auto impl = std::make_unique<Impl>(device, options);
  ActivationStoreOptions& o = impl->options;
  o.staging_bytes =
      round_up(std::max<std::size_t>(o.staging_bytes, o.aio_block_bytes), o.aio_block_bytes);
  o.staging_count = std::max<std::size_t>(o.staging_count, 2);
  ZINF_ASSIGN_OR_RETURN(impl->stream, device.create_stream("activations"));
  ZINF_ASSIGN_OR_RETURN(impl->saved, device.create_event());
  if (o.offload && o.host_bytes > 0) {
    PinnedPoolOptions po;
    po.block_bytes = round_up(o.host_bytes, 4096);
    po.block_count = 1;
    po.huge_pages = HugePages::kNone;
    po.device = &device;
    Result<std::unique_ptr<PinnedPool>> arena = PinnedPool::create(po);
    if (!arena.is_ok()) {
      return arena.status().with_context(
          fmt::format("the activation arena (zinf.activation_host_bytes {})", o.host_bytes));
    }
    impl->arena = std::move(arena).value();
    impl->report.host_bytes += impl->arena->bytes();
  }
  return std::unique_ptr<ActivationStore>(new ActivationStore(std::move(impl)));
}

Status ActivationStore::save(std::string_view key, const void* data, std::size_t bytes) {
  return impl_->save(key, data, bytes);
}
Status ActivationStore::load(std::string_view key, void* data) { return impl_->load(key, data); }
Status ActivationStore::flush() {
  ZINF_RETURN_IF_ERROR(impl_->sticky);
  return impl_->fail(impl_->finish_save());
}
std::size_t ActivationStore::saved_bytes(std::string_view key) const {
  auto it = impl_->index.find(key);
  return it == impl_->index.end() ? 0 : impl_->entries[it->second].bytes;
}
ActivationStoreReport ActivationStore::report() const { return impl_->report; }

// --- EngineActivations --------------------------------------------------------------------------

EngineActivations::EngineActivations(const Config& config, Device& device, Communicator& comm,
                                     const std::vector<std::string>& nvme_paths,
                                     std::shared_ptr<FaultInjector> faults, StickyError& sticky)
    : config_(config),
      device_(device),
      comm_(comm),
      nvme_paths_(nvme_paths),
      faults_(std::move(faults)),
      sticky_(sticky) {}

EngineActivations::~EngineActivations() = default;

Status EngineActivations::open() {
  if (store_ != nullptr) return Status::ok();
  const ActivationConfig& a = config_.activations;
  ActivationStoreOptions o;
  o.offload = a.cpu_checkpointing;
  o.host_bytes = a.host_bytes;
  if (o.offload && !a.nvme_path.empty()) {
    o.nvme_dir = nvme_paths_.empty() ? a.nvme_path : nvme_paths_.front();
    ZINF_RETURN_IF_ERROR(prepare_nvme_directory(
        nvme_paths_.empty() ? "zinf.activation_nvme_path" : "Env::nvme_paths", o.nvme_dir,
        comm_.rank()));
  }
  o.nvme_bytes = a.nvme_bytes;
  o.aio_block_bytes = config_.aio_block_bytes;
  o.aio_queue_depth = static_cast<std::uint32_t>(config_.aio_queue_depth);
  o.staging_bytes = std::max<std::size_t>(std::size_t{8} << 20, config_.aio_block_bytes);
  o.timeout = std::chrono::milliseconds(config_.collective_timeout_ms);
  o.rank = comm_.rank();
  o.io_faults = faults_;
  ZINF_ASSIGN_OR_RETURN(store_, ActivationStore::create(device_, o));
  return Status::ok();
}

// Bad input, and a checkpoint there is no room for, leave the engine usable (the store refused
// them before changing anything); anything else fails this rank and, through the communicator,
// every other one.
Status EngineActivations::fail(Status st) {
  if (st.is_ok()) return st;
  switch (st.code()) {
    case Code::kInvalidArgument:
    case Code::kNotFound:
    case Code::kFailedPrecondition:
    case Code::kResourceExhausted:  // no room for a new checkpoint: refused before it changed
      return st;
    default:
      break;
  }
  (void)sticky_.fail(st);
  comm_.abort(Status::aborted(fmt::format("rank {}: {}", comm_.rank(), st.message())));
  return st;
}

void EngineActivations::note_peak() {
  const std::uint64_t mine = store_ != nullptr ? store_->report().device_bytes : 0;
  device_peak_bytes_ = std::max(device_peak_bytes_, caller_bytes_ + mine);
}

Status EngineActivations::save(std::string_view key, const void* data, std::size_t bytes) {
  ZINF_RETURN_IF_ERROR(sticky_.status());
  ZINF_RETURN_IF_ERROR(fail(open()));
  Status st = fail(store_->save(key, data, bytes));
  note_peak();
  return st;
}

Status EngineActivations::load(std::string_view key, void* data) {
  ZINF_RETURN_IF_ERROR(sticky_.status());
  if (store_ == nullptr) {
    return Status::not_found(fmt::format("load_activation('{}'): not saved", key));
  }
  Status st = fail(store_->load(key, data));
  note_peak();
  return st;
}

Status EngineActivations::flush() {
  ZINF_RETURN_IF_ERROR(sticky_.status());
  if (store_ == nullptr) return Status::ok();
  return fail(store_->flush());
}

void EngineActivations::set_caller_bytes(std::uint64_t bytes) {
  caller_bytes_ = bytes;
  note_peak();
}

void EngineActivations::add_memory(MemoryReport& m) const {
  m.activation_device_bytes_peak = device_peak_bytes_;
  if (store_ == nullptr) return;
  const ActivationStoreReport r = store_->report();
  m.activation_host_bytes = r.host_bytes;
  m.activation_nvme_bytes = r.nvme_bytes;
  m.activation_nvme_write_bytes = r.nvme_write_bytes;
  m.activation_nvme_read_bytes = r.nvme_read_bytes;
}

}  // namespace zinf
