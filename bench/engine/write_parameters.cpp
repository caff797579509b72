// Engine::write_parameters one parameter at a time against the batch form, on one rank: a model
// of --params f32 parameters in --tensors parameters of equal size, stage 2, AdamW with its
// state on NVMe (--offload nvme, default) or in host memory (--offload cpu), in --dir. Each of
// --rounds rounds writes every parameter twice, with new seeded values each time:
//   singles   write_parameters(name, values) for each parameter in turn (one pass over the
//             partition and one publish each)
//   batch     write_parameters(names, values_fn) once (one pass, one publish), values_fn making
//             each parameter's values when the pass asks for them
// in alternating order (singles first in odd rounds, batch first in even ones), so drift in the
// machine's load falls on both. The values are made the same way in both (one parameter's worth
// at a time), inside the timed call. Each round prints both times and singles / batch; the end
// prints the median ratio, and checks that every master equals the last values written, bit for
// bit.
//
//   build/bin/bench_engine_write_parameters --params 16777216 --tensors 32 --dir /tmp/zinf-wp
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "bench/bench_stats.hpp"
#include "bench/engine/engine_bench.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"

namespace {

using zinf::bench::fail;
using zinf::bench::median;
using zinf::bench::seconds_since;

using namespace zinf;

// Parameter `tensor`'s values of write `generation`: a cheap seeded pattern, different for each.
void make_values(std::uint64_t generation, std::size_t tensor, std::span<float> out) {
  std::uint64_t x = generation * 0x9e3779b97f4a7c15ull + tensor * 0xbf58476d1ce4e5b9ull + 1;
  for (float& v : out) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<float>(x >> 40) * 0x1.0p-24f - 0.5f;
  }
}

int run(std::size_t params, std::size_t tensors, const std::string& dir, OffloadDevice offload,
        int rounds) {
  Result<bench::OneRank> opened = bench::open_one_rank(dir, offload, std::size_t{1} << 22);
  if (!opened.is_ok()) return fail("open", opened.status());
  Engine& engine = *opened->engine;
  const std::size_t each = params / tensors;
  std::vector<std::string> names(tensors);
  for (std::size_t i = 0; i < tensors; ++i) {
    names[i] = fmt::format("w{}", i);
    ParameterSpec spec;
    spec.name = names[i];
    spec.module = fmt::format("m{}", i);
    spec.shape = {static_cast<std::int64_t>(each)};
    spec.initializer = [i](std::size_t first, std::size_t count, float* out) {
      make_values(0, i, std::span<float>(out, count));
      (void)first;
      return Status::ok();
    };
    if (Status st = engine.register_parameter(spec); !st.is_ok()) return fail("register", st);
  }
  if (Status st = engine.finalize(); !st.is_ok()) return fail("finalize", st);
  const std::vector<std::string_view> views(names.begin(), names.end());

  std::uint64_t generation = 0;
  std::vector<float> one(each);  // the singles' values, one parameter at a time
  auto singles = [&]() -> Result<double> {
    ++generation;
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < tensors; ++i) {
      make_values(generation, i, one);
      ZINF_RETURN_IF_ERROR(engine.write_parameters(names[i], one.data()));
    }
    return seconds_since(t0);
  };
  auto batch = [&]() -> Result<double> {
    ++generation;
    const auto t0 = std::chrono::steady_clock::now();
    ZINF_RETURN_IF_ERROR(
        engine.write_parameters(views, [&](std::string_view name, std::span<float> out) {
          make_values(generation, std::stoull(std::string(name.substr(1))), out);
          return Status::ok();
        }));
    return seconds_since(t0);
  };

  fmt::print("{} f32 parameters in {} tensors, state {}, sub-groups of {} elements\n",
             each * tensors, tensors, offload_device_name(offload),
             engine.config().zero.sub_group_size);
  fmt::print("| round | {} singles | one batch | singles / batch |\n|---|---|---|---|\n", tensors);
  std::vector<double> ratios;
  for (int round = 1; round <= rounds; ++round) {
    double singles_s = 0, batch_s = 0;
    for (int k = 0; k < 2; ++k) {
      const bool do_batch = (k == 0) == (round % 2 == 0);
      Result<double> s = do_batch ? batch() : singles();
      if (!s.is_ok()) return fail(do_batch ? "batch" : "singles", s.status());
      (do_batch ? batch_s : singles_s) = *s;
    }
    ratios.push_back(singles_s / batch_s);
    fmt::print("| {} | {:.3f} s | {:.3f} s | {:.1f} |\n", round, singles_s, batch_s, ratios.back());
  }
  bool same = true;
  std::vector<float> out(each);
  for (std::size_t i = 0; i < tensors; ++i) {
    if (Status st = engine.read_parameters(names[i], out.data()); !st.is_ok()) {
      return fail("read_parameters", st);
    }
    make_values(generation, i, one);
    same = same && std::memcmp(out.data(), one.data(), each * sizeof(float)) == 0;
  }
  fmt::print("median singles / batch {:.1f}; masters {} the last values written\n", median(ratios),
             same ? "equal" : "DIFFER FROM");
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t params = std::size_t{1} << 24;
  std::size_t tensors = 32;
  std::string dir = "/tmp/zinf-bench-write-parameters";
  zinf::OffloadDevice offload = zinf::OffloadDevice::kNvme;
  int rounds = 5;
  if (argc % 2 == 0) {  // every option takes a value: an odd count of words is a mistake
    fmt::print(stderr,
               "usage: bench_engine_write_parameters [--params N] [--tensors K] [--dir DIR] "
               "[--offload cpu|nvme] [--rounds R]\n");
    return 2;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    const std::string value = argv[i + 1];
    if (key == "--params") {
      params = std::stoull(value);
    } else if (key == "--tensors") {
      tensors = std::max<std::size_t>(1, std::stoull(value));
    } else if (key == "--dir") {
      dir = value;
    } else if (key == "--offload") {
      if (value != "cpu" && value != "nvme") {
        fmt::print(stderr, "--offload {}: expected cpu or nvme\n", value);
        return 2;
      }
      offload = value == "cpu" ? zinf::OffloadDevice::kHost : zinf::OffloadDevice::kNvme;
    } else if (key == "--rounds") {
      rounds = std::max(1, std::atoi(value.c_str()));
    } else {
      fmt::print(stderr, "unknown option {}\n", key);
      return 2;
    }
  }
  return run(params, tensors, dir, offload, rounds);
}
