// One rank's gradient reduction (GradReducer, a host-accessible device, the accumulator in host
// memory, as in train_lm) beside the memory's limit for the same work, in interleaved rounds.
// 64 Mi bf16 gradient elements in 8 parameters of two modules, reduced module by module:
//   store   the first micro-batch after zero(): each element widened into the accumulator
//           (6 bytes an element at the least: 2 read, 4 written); its limit a stream pattern that
//           reads a 2-byte stream and writes a 4-byte one, on every core (base/membw.hpp);
//   add     a later micro-batch: widened and added (10 bytes: 2 read, 4 read and written back);
//           its limit the pattern that reads a 2-byte stream and updates a 4-byte one in place.
// Each case runs two ways: `in place` (GradReducer::reduce_in_place, what one rank takes) and
// `buckets` (the bucket schedule, forced by handing the reducer its accumulator as a
// GradAccumulator object: fill a 16 Mi-element bucket, reduce-scatter it, add it, with zero()
// clearing the accumulator; what one rank did before, and what every rank of a larger world
// does). Rates count the least bytes of the case, so the ratios to the limit say how close each
// way is to the memory's rate. Each round prints every rate; the end prints the medians of
// way / limit and in place / buckets.
//
//   build/bin/bench_zero_reduce [--rounds 5]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/membw.hpp"
#include "base/random.hpp"
#include "bench/bench_stats.hpp"
#include "zero/grad_accumulator.hpp"
#include "zero/grad_reducer.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

using zinf::bench::median;

using Clock = std::chrono::steady_clock;

constexpr std::size_t kParams = 8;
constexpr std::size_t kParamElements = std::size_t{8} << 20;
constexpr std::size_t kElements = kParams * kParamElements;

// Seconds a call of fn takes, over calls repeated until at least 0.3 s passed.
template <typename Fn>
double seconds_per_call(Fn&& fn) {
  int calls = 0;
  const auto t0 = Clock::now();
  double seconds = 0;
  do {
    fn();
    ++calls;
    seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (seconds < 0.3);
  return seconds / calls;
}

void check(const Status& st) {
  if (!st.is_ok()) {
    fmt::print(stderr, "bench_zero_reduce: {}\n", st.to_string());
    std::exit(1);
  }
}

// A reducer over the bench's parameters; with `object` set it adds into that accumulator
// object (the bucket schedule), else into `acc` itself.
struct Reduction {
  Reduction(const Partitioner& p, Device& device, Communicator& comm, float* acc, bool buckets)
      : partitioner(p), object(acc, GradReducer::partition_element_count(p)) {
    GradReducerOptions ro;
    ro.bucket_elements = std::size_t{16} << 20;  // train_lm's reduce_bucket_size
    if (buckets) ro.accumulator = &object;
    reducer = std::move(GradReducer::create(p, 0, device, comm, acc, ro, nullptr)).value();
  }
  // zero(), then `micro_batches` micro-batches, module by module in backward order.
  void run(std::span<const GradSource> sources, int micro_batches) {
    reducer->zero();
    for (int k = 0; k < micro_batches; ++k) {
      for (const char* m : {"b", "a"}) {
        check(reducer->reduce(partitioner.module_groups(m).value(), sources));
      }
    }
    check(reducer->wait());
  }
  const Partitioner& partitioner;
  MemoryAccumulator object;
  std::unique_ptr<GradReducer> reducer;
};

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) {
  using namespace zinf;
  int rounds = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else {
      fmt::print(stderr, "usage: bench_zero_reduce [--rounds N]\n");
      return 2;
    }
  }
  PartitionerOptions po;
  po.stage = ZeroStage::kStage2;
  Partitioner p = std::move(Partitioner::create(po)).value();
  for (std::size_t i = 0; i < kParams; ++i) {
    check(p.add({fmt::format("p{}", i),
                 i < kParams / 2 ? "a" : "b",
                 {static_cast<std::int64_t>(kParamElements)},
                 DType::kBF16})
              .status());
  }
  check(p.finalize());
  std::vector<std::vector<std::uint16_t>> grads(kParams);
  std::vector<GradSource> sources(kParams);
  std::vector<float> scratch(kParamElements);
  for (std::size_t i = 0; i < kParams; ++i) {
    fill_uniform(scratch.data(), scratch.size(), 0x7ed0 + i, -1.0f, 1.0f);
    grads[i].resize(kParamElements);
    convert_f32_to_bf16(scratch.data(), grads[i].data(), kParamElements);
    sources[i] = {grads[i].data(), DType::kBF16};
  }
  std::unique_ptr<Device> device = std::move(make_host_device({})).value();
  auto comms = std::move(make_local_comm_group(std::vector<Device*>{device.get()})).value();
  const std::size_t partition = GradReducer::partition_element_count(p);
  std::vector<float> acc_in_place(partition), acc_buckets(partition);
  Reduction in_place(p, *device, *comms[0], acc_in_place.data(), /*buckets=*/false);
  Reduction buckets(p, *device, *comms[0], acc_buckets.data(), /*buckets=*/true);
  BandwidthProbe store_limit(StreamPattern{{2}, {}, {4}}, kElements, 0);
  BandwidthProbe add_limit(StreamPattern{{2}, {4}, {}}, kElements, 0);

  fmt::print("one rank's reduction of {} Mi bf16 gradient elements, {} rounds\n", kElements >> 20,
             rounds);
  std::vector<double> s_in, s_bk, s_gain, a_in, a_bk, a_gain;
  for (int r = 1; r <= rounds; ++r) {
    const double store_gb = kElements * 6 / 1e9, add_gb = kElements * 10 / 1e9;
    const double sl = store_limit.run_once();
    const double t1i = seconds_per_call([&] { in_place.run(sources, 1); });
    const double t1b = seconds_per_call([&] { buckets.run(sources, 1); });
    const double al = add_limit.run_once();
    // Two micro-batches: the first stores, the second adds; the add's time is the difference.
    const double t2i = seconds_per_call([&] { in_place.run(sources, 2); });
    const double t2b = seconds_per_call([&] { buckets.run(sources, 2); });
    const double si = store_gb / t1i, sb = store_gb / t1b;
    const double ai = add_gb / (t2i - t1i), ab = add_gb / (t2b - t1b);
    fmt::print(
        "round {}: store: limit {:.1f} GB/s, in place {:.1f}, buckets {:.1f}; add: limit {:.1f}, "
        "in place {:.1f}, buckets {:.1f}\n",
        r, sl, si, sb, al, ai, ab);
    if (std::memcmp(acc_in_place.data(), acc_buckets.data(), partition * sizeof(float)) != 0) {
      fmt::print(stderr, "bench_zero_reduce: the two ways' sums differ\n");
      return 1;
    }
    s_in.push_back(si / sl);
    s_bk.push_back(sb / sl);
    s_gain.push_back(si / sb);
    a_in.push_back(ai / al);
    a_bk.push_back(ab / al);
    a_gain.push_back(ai / ab);
  }
  fmt::print(
      "median: store: in place / limit {:.2f}, buckets / limit {:.2f}, in place / buckets {:.2f}; "
      "add: in place / limit {:.2f}, buckets / limit {:.2f}, in place / buckets {:.2f}\n",
      median(s_in), median(s_bk), median(s_gain), median(a_in), median(a_bk), median(a_gain));
  return 0;
}
