# Installs zinf so that another CMake project can find_package(zinf) and link zinf::zinf, with
# every dependency found again on the consumer's side (cmake/zinfConfig.cmake.in).
include(CMakePackageConfigHelpers)
install(TARGETS zinf EXPORT zinfTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/zinf DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
set(ZINF_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/zinf)
install(EXPORT zinfTargets NAMESPACE zinf:: DESTINATION ${ZINF_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/zinfConfig.cmake.in
  ${PROJECT_BINARY_DIR}/zinfConfig.cmake INSTALL_DESTINATION ${ZINF_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/zinfConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/zinfConfig.cmake ${PROJECT_BINARY_DIR}/zinfConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/FindLiburing.cmake
              ${PROJECT_SOURCE_DIR}/cmake/FindXxHash.cmake
        DESTINATION ${ZINF_CMAKE_DIR})
