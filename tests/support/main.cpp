// doctest's implementation and main. The tests' precompiled header has already included
// doctest's interface, so the implementation is asked for by name as well.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
