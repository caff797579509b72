# Installs the zinf build in ZINF_BUILD_DIR into a fresh prefix, then builds and runs the consumer
# project in ZINF_CONSUMER_SOURCE against it. Any failing step fails the test.
file(REMOVE_RECURSE "${ZINF_WORK_DIR}")
set(prefix "${ZINF_WORK_DIR}/prefix")
set(build "${ZINF_WORK_DIR}/build")

include("${CMAKE_CURRENT_LIST_DIR}/package_steps.cmake")

run_step("install" ${CMAKE_COMMAND} --install "${ZINF_BUILD_DIR}" --prefix "${prefix}")
run_step("configure consumer" ${CMAKE_COMMAND} -S "${ZINF_CONSUMER_SOURCE}" -B "${build}"
         -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release
         -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER})
run_step("build consumer" ${CMAKE_COMMAND} --build "${build}")
run_step("run consumer" "${build}/zinf_consumer")
message(STATUS "consumer said: ${step_output}")
if(NOT step_output MATCHES "zinf consumer ok")
  message(FATAL_ERROR "consumer did not report success: ${step_output}")
endif()
# The MPI program, as two processes under mpirun, when zinf was built with MPI.
if(ZINF_MPIEXEC AND EXISTS "${build}/zinf_mpi_consumer")
  run_step("run mpi consumer" ${ZINF_MPIEXEC} --allow-run-as-root --oversubscribe --bind-to none
           -np 2 "${build}/zinf_mpi_consumer")
  message(STATUS "mpi consumer said: ${step_output}")
  foreach(rank 0 1)
    if(NOT step_output MATCHES "zinf mpi consumer ok: rank ${rank} of 2")
      message(FATAL_ERROR "mpi consumer rank ${rank} did not report success: ${step_output}")
    endif()
  endforeach()
endif()
