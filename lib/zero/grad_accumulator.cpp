#include "zero/grad_accumulator.hpp"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_reduce.h>

#include <algorithm>
#include <cstring>

#include "base/assert.hpp"
#include "tier/state_store.hpp"

namespace zinf {
namespace {

constexpr std::size_t kPage = 4096;

std::size_t round_page(std::size_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }

}  // namespace

double sum_of_squares(const float* x, std::size_t count) {
  constexpr std::size_t kTile = std::size_t{1} << 16;
  return tbb::parallel_deterministic_reduce(
      tbb::blocked_range<std::size_t>(0, count, kTile), 0.0,
      [x](const tbb::blocked_range<std::size_t>& r, double init) {
        // Four accumulators let the compiler keep several multiply-adds in flight.
        double a[4] = {0.0, 0.0, 0.0, 0.0};
        std::size_t i = r.begin();
        for (; i + 4 <= r.end(); i += 4) {
          for (int k = 0; k < 4; ++k) {
            const double v = static_cast<double>(x[i + static_cast<std::size_t>(k)]);
            a[k] += v * v;
          }
        }
        for (; i < r.end(); ++i) a[0] += static_cast<double>(x[i]) * x[i];
        return init + ((a[0] + a[1]) + (a[2] + a[3]));
      },
      [](double a, double b) { return a + b; });
}

// --- MemoryAccumulator ------------------------------------------------------------------------

Status MemoryAccumulator::add(std::size_t first, std::size_t count, const float* src) {
  ZINF_ASSERT(first + count <= element_count_);
  float* acc = data_ + first;
  for (std::size_t i = 0; i < count; ++i) acc[i] += src[i];
  return Status::ok();
}

void MemoryAccumulator::zero() { std::memset(data_, 0, element_count_ * sizeof(float)); }

// --- SpillAccumulator -------------------------------------------------------------------------

Result<std::unique_ptr<SpillAccumulator>> SpillAccumulator::create(StateStore& store,
                                                                   const SpillOptions& options,
                                                                   EngineCounters* counters) {
  ZINF_ASSERT(store.on_nvme(Piece::kGrads));
  ZINF_ASSERT(store.dtype(Piece::kGrads) == DType::kF32);
  if (options.buffer_count == 0) {
    return Status::invalid_argument("SpillAccumulator: buffer_count is 0 (at least 1)");
  }
  std::unique_ptr<SpillAccumulator> s(new SpillAccumulator(store, options, counters));
  s->sub_groups_.resize(store.sub_group_count());
  // No more buffers than sub-groups: a spare buffer could never be used.
  const std::size_t buffers = std::min(options.buffer_count, store.sub_group_count());
  s->buffer_bytes_ = round_page(store.sub_group_params() * sizeof(float));
  s->buffers_.resize(buffers);
  for (Buffer& b : s->buffers_) {
    b.data = AlignedBuffer(s->buffer_bytes_);
    // The page padding past a short last sub-group is written too; keep it defined.
    std::memset(b.data.data(), 0, b.data.bytes());
  }
  return s;
}

SpillAccumulator::~SpillAccumulator() {
  // No write may outlive its buffer.
  for (std::size_t b = 0; b < buffers_.size(); ++b) settle(static_cast<int>(b));
}

void SpillAccumulator::settle(int b) {
  Buffer& buf = buffers_[static_cast<std::size_t>(b)];
  if (!buf.writing) return;
  SwapSpace& swap = *store_.swap();
  Status st = swap.wait(buf.ticket, options_.timeout);
  if (st.code() == Code::kTimeout) {
    // A drive that stopped answering: cancel, and give the cancel one more wait.
    swap.cancel(buf.ticket);
    st = swap.wait(buf.ticket, options_.timeout);
  }
  if (st.code() == Code::kTimeout) {
    // Not even the cancel ended it: give the write up (its blocks are lost) and keep its buffer
    // out of use until this object goes, since the device may still read it.
    swap.abandon(buf.ticket);
    abandoned_.push_back(std::move(buf.data));
    buf.data = AlignedBuffer(buffer_bytes_);
    std::memset(buf.data.data(), 0, buf.data.bytes());
  }
  buf.writing = false;
  store_.end_write(Piece::kGrads, static_cast<std::size_t>(buf.sub_group), st.is_ok());
  (void)fail(st);
}

std::size_t SpillAccumulator::host_bytes() const { return buffers_.size() * buffer_bytes_; }

std::size_t SpillAccumulator::open_count() const {
  std::size_t n = 0;
  for (const Buffer& b : buffers_) n += b.sub_group >= 0 ? 1 : 0;
  return n;
}

Status SpillAccumulator::fail(Status st) {
  if (!st.is_ok() && status_.is_ok()) status_ = st;
  return st;
}

Status SpillAccumulator::add(std::size_t first, std::size_t count, const float* src) {
  ZINF_RETURN_IF_ERROR(status_);
  const std::size_t sg_params = store_.sub_group_params();
  const std::size_t end = first + count;
  ZINF_ASSERT(end <= store_.param_count());
  while (first < end) {
    const std::size_t i = first / sg_params;
    const std::size_t sg_first = store_.sub_group_first(i);
    const std::size_t sg_size = store_.sub_group_size(i);
    const std::size_t n = std::min(end, sg_first + sg_size) - first;
    ZINF_ASSIGN_OR_RETURN(int b, open(i));
    float* acc = buffers_[static_cast<std::size_t>(b)].data.as<float>() + (first - sg_first);
    for (std::size_t k = 0; k < n; ++k) acc[k] += src[k];
    buffers_[static_cast<std::size_t>(b)].dirty = true;
    SubGroup& s = sub_groups_[i];
    s.arrived += n;
    if (s.arrived >= sg_size) {
      // Complete for this micro-batch: write it now, so the buffer frees up while backward runs.
      s.arrived = 0;
      ZINF_RETURN_IF_ERROR(write(b));
    }
    first += n;
    src += n;
  }
  return Status::ok();
}

Result<int> SpillAccumulator::open(std::size_t i) {
  SubGroup& s = sub_groups_[i];
  if (s.where == Where::kBuffer) {
    const int b = s.buffer;
    Buffer& buf = buffers_[static_cast<std::size_t>(b)];
    // Its write reads the buffer: it must land before the sums change.
    if (buf.writing) ZINF_RETURN_IF_ERROR(write_done(b));
    buf.last_use = ++clock_;
    return b;
  }
  ZINF_ASSIGN_OR_RETURN(int b, take_buffer());
  Buffer& buf = buffers_[static_cast<std::size_t>(b)];
  const std::size_t bytes = store_.sub_group_size(i) * sizeof(float);
  if (s.where == Where::kZero) {
    std::memset(buf.data.data(), 0, bytes);
  } else {
    ZINF_RETURN_IF_ERROR(fail(store_.read_piece(Piece::kGrads, i, buf.data.data())));
    ++counts_.read_backs;
    counts_.read_bytes += round_page(bytes);
  }
  buf.sub_group = static_cast<long>(i);
  buf.dirty = false;
  buf.last_use = ++clock_;
  s.where = Where::kBuffer;
  s.buffer = b;
  return b;
}

Result<int> SpillAccumulator::take_buffer() {
  // A free buffer.
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    if (buffers_[b].sub_group < 0) return static_cast<int>(b);
  }
  // A clean one (written, or being written): the oldest, whose write most likely landed.
  int pick = -1;
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    const Buffer& buf = buffers_[b];
    if (buf.dirty) continue;
    if (pick < 0 || buf.last_use < buffers_[static_cast<std::size_t>(pick)].last_use) {
      pick = static_cast<int>(b);
    }
  }
  if (pick < 0) {
    // Every buffer holds partial sums: evict the least recently used.
    for (std::size_t b = 0; b < buffers_.size(); ++b) {
      if (pick < 0 || buffers_[b].last_use < buffers_[static_cast<std::size_t>(pick)].last_use) {
        pick = static_cast<int>(b);
      }
    }
    ZINF_RETURN_IF_ERROR(write(pick));
    ++counts_.evictions;
  }
  if (buffers_[static_cast<std::size_t>(pick)].writing) ZINF_RETURN_IF_ERROR(write_done(pick));
  detach(pick);
  return pick;
}

Status SpillAccumulator::write(int b) {
  Buffer& buf = buffers_[static_cast<std::size_t>(b)];
  ZINF_ASSERT(buf.sub_group >= 0 && !buf.writing);
  const auto i = static_cast<std::size_t>(buf.sub_group);
  const std::size_t count = store_.sub_group_size(i);
  sub_groups_[i].sumsq = zinf::sum_of_squares(buf.data.as<const float>(), count);
  store_.begin_write(Piece::kGrads, i);
  Result<SwapTicket> t = store_.swap()->write(store_.extent(Piece::kGrads, i), buf.data.data());
  if (!t.is_ok()) {
    store_.end_write(Piece::kGrads, i, false);
    return fail(t.status());
  }
  buf.ticket = *t;
  buf.writing = true;
  buf.dirty = false;
  counts_.write_bytes += round_page(count * sizeof(float));
  return Status::ok();
}

Status SpillAccumulator::write_done(int b) {
  Buffer& buf = buffers_[static_cast<std::size_t>(b)];
  ZINF_ASSERT(buf.writing);
  const auto i = static_cast<std::size_t>(buf.sub_group);
  Status st = store_.swap()->wait(buf.ticket, options_.timeout);
  if (st.code() == Code::kTimeout) return fail(st);  // still in flight: keep the buffer
  buf.writing = false;
  store_.end_write(Piece::kGrads, i, st.is_ok());
  return fail(st);
}

void SpillAccumulator::detach(int b) {
  Buffer& buf = buffers_[static_cast<std::size_t>(b)];
  ZINF_ASSERT(!buf.dirty && !buf.writing);
  if (buf.sub_group < 0) return;
  SubGroup& s = sub_groups_[static_cast<std::size_t>(buf.sub_group)];
  s.where = Where::kDisk;
  s.buffer = -1;
  buf.sub_group = -1;
}

void SpillAccumulator::publish_counts() {
  if (counters_ == nullptr) return;
  counters_->grad_spill_write_bytes = counts_.write_bytes;
  counters_->grad_spill_read_bytes = counts_.read_bytes;
  counters_->grad_spill_read_backs = counts_.read_backs;
  counters_->grad_spill_evictions = counts_.evictions;
}

Status SpillAccumulator::flush() {
  Status st = flush_all();
  publish_counts();
  return st;
}

Status SpillAccumulator::flush_all() {
  ZINF_RETURN_IF_ERROR(status_);
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    if (buffers_[b].sub_group >= 0 && buffers_[b].dirty) {
      ZINF_RETURN_IF_ERROR(write(static_cast<int>(b)));
    }
  }
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    if (buffers_[b].writing) ZINF_RETURN_IF_ERROR(write_done(static_cast<int>(b)));
  }
  // A sub-group no chunk reached since zero() is all zeros; the step reads its extent, so it
  // must hold zeros too. (GradReducer covers every element each micro-batch, so this only runs
  // for a step with no gradients at all, which the engine refuses before it gets here.)
  for (std::size_t i = 0; i < sub_groups_.size(); ++i) {
    if (sub_groups_[i].where != Where::kZero) continue;
    ZINF_ASSIGN_OR_RETURN(int b, open(i));
    buffers_[static_cast<std::size_t>(b)].dirty = true;
    ZINF_RETURN_IF_ERROR(write(b));
    ZINF_RETURN_IF_ERROR(write_done(b));
  }
  return status_;
}

void SpillAccumulator::zero() {
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    Buffer& buf = buffers_[b];
    settle(static_cast<int>(b));
    buf.sub_group = -1;
    buf.dirty = false;
  }
  // Nothing is read back or written: every sub-group starts from zeros again.
  for (SubGroup& s : sub_groups_) s = SubGroup{};
  publish_counts();
}

}  // namespace zinf
