# ctest packaging.install_consumer: installs the build tree into a fresh
# prefix, builds tests/packaging/consumer against it with find_package(ferry)
# and with pkg-config (Ninja), runs both and checks that they print this
# build's version and load the installed libferry.
#   cmake -DFERRY_BUILD_DIR=... -DFERRY_SOURCE_DIR=... -DFERRY_VERSION=x.y.z
#         -DWORK_DIR=... -P install_consumer_test.cmake
foreach(v FERRY_BUILD_DIR FERRY_SOURCE_DIR FERRY_VERSION WORK_DIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "install_consumer_test: -D${v}=... missing")
  endif()
endforeach()

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${ARGN}\n${out}")
  endif()
  set(run_out "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
run("cmake --install" ${CMAKE_COMMAND} --install "${FERRY_BUILD_DIR}" --prefix "${prefix}")

# What an install must hold (lib may be lib/<multiarch>).
file(GLOB_RECURSE cfg "${prefix}/*/cmake/ferry/ferryConfig.cmake")
file(GLOB_RECURSE cfgv "${prefix}/*/cmake/ferry/ferryConfigVersion.cmake")
file(GLOB_RECURSE pc "${prefix}/*/pkgconfig/ferry.pc")
file(GLOB_RECURSE libs "${prefix}/*/libferry.so*")
foreach(v cfg cfgv pc libs)
  if(NOT ${v})
    message(FATAL_ERROR "install_consumer_test: ${v} missing under ${prefix}")
  endif()
endforeach()
foreach(h engine.h status.h types.h)
  if(NOT EXISTS "${prefix}/include/ferry/${h}")
    message(FATAL_ERROR "install_consumer_test: include/ferry/${h} missing under ${prefix}")
  endif()
endforeach()
get_filename_component(pcdir "${pc}" DIRECTORY)
message(STATUS "installed: ${cfg}, ${pc}, ${libs}")

find_program(NINJA ninja REQUIRED)
foreach(via config pkgconfig)
  set(b "${WORK_DIR}/consumer-${via}")
  # Only the temporary prefix may provide ferry: no user package registry, no
  # other pkg-config directories.
  run("configure consumer (${via})"
      ${CMAKE_COMMAND} -E env "PKG_CONFIG_PATH=${pcdir}" "PKG_CONFIG_LIBDIR=${pcdir}"
      ${CMAKE_COMMAND} -S "${FERRY_SOURCE_DIR}/tests/packaging/consumer" -B "${b}" -G Ninja
      -DCMAKE_MAKE_PROGRAM=${NINJA} -DCMAKE_BUILD_TYPE=Release
      "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
      -DFERRY_CONSUMER_VIA=${via})
  string(REGEX MATCH "ferry_consumer: [^\n]*" found "${run_out}")
  message(STATUS "${via}: ${found}")
  string(FIND "${found}" "ferry ${FERRY_VERSION} from ${prefix}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "consumer (${via}) did not find ferry ${FERRY_VERSION} in ${prefix}:\n${run_out}")
  endif()
  run("build consumer (${via})" ${CMAKE_COMMAND} --build "${b}")
  run("run consumer (${via})" "${b}/ferry_consumer")
  message(STATUS "${via}: consumer says:\n${run_out}")
  string(FIND "${run_out}" "ferry version ${FERRY_VERSION} " at)
  if(at EQUAL -1)
    message(FATAL_ERROR "consumer (${via}) printed the wrong version (want ${FERRY_VERSION}):\n${run_out}")
  endif()
  string(FIND "${run_out}" "libferry ${prefix}/" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "consumer (${via}) did not load the installed libferry:\n${run_out}")
  endif()
endforeach()
message(STATUS "install_consumer_test: passed")
