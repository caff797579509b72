// Parsing of DeepSpeed's `scheduler` section into a ScheduleConfig (include/zinf/schedule.hpp).
#pragma once

#include <nlohmann/json.hpp>

#include "zinf/schedule.hpp"
#include "zinf/status.hpp"

namespace zinf {

// Reads `section`, the value of the "scheduler" key (in file order, so the first unknown key
// named is the file's first): {"type": ..., "params": {...}}. Every key is
// acted on or refused: an unknown type (LRRangeTest included) or an unknown key fails with
// kInvalidArgument naming it ("scheduler.type", "scheduler.params.<key>"), as does a value of the
// wrong kind. The values are checked fully by LrSchedule::create(), which needs the optimizer's lr.
Status parse_scheduler_section(const nlohmann::ordered_json& section, ScheduleConfig* out);

}  // namespace zinf
