// zinf._zinf: the Python binding over zinf's public C++ API (include/zinf/*.hpp), built with
// nanobind. It is deliberately thin: one class, Engine, that owns a rank's device, communicator
// and zinf::Engine, and hands parameters out as DLPack arrays over the engine's own memory
// (torch.from_dlpack() makes a tensor of them without a copy). Everything torch-shaped lives in
// Python (python/zinf/torch.py).
//
// Errors: every zinf::Status that is not OK becomes a zinf.Error (a RuntimeError) whose message is
// Status::to_string(), "<code name>: <message>", so the code and the named file, key, module or
// parameter reach the Python caller. Calls that may block (gather, reduce, step, checkpoints,
// finalize, reading and writing parameters, set_learning_rate, opening and closing the engine)
// release the GIL, through without_gil(): with the "torch" communicator a collective needs the
// GIL to finish (torch_comm.hpp), so no call may hold it while it waits for one.
//
// Thread-safety: as zinf::Engine, call one Engine from one thread.
#include <fcntl.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <unistd.h>
#include <xxhash.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torch_comm.hpp"
#include "zinf/comm.hpp"
#include "zinf/config.hpp"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"
#include "zinf/engine.hpp"
#include "zinf/status.hpp"
#include "zinf/version.hpp"

namespace nb = nanobind;

namespace {

// Carries a failed Status to Python as zinf.Error.
class ZinfError : public std::runtime_error {
 public:
  explicit ZinfError(const zinf::Status& status) : std::runtime_error(status.to_string()) {}
};

void check(const zinf::Status& status) {
  if (!status.is_ok()) throw ZinfError(status);
}

template <typename T>
T take(zinf::Result<T>&& result) {
  check(result.status());
  return std::move(result).value();
}

// Runs `call`, which returns a zinf::Status or a zinf::Result<T>, with the GIL released (it may
// block on I/O, on worker threads or on the other ranks), and raises zinf.Error for a failure
// once the GIL is held again; returns the Result's value. `call` must not touch Python objects.
template <typename Call>
auto without_gil(Call&& call) {
  auto outcome = [&] {
    nb::gil_scoped_release release;
    return call();
  }();
  if constexpr (std::is_same_v<decltype(outcome), zinf::Status>) {
    check(outcome);
  } else {
    return take(std::move(outcome));
  }
}

zinf::DType dtype_from_name(const std::string& name) {
  const auto dtype = zinf::parse_dtype(name);
  if (!dtype) {
    throw ZinfError(
        zinf::Status::invalid_argument("dtype: '" + name + "' is not f32, f16 or bf16"));
  }
  return *dtype;
}

// DLPack's type codes (dlpack.h DLDataTypeCode): kDLFloat = 2, kDLBfloat = 4.
nb::dlpack::dtype dlpack_dtype(zinf::DType dtype) {
  switch (dtype) {
    case zinf::DType::kF32:
      return nb::dtype<float>();
    case zinf::DType::kF16:
      return nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case zinf::DType::kBF16:
      return nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
  }
  throw std::logic_error("unknown dtype");
}

bool dtype_from_dlpack(nb::dlpack::dtype type, zinf::DType* dtype) {
  if (type.lanes != 1) return false;
  if (type.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)) {
    if (type.bits == 32)
      *dtype = zinf::DType::kF32;
    else if (type.bits == 16)
      *dtype = zinf::DType::kF16;
    else
      return false;
    return true;
  }
  if (type.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat) && type.bits == 16) {
    *dtype = zinf::DType::kBF16;
    return true;
  }
  return false;
}

using HostArray = nb::ndarray<nb::c_contig, nb::device::cpu>;
using FloatArray = nb::ndarray<float, nb::c_contig, nb::device::cpu>;

// One rank: a HostDevice, a communicator, and the engine. The communicator is a LocalComm group
// of one ("local"), this process's rank of MPI_COMM_WORLD ("mpi": make_mpi_comm initialises MPI
// when the process has not), or this process's rank of a torch.distributed gloo group ("torch",
// over `transport`, zinf.torch's _TorchTransport: torch_comm.hpp); the collectives of the last two
// fail after collective_timeout_ms when a peer does not arrive. Members are destroyed in reverse
// order: the engine before the communicator before the device, and always without the GIL (a
// torch communicator's worker takes it to finish a collective the engine may be waiting for).
class PyEngine {
 public:
  PyEngine(const std::string& config_json, const std::vector<std::string>& nvme_paths,
           std::uint64_t device_memory_limit_bytes, const std::string& comm, nb::object transport) {
    const zinf::Config config = take(zinf::parse_config(config_json));
    zinf::HostDeviceOptions device_options;
    if (device_memory_limit_bytes != 0)
      device_options.memory_limit_bytes = device_memory_limit_bytes;
    device_ = take(zinf::make_host_device(device_options));
    const auto timeout = std::chrono::milliseconds(config.collective_timeout_ms);
    if (comm == "local") {
      zinf::LocalCommOptions comm_options;
      comm_options.timeout = timeout;
      comms_ = take(zinf::make_local_comm_group({device_.get()}, comm_options));
    } else if (comm == "mpi") {
      zinf::MpiCommOptions comm_options;
      comm_options.timeout = timeout;
      comms_.push_back(take(zinf::make_mpi_comm(*device_, comm_options)));
    } else if (comm == "torch") {
      if (transport.is_none()) {
        throw ZinfError(zinf::Status::invalid_argument(
            "comm \"torch\" needs a transport (zinf.torch makes it from torch.distributed)"));
      }
      comms_.push_back(take(zinf_python::make_torch_comm(*device_, transport, timeout)));
    } else {
      throw ZinfError(zinf::Status::invalid_argument("comm: '" + comm +
                                                     "' is not \"local\", \"mpi\" or \"torch\""));
    }
    zinf::Env env;
    env.device = device_.get();
    env.comm = comms_[0].get();
    env.nvme_paths = nvme_paths;
    zinf::Result<std::unique_ptr<zinf::Engine>> engine = [&] {
      nb::gil_scoped_release release;
      return zinf::Engine::open(config, env);
    }();
    if (!engine.is_ok()) {
      destroy();
      check(engine.status());
    }
    engine_ = std::move(engine).value();
  }

  ~PyEngine() { destroy(); }
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;

  // Registers a parameter with its initial values (`values`, copied now) or, when `values` is
  // None, with `initializer`: a callable (first_element, out) that fills the float32 array `out`
  // with elements [first_element, first_element + len(out)) of the parameter, called during
  // finalize() for this rank's slice only (ParameterSpec::initializer). An exception it raises
  // fails finalize() naming the parameter. `trainable` False registers a frozen parameter
  // (ParameterSpec::trainable).
  void register_parameter(const std::string& name, const std::string& module,
                          const std::vector<std::int64_t>& shape, const std::string& dtype,
                          std::optional<FloatArray> values, nb::object initializer,
                          const std::string& group, std::uint64_t values_hash, bool trainable) {
    zinf::ParameterSpec spec;
    spec.name = name;
    spec.module = module;
    spec.shape = shape;
    spec.dtype = dtype_from_name(dtype);
    spec.group = group;
    spec.initializer_values_hash = values_hash;
    spec.trainable = trainable;
    std::size_t element_count = 1;
    for (const std::int64_t dim : shape)
      element_count *= static_cast<std::size_t>(dim > 0 ? dim : 0);
    if (values.has_value()) {
      if (values->size() != element_count) {
        throw ZinfError(zinf::Status::invalid_argument(
            "parameter '" + name + "': " + std::to_string(values->size()) +
            " initial values for a shape of " + std::to_string(element_count) + " elements"));
      }
      spec.initial_values = values->data();
    } else if (!initializer.is_none()) {
      // The engine copies and drops the function without the GIL: the callable is held by a
      // shared_ptr whose deleter takes the GIL, so no copy touches its reference count.
      std::shared_ptr<nb::object> callable(new nb::object(initializer), [](nb::object* o) {
        nb::gil_scoped_acquire acquire;
        delete o;
      });
      spec.initializer = [callable, name](std::size_t first, std::size_t count,
                                          float* out) -> zinf::Status {
        nb::gil_scoped_acquire acquire;
        try {
          const std::size_t shape[1] = {count};
          // A numpy view of `out` (rv_policy::reference: without it nanobind hands over a copy
          // of an array that has no owner).
          nb::object view =
              nb::cast(nb::ndarray<nb::numpy, float, nb::c_contig>(out, 1, shape, nb::handle()),
                       nb::rv_policy::reference);
          (*callable)(first, view);
          return zinf::Status::ok();
        } catch (const std::exception& e) {
          return zinf::Status::invalid_argument("initializer of parameter '" + name +
                                                "' raised: " + e.what());
        }
      };
    } else {
      throw ZinfError(zinf::Status::invalid_argument("parameter '" + name +
                                                     "': neither values nor an initializer"));
    }
    check(engine().register_parameter(spec));
    element_counts_[name] = element_count;
  }

  // Aborts the communicator with `message` (kAborted): the peers' collectives fail at once with
  // it instead of waiting for collective_timeout_ms, and every later call of this engine fails.
  void abort(const std::string& message) {
    if (!comms_.empty()) comms_[0]->abort(zinf::Status::aborted(message));
  }

  // The communicator's sticky status: "OK", or the first failure (a peer's abort notice names
  // the rank it came from).
  std::string comm_status() const {
    return comms_.empty() ? "closed" : comms_[0]->status().to_string();
  }

  // The parameter's device copy as a DLPack array over the engine's memory, owned by `self`
  // (the Python Engine), which stays alive while any tensor made from it does. Valid while the
  // parameter's module is gathered (always at stages 1 and 2).
  static nb::ndarray<> parameter(nb::handle self, const std::string& name) {
    PyEngine& engine = nb::cast<PyEngine&>(self);
    const zinf::TensorView view = take(engine.engine().parameter(name));
    std::vector<std::size_t> shape(view.shape.begin(), view.shape.end());
    return nb::ndarray<>(view.data, shape.size(), shape.data(), self, nullptr,
                         dlpack_dtype(view.dtype), nb::device::cpu::value, 0);
  }

  // One GradientRef per (name, array); the arrays are read before this returns.
  void reduce_gradients(const std::string& module, const std::vector<std::string>& names,
                        const std::vector<HostArray>& gradients) {
    if (names.size() != gradients.size()) {
      throw ZinfError(zinf::Status::invalid_argument(
          "reduce_gradients('" + module + "'): " + std::to_string(names.size()) + " names and " +
          std::to_string(gradients.size()) + " gradients"));
    }
    std::vector<zinf::GradientRef> refs(names.size());
    for (std::size_t i = 0; i < names.size(); ++i) {
      zinf::DType dtype;
      if (!dtype_from_dlpack(gradients[i].dtype(), &dtype)) {
        throw ZinfError(zinf::Status::invalid_argument(
            "gradient of '" + names[i] + "': dtype is not float32, float16 or bfloat16"));
      }
      refs[i] = zinf::GradientRef{names[i], gradients[i].data(), gradients[i].size(), dtype};
    }
    zinf::Engine& core = engine();
    without_gil([&] { return core.reduce_gradients(module, refs); });
  }

  // average_over: Engine::step(average_over) (0: the mean of the micro-batches reduced).
  nb::dict step(int average_over) {
    zinf::Engine& core = engine();
    const zinf::StepReport report = without_gil([&] { return core.step(average_over); });
    nb::dict out;
    out["step"] = report.step;
    out["skipped"] = report.skipped;
    out["micro_batches"] = report.micro_batches;
    out["loss_scale"] = report.loss_scale;
    out["next_loss_scale"] = report.next_loss_scale;
    out["grad_norm"] = report.grad_norm;
    out["clip_coef"] = report.clip_coef;
    out["wall_ns"] = report.wall_ns;
    out["optimizer_ns"] = report.optimizer_ns;
    out["optimizer_nvme_read_bytes"] = report.optimizer_nvme_read_bytes;
    out["optimizer_nvme_write_bytes"] = report.optimizer_nvme_write_bytes;
    out["param_nvme_write_bytes"] = report.param_nvme_write_bytes;
    out["overlapped"] = report.overlapped;
    out["hidden_ns"] = report.hidden_ns;
    out["gather_wait_ns"] = report.gather_wait_ns;
    out["in_backward"] = report.in_backward;
    out["read_ahead"] = report.read_ahead;
    return out;
  }

  // The fp32 master of parameter `name` into `out`, which must hold exactly its elements.
  void read_parameters(const std::string& name, FloatArray out) {
    float* data = checked_out("read_parameters('" + name + "')", name, out);
    zinf::Engine& core = engine();
    without_gil([&] { return core.read_parameters(name, data); });
  }

  // One optimizer moment of `name` ("exp_avg" or "exp_avg_sq") into `out`, as read_parameters.
  void read_optimizer_state(const std::string& name, const std::string& state, FloatArray out) {
    float* data = checked_out("read_optimizer_state('" + name + "', '" + state + "')", name, out);
    zinf::Engine& core = engine();
    without_gil([&] { return core.read_optimizer_state(name, state, data); });
  }

  // `out`'s data when it holds exactly parameter `name`'s elements; `call` names the call.
  float* checked_out(const std::string& call, const std::string& name, FloatArray out) const {
    const auto it = element_counts_.find(name);
    if (it == element_counts_.end()) {
      throw ZinfError(zinf::Status::not_found(call + ": no parameter '" + name + "'"));
    }
    if (out.size() != it->second) {
      throw ZinfError(
          zinf::Status::invalid_argument(call + ": out holds " + std::to_string(out.size()) +
                                         " floats, the parameter " + std::to_string(it->second)));
    }
    return out.data();
  }

  // Rank `root`'s values replace the fp32 master of `name` on every rank (Engine::
  // write_parameters; collective). `values` may be None on the other ranks.
  void write_parameters(const std::string& name, std::optional<FloatArray> values, int root) {
    const auto it = element_counts_.find(name);
    if (it == element_counts_.end()) {
      throw ZinfError(zinf::Status::not_found("write_parameters: no parameter '" + name + "'"));
    }
    if (values.has_value() && values->size() != it->second) {
      throw ZinfError(zinf::Status::invalid_argument(
          "write_parameters('" + name + "'): " + std::to_string(values->size()) +
          " values for a parameter of " + std::to_string(it->second)));
    }
    const float* data = values.has_value() ? values->data() : nullptr;
    zinf::Engine& core = engine();
    without_gil([&] { return core.write_parameters(name, data, root); });
  }

  // Rank `root`'s values replace the fp32 masters of `names` on every rank, their groups only
  // (Engine::write_parameters' batch form; collective, every rank passing the same
  // names in the same order). values_fn(name) is called on the root only, once for each name, in
  // the engine's layout order, and returns the parameter's values: a contiguous float32 CPU
  // array or tensor of its element count. It may be None on the other ranks. The GIL is released
  // while the engine works and taken again for each call of values_fn; an exception it raises,
  // or an array of the wrong size, fails the call on every rank (a sticky error, as any failure
  // once the pass has begun).
  void write_parameters_batch(const std::vector<std::string>& names,
                              std::optional<nb::callable> values_fn, int root) {
    const std::vector<std::string_view> views(names.begin(), names.end());
    zinf::ParameterValues values;
    if (values_fn.has_value()) {
      // The engine's error names the parameter: "write_parameters('<name>'): values: ...".
      values = [&values_fn](std::string_view name, std::span<float> out) -> zinf::Status {
        nb::gil_scoped_acquire acquire;
        try {
          nb::object result = (*values_fn)(nb::str(name.data(), name.size()));
          FloatArray array;
          if (!nb::try_cast(result, array)) {
            return zinf::Status::invalid_argument(std::string("values_fn returned ") +
                                                  nb::type_name(result.type()).c_str() +
                                                  ", not a contiguous float32 CPU array");
          }
          if (array.size() != out.size()) {
            return zinf::Status::invalid_argument(
                "values_fn returned " + std::to_string(array.size()) +
                " values for a parameter of " + std::to_string(out.size()));
          }
          std::memcpy(out.data(), array.data(), out.size_bytes());
          return zinf::Status::ok();
        } catch (const nb::python_error& e) {
          return zinf::Status::invalid_argument(std::string("values_fn raised ") +
                                                nb::type_name(e.type()).c_str() + ": " +
                                                nb::str(e.value()).c_str());
        } catch (const std::exception& e) {
          return zinf::Status::invalid_argument(std::string("values_fn raised: ") + e.what());
        }
      };
    }
    zinf::Engine& core = engine();
    without_gil([&] { return core.write_parameters(views, values, root); });
  }

  nb::dict counters() const {
    const zinf::EngineCounters& c = engine().counters();
    nb::dict out;
    out["gathers"] = c.gathers;
    out["gathers_issued"] = c.gathers_issued;
    out["prefetches_issued"] = c.prefetches_issued;
    out["prefetch_hits"] = c.prefetch_hits;
    out["prefetches_dropped"] = c.prefetches_dropped;
    out["order_misses"] = c.order_misses;
    out["live_elements"] = c.live_elements;
    out["live_elements_peak"] = c.live_elements_peak;
    out["persistent_elements"] = c.persistent_elements;
    out["all_gather_bytes"] = c.all_gather_bytes;
    out["reduce_scatter_bytes"] = c.reduce_scatter_bytes;
    out["param_nvme_read_bytes"] = c.param_nvme_read_bytes;
    out["param_nvme_write_bytes"] = c.param_nvme_write_bytes;
    out["steps"] = c.steps;
    out["skipped_steps"] = c.skipped_steps;
    return out;
  }

  nb::dict memory() const {
    // Engine::memory() requires finalize() (the buffers are sized there); refused as in C.
    if (!engine().finalized()) {
      throw ZinfError(zinf::Status::failed_precondition(
          "memory: the engine is not finalized (its buffers are sized at finalize)"));
    }
    const zinf::MemoryReport m = engine().memory();
    nb::dict out;
    out["device_bytes"] = m.device_bytes;
    out["host_bytes"] = m.host_bytes;
    out["nvme_bytes"] = m.nvme_bytes;
    out["activation_device_bytes_peak"] = m.activation_device_bytes_peak;
    out["activation_host_bytes"] = m.activation_host_bytes;
    out["activation_nvme_bytes"] = m.activation_nvme_bytes;
    out["activation_nvme_write_bytes"] = m.activation_nvme_write_bytes;
    out["activation_nvme_read_bytes"] = m.activation_nvme_read_bytes;
    return out;
  }

  // Engine::save_activation of the bytes of `data` (a C-contiguous host array). The store copies
  // from device memory, and torch's CPU tensors are not memory of this HostDevice, so the bytes
  // go through a device buffer, held until the store's next call has returned (the store reads
  // a save's memory asynchronously, until then).
  void save_activation(const std::string& key, const HostArray& data) {
    zinf::Engine& core = engine();  // raises once closed, before the device is used
    const std::size_t bytes = data.nbytes();
    zinf::DeviceBuffer staging;
    if (bytes > 0) {
      staging = take(zinf::DeviceBuffer::allocate(*device_, bytes));
      std::memcpy(staging.data(), data.data(), bytes);
    }
    auto it = activation_bytes_.try_emplace(key, 0).first;
    const void* pointer = staging.data();
    zinf::Status status;
    {
      nb::gil_scoped_release release;
      status = core.save_activation(key, pointer, bytes);
    }
    // This call returned: the store is done with the buffers of the saves before it (unless it
    // failed before waiting for them, when they are kept).
    if (status.is_ok()) pending_saves_.clear();
    pending_saves_.push_back(std::move(staging));
    check(status);
    it->second = bytes;
  }

  // Engine::load_activation into `out`, which must hold exactly the bytes saved under `key`
  // (checked here: the engine writes the saved size), through a device buffer as above.
  void load_activation(const std::string& key, const HostArray& out) {
    zinf::Engine& core = engine();  // raises once closed, before the device is used
    const auto it = activation_bytes_.find(key);
    const std::size_t bytes = out.nbytes();
    if (it != activation_bytes_.end() && it->second != 0 && it->second != bytes) {
      throw ZinfError(zinf::Status::invalid_argument(
          "load_activation('" + key + "'): out holds " + std::to_string(bytes) +
          " bytes, the activation " + std::to_string(it->second)));
    }
    zinf::DeviceBuffer staging;
    if (bytes > 0) staging = take(zinf::DeviceBuffer::allocate(*device_, bytes));
    void* pointer = staging.data();
    without_gil([&] { return core.load_activation(key, pointer); });
    pending_saves_.clear();
    std::memcpy(out.data(), pointer, bytes);
    if (it != activation_bytes_.end()) it->second = 0;
  }

  // Rank `root`'s bytes of `buffer` into every rank's `buffer` (a contiguous CPU array of any
  // number of bytes, the same on every rank), over the engine's communicator; collective.
  // For what the engine does not hold (zinf.torch's frozen parameters at stages 1 and 2).
  // Between engine calls: the engine must have no collective of its own in flight.
  void broadcast_bytes(const HostArray& buffer, int root, const std::string& name) {
    const std::size_t bytes = buffer.nbytes();
    auto* data = static_cast<std::uint8_t*>(buffer.data());
    // DType has no byte type: the bytes move as 2-byte elements, in place, and an odd last byte
    // in a pair of its own (the buffer has no byte after it to pad with), in a second broadcast
    // issued behind the first and waited for with it. The pair is the engine's, not this
    // frame's: a wait that runs out returns while the stream may still write it.
    const std::size_t even_bytes = bytes - bytes % 2;
    std::array<std::uint8_t, 2>& tail = client_tail_;
    tail = {bytes % 2 != 0 ? data[bytes - 1] : std::uint8_t{0}, 0};
    run_client_collective([&](zinf::Communicator& comm, zinf::Stream& stream) {
      if (even_bytes > 0 || bytes == 0) {
        ZINF_RETURN_IF_ERROR(
            comm.broadcast(data, data, even_bytes / 2, zinf::DType::kF16, root, stream, name));
      }
      if (bytes % 2 == 0) return zinf::Status::ok();
      return comm.broadcast(tail.data(), tail.data(), 1, zinf::DType::kF16, root, stream, name);
    });
    if (bytes % 2 != 0) data[bytes - 1] = tail[0];
  }

  // Every rank's `send` (a contiguous CPU array of any number of bytes, the same on every rank)
  // into `recv`, rank after rank; collective, between engine calls as broadcast_bytes. `send`
  // and `recv` must not overlap: with an odd size the even prefixes land packed at the front of
  // `recv` before they move up (below), which would overwrite a `send` inside it before it is
  // read, so an in-place call is refused before the collective (invalid_argument naming the
  // call, as a wrong size is).
  void all_gather_bytes(const HostArray& send, const HostArray& recv, const std::string& name) {
    const std::size_t bytes = send.nbytes();
    const std::size_t world = static_cast<std::size_t>(engine().world_size());
    if (recv.nbytes() != bytes * world) {
      throw ZinfError(zinf::Status::invalid_argument(
          "all_gather_bytes('" + name + "'): send holds " + std::to_string(bytes) +
          " bytes, recv " + std::to_string(recv.nbytes()) + " (must be " +
          std::to_string(bytes * world) + ")"));
    }
    const auto* in = static_cast<const std::uint8_t*>(send.data());
    auto* out = static_cast<std::uint8_t*>(recv.data());
    const auto in_begin = reinterpret_cast<std::uintptr_t>(in);
    const auto out_begin = reinterpret_cast<std::uintptr_t>(out);
    if (bytes > 0 && in_begin < out_begin + bytes * world && out_begin < in_begin + bytes) {
      throw ZinfError(zinf::Status::invalid_argument(
          "all_gather_bytes('" + name + "'): send and recv overlap (send holds " +
          std::to_string(bytes) + " bytes, recv " + std::to_string(bytes * world) +
          "); pass separate buffers"));
    }
    // As in broadcast_bytes, the bytes move as 2-byte elements. With an odd size the even
    // prefixes land packed at the front of `recv` (rank r's at r * even_bytes, which `recv`
    // holds: even_bytes * world < bytes * world), and each rank's odd last byte in a pair of its
    // own, gathered into the engine's pairs (the engine's, not this frame's, as broadcast_bytes'
    // tail); then the prefixes move up to r * bytes, the last rank's first, so that none is
    // overwritten before it has moved, and the last bytes go behind them.
    const std::size_t even_bytes = bytes - bytes % 2;
    if (bytes % 2 != 0) {
      client_tail_ = {in[bytes - 1], 0};
      client_tails_.resize(2 * world);  // the world does not change: sized once
    }
    run_client_collective([&](zinf::Communicator& comm, zinf::Stream& stream) {
      if (even_bytes > 0 || bytes == 0) {
        ZINF_RETURN_IF_ERROR(
            comm.all_gather(in, out, even_bytes / 2, zinf::DType::kF16, stream, name));
      }
      if (bytes % 2 == 0) return zinf::Status::ok();
      return comm.all_gather(client_tail_.data(), client_tails_.data(), 1, zinf::DType::kF16,
                             stream, name);
    });
    if (bytes % 2 == 0) return;
    for (std::size_t r = world; r-- > 0;) {
      std::memmove(out + r * bytes, out + r * even_bytes, even_bytes);
      out[r * bytes + even_bytes] = client_tails_[2 * r];
    }
  }

  // Destroys the engine, then the communicator (an MpiComm stops its progress thread and frees
  // its MPI communicators, a torch one its worker), then the device: every parameter's memory is
  // gone afterwards, and every later call raises. zinf.torch calls it at interpreter exit (before
  // MPI is finalised).
  void close() { destroy(); }

  zinf::Engine& engine() {
    if (!engine_) throw ZinfError(zinf::Status::failed_precondition("the engine was closed"));
    return *engine_;
  }
  const zinf::Engine& engine() const { return const_cast<PyEngine*>(this)->engine(); }

 private:
  // What close() and the destructor do; called with the GIL held, released while the engine's
  // threads and the communicator's worker are waited for.
  void destroy() {
    nb::gil_scoped_release release;
    engine_.reset();
    pending_saves_.clear();
    client_done_.reset();
    client_stream_.reset();
    comms_.clear();
    device_.reset();
  }

  // Issues collectives on the client stream (made on first use) and waits for them without the
  // GIL (a torch communicator's worker takes it); raises zinf.Error for a failure.
  template <typename Issue>
  void run_client_collective(Issue&& issue) {
    engine();  // raises once closed
    if (!client_stream_) {
      client_stream_ = take(device_->create_stream("client collectives"));
      client_done_ = take(device_->create_event());
    }
    zinf::Communicator& comm = *comms_.at(0);
    without_gil([&] {
      ZINF_RETURN_IF_ERROR(issue(comm, *client_stream_));
      ZINF_RETURN_IF_ERROR(device_->record(*client_done_, *client_stream_));
      return comm.wait(*client_done_);
    });
  }

  std::unique_ptr<zinf::Device> device_;
  // Device copies of the last saved activations, read by the store until its next call returns.
  std::vector<zinf::DeviceBuffer> pending_saves_;
  std::vector<std::unique_ptr<zinf::Communicator>> comms_;
  std::unique_ptr<zinf::Stream> client_stream_;  // broadcast_bytes and all_gather_bytes
  std::unique_ptr<zinf::Event> client_done_;
  // broadcast_bytes' odd last byte, or this rank's for all_gather_bytes, in a pair.
  std::array<std::uint8_t, 2> client_tail_{};
  std::vector<std::uint8_t> client_tails_;  // all_gather_bytes: every rank's pair, rank by rank
  std::unique_ptr<zinf::Engine> engine_;
  std::unordered_map<std::string, std::size_t> element_counts_;
  // Bytes of each activation saved and not loaded yet (0: none), for load_activation's check.
  std::unordered_map<std::string, std::size_t> activation_bytes_;
};

// XXH3-64 (seed 0) of the file at `path` and its size in bytes, read in blocks of kBlockBytes
// through libxxhash's streaming state, which gives XXH3_64bits of the whole content: the checksum
// the C++ save writes into a checkpoint's manifest for each file. Runs with the GIL released; a
// failure to open or read is an OSError (FileNotFoundError, PermissionError, ...) naming the file,
// and for a read, the offset.
std::pair<std::uint64_t, std::uint64_t> xxh3_64_file(const std::string& path) {
  constexpr std::size_t kBlockBytes = std::size_t{1} << 20;
  int err = 0;
  std::string operation;
  std::uint64_t size_bytes = 0;
  std::uint64_t hash = 0;
  {
    nb::gil_scoped_release release;
    std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                   &XXH3_freeState);
    std::vector<unsigned char> block(kBlockBytes);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      err = errno;
      operation = "cannot open it to compute its xxh3-64";
    } else if (state == nullptr || XXH3_64bits_reset(state.get()) != XXH_OK) {
      err = ENOMEM;
      operation = "cannot allocate xxHash's state to compute its xxh3-64";
    } else {
      for (;;) {
        const ssize_t got = ::read(fd, block.data(), block.size());
        if (got < 0) {
          if (errno == EINTR) continue;
          err = errno;
          operation =
              "cannot read it at offset " + std::to_string(size_bytes) + " to compute its xxh3-64";
          break;
        }
        if (got == 0) break;
        XXH3_64bits_update(state.get(), block.data(), static_cast<std::size_t>(got));
        size_bytes += static_cast<std::uint64_t>(got);
      }
      hash = XXH3_64bits_digest(state.get());
    }
    if (fd >= 0) ::close(fd);
  }
  if (err != 0) {
    // OSError(errno, text, filename) is the subclass errno names (FileNotFoundError for ENOENT).
    const std::string text = std::string(std::strerror(err)) + ": " + operation;
    nb::object error = nb::handle(PyExc_OSError)(err, text, path);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    throw nb::python_error();
  }
  return {size_bytes, hash};
}

}  // namespace

NB_MODULE(_zinf, m) {
  m.doc() = "zinf's C++ engine (include/zinf/engine.hpp); see zinf.torch for the torch front end";
  nb::exception<ZinfError>(m, "Error", PyExc_RuntimeError);
  // Parameters' tensors own a reference to their Engine (the DLPack owner), and torch may keep
  // such tensors until interpreter shutdown, after nanobind's leak check.
  nb::set_leak_warnings(false);
  m.attr("__version__") = std::string(zinf::version());

  m.def(
      "strip_config_comments",
      [](const std::string& text) { return zinf::strip_config_comments(text); }, nb::arg("text"),
      "The JSON of a config file written with comments and trailing commas, as DeepSpeed's "
      "reader (hjson) takes them.");
  m.def(
      "normalize_config",
      [](const std::string& json) { return zinf::config_to_json(take(zinf::parse_config(json))); },
      nb::arg("json"),
      "Parses a DeepSpeed-style JSON config and returns it with every default written out.");

  m.def(
      "xxh3_64",
      [](nb::bytes data) {
        const char* bytes = data.c_str();
        const std::size_t size_bytes = data.size();
        nb::gil_scoped_release release;
        return static_cast<std::uint64_t>(XXH3_64bits(bytes, size_bytes));
      },
      nb::arg("data"),
      "XXH3-64 (seed 0) of `data`, libxxhash's XXH3_64bits: the checksum a checkpoint's manifest "
      "records.");
  m.def("xxh3_64_file", &xxh3_64_file, nb::arg("path"),
        "(size in bytes, XXH3-64) of the file at `path`, read in blocks with the GIL released: "
        "the size and checksum a checkpoint's manifest records for it. OSError naming the file "
        "where it cannot be opened or read.");

  m.def(
      "export_checkpoint",
      [](const std::string& dir, const std::string& tag, const std::string& out,
         const std::string& dtype) {
        if (dtype != "fp32" && dtype != "bf16") {
          throw ZinfError(zinf::Status::invalid_argument("export_checkpoint: dtype '" + dtype +
                                                         "' (fp32 or bf16)"));
        }
        without_gil([&] {
          return zinf::export_checkpoint_safetensors(
              dir, tag, out, dtype == "fp32" ? zinf::DType::kF32 : zinf::DType::kBF16);
        });
      },
      nb::arg("dir"), nb::arg("tag"), nb::arg("out"), nb::arg("dtype"),
      "Writes a checkpoint's full fp32 masters as a safetensors file (zinf ckpt export).");

  nb::class_<PyEngine>(m, "Engine", nb::is_weak_referenceable())
      .def(nb::init<const std::string&, const std::vector<std::string>&, std::uint64_t,
                    const std::string&, nb::object>(),
           nb::arg("config_json"), nb::arg("nvme_paths") = std::vector<std::string>{},
           nb::arg("device_memory_limit_bytes") = 0, nb::arg("comm") = "local",
           nb::arg("transport") = nb::none())
      .def("register_parameter", &PyEngine::register_parameter, nb::arg("name"), nb::arg("module"),
           nb::arg("shape"), nb::arg("dtype"), nb::arg("values").none(),
           nb::arg("initializer") = nb::none(), nb::arg("group") = "", nb::arg("values_hash") = 0,
           nb::arg("trainable") = true)
      .def(
          "add_param_group",
          [](PyEngine& e, const std::string& name, double weight_decay, double lr_scale) {
            check(e.engine().add_param_group(zinf::ParamGroup{name, weight_decay, lr_scale}));
          },
          nb::arg("name"), nb::arg("weight_decay") = -1.0, nb::arg("lr_scale") = 1.0)
      .def("abort", &PyEngine::abort, nb::arg("message"))
      .def("close", &PyEngine::close)
      .def("comm_status", &PyEngine::comm_status)
      .def("finalize",
           [](PyEngine& e) {
             zinf::Engine& core = e.engine();
             without_gil([&] { return core.finalize(); });
           })
      .def_prop_ro("finalized", [](const PyEngine& e) { return e.engine().finalized(); })
      .def("gather",
           [](PyEngine& e, const std::string& module) {
             zinf::Engine& core = e.engine();
             without_gil([&] { return core.gather(module); });
           })
      .def("release",
           [](PyEngine& e, const std::string& module) {
             zinf::Engine& core = e.engine();
             without_gil([&] { return core.release(module); });
           })
      .def("parameter", &PyEngine::parameter, nb::arg("name"))
      .def("reduce_gradients", &PyEngine::reduce_gradients, nb::arg("module"), nb::arg("names"),
           nb::arg("gradients"))
      .def("step", &PyEngine::step, nb::arg("average_over") = 0)
      .def(
          "save_checkpoint",
          [](PyEngine& e, const std::string& dir, const std::string& tag) {
            zinf::Engine& core = e.engine();
            without_gil([&] {
              return tag.empty() ? core.save_checkpoint(dir) : core.save_checkpoint(dir, tag);
            });
          },
          nb::arg("dir"), nb::arg("tag") = "")
      .def(
          "load_checkpoint",
          [](PyEngine& e, const std::string& dir, const std::string& tag) {
            zinf::Engine& core = e.engine();
            without_gil([&] { return core.load_checkpoint(dir, tag); });
          },
          nb::arg("dir"), nb::arg("tag") = "")
      .def("set_client_state",
           [](PyEngine& e, nb::bytes blob) {
             e.engine().set_client_state(std::string_view(blob.c_str(), blob.size()));
           })
      .def("client_state",
           [](const PyEngine& e) {
             const std::string& blob = e.engine().client_state();
             return nb::bytes(blob.data(), blob.size());
           })
      .def("read_parameters", &PyEngine::read_parameters, nb::arg("name"), nb::arg("out"))
      .def("read_optimizer_state", &PyEngine::read_optimizer_state, nb::arg("name"),
           nb::arg("state"), nb::arg("out"))
      .def("write_parameters", &PyEngine::write_parameters, nb::arg("name"),
           nb::arg("values").none(), nb::arg("root") = 0)
      .def("write_parameters_batch", &PyEngine::write_parameters_batch, nb::arg("names"),
           nb::arg("values_fn").none(), nb::arg("root") = 0)
      .def("broadcast_bytes", &PyEngine::broadcast_bytes, nb::arg("buffer"), nb::arg("root"),
           nb::arg("name"))
      .def("all_gather_bytes", &PyEngine::all_gather_bytes, nb::arg("send"), nb::arg("recv"),
           nb::arg("name"))
      .def_prop_ro("loss_scale", [](const PyEngine& e) { return e.engine().loss_scale(); })
      .def("set_learning_rate",
           [](PyEngine& e, double lr) {
             // May wait for the overlapped step's reads to be called off.
             zinf::Engine& core = e.engine();
             without_gil([&] { return core.set_learning_rate(lr); });
           })
      .def_prop_ro("learning_rate", [](const PyEngine& e) { return e.engine().learning_rate(); })
      .def_prop_ro("betas", [](const PyEngine& e) { return e.engine().betas(); })
      .def_prop_ro("rank", [](const PyEngine& e) { return e.engine().rank(); })
      .def_prop_ro("world_size", [](const PyEngine& e) { return e.engine().world_size(); })
      .def("config_json",
           [](const PyEngine& e) { return zinf::config_to_json(e.engine().config()); })
      .def("modules", [](const PyEngine& e) { return e.engine().modules(); })
      .def("recorded_order", [](const PyEngine& e) { return e.engine().recorded_order(); })
      .def("counters", &PyEngine::counters)
      .def("memory", &PyEngine::memory)
      .def("save_activation", &PyEngine::save_activation, nb::arg("key"), nb::arg("data"))
      .def("load_activation", &PyEngine::load_activation, nb::arg("key"), nb::arg("out"))
      .def("flush_activations",
           [](PyEngine& e) {
             zinf::Engine& core = e.engine();
             without_gil([&] { return core.flush_activations(); });
           })
      .def("set_activation_bytes", [](PyEngine& e, std::uint64_t device_bytes) {
        e.engine().set_activation_bytes(device_bytes);
      });
}
