// The libFuzzer entry of one target: scripts/fuzz compiles this file once per target with
// -DZINF_FUZZ_ENTRY=<name> (a function of targets/targets.hpp).
#include "targets/targets.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t bytes) {
  return zinf::fuzz::ZINF_FUZZ_ENTRY(data, bytes);
}
