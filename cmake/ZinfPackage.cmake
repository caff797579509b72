# Installs zinf so that another CMake project can find_package(zinf) and link zinf::zinf, with
# every dependency found again on the consumer's side (cmake/zinfConfig.cmake.in), never by an
# absolute path from this machine: an installed prefix may be moved or copied elsewhere.
# The CUDA backend is a component: zinf::cuda (and the CUDA toolkit and NCCL it needs) are looked
# for only by find_package(zinf COMPONENTS cuda).
include(CMakePackageConfigHelpers)
set(ZINF_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/zinf)
install(TARGETS zinf EXPORT zinfTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/zinf DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT zinfTargets NAMESPACE zinf:: DESTINATION ${ZINF_CMAKE_DIR})
if(TARGET zinf_cuda)
  install(TARGETS zinf_cuda EXPORT zinfCudaTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(EXPORT zinfCudaTargets NAMESPACE zinf:: DESTINATION ${ZINF_CMAKE_DIR})
endif()
set(ZINF_PACKAGE_HAS_CUDA OFF)
if(TARGET zinf_cuda)
  set(ZINF_PACKAGE_HAS_CUDA ON)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/zinfConfig.cmake.in
  ${PROJECT_BINARY_DIR}/zinfConfig.cmake INSTALL_DESTINATION ${ZINF_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/zinfConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/zinfConfig.cmake ${PROJECT_BINARY_DIR}/zinfConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/FindLiburing.cmake
              ${PROJECT_SOURCE_DIR}/cmake/FindXxHash.cmake
              ${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake
        DESTINATION ${ZINF_CMAKE_DIR})

# zinf.pc, for builds without CMake (docs/CAPI.md "Linking"): `pkg-config --static --cflags --libs
# zinf`. Each dependency is named as a pkg-config module where this machine has one (found again
# on the consumer's side, as the CMake package does), else as -l<name>; the C++ runtime, libm and
# threads are what a C program's link lacks. Covers zinf::zinf only: zinf::cuda is for CMake.
find_package(PkgConfig QUIET)
set(ZINF_PC_REQUIRES "")
set(ZINF_PC_REQUIRES_PRIVATE "")
set(ZINF_PC_LIBS_PRIVATE "")
set(ZINF_PC_CFLAGS "")
# zinf_pc_dependency(<public|private> <module> <fallback -l flags>...)
function(zinf_pc_dependency visibility module)
  set(found FALSE)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(zinf_pc_${module} QUIET ${module})
    set(found ${zinf_pc_${module}_FOUND})
  endif()
  if(found AND visibility STREQUAL "public")
    list(APPEND ZINF_PC_REQUIRES ${module})
  elseif(found)
    list(APPEND ZINF_PC_REQUIRES_PRIVATE ${module})
  else()
    list(APPEND ZINF_PC_LIBS_PRIVATE ${ARGN})
  endif()
  set(ZINF_PC_REQUIRES ${ZINF_PC_REQUIRES} PARENT_SCOPE)
  set(ZINF_PC_REQUIRES_PRIVATE ${ZINF_PC_REQUIRES_PRIVATE} PARENT_SCOPE)
  set(ZINF_PC_LIBS_PRIVATE ${ZINF_PC_LIBS_PRIVATE} PARENT_SCOPE)
endfunction()
# fmt is public: the C++ headers include it (target_link_libraries(zinf PUBLIC fmt::fmt)).
zinf_pc_dependency(public fmt -lfmt)
zinf_pc_dependency(private tbb -ltbb)
zinf_pc_dependency(private liburing -luring)
zinf_pc_dependency(private libxxhash -lxxhash)
if(ZINF_WITH_MPI_RESOLVED)
  string(APPEND ZINF_PC_CFLAGS " -DZINF_HAVE_MPI=1")
  # The MPI that FindMPI found: Open MPI's or MPICH's module, else its libraries by path.
  set(zinf_pc_mpi_module "")
  if(MPI_C_LIBRARIES MATCHES "openmpi")
    set(zinf_pc_mpi_module ompi-c)
  elseif(MPI_C_LIBRARIES MATCHES "mpich")
    set(zinf_pc_mpi_module mpich)
  endif()
  if(zinf_pc_mpi_module)
    zinf_pc_dependency(private ${zinf_pc_mpi_module} ${MPI_C_LIBRARIES})
  else()
    list(APPEND ZINF_PC_LIBS_PRIVATE ${MPI_C_LIBRARIES})
  endif()
endif()
list(APPEND ZINF_PC_LIBS_PRIVATE -lstdc++ -lm -pthread)
list(JOIN ZINF_PC_REQUIRES " " ZINF_PC_REQUIRES)
list(JOIN ZINF_PC_REQUIRES_PRIVATE " " ZINF_PC_REQUIRES_PRIVATE)
list(JOIN ZINF_PC_LIBS_PRIVATE " " ZINF_PC_LIBS_PRIVATE)
set(ZINF_PC_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
file(RELATIVE_PATH ZINF_PC_PREFIX_FROM_PCDIR "/prefix/${ZINF_PC_DIR}" "/prefix")
string(REGEX REPLACE "/$" "" ZINF_PC_PREFIX_FROM_PCDIR "${ZINF_PC_PREFIX_FROM_PCDIR}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/zinf.pc.in ${PROJECT_BINARY_DIR}/zinf.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/zinf.pc DESTINATION ${ZINF_PC_DIR})
