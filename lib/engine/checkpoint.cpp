// The engine's checkpoint save and load (checkpoint.hpp): the tag directory's life (written
// under a temporary name, renamed once complete, named by `latest`, pruned to keep_last), the
// checks a load makes before it touches the state, and resharding: a checkpoint saved with
// another world size, stage or layout is read by parameter name.
//
// Why a crash never costs the previous checkpoint: nothing of a save is written under a name a
// load reads until it is complete and durable. Every rank file and the manifest are written into
// <dir>/.<tag>.tmp and fsynced; the directory is fsynced and renamed to <dir>/<tag> (atomic), and
// <dir> fsynced; only then is <dir>/latest replaced (write a temporary, fsync, rename, fsync
// <dir>). A load reads the tag `latest` names. So at any instant `latest` names either the
// previous tag, untouched, or the new one, complete. Older tags (keep_last) are deleted only
// after that; the version of the same tag a save replaces, once the new one has its name (below).
// A kill between the two renames leaves a complete tag newer than the one `latest` names; the
// run restarted from `latest` saves that tag again, and the save replaces it as any existing tag.
//
// A tag that exists already is replaced, as DeepSpeed's save writes over it ("last", "best", or
// a job run again into its output directory). The new tag is written to .<tag>.tmp as any other;
// once it is complete, renameat2(RENAME_EXCHANGE) swaps the two directories in one step, so
// <dir>/<tag> names the old tag, complete, until it names the new one, complete; the old one,
// now under .<tag>.tmp, is then removed. Where the filesystem has no exchange, the old tag is
// renamed to .<tag>.old and the new one to <tag>: a crash between the two leaves no <tag> but a
// complete .<tag>.old, which a load reads in its place and the next save renames back before
// anything else (restore_replaced_tags); where that rename fails, the save leaves it in place.
// A removal unlinks a directory's manifest first, so an .<tag>.old that holds one is complete.
// keep_last renames a tag it prunes to .<tag>.pruned, never .<tag>.old, so a crash while it
// removes one leaves nothing a load reads or a save restores.
// One save at a time changes the directory: rank 0 holds a lock on it for the whole save
// (SaveLock), so two jobs given one directory are refused rather than removing each other's
// temporary directories.
#include "engine/checkpoint.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <stdio.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "base/assert.hpp"
#include "engine/layout.hpp"
#include "zinf/log.hpp"
#include "zinf/schedule.hpp"

namespace zinf {
namespace {

CheckpointSaveSeams& save_seams() {
  static CheckpointSaveSeams seams;
  return seams;
}

void save_point(std::string_view point) {
  if (save_seams().at) save_seams().at(point);
}

// Removes a tag directory (or what is left of one) by name: its manifest first, so a crash in
// the middle never leaves a directory that holds a manifest but not every file it lists.
void remove_tag_dir(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove(fmt::format("{}/{}", path, kCheckpointManifest), ec);
  (void)sync_dir(path);
  std::filesystem::remove_all(path, ec);
  if (ec) log_warn("checkpoint: cannot remove '{}': {}", path, ec.message());
}

CheckpointHeader header_of(const CheckpointContext& ctx, const ResumeState& resume) {
  CheckpointHeader h;
  h.rank = static_cast<std::uint32_t>(ctx.rank);
  h.world_size = static_cast<std::uint32_t>(ctx.world_size);
  h.stage = static_cast<std::uint32_t>(ctx.config->zero.stage);
  h.optimizer = static_cast<std::uint32_t>(ctx.config->optimizer.kind);
  for (Piece p : state_pieces(ctx.config->optimizer.kind)) {
    h.piece_mask |= 1u << static_cast<unsigned>(p);
  }
  h.partition_elements = ctx.layout->partition_elements();
  h.fingerprint = ctx.layout->partitioner().fingerprint();
  h.step = resume.step;
  h.loss_scale = resume.loss_scale;
  h.loss_scale_good_steps = resume.loss_scale_good_steps;
  h.loss_scale_hysteresis_left = resume.loss_scale_hysteresis_left;
  return h;
}

CheckpointManifest manifest_of(const CheckpointContext& ctx, const std::string& tag,
                               const ResumeState& resume) {
  const ParameterLayout& layout = *ctx.layout;
  const Partitioner& part = layout.partitioner();
  CheckpointManifest m;
  m.tag = tag;
  m.world_size = ctx.world_size;
  m.stage = ctx.config->zero.stage;
  m.optimizer = std::string(optimizer_name(ctx.config->optimizer.kind));
  m.fingerprint = part.fingerprint();
  m.partition_elements = layout.partition_elements();
  // The manifest's share of the resume state (its loss scaler is in the rank files' headers, its
  // client state in client_state.bin).
  m.resume.step = resume.step;
  m.resume.lr = resume.lr;
  m.resume.lr_override = resume.lr_override;
  m.resume.schedule = resume.schedule;
  m.resume.gather_order = resume.gather_order;
  m.resume.previous_clip_coef = resume.previous_clip_coef;
  m.loss_scaler = loss_scaler_mode(ctx.config->fp16);
  for (ParamId id = 0; id < part.param_count(); ++id) {
    const ParamLocation& loc = part.location(id);
    m.params.push_back({layout.param(id).spec.name, part.spec(id).shape, part.spec(id).dtype,
                        loc.group, loc.group_offset, layout.param(id).spec.trainable});
  }
  for (std::uint32_t g = 0; g < part.group_count(); ++g) {
    m.groups.push_back({part.group(g).shard_element_count, layout.offset(g)});
  }
  return m;
}

// Removes the tags beyond the newest `keep` (by serial) among those of step `step` or below,
// from `tags`: the directory's complete tags (list_checkpoint_tag_summaries(), oldest first), the
// one just saved, `current`, among them. The save's lock kept the directory as it was listed.
// A tag of a later step than the one just saved is never removed nor counted: it belongs to a
// later point of training than this run has reached, so to another run saving into the same
// directory or to the training this run was rolled back from (a resume from an older tag), and
// the newest serials would otherwise delete it. Each old tag is first renamed to ".<tag>.pruned",
// so a crash in the middle of its removal leaves no tag of that name: no load reads it, no save
// restores it (as it does a complete ".<tag>.old"), and the next save removes it.
void prune_tags(const std::string& dir, std::size_t keep, const std::string& current,
                std::int64_t step, std::vector<CheckpointTagSummary> tags) {
  std::erase_if(tags, [&](const CheckpointTagSummary& m) { return m.step > step; });
  std::error_code ec;
  for (std::size_t i = 0; i + keep < tags.size(); ++i) {
    if (tags[i].tag == current) continue;
    const std::string from = fmt::format("{}/{}", dir, tags[i].tag);
    const std::string to = fmt::format("{}/.{}.pruned", dir, tags[i].tag);
    std::filesystem::remove_all(to, ec);
    if (::rename(from.c_str(), to.c_str()) != 0) {
      log_warn("checkpoint: cannot remove old tag '{}': {}", from, std::strerror(errno));
      continue;
    }
    save_point("pruning");
    remove_tag_dir(to);
  }
  (void)sync_dir(dir);
}

// The right to change a checkpoint directory's entries for the length of one save: an exclusive
// flock(2) on <dir>/.zinf-save.lock, taken by the rank that does the directory's work (rank 0).
// Without it two jobs saving into one directory remove each other's ".<tag>.tmp" (each save
// clears what crashed saves left) and prune each other's tags. The holder writes "pid <pid> host
// <host>" into the file so the refused one can name it; the kernel drops the lock when the holder
// exits, however it exits, so a crash leaves no stale lock (only stale text, which the next
// holder overwrites). The file itself stays: removing it would let a third process lock a new
// file of that name while the second still holds the old one.
class SaveLock {
 public:
  SaveLock() = default;
  ~SaveLock() {
    if (fd_ < 0) return;
    // Nobody holds it now: its text would name a process that no longer saves.
    (void)::ftruncate(fd_, 0);
    ::close(fd_);
  }
  SaveLock(const SaveLock&) = delete;
  SaveLock& operator=(const SaveLock&) = delete;

  // kFailedPrecondition naming `dir` and the holder when another save holds it.
  Status lock(const std::string& dir) {
    const std::string path = fmt::format("{}/{}", dir, kCheckpointSaveLock);
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      return status_from_errno(fmt::format("checkpoint: open the save lock '{}'", path), errno);
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS) {
        // A filesystem without flock (some network filesystems mounted without it): the save
        // goes on unguarded, as it did before the lock, rather than never saving.
        ::close(fd);
        log_warn(
            "checkpoint: cannot lock '{}' ({}): saves into '{}' are not guarded against another "
            "job saving there at the same time",
            path, std::strerror(err), dir);
        return Status::ok();
      }
      std::string holder(256, '\0');
      const ssize_t got = ::pread(fd, holder.data(), holder.size(), 0);
      holder.resize(got > 0 ? static_cast<std::size_t>(got) : 0);
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == '\0')) {
        holder.pop_back();
      }
      ::close(fd);
      if (err != EWOULDBLOCK) {
        return status_from_errno(fmt::format("checkpoint: lock '{}'", path), err);
      }
      return Status::failed_precondition(fmt::format(
          "the checkpoint directory '{}' is being saved into by another process ({}; it holds "
          "'{}'): two jobs saving into one directory would remove each other's files (give "
          "each job its own directory)",
          dir, holder.empty() ? std::string("its pid not written yet") : holder, path));
    }
    char host[256] = {};
    (void)::gethostname(host, sizeof(host) - 1);
    const std::string text = fmt::format("pid {} host {}\n", ::getpid(), host);
    // Best effort: the text only names this process to another one refused the lock.
    if (::ftruncate(fd, 0) == 0) (void)::pwrite(fd, text.data(), text.size(), 0);
    fd_ = fd;
    return Status::ok();
  }

 private:
  int fd_ = -1;
};

// The tag of `old_path`, a "<dir>/.<tag>.old" directory, where it is that tag's only complete
// copy (moved_aside_tag_dir: no <dir>/<tag>, its manifest there); "" otherwise.
std::string moved_aside_tag(IoEngine& io, const std::string& dir, const std::string& old_path) {
  const std::string name = std::filesystem::path(old_path).filename().string();
  const std::string tag = name.substr(1, name.size() - 5);  // ".<tag>.old"
  if (!check_checkpoint_tag(tag).is_ok() || moved_aside_tag_dir(io, dir, tag).empty()) return "";
  return tag;
}

// A save that replaced a tag on a filesystem without RENAME_EXCHANGE and was cut short between
// its two renames left <dir>/.<tag>.old complete and no <dir>/<tag>: each such tag gets its name
// back before the save removes what crashed saves left, so no complete tag is lost to that
// removal; each tag renamed back joins `tags` (oldest first). Where the rename fails (no space,
// no permission), the tag stays there, still loadable, and the save does not remove it.
void restore_replaced_tags(IoEngine& io, const std::string& dir,
                           const std::vector<std::string>& old_dirs,
                           std::vector<CheckpointTagSummary>* tags) {
  for (const std::string& old : old_dirs) {
    const std::string tag = moved_aside_tag(io, dir, old);
    if (tag.empty()) continue;
    const std::string final_dir = fmt::format("{}/{}", dir, tag);
    const int failed = save_seams().restore_error;
    if (failed != 0 || ::rename(old.c_str(), final_dir.c_str()) != 0) {
      log_warn(
          "checkpoint: cannot rename '{}' back to '{}' ({}): it is left there, the only "
          "copy of tag '{}'",
          old, final_dir, std::strerror(failed != 0 ? failed : errno), tag);
      continue;
    }
    log_warn("checkpoint: '{}' renamed back to '{}' (a save replacing that tag was cut short)", old,
             final_dir);
    const std::string path = fmt::format("{}/{}", final_dir, kCheckpointManifest);
    Result<std::string> text = read_text_file(io, path);
    Result<CheckpointTagSummary> m = text.is_ok() ? parse_checkpoint_manifest_summary(*text, path)
                                                  : Result<CheckpointTagSummary>(text.status());
    if (m.is_ok() && m->tag == tag) tags->push_back(std::move(*m));
  }
  sort_tags_oldest_first(*tags);
  (void)sync_dir(dir);
}

// Rank 0's first phase of a save: the directory, its save lock, whether a tag of this name is
// there to replace (*replace), a fresh temporary directory, and the serial for the new manifest.
// The directory is listed once, under the lock, one manifest's summary at a time: its complete
// tags, oldest first, go to *tags (for keep_last).
Status prepare_save(IoEngine& io, const std::string& dir, const std::string& tag,
                    const std::string& temp, SaveLock* lock, bool* replace, std::uint64_t* serial,
                    std::vector<CheckpointTagSummary>* tags_out) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return status_from_errno(fmt::format("cannot create the directory '{}'", dir), ec.value());
  }
  ZINF_RETURN_IF_ERROR(lock->lock(dir));
  RefusedCheckpointTags refused;
  std::vector<CheckpointTagSummary>& tags = *tags_out;
  tags = list_checkpoint_tag_summaries(io, dir, &refused);
  restore_replaced_tags(io, dir, refused.old_dirs, &tags);
  const std::string final_dir = fmt::format("{}/{}", dir, tag);
  *replace = false;
  if (std::filesystem::exists(final_dir, ec) || std::filesystem::is_symlink(final_dir, ec)) {
    // A checkpoint of this name (complete, or one a failed save left with rank files) is
    // replaced; anything else there is not the engine's to remove.
    const bool ours =
        std::any_of(tags.begin(), tags.end(),
                    [&](const CheckpointTagSummary& m) { return m.tag == tag; }) ||
        std::any_of(refused.tags.begin(), refused.tags.end(),
                    [&](const RefusedCheckpointTags::Tag& t) { return t.tag == tag; });
    if (!ours || std::filesystem::is_symlink(final_dir, ec)) {
      return Status::failed_precondition(fmt::format(
          "'{}' exists and is not a checkpoint directory (no {} nor rank files): a save replaces "
          "only a checkpoint of that tag (choose another tag, or remove it)",
          final_dir, kCheckpointManifest));
    }
    *replace = true;
  }
  // What crashed saves left. No other save is running here (the lock), so each is a leftover;
  // but an .<tag>.old that restore_replaced_tags could not rename back is still the only copy of
  // its tag, and stays.
  for (const std::vector<std::string>* stale :
       {&refused.temp_dirs, &refused.old_dirs, &refused.pruned_dirs}) {
    for (const std::string& path : *stale) {
      if (stale == &refused.old_dirs && !moved_aside_tag(io, dir, path).empty()) continue;
      std::filesystem::remove_all(path, ec);
    }
  }
  std::filesystem::create_directory(temp, ec);
  if (ec) {
    return status_from_errno(fmt::format("cannot create the directory '{}'", temp), ec.value());
  }
  *serial = tags.empty() ? 1 : tags.back().serial + 1;
  return Status::ok();
}

// Puts the complete tag in `temp` under the name `final_dir`, where a tag of that name exists
// (replace) or not. Replacing, at no instant is there no complete tag under `final_dir` where the
// filesystem can exchange two names in one step; elsewhere only between two renames, and then a
// complete `aside` (restore_replaced_tags). The old tag is removed once the new one has its name.
Status commit_tag(const std::string& dir, const std::string& temp, const std::string& final_dir,
                  const std::string& aside, bool replace) {
  if (!replace) {
    if (::rename(temp.c_str(), final_dir.c_str()) != 0) {
      return status_from_errno(fmt::format("rename '{}' to '{}'", temp, final_dir), errno);
    }
    return sync_dir(dir);
  }
  std::error_code ec;
  if (save_seams().exchange &&
      ::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    // `temp` holds the old tag now, under a name no load reads.
    ZINF_RETURN_IF_ERROR(sync_dir(dir));
    save_point("exchanged");
    remove_tag_dir(temp);
    return Status::ok();
  }
  if (save_seams().exchange && errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP) {
    return status_from_errno(fmt::format("exchange '{}' and '{}'", temp, final_dir), errno);
  }
  std::filesystem::remove_all(aside, ec);
  if (::rename(final_dir.c_str(), aside.c_str()) != 0) {
    return status_from_errno(fmt::format("rename '{}' to '{}'", final_dir, aside), errno);
  }
  save_point("moved-aside");
  if (::rename(temp.c_str(), final_dir.c_str()) != 0) {
    const int err = errno;
    // The old tag gets its name back, so the failed save leaves it where it was.
    if (::rename(aside.c_str(), final_dir.c_str()) != 0) {
      log_warn("checkpoint: cannot rename '{}' back to '{}': {}", aside, final_dir,
               std::strerror(errno));
    }
    return status_from_errno(fmt::format("rename '{}' to '{}'", temp, final_dir), err);
  }
  ZINF_RETURN_IF_ERROR(sync_dir(dir));
  save_point("renamed");
  remove_tag_dir(aside);
  return Status::ok();
}

Status write_small_file(IoEngine& io, const std::string& path, std::string_view bytes,
                        ManifestFile* out);

// This rank's file. Where the state's home can (the master and moments on NVMe in the
// checkpoint layout), the swap file itself, hard-linked with the header written in front, and
// its block checksums beside it: nothing is copied, and the swap space never writes that file
// again (SwapSpace::link_files). Otherwise the header, then each piece of the state as it
// streams out of its home (device, host or NVMe), through the writer's pipeline.
Status write_rank_file(const CheckpointContext& ctx, IoEngine& io, const std::string& temp,
                       const std::string& final_dir, const ResumeState& resume, ManifestFile* out) {
  const std::string name = fmt::format("rank{}.zinfckpt", ctx.rank);
  const std::string path = checkpoint_rank_path(temp, ctx.rank);
  const std::uint64_t file_bytes = checkpoint_rank_file_bytes(
      state_pieces(ctx.config->optimizer.kind).size(), ctx.layout->partition_elements());
  AlignedBuffer head(kCheckpointHeaderBytes);
  std::memset(head.data(), 0, head.bytes());
  encode_checkpoint_header(header_of(ctx, resume),
                           std::span<std::byte, kCheckpointHeaderBytes>(head.data(), head.bytes()));
  std::vector<FileBlockSum> sums;
  ZINF_ASSIGN_OR_RETURN(const bool linked,
                        ctx.state->link_checkpoint(
                            head.data(), path, checkpoint_rank_path(final_dir, ctx.rank), &sums));
  if (linked) {
    ManifestFile blocks;
    ZINF_RETURN_IF_ERROR(write_small_file(io, fmt::format("{}/rank{}.blocks", temp, ctx.rank),
                                          encode_block_sums(sums), &blocks));
    *out = {name, file_bytes, 0, blocks.file, blocks.bytes, blocks.xxh3};
    return Status::ok();
  }
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> w,
                        CheckpointWriter::create(io, path, /*direct=*/true, file_bytes));
  ZINF_RETURN_IF_ERROR(w->append(head.data(), head.bytes()));
  for (Piece piece : state_pieces(ctx.config->optimizer.kind)) {
    ZINF_RETURN_IF_ERROR(
        ctx.state->read_state(piece, [&](std::size_t, std::size_t count, const float* values) {
          return w->append(values, count * sizeof(float));
        }));
  }
  ZINF_RETURN_IF_ERROR(w->commit());
  *out = ManifestFile{};
  out->file = name;
  out->bytes = w->bytes();
  out->xxh3 = w->digest();
  return Status::ok();
}

Status write_small_file(IoEngine& io, const std::string& path, std::string_view bytes,
                        ManifestFile* out) {
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> w,
                        CheckpointWriter::create(io, path, /*direct=*/false));
  ZINF_RETURN_IF_ERROR(w->append(bytes.data(), bytes.size()));
  ZINF_RETURN_IF_ERROR(w->commit());
  if (out != nullptr) {
    *out = ManifestFile{};
    out->file = std::filesystem::path(path).filename().string();
    out->bytes = w->bytes();
    out->xxh3 = w->digest();
  }
  return Status::ok();
}

// "0-3, 5, 7-8": sorted ranks as runs.
std::string rank_runs(const std::vector<int>& ranks) {
  std::string out;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += j == i ? fmt::format("{}", ranks[i]) : fmt::format("{}-{}", ranks[i], ranks[j]);
    i = j + 1;
  }
  return out;
}

// The bytes of a tag that travel to name it when the ranks' tags differ: a valid tag's 200.
constexpr std::size_t kTagWords = 25;

// Every rank saves under the same tag, before anything is written. DeepSpeed compares the tags
// only as checkpoint.tag_validation asks ("Warn" logs a mismatch, "Ignore" skips it); zinf saves
// one tag directory, which rank 0 creates and names, so ranks naming different tags would write
// their files into a directory that holds other ranks' tag or none. Differing tags therefore fail
// the save on every rank, whatever tag_validation says. The ranks all-gather one word, the
// xxh3-64 of their tag; only when those differ do they all-gather the tags themselves, so that
// every rank's error names every rank's tag. A failure of the exchange is sticky.
Status check_same_tag(const CheckpointContext& ctx, std::string_view call, const std::string& tag) {
  if (ctx.world_size == 1) return Status::ok();
  RankExchange& ex = *ctx.exchange;
  const std::uint64_t hash = XXH3_64bits(tag.data(), tag.size());
  Result<std::vector<std::uint64_t>> hashes = ex.exchange(&hash, 1);
  if (!hashes.is_ok()) return ctx.sticky->fail(hashes.status().with_context(call));
  if (std::all_of(hashes->begin(), hashes->end(),
                  [&](std::uint64_t h) { return h == hashes->front(); })) {
    return Status::ok();
  }
  std::uint64_t words[1 + kTagWords] = {};
  const std::size_t sent = std::min(tag.size(), kTagWords * sizeof(std::uint64_t));
  words[0] = tag.size();
  std::memcpy(&words[1], tag.data(), sent);
  Result<std::vector<std::uint64_t>> tags = ex.exchange(words, 1 + kTagWords);
  if (!tags.is_ok()) return ctx.sticky->fail(tags.status().with_context(call));
  // Each distinct tag, in the order of the first rank that names it, with its ranks.
  std::vector<std::pair<std::string, std::vector<int>>> named;
  for (int r = 0; r < ctx.world_size; ++r) {
    const std::uint64_t* w = tags->data() + static_cast<std::size_t>(r) * (1 + kTagWords);
    const std::size_t bytes =
        static_cast<std::size_t>(std::min<std::uint64_t>(w[0], kTagWords * sizeof(std::uint64_t)));
    std::string t(reinterpret_cast<const char*>(&w[1]), bytes);
    if (w[0] > bytes) t += "...";
    auto it = std::find_if(named.begin(), named.end(), [&](const auto& n) { return n.first == t; });
    if (it == named.end()) {
      named.push_back({t, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  std::string listing;
  for (const auto& [t, ranks] : named) {
    if (!listing.empty()) listing += ", ";
    listing += fmt::format("'{}' on rank{} {}", t, ranks.size() == 1 ? "" : "s", rank_runs(ranks));
  }
  return Status::invalid_argument(fmt::format(
      "{}: the ranks save under different tags ({}): every rank must pass the same tag, since a "
      "checkpoint is one tag directory (zinf refuses differing tags whatever "
      "checkpoint.tag_validation says); nothing was written",
      call, listing));
}

}  // namespace

void set_checkpoint_save_seams(CheckpointSaveSeams seams) { save_seams() = std::move(seams); }

Status checkpoint_precondition(std::string_view call, const ParameterLayout& layout, long in_use,
                               bool grads_pending) {
  if (in_use >= 0) {
    return Status::failed_precondition(
        fmt::format("{}: module '{}' is gathered (release it first)", call,
                    layout.module_names()[static_cast<std::size_t>(in_use)]));
  }
  if (grads_pending) {
    return Status::failed_precondition(fmt::format(
        "{}: gradients were reduced since the last step (a checkpoint is taken between steps; "
        "call step() first)",
        call));
  }
  return Status::ok();
}

std::vector<std::string> gather_order_names(const ParameterLayout& layout,
                                            const std::vector<std::size_t>& order) {
  std::vector<std::string> names;
  for (std::size_t m : order) names.push_back(layout.module_names()[m]);
  return names;
}

std::vector<std::size_t> gather_order_indices(const ParameterLayout& layout,
                                              const std::vector<std::string>& names) {
  std::vector<std::size_t> order;
  for (const std::string& name : names) {
    Result<std::size_t> m = layout.find_module("load_checkpoint", name);
    if (!m.is_ok()) return {};
    order.push_back(*m);
  }
  return order;
}

Status save_checkpoint(const CheckpointContext& ctx, std::string_view call, const std::string& dir,
                       const std::string& tag, Status precondition, const ResumeState& resume) {
  RankExchange& ex = *ctx.exchange;
  const std::string temp = fmt::format("{}/.{}.tmp", dir, tag);
  std::unique_ptr<IoEngine> io;
  std::uint64_t serial = 0;
  SaveLock lock;         // rank 0's, held to the end of the save
  bool replace = false;  // a tag of this name is there; the new one replaces it once complete
  std::vector<CheckpointTagSummary> tags;  // rank 0: the directory's complete tags, oldest first
  ZINF_RETURN_IF_ERROR(check_same_tag(ctx, call, tag));
  Status local = std::move(precondition);
  if (local.is_ok()) {
    local = [&]() -> Status {
      ZINF_RETURN_IF_ERROR(check_checkpoint_tag(tag));
      ZINF_ASSIGN_OR_RETURN(io, open_checkpoint_io(ctx.io_faults));
      if (ctx.rank == 0) {
        ZINF_RETURN_IF_ERROR(prepare_save(*io, dir, tag, temp, &lock, &replace, &serial, &tags));
      }
      return Status::ok();
    }()
                         .with_context(call);
  }
  ZINF_RETURN_IF_ERROR(ex.agree(call, local));

  // Every rank's file, in parallel.
  ManifestFile file;
  local = write_rank_file(ctx, *io, temp, fmt::format("{}/{}", dir, tag), resume, &file);
  Status written = ex.agree(call, local.with_context(call));
  if (!written.is_ok()) {
    if (ctx.rank == 0) {
      // Every rank is past its writes (agree is collective): nothing of the save remains.
      std::error_code ec;
      std::filesystem::remove_all(temp, ec);
    }
    return written;
  }
  // Each rank's file: its size and checksum, and for a linked one its block list's.
  const std::uint64_t words[4] = {file.bytes, file.xxh3, file.blocks_bytes, file.blocks_xxh3};
  Result<std::vector<std::uint64_t>> files = ex.exchange(words, 4);
  if (!files.is_ok()) return ctx.sticky->fail(files.status());

  // Rank 0: the client state, the manifest (last inside the tag), the rename, `latest`.
  local = Status::ok();
  if (ctx.rank == 0) {
    local = [&]() -> Status {
      CheckpointManifest m = manifest_of(ctx, tag, resume);
      m.serial = serial;
      for (int r = 0; r < ctx.world_size; ++r) {
        const std::uint64_t* w = files->data() + 4 * r;
        m.ranks.push_back({fmt::format("rank{}.zinfckpt", r), w[0], w[1],
                           w[2] > 0 ? fmt::format("rank{}.blocks", r) : std::string(), w[2], w[3]});
      }
      if (!resume.client_state.empty()) {
        ManifestFile cs;
        ZINF_RETURN_IF_ERROR(write_small_file(
            *io, fmt::format("{}/{}", temp, kCheckpointClientState), resume.client_state, &cs));
        m.client_state.push_back(cs);
      }
      ZINF_RETURN_IF_ERROR(write_small_file(*io, fmt::format("{}/{}", temp, kCheckpointManifest),
                                            encode_checkpoint_manifest(m), nullptr));
      ZINF_RETURN_IF_ERROR(sync_dir(temp));
      const std::string final_dir = fmt::format("{}/{}", dir, tag);
      save_point("written");
      ZINF_RETURN_IF_ERROR(
          commit_tag(dir, temp, final_dir, fmt::format("{}/.{}.old", dir, tag), replace));
      save_point("committed");
      Status latest = write_file_atomically(*io, fmt::format("{}/{}", dir, kCheckpointLatest), tag);
      if (!latest.is_ok()) {
        // While `latest` still names the previous tag, the new one goes, so a retry of the same
        // tag can succeed.
        // A tag that replaced one stays: the old one is gone, and a tag may be saved again.
        Result<std::string> named = read_latest_tag(*io, dir);
        if (!replace && (!named.is_ok() || *named != tag)) {
          std::error_code ec;
          std::filesystem::remove_all(final_dir, ec);
          (void)sync_dir(dir);
        }
        return latest;
      }
      save_point("latest");
      if (ctx.config->keep_last > 0) {
        // The tag saved, newest, in place of the one it replaced.
        std::erase_if(tags, [&](const CheckpointTagSummary& t) { return t.tag == tag; });
        tags.push_back({tag, serial, resume.step});
        prune_tags(dir, static_cast<std::size_t>(ctx.config->keep_last), tag, resume.step,
                   std::move(tags));
      }
      return Status::ok();
    }();
    if (!local.is_ok()) {
      std::error_code ec;
      std::filesystem::remove_all(temp, ec);
    }
  }
  return ex.agree(call, local.with_context(call));
}

// --- Load ----------------------------------------------------------------------------------------
namespace {

// A run of this rank's new partition read from one saved rank file.
struct Segment {
  std::size_t first = 0;        // new partition element
  int old_rank = 0;             // the file
  std::uint64_t old_first = 0;  // element in the saved partition
  std::size_t count = 0;
};

// Maps this rank's partition onto the saved files by parameter name. kInvalidArgument naming
// the first parameter that is not in both, or whose shape differs.
Status plan_segments(const CheckpointContext& ctx, const CheckpointManifest& m,
                     std::vector<Segment>* out) {
  const Partitioner& part = ctx.layout->partitioner();
  std::map<std::string_view, const ManifestParam*> saved;
  for (const ManifestParam& p : m.params) saved.emplace(p.name, &p);
  for (ParamId id = 0; id < part.param_count(); ++id) {
    const std::string& name = ctx.layout->param(id).spec.name;
    auto it = saved.find(name);
    if (it == saved.end()) {
      return Status::invalid_argument(fmt::format(
          "parameter '{}' is not in the checkpoint (a checkpoint loads into an engine with "
          "the same parameters)",
          name));
    }
    if (it->second->shape != part.spec(id).shape) {
      return Status::invalid_argument(
          fmt::format("parameter '{}' has shape {} in the checkpoint, {} here", name,
                      shape_text(it->second->shape), shape_text(part.spec(id).shape)));
    }
  }
  if (saved.size() != part.param_count()) {
    for (const ManifestParam& p : m.params) {
      if (!ctx.layout->find_param(p.name).has_value()) {
        return Status::invalid_argument(fmt::format(
            "the checkpoint's parameter '{}' is not registered in this engine", p.name));
      }
    }
  }
  for (std::uint32_t g = 0; g < part.group_count(); ++g) {
    for (const ParamPiece& piece : part.shard_pieces(g, ctx.rank)) {
      const ManifestParam& old = *saved.at(ctx.layout->param(piece.param).spec.name);
      const std::uint64_t old_shard = m.groups[old.group].shard_elements;
      std::uint64_t pos = old.group_offset + piece.param_offset;  // in the saved group
      std::size_t first = ctx.layout->offset(g) + piece.shard_offset;
      std::size_t left = piece.element_count;
      while (left > 0) {
        const int old_rank = static_cast<int>(pos / old_shard);
        const std::uint64_t within = pos - static_cast<std::uint64_t>(old_rank) * old_shard;
        const std::size_t take =
            static_cast<std::size_t>(std::min<std::uint64_t>(left, old_shard - within));
        const std::uint64_t old_first = m.groups[old.group].partition_offset + within;
        if (!out->empty() && out->back().old_rank == old_rank &&
            out->back().first + out->back().count == first &&
            out->back().old_first + out->back().count == old_first) {
          out->back().count += take;
        } else {
          out->push_back({first, old_rank, old_first, take});
        }
        pos += take;
        first += take;
        left -= take;
      }
    }
  }
  return Status::ok();
}

// Opens a saved rank file and checks its size and header against the manifest. `direct`: for
// one front-to-back pass (positioned after the header), whose end (CheckpointReader::finish)
// gives the checksum that check_rank_checksum() compares; otherwise for reads at any offset, and
// the checksum is checked here, before anything is read from the file.
Status open_rank_file(IoEngine& io, const std::string& tag_dir, const CheckpointManifest& m,
                      int rank, std::size_t pieces, bool direct,
                      std::unique_ptr<CheckpointReader>* out, CheckpointHeader* header,
                      bool check_now = true) {
  const ManifestFile& f = m.ranks[static_cast<std::size_t>(rank)];
  const std::string path = fmt::format("{}/{}", tag_dir, f.file);
  const std::uint64_t expect = checkpoint_rank_file_bytes(pieces, m.partition_elements);
  if (f.bytes != expect) {
    return Status::corruption(fmt::format("'{}': the manifest says {} bytes, its layout needs {}",
                                          path, f.bytes, expect));
  }
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> r,
                        open_rank_reader(io, tag_dir, f, direct));
  if (!direct && check_now) {
    ZINF_ASSIGN_OR_RETURN(std::uint64_t sum, r->checksum());
    ZINF_RETURN_IF_ERROR(check_rank_digest(f, *r, sum));
  }
  std::vector<std::byte> head(kCheckpointHeaderBytes);
  if (direct) {
    ZINF_RETURN_IF_ERROR(r->read(head.data(), head.size()));
  } else {
    ZINF_RETURN_IF_ERROR(r->read_at(0, head.size(), head.data()));
    // A linked file taken in place is never read through: its header page (the loss scaler and
    // the fields compared below) is checked against its block checksum here, as a pass checks
    // it with the rest of the file.
    const std::vector<FileBlockSum>& sums = r->block_sums();
    if (!check_now && !sums.empty() && sums[0].end_offset == kCheckpointHeaderBytes &&
        XXH3_64bits(head.data(), head.size()) != sums[0].xxh3) {
      return Status::corruption(fmt::format(
          "'{}' does not match its block checksums: bytes [0, {}) differ (block 0 of {}: the "
          "header)",
          path, kCheckpointHeaderBytes, sums.size()));
    }
  }
  Result<CheckpointHeader> decoded = decode_checkpoint_header(head);
  if (!decoded.is_ok()) {
    return Status(decoded.status().code(), 0,
                  fmt::format("'{}': {}", path, decoded.status().message()));
  }
  const CheckpointHeader& h = *decoded;
  if (h.version != m.version || h.rank != static_cast<std::uint32_t>(rank) ||
      h.world_size != static_cast<std::uint32_t>(m.world_size) ||
      h.stage != static_cast<std::uint32_t>(m.stage) ||
      h.partition_elements != m.partition_elements || h.fingerprint != m.fingerprint ||
      h.step != m.resume.step) {
    return Status::corruption(fmt::format("'{}': its header does not match the manifest", path));
  }
  *header = h;
  *out = std::move(r);
  return Status::ok();
}

// The master is loaded in runs of this many elements (512 KiB), each handed to the state
// (OptimizerState::master_loaded) right after it is written, while it is in the core's cache:
// the republish's rounding to the device dtype then costs no second pass over the master.
constexpr std::size_t kLoadRunElements = std::size_t{1} << 17;

// Writes `piece` of the state through `fill`; the master in runs, each handed to the state.
Status load_piece(OptimizerState& state, Piece piece, StateFill fill) {
  if (piece != Piece::kParams) return state.write_state(piece, fill);
  return state.write_state(piece, [&](std::size_t first, std::size_t count, float* out) {
    for (std::size_t done = 0; done < count;) {
      const std::size_t run = std::min(kLoadRunElements, count - done);
      ZINF_RETURN_IF_ERROR(fill(first + done, run, out + done));
      ZINF_RETURN_IF_ERROR(state.master_loaded(first + done, run, out + done));
      done += run;
    }
    return Status::ok();
  });
}

// The schedule the engine runs after the load (resumed_schedule(), as Engine's
// restore_schedule takes it), checked before the state is touched, so a schedule this build
// refuses (a checkpoint of a build that took a negative decay_lr_rate) fails the load, naming the
// manifest and the key, instead of being dropped.
Status check_resumed_schedule(const Config& config, const ResumeState& resume,
                              std::string_view manifest_path) {
  const ResumedSchedule resumed = resumed_schedule(config.scheduler, config.optimizer.lr, resume);
  const ScheduleConfig& schedule = resumed.schedule;
  const Result<LrSchedule> created = LrSchedule::create(schedule, resumed.lr);
  if (created.is_ok()) return Status::ok();
  return created.status().with_context(
      resumed.own_kept
          ? fmt::format("checkpoint manifest '{}': the engine's {} schedule at the checkpoint's "
                        "'lr_schedule.last_batch_iteration' {}",
                        manifest_path, schedule_name(schedule.kind), schedule.last_batch_iteration)
          : fmt::format("checkpoint manifest '{}': its 'lr_schedule' ({}), which the engine takes "
                        "on load, is one this build refuses",
                        manifest_path, schedule_name(schedule.kind)));
}

}  // namespace

ResumedSchedule resumed_schedule(const ScheduleConfig& own, double own_lr,
                                 const ResumeState& saved) {
  ResumedSchedule r;
  r.own_kept = !saved.lr_override && own.kind != ScheduleKind::kNone;
  if (r.own_kept) {
    r.schedule = own;
    r.schedule.last_batch_iteration = saved.schedule.last_batch_iteration;
    r.lr = own_lr;
  } else {
    r.schedule = saved.schedule;
    r.lr = saved.lr;
  }
  return r;
}

Status load_checkpoint_state(const CheckpointContext& ctx, std::string_view call,
                             const std::string& dir, const std::string& tag_in, Status precondition,
                             ResumeState* resume) {
  const std::vector<Piece> pieces = state_pieces(ctx.config->optimizer.kind);
  std::unique_ptr<IoEngine> io;
  CheckpointManifest m;
  CheckpointHeader header;
  std::string tag_dir;
  bool same_layout = false;
  bool adopt = false;  // same layout, the rank file linked and taken in place
  std::vector<Segment> segments;
  // Same layout: this rank's own file, front to back. Resharded: every file a segment reads,
  // each verified before the state is touched, a bounded number of them open at a time.
  std::unique_ptr<CheckpointReader> own;
  std::optional<RankFileReaders> saved;
  Status local = std::move(precondition);
  if (local.is_ok()) {
    local = [&]() -> Status {
      ZINF_ASSIGN_OR_RETURN(io, open_checkpoint_io(ctx.io_faults));
      std::string tag = tag_in;
      if (tag.empty()) {
        ZINF_ASSIGN_OR_RETURN(tag, read_latest_tag(*io, dir));
      }
      ZINF_RETURN_IF_ERROR(check_checkpoint_tag(tag));
      tag_dir = fmt::format("{}/{}", dir, tag);
      const std::string aside = moved_aside_tag_dir(*io, dir, tag);
      if (!aside.empty()) {
        // A save replacing this tag was cut short between its two renames (a filesystem
        // without RENAME_EXCHANGE): the old tag, complete, is read where it was moved; the next
        // save renames it back.
        log_warn("checkpoint: '{}' is missing; loading '{}' (a save replacing it was cut short)",
                 tag_dir, aside);
        tag_dir = aside;
      }
      const std::string manifest_path = fmt::format("{}/{}", tag_dir, kCheckpointManifest);
      Result<std::string> text = read_text_file(*io, manifest_path);
      if (!text.is_ok()) {
        return text.status().with_context(
            fmt::format("no complete checkpoint '{}' (the manifest is written last)", tag_dir));
      }
      ZINF_ASSIGN_OR_RETURN(m, parse_checkpoint_manifest(*text, manifest_path));
      if (m.optimizer != optimizer_name(ctx.config->optimizer.kind)) {
        return Status::invalid_argument(fmt::format(
            "the checkpoint was saved with optimizer.type {}, this engine has optimizer.type {}",
            m.optimizer, optimizer_name(ctx.config->optimizer.kind)));
      }
      ZINF_RETURN_IF_ERROR(check_resumed_schedule(*ctx.config, m.resume, manifest_path));
      same_layout = m.world_size == ctx.world_size &&
                    m.fingerprint == ctx.layout->partitioner().fingerprint() &&
                    m.partition_elements == ctx.layout->partition_elements();
      if (same_layout) {
        // A linked rank file the state's home can take as it is (the same store layout): only
        // its header is read now.
        if (!m.ranks[static_cast<std::size_t>(ctx.rank)].blocks.empty()) {
          ZINF_RETURN_IF_ERROR(open_rank_file(*io, tag_dir, m, ctx.rank, pieces.size(),
                                              /*direct=*/false, &own, &header,
                                              /*check_now=*/false));
          adopt = ctx.state->adoptable(own->block_sums());
          if (adopt) return Status::ok();
          own.reset();
        }
        return open_rank_file(*io, tag_dir, m, ctx.rank, pieces.size(), /*direct=*/true, &own,
                              &header);
      }
      ZINF_RETURN_IF_ERROR(plan_segments(ctx, m, &segments));
      saved.emplace(*io, tag_dir, m);
      std::set<int> old_ranks;
      for (const Segment& s : segments) old_ranks.insert(s.old_rank);
      // A rank that owns nothing but padding still takes the step and loss scale from a file.
      if (old_ranks.empty()) old_ranks.insert(0);
      for (const int old_rank : old_ranks) {
        std::unique_ptr<CheckpointReader> r;
        ZINF_RETURN_IF_ERROR(open_rank_file(*io, tag_dir, m, old_rank, pieces.size(),
                                            /*direct=*/false, &r, &header));
        saved->verified(old_rank, std::move(r));
      }
      return Status::ok();
    }()
                         .with_context(call);
    if (local.is_ok() && !m.client_state.empty()) {
      const ManifestFile& f = m.client_state.front();
      Result<std::string> blob =
          read_checked_file(*io, fmt::format("{}/{}", tag_dir, f.file), f.bytes, f.xxh3);
      local = blob.status().with_context(call);
      if (local.is_ok()) resume->client_state = std::move(*blob);
    }
  }
  ZINF_RETURN_IF_ERROR(ctx.exchange->agree(call, local));

  // From here on the state is being replaced. Same layout: this rank's file streams through the
  // reader's pipeline into the state, hashed as it arrives, and its checksum is known once the
  // last block is in; resharded: every file was checked above (one closed to keep at most
  // kCheckpointOpenReaderCount open is reopened only if it is still the file checked, kCorruption
  // otherwise, sticky like any error here). Either way every rank learns
  // every rank's verdict before the resume state is taken; an error here leaves the partition
  // part old and part new, so it is sticky (the engine refuses to train on it).
  local = [&]() -> Status {
    if (adopt) {
      // The file becomes the state's home: nothing is read now; every block is checked against
      // its checksum when first read (write_loaded() below reads the master, a step the rest),
      // and a mismatch then is kCorruption naming this file.
      return ctx.state->adopt_checkpoint(own->path(), own->path(), own->block_sums());
    }
    for (std::size_t pi = 0; pi < pieces.size(); ++pi) {
      const Piece piece = pieces[pi];
      if (same_layout) {
        ZINF_RETURN_IF_ERROR(
            load_piece(*ctx.state, piece, [&](std::size_t, std::size_t count, float* out) {
              return own->read(out, count * sizeof(float));
            }));
        continue;
      }
      const std::uint64_t piece_bytes = m.partition_elements * sizeof(float);
      ZINF_RETURN_IF_ERROR(
          load_piece(*ctx.state, piece, [&](std::size_t first, std::size_t count, float* out) {
            std::fill(out, out + count, 0.0f);  // padding
            auto it = std::upper_bound(segments.begin(), segments.end(), first,
                                       [](std::size_t f, const Segment& s) { return f < s.first; });
            if (it != segments.begin()) --it;
            for (; it != segments.end() && it->first < first + count; ++it) {
              const std::size_t lo = std::max(first, it->first);
              const std::size_t hi = std::min(first + count, it->first + it->count);
              if (lo >= hi) continue;
              const std::uint64_t at = kCheckpointHeaderBytes + pi * piece_bytes +
                                       (it->old_first + (lo - it->first)) * sizeof(float);
              ZINF_RETURN_IF_ERROR(
                  saved->read_at(it->old_rank, at, (hi - lo) * sizeof(float), out + (lo - first)));
            }
            return Status::ok();
          }));
    }
    if (same_layout) {
      // The rest of the file (its padding) completes the checksum.
      ZINF_ASSIGN_OR_RETURN(std::uint64_t sum, own->finish());
      ZINF_RETURN_IF_ERROR(
          check_rank_digest(m.ranks[static_cast<std::size_t>(ctx.rank)], *own, sum));
    }
    return Status::ok();
  }();
  // The new shards from the loaded master, written and waited for before the ranks agree; the
  // caller all-gathers the persistent groups only once every rank's load and writes succeeded.
  // So a rank whose shard write fails, or (a file taken in place) whose master fails its
  // checksum when this first reads it, fails every rank here rather than leaving them in the
  // all-gather. A state that streams the shards (OptimizerState::master_loaded) wrote them
  // during the load, before the file's checksum was known: a mismatch then fails every rank
  // stickily, so nothing gathers those shards.
  if (local.is_ok()) local = ctx.state->write_loaded();
  ZINF_RETURN_IF_ERROR(ctx.sticky->fail(ctx.exchange->agree(call, local.with_context(call))));
  resume->step = header.step;
  resume->loss_scale = header.loss_scale;
  resume->loss_scale_good_steps = header.loss_scale_good_steps;
  resume->loss_scale_hysteresis_left = header.loss_scale_hysteresis_left;
  resume->loss_scaler_mode = m.loss_scaler.value_or(
      header.loss_scale != 1.0 ? LossScalerMode::kDynamic : LossScalerMode::kOff);
  resume->lr = m.resume.lr;
  resume->lr_override = m.resume.lr_override;
  resume->schedule = m.resume.schedule;
  resume->gather_order = m.resume.gather_order;
  resume->previous_clip_coef = m.resume.previous_clip_coef;
  return Status::ok();
}

}  // namespace zinf
