# LibTorch from a torch wheel (or a LibTorch folder), as the imported target
# neml2_dispatch::torch. Included by this project's build and, installed beside
# neml2_dispatchConfig.cmake, by every consumer's find_package: the torch is located when
# the consumer configures, so an installed package can move and use another torch.
#
# We do not use the wheel's TorchConfig.cmake: it searches for a CUDA toolkit and, on a
# machine whose toolkit differs from the wheel's CUDA libraries, links against the wrong
# NCCL. The wheel is self-contained, so a plain imported target over its files is enough.
#
# Where torch is looked for, first found wins:
#   1. NEML2_DISPATCH_TORCH_DIR (the torch folder of a wheel, or a LibTorch folder), or
#      NEML2_DISPATCH_PYTHON (a python that imports torch); CMake or environment variables
#   2. Torch_DIR (<torch>/share/cmake/Torch), CMake or environment variable
#   3. each CMAKE_PREFIX_PATH entry (CMake or environment) that is a torch folder
#   4. the python of the active virtual environment, then python3 on PATH
# NEML2_DISPATCH_CUDA (AUTO/ON/OFF): also load libtorch_cuda, so CUDA artifacts run.

set(NEML2_DISPATCH_CUDA AUTO CACHE STRING "Link libtorch_cuda (AUTO: when the wheel has it)")

# The torch folder `python` imports, or "" when it cannot import torch.
function(_neml2_dispatch_torch_of_python python out)
  execute_process(
    COMMAND "${python}" -c "import os, torch; print(os.path.dirname(torch.__file__))"
    OUTPUT_VARIABLE dir OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc ERROR_QUIET)
  if(NOT rc EQUAL 0)
    set(dir "")
  endif()
  set(${out} "${dir}" PARENT_SCOPE)
endfunction()

function(_neml2_dispatch_is_torch_dir dir out)
  set(found FALSE)
  if(dir AND EXISTS "${dir}/lib/libtorch_cpu.so" AND EXISTS "${dir}/include/torch")
    set(found TRUE)
  endif()
  set(${out} ${found} PARENT_SCOPE)
endfunction()

# Inside _neml2_dispatch_locate_torch: the answer, and return (a macro returns from its caller).
macro(_neml2_dispatch_found dir by)
  set(${out} "${dir}" PARENT_SCOPE)
  set(${how} "${by}" PARENT_SCOPE)
  return()
endmacro()

function(_neml2_dispatch_locate_torch out how)
  foreach(var NEML2_DISPATCH_TORCH_DIR NEML2_DISPATCH_PYTHON Torch_DIR)
    if(NOT ${var} AND DEFINED ENV{${var}})
      set(${var} "$ENV{${var}}")
    endif()
  endforeach()
  if(NEML2_DISPATCH_TORCH_DIR)
    _neml2_dispatch_found("${NEML2_DISPATCH_TORCH_DIR}" NEML2_DISPATCH_TORCH_DIR)
  endif()
  if(NEML2_DISPATCH_PYTHON)
    _neml2_dispatch_torch_of_python("${NEML2_DISPATCH_PYTHON}" dir)
    if(NOT dir)
      message(FATAL_ERROR "neml2_dispatch: NEML2_DISPATCH_PYTHON='${NEML2_DISPATCH_PYTHON}' "
                          "cannot import torch. Point it at a python whose environment has "
                          "torch (e.g. <venv>/bin/python), or set NEML2_DISPATCH_TORCH_DIR="
                          "<site-packages>/torch instead.")
    endif()
    _neml2_dispatch_found("${dir}" NEML2_DISPATCH_PYTHON)
  endif()
  if(Torch_DIR)
    get_filename_component(dir "${Torch_DIR}/../../.." ABSOLUTE)
    _neml2_dispatch_is_torch_dir("${dir}" found)
    if(found)
      _neml2_dispatch_found("${dir}" Torch_DIR)
    endif()
  endif()
  set(prefixes ${CMAKE_PREFIX_PATH} $ENV{CMAKE_PREFIX_PATH})
  string(REPLACE ":" ";" prefixes "${prefixes}")
  foreach(dir IN LISTS prefixes)
    _neml2_dispatch_is_torch_dir("${dir}" found)
    if(found)
      _neml2_dispatch_found("${dir}" CMAKE_PREFIX_PATH)
    endif()
  endforeach()
  set(pythons "")
  if(DEFINED ENV{VIRTUAL_ENV})
    list(APPEND pythons "$ENV{VIRTUAL_ENV}/bin/python")
  endif()
  find_program(_neml2_dispatch_python3 NAMES python3 python NO_CACHE)
  if(_neml2_dispatch_python3)
    list(APPEND pythons "${_neml2_dispatch_python3}")
  endif()
  foreach(python IN LISTS pythons)
    if(EXISTS "${python}")
      _neml2_dispatch_torch_of_python("${python}" dir)
      if(dir)
        _neml2_dispatch_found("${dir}" "${python}")
      endif()
    endif()
  endforeach()
  message(FATAL_ERROR
    "neml2_dispatch: no torch found. Tell CMake where it is, with one of:\n"
    "  -DNEML2_DISPATCH_TORCH_DIR=<site-packages>/torch   (or a LibTorch folder)\n"
    "  -DNEML2_DISPATCH_PYTHON=<venv>/bin/python          (a python that imports torch)\n"
    "  -DTorch_DIR=<torch>/share/cmake/Torch\n"
    "  -DCMAKE_PREFIX_PATH=<site-packages>/torch\n"
    "or activate a virtual environment that has torch. Looked at: Torch_DIR, "
    "CMAKE_PREFIX_PATH '${prefixes}', pythons '${pythons}'.")
endfunction()

if(NOT TARGET neml2_dispatch::torch)
  _neml2_dispatch_locate_torch(NEML2_DISPATCH_TORCH_DIR _torch_found_by)
  set(NEML2_DISPATCH_TORCH_DIR "${NEML2_DISPATCH_TORCH_DIR}" CACHE PATH
      "The torch folder (of a wheel, or LibTorch)")

  set(_lib "${NEML2_DISPATCH_TORCH_DIR}/lib")
  foreach(_f libtorch.so libtorch_cpu.so libc10.so)
    if(NOT EXISTS "${_lib}/${_f}")
      message(FATAL_ERROR "neml2_dispatch: ${_lib}/${_f} not found (torch taken from "
                          "${_torch_found_by}); NEML2_DISPATCH_TORCH_DIR must be the torch "
                          "folder of a torch wheel (<site-packages>/torch) or a LibTorch folder.")
    endif()
  endforeach()

  set(NEML2_DISPATCH_TORCH_VERSION "")
  foreach(_version_file version.py build-version)
    if(NOT NEML2_DISPATCH_TORCH_VERSION AND EXISTS "${NEML2_DISPATCH_TORCH_DIR}/${_version_file}")
      file(STRINGS "${NEML2_DISPATCH_TORCH_DIR}/${_version_file}" _version_line
           REGEX "^(__version__|[0-9])" LIMIT_COUNT 1)
      string(REGEX MATCH "[0-9]+\\.[0-9]+\\.[0-9]+" NEML2_DISPATCH_TORCH_VERSION "${_version_line}")
    endif()
  endforeach()

  set(_with_cuda OFF)
  if(NEML2_DISPATCH_CUDA STREQUAL "AUTO")
    if(EXISTS "${_lib}/libtorch_cuda.so")
      set(_with_cuda ON)
    endif()
  elseif(NEML2_DISPATCH_CUDA)
    set(_with_cuda ON)
  endif()
  # The CUDA release of the torch linked with its CUDA runner ("" without): what runs this
  # build needs a torch with CUDA too (the Python module checks it at import).
  set(NEML2_DISPATCH_TORCH_CUDA "")
  if(_with_cuda AND EXISTS "${NEML2_DISPATCH_TORCH_DIR}/version.py")
    file(STRINGS "${NEML2_DISPATCH_TORCH_DIR}/version.py" _cuda_line REGEX "^cuda" LIMIT_COUNT 1)
    string(REGEX MATCH "[0-9]+\\.[0-9]+" NEML2_DISPATCH_TORCH_CUDA "${_cuda_line}")
  endif()
  # Also seen by a project above the one that included this (python/, the wheel's).
  set(NEML2_DISPATCH_TORCH_VERSION "${NEML2_DISPATCH_TORCH_VERSION}" CACHE INTERNAL "")
  set(NEML2_DISPATCH_TORCH_CUDA "${NEML2_DISPATCH_TORCH_CUDA}" CACHE INTERNAL "")

  # GLOBAL: a project that adds this one with add_subdirectory sees it too.
  add_library(neml2_dispatch::torch INTERFACE IMPORTED GLOBAL)
  target_include_directories(neml2_dispatch::torch SYSTEM INTERFACE
    "${NEML2_DISPATCH_TORCH_DIR}/include"
    "${NEML2_DISPATCH_TORCH_DIR}/include/torch/csrc/api/include")
  # Model .so files need libtorch (and libtorch_cuda registers the CUDA runner at load
  # time): both must really be loaded even though we call none of their symbols.
  set(_always_loaded "${_lib}/libtorch.so")
  if(_with_cuda)
    list(APPEND _always_loaded "${_lib}/libtorch_cuda.so" "${_lib}/libc10_cuda.so")
    target_compile_definitions(neml2_dispatch::torch INTERFACE NEML2_DISPATCH_WITH_CUDA=1)
  endif()
  # Torch's OpenMP runtime (a wheel's libgomp.so.1, LibTorch's libgomp-<hash>.so.1): the
  # library's CPU lanes run on its team, so that torch's loops inside a lane see the region.
  file(GLOB _gomp "${_lib}/libgomp.so.1" "${_lib}/libgomp-*.so.1")
  if(NOT _gomp)
    message(FATAL_ERROR "neml2_dispatch: no libgomp in ${_lib}; the library runs its CPU "
                        "lanes on torch's OpenMP runtime: use a torch built with OpenMP "
                        "(every torch wheel for Linux is)")
  endif()
  list(GET _gomp 0 _gomp)
  target_link_libraries(neml2_dispatch::torch INTERFACE
    "-Wl,--no-as-needed" ${_always_loaded} "-Wl,--as-needed"
    "${_lib}/libtorch_cpu.so" "${_lib}/libc10.so" "${_gomp}")
  target_compile_definitions(neml2_dispatch::torch INTERFACE _GLIBCXX_USE_CXX11_ABI=1)
  message(STATUS "neml2_dispatch: torch ${NEML2_DISPATCH_TORCH_VERSION} at "
                 "${NEML2_DISPATCH_TORCH_DIR} (from ${_torch_found_by}; CUDA runner: ${_with_cuda})")
endif()
