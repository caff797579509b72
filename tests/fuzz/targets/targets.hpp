// The fuzz targets: each takes arbitrary bytes to one parser of the project's inputs and checks
// what must hold of every input (no crash, no undefined behaviour, and for text that parses, that
// printing and parsing again gives the same value). Each returns 0, as libFuzzer expects.
//
// scripts/fuzz builds each target as a libFuzzer binary with clang (fuzz_<name>, through
// libfuzzer_main.cpp); the normal build links them all into zinf_fuzz_test, which feeds them the
// seed corpus (tests/fuzz/corpus/<name>/) and every input a fuzzer ever crashed on
// (tests/fuzz/regressions/<name>/).
#pragma once

#include <cstddef>
#include <cstdint>

namespace zinf::fuzz {

// zinf::parse_config (the engine's JSON config, the public API).
int config(const std::uint8_t* data, std::size_t bytes);
// The TCP bootstrap's wire messages: hello and reply header decoders.
int tcp_wire(const std::uint8_t* data, std::size_t bytes);
// `zinf plan`'s model description: the --params size text, layers and hidden size, and the
// JSON it reads (a machine profile, a plan config).
int plan_input(const std::uint8_t* data, std::size_t bytes);
// The checkpoint file's header (decode_checkpoint_header, with an encode-back check).
int checkpoint_header(const std::uint8_t* data, std::size_t bytes);
// The checkpoint manifest (parse_checkpoint_manifest, with a write-back check).
int checkpoint_manifest(const std::uint8_t* data, std::size_t bytes);

}  // namespace zinf::fuzz
