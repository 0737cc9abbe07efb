# Compiled models and eager-NEML2 reference values, made at build time.
#
#   neml2_dispatch_add_artifact(<name> INPUT <file.i> MODEL <model>
#                               [COMPILE_OPTIONS ...] [REFERENCE_OPTIONS ...] [NO_REFERENCE])
#
# compiles <file.i> (relative to the calling CMakeLists.txt, or absolute) with neml2-compile (cached outside the build tree by
# tools/compile_artifact.py) into ${NEML2_DISPATCH_ARTIFACTS}/<name>/ and, unless
# NO_REFERENCE, writes eager reference values into ${NEML2_DISPATCH_ARTIFACTS}/<name>.ref/
# (cached the same way by tools/make_reference.py).
# The target neml2_dispatch_artifacts builds them all.

set(NEML2_DISPATCH_ARTIFACTS "${PROJECT_BINARY_DIR}/artifacts")
if(NOT TARGET neml2_dispatch_artifacts)
  add_custom_target(neml2_dispatch_artifacts ALL)
endif()

function(neml2_dispatch_add_artifact name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "NO_REFERENCE" "INPUT;MODEL"
                        "COMPILE_OPTIONS;REFERENCE_OPTIONS")
  get_filename_component(input "${arg_INPUT}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
  set(out "${NEML2_DISPATCH_ARTIFACTS}/${name}")
  set(tools "${PROJECT_SOURCE_DIR}/tools")
  set(outputs "${out}.stamp")
  add_custom_command(
    OUTPUT "${out}.stamp"
    COMMAND "${NEML2_DISPATCH_PYTHON}" "${tools}/compile_artifact.py" "${input}"
            --model ${arg_MODEL} ${arg_COMPILE_OPTIONS} --out "${out}"
    COMMAND ${CMAKE_COMMAND} -E touch "${out}.stamp"
    DEPENDS "${input}" "${tools}/compile_artifact.py"
    COMMENT "neml2-compile ${arg_INPUT} for ${name} (or its cached result)"
    VERBATIM)
  if(NOT arg_NO_REFERENCE)
    add_custom_command(
      OUTPUT "${out}.ref/reference.json"
      COMMAND "${NEML2_DISPATCH_PYTHON}" "${tools}/make_reference.py" "${input}"
              --model ${arg_MODEL} ${arg_REFERENCE_OPTIONS} --out "${out}.ref"
      # A cached result keeps the cache entry's time, older than the input of a fresh
      # clone: without this, make would run the step again on every build.
      COMMAND ${CMAKE_COMMAND} -E touch "${out}.ref/reference.json"
      DEPENDS "${input}" "${tools}/make_reference.py"
      COMMENT "eager NEML2 reference values for ${name}"
      VERBATIM)
    list(APPEND outputs "${out}.ref/reference.json")
  endif()
  add_custom_target(artifact_${name} DEPENDS ${outputs})
  add_dependencies(neml2_dispatch_artifacts artifact_${name})
endfunction()
