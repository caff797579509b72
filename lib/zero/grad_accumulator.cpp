#include "zero/grad_accumulator.hpp"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_reduce.h>

#include <algorithm>
#include <cstring>

#include "base/arith.hpp"
#include "base/assert.hpp"
#include "tier/state_store.hpp"

namespace zinf {
namespace {

// sum_of_squares's tile: at most kSquareTile elements a leaf of its reduction tree.
constexpr std::size_t kSquareTile = std::size_t{1} << 16;

// One leaf's running state: four lanes, element k of the leaf going to lane k mod 4 (the tail
// past the last whole quad to lane 0). Four accumulators let the compiler keep several
// multiply-adds in flight. Fed in pieces whose lengths are multiples of 4 (all but the last), it
// adds the same values in the same order as one call over the whole leaf.
struct SquareLanes {
  double a[4] = {0.0, 0.0, 0.0, 0.0};

  void add(const float* x, std::size_t count) {
    std::size_t i = 0;
    for (; i + 4 <= count; i += 4) {
      for (int k = 0; k < 4; ++k) {
        const double v = static_cast<double>(x[i + static_cast<std::size_t>(k)]);
        a[k] += v * v;
      }
    }
    for (; i < count; ++i) a[0] += static_cast<double>(x[i]) * x[i];
  }
  // The leaf's value as parallel_deterministic_reduce folds it: identity + body.
  double total() const { return 0.0 + ((a[0] + a[1]) + (a[2] + a[3])); }
};

double square_leaf(const float* x, std::size_t count) {
  SquareLanes lanes;
  lanes.add(x, count);
  return lanes.total();
}

// The leaves of sum_of_squares's tree over [first, first + count), in order: the range halved
// (blocked_range's split, the middle rounded down) until a part is at most kSquareTile long.
template <typename F>
void for_each_square_leaf(std::size_t first, std::size_t count, F&& leaf) {
  if (count <= kSquareTile) {
    leaf(first, count);
    return;
  }
  const std::size_t half = count / 2;
  for_each_square_leaf(first, half, leaf);
  for_each_square_leaf(first + half, count - half, leaf);
}

std::size_t square_leaf_count(std::size_t count) {
  std::size_t leaves = 0;
  if (count > 0) for_each_square_leaf(0, count, [&leaves](std::size_t, std::size_t) { ++leaves; });
  return leaves;
}

// acc[0, count) += src[0, count). A plain loop: GCC vectorises it (with a run-time overlap
// check), and each element gets one IEEE add whatever the width, so the bits are those of the
// scalar loop.
void add_floats(float* acc, const float* src, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) acc[i] += src[i];
}

// Folds leaf values (in leaf order, from *next on) as sum_of_squares's tree does: each inner
// node is left + right.
double fold_square_leaves(std::size_t count, const double*& next) {
  if (count <= kSquareTile) return *next++;
  const std::size_t half = count / 2;
  const double left = fold_square_leaves(half, next);
  const double right = fold_square_leaves(count - half, next);
  return left + right;
}

}  // namespace

double sum_of_squares(const float* x, std::size_t count) {
  // parallel_deterministic_reduce with the simple partitioner halves the range until a part is at
  // most kSquareTile long and folds the leaves' values pairwise in that tree, whatever thread ran
  // them. SpillAccumulator rebuilds the same tree from leaves computed as chunks arrive
  // (for_each_square_leaf, fold_square_leaves): change one, change the other.
  return tbb::parallel_deterministic_reduce(
      tbb::blocked_range<std::size_t>(0, count, kSquareTile), 0.0,
      [x](const tbb::blocked_range<std::size_t>& r, double init) {
        return init + square_leaf(x + r.begin(), r.size());
      },
      [](double a, double b) { return a + b; });
}

// --- MemoryAccumulator ------------------------------------------------------------------------

Status MemoryAccumulator::add(std::size_t first, std::size_t count, const float* src) {
  ZINF_ASSERT(first + count <= element_count_);
  add_floats(data_ + first, src, count);
  return Status::ok();
}

void MemoryAccumulator::zero() { std::memset(data_, 0, element_count_ * sizeof(float)); }

void MemoryAccumulator::assign(std::size_t first, std::size_t count, const float* src) {
  ZINF_ASSERT(first <= element_count_ && count <= element_count_ - first);
  std::memcpy(data_ + first, src, count * sizeof(float));
}

// --- SpillAccumulator -------------------------------------------------------------------------

Result<std::unique_ptr<SpillAccumulator>> SpillAccumulator::create(StateStore& store,
                                                                   const SpillOptions& options,
                                                                   ZeroCounters* counters) {
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
  const std::size_t leaves = square_leaf_count(store.sub_group_params());
  s->scratch_.resize(leaves);
  for (Buffer& b : s->buffers_) {
    b.data = AlignedBuffer(s->buffer_bytes_);
    // The largest sub-group has the most leaves (a shorter one never has more).
    b.leaves.reserve(leaves);
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
  if (!buf.writing && !buf.reading) return;
  SwapSpace& swap = *store_.swap();
  Status st = swap.wait(buf.ticket, options_.timeout);
  if (st.code() == Code::kTimeout) {
    // A drive that stopped answering: cancel, and give the cancel one more wait.
    swap.cancel(buf.ticket);
    st = swap.wait(buf.ticket, options_.timeout);
  }
  if (st.code() == Code::kTimeout) {
    // Not even the cancel ended it: give the op up (a write's blocks are lost) and keep its
    // buffer out of use until this object goes, since the device may still use it.
    swap.abandon(buf.ticket);
    abandoned_.push_back(std::move(buf.data));
    buf.data = AlignedBuffer(buffer_bytes_);
    std::memset(buf.data.data(), 0, buf.data.bytes());
  }
  if (buf.writing) {
    buf.writing = false;
    store_.end_write(Piece::kGrads, static_cast<std::size_t>(buf.sub_group), st.is_ok());
  } else {
    // A read-ahead: whatever the buffer holds now, its sub-group is on disk only.
    buf.reading = false;
    detach(b);
  }
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
    add_to(buffers_[static_cast<std::size_t>(b)], first - sg_first, n, src);
    if (read_ahead_next_) {
      // A later micro-batch reached a sub-group on disk. Backward hands chunks over from the
      // partition's end to its start, so the one below is most likely next: read it while
      // this one is summed (after the add, so this sub-group's buffer is dirty and stays).
      read_ahead_next_ = false;
      if (i > 0 && options_.read_ahead) read_ahead(i - 1);
    }
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
    if (buf.reading) {
      // Read ahead: backward is walking down the partition, read the next one ahead too.
      ZINF_RETURN_IF_ERROR(read_done(b));
      ++counts_.read_ahead_hits;
      read_ahead_next_ = true;
    }
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
    read_ahead_next_ = true;
  }
  attach(b, i);
  return b;
}

int SpillAccumulator::free_buffer() const {
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    if (buffers_[b].sub_group < 0) return static_cast<int>(b);
  }
  return -1;
}

void SpillAccumulator::attach(int b, std::size_t i) {
  Buffer& buf = buffers_[static_cast<std::size_t>(b)];
  buf.sub_group = static_cast<long>(i);
  buf.dirty = false;
  reset_leaves(buf, store_.sub_group_size(i));
  buf.last_use = ++clock_;
  SubGroup& s = sub_groups_[i];
  s.where = Where::kBuffer;
  s.buffer = b;
}

Result<int> SpillAccumulator::take_buffer() {
  if (const int b = free_buffer(); b >= 0) return b;
  // A clean one (written, or being written): the oldest, whose write most likely landed; one
  // read ahead only when no other is clean.
  int pick = -1;
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    const Buffer& buf = buffers_[b];
    if (buf.dirty) continue;
    if (pick >= 0) {
      const Buffer& p = buffers_[static_cast<std::size_t>(pick)];
      if (buf.reading != p.reading ? buf.reading : buf.last_use >= p.last_use) continue;
    }
    pick = static_cast<int>(b);
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
  if (buffers_[static_cast<std::size_t>(pick)].reading) ZINF_RETURN_IF_ERROR(read_done(pick));
  detach(pick);
  return pick;
}

void SpillAccumulator::read_ahead(std::size_t i) {
  SubGroup& s = sub_groups_[i];
  // Only a sub-group on disk whose extent holds data (a lost one is left to the synchronous read
  // in open(), which reports it).
  if (s.where != Where::kDisk || store_.residency(Piece::kGrads, i) != Residency::kDisk) return;
  SwapSpace& swap = *store_.swap();
  // Only a buffer that costs nothing now: a free one, else the oldest clean one whose write has
  // landed. Never an eviction, never a wait: a wrong guess must not slow the right path.
  int pick = free_buffer();
  if (pick < 0) {
    for (std::size_t b = 0; b < buffers_.size(); ++b) {
      const Buffer& buf = buffers_[b];
      if (buf.dirty || buf.reading || (buf.writing && !swap.poll(buf.ticket))) continue;
      if (pick < 0 || buf.last_use < buffers_[static_cast<std::size_t>(pick)].last_use) {
        pick = static_cast<int>(b);
      }
    }
  }
  if (pick < 0) return;
  Buffer& buf = buffers_[static_cast<std::size_t>(pick)];
  if (buf.writing && !write_done(pick).is_ok()) return;  // landed already: no wait
  detach(pick);
  Result<SwapTicket> t = swap.read(store_.extent(Piece::kGrads, i), buf.data.data());
  if (!t.is_ok()) return;  // the synchronous read in open() will meet the error and report it
  buf.ticket = *t;
  buf.reading = true;
  attach(pick, i);
  ++counts_.read_backs;
  ++counts_.read_aheads;
  counts_.read_bytes += round_page(store_.sub_group_size(i) * sizeof(float));
}

Status SpillAccumulator::read_done(int b) {
  Buffer& buf = buffers_[static_cast<std::size_t>(b)];
  ZINF_ASSERT(buf.reading);
  Status st = store_.swap()->wait(buf.ticket, options_.timeout);
  if (st.code() == Code::kTimeout) return fail(st);  // still in flight: keep the buffer
  buf.reading = false;
  // A failed read leaves the buffer undefined: the sub-group is on disk only.
  if (!st.is_ok()) detach(b);
  return fail(st);
}

Status SpillAccumulator::write(int b) {
  Buffer& buf = buffers_[static_cast<std::size_t>(b)];
  ZINF_ASSERT(buf.sub_group >= 0 && !buf.writing && !buf.reading);
  const auto i = static_cast<std::size_t>(buf.sub_group);
  const std::size_t count = store_.sub_group_size(i);
  sub_groups_[i].sumsq = leaf_sum_of_squares(buf);
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

void SpillAccumulator::reset_leaves(Buffer& buf, std::size_t count) {
  buf.leaves.clear();
  for_each_square_leaf(0, count, [&buf](std::size_t first, std::size_t leaf_count) {
    buf.leaves.push_back(Leaf{first, leaf_count, 0, 0.0, false});
  });
}

void SpillAccumulator::add_to(Buffer& buf, std::size_t at, std::size_t count, const float* src) {
  // A cache-sized block: added, then squared while it is still in L1.
  constexpr std::size_t kBlock = 4096;
  static_assert(kBlock % 4 == 0, "SquareLanes takes whole quads until the leaf's last piece");
  float* acc = buf.data.as<float>();
  const std::size_t end = at + count;
  // The leaf holding `at`: the last one starting at or before it.
  auto leaf = std::upper_bound(buf.leaves.begin(), buf.leaves.end(), at,
                               [](std::size_t v, const Leaf& l) { return v < l.first; });
  ZINF_ASSERT(leaf != buf.leaves.begin());
  --leaf;
  while (at < end) {
    ZINF_ASSERT(leaf != buf.leaves.end());
    Leaf& l = *leaf;
    const std::size_t leaf_end = l.first + l.count;
    const std::size_t hi = std::min(end, leaf_end);
    l.arrived += hi - at;
    if (at == l.first && hi == leaf_end && l.arrived == l.count) {
      // The whole leaf in this chunk, none of it before: add and square in one pass.
      SquareLanes lanes;
      for (std::size_t p = at; p < hi; p += kBlock) {
        const std::size_t q = std::min(hi, p + kBlock);
        add_floats(acc + p, src + (p - at), q - p);
        lanes.add(acc + p, q - p);
      }
      l.sumsq = lanes.total();
      l.valid = true;
    } else {
      add_floats(acc + at, src, hi - at);
      // Every element of the leaf has had its add since the buffer was last written: its sum of
      // squares is final unless another add touches it (which clears `valid` again).
      l.valid = l.arrived == l.count;
      if (l.valid) l.sumsq = square_leaf(acc + l.first, l.count);
    }
    src += hi - at;
    at = hi;
    ++leaf;
  }
  buf.dirty = true;
}

double SpillAccumulator::leaf_sum_of_squares(Buffer& buf) {
  const float* x = buf.data.as<const float>();
  std::size_t count = 0;
  for (Leaf& l : buf.leaves) {
    // Not every element arrived since the last write (an eviction, or a read-back's partial
    // sums): square it from the buffer now.
    if (!l.valid) l.sumsq = square_leaf(x + l.first, l.count);
    l.valid = true;
    l.arrived = 0;  // the next micro-batch's adds start counting again
    scratch_[count++] = l.sumsq;
  }
  if (count == 0) return 0.0;
  const double* next = scratch_.data();
  const double sum = fold_square_leaves(buf.leaves.back().first + buf.leaves.back().count, next);
  ZINF_ASSERT(next == scratch_.data() + count);
  return sum;
}

void SpillAccumulator::detach(int b) {
  Buffer& buf = buffers_[static_cast<std::size_t>(b)];
  ZINF_ASSERT(!buf.dirty && !buf.writing && !buf.reading);
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
  // Reads ahead that no chunk came for: nothing of this object stays in flight past here.
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    if (buffers_[b].reading) ZINF_RETURN_IF_ERROR(read_done(static_cast<int>(b)));
  }
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
