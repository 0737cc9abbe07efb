#pragma once

// The library's private parts that tests reach into (src/ is on the tests' include path):
// the Newton loop (and its row pass's systems and kernels, LAPACK's rows, subnormals
// flushed) and GMRES over graphs written in a test, one graph, the call protocol, the result
// memory, and the worker pool's threads.

#include "core/flush_subnormals.hpp"
#include "core/worker_pool.hpp"
#include "engine/placement.hpp"
#include "graph/graph.hpp"
#include "implicit/gmres.hpp"
#include "implicit/lapack_rows.hpp"
#include "implicit/newton.hpp"
#include "implicit/newton_rows.hpp"
#include "implicit/row_lu.hpp"
#include "implicit/row_system.hpp"
#include "implicit/substepping.hpp"
#include "session/call_protocol.hpp"
#include "session/result_memory.hpp"
