// Every injected fault gives its documented Status (lib/io/fault.hpp), never a hang or a crash,
// and the data of the requests that succeeded is intact. Each test prints its seed.
#include "io/fault.hpp"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "base/random.hpp"
#include "io_test_util.hpp"

namespace zinf {
namespace {

using io_test::must_open;
using io_test::random_buffer;
using io_test::read_file_plain;
using io_test::ScratchDir;

constexpr std::size_t kRequestBytes = 64 << 10;  // two pieces of 32 KiB
constexpr int kRequests = 200;
constexpr std::size_t kTotal = kRequestBytes * kRequests;

class FaultTest : public io_test::EngineKindTest {
 protected:
  // An engine with `spec` injected (disabled until the reference data is on disk), a file
  // holding kTotal random bytes, and those bytes in `source_`.
  void open(const FaultSpec& spec, const std::string& name) {
    std::printf("fault test %s: seed %llu\n", name.c_str(),
                static_cast<unsigned long long>(spec.seed));
    dir_ = std::make_unique<ScratchDir>(name);
    path_ = dir_->file("data.bin");
    faults_ = std::make_shared<FaultInjector>(spec);
    faults_->set_enabled(false);
    IoOptions options;
    options.block_bytes = 32 << 10;
    options.queue_depth = 16;
    options.rings = 2;
    options.max_requests = 512;
    options.retry_max = 8;
    options.faults = faults_;
    engine_ = must_open(GetParam(), options);
    ASSERT_TRUE(engine_);
    Result<FileHandle> file = engine_->open_file(path_, {.create = true});
    ASSERT_TRUE(file.is_ok()) << file.status().to_string();
    file_ = *file;
    source_ = random_buffer(kTotal, spec.seed ^ 0x5eed);
    const Status written = engine_->write_sync(file_, 0, kTotal, source_.data());
    ASSERT_TRUE(written.is_ok()) << written.to_string();
    faults_->set_enabled(true);
  }

  // Submits every request before waiting for any; returns each request's Status.
  std::vector<Status> run_all(IoOp op, std::byte* memory) {
    std::vector<Ticket> tickets;
    for (int i = 0; i < kRequests; ++i) {
      Result<Ticket> t = engine_->submit(
          IoRequest{op, file_, i * kRequestBytes, kRequestBytes, memory + i * kRequestBytes});
      EXPECT_TRUE(t.is_ok()) << t.status().to_string();
      tickets.push_back(*t);
    }
    std::vector<Status> out;
    for (Ticket t : tickets) out.push_back(engine_->wait(t, std::chrono::seconds(60)));
    return out;
  }

  bool request_intact(const std::byte* got, int i) const {
    return std::memcmp(got + i * kRequestBytes, source_.data() + i * kRequestBytes,
                       kRequestBytes) == 0;
  }

  // Names the file and an offset, as every I/O error must.
  void expect_names_place(const Status& s) const {
    EXPECT_NE(s.message().find(path_), std::string::npos) << s.to_string();
    EXPECT_NE(s.message().find("offset "), std::string::npos) << s.to_string();
  }

  std::unique_ptr<ScratchDir> dir_;
  std::string path_;
  std::shared_ptr<FaultInjector> faults_;
  std::unique_ptr<IoEngine> engine_;
  FileHandle file_;
  AlignedBuffer source_;
};

TEST_P(FaultTest, EioFailsItsRequestAndLeavesOthersIntact) {
  open({.seed = 101, .eio_rate = 0.2}, "eio");
  AlignedBuffer back(kTotal);
  std::memset(back.data(), 0, kTotal);
  std::vector<Status> results = run_all(IoOp::kRead, back.data());
  int failed = 0;
  for (int i = 0; i < kRequests; ++i) {
    if (results[i].is_ok()) {
      EXPECT_TRUE(request_intact(back.data(), i)) << "request " << i;
    } else {
      ++failed;
      EXPECT_EQ(results[i].code(), Code::kIoError) << results[i].to_string();
      EXPECT_EQ(results[i].sys_code(), EIO);
      expect_names_place(results[i]);
    }
  }
  EXPECT_GT(failed, 0);
  EXPECT_LT(failed, kRequests);
  EXPECT_GE(faults_->counts().eio, static_cast<std::uint64_t>(failed));
  EXPECT_EQ(engine_->stats().failed_requests, static_cast<std::uint64_t>(failed));
}

TEST_P(FaultTest, EnospcOnWriteIsNoSpaceNamingThePath) {
  open({.seed = 202, .enospc_rate = 0.2}, "enospc");
  AlignedBuffer fresh = random_buffer(kTotal, 0xf7e5);
  std::vector<Status> results = run_all(IoOp::kWrite, fresh.data());
  faults_->set_enabled(false);
  const std::string on_disk = read_file_plain(path_);
  ASSERT_EQ(on_disk.size(), kTotal);
  int failed = 0;
  for (int i = 0; i < kRequests; ++i) {
    if (results[i].is_ok()) {
      EXPECT_EQ(std::memcmp(on_disk.data() + i * kRequestBytes, fresh.data() + i * kRequestBytes,
                            kRequestBytes),
                0)
          << "request " << i;
    } else {
      ++failed;
      EXPECT_EQ(results[i].code(), Code::kNoSpace) << results[i].to_string();
      EXPECT_EQ(results[i].sys_code(), ENOSPC);
      expect_names_place(results[i]);
    }
  }
  EXPECT_GT(failed, 0);
}

TEST_P(FaultTest, ShortTransfersAreResumed) {
  open({.seed = 303, .short_rate = 0.5}, "short");
  AlignedBuffer back(kTotal);
  std::memset(back.data(), 0, kTotal);
  for (const Status& s : run_all(IoOp::kRead, back.data())) EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(std::memcmp(back.data(), source_.data(), kTotal), 0);
  AlignedBuffer fresh = random_buffer(kTotal, 0x3030);
  for (const Status& s : run_all(IoOp::kWrite, fresh.data())) {
    EXPECT_TRUE(s.is_ok()) << s.to_string();
  }
  EXPECT_EQ(std::memcmp(read_file_plain(path_).data(), fresh.data(), kTotal), 0);
  EXPECT_GT(faults_->counts().short_io, 0u);
  EXPECT_EQ(engine_->stats().short_resubmits, faults_->counts().short_io);
}

TEST_P(FaultTest, EintrAndEagainAreRetried) {
  open({.seed = 404, .eintr_rate = 0.1, .eagain_rate = 0.1}, "eintr");
  AlignedBuffer back(kTotal);
  std::memset(back.data(), 0, kTotal);
  for (const Status& s : run_all(IoOp::kRead, back.data())) EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(std::memcmp(back.data(), source_.data(), kTotal), 0);
  const FaultCounts counts = faults_->counts();
  EXPECT_GT(counts.eintr, 0u);
  EXPECT_GT(counts.eagain, 0u);
  EXPECT_EQ(engine_->stats().retries, counts.eintr + counts.eagain);
}

// Retries are bounded: an EINTR that never stops becomes an error after retry_max tries.
TEST_P(FaultTest, EndlessEintrGivesUpWithErrno) {
  open({.seed = 505, .eintr_rate = 1.0}, "eintr-forever");
  AlignedBuffer back(kRequestBytes);
  Status s = engine_->read_sync(file_, 0, kRequestBytes, back.data());
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_EQ(s.sys_code(), EINTR);
  expect_names_place(s);
}

// The engine cannot see a flipped bit; the injector flips exactly one bit per piece read.
TEST_P(FaultTest, BitFlipsChangeExactlyOneBitPerPiece) {
  open({.seed = 606, .bit_flip_rate = 1.0}, "flip");
  AlignedBuffer back(kTotal);
  for (const Status& s : run_all(IoOp::kRead, back.data())) EXPECT_TRUE(s.is_ok());
  std::uint64_t bits = 0;
  const auto* a = reinterpret_cast<const unsigned char*>(back.data());
  const auto* b = reinterpret_cast<const unsigned char*>(source_.data());
  for (std::size_t i = 0; i < kTotal; ++i) bits += __builtin_popcount(a[i] ^ b[i]);
  EXPECT_EQ(bits, faults_->counts().bit_flip);
  EXPECT_EQ(bits, static_cast<std::uint64_t>(kTotal / (32 << 10)));
}

// Everything at once, with latency: no hang, every failure one of the documented codes, every
// success intact.
TEST_P(FaultTest, MixedFaultsNeverHangAndKeepSuccessesIntact) {
  open({.seed = 707,
        .eio_rate = 0.05,
        .enospc_rate = 0.05,
        .short_rate = 0.2,
        .eintr_rate = 0.1,
        .eagain_rate = 0.1,
        .latency_rate = 0.05,
        .latency = std::chrono::microseconds(500)},
       "mixed");
  AlignedBuffer back(kTotal);
  std::memset(back.data(), 0, kTotal);
  std::vector<Status> results = run_all(IoOp::kRead, back.data());
  int ok = 0;
  for (int i = 0; i < kRequests; ++i) {
    if (results[i].is_ok()) {
      ++ok;
      EXPECT_TRUE(request_intact(back.data(), i)) << "request " << i;
    } else {
      EXPECT_EQ(results[i].code(), Code::kIoError) << results[i].to_string();
      expect_names_place(results[i]);
    }
  }
  EXPECT_GT(ok, kRequests / 2);
}

// A piece whose completion never arrives: wait() times out, again and again, until cancel();
// the request then fails with ECANCELED naming the file and offset, and the engine goes on.
TEST_P(FaultTest, HungPieceTimesOutUntilCancelled) {
  open({.seed = 808, .hang_rate = 1.0, .hang_max = 1}, "hang");
  AlignedBuffer back(kRequestBytes);
  Result<Ticket> ticket = engine_->read(file_, kRequestBytes, kRequestBytes, back.data());
  ASSERT_TRUE(ticket.is_ok()) << ticket.status().to_string();
  for (int i = 0; i < 3; ++i) {
    const Status s = engine_->wait(*ticket, std::chrono::milliseconds(30));
    EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
    expect_names_place(s);
  }
  EXPECT_FALSE(engine_->poll(*ticket));
  EXPECT_EQ(faults_->counts().hang, 1u);
  EXPECT_TRUE(engine_->cancel(*ticket).is_ok());
  const auto start = std::chrono::steady_clock::now();
  const Status s = engine_->wait(*ticket, std::chrono::seconds(10));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_EQ(s.sys_code(), ECANCELED);
  EXPECT_NE(s.message().find("cancelled"), std::string::npos) << s.to_string();
  expect_names_place(s);
  // hang_max is used up: the same read now succeeds, with the file's bytes.
  std::memset(back.data(), 0, kRequestBytes);
  const Status again = engine_->read_sync(file_, kRequestBytes, kRequestBytes, back.data());
  ASSERT_TRUE(again.is_ok()) << again.to_string();
  EXPECT_EQ(std::memcmp(back.data(), source_.data() + kRequestBytes, kRequestBytes), 0);
  // Cancelling a request that already finished changes nothing.
  Result<Ticket> done = engine_->read(file_, 0, kRequestBytes, back.data());
  ASSERT_TRUE(done.is_ok());
  while (!engine_->poll(*done)) std::this_thread::yield();
  EXPECT_TRUE(engine_->cancel(*done).is_ok());
  EXPECT_TRUE(engine_->wait(*done, std::chrono::seconds(10)).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), source_.data(), kRequestBytes), 0);
}

// A device that ignores the cancel too: the request stays in flight (its memory off limits),
// and closing the engine still returns.
TEST_P(FaultTest, HungPieceThatIgnoresCancelEndsWithTheEngine) {
  open({.seed = 909, .hang_rate = 1.0, .hang_max = 1, .hang_ignores_cancel = true}, "hang-stuck");
  AlignedBuffer fresh = random_buffer(kRequestBytes, 0x909);
  Result<Ticket> ticket = engine_->write(file_, 0, kRequestBytes, fresh.data());
  ASSERT_TRUE(ticket.is_ok()) << ticket.status().to_string();
  EXPECT_EQ(engine_->wait(*ticket, std::chrono::milliseconds(30)).code(), Code::kTimeout);
  EXPECT_TRUE(engine_->cancel(*ticket).is_ok());
  EXPECT_EQ(engine_->wait(*ticket, std::chrono::milliseconds(100)).code(), Code::kTimeout);
  EXPECT_FALSE(engine_->poll(*ticket));
  const auto start = std::chrono::steady_clock::now();
  engine_.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// A cancel that arrives while the injector still holds the piece (before the engine has marked it
// hung) must still release it: the thread engine once lost such a cancel and kept the piece in
// flight until the engine closed.
TEST_P(FaultTest, ACancelBeforeThePieceHangsStillReleasesIt) {
  open({.seed = 808,
        .latency_rate = 1.0,
        .latency = std::chrono::microseconds(300000),
        .hang_rate = 1.0,
        .hang_max = 1},
       "hang-cancel-early");
  AlignedBuffer back(kRequestBytes);
  Result<Ticket> ticket = engine_->read(file_, kRequestBytes, kRequestBytes, back.data());
  ASSERT_TRUE(ticket.is_ok()) << ticket.status().to_string();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(engine_->cancel(*ticket).is_ok());
  const Status s = engine_->wait(*ticket, std::chrono::seconds(3));
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_EQ(s.sys_code(), ECANCELED);
}

INSTANTIATE_TEST_SUITE_P(Kinds, FaultTest, io_test::kAllEngineKinds, io_test::kind_name);

}  // namespace
}  // namespace zinf
