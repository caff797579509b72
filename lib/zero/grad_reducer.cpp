#include "zero/grad_reducer.hpp"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>

#include "base/assert.hpp"

namespace zinf {
namespace {

// reduce_in_place()'s blocks, elements: large enough that a block's work outweighs handing it to
// a thread, small enough that a module of a few million elements still spreads over the cores.
constexpr std::size_t kInPlaceBlock = std::size_t{256} << 10;

// dst[i] = float(src[offset + i]) for `count` elements of `dtype`.
void widen(const void* src, DType dtype, std::size_t offset, std::size_t count, float* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, static_cast<const float*>(src) + offset, count * sizeof(float));
      break;
    case DType::kBF16:
      convert_bf16_to_f32(static_cast<const std::uint16_t*>(src) + offset, dst, count);
      break;
    case DType::kF16:
      convert_f16_to_f32(static_cast<const std::uint16_t*>(src) + offset, dst, count);
      break;
  }
}

// dst[i] += float(src[i]).
void widen_add(const void* src, DType dtype, std::size_t count, float* dst) {
  switch (dtype) {
    case DType::kF32: {
      const float* s = static_cast<const float*>(src);
      for (std::size_t i = 0; i < count; ++i) dst[i] += s[i];
      break;
    }
    case DType::kBF16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
      for (std::size_t i = 0; i < count; ++i) dst[i] += bf16_to_f32(s[i]);
      break;
    }
    case DType::kF16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
      for (std::size_t i = 0; i < count; ++i) dst[i] += f16_to_f32(s[i]);
      break;
    }
  }
}

// Walks elements [begin, end) of group `info` in increasing offsets (parameters lie in a group
// in increasing offsets): gap(lo, hi) for each run no parameter covers (padding), and
// piece(id, skip, lo, hi) for each parameter's overlap [lo, hi) with the range, `skip` elements
// into the parameter. Stops at the first error.
template <typename Gap, typename Piece>
Status walk_range(const Partitioner& partitioner, const GroupInfo& info, std::size_t begin,
                  std::size_t end, Gap gap, Piece piece) {
  std::size_t cursor = begin;
  for (ParamId id = info.first_param; id < info.first_param + info.param_count; ++id) {
    const ParamLocation& loc = partitioner.location(id);
    const std::size_t lo = std::max(begin, loc.group_offset);
    const std::size_t hi = std::min(end, loc.group_offset + loc.element_count);
    if (lo >= hi) continue;
    ZINF_ASSERT(lo >= cursor);
    if (lo > cursor) ZINF_RETURN_IF_ERROR(gap(cursor, lo));
    ZINF_RETURN_IF_ERROR(piece(id, lo - loc.group_offset, lo, hi));
    cursor = hi;
  }
  return cursor < end ? gap(cursor, end) : Status::ok();
}

// Elements [begin, end) of group `info` into dst[0, end - begin): the gradients in `sources`
// widened, with zeros between them (padding), or with `add` added to what dst holds (padding left
// as it is).
void widen_range(const Partitioner& partitioner, const GroupInfo& info,
                 std::span<const GradSource> sources, std::size_t begin, std::size_t end,
                 float* dst, bool add) {
  (void)walk_range(
      partitioner, info, begin, end,
      [&](std::size_t lo, std::size_t hi) {
        if (!add) std::memset(dst + (lo - begin), 0, (hi - lo) * sizeof(float));
        return Status::ok();
      },
      [&](ParamId id, std::size_t skip, std::size_t lo, std::size_t hi) {
        const GradSource& src = sources[id];
        ZINF_ASSERT(src.data != nullptr);
        if (add) {
          widen_add(static_cast<const std::byte*>(src.data) + skip * dtype_bytes(src.dtype),
                    src.dtype, hi - lo, dst + (lo - begin));
        } else {
          widen(src.data, src.dtype, skip, hi - lo, dst + (lo - begin));
        }
        return Status::ok();
      });
}

}  // namespace

std::size_t GradReducer::partition_element_count(const Partitioner& partitioner) {
  std::size_t total = 0;
  for (std::uint32_t g = 0; g < partitioner.group_count(); ++g) {
    total += partitioner.group(g).shard_element_count;
  }
  return total;
}

GradReducer::GradReducer(const Partitioner& partitioner, int rank, Device& device,
                         Communicator& comm, float* accumulator, const GradReducerOptions& options,
                         ZeroCounters* counters)
    : partitioner_(partitioner),
      rank_(rank),
      world_(partitioner.world_size()),
      device_(device),
      comm_(comm),
      accumulator_(options.accumulator),
      options_(options),
      counters_(counters) {
  if (options.accumulator_on_device) {
    // Device memory host code may not touch: accumulate() adds into it on the device.
    device_accumulator_ = accumulator;
  } else if (accumulator_ == nullptr) {
    memory_accumulator_ =
        std::make_unique<MemoryAccumulator>(accumulator, partition_element_count(partitioner));
    accumulator_ = memory_accumulator_.get();
  }
}

GradReducer::~GradReducer() {
  if (fill_stream_ != nullptr) (void)device_.synchronize(*fill_stream_, options_.timeout);
  if (stream_ != nullptr) (void)device_.synchronize(*stream_, options_.timeout);
}

Result<std::unique_ptr<GradReducer>> GradReducer::create(const Partitioner& partitioner, int rank,
                                                         Device& device, Communicator& comm,
                                                         float* accumulator,
                                                         const GradReducerOptions& options,
                                                         ZeroCounters* counters) {
  ZINF_ASSERT(partitioner.finalized());
  std::unique_ptr<GradReducer> r(
      new GradReducer(partitioner, rank, device, comm, accumulator, options, counters));
  std::size_t offset = 0;
  std::size_t largest_shard = 1;
  for (std::uint32_t g = 0; g < partitioner.group_count(); ++g) {
    r->offsets_.push_back(offset);
    offset += partitioner.group(g).shard_element_count;
    largest_shard = std::max(largest_shard, partitioner.group(g).shard_element_count);
  }
  r->partition_elements_ = offset;
  if (!options.group_offsets.empty()) {
    ZINF_ASSERT(options.accumulator_on_device);
    ZINF_ASSERT(options.group_offsets.size() == partitioner.group_count());
    r->offsets_ = options.group_offsets;
  }
  // A chunk larger than the largest shard would only waste bucket memory.
  r->chunk_elements_ = std::clamp<std::size_t>(
      options.bucket_elements / static_cast<std::size_t>(r->world_), 1, largest_shard);
  r->counts_.assign(partitioner.param_count(), 0);
  for (std::uint32_t g = 0; g < partitioner.group_count(); ++g) {
    r->group_names_.push_back(group_label(partitioner, g, "grads"));
  }
  ZINF_ASSERT(options.frozen.empty() || options.frozen.size() == partitioner.param_count());
  // A custom accumulator (the NVMe spill) counts a sub-group done once every element of it was
  // added, and no chunk is ever added for a frozen parameter.
  ZINF_ASSERT_MSG(
      options.accumulator == nullptr ||
          std::find(options.frozen.begin(), options.frozen.end(), true) == options.frozen.end(),
      "frozen parameters with a custom gradient accumulator");
  r->frozen_groups_.assign(partitioner.group_count(), false);
  for (std::uint32_t g = 0; g < partitioner.group_count(); ++g) {
    const GroupInfo& info = partitioner.group(g);
    bool frozen = !options.frozen.empty() && info.param_count > 0;
    for (ParamId id = info.first_param; frozen && id < info.first_param + info.param_count; ++id) {
      frozen = options.frozen[id];
    }
    r->frozen_groups_[g] = frozen;
    // A group without room in the accumulator is never written: it takes no gradients.
    ZINF_ASSERT(r->offsets_[g] != GradReducerOptions::kNoRoom || frozen);
  }
  ZINF_ASSIGN_OR_RETURN(r->stream_, device.create_stream("grad_reduce"));
  ZINF_ASSIGN_OR_RETURN(r->done_, device.create_event());
  const std::size_t bucket_bytes =
      r->chunk_elements_ * static_cast<std::size_t>(r->world_) * sizeof(float);
  // One rank with its accumulator in host memory reduces in place at stages 2-3: no buckets.
  r->in_place_ = r->world_ == 1 && r->memory_accumulator_ != nullptr && device.host_accessible() &&
                 partitioner.partitions(StateKind::kGradients);
  for (int k = 0; k < 2; ++k) {
    if (!r->in_place_) {
      ZINF_ASSIGN_OR_RETURN(r->buckets_[k], DeviceBuffer::allocate(device, bucket_bytes));
    }
    // One rank reduces its bucket in place (the result is the bucket itself): no receive buffer.
    if (r->world_ > 1) {
      ZINF_ASSIGN_OR_RETURN(r->recv_[k],
                            DeviceBuffer::allocate(device, r->chunk_elements_ * sizeof(float)));
    }
    ZINF_ASSIGN_OR_RETURN(r->bucket_free_[k], device.create_event());
  }
  if (!partitioner.partitions(StateKind::kGradients)) {
    // A frozen group takes no gradients: no full copy (an empty buffer), and it is never
    // reduce-scattered (its slice of the accumulator is zeroed once: zero_frozen_groups()).
    for (std::uint32_t g = 0; g < partitioner.group_count(); ++g) {
      DeviceBuffer full;
      if (!r->frozen_groups_[g]) {
        ZINF_ASSIGN_OR_RETURN(
            full, DeviceBuffer::allocate(device, partitioner.group(g).padded_element_count * 4));
      }
      r->full_.push_back(std::move(full));
    }
  }
  ZINF_ASSERT(!options.accumulator_on_device || !device.host_accessible());
  r->group_reduced_.assign(partitioner.group_count(), false);
  if (!device.host_accessible()) ZINF_RETURN_IF_ERROR(r->create_device_side());
  if (options.accumulator_zeroed) {
    // The same as zero() without touching the accumulator's pages.
    if (r->ops_ == nullptr) r->clear_full();
    std::fill(r->counts_.begin(), r->counts_.end(), 0u);
  } else {
    r->zero();
  }
  ZINF_RETURN_IF_ERROR(r->zero_frozen_groups());
  return r;
}

Status GradReducer::zero_frozen_groups() {
  if (options_.frozen.empty()) return Status::ok();
  const bool stage1 = !partitioner_.partitions(StateKind::kGradients);
  for (std::uint32_t g = 0; g < partitioner_.group_count(); ++g) {
    const GroupInfo& info = partitioner_.group(g);
    if (!stage1 && info.param_count > 0 && options_.frozen[info.first_param]) {
      // Stages 2-3 reduce a group's shard whole, each parameter's gradient read into it.
      ZINF_ASSERT_MSG(frozen_groups_[g], "a gradient group mixes frozen and trainable params");
    }
    // Stage 1 reduces a group that mixes them as a trainable one: its full copy keeps zeros in
    // the frozen parameters' ranges.
    if (!frozen_groups_[g] || offsets_[g] == GradReducerOptions::kNoRoom) continue;
    const std::size_t count = info.shard_element_count;
    if (options_.accumulator_on_device) {
      ZINF_RETURN_IF_ERROR(device_.memset_async(device_accumulator_ + offsets_[g], 0,
                                                count * sizeof(float), *stream_));
    } else if (!options_.accumulator_zeroed) {
      // Fresh zero pages (accumulator_zeroed) hold zeros already: writing them would make the
      // frozen share of the accumulator resident for nothing.
      std::memset(memory_accumulator_->data() + offsets_[g], 0, count * sizeof(float));
    }
  }
  return device_.synchronize(*stream_, options_.timeout);
}

void GradReducer::zero() {
  // Callers wait() first: a reduce-scatter still adding into the accumulator would race.
  if (overwrites_first()) {
    group_reduced_.assign(partitioner_.group_count(), false);  // see accumulate()
  } else {
    accumulator_->zero();
  }
  // On a device that is not host-accessible stage 1's full gradients are not cleared: the first
  // gradient of each parameter after this overwrites its range (reduce_on_device).
  if (ops_ == nullptr) clear_full();
  std::fill(counts_.begin(), counts_.end(), 0u);
}

std::size_t GradReducer::full_bytes() const {
  std::size_t bytes = 0;
  for (const DeviceBuffer& full : full_) bytes += full.bytes();
  return bytes;
}

void GradReducer::clear_full() {
  for (DeviceBuffer& full : full_) {
    if (full.bytes() > 0) std::memset(full.data(), 0, full.bytes());
  }
}

void GradReducer::zero_group(std::uint32_t g) {
  ZINF_ASSERT(zeroes_groups());
  group_reduced_[g] = false;  // its next reduction overwrites the slice
  if (ops_ == nullptr && !full_.empty() && full_[g].bytes() > 0) {
    std::memset(full_[g].data(), 0, full_[g].bytes());
  }
  forget_group(g);
}

void GradReducer::forget_group(std::uint32_t g) {
  ZINF_ASSERT(zeroes_groups());
  const GroupInfo& info = partitioner_.group(g);
  std::fill_n(counts_.begin() + info.first_param, info.param_count, 0u);
}

Result<int> GradReducer::micro_batches() const {
  if (counts_.empty()) return 0;
  // The trainable parameters with the fewest and the most reductions: the one short of its
  // gradients is the one to name. Frozen ones are never reduced.
  auto low = counts_.end(), high = counts_.end();
  for (auto it = counts_.begin(); it != counts_.end(); ++it) {
    if (!options_.frozen.empty() && options_.frozen[it - counts_.begin()]) continue;
    if (low == counts_.end() || *it < *low) low = it;
    if (high == counts_.end() || *it > *high) high = it;
  }
  if (low == counts_.end()) {
    return Status::failed_precondition(
        "step: every parameter is frozen (ParameterSpec::trainable false): nothing to step");
  }
  if (*high == 0) {
    return Status::failed_precondition(fmt::format(
        "step: no gradients were reduced since the last step (parameter '{}' had 0, as did every "
        "other): reduce every module's gradients after its backward (reduce_gradients(); "
        "engine.backward(loss) in zinf.torch), then call step()",
        partitioner_.spec(static_cast<ParamId>(low - counts_.begin())).name));
  }
  if (*low != *high) {
    return Status::failed_precondition(fmt::format(
        "step: parameter '{}' had {} gradient(s) reduced since the last step, '{}' had {}; "
        "every parameter needs the same number (>= 1)",
        partitioner_.spec(static_cast<ParamId>(low - counts_.begin())).name, *low,
        partitioner_.spec(static_cast<ParamId>(high - counts_.begin())).name, *high));
  }
  return static_cast<int>(*high);
}

// The one bucket schedule, for every kind of device. For each chunk of group g's shard: wait on
// the host until the bucket's previous reduce-scatter and accumulation have run, so that the
// bucket, its staging buffer and its AddChunk record may be reused; fill the bucket (host code on
// a host_accessible() device; otherwise DeviceOps work on fill_stream_, which stream_ then waits
// for, so the host never touches the data); reduce-scatter it on stream_; add the rank's reduced
// chunk into the accumulator (accumulate()); record that the bucket is free. Two buckets
// alternate, so bucket k+1 fills while k reduces.
template <typename Fill>
Status GradReducer::reduce_group(std::uint32_t g, Fill fill) {
  const GroupInfo& info = partitioner_.group(g);
  const std::size_t shard = info.shard_element_count;
  const std::string& name = group_names_[g];
  ZINF_ASSERT_MSG(offsets_[g] != GradReducerOptions::kNoRoom, "a frozen group takes no gradients");
  for (std::size_t c0 = 0; c0 < shard; c0 += chunk_elements_) {
    const std::size_t count = std::min(chunk_elements_, shard - c0);
    const int k = next_bucket_;
    next_bucket_ ^= 1;
    // Through the communicator: the bucket is free once its reduce-scatter has run, and when a
    // peer is gone that collective's own deadline names it (a bare event wait would run out at
    // about the same moment naming nothing but the event).
    ZINF_RETURN_IF_ERROR(comm_.wait(*bucket_free_[k], options_.timeout));
    float* bucket = buckets_[k].as<float>();
    for (int q = 0; q < world_; ++q) {
      ZINF_RETURN_IF_ERROR(fill(bucket + static_cast<std::size_t>(q) * count,
                                partitioner_.shard_offset(g, q) + c0, count));
    }
    if (ops_ != nullptr) {
      ZINF_RETURN_IF_ERROR(device_.record(*filled_[k], *fill_stream_));
      ZINF_RETURN_IF_ERROR(device_.wait(*stream_, *filled_[k]));
    }
    float* recv = world_ > 1 ? recv_[k].as<float>() : bucket;
    ZINF_RETURN_IF_ERROR(
        comm_.reduce_scatter(bucket, recv, count, DType::kF32, ReduceOp::kAverage, *stream_, name));
    ZINF_RETURN_IF_ERROR(accumulate(g, k, recv, offsets_[g] + c0, count));
    ZINF_RETURN_IF_ERROR(device_.record(*bucket_free_[k], *stream_));
    if (counters_ != nullptr) {
      ++counters_->buckets_reduced;
      counters_->reduce_scatter_bytes += count * static_cast<std::size_t>(world_) * 4;
    }
  }
  group_reduced_[g] = true;
  return Status::ok();
}

Status GradReducer::accumulate(std::uint32_t g, int k, const float* recv, std::size_t first,
                               std::size_t count) {
  // The group's first reduction since zero() overwrites its slice of an accumulator in memory,
  // so nothing has to clear it between steps.
  if (options_.accumulator_on_device) {
    return ops_->widen(recv, DType::kF32, device_accumulator_ + first, count,
                       /*accumulate=*/group_reduced_[g], *stream_);
  }
  const float* values = recv;
  if (ops_ != nullptr) {
    // Host code may not read this device's memory: the chunk comes down into pinned staging.
    float* staged = recv_host_[k].as<float>();
    ZINF_RETURN_IF_ERROR(device_.copy_d2h(staged, recv, count * sizeof(float), *stream_));
    values = staged;
  }
  // The bucket's previous add has run (reduce_group waited for bucket_free_[k]).
  MemoryAccumulator* assign = group_reduced_[g] ? nullptr : memory_accumulator_.get();
  add_chunks_[k] = {accumulator_, assign, first, values, count};
  return device_.launch_host_func(*stream_, &GradReducer::add_chunk, &add_chunks_[k]);
}

Status GradReducer::add_chunk(void* chunk, const Status& upstream) {
  // After a failure upstream the chunk holds nothing worth adding.
  if (!upstream.is_ok()) return upstream;
  const auto* c = static_cast<const AddChunk*>(chunk);
  if (c->assign != nullptr) {
    c->assign->assign(c->first, c->count, c->values);
    return Status::ok();
  }
  return c->accumulator->add(c->first, c->count, c->values);
}

Status GradReducer::wait() {
  ZINF_RETURN_IF_ERROR(device_.record(*done_, *stream_));
  ZINF_RETURN_IF_ERROR(comm_.wait(*done_, options_.timeout));
  return accumulator_ != nullptr ? accumulator_->flush() : Status::ok();
}

Status GradReducer::reduce(std::span<const std::uint32_t> groups,
                           std::span<const GradSource> sources) {
  ZINF_ASSERT(sources.size() == partitioner_.param_count());
  if (ops_ != nullptr) return reduce_on_device(groups, sources);
  // Host code reads the gradients: the caller's work that writes them must have run.
  if (caller_ != nullptr) ZINF_RETURN_IF_ERROR(caller_->host_wait(options_.timeout));
  if (!partitioner_.partitions(StateKind::kGradients)) {
    // Stage 1: accumulate locally; the reduce-scatter waits for the step.
    for (std::uint32_t g : groups) {
      const GroupInfo& info = partitioner_.group(g);
      ZINF_ASSERT_MSG(!frozen_groups_[g], "a frozen group takes no gradients");
      float* full = full_[g].as<float>();
      for (ParamId id = info.first_param; id < info.first_param + info.param_count; ++id) {
        const ParamLocation& loc = partitioner_.location(id);
        ZINF_ASSERT(sources[id].data != nullptr);
        widen_add(sources[id].data, sources[id].dtype, loc.element_count, full + loc.group_offset);
        ++counts_[id];
      }
    }
    return Status::ok();
  }
  if (in_place_) return reduce_in_place(groups, sources);
  for (std::uint32_t g : groups) {
    const GroupInfo& info = partitioner_.group(g);
    Status st = reduce_group(g, [&](float* dst, std::size_t begin, std::size_t count) {
      widen_range(partitioner_, info, sources, begin, begin + count, dst, /*add=*/false);
      return Status::ok();
    });
    ZINF_RETURN_IF_ERROR(st);
    count_group(info);
  }
  return Status::ok();
}

// One rank's reduce-scatter (kAverage) hands back its own values, so with the accumulator in
// host memory there is nothing to bucket: each gradient is widened straight into the group's
// slice on its first reduction since zero() (zeros between, for the padding) and added to it on
// later ones: the bits of the bucket schedule, which also stores a group's first chunk (so a
// -0.0 gradient stays -0.0, where adding it into a cleared accumulator gave +0.0), with about a
// fifth of the memory traffic that schedule had at bf16 when it cleared the accumulator (no
// bucket to clear, fill and read back; no slice to clear and read).
Status GradReducer::reduce_in_place(std::span<const std::uint32_t> groups,
                                    std::span<const GradSource> sources) {
  for (std::uint32_t g : groups) {
    const GroupInfo& info = partitioner_.group(g);
    float* slice = memory_accumulator_->data() + offsets_[g];
    const bool add = group_reduced_[g];
    // Element-wise, so the same bits however the blocks are spread over threads.
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, info.shard_element_count, kInPlaceBlock),
                      [&](const tbb::blocked_range<std::size_t>& r) {
                        widen_range(partitioner_, info, sources, r.begin(), r.end(),
                                    slice + r.begin(), add);
                      });
    count_group(info);
    group_reduced_[g] = true;
  }
  return Status::ok();
}

void GradReducer::count_group(const GroupInfo& info) {
  const auto first = counts_.begin() + info.first_param;
  std::for_each(first, first + info.param_count, [](std::uint32_t& n) { ++n; });
}

Status GradReducer::reduce_accumulated() {
  if (partitioner_.partitions(StateKind::kGradients)) return Status::ok();
  // A frozen group has no full copy and is not reduced: its slice of the accumulator holds the
  // zeros zero_frozen_groups() wrote, which is what reducing its zero gradients gave.
  if (ops_ != nullptr) {
    for (std::uint32_t g = 0; g < partitioner_.group_count(); ++g) {
      if (frozen_groups_[g]) continue;
      float* full = full_[g].as<float>();
      ZINF_RETURN_IF_ERROR(reduce_group(g, [&](float* dst, std::size_t begin, std::size_t count) {
        return device_.copy_d2d(dst, full + begin, count * sizeof(float), *fill_stream_);
      }));
    }
    // The full gradients stay as they are: see zero().
    return wait();
  }
  for (std::uint32_t g = 0; g < partitioner_.group_count(); ++g) {
    if (frozen_groups_[g]) continue;
    const float* full = full_[g].as<float>();
    ZINF_RETURN_IF_ERROR(reduce_group(g, [&](float* dst, std::size_t begin, std::size_t count) {
      std::memcpy(dst, full + begin, count * sizeof(float));
      return Status::ok();
    }));
  }
  ZINF_RETURN_IF_ERROR(wait());
  clear_full();
  return Status::ok();
}

// --- Devices that are not host-accessible ------------------------------------------------------

Status GradReducer::create_device_side() {
  ZINF_ASSIGN_OR_RETURN(ops_, make_device_ops(device_));
  ZINF_ASSIGN_OR_RETURN(fill_stream_, device_.create_stream("grad_fill"));
  for (int k = 0; k < 2; ++k) {
    ZINF_ASSIGN_OR_RETURN(filled_[k], device_.create_event());
    ZINF_ASSIGN_OR_RETURN(recv_host_[k],
                          RegisteredBuffer::allocate(device_, chunk_elements_ * sizeof(float)));
  }
  // Stage 1's padding is never written after this.
  for (DeviceBuffer& full : full_) {
    if (full.bytes() == 0) continue;  // a frozen group's
    ZINF_RETURN_IF_ERROR(device_.memset_async(full.data(), 0, full.bytes(), *fill_stream_));
  }
  return device_.synchronize(*fill_stream_, options_.timeout);
}

Status GradReducer::reduce_on_device(std::span<const std::uint32_t> groups,
                                     std::span<const GradSource> sources) {
  // The fill stream reads the gradients after the caller's work that writes them.
  if (caller_ != nullptr) {
    ZINF_RETURN_IF_ERROR(caller_->order_after_caller(*fill_stream_, /*before_read=*/true));
  }
  if (!partitioner_.partitions(StateKind::kGradients)) {
    // Stage 1: add into the full gradients on the device. A parameter's first gradient since
    // zero() overwrites its range, so nothing has to clear the full gradients between steps.
    for (std::uint32_t g : groups) {
      const GroupInfo& info = partitioner_.group(g);
      ZINF_ASSERT_MSG(!frozen_groups_[g], "a frozen group takes no gradients");
      float* full = full_[g].as<float>();
      for (ParamId id = info.first_param; id < info.first_param + info.param_count; ++id) {
        const ParamLocation& loc = partitioner_.location(id);
        ZINF_ASSERT(sources[id].data != nullptr);
        ZINF_RETURN_IF_ERROR(ops_->widen(sources[id].data, sources[id].dtype,
                                         full + loc.group_offset, loc.element_count,
                                         /*accumulate=*/counts_[id] > 0, *fill_stream_));
        ++counts_[id];
      }
    }
  } else {
    for (std::uint32_t g : groups) {
      const GroupInfo& info = partitioner_.group(g);
      // Each rank's slot of the bucket: the gradients that overlap it, widened, and zeros in
      // between (padding), all as work on the fill stream.
      Status st = reduce_group(g, [&](float* dst, std::size_t begin, std::size_t count) -> Status {
        return walk_range(
            partitioner_, info, begin, begin + count,
            [&](std::size_t lo, std::size_t hi) {
              return device_.memset_async(dst + (lo - begin), 0, (hi - lo) * sizeof(float),
                                          *fill_stream_);
            },
            [&](ParamId id, std::size_t skip, std::size_t lo, std::size_t hi) {
              const GradSource& src = sources[id];
              ZINF_ASSERT(src.data != nullptr);
              return ops_->widen(
                  static_cast<const std::byte*>(src.data) + skip * dtype_bytes(src.dtype),
                  src.dtype, dst + (lo - begin), hi - lo, /*accumulate=*/false, *fill_stream_);
            });
      });
      ZINF_RETURN_IF_ERROR(st);
      count_group(info);
    }
  }
  // The caller's later work waits for the read; without a caller's stream the call returns once
  // the gradients have been read, as on the host path.
  if (caller_ != nullptr) return caller_->order_caller_after(*fill_stream_);
  return device_.synchronize(*fill_stream_, options_.timeout);
}

}  // namespace zinf
