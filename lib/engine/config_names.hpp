// Names shared by the config's reader (config.cpp), its checker and writer (config_write.cpp),
// and the scheduler section's reader (schedule.cpp).
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "zinf/optim.hpp"

namespace zinf {

// The DeepSpeed spelling of each optimizer kind (DeepSpeed lowercases the type before it
// compares, so any case is accepted on input).
std::string_view deepspeed_type_name(OptimizerKind kind);

// A hint for an unknown key `name` that looks like a slip of one of `known`, the keys of its
// section: `keys are case-sensitive: "<key>"` when it differs from one only in case, else
// `did you mean "<key>"?` naming the nearest one within two edits (insertion, deletion,
// substitution, swap of two neighbours; one for a name of 3 to 5 characters, none for a shorter
// one, one in ten characters for a name of 30 or more); the first of equally near ones. Nothing
// when none is that near. Every section's unknown keys are refused with it, so that a slip reads
// the same wherever it is made (the scheduler's parameters are checked in schedule.cpp).
std::optional<std::string> misspelling_hint(std::span<const std::string_view> known,
                                            std::string_view name);

}  // namespace zinf
