// `piper sweep` under mpirun: the combinations are partitioned over the MPI ranks, each rank runs its
// share on its own worker threads, and rank 0 appends every row to the one results CSV (resumable).
#pragma once

#include <string>

namespace piper::cli {

// True when this process was started by mpirun/mpiexec in a job of more than one rank (Open MPI,
// PMIx or PMI environment), so that a plain `piper sweep` never initializes MPI.
bool launched_under_mpi();

// Runs the sweep over MPI_COMM_WORLD. Rank 0 reads the spec and the results file and sends the spec
// to the others (they need no shared filesystem); pending combinations are dealt round-robin by
// rank; rows stream to rank 0 as they finish, so a killed job resumes like a local sweep.
// Returns the exit code (rank 0 throws CliError for a bad spec or results file; other ranks return 2).
int run_sweep_mpi(const std::string& spec_path, const std::string& output_path, int jobs);

}  // namespace piper::cli
