// ZeroCounters: running totals the zero layer keeps (the coordinator's gathers and prefetches,
// the reducer's buckets and bytes, the spill's NVMe traffic). The engine copies them into the
// public EngineCounters (include/zinf/engine.hpp), whose fields of the same names they are, so
// the zero layer's internals are not tied to the public ABI.
//
// Thread-safety: written on the rank's thread only.
#pragma once

#include <cstdint>

namespace zinf {

struct ZeroCounters {
  std::uint64_t gathers = 0;
  std::uint64_t gathers_issued = 0;
  std::uint64_t prefetches_issued = 0;
  std::uint64_t prefetch_hits = 0;
  std::uint64_t prefetches_dropped = 0;
  std::uint64_t order_misses = 0;
  std::uint64_t live_elements = 0;
  std::uint64_t live_elements_peak = 0;
  std::uint64_t persistent_elements = 0;
  std::uint64_t all_gather_bytes = 0;
  std::uint64_t reduce_scatter_bytes = 0;
  std::uint64_t buckets_reduced = 0;
  std::uint64_t param_nvme_read_bytes = 0;
  std::uint64_t param_nvme_write_bytes = 0;
  std::uint64_t grad_spill_write_bytes = 0;
  std::uint64_t grad_spill_read_bytes = 0;
  std::uint64_t grad_spill_read_backs = 0;
  std::uint64_t grad_spill_evictions = 0;
};

}  // namespace zinf
