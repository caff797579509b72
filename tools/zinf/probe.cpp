// zinf probe: what the machine a user is about to train on can do — cores and SIMD features,
// memory bandwidth (STREAM triad and the fp32 Adam access pattern), and the filesystem of a path.
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "base/cpu.hpp"
#include "base/membw.hpp"
#include "command.hpp"

namespace zinf::cli {
namespace {

struct ProbeOptions {
  std::string path;
  std::string size = "256MiB";
  int threads = 0;
  int reps = 5;
  bool json = false;
};

std::string fs_name(long type) {
  switch (static_cast<unsigned long>(type)) {
    case EXT4_SUPER_MAGIC:
      return "ext4";  // also ext2/ext3: they share the magic
    case XFS_SUPER_MAGIC:
      return "xfs";
    case BTRFS_SUPER_MAGIC:
      return "btrfs";
    case TMPFS_MAGIC:
      return "tmpfs";
    case OVERLAYFS_SUPER_MAGIC:
      return "overlay";
    case NFS_SUPER_MAGIC:
      return "nfs";
    case 0x65735546:
      return "fuse";
    case 0x2fc12fc1:
      return "zfs";
    case 0xf2f52010:
      return "f2fs";
    default:
      return fmt::format("0x{:x}", static_cast<unsigned long>(type));
  }
}

// Writes and reads back one 4 KiB block with O_DIRECT in `dir`. Returns "" when that works, or
// the reason it does not.
std::string o_direct_check(const std::string& dir) {
  std::string templ = dir + "/.zinf-probe-XXXXXX";
  int fd = mkstemp(templ.data());
  if (fd < 0) return fmt::format("cannot create a file in {}: {}", dir, std::strerror(errno));
  close(fd);
  std::string reason;
  fd = open(templ.c_str(), O_RDWR | O_DIRECT);
  if (fd < 0) {
    reason = fmt::format("open with O_DIRECT: {}", std::strerror(errno));
  } else {
    void* block = nullptr;
    if (posix_memalign(&block, 4096, 4096) != 0) {
      reason = "out of memory";
    } else {
      std::memset(block, 0xa5, 4096);
      if (pwrite(fd, block, 4096, 0) != 4096) {
        reason = fmt::format("O_DIRECT write: {}", std::strerror(errno));
      } else if (pread(fd, block, 4096, 0) != 4096) {
        reason = fmt::format("O_DIRECT read: {}", std::strerror(errno));
      }
      std::free(block);
    }
    close(fd);
  }
  unlink(templ.c_str());
  return reason;
}

void run_probe(const ProbeOptions& options) {
  std::size_t bytes_per_stream = 0;
  if (!parse_size(options.size, &bytes_per_stream) || bytes_per_stream < 4096) {
    fail(fmt::format("--size {}: not a size of at least 4KiB (e.g. 256MiB)", options.size));
    return;
  }
  const std::size_t elements = bytes_per_stream / 4;
  const int threads = options.threads > 0 ? options.threads : cpu_count();

  nlohmann::json out;
  out["cpu_model"] = cpu_model_name();
  out["cpu_cores"] = cpu_count();
  out["cpu_features"] = cpu_features().names();
  out["threads"] = threads;
  out["stream_bytes"] = bytes_per_stream;

  // Interleave the two patterns round by round, so drift on a shared machine hits both alike.
  BandwidthProbe triad(StreamPattern::triad(), elements, threads);
  BandwidthProbe adam(StreamPattern::adam_f32(), elements, threads);
  std::vector<double> triad_gbps, adam_gbps;
  for (int r = 0; r < std::max(options.reps, 1); ++r) {
    triad_gbps.push_back(triad.run_once());
    adam_gbps.push_back(adam.run_once());
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  };
  out["mem_triad_gbps"] = median(triad_gbps);
  out["mem_adam_pattern_gbps"] = median(adam_gbps);
  out["mem_reps"] = options.reps;

  if (!options.path.empty()) {
    struct statvfs vfs {};
    struct statfs fs {};
    if (statvfs(options.path.c_str(), &vfs) != 0 || statfs(options.path.c_str(), &fs) != 0) {
      fail(fmt::format("--path {}: {}", options.path, std::strerror(errno)));
      return;
    }
    out["path"] = options.path;
    out["path_free_bytes"] = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    out["path_total_bytes"] = static_cast<std::uint64_t>(vfs.f_blocks) * vfs.f_frsize;
    out["path_fs"] = fs_name(fs.f_type);
    const std::string reason = o_direct_check(options.path);
    out["path_o_direct"] = reason.empty();
    if (!reason.empty()) out["path_o_direct_error"] = reason;
  }

  if (options.json) {
    print_json(out);
    return;
  }
  std::string features;
  for (const auto& f : out["cpu_features"]) features += f.get<std::string>() + " ";
  fmt::print("cpu        {} ({} cores)\n", out["cpu_model"].get<std::string>(), cpu_count());
  fmt::print("simd       {}\n", features);
  Table table({"measure", "GB/s", "bytes/elem", "threads"});
  table.add_row({"memory: triad a=b+s*c",
                 fmt::format("{:.1f}", out["mem_triad_gbps"].get<double>()), "12",
                 std::to_string(threads)});
  table.add_row({"memory: adam pattern (4R/3W)",
                 fmt::format("{:.1f}", out["mem_adam_pattern_gbps"].get<double>()), "28",
                 std::to_string(threads)});
  table.print();
  if (!options.path.empty()) {
    fmt::print("path       {} ({}), {} free, O_DIRECT {}\n", options.path,
               out["path_fs"].get<std::string>(),
               format_bytes(out["path_free_bytes"].get<double>()),
               out["path_o_direct"].get<bool>()
                   ? "works"
                   : "fails: " + out["path_o_direct_error"].get<std::string>());
  }
}

void setup_probe(CLI::App& app) {
  auto options = std::make_shared<ProbeOptions>();
  CLI::App* sub = app.add_subcommand(
      "probe", "Measure this machine: cores, SIMD, memory bandwidth, and a path's filesystem");
  sub->add_option("--path", options->path, "Directory to check (free space, filesystem, O_DIRECT)")
      ->check(CLI::ExistingDirectory);
  sub->add_option("--size", options->size, "Bytes per stream for the bandwidth passes")
      ->capture_default_str();
  sub->add_option("--threads", options->threads, "Threads for the bandwidth passes (0 = all)")
      ->capture_default_str();
  sub->add_option("--reps", options->reps, "Timed repetitions (median reported)")
      ->capture_default_str();
  sub->add_flag("--json", options->json, "Print one JSON object");
  sub->callback([options] { run_probe(*options); });
}

}  // namespace

ZINF_COMMAND("probe", setup_probe);

}  // namespace zinf::cli
