// zinf ckpt export / inspect (checkpoint_export.cpp). A two-rank stage-3 checkpoint exported as
// safetensors: the file follows the format byte for byte (8-byte little-endian header length, a
// JSON header of dtype/shape/data_offsets padded to 8 bytes, tensors back to back in name order)
// and each tensor equals read_parameters() of the engine that saved it (bf16: rounded to nearest
// even). The Python `safetensors` package (build/venv, from scripts/test) loads it to the same
// values; without that venv the test says so and skips. inspect lists the tags and finds a
// flipped byte.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine_test_util.hpp"
#include "plan/cli_test_util.hpp"
#include "safetensors_test_util.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

using engine_test::Model;

// Trains 3 steps on 2 ranks (stage 3, 8 parameters sharded across both), saves tag "t" and
// returns every parameter's master by name.
std::map<std::string, std::vector<float>> save_two_ranks(const Model& model,
                                                         const std::string& dir) {
  std::map<std::string, std::vector<float>> out;
  const Config config =
      engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, "");
  engine_test::Ranks ranks = engine_test::make_ranks(2);
  std::vector<Status> st = engine_test::run_ranks(2, [&](int rank) -> Status {
    Env env;
    env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
    env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
    ZINF_ASSIGN_OR_RETURN(auto e, Engine::open(config, env));
    engine_test::TrainOptions options;
    options.steps = 3;
    ZINF_RETURN_IF_ERROR(engine_test::train_rank(*e, model, rank, options, nullptr, nullptr));
    e->set_client_state("a data loader's position: epoch 3, batch 1234");
    ZINF_RETURN_IF_ERROR(e->save_checkpoint(dir, "t"));
    for (const engine_test::ParamDef& d : model.params) {
      std::vector<float> values(d.element_count());
      ZINF_RETURN_IF_ERROR(e->read_parameters(d.name, values.data()));
      if (rank == 0) out[d.name] = std::move(values);
    }
    return Status::ok();
  });
  for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << s.to_string();
  return out;
}

TEST(CheckpointExport, SafetensorsBytesEqualReadParameters) {
  engine_test::ScratchDir scratch("ckpt-export");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 31);
  const std::map<std::string, std::vector<float>> masters = save_two_ranks(model, dir);
  ASSERT_FALSE(::testing::Test::HasFailure());
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const std::string path = scratch.path() + "/model.safetensors";
    const Status st = export_checkpoint_safetensors(dir, "", path, dtype);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    engine_test::SafetensorsFile exported;
    ASSERT_NO_FATAL_FAILURE(engine_test::read_safetensors(path, exported));
    const std::string& file = exported.bytes;
    const std::uint64_t header_bytes = exported.header_bytes;
    const nlohmann::json& header = exported.header;
    EXPECT_EQ(header_bytes % 8, 0u);
    const std::size_t data = 8 + header_bytes;
    EXPECT_EQ(header["__metadata__"]["zinf_tag"], "t");
    EXPECT_EQ(header["__metadata__"]["zinf_step"], "3");
    std::uint64_t expect_begin = 0;
    std::size_t tensors = 0;
    const std::size_t width = dtype == DType::kF32 ? 4 : 2;
    for (const auto& [name, want] : masters) {  // std::map: name order, as the file's
      ASSERT_TRUE(header.contains(name)) << name;
      const nlohmann::json& t = header[name];
      EXPECT_EQ(t["dtype"], dtype == DType::kF32 ? "F32" : "BF16");
      const std::uint64_t begin = t["data_offsets"][0], end = t["data_offsets"][1];
      EXPECT_EQ(begin, expect_begin) << name << ": tensors back to back in name order";
      ASSERT_EQ(end - begin, want.size() * width) << name;
      std::size_t elements = 1;
      for (const auto& d : t["shape"]) elements *= d.get<std::size_t>();
      EXPECT_EQ(elements, want.size()) << name;
      if (dtype == DType::kF32) {
        EXPECT_EQ(std::memcmp(file.data() + data + begin, want.data(), end - begin), 0) << name;
      } else {
        std::vector<std::uint16_t> half(want.size());
        for (std::size_t i = 0; i < want.size(); ++i) half[i] = f32_to_bf16(want[i]);
        EXPECT_EQ(std::memcmp(file.data() + data + begin, half.data(), end - begin), 0) << name;
      }
      expect_begin = end;
      ++tensors;
    }
    EXPECT_EQ(tensors + 1, header.size()) << "one entry per parameter and __metadata__";
    EXPECT_EQ(data + expect_begin, file.size()) << "nothing after the last tensor";
  }
}

// build/venv/bin/python beside this test's build directory, or $ZINF_VENV_PYTHON.
std::string venv_python() {
  if (const char* p = std::getenv("ZINF_VENV_PYTHON")) return p;
  char exe[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return "";
  return (std::filesystem::path(std::string(exe, static_cast<std::size_t>(n))).parent_path() /
          ".." / "venv" / "bin" / "python")
      .lexically_normal()
      .string();
}

TEST(CheckpointExport, PythonSafetensorsLoadsTheSameValues) {
  const std::string python = venv_python();
  if (python.empty() || !std::filesystem::exists(python)) {
    GTEST_SKIP() << "no Python venv with safetensors at '" << python
                 << "' (scripts/test makes build/venv; or set ZINF_VENV_PYTHON)";
  }
  engine_test::ScratchDir scratch("ckpt-export-py");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 32);
  const std::map<std::string, std::vector<float>> masters = save_two_ranks(model, dir);
  ASSERT_FALSE(::testing::Test::HasFailure());
  // The reference values, as raw f32 in name order, and the names.
  nlohmann::json names = nlohmann::json::array();
  {
    std::ofstream ref(scratch.path() + "/ref.bin", std::ios::binary);
    for (const auto& [name, values] : masters) {
      names.push_back(name);
      ref.write(reinterpret_cast<const char*>(values.data()),
                static_cast<std::streamsize>(values.size() * 4));
    }
  }
  std::ofstream(scratch.path() + "/names.json") << names.dump();
  for (const char* dtype : {"fp32", "bf16"}) {
    const std::string path = scratch.path() + "/" + dtype + ".safetensors";
    ASSERT_TRUE(export_checkpoint_safetensors(
                    dir, "t", path, std::string(dtype) == "fp32" ? DType::kF32 : DType::kBF16)
                    .is_ok());
  }
  const std::string script = scratch.path() + "/check.py";
  std::ofstream(script) << R"(import json, sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file
root = sys.argv[1]
names = json.load(open(root + "/names.json"))
ref = torch.frombuffer(bytearray(open(root + "/ref.bin", "rb").read()), dtype=torch.float32)
for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    tensors = load_file(root + "/" + dtype + ".safetensors")
    assert sorted(tensors) == names, (sorted(tensors), names)
    with safe_open(root + "/" + dtype + ".safetensors", "pt") as f:
        assert f.metadata()["zinf_tag"] == "t", f.metadata()
    at = 0
    for name in names:
        t = tensors[name]
        want = ref[at:at + t.numel()].reshape(t.shape).to(torch_dtype)
        at += t.numel()
        assert t.dtype == torch_dtype, (name, t.dtype)
        assert torch.equal(t, want), name
print("safetensors", len(names), "tensors equal in fp32 and bf16")
)";
  const std::string command = python + " " + script + " " + scratch.path() + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
  const int rc = ::pclose(pipe);
  std::printf("%s", output.c_str());
  EXPECT_EQ(rc, 0) << output;
}

TEST(CheckpointExport, InspectListsTagsAndFindsAFlippedByte) {
  engine_test::ScratchDir scratch("ckpt-inspect");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 33);
  save_two_ranks(model, dir);
  Result<nlohmann::json> info = inspect_checkpoints(dir, true);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  EXPECT_EQ((*info)["latest"], "t");
  ASSERT_EQ((*info)["tags"].size(), 1u);
  const nlohmann::json& t = (*info)["tags"][0];
  EXPECT_EQ(t["world_size"], 2);
  EXPECT_EQ(t["stage"], 3);
  EXPECT_EQ(t["step"], 3);
  EXPECT_EQ(t["parameters"], model.params.size());
  EXPECT_EQ(t["checksums"], "ok");
  const std::string victim = dir + "/t/rank1.zinfckpt";
  std::string bytes = engine_test::read_file(victim);
  bytes[5000] = static_cast<char>(bytes[5000] ^ 4);
  std::ofstream(victim, std::ios::binary | std::ios::trunc) << bytes;
  info = inspect_checkpoints(dir, true);
  ASSERT_TRUE(info.is_ok());
  const std::string checksums = (*info)["tags"][0]["checksums"];
  EXPECT_NE(checksums.find(victim), std::string::npos) << checksums;
  // The failed check is a problem too (what `zinf ckpt inspect` exits 1 on, --json or not).
  ASSERT_EQ((*info)["problems"].size(), 1u) << (*info)["problems"].dump();
  EXPECT_EQ((*info)["problems"][0], "tag t: " + checksums);
  if (const std::string zinf = plan::zinf_binary(); zinf.empty()) {
    std::printf("bin/zinf is not built (target zinf_cli): its exit code is not checked\n");
  } else {
    std::string out;
    EXPECT_EQ(plan::run_command(zinf + " ckpt inspect --json " + dir + " 2>&1", &out), 1) << out;
    EXPECT_NE(out.find("\"problems\""), std::string::npos) << out;
    EXPECT_EQ(plan::run_command(zinf + " ckpt inspect " + dir + " 2>&1", &out), 1) << out;
    EXPECT_NE(out.find("FAILED (below)"), std::string::npos) << out;
    EXPECT_NE(out.find("problem: tag t: '" + victim), std::string::npos) << out;
  }
  bytes[5000] = static_cast<char>(bytes[5000] ^ 4);  // mended
  std::ofstream(victim, std::ios::binary | std::ios::trunc) << bytes;
  info = inspect_checkpoints(dir, true);
  ASSERT_TRUE(info.is_ok());
  EXPECT_TRUE((*info)["problems"].empty()) << (*info)["problems"].dump();
  // What a load would refuse, each named in `problems`: the client state changed; a copy of the
  // tag whose manifest does not parse; a save cut short; `latest` naming a tag that is not there.
  {
    const std::string client = dir + "/t/client_state.bin";
    ASSERT_TRUE(std::filesystem::exists(client));
    std::string blob = engine_test::read_file(client);
    blob[3] = static_cast<char>(blob[3] ^ 1);
    std::ofstream(client, std::ios::binary | std::ios::trunc) << blob;
    info = inspect_checkpoints(dir, true);
    ASSERT_TRUE(info.is_ok());
    const std::string c = (*info)["tags"][0]["checksums"];
    EXPECT_NE(c.find("client_state.bin' does not match"), std::string::npos) << c;
    std::filesystem::create_directories(dir + "/u");
    std::ofstream(dir + "/u/manifest.json") << "{ not json";
    std::filesystem::create_directories(dir + "/.v.tmp");
    std::filesystem::create_directories(dir + "/tensorboard");  // the program's, not a tag
    std::ofstream(dir + "/latest", std::ios::trunc) << "w";
    info = inspect_checkpoints(dir, true);
    ASSERT_TRUE(info.is_ok()) << info.status().to_string();
    const std::string problems = (*info)["problems"].dump();
    EXPECT_EQ((*info)["problems"].size(), 3u) << problems;
    EXPECT_NE(problems.find("tag t: '" + client + "' does not match"), std::string::npos)
        << problems;
    EXPECT_NE(problems.find("names tag 'w', which is not a complete checkpoint"), std::string::npos)
        << problems;
    EXPECT_NE(problems.find("tag 'u' is not a complete checkpoint"), std::string::npos) << problems;
    const std::string notes = (*info)["notes"].dump();
    EXPECT_NE(notes.find(".v.tmp': a save in progress or cut short"), std::string::npos) << notes;
    EXPECT_EQ(problems.find("tensorboard"), std::string::npos) << problems;
  }
  // A directory with no checkpoint, and no directory at all: kNotFound naming the path.
  const std::string empty = scratch.path() + "/empty";
  std::filesystem::create_directories(empty);
  for (const std::string& missing : {empty, scratch.path() + "/no-such-dir"}) {
    const Status st = inspect_checkpoints(missing, true).status();
    EXPECT_EQ(st.code(), Code::kNotFound) << st.to_string();
    EXPECT_NE(st.message().find("'" + missing + "'"), std::string::npos) << st.to_string();
  }
}

// One walk of the directory gives both the complete tags (every save and load) and, when asked,
// what inspect reports: a copy of tag t under another name (its manifest names t), a tag whose
// manifest is gone but whose rank file is there, and a save cut short. A directory of the
// program's, a stale ".old" and a file named like a save in progress are none of those; the
// ".old" is a note, as the save cut short is.
TEST(CheckpointExport, ListedTagsAndRefusedOnesComeFromOneWalk) {
  engine_test::ScratchDir scratch("ckpt-refused");
  const std::string dir = scratch.path() + "/ckpt";
  save_two_ranks(engine_test::make_model(DType::kF32, 33), dir);
  namespace fs = std::filesystem;
  fs::copy(dir + "/t", dir + "/copy", fs::copy_options::recursive);
  fs::create_directories(dir + "/torn");
  fs::copy(dir + "/t/rank0.zinfckpt", dir + "/torn/rank0.zinfckpt");
  fs::create_directories(dir + "/.v.tmp");
  fs::create_directories(dir + "/.w.old");
  fs::create_directories(dir + "/tensorboard");
  std::ofstream(dir + "/tensorboard/events") << "not a checkpoint";
  std::ofstream(dir + "/.x.tmp") << "a file, not a save";
  Result<std::unique_ptr<IoEngine>> io = open_checkpoint_io(nullptr);
  ASSERT_TRUE(io.is_ok()) << io.status().to_string();

  std::vector<CheckpointManifest> tags = list_checkpoint_tags(**io, dir);
  ASSERT_EQ(tags.size(), 1u);
  EXPECT_EQ(tags[0].tag, "t");

  RefusedCheckpointTags refused;
  refused.temp_dirs.push_back("left from before: cleared");
  tags = list_checkpoint_tags(**io, dir, &refused);
  ASSERT_EQ(tags.size(), 1u);
  EXPECT_EQ(tags[0].tag, "t");
  std::map<std::string, std::string> reasons;
  for (const RefusedCheckpointTags::Tag& t : refused.tags) reasons[t.tag] = t.reason;
  ASSERT_EQ(reasons.size(), 2u);
  EXPECT_EQ(reasons["copy"], "its manifest names tag 't'");
  EXPECT_NE(reasons["torn"].find(dir + "/torn/manifest.json"), std::string::npos)
      << reasons["torn"];
  EXPECT_EQ(refused.temp_dirs, std::vector<std::string>{dir + "/.v.tmp"});
  EXPECT_EQ(refused.old_dirs, std::vector<std::string>{dir + "/.w.old"});

  Result<nlohmann::json> info = inspect_checkpoints(dir, false);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  const nlohmann::json& problems = (*info)["problems"];
  ASSERT_EQ(problems.size(), 2u) << problems.dump();
  std::vector<std::string> texts = {problems[0], problems[1]};
  std::sort(texts.begin(), texts.end());
  EXPECT_EQ(texts[0], "tag 'copy' is not a complete checkpoint: its manifest names tag 't'");
  EXPECT_EQ(texts[1], "tag 'torn' is not a complete checkpoint: " + reasons["torn"]);
  ASSERT_EQ((*info)["notes"].size(), 2u);
  EXPECT_EQ((*info)["notes"][0], "'" + dir +
                                     "/.v.tmp': a save in progress or cut short (the next save "
                                     "into this directory removes it)");
  EXPECT_EQ((*info)["notes"][1], "'" + dir +
                                     "/.w.old': a tag a save was removing (pruned by keep_last, "
                                     "or a leftover it replaced) when it was cut short; no load "
                                     "reads it, and the next save into this directory removes "
                                     "it");
}

}  // namespace
}  // namespace zinf
