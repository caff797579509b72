// The library's version, as "MAJOR.MINOR.PATCH".
#pragma once

namespace zinf {
const char* version();
}  // namespace zinf
