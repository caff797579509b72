# The README's hello world, as a reader would use it: installs the zinf build in ZINF_BUILD_DIR,
# writes the first ```cpp block after the README's "## Hello world" heading to hello.cpp and the
# first ```cmake block after it to CMakeLists.txt, builds that project against the installed
# package and runs it. It passes when the program succeeds and its last printed loss is at most
# half its first. With ZINF_HIDE_CUDA, the consumer is configured, built and run as on a machine
# without the CUDA toolkit (PATH without it, CUDAToolkit_ROOT pointing nowhere, its prefix
# ignored): zinf::zinf must need no CUDA.
include(${CMAKE_CURRENT_LIST_DIR}/package_steps.cmake)
file(REMOVE_RECURSE "${ZINF_WORK_DIR}")
set(prefix "${ZINF_WORK_DIR}/prefix")
set(source "${ZINF_WORK_DIR}/hello")
set(build "${ZINF_WORK_DIR}/build")
run_step("install" ${CMAKE_COMMAND} --install "${ZINF_BUILD_DIR}" --prefix "${prefix}")

# The code blocks, exactly as the README shows them.
function(readme_block text fence out_var)
  string(FIND "${text}" "${fence}\n" begin)
  if(begin EQUAL -1)
    message(FATAL_ERROR "README: no ${fence} block after the hello-world heading")
  endif()
  string(LENGTH "${fence}\n" fence_length)
  math(EXPR begin "${begin} + ${fence_length}")
  string(SUBSTRING "${text}" ${begin} -1 rest)
  string(FIND "${rest}" "```" end)
  string(SUBSTRING "${rest}" 0 ${end} block)
  set(${out_var} "${block}" PARENT_SCOPE)
endfunction()
file(READ "${ZINF_README}" readme)
string(FIND "${readme}" "\n## Hello world" heading)
if(heading EQUAL -1)
  message(FATAL_ERROR "${ZINF_README} has no '## Hello world' section")
endif()
string(SUBSTRING "${readme}" ${heading} -1 readme)
readme_block("${readme}" "```cpp" code)
readme_block("${readme}" "```cmake" lists)
file(WRITE "${source}/hello.cpp" "${code}")
file(WRITE "${source}/CMakeLists.txt" "${lists}")

set(env)
set(hide)
if(ZINF_HIDE_CUDA)
  hidden_cuda_env(env)
  set(hide -DCUDAToolkit_ROOT=/nonexistent-cuda -DCMAKE_IGNORE_PREFIX_PATH=/usr/local/cuda)
endif()
run_step("configure hello" ${CMAKE_COMMAND} -E env ${env}
         ${CMAKE_COMMAND} -S "${source}" -B "${build}" -DCMAKE_PREFIX_PATH=${prefix}
         -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER} ${hide})
run_step("build hello" ${CMAKE_COMMAND} -E env ${env} ${CMAKE_COMMAND} --build "${build}")
if(ZINF_HIDE_CUDA)
  file(STRINGS "${build}/CMakeCache.txt" cuda_lines REGEX "^CUDAToolkit_.*(/usr/local/cuda)")
  if(cuda_lines)
    message(FATAL_ERROR "the consumer found the CUDA toolkit it was to go without: ${cuda_lines}")
  endif()
endif()
# The program runs where a user would run it: its NVMe directory is relative to the working one.
file(MAKE_DIRECTORY "${ZINF_WORK_DIR}/run")
if(NOT ZINF_ENGINE_CREATES_NVME_DIR)
  # Until Engine::open creates a missing NVMe directory itself.
  file(MAKE_DIRECTORY "${ZINF_WORK_DIR}/run/hello-nvme")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env ${env} "${build}/hello"
                WORKING_DIRECTORY "${ZINF_WORK_DIR}/run"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message(STATUS "hello said:\n${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "hello failed (${rc})")
endif()

# "step   1  loss 0.2861": the first and the last loss, in units of 1e-4.
string(REGEX MATCHALL "loss [0-9]+\\.[0-9][0-9][0-9][0-9]" losses "${out}")
list(LENGTH losses count)
if(count LESS 2)
  message(FATAL_ERROR "hello printed fewer than two losses")
endif()
list(GET losses 0 first)
list(GET losses -1 last)
foreach(var first last)
  string(REGEX REPLACE "loss 0*([0-9]*)\\.([0-9]+)" "\\1\\2" digits "${${var}}")
  string(REGEX REPLACE "^0+" "" digits "${digits}")
  if(digits STREQUAL "")
    set(digits 0)
  endif()
  set(${var}_units ${digits})
endforeach()
math(EXPR twice_last "2 * ${last_units}")
if(twice_last GREATER first_units)
  message(FATAL_ERROR "the loss did not halve: first ${first}, last ${last}")
endif()
message(STATUS "the loss fell from ${first} to ${last}")
