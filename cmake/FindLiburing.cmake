# Finds liburing, which ships a pkg-config file but no CMake config.
# Defines Liburing::liburing and Liburing_FOUND.
find_path(Liburing_INCLUDE_DIR NAMES liburing.h)
find_library(Liburing_LIBRARY NAMES uring)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Liburing REQUIRED_VARS Liburing_LIBRARY Liburing_INCLUDE_DIR)
if(Liburing_FOUND AND NOT TARGET Liburing::liburing)
  add_library(Liburing::liburing UNKNOWN IMPORTED)
  set_target_properties(Liburing::liburing PROPERTIES
    IMPORTED_LOCATION "${Liburing_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${Liburing_INCLUDE_DIR}")
endif()
mark_as_advanced(Liburing_INCLUDE_DIR Liburing_LIBRARY)
