// zinf io bench / zinf io tune: what the drive under a path can do through zinf's I/O engine.
//
//   zinf io bench --path DIR|FILE --bytes 4GiB --block 1MiB --depth 32 --rings 1 --op read
//                 [--engine auto|uring|thread] [--huge auto|hugetlb|thp|none] [--json]
//   zinf io tune  --path DIR [--json] [--out FILE] [--blocks 64KiB,...] [--depths 1,...]
//                 [--rings 1,2,4] [--seconds 0.5]
//
// A directory gets a file of its own (preallocated, written with random data before a read is
// timed, removed afterwards); an existing file is used as it is (a write bench overwrites it,
// wrapping within its size, and refuses a file shorter than one request).
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "command.hpp"
#include "io/buffer_pool.hpp"
#include "io/io_bench.hpp"
#include "io/io_engine.hpp"

namespace zinf::cli {
namespace {

bool parse_huge(std::string_view text, HugePages* huge) {
  if (text == "auto") {
    *huge = HugePages::kAuto;
  } else if (text == "hugetlb") {
    *huge = HugePages::kHugeTlbOnly;
  } else if (text == "thp") {
    *huge = HugePages::kThpOnly;
  } else if (text == "none") {
    *huge = HugePages::kNone;
  } else {
    return false;
  }
  return true;
}

// The file a run uses: the caller's, or one of our own in a directory (removed on destruction).
class BenchFile {
 public:
  ~BenchFile() {
    if (engine_ != nullptr && handle_.valid()) (void)engine_->close_file(handle_);
    if (owned_) ::unlink(path_.c_str());
  }

  // Opens `path`. For a directory, creates a file of `bytes` there and, when `fill`, writes
  // random data over all of it (untimed) so reads hit the drive, not unwritten extents.
  Status open(IoEngine& engine, const std::string& path, std::uint64_t bytes, bool fill,
              BufferPool& pool) {
    engine_ = &engine;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      return status_from_errno(fmt::format("--path {}", path), errno);
    if (S_ISDIR(st.st_mode)) {
      path_ = fmt::format("{}/zinf-io-bench-{}.bin", path, ::getpid());
      owned_ = true;
      const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (fd < 0) return status_from_errno(fmt::format("create {}", path_), errno);
      const int rc = ::fallocate(fd, 0, 0, static_cast<off_t>(bytes));
      const int err = errno;
      ::close(fd);
      if (rc != 0)
        return status_from_errno(fmt::format("fallocate {} bytes for {}", bytes, path_), err);
      file_bytes_ = bytes;
    } else {
      path_ = path;
      file_bytes_ = static_cast<std::uint64_t>(st.st_size);
    }
    ZINF_ASSIGN_OR_RETURN(handle_, engine.open_file(path_, {.write = true, .create = false}));
    if (owned_ && fill) {
      IoBenchConfig config;
      config.op = IoOp::kWrite;
      config.bytes = bytes;
      ZINF_RETURN_IF_ERROR(run_io_bench(engine, handle_, pool, config).status());
    }
    return Status::ok();
  }

  FileHandle handle() const { return handle_; }
  std::uint64_t file_bytes() const { return file_bytes_; }
  const std::string& path() const { return path_; }

 private:
  IoEngine* engine_ = nullptr;
  FileHandle handle_;
  std::string path_;
  std::uint64_t file_bytes_ = 0;
  bool owned_ = false;
};

// An aio block: a whole number of O_DIRECT's alignment, and not empty.
bool aio_block(std::size_t bytes) { return bytes != 0 && bytes % kDirectAlignment == 0; }

struct Setup {
  std::unique_ptr<IoEngine> engine;
  std::unique_ptr<BufferPool> pool;
};

// `request_bytes` 0 picks io_bench_request_bytes().
Result<Setup> make_setup(EngineKind kind, std::size_t block, std::uint32_t depth,
                         std::uint32_t rings, HugePages huge, std::uint64_t seed,
                         std::size_t request_bytes = 0) {
  IoOptions options;
  options.kind = kind;
  options.block_bytes = block;
  options.queue_depth = depth;
  options.rings = rings;
  if (request_bytes == 0) request_bytes = io_bench_request_bytes(options);
  if (request_bytes % block != 0) {
    return Status::invalid_argument(
        fmt::format("--request {}: not a multiple of --block {}", request_bytes, block));
  }
  const std::size_t requests = io_bench_pool_blocks(options, request_bytes);
  options.max_requests = static_cast<std::uint32_t>(requests + 16);
  Setup setup;
  ZINF_ASSIGN_OR_RETURN(setup.engine, open_engine(options));
  ZINF_ASSIGN_OR_RETURN(
      setup.pool, BufferPool::create(
                      {.block_bytes = request_bytes, .block_count = requests, .huge_pages = huge}));
  ZINF_RETURN_IF_ERROR(setup.pool->register_with(*setup.engine));
  // Writes carry random data: never time zeros.
  fill_random_bytes(setup.pool->data(), setup.pool->bytes(), seed);
  return setup;
}

struct BenchOptions {
  std::string path;
  std::string bytes = "4GiB";
  std::string block = "1MiB";
  std::string request = "auto";
  std::uint32_t depth = 32;
  std::uint32_t rings = 1;
  std::string op = "read";
  std::string engine = "auto";
  std::string huge = "auto";
  bool json = false;
};

void run_bench(const BenchOptions& o) {
  std::size_t bytes = 0, block = 0, request = 0;
  EngineKind kind;
  HugePages huge;
  if (!parse_size(o.bytes, &bytes) || !parse_size(o.block, &block)) {
    return fail(
        fmt::format("--bytes {} / --block {}: not sizes (e.g. 4GiB, 1MiB)", o.bytes, o.block));
  }
  if (!aio_block(block)) {
    return fail(fmt::format("--block {}: not a multiple of 4KiB (O_DIRECT)", o.block));
  }
  if (bytes == 0) return fail(fmt::format("--bytes {}: no bytes to move", o.bytes));
  if (o.request != "auto" && !parse_size(o.request, &request)) {
    return fail(fmt::format("--request {}: not a size", o.request));
  }
  if (o.op != "read" && o.op != "write") return fail("--op: read or write");
  if (!parse_engine_kind(o.engine, &kind)) return fail("--engine: auto, uring or thread");
  if (!parse_huge(o.huge, &huge)) return fail("--huge: auto, hugetlb, thp or none");
  const IoOp op = o.op == "read" ? IoOp::kRead : IoOp::kWrite;

  Result<Setup> setup = make_setup(kind, block, o.depth, o.rings, huge, 0x10b, request);
  if (!setup.is_ok()) return fail(setup.status().to_string());
  BenchFile file;
  Status opened = file.open(*setup->engine, o.path, bytes, op == IoOp::kRead, *setup->pool);
  if (!opened.is_ok()) return fail(opened.to_string());
  // Within the file as it is: a write wraps rather than growing the caller's file.
  Result<IoBenchConfig> config =
      io_bench_file_config(op, bytes, file.file_bytes(), setup->pool->block_bytes(), file.path());
  if (!config.is_ok()) return fail(config.status().to_string());
  Result<IoBenchResult> result = run_io_bench(*setup->engine, file.handle(), *setup->pool, *config);
  if (!result.is_ok()) return fail(result.status().to_string());
  const IoEngineStats stats = setup->engine->stats();

  nlohmann::json out;
  out["op"] = o.op;
  out["engine"] = engine_kind_name(setup->engine->kind());
  out["block_bytes"] = block;
  out["request_bytes"] = setup->pool->block_bytes();
  out["queue_depth"] = o.depth;
  out["rings"] = o.rings;
  out["bytes"] = result->bytes;
  out["seconds"] = result->seconds;
  out["gbps"] = result->gbps();
  out["path"] = file.path();
  out["memory"] = page_kind_name(setup->pool->page_kind());
  out["memory_locked"] = setup->pool->locked();
  out["fixed_buffers"] = stats.fixed_pieces == stats.pieces && stats.pieces > 0;
  if (o.json) return print_json(out);
  fmt::print(
      "{} {} of {} in {:.3f} s: {:.3f} GB/s ({} engine, block {}, depth {}, rings {}, "
      "{} pages{})\n",
      o.op, format_bytes(static_cast<double>(result->bytes)), file.path(), result->seconds,
      result->gbps(), engine_kind_name(setup->engine->kind()), format_bytes(block), o.depth,
      o.rings, page_kind_name(setup->pool->page_kind()), setup->pool->locked() ? ", locked" : "");
}

struct TuneOptions {
  std::string path;
  std::vector<std::string> blocks = {"64KiB", "128KiB", "256KiB", "512KiB",
                                     "1MiB",  "2MiB",   "4MiB",   "8MiB"};
  std::vector<std::uint32_t> depths = {1, 2, 4, 8, 16, 32, 64, 128};
  std::vector<std::uint32_t> rings = {1, 2, 4};
  std::string file_bytes = "1GiB";
  std::string max_in_flight = "256MiB";
  double seconds = 0.3;
  std::string engine = "auto";
  std::string out;
  bool json = false;
};

std::string default_tune_file() {
  if (const char* env = std::getenv("ZINF_IO_TUNE_FILE"); env != nullptr && env[0] != '\0') {
    return env;
  }
  const char* cache = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const std::string base = cache != nullptr && cache[0] != '\0'
                               ? std::string(cache)
                               : std::string(home != nullptr ? home : "/tmp") + "/.cache";
  return base + "/zinf/io-tune.json";
}

void run_tune(const TuneOptions& o) {
  EngineKind kind;
  if (!parse_engine_kind(o.engine, &kind)) return fail("--engine: auto, uring or thread");
  std::size_t file_bytes = 0, max_in_flight = 0;
  if (!parse_size(o.file_bytes, &file_bytes) || !parse_size(o.max_in_flight, &max_in_flight)) {
    return fail("--file-bytes / --max-in-flight: not sizes");
  }
  std::vector<std::size_t> blocks;
  for (const std::string& text : o.blocks) {
    std::size_t b = 0;
    if (!parse_size(text, &b) || !aio_block(b)) {
      return fail(fmt::format("--blocks {}: not a multiple of 4KiB", text));
    }
    blocks.push_back(b);
  }
  const std::size_t largest = *std::max_element(blocks.begin(), blocks.end());

  // One file for the whole sweep, written once with random data by a mid-sized setup; it holds
  // at least four of the largest blocks and one of the filler's requests.
  Result<Setup> filler = make_setup(kind, 1 << 20, 16, 1, HugePages::kAuto, 0x70e);
  if (!filler.is_ok()) return fail(filler.status().to_string());
  file_bytes = std::max({file_bytes, largest * 4, filler->pool->block_bytes()});
  auto file = std::make_unique<BenchFile>();
  Status opened = file->open(*filler->engine, o.path, file_bytes, true, *filler->pool);
  if (!opened.is_ok()) return fail(opened.to_string());
  const std::string path = file->path();
  const std::uint64_t span = file->file_bytes();

  nlohmann::json points = nlohmann::json::array();
  Table table({"op", "block", "depth", "rings", "GB/s"});
  nlohmann::json best = nlohmann::json::object();
  std::string engine_name;
  for (const char* op_name : {"read", "write"}) {
    const IoOp op = std::string_view(op_name) == "read" ? IoOp::kRead : IoOp::kWrite;
    for (std::size_t block : blocks) {
      for (std::uint32_t depth : o.depths) {
        for (std::uint32_t rings : o.rings) {
          if (static_cast<std::uint64_t>(block) * depth * rings > max_in_flight) continue;
          Result<Setup> setup =
              make_setup(kind, block, depth, rings, HugePages::kAuto, block ^ depth);
          if (!setup.is_ok()) return fail(setup.status().to_string());
          engine_name = engine_kind_name(setup->engine->kind());
          Result<FileHandle> handle = setup->engine->open_file(path, {});
          if (!handle.is_ok()) return fail(handle.status().to_string());
          IoBenchConfig config;
          config.op = op;
          config.bytes = span * 64;  // bounded by the time limit
          config.file_bytes = span;
          config.time_limit = std::chrono::milliseconds(static_cast<long>(o.seconds * 1000));
          Result<IoBenchResult> r = run_io_bench(*setup->engine, *handle, *setup->pool, config);
          (void)setup->engine->close_file(*handle);
          if (!r.is_ok()) return fail(r.status().to_string());
          nlohmann::json point = {{"op", op_name},        {"block_bytes", block},
                                  {"queue_depth", depth}, {"rings", rings},
                                  {"bytes", r->bytes},    {"seconds", r->seconds},
                                  {"gbps", r->gbps()}};
          points.push_back(point);
          table.add_row({op_name, format_bytes(static_cast<double>(block)), std::to_string(depth),
                         std::to_string(rings), fmt::format("{:.3f}", r->gbps())});
          if (!best.contains(op_name) || best[op_name]["gbps"].get<double>() < r->gbps()) {
            best[op_name] = point;
          }
        }
      }
    }
  }
  file.reset();
  filler = Status::aborted("done");

  // The knee: the point with the fewest bytes in flight (block x depth x rings, which is the
  // pinned memory the step needs) that reaches 95% of the best rate.
  nlohmann::json knee = nlohmann::json::object();
  for (const auto& point : points) {
    const std::string op_name = point["op"].get<std::string>();
    if (point["gbps"].get<double>() < 0.95 * best[op_name]["gbps"].get<double>()) continue;
    auto in_flight = [](const nlohmann::json& p) {
      return p["block_bytes"].get<double>() * p["queue_depth"].get<double>() *
             p["rings"].get<double>();
    };
    if (!knee.contains(op_name) || in_flight(point) < in_flight(knee[op_name])) {
      knee[op_name] = point;
    }
  }

  nlohmann::json out;
  out["path"] = o.path;
  out["engine"] = engine_name;
  out["seconds_per_point"] = o.seconds;
  out["points"] = points;
  out["best"] = best;
  out["knee"] = knee;
  const std::string out_path = o.out.empty() ? default_tune_file() : o.out;
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(out_path).parent_path(), ec);
  std::ofstream saved(out_path);
  saved << out.dump(2) << '\n';
  if (!saved) return fail(fmt::format("cannot write {}", out_path));
  out["saved_to"] = out_path;
  if (o.json) return print_json(out);
  table.print();
  for (const char* op_name : {"read", "write"}) {
    if (!best.contains(op_name)) continue;
    const auto& b = best[op_name];
    fmt::print("best {:<5}  block {}, depth {}, rings {}: {:.3f} GB/s\n", op_name,
               format_bytes(b["block_bytes"].get<double>()), b["queue_depth"].get<int>(),
               b["rings"].get<int>(), b["gbps"].get<double>());
  }
  for (const char* op_name : {"read", "write"}) {
    if (!knee.contains(op_name)) continue;
    const auto& k = knee[op_name];
    fmt::print(
        "knee {:<5}  block {}, depth {}, rings {}: {:.3f} GB/s (>= 95% of best with the "
        "fewest bytes in flight)\n",
        op_name, format_bytes(k["block_bytes"].get<double>()), k["queue_depth"].get<int>(),
        k["rings"].get<int>(), k["gbps"].get<double>());
  }
  fmt::print("saved to {}\n", out_path);
}

void setup_io(CLI::App& app) {
  CLI::App* io = group(app, "io", "The NVMe I/O engine: measure and tune");

  auto bench = std::make_shared<BenchOptions>();
  CLI::App* b = io->add_subcommand("bench", "Sequential read or write throughput of a path");
  b->add_option("--path", bench->path, "Directory (a file of its own) or existing file")
      ->required();
  b->add_option("--bytes", bench->bytes, "Bytes to move")->capture_default_str();
  b->add_option("--block", bench->block, "Request size")->capture_default_str();
  b->add_option("--request", bench->request,
                "Bytes per engine request, cut into --block pieces (auto: block x depth/4)")
      ->capture_default_str();
  b->add_option("--depth", bench->depth, "Requests in flight per ring")->capture_default_str();
  b->add_option("--rings", bench->rings, "io_uring instances (threads)")->capture_default_str();
  b->add_option("--op", bench->op, "read or write")->capture_default_str();
  b->add_option("--engine", bench->engine, "auto, uring or thread")->capture_default_str();
  b->add_option("--huge", bench->huge, "Buffer pages: auto, hugetlb, thp or none")
      ->capture_default_str();
  b->add_flag("--json", bench->json, "Print one JSON object");
  b->callback([bench] { run_bench(*bench); });

  auto tune = std::make_shared<TuneOptions>();
  CLI::App* t = io->add_subcommand(
      "tune", "Sweep block x depth x rings for reads and writes; print and save the best");
  t->add_option("--path", tune->path, "Directory on the drive to tune")
      ->required()
      ->check(CLI::ExistingDirectory);
  t->add_option("--blocks", tune->blocks, "Block sizes")->delimiter(',')->capture_default_str();
  t->add_option("--depths", tune->depths, "Queue depths")->delimiter(',')->capture_default_str();
  t->add_option("--rings", tune->rings, "Ring counts")->delimiter(',')->capture_default_str();
  t->add_option("--seconds", tune->seconds, "Seconds per point")->capture_default_str();
  t->add_option("--file-bytes", tune->file_bytes, "Size of the file swept over")
      ->capture_default_str();
  t->add_option("--max-in-flight", tune->max_in_flight,
                "Skip points with more bytes in flight (block x depth x rings)")
      ->capture_default_str();
  t->add_option("--engine", tune->engine, "auto, uring or thread")->capture_default_str();
  t->add_option("--out", tune->out,
                "Where to save the result (default $ZINF_IO_TUNE_FILE, else "
                "$XDG_CACHE_HOME/zinf/io-tune.json, else ~/.cache/zinf/io-tune.json)");
  t->add_flag("--json", tune->json, "Print one JSON object");
  t->callback([tune] { run_tune(*tune); });
}

}  // namespace

ZINF_COMMAND("io", setup_io);

}  // namespace zinf::cli
