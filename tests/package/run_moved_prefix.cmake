# Installs the zinf build in ZINF_BUILD_DIR into one prefix, moves the prefix elsewhere, and builds
# and runs the consumer in ZINF_CONSUMER_SOURCE from the new place, so that nothing in the package
# may refer to where it was installed. With ZINF_HAS_CUDA, a second consumer asks for the cuda
# component (find_package(zinf COMPONENTS cuda)) and links zinf::cuda, also from the new place.
include(${CMAKE_CURRENT_LIST_DIR}/package_steps.cmake)
file(REMOVE_RECURSE "${ZINF_WORK_DIR}")
set(first "${ZINF_WORK_DIR}/first-prefix")
set(moved "${ZINF_WORK_DIR}/moved/prefix")
run_step("install" ${CMAKE_COMMAND} --install "${ZINF_BUILD_DIR}" --prefix "${first}")
file(MAKE_DIRECTORY "${ZINF_WORK_DIR}/moved")
file(RENAME "${first}" "${moved}")
expect_no_path_in_package("${moved}" "${first}")
expect_no_path_in_package("${moved}" "/usr/local/cuda")
set(consumers "${ZINF_CONSUMER_SOURCE}")
if(ZINF_HAS_CUDA)
  list(APPEND consumers "${ZINF_CONSUMER_SOURCE}/cuda_component")
endif()
foreach(source IN LISTS consumers)
  get_filename_component(name "${source}" NAME)
  set(build "${ZINF_WORK_DIR}/build-${name}")
  run_step("configure ${name}" ${CMAKE_COMMAND} -S "${source}" -B "${build}"
           -DCMAKE_PREFIX_PATH=${moved} -DCMAKE_BUILD_TYPE=Release
           -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER})
  run_step("build ${name}" ${CMAKE_COMMAND} --build "${build}")
  run_step("run ${name}" "${build}/zinf_consumer")
  if(NOT step_output MATCHES "zinf consumer ok")
    message(FATAL_ERROR "${name} did not report success: ${step_output}")
  endif()
endforeach()
