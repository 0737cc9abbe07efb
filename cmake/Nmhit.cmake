# nmhit, NEML2's HIT parser (the `nmhit` wheel, a dependency of `neml2`: a static C++17
# library built with the C++11 ABI), folded into the neml2_dispatch library itself: its
# objects are archived with ours, so neither the installed package nor a consumer needs
# nmhit (a PRIVATE link of a static library would still be exported as a link-only
# dependency).
#
# Where it is looked for: NEML2_DISPATCH_NMHIT_DIR (the nmhit package folder), the
# site-packages of the torch in use, then what NEML2_DISPATCH_PYTHON imports.
#
#   neml2_dispatch_add_nmhit(<target>)   its headers (private) and objects into <target>

set(NEML2_DISPATCH_NMHIT_DIR "" CACHE PATH "The nmhit package folder (<site-packages>/nmhit)")
if(NOT NEML2_DISPATCH_NMHIT_DIR)
  if(EXISTS "${NEML2_DISPATCH_TORCH_DIR}/../nmhit/lib/libnmhit.a")
    get_filename_component(_nmhit "${NEML2_DISPATCH_TORCH_DIR}/../nmhit" ABSOLUTE)
  elseif(NEML2_DISPATCH_PYTHON)
    execute_process(
      COMMAND "${NEML2_DISPATCH_PYTHON}" -c "import os, nmhit; print(os.path.dirname(nmhit.__file__))"
      OUTPUT_VARIABLE _nmhit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  set(NEML2_DISPATCH_NMHIT_DIR "${_nmhit}" CACHE PATH "The nmhit package folder" FORCE)
endif()
set(_nmhit_lib "${NEML2_DISPATCH_NMHIT_DIR}/lib/libnmhit.a")
if(NOT EXISTS "${_nmhit_lib}" OR NOT EXISTS "${NEML2_DISPATCH_NMHIT_DIR}/include/nmhit/nmhit.h")
  message(FATAL_ERROR "neml2_dispatch: nmhit (NEML2's HIT parser, which reads the stubs) not "
                      "found at '${NEML2_DISPATCH_NMHIT_DIR}'. Install it beside torch "
                      "(pip install nmhit; scripts/setup.sh does), or set "
                      "NEML2_DISPATCH_NMHIT_DIR=<site-packages>/nmhit.")
endif()

# The archive's objects, unpacked at configure time (again whenever the archive changes).
set(_nmhit_objects "${PROJECT_BINARY_DIR}/nmhit-objects")
file(SHA256 "${_nmhit_lib}" _nmhit_hash)
if(NOT EXISTS "${_nmhit_objects}/${_nmhit_hash}")
  file(REMOVE_RECURSE "${_nmhit_objects}")
  file(MAKE_DIRECTORY "${_nmhit_objects}")
  execute_process(COMMAND "${CMAKE_AR}" x "${_nmhit_lib}" WORKING_DIRECTORY "${_nmhit_objects}"
                  RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "neml2_dispatch: '${CMAKE_AR} x ${_nmhit_lib}' failed")
  endif()
  file(TOUCH "${_nmhit_objects}/${_nmhit_hash}")
endif()
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${_nmhit_lib}")
file(GLOB NEML2_DISPATCH_NMHIT_OBJECTS "${_nmhit_objects}/*.o")
message(STATUS "neml2_dispatch: nmhit at ${NEML2_DISPATCH_NMHIT_DIR}")

function(neml2_dispatch_add_nmhit target)
  target_sources(${target} PRIVATE ${NEML2_DISPATCH_NMHIT_OBJECTS})
  target_include_directories(${target} SYSTEM PRIVATE
    $<BUILD_INTERFACE:${NEML2_DISPATCH_NMHIT_DIR}/include>)
endfunction()
