// Shared by the tests of build/mpi_tests, which run under mpirun (tests/dist launches them).
#pragma once

#include "comm/comm.h"

namespace tuna::test {

// MPI_COMM_WORLD as a Comm (MPI_Init is done by main); a 60 s timeout turns a test that deadlocks into
// an error naming the collective instead of a CI job that hangs.
Comm& world();

}  // namespace tuna::test
