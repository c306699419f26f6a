# Where Ferry's C++ dependencies come from: fmt, spdlog and nlohmann-json
# (docs/design.md, "Dependencies and building without root").
#
# 1. Installed packages first: Debian's libfmt-dev, libspdlog-dev and
#    nlohmann-json3-dev (./ferry.sh installs them), or anything on
#    CMAKE_PREFIX_PATH. The development build and CI take this road.
# 2. When they are absent and FERRY_FETCH_DEPENDENCIES is ON (the default),
#    pinned archives from PyPI's file host, checked by SHA-256, used as
#    header-only libraries: this is what lets `pip install .` build on a
#    machine with a compiler and Python but no root and no -dev packages.
#    - spdlog 1.10.0 with the fmt 8.1.1 it bundles, from the source archive of
#      the `spdlog` Python wrapper 2.0.6 (it carries spdlog's tree unchanged);
#      fmt and spdlog come from there together, never one installed and the
#      other fetched (two fmt versions in one program would clash);
#    - nlohmann-json 3.12.0, from the `nlohmann-json` wheel (its headers).
#    A machine without network gets the archives from FERRY_DEPENDENCY_DIR
#    (CMake cache or environment variable), a folder filled elsewhere by
#    packaging/fetch_dependencies.sh.
option(FERRY_FETCH_DEPENDENCIES
       "Fetch pinned header-only fmt/spdlog/nlohmann-json when they are not installed" ON)
set(FERRY_DEPENDENCY_DIR "$ENV{FERRY_DEPENDENCY_DIR}" CACHE PATH
    "Folder holding the dependency archives (packaging/fetch_dependencies.sh), for builds without network")

set(FERRY_SPDLOG_ARCHIVE "spdlog-2.0.6.tar.gz")
set(FERRY_SPDLOG_URL
    "https://files.pythonhosted.org/packages/d5/02/604753f90b84696e1c67983afee39b56ec0898c78df573d7ecb388d2ffbf/spdlog-2.0.6.tar.gz")
set(FERRY_SPDLOG_SHA256 "9791cf17f1fd23168c0a0803170b3cbf863d7e819adeeb25e224f242e3f9ecef")
set(FERRY_JSON_ARCHIVE "nlohmann_json-3.12.0-py3-none-any.whl")
set(FERRY_JSON_URL
    "https://files.pythonhosted.org/packages/51/69/a42fddc89a6de959b65b27a15d69de85e88d2f99884e00b1b02c12dce301/nlohmann_json-3.12.0-py3-none-any.whl")
set(FERRY_JSON_SHA256 "5f6132720fb25d0d70bf0742f8397b49a540dcc193e7312a914f6aa49f054810")

# Downloads (or takes from FERRY_DEPENDENCY_DIR), checks and unpacks one
# archive under the build tree; sets <name>_SOURCE_DIR. Nothing of it is
# built or added as a subproject.
function(ferry_fetch_archive name archive url sha256)
  if(NOT FERRY_FETCH_DEPENDENCIES)
    message(FATAL_ERROR
      "ferry: ${name} is not installed and FERRY_FETCH_DEPENDENCIES is OFF. Install it "
      "(Debian: ./ferry.sh installs the -dev packages) or turn the option on.")
  endif()
  set(dir "${CMAKE_BINARY_DIR}/_deps/${name}")
  set(stamp "${dir}/.ferry-sha256")
  if(EXISTS "${stamp}")
    file(READ "${stamp}" have)
    if(have STREQUAL sha256)
      set(${name}_SOURCE_DIR "${dir}" PARENT_SCOPE)
      return()
    endif()
  endif()
  set(file "${CMAKE_BINARY_DIR}/_deps/${archive}")
  file(MAKE_DIRECTORY "${CMAKE_BINARY_DIR}/_deps")
  if(FERRY_DEPENDENCY_DIR)
    if(NOT EXISTS "${FERRY_DEPENDENCY_DIR}/${archive}")
      message(FATAL_ERROR
        "ferry: FERRY_DEPENDENCY_DIR is ${FERRY_DEPENDENCY_DIR} but ${archive} is not there "
        "(packaging/fetch_dependencies.sh ${FERRY_DEPENDENCY_DIR} downloads it)")
    endif()
    message(STATUS "ferry: ${name} not installed: using ${FERRY_DEPENDENCY_DIR}/${archive}")
    file(COPY_FILE "${FERRY_DEPENDENCY_DIR}/${archive}" "${file}")
  else()
    message(STATUS "ferry: ${name} not installed: downloading ${url}")
    file(DOWNLOAD "${url}" "${file}" STATUS got TLS_VERIFY ON)
    list(GET got 0 code)
    if(NOT code EQUAL 0)
      list(GET got 1 why)
      message(FATAL_ERROR
        "ferry: downloading ${url} failed: ${why}. Without network, fill a folder with "
        "packaging/fetch_dependencies.sh on a machine that has it and pass it as "
        "FERRY_DEPENDENCY_DIR.")
    endif()
  endif()
  file(SHA256 "${file}" got_sha256)
  if(NOT got_sha256 STREQUAL sha256)
    message(FATAL_ERROR "ferry: ${archive} has SHA-256 ${got_sha256}, expected ${sha256}")
  endif()
  file(REMOVE_RECURSE "${dir}")
  file(ARCHIVE_EXTRACT INPUT "${file}" DESTINATION "${dir}")
  # A source archive holds one top folder: make <name>_SOURCE_DIR that folder.
  file(GLOB top LIST_DIRECTORIES true "${dir}/*")
  list(LENGTH top n)
  if(n EQUAL 1 AND IS_DIRECTORY "${top}" AND archive MATCHES "\\.tar\\.gz$")
    file(RENAME "${top}" "${dir}.tmp")
    file(REMOVE_RECURSE "${dir}")
    file(RENAME "${dir}.tmp" "${dir}")
  endif()
  file(WRITE "${stamp}" "${sha256}")
  set(${name}_SOURCE_DIR "${dir}" PARENT_SCOPE)
endfunction()

find_package(fmt QUIET)
find_package(spdlog QUIET)
if(fmt_FOUND AND spdlog_FOUND)
  set(FERRY_DEPENDENCIES_FROM "installed fmt ${fmt_VERSION}, spdlog ${spdlog_VERSION}")
else()
  ferry_fetch_archive(ferry_spdlog "${FERRY_SPDLOG_ARCHIVE}" "${FERRY_SPDLOG_URL}"
                      "${FERRY_SPDLOG_SHA256}")
  set(spdlog_include "${ferry_spdlog_SOURCE_DIR}/spdlog/include")
  if(NOT EXISTS "${spdlog_include}/spdlog/fmt/bundled/format.h")
    message(FATAL_ERROR "ferry: ${FERRY_SPDLOG_ARCHIVE} does not hold spdlog's bundled fmt")
  endif()
  # <fmt/...> is spdlog's bundled copy: one fmt for Ferry and spdlog.
  set(fmt_include "${CMAKE_BINARY_DIR}/_deps/ferry-fmt-include")
  file(MAKE_DIRECTORY "${fmt_include}")
  file(CREATE_LINK "${spdlog_include}/spdlog/fmt/bundled" "${fmt_include}/fmt" SYMBOLIC)
  add_library(ferry_fmt_headers INTERFACE)
  target_include_directories(ferry_fmt_headers SYSTEM INTERFACE "${fmt_include}")
  target_compile_definitions(ferry_fmt_headers INTERFACE FMT_HEADER_ONLY=1)
  add_library(fmt::fmt ALIAS ferry_fmt_headers)
  add_library(ferry_spdlog_headers INTERFACE)
  target_include_directories(ferry_spdlog_headers SYSTEM INTERFACE "${spdlog_include}")
  target_compile_definitions(ferry_spdlog_headers INTERFACE SPDLOG_HEADER_ONLY=1)
  target_link_libraries(ferry_spdlog_headers INTERFACE ferry_fmt_headers)
  add_library(spdlog::spdlog ALIAS ferry_spdlog_headers)
  set(FERRY_DEPENDENCIES_FROM "fetched header-only spdlog 1.10.0 with its fmt 8.1.1")
endif()

find_package(nlohmann_json 3 CONFIG QUIET)
if(nlohmann_json_FOUND)
  # Debian's nlohmann-json3-dev.
elseif(EXISTS "/usr/include/nlohmann/json.hpp")
  add_library(ferry_json_headers INTERFACE)  # installed without its CMake files
  add_library(nlohmann_json::nlohmann_json ALIAS ferry_json_headers)
else()
  ferry_fetch_archive(ferry_json "${FERRY_JSON_ARCHIVE}" "${FERRY_JSON_URL}" "${FERRY_JSON_SHA256}")
  if(NOT EXISTS "${ferry_json_SOURCE_DIR}/nlohmann_json/include/nlohmann/json.hpp")
    message(FATAL_ERROR "ferry: ${FERRY_JSON_ARCHIVE} does not hold nlohmann/json.hpp")
  endif()
  add_library(ferry_json_headers INTERFACE)
  target_include_directories(ferry_json_headers SYSTEM INTERFACE
                             "${ferry_json_SOURCE_DIR}/nlohmann_json/include")
  add_library(nlohmann_json::nlohmann_json ALIAS ferry_json_headers)
  string(APPEND FERRY_DEPENDENCIES_FROM ", fetched nlohmann-json 3.12.0")
endif()
message(STATUS "ferry: dependencies: ${FERRY_DEPENDENCIES_FROM}")
