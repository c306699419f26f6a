# Install rules for using Ferry from other projects (`cmake --install <build>
# [--prefix P]`):
#   include/ferry/*.h                     the public C++ API
#   lib/libferry.so.<soversion>           + the libferry.so link (component ferry_dev)
#   lib/cmake/ferry/ferryConfig.cmake     find_package(ferry) -> ferry::ferry
#   lib/cmake/ferry/ferryConfigVersion.cmake
#   lib/pkgconfig/ferry.pc                pkg-config --cflags --libs ferry
# Components: ferry_runtime (the library) and ferry_dev (the rest). The wheel
# installs only the component "python" (pyproject.toml), so none of this goes
# into it. tests/packaging checks all of it with a small consumer.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(FERRY_CMAKE_INSTALL_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/ferry")

# libferry's own dependencies (fmt, spdlog, the CUDA runtime) are private:
# no public header includes them. A consumer links only libferry; the linker
# and the loader find libferry's dependencies through its RUNPATH (the
# directories they were linked from outside the system's, e.g. the CUDA
# toolkit's lib) or the system's library path. The build tree's
# libferry gets the same RUNPATH (BUILD_WITH_INSTALL_RPATH): else CMake pads
# the build RUNPATH for the rewrite at install with a trailing ':', an empty
# entry that the loader reads as the current directory, and the wheel (which
# takes the build tree's libferry, python/CMakeLists.txt) would inherit it.
set_target_properties(ferry PROPERTIES
  INSTALL_RPATH_USE_LINK_PATH ON
  BUILD_WITH_INSTALL_RPATH ON)

install(TARGETS ferry EXPORT ferryTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    COMPONENT ferry_runtime
    NAMELINK_COMPONENT ferry_dev
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ferry
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  COMPONENT ferry_dev
  FILES_MATCHING PATTERN "*.h" PATTERN "*.cuh")

install(EXPORT ferryTargets
  NAMESPACE ferry::
  DESTINATION ${FERRY_CMAKE_INSTALL_DIR}
  COMPONENT ferry_dev)
configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/ferryConfig.cmake.in
  ${PROJECT_BINARY_DIR}/ferryConfig.cmake
  INSTALL_DESTINATION ${FERRY_CMAKE_INSTALL_DIR})
# 0.y.z: only 0.y.* satisfies a request for 0.y (a minor release may break the
# API); from 1.0 on, any later version of the same major.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(_ferry_compat SameMinorVersion)
else()
  set(_ferry_compat SameMajorVersion)
endif()
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/ferryConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY ${_ferry_compat})
install(FILES
  ${PROJECT_BINARY_DIR}/ferryConfig.cmake
  ${PROJECT_BINARY_DIR}/ferryConfigVersion.cmake
  DESTINATION ${FERRY_CMAKE_INSTALL_DIR}
  COMPONENT ferry_dev)

# ferry.pc, relocatable: its prefix is found from where the file lies
# (${pcfiledir}), so `cmake --install --prefix P` works for any P.
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(FERRY_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  set(FERRY_PC_LIBDIR "${CMAKE_INSTALL_FULL_LIBDIR}")
  set(FERRY_PC_INCLUDEDIR "${CMAKE_INSTALL_FULL_INCLUDEDIR}")
else()
  file(RELATIVE_PATH _ferry_pc_up "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
  string(REGEX REPLACE "/$" "" _ferry_pc_up "${_ferry_pc_up}")
  set(FERRY_PC_PREFIX "\${pcfiledir}/${_ferry_pc_up}")
  set(FERRY_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
  set(FERRY_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/ferry.pc.in ${PROJECT_BINARY_DIR}/ferry.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/ferry.pc
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig
  COMPONENT ferry_dev)
