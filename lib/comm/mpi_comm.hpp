// MpiComm: the Communicator interface (include/zinf/comm.hpp) over MPI, one process per rank.
//
// How a collective runs. issue() numbers it (the sequence, as LocalComm does) and enqueues a
// host function on the stream; on a device whose memory host code cannot touch (a CudaDevice, an
// opaque HostDevice) it first copies the send buffer down into a host staging buffer (registered
// with the device and reused: lib/device/staging_buffers.hpp) and afterwards copies the result
// up, on the same stream. When the stream reaches the host
// function, it hands the collective to the communicator's progress thread and waits. The
// progress thread is the only thread that moves data: it posts each collective's nonblocking
// point-to-point messages (MPI_Isend / MPI_Irecv on a duplicate of the caller's communicator,
// tagged with the sequence number, so collectives on different streams never match each other's
// messages; to each peer, a 16-byte descriptor of the collective goes ahead of the data) and polls
// every collective in flight with MPI_Testsome, so collectives of several streams progress together
// and none waits behind another. Once the pieces are in, the stream's thread reduces them in rank
// order with the same code as LocalComm (lib/comm/collective_util.hpp), so the results are
// LocalComm's bits:
//
//   all_gather      every rank sends its piece to every other rank
//   reduce_scatter  rank r receives piece r from every rank, then sums them in rank order
//   all_reduce      every rank receives every other rank's whole buffer and sums in rank order
//                   (world - 1 buffers in: meant for the small worlds of one node's processes)
//   broadcast       the root sends to every rank
//   barrier         a zero-byte message from every rank to every rank
//
// A dead or stalled peer. MPI has no timeouts: a receive from a process that died waits forever,
// and Open MPI's mpirun by default kills the whole job when one process dies (docs/DEVICE_COMM.md
// says what each launcher does). Here every collective has a deadline (MpiCommOptions::timeout
// from the moment the stream reaches it): past it the collective fails with kTimeout naming the
// ranks whose data did not arrive, the communicator is aborted, and an abort notice (the error's
// code and message) goes to every other rank on a control communicator; a rank that receives one
// fails its collectives in flight and every later call with that error, naming the rank it came
// from. Ranks that issued different collectives (another kind, element count, dtype, reduction or
// root) fail with kCommError naming both calls ("ranks disagree: rank 1 issued
// broadcast of 4 f32 (root 1), this rank issued broadcast of 4 f32 (root 0)"): each compares the
// descriptor every peer sent ahead of its data with its own before it takes the data (a
// collective of no elements sends its descriptor too, and a message of no bytes). With two ranks
// both fail with that kCommError. With more, not every rank does: a rank that issues the
// collective after a peer's abort notice arrived is refused with kAborted carrying the peer's
// message (which names both calls); one whose collective was in flight gets the notice's
// kCommError, naming the rank it came from. After a
// failure MPI_Finalize is skipped at exit (it could wait for the dead peer).
//
// MPI_Finalize while the communicator is open. The communicator's progress thread calls MPI until
// it is destroyed, so MPI_Finalize belongs after that; when it comes first (a program's mistake,
// or an exit path's or atexit handler's MPI_Finalize), MPI_Finalize stops the communicator before
// it tears MPI down (the delete callback of an attribute on MPI_COMM_SELF, which MPI_Finalize
// runs first): collectives in flight and every later one fail with kAborted naming MPI_Finalize,
// the other ranks get the abort notice, and the communicator makes no MPI call after that (its
// destruction included). mpi_finalize_losses() tells whether collectives were lost to it.
//
// Thread-safety: as Communicator. MPI must be initialised with MPI_THREAD_MULTIPLE (the progress
// thread calls MPI while the program's threads may too).
#pragma once

#if defined(ZINF_HAVE_MPI)

#include <chrono>
#include <cstddef>
#include <span>
#include <vector>

#include "zinf/comm.hpp"

namespace zinf {

// Where this process sits in MPI_COMM_WORLD.
struct MpiWorld {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // rank among the processes of this node (MPI_COMM_TYPE_SHARED)
};

// Initialises MPI when the program has not (MPI_THREAD_MULTIPLE, finalised at exit) and returns
// this process's place in MPI_COMM_WORLD. The local rank is the launcher's
// (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID) or else counted from every rank's host name,
// gathered by a nonblocking collective polled against `timeout`: kTimeout when some rank does not
// join it in time; kInvalidArgument naming the variable when the launcher's figure is not an
// integer in [0, world size). kFailedPrecondition when MPI was initialised below
// MPI_THREAD_MULTIPLE or finalised. MPI_Init itself, when zinf calls it, has no deadline (MPI
// offers none).
Result<MpiWorld> mpi_world_of_process(std::chrono::milliseconds timeout = std::chrono::minutes(5));

// After MPI_Finalize stopped `comm` (an MpiComm) while it was open: kAborted naming MPI_Finalize
// and how many of its collectives failed (cut short in flight, or refused later; before this
// rank's MPI_Finalize too, as when another rank's came first), when any did. Ok otherwise:
// MPI_Finalize has not run, nothing failed, or `comm` is no MpiComm.
Status mpi_finalize_losses(const Communicator& comm);

// Rank 0 of MPI_COMM_WORLD sends `blob` (the ncclUniqueId) to every rank; every rank returns it.
// Nonblocking broadcasts polled against `timeout`: kTimeout when they do not finish in time.
Result<std::vector<std::byte>> mpi_broadcast_blob(std::span<const std::byte> blob,
                                                  std::chrono::milliseconds timeout);

}  // namespace zinf

#endif  // ZINF_HAVE_MPI
