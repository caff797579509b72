#include "zinf/comm.hpp"

namespace zinf {

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

}  // namespace zinf
