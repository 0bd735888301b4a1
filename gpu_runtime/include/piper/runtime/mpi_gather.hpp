// Gathers every rank's run of values on rank 0 of MPI_COMM_WORLD, in rank order: what the trainers
// use to assemble checkpoints, parameter dumps, traces and calibrations from all ranks.
#pragma once

#include <string>
#include <type_traits>
#include <vector>

#include <mpi.h>

namespace piper::runtime {

// On rank 0: `all` holds every rank's values back to back, rank r's starting at offsets[r] and
// sizes[r] long. On the other ranks all three are left empty.
template <class Container>
struct Gathered {
  Container all;
  std::vector<int> offsets, sizes;
};

// Collective over MPI_COMM_WORLD: every rank must call it. Container is std::string (bytes) or
// std::vector<double>.
template <class Container>
Gathered<Container> gather_on_root(const Container& mine) {
  using T = typename Container::value_type;
  static_assert(std::is_same_v<T, char> || std::is_same_v<T, double>, "gather_on_root: bytes or doubles");
  const MPI_Datatype type = std::is_same_v<T, double> ? MPI_DOUBLE : MPI_BYTE;
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  Gathered<Container> g;
  int n = static_cast<int>(mine.size());
  if (rank == 0) g.sizes.resize(static_cast<std::size_t>(size)), g.offsets.resize(static_cast<std::size_t>(size));
  MPI_Gather(&n, 1, MPI_INT, g.sizes.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  int total = 0;
  for (std::size_t i = 0; i < g.sizes.size(); ++i) g.offsets[i] = total, total += g.sizes[i];
  g.all.resize(static_cast<std::size_t>(total));
  MPI_Gatherv(mine.data(), n, type, g.all.data(), g.sizes.data(), g.offsets.data(), type, 0, MPI_COMM_WORLD);
  return g;
}

}  // namespace piper::runtime
