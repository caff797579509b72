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
