# Finds xxHash (Debian: libxxhash-dev), which ships no CMake config.
# Defines XxHash::xxhash and XxHash_FOUND.
find_path(XxHash_INCLUDE_DIR NAMES xxhash.h)
find_library(XxHash_LIBRARY NAMES xxhash)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(XxHash REQUIRED_VARS XxHash_LIBRARY XxHash_INCLUDE_DIR)
if(XxHash_FOUND AND NOT TARGET XxHash::xxhash)
  add_library(XxHash::xxhash UNKNOWN IMPORTED)
  set_target_properties(XxHash::xxhash PROPERTIES
    IMPORTED_LOCATION "${XxHash_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${XxHash_INCLUDE_DIR}")
endif()
mark_as_advanced(XxHash_INCLUDE_DIR XxHash_LIBRARY)
