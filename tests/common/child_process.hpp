// Runs part of a test in a forked child process: for what must not touch the test process (a
// lowered resource limit, an _exit() in the middle of a save), bounded by a deadline so that a
// child that hangs fails the test instead of stalling it.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

namespace zinf::test {

// How a child run by in_child() ended.
struct ChildEnd {
  bool ended = false;  // it ended before the deadline; false: it was killed then, or never ran
  int wstatus = 0;     // waitpid()'s status when it ended
  std::string output;  // what it wrote to the pipe it was handed, or why it never ran

  // Its exit status when it ended by exiting, else -1.
  int exit_code() const { return ended && WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1; }
};

// Forks a child that runs fn(fd) and _exits with what it returns; `fd` is the write end of a
// pipe whose contents come back in ChildEnd::output. Waits for the child `timeout` at most, then
// kills it (SIGKILL). A fork copies only the calling thread: fn starts any thread it needs (an
// engine, a communicator group) itself.
inline ChildEnd in_child(const std::function<int(int fd)>& fn,
                         std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  using std::chrono::steady_clock;
  ChildEnd end;
  int fds[2];
  if (::pipe(fds) != 0) {
    end.output = "pipe() failed, errno " + std::to_string(errno);
    return end;
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::_exit(fn(fds[1]));
  }
  ::close(fds[1]);
  if (pid < 0) {
    end.output = "fork() failed, errno " + std::to_string(errno);
    ::close(fds[0]);
    return end;
  }
  // Reads what the child writes until EOF while polling for its end every 10 ms, so that a
  // grandchild that keeps the pipe open does not hold the wait.
  const steady_clock::time_point deadline = steady_clock::now() + timeout;
  bool reading = true;
  while (steady_clock::now() < deadline) {
    if (reading) {
      pollfd p{fds[0], POLLIN, 0};
      const int ready = ::poll(&p, 1, 10);
      if (ready < 0 && errno != EINTR) reading = false;
      if (ready > 0) {
        char chunk[512];
        const ssize_t got = ::read(fds[0], chunk, sizeof(chunk));
        if (got > 0) end.output.append(chunk, static_cast<std::size_t>(got));
        if (got == 0 || (got < 0 && errno != EINTR)) reading = false;
        continue;  // read on while there is more, before looking for the end
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    const pid_t done = ::waitpid(pid, &end.wstatus, WNOHANG);
    if (done == pid) {
      // Whatever it wrote before it ended is in the pipe now.
      while (reading) {
        pollfd p{fds[0], POLLIN, 0};
        char chunk[512];
        const ssize_t got = ::poll(&p, 1, 0) > 0 ? ::read(fds[0], chunk, sizeof(chunk)) : 0;
        if (got > 0) end.output.append(chunk, static_cast<std::size_t>(got));
        if (got <= 0) reading = false;
      }
      ::close(fds[0]);
      end.ended = true;
      return end;
    }
    if (done < 0 && errno != EINTR) break;
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &end.wstatus, 0);
  ::close(fds[0]);
  return end;
}

}  // namespace zinf::test
