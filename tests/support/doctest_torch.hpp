#pragma once

// doctest after torch: c10's logging defines its own CHECK macro, and whichever header
// comes second wins. Include this instead of <doctest/doctest.h> in every test.

#include <ATen/ATen.h>
#include <doctest/doctest.h>
