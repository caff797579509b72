// UringEngine's own error paths, where the engine talks to the ring rather than to the drive:
// a hard io_uring_submit error, a persistently failing io_uring_wait_cqe, and a submission queue
// filled with cancels while the kernel takes nothing. The ring faults come from FaultSpec
// (lib/io/fault.hpp); the reads that stay in the kernel are reads of an empty pipe.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "io/fault.hpp"
#include "io/io_engine.hpp"
#include "io_test_util.hpp"

namespace zinf {
namespace {

using io_test::must_open;
using io_test::random_buffer;
using io_test::ScratchDir;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr std::size_t kBlock = 4096;

class UringRingFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!io_test::uring_available(&why)) GTEST_SKIP() << "io_uring unavailable here: " << why;
  }
};

double cpu_seconds() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
}

std::size_t count_lines_with(const std::string& text, const std::string& needle) {
  std::size_t count = 0;
  for (std::size_t at = text.find(needle); at != std::string::npos;
       at = text.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

// A hard submit error (EFAULT: not one the engine retries) reaches wait() of the request whose
// pieces were queued, at once, naming the file and offset; later requests on the broken ring
// fail the same way instead of timing out; the engine closes cleanly.
TEST_F(UringRingFaults, HardSubmitErrorFailsTheRequestsNotATimeout) {
  ScratchDir dir("uring-submit-error");
  const std::string path = dir.file("data.bin");
  FaultSpec spec;
  spec.submit_errno = EFAULT;
  auto faults = std::make_shared<FaultInjector>(spec);
  faults->set_enabled(false);
  auto engine = must_open(EngineKind::kUring,
                          {.block_bytes = kBlock, .queue_depth = 4, .rings = 1, .faults = faults});
  ASSERT_TRUE(engine);
  Result<FileHandle> file = engine->open_file(path, {.create = true});
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  AlignedBuffer data = random_buffer(16 * kBlock, 19);
  ASSERT_TRUE(engine->write_sync(*file, 0, data.bytes(), data.data()).is_ok());

  faults->set_enabled(true);
  AlignedBuffer got(16 * kBlock, 4096);
  Result<Ticket> t = engine->read(*file, 0, got.bytes(), got.data());
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  const auto start = std::chrono::steady_clock::now();
  const Status s = engine->wait(*t, seconds(5));
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(1));
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_EQ(s.sys_code(), EFAULT) << s.to_string();
  EXPECT_NE(s.message().find("read of " + path + " at offset 0"), std::string::npos)
      << s.to_string();
  EXPECT_NE(s.message().find("io_uring_submit"), std::string::npos) << s.to_string();

  // The ring stays broken even when the kernel would take entries again.
  faults->set_enabled(false);
  Result<Ticket> later = engine->read(*file, 8 * kBlock, kBlock, got.data());
  ASSERT_TRUE(later.is_ok());
  const Status again = engine->wait(*later, seconds(5));
  EXPECT_EQ(again.sys_code(), EFAULT) << again.to_string();
  EXPECT_NE(again.message().find("at offset " + std::to_string(8 * kBlock)), std::string::npos)
      << again.to_string();
  EXPECT_EQ(faults->counts().submit_error, 1u);
  engine.reset();  // must not hang or abort
}

// io_uring_wait_cqe failing on every call: completions are still reaped (data round-trips), the
// ring's thread does not spin (CPU time stays a small part of the wall time), and the error is
// logged once, not once per failed wait.
TEST_F(UringRingFaults, PersistentWaitErrorNeitherSpinsNorFloodsTheLog) {
  ScratchDir dir("uring-wait-error");
  const std::string path = dir.file("data.bin");
  FaultSpec spec;
  spec.wait_errno = EBADF;
  auto faults = std::make_shared<FaultInjector>(spec);
  ::testing::internal::CaptureStderr();
  double cpu_used = 0;
  const auto wall = milliseconds(600);
  {
    auto engine = must_open(EngineKind::kUring,
                            {.block_bytes = kBlock, .queue_depth = 4, .rings = 1, .faults = faults});
    ASSERT_TRUE(engine);
    Result<FileHandle> file = engine->open_file(path, {.create = true});
    ASSERT_TRUE(file.is_ok()) << file.status().to_string();
    AlignedBuffer data = random_buffer(32 * kBlock, 23);
    AlignedBuffer got(32 * kBlock, 4096);
    EXPECT_TRUE(engine->write_sync(*file, 0, data.bytes(), data.data()).is_ok());
    EXPECT_TRUE(engine->read_sync(*file, 0, got.bytes(), got.data()).is_ok());
    EXPECT_EQ(std::memcmp(got.data(), data.data(), data.bytes()), 0);
    const double before = cpu_seconds();
    std::this_thread::sleep_for(wall);  // the ring's thread is alone, waiting
    cpu_used = cpu_seconds() - before;
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_LT(cpu_used, 0.25 * std::chrono::duration<double>(wall).count())
      << "the completion loop spins: " << cpu_used << " s of CPU in " << wall.count() << " ms";
  EXPECT_EQ(count_lines_with(log, "waiting for io_uring completions failed"), 1u)
      << log.substr(0, 2000);
  EXPECT_GT(faults->counts().wait_error, 0u);
}

// The submission queue filled with cancels while io_uring_submit answers EBUSY (the kernel takes
// nothing): a new request waits for room instead of tripping an assertion, repeated cancels do
// not overflow the queue, and once the kernel takes entries again everything completes: the
// blocked read as cancelled, the other request with its data. The destructor then finds its
// entry for the wake-up no-op.
TEST_F(UringRingFaults, FullSubmissionQueueWithCancelsNeitherAbortsNorWedges) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0) << std::strerror(errno);
  ScratchDir dir("uring-full-sq");
  const std::string path = dir.file("data.bin");
  FaultSpec spec;
  spec.submit_errno = EBUSY;
  auto faults = std::make_shared<FaultInjector>(spec);
  faults->set_enabled(false);
  auto engine = must_open(EngineKind::kUring,
                          {.block_bytes = kBlock, .queue_depth = 2, .rings = 1, .faults = faults});
  ASSERT_TRUE(engine);
  Result<FileHandle> pipe = engine->adopt_fd(fds[0], "test-pipe", /*direct=*/false);
  ASSERT_TRUE(pipe.is_ok()) << pipe.status().to_string();
  Result<FileHandle> file = engine->open_file(path, {.create = true});
  ASSERT_TRUE(file.is_ok());
  AlignedBuffer data = random_buffer(2 * kBlock, 29);
  ASSERT_TRUE(engine->write_sync(*file, 0, data.bytes(), data.data()).is_ok());

  faults->set_enabled(true);
  AlignedBuffer blocked(kBlock, 4096);
  Result<Ticket> a = engine->read(*pipe, 0, kBlock, blocked.data());
  ASSERT_TRUE(a.is_ok());
  // Every cancel adds an entry while the kernel takes none.
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(engine->cancel(*a).is_ok());
  AlignedBuffer got(2 * kBlock, 4096);
  Result<Ticket> b = engine->read(*file, 0, got.bytes(), got.data());
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(engine->wait(*b, milliseconds(100)).code(), Code::kTimeout);

  faults->set_enabled(false);
  EXPECT_TRUE(engine->cancel(*a).is_ok());  // its submit now reaches the kernel
  const Status sa = engine->wait(*a, seconds(5));
  EXPECT_EQ(sa.sys_code(), ECANCELED) << sa.to_string();
  const Status sb = engine->wait(*b, seconds(5));
  EXPECT_TRUE(sb.is_ok()) << sb.to_string();
  EXPECT_EQ(std::memcmp(got.data(), data.data(), data.bytes()), 0);
  EXPECT_GT(faults->counts().submit_error, 0u);

  // Again with the queue full at the end: the destructor must still wake the ring's thread.
  faults->set_enabled(true);
  Result<Ticket> c = engine->read(*pipe, 0, kBlock, blocked.data());
  ASSERT_TRUE(c.is_ok());
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(engine->cancel(*c).is_ok());
  engine.reset();  // must neither abort nor hang
  ::close(fds[0]);
  ::close(fds[1]);
}

}  // namespace
}  // namespace zinf
