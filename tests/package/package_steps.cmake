# Steps shared by the installed-package tests (run_consumer.cmake, run_moved_prefix.cmake,
# run_readme.cmake, tests/capi/pkg_config/run.cmake), included by those `cmake -P` scripts.

# Runs a command; fails the test with its output when it fails. The output is left in
# step_output.
function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok")
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

# The environment of a machine without the CUDA toolkit, for `cmake -E env ${no_cuda_env}`: PATH
# without any CUDA directory, and nothing pointing at one.
function(hidden_cuda_env out_var)
  set(path_entries "$ENV{PATH}")
  string(REPLACE ":" ";" path_entries "${path_entries}")
  list(FILTER path_entries EXCLUDE REGEX "cuda")
  string(REPLACE ";" ":" path "${path_entries}")
  set(${out_var} --unset=CUDA_PATH --unset=CUDA_HOME --unset=CUDACXX --unset=CUDAToolkit_ROOT
                 "PATH=${path}" PARENT_SCOPE)
endfunction()

# Fails when a file of the installed package names `text` (an absolute path of this machine).
function(expect_no_path_in_package prefix text)
  file(GLOB_RECURSE files "${prefix}/lib*/cmake/zinf/*.cmake")
  foreach(f IN LISTS files)
    file(READ "${f}" content)
    string(FIND "${content}" "${text}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "${f} refers to ${text}: the package is not relocatable")
    endif()
  endforeach()
endfunction()
