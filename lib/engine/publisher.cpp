// Publisher: see publisher.hpp.
#include "engine/publisher.hpp"

#include <algorithm>
#include <cstring>

#include "base/assert.hpp"

namespace zinf {

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

void Publisher::allocate_buffer() {
  buffer_ = AlignedBuffer(std::max<std::size_t>(layout_.device_copy_bytes(), 64));
}

void Publisher::narrow_groups(std::size_t first, std::size_t count, const float* src,
                              FunctionRef<bool(DType)> want,
                              FunctionRef<std::byte*(std::uint32_t)> values) {
  const std::size_t end = first + count;
  for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
    const GroupInfo& info = layout_.group(g);
    if (!want(info.dtype)) continue;
    const std::size_t group_first = layout_.offset(g);
    const std::size_t lo = std::max(first, group_first);
    const std::size_t hi = std::min(end, group_first + info.shard_element_count);
    if (lo >= hi) continue;
    narrow(src + (lo - first), hi - lo, info.dtype,
           values(g) + (lo - group_first) * dtype_bytes(info.dtype));
  }
}

Status Publisher::write_shards(FunctionRef<const std::byte*(std::uint32_t)> values,
                               bool gather_persistent) {
  for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
    // The values stay until the next step: no wait for each copy up (publish() or the
    // overlapped step's end waits for them all).
    ZINF_RETURN_IF_ERROR(write_group(g, values(g), /*wait=*/false));
  }
  return gather_persistent ? publish() : Status::ok();
}

Status Publisher::write_group(std::uint32_t g, const std::byte* values, bool wait) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ZINF_RETURN_IF_ERROR(coord_->write_shard(g, values));
    // A gather of g's module queues its copies after this write's on the coordinator's stream.
    if (wait) ZINF_RETURN_IF_ERROR(coord_->wait_writes());
    // Outside a pass every group counts as written.
    if (in_pass_) written_[g] = 1;
  }
  written_cv_.notify_all();
  return Status::ok();
}

Status Publisher::write_group_part(std::uint32_t g, std::size_t first, std::size_t count,
                                   const std::byte* values, bool last) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ZINF_RETURN_IF_ERROR(coord_->write_shard_part(g, first, count, values));
    // The stage is refilled next.
    ZINF_RETURN_IF_ERROR(coord_->wait_writes());
    if (!last) return Status::ok();
    if (in_pass_) written_[g] = 1;
  }
  written_cv_.notify_all();
  return Status::ok();
}

void Publisher::begin_pass() {
  std::lock_guard<std::mutex> lock(mu_);
  in_pass_ = true;
  written_.assign(layout_.group_count(), 0);
}

void Publisher::end_pass(bool ok) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_pass_ = false;
    pass_ok_ = ok;
  }
  written_cv_.notify_all();
}

void Publisher::allocate_stage() {
  stage_ = AlignedBuffer(std::max<std::size_t>(layout_.largest_half_shard_bytes(), 64));
}

void Publisher::restart_stream(bool descending, std::size_t top) {
  const std::size_t n = layout_.partition_elements();
  stream_top_ = std::min(top, n);
  ZINF_ASSERT(stream_top_ == n || (descending && stream_top_ > 0 && can_turn_at(stream_top_)));
  stream_in_top_ = false;
  stream_descending_ = descending;
  stream_next_ = descending ? stream_top_ : 0;
  stream_group_ = descending ? layout_.group_count() : 0;
  if (descending && stream_top_ < n) {
    // The group holding element top - 1 is the first written going down; the ranges from top
    // up begin with it when it goes on past top (its upper part), else with the next one.
    const std::uint32_t g = layout_.first_group_ending_after(stream_top_ - 1);
    stream_group_ = g + 1;
    stream_top_group_ =
        layout_.offset(g) + layout_.group(g).shard_element_count > stream_top_ ? g : g + 1;
  }
  stream_end_group_ = layout_.group_count();
  stream_stop_ = n;
  stream_filled_ = 0;
  part_done_.assign(layout_.group_count(), 0);
}

bool Publisher::can_turn_at(std::size_t element) const {
  // The group holding `element` past its start, if any, is written in two parts.
  const std::uint32_t g = layout_.first_group_ending_after(element);
  return g == layout_.group_count() || layout_.offset(g) >= element ||
         coord_->writes_shard_parts(g);
}

Status Publisher::write_stage(std::uint32_t g, std::size_t first, std::size_t count) {
  const std::size_t total = layout_.group(g).shard_element_count;
  if (count == total) return write_group(g, stage_.data(), /*wait=*/true);
  part_done_[g] += count;
  ZINF_ASSERT(part_done_[g] <= total);
  return write_group_part(g, first, count,
                          stage_.data() + first * dtype_bytes(layout_.half_dtype()),
                          /*last=*/part_done_[g] == total);
}

Status Publisher::stage(std::size_t first, std::size_t count,
                        FunctionRef<void(std::size_t, std::size_t, std::byte*)> fill) {
  const std::size_t end = first + count;
  if (stream_descending_ && end != stream_next_) {
    // The pass turned (OptimizerPipeline's StepArgs::ascend): the rest below comes from the
    // partition's start up to where the descending ranges ended. A group that straddles that
    // point has its upper part, filled by the descending ranges, written into its shard now,
    // and its lower part when the ascending ranges end; groups from stream_group_ up are
    // written.
    ZINF_ASSERT_MSG(first == 0, "Publisher::stage: a turn that does not go to the start");
    if (stream_filled_ != 0) {
      const std::uint32_t g = stream_group_ - 1;
      const std::size_t group_first = layout_.offset(g);
      const std::size_t hi =
          std::min(group_first + layout_.group(g).shard_element_count, stream_top_);
      ZINF_ASSERT_MSG(stream_filled_ == hi - stream_next_,
                      "Publisher::stage: a turn with a gap in its group");
      ZINF_RETURN_IF_ERROR(write_stage(g, stream_next_ - group_first, hi - stream_next_));
    }
    stream_descending_ = false;
    stream_stop_ = stream_next_;
    // One past the group being assembled: a straddling group's lower part comes last.
    stream_end_group_ = stream_group_;
    stream_group_ = 0;
    stream_next_ = 0;
    stream_filled_ = 0;
  }
  ZINF_ASSERT_MSG((stream_descending_ ? end : first) == stream_next_,
                  "Publisher::stage: ranges out of partition order");
  ZINF_ASSERT_MSG(end <= stream_stop_, "Publisher::stage: a range past where the stream ends");
  stream_next_ = stream_descending_ ? first : end;
  const std::size_t bytes = dtype_bytes(layout_.half_dtype());
  // The elements this run of ranges covers: below top going down, below where the descending
  // ranges ended going up after a turn, from top up at the end.
  const std::size_t run_first = stream_in_top_ ? stream_top_ : 0;
  const std::size_t run_end = stream_descending_ ? stream_top_ : stream_stop_;
  while (!phase_done()) {
    const std::uint32_t g = stream_descending_ ? stream_group_ - 1 : stream_group_;
    const std::size_t group_first = layout_.offset(g);
    const std::size_t part_first = std::max(group_first, run_first);
    const std::size_t part_end =
        std::min(group_first + layout_.group(g).shard_element_count, run_end);
    const std::size_t lo = std::max(first, part_first);
    const std::size_t hi = std::min(end, part_end);
    if (lo < hi) {
      fill(lo, hi, stage_.data() + (lo - group_first) * bytes);
      stream_filled_ += hi - lo;
    }
    // The group goes on in the next range: past `end` going up, before `first` going down.
    if (stream_descending_ ? part_first < first : part_end > end) break;
    ZINF_ASSERT_MSG(stream_filled_ == part_end - part_first,
                    "Publisher::stage: a group written half filled");
    // The stage is refilled by the next group: the copy up must have read it.
    ZINF_RETURN_IF_ERROR(write_stage(g, part_first - group_first, part_end - part_first));
    stream_filled_ = 0;
    stream_group_ = stream_descending_ ? stream_group_ - 1 : stream_group_ + 1;
  }
  if (phase_done() && !stream_in_top_ && stream_top_ < layout_.partition_elements()) {
    // Below top every group is written: the ranges go on from top up.
    stream_in_top_ = true;
    stream_descending_ = false;
    stream_next_ = stream_top_;
    stream_stop_ = layout_.partition_elements();
    stream_group_ = stream_top_group_;
    stream_end_group_ = layout_.group_count();
    stream_filled_ = 0;
  }
  return Status::ok();
}

}  // namespace zinf
