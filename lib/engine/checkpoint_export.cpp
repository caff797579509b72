// A checkpoint outside the engine (checkpoint.hpp): the full fp32 master of every parameter
// gathered from the rank files by parameter name (whatever world size saved them), written as a
// safetensors file, and a checkpoint directory's description for `zinf ckpt inspect`.
//
// safetensors (https://github.com/huggingface/safetensors, "Format"): an unsigned 64-bit
// little-endian N, then N bytes of a UTF-8 JSON object mapping each tensor's name to {"dtype",
// "shape", "data_offsets": [begin, end]} (byte offsets into the data that follows, relative to
// its start) and an optional "__metadata__" object of strings, then the data: the tensors
// back to back, row-major, little-endian, with no gap and nothing after the last. We pad the
// header with spaces to a multiple of 8 bytes so the data starts 8-byte aligned, and lay the
// tensors out in name order (the header's keys are sorted too).
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "engine/checkpoint.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

struct OpenTag {
  std::string dir;  // <dir>/<tag>, or <dir>/.<tag>.old where a save replacing it was cut short
  CheckpointManifest manifest;
  std::optional<RankFileReaders> ranks;
};

// The manifest and every rank file of <dir>/<tag>, each file's size and checksum verified. As a
// load does, a tag a replacing save moved aside and did not rename back (moved_aside_tag_dir) is
// read where it is.
Status open_tag(IoEngine& io, const std::string& dir, std::string tag, OpenTag* out) {
  if (tag.empty()) {
    ZINF_ASSIGN_OR_RETURN(tag, read_latest_tag(io, dir));
  }
  ZINF_RETURN_IF_ERROR(check_checkpoint_tag(tag));
  out->dir = fmt::format("{}/{}", dir, tag);
  if (std::string aside = moved_aside_tag_dir(io, dir, tag); !aside.empty()) {
    out->dir = std::move(aside);
  }
  const std::string path = fmt::format("{}/{}", out->dir, kCheckpointManifest);
  ZINF_ASSIGN_OR_RETURN(std::string text, read_text_file(io, path));
  ZINF_ASSIGN_OR_RETURN(out->manifest, parse_checkpoint_manifest(text, path));
  out->ranks.emplace(io, out->dir, out->manifest);
  // One file at a time: the readers keep a bounded number of them open.
  for (std::size_t r = 0; r < out->manifest.ranks.size(); ++r) {
    const ManifestFile& f = out->manifest.ranks[r];
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                          open_rank_reader(io, out->dir, f, /*direct=*/false));
    ZINF_ASSIGN_OR_RETURN(std::uint64_t sum, reader->checksum());
    ZINF_RETURN_IF_ERROR(check_rank_digest(f, *reader, sum));
    out->ranks->verified(static_cast<int>(r), std::move(reader));
  }
  return Status::ok();
}

// Parameter `p`'s fp32 master from the rank files that hold its slices.
Status read_master(OpenTag& t, const ManifestParam& p, std::vector<float>* out) {
  std::uint64_t elements = 1;
  for (std::int64_t d : p.shape) elements *= static_cast<std::uint64_t>(d);
  out->resize(elements);
  const ManifestGroup& g = t.manifest.groups[p.group];
  std::uint64_t done = 0;
  while (done < elements) {
    const std::uint64_t pos = p.group_offset + done;
    const std::uint64_t rank = pos / g.shard_elements;
    const std::uint64_t within = pos - rank * g.shard_elements;
    const std::uint64_t take = std::min(elements - done, g.shard_elements - within);
    // Piece 0 of a rank file is the fp32 master.
    const std::uint64_t at = kCheckpointHeaderBytes + (g.partition_offset + within) * sizeof(float);
    ZINF_RETURN_IF_ERROR(
        t.ranks->read_at(static_cast<int>(rank), at, take * sizeof(float), out->data() + done));
    done += take;
  }
  return Status::ok();
}

}  // namespace

Status export_checkpoint_safetensors(const std::string& dir, const std::string& tag,
                                     const std::string& out_path, DType dtype) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return Status::invalid_argument(
        fmt::format("export: dtype {} (f32 or bf16)", dtype_name(dtype)));
  }
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> io, open_checkpoint_io(nullptr));
  OpenTag t;
  ZINF_RETURN_IF_ERROR(open_tag(*io, dir, tag, &t));
  std::vector<const ManifestParam*> params;
  for (const ManifestParam& p : t.manifest.params) params.push_back(&p);
  std::sort(params.begin(), params.end(),
            [](const ManifestParam* a, const ManifestParam* b) { return a->name < b->name; });
  const std::size_t element_bytes = dtype == DType::kF32 ? 4 : 2;
  nlohmann::json header = nlohmann::json::object();
  std::uint64_t offset = 0;
  for (const ManifestParam* p : params) {
    std::uint64_t elements = 1;
    for (std::int64_t d : p->shape) elements *= static_cast<std::uint64_t>(d);
    const std::uint64_t bytes = elements * element_bytes;
    header[p->name] = {{"dtype", dtype == DType::kF32 ? "F32" : "BF16"},
                       {"shape", p->shape},
                       {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {{"format", "pt"},
                            {"zinf_tag", t.manifest.tag},
                            {"zinf_step", std::to_string(t.manifest.resume.step)}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::byte length[8];
  for (int i = 0; i < 8; ++i) {
    length[i] = static_cast<std::byte>(static_cast<std::uint64_t>(text.size()) >> (8 * i));
  }
  // Written under a temporary name and renamed: a reader never sees half a file.
  const std::string temp = out_path + ".tmp";
  {
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> w,
                          CheckpointWriter::create(*io, temp, /*direct=*/false));
    ZINF_RETURN_IF_ERROR(w->append(length, sizeof length));
    ZINF_RETURN_IF_ERROR(w->append(text.data(), text.size()));
    std::vector<float> values;
    std::vector<std::uint16_t> half;
    for (const ManifestParam* p : params) {
      ZINF_RETURN_IF_ERROR(read_master(t, *p, &values));
      if (dtype == DType::kF32) {
        ZINF_RETURN_IF_ERROR(w->append(values.data(), values.size() * sizeof(float)));
      } else {
        half.resize(values.size());
        convert_f32_to_bf16(values.data(), half.data(), values.size());
        ZINF_RETURN_IF_ERROR(w->append(half.data(), half.size() * sizeof(std::uint16_t)));
      }
    }
    ZINF_RETURN_IF_ERROR(w->commit());
  }
  if (::rename(temp.c_str(), out_path.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    return status_from_errno(fmt::format("export: rename '{}' to '{}'", temp, out_path), err);
  }
  return Status::ok();
}

Result<nlohmann::json> inspect_checkpoints(const std::string& dir, bool verify) {
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> io, open_checkpoint_io(nullptr));
  nlohmann::json out;
  out["dir"] = dir;
  Result<std::string> latest = read_latest_tag(*io, dir);
  out["latest"] = latest.is_ok() ? nlohmann::json(*latest) : nlohmann::json(nullptr);
  RefusedCheckpointTags refused;
  std::vector<CheckpointManifest> manifests = list_checkpoint_tags(*io, dir, &refused);
  // A tag a replacing save moved to .<tag>.old and did not rename back is the tag a load reads
  // (moved_aside_tag_dir): it is listed, and verified, where it is.
  std::map<std::string, std::string> aside_dirs;  // tag -> its .<tag>.old
  for (const std::string& old : refused.old_dirs) {
    const std::string name = std::filesystem::path(old).filename().string();
    const std::string tag = name.substr(1, name.size() - 5);  // ".<tag>.old"
    if (!check_checkpoint_tag(tag).is_ok() || moved_aside_tag_dir(*io, dir, tag).empty()) continue;
    const std::string path = fmt::format("{}/{}", old, kCheckpointManifest);
    Result<std::string> text = read_text_file(*io, path);
    Result<CheckpointManifest> m = text.is_ok() ? parse_checkpoint_manifest(*text, path)
                                                : Result<CheckpointManifest>(text.status());
    if (!m.is_ok()) continue;  // changed since moved_aside_tag_dir() read it
    aside_dirs[tag] = old;
    manifests.push_back(std::move(*m));
  }
  sort_tags_oldest_first(manifests);
  // What a load would refuse: a `latest` that cannot be read or names no complete tag, tag
  // directories whose manifest does not read, and (below) a tag whose files do not match their
  // checksums (problems); and saves in progress or cut short (notes).
  nlohmann::json problems = nlohmann::json::array();
  std::error_code ec;
  const bool has_latest_file = std::filesystem::exists(fmt::format("{}/latest", dir), ec);
  if (has_latest_file && !latest.is_ok()) {
    problems.push_back(std::string(latest.status().message()));
  } else if (latest.is_ok() &&
             std::none_of(manifests.begin(), manifests.end(),
                          [&](const CheckpointManifest& m) { return m.tag == *latest; }) &&
             moved_aside_tag_dir(*io, dir, *latest).empty()) {
    problems.push_back(fmt::format(
        "'{}/latest' names tag '{}', which is not a complete checkpoint here", dir, *latest));
  }
  for (const RefusedCheckpointTags::Tag& t : refused.tags) {
    problems.push_back(fmt::format("tag '{}' is not a complete checkpoint: {}", t.tag, t.reason));
  }
  // A save in progress, or one cut short (the next save removes it): not a problem of the
  // checkpoints there.
  nlohmann::json notes = nlohmann::json::array();
  for (const std::string& temp : refused.temp_dirs) {
    notes.push_back(fmt::format(
        "'{}': a save in progress or cut short (the next save into this directory removes it)",
        temp));
  }
  for (const std::string& old : refused.old_dirs) {
    const std::string name = std::filesystem::path(old).filename().string();
    const std::string tag = name.substr(1, name.size() - 5);  // ".<tag>.old"
    if (aside_dirs.count(tag) != 0) {
      notes.push_back(fmt::format(
          "'{}': tag '{}', complete, moved aside by a save that was replacing it when it was cut "
          "short (there is no '{}/{}'): a load of tag '{}' reads it there, and the next save into "
          "this directory renames it back",
          old, tag, dir, tag, tag));
      continue;
    }
    notes.push_back(fmt::format(
        "'{}': a tag a save was removing (pruned by keep_last, or a leftover it replaced) when it "
        "was cut short; no load reads it, and the next save into this directory removes it",
        old));
  }
  for (const std::string& pruned : refused.pruned_dirs) {
    notes.push_back(fmt::format(
        "'{}': a tag keep_last was pruning when a save was cut short; no load reads it, and the "
        "next save into this directory removes it",
        pruned));
  }
  const std::string latest_tmp = fmt::format("{}/{}", dir, kCheckpointLatestTemp);
  if (std::filesystem::exists(latest_tmp, ec)) {
    Result<std::string> named = read_text_file(*io, latest_tmp);
    notes.push_back(fmt::format(
        "'{}'{}: left by a save cut short while it replaced 'latest'; a resume reads 'latest', "
        "not it, and the next save overwrites it",
        latest_tmp, named.is_ok() ? fmt::format(" (naming '{}')", *named) : std::string()));
  }
  // Complete tags no resume reads by default, left by a save cut short between its tag's rename
  // and `latest`'s (is_leftover_tag(); the next save of such a tag replaces it as any other).
  for (const CheckpointManifest& m : manifests) {
    if (!is_leftover_tag(manifests, has_latest_file, latest, m)) continue;
    if (!has_latest_file) {
      notes.push_back(fmt::format(
          "tag '{}' is complete, but there is no '{}/latest' (a save cut short before it wrote "
          "'latest'): a resume from the directory finds no checkpoint (load the tag by name), and "
          "the next save of tag '{}' replaces it",
          m.tag, dir, m.tag));
    } else {
      notes.push_back(fmt::format(
          "tag '{}' is complete and of a later step than '{}', the tag 'latest' names (a save cut "
          "short "
          "before it moved 'latest'): a resume from the directory loads '{}' (load '{}' by name "
          "to resume from it), and the next save of tag '{}' replaces it",
          m.tag, *latest, *latest, m.tag, m.tag));
    }
  }
  out["notes"] = notes;
  if (manifests.empty() && !latest.is_ok() && problems.empty()) {
    // Nothing to list: a mistyped path, or a save that never finished.
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec)) {
      return Status::not_found(fmt::format("'{}': no such checkpoint directory", dir));
    }
    return Status::not_found(fmt::format(
        "'{}' holds no checkpoint: no 'latest' file and no tag directory with a manifest", dir));
  }
  nlohmann::json tags = nlohmann::json::array();
  for (const CheckpointManifest& m : manifests) {
    std::uint64_t elements = 0, bytes = 0;
    for (const ManifestParam& p : m.params) {
      std::uint64_t n = 1;
      for (std::int64_t d : p.shape) n *= static_cast<std::uint64_t>(d);
      elements += n;
    }
    for (const ManifestFile& f : m.ranks) bytes += f.bytes;
    for (const ManifestFile& f : m.client_state) bytes += f.bytes;
    // What the tag's files take on the disk: a rank file saved by link is the whole swap file
    // it froze, the state the manifest counts and whatever else the swap held.
    const auto aside = aside_dirs.find(m.tag);
    const std::string tag_dir =
        aside != aside_dirs.end() ? aside->second : fmt::format("{}/{}", dir, m.tag);
    std::uint64_t disk_bytes = 0;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(tag_dir, ec)) {
      struct stat st {};
      if (::lstat(entry.path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
        disk_bytes += static_cast<std::uint64_t>(st.st_blocks) * 512;
      }
    }
    std::string checksums = "not verified";
    if (verify) {
      OpenTag t;
      Status st = open_tag(*io, dir, m.tag, &t);
      // The client state too, as a load checks it.
      for (const ManifestFile& f : m.client_state) {
        if (!st.is_ok()) break;
        st = read_checked_file(*io, fmt::format("{}/{}", t.dir, f.file), f.bytes, f.xxh3).status();
      }
      checksums = st.is_ok() ? "ok" : std::string(st.message());
      if (!st.is_ok()) problems.push_back(fmt::format("tag {}: {}", m.tag, checksums));
    }
    tags.push_back({{"tag", m.tag},
                    {"step", m.resume.step},
                    {"world_size", m.world_size},
                    {"stage", m.stage},
                    {"optimizer", m.optimizer},
                    {"parameters", m.params.size()},
                    {"parameter_elements", elements},
                    {"bytes", bytes},
                    {"disk_bytes", disk_bytes},
                    {"dir", tag_dir},
                    {"checksums", checksums}});
  }
  out["tags"] = tags;
  out["problems"] = problems;
  return out;
}

}  // namespace zinf
