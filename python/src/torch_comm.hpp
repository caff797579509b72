// TorchComm: the Communicator interface (include/zinf/comm.hpp) over torch.distributed, one
// process per rank, for jobs started by torchrun (which runs no MPI launcher).
//
// The data moves through a gloo process group of its own (zinf.torch makes it with
// torch.distributed.new_group(backend="gloo"), so that zinf's collectives never interleave with
// the script's), driven from Python by a `transport` object (zinf.torch's _TorchTransport, whose
// methods are listed below). The collectives run on HostDevice streams, as MpiComm's do:
//
// How a collective runs. issue() numbers it (the sequence: every rank issues the same
// collectives in the same order) and enqueues a host function on the stream. When the stream
// reaches it, the host function hands the collective to the communicator's one worker thread and
// waits. The worker runs the collectives strictly in sequence order, one at a time, whichever
// stream reached its collective first, so that gloo (which matches collectives by the order of
// the calls on a group) sees the same sequence on every rank. For each one it takes the GIL and
// calls the transport, which copies the send bytes into a tensor torch owns and starts the gloo
// operation on bytes (uint8 tensors); gloo releases the GIL while it works:
//
//   all_gather      all_gather_into_tensor of each rank's piece
//   reduce_scatter  all_to_all_single (rank r receives piece r of every rank), then the sum
//   all_reduce      all_gather_into_tensor of the whole buffers, then the sum
//   broadcast       broadcast from the root
//
// Sums run here, in rank order with f32 accumulators, rounded once to the dtype, as LocalComm and
// MpiComm do (lib/comm/collective_util.hpp), so a run under torchrun gives the same bits as one
// under mpirun, for any number of ranks (gloo's own reductions add in an order of their own, and
// have no average). All-reduces move world_size buffers to every rank, as MpiComm's do: meant for
// the few processes of one node.
//
// Buffers. gloo only ever touches tensors torch owns (copies of the send bytes, and the output
// tensor): a collective that is given up (an abort) leaves its gloo operation behind, still
// referencing them, and torch keeps them alive until gloo is done. The results are copied into
// `recv` after the operation completes, under the collective's lock and only if it has not been
// failed meanwhile, so nothing is written into the engine's memory after its collective
// returned.
//
// A dead, stalled or failing peer. The group is made with zinf.collective_timeout_ms, and the
// worker gives each collective that deadline too (from the moment its worker starts it, which is
// later than the stream reaching it when collectives queue behind a slow one): past it
// the collective fails with kTimeout. A rank whose process died fails its peers' operations at
// once (gloo's connection closes). A rank that aborts (abort(), a failed collective, earlier work
// on the stream that failed, zinf.torch's handler of an exception) posts an abort notice, its
// error's code and message, under a key of the group's store; the worker of every other rank
// looks for it every 50 ms while an operation is in flight, and then fails that collective and
// every later call with the notice, naming the rank it came from.
//
// barrier() counts the ranks through the same store (an add on a key per barrier), so that it
// does not take a place in the group's sequence (the engine may call it from another thread than
// the one that issues).
//
// The GIL. The worker takes it to call the transport; gloo's waits release it. No thread that
// holds the GIL may wait for a collective (the binding runs every engine call that may wait
// without the GIL), and the communicator must be destroyed without it.
//
// Transport methods (Python): rank, world_size (attributes); launch(kind, send, out_bytes, root)
// -> (work, out) with kind 0 all_gather, 1 all_to_all, 2 broadcast, `send` a numpy uint8 view
// valid during the call and `out` a uint8 tensor of out_bytes; wait(work, slice_s) -> True when
// done, False while pending, raises the operation's error; notice() -> the abort notice a peer
// posted ("<rank>\n<code>\n<message>") or None; post_notice(text); barrier_arrive(generation)
// -> the ranks arrived so far; barrier_count(generation); close(healthy).
//
// Thread-safety: as Communicator.
#pragma once

#include <nanobind/nanobind.h>

#include <chrono>
#include <memory>

#include "zinf/comm.hpp"
#include "zinf/device.hpp"

namespace zinf_python {

// The communicator of this process's rank over `transport` (see the file comment), on `device`,
// a HostDevice whose memory host code can touch. Returns kInvalidArgument for another device or a
// timeout that is not positive, kCommError when the transport does not answer.
// REQUIRES: the GIL is held; `device` outlives the result; the result is destroyed without it.
zinf::Result<std::unique_ptr<zinf::Communicator>> make_torch_comm(
    zinf::Device& device, nanobind::object transport, std::chrono::milliseconds timeout);

}  // namespace zinf_python
