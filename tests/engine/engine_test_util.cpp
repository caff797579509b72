#include "engine_test_util.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <utility>

#include "base/random.hpp"
#include "io/fault.hpp"
#include "kernels/adam.h"
#include "zinf/dtype.hpp"
#include "zinf/optim.hpp"

namespace zinf::engine_test {

std::size_t ParamDef::element_count() const {
  std::size_t n = 1;
  for (std::int64_t d : shape) n *= static_cast<std::size_t>(d);
  return n;
}

Model make_model(DType dtype, std::uint64_t seed) {
  Model m;
  m.modules = {"embed", "block0", "block1", "block2", "head"};
  m.params = {
      {"embed.w", "embed", {37, 13}, dtype},   {"block0.w", "block0", {29, 31}, dtype},
      {"block0.b", "block0", {29}, dtype},     {"block1.w", "block1", {41, 7}, dtype},
      {"block1.b", "block1", {41}, dtype},     {"block1.scale", "block1", {}, dtype},
      {"block2.w", "block2", {23, 19}, dtype}, {"block2.b", "block2", {23}, dtype},
      {"head.w", "head", {13, 37}, dtype},     {"head.b", "head", {13}, dtype},
  };
  for (std::size_t p = 0; p < m.params.size(); ++p) {
    std::vector<float> v(m.params[p].element_count());
    fill_uniform(v.data(), v.size(), seed * 1000 + p, -1.0f, 1.0f);
    m.initial.push_back(std::move(v));
  }
  return m;
}

Model page_model(std::uint64_t seed) {
  Model m;
  m.modules = {"embed", "block", "head"};
  m.params = {
      {"embed.w", "embed", {64, 64}, DType::kF32},
      {"block.w", "block", {32, 64}, DType::kF32},
      {"block.b", "block", {2048}, DType::kF32},
      {"head.w", "head", {64, 32}, DType::kF32},
  };
  for (std::size_t p = 0; p < m.params.size(); ++p) {
    std::vector<float> v(m.params[p].element_count());
    fill_uniform(v.data(), v.size(), seed * 1000 + p, -1.0f, 1.0f);
    m.initial.push_back(std::move(v));
  }
  return m;
}

Ranks make_ranks(int world, std::chrono::milliseconds timeout, std::uint32_t jitter_max_us,
                 bool opaque) {
  test::HostRanksOptions o;
  o.timeout = timeout;
  o.jitter_max_us = jitter_max_us;
  o.jitter_seed = 77;
  o.opaque = opaque;
  return test::make_host_ranks(world, o);
}

std::vector<Status> run_engines(const Config& config, Ranks& ranks,
                                const std::function<Status(int rank, Engine& engine)>& fn) {
  return run_ranks(static_cast<int>(ranks.devices.size()), [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    Env env;
    env.device = ranks.devices[r].get();
    env.comm = ranks.comms[r].get();
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
    return fn(rank, *engine);
  });
}

std::vector<Status> with_engines(const Config& config, const Model& model, int world,
                                 const std::function<Status(int rank, Engine& engine)>& fn) {
  Ranks ranks = make_ranks(world);
  return run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
    ZINF_RETURN_IF_ERROR(register_model(engine, model));
    ZINF_RETURN_IF_ERROR(engine.finalize());
    return fn(rank, engine);
  });
}

Status train_steps(Engine& engine, const Model& model, int rank, int first_step, int last_step) {
  TrainOptions options;
  options.first_step = first_step;
  options.steps = last_step;
  options.check_gathered = false;
  return train_rank(engine, model, rank, options, nullptr, nullptr);
}

Status train_and_save(const Config& config, const Model& model, int world, int steps,
                      const std::string& dir, const std::string& tag) {
  const std::vector<Status> st =
      with_engines(config, model, world, [&](int rank, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(train_steps(engine, model, rank, 1, steps));
        return engine.save_checkpoint(dir, tag);
      });
  for (const Status& s : st) ZINF_RETURN_IF_ERROR(s);
  return Status::ok();
}

LoadedRun load_and_train(const Config& config, Ranks& ranks, const Model& model,
                         const std::string& dir, const std::string& tag, int first_step,
                         int last_step) {
  const std::size_t world = ranks.devices.size();
  LoadedRun run;
  run.finalized_host_bytes.resize(world);
  run.loaded_host_bytes.resize(world);
  run.status = run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
    ZINF_RETURN_IF_ERROR(register_model(engine, model));
    ZINF_RETURN_IF_ERROR(engine.finalize());
    run.finalized_host_bytes[rank] = engine.memory().host_bytes;
    ZINF_RETURN_IF_ERROR(engine.load_checkpoint(dir, tag));
    run.loaded_host_bytes[rank] = engine.memory().host_bytes;
    ZINF_RETURN_IF_ERROR(train_steps(engine, model, rank, first_step, last_step));
    ZINF_ASSIGN_OR_RETURN(auto masters, read_masters(engine, model));
    if (rank == 0) run.masters = std::move(masters);
    return Status::ok();
  });
  return run;
}

bool flip_bits(const std::string& path, std::uint64_t offset, unsigned char mask) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  char byte = 0;
  if (!f.seekg(static_cast<std::streamoff>(offset)) || !f.read(&byte, 1)) return false;
  byte = static_cast<char>(static_cast<unsigned char>(byte) ^ mask);
  return static_cast<bool>(f.seekp(static_cast<std::streamoff>(offset)).write(&byte, 1));
}

Model big_lora_model() {
  Model m;
  m.modules = {"base", "lora"};
  for (int l = 0; l < 16; ++l) {
    m.params.push_back({fmt::format("base.w{}", l), "base", {2048, 2048}, DType::kBF16});
  }
  for (int l = 0; l < 8; ++l) {
    m.params.push_back({fmt::format("lora.a{}", l), "lora", {1024, 128}, DType::kBF16});
  }
  for (std::size_t p = 0; p < m.params.size(); ++p) {
    std::vector<float> v(m.params[p].element_count());
    fill_uniform(v.data(), v.size(), 7300 + p, -1.0f, 1.0f);
    m.initial.push_back(std::move(v));
  }
  m.frozen_module = "base";
  return m;
}

std::vector<float> seeded(std::size_t count, std::uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(count);
  for (float& x : values) x = dist(rng);
  return values;
}

std::vector<float> widen_view(const TensorView& view) {
  std::vector<float> out(view.element_count);
  switch (view.dtype) {
    case DType::kF32:
      std::memcpy(out.data(), view.data, out.size() * 4);
      break;
    case DType::kBF16:
      convert_bf16_to_f32(static_cast<const std::uint16_t*>(view.data), out.data(), out.size());
      break;
    case DType::kF16:
      convert_f16_to_f32(static_cast<const std::uint16_t*>(view.data), out.data(), out.size());
      break;
  }
  return out;
}

std::vector<std::uint16_t> narrow_to_half(const std::vector<float>& values, DType dtype) {
  std::vector<std::uint16_t> out(values.size());
  if (dtype == DType::kBF16) {
    convert_f32_to_bf16(values.data(), out.data(), values.size());
  } else {
    convert_f32_to_f16(values.data(), out.data(), values.size());
  }
  return out;
}

namespace {

float round_to(float x, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return x;
    case DType::kBF16:
      return bf16_to_f32(f32_to_bf16(x));
    case DType::kF16:
      return f16_to_f32(f32_to_f16(x));
  }
  return x;
}

// What the training program sees of the device: a copy stream when the device memory is not
// host-accessible. Reads gathered parameters and writes gradients through it.
class DeviceAccess {
 public:
  // On `compute` (the engine's compute stream) when given, else on a stream of its own.
  static Result<DeviceAccess> open(Device* device, Stream* compute = nullptr) {
    DeviceAccess access;
    if (device == nullptr || device->host_accessible()) return access;
    access.device_ = device;
    access.stream_ = compute;
    if (compute == nullptr) {
      ZINF_ASSIGN_OR_RETURN(access.own_stream_, device->create_stream("test io"));
      access.stream_ = access.own_stream_.get();
    }
    return access;
  }

  Result<std::vector<float>> read(const TensorView& view) {
    if (device_ == nullptr) return widen_view(view);
    std::vector<std::byte> raw(view.element_count * dtype_bytes(view.dtype));
    ZINF_RETURN_IF_ERROR(device_->copy_d2h(raw.data(), view.data, raw.size(), *stream_));
    ZINF_RETURN_IF_ERROR(device_->synchronize(*stream_, std::chrono::seconds(30)));
    TensorView host = view;
    host.data = raw.data();
    return widen_view(host);
  }

  // Device memory holding `bytes` bytes of `data` (in place when host-accessible).
  Result<const void*> upload(const void* data, std::size_t bytes) {
    if (device_ == nullptr) return data;
    ZINF_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::allocate(*device_, bytes));
    ZINF_RETURN_IF_ERROR(device_->copy_h2d(buffer.data(), data, bytes, *stream_));
    ZINF_RETURN_IF_ERROR(device_->synchronize(*stream_, std::chrono::seconds(30)));
    uploads_.push_back(std::move(buffer));
    return uploads_.back().data();
  }
  // Frees what upload() made, once the engine has read it: with a compute stream,
  // reduce_gradients() returns before the read, which that stream waits for.
  Status clear() {
    if (device_ != nullptr && !uploads_.empty()) {
      ZINF_RETURN_IF_ERROR(device_->synchronize(*stream_, std::chrono::seconds(30)));
    }
    uploads_.clear();
    return Status::ok();
  }

 private:
  Device* device_ = nullptr;
  std::unique_ptr<Stream> own_stream_;
  Stream* stream_ = nullptr;
  std::vector<DeviceBuffer> uploads_;
};

}  // namespace

std::vector<float> make_grad(const ParamDef& def, const std::vector<float>& w, int rank, int step,
                             int micro, std::size_t p) {
  std::vector<float> target(w.size());
  const std::uint64_t seed =
      (static_cast<std::uint64_t>(rank) * 1'000'003 + static_cast<std::uint64_t>(step) * 1009 +
       static_cast<std::uint64_t>(micro) * 101 + p) *
      2654435761ull;
  fill_uniform(target.data(), target.size(), seed, -1.0f, 1.0f);
  std::vector<float> g(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) g[i] = round_to((w[i] - target[i]) * 0.5f, def.dtype);
  return g;
}

Status register_model(Engine& engine, const Model& model) {
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    const ParamDef& d = model.params[p];
    ParameterSpec spec{d.name, d.module, d.shape, d.dtype, model.initial[p].data()};
    spec.trainable = d.module != model.frozen_module;
    ZINF_RETURN_IF_ERROR(engine.register_parameter(spec));
  }
  return Status::ok();
}

Status train_rank(Engine& engine, const Model& model, int rank, const TrainOptions& options,
                  const std::vector<std::vector<std::vector<float>>>* reference_device,
                  std::vector<StepReport>* reports) {
  if (!engine.finalized()) ZINF_RETURN_IF_ERROR(register_model(engine, model));
  const std::size_t count = model.params.size();
  ZINF_ASSIGN_OR_RETURN(DeviceAccess access,
                        DeviceAccess::open(options.device, options.compute_stream));
  if (options.compute_stream != nullptr) {
    ZINF_RETURN_IF_ERROR(engine.set_compute_stream(options.compute_stream));
  }
  for (int step = options.first_step; step <= options.steps; ++step) {
    for (int micro = 0; micro < options.micro_batches; ++micro) {
      std::vector<std::vector<float>> w(count);
      for (const std::string& m : model.modules) {
        ZINF_RETURN_IF_ERROR(engine.gather(m));
        for (std::size_t p = 0; p < count; ++p) {
          if (model.params[p].module != m) continue;
          ZINF_ASSIGN_OR_RETURN(TensorView view, engine.parameter(model.params[p].name));
          ZINF_ASSIGN_OR_RETURN(w[p], access.read(view));
          if (options.check_gathered && reference_device != nullptr) {
            const std::vector<float>& want =
                (*reference_device)[static_cast<std::size_t>(step - 1)][p];
            const bool same = options.gathered_tolerance > 0
                                  ? max_rel_diff(w[p], want) <= options.gathered_tolerance
                                  : std::memcmp(want.data(), w[p].data(), want.size() * 4) == 0;
            if (!same) {
              std::size_t i = 0;
              while (i + 1 < want.size() && std::memcmp(&want[i], &w[p][i], 4) == 0) ++i;
              return Status::internal(fmt::format(
                  "rank {} step {} micro {}: gathered '{}'[{}] = {} but the reference has {}", rank,
                  step, micro, model.params[p].name, i, w[p][i], want[i]));
            }
          }
        }
        ZINF_RETURN_IF_ERROR(engine.release(m));
      }
      for (auto it = model.modules.rbegin(); it != model.modules.rend(); ++it) {
        ZINF_RETURN_IF_ERROR(engine.gather(*it));
        std::vector<std::vector<float>> grads32;
        std::vector<std::vector<std::uint16_t>> grads16;
        std::vector<GradientRef> refs;
        for (std::size_t p = 0; p < count; ++p) {
          const ParamDef& d = model.params[p];
          if (d.module != *it) continue;
          // The backward pass computes with the values gathered now.
          ZINF_ASSIGN_OR_RETURN(TensorView view, engine.parameter(d.name));
          ZINF_ASSIGN_OR_RETURN(std::vector<float> values, access.read(view));
          std::vector<float> g = make_grad(d, values, rank, step, micro, p);
          if (d.dtype == DType::kF32) {
            grads32.push_back(std::move(g));
          } else {
            grads16.push_back(narrow_to_half(g, d.dtype));
          }
        }
        std::size_t i32 = 0, i16 = 0;
        for (std::size_t p = 0; p < count; ++p) {
          const ParamDef& d = model.params[p];
          if (d.module != *it) continue;
          const void* data = d.dtype == DType::kF32
                                 ? static_cast<const void*>(grads32[i32++].data())
                                 : grads16[i16++].data();
          ZINF_ASSIGN_OR_RETURN(data,
                                access.upload(data, d.element_count() * dtype_bytes(d.dtype)));
          refs.push_back({d.name, data, d.element_count(), d.dtype});
        }
        if (*it != model.frozen_module) {
          ZINF_RETURN_IF_ERROR(engine.reduce_gradients(*it, refs));
        }
        ZINF_RETURN_IF_ERROR(access.clear());
        ZINF_RETURN_IF_ERROR(engine.release(*it));
      }
    }
    ZINF_ASSIGN_OR_RETURN(StepReport report, engine.step());
    if (reports != nullptr) reports->push_back(report);
  }
  if (options.compute_stream != nullptr) return engine.set_compute_stream(nullptr);
  return Status::ok();
}

std::shared_ptr<FaultInjector> failing_io(bool reads) {
  FaultSpec spec;
  spec.eio_rate = 1.0;
  spec.reads = reads;
  spec.writes = !reads;
  auto faults = std::make_shared<FaultInjector>(spec);
  faults->set_enabled(false);
  return faults;
}

std::shared_ptr<FaultInjector> io_counter(bool reads) {
  FaultSpec spec;
  spec.latency_rate = 1.0;
  spec.latency = std::chrono::microseconds(0);
  spec.reads = reads;
  spec.writes = !reads;
  return std::make_shared<FaultInjector>(spec);
}

Result<std::unique_ptr<Engine>> open_rank(Ranks& ranks, int rank, const Config& config,
                                          std::shared_ptr<FaultInjector> faults) {
  const auto r = static_cast<std::size_t>(rank);
  Env env;
  env.device = ranks.devices[r].get();
  env.comm = ranks.comms[r].get();
  env.io_faults = std::move(faults);
  return Engine::open(config, env);
}

Result<std::unique_ptr<Engine>> open_finalized(Ranks& ranks, int rank, const Config& config,
                                               const Model& model,
                                               std::shared_ptr<FaultInjector> faults) {
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                        open_rank(ranks, rank, config, std::move(faults)));
  ZINF_RETURN_IF_ERROR(register_model(*engine, model));
  ZINF_RETURN_IF_ERROR(engine->finalize());
  return engine;
}

Reference run_reference(const Config& config, const Model& model, int world,
                        const TrainOptions& options) {
  const std::size_t count = model.params.size();
  Reference ref;
  ref.master = model.initial;
  std::vector<std::vector<float>> m(count), v(count);
  for (std::size_t p = 0; p < count; ++p) {
    m[p].assign(model.initial[p].size(), 0.0f);
    v[p].assign(model.initial[p].size(), 0.0f);
  }
  const int micro_count = options.micro_batches;
  const int saved_world = world;
  double previous_coef = 1.0;  // zinf.clip_from_previous_step
  for (int step = 1; step <= options.steps; ++step) {
    world = options.resharded_from_step > 0 && step >= options.resharded_from_step
                ? options.resharded_world
                : saved_world;
    std::vector<std::vector<float>> device(count);
    for (std::size_t p = 0; p < count; ++p) {
      device[p].resize(ref.master[p].size());
      for (std::size_t i = 0; i < device[p].size(); ++i) {
        device[p][i] = round_to(ref.master[p][i], model.params[p].dtype);
      }
    }
    std::vector<std::vector<float>> acc(count);
    for (std::size_t p = 0; p < count; ++p) {
      const std::size_t n = device[p].size();
      acc[p].assign(n, 0.0f);
      if (model.params[p].module == model.frozen_module) continue;  // no gradient
      // grads[r][k]
      std::vector<std::vector<std::vector<float>>> g(static_cast<std::size_t>(world));
      for (int r = 0; r < world; ++r) {
        for (int k = 0; k < micro_count; ++k) {
          g[static_cast<std::size_t>(r)].push_back(
              make_grad(model.params[p], device[p], r, step, k, p));
        }
      }
      if (config.zero.stage == 1) {
        // Each rank sums its micro-batches, then the average over ranks, in rank order.
        std::vector<std::vector<float>> full(static_cast<std::size_t>(world),
                                             std::vector<float>(n, 0.0f));
        for (int r = 0; r < world; ++r) {
          for (int k = 0; k < micro_count; ++k) {
            for (std::size_t i = 0; i < n; ++i) {
              full[static_cast<std::size_t>(r)][i] +=
                  g[static_cast<std::size_t>(r)][static_cast<std::size_t>(k)][i];
            }
          }
        }
        for (std::size_t i = 0; i < n; ++i) {
          float s = full[0][i];
          for (int r = 1; r < world; ++r) s += full[static_cast<std::size_t>(r)][i];
          acc[p][i] = 0.0f + s / static_cast<float>(world);
        }
      } else {
        for (int k = 0; k < micro_count; ++k) {
          for (std::size_t i = 0; i < n; ++i) {
            float s = g[0][static_cast<std::size_t>(k)][i];
            for (int r = 1; r < world; ++r) {
              s += g[static_cast<std::size_t>(r)][static_cast<std::size_t>(k)][i];
            }
            acc[p][i] += s / static_cast<float>(world);
          }
        }
      }
    }
    ref.device_per_step.push_back(device);
    double unscale = 1.0 / static_cast<double>(micro_count);
    double coef = 1.0;
    if (config.gradient_clipping > 0.0) {
      double sumsq = 0.0;
      for (const auto& a : acc) {
        for (float x : a) sumsq += static_cast<double>(x) * x;
      }
      const double norm = std::sqrt(sumsq * unscale * unscale);
      if (norm > config.gradient_clipping) coef = config.gradient_clipping / (norm + 1e-6);
      if (config.clip_from_previous_step) {
        // The previous step's coefficient; the first step's own.
        std::swap(coef, previous_coef);
        if (step == 1) coef = previous_coef;
      }
    }
    StepOptions so;
    so.step = step;
    so.grad_scale = static_cast<float>(coef * unscale);
    so.threads = 1;
    if (options.device_adam) {
      kernels::AdamHyper hyper;
      hyper.lr = static_cast<float>(config.optimizer.lr);
      hyper.beta1 = static_cast<float>(config.optimizer.beta1);
      hyper.beta2 = static_cast<float>(config.optimizer.beta2);
      hyper.eps = static_cast<float>(config.optimizer.eps);
      hyper.weight_decay = static_cast<float>(config.optimizer.weight_decay);
      hyper.adamw = config.optimizer.kind == OptimizerKind::kAdamW;
      const kernels::AdamStepArgs args = kernels::adam_step_args(hyper, step);
      for (std::size_t p = 0; p < count; ++p) {
        if (model.params[p].module == model.frozen_module) continue;  // left out of the step
        for (float& g : acc[p]) g = g * so.grad_scale;
        kernels::adam_step_ref(ref.master[p].data(), acc[p].data(), m[p].data(), v[p].data(),
                               nullptr, kernels::HalfType::kNone, acc[p].size(), args);
      }
      continue;
    }
    for (std::size_t p = 0; p < count; ++p) {
      if (model.params[p].module == model.frozen_module) continue;  // left out of the step
      OptimizerSpan span;
      span.params = ref.master[p].data();
      span.exp_avg = m[p].data();
      span.exp_avg_sq = v[p].data();
      span.grads = acc[p].data();
      span.count = acc[p].size();
      Result<StepResult> r = optimizer_step(config.optimizer, span, so);
      if (!r.is_ok()) std::abort();
    }
  }
  ref.exp_avg = std::move(m);
  ref.exp_avg_sq = std::move(v);
  return ref;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  // An empty vector's data() may be null, which memcmp must not be given even for 0 bytes.
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b, double floor) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]) /
                     std::max(std::fabs(static_cast<double>(b[i])), floor);
    if (!(d <= worst)) worst = d;  // NaN wins
  }
  return a.size() == b.size() ? worst : 1e30;
}

double worst_rel_diff(const std::vector<std::vector<float>>& got,
                      const std::vector<std::vector<float>>& want) {
  double worst = 0;
  for (std::size_t p = 0; p < want.size(); ++p) {
    worst = std::max(worst, max_rel_diff(got.at(p), want[p]));
  }
  return worst;
}

Config small_config(int stage, OffloadDevice optimizer, OffloadDevice params,
                    const std::string& nvme_path) {
  Config c;
  c.optimizer.kind = OptimizerKind::kAdamW;
  c.optimizer.lr = 1e-2;  // large enough that every step moves every value
  c.optimizer.weight_decay = 0.05;
  c.zero.stage = stage;
  c.zero.offload_optimizer.device = optimizer;
  c.zero.offload_optimizer.nvme_path = nvme_path;
  c.zero.offload_optimizer.buffer_count = 3;
  c.zero.offload_param.device = params;
  c.zero.offload_param.nvme_path = nvme_path;
  c.zero.offload_param.buffer_count = 2;
  c.zero.sub_group_size = 700;
  c.zero.reduce_bucket_size = 600;
  c.zero.stage3_prefetch_bucket_size = 1600;
  c.zero.stage3_max_live_parameters = 2500;
  c.zero.stage3_param_persistence_threshold = 30;
  c.aio_block_bytes = 65536;
  c.aio_queue_depth = 8;
  c.cpu_threads = 1;
  c.collective_timeout_ms = 30'000;
  return c;
}

Result<std::vector<std::vector<float>>> read_masters(Engine& engine, const Model& model) {
  std::vector<std::vector<float>> out;
  for (const ParamDef& def : model.params) {
    out.emplace_back(def.element_count());
    ZINF_RETURN_IF_ERROR(engine.read_parameters(def.name, out.back().data()));
  }
  return out;
}

RankRuns train_against_reference(const Config& config, Ranks& ranks, const Model& model,
                                 const TrainOptions& options, const Reference& reference) {
  const std::size_t world = ranks.devices.size();
  RankRuns runs;
  runs.finals.resize(world);
  runs.reports.resize(world);
  runs.counters.resize(world);
  runs.status = run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    TrainOptions rank_options = options;
    rank_options.device = ranks.devices[r].get();
    ZINF_RETURN_IF_ERROR(train_rank(engine, model, rank, rank_options, &reference.device_per_step,
                                    &runs.reports[r]));
    ZINF_ASSIGN_OR_RETURN(runs.finals[r], read_masters(engine, model));
    runs.counters[r] = engine.counters();
    return Status::ok();
  });
  return runs;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

}  // namespace zinf::engine_test
