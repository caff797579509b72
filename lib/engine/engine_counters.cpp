#include "engine/engine_counters.hpp"

namespace zinf {

void copy_engine_counters(const ZeroCounters& z, std::uint64_t steps, std::uint64_t skipped_steps,
                          EngineCounters& c) {
  c.gathers = z.gathers;
  c.gathers_issued = z.gathers_issued;
  c.prefetches_issued = z.prefetches_issued;
  c.prefetch_hits = z.prefetch_hits;
  c.prefetches_dropped = z.prefetches_dropped;
  c.order_misses = z.order_misses;
  c.live_elements = z.live_elements;
  c.live_elements_peak = z.live_elements_peak;
  c.persistent_elements = z.persistent_elements;
  c.all_gather_bytes = z.all_gather_bytes;
  c.reduce_scatter_bytes = z.reduce_scatter_bytes;
  c.buckets_reduced = z.buckets_reduced;
  c.param_nvme_read_bytes = z.param_nvme_read_bytes;
  c.param_nvme_write_bytes = z.param_nvme_write_bytes;
  c.steps = steps;
  c.skipped_steps = skipped_steps;
  c.grad_spill_write_bytes = z.grad_spill_write_bytes;
  c.grad_spill_read_bytes = z.grad_spill_read_bytes;
  c.grad_spill_read_backs = z.grad_spill_read_backs;
  c.grad_spill_evictions = z.grad_spill_evictions;
}

}  // namespace zinf
