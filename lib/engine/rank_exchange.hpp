// RankExchange: the small agreements the engine's ranks make outside the ZeRO data path. Words
// all-gathered from every rank (parameter fingerprints at finalize, checkpoint file digests), and
// agree(): every rank learns whether any rank failed a local phase, so no rank goes on into a
// collective the others left.
//
// StickyError: the engine's first operating error; once set, every later call returns it.
//
// Thread-safety: one thread (the rank's).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "zinf/comm.hpp"
#include "zinf/device.hpp"
#include "zinf/status.hpp"

namespace zinf {

class StickyError {
 public:
  // Records `st` when it is the first error; returns it either way.
  Status fail(Status st) {
    if (!st.is_ok() && first_.is_ok()) first_ = st;
    return st;
  }
  const Status& status() const { return first_; }

 private:
  Status first_;
};

class RankExchange {
 public:
  // Everything must outlive this object; `stream` and `event` are the engine's.
  RankExchange(Device& device, Communicator& comm, Stream& stream, Event& event,
               std::chrono::milliseconds timeout, StickyError& sticky)
      : device_(device),
        comm_(comm),
        stream_(stream),
        event_(event),
        timeout_(timeout),
        sticky_(sticky) {}

  // All-gathers `count` 64-bit words from every rank (as f32 pairs, which all_gather copies bit
  // for bit): rank r's words at [r * count, (r + 1) * count). Collective.
  Result<std::vector<std::uint64_t>> exchange(const std::uint64_t* words, std::size_t count);

  // Every rank's outcome of a local phase: this rank's error, else kAborted naming the first
  // rank that failed. A failure of the exchange itself is sticky. Collective.
  Status agree(std::string_view call, Status local);

 private:
  Device& device_;
  Communicator& comm_;
  Stream& stream_;
  Event& event_;
  std::chrono::milliseconds timeout_;
  StickyError& sticky_;
};

}  // namespace zinf
