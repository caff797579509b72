// The planner: for given memory budgets, the placement that fits with headroom and has the
// lowest predicted step time; when nothing fits, which tier is short and by how much; and how
// many GPUs the same job would need with everything on the GPUs.
//
// Search: every ZeRO stage (1, 2, 3), optimizer state on device / host / NVMe, half params
// (stage 3) on device / host / NVMe, gradients on the host or spilled to NVMe (optimizer on
// NVMe), and for state on NVMe the sub-group size (2^22 .. 2^28 parameters) and buffer count
// (3, 4, 6, 8: read i+1, update i and write i-1 need three). Bucket and prefetch sizes follow
// DeepSpeed's recipe for `auto` in its Hugging Face integration: reduce_bucket_size = h²,
// stage3_prefetch_bucket_size = 0.9·h², stage3_param_persistence_threshold = 10·h;
// stage3_max_live_parameters = two layers or the largest tensor, whichever is more. A candidate
// fits when, per rank, device bytes ≤ (1 − headroom)·gpu_mem, and per machine host bytes ≤ (1 −
// headroom)·host_mem and NVMe bytes ≤ (1 − headroom)·nvme_capacity. Among those that fit the lowest
// predicted step time wins; times within 1% count as equal and then the one with less offloaded
// (then the lower stage) wins.
//
// No-offload comparison: ZeRO-3 with everything on the device needs, per GPU,
//   18·P / N  (2 half params + 4 fp32 gradient accumulator + 12 fp32 master, m, v, per
//              parameter: the engine accumulates gradients in fp32, where the ZeRO paper's
//              16 B keeps them in half precision)
//   + fixed   (activations + gathered params + comm buckets + reserved)
// ≤ (1 − headroom)·gpu_mem, so N = ceil(18·P / ((1 − headroom)·gpu_mem − fixed)). With frozen
// parameters (T of P trainable) the state is DeepSpeed's for them, 18·T + 2·(P − T): a frozen
// parameter keeps its 16-bit weight only (no fp32 master, optimizer state or gradient).
// Gradients spilled to NVMe are not searched with frozen parameters (the engine refuses them).
//
// Thread-safety: values and pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "plan/estimate.hpp"
#include "plan/model.hpp"
#include "plan/time_model.hpp"
#include "zinf/status.hpp"

namespace zinf::plan {

struct Budgets {
  std::uint64_t gpus = 1;              // GPUs in the job (= ranks)
  std::uint64_t gpus_per_machine = 0;  // 0: all GPUs on one machine
  std::uint64_t gpu_mem_bytes = 0;     // per GPU
  std::uint64_t host_mem_bytes = 0;    // per machine
  std::uint64_t nvme_bytes = 0;        // per machine (0: no NVMe)
  double headroom = 0.10;              // fraction of each budget left unplanned
};

// Choices the user fixed (zinf plan --stage, --offload-optimizer, --offload-param); the planner
// searches only the rest.
struct PlanConstraints {
  std::optional<int> stage;
  std::optional<OffloadDevice> optimizer;
  std::optional<OffloadDevice> params;
  std::optional<std::uint64_t> sub_group_params;
  std::optional<std::uint64_t> buffer_count;
  // Whether gradients may spill to NVMe (the engine accepts the key but keeps gradients in host
  // memory in this version).
  bool allow_gradient_spill = true;
  // zinf.overlap_step and the part of the compute its optimizer pass hides behind
  // (EngineSetup, time_model.hpp).
  bool overlap_step = true;
  double overlap_compute_fraction = 2.0 / 3.0;
  // EngineSetup::exact_clipping_or_loss_scaling: the config clips exactly or scales the loss.
  bool exact_clipping_or_loss_scaling = false;
  // zinf.device_reserved_bytes: device memory each GPU leaves to the runtime (CUDA context,
  // cuBLAS workspace, allocator slack) in every placement; EngineSetup's 1 GiB by default.
  std::uint64_t device_reserved_bytes = EngineSetup{}.device_reserved_bytes;
};

struct TierUse {
  MemoryTier tier = MemoryTier::kDevice;
  std::uint64_t need_bytes = 0;    // per rank for the device, per machine otherwise
  std::uint64_t budget_bytes = 0;  // the same unit
  std::uint64_t usable_bytes = 0;  // budget less headroom
  bool fits() const { return need_bytes <= usable_bytes; }
  std::uint64_t shortfall_bytes() const { return fits() ? 0 : need_bytes - usable_bytes; }
};

struct Candidate {
  EngineSetup setup;
  MemoryEstimate memory;
  StepPrediction time;
  std::array<TierUse, kMemoryTierCount> use{};
  bool fits() const;
};

struct NoOffloadComparison {
  std::uint64_t state_bytes = 0;       // 18·P (18·T + 2·(P − T) with frozen parameters)
  std::uint64_t usable_bytes = 0;      // (1 − headroom)·gpu_mem
  std::uint64_t fixed_bytes = 0;       // activations + gathered + buckets + reserved
  std::uint64_t activation_bytes = 0;  // the parts of fixed_bytes
  std::uint64_t gathered_bytes = 0;
  std::uint64_t bucket_bytes = 0;
  std::uint64_t reserved_bytes = 0;
  std::uint64_t gpus_needed = 0;  // 0 when fixed_bytes alone exceed usable_bytes
  std::string arithmetic;         // the sum written out, one line
};

// A tier that no placement fits, and by how much.
struct Shortfall {
  MemoryTier tier = MemoryTier::kDevice;
  std::uint64_t need_bytes = 0;  // the least any placement needs (see `every_placement`)
  std::uint64_t usable_bytes = 0;
  std::uint64_t budget_bytes = 0;
  // True: every placement needs at least need_bytes here, whatever the other tiers hold.
  // False: only placements that fit the other tiers were counted; more of this tier makes the
  // plan fit.
  bool every_placement = false;
  std::uint64_t shortfall_bytes() const { return need_bytes - usable_bytes; }
};

struct PlanResult {
  bool fits = false;
  // When nothing fits: the short tiers (see Shortfall), least short first. Empty when each
  // tier fits some placement alone and no placement fits all but one; then `best` tells.
  std::vector<Shortfall> shortfalls;
  // The chosen candidate when fits; otherwise the candidate closest to fitting (least total
  // relative shortfall), whose `use` says which tiers are short.
  Candidate best;
  NoOffloadComparison no_offload;
  std::uint64_t candidates_considered = 0;
  std::uint64_t candidates_fitting = 0;
};

// Sets bucket, prefetch and persistence sizes from the model (DeepSpeed's `auto` recipe above).
void size_buckets(const ModelShape& model, EngineSetup* setup);

// Checks `setup` against `budgets`: bytes per tier, fits, shortfalls.
Candidate evaluate(const ModelShape& model, const TrainingShape& training, const EngineSetup& setup,
                   const Budgets& budgets, const MachineProfile& profile);

// `device_reserved_bytes`: the reserve each GPU keeps (zinf.device_reserved_bytes).
NoOffloadComparison no_offload_gpus(
    const ModelShape& model, const TrainingShape& training, const Budgets& budgets,
    std::uint64_t device_reserved_bytes = EngineSetup{}.device_reserved_bytes);

// Fails with invalid_argument for budgets that make no sense (no GPUs, no GPU memory, GPUs not a
// multiple of gpus_per_machine) or constraints that contradict each other; otherwise returns a
// result whether or not anything fits.
Result<PlanResult> make_plan(const ModelShape& model, const TrainingShape& training,
                             const Budgets& budgets, const MachineProfile& profile,
                             const PlanConstraints& constraints = {});

// For a plan that does not fit: "nothing fits", then one line per short tier, "<tier> is short
// by <bytes>: ..." with the least it needs and what is usable; "" when the plan fits. A device
// short in every placement also names what of the fixed part could close the gap: the
// activations and the runtime reserve, each when it is the larger of the two or alone at least
// the shortfall, larger first.
std::string shortfall_message(const PlanResult& result);

}  // namespace zinf::plan
