# Installs the zinf build in ZINF_BUILD_DIR into a fresh prefix, then compiles ZINF_SOURCE (a C
# program) with the C compiler alone and the flags of `pkg-config --static --cflags --libs zinf`
# (the installed zinf.pc, found through PKG_CONFIG_PATH), and runs it. Without pkg-config the test
# says so and is skipped (tests/CMakeLists.txt: SKIP_REGULAR_EXPRESSION).
find_program(pkg_config NAMES pkg-config pkgconf)
if(NOT pkg_config)
  message(STATUS "SKIPPED: pkg-config is not installed (Debian: apt-get install pkg-config)")
  return()
endif()
file(REMOVE_RECURSE "${ZINF_WORK_DIR}")
set(prefix "${ZINF_WORK_DIR}/prefix")

include("${CMAKE_CURRENT_LIST_DIR}/../../package/package_steps.cmake")

run_step("install" ${CMAKE_COMMAND} --install "${ZINF_BUILD_DIR}" --prefix "${prefix}")
file(GLOB_RECURSE pc_files "${prefix}/*/zinf.pc")
list(LENGTH pc_files pc_count)
if(NOT pc_count EQUAL 1)
  message(FATAL_ERROR "expected one zinf.pc under ${prefix}, found: ${pc_files}")
endif()
get_filename_component(pc_dir "${pc_files}" DIRECTORY)
set(ENV{PKG_CONFIG_PATH} "${pc_dir}")
run_step("pkg-config" ${pkg_config} --static --cflags --libs zinf)
string(STRIP "${step_output}" flags)
message(STATUS "flags: ${flags}")
separate_arguments(flags UNIX_COMMAND "${flags}")
run_step("compile" ${CMAKE_C_COMPILER} -std=c99 -Wall -Wextra -Werror "${ZINF_SOURCE}"
         -o "${ZINF_WORK_DIR}/hello" ${flags})
run_step("run" "${ZINF_WORK_DIR}/hello")
message(STATUS "program said: ${step_output}")
if(NOT step_output MATCHES "zinf pkg-config consumer ok")
  message(FATAL_ERROR "the program did not report success: ${step_output}")
endif()
