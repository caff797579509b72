// Names shared by the config's reader (config.cpp) and its checker and writer
// (config_write.cpp).
#pragma once

#include <string_view>

#include "zinf/optim.hpp"

namespace zinf {

// The DeepSpeed spelling of each optimizer kind (DeepSpeed lowercases the type before it
// compares, so any case is accepted on input).
std::string_view deepspeed_type_name(OptimizerKind kind);

}  // namespace zinf
