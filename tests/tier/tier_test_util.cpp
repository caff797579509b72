#include "tier_test_util.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "base/aligned.hpp"
#include "base/random.hpp"
#include "zinf/dtype.hpp"
#include "zinf/optim.hpp"

namespace zinf::tier_test {

ScratchDir::ScratchDir(const std::string& name) {
  const char* root = std::getenv("ZINF_TEST_TMPDIR");
  const std::string base = root != nullptr && root[0] != '\0' ? root : "/tmp";
  path_ = base + "/tier-" + name + "-" + std::to_string(::getpid());
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

ScratchDir::~ScratchDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

Status open_rig(const std::string& name, const RigOptions& options, Rig* s) {
  s->dir = std::make_unique<ScratchDir>(name);
  IoOptions io;
  io.kind = options.engine;
  io.block_bytes = options.io_block_bytes;
  io.queue_depth = options.io_queue_depth;
  io.max_requests = options.io_max_requests;
  io.faults = options.faults;
  ZINF_ASSIGN_OR_RETURN(s->engine, open_engine(io));
  // Room for every NVMe piece of the partition, each sub-group's rounded to pages (the store's
  // own count, as the engine sizes its swap space), and 8 MiB more. Every byte of it is
  // allocated on disk: a bound of a page per 64 parameters took 2 GiB for 6M parameters and
  // failed on a machine with 2 GB free.
  const StateStoreOptions& so = options.store;
  ZINF_ASSIGN_OR_RETURN(const StoreLayout layout, StateStore::layout(so));
  SwapOptions swap;
  swap.dirs = {options.swap_dir.empty() ? s->dir->path() : options.swap_dir};
  if (options.swap_dir.empty() && options.swap_dir_count > 1) {
    swap.dirs.clear();
    for (std::size_t d = 0; d < options.swap_dir_count; ++d) {
      swap.dirs.push_back(fmt::format("{}/swap{}", s->dir->path(), d));
      std::filesystem::create_directories(swap.dirs.back());
    }
  }
  swap.block_bytes = options.io_block_bytes;
  swap.capacity_bytes = layout.nvme_bytes + (std::uint64_t{8} << 20);
  // Striped, each extent's share of each directory is whole blocks: up to a block more per
  // extent and directory.
  if (swap.dirs.size() > 1) {
    swap.capacity_bytes += (layout.nvme_extents + 4) * options.io_block_bytes * swap.dirs.size();
  }
  swap.max_ops = 64;
  ZINF_ASSIGN_OR_RETURN(s->swap, SwapSpace::open(*s->engine, swap));
  ZINF_ASSIGN_OR_RETURN(s->store, StateStore::open(so, s->swap.get()));
  if (s->store->block_bytes() > 0) {
    PinnedPoolOptions pool;
    pool.block_bytes = (s->store->block_bytes() + 4095) / 4096 * 4096;
    pool.block_count = options.pool_blocks;
    pool.huge_pages = HugePages::kNone;  // small test pools: leave the huge pages to others
    ZINF_ASSIGN_OR_RETURN(s->pool, PinnedPool::create(pool));
    ZINF_RETURN_IF_ERROR(s->pool->register_with(*s->engine));
  }
  PipelineOptions po = options.pipeline;
  po.optimizer.kind = so.optimizer;
  ZINF_ASSIGN_OR_RETURN(s->pipeline, OptimizerPipeline::open(*s->store, s->pool.get(), po));
  return Status::ok();
}

void Reference::init(std::size_t param_count, std::uint64_t seed) {
  count = param_count;
  params.resize(count);
  exp_avg.resize(count);
  exp_avg_sq.resize(count);
  half.resize(count);
  fill_uniform(params.data(), count, seed, -1.0f, 1.0f);
  fill_uniform(exp_avg.data(), count, seed + 1, -0.1f, 0.1f);
  fill_uniform(exp_avg_sq.data(), count, seed + 2, 1e-4f, 1e-2f);
  for (std::size_t i = 0; i < count; ++i) half[i] = f32_to_bf16(-params[i]);
}

void Reference::make_grads(DType dtype, std::uint64_t seed) {
  std::vector<float> g(count);
  fill_uniform(g.data(), count, seed, -1.0f, 1.0f);
  grads.resize(count * dtype_bytes(dtype));
  if (dtype == DType::kF32) {
    std::memcpy(grads.data(), g.data(), grads.size());
  } else if (dtype == DType::kBF16) {
    convert_f32_to_bf16(g.data(), reinterpret_cast<std::uint16_t*>(grads.data()), count);
  } else {
    convert_f32_to_f16(g.data(), reinterpret_cast<std::uint16_t*>(grads.data()), count);
  }
}

void Reference::step(const OptimizerParams& hp, const StateStoreOptions& store, std::int64_t t,
                     float grad_scale) {
  OptimizerSpan span;
  span.params = params.data();
  span.exp_avg = store.optimizer != OptimizerKind::kAdagrad ? exp_avg.data() : nullptr;
  span.exp_avg_sq = store.optimizer != OptimizerKind::kLion ? exp_avg_sq.data() : nullptr;
  span.grads = grads.data();
  span.grad_dtype = store.grad_dtype;
  span.params_half = store.with_half ? half.data() : nullptr;
  span.half_dtype = store.half_dtype;
  span.count = count;
  StepOptions options;
  options.step = t;
  options.grad_scale = grad_scale;
  // A different thread count and tile than the pipeline's: the result must not depend on them.
  options.threads = 1;
  options.tile_elements = 3000;
  Result<StepResult> r = optimizer_step(hp, span, options);
  ZINF_ASSERT_MSG(r.is_ok(), "reference optimizer_step failed");
}

namespace {

const void* ref_data(const Reference& ref, Piece piece, std::size_t first, DType dtype) {
  const std::size_t at = first * dtype_bytes(dtype);
  switch (piece) {
    case Piece::kParams:
      return reinterpret_cast<const std::byte*>(ref.params.data()) + at;
    case Piece::kExpAvg:
      return reinterpret_cast<const std::byte*>(ref.exp_avg.data()) + at;
    case Piece::kExpAvgSq:
      return reinterpret_cast<const std::byte*>(ref.exp_avg_sq.data()) + at;
    case Piece::kGrads:
      return ref.grads.data() + at;
    case Piece::kParamsHalf:
      return reinterpret_cast<const std::byte*>(ref.half.data()) + at;
  }
  return nullptr;
}

Status load_piece(StateStore& store, const Reference& ref, Piece piece) {
  for (std::size_t i = 0; i < store.sub_group_count(); ++i) {
    const std::size_t bytes = store.piece_bytes(piece, i);
    AlignedBuffer buffer((bytes + 4095) / 4096 * 4096, 4096);
    std::memset(buffer.data(), 0, buffer.bytes());
    std::memcpy(buffer.data(), ref_data(ref, piece, store.sub_group_first(i), store.dtype(piece)),
                bytes);
    ZINF_RETURN_IF_ERROR(store.write_piece(piece, i, buffer.data()));
  }
  return Status::ok();
}

}  // namespace

Status load_store(StateStore& store, const Reference& ref) {
  for (std::size_t p = 0; p < kPieceCount; ++p) {
    const auto piece = static_cast<Piece>(p);
    if (piece == Piece::kGrads && ref.grads.empty()) continue;  // load_grads() puts them later
    if (!store.has(piece) || store.tier(piece) == StoreMedium::kBlock)
      continue;  // not kept: no state
    ZINF_RETURN_IF_ERROR(load_piece(store, ref, piece));
  }
  return Status::ok();
}

Status load_grads(StateStore& store, const Reference& ref) {
  return load_piece(store, ref, Piece::kGrads);
}

std::string compare_sub_group(StateStore& store, std::size_t i, const Reference& ref) {
  std::string out;
  for (std::size_t p = 0; p < kPieceCount; ++p) {
    const auto piece = static_cast<Piece>(p);
    if (!store.has(piece) || piece == Piece::kGrads) continue;
    if (store.tier(piece) == StoreMedium::kBlock)
      continue;  // handed over, not kept: the test checks it
    const std::size_t bytes = store.piece_bytes(piece, i);
    AlignedBuffer buffer((bytes + 4095) / 4096 * 4096, 4096);
    Status status = store.read_piece(piece, i, buffer.data());
    if (!status.is_ok()) return "read error: " + status.to_string();
    const auto* expect = static_cast<const std::byte*>(
        ref_data(ref, piece, store.sub_group_first(i), store.dtype(piece)));
    if (std::memcmp(buffer.data(), expect, bytes) != 0) {
      std::size_t at = 0;
      while (buffer.data()[at] == expect[at]) ++at;
      out += fmt::format("{} differs at byte {}; ", piece_name(piece), at);
    }
  }
  return out;
}

std::string compare_all(StateStore& store, const Reference& ref) {
  std::string out;
  for (std::size_t i = 0; i < store.sub_group_count(); ++i) {
    const std::string diff = compare_sub_group(store, i, ref);
    if (!diff.empty()) out += fmt::format("sg {}: {}\n", i, diff);
  }
  return out;
}

RigOptions frozen_rig_options(std::size_t sub, const std::array<StoreMedium, kPieceCount>& tiers,
                              int threads) {
  RigOptions so;
  so.store.param_count = kFrozenSubGroups.size() * sub;
  so.store.sub_group_params = sub;
  so.store.optimizer = OptimizerKind::kAdamW;
  so.store.tiers = tiers;
  OptimizerParams trained;
  trained.kind = OptimizerKind::kAdamW;
  trained.lr = 1e-2;
  trained.weight_decay = 0.1;
  OptimizerParams still = trained;
  still.lr = 0.0;
  still.weight_decay = 0.0;
  so.pipeline.optimizer = trained;
  so.pipeline.groups = {trained, still};
  so.pipeline.ranges = {{0, 0}, {2 * sub, 1}, {5 * sub, 0}, {7 * sub, 1}};
  so.pipeline.frozen_sub_groups = kFrozenSubGroups;
  so.pipeline.threads = threads;
  return so;
}

Status open_loaded_rig(const std::string& name, const RigOptions& options, std::uint64_t seed,
                       std::uint64_t grads_seed, Rig* setup, Reference* ref) {
  ZINF_RETURN_IF_ERROR(open_rig(name, options, setup));
  ref->init(options.store.param_count, seed);
  if (grads_seed != 0) ref->make_grads(options.store.grad_dtype, grads_seed);
  return load_store(*setup->store, *ref);
}

}  // namespace zinf::tier_test
