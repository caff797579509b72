// zinf_run_local (include/zinf/zinf.h), used through the C ABI alone: a job trains and its ranks
// agree; the first failing rank's code and message reach the caller with the rank named; the
// other ranks are stopped; every thread has ended when the call returns.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "zinf/zinf.h"

namespace {

std::atomic<int> g_threads_ended{0};
struct ThreadEndCounter {
  bool armed = false;
  ~ThreadEndCounter() {
    if (armed) g_threads_ended.fetch_add(1);
  }
};
void count_this_thread_end() {
  thread_local ThreadEndCounter counter;
  counter.armed = true;
}

zinf_config_t* stage3_config() {
  const std::string json = R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zinf": {"collective_timeout_ms": 30000, "cpu_threads": 1}})";
  zinf_config_t* config = nullptr;
  EXPECT_EQ(zinf_config_from_json(json.data(), json.size(), &config), ZINF_OK)
      << zinf_last_error_message();
  return config;
}

struct Job {
  std::mutex mutex;
  std::vector<std::vector<float>> after = std::vector<std::vector<float>>(2);
  std::vector<zinf_code_t> seen = std::vector<zinf_code_t>(2, ZINF_OK);
  std::atomic<int> calls{0};
  std::vector<std::string> messages;
};

#define RETURN_IF_FAILED(call)          \
  do {                                  \
    const zinf_code_t code_ = (call);   \
    if (code_ != ZINF_OK) return code_; \
  } while (0)

zinf_code_t register_and_finalize(zinf_engine_t* engine) {
  const float initial[6] = {0.5f, -0.25f, 1.0f, 0.125f, -2.0f, 3.0f};
  const int64_t shape[2] = {2, 3};
  RETURN_IF_FAILED(
      zinf_engine_register_parameter(engine, "fc.w", "fc", shape, 2, ZINF_DTYPE_F32, initial));
  return zinf_engine_finalize(engine);
}

zinf_code_t train_one_step(void* user, zinf_engine_t* engine, int rank) {
  count_this_thread_end();
  Job& job = *static_cast<Job*>(user);
  job.calls.fetch_add(1);
  RETURN_IF_FAILED(register_and_finalize(engine));
  RETURN_IF_FAILED(zinf_engine_gather(engine, "fc"));
  std::vector<float> grad(6, 0.25f * static_cast<float>(rank + 1));
  const zinf_gradient_t g = {"fc.w", grad.data(), grad.size(), ZINF_DTYPE_F32};
  RETURN_IF_FAILED(zinf_engine_reduce_gradients(engine, "fc", &g, 1));
  RETURN_IF_FAILED(zinf_engine_release(engine, "fc"));
  zinf_step_report_t report;
  std::memset(&report, 0, sizeof(report));
  report.struct_size = sizeof(report);
  RETURN_IF_FAILED(zinf_engine_step(engine, &report));
  std::vector<float> values(6);
  RETURN_IF_FAILED(zinf_engine_read_parameters(engine, "fc.w", values.data(), values.size()));
  std::lock_guard lock(job.mutex);
  job.after[static_cast<std::size_t>(rank)] = values;
  return ZINF_OK;
}

TEST(CApiRunLocal, RanksTrainTogetherAndEveryThreadIsJoined) {
  zinf_config_t* config = stage3_config();
  Job job;
  g_threads_ended = 0;
  ASSERT_EQ(zinf_run_local(2, config, train_one_step, &job), ZINF_OK) << zinf_last_error_message();
  EXPECT_EQ(job.calls.load(), 2);
  EXPECT_EQ(g_threads_ended.load(), 2);
  ASSERT_EQ(job.after[0].size(), 6u);
  EXPECT_EQ(job.after[0], job.after[1]);
  EXPECT_NE(job.after[0][0], 0.5f) << "the step changed nothing";
  zinf_config_destroy(config);
}

zinf_code_t rank1_asks_for_an_unknown_module(void* user, zinf_engine_t* engine, int rank) {
  count_this_thread_end();
  Job& job = *static_cast<Job*>(user);
  // Rank 1 fails on bad input; rank 0 goes on into the all-gather that rank 1 never joins (or is
  // aborted in finalize's last collective, if rank 1 fails before rank 0 has left it).
  zinf_code_t code = register_and_finalize(engine);
  if (code == ZINF_OK) code = zinf_engine_gather(engine, rank == 1 ? "nope" : "fc");
  std::lock_guard lock(job.mutex);
  job.seen[static_cast<std::size_t>(rank)] = code;
  return code;
}

TEST(CApiRunLocal, FirstErrorNamesItsRankAndStopsTheOthers) {
  zinf_config_t* config = stage3_config();
  Job job;
  g_threads_ended = 0;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(zinf_run_local(2, config, rank1_asks_for_an_unknown_module, &job), ZINF_NOT_FOUND);
  const std::string message = zinf_last_error_message();
  EXPECT_EQ(message.rfind("rank 1: ", 0), 0u) << message;
  EXPECT_NE(message.find("'nope'"), std::string::npos) << message;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(job.seen[0], ZINF_ABORTED);
  EXPECT_EQ(g_threads_ended.load(), 2);
  zinf_config_destroy(config);
}

zinf_code_t fails_without_a_call(void*, zinf_engine_t*, int rank) {
  return rank == 0 ? ZINF_IO_ERROR : ZINF_OK;
}

TEST(CApiRunLocal, ACodeWithoutAFailedCallAndBadArguments) {
  zinf_config_t* config = stage3_config();
  EXPECT_EQ(zinf_run_local(2, config, fails_without_a_call, nullptr), ZINF_IO_ERROR);
  EXPECT_EQ(std::string(zinf_last_error_message()),
            std::string("rank 0: the rank function returned ") + zinf_code_name(ZINF_IO_ERROR));
  EXPECT_EQ(zinf_run_local(2, config, nullptr, nullptr), ZINF_INVALID_ARGUMENT);
  EXPECT_EQ(zinf_run_local(2, nullptr, fails_without_a_call, nullptr), ZINF_INVALID_ARGUMENT);
  EXPECT_EQ(zinf_run_local(0, config, fails_without_a_call, nullptr), ZINF_INVALID_ARGUMENT);
  zinf_config_destroy(config);
}

// The engine zinf_run_local lends a rank function is not a handle of the caller's: it runs on a
// host device that run_local made, and run_local closes it. A CUDA stream is refused naming the
// reason, and zinf_engine_close on it (a garbage-collected wrapper's finalizer, say) does nothing.
zinf_code_t misuses_the_lent_engine(void* user, zinf_engine_t* engine, int) {
  Job& job = *static_cast<Job*>(user);
  int fake_stream = 0;
  const zinf_code_t code = zinf_engine_set_cuda_stream(engine, &fake_stream);
  const std::string message = zinf_last_error_message();
  {
    std::lock_guard lock(job.mutex);
    job.seen[0] = code;
    job.messages.push_back(message);
  }
  RETURN_IF_FAILED(zinf_engine_set_cuda_stream(engine, nullptr));
  zinf_engine_close(engine);
  RETURN_IF_FAILED(register_and_finalize(engine));
  job.calls.fetch_add(1);
  return ZINF_OK;
}

TEST(CApiRunLocal, TheLentEngineRefusesAStreamAndIsNotClosedByTheRankFunction) {
  zinf_config_t* config = stage3_config();
  Job job;
  ASSERT_EQ(zinf_run_local(1, config, misuses_the_lent_engine, &job), ZINF_OK)
      << zinf_last_error_message();
  EXPECT_EQ(job.seen[0], ZINF_INVALID_ARGUMENT);
  ASSERT_EQ(job.messages.size(), 1u);
  EXPECT_NE(job.messages[0].find("zinf_run_local"), std::string::npos) << job.messages[0];
  EXPECT_EQ(job.calls.load(), 1);
  zinf_config_destroy(config);
}

}  // namespace
