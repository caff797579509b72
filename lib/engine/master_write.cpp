// read_master_values and write_master_values (master_write.hpp).
#include "engine/master_write.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "base/hash.hpp"
#include "zinf/device.hpp"

namespace zinf {

namespace {

// One parameter of a batch: where its piece lies in this rank's partition, if it has one.
struct BatchEntry {
  std::string_view name;
  std::size_t element_count = 0;
  bool owned = false;            // this rank holds a piece of it
  std::size_t lo = 0, hi = 0;    // the piece: partition elements [lo, hi)
  std::size_t param_offset = 0;  // the piece's first element within the parameter
};

// The batch's broadcasts from the root, one parameter's values at a time, in the entries' order
// (layout order), the same on every rank. Before each broadcast the ranks agree that each is
// still in the pass: a rank whose pass failed says so at the next agreement, and every rank
// stops there instead of waiting in a broadcast the failed rank will not make.
class BatchSource {
 public:
  BatchSource(const MasterAccess& w, std::span<const BatchEntry> entries,
              const ParameterValues& values, int root, std::vector<float>& host,
              DeviceBuffer& buffer)
      : w_(w), entries_(entries), values_(values), root_(root), host_(host), buffer_(buffer) {}

  // Makes entry i's values the current ones (values()), broadcasting every entry up to i not
  // broadcast yet; a rank discards those it owns no piece of. REQUIRES: no later entry was
  // broadcast.
  Status bring(std::size_t i) {
    ZINF_ASSERT(i < entries_.size() && next_ <= i + 1);
    while (next_ <= i) ZINF_RETURN_IF_ERROR(broadcast_next(Status::ok()));
    return Status::ok();
  }
  // Entry i's values, once bring(i) was the last to broadcast.
  const float* values(std::size_t i) const {
    ZINF_ASSERT(next_ == i + 1 && entries_[i].owned);
    return host_.data();
  }
  // After the pass, whose outcome is `pass`: the broadcasts it did not need and one last
  // agreement, so that a rank whose pass failed after the last broadcast fails every rank there
  // too; or, after it failed here while the others may still wait for a broadcast, one agreement
  // carrying the failure so that they stop at it.
  Status finish(Status pass, std::string_view call) {
    if (pass.is_ok()) {
      while (next_ < entries_.size()) ZINF_RETURN_IF_ERROR(broadcast_next(Status::ok()));
      return w_.exchange->agree(call, Status::ok());
    }
    if (stopped_) return pass;
    if (next_ < entries_.size()) {
      (void)broadcast_next(pass);
    } else {
      (void)w_.exchange->agree(call, pass);
    }
    return pass;
  }

 private:
  // Agrees with every rank on `local` (this rank's outcome so far) and the root's values of the
  // next entry, then broadcasts them. Any failure ends the broadcasts on this rank.
  Status broadcast_next(Status local) {
    const BatchEntry& e = entries_[next_];
    const std::string call = fmt::format("write_parameters('{}')", e.name);
    const bool root = w_.rank == root_;
    const std::span<float> out(host_.data(), e.element_count);
    if (root && local.is_ok()) {
      local = values_(e.name, out);
      if (!local.is_ok()) local = local.with_context(fmt::format("{}: values", call));
    }
    stopped_ = true;  // until the broadcast is over
    ZINF_RETURN_IF_ERROR(w_.exchange->agree(call, std::move(local)));
    const std::size_t bytes = out.size_bytes();
    if (root) {
      ZINF_RETURN_IF_ERROR(w_.device->copy_h2d(buffer_.data(), out.data(), bytes, *w_.stream));
    }
    ZINF_RETURN_IF_ERROR(w_.comm->broadcast(buffer_.data(), buffer_.data(), e.element_count,
                                            DType::kF32, root_, *w_.stream, call));
    if (!root && e.owned) {
      ZINF_RETURN_IF_ERROR(w_.device->copy_d2h(out.data(), buffer_.data(), bytes, *w_.stream));
    }
    // Waited for every time: the root's next values go into the same host buffer.
    ZINF_RETURN_IF_ERROR(w_.device->record(*w_.event, *w_.stream));
    ZINF_RETURN_IF_ERROR(w_.comm->wait(*w_.event, w_.timeout));
    stopped_ = false;
    ++next_;
    return Status::ok();
  }

  const MasterAccess& w_;
  std::span<const BatchEntry> entries_;
  const ParameterValues& values_;
  int root_;
  std::vector<float>& host_;
  DeviceBuffer& buffer_;
  std::size_t next_ = 0;  // the entries broadcast so far
  bool stopped_ = false;  // an agreement or a broadcast failed: no more collectives
};

// Each rank's outcome of the preparation and its fingerprint of (names, root), exchanged: this
// rank's error, kAborted naming the first rank that failed, kInvalidArgument when a rank's
// fingerprint differs from rank 0's.
Status agree_batch(const MasterAccess& w, std::string_view call, Status local,
                   std::uint64_t fingerprint) {
  const std::uint64_t words[2] = {static_cast<std::uint64_t>(local.code()), fingerprint};
  Result<std::vector<std::uint64_t>> all = w.exchange->exchange(words, 2);
  if (!all.is_ok()) return w.sticky->fail(all.status());
  if (!local.is_ok()) return local;
  const std::vector<std::uint64_t>& v = *all;
  for (std::size_t r = 0; r < v.size() / 2; ++r) {
    if (v[2 * r] != 0) {
      return Status::aborted(fmt::format("{}: rank {} failed ({}); see its error", call, r,
                                         code_name(static_cast<Code>(v[2 * r]))));
    }
  }
  for (std::size_t r = 1; r < v.size() / 2; ++r) {
    if (v[2 * r + 1] != v[1]) {
      return Status::invalid_argument(fmt::format(
          "{}: rank {} passed other names or another root than rank 0 (every rank passes the "
          "same names in the same order, and the same root)",
          call, r));
    }
  }
  return Status::ok();
}

}  // namespace

std::string write_parameters_call(std::span<const std::string_view> names) {
  if (names.empty()) return "write_parameters()";
  if (names.size() == 1) return fmt::format("write_parameters('{}')", names[0]);
  return fmt::format("write_parameters('{}' and {} more)", names[0], names.size() - 1);
}

Status write_master_values(const MasterAccess& w, std::span<const std::string_view> names,
                           const ParameterValues& values, int root, Status precondition) {
  const std::string call = write_parameters_call(names);
  const Partitioner& part = w.layout->partitioner();
  // The names' parameters, each once. Every check's outcome is agreed with the other ranks
  // (agree_batch() below) before anything else, so a rank whose call is refused fails the others
  // at once rather than leaving them waiting in the first broadcast.
  //
  // The names' checks cost the names, not the model: each name is looked up (a map), and a name
  // given twice is found by sorting (parameter, position) pairs, the first error in `names`
  // order reported as a check name by name would (an unknown name, or the second mention of a
  // parameter, whichever comes first).
  Status local = Status::ok();
  struct Given {
    ParamId id;
    std::size_t position;  // in `names`
  };
  std::vector<Given> given;
  given.reserve(names.size());
  std::size_t unknown = names.size();  // the first unknown name's position
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::optional<std::size_t> found = w.layout->find_param(names[i]);
    if (!found.has_value()) {
      unknown = i;
      break;
    }
    given.push_back({static_cast<ParamId>(*found), i});
  }
  std::sort(given.begin(), given.end(), [](const Given& a, const Given& b) {
    return a.id != b.id ? a.id < b.id : a.position < b.position;
  });
  std::size_t twice = SIZE_MAX, first_mention = 0;  // the earliest second mention, and the first
  for (std::size_t k = 1; k < given.size(); ++k) {
    if (given[k].id == given[k - 1].id && given[k].position < twice) {
      twice = given[k].position;
      first_mention = given[k - 1].position;
    }
  }
  if (twice < unknown) {
    local = Status::invalid_argument(
        fmt::format("write_parameters('{}'): the parameter is named twice (at {} and {})",
                    names[twice], first_mention, twice));
  } else if (unknown < names.size()) {
    local =
        Status::not_found(fmt::format("write_parameters('{}'): unknown parameter", names[unknown]));
  }
  if (local.is_ok()) local = precondition;
  if (local.is_ok() && (root < 0 || root >= w.comm->world_size())) {
    local = Status::invalid_argument(
        fmt::format("{}: root {} is not a rank of {}", call, root, w.comm->world_size()));
  }
  // What every rank must agree on: the names in their order, and the root.
  std::string words;
  for (std::string_view name : names) {
    words.append(name);
    words.push_back('\0');
  }
  words.append(std::to_string(root));
  const std::uint64_t fingerprint = xxh3_64(words.data(), words.size());
  if (!local.is_ok() || names.empty()) return agree_batch(w, call, std::move(local), fingerprint);

  // Layout order: group by group, and within a group by offset, which is the order the pass
  // over this rank's partition reaches the pieces in (the partition lies in group order, each
  // group's slice a contiguous run of the group).
  std::sort(given.begin(), given.end(), [&](const Given& a, const Given& b) {
    const ParamLocation& la = part.location(a.id);
    const ParamLocation& lb = part.location(b.id);
    return la.group != lb.group ? la.group < lb.group : la.group_offset < lb.group_offset;
  });
  std::vector<BatchEntry> entries(given.size());
  std::size_t largest = 0;
  std::size_t previous_hi = 0;
  for (std::size_t i = 0; i < given.size(); ++i) {
    const ParamLocation& loc = part.location(given[i].id);
    BatchEntry& e = entries[i];
    e.name = names[given[i].position];
    e.element_count = loc.element_count;
    largest = std::max(largest, loc.element_count);
    const std::optional<ParamPiece> piece = part.param_piece(given[i].id, w.rank);
    if (piece.has_value() && piece->element_count > 0) {
      e.owned = true;
      e.lo = w.layout->offset(loc.group) + piece->shard_offset;
      e.hi = e.lo + piece->element_count;
      e.param_offset = piece->param_offset;
      ZINF_ASSERT(e.lo >= previous_hi);  // the pieces lie in the entries' order
      previous_hi = e.hi;
    }
  }

  // One parameter's values at a time: in host memory (the root's from `values`, the others'
  // copied back from the broadcast) and in device memory for the communicator.
  std::vector<float> host;
  Result<DeviceBuffer> buffer = DeviceBuffer::allocate(*w.device, largest * sizeof(float));
  local = buffer.status();
  if (local.is_ok() && w.rank == root && !values) {
    local = Status::invalid_argument(fmt::format("{}: values is null on the root", call));
  }
  if (local.is_ok()) host.resize(largest);
  // The prefetched modules go before the pass, which may write the shards as it goes (a state
  // that streams them, master_loaded()); an error of the prefetch is sticky.
  if (local.is_ok()) local = w.sticky->fail(w.coord->drop_prefetched());
  ZINF_RETURN_IF_ERROR(agree_batch(w, call, std::move(local), fingerprint));

  // The groups the names lie in, the same on every rank, and this rank's slices of them: only
  // those slices of the master are updated, only those groups' shards written and, where they
  // stay gathered, all-gathered again. The rest of the partition holds what it held, so a write
  // of one parameter costs its groups, not the rank's whole partition, and a batch of parameters
  // far apart (the embedding and the head) costs their groups, not every group between them.
  //
  // The groups go to the state in runs: a run of neighbouring named groups is one ranged update
  // (update_master_range, then write_loaded), and two runs are one across the groups between
  // them where the state would read and rewrite one block of the master for both
  // (shares_rewrite: an NVMe sub-group that holds the end of one and the start of the next).
  // Such a run reads and rewrites every sub-group that holds it, the gap's too (as it would the
  // one block the two runs share): on NVMe the master is written in whole sub-groups, so with
  // the default sub_group_size, where a rank's partition is often one sub-group, a batch reads
  // and rewrites it whole. Only the named groups are changed, rounded and have their shards
  // written (the run's part of `named` goes with it as update_master_range's `changed`): the
  // groups between them keep their master, their shards and their gathered copies as they are.
  // Runs cost no collective: the broadcasts are one per parameter whatever the runs, and the
  // all-gathers one per named group that stays gathered, made once after the last run. A rank's
  // runs may thus differ from another's (its sub-groups are cut at its frozen pieces); the groups
  // written and all-gathered do not, being the named ones.
  //
  // `named` lists the groups in increasing order (the entries are in layout order), so the runs,
  // the states' choice of shards to write and the all-gather go over the call's own groups, not
  // over every group of the model. The settle() before it walks the groups only when a step left
  // some to all-gather (OverlappedStep::publish_pending keeps their count), and the precondition
  // finds none in use from a count (ParamCoordinator::first_in_use). With the state in a
  // StateStore each run still walks every sub-group (StoreState::settled_frozen()).
  std::vector<std::uint32_t> named;
  named.reserve(entries.size());
  for (const Given& g : given) {
    const std::uint32_t group = part.location(g.id).group;
    if (named.empty() || named.back() != group) named.push_back(group);
  }
  struct Run {
    GroupSpan span;
    std::size_t first_named = 0, end_named = 0;  // its groups in `named`
  };
  std::vector<Run> runs;
  for (std::size_t i = 0; i < named.size(); ++i) {
    const std::uint32_t g = named[i];
    ZINF_ASSERT(i == 0 || named[i - 1] < g);
    const GroupSpan one = group_run(*w.layout, g, g + 1);
    if (!runs.empty() && (runs.back().span.end_group == g ||
                          w.state->shares_rewrite(runs.back().span.end, one.begin))) {
      runs.back().span = group_run(*w.layout, runs.back().span.first_group, g + 1);
      runs.back().end_named = i + 1;
    } else {
      runs.push_back({one, i, i + 1});
    }
  }

  BatchSource source(w, entries, values, root, host, *buffer);
  std::size_t cursor = 0;  // the first entry whose piece the pass has not finished
  OptimizerState& state = *w.state;
  // Every element of a run is written: update_master_range() hands each piece over as it is,
  // and the batch's elements in it are patched in (those of the groups between named ones are
  // left as they are). Each piece is then rounded into what the shards are published from while
  // it is in cache (master_loaded(), as a checkpoint load does; a state that streams the shards
  // writes them as their groups complete), so the master is not read back to publish it. The
  // shards of a run are written (write_loaded) and waited for before the next run, as part of
  // the pass, so that the last agreement tells every rank whether every rank's shards are
  // written; only then are the persistent groups all-gathered. A rank whose shard write failed
  // thus fails every rank in this call (the ranks' shards now disagree: the error is sticky
  // everywhere) instead of leaving them in the all-gather, or returning OK where no all-gather
  // follows.
  auto fill = [&](std::size_t first, std::size_t count, float* out) -> Status {
    const std::size_t end = first + count;
    while (cursor < entries.size()) {
      const BatchEntry& e = entries[cursor];
      if (!e.owned) {
        ++cursor;  // broadcast on the way to the next one this rank needs
        continue;
      }
      if (e.lo >= end) break;
      ZINF_ASSERT(e.hi > first);
      ZINF_RETURN_IF_ERROR(source.bring(cursor));
      const std::size_t a = std::max(e.lo, first);
      const std::size_t b = std::min(e.hi, end);
      std::memcpy(out + (a - first), source.values(cursor) + e.param_offset + (a - e.lo),
                  (b - a) * sizeof(float));
      if (e.hi > end) break;  // it goes on in the next piece
      ++cursor;
    }
    return state.master_loaded(first, count, out);
  };
  Status st;
  for (const Run& run : runs) {
    const std::span<const std::uint32_t> changed = std::span<const std::uint32_t>(named).subspan(
        run.first_named, run.end_named - run.first_named);
    st = state.update_master_range(run.span.begin, run.span.end, changed, fill);
    if (st.is_ok()) {
      st = state.write_loaded();
      if (!st.is_ok()) st = st.with_context(fmt::format("{}: writing the new shards", call));
    }
    if (!st.is_ok()) break;
  }
  st = source.finish(std::move(st), call);
  if (st.is_ok()) st = w.publisher->publish_groups(named);
  return w.sticky->fail(std::move(st));
}

Status write_master_values(const MasterAccess& w, std::string_view name, const float* values,
                           int root, Status precondition) {
  ParameterValues copy;
  if (values != nullptr) {
    copy = [values](std::string_view, std::span<float> out) {
      std::memcpy(out.data(), values, out.size_bytes());
      return Status::ok();
    };
  }
  return write_master_values(w, std::span<const std::string_view>(&name, 1), copy, root,
                             std::move(precondition));
}

namespace {

// read_master_values() and read_moment_values(): `call` names the call in errors; `piece` is the
// master or a moment the state has.
Status read_values(const MasterAccess& w, const std::string& call, Piece piece,
                   std::string_view name, float* out) {
  const std::optional<std::size_t> id = w.layout->find_param(name);
  if (!id.has_value()) return Status::not_found(fmt::format("{}: unknown parameter", call));
  const Partitioner& part = w.layout->partitioner();
  const ParamLocation& loc = part.location(static_cast<ParamId>(*id));
  const GroupInfo& info = part.group(loc.group);
  const std::size_t shard = info.shard_element_count;
  // This rank's slice of the group, copied into the buffer, then an all-gather of the whole group
  // in f32. Everything a rank can fail at alone comes first (a null `out`, the buffer, reading
  // the slice, queueing its copy), and every rank learns whether every rank got there, so a rank
  // that failed fails every rank at once instead of leaving them waiting in the all-gather until
  // the collective timeout. Those errors are not sticky: nothing changed (a read error of the
  // state stays where it is, and the step that reads it fails in turn).
  Result<DeviceBuffer> full =
      out == nullptr
          ? Result<DeviceBuffer>(Status::invalid_argument(fmt::format("{}: out is null", call)))
          : DeviceBuffer::allocate(*w.device, info.padded_element_count * 4);
  Status local = full.status();
  std::vector<float> slice;
  const std::size_t first = w.layout->offset(loc.group);
  // Copies the part of [f, f + count) that lies in this rank's slice.
  auto take = [&](std::size_t f, std::size_t count, const float* src) {
    const std::size_t lo = std::max(f, first);
    const std::size_t hi = std::min(f + count, first + shard);
    if (lo < hi) std::memcpy(slice.data() + (lo - first), src + (lo - f), (hi - lo) * 4);
  };
  if (local.is_ok()) {
    slice.resize(shard);
    // Only the parameter's part of the slice is read (where the state is on NVMe, only the swap
    // blocks that hold it); the rest of the slice stays zero, which the all-gather carries
    // and nobody copies out. A rank that owns none of the parameter reads nothing.
    const std::optional<ParamPiece> own_part = part.param_piece(static_cast<ParamId>(*id), w.rank);
    if (own_part.has_value()) {
      const std::size_t begin = first + own_part->shard_offset;
      const std::size_t end = begin + own_part->element_count;
      if (piece == Piece::kParams) {
        local = w.state->read_master(begin, end, take);
      } else {
        local = w.state->read_state_range(piece, begin, end,
                                          [&](std::size_t f, std::size_t count, const float* src) {
                                            take(f, count, src);
                                            return Status::ok();
                                          });
      }
    }
  }
  float* own = local.is_ok() ? full->as<float>() + part.shard_offset(loc.group, w.rank) : nullptr;
  bool queued = false;
  if (local.is_ok()) {
    local = w.device->copy_h2d(own, slice.data(), shard * 4, *w.stream);
    queued = true;
  }
  if (Status agreed = w.exchange->agree(call, std::move(local)); !agreed.is_ok()) {
    // The queued copy reads `slice`, which is freed on return.
    if (queued) (void)w.device->synchronize(*w.stream, w.timeout);
    return agreed;
  }
  Status st = w.comm->all_gather(own, full->data(), shard, DType::kF32, *w.stream, call);
  if (st.is_ok()) {
    st = w.device->copy_d2h(out, full->as<float>() + loc.group_offset, loc.element_count * 4,
                            *w.stream);
  }
  if (st.is_ok()) st = w.device->record(*w.event, *w.stream);
  if (st.is_ok()) st = w.comm->wait(*w.event, w.timeout);
  return w.sticky->fail(st);
}

}  // namespace

Status read_master_values(const MasterAccess& w, std::string_view name, float* out) {
  return read_values(w, fmt::format("read_parameters('{}')", name), Piece::kParams, name, out);
}

Status read_moment_values(const MasterAccess& w, OptimizerKind kind, std::string_view name,
                          std::string_view state, float* out) {
  const std::string call = fmt::format("read_optimizer_state('{}', '{}')", name, state);
  std::string kept;
  for (Piece piece : state_pieces(kind)) {
    if (piece == Piece::kParams) continue;
    if (piece_name(piece) == state) return read_values(w, call, piece, name, out);
    kept += fmt::format("{}\"{}\"", kept.empty() ? "" : ", ", piece_name(piece));
  }
  return Status::invalid_argument(fmt::format("{}: {} keeps no \"{}\" (it keeps {})", call,
                                              optimizer_name(kind), state,
                                              kept.empty() ? "none" : kept));
}

}  // namespace zinf
