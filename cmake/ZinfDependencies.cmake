# The host-side dependencies. Each is a Debian package; docs/DEPENDENCIES.md says why it is here.
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(TBB REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(Liburing REQUIRED)
find_package(XxHash REQUIRED)
if(ZINF_BUILD_TOOLS OR ZINF_BUILD_TESTS)  # the fuzz tests parse `zinf plan` options too
  find_package(CLI11 REQUIRED)
endif()
if(ZINF_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(ZINF_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()
# MPI (Open MPI from Debian: libopenmpi-dev) for MpiComm, one process per rank. ZINF_WITH_MPI:
# AUTO builds it when MPI's C bindings are found, ON requires them, OFF leaves MpiComm out
# (make_mpi_comm then returns kUnsupported naming this option).
set(ZINF_WITH_MPI_RESOLVED OFF)
if(NOT ZINF_WITH_MPI STREQUAL "OFF")
  find_package(MPI COMPONENTS C)
  if(MPI_C_FOUND)
    set(ZINF_WITH_MPI_RESOLVED ON)
    # mpi.h in C++ would pull in the removed MPI C++ bindings (undefined MPI::Comm symbols):
    # targets that include it link zinf_mpi_c, MPI's C bindings without them.
    if(NOT TARGET zinf_mpi_c)
      add_library(zinf_mpi_c INTERFACE)
      target_link_libraries(zinf_mpi_c INTERFACE MPI::MPI_C)
      target_compile_definitions(zinf_mpi_c INTERFACE OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)
    endif()
    find_program(ZINF_MPIEXEC NAMES ${MPIEXEC_EXECUTABLE} mpirun mpiexec)
  elseif(ZINF_WITH_MPI STREQUAL "ON")
    message(FATAL_ERROR "ZINF_WITH_MPI=ON but MPI was not found (apt-get install libopenmpi-dev)")
  endif()
endif()
