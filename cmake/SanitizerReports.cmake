# neml2_dispatch_fail_on_sanitizer_reports(): in a sanitizer build (the asan and tsan
# presets), every test of the calling directory fails when its output has a sanitizer
# report, also the tests that pass on a regular expression (ctest then ignores their
# exit status). Call it at the end of a CMakeLists.txt that adds tests.
function(neml2_dispatch_fail_on_sanitizer_reports)
  if(NOT CMAKE_CXX_FLAGS MATCHES "-fsanitize=")
    return()
  endif()
  get_property(tests DIRECTORY PROPERTY TESTS)
  if(tests)
    set_tests_properties(${tests} PROPERTIES FAIL_REGULAR_EXPRESSION
      "ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error: |WARNING: ThreadSanitizer")
  endif()
endfunction()
