# fmt, nlohmann_json, doctest, CLI11 and Google Benchmark: Debian's packages, or, on a machine
# without them (the GPU machine), a bundled folder NEML2_DISPATCH_BUNDLED_DEPS with their
# headers in include/ and libbenchmark in lib/ (made by scripts/prepare-gpu-carry.sh).

set(NEML2_DISPATCH_BUNDLED_DEPS "" CACHE PATH "Bundled dependency headers and libraries")
# The neml2-dispatch program (apps/), part of the package; it needs CLI11.
option(NEML2_DISPATCH_PROGRAM "Build the neml2-dispatch program" ON)

if(NEML2_DISPATCH_BUNDLED_DEPS)
  set(_deps "${NEML2_DISPATCH_BUNDLED_DEPS}")
  foreach(_target fmt::fmt-header-only nlohmann_json::nlohmann_json doctest::doctest CLI11::CLI11)
    add_library(${_target} INTERFACE IMPORTED)
    set_target_properties(${_target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_deps}/include")
  endforeach()
  set_target_properties(fmt::fmt-header-only PROPERTIES INTERFACE_COMPILE_DEFINITIONS FMT_HEADER_ONLY=1)
  file(GLOB _benchmark "${_deps}/lib/libbenchmark.so*")
  if(_benchmark)
    list(GET _benchmark 0 _benchmark)
    add_library(benchmark::benchmark SHARED IMPORTED)
    set_target_properties(benchmark::benchmark PROPERTIES
      IMPORTED_LOCATION "${_benchmark}" INTERFACE_INCLUDE_DIRECTORIES "${_deps}/include")
  elseif(NEML2_DISPATCH_BENCHMARKS)
    message(STATUS "neml2_dispatch: no libbenchmark in ${_deps}/lib; benchmarks off")
    set(NEML2_DISPATCH_BENCHMARKS OFF)
  endif()
else()
  find_package(fmt REQUIRED)
  find_package(nlohmann_json 3.10 REQUIRED)
  if(NEML2_DISPATCH_PROGRAM)
    find_package(CLI11 2.1 REQUIRED)
  endif()
  if(NEML2_DISPATCH_TESTS)
    find_package(doctest REQUIRED)
  endif()
  if(NEML2_DISPATCH_BENCHMARKS)
    find_package(benchmark REQUIRED)
  endif()
endif()
