#include "trainer.hpp"

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include "data.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"
#include "zinf/engine.hpp"
#include "zinf/trace.hpp"

namespace train_lm {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::size_t max_module_params(const std::vector<ModuleSpec>& specs) {
  std::size_t most = 0;
  for (const ModuleSpec& spec : specs) most = std::max(most, spec.param_count());
  return most;
}

// The process's peak resident set since start, or since the last reset_peak_rss(): VmHWM of
// /proc/self/status (getrusage's ru_maxrss cannot be reset).
std::uint64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return std::uint64_t(usage.ru_maxrss) * 1024;
}

// Writing 5 to clear_refs resets VmHWM to the current RSS (proc(5)), so that the peak of the
// training steps can be told apart from the peak of setting up.
void reset_peak_rss() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
}

// CPU seconds (user + system) of every thread of the process so far, io_uring's workers
// included: with --step-times, a step's CPU against its wall time shows how busy the cores were.
double process_cpu_s() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto s = [](const timeval& t) { return double(t.tv_sec) + double(t.tv_usec) * 1e-6; };
  return s(usage.ru_utime) + s(usage.ru_stime);
}

// The text of a small file without its trailing white space ("" when it cannot be read).
std::string read_all_text(const fs::path& path) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back())) != 0) {
    text.pop_back();
  }
  return text;
}

// FNV-1a (64 bits) of `text`: the fingerprint of the training text that the ranks of a job
// compare.
std::uint64_t fnv1a(const std::string& text) {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  for (const unsigned char c : text) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

// Activation floats of one Model sized for `tokens`.
std::uint64_t activation_bytes(const ModelShape& s, std::size_t tokens) {
  const std::uint64_t per_token = s.context_bytes * s.embed_dim * 2 +    // x0, dx0
                                  (s.blocks + 1) * (2 * s.hidden + 1) +  // h, norm, inv_rms
                                  s.blocks * s.ffn + 256 + 2 * s.hidden +
                                  std::max<std::size_t>(s.ffn, 256);
  return per_token * 4 * tokens;
}

zinf::OffloadDevice offload_device(const std::string& name) {
  zinf::OffloadDevice device = zinf::OffloadDevice::kNone;
  zinf::parse_offload_device(name, &device);
  return device;
}

std::uint64_t sub_group_params(const Options& o, std::uint64_t param_count) {
  if (o.sub_group_size != 0) return o.sub_group_size;
  // About eight sub-groups a rank, so the NVMe reads of one overlap the update of another, in
  // multiples of 2048 parameters, between 64Ki and 4Mi (a 4Mi sub-group is 64 MiB of fp32
  // master, moments and gradient in each pinned block).
  const std::uint64_t per_rank = (param_count + std::uint64_t(o.world_size) - 1) / o.world_size;
  std::uint64_t sub = (per_rank / 8 + 2047) / 2048 * 2048;
  return std::clamp<std::uint64_t>(sub, 65536, std::uint64_t{4} << 20);
}

// The nearest existing directory at or above `path`.
fs::path existing_ancestor(fs::path path) {
  std::error_code ec;
  path = fs::absolute(path, ec);
  while (!path.empty() && !fs::exists(path, ec)) {
    if (path == path.parent_path()) break;
    path = path.parent_path();
  }
  return path;
}

// Checks that a directory can be made at `path` (its free space: check_disk_space()); one line
// of error otherwise.
bool check_writable_dir(const std::string& option, const std::string& path, std::string* error) {
  std::error_code ec;
  if (fs::exists(path, ec) && !fs::is_directory(path, ec)) {
    *error = option + " " + path + ": exists and is not a directory";
    return false;
  }
  const fs::path base = existing_ancestor(path);
  struct statvfs info {};
  if (statvfs(base.c_str(), &info) != 0) {
    *error = option + " " + path + ": cannot stat " + base.string() + ": " + std::strerror(errno);
    return false;
  }
  if ((info.f_flag & ST_RDONLY) != 0 || access(base.c_str(), W_OK) != 0) {
    *error = option + " " + path + ": " + base.string() + " is on a read-only filesystem or " +
             "not writable";
    return false;
  }
  return true;
}

// What a run will write under the directory an option names.
struct DiskNeed {
  std::string option;
  std::string path;
  std::uint64_t bytes = 0;
  std::string what;  // "swap files", "3 checkpoints"
};

// Checks that each filesystem holds what the needs on it add up to (the swap files and the
// checkpoints may share one); one line of error naming the options on it otherwise.
bool check_disk_space(const std::vector<DiskNeed>& needs, std::string* error) {
  struct Filesystem {
    dev_t dev = 0;
    std::uint64_t free_bytes = 0;
    std::string base;
    std::vector<const DiskNeed*> needs;
  };
  std::vector<Filesystem> filesystems;
  for (const DiskNeed& need : needs) {
    if (need.bytes == 0) continue;
    const fs::path base = existing_ancestor(need.path);
    struct stat st {};
    struct statvfs info {};
    if (stat(base.c_str(), &st) != 0 || statvfs(base.c_str(), &info) != 0) {
      *error = need.option + " " + need.path + ": cannot stat " + base.string() + ": " +
               std::strerror(errno);
      return false;
    }
    auto it = std::find_if(filesystems.begin(), filesystems.end(),
                           [&](const Filesystem& f) { return f.dev == st.st_dev; });
    if (it == filesystems.end()) {
      it = filesystems.insert(filesystems.end(), Filesystem{});
      it->dev = st.st_dev;
      it->free_bytes = std::uint64_t(info.f_bavail) * info.f_frsize;
      it->base = base.string();
    }
    it->needs.push_back(&need);
  }
  for (const Filesystem& f : filesystems) {
    std::uint64_t bytes = 0;
    std::string options, parts;
    for (const DiskNeed* need : f.needs) {
      bytes += need->bytes;
      options += (options.empty() ? "" : " and ") + need->option + " " + need->path;
      parts +=
          (parts.empty() ? "" : " + ") + format_bytes(double(need->bytes)) + " of " + need->what;
    }
    if (bytes > f.free_bytes) {
      *error = options + ": " +
               (f.needs.size() == 1 ? "needs " + parts + " but " + f.base
                                    : "need " + format_bytes(double(bytes)) + " (" + parts +
                                          ") but " + f.base + ", where they are,") +
               " has " + format_bytes(double(f.free_bytes)) + " free";
      return false;
    }
  }
  return true;
}

// The topmost directory of `path` (absolute) that does not exist, so that making `path` makes it
// and everything below it; empty when `path` exists.
fs::path topmost_missing(const std::string& path) {
  std::error_code ec;
  fs::path top;
  for (fs::path p = fs::absolute(path, ec); !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    top = p;
    if (p == p.parent_path()) break;
  }
  return top;
}

// `path` absolute, its existing part through symbolic links resolved, without "." or ".." and
// without a trailing separator.
fs::path normal_path(const fs::path& path) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  if (ec) p = fs::absolute(path, ec).lexically_normal();
  return p.has_filename() || p == p.root_path() ? p : p.parent_path();
}

// Whether `dir` is `path` or one of its parents.
bool is_at_or_above(const fs::path& dir, const fs::path& path) {
  const fs::path d = normal_path(dir), p = normal_path(path);
  return std::mismatch(d.begin(), d.end(), p.begin(), p.end()).first == d.end();
}

// Removes `path` and its parents up to `top` (from topmost_missing() before they were made), each
// only while it is an empty directory, and none at or above `keep` (the --out directory, which
// the outputs are written into next): ranks of a job that share the NVMe path each call it when
// they are done, and the last one removes it. Nothing when `top` is empty (the path existed).
void remove_empty_dirs(const std::string& path, const fs::path& top, const std::string& keep) {
  std::error_code ec;
  fs::path p = fs::absolute(path, ec);
  // Only directories at or below `top`.
  if (top.empty() || ec || !is_at_or_above(top, p)) return;
  for (;;) {
    if (!keep.empty() && is_at_or_above(p, keep)) return;
    // One that another rank removed already is passed over. fs::remove removes an empty
    // directory only: one that still holds something (another rank's swap directory) ends it,
    // and that rank removes it when it is done.
    if (fs::is_directory(p, ec)) {
      fs::remove(p, ec);
      if (ec) return;
    }
    if (p == top || p == p.parent_path()) return;
    p = p.parent_path();
  }
}

// Whether `dir` holds a complete checkpoint tag: a manifest.json in a directory whose name does
// not start with '.' (a save cut short is .<tag>.tmp).
bool holds_checkpoint(const fs::path& dir) {
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    if (p.filename() == "manifest.json" && !p.parent_path().filename().string().starts_with(".")) {
      return true;
    }
  }
  return false;
}

// The step of a tag train_lm saves (the engine's default tag, global_step<N>); -1 for another
// name.
std::int64_t tag_step(const std::string& tag) {
  constexpr std::string_view kPrefix = "global_step";
  if (!tag.starts_with(kPrefix) || tag.size() == kPrefix.size() || tag.size() > kPrefix.size() + 18)
    return -1;
  std::int64_t step = 0;
  for (std::size_t i = kPrefix.size(); i < tag.size(); ++i) {
    if (std::isdigit(static_cast<unsigned char>(tag[i])) == 0) return -1;
    step = step * 10 + (tag[i] - '0');
  }
  return step;
}

// What a checkpoint directory holds: the tag its `latest` names, and its complete tags (a
// directory whose name does not start with '.' holding a manifest.json; a save cut short before
// its tag's rename is .<tag>.tmp), by step.
struct SavedTags {
  bool has_latest = false;
  std::string latest;
  std::vector<std::string> tags;

  // "global_step290, global_step300", at most the last `count_max`.
  std::string names(std::size_t count_max = 4) const {
    std::string text;
    const std::size_t first = tags.size() > count_max ? tags.size() - count_max : 0;
    if (first > 0) text = "..., ";
    for (std::size_t i = first; i < tags.size(); ++i) text += (i > first ? ", " : "") + tags[i];
    return text;
  }
};

SavedTags saved_tags(const fs::path& dir) {
  SavedTags saved;
  std::error_code ec;
  saved.has_latest = fs::is_regular_file(dir / "latest", ec);
  if (saved.has_latest) saved.latest = read_all_text(dir / "latest");
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code file_ec;
    if (!name.starts_with(".") && fs::is_regular_file(it->path() / "manifest.json", file_ec)) {
      saved.tags.push_back(name);
    }
  }
  std::sort(saved.tags.begin(), saved.tags.end(), [](const std::string& a, const std::string& b) {
    return std::make_pair(tag_step(a), a) < std::make_pair(tag_step(b), b);
  });
  return saved;
}

// Removes a swap directory that other jobs sharing the NVMe path may use at the same time, only
// if this run created it and it is empty: this process's swap files are gone by then (each
// engine removes its own when it closes, and every engine has closed when this runs), another
// job's live ones stay, and so does the directory holding them (that job removes it when it ends).
void remove_swap_dir(const fs::path& dir, bool created_dir) {
  std::error_code ec;
  if (created_dir) fs::remove(dir, ec);  // only when empty
}

// Directories this run created, removed again (with what is in them) when the run fails, so a
// failed run leaves nothing behind but the checkpoints it saved.
class CreatedDirs {
 public:
  bool make(const std::string& option, const std::string& path, std::string* error) {
    // Remember the topmost directory that did not exist, to remove the whole chain later.
    const fs::path top = topmost_missing(path);
    std::error_code ec;
    fs::create_directories(path, ec);
    if (ec) {
      *error = option + " " + path + ": cannot create it: " + ec.message();
      return false;
    }
    if (!top.empty()) created_.push_back(top);
    return true;
  }
  // Makes the swap directory `path` in its existing NVMe path, which this run may share with
  // other processes, and other jobs given the same --nvme-path share `path` itself: neither is
  // removed with what is in it, only this process's swap files and then `path` if this run made
  // it and it is empty (remove_swap_dir()), never the parent, even where the parent went
  // missing in between.
  bool make_swap_dir(const std::string& option, const std::string& path, std::string* error) {
    std::error_code ec;
    const bool made = fs::create_directory(path, ec);
    if (ec) {
      *error = option + " " + path + ": cannot create it: " + ec.message();
      return false;
    }
    swap_dirs_.push_back({fs::absolute(path, ec), made});
    return true;
  }
  // The swap directory made by make_swap_dir(), removed if this run made it and nothing else is
  // left in it. Once only.
  void remove_swap_dirs() {
    for (const auto& [path, made] : swap_dirs_) remove_swap_dir(path, made);
    swap_dirs_.clear();
  }
  // A directory that holds a complete checkpoint (a tag's manifest.json; the default --save-dir
  // is inside --out) is kept whole, with a line saying so: a failed run never deletes the
  // checkpoints it saved before it failed.
  void remove_all() {
    remove_swap_dirs();
    for (auto it = created_.rbegin(); it != created_.rend(); ++it) {
      std::error_code ec;
      if (holds_checkpoint(*it)) {
        std::fprintf(stderr, "train_lm: kept %s: it holds the checkpoints this run saved\n",
                     it->string().c_str());
        continue;
      }
      fs::remove_all(*it, ec);
    }
    created_.clear();
  }
  const std::vector<fs::path>& created() const { return created_; }

 private:
  std::vector<fs::path> created_;
  std::vector<std::pair<fs::path, bool>> swap_dirs_;  // the path, and whether this run made it
};

// Seconds of the optimizer pipeline's "update" spans (AdamW on a sub-group) that started at or
// after `since_ns`, summed over every rank's pipeline. The rest of the optimizer phase is time the
// step waited for NVMe (or host) reads and writes.
double update_seconds(const zinf::Trace& trace, std::int64_t since_ns) {
  double total = 0;
  const std::vector<std::string> tracks = trace.track_names();
  for (const zinf::Trace::Event& e : trace.events()) {
    if (e.start_ns < since_ns || e.track < 0 || std::size_t(e.track) >= tracks.size()) continue;
    if (tracks[std::size_t(e.track)] == "update") total += double(e.duration_ns) * 1e-9;
  }
  return total;
}

// --- The plain fp32 path: parameters, gradients and AdamW state in this program ---------------

class PlainAccess final : public ParamAccess {
 public:
  PlainAccess(const ModelShape& shape, std::uint64_t seed) : specs_(module_specs(shape)) {
    std::size_t total = 0;
    for (const ModuleSpec& spec : specs_) {
      offsets_.push_back(total);
      total += spec.param_count();
    }
    params_.resize(total);
    grads_.assign(total, 0.0f);
    micro_grads_.assign(total, 0.0f);
    m_.assign(total, 0.0f);
    v_.assign(total, 0.0f);
    for (std::size_t i = 0; i < specs_.size(); ++i)
      init_module(shape, i, seed, &params_[offsets_[i]]);
  }
  const float* acquire(std::size_t m) override { return &params_[offsets_[m]]; }
  void release(std::size_t) override {}
  float* gradient_buffer(std::size_t m) override { return &micro_grads_[offsets_[m]]; }
  // Micro-batches add up in order, as in the engine's accumulator.
  void gradient_ready(std::size_t m) override {
    const std::size_t end = offsets_[m] + specs_[m].param_count();
    for (std::size_t i = offsets_[m]; i < end; ++i) grads_[i] += micro_grads_[i];
  }

  // AdamW (Loshchilov and Hutter, 2019) with bias correction, after clipping the global norm to
  // `clip`, as zinf's engine does it.
  void step(const Options& o, double lr, std::size_t micro_batches) {
    ++t_;
    const double unscale = 1.0 / double(micro_batches);
    double sum_sq = 0;
    for (float g : grads_) sum_sq += double(g) * g;
    const double norm = std::sqrt(sum_sq) * unscale;
    double coef = o.grad_clip > 0 && norm > o.grad_clip ? o.grad_clip / (norm + 1e-6) : 1.0;
    if (o.clip_previous) {
      // zinf.clip_from_previous_step: the previous step's coefficient (the first step's own).
      const double own = coef;
      if (t_ > 1) coef = previous_coef_;
      previous_coef_ = own;
    }
    const double beta1 = 0.9, beta2 = 0.99, eps = 1e-8;
    const double c1 = 1.0 - std::pow(beta1, double(t_)), c2 = 1.0 - std::pow(beta2, double(t_));
    const float step_size = float(lr / c1), decay = float(1.0 - lr * o.weight_decay);
    const float b1 = float(beta1), b2 = float(beta2), cf = float(coef * unscale);
    const float inv_sqrt_c2 = float(1.0 / std::sqrt(c2));
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, params_.size(), 16384),
                      [&](const tbb::blocked_range<std::size_t>& range) {
                        for (std::size_t i = range.begin(); i < range.end(); ++i) {
                          const float g = grads_[i] * cf;
                          m_[i] = b1 * m_[i] + (1 - b1) * g;
                          v_[i] = b2 * v_[i] + (1 - b2) * g * g;
                          params_[i] =
                              params_[i] * decay -
                              step_size * m_[i] / (std::sqrt(v_[i]) * inv_sqrt_c2 + float(eps));
                          grads_[i] = 0.0f;  // the next step accumulates afresh
                        }
                      });
  }
  std::uint64_t state_bytes() const { return 16 * params_.size(); }

 private:
  std::vector<ModuleSpec> specs_;
  std::vector<std::size_t> offsets_;
  std::vector<float> params_, grads_, micro_grads_, m_, v_;
  std::int64_t t_ = 0;
  double previous_coef_ = 1.0;  // --clip-previous
};

// --- The zinf path: one Engine per rank ----------------------------------------------------------

std::string weight_name(const ModuleSpec& spec) { return spec.name + ".weight"; }
std::string bias_name(const ModuleSpec& spec) { return spec.name + ".bias"; }

void parallel_to_f32(const void* src, zinf::DType dtype, float* dst, std::size_t count) {
  constexpr std::size_t kChunk = 1 << 16;
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, count, kChunk),
                    [&](const tbb::blocked_range<std::size_t>& r) {
                      if (dtype == zinf::DType::kF32) {
                        std::memcpy(dst + r.begin(), static_cast<const float*>(src) + r.begin(),
                                    r.size() * sizeof(float));
                      } else {
                        zinf::convert_bf16_to_f32(
                            static_cast<const std::uint16_t*>(src) + r.begin(), dst + r.begin(),
                            r.size());
                      }
                    });
}

// Hands the model each module's parameters from the engine (gathered, then cast to fp32 in a
// scratch buffer the size of the largest module) and its gradients to reduce_gradients().
//
// On a host-accessible device (HostDevice) the engine's device memory is host memory: the
// parameters are read in place and the gradients handed over from the scratch buffer. On any
// other (CudaDevice, an opaque HostDevice) the model still computes on the CPU, so every
// parameter comes down by a device-to-host copy into a host staging buffer (then widened to fp32
// as before), and every gradient goes up by a host-to-device copy into a device buffer the size
// of the largest module, whose pointers reduce_gradients() gets. Both copies run on a stream of
// the rank's device and are synchronised before the engine may touch that memory again: before
// release() (the next gather may overwrite the freed buffers) and before reduce_gradients()
// (the engine reads the gradients on its own stream). The host buffers are registered with the
// device, so that CUDA copies them asynchronously without a bounce buffer.
//
// The model cannot take errors, so the first one is kept and every later call does nothing; the
// caller checks status() after construction and after each pass.
class EngineAccess final : public ParamAccess {
 public:
  EngineAccess(zinf::Engine& engine, zinf::Device& device, const ModelShape& shape,
               zinf::DType param_dtype, int rank, TimeSplit* time)
      : engine_(engine),
        device_(device),
        specs_(module_specs(shape)),
        time_(time),
        copies_(!device.host_accessible()) {
    // One buffer serves parameters and gradients: the model never holds both at once.
    const std::size_t largest = max_module_params(specs_);
    scratch_.resize(largest);
    if (copies_) status_ = open_copies(largest, param_dtype, rank);
  }
  ~EngineAccess() override {
    // Every copy was synchronised when issued, so nothing is in flight on the stream.
    if (scratch_registered_) (void)device_.unregister_host(scratch_.data());
    if (staging_registered_) (void)device_.unregister_host(staging_.data());
  }
  EngineAccess(const EngineAccess&) = delete;
  EngineAccess& operator=(const EngineAccess&) = delete;

  const float* acquire(std::size_t m) override {
    const auto start = Clock::now();
    if (status_.is_ok()) status_ = acquire_into(specs_[m]);
    time_->gather_s += seconds_since(start);
    return scratch_.data();
  }
  void release(std::size_t m) override {
    const auto start = Clock::now();
    if (status_.is_ok()) status_ = engine_.release(specs_[m].name);
    time_->gather_s += seconds_since(start);
  }
  float* gradient_buffer(std::size_t) override { return scratch_.data(); }
  void gradient_ready(std::size_t m) override {
    const auto start = Clock::now();
    if (status_.is_ok()) status_ = reduce_from(specs_[m]);
    time_->reduce_s += seconds_since(start);
  }
  const zinf::Status& status() const { return status_; }

 private:
  // Copies take at most this long before the run fails with kTimeout (a hung device).
  static constexpr std::chrono::milliseconds kCopyTimeout{120'000};

  zinf::Status open_copies(std::size_t largest, zinf::DType param_dtype, int rank) {
    staging_.resize(largest * zinf::dtype_bytes(param_dtype));
    ZINF_ASSIGN_OR_RETURN(stream_, device_.create_stream("train_lm rank " + std::to_string(rank)));
    ZINF_ASSIGN_OR_RETURN(gradients_, zinf::DeviceBuffer::allocate(device_, largest * 4));
    ZINF_RETURN_IF_ERROR(device_.register_host(staging_.data(), staging_.size()));
    staging_registered_ = true;
    ZINF_RETURN_IF_ERROR(device_.register_host(scratch_.data(), scratch_.size() * 4));
    scratch_registered_ = true;
    return zinf::Status::ok();
  }

  // Gathers the module and widens its weights, then biases, to fp32 in the scratch buffer: read
  // in place, or from the staging buffer they are first copied down into.
  zinf::Status acquire_into(const ModuleSpec& spec) {
    ZINF_RETURN_IF_ERROR(engine_.gather(spec.name));
    ZINF_ASSIGN_OR_RETURN(zinf::TensorView w, engine_.parameter(weight_name(spec)));
    zinf::TensorView b;
    if (spec.has_bias) {
      ZINF_ASSIGN_OR_RETURN(b, engine_.parameter(bias_name(spec)));
    }
    float* bias_dst = scratch_.data() + spec.in * spec.out;
    if (!copies_) {
      parallel_to_f32(w.data, w.dtype, scratch_.data(), spec.in * spec.out);
      if (spec.has_bias) parallel_to_f32(b.data, b.dtype, bias_dst, spec.out);
      return zinf::Status::ok();
    }
    const std::size_t w_bytes = w.element_count * zinf::dtype_bytes(w.dtype);
    const std::size_t b_bytes = spec.has_bias ? b.element_count * zinf::dtype_bytes(b.dtype) : 0;
    ZINF_RETURN_IF_ERROR(device_.copy_d2h(staging_.data(), w.data, w_bytes, *stream_));
    if (spec.has_bias) {
      ZINF_RETURN_IF_ERROR(device_.copy_d2h(staging_.data() + w_bytes, b.data, b_bytes, *stream_));
    }
    // Before the widening reads the staging buffer, and before release() frees the module.
    ZINF_RETURN_IF_ERROR(device_.synchronize(*stream_, kCopyTimeout));
    parallel_to_f32(staging_.data(), w.dtype, scratch_.data(), spec.in * spec.out);
    if (spec.has_bias) parallel_to_f32(staging_.data() + w_bytes, b.dtype, bias_dst, spec.out);
    return zinf::Status::ok();
  }

  // Hands the fp32 gradients in the scratch buffer (weights, then biases) to the engine, from
  // host memory in place or from the device buffer they are copied up into.
  zinf::Status reduce_from(const ModuleSpec& spec) {
    const std::size_t count = spec.param_count();
    const float* data = scratch_.data();
    if (copies_) {
      ZINF_RETURN_IF_ERROR(
          device_.copy_h2d(gradients_.data(), scratch_.data(), count * 4, *stream_));
      // The engine reads the gradients on its own stream: they must be there when it is called.
      ZINF_RETURN_IF_ERROR(device_.synchronize(*stream_, kCopyTimeout));
      data = gradients_.as<const float>();
    }
    // GradientRef holds the names as views: they must outlive the call.
    const std::string weight = weight_name(spec), bias = bias_name(spec);
    zinf::GradientRef refs[2] = {{weight, data, spec.in * spec.out, zinf::DType::kF32},
                                 {bias, data + spec.in * spec.out, spec.out, zinf::DType::kF32}};
    return engine_.reduce_gradients(
        spec.name, std::span<const zinf::GradientRef>(refs, spec.has_bias ? 2 : 1));
  }

  zinf::Engine& engine_;
  zinf::Device& device_;
  std::vector<ModuleSpec> specs_;
  TimeSplit* time_;
  const bool copies_;  // the device is not host-accessible: parameters and gradients are copied
  std::vector<float> scratch_;
  // Only on a device that is not host-accessible: the copies' stream, the parameters' staging
  // buffer (the largest module in the parameter dtype) and the gradients' device buffer.
  std::unique_ptr<zinf::Stream> stream_;
  std::vector<std::byte> staging_;
  zinf::DeviceBuffer gradients_;
  bool staging_registered_ = false, scratch_registered_ = false;
  zinf::Status status_;
};

// Registers the model through initializers, so that its initial values are never held whole:
// the engine asks each rank for its partition's ranges during finalize(), in registration order,
// and the rank's cache generates one module at a time (init_module, seeded per module, so the
// values are the same bits as generating the whole model) and serves the ranges from it. Memory:
// the largest module's fp32 values, freed when finalize() drops the initializers.
zinf::Status register_model(zinf::Engine& engine, const ModelShape& shape, std::uint64_t seed,
                            zinf::DType dtype) {
  struct ModuleCache {
    std::size_t module = std::numeric_limits<std::size_t>::max();
    std::vector<float> values;  // the cached module's weights then biases
  };
  const std::vector<ModuleSpec> specs = module_specs(shape);
  auto cache = std::make_shared<ModuleCache>();
  const std::size_t largest = max_module_params(specs);
  // The initializer of the parameter at `base` in module m's values.
  auto initializer = [&](std::size_t m, std::size_t base) {
    return [cache, shape, seed, largest, m, base](std::size_t first_element,
                                                  std::size_t element_count, float* out) {
      if (cache->module != m) {
        cache->values.resize(largest);
        init_module(shape, m, seed, cache->values.data());
        cache->module = m;
      }
      std::memcpy(out, cache->values.data() + base + first_element, element_count * sizeof(float));
      return zinf::Status::ok();
    };
  };
  for (std::size_t m = 0; m < specs.size(); ++m) {
    const ModuleSpec& spec = specs[m];
    zinf::ParameterSpec weight;
    weight.name = weight_name(spec);
    weight.module = spec.name;
    weight.shape = {std::int64_t(spec.in), std::int64_t(spec.out)};
    weight.dtype = dtype;
    weight.initializer = initializer(m, 0);
    ZINF_RETURN_IF_ERROR(engine.register_parameter(weight));
    if (spec.has_bias) {
      zinf::ParameterSpec bias = weight;
      bias.name = bias_name(spec);
      bias.shape = {std::int64_t(spec.out)};
      bias.initializer = initializer(m, spec.in * spec.out);
      ZINF_RETURN_IF_ERROR(engine.register_parameter(bias));
    }
  }
  return engine.finalize();
}

zinf::Config engine_config(const Options& o, std::uint64_t param_count,
                           std::size_t largest_module) {
  zinf::Config c;
  c.train_micro_batch_size_per_gpu = o.batch / (std::size_t(o.world_size) * o.micro_batches);
  c.gradient_accumulation_steps = o.micro_batches;
  c.gradient_accumulation_given = true;  // every step has exactly that many
  c.gradient_clipping = o.grad_clip;
  c.clip_from_previous_step = o.clip_previous;
  c.cpu_threads = o.optimizer_threads;
  c.keep_last = o.keep_last;
  c.overlap_step = o.overlap_step;
  c.bf16_enabled = o.param_dtype == "bf16";
  c.optimizer.kind = zinf::OptimizerKind::kAdamW;
  c.optimizer.lr = o.lr;
  c.optimizer.beta1 = 0.9;
  c.optimizer.beta2 = 0.99;
  c.optimizer.eps = 1e-8;
  c.optimizer.weight_decay = o.weight_decay;
  c.scheduler = o.schedule;
  c.zero.stage = o.stage;
  c.zero.offload_optimizer.device = offload_device(o.offload_optimizer);
  c.zero.offload_optimizer.nvme_path = o.nvme_path;
  c.zero.offload_optimizer.buffer_count = o.optimizer_buffers;
  c.zero.offload_param.device = offload_device(o.offload_param);
  c.zero.offload_param.nvme_path = o.nvme_path;
  c.zero.sub_group_size = sub_group_params(o, param_count);
  c.gradients_on_nvme = o.gradients_on_nvme;
  // The model holds one module gathered at a time; allow one more in flight (the prefetch) and
  // keep the reduce buckets small, so that a large model's transient buffers stay small next to
  // its state: 16Mi elements a bucket is 64 MiB of fp32 a rank.
  c.zero.reduce_bucket_size = std::size_t{16} << 20;
  c.zero.stage3_prefetch_bucket_size = largest_module;
  c.zero.stage3_max_live_parameters = 2 * largest_module;
  c.zero.stage3_param_persistence_threshold = o.persistence_threshold;
  c.world_size = o.world_size;
  c.collective_timeout_ms = o.collective_timeout_ms;
  return c;
}

// The activation store for --checkpoint-activations --offload-activations: cpu keeps every block
// input of a micro-batch in the pinned host arena; nvme puts them all in the swap directory (no
// arena), in a swap file sized for them.
void set_activation_config(const Options& o, const ModelShape& shape, const std::string& swap_dir,
                           zinf::Config* c) {
  const std::size_t world = std::size_t(o.world_size);
  const std::uint64_t tokens =
      std::max<std::uint64_t>(o.batch / (world * o.micro_batches), 1) * o.seq_len;
  const std::uint64_t block_bytes = tokens * shape.hidden * sizeof(float);
  const std::uint64_t unit = std::uint64_t{1} << 20;  // the swap block (aio.block_size)
  c->activations.cpu_checkpointing = o.offload_activations != "none";
  if (o.offload_activations == "cpu") {
    c->activations.host_bytes = shape.blocks * ((block_bytes + 255) / 256 * 256);
  } else if (o.offload_activations == "nvme") {
    c->activations.host_bytes = 0;
    c->activations.nvme_path = swap_dir;
    c->activations.nvme_bytes = shape.blocks * ((block_bytes + unit - 1) / unit * unit) + unit;
  }
}

// The exchange between the processes of a job (--comm mpi, nccl): all-gathers a few bytes of
// every rank through the communicator, on the rank's device, so that each process holds every
// rank's sums in rank order, as the threads of --comm local share them. The bytes travel as f32
// elements of an all-gather, which copies them unchanged.
class Exchange {
 public:
  static constexpr std::size_t kMaxBytes = 256;

  Exchange(zinf::Device& device, zinf::Communicator& comm, std::chrono::milliseconds timeout)
      : device_(device), comm_(comm), timeout_(timeout) {}
  zinf::Status open() {
    const std::size_t world = std::size_t(comm_.world_size());
    ZINF_ASSIGN_OR_RETURN(send_, zinf::DeviceBuffer::allocate(device_, kMaxBytes));
    ZINF_ASSIGN_OR_RETURN(recv_, zinf::DeviceBuffer::allocate(device_, kMaxBytes * world));
    ZINF_ASSIGN_OR_RETURN(stream_, device_.create_stream("train_lm exchange"));
    ZINF_ASSIGN_OR_RETURN(done_, device_.create_event());
    return zinf::Status::ok();
  }
  // all[r * bytes, (r + 1) * bytes) = rank r's `mine`, for every rank r.
  // REQUIRES: bytes is a multiple of 4 and at most kMaxBytes.
  zinf::Status all_gather(const void* mine, std::size_t bytes, void* all) {
    const std::size_t world = std::size_t(comm_.world_size());
    ZINF_RETURN_IF_ERROR(device_.copy_h2d(send_.data(), mine, bytes, *stream_));
    ZINF_RETURN_IF_ERROR(comm_.all_gather(send_.data(), recv_.data(), bytes / 4, zinf::DType::kF32,
                                          *stream_, "train_lm sums"));
    ZINF_RETURN_IF_ERROR(device_.copy_d2h(all, recv_.data(), bytes * world, *stream_));
    ZINF_RETURN_IF_ERROR(device_.record(*done_, *stream_));
    return comm_.wait(*done_, timeout_);
  }
  // (*all)[r] = rank r's `mine`, for every rank r: texts of any length, in pieces of kMaxBytes.
  zinf::Status all_gather_text(const std::string& mine, std::vector<std::string>* all) {
    const std::size_t world = std::size_t(comm_.world_size());
    const std::uint32_t length = std::uint32_t(mine.size());
    std::vector<std::uint32_t> lengths(world);
    ZINF_RETURN_IF_ERROR(all_gather(&length, sizeof(length), lengths.data()));
    const std::size_t longest = *std::max_element(lengths.begin(), lengths.end());
    all->assign(world, std::string());
    std::vector<char> piece(kMaxBytes), pieces(kMaxBytes * world);
    for (std::size_t offset = 0; offset < longest; offset += kMaxBytes) {
      std::fill(piece.begin(), piece.end(), '\0');
      if (offset < mine.size()) {
        mine.copy(piece.data(), std::min(kMaxBytes, mine.size() - offset), offset);
      }
      ZINF_RETURN_IF_ERROR(all_gather(piece.data(), kMaxBytes, pieces.data()));
      for (std::size_t r = 0; r < world; ++r) {
        if (offset < lengths[r]) {
          (*all)[r].append(&pieces[r * kMaxBytes],
                           std::min<std::size_t>(kMaxBytes, lengths[r] - offset));
        }
      }
    }
    return zinf::Status::ok();
  }

 private:
  zinf::Device& device_;
  zinf::Communicator& comm_;
  const std::chrono::milliseconds timeout_;
  // The buffers outlive the stream, whose destruction waits for its work.
  zinf::DeviceBuffer send_, recv_;
  std::unique_ptr<zinf::Stream> stream_;
  std::unique_ptr<zinf::Event> done_;
};

// What the ranks share: the step barrier, each rank's loss sums, the stop flag and the first
// error. The barrier's completion (run by one thread when every rank has arrived) turns the sums
// into the curve and the progress bar.
// What a checkpoint keeps beside the engine's state (the engine's client state): the step, the
// batch sampler's state and the loss curve so far, so that a resumed run draws the same batches
// and writes the same loss.csv. Text, doubles as C99 hex floats (exact):
//   train_lm-resume 1 / step N / rng STATE / point STEP TRAIN VAL|- TOKENS_PER_S ...
std::string resume_blob(std::int64_t step, std::uint64_t rng_state,
                        const std::vector<CurvePoint>& curve) {
  std::string text = "train_lm-resume 1\nstep " + std::to_string(step) + "\nrng " +
                     std::to_string(rng_state) + "\n";
  char line[160];
  for (const CurvePoint& p : curve) {
    if (p.val_loss) {
      std::snprintf(line, sizeof line, "point %lld %a %a %a\n", static_cast<long long>(p.step),
                    p.train_loss, *p.val_loss, p.tokens_per_s);
    } else {
      std::snprintf(line, sizeof line, "point %lld %a - %a\n", static_cast<long long>(p.step),
                    p.train_loss, p.tokens_per_s);
    }
    text += line;
  }
  return text;
}

bool parse_resume_blob(const std::string& text, std::int64_t* step, std::uint64_t* rng_state,
                       std::vector<CurvePoint>* curve) {
  std::istringstream in(text);
  std::string word;
  int version = 0;
  if (!(in >> word >> version) || word != "train_lm-resume" || version != 1) return false;
  if (!(in >> word >> *step) || word != "step") return false;
  if (!(in >> word >> *rng_state) || word != "rng") return false;
  curve->clear();
  while (in >> word) {
    if (word != "point") return false;
    std::string step_text, train, val, rate;
    if (!(in >> step_text >> train >> val >> rate)) return false;
    CurvePoint p;
    p.step = std::stoll(step_text);
    p.train_loss = std::strtod(train.c_str(), nullptr);
    if (val != "-") p.val_loss = std::strtod(val.c_str(), nullptr);
    p.tokens_per_s = std::strtod(rate.c_str(), nullptr);
    curve->push_back(p);
  }
  return true;
}

struct Shared;
struct StepDone {
  Shared* shared;
  void operator()() noexcept;
};

struct Shared {
  // `local_ranks` of the world's ranks run in this process: all of them as threads (--comm
  // local), or one (--comm mpi, nccl), whose sums the others' processes learn by an exchange.
  Shared(const Options& o, const ModelShape& s, const Corpus& c, RunSummary* sum, int local_ranks,
         bool prints)
      : options(o),
        shape(s),
        corpus(c),
        summary(sum),
        world(o.world_size),
        sync(local_ranks, StepDone{this}),
        train_sum(std::size_t(o.world_size)),
        val_sum(std::size_t(o.world_size)),
        memory(std::size_t(o.world_size)),
        nvme_read(std::size_t(o.world_size)),
        nvme_write(std::size_t(o.world_size)),
        progress(stderr, o.steps, o.progress && !o.quiet && prints),
        prints(prints) {}

  void fail(int rank, const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex);
    if (error.empty())
      error = world > 1 ? "rank " + std::to_string(rank) + ": " + message : message;
    failed = true;
  }

  const Options& options;
  const ModelShape& shape;
  const Corpus& corpus;
  RunSummary* summary;
  int world;
  std::barrier<StepDone> sync;
  // Written by each rank before the barrier, read in its completion.
  std::vector<double> train_sum, val_sum;
  std::vector<zinf::MemoryReport> memory;
  std::vector<std::uint64_t> nvme_read, nvme_write;
  std::int64_t step = 0;  // the step the ranks are finishing (the checkpoint's when resumed)
  bool has_val = false;
  std::atomic<bool> stop{false};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::string error;
  Clock::time_point start = Clock::now();
  Clock::time_point last_step_end = Clock::now();
  double train_s = 0;  // wall time inside steps, for tokens/s
  double last_val = 0;
  TimeSplit last_time;  // rank 0's split at the previous step, for the per-step lines
  std::uint64_t last_nvme_bytes = 0;
  double last_cpu_s = 0;  // process_cpu_s() at the end of the previous step's line
  ProgressBar progress;
  zinf::Trace* trace = nullptr;
  // One process per rank: what each rank's process wrote into the vectors above reaches the
  // others before the barrier (null with --comm local, where they share them).
  Exchange* exchange = nullptr;
  int first_rank = 0;  // the rank of this process's first thread
  bool prints = true;  // this process prints (rank 0's)
  // The optimizer pipeline's spans are in `trace` (the optimizer state is offloaded): the I/O wait
  // can be told from the update time.
  bool pipeline_traced = false;
  std::int64_t first_step_ns = 0, last_step_end_ns = 0;
};

void StepDone::operator()() noexcept {
  Shared& s = *shared;
  const Options& o = s.options;
  if (s.failed) return;
  double val = 0;
  if (s.has_val) {
    for (double v : s.val_sum) val += v;
    val /= double(o.eval_tokens / std::size_t(o.world_size) * std::size_t(o.world_size));
    s.last_val = val;
  }
  RunSummary& sum = *s.summary;
  // The validation's line: the one before the first step always, and every later one when no
  // progress bar shows them.
  auto print_validation = [&]() {
    s.progress.finish_line();
    std::fprintf(stderr, "step %lld: validation loss %.3f nats/byte (ln 256 = 5.545)\n",
                 static_cast<long long>(s.step), val);
  };
  // The validation before the first step this run trains.
  if (s.step < s.summary->first_step) {
    sum.first_val_loss = val;
    if (!o.quiet && s.prints) print_validation();
    s.last_step_end = Clock::now();
    // The split covers the steps: the first validation (and its gathers) is setting up.
    sum.time = TimeSplit{};
    s.last_time = sum.time;
    s.first_step_ns = s.last_step_end_ns = zinf::Trace::now_ns();
    s.last_cpu_s = process_cpu_s();
    sum.setup_peak_rss_bytes = peak_rss_bytes();
    reset_peak_rss();
    return;
  }
  double train = 0;
  for (double v : s.train_sum) train += v;
  const std::size_t tokens = o.batch * o.seq_len;
  train /= double(tokens);
  sum.tokens_seen += tokens;
  ++sum.steps_done;
  sum.final_train_loss = train;
  const double step_s = seconds_since(s.last_step_end);
  s.last_step_end = Clock::now();
  s.train_s += step_s;
  CurvePoint point;
  point.step = s.step;
  point.train_loss = train;
  if (s.has_val) {
    point.val_loss = val;
    sum.final_val_loss = val;
  }
  point.tokens_per_s = double(tokens) / std::max(step_s, 1e-9);
  sum.curve.push_back(point);
  const double elapsed = seconds_since(s.start);
  const double cpu_s = process_cpu_s();
  // Slow steps (a large model) get a line each saying where their time went.
  if (!o.quiet && s.prints && (o.step_times || step_s > 2.0)) {
    const TimeSplit& now = sum.time;
    const TimeSplit& was = s.last_time;
    std::uint64_t nvme_bytes = 0;
    for (int r = 0; r < s.world; ++r) {
      nvme_bytes += s.nvme_read[std::size_t(r)] + s.nvme_write[std::size_t(r)];
    }
    const double optimizer_s = now.optimizer_s - was.optimizer_s;
    const double io_wait_s =
        s.pipeline_traced
            ? std::max(0.0, optimizer_s - update_seconds(*s.trace, s.last_step_end_ns) / s.world)
            : 0.0;
    // Overlapped (zinf.overlap_step), the optimizer figures are the previous step's pass, which
    // ran on behind this step's forward: how much of it was hidden, and how long gathers waited.
    char overlap[96] = "";
    if (o.use_engine && o.overlap_step && o.offload_optimizer != "none") {
      std::snprintf(overlap, sizeof(overlap),
                    "; previous step's, %.2fs hidden, gathers waited %.2fs",
                    now.hidden_s - was.hidden_s, now.gather_wait_s - was.gather_wait_s);
    }
    s.progress.finish_line();
    std::fprintf(stderr,
                 "step %lld: %.2fs = forward %.2fs + backward %.2fs + gather %.2fs + reduce "
                 "%.2fs + step %.2fs (AdamW+NVMe %.2fs of which I/O wait %.2fs, %s NVMe "
                 "traffic, %.2f GB/s%s) + eval %.2fs; loss %.3f; cpu %.2fs\n",
                 static_cast<long long>(s.step), step_s, now.forward_s - was.forward_s,
                 now.backward_s - was.backward_s, now.gather_s - was.gather_s,
                 now.reduce_s - was.reduce_s, now.step_s - was.step_s, optimizer_s, io_wait_s,
                 format_bytes(double(nvme_bytes - s.last_nvme_bytes)).c_str(),
                 optimizer_s > 0 ? double(nvme_bytes - s.last_nvme_bytes) / optimizer_s / 1e9 : 0.0,
                 overlap, now.eval_s - was.eval_s, train, cpu_s - s.last_cpu_s);
    s.last_time = now;
    s.last_nvme_bytes = nvme_bytes;
  }
  if (s.has_val && !o.progress && !o.quiet && s.prints) print_validation();
  s.last_step_end_ns = zinf::Trace::now_ns();
  s.last_cpu_s = cpu_s;
  const double mean_rate = double(sum.tokens_seen) / std::max(s.train_s, 1e-9);
  char extra[64];
  std::snprintf(extra, sizeof(extra), "val %.3f", s.last_val);
  s.progress.update(s.step, train, mean_rate, elapsed, extra);
  if (o.time_limit_s > 0 && elapsed > o.time_limit_s) s.stop = true;
}

// --checkpoint-activations through the engine's activation store: each block's input under the
// key "block<l>.input". The model cannot take errors, so the first one is kept (as EngineAccess
// does) and every later call does nothing.
class EngineCheckpoints final : public CheckpointStore {
 public:
  explicit EngineCheckpoints(zinf::Engine& engine) : engine_(engine) {}
  void save(std::size_t block, const float* data, std::size_t count) override {
    if (status_.is_ok()) status_ = engine_.save_activation(key(block), data, count * sizeof(float));
  }
  void load(std::size_t block, float* data) override {
    if (status_.is_ok()) status_ = engine_.load_activation(key(block), data);
  }
  void flush() override {
    if (status_.is_ok()) status_ = engine_.flush_activations();
  }
  const zinf::Status& status() const { return status_; }

 private:
  static std::string key(std::size_t block) { return "block" + std::to_string(block) + ".input"; }
  zinf::Engine& engine_;
  zinf::Status status_;
};

// --checkpoint-activations without the engine: the block inputs in vectors of this program,
// counted as device-resident (they would be on a GPU); the most bytes held at once.
class KeptCheckpoints final : public CheckpointStore {
 public:
  void save(std::size_t block, const float* data, std::size_t count) override {
    if (kept_.size() <= block) kept_.resize(block + 1);
    kept_[block].assign(data, data + count);
    held_bytes_ += count * sizeof(float);
    peak_bytes_ = std::max(peak_bytes_, held_bytes_);
  }
  void load(std::size_t block, float* data) override {
    std::copy(kept_[block].begin(), kept_[block].end(), data);
    held_bytes_ -= kept_[block].size() * sizeof(float);
    kept_[block].clear();
  }
  void flush() override {}
  std::uint64_t peak_bytes() const { return peak_bytes_; }

 private:
  std::vector<std::vector<float>> kept_;
  std::uint64_t held_bytes_ = 0, peak_bytes_ = 0;
};

// One rank's whole run. `engine` (and `device`, `comm`) are null on the plain path.
void run_rank(Shared& shared, int rank, zinf::Engine* engine, zinf::Device* device,
              zinf::Communicator* comm) {
  const Options& o = shared.options;
  const ModelShape& shape = shared.shape;
  const std::size_t world = std::size_t(o.world_size);
  // The global batch is cut into world * micro_batches equal slices, rank r taking slices
  // r * micro_batches ... (r + 1) * micro_batches - 1 in turn. With 4 slices, one rank with 4
  // micro-batches and four ranks with one each add the same gradients in the same order.
  const std::size_t micro_batches = o.micro_batches;
  const std::size_t micro_tokens = o.batch / (world * micro_batches) * o.seq_len;
  const std::size_t eval_local = o.eval_tokens / world;
  const std::size_t chunk_tokens = std::max<std::size_t>(micro_tokens, 1);
  // This rank's first error. It is also the reason this rank aborts the communicator with, which
  // the other ranks' errors quote ("rank 1 failed: ..."), so that they say what failed here.
  std::string own_error;
  auto fail = [&](const std::string& message) {
    shared.fail(rank, message);
    if (own_error.empty()) own_error = message;
  };
  // Leaves the run after fail(): the other ranks' collectives fail at once instead of waiting for
  // this rank until their timeout.
  auto fail_out = [&]() {
    if (comm != nullptr) comm->abort(zinf::Status::aborted(own_error));
    if (engine != nullptr && o.verify_swap_on_error) {
      // Whatever failed (a dead rank's collective), this rank's swap files must be intact.
      zinf::Result<zinf::SwapCheckReport> swap = engine->verify_swap();
      if (swap.is_ok()) {
        std::fprintf(stderr,
                     "train_lm: rank %d: swap verified: %llu blocks (%llu bytes) match their "
                     "checksums, %llu skipped\n",
                     rank, static_cast<unsigned long long>(swap->blocks),
                     static_cast<unsigned long long>(swap->bytes),
                     static_cast<unsigned long long>(swap->skipped_blocks));
      } else {
        std::fprintf(stderr, "train_lm: rank %d: swap verification failed: %s\n", rank,
                     swap.status().to_string().c_str());
      }
    }
    shared.sync.arrive_and_drop();
  };

  // --checkpoint-activations: with the engine, the residual stream the model saves from lives in
  // the engine's device memory (HostDevice: host memory the model writes in place).
  std::unique_ptr<EngineCheckpoints> engine_checkpoints;
  std::unique_ptr<KeptCheckpoints> kept_checkpoints;
  zinf::DeviceBuffer stream_buffers[2];
  Checkpointing checkpointing;
  if (o.checkpoint_activations && engine != nullptr) {
    engine_checkpoints = std::make_unique<EngineCheckpoints>(*engine);
    checkpointing.store = engine_checkpoints.get();
    for (int b = 0; b < 2; ++b) {
      zinf::Result<zinf::DeviceBuffer> buffer =
          zinf::DeviceBuffer::allocate(*device, chunk_tokens * shape.hidden * sizeof(float));
      if (!buffer.is_ok()) {
        fail("--checkpoint-activations: " + buffer.status().to_string());
        return fail_out();
      }
      stream_buffers[b] = std::move(*buffer);
      checkpointing.stream_buffers[b] = stream_buffers[b].as<float>();
    }
  } else if (o.checkpoint_activations) {
    kept_checkpoints = std::make_unique<KeptCheckpoints>();
    checkpointing.store = kept_checkpoints.get();
  }
  Model model(shape, chunk_tokens, checkpointing);
  if (engine != nullptr) engine->set_activation_bytes(model.activation_bytes());
  TimeSplit local_time;
  TimeSplit& time = rank == 0 ? shared.summary->time : local_time;

  std::unique_ptr<PlainAccess> plain;
  std::unique_ptr<EngineAccess> through_engine;
  ParamAccess* access = nullptr;
  if (engine == nullptr) {
    plain = std::make_unique<PlainAccess>(shape, o.seed);
    access = plain.get();
  } else {
    through_engine = std::make_unique<EngineAccess>(
        *engine, *device, shape, o.param_dtype == "bf16" ? zinf::DType::kBF16 : zinf::DType::kF32,
        rank, &time);
    access = through_engine.get();
  }
  const int track =
      shared.trace != nullptr ? shared.trace->track("train_lm rank " + std::to_string(rank)) : 0;
  auto check = [&](const char* what) {
    if (through_engine && !through_engine->status().is_ok()) {
      fail(std::string(what) + ": " + through_engine->status().to_string());
      return false;
    }
    if (engine_checkpoints && !engine_checkpoints->status().is_ok()) {
      fail(std::string(what) + ": " + engine_checkpoints->status().to_string());
      return false;
    }
    return true;
  };

  if (!check("device")) return fail_out();

  // --resume: the engine's state from the checkpoint, and from its client state the step, the
  // batch sampler and (rank 0) the loss curve so far.
  std::int64_t first_step = 1;
  std::uint64_t rng_state = o.seed ^ 0xD1B54A32D192ED03ull;
  if (!o.resume_dir.empty()) {
    const auto load_start = Clock::now();
    zinf::Status st = engine->load_checkpoint(o.resume_dir);
    const double load_s = seconds_since(load_start);
    std::vector<CurvePoint> curve;
    std::int64_t saved_step = 0;
    if (st.is_ok() && !parse_resume_blob(engine->client_state(), &saved_step, &rng_state, &curve)) {
      st = zinf::Status::corruption("--resume " + o.resume_dir +
                                    ": the checkpoint holds no train_lm state");
    }
    if (!st.is_ok()) {
      fail("--resume: " + st.to_string());
      return fail_out();
    }
    if (saved_step >= o.steps) {
      // Nothing left to train: said, not a run of no steps that reports zeros.
      fail("--resume " + o.resume_dir + ": the checkpoint is at step " +
           std::to_string(saved_step) + ", and --steps is " + std::to_string(o.steps) +
           ": nothing to train (give --steps above " + std::to_string(saved_step) + ")");
      return fail_out();
    }
    // A tag this run would save exists already in --save-dir. The engine replaces a tag saved
    // again. A complete tag newer than the one `latest` names (or any, with no `latest`) is what
    // a save cut short between its tag's rename and `latest`'s leaves, or what follows a
    // `latest` pointed back: this run saves it again, and that is said. Any other (the tags of
    // another run, when --save-dir is not --resume's) would be another run's checkpoint
    // replaced: refused now, before any step.
    const SavedTags held = saved_tags(o.save_dir);
    const std::int64_t latest_step = held.has_latest ? tag_step(held.latest) : -1;
    for (std::int64_t step = saved_step + 1; o.save_every > 0 && step <= o.steps; ++step) {
      if (step % o.save_every != 0) continue;
      const std::string name = "global_step" + std::to_string(step);
      const fs::path tag = fs::path(o.save_dir) / name;
      std::error_code ec;
      if (!fs::exists(tag, ec)) continue;
      const bool complete = std::find(held.tags.begin(), held.tags.end(), name) != held.tags.end();
      if (complete && (!held.has_latest || (latest_step >= 0 && step > latest_step))) {
        if (rank == shared.first_rank && shared.prints) {
          std::fprintf(stderr,
                       "train_lm: note: %s is newer than the tag `latest` names (a save cut "
                       "short before it moved `latest`): this run saves it again\n",
                       tag.string().c_str());
        }
        continue;
      }
      fail("--resume " + o.resume_dir + " at step " + std::to_string(saved_step) + ": " +
           tag.string() + " exists already, and this run would save that tag again (replacing " +
           "it): give another --save-dir, or remove the tags after step " +
           std::to_string(saved_step));
      return fail_out();
    }
    first_step = saved_step + 1;
    if (rank == shared.first_rank) {
      shared.summary->curve = std::move(curve);
      shared.summary->first_step = first_step;
    }
    if (rank == shared.first_rank && !o.quiet && shared.prints) {
      // Which checkpoint, and what of this command it overrides.
      std::string tag = read_all_text(fs::path(o.resume_dir) / "latest");
      std::fprintf(stderr,
                   "resumed from %s/%s at step %lld (loaded in %.2fs): the checkpoint's "
                   "learning-rate schedule, data position and seed go on (this command's --lr, "
                   "--warmup and --seed are not used)\n",
                   o.resume_dir.c_str(), tag.c_str(), static_cast<long long>(saved_step), load_s);
    }
  }

  TokenBatch val_batch, batch;
  shared.corpus.validation_batch(eval_local * world, shape.context_bytes, &val_batch);
  auto evaluate = [&]() {
    zinf::Trace::Span span(shared.trace, track, "validation");
    const auto start = Clock::now();
    const double gather_before = time.gather_s;
    double sum = 0;
    // Every rank runs the same number of forward passes (so the same gathers), some maybe short.
    const std::size_t first = std::size_t(rank) * eval_local;
    for (std::size_t done = 0; done < eval_local; done += chunk_tokens) {
      const std::size_t count = std::min(chunk_tokens, eval_local - done);
      sum += model.forward(&val_batch.contexts[(first + done) * shape.context_bytes],
                           &val_batch.targets[first + done], count, *access,
                           /*for_backward=*/false);
      if (!check("validation")) return false;
    }
    shared.val_sum[std::size_t(rank)] = sum;
    time.eval_s += seconds_since(start) - (time.gather_s - gather_before);
    return true;
  };

  // Only the process's first rank writes what the barrier's completion reads; every rank decides
  // the same locally.
  if (rank == shared.first_rank) {
    shared.step = first_step - 1;
    shared.has_val = true;
  }
  // One process per rank: every rank's sums reach every process before the barrier's completion
  // reads them; after it, rank 0's decision to stop (the time limit) reaches the others.
  auto exchange_sums = [&](const char* what) {
    if (shared.exchange == nullptr) return true;
    const double mine[2] = {shared.train_sum[std::size_t(rank)], shared.val_sum[std::size_t(rank)]};
    std::vector<double> all(2 * world);
    zinf::Status st = shared.exchange->all_gather(mine, sizeof(mine), all.data());
    if (!st.is_ok()) {
      fail(std::string(what) + ": " + st.to_string());
      return false;
    }
    for (std::size_t r = 0; r < world; ++r) {
      shared.train_sum[r] = all[2 * r];
      shared.val_sum[r] = all[2 * r + 1];
    }
    return true;
  };
  auto exchange_stop = [&](const char* what) {
    if (shared.exchange == nullptr) return true;
    const std::uint32_t mine = shared.stop ? 1 : 0;
    std::vector<std::uint32_t> all(world);
    zinf::Status st = shared.exchange->all_gather(&mine, sizeof(mine), all.data());
    if (!st.is_ok()) {
      fail(std::string(what) + ": " + st.to_string());
      return false;
    }
    shared.stop = all[0] != 0;
    return true;
  };

  if (!evaluate()) return fail_out();
  if (!exchange_sums("validation")) return fail_out();
  shared.sync.arrive_and_wait();
  if (shared.failed) return;

  // Every rank draws the same global batch and trains on its slice of it, so the world size
  // changes only how the sums are split, not what is learned.
  Rng rng(rng_state);
  for (std::int64_t step = first_step; step <= o.steps; ++step) {
    const auto step_start = Clock::now();
    // The engine steps the schedule (Config::scheduler) itself.
    const double lr = engine != nullptr ? engine->learning_rate() : plain_learning_rate(o, step);
    shared.corpus.sample_train(rng, o.batch, o.seq_len, shape.context_bytes, &batch);
    double loss_sum = 0;
    for (std::size_t micro = 0; micro < micro_batches; ++micro) {
      const std::size_t first = (std::size_t(rank) * micro_batches + micro) * micro_tokens;
      double gather_before = time.gather_s;
      auto start = Clock::now();
      {
        zinf::Trace::Span span(shared.trace, track, "forward");
        loss_sum += model.forward(&batch.contexts[first * shape.context_bytes],
                                  &batch.targets[first], micro_tokens, *access);
      }
      time.forward_s += seconds_since(start) - (time.gather_s - gather_before);
      if (!check("forward")) return fail_out();

      gather_before = time.gather_s;
      const double reduce_before = time.reduce_s;
      start = Clock::now();
      {
        zinf::Trace::Span span(shared.trace, track, "backward");
        // The gradient of this micro-batch's mean loss; the engine sums the micro-batches of a
        // step, averages over ranks and divides by the micro-batch count.
        model.backward(1.0f / float(micro_tokens), *access);
      }
      time.backward_s +=
          seconds_since(start) - (time.gather_s - gather_before) - (time.reduce_s - reduce_before);
      if (!check("backward")) return fail_out();
    }

    const auto step_call = Clock::now();
    if (engine != nullptr) {
      zinf::Result<zinf::StepReport> report = engine->step();
      if (!report.is_ok()) {
        fail("step " + std::to_string(step) + ": " + report.status().to_string());
        return fail_out();
      }
      const zinf::StepReport& r = report.value();
      time.optimizer_s += double(r.optimizer_ns) * 1e-9;
      time.hidden_s += double(r.hidden_ns) * 1e-9;
      time.gather_wait_s += double(r.gather_wait_ns) * 1e-9;
      shared.nvme_read[std::size_t(rank)] += r.optimizer_nvme_read_bytes;
      shared.nvme_write[std::size_t(rank)] +=
          r.optimizer_nvme_write_bytes + r.param_nvme_write_bytes;
    } else {
      plain->step(o, lr, micro_batches);
    }
    time.step_s += seconds_since(step_call);

    shared.train_sum[std::size_t(rank)] = loss_sum;
    // The time limit is decided at the previous barrier; a stopping run ends on a validation.
    const bool stopping = shared.stop;
    const bool validate = step % o.eval_every == 0 || step == o.steps || stopping;
    if (validate && !evaluate()) return fail_out();
    if (rank == shared.first_rank) {
      shared.step = step;
      shared.has_val = validate;
    }
    time.total_s += seconds_since(step_start);
    if (!exchange_sums(("step " + std::to_string(step)).c_str())) return fail_out();
    shared.sync.arrive_and_wait();
    if (shared.failed) return;
    if (!exchange_stop(("step " + std::to_string(step)).c_str())) return fail_out();
    // --save-every: the checkpoint after the step's barrier, when rank 0's curve holds the step.
    if (engine != nullptr && o.save_every > 0 && step % o.save_every == 0) {
      engine->set_client_state(resume_blob(step, rng.state(), shared.summary->curve));
      const auto save_start = Clock::now();
      zinf::Status st = engine->save_checkpoint(o.save_dir);
      if (!st.is_ok()) {
        fail("step " + std::to_string(step) + ": " + st.to_string());
        return fail_out();
      }
      if (rank == shared.first_rank && !o.quiet && shared.prints) {
        shared.progress.finish_line();
        std::fprintf(stderr, "step %lld: saved %s/global_step%lld in %.2fs\n",
                     static_cast<long long>(step), o.save_dir.c_str(), static_cast<long long>(step),
                     seconds_since(save_start));
      }
    }
    if (stopping || step == o.stop_after) break;
  }
  if (engine == nullptr) {
    shared.memory[0].activation_device_bytes_peak =
        model.activation_bytes() + (kept_checkpoints ? kept_checkpoints->peak_bytes() : 0);
  }
  if (engine != nullptr) {
    shared.memory[std::size_t(rank)] = engine->memory();
    const zinf::EngineCounters& counters = engine->counters();
    shared.nvme_read[std::size_t(rank)] += counters.param_nvme_read_bytes;
  }
}

// Each rank's device and communicator. Declared in this order so that the communicators, which
// run on the devices, are destroyed first. With --comm mpi or nccl there is one of each, this
// process's rank `first_rank`.
struct Ranks {
  std::vector<std::unique_ptr<zinf::Device>> devices;
  std::vector<std::unique_ptr<zinf::Communicator>> comms;
  int first_rank = 0;
};

// The local rank a launcher gives this process: which GPU it takes.
int launcher_local_rank() {
  for (const char* name :
       {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::atoi(value) >= 0) return std::atoi(value);
  }
  return 0;
}

// One process per rank (--comm mpi, nccl): this process's device, and its communicator opened
// through the public constructors, from the launcher's environment.
bool open_process_rank(const Options& o, std::uint64_t device_budget, Ranks* ranks,
                       std::string* error) {
  const std::string where = o.device == "cuda" ? "--device cuda" : "--comm " + o.comm;
  zinf::Result<std::unique_ptr<zinf::Device>> device = zinf::Status::internal("no device");
  if (o.device == "cuda") {
    zinf::CudaDeviceOptions device_options;
    device_options.memory_limit_bytes = o.device_memory_bytes;  // 0: the whole GPU
    device = zinf::make_cuda_device(launcher_local_rank(), device_options);
  } else {
    zinf::HostDeviceOptions device_options;
    device_options.ordinal = launcher_rank(o.comm);
    device_options.memory_limit_bytes = device_budget;
    device_options.opaque = o.device == "opaque";
    device = zinf::make_host_device(device_options);
  }
  if (!device.is_ok()) {
    *error = where + ": " + device.status().to_string();
    return false;
  }
  zinf::Result<std::unique_ptr<zinf::Communicator>> comm = zinf::Status::internal("no comm");
  if (o.comm == "mpi") {
    zinf::MpiCommOptions comm_options;
    comm_options.timeout = std::chrono::milliseconds(o.collective_timeout_ms);
    comm = zinf::make_mpi_comm(*device.value(), comm_options);
  } else {
    zinf::NcclCommOptions comm_options;
    comm_options.init_timeout = std::chrono::milliseconds(120'000);
    comm = zinf::make_nccl_comm(*device.value(), comm_options);
  }
  if (!comm.is_ok()) {
    *error = where + ": communicator: " + comm.status().to_string();
    return false;
  }
  const int ranks_open = comm.value()->world_size();
  if (ranks_open != o.world_size) {
    const std::string open_text =
        std::to_string(ranks_open) + (ranks_open == 1 ? " rank" : " ranks");
    if (o.world_size_from == "--world-size") {
      *error = where + ": --world-size " + std::to_string(o.world_size) +
               " but the communicator has " + open_text +
               " (one process per rank: start them with mpirun, srun or torchrun)";
    } else {
      // The launcher's variable was a guess (parse_options): say which, and how to override it.
      *error = where + ": the communicator has " + open_text +
               " but the launcher's environment says " + std::to_string(o.world_size) +
               (o.world_size_from.empty() ? "" : " (" + o.world_size_from + ")") +
               "; if that is left from another launch, --world-size " + std::to_string(ranks_open) +
               " overrides it";
    }
    // Every rank may not see the same mismatch (one given another --world-size): the others
    // learn of it from the abort instead of waiting for this rank.
    comm.value()->abort(zinf::Status::aborted(*error));
    return false;
  }
  ranks->first_rank = comm.value()->rank();
  ranks->devices.push_back(std::move(device).value());
  ranks->comms.push_back(std::move(comm).value());
  return true;
}

// Opens --device for every rank and the communicator between them: HostDevices (opaque or not)
// with LocalComm, or this process's rank of an MPI or NCCL job. One line of error naming the
// device otherwise.
bool open_ranks(const Options& o, std::uint64_t device_budget, Ranks* ranks, std::string* error) {
  if (o.comm != "local") return open_process_rank(o, device_budget, ranks, error);
  std::vector<zinf::Device*> device_ptrs;
  for (int r = 0; r < o.world_size; ++r) {
    zinf::HostDeviceOptions device_options;
    device_options.ordinal = r;
    device_options.memory_limit_bytes = device_budget;
    device_options.opaque = o.device == "opaque";
    zinf::Result<std::unique_ptr<zinf::Device>> device = zinf::make_host_device(device_options);
    if (!device.is_ok()) {
      *error = "--device " + o.device + ": " + device.status().to_string();
      return false;
    }
    device_ptrs.push_back(device.value().get());
    ranks->devices.push_back(std::move(device).value());
  }
  zinf::LocalCommOptions comm_options;
  comm_options.timeout = std::chrono::milliseconds(o.collective_timeout_ms);
  zinf::Result<std::vector<std::unique_ptr<zinf::Communicator>>> comms =
      zinf::make_local_comm_group(device_ptrs, comm_options);
  if (!comms.is_ok()) {
    *error = "communicator: " + comms.status().to_string();
    return false;
  }
  ranks->comms = std::move(comms).value();
  return true;
}

}  // namespace

double plain_learning_rate(const Options& o, std::int64_t step) {
  // parse_options checked the schedule.
  const zinf::Result<zinf::LrSchedule> s = zinf::LrSchedule::create(o.schedule, o.lr);
  if (!s.is_ok() || (step == 1 && o.schedule.last_batch_iteration >= 0)) return o.lr;
  return s->lr_at(o.schedule.last_batch_iteration + step - 1);
}

Footprint estimate_footprint(const Options& o, const ModelShape& shape) {
  const std::vector<ModuleSpec> specs = module_specs(shape);
  const std::uint64_t params = param_count(shape);
  const std::uint64_t world = std::uint64_t(o.world_size);
  const std::uint64_t slice = (params + world - 1) / world;
  const std::uint64_t largest = max_module_params(specs);
  const std::uint64_t dtype_bytes = o.param_dtype == "bf16" ? 2 : 4;
  const std::uint64_t local_tokens = o.batch / (world * o.micro_batches) * o.seq_len;
  Footprint f;
  if (!o.use_engine) {
    f.host_bytes = 16 * params + activation_bytes(shape, local_tokens);
    return f;
  }
  std::uint64_t device = 0;
  if (o.stage == 3) {
    if (o.offload_param == "none") device += slice * dtype_bytes;
    device += std::min<std::uint64_t>(params, 3 * largest) * dtype_bytes;  // gathered modules
  } else {
    device += params * dtype_bytes;
  }
  device += (o.stage == 1 ? params : slice) * 4;  // fp32 gradient accumulators
  if (o.offload_optimizer == "none") device += 12 * slice;
  f.device_bytes_per_rank = device;
  // HostDevice memory is host memory; a GPU's is not.
  std::uint64_t host = o.device == "cuda" ? 0 : world * device;
  host += world * (largest * 4 + activation_bytes(shape, local_tokens));
  // Without host access the parameters come down through a staging buffer.
  if (o.device != "host") host += world * largest * dtype_bytes;
  if (o.offload_optimizer == "cpu") host += 12 * params;
  if (o.offload_param == "cpu") host += params * dtype_bytes;
  // Each rank's swap file, as the engine sizes it in one directory: every extent page-rounded
  // (a 4 KiB page at most), the file rounded up to an aio block (1 MiB).
  const std::uint64_t page = 4096, block = std::uint64_t{1} << 20;
  std::uint64_t swap = 0;
  if (o.offload_optimizer == "nvme") {
    const std::uint64_t sub = sub_group_params(o, params);
    host += world * o.optimizer_buffers * 16 * sub;
    const std::uint64_t groups = (slice + sub - 1) / sub;
    swap += 12 * slice + 3 * groups * page + page;  // master and moments, the header page
    // --gradients-on-nvme: the f32 gradient accumulators in the same file.
    if (o.gradients_on_nvme) swap += 4 * slice + groups * page;
  }
  if (o.stage == 3 && o.offload_param == "nvme") {
    swap += slice * dtype_bytes + specs.size() * page;  // a shard of each module's parameters
  }
  if (swap > 0) f.swap_bytes = world * ((swap + block - 1) / block * block);
  f.nvme_bytes = f.swap_bytes;
  f.checkpoint_bytes = 12 * params + world * page;
  if (o.offload_activations == "nvme") {
    const std::uint64_t tokens =
        std::max<std::uint64_t>(o.batch / (world * o.micro_batches), 1) * o.seq_len;
    const std::uint64_t block_input = tokens * shape.hidden * sizeof(float);
    f.nvme_bytes += world * (shape.blocks * ((block_input + block - 1) / block * block) + block);
  }
  f.host_bytes = host;
  return f;
}

int run_training(const Options& o, const ModelShape& shape, const std::string& banner,
                 RunSummary* summary, std::string* error) {
  summary->shape = shape;
  summary->param_count = param_count(shape);
  const auto wall_start = Clock::now();

  // Everything that can be checked is checked before anything is created.
  Corpus corpus;
  const std::string data_path = o.data_path.empty() ? TRAIN_LM_DEFAULT_DATA : o.data_path;
  if (!corpus.load(data_path, error)) return 1;
  if (corpus.split_offset() <= shape.context_bytes + o.seq_len + 1) {
    *error = "--seq-len " + std::to_string(o.seq_len) + " is longer than the train split of " +
             data_path;
    return 1;
  }
  const Footprint need = estimate_footprint(o, shape);
  const std::uint64_t device_budget =
      o.device_memory_bytes != 0 ? o.device_memory_bytes : std::uint64_t{16} << 30;
  const std::uint64_t host_budget =
      o.host_memory_bytes != 0
          ? o.host_memory_bytes
          : std::uint64_t(double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE)) * 0.9);
  const std::string model_text = format_count(double(summary->param_count)) + " parameters";
  const std::string placement = o.use_engine ? "at --stage " + std::to_string(o.stage) +
                                                   " --offload-optimizer " + o.offload_optimizer +
                                                   " --offload-param " + o.offload_param
                                             : "with --engine off";
  if (need.device_bytes_per_rank > device_budget) {
    *error = "the model (" + model_text + ") needs about " +
             format_bytes(double(need.device_bytes_per_rank)) + " of device memory per rank " +
             placement + ", above the budget of " + format_bytes(double(device_budget)) +
             " (--device-memory)";
    return 1;
  }
  if (need.host_bytes > host_budget) {
    *error = "the model (" + model_text + ") needs about " + format_bytes(double(need.host_bytes)) +
             " of host memory " + placement + ", above the budget of " +
             format_bytes(double(host_budget)) + " (--host-memory)";
    return 1;
  }
  const bool uses_nvme =
      o.use_engine && (o.offload_optimizer == "nvme" || o.offload_param == "nvme" ||
                       o.offload_activations == "nvme");
  if (uses_nvme && !check_writable_dir("--nvme-path", o.nvme_path, error)) return 1;
  if (!check_writable_dir("--out", o.out_dir, error) ||
      !check_disk_space({{"--out", o.out_dir, 1 << 20, "outputs"}}, error)) {
    return 1;
  }
  std::vector<DiskNeed> disk;
  std::string disk_warning;
  if (uses_nvme) disk.push_back({"--nvme-path", o.nvme_path, need.nvme_bytes, "swap files"});
  // --resume loads the tag `latest` names. A directory with complete tags but no `latest` is what
  // a first save cut short between its tag's rename and `latest`'s leaves (the engine said only
  // that there is no checkpoint).
  if (!o.resume_dir.empty()) {
    const SavedTags resume = saved_tags(o.resume_dir);
    if (!resume.has_latest && !resume.tags.empty()) {
      *error = "--resume " + o.resume_dir + ": it holds complete checkpoint tags (" +
               resume.names() + ") but no `latest`, which --resume loads (a first save cut " +
               "short before it wrote `latest`): write the tag to resume from into " +
               (fs::path(o.resume_dir) / "latest").string() + " (echo " + resume.tags.back() +
               " > " + (fs::path(o.resume_dir) / "latest").string() +
               "), or remove the directory and start again";
      return 1;
    }
  }
  if (o.save_every > 0 && o.steps >= o.save_every) {
    if (!check_writable_dir("--save-dir", o.save_dir, error)) return 1;
    // A run that is not resumed saves a new run's tags: beside an earlier run's in --save-dir,
    // they would mix two runs in one directory, --keep-last would delete the earlier run's, and
    // the first tag of the same name would fail that save after the steps before it.
    if (o.resume_dir.empty()) {
      const SavedTags held = saved_tags(o.save_dir);
      if (held.has_latest) {
        const std::int64_t step = tag_step(held.latest);
        *error = "--save-dir " + o.save_dir + " holds the checkpoints of an earlier run (latest " +
                 held.latest + (step >= 0 ? ", step " + std::to_string(step) : std::string()) +
                 "): pass --resume " + o.save_dir +
                 " to continue that run, or give another --save-dir";
        return 1;
      }
      if (!held.tags.empty()) {
        *error = "--save-dir " + o.save_dir + " holds the checkpoint tags of an earlier run (" +
                 held.names() + ") but no `latest` (a first save cut short before it wrote " +
                 "`latest`): write the tag to continue from into " +
                 (fs::path(o.save_dir) / "latest").string() + " and pass --resume " + o.save_dir +
                 " to continue that run, or give another --save-dir";
        return 1;
      }
    }
    // The tags on disk at once: --keep-last and the one being written.
    const std::int64_t saves = o.steps / o.save_every;
    const std::int64_t kept =
        o.keep_last > 0 ? std::min<std::int64_t>(saves, o.keep_last + 1) : saves;
    std::uint64_t each = need.checkpoint_bytes;
    struct stat save_fs {
    }, nvme_fs{};
    if (o.offload_optimizer == "nvme" &&
        stat(existing_ancestor(o.save_dir).c_str(), &save_fs) == 0 &&
        stat(existing_ancestor(o.nvme_path).c_str(), &nvme_fs) == 0 &&
        save_fs.st_dev == nvme_fs.st_dev) {
      each = std::max(each, need.swap_bytes);  // saved by link: the frozen swap files
    }
    // One checkpoint must fit, or the first save fails; the ones kept at once are a warning, as
    // a run may be watched and its tags moved away.
    std::vector<DiskNeed> all = disk;
    disk.push_back({"--save-dir", o.save_dir, each, "a checkpoint"});
    if (kept > 1) {
      all.push_back({"--save-dir", o.save_dir, std::uint64_t(kept) * each,
                     std::to_string(kept) + " checkpoints"});
      if (!check_disk_space(all, &disk_warning)) {
        disk_warning +=
            ": a save will fail when the disk is full (a smaller --keep-last keeps "
            "fewer tags)";
      }
    }
  }
  if (!check_disk_space(disk, error)) return 1;
  // What this run will make of the NVMe path (its topmost missing directory), to remove once
  // empty. Looked at before the communicator opens, which every rank of a job passes before any
  // creates anything, so that ranks sharing the path agree on it.
  const fs::path nvme_top = uses_nvme ? topmost_missing(o.nvme_path) : fs::path();
  // The devices and communicators are opened before anything is created on disk, so that a run
  // without the device asked for (no GPU) leaves nothing behind.
  Ranks ranks;
  if (o.use_engine && !open_ranks(o, device_budget, &ranks, error)) return 1;

  CreatedDirs created;
  // Every failure from here on aborts the communicator with its message: the other ranks'
  // collectives fail at once, naming this rank and quoting the message, instead of waiting for it
  // until the collective timeout; and this process skips MPI_Finalize at exit, which would wait
  // for them. Then it removes what it made.
  auto fail = [&](const std::string& message) {
    *error = message;
    for (std::unique_ptr<zinf::Communicator>& comm : ranks.comms) {
      comm->abort(zinf::Status::aborted(message));
    }
    created.remove_all();
    remove_empty_dirs(o.nvme_path, nvme_top, "");
    return 1;
  };
  // One process per rank: only rank 0 writes the outputs, and each rank's swap files go in a
  // directory of its own, the only one it creates or removes (the others' are theirs).
  const bool processes = o.comm != "local";
  const bool prints = ranks.first_rank == 0;
  summary->rank = ranks.first_rank;
  summary->writes_outputs = prints;
  // The exchange between the processes, opened before anything is created, and first used to
  // check that every rank was given the same options (and the same text): ranks that differ in
  // them would train different models, or issue different collectives, which fail only as bytes
  // that do not match, naming no option.
  std::unique_ptr<Exchange> exchange;
  if (processes) {
    exchange = std::make_unique<Exchange>(*ranks.devices[0], *ranks.comms[0],
                                          std::chrono::milliseconds(o.collective_timeout_ms));
    zinf::Status opened = exchange->open();
    if (!opened.is_ok()) return fail(opened.to_string());
    char fingerprint[96];
    std::snprintf(fingerprint, sizeof(fingerprint), "a text of %zu bytes, FNV-1a %016llx",
                  corpus.text().size(), static_cast<unsigned long long>(fnv1a(corpus.text())));
    std::vector<std::string> texts;
    zinf::Status st = exchange->all_gather_text(
        options_every_rank_shares(o) + "--data " + fingerprint + "\n", &texts);
    if (!st.is_ok()) return fail("comparing the ranks' options: " + st.to_string());
    const std::string differs = first_option_ranks_disagree_on(texts);
    if (!differs.empty()) {
      // Every rank holds every rank's options and reaches this same verdict here, so none waits
      // for another: the communicator is not aborted (the abort could fail the exchange's last
      // collective on a rank that has not seen it complete yet, hiding the verdict there).
      *error = differs;
      return 2;
    }
  }
  if (prints && !created.make("--out", o.out_dir, error)) return fail(*error);
  // Ranks of a job may share the NVMe path: each makes it, and removes it only once it is empty
  // (remove_empty_dirs), never with what is in it.
  if (uses_nvme) {
    std::error_code ec;
    fs::create_directories(o.nvme_path, ec);
    if (ec) return fail("--nvme-path " + o.nvme_path + ": cannot create it: " + ec.message());
  }
  // A directory of train_lm's inside the NVMe path, apart from whatever else the path holds. Jobs
  // given the same --nvme-path share it, so each removes only its own swap files from it.
  const std::string swap_dir =
      (fs::path(o.nvme_path) /
       (processes ? "train_lm.swap.rank" + std::to_string(ranks.first_rank) : "train_lm.swap"))
          .string();
  if (uses_nvme && !created.make_swap_dir("--nvme-path", swap_dir, error)) return fail(*error);

  if (!o.quiet && prints) std::fputs(banner.c_str(), stderr);
  if (prints && !disk_warning.empty()) {
    std::fprintf(stderr, "train_lm: warning: %s\n", disk_warning.c_str());
  }
  // A trace is kept when asked for, and whenever the optimizer state is offloaded: its pipeline's
  // spans tell the AdamW time from the time spent waiting for I/O.
  const bool pipeline = o.use_engine && o.offload_optimizer != "none";
  std::unique_ptr<zinf::Trace> trace;
  if (!o.trace_path.empty() || pipeline) trace = std::make_unique<zinf::Trace>();

  Shared shared(o, shape, corpus, summary, o.use_engine ? int(ranks.comms.size()) : 1, prints);
  shared.first_rank = ranks.first_rank;
  shared.exchange = exchange.get();
  shared.trace = trace.get();
  shared.pipeline_traced = pipeline;
  if (!o.use_engine) {
    run_rank(shared, 0, nullptr, nullptr, nullptr);
  } else {
    zinf::Config config =
        engine_config(o, summary->param_count, max_module_params(module_specs(shape)));
    config.zero.offload_optimizer.nvme_path = swap_dir;
    config.zero.offload_param.nvme_path = swap_dir;
    set_activation_config(o, shape, swap_dir, &config);
    {
      std::vector<std::thread> threads;
      for (std::size_t local = 0; local < ranks.comms.size(); ++local) {
        const int r = ranks.first_rank + int(local);
        threads.emplace_back([&, r, local] {
          zinf::Env env;
          env.device = ranks.devices[local].get();
          env.comm = ranks.comms[local].get();
          if (uses_nvme) env.nvme_paths = {swap_dir};
          env.trace = trace.get();
          zinf::Result<std::unique_ptr<zinf::Engine>> engine = zinf::Engine::open(config, env);
          zinf::Status opened =
              engine.is_ok()
                  ? register_model(*engine.value(), shape, o.seed,
                                   o.param_dtype == "bf16" ? zinf::DType::kBF16 : zinf::DType::kF32)
                  : engine.status();
          if (!opened.is_ok()) {
            // The other ranks learn why from the abort.
            shared.fail(r, "engine: " + opened.to_string());
            env.comm->abort(zinf::Status::aborted("engine: " + opened.to_string()));
            shared.sync.arrive_and_drop();
            return;
          }
          run_rank(shared, r, engine.value().get(), env.device, env.comm);
        });
      }
      for (std::thread& t : threads) t.join();
    }
  }
  summary->peak_rss_bytes = peak_rss_bytes();
  if (exchange != nullptr && !shared.failed) {
    // Every rank's tiers, traffic, activations and its process's peak resident sets, for rank
    // 0's summary.
    const std::size_t me = std::size_t(ranks.first_rank);
    const zinf::MemoryReport& m = shared.memory[me];
    constexpr std::size_t kFigures = 11;
    const std::uint64_t mine[kFigures] = {m.device_bytes,
                                          m.host_bytes,
                                          m.nvme_bytes,
                                          shared.nvme_read[me],
                                          shared.nvme_write[me],
                                          m.activation_device_bytes_peak,
                                          m.activation_host_bytes,
                                          m.activation_nvme_write_bytes,
                                          m.activation_nvme_read_bytes,
                                          summary->setup_peak_rss_bytes,
                                          summary->peak_rss_bytes};
    std::vector<std::uint64_t> all(kFigures * std::size_t(o.world_size));
    zinf::Status st = exchange->all_gather(mine, sizeof(mine), all.data());
    if (!st.is_ok()) shared.fail(ranks.first_rank, "summary: " + st.to_string());
    // Each process's peak resident set, summed: no less than the job held at any one moment.
    if (st.is_ok()) summary->setup_peak_rss_bytes = summary->peak_rss_bytes = 0;
    for (std::size_t r = 0; st.is_ok() && r < std::size_t(o.world_size); ++r) {
      const std::uint64_t* theirs = &all[kFigures * r];
      zinf::MemoryReport& report = shared.memory[r];
      report.device_bytes = theirs[0];
      report.host_bytes = theirs[1];
      report.nvme_bytes = theirs[2];
      shared.nvme_read[r] = theirs[3];
      shared.nvme_write[r] = theirs[4];
      report.activation_device_bytes_peak = theirs[5];
      report.activation_host_bytes = theirs[6];
      report.activation_nvme_write_bytes = theirs[7];
      report.activation_nvme_read_bytes = theirs[8];
      summary->setup_peak_rss_bytes += theirs[9];
      summary->peak_rss_bytes += theirs[10];
    }
  }
  for (int r = 0; r < o.world_size; ++r) {
    const zinf::MemoryReport& m = shared.memory[std::size_t(r)];
    summary->device_bytes += m.device_bytes;
    summary->host_bytes += m.host_bytes;
    summary->nvme_bytes += m.nvme_bytes;
    summary->nvme_read_bytes += shared.nvme_read[std::size_t(r)];
    summary->nvme_write_bytes += shared.nvme_write[std::size_t(r)];
    summary->activation_device_bytes_peak += m.activation_device_bytes_peak;
    summary->activation_host_bytes += m.activation_host_bytes;
    summary->activation_nvme_write_bytes += m.activation_nvme_write_bytes;
    summary->activation_nvme_read_bytes += m.activation_nvme_read_bytes;
  }
  shared.progress.finish_line();
  if (shared.failed) return fail(shared.error);
  // The swap files are scratch: they go with the run, and so does what the run made of the NVMe
  // path once no rank's swap directory is left in it. Another job given the same --nvme-path
  // uses the same swap directory: its live swap files stay, and so does the directory.
  if (uses_nvme) {
    created.remove_swap_dirs();
    remove_empty_dirs(o.nvme_path, nvme_top, o.out_dir);
  }

  summary->wall_s = seconds_since(wall_start);
  if (pipeline && summary->steps_done > 0) {
    // A trace that filled up dropped spans: the update time would be short, so say nothing.
    summary->time.io_wait_s =
        trace->dropped_count() > 0
            ? std::nan("")
            : std::max(0.0, summary->time.optimizer_s -
                                update_seconds(*trace, shared.first_step_ns) / o.world_size);
  }
  if (trace && !o.trace_path.empty() && prints) {
    zinf::Status written = trace->write_json(o.trace_path);
    if (!written.is_ok()) {
      // Every collective is done, so the communicator is not aborted: no rank waits for this one,
      // and MPI finalises as after a run that succeeded.
      *error = "--trace: " + written.to_string();
      created.remove_all();
      return 1;
    }
  }
  return 0;
}

}  // namespace train_lm
