#include "zinf/comm.hpp"

#include <cstddef>
#include <vector>

#include "comm/collective_util.hpp"

namespace zinf {

void reduce_host_pieces(const void* pieces, int world, std::size_t element_count, DType dtype,
                        ReduceOp op, void* out) {
  const auto* base = static_cast<const std::byte*>(pieces);
  std::vector<const std::byte*> srcs(static_cast<std::size_t>(world));
  for (std::size_t r = 0; r < srcs.size(); ++r) {
    srcs[r] = base + r * element_count * dtype_bytes(dtype);
  }
  reduce_range(srcs, 0, static_cast<std::byte*>(out), 0, element_count, dtype, op);
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAverage:
      return "average";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "unknown";
}

std::string_view collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kBroadcast:
      return "broadcast";
  }
  return "unknown";
}

// The constructors of backends this build leaves out: kUnsupported naming the build option.
#if !defined(ZINF_HAVE_MPI)
Result<std::unique_ptr<Communicator>> make_mpi_comm(Device&, const MpiCommOptions&) {
  return Status::unsupported(
      "make_mpi_comm: zinf was built without MPI (configure with -DZINF_WITH_MPI=ON where "
      "libopenmpi-dev is installed)");
}
Result<std::unique_ptr<Communicator>> make_mpi_comm(const void*, Device& device,
                                                    const MpiCommOptions& options) {
  return make_mpi_comm(device, options);
}
#endif

#if !defined(ZINF_BUILDS_NCCL)
Result<std::unique_ptr<Communicator>> make_nccl_comm(void*, Device&, bool) {
  return Status::unsupported(
      "make_nccl_comm: zinf was built without NCCL (configure with -DZINF_WITH_NCCL=ON where "
      "CUDA and NCCL are installed)");
}
Result<std::unique_ptr<Communicator>> make_nccl_comm(Device& device, const NcclCommOptions&) {
  return make_nccl_comm(nullptr, device, false);
}
#endif

}  // namespace zinf
