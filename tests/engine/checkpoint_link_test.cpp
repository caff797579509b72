// Checkpoints of optimizer state on NVMe saved by hard-linking the swap file (StateStore::
// link_checkpoint): the tag's rank file is the swap file itself with its block checksums beside
// it, nothing is copied, and the engine never writes that file again, so the checkpoint keeps
// its bytes while training goes on. What a user checks: the bytes of the saved file before and
// after more steps, that a load of the same layout takes the file in place (the engine holds it
// open until the steps after rewrote the state) and gives back the saved masters to the bit and
// continues as the uninterrupted run, resharded too (read, not taken), that a flipped bit is
// kCorruption naming the file (at the load, or for a moment taken in place at the first step),
// and that a checkpoint directory on another filesystem falls back to copying.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::page_model;
using engine_test::TrainOptions;
using engine_test::with_engines;

Config link_config(const std::string& nvme) {
  Config c = engine_test::small_config(2, OffloadDevice::kNvme, OffloadDevice::kNone, nvme);
  c.zero.sub_group_size = 1024;
  c.keep_last = 4;
  return c;
}

using Masters = std::vector<std::vector<float>>;

Status read_masters(Engine& engine, const Model& model, Masters* out) {
  out->clear();
  for (const engine_test::ParamDef& d : model.params) {
    std::vector<float> values(d.element_count());
    ZINF_RETURN_IF_ERROR(engine.read_parameters(d.name, values.data()));
    out->push_back(std::move(values));
  }
  return Status::ok();
}

Status train(Engine& engine, const Model& model, int rank, int first_step, int last_step) {
  TrainOptions options;
  options.first_step = first_step;
  options.steps = last_step;
  return engine_test::train_rank(engine, model, rank, options, nullptr, nullptr);
}

CheckpointManifest manifest(const std::string& tag_dir) {
  std::ifstream in(tag_dir + "/manifest.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Result<CheckpointManifest> m = parse_checkpoint_manifest(text, tag_dir);
  EXPECT_TRUE(m.is_ok()) << m.status().to_string();
  return m.is_ok() ? *m : CheckpointManifest{};
}

// The xxh3-64 of a file's first `bytes` bytes.
std::uint64_t prefix_hash(const std::string& path, std::uint64_t bytes) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> data(bytes);
  in.read(data.data(), static_cast<std::streamsize>(bytes));
  EXPECT_EQ(static_cast<std::uint64_t>(in.gcount()), bytes) << path;
  return XXH3_64bits(data.data(), data.size());
}

nlink_t link_count(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_nlink;
}

// How many of this process's open files are `path` (the swap space keeps an adopted checkpoint
// file open until the state in it was rewritten).
int open_count(const std::string& path) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::filesystem::path target = std::filesystem::read_symlink(entry.path(), ec);
    if (!ec && target == std::filesystem::path(path)) ++count;
  }
  return count;
}

void expect_equal(const Masters& a, const Masters& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t p = 0; p < a.size(); ++p) {
    ASSERT_EQ(a[p].size(), b[p].size()) << what;
    EXPECT_EQ(std::memcmp(a[p].data(), b[p].data(), a[p].size() * sizeof(float)), 0)
        << what << ": parameter " << p;
  }
}

TEST(CheckpointLink, LinkedSaveKeepsItsBytesAndLoadsAsTheUninterruptedRun) {
  engine_test::ScratchDir scratch("ckpt-link");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = page_model(31);
  const Config config = link_config(scratch.path());
  constexpr int kWorld = 2;
  Masters at2, at4;
  std::vector<std::uint64_t> hashes(kWorld);
  std::vector<std::uint64_t> sizes(kWorld);
  // Steps 1-2, save "a", steps 3-4 (the file of "a" must not change), save "b".
  for (const Status& st : with_engines(config, model, kWorld, [&](int rank, Engine&e) -> Status {
         Masters mine;  // read_parameters is collective: every rank reads
         ZINF_RETURN_IF_ERROR(train(e, model, rank, 1, 2));
         ZINF_RETURN_IF_ERROR(read_masters(e, model, &mine));
         if (rank == 0) at2 = mine;
         ZINF_RETURN_IF_ERROR(e.save_checkpoint(dir, "a"));
         const std::string file = checkpoint_rank_path(dir + "/a", rank);
         const CheckpointManifest m = manifest(dir + "/a");
         const ManifestFile& f = m.ranks.at(static_cast<std::size_t>(rank));
         if (f.blocks.empty()) return Status::internal(fmt::format("{} was copied", file));
         // The swap file itself: one more name for it.
         if (link_count(file) != 2) return Status::internal(fmt::format("{}: not linked", file));
         sizes[static_cast<std::size_t>(rank)] = f.bytes;
         hashes[static_cast<std::size_t>(rank)] = prefix_hash(file, f.bytes);
         ZINF_RETURN_IF_ERROR(train(e, model, rank, 3, 4));
         if (prefix_hash(file, f.bytes) != hashes[static_cast<std::size_t>(rank)]) {
           return Status::internal(fmt::format("{} changed after the save", file));
         }
         if (link_count(file) != 1) {
           return Status::internal(fmt::format("{}: still the engine's swap file", file));
         }
         ZINF_RETURN_IF_ERROR(read_masters(e, model, &mine));
         if (rank == 0) at4 = mine;
         return e.save_checkpoint(dir, "b");
       })) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  EXPECT_FALSE(manifest(dir + "/b").ranks.at(0).blocks.empty());
  // `zinf ckpt inspect` counts the state and, apart, what the linked files take on the disk: the
  // whole swap file each.
  {
    Result<nlohmann::json> info = inspect_checkpoints(dir, false);
    ASSERT_TRUE(info.is_ok()) << info.status().to_string();
    const nlohmann::json& a = (*info)["tags"][0];
    ASSERT_EQ(a["tag"], "a");
    // What the rank files hold (the whole swap files: the state, rounded up to an aio block) and
    // take on the disk (their blocks: less than their size where the swap file fell back to a
    // sparse one).
    std::uint64_t linked = 0, allocated = 0, state = 0;
    for (int r = 0; r < kWorld; ++r) {
      const std::string file = checkpoint_rank_path(dir + "/a", r);
      struct stat st {};
      ASSERT_EQ(::stat(file.c_str(), &st), 0) << file;
      linked += static_cast<std::uint64_t>(st.st_size);
      allocated += static_cast<std::uint64_t>(st.st_blocks) * 512;
      state += sizes[r];
    }
    EXPECT_GE(linked, state);
    EXPECT_LE(linked, state + kWorld * config.aio_block_bytes);
    EXPECT_GE(a["bytes"].get<std::uint64_t>(), state);
    EXPECT_GE(a["disk_bytes"].get<std::uint64_t>(), allocated);
    if (allocated >= linked) {
      EXPECT_GT(a["disk_bytes"].get<std::uint64_t>(), state);
    }
  }
  for (int r = 0; r < kWorld; ++r) {
    const std::string file = checkpoint_rank_path(dir + "/a", r);
    EXPECT_EQ(prefix_hash(file, sizes[r]), hashes[r]) << file;
  }
  // "a" loads as it was saved, taken in place (the swap space reads it: it is open), and two
  // more steps give step 4's masters to the bit (moments included), after which the engine no
  // longer holds it; "b" loads as step 4; and resharded into one rank too (read, not taken).
  for (const Status& st : with_engines(config, model, kWorld, [&](int rank, Engine&e) -> Status {
         Masters loaded;
         const std::string file = checkpoint_rank_path(dir + "/a", rank);
         ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "a"));
         if (open_count(file) != 1) {
           return Status::internal(fmt::format("{}: not taken in place", file));
         }
         ZINF_RETURN_IF_ERROR(read_masters(e, model, &loaded));
         if (rank == 0) expect_equal(loaded, at2, "loaded a");
         ZINF_RETURN_IF_ERROR(train(e, model, rank, 3, 4));
         if (open_count(file) != 0) {
           return Status::internal(fmt::format("{}: still open after the state moved on", file));
         }
         ZINF_RETURN_IF_ERROR(read_masters(e, model, &loaded));
         if (rank == 0) expect_equal(loaded, at4, "a and steps 3-4");
         ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "b"));
         ZINF_RETURN_IF_ERROR(read_masters(e, model, &loaded));
         if (rank == 0) expect_equal(loaded, at4, "loaded b");
         return Status::ok();
       })) {
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
  for (const Status& st : with_engines(config, model, 1, [&](int, Engine& e) -> Status {
         Masters loaded;
         ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "b"));
         ZINF_RETURN_IF_ERROR(read_masters(e, model, &loaded));
         expect_equal(loaded, at4, "b resharded to one rank");
         return Status::ok();
       })) {
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
}

TEST(CheckpointLink, FlippedBitInALinkedFileIsCorruptionNamingIt) {
  engine_test::ScratchDir scratch("ckpt-link-flip");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = page_model(32);
  const Config config = link_config(scratch.path());
  for (const Status& st : with_engines(config, model, 1, [&](int rank, Engine&e) -> Status {
         ZINF_RETURN_IF_ERROR(train(e, model, rank, 1, 2));
         return e.save_checkpoint(dir, "a");
       })) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  const std::string victim = dir + "/a/rank0.zinfckpt";
  const CheckpointManifest m = manifest(dir + "/a");
  ASSERT_FALSE(m.ranks.at(0).blocks.empty());
  // A byte of the first moment.
  ASSERT_TRUE(
      engine_test::flip_bits(victim, 4096 + m.partition_elements * sizeof(float) + 999, 0x01));
  // Resharded (two ranks): every block is checked before any is read, so the load fails.
  std::vector<Status> st =
      with_engines(config, model, 2, [&](int, Engine& e) { return e.load_checkpoint(dir, "a"); });
  EXPECT_EQ(st[0].code(), Code::kCorruption) << st[0].to_string();
  EXPECT_NE(st[0].message().find(victim), std::string::npos) << st[0].to_string();
  EXPECT_NE(st[0].message().find("checksum"), std::string::npos) << st[0].to_string();
  // The same layout takes the file in place and checks each block when it is first read: the
  // moment's block at the first step, whose error names the file.
  Status stepped;
  st = with_engines(config, model, 1, [&](int rank, Engine& e) -> Status {
    ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "a"));
    stepped = train(e, model, rank, 3, 3);
    // The step may run on after step() returned (overlap_step): the next call meets its error.
    Masters after;
    if (stepped.is_ok()) stepped = read_masters(e, model, &after);
    return Status::ok();
  });
  EXPECT_TRUE(st[0].is_ok()) << st[0].to_string();
  EXPECT_EQ(stepped.code(), Code::kCorruption) << stepped.to_string();
  EXPECT_NE(stepped.message().find(victim), std::string::npos) << stepped.to_string();
  EXPECT_NE(stepped.message().find("checksum"), std::string::npos) << stepped.to_string();
  // A flipped bit in the master is met by the load itself (it republishes from the master).
  ASSERT_TRUE(engine_test::flip_bits(victim, 4096 + 5, 0x40));
  st = with_engines(config, model, 1, [&](int, Engine& e) { return e.load_checkpoint(dir, "a"); });
  EXPECT_EQ(st[0].code(), Code::kCorruption) << st[0].to_string();
  EXPECT_NE(st[0].message().find(victim), std::string::npos) << st[0].to_string();
}

// A load that takes a linked file in place reads nothing of it but the header, whose loss scaler
// no manifest field repeats: a flipped bit there is kCorruption naming the file, found before the
// state is touched (the engine stays usable and loads an intact tag next).
TEST(CheckpointLink, FlippedBitInALinkedHeaderIsCorruptionNamingIt) {
  engine_test::ScratchDir scratch("ckpt-link-head");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = page_model(34);
  const Config config = link_config(scratch.path());
  Masters at2;
  for (const Status& st : with_engines(config, model, 1, [&](int rank, Engine&e) -> Status {
         ZINF_RETURN_IF_ERROR(train(e, model, rank, 1, 2));
         ZINF_RETURN_IF_ERROR(read_masters(e, model, &at2));
         ZINF_RETURN_IF_ERROR(e.save_checkpoint(dir, "a"));
         ZINF_RETURN_IF_ERROR(train(e, model, rank, 3, 3));
         return e.save_checkpoint(dir, "b");
       })) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  const std::string victim = dir + "/b/rank0.zinfckpt";
  ASSERT_FALSE(manifest(dir + "/b").ranks.at(0).blocks.empty());
  // loss_scale_good_steps, at byte 64 of the header.
  ASSERT_TRUE(engine_test::flip_bits(victim, 64, 0x02));
  const std::vector<Status> st = with_engines(config, model, 1, [&](int, Engine& e) -> Status {
    const Status loaded = e.load_checkpoint(dir, "b");
    EXPECT_EQ(loaded.code(), Code::kCorruption) << loaded.to_string();
    EXPECT_NE(loaded.message().find(victim), std::string::npos) << loaded.to_string();
    EXPECT_NE(loaded.message().find("header"), std::string::npos) << loaded.to_string();
    Masters back;
    ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "a"));
    ZINF_RETURN_IF_ERROR(read_masters(e, model, &back));
    expect_equal(back, at2, "tag a after the refused load of tag b");
    return Status::ok();
  });
  EXPECT_TRUE(st[0].is_ok()) << st[0].to_string();
}

// Two engines of one rank in one process with one NVMe directory share the swap file's name; the
// one opened second takes it. The first's save then cannot link its swap file by that name and
// copies its state instead, and the checkpoint loads the first engine's masters.
TEST(CheckpointLink, AnEngineWhoseSwapNameWasTakenSavesByCopy) {
  engine_test::ScratchDir scratch("ckpt-link-two-engines");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = page_model(35);
  const Config config = link_config(scratch.path());
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  engine_test::Ranks other_ranks = engine_test::make_ranks(1);
  auto open = [&](engine_test::Ranks& r) -> Result<std::unique_ptr<Engine>> {
    Env env;
    env.device = r.devices[0].get();
    env.comm = r.comms[0].get();
    return Engine::open(config, env);
  };
  Result<std::unique_ptr<Engine>> first = open(ranks);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  ASSERT_TRUE(train(**first, model, 0, 1, 2).is_ok());
  Masters at2;
  ASSERT_TRUE(read_masters(**first, model, &at2).is_ok());
  Result<std::unique_ptr<Engine>> second = open(other_ranks);
  ASSERT_TRUE(second.is_ok()) << second.status().to_string();
  ASSERT_TRUE(train(**second, model, 0, 1, 1).is_ok());  // its own, other state in its file
  const Status saved = (*first)->save_checkpoint(dir, "a");
  ASSERT_TRUE(saved.is_ok()) << saved.to_string();
  const CheckpointManifest m = manifest(dir + "/a");
  ASSERT_EQ(m.ranks.size(), 1u);
  EXPECT_TRUE(m.ranks[0].blocks.empty()) << "linked a swap file of another engine?";
  first->reset();
  second->reset();
  for (const Status& st : with_engines(config, model, 1, [&](int, Engine& e) -> Status {
         Masters loaded;
         ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, "a"));
         ZINF_RETURN_IF_ERROR(read_masters(e, model, &loaded));
         expect_equal(loaded, at2, "the first engine's checkpoint");
         return Status::ok();
       })) {
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
}

TEST(CheckpointLink, CheckpointOnAnotherFilesystemIsCopied) {
  const std::string shm = "/dev/shm";
  engine_test::ScratchDir scratch("ckpt-link-xdev");
  struct stat a {
  }, b{};
  if (::stat(shm.c_str(), &a) != 0 || ::stat(scratch.path().c_str(), &b) != 0 ||
      a.st_dev == b.st_dev) {
    GTEST_SKIP() << "no second filesystem at " << shm;
  }
  const std::string dir = fmt::format("{}/zinf-ckpt-link-xdev-{}", shm, ::getpid());
  std::filesystem::remove_all(dir);
  const Model model = page_model(33);
  const Config config = link_config(scratch.path());
  Masters at2;
  for (const Status& st : with_engines(config, model, 1, [&](int rank, Engine&e) -> Status {
         ZINF_RETURN_IF_ERROR(train(e, model, rank, 1, 2));
         ZINF_RETURN_IF_ERROR(read_masters(e, model, &at2));
         return e.save_checkpoint(dir, "a");
       })) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  const CheckpointManifest m = manifest(dir + "/a");
  ASSERT_EQ(m.ranks.size(), 1u);
  EXPECT_TRUE(m.ranks[0].blocks.empty()) << "linked across filesystems?";
  EXPECT_EQ(std::filesystem::file_size(dir + "/a/rank0.zinfckpt"), m.ranks[0].bytes);
  EXPECT_EQ(link_count(dir + "/a/rank0.zinfckpt"), 1u);
  for (const Status& st : with_engines(config, model, 1, [&](int, Engine& e) -> Status {
         Masters loaded;
         ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir));
         ZINF_RETURN_IF_ERROR(read_masters(e, model, &loaded));
         expect_equal(loaded, at2, "copied checkpoint");
         return Status::ok();
       })) {
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace zinf
