# LibTorch from the PyPI torch wheel, as the imported target neml2_dispatch::torch.
#
# We do not use the wheel's TorchConfig.cmake: it searches for a CUDA toolkit and, on a
# machine whose toolkit differs from the wheel's CUDA libraries, links against the wrong
# NCCL. The wheel is self-contained, so a plain imported target over its files is enough.
#
# Input: NEML2_DISPATCH_PYTHON (a python with torch) or NEML2_DISPATCH_TORCH_DIR.
# NEML2_DISPATCH_CUDA (AUTO/ON/OFF): also load libtorch_cuda, so CUDA artifacts run.

set(NEML2_DISPATCH_CUDA AUTO CACHE STRING "Link libtorch_cuda (AUTO: when the wheel has it)")

if(NOT NEML2_DISPATCH_TORCH_DIR)
  if(NOT NEML2_DISPATCH_PYTHON)
    find_package(Python3 REQUIRED COMPONENTS Interpreter)
    set(NEML2_DISPATCH_PYTHON "${Python3_EXECUTABLE}")
  endif()
  execute_process(
    COMMAND "${NEML2_DISPATCH_PYTHON}" -c "import os, torch; print(os.path.dirname(torch.__file__))"
    OUTPUT_VARIABLE _torch_dir OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "neml2_dispatch: '${NEML2_DISPATCH_PYTHON}' cannot import torch. "
                        "Run scripts/setup.sh, or pass -DNEML2_DISPATCH_PYTHON=<venv>/bin/python "
                        "or -DNEML2_DISPATCH_TORCH_DIR=<site-packages>/torch.")
  endif()
  set(NEML2_DISPATCH_TORCH_DIR "${_torch_dir}" CACHE PATH "The torch package folder (of the wheel)")
endif()

set(_lib "${NEML2_DISPATCH_TORCH_DIR}/lib")
foreach(_f libtorch.so libtorch_cpu.so libc10.so)
  if(NOT EXISTS "${_lib}/${_f}")
    message(FATAL_ERROR "neml2_dispatch: ${_lib}/${_f} not found; NEML2_DISPATCH_TORCH_DIR "
                        "must be the torch folder of a torch wheel.")
  endif()
endforeach()

file(STRINGS "${NEML2_DISPATCH_TORCH_DIR}/version.py" _version_line REGEX "^__version__")
string(REGEX MATCH "[0-9]+\\.[0-9]+\\.[0-9]+" NEML2_DISPATCH_TORCH_VERSION "${_version_line}")

set(_with_cuda OFF)
if(NEML2_DISPATCH_CUDA STREQUAL "AUTO")
  if(EXISTS "${_lib}/libtorch_cuda.so")
    set(_with_cuda ON)
  endif()
elseif(NEML2_DISPATCH_CUDA)
  set(_with_cuda ON)
endif()

add_library(neml2_dispatch_torch INTERFACE)
add_library(neml2_dispatch::torch ALIAS neml2_dispatch_torch)
set_target_properties(neml2_dispatch_torch PROPERTIES EXPORT_NAME torch)
target_include_directories(neml2_dispatch_torch SYSTEM INTERFACE
  "${NEML2_DISPATCH_TORCH_DIR}/include"
  "${NEML2_DISPATCH_TORCH_DIR}/include/torch/csrc/api/include")
# Model .so files need libtorch (and libtorch_cuda registers the CUDA runner at load
# time): both must really be loaded even though we call none of their symbols.
set(_always_loaded "${_lib}/libtorch.so")
if(_with_cuda)
  list(APPEND _always_loaded "${_lib}/libtorch_cuda.so" "${_lib}/libc10_cuda.so")
  target_compile_definitions(neml2_dispatch_torch INTERFACE NEML2_DISPATCH_WITH_CUDA=1)
endif()
target_link_libraries(neml2_dispatch_torch INTERFACE
  "-Wl,--no-as-needed" ${_always_loaded} "-Wl,--as-needed"
  "${_lib}/libtorch_cpu.so" "${_lib}/libc10.so")
target_compile_definitions(neml2_dispatch_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=1)
message(STATUS "neml2_dispatch: torch ${NEML2_DISPATCH_TORCH_VERSION} at ${NEML2_DISPATCH_TORCH_DIR} (CUDA runner: ${_with_cuda})")
