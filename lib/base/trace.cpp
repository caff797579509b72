#include "zinf/trace.hpp"

#include <time.h>

#include <cerrno>
#include <cstdio>
#include <nlohmann/json.hpp>

namespace zinf {

Trace::Trace(std::size_t max_events) : max_events_(max_events), origin_ns_(now_ns()) {
  events_.reserve(max_events_ < 4096 ? max_events_ : 4096);
}

std::int64_t Trace::now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

int Trace::track(std::string_view name) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < tracks_.size(); ++i) {
    if (tracks_[i] == name) return static_cast<int>(i);
  }
  tracks_.emplace_back(name);
  return static_cast<int>(tracks_.size() - 1);
}

void Trace::add(int track, std::string_view name, std::int64_t start_ns, std::int64_t end_ns,
                std::string_view args_json) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (events_.size() >= max_events_) {
    ++dropped_;
    return;
  }
  events_.push_back(Event{track, std::string(name), start_ns,
                          end_ns > start_ns ? end_ns - start_ns : 0, std::string(args_json)});
}

Trace::Span::Span(Trace* trace, int track, std::string_view name)
    : trace_(trace), track_(track), start_ns_(0) {
  if (trace_ != nullptr) {
    name_.assign(name);
    start_ns_ = now_ns();
  }
}

Trace::Span::Span(Span&& other) noexcept
    : trace_(other.trace_),
      track_(other.track_),
      name_(std::move(other.name_)),
      start_ns_(other.start_ns_) {
  other.trace_ = nullptr;
}

void Trace::Span::end() {
  if (trace_ == nullptr) return;
  trace_->add(track_, name_, start_ns_, now_ns());
  trace_ = nullptr;
}

std::size_t Trace::event_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

std::size_t Trace::dropped_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return dropped_;
}

std::vector<Trace::Event> Trace::events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_;
}

std::vector<std::string> Trace::track_names() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return tracks_;
}

std::string Trace::to_json() const {
  std::lock_guard<std::mutex> lock(mutex_);
  using nlohmann::json;
  json events = json::array();
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", 1}, {"args", {{"name", "zinf"}}}});
  for (std::size_t i = 0; i < tracks_.size(); ++i) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", static_cast<int>(i)},
                      {"args", {{"name", tracks_[i]}}}});
    events.push_back({{"name", "thread_sort_index"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", static_cast<int>(i)},
                      {"args", {{"sort_index", static_cast<int>(i)}}}});
  }
  for (const Event& e : events_) {
    json event = {{"name", e.name},
                  {"ph", "X"},
                  {"pid", 1},
                  {"tid", e.track},
                  {"ts", static_cast<double>(e.start_ns - origin_ns_) / 1e3},
                  {"dur", static_cast<double>(e.duration_ns) / 1e3}};
    if (!e.args_json.empty()) {
      json args = json::parse(e.args_json, nullptr, /*allow_exceptions=*/false);
      if (!args.is_discarded()) event["args"] = std::move(args);
    }
    events.push_back(std::move(event));
  }
  json root = {{"traceEvents", std::move(events)},
               {"displayTimeUnit", "ms"},
               {"metadata", {{"producer", "zinf"}, {"dropped_events", dropped_}}}};
  return root.dump();
}

Status Trace::write_json(const std::string& path) const {
  const std::string text = to_json();
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) return status_from_errno("open trace file " + path, errno);
  const std::size_t written = std::fwrite(text.data(), 1, text.size(), file);
  const int write_errno = errno;
  if (std::fclose(file) != 0 || written != text.size()) {
    return status_from_errno("write trace file " + path, write_errno ? write_errno : EIO);
  }
  return Status::ok();
}

}  // namespace zinf
