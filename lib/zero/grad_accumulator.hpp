// GradAccumulator: where GradReducer adds each reduced chunk of this rank's fp32 gradient
// partition (the groups' slices end to end, GradReducer's partition offsets).
//
// Two kinds:
//   MemoryAccumulator  the whole partition as one host-accessible float array (device memory
//                      for offload_optimizer "none", the StateStore's host kGrads array else);
//   SpillAccumulator   zinf.gradients_on_nvme: the StateStore's kGrads piece on NVMe, one extent
//                      per sub-group, with only buffer_count sub-group-sized host buffers.
//
// SpillAccumulator. GradReducer adds every partition element exactly once per micro-batch
// (reduce() covers each group's whole shard, padding included), so a sub-group that received
// sub_group_size elements since it was opened is complete for this micro-batch: its buffer is
// written to the sub-group's extent (asynchronously, through the SwapSpace) and becomes free once
// the write lands. A sub-group touched again later (the next micro-batch of the same step) is
// read back first; one not written since zero() starts from zeros without a read. When a chunk
// reaches a sub-group that was read back (or read ahead), the sub-group below it, backward's
// next, is read ahead into a buffer that is free or clean with its write landed (never an
// eviction, never a wait), so a read-back overlaps the adds into the sub-group above it. When every
// buffer holds an open sub-group, the least recently used one is evicted: its partial sums are
// written and read back when it is touched again. So memory stays buffer_count sub-groups
// whatever the order of the chunks; correctness never depends on the completion count (it only
// decides when a buffer is written early). Backward visits modules in reverse partition order,
// so normally one to three sub-groups are open at once.
//
// The norm. sum_of_squares(i) is the sum of x*x in double over sub-group i's elements as of its
// last write (computed from the buffer, so the step never reads the gradients back for the
// norm): each buffer keeps zinf::sum_of_squares's leaves (64 Ki-element tiles), a leaf is
// squared when its last element arrives (in the add's own pass when one chunk covers it), and
// the write folds the leaves in zinf::sum_of_squares's tree, so the bits are that function's. The
// engine adds those in sub-group order, and for the host kGrads array the same function over the
// same ranges in the same order, so a spilled and a non-spilled run of one config give the same
// bits.
//
// Thread-safety: add() runs on the reducer's stream (one thread, in issue order); flush(),
// zero() and the accessors from the rank's thread while no add() runs (after GradReducer::wait).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "base/aligned.hpp"
#include "io/swap_space.hpp"
#include "zero/zero_counters.hpp"
#include "zinf/status.hpp"

namespace zinf {

class StateStore;

// The sum of x * x in double over `count` floats, in tiles of fixed size summed in tile order, so
// the result does not depend on the thread count or scheduling (the same bits every run).
double sum_of_squares(const float* x, std::size_t count);

class GradAccumulator {
 public:
  virtual ~GradAccumulator() = default;
  // partition[first, first + count) += src[0, count).
  virtual Status add(std::size_t first, std::size_t count, const float* src) = 0;
  // Makes every sum added so far visible where the step reads it (spill: written to NVMe and
  // landed). Its first error, sticky.
  virtual Status flush() = 0;
  // Every element back to zero (spill: without any I/O).
  virtual void zero() = 0;
  // Host memory it holds (not counting a caller-owned array).
  virtual std::size_t host_bytes() const = 0;
};

// The partition as one caller-owned float array of `element_count` elements.
class MemoryAccumulator final : public GradAccumulator {
 public:
  MemoryAccumulator(float* data, std::size_t element_count)
      : data_(data), element_count_(element_count) {}
  Status add(std::size_t first, std::size_t count, const float* src) override;
  Status flush() override { return Status::ok(); }
  void zero() override;
  // partition[first, first + count) = src[0, count): a range's first sum since it was last
  // zeroed, without reading the old one.
  void assign(std::size_t first, std::size_t count, const float* src);
  std::size_t host_bytes() const override { return 0; }
  float* data() const { return data_; }

 private:
  float* data_;
  std::size_t element_count_;
};

struct SpillOptions {
  // Sub-group-sized host buffers (>= 1).
  std::size_t buffer_count = 4;
  // Read the next sub-group ahead in later micro-batches (off: every read-back synchronous, for
  // benchmarks to compare against).
  bool read_ahead = true;
  // Longest wait for one read or write.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
};

class SpillAccumulator final : public GradAccumulator {
 public:
  // REQUIRES: store.on_nvme(Piece::kGrads), its dtype f32; `store` outlives this object.
  // `counters` (optional) receives the grad_spill_* counts at each flush() and zero() (on the
  // rank's thread, so a reader of the counters never races the reduce stream).
  static Result<std::unique_ptr<SpillAccumulator>> create(StateStore& store,
                                                          const SpillOptions& options,
                                                          ZeroCounters* counters);
  ~SpillAccumulator() override;

  // Errors: the swap space's (naming the extent's key), sticky; after one, the kGrads pieces it
  // was writing are kLost in the store.
  Status add(std::size_t first, std::size_t count, const float* src) override;
  Status flush() override;
  void zero() override;
  std::size_t host_bytes() const override;

  // Sub-group i's sum of squares as of its last write since zero() (0 when none).
  // REQUIRES: after flush().
  double sum_of_squares(std::size_t i) const { return sub_groups_[i].sumsq; }
  // Read-backs started ahead of their sub-group's first chunk (counted in read_backs too), and
  // those a chunk then came for, since create().
  std::uint64_t read_ahead_count() const { return counts_.read_aheads; }
  std::uint64_t read_ahead_hit_count() const { return counts_.read_ahead_hits; }
  // Sub-groups open in a buffer now.
  std::size_t open_count() const;

 private:
  enum class Where : std::uint8_t {
    kZero,    // all zeros: nothing written since zero()
    kBuffer,  // in buffers_[buffer] (a write of it may be in flight)
    kDisk,    // only on NVMe
  };
  struct SubGroup {
    Where where = Where::kZero;
    int buffer = -1;
    std::size_t arrived = 0;  // elements added since it was last complete
    double sumsq = 0.0;
  };
  // One leaf of sum_of_squares's reduction tree over the buffer's sub-group (offsets in it).
  struct Leaf {
    std::size_t first = 0, count = 0;
    std::size_t arrived = 0;  // elements added since the buffer was last written
    double sumsq = 0.0;       // the leaf's value, when valid
    bool valid = false;       // sumsq is of the buffer as it is now
  };
  struct Buffer {
    AlignedBuffer data;
    std::vector<Leaf> leaves;
    long sub_group = -1;  // -1: free
    bool dirty = false;   // holds sums not yet written
    bool writing = false;
    bool reading = false;  // a read ahead in flight (never together with writing)
    SwapTicket ticket;
    std::uint64_t last_use = 0;
  };

  SpillAccumulator(StateStore& store, const SpillOptions& options, ZeroCounters* counters)
      : store_(store), options_(options), counters_(counters) {}
  // Ends buffer b's write, if any, whatever it takes (wait; cancel and wait; abandon), so the
  // buffer can be reused or freed. Errors become the sticky status.
  void settle(int b);
  // Puts sub-group i into a buffer (zeros or read back), returns its index.
  Result<int> open(std::size_t i);
  // A buffer for a new sub-group: a free one, else one holding a clean sub-group (waiting for
  // its write), else the least recently used open one written out (an eviction).
  Result<int> take_buffer();
  // The first buffer holding no sub-group, or -1.
  int free_buffer() const;
  // Puts sub-group i in buffer b, clean, with its leaves laid out afresh and b the most recently
  // used.
  void attach(int b, std::size_t i);
  // Starts reading sub-group i (on disk) into a buffer, if one is free or clean with its write
  // landed; otherwise, or on a submit error, does nothing (open() reads it when it comes).
  void read_ahead(std::size_t i);
  // Waits for buffer b's read ahead; a failed one leaves its sub-group on disk only.
  Status read_done(int b);
  // Submits the write of buffer b's sub-group.
  Status write(int b);
  // Waits for buffer b's write; on success its sub-group's disk copy is current.
  Status write_done(int b);
  // Lays out buffer b's leaves for a sub-group of `count` elements, none summed.
  void reset_leaves(Buffer& buf, std::size_t count);
  // buf's sub-group [at, at + count) += src; a leaf whose every element has now arrived gets its
  // sum of squares, in the same pass as the add when the chunk covers it whole.
  void add_to(Buffer& buf, std::size_t at, std::size_t count, const float* src);
  // zinf::sum_of_squares over buf's sub-group, to the bit, from the leaves' sums (squaring only
  // leaves not summed since their last add). Starts the leaves' arrival counts again.
  double leaf_sum_of_squares(Buffer& buf);
  // Detaches buffer b (its sub-group must be clean): the sub-group is on disk only.
  void detach(int b);
  Status fail(Status st);
  Status flush_all();

  // Totals since create(), kept here on the reduce stream and copied to counters_ by
  // publish_counts().
  struct Counts {
    std::uint64_t write_bytes = 0, read_bytes = 0, read_backs = 0, evictions = 0;
    std::uint64_t read_aheads = 0, read_ahead_hits = 0;  // not in ZeroCounters (yet)
  };
  void publish_counts();

  StateStore& store_;
  SpillOptions options_;
  ZeroCounters* counters_;
  Counts counts_;
  std::vector<SubGroup> sub_groups_;
  std::vector<Buffer> buffers_;
  std::vector<double> scratch_;           // leaf values for leaf_sum_of_squares, sized at create()
  std::vector<AlignedBuffer> abandoned_;  // buffers of writes given up on (settle)
  std::size_t buffer_bytes_ = 0;
  std::uint64_t clock_ = 0;
  bool read_ahead_next_ = false;  // open() read a sub-group back, or met one read ahead
  Status status_;
};

}  // namespace zinf
