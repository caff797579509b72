// DeviceOptimizer: offload_optimizer "none" on a device that is not host-accessible (a GPU).
//
// This rank's fp32 master, Adam moments and fp32 gradient accumulator stay in device memory, in
// the partition layout the engine uses everywhere (group g's slice at offset(g)), and everything
// on them runs as device stream work (DeviceOps: the kernels of kernels/ on CUDA): the gradient
// accumulator is the GradReducer's (it adds reduced chunks on the device), the norm is
// sum_of_squares on the device, and a step is, per group, scale (the grad_scale of the step) then
// adam_step, which writes the group's bf16/f16 copy into a device buffer in the same pass. The
// host sees only what it asks for: the norm (one float) and, for read-back, the master; the new
// values go to the parameter shards from device memory (ParamCoordinator::
// write_shard_from_device).
//
// Parameter groups: the ranges given at create() (partition offsets, as optimizer_step()'s
// OptimizerRange) step with their group's hyper-parameters: each group's piece of each dtype
// group is one adam_step launch with that group's per-step scalars. Pieces start at parameter or
// slice boundaries (multiples of 16 elements), so every launch keeps the vectorised path.
//
// Frozen runs: create() may mark ranges as frozen, their elements those of frozen parameters
// (ParameterSpec::trainable false) and padding, stepped with learning rate 0 and weight decay 0
// on a gradient that is always zero (param_groups.hpp): Adam leaves their moments at zero and
// their master as it is, so while their moments are zero a step is the identity there. Their
// moments then take no device memory: exp_avg and exp_avg_sq hold the other runs' only, packed
// (each run's at its own moment offset, kept congruent to its partition offset modulo 16
// elements so that every launch keeps the vectorised path), and step() launches neither scale
// nor adam_step over them. Their bf16/f16 copy (what values() returns) is what the step would
// write for every finite master element, the master rounded: DeviceOps::narrow, which rounds as
// adam_step rounds its output, writes it at create() and after each write_state() of the master
// (for a run that keeps its master; a half-only run's, below, is narrowed on the host).
// read_state() gives their moments as zeros and write_state() accepts all-zero ones and stores
// nothing; non-zero moments written there (a checkpoint saved with the parameter trainable) are
// kept: the moments are then allocated for the whole partition ("unpacked", for the rest of the
// optimizer's life) and every run is stepped as any other. The results are the same bits as
// stepping every run, for every finite master element: a step would turn a NaN into the kernel's
// canonical NaN on CUDA where narrow keeps its payload, and, under plain Adam, an infinity into a
// NaN (0 * inf in the zero weight decay's term), where a frozen run keeps both.
//
// A frozen run's master kept as its half copy alone: a frozen run of a bf16/f16 group whose every
// master element the half dtype holds exactly (widen(narrow(x)) is x, bit for bit: a LoRA base
// weight loaded from bf16) keeps no fp32 master on the device ("half-only"): master_ holds the
// other runs' only, packed as the moments are (each run's at its own master offset, congruent to
// its partition offset modulo 16 elements; runs one after another in the partition stay one after
// another, so an f32 group's master, which values() hands out, stays contiguous), and the half
// copy, the bits narrow would round from that master, holds it. Every read of the master widens
// the half copy (read_state(0) and read_master() copy its half bytes to the host and widen them
// there, exactly: no device scratch); a write of the master keeps such a run half-only while the
// half dtype holds the new values exactly (they are narrowed on the host, in chunks of at most
// kHalfChunkElements, and uploaded into the half copy); the first value one does not hold gives
// the half-only runs of the span the caller writes their master back (the master reallocated
// once in the new layout, each such run's widened from its half copy on the device:
// DeviceOps::widen): a checkpoint load, every half-only run (writing in chunks, it then needs the
// old packed master and the whole new one at its peak, never more), a write of some parameters
// only the runs of their span, the others staying half-only. Non-zero moments written into a
// frozen run give every half-only run its master (unpack(): every run is stepped from then on). No
// step reads a half-only run: it is frozen and, while packed, not stepped. create() finds them with
// one pass over the frozen runs' host master.
//
// The gradient accumulator keeps the whole partition (group g's slice at its partition offset),
// or, asked to pack the gradients at create(), only the dtype groups that hold a run that is not
// frozen: a group of frozen runs only (a frozen partitioner group, its padding included:
// param_groups.hpp) is never written by the reducer (a frozen group takes no gradients) and its
// gradients are zero, so it gets no room (grad_offsets(): kNoGrad), and the others lie one after
// another, each congruent to its partition offset modulo 16 elements. The norm is then summed over
// the packed array: the same sum up to the order in which CUDA's fp32 block sums add up (the
// HostDevice's reference sums in fp64, in order: the same bits). Once unpacked, a frozen run
// without room steps on a zero buffer in chunks of at most kZeroChunkElements; the buffer,
// allocated with the moments, is the largest such run's size or a chunk's, whichever is smaller.
//
// Adam and AdamW only (the kernels/adam step; the CPU optimizer's Adagrad and Lion have no GPU
// kernel). The kernel rounds every operation (no FMA contraction) where the CPU optimizer fuses
// multiply-adds, so results agree with a CPU run to within float rounding, not to the bit.
//
// Thread-safety: one thread (the engine's).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "device/device_ops.hpp"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"
#include "zinf/optim.hpp"
#include "zinf/status.hpp"

namespace zinf {

class DeviceOptimizer {
 public:
  struct Group {
    std::size_t offset = 0;       // first element in the partition
    std::size_t count = 0;        // elements (the rank's shard of the group)
    std::size_t byte_offset = 0;  // first byte of its values in the device dtype, packed
    DType dtype = DType::kF32;    // the group's device dtype
  };

  // kUnsupported naming optimizer.type for an optimizer the device cannot step.
  static Status check(const OptimizerParams& params, const Device& device);
  // Allocates the state for `partition_elements` elements and uploads `master` (host memory,
  // partition_elements floats); the moments start at zero. `frozen`, empty or one flag per range:
  // the ranges whose elements never take a gradient and step with learning rate 0 and weight
  // decay 0 (above). `pack_grads`: the gradient accumulator leaves out the groups of frozen runs
  // only (above). REQUIRES: the groups lie one after another from element 0 to
  // partition_elements.
  static Result<std::unique_ptr<DeviceOptimizer>> create(Device& device, std::vector<Group> groups,
                                                         std::size_t partition_elements,
                                                         const float* master,
                                                         std::chrono::milliseconds timeout,
                                                         std::vector<OptimizerRange> ranges = {},
                                                         std::vector<bool> frozen = {},
                                                         bool pack_grads = false);
  ~DeviceOptimizer();

  // The fp32 gradient accumulator (device memory): group g's gradients, its count elements, at
  // grads() + grad_offsets()[g], kNoGrad for a group that has none (packed, above); without
  // packing grad_offsets()[g] is the group's partition offset.
  static constexpr std::size_t kNoGrad = SIZE_MAX;
  // A frozen run without gradients, stepped after unpack(), steps on a buffer of zeros in chunks
  // of at most this many elements (Adam is element-wise: the same bits as one launch over the
  // run), so that buffer takes 4 MiB however large the frozen runs are.
  static constexpr std::size_t kZeroChunkElements = std::size_t{1} << 20;
  float* grads() const { return grads_.as<float>(); }
  const std::vector<std::size_t>& grad_offsets() const { return grad_offsets_; }
  // The accumulator's elements (its groups' and the gaps that align them).
  std::size_t grad_elements() const { return grad_elements_; }
  // The sum of squares of the accumulator (inf or NaN when an element is).
  Result<double> sum_of_squares();
  // One optimizer step at step number `step` (from 1): grads *= grad_scale, then Adam/AdamW,
  // each range of the partition with groups[its group] (one group, `params`, in the first form).
  // REQUIRES: every group create()'s ranges name is in `groups`; at most kMaxOptimizerGroups;
  // the frozen ranges' group has learning rate 0 and weight decay 0.
  Status step(std::int64_t step, float grad_scale, const OptimizerParams& params);
  Status step(std::int64_t step, float grad_scale, std::span<const OptimizerParams> groups);
  // Group g's new values in its dtype (device memory): the master for f32 groups, else the half
  // copy the step wrote. Valid after step() until the next one.
  const void* values(std::uint32_t g) const;
  // out[0, count) <- master elements [first, first + count).
  Status read_master(std::size_t first, std::size_t count, float* out);
  // Checkpoints: elements [first, first + count) of the master (which 0), exp_avg (1) or
  // exp_avg_sq (2), read into or written from host memory; both return when the copy is done.
  // Frozen runs' moments read as zeros; a write of non-zero moments into one allocates the
  // moments of the whole partition first (kResourceExhausted, nothing written, when the device
  // has no room for them). A master write that a half-only run's dtype does not hold exactly gives
  // the half-only runs that meet partition elements [restore_begin, restore_end) their master
  // first (kResourceExhausted naming the element, nothing written, when the device has no room):
  // a checkpoint load, which writes the whole partition in chunks, leaves the whole partition
  // (one reallocation); a write of some parameters passes the span it writes, so that the other
  // half-only runs keep no master. REQUIRES: [first, first + count) inside that span.
  Status read_state(int which, std::size_t first, std::size_t count, float* out);
  Status write_state(int which, std::size_t first, std::size_t count, const float* in,
                     std::size_t restore_begin = 0, std::size_t restore_end = SIZE_MAX);
  // The device memory the optimizer holds: master (of the runs that keep one), moments,
  // gradients, half copy (and, once unpacked, the zero gradients of the frozen runs without
  // room).
  std::uint64_t device_bytes() const;
  // Whether the frozen runs' moments take no memory (there are frozen runs, and no non-zero
  // moment was written into one).
  bool packed() const { return packed_; }
  // The partition elements whose master the half copy alone holds (half-only runs, above).
  std::size_t half_only_elements() const;
  // A half-only run's master is written through a host block of at most this many halves.
  static constexpr std::size_t kHalfChunkElements = std::size_t{1} << 20;

 private:
  DeviceOptimizer(Device& device, std::chrono::milliseconds timeout)
      : device_(device), timeout_(timeout) {}
  // The buffer read_state() and write_state() mean by `which`, once [first, first + count) is
  // checked to lie inside the partition.
  DeviceBuffer& state(int which, std::size_t first, std::size_t count);
  // Calls fn(run, lo, hi) for each run that elements [first, first + count) meet, with the
  // elements [lo, hi) of it they hold, in order.
  template <typename Fn>
  Status for_each_run(std::size_t first, std::size_t count, Fn fn);
  // The bf16/f16 copy of the frozen runs' elements in [first, first + count) rounded from the
  // master, as a step writes it (while packed).
  Status round_frozen(std::size_t first, std::size_t count);
  // Moments for the whole partition: the packed ones moved to their partition offsets, the
  // frozen runs' zero; from now on every run is stepped. Every half-only run gets its master once
  // the moments and zeros are allocated (kResourceExhausted, nothing changed, when the device has
  // no room for them or for the masters; the error names `why`, the write that called for it).
  // "Nothing changed" has a cost: while the masters are given back, the old packed master and
  // packed moments, the new master and the whole partition's moments are held at once, a peak
  // higher by the smaller of the old packed master and the whole moments than giving the masters
  // back first and freeing the old master before allocating the moments would need.
  Status unpack(std::string_view why);
  struct Run;
  // Sets each run's master offset (Run::master) for the runs that have one (master not
  // kNoMaster): one after another in partition order, a run after a half-only one (or the first)
  // at the next multiple of 16 elements plus its partition offset modulo 16 (so congruent to it,
  // at most 30 elements past the run before). Returns the elements the master buffer needs (the
  // partition, when every run has a master).
  static std::size_t layout_masters(std::vector<Run>& runs);
  // Gives every half-only run that meets partition elements [begin, end) its master: a new
  // master buffer in the new layout (one reallocation: the old buffer and the new one at the
  // peak), the kept runs' masters moved into it, those runs' widened from their half copies
  // (kResourceExhausted naming `why`, nothing changed, when the device has no room). The half-only
  // runs outside [begin, end) stay so.
  Status restore_masters(std::string_view why, std::size_t begin, std::size_t end);
  // The first of values[0, count) that `dtype` does not hold exactly (whose widen(narrow(x)) is
  // not x, bit for bit), or count when it holds them all: narrow_checked(), a block at a time.
  static std::size_t first_inexact(DType dtype, const float* values, std::size_t count);
  // Narrows `in` (count elements, exact in the run's dtype) on the host and uploads them into the
  // half copy of half-only run `r` from partition element `first` on; returns when copied.
  Status upload_half(const Run& r, std::size_t first, std::size_t count, const float* in);
  // The end of a path that queued work into `buffers` (device buffers of its own, not yet in use)
  // and whose queueing returned `queued`: waits for the stream, once. Both succeeded: returns ok,
  // the buffers filled and left to the caller. Otherwise returns the first failure (the queueing
  // or the wait), and frees the buffers when the wait succeeded (the work can no longer write
  // into them); where it failed (the work may still run on the stream) they are kept in kept_,
  // freed by the destructor after its own wait.
  Status drain_then(Status queued, std::span<DeviceBuffer> buffers);
  // Where partition element `first` of run `r` (which has a master) has its master.
  float* master_at(const Run& r, std::size_t first) const;

  Device& device_;
  std::chrono::milliseconds timeout_;
  // Buffers a failed restore_masters() or unpack() queued work into that may still run
  // (drain_then()); declared before stream_, so that they go after it.
  std::vector<DeviceBuffer> kept_;
  // One adam_step launch: a parameter group's run inside dtype group `group`.
  struct Run {
    std::uint32_t group = 0;        // the dtype group (groups_)
    std::uint32_t param_group = 0;  // the parameter group whose hyper-parameters apply
    std::size_t offset = 0;         // first element in the partition
    std::size_t count = 0;
    bool frozen = false;     // create()'s frozen ranges
    std::size_t moment = 0;  // first element of its moments (kNoMoment: none, packed)
    std::size_t grad = 0;    // first element of its gradients in grads_ (kNoGrad: none)
    std::size_t master = 0;  // first element of its master in master_ (kNoMaster: half-only)
  };
  static constexpr std::size_t kNoMoment = SIZE_MAX;
  static constexpr std::size_t kNoMaster = SIZE_MAX;
  std::vector<Group> groups_;
  std::vector<Run> runs_;  // in partition order
  // The gradient elements step() scales (offset in grads_, count).
  struct Span {
    std::size_t offset = 0;
    std::size_t count = 0;
  };
  std::vector<Span> scale_spans_;
  std::size_t partition_elements_ = 0;
  std::vector<std::size_t> grad_offsets_;  // per dtype group (grad_offsets())
  std::size_t grad_elements_ = 0;
  std::size_t zero_elements_ = 0;  // the zeros' elements: largest such run, or a chunk
  std::unique_ptr<DeviceOps> ops_;
  std::unique_ptr<Stream> stream_;
  DeviceBuffer master_, exp_avg_, exp_avg_sq_, grads_;
  DeviceBuffer half_;     // the half groups' new values, packed as the engine packs them
  DeviceBuffer scratch_;  // sum-of-squares partials, its result, the scale's inf flag
  DeviceBuffer zeros_;    // unpacked: zero gradients for the frozen runs without room
  bool packed_ = false;
  RegisteredBuffer result_;
  std::vector<std::uint16_t> half_chunk_;  // upload_half()'s host block (half-only runs only)
};

}  // namespace zinf
