// What the host-memory Communicators (LocalComm, MpiComm) share: the argument checks, the
// reduction, so that both give the same bits: f32 accumulators in rank order
// (((x0 + x1) + x2) ...), rounded once to the dtype; and the group_start/end bookkeeping.
//
// Thread-safety: the functions are pure functions of their arguments; GroupDepth is a value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/comm.hpp"
#include "zinf/dtype.hpp"

namespace zinf {

// group_start() / group_end() of the communicators whose grouping is only checked (LocalComm,
// MpiComm: their collectives are matched by issue order, grouped or not): groups nest, and an
// end without a start is kFailedPrecondition naming the communicator.
// Thread-safety: none; the communicator calls it under its issue lock.
class GroupDepth {
 public:
  Status start() {
    ++depth_;
    return Status::ok();
  }
  Status end(std::string_view comm_name);

 private:
  int depth_ = 0;
};

// "all_gather #12 'layers.3'": the collective's kind, its sequence number on the communicator and
// its name, for errors.
std::string describe_collective(const Collective& op, std::uint64_t sequence);

// "broadcast of 4 f32 (root 1) 'layers.3'": what a rank asked for, for the messages of ranks that
// disagree. The reduction is named for reduce_scatter and all_reduce, the root for broadcast.
std::string describe_call(const Collective& op);

// Whether two ranks' calls are the same collective as NCCL requires: the same kind, element count
// and dtype, the same reduction where it reduces and the same root where it broadcasts; and, where
// both calls carry a name, the same name (as far as each transport keeps it).
bool collectives_agree(const Collective& a, const Collective& b);

// Checks a collective's arguments as every backend must: an element count that overflows, a
// broadcast root outside [0, world_size), null buffers, or send and recv ranges that overlap
// other than in NCCL's in-place forms are kInvalidArgument naming the collective (as
// describe_collective(op, sequence) does) and `comm_name`. Allocates only to report an error.
Status validate_collective(const Collective& op, std::uint64_t sequence, int rank, int world_size,
                           std::string_view comm_name);

// dst[dst_first + i] = op over r in rank order of srcs[r][src_first + i], for i in [0, count),
// accumulated in f32 and rounded once (kAverage divides the f32 sum by srcs.size()). NaN wins for
// kMax and kMin. Each tile is read in full before it is written, so dst may be one of the sources;
// one source that is dst itself (one rank, in place) is its own result and is left as it is.
// REQUIRES: !srcs.empty().
void reduce_range(std::span<const std::byte* const> srcs, std::size_t src_first, std::byte* dst,
                  std::size_t dst_first, std::size_t count, DType dtype, ReduceOp op);

}  // namespace zinf
