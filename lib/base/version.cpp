#include "zinf/version.hpp"

namespace zinf {
const char* version() { return ZINF_VERSION; }
}  // namespace zinf
