// The machine profile the time model reads: where it is kept, which keys it needs, and how to
// measure the missing figures now.
//
// A profile is one JSON object. The planner reads these keys and ignores the rest, so the
// output of `zinf probe --json` is a valid profile, and `zinf io tune` can add its results:
//   mem_adam_pattern_gbps   the fp32 Adam access pattern's bandwidth (zinf probe)
//   cpu_cores               (zinf probe)
//   nvme_read_gbps, nvme_write_gbps    NVMe rates at the engine's block size and depth
//   nvme_duplex_gbps    bytes read + written per second with reads and writes at once (0 or
//                       absent: unknown, the drive is taken to share one budget between them)
//   io: {"read_gbps": R, "write_gbps": W}   the same, as a section
//   io: {"results": [{"block_bytes": B, "queue_depth": D, "read_gbps": R, "write_gbps": W},
//        ...]}          a sweep: the entry at the engine's block size and depth is used when
//                       there is one, else the best read and the best write
//   points: [{"op": "read"|"write", "block_bytes": B, "queue_depth": D, "gbps": G}, ...],
//   best: {"read": {"block_bytes": B, "queue_depth": D, "gbps": G}, "write": {...}}
//                       what `zinf io tune` saves (default $ZINF_IO_TUNE_FILE, else
//                       ~/.cache/zinf/io-tune.json): the best read's block size and depth,
//                       which the plan then uses (aio.block_size, aio.queue_depth), its read
//                       rate, and the best write rate at that block size and depth
//   h2d_gbps, gpu_mem_gbps, gpu_tflops, gpu_link_gbps   GPU figures, when measured
// Rates are GB/s (1e9 bytes/s).
//
// Default location: $ZINF_MACHINE_PROFILE, else $XDG_CACHE_HOME/zinf/machine.json, else
// $HOME/.cache/zinf/machine.json.
// Thread-safety: functions; the measurements must not overlap other heavy work in time.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "plan/time_model.hpp"
#include "zinf/status.hpp"

namespace zinf::plan {

std::string default_profile_path();
// Where `zinf io tune` saves its sweep: $ZINF_IO_TUNE_FILE, else $XDG_CACHE_HOME/zinf/io-tune.json,
// else $HOME/.cache/zinf/io-tune.json.
std::string default_io_tune_path();

// Reads the keys above from the JSON text into `profile`, leaving fields the text does not
// have as they are; `source` names the file in profile->*_source. `io_block_bytes` and
// `io_queue_depth` pick the io tune entry. invalid_argument naming the key on a bad value.
Status parse_machine_profile(std::string_view text, const std::string& source,
                             std::uint64_t io_block_bytes, std::uint64_t io_queue_depth,
                             MachineProfile* profile);

// Reads `path` with parse_machine_profile(); not_found when the file does not exist.
Status load_machine_profile(const std::string& path, std::uint64_t io_block_bytes,
                            std::uint64_t io_queue_depth, MachineProfile* profile);

// Writes the measured figures of `profile` (the keys above, those that are nonzero) into the
// JSON object at `path`, keeping its other keys, creating the file and its directory if needed.
// io_error naming the path on failure; invalid_argument when the file is not a JSON object.
Status save_machine_profile(const std::string& path, const MachineProfile& profile);

// Bandwidth of the CPU Adam's access pattern with the half copy (read g; read and write p, m,
// v; write the half params: 30 B an element), `bytes_per_stream` per stream, all cores, median
// of `reps` passes after a warm-up. GB/s.
double measure_adam_gbps(std::uint64_t bytes_per_stream, int reps);

struct DiskRates {
  double read_gbps = 0;
  double write_gbps = 0;
  double duplex_gbps = 0;  // bytes read + written per second with both running at once
};

// Sequential write, then read, then both at once (half the ops each) of `file_bytes` in a swap
// space under `dir`: the path the step's I/O takes (SwapSpace: preallocated O_DIRECT file,
// xxh3 checksums per block; the engine: io_uring, `block_bytes` pieces, `queue_depth` in flight,
// the thread engine where io_uring is refused), in extents of 16 blocks (the step reads and
// writes whole tensors of a sub-group) from huge-page registered memory filled with seeded
// random bytes. A first, untimed write allocates the file's blocks (the step overwrites blocks
// its load wrote). The swap file is removed afterwards. unsupported when O_DIRECT is refused
// (tmpfs), not_found / io_error / no_space naming the path as SwapSpace::open() gives them.
// One block size and depth, a short run: `zinf io tune` sweeps them.
Result<DiskRates> measure_disk(const std::string& dir, std::uint64_t file_bytes,
                               std::uint64_t block_bytes, std::uint32_t queue_depth);

}  // namespace zinf::plan
