// Trace: timed spans on named tracks, written as Chrome trace JSON ("traceEvents" with complete
// "X" events and thread_name metadata), which Perfetto (ui.perfetto.dev) and chrome://tracing
// open. Each track shows as one row; the engine puts reads, updates and writes on their own rows.
//
// Memory is bounded: at most `max_events` spans are kept; later ones are counted as dropped and
// the count is written into the file's metadata.
//
// Thread-safety: all methods may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/status.hpp"

namespace zinf {

class Trace {
 public:
  struct Event {
    int track;
    std::string name;
    std::int64_t start_ns;  // from Trace::now_ns()
    std::int64_t duration_ns;
    std::string args_json;  // "" or a JSON object, written as the event's "args"
  };

  explicit Trace(std::size_t max_events = std::size_t{1} << 20);

  // Monotonic clock in nanoseconds (CLOCK_MONOTONIC).
  static std::int64_t now_ns();

  // Returns the id of the track called `name`, creating it on first use.
  int track(std::string_view name);

  // Records a finished span.
  void add(int track, std::string_view name, std::int64_t start_ns, std::int64_t end_ns,
           std::string_view args_json = {});

  // RAII span: starts at construction, recorded when it ends or is destroyed. A Span made from a
  // null Trace does nothing, so callers can trace optionally without branches.
  class Span {
   public:
    Span(Trace* trace, int track, std::string_view name);
    Span(Span&& other) noexcept;
    Span& operator=(Span&&) = delete;
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;
    ~Span() { end(); }
    void end();

   private:
    Trace* trace_;
    int track_;
    std::string name_;
    std::int64_t start_ns_;
  };
  Span span(int track, std::string_view name) { return Span(this, track, name); }

  std::size_t event_count() const;
  std::size_t dropped_count() const;
  std::vector<Event> events() const;
  std::vector<std::string> track_names() const;

  // The whole trace as Chrome trace JSON. Timestamps are microseconds from the trace's creation.
  std::string to_json() const;
  // Writes to_json() to `path`; the error names the path.
  Status write_json(const std::string& path) const;

 private:
  mutable std::mutex mutex_;
  std::size_t max_events_;
  std::size_t dropped_ = 0;
  std::int64_t origin_ns_;
  std::vector<std::string> tracks_;
  std::vector<Event> events_;
};

}  // namespace zinf
