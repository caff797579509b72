// read_master_values and write_master_values (master_write.hpp).
#include "engine/master_write.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "zinf/device.hpp"

namespace zinf {

namespace {

Status write_slice(const MasterAccess& w, ParamId id, const float* values, int root,
                   std::string_view call) {
  const Partitioner& part = w.layout->partitioner();
  const ParamLocation& loc = part.location(id);
  // The root's values to every rank, through device memory (the communicator's buffers).
  const std::size_t bytes = loc.element_count * sizeof(float);
  ZINF_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::allocate(*w.device, bytes));
  if (w.rank == root) {
    ZINF_RETURN_IF_ERROR(w.device->copy_h2d(buffer.data(), values, bytes, *w.stream));
  }
  ZINF_RETURN_IF_ERROR(w.comm->broadcast(buffer.data(), buffer.data(), loc.element_count,
                                         DType::kF32, root, *w.stream, call));
  std::vector<float> full(loc.element_count);
  ZINF_RETURN_IF_ERROR(w.device->copy_d2h(full.data(), buffer.data(), bytes, *w.stream));
  ZINF_RETURN_IF_ERROR(w.device->record(*w.event, *w.stream));
  ZINF_RETURN_IF_ERROR(w.comm->wait(*w.event, w.timeout));

  const std::optional<ParamPiece> piece = part.param_piece(id, w.rank);
  if (!piece.has_value()) return Status::ok();  // this rank owns none of it
  // [lo, hi) of this rank's partition holds the parameter's elements from piece->param_offset.
  const std::size_t lo = w.layout->offset(loc.group) + piece->shard_offset;
  const std::size_t hi = lo + piece->element_count;
  const float* src = full.data() + piece->param_offset;
  // The write replaces every element of the master, so each piece is first read back as it is
  // (read_master covers at least the piece), then the parameter's elements are patched in.
  OptimizerState& state = *w.state;
  return state.write_state(
      Piece::kParams, [&](std::size_t first, std::size_t count, float* out) -> Status {
        ZINF_RETURN_IF_ERROR(state.read_master(
            first, first + count, [&](std::size_t f, std::size_t n, const float* in) {
              const std::size_t a = std::max(f, first);
              const std::size_t b = std::min(f + n, first + count);
              if (a < b && out + (a - first) != in + (a - f)) {
                std::memmove(out + (a - first), in + (a - f), (b - a) * sizeof(float));
              }
            }));
        const std::size_t a = std::max(lo, first);
        const std::size_t b = std::min(hi, first + count);
        if (a < b) std::memcpy(out + (a - first), src + (a - lo), (b - a) * sizeof(float));
        return Status::ok();
      });
}

}  // namespace

Status write_master_values(const MasterAccess& w, std::string_view name, const float* values,
                           int root, Status precondition) {
  const std::string call = fmt::format("write_parameters('{}')", name);
  const std::optional<std::size_t> found = w.layout->find_param(name);
  if (!found.has_value()) return Status::not_found(fmt::format("{}: unknown parameter", call));
  ZINF_RETURN_IF_ERROR(precondition);
  if (root < 0 || root >= w.comm->world_size()) {
    return Status::invalid_argument(
        fmt::format("{}: root {} is not a rank of {}", call, root, w.comm->world_size()));
  }
  if (w.rank == root && values == nullptr) {
    return Status::invalid_argument(fmt::format("{}: values is null on the root", call));
  }
  Status st = write_slice(w, static_cast<ParamId>(*found), values, root, call);
  if (st.is_ok()) st = w.coord->drop_prefetched();
  if (st.is_ok()) st = w.state->publish_master();
  return w.sticky->fail(std::move(st));
}

Status read_master_values(const MasterAccess& w, std::string_view name, float* out) {
  const std::optional<std::size_t> id = w.layout->find_param(name);
  if (!id.has_value()) {
    return Status::not_found(fmt::format("read_parameters('{}'): unknown parameter", name));
  }
  if (out == nullptr) {
    return Status::invalid_argument(fmt::format("read_parameters('{}'): out is null", name));
  }
  const Partitioner& part = w.layout->partitioner();
  const ParamLocation& loc = part.location(static_cast<ParamId>(*id));
  const GroupInfo& info = part.group(loc.group);
  const std::size_t shard = info.shard_element_count;
  // This rank's master slice of the group, then an all-gather of the whole group in f32. The
  // buffer and the slice come first and every rank learns whether every rank has them, so a
  // rank that cannot allocate fails every rank at once instead of leaving them waiting in the
  // all-gather until the collective timeout.
  Result<DeviceBuffer> full = DeviceBuffer::allocate(*w.device, info.padded_element_count * 4);
  Status local = full.status();
  std::vector<float> slice;
  const std::size_t first = w.layout->offset(loc.group);
  if (local.is_ok()) {
    slice.resize(shard);
    local = w.sticky->fail(w.state->read_master(
        first, first + shard, [&](std::size_t f, std::size_t count, const float* src) {
          const std::size_t lo = std::max(f, first);
          const std::size_t hi = std::min(f + count, first + shard);
          if (lo < hi) std::memcpy(slice.data() + (lo - first), src + (lo - f), (hi - lo) * 4);
        }));
  }
  ZINF_RETURN_IF_ERROR(
      w.exchange->agree(fmt::format("read_parameters('{}')", name), std::move(local)));
  float* own = full->as<float>() + part.shard_offset(loc.group, w.rank);
  Status st = w.device->copy_h2d(own, slice.data(), shard * 4, *w.stream);
  if (st.is_ok()) {
    st = w.comm->all_gather(own, full->data(), shard, DType::kF32, *w.stream, "read_parameters");
  }
  if (st.is_ok()) {
    st = w.device->copy_d2h(out, full->as<float>() + loc.group_offset, loc.element_count * 4,
                            *w.stream);
  }
  if (st.is_ok()) st = w.device->record(*w.event, *w.stream);
  if (st.is_ok()) st = w.comm->wait(*w.event, w.timeout);
  return w.sticky->fail(st);
}

}  // namespace zinf
