#include "plan/profile.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "base/aligned.hpp"
#include "base/membw.hpp"
#include "base/random.hpp"
#include "io/buffer_pool.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"

namespace zinf::plan {
namespace {

using nlohmann::json;

Status read_rate(const json& object, const char* key, const std::string& path, double* out) {
  if (!object.contains(key)) return Status::ok();
  const json& v = object.at(key);
  if (!v.is_number() || v.get<double>() < 0) {
    return Status::invalid_argument(
        fmt::format("{}{}: {} is not a non-negative number", path, key, v.dump()));
  }
  *out = v.get<double>();
  return Status::ok();
}

// An optional count of a sweep entry (`where` names it in errors): absent is 0; present, it must
// be a non-negative integer (a float such as 2e83 would not fit the conversion).
Status read_count(const json& entry, const char* where, const char* key, std::uint64_t* out) {
  const auto it = entry.find(key);
  if (it == entry.end()) return Status::ok();
  if (!it->is_number_unsigned()) {
    return Status::invalid_argument(fmt::format("{}{}: is not a non-negative integer", where, key));
  }
  *out = it->get<std::uint64_t>();
  return Status::ok();
}

// Picks NVMe rates out of an io tune sweep: the entry at the engine's block size and depth, or
// the best read and best write.
Status read_sweep(const json& results, std::uint64_t block_bytes, std::uint64_t queue_depth,
                  double* read_gbps, double* write_gbps) {
  if (!results.is_array()) return Status::invalid_argument("io.results: is not an array");
  double best_read = 0;
  double best_write = 0;
  for (const json& entry : results) {
    if (!entry.is_object()) return Status::invalid_argument("io.results[]: is not an object");
    double r = 0;
    double w = 0;
    ZINF_RETURN_IF_ERROR(read_rate(entry, "read_gbps", "io.results[].", &r));
    ZINF_RETURN_IF_ERROR(read_rate(entry, "write_gbps", "io.results[].", &w));
    std::uint64_t entry_block = 0;
    std::uint64_t entry_depth = 0;
    ZINF_RETURN_IF_ERROR(read_count(entry, "io.results[].", "block_bytes", &entry_block));
    ZINF_RETURN_IF_ERROR(read_count(entry, "io.results[].", "queue_depth", &entry_depth));
    const bool match = entry_block == block_bytes && entry_depth == queue_depth;
    if (match && r > 0 && w > 0) {
      *read_gbps = r;
      *write_gbps = w;
      return Status::ok();
    }
    best_read = std::max(best_read, r);
    best_write = std::max(best_write, w);
  }
  if (best_read > 0) *read_gbps = best_read;
  if (best_write > 0) *write_gbps = best_write;
  return Status::ok();
}

// Reads `zinf io tune`'s saved sweep: "points" (op, block_bytes, queue_depth, rings, gbps) and
// "best" per op. The engine runs one block size and depth for both directions, so the read's
// best point sets them, and the write rate is the best write at that same point (over ring
// counts), or the best write anywhere when the sweep has none there.
Status read_io_tune(const json& root, MachineProfile* p) {
  if (!root.contains("best") || !root.at("best").is_object()) {
    return Status::invalid_argument("best: missing or not an object");
  }
  const json& best = root.at("best");
  if (!best.contains("read") || !best.contains("write")) {
    return Status::invalid_argument("best: needs both read and write");
  }
  double read = 0;
  double write = 0;
  ZINF_RETURN_IF_ERROR(read_rate(best.at("read"), "gbps", "best.read.", &read));
  ZINF_RETURN_IF_ERROR(read_rate(best.at("write"), "gbps", "best.write.", &write));
  std::uint64_t block = 0;
  std::uint64_t depth = 0;
  ZINF_RETURN_IF_ERROR(read_count(best.at("read"), "best.read.", "block_bytes", &block));
  ZINF_RETURN_IF_ERROR(read_count(best.at("read"), "best.read.", "queue_depth", &depth));
  double write_there = 0;
  if (root.contains("points") && root.at("points").is_array()) {
    for (const json& point : root.at("points")) {
      if (!point.is_object() || point.value("op", std::string()) != "write") continue;
      std::uint64_t point_block = 0;
      std::uint64_t point_depth = 0;
      ZINF_RETURN_IF_ERROR(read_count(point, "points[].", "block_bytes", &point_block));
      ZINF_RETURN_IF_ERROR(read_count(point, "points[].", "queue_depth", &point_depth));
      if (point_block != block || point_depth != depth) continue;
      double gbps = 0;
      ZINF_RETURN_IF_ERROR(read_rate(point, "gbps", "points[].", &gbps));
      write_there = std::max(write_there, gbps);
    }
  }
  if (read <= 0 || write <= 0) return Status::ok();
  p->nvme_read_gbps = read;
  p->nvme_write_gbps = write_there > 0 ? write_there : write;
  p->nvme_block_bytes = block;
  p->nvme_queue_depth = depth;
  return Status::ok();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

std::string default_profile_path() {
  if (const char* p = std::getenv("ZINF_MACHINE_PROFILE"); p != nullptr && *p != '\0') return p;
  if (const char* p = std::getenv("XDG_CACHE_HOME"); p != nullptr && *p != '\0') {
    return std::string(p) + "/zinf/machine.json";
  }
  if (const char* p = std::getenv("HOME"); p != nullptr && *p != '\0') {
    return std::string(p) + "/.cache/zinf/machine.json";
  }
  return ".zinf-machine.json";
}

std::string default_io_tune_path() {
  if (const char* p = std::getenv("ZINF_IO_TUNE_FILE"); p != nullptr && *p != '\0') return p;
  if (const char* p = std::getenv("XDG_CACHE_HOME"); p != nullptr && *p != '\0') {
    return std::string(p) + "/zinf/io-tune.json";
  }
  if (const char* p = std::getenv("HOME"); p != nullptr && *p != '\0') {
    return std::string(p) + "/.cache/zinf/io-tune.json";
  }
  return ".zinf-io-tune.json";
}

Status parse_machine_profile(std::string_view text, const std::string& source,
                             std::uint64_t io_block_bytes, std::uint64_t io_queue_depth,
                             MachineProfile* profile) {
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return Status::invalid_argument(fmt::format("{}: not a JSON object", source));
  }
  MachineProfile p = *profile;
  const double adam_before = p.mem_adam_gbps;
  ZINF_RETURN_IF_ERROR(read_rate(root, "mem_adam_pattern_gbps", "", &p.mem_adam_gbps));
  if (p.mem_adam_gbps != adam_before) p.memory_source = source;
  if (root.contains("cpu_cores") && root.at("cpu_cores").is_number_integer()) {
    p.cpu_cores = root.at("cpu_cores").get<int>();
  }
  double read = 0;
  double write = 0;
  ZINF_RETURN_IF_ERROR(read_rate(root, "nvme_read_gbps", "", &read));
  ZINF_RETURN_IF_ERROR(read_rate(root, "nvme_write_gbps", "", &write));
  ZINF_RETURN_IF_ERROR(read_rate(root, "nvme_duplex_gbps", "", &p.nvme_duplex_gbps));
  if (root.contains("io")) {
    const json& io = root.at("io");
    if (!io.is_object())
      return Status::invalid_argument(fmt::format("{}: io is not an object", source));
    ZINF_RETURN_IF_ERROR(read_rate(io, "read_gbps", "io.", &read));
    ZINF_RETURN_IF_ERROR(read_rate(io, "write_gbps", "io.", &write));
    if (io.contains("results")) {
      ZINF_RETURN_IF_ERROR(
          read_sweep(io.at("results"), io_block_bytes, io_queue_depth, &read, &write));
    }
  }
  if (read > 0 && write > 0) {
    p.nvme_read_gbps = read;
    p.nvme_write_gbps = write;
    p.nvme_source = source;
  }
  if (root.contains("best")) {
    const double before = p.nvme_read_gbps;
    ZINF_RETURN_IF_ERROR(read_io_tune(root, &p).with_context(source));
    if (p.nvme_read_gbps != before) p.nvme_source = source + " (zinf io tune)";
  }
  bool gpu_given = false;
  for (auto [key, field] :
       {std::pair{"h2d_gbps", &p.h2d_gbps}, std::pair{"gpu_mem_gbps", &p.gpu_mem_gbps},
        std::pair{"gpu_tflops", &p.gpu_tflops}, std::pair{"gpu_link_gbps", &p.gpu_link_gbps}}) {
    if (root.contains(key)) gpu_given = true;
    ZINF_RETURN_IF_ERROR(read_rate(root, key, "", field));
  }
  if (gpu_given) p.gpu_source = source;
  *profile = p;
  return Status::ok();
}

Status load_machine_profile(const std::string& path, std::uint64_t io_block_bytes,
                            std::uint64_t io_queue_depth, MachineProfile* profile) {
  std::ifstream file(path);
  if (!file) return status_from_errno(fmt::format("machine profile {}", path), errno);
  std::stringstream text;
  text << file.rdbuf();
  return parse_machine_profile(text.str(), fmt::format("file {}", path), io_block_bytes,
                               io_queue_depth, profile);
}

Status save_machine_profile(const std::string& path, const MachineProfile& profile) {
  json root = json::object();
  {
    std::ifstream in(path);
    if (in) {
      std::stringstream text;
      text << in.rdbuf();
      if (!text.str().empty()) {
        root = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
        if (root.is_discarded() || !root.is_object()) {
          return Status::invalid_argument(fmt::format("{}: not a JSON object", path));
        }
      }
    }
  }
  auto put = [&](const char* key, double value) {
    if (value > 0) root[key] = value;
  };
  put("mem_adam_pattern_gbps", profile.mem_adam_gbps);
  put("nvme_read_gbps", profile.nvme_read_gbps);
  put("nvme_write_gbps", profile.nvme_write_gbps);
  put("nvme_duplex_gbps", profile.nvme_duplex_gbps);
  if (profile.cpu_cores > 0) root["cpu_cores"] = profile.cpu_cores;
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  std::ofstream out(path, std::ios::out | std::ios::trunc);
  if (!out) return status_from_errno(fmt::format("open {}", path), errno);
  out << root.dump(2) << "\n";
  out.close();
  if (!out) return status_from_errno(fmt::format("write {}", path), errno);
  return Status::ok();
}

double measure_adam_gbps(std::uint64_t bytes_per_stream, int reps) {
  // Read g; read and write p, m, v; write the half copy.
  const StreamPattern pattern{{4}, {4, 4, 4}, {2}};
  BandwidthProbe probe(pattern, bytes_per_stream / 4, 0);
  probe.run_once();  // warm-up: page faults, frequency
  std::vector<double> gbps;
  for (int r = 0; r < std::max(reps, 1); ++r) gbps.push_back(probe.run_once());
  return median(gbps);
}

Result<DiskRates> measure_disk(const std::string& dir, std::uint64_t file_bytes,
                               std::uint64_t block_bytes, std::uint32_t queue_depth) {
  if (block_bytes == 0 || block_bytes % 4096 != 0 || queue_depth == 0) {
    return Status::invalid_argument(fmt::format(
        "measure_disk: block_bytes {} must be a positive multiple of 4096, queue_depth {} "
        "positive",
        block_bytes, queue_depth));
  }
  // Extents the size of a sub-group's tensor: the step reads and writes whole pieces, which the
  // swap space checksums per block and the engine cuts into block_bytes pieces at queue_depth.
  const std::uint64_t extent_bytes = block_bytes * 16;
  const std::uint64_t extents = std::max<std::uint64_t>(2, file_bytes / extent_bytes);
  // Enough extents in flight to keep queue_depth pieces at the drive in each direction, + one.
  const std::size_t slots = static_cast<std::size_t>(
      2 * ((queue_depth * block_bytes + extent_bytes - 1) / extent_bytes + 1));

  IoOptions io;
  io.block_bytes = static_cast<std::size_t>(block_bytes);
  io.queue_depth = queue_depth;
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> engine, open_engine(io));
  SwapOptions swap_options;
  swap_options.dirs = {dir};
  swap_options.capacity_bytes = extents * extent_bytes;
  swap_options.block_bytes = static_cast<std::size_t>(block_bytes);
  swap_options.max_extents = static_cast<std::uint32_t>(extents);
  swap_options.max_ops = static_cast<std::uint32_t>(slots + 8);
  swap_options.file_name = "zinf-plan-disk-{pid}.bin";
  Result<std::unique_ptr<SwapSpace>> opened = SwapSpace::open(*engine, swap_options);
  if (!opened.is_ok()) {
    if (opened.status().code() == Code::kUnsupported) {
      return Status::unsupported(
          fmt::format("{}; give --nvme-read-gbps and --nvme-write-gbps", opened.status().message()),
          opened.status().sys_code());
    }
    return opened.status();
  }
  std::unique_ptr<SwapSpace> swap = std::move(opened).value();
  std::vector<ExtentId> ids;
  for (std::uint64_t e = 0; e < extents; ++e) {
    ZINF_ASSIGN_OR_RETURN(ExtentId id, swap->create(fmt::format("plan/disk{}", e), extent_bytes));
    ids.push_back(id);
  }
  // Huge pages, locked and registered, as the step's PinnedPool has them: with 4 KiB pages the
  // kernel's per-page work showed as a slower disk on a busy 2-core machine.
  BufferPoolOptions pool_options;
  pool_options.block_bytes = static_cast<std::size_t>(extent_bytes);
  pool_options.block_count = slots;
  pool_options.huge_pages = HugePages::kAuto;
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<BufferPool> pool, BufferPool::create(pool_options));
  for (std::size_t b = 0; b < slots; ++b) {
    fill_random_bytes(pool->block(b), pool->block_bytes(), 0x9e3779b9u + b);
  }
  ZINF_RETURN_IF_ERROR(pool->register_with(*engine));

  // Streams whole extents: reads, writes, or both at once (slot i reads when i is even, reads
  // from the first extents, writes to the second half), each slot resubmitted as soon as its
  // op completes, until `ops` were submitted. Returns bytes per second (1e9).
  std::vector<bool> written(extents, false);
  auto stream = [&](bool reads, bool writes, std::uint64_t ops) -> Result<double> {
    std::vector<SwapTicket> tickets(slots);
    std::vector<bool> busy(slots, false);
    std::uint64_t next[2] = {0, writes && reads ? extents / 2 : 0};
    std::uint64_t submitted = 0;
    std::uint64_t done = 0;
    const auto start = std::chrono::steady_clock::now();
    auto submit = [&](std::size_t i) -> Status {
      const bool read = reads && (!writes || i % 2 == 0);
      std::uint64_t& e = next[read ? 0 : 1];
      // Reads only touch extents already written (the swap space refuses others).
      if (read && !written[e]) e = 0;
      Result<SwapTicket> t =
          read ? swap->read(ids[e], pool->block(i)) : swap->write(ids[e], pool->block(i));
      if (!t.is_ok()) return t.status();
      if (!read) written[e] = true;
      tickets[i] = *t;
      e = (e + 1) % extents;
      busy[i] = true;
      ++submitted;
      return Status::ok();
    };
    Status first_error;
    for (std::size_t i = 0; i < slots && submitted < ops; ++i) {
      first_error = submit(i);
      if (!first_error.is_ok()) break;
    }
    for (bool any = true; any;) {
      any = false;
      for (std::size_t i = 0; i < slots; ++i) {
        if (!busy[i]) continue;
        any = true;
        Status st = swap->wait(tickets[i], std::chrono::seconds(60));
        if (st.code() == Code::kTimeout) return st;  // still in flight: cannot go on
        busy[i] = false;
        if (!st.is_ok()) {
          if (first_error.is_ok()) first_error = st;
          continue;
        }
        ++done;
        if (first_error.is_ok() && submitted < ops) first_error = submit(i);
      }
    }
    ZINF_RETURN_IF_ERROR(first_error);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return static_cast<double>(done * extent_bytes) / s / 1e9;
  };
  // The first write allocates the blocks of a thin-provisioned or virtual disk; the step
  // overwrites extents its load wrote, so only the second write is timed.
  ZINF_RETURN_IF_ERROR(stream(false, true, extents).status());
  DiskRates rates;
  ZINF_ASSIGN_OR_RETURN(rates.write_gbps, stream(false, true, extents));
  ZINF_ASSIGN_OR_RETURN(rates.read_gbps, stream(true, false, extents));
  ZINF_ASSIGN_OR_RETURN(rates.duplex_gbps, stream(true, true, extents));
  return rates;
}

}  // namespace zinf::plan
