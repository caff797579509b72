#include "zinf/status.hpp"

#include <gtest/gtest.h>

#include <cerrno>
#include <memory>
#include <string>

namespace zinf {
namespace {

TEST(Status, OkIsCheapAndEmpty) {
  Status s;
  EXPECT_TRUE(s.is_ok());
  EXPECT_EQ(s.code(), Code::kOk);
  EXPECT_EQ(s.sys_code(), 0);
  EXPECT_EQ(s.to_string(), "ok");
}

TEST(Status, CarriesCodeErrnoAndMessage) {
  Status s = status_from_errno("write /nvme/zinf/swap0 at offset 4096", ENOSPC);
  EXPECT_EQ(s.code(), Code::kNoSpace);
  EXPECT_EQ(s.sys_code(), ENOSPC);
  EXPECT_NE(s.to_string().find("/nvme/zinf/swap0"), std::string::npos);
  EXPECT_NE(s.to_string().find("No space left on device"), std::string::npos);
  EXPECT_NE(s.to_string().find("errno 28"), std::string::npos);
  EXPECT_EQ(status_from_errno("open x", ENOENT).code(), Code::kNotFound);
  EXPECT_EQ(status_from_errno("read x", EIO).code(), Code::kIoError);
}

TEST(Status, ContextAndCopies) {
  Status s = Status::corruption("block 3 checksum mismatch");
  Status c = s.with_context("key rank0/group3/exp_avg");
  EXPECT_EQ(c.code(), Code::kCorruption);
  EXPECT_EQ(c.message(), "key rank0/group3/exp_avg: block 3 checksum mismatch");
  Status copy = c;
  EXPECT_EQ(copy.to_string(), c.to_string());
  EXPECT_TRUE(Status::ok().with_context("x").is_ok());
}

Result<int> parse_positive(int x) {
  if (x <= 0) return Status::invalid_argument("x must be positive");
  return x * 2;
}

Status use(int x, int* out) {
  ZINF_ASSIGN_OR_RETURN(int y, parse_positive(x));
  *out = y;
  return Status::ok();
}

TEST(Result, ValueOrStatus) {
  auto good = parse_positive(4);
  ASSERT_TRUE(good.is_ok());
  EXPECT_EQ(*good, 8);
  auto bad = parse_positive(-1);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  int out = 0;
  EXPECT_TRUE(use(3, &out).is_ok());
  EXPECT_EQ(out, 6);
  EXPECT_EQ(use(0, &out).code(), Code::kInvalidArgument);
}

TEST(Result, HoldsMoveOnlyValues) {
  Result<std::unique_ptr<int>> r(std::make_unique<int>(5));
  ASSERT_TRUE(r.is_ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 5);
}

TEST(ResultDeathTest, ValueOfErrorAborts) {
  EXPECT_DEATH(
      {
        Result<int> r(Status::timeout("wait on ticket for file f at offset 0"));
        (void)r.value();
      },
      "timeout: wait on ticket");
}

}  // namespace
}  // namespace zinf
