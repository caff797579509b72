// DeviceOptimizer (see device_optimizer.hpp).
#include "engine/device_optimizer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>

#include "base/assert.hpp"
#include "engine/narrow.hpp"
#include "kernels/sq_norm.h"
#include "tier/state_store.hpp"

namespace zinf {
namespace {

// The kernel's per-step scalars (kernels/adam.h: the hyper-parameters as floats, the bias
// corrections in double).
kernels::AdamStepArgs adam_args(const OptimizerParams& params, std::int64_t step) {
  kernels::AdamHyper hyper;
  hyper.lr = static_cast<float>(params.lr);
  hyper.beta1 = static_cast<float>(params.beta1);
  hyper.beta2 = static_cast<float>(params.beta2);
  hyper.eps = static_cast<float>(params.eps);
  hyper.weight_decay = static_cast<float>(params.weight_decay);
  hyper.adamw = params.kind == OptimizerKind::kAdamW;
  return kernels::adam_step_args(hyper, step);
}

constexpr std::size_t kScratchFloats = kernels::kSqNormPartials + 2;  // partials, sum, flag

}  // namespace

Status DeviceOptimizer::check(const OptimizerParams& params, const Device& device) {
  if (params.kind == OptimizerKind::kAdam || params.kind == OptimizerKind::kAdamW) {
    if (params.bias_correction) return Status::ok();
    return Status::unsupported(fmt::format(
        "optimizer.params.bias_correction: false with zero_optimization.offload_optimizer.device "
        "\"none\" on {} (not host-accessible): the device's Adam always corrects the bias",
        device.name()));
  }
  return Status::unsupported(fmt::format(
      "optimizer.type: {} with zero_optimization.offload_optimizer.device \"none\" on {} (not "
      "host-accessible): only Adam and AdamW run on the device; offload the optimizer to \"cpu\" "
      "or \"nvme\"",
      optimizer_name(params.kind), device.name()));
}

Result<std::unique_ptr<DeviceOptimizer>> DeviceOptimizer::create(
    Device& device, std::vector<Group> groups, std::size_t partition_elements, const float* master,
    std::chrono::milliseconds timeout, std::vector<OptimizerRange> ranges, std::vector<bool> frozen,
    bool pack_grads) {
  std::unique_ptr<DeviceOptimizer> o(new DeviceOptimizer(device, timeout));
  o->groups_ = std::move(groups);
  o->partition_elements_ = partition_elements;
  if (ranges.empty()) ranges.push_back(OptimizerRange{});
  ZINF_ASSERT(ranges[0].begin == 0);
  ZINF_ASSERT(frozen.empty() || frozen.size() == ranges.size());
  // Cut each dtype group at the range boundaries inside it.
  std::size_t tiled = 0;
  for (std::uint32_t g = 0; g < o->groups_.size(); ++g) {
    const Group& group = o->groups_[g];
    ZINF_ASSERT(group.offset == tiled);
    const std::size_t end = group.offset + group.count;
    tiled = end;
    auto r = std::upper_bound(ranges.begin(), ranges.end(), group.offset,
                              [](std::size_t e, const OptimizerRange& x) { return e < x.begin; }) -
             1;
    for (std::size_t b = group.offset; b < end; ++r) {
      const std::size_t stop = r + 1 != ranges.end() ? std::min(end, r[1].begin) : end;
      ZINF_ASSERT(r->group < kMaxOptimizerGroups);
      const bool run_frozen =
          !frozen.empty() && frozen[static_cast<std::size_t>(r - ranges.begin())];
      o->runs_.push_back(Run{g, r->group, b, stop - b, run_frozen, b, b, b});
      b = stop;
    }
  }
  ZINF_ASSERT(tiled == partition_elements);
  // The gradients: the whole partition, or (pack_grads) the dtype groups that hold a run that is
  // not frozen, each at the first offset past the one before that is congruent to its partition
  // offset modulo 16 elements (the kernels' vector path, as the moments). A group of frozen runs
  // only is never written (the reducer reduces no frozen group), so it needs no room.
  std::vector<bool> room(o->groups_.size(), !pack_grads);
  for (const Run& r : o->runs_) {
    if (!r.frozen) room[r.group] = true;
  }
  o->grad_offsets_.assign(o->groups_.size(), kNoGrad);
  std::size_t grad_next = 0;
  for (std::uint32_t g = 0; g < o->groups_.size(); ++g) {
    if (!room[g]) continue;
    const Group& group = o->groups_[g];
    o->grad_offsets_[g] = grad_next + (group.offset - grad_next) % 16;
    grad_next = o->grad_offsets_[g] + group.count;
  }
  o->grad_elements_ = grad_next;
  for (Run& r : o->runs_) {
    const std::size_t at = o->grad_offsets_[r.group];
    r.grad = at == kNoGrad ? kNoGrad : at + (r.offset - o->groups_[r.group].offset);
    if (r.grad == kNoGrad) {
      o->zero_elements_ = std::max(o->zero_elements_, std::min(r.count, kZeroChunkElements));
    }
  }
  // The gradients step() scales: each dtype group's stretches of runs that are not frozen (a
  // frozen run's gradients are zero, which the scale leaves zero).
  for (std::size_t k = 0; k < o->runs_.size();) {
    const Run& first = o->runs_[k];
    std::size_t e = k + 1;
    while (e < o->runs_.size() && o->runs_[e].group == first.group &&
           o->runs_[e].frozen == first.frozen) {
      ++e;
    }
    const Run& last = o->runs_[e - 1];
    if (!first.frozen) {
      o->scale_spans_.push_back({first.grad, last.offset + last.count - first.offset});
    }
    k = e;
  }
  // The frozen runs' moments are zero and stay so: only the other runs' are stored, packed.
  std::size_t moment_elements = partition_elements;
  o->packed_ = std::any_of(o->runs_.begin(), o->runs_.end(), [](const Run& r) { return r.frozen; });
  if (o->packed_) {
    std::size_t next = 0;
    for (Run& r : o->runs_) {
      if (r.frozen) {
        r.moment = kNoMoment;
        continue;
      }
      // Congruent to the run's offset modulo 16 elements: where the master and gradients of a
      // run are 16-byte aligned, so are its moments, and the kernel's vector path stays.
      r.moment = (next + 15) / 16 * 16 + r.offset % 16;
      next = r.moment + r.count;
    }
    moment_elements = next;
  }
  // Half-only runs: frozen runs (not stepped while packed) of a half group whose master the half
  // dtype holds exactly take no master; the others' masters are packed around them.
  std::size_t half_only = 0;
  for (Run& r : o->runs_) {
    const DType dtype = o->groups_[r.group].dtype;
    if (o->packed_ && r.frozen && dtype != DType::kF32 &&
        first_inexact(dtype, master + r.offset, r.count) == r.count) {
      r.master = kNoMaster;
      half_only = std::max(half_only, r.count);
    }
  }
  const std::size_t master_elements = layout_masters(o->runs_);
  if (half_only > 0) o->half_chunk_.resize(std::min(half_only, kHalfChunkElements));
  ZINF_ASSIGN_OR_RETURN(o->ops_, make_device_ops(device));
  ZINF_ASSIGN_OR_RETURN(o->stream_, device.create_stream("optimizer"));
  const std::size_t bytes = std::max<std::size_t>(master_elements, 1) * sizeof(float);
  const std::size_t moment_bytes = std::max<std::size_t>(moment_elements, 1) * sizeof(float);
  const std::size_t grad_bytes = std::max<std::size_t>(o->grad_elements_, 1) * sizeof(float);
  ZINF_ASSIGN_OR_RETURN(o->master_, DeviceBuffer::allocate(device, bytes));
  ZINF_ASSIGN_OR_RETURN(o->exp_avg_, DeviceBuffer::allocate(device, moment_bytes));
  ZINF_ASSIGN_OR_RETURN(o->exp_avg_sq_, DeviceBuffer::allocate(device, moment_bytes));
  ZINF_ASSIGN_OR_RETURN(o->grads_, DeviceBuffer::allocate(device, grad_bytes));
  std::size_t half_bytes = 0;
  for (const Group& g : o->groups_) {
    if (g.dtype != DType::kF32) half_bytes = std::max(half_bytes, g.byte_offset + g.count * 2);
  }
  if (half_bytes > 0) {
    ZINF_ASSIGN_OR_RETURN(o->half_, DeviceBuffer::allocate(device, half_bytes));
  }
  ZINF_ASSIGN_OR_RETURN(o->scratch_, DeviceBuffer::allocate(device, kScratchFloats * 4));
  ZINF_ASSIGN_OR_RETURN(o->result_, RegisteredBuffer::allocate(device, sizeof(float)));
  Stream& s = *o->stream_;
  // Each run's master, or a half-only run's half copy (round_frozen() below skips those).
  for (const Run& r : o->runs_) {
    ZINF_RETURN_IF_ERROR(
        r.master == kNoMaster
            ? o->upload_half(r, r.offset, r.count, master + r.offset)
            : device.copy_h2d(o->master_at(r, r.offset), master + r.offset, r.count * 4, s));
  }
  ZINF_RETURN_IF_ERROR(device.memset_async(o->exp_avg_.data(), 0, moment_bytes, s));
  ZINF_RETURN_IF_ERROR(device.memset_async(o->exp_avg_sq_.data(), 0, moment_bytes, s));
  ZINF_RETURN_IF_ERROR(device.memset_async(o->grads_.data(), 0, grad_bytes, s));
  ZINF_RETURN_IF_ERROR(o->round_frozen(0, partition_elements));
  ZINF_RETURN_IF_ERROR(device.synchronize(s, timeout));
  return o;
}

std::size_t DeviceOptimizer::layout_masters(std::vector<Run>& runs) {
  std::size_t next = 0;
  bool after_gap = true;
  for (Run& r : runs) {
    if (r.master == kNoMaster) {
      after_gap = true;
      continue;
    }
    // Right after the run before (its partition neighbour): congruent to the offset already.
    r.master = after_gap ? (next + 15) / 16 * 16 + r.offset % 16 : next;
    next = r.master + r.count;
    after_gap = false;
  }
  return next;
}

std::size_t DeviceOptimizer::first_inexact(DType dtype, const float* values, std::size_t count) {
  // A block at a time on the stack: a whole frozen base is checked at create().
  constexpr std::size_t kBlockElements = 4096;
  std::array<std::uint16_t, kBlockElements> half;
  std::array<float, kBlockElements> wide;
  for (std::size_t done = 0; done < count; done += kBlockElements) {
    const std::size_t block_elements = std::min(kBlockElements, count - done);
    const std::size_t at =
        narrow_checked(dtype, values + done, block_elements, half.data(), wide.data());
    if (at < block_elements) return done + at;
  }
  return count;
}

float* DeviceOptimizer::master_at(const Run& r, std::size_t first) const {
  ZINF_ASSERT(r.master != kNoMaster && first >= r.offset && first <= r.offset + r.count);
  return master_.as<float>() + r.master + (first - r.offset);
}

Status DeviceOptimizer::upload_half(const Run& r, std::size_t first, std::size_t count,
                                    const float* in) {
  const Group& g = groups_[r.group];
  ZINF_ASSERT(r.master == kNoMaster && !half_chunk_.empty());
  std::byte* half = half_.as<std::byte>() + g.byte_offset + (first - g.offset) * 2;
  for (std::size_t done = 0; done < count; done += half_chunk_.size()) {
    const std::size_t chunk_elements = std::min(half_chunk_.size(), count - done);
    narrow(in + done, chunk_elements, g.dtype, half_chunk_.data());
    ZINF_RETURN_IF_ERROR(
        device_.copy_h2d(half + done * 2, half_chunk_.data(), chunk_elements * 2, *stream_));
    // The block is reused by the next chunk.
    ZINF_RETURN_IF_ERROR(device_.synchronize(*stream_, timeout_));
  }
  return Status::ok();
}

Status DeviceOptimizer::restore_masters(std::string_view why, std::size_t begin, std::size_t end) {
  // Every half-only run that meets [begin, end) at once: one new buffer beside the old one (the
  // old packed master and the whole new one at the peak), however many of the caller's writes or
  // runs call for it. The others stay half-only.
  std::vector<Run> runs = runs_;
  std::size_t restored = 0;
  for (Run& r : runs) {
    if (r.master == kNoMaster && r.offset < end && begin < r.offset + r.count) {
      r.master = 0;
      restored += r.count;
    }
  }
  if (restored == 0) return Status::ok();
  const std::size_t elements = layout_masters(runs);
  Result<DeviceBuffer> r =
      DeviceBuffer::allocate(device_, std::max<std::size_t>(elements, 1) * sizeof(float));
  if (!r.is_ok()) {
    return r.status().with_context(fmt::format(
        "the frozen parameters whose master their half copy alone holds get their fp32 master back "
        "on the device ({} elements more) because {}",
        restored, why));
  }
  DeviceBuffer master = std::move(r).value();
  Status s = Status::ok();
  for (std::size_t k = 0; k < runs.size() && s.is_ok(); ++k) {
    const Run& was = runs_[k];
    const Run& now = runs[k];
    if (now.master == kNoMaster) continue;  // half-only still
    float* dst = master.as<float>() + now.master;
    if (was.master != kNoMaster) {
      s = device_.copy_d2d(dst, master_at(was, was.offset), was.count * 4, *stream_);
      continue;
    }
    // Widening is exact: the master the half copy held.
    const Group& g = groups_[was.group];
    s = ops_->widen(half_.as<std::byte>() + g.byte_offset + (was.offset - g.offset) * 2, g.dtype,
                    dst, was.count, /*accumulate=*/false, *stream_);
  }
  ZINF_RETURN_IF_ERROR(drain_then(std::move(s), std::span<DeviceBuffer>(&master, 1)));
  master_ = std::move(master);
  runs_ = std::move(runs);
  return Status::ok();
}

std::size_t DeviceOptimizer::half_only_elements() const {
  std::size_t elements = 0;
  for (const Run& r : runs_) elements += r.master == kNoMaster ? r.count : 0;
  return elements;
}

Status DeviceOptimizer::drain_then(Status queued, std::span<DeviceBuffer> buffers) {
  // One wait, whatever failed. Work queued before a failure may still write into `buffers` (a
  // HostDevice frees at once, and its stream's worker runs the queued work whatever the caller
  // does): only a wait that succeeds says it is done. Where this wait fails (a timeout: waiting
  // again would take a second timeout_), the buffers are kept until the destructor has waited
  // for the stream.
  const bool was_queued = queued.is_ok();
  Status waited = device_.synchronize(*stream_, timeout_);
  if (was_queued && waited.is_ok()) return waited;
  for (DeviceBuffer& b : buffers) {
    if (b.bytes() == 0) continue;
    if (waited.is_ok()) {
      b = DeviceBuffer();
    } else {
      kept_.push_back(std::move(b));
    }
  }
  return was_queued ? waited : queued;
}

DeviceOptimizer::~DeviceOptimizer() {
  if (stream_ == nullptr) return;
  // Where this wait fails too, kept_ is freed after stream_ (members go in reverse order of
  // declaration), whose destruction on a HostDevice runs the work still queued first.
  if (device_.synchronize(*stream_, timeout_).is_ok()) kept_.clear();
}

Result<double> DeviceOptimizer::sum_of_squares() {
  float* scratch = scratch_.as<float>();
  float* sum = scratch + kernels::kSqNormPartials;
  // Over the gradients kept (the groups of frozen runs only are zero and are not: the same sum
  // up to the order of the fp32 block sums on CUDA), the alignment gaps' zeros included.
  ZINF_RETURN_IF_ERROR(ops_->sum_of_squares(grads(), grad_elements_, scratch, sum, *stream_));
  ZINF_RETURN_IF_ERROR(device_.copy_d2h(result_.data(), sum, sizeof(float), *stream_));
  ZINF_RETURN_IF_ERROR(device_.synchronize(*stream_, timeout_));
  return static_cast<double>(*result_.as<float>());
}

Status DeviceOptimizer::step(std::int64_t step, float grad_scale, const OptimizerParams& params) {
  return this->step(step, grad_scale, std::span<const OptimizerParams>(&params, 1));
}

Status DeviceOptimizer::step(std::int64_t step, float grad_scale,
                             std::span<const OptimizerParams> groups) {
  ZINF_ASSERT(!groups.empty() && groups.size() <= kMaxOptimizerGroups);
  // Every group's scalars once per step, on the stack: a step allocates nothing.
  std::array<kernels::AdamStepArgs, kMaxOptimizerGroups> args;
  for (std::size_t g = 0; g < groups.size(); ++g) args[g] = adam_args(groups[g], step);
  auto* flag = reinterpret_cast<std::int32_t*>(scratch_.as<float>() + kernels::kSqNormPartials + 1);
  // The overflow check ran before the step: the flag is not read.
  for (const Span& s : scale_spans_) {
    ZINF_RETURN_IF_ERROR(
        ops_->scale(grads_.as<float>() + s.offset, s.count, grad_scale, flag, *stream_));
  }
  for (const Run& r : runs_) {
    const Group& g = groups_[r.group];
    ZINF_ASSERT(r.param_group < groups.size());
    if (r.frozen) {
      ZINF_ASSERT(groups[r.param_group].lr == 0 && groups[r.param_group].weight_decay == 0);
      // Zero moments and gradient at learning rate 0: the step would leave every bit as it is
      // (the half copy was rounded from this master).
      if (packed_) continue;
    }
    // unpack() gave every half-only run its master.
    ZINF_ASSERT(r.master != kNoMaster);
    // A frozen run without gradients (unpacked) steps on zeros, aligned as its master is, a chunk
    // of at most zero_elements_ at a time; any other run in one launch.
    ZINF_ASSERT(r.grad != kNoGrad || (r.frozen && zero_elements_ > 0));
    const std::size_t chunk = r.grad == kNoGrad ? zero_elements_ : r.count;
    for (std::size_t done = 0; done < r.count; done += chunk) {
      const std::size_t at = r.offset + done;
      void* half = g.dtype == DType::kF32
                       ? nullptr
                       : half_.as<std::byte>() + g.byte_offset + (at - g.offset) * 2;
      const float* grad = r.grad == kNoGrad ? zeros_.as<const float>() + at % 16
                                            : grads_.as<const float>() + r.grad + done;
      ZINF_RETURN_IF_ERROR(
          ops_->adam_step(master_at(r, at), grad, exp_avg_.as<float>() + r.moment + done,
                          exp_avg_sq_.as<float>() + r.moment + done, half, g.dtype,
                          std::min(chunk, r.count - done), args[r.param_group], *stream_));
    }
  }
  return device_.synchronize(*stream_, timeout_);
}

const void* DeviceOptimizer::values(std::uint32_t g) const {
  const Group& group = groups_[g];
  if (group.dtype == DType::kF32) {
    // The group's runs have masters one after another (layout_masters()): its first run's.
    auto it = std::lower_bound(runs_.begin(), runs_.end(), group.offset,
                               [](const Run& r, std::size_t e) { return r.offset < e; });
    ZINF_ASSERT(it != runs_.end() && it->offset == group.offset);
    return master_at(*it, group.offset);
  }
  return half_.as<std::byte>() + group.byte_offset;
}

Status DeviceOptimizer::read_master(std::size_t first, std::size_t count, float* out) {
  return read_state(0, first, count, out);
}

DeviceBuffer& DeviceOptimizer::state(int which, std::size_t first, std::size_t count) {
  ZINF_ASSERT(which >= 0 && which <= 2 && first + count <= partition_elements_);
  return which == 0 ? master_ : which == 1 ? exp_avg_ : exp_avg_sq_;
}

template <typename Fn>
Status DeviceOptimizer::for_each_run(std::size_t first, std::size_t count, Fn fn) {
  const std::size_t end = first + count;
  auto it = std::upper_bound(runs_.begin(), runs_.end(), first,
                             [](std::size_t e, const Run& r) { return e < r.offset; });
  if (it != runs_.begin()) --it;
  for (; it != runs_.end() && it->offset < end; ++it) {
    const std::size_t lo = std::max(first, it->offset);
    const std::size_t hi = std::min(end, it->offset + it->count);
    if (lo < hi) ZINF_RETURN_IF_ERROR(fn(*it, lo, hi));
  }
  return Status::ok();
}

Status DeviceOptimizer::round_frozen(std::size_t first, std::size_t count) {
  if (!packed_) return Status::ok();
  // The frozen group's step (learning rate 0, weight decay 0) on zero moments and gradient
  // computes p * (1 - 0) - 0 * (0 / (0 + eps)) = p for every finite p, -0 included, and rounds
  // it to the half copy with f32_to_bf16 / f32_to_f16; narrow rounds the master with the same
  // functions, so the copy has the bits the step would write. (A NaN master keeps its sign and
  // payload here, where the step's arithmetic may have given the device's canonical NaN.)
  return for_each_run(first, count, [&](const Run& r, std::size_t lo, std::size_t hi) -> Status {
    const Group& g = groups_[r.group];
    // A half-only run's half copy is its master.
    if (!r.frozen || g.dtype == DType::kF32 || r.master == kNoMaster) return Status::ok();
    return ops_->narrow(master_at(r, lo), g.dtype,
                        half_.as<std::byte>() + g.byte_offset + (lo - g.offset) * 2, hi - lo,
                        *stream_);
  });
}

Status DeviceOptimizer::unpack(std::string_view why) {
  const std::size_t bytes = std::max<std::size_t>(partition_elements_, 1) * sizeof(float);
  // The moments, and zeros for the frozen runs that have no gradients (the largest run's or a
  // chunk's, and room to keep each congruent to its master modulo 16 elements).
  std::array<DeviceBuffer, 3> full;
  const std::size_t zero_bytes = zero_elements_ > 0 ? (zero_elements_ + 16) * sizeof(float) : 0;
  for (std::size_t k = 0; k < full.size(); ++k) {
    if (k == 2 && zero_bytes == 0) break;
    Result<DeviceBuffer> r = DeviceBuffer::allocate(device_, k < 2 ? bytes : zero_bytes);
    if (!r.is_ok() && k < 2) {
      return r.status().with_context(
          fmt::format("{} need moments for every element of the partition on the device", why));
    }
    if (!r.is_ok()) {
      return r.status().with_context(fmt::format(
          "{} step the frozen run, and a frozen group without gradient slots steps on a device "
          "buffer of zeros: {} bytes ({} elements, and 16 to align them)",
          why, zero_bytes, zero_elements_));
    }
    full[k] = std::move(r).value();
  }
  // Every run is stepped from now on, from its master: given back once the moments are allocated,
  // so that a device without room for them fails with nothing changed.
  ZINF_RETURN_IF_ERROR(
      restore_masters(fmt::format("{} step every run", why), 0, partition_elements_));
  // The moments and zeros, filled on the stream; a failure waits for the work queued into them
  // before they are freed.
  Status s = Status::ok();
  if (zero_bytes > 0) s = device_.memset_async(full[2].data(), 0, zero_bytes, *stream_);
  std::array<DeviceBuffer*, 2> packed = {&exp_avg_, &exp_avg_sq_};
  for (std::size_t k = 0; k < packed.size() && s.is_ok(); ++k) {
    s = device_.memset_async(full[k].data(), 0, bytes, *stream_);
    for (const Run& r : runs_) {
      if (r.frozen || !s.is_ok()) continue;
      s = device_.copy_d2d(full[k].as<float>() + r.offset, packed[k]->as<const float>() + r.moment,
                           r.count * sizeof(float), *stream_);
    }
  }
  ZINF_RETURN_IF_ERROR(drain_then(std::move(s), full));
  exp_avg_ = std::move(full[0]);
  exp_avg_sq_ = std::move(full[1]);
  zeros_ = std::move(full[2]);
  for (Run& r : runs_) r.moment = r.offset;
  // Every run is stepped from now on, which writes the half copy of the frozen ones too.
  packed_ = false;
  return Status::ok();
}

Status DeviceOptimizer::read_state(int which, std::size_t first, std::size_t count, float* out) {
  const DeviceBuffer& buffer = state(which, first, count);
  if (which == 0) {
    // Each run's master, or a half-only run's half bytes into the second half of its stretch of
    // `out`, widened there once they are in (below).
    ZINF_RETURN_IF_ERROR(
        for_each_run(first, count, [&](const Run& r, std::size_t lo, std::size_t hi) -> Status {
          float* dst = out + (lo - first);
          if (r.master != kNoMaster) {
            return device_.copy_d2h(dst, master_at(r, lo), (hi - lo) * sizeof(float), *stream_);
          }
          const Group& g = groups_[r.group];
          return device_.copy_d2h(reinterpret_cast<std::byte*>(dst) + (hi - lo) * 2,
                                  half_.as<const std::byte>() + g.byte_offset + (lo - g.offset) * 2,
                                  (hi - lo) * 2, *stream_);
        }));
    ZINF_RETURN_IF_ERROR(device_.synchronize(*stream_, timeout_));
    return for_each_run(first, count, [&](const Run& r, std::size_t lo, std::size_t hi) -> Status {
      if (r.master != kNoMaster) return Status::ok();
      // In place, front to back: float i (bytes [4i, 4i + 4)) overwrites only halves j with
      // 2e + 2j < 4i + 4 (e the stretch's elements), that is j < 2i + 2 - e <= i + 1 (i < e),
      // each read before.
      auto* bytes = reinterpret_cast<std::byte*>(out + (lo - first));
      const std::size_t stretch_elements = hi - lo;
      const bool bf16 = groups_[r.group].dtype == DType::kBF16;
      for (std::size_t i = 0; i < stretch_elements; ++i) {
        std::uint16_t h;
        std::memcpy(&h, bytes + 2 * stretch_elements + 2 * i, sizeof(h));
        const float x = bf16 ? bf16_to_f32(h) : f16_to_f32(h);
        std::memcpy(bytes + 4 * i, &x, sizeof(x));
      }
      return Status::ok();
    });
  }
  if (!packed_) {
    ZINF_RETURN_IF_ERROR(
        device_.copy_d2h(out, buffer.as<const float>() + first, count * sizeof(float), *stream_));
    return device_.synchronize(*stream_, timeout_);
  }
  ZINF_RETURN_IF_ERROR(
      for_each_run(first, count, [&](const Run& r, std::size_t lo, std::size_t hi) -> Status {
        float* dst = out + (lo - first);
        if (r.moment == kNoMoment) {
          std::memset(dst, 0, (hi - lo) * sizeof(float));
          return Status::ok();
        }
        return device_.copy_d2h(dst, buffer.as<const float>() + r.moment + (lo - r.offset),
                                (hi - lo) * sizeof(float), *stream_);
      }));
  return device_.synchronize(*stream_, timeout_);
}

Status DeviceOptimizer::write_state(int which, std::size_t first, std::size_t count,
                                    const float* in, std::size_t restore_begin,
                                    std::size_t restore_end) {
  (void)state(which, first, count);
  if (which == 0) {
    // A half-only run stays so while its half dtype holds the new values exactly; the first value
    // one does not hold gives every half-only run that meets [restore_begin, restore_end) its
    // master back (one reallocation, however many chunks of that range the caller writes).
    ZINF_ASSERT(restore_begin <= first && first + count <= restore_end);
    std::string inexact;
    ZINF_RETURN_IF_ERROR(
        for_each_run(first, count, [&](const Run& r, std::size_t lo, std::size_t hi) -> Status {
          if (r.master != kNoMaster || !inexact.empty()) return Status::ok();
          const DType dtype = groups_[r.group].dtype;
          const std::size_t at = first_inexact(dtype, in + (lo - first), hi - lo);
          if (at < hi - lo) {
            inexact = fmt::format(
                "partition element {} (dtype group {}, parameter group {}, frozen run [{}, {})), "
                "written as {}, is a value {} does not hold",
                lo + at, r.group, r.param_group, r.offset, r.offset + r.count, in[lo - first + at],
                dtype_name(dtype));
          }
          return Status::ok();
        }));
    if (!inexact.empty()) {
      ZINF_RETURN_IF_ERROR(restore_masters(inexact, restore_begin, restore_end));
    }
    ZINF_RETURN_IF_ERROR(
        for_each_run(first, count, [&](const Run& r, std::size_t lo, std::size_t hi) -> Status {
          if (r.master == kNoMaster) return upload_half(r, lo, hi - lo, in + (lo - first));
          return device_.copy_h2d(master_at(r, lo), in + (lo - first), (hi - lo) * sizeof(float),
                                  *stream_);
        }));
    ZINF_RETURN_IF_ERROR(round_frozen(first, count));
    return device_.synchronize(*stream_, timeout_);
  }
  if (packed_) {
    // Zeros for a frozen run are what it holds; anything else (moments saved trainable) is kept,
    // in moments for the whole partition.
    std::string kept;
    ZINF_RETURN_IF_ERROR(
        for_each_run(first, count, [&](const Run& r, std::size_t lo, std::size_t hi) -> Status {
          if (r.frozen && kept.empty() &&
              !all_zero_bytes(in + (lo - first), (hi - lo) * sizeof(float))) {
            kept = fmt::format(
                "non-zero {} written into partition elements [{}, {}) (dtype group {}, parameter "
                "group {}, frozen run [{}, {}); saved trainable)",
                which == 1 ? "exp_avg" : "exp_avg_sq", lo, hi, r.group, r.param_group, r.offset,
                r.offset + r.count);
          }
          return Status::ok();
        }));
    if (!kept.empty()) ZINF_RETURN_IF_ERROR(unpack(kept));
  }
  DeviceBuffer& buffer = state(which, first, count);
  if (!packed_) {
    ZINF_RETURN_IF_ERROR(
        device_.copy_h2d(buffer.as<float>() + first, in, count * sizeof(float), *stream_));
    return device_.synchronize(*stream_, timeout_);
  }
  ZINF_RETURN_IF_ERROR(
      for_each_run(first, count, [&](const Run& r, std::size_t lo, std::size_t hi) -> Status {
        if (r.moment == kNoMoment) return Status::ok();
        return device_.copy_h2d(buffer.as<float>() + r.moment + (lo - r.offset), in + (lo - first),
                                (hi - lo) * sizeof(float), *stream_);
      }));
  return device_.synchronize(*stream_, timeout_);
}

std::uint64_t DeviceOptimizer::device_bytes() const {
  return master_.bytes() + exp_avg_.bytes() + exp_avg_sq_.bytes() + grads_.bytes() + half_.bytes() +
         zeros_.bytes();
}

}  // namespace zinf
