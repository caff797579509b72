// Helpers shared by the tier tests: a scratch directory, a whole tiered setup (engine, swap
// space, store, pool, pipeline), and the in-memory reference run the stored state is checked
// against.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "device/pinned_pool.hpp"
#include "io/fault.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "tier/optimizer_pipeline.hpp"
#include "tier/state_store.hpp"

namespace zinf::tier_test {

// A fresh directory under $ZINF_TEST_TMPDIR (or /tmp), removed with its files on destruction.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& name);
  ~ScratchDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct RigOptions {
  StateStoreOptions store;
  std::size_t pool_blocks = 3;
  std::size_t io_block_bytes = 64 << 10;  // engine pieces and swap checksum blocks
  EngineKind engine = EngineKind::kAuto;
  std::shared_ptr<FaultInjector> faults = nullptr;
  PipelineOptions pipeline;
  // The swap directory; "" for a fresh scratch directory.
  std::string swap_dir;
  // With swap_dir "": how many fresh directories (under the scratch directory) the swap space
  // stripes over.
  std::size_t swap_dir_count = 1;
  // The engine's pieces in flight per ring, and IoOptions::max_requests.
  std::uint32_t io_queue_depth = 16;
  std::uint32_t io_max_requests = IoOptions{}.max_requests;
};

// The frozen-parameter layout the frozen tests share: 8 sub-groups of `sub` AdamW elements on
// the piece tiers `tiers`, sub-groups 2-4 and 7 frozen (kFrozenSubGroups): parameter group 1
// (lr 0, weight decay 0) over them, group 0 (lr 1e-2, weight decay 0.1) over the others, as the
// engine's param_groups give a frozen parameter; `threads` pipeline threads.
inline const std::vector<bool> kFrozenSubGroups = {false, false, true,  true,
                                                   true,  false, false, true};
RigOptions frozen_rig_options(std::size_t sub, const std::array<StoreMedium, kPieceCount>& tiers,
                              int threads);

// Everything one tiered optimizer needs, opened in order; `ok` false with a message on failure.
struct Rig {
  std::unique_ptr<ScratchDir> dir;
  std::unique_ptr<IoEngine> engine;
  std::unique_ptr<SwapSpace> swap;
  std::unique_ptr<StateStore> store;
  std::unique_ptr<PinnedPool> pool;
  std::unique_ptr<OptimizerPipeline> pipeline;
  // Destroyed in reverse: pipeline (no lease outlives it), pool (unregisters from the engine),
  // store, swap space, engine, directory.
};
Status open_rig(const std::string& name, const RigOptions& options, Rig* setup);

struct Reference;
// open_rig(), then the seeded reference every test starts from, loaded into the store:
// ref->init(param_count, seed), ref->make_grads(options.store.grad_dtype, grads_seed) unless
// grads_seed is 0 (the test makes its gradients per step), load_store().
Status open_loaded_rig(const std::string& name, const RigOptions& options, std::uint64_t seed,
                       std::uint64_t grads_seed, Rig* setup, Reference* ref);

// The whole partition's state in memory, as one would hold it without any tiering: the
// reference the store is compared with, bit for bit.
struct Reference {
  std::size_t count = 0;
  std::vector<float> params, exp_avg, exp_avg_sq;
  std::vector<std::uint16_t> half;
  std::vector<std::byte> grads;  // count * dtype bytes

  // Seeded random state, never zeros: params in [-1, 1), exp_avg in [-0.1, 0.1), exp_avg_sq in
  // [1e-4, 1e-2), half random bits of finite values.
  void init(std::size_t param_count, std::uint64_t seed);
  // New random gradients of `dtype` for a step.
  void make_grads(DType dtype, std::uint64_t seed);
  // One optimizer_step over the whole partition, in memory.
  void step(const OptimizerParams& hp, const StateStoreOptions& store, std::int64_t t,
            float grad_scale);
};

// Copies the reference's state (and its gradients, once made) into every piece of the store.
Status load_store(StateStore& store, const Reference& ref);
// Copies the reference's gradients into the store's grads pieces.
Status load_grads(StateStore& store, const Reference& ref);

// Compares sub-group i of every piece the step writes (params, moments, half) with `ref` (a half
// piece on the block tier is not kept by the store, so not compared here).
// Returns "" when all equal bit for bit, else what differs; a read error is returned as
// "read error: <status>".
std::string compare_sub_group(StateStore& store, std::size_t i, const Reference& ref);
// compare_sub_group() for every sub-group: "" when all equal, else "sg <i>: <what differs>" for
// each that does not.
std::string compare_all(StateStore& store, const Reference& ref);

}  // namespace zinf::tier_test
