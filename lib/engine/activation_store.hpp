// ActivationStore: the activation checkpoints of one rank (Engine::save_activation() /
// load_activation(), the config's activation_checkpointing section).
//
// During the forward pass the training program saves the tensors it keeps for the backward pass
// (with checkpointing, each block's input) under a key; during the backward pass it loads them
// back, usually in the reverse order. Where a checkpoint lives:
//   device  (cpu_checkpointing false) a device allocation of its size, freed when it is loaded;
//   host    (cpu_checkpointing true) a pinned host arena of zinf.activation_host_bytes, used as a
//           stack: saves push, loads pop (a checkpoint loaded out of order frees its space when
//           everything above it is loaded too);
//   nvme    beyond the arena, when zinf.activation_nvme_path is set: an extent of a swap file,
//           written and read through the I/O engine in chunks of the pinned staging blocks, each
//           block checksummed (SwapSpace), so a read that does not match what was written is
//           kCorruption naming the key.
//
// Asynchrony. save() issues the copy off the device on the store's stream and returns; the NVMe
// write of each chunk is submitted from that stream once its device-to-host copy is done, so the
// caller's next compute overlaps both. The caller's memory must keep its values until the next
// call of this store returns (each call first waits for the previous save's copies), which lets a
// forward pass alternate two buffers. load() returns once the values are in the caller's memory.
//
// Prefetch. The keys' save order of the first forward pass (up to the first load) is recorded;
// from then on each load() starts NVMe reads of the chunks that follow in the reverse of that
// order into free staging blocks, so the next load finds its data in host memory. The last saved
// chunks are still in their staging blocks when the backward pass starts: a load takes them from
// there without reading them back.
//
// Bounded memory: the arena, staging_count blocks of staging_bytes, the swap file's
// zinf.activation_nvme_bytes; nothing else grows with the activations but the device copies.
//
// Errors: every Status names the activation key; an I/O or device error is sticky (every later
// call returns it), but a copy the device refuses for its pointer (not inside memory it allocated)
// is kInvalidArgument and changes nothing.
//
// Thread-safety: one thread (the rank's), as the Engine.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/status.hpp"

namespace zinf {

class FaultInjector;
class StickyError;
struct MemoryReport;

struct ActivationStoreOptions {
  // false: checkpoints stay on the device (copies the store owns); true: off the device.
  bool offload = false;
  // Host arena for offloaded checkpoints (bytes; 0: none, everything beyond goes to NVMe).
  std::uint64_t host_bytes = 0;
  // Swap directory for checkpoints beyond the arena ("" : none, and a checkpoint that does not fit
  // the arena is kResourceExhausted naming zinf.activation_host_bytes).
  std::string nvme_dir;
  // Swap file capacity, preallocated when the first checkpoint goes to NVMe.
  std::uint64_t nvme_bytes = 0;
  // Pinned staging blocks of the NVMe tier: each a multiple of aio_block_bytes.
  std::size_t staging_bytes = std::size_t{8} << 20;
  std::size_t staging_count = 4;
  std::size_t aio_block_bytes = std::size_t{1} << 20;
  std::uint32_t aio_queue_depth = 32;
  std::chrono::milliseconds timeout{60'000};
  int rank = 0;
  std::shared_ptr<FaultInjector> io_faults;  // tests only
};

// What the store holds; peaks since create().
struct ActivationStoreReport {
  std::uint64_t device_bytes = 0;       // checkpoints on the device now
  std::uint64_t device_bytes_peak = 0;  // most at once
  std::uint64_t host_bytes = 0;         // the arena and the staging blocks (allocated)
  std::uint64_t host_used_bytes_peak = 0;
  std::uint64_t nvme_bytes = 0;  // swap file capacity (opened)
  std::uint64_t saves = 0, loads = 0;
  std::uint64_t nvme_write_bytes = 0, nvme_read_bytes = 0;
  std::uint64_t prefetch_hits = 0;  // chunks a load found read ahead, or still staged
};

class ActivationStore {
 public:
  static Result<std::unique_ptr<ActivationStore>> create(Device& device,
                                                         const ActivationStoreOptions& options);
  ~ActivationStore();
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  // Saves `bytes` (> 0) at device pointer `data` under `key`. kInvalidArgument for an empty key,
  // a null pointer or 0 bytes; kFailedPrecondition when `key` is saved and not loaded yet;
  // kInvalidArgument when the key went to NVMe in an earlier step with fewer bytes, or when the
  // device refuses to copy from `data` (not `bytes` of its memory): nothing is saved, and what
  // the call reserved (device allocation, arena space) is given back.
  Status save(std::string_view key, const void* data, std::size_t bytes);
  // Copies the checkpoint `key` into device pointer `data` (its saved size) and frees it.
  // kNotFound when `key` is not saved; kInvalidArgument when the device refuses to copy to `data`
  // (not the saved size of its memory): the checkpoint stays saved.
  Status load(std::string_view key, void* data);
  // Waits for the last save's copies off the caller's memory.
  Status flush();
  // Bytes saved under `key` now (0 when none).
  std::size_t saved_bytes(std::string_view key) const;

  ActivationStoreReport report() const;

  struct Impl;

 private:
  explicit ActivationStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The engine's side of the store: opened at the first save from the config's
// activation_checkpointing section, the device peak of the memory report (the store's device
// copies plus the bytes the caller says it holds), and operating errors made sticky and sent to
// every rank (the communicator is aborted, so the other ranks' next collective fails at once with
// this rank's error, which names the activation).
class EngineActivations {
 public:
  EngineActivations(const Config& config, Device& device, Communicator& comm,
                    const std::vector<std::string>& nvme_paths,
                    std::shared_ptr<FaultInjector> faults, StickyError& sticky);
  ~EngineActivations();
  Status save(std::string_view key, const void* data, std::size_t bytes);
  Status load(std::string_view key, void* data);
  Status flush();
  void set_caller_bytes(std::uint64_t bytes);
  // The activation fields of the memory report.
  void add_memory(MemoryReport& report) const;

 private:
  Status open();
  Status fail(Status st);
  void note_peak();

  const Config& config_;
  Device& device_;
  Communicator& comm_;
  std::vector<std::string> nvme_paths_;
  std::shared_ptr<FaultInjector> faults_;
  StickyError& sticky_;
  std::unique_ptr<ActivationStore> store_;
  std::uint64_t caller_bytes_ = 0;
  std::uint64_t device_peak_bytes_ = 0;
};

}  // namespace zinf
