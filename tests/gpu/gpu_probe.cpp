// zinf_gpu_probe: what scripts/gpu-check learns about a machine before it runs any test, in a few
// seconds. Each check prints one line,
//
//   probe | <check> | <PASS|FALLBACK|NO_GPU|FAIL> | <detail>
//
// FALLBACK means the feature is refused and the code path that does without it was exercised
// instead (O_DIRECT refused: buffered I/O; io_uring refused: the thread engine; no hugetlb pages:
// THP or 4 KiB pages). NO_GPU means no usable CUDA device, with the runtime's reason; the checks
// that need one are then reported NO_GPU too, and the rest still run.
//
//   zinf_gpu_probe [--scratch DIR] [--min-free-gib N]
//
// Exit status: 0 when every check passed or fell back, 3 when there is no GPU (and nothing
// failed), 1 on any failure.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "base/aligned.hpp"
#include "base/random.hpp"
#include "comm/tcp_bootstrap.hpp"
#include "device/cuda_device.hpp"
#include "device/pinned_pool.hpp"
#include "gpu/gpu_util.hpp"
#include "io/io_engine.hpp"
#include "kernels/cast.h"
#include "zinf/dtype.hpp"
#if defined(ZINF_HAVE_NCCL)
#include "comm/nccl_comm.hpp"
#endif

namespace zinf {
namespace {

enum class Outcome { kPass, kFallback, kNoGpu, kFail };

int g_failures = 0;
bool g_no_gpu = false;

void report(const char* check, Outcome outcome, const std::string& detail) {
  static const char* const kNames[] = {"PASS", "FALLBACK", "NO_GPU", "FAIL"};
  std::printf("probe | %s | %s | %s\n", check, kNames[static_cast<int>(outcome)], detail.c_str());
  std::fflush(stdout);
  if (outcome == Outcome::kFail) ++g_failures;
  if (outcome == Outcome::kNoGpu) g_no_gpu = true;
}

std::string version_text(int v) {  // CUDA encodes 13.0 as 13000.
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

// Driver and runtime versions, the devices. Returns whether a device is usable.
bool probe_cuda() {
  int driver = 0, runtime = 0;
  (void)cudaDriverGetVersion(&driver);
  (void)cudaRuntimeGetVersion(&runtime);
  const std::string versions = "driver supports CUDA " +
                               (driver > 0 ? version_text(driver) : std::string("(no driver)")) +
                               ", runtime " + version_text(runtime);
  const std::string reason = gpu_test::no_device_reason();
  if (!reason.empty()) {
    report("cuda device", Outcome::kNoGpu, "no GPU: " + reason + "; " + versions);
    return false;
  }
  int count = 0;
  (void)cudaGetDeviceCount(&count);
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, 0);
  char detail[512];
  std::snprintf(detail, sizeof(detail), "%d device(s); 0: %s, sm_%d%d, %.1f GiB; %s", count,
                prop.name, prop.major, prop.minor,
                static_cast<double>(prop.totalGlobalMem) / (1u << 30), versions.c_str());
  report("cuda device", Outcome::kPass, detail);
  return true;
}

// One launch of the library's cast kernel on seeded random floats, against the reference.
void probe_kernel() {
  const std::size_t count = 4099;
  std::vector<float> host(count);
  fill_uniform(host.data(), count, 0x9e0be);
  float* src = nullptr;
  std::uint16_t* dst = nullptr;
  cudaError_t err = cudaMalloc(&src, count * sizeof(float));
  if (err == cudaSuccess) err = cudaMalloc(&dst, count * sizeof(std::uint16_t));
  if (err == cudaSuccess) {
    err = cudaMemcpy(src, host.data(), count * sizeof(float), cudaMemcpyHostToDevice);
  }
  if (err == cudaSuccess)
    err = static_cast<cudaError_t>(kernels::cast_f32_to_bf16(src, dst, count, nullptr));
  std::vector<std::uint16_t> back(count);
  if (err == cudaSuccess) {
    err = cudaMemcpy(back.data(), dst, count * sizeof(std::uint16_t), cudaMemcpyDeviceToHost);
  }
  cudaFree(src);
  cudaFree(dst);
  if (err != cudaSuccess) {
    report(
        "kernel launch", Outcome::kFail,
        std::string("cast_f32_to_bf16: ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
    return;
  }
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i) wrong += back[i] != f32_to_bf16(host[i]) ? 1 : 0;
  report("kernel launch", wrong == 0 ? Outcome::kPass : Outcome::kFail,
         "cast_f32_to_bf16 of " + std::to_string(count) + " floats: " + std::to_string(wrong) +
             " differ from the reference");
}

// A PinnedPool block registered with the GPU (cudaHostRegister), copied down and back.
void probe_pinned(Device* device) {
  if (device == nullptr) {
    report("host register (pool block)", Outcome::kNoGpu, "no GPU");
    return;
  }
  const std::size_t bytes = std::size_t{16} << 20;
  Result<std::unique_ptr<PinnedPool>> pool =
      PinnedPool::create({.block_bytes = bytes, .block_count = 1, .device = device});
  if (!pool.is_ok()) {
    report("host register (pool block)", Outcome::kFail, pool.status().to_string());
    return;
  }
  std::byte* block = (*pool)->block(0);
  fill_random_bytes(block, bytes, 0xb10c);
  std::vector<std::byte> expect(block, block + bytes);
  Result<DeviceBuffer> buffer = DeviceBuffer::allocate(*device, bytes);
  Result<std::unique_ptr<Stream>> stream = device->create_stream("probe");
  Status st = buffer.is_ok() ? (stream.is_ok() ? Status::ok() : stream.status()) : buffer.status();
  if (st.is_ok()) st = device->copy_h2d(buffer->data(), block, bytes, **stream);
  if (st.is_ok()) st = device->synchronize(**stream, std::chrono::seconds(20));
  if (st.is_ok()) std::memset(block, 0, bytes);
  if (st.is_ok()) st = device->copy_d2h(block, buffer->data(), bytes, **stream);
  if (st.is_ok()) st = device->synchronize(**stream, std::chrono::seconds(20));
  if (!st.is_ok()) {
    report("host register (pool block)", Outcome::kFail, st.to_string());
    return;
  }
  const bool same = std::memcmp(block, expect.data(), bytes) == 0;
  report("host register (pool block)", same ? Outcome::kPass : Outcome::kFail,
         "16 MiB block (" + std::string(page_kind_name((*pool)->page_kind())) +
             " pages) registered, copied down and back: " + (same ? "same bytes" : "BYTES DIFFER"));
}

// Where the loader found libnccl.so.2, and its version.
std::string nccl_library() {
  void* sym = dlsym(RTLD_DEFAULT, "ncclGetVersion");
  if (sym == nullptr) return "libnccl not loaded";
  Dl_info info{};
  std::string where = dladdr(sym, &info) != 0 && info.dli_fname != nullptr ? info.dli_fname : "?";
  int version = 0;
  reinterpret_cast<int (*)(int*)>(sym)(&version);
  // NCCL encodes 2.28.9 as 22809.
  return "NCCL " + std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) +
         "." + std::to_string(version % 100) + " from " + where;
}

void probe_nccl(Device* device) {
#if defined(ZINF_HAVE_NCCL)
  if (device == nullptr) {
    report("one-rank NCCL init", Outcome::kNoGpu, "no GPU; " + nccl_library());
    return;
  }
  LaunchEnv env;
  env.master_port = gpu_test::free_tcp_port();
  const auto t0 = std::chrono::steady_clock::now();
  Result<std::unique_ptr<Communicator>> comm =
      make_nccl_comm(env, *device, {.init_timeout = std::chrono::seconds(30)});
  Status st = comm.is_ok() ? (*comm)->barrier(std::chrono::seconds(20)) : comm.status();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  report("one-rank NCCL init", st.is_ok() ? Outcome::kPass : Outcome::kFail,
         (st.is_ok() ? "init + barrier in " + std::to_string(static_cast<int>(ms)) + " ms; "
                     : st.to_string() + "; ") +
             nccl_library());
#else
  (void)device;
  report("one-rank NCCL init", Outcome::kFail, "zinf was built without NCCL");
#endif
}

// O_DIRECT and io_uring through the library's own IoEngine, on the scratch directory: a 1 MiB
// write and read back. O_DIRECT refused (unsupported) falls back to buffered I/O, io_uring refused
// to the thread engine; either is FALLBACK, and the bytes must still come back.
void probe_io(const std::string& scratch) {
  Result<std::unique_ptr<IoEngine>> engine = open_engine({});
  if (!engine.is_ok()) {
    report("io engine", Outcome::kFail, engine.status().to_string());
    return;
  }
  const bool uring = (*engine)->kind() == EngineKind::kUring;
  report("io_uring", uring ? Outcome::kPass : Outcome::kFallback,
         uring ? "io_uring engine" : "io_uring refused here: thread engine (pread/pwrite)");
  const std::string path = scratch + "/zinf_gpu_probe_" + std::to_string(::getpid());
  bool direct = true;
  Result<FileHandle> file =
      (*engine)->open_file(path, {.write = true, .create = true, .direct = true});
  std::string refusal;
  if (!file.is_ok() && file.status().code() == Code::kUnsupported) {
    refusal = file.status().to_string();
    direct = false;
    file = (*engine)->open_file(path, {.write = true, .create = true, .direct = false});
  }
  if (!file.is_ok()) {
    report("O_DIRECT", Outcome::kFail, file.status().to_string());
    std::remove(path.c_str());
    return;
  }
  const std::size_t bytes = std::size_t{1} << 20;
  AlignedBuffer out(bytes), in(bytes);
  fill_random_bytes(out.data(), bytes, 0xd1ec7);
  std::memset(in.data(), 0, bytes);
  Status st = Status::ok();
  for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
    Result<Ticket> t = (*engine)->submit({.op = op,
                                          .file = *file,
                                          .offset = 0,
                                          .bytes = bytes,
                                          .data = op == IoOp::kWrite ? out.data() : in.data()});
    st = t.is_ok() ? (*engine)->wait(*t, std::chrono::seconds(20)) : t.status();
    if (!st.is_ok()) break;
  }
  (void)(*engine)->close_file(*file);
  std::remove(path.c_str());
  if (!st.is_ok()) {
    report("O_DIRECT", Outcome::kFail, st.to_string());
    return;
  }
  const bool same = std::memcmp(out.data(), in.data(), bytes) == 0;
  report(
      "O_DIRECT",
      !same    ? Outcome::kFail
      : direct ? Outcome::kPass
               : Outcome::kFallback,
      std::string(direct ? "1 MiB written and read back with O_DIRECT"
                         : "refused (" + refusal + "): buffered I/O, 1 MiB written and read back") +
          " in " + scratch + (same ? "" : ": BYTES DIFFER"));
}

void probe_huge_pages() {
  const std::size_t bytes = std::size_t{2} << 20;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
  if (p != MAP_FAILED) {
    std::memset(p, 1, bytes);
    ::munmap(p, bytes);
    report("huge pages", Outcome::kPass, "2 MiB hugetlb page mapped");
    return;
  }
  const int err = errno;
  std::string thp = "unknown";
  if (FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r")) {
    char line[128] = {0};
    if (std::fgets(line, sizeof(line), f) != nullptr) thp = line;
    std::fclose(f);
    while (!thp.empty() && thp.back() == '\n') thp.pop_back();
  }
  report("huge pages", Outcome::kFallback,
         std::string("no hugetlb page (") + std::strerror(err) + "): the pools use THP (" + thp +
             ") or 4 KiB pages");
}

void probe_disk(const std::string& scratch, double min_free_gib) {
  struct statvfs st {};
  if (::statvfs(scratch.c_str(), &st) != 0) {
    report("free disk", Outcome::kFail, "statvfs " + scratch + ": " + std::strerror(errno));
    return;
  }
  const double free_gib = static_cast<double>(st.f_bavail) * st.f_frsize / double(1u << 30);
  char detail[512];
  std::snprintf(detail, sizeof(detail), "%.1f GiB free in %s (need %.1f)", free_gib,
                scratch.c_str(), min_free_gib);
  report("free disk", free_gib >= min_free_gib ? Outcome::kPass : Outcome::kFail, detail);
}

int run(int argc, char** argv) {
  std::string scratch = "/tmp";
  double min_free_gib = 2.0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--scratch" && i + 1 < argc) {
      scratch = argv[++i];
    } else if (arg == "--min-free-gib" && i + 1 < argc) {
      min_free_gib = std::atof(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: zinf_gpu_probe [--scratch DIR] [--min-free-gib N]\n");
      return 2;
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(scratch, ec);

  std::unique_ptr<Device> device;
  if (probe_cuda()) {
    probe_kernel();
    Result<std::unique_ptr<Device>> made = make_cuda_device();
    if (made.is_ok()) {
      device = std::move(*made);
    } else {
      report("CudaDevice", Outcome::kFail, made.status().to_string());
    }
  } else {
    report("kernel launch", Outcome::kNoGpu, "no GPU");
  }
  probe_pinned(device.get());
  probe_nccl(device.get());
  probe_io(scratch);
  probe_huge_pages();
  probe_disk(scratch, min_free_gib);
  if (g_failures > 0) return 1;
  return g_no_gpu ? 3 : 0;
}

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) { return zinf::run(argc, argv); }
