# cmake -DOBJCOPY=... -DOBJECTS="a.o;b.o" -P LocalizeSymbols.cmake
#
# Leaves global in each object only the symbols of namespace neml2 (mangled names holding
# "5neml2": functions, members, vtables, typeinfo, thunks); every other definition it holds
# (the weak copies of fmt's, torch's and the standard library's inline functions and
# template instances, their static locals: compiled with -fno-gnu-unique, which objcopy
# could not make local) becomes local to it. An object of the asynchronous engine is then
# linked only by a program that names one of its neml2 symbols: never for a weak copy that
# another library's object asks for (CMakeLists.txt: the single-device guarantee). Its
# inline functions' sections are then its own, no longer shared with other objects' copies
# (a few KB of code twice).
foreach(object IN LISTS OBJECTS)
  # Without its COMDAT groups first (-R .group): a symbol made local cannot name a group
  # another object's copy of which the linker would keep in its place.
  execute_process(COMMAND "${OBJCOPY}" --remove-section=.group --wildcard
                          "--keep-global-symbol=*5neml2*" "${object}"
                  RESULT_VARIABLE status ERROR_VARIABLE error)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "objcopy could not localize the symbols of ${object}: ${error}")
  endif()
endforeach()
