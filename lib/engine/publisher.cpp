// Publisher: see publisher.hpp.
#include "engine/publisher.hpp"

#include <algorithm>
#include <functional>

#include "base/assert.hpp"

namespace zinf {

GroupSpan groups_spanning(const ParameterLayout& layout, std::size_t begin, std::size_t end) {
  ZINF_ASSERT(begin < end && end <= layout.partition_elements());
  return group_run(layout, layout.first_group_ending_after(begin),
                   layout.first_group_ending_after(end - 1) + 1);
}

GroupSpan group_run(const ParameterLayout& layout, std::uint32_t first_group,
                    std::uint32_t end_group) {
  ZINF_ASSERT(first_group < end_group && end_group <= layout.group_count());
  GroupSpan out;
  out.first_group = first_group;
  out.end_group = end_group;
  out.begin = layout.offset(first_group);
  out.end = layout.offset(end_group - 1) + layout.group(end_group - 1).shard_element_count;
  return out;
}

bool widen_to_groups(const ParameterLayout& layout, std::size_t* begin, std::size_t* end,
                     GroupSpan* span) {
  *span = groups_spanning(layout, *begin, *end);
  if (*begin == 0 && *end >= layout.partition_elements()) return false;
  *begin = span->begin;
  *end = span->end;
  return true;
}

void Publisher::allocate_buffer() {
  buffer_ = AlignedBuffer(std::max<std::size_t>(layout_.device_copy_bytes(), 64));
}

void Publisher::narrow_groups(std::size_t first, std::size_t count, const float* src,
                              FunctionRef<bool(std::uint32_t)> want,
                              FunctionRef<std::byte*(std::uint32_t)> values) {
  const std::size_t end = first + count;
  // Only the groups overlapping [first, end): a caller narrowing run by run does not walk every
  // group for each run.
  for (std::uint32_t g = layout_.first_group_ending_after(first); g < layout_.group_count(); ++g) {
    const std::size_t group_first = layout_.offset(g);
    if (group_first >= end) break;
    const GroupInfo& info = layout_.group(g);
    if (!want(g)) continue;
    const std::size_t lo = std::max(first, group_first);
    const std::size_t hi = std::min(end, group_first + info.shard_element_count);
    if (lo >= hi) continue;
    narrow(src + (lo - first), hi - lo, info.dtype,
           values(g) + (lo - group_first) * dtype_bytes(info.dtype));
  }
}

Status Publisher::write_shards(FunctionRef<const std::byte*(std::uint32_t)> values,
                               bool gather_persistent, bool frozen_too) {
  for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
    if (!publishes(g, frozen_too)) continue;
    // The values stay until the next step: no wait for each copy up (publish() or the
    // overlapped step's end waits for them all).
    ZINF_RETURN_IF_ERROR(write_group(g, values(g), /*wait=*/false));
  }
  return gather_persistent ? publish(frozen_too) : Status::ok();
}

Status Publisher::write_group_shards(FunctionRef<const std::byte*(std::uint32_t)> values,
                                     std::uint32_t first_group, std::uint32_t end_group,
                                     std::span<const std::uint32_t> chosen) {
  ZINF_ASSERT(first_group <= end_group && end_group <= layout_.group_count());
  if (chosen.empty()) {
    for (std::uint32_t g = first_group; g < end_group; ++g) {
      ZINF_RETURN_IF_ERROR(write_group(g, values(g), /*wait=*/false));
    }
    return Status::ok();
  }
  // Ascending, each once: the walk below starts at a binary search. The check costs what the walk
  // does, far less than the writes.
  ZINF_ASSERT(std::adjacent_find(chosen.begin(), chosen.end(), std::greater_equal<>()) ==
              chosen.end());
  // The chosen groups in [first_group, end_group) alone, not every group of the range.
  for (auto it = std::lower_bound(chosen.begin(), chosen.end(), first_group);
       it != chosen.end() && *it < end_group; ++it) {
    ZINF_RETURN_IF_ERROR(write_group(*it, values(*it), /*wait=*/false));
  }
  return Status::ok();
}

Status Publisher::publish_groups(std::span<const std::uint32_t> chosen) {
  // An empty list is not "every group" here (publish() is that): no caller asks for nothing.
  ZINF_ASSERT(!chosen.empty());
  std::lock_guard<std::mutex> lock(mu_);
  return coord_->publish(chosen);
}

Status Publisher::publish(bool frozen_too) {
  std::lock_guard<std::mutex> lock(mu_);
  // Every rank froze the same parameters (ParameterLayout::check_trainable_agree), so every rank
  // all-gathers the same groups in the same order.
  return coord_->publish([&](std::uint32_t g) { return publishes(g, frozen_too); });
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
  pass_error_ = Status::ok();
  // A frozen group's shard already holds what the pass would write (it writes none): a gather
  // of a frozen module does not wait for the pass.
  written_.assign(layout_.group_count(), 0);
  for (std::uint32_t g = 0; g < layout_.group_count(); ++g) {
    if (!publishes(g, /*frozen_too=*/false)) written_[g] = 1;
  }
}

void Publisher::end_pass(Status outcome) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_pass_ = false;
    pass_ok_ = outcome.is_ok();
    pass_error_ = std::move(outcome);
  }
  written_cv_.notify_all();
}

void Publisher::allocate_stage() {
  stage_ = AlignedBuffer(std::max<std::size_t>(layout_.largest_half_shard_bytes(), 64));
}

void Publisher::restart_stream(bool descending, bool frozen_too) {
  stream_descending_ = descending;
  stream_frozen_too_ = frozen_too;
  stream_chosen_.clear();
  stream_next_ = descending ? layout_.partition_elements() : 0;
  stream_group_ = descending ? layout_.group_count() : 0;
  stream_end_group_ = layout_.group_count();
  stream_stop_ = layout_.partition_elements();
  stream_filled_ = 0;
}

void Publisher::restart_stream_groups(std::uint32_t first_group, std::uint32_t end_group,
                                      std::span<const std::uint32_t> chosen) {
  ZINF_ASSERT(first_group < end_group && end_group <= layout_.group_count());
  restart_stream();
  stream_chosen_.assign(chosen.begin(), chosen.end());
  stream_next_ = layout_.offset(first_group);
  stream_group_ = first_group;
  stream_end_group_ = end_group;
  stream_stop_ = layout_.offset(end_group - 1) + layout_.group(end_group - 1).shard_element_count;
}

bool Publisher::can_turn_at(std::size_t element) const {
  // The group holding `element` past its start, if any, is written in two parts.
  const std::uint32_t g = layout_.first_group_ending_after(element);
  return g == layout_.group_count() || layout_.offset(g) >= element ||
         !publishes(g, stream_frozen_too_) || coord_->writes_shard_parts(g);
}

Status Publisher::stage(std::size_t first, std::size_t count,
                        FunctionRef<void(std::size_t, std::size_t, std::byte*)> fill) {
  const std::size_t end = first + count;
  if (stream_descending_ && end != stream_next_) {
    // The pass turned (OptimizerPipeline's StepArgs::ascend): the rest comes from the partition's
    // start up to where the descending ranges ended. A group that straddles that point has its
    // upper part, filled by the descending ranges, written into its shard now, and its lower
    // part when the ascending ranges end; groups from stream_group_ up are written.
    ZINF_ASSERT_MSG(first == 0, "Publisher::stage: a turn that does not go to the start");
    if (stream_filled_ != 0) {
      const std::uint32_t g = stream_group_ - 1;
      const std::size_t lo = stream_next_ - layout_.offset(g);
      const std::size_t count = layout_.group(g).shard_element_count - lo;
      ZINF_ASSERT_MSG(stream_filled_ == count, "Publisher::stage: a turn with a gap in its group");
      const std::size_t bytes = dtype_bytes(layout_.half_dtype());
      if (publishes(g, stream_frozen_too_)) {
        ZINF_RETURN_IF_ERROR(
            write_group_part(g, lo, count, stage_.data() + lo * bytes, /*last=*/false));
      }
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
  while (!stream_complete()) {
    const std::uint32_t g = stream_descending_ ? stream_group_ - 1 : stream_group_;
    const std::size_t group_first = layout_.offset(g);
    const std::size_t group_count = layout_.group(g).shard_element_count;
    // A frozen group in a step's stream, or a group a ranged stream does not choose: counted
    // through, never filled or written.
    const bool skip = !publishes(g, stream_frozen_too_) || !chosen_group(stream_chosen_, g);
    // After a turn the ascending ranges stop where the descending ones ended: a group straddling
    // that point gets its lower part here.
    const std::size_t group_end = std::min(group_first + group_count, stream_stop_);
    const std::size_t lo = std::max(first, group_first);
    const std::size_t hi = std::min(end, group_end);
    if (lo < hi) {
      if (!skip) fill(lo, hi, stage_.data() + (lo - group_first) * bytes);
      stream_filled_ += hi - lo;
    }
    // The group goes on in the next range: past `end` going up, before `first` going down.
    if (stream_descending_ ? group_first < first : group_end > end) break;
    ZINF_ASSERT_MSG(stream_filled_ == group_end - group_first,
                    "Publisher::stage: a group written half filled");
    // The stage is refilled by the next group: the copy up must have read it.
    if (skip) {
      // Counted as written since begin_pass().
    } else if (group_end - group_first < group_count) {
      ZINF_RETURN_IF_ERROR(write_group_part(g, 0, group_end - group_first, stage_.data(),
                                            /*last=*/true));
    } else {
      ZINF_RETURN_IF_ERROR(write_group(g, stage_.data(), /*wait=*/true));
    }
    stream_filled_ = 0;
    stream_group_ = stream_descending_ ? stream_group_ - 1 : stream_group_ + 1;
  }
  return Status::ok();
}

}  // namespace zinf
