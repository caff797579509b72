#include "comm/collective_util.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace zinf {
namespace {

// f32 accumulators per tile: 2 KiB on the stack, a few L1 lines per source.
constexpr std::size_t kTileElements = 512;

void load_f32(const std::byte* src, DType dtype, std::size_t first, std::size_t count, float* out) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, src + first * 4, count * 4);
      return;
    case DType::kBF16:
      convert_bf16_to_f32(reinterpret_cast<const std::uint16_t*>(src) + first, out, count);
      return;
    case DType::kF16:
      convert_f16_to_f32(reinterpret_cast<const std::uint16_t*>(src) + first, out, count);
      return;
  }
}

void store_f32(const float* in, DType dtype, std::size_t first, std::size_t count, std::byte* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst + first * 4, in, count * 4);
      return;
    case DType::kBF16:
      convert_f32_to_bf16(in, reinterpret_cast<std::uint16_t*>(dst) + first, count);
      return;
    case DType::kF16:
      convert_f32_to_f16(in, reinterpret_cast<std::uint16_t*>(dst) + first, count);
      return;
  }
}

}  // namespace

Status GroupDepth::end(std::string_view comm_name) {
  if (depth_ == 0) {
    return Status::failed_precondition(
        fmt::format("{}: group_end() without a matching group_start()", comm_name));
  }
  --depth_;
  return Status::ok();
}

std::string describe_call(const Collective& op) {
  std::string text = fmt::format("{} of {} {}", collective_kind_name(op.kind), op.element_count,
                                 dtype_name(op.dtype));
  if (op.kind == CollectiveKind::kReduceScatter || op.kind == CollectiveKind::kAllReduce) {
    text += fmt::format(" ({})", reduce_op_name(op.op));
  }
  if (op.kind == CollectiveKind::kBroadcast) text += fmt::format(" (root {})", op.root);
  if (!op.name.empty()) text += fmt::format(" '{}'", op.name);
  return text;
}

bool collectives_agree(const Collective& a, const Collective& b) {
  const bool reduces =
      a.kind == CollectiveKind::kReduceScatter || a.kind == CollectiveKind::kAllReduce;
  // Two calls of the same shape may still be different collectives: a gather of module 'fc2'
  // on one rank and of 'fc1' on another move buffers of the same padded size. Their names tell
  // them apart where both ranks name the call.
  const bool names_agree = a.name.empty() || b.name.empty() || a.name == b.name;
  return a.kind == b.kind && a.element_count == b.element_count && a.dtype == b.dtype &&
         (!reduces || a.op == b.op) && (a.kind != CollectiveKind::kBroadcast || a.root == b.root) &&
         names_agree;
}

std::string describe_collective(const Collective& op, std::uint64_t sequence) {
  if (op.name.empty()) return fmt::format("{} #{}", collective_kind_name(op.kind), sequence);
  return fmt::format("{} #{} '{}'", collective_kind_name(op.kind), sequence, op.name);
}

Status validate_collective(const Collective& op, std::uint64_t sequence, int rank, int world_size,
                           std::string_view comm_name) {
  // Built only for an error: a valid call allocates nothing.
  const auto label = [&] { return describe_collective(op, sequence); };
  const std::size_t world = static_cast<std::size_t>(world_size);
  const std::size_t element_bytes = dtype_bytes(op.dtype);
  const std::size_t chunk_bytes = op.element_count * element_bytes;
  if (op.element_count > std::numeric_limits<std::size_t>::max() / (element_bytes * world)) {
    return Status::invalid_argument(
        fmt::format("{} on {}: element_count {} overflows", label(), comm_name, op.element_count));
  }
  std::size_t send_bytes = chunk_bytes;
  std::size_t recv_bytes = chunk_bytes;
  if (op.kind == CollectiveKind::kAllGather) recv_bytes = chunk_bytes * world;
  if (op.kind == CollectiveKind::kReduceScatter) send_bytes = chunk_bytes * world;
  const bool needs_send = op.kind != CollectiveKind::kBroadcast || op.root == rank;
  if (op.kind == CollectiveKind::kBroadcast && (op.root < 0 || op.root >= world_size)) {
    return Status::invalid_argument(fmt::format("{} on {}: root {} is not a rank of {}", label(),
                                                comm_name, op.root, world_size));
  }
  if (op.element_count == 0) return Status::ok();
  if ((needs_send && op.send == nullptr) || op.recv == nullptr) {
    return Status::invalid_argument(fmt::format("{} on {}: null {} buffer for {} elements", label(),
                                                comm_name, op.recv == nullptr ? "recv" : "send",
                                                op.element_count));
  }
  if (!needs_send) return Status::ok();
  const auto send = reinterpret_cast<std::uintptr_t>(op.send);
  const auto recv = reinterpret_cast<std::uintptr_t>(op.recv);
  if (send < recv + recv_bytes && recv < send + send_bytes) {
    // Overlap is allowed only in NCCL's in-place forms.
    const std::size_t own_offset = static_cast<std::size_t>(rank) * chunk_bytes;
    const bool in_place =
        (op.kind == CollectiveKind::kAllGather && send == recv + own_offset) ||
        (op.kind == CollectiveKind::kReduceScatter && recv == send + own_offset) ||
        ((op.kind == CollectiveKind::kAllReduce || op.kind == CollectiveKind::kBroadcast) &&
         send == recv);
    if (!in_place) {
      return Status::invalid_argument(
          fmt::format("{} on {}: send and recv buffers overlap and are not the in-place form",
                      label(), comm_name));
    }
  }
  return Status::ok();
}

void reduce_range(std::span<const std::byte* const> srcs, std::size_t src_first, std::byte* dst,
                  std::size_t dst_first, std::size_t count, DType dtype, ReduceOp op) {
  // One rank's sum, average, maximum or minimum of its own values in place: nothing to do.
  const std::size_t bytes = dtype_bytes(dtype);
  if (srcs.size() == 1 && srcs[0] + src_first * bytes == dst + dst_first * bytes) return;
  float acc[kTileElements];
  float next[kTileElements];
  const int world = static_cast<int>(srcs.size());
  for (std::size_t base = 0; base < count; base += kTileElements) {
    const std::size_t tile = std::min(kTileElements, count - base);
    load_f32(srcs[0], dtype, src_first + base, tile, acc);
    for (int r = 1; r < world; ++r) {
      // f32 sources are read in place; half types are widened into `next` first.
      const float* x = next;
      if (dtype == DType::kF32) {
        x = reinterpret_cast<const float*>(srcs[static_cast<std::size_t>(r)]) + src_first + base;
      } else {
        load_f32(srcs[static_cast<std::size_t>(r)], dtype, src_first + base, tile, next);
      }
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAverage:
          for (std::size_t i = 0; i < tile; ++i) acc[i] += x[i];
          break;
        case ReduceOp::kMax:
          // A NaN anywhere wins: a NaN acc is never replaced, a NaN input always is taken.
          for (std::size_t i = 0; i < tile; ++i) {
            if (x[i] > acc[i] || std::isnan(x[i])) acc[i] = x[i];
          }
          break;
        case ReduceOp::kMin:
          for (std::size_t i = 0; i < tile; ++i) {
            if (x[i] < acc[i] || std::isnan(x[i])) acc[i] = x[i];
          }
          break;
      }
    }
    if (op == ReduceOp::kAverage) {
      const float ranks = static_cast<float>(world);
      for (std::size_t i = 0; i < tile; ++i) acc[i] /= ranks;
    }
    store_f32(acc, dtype, dst_first + base, tile, dst);
  }
}

}  // namespace zinf
