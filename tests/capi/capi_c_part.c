/* The C side of the C API tests: compiled as C99 (tests/CMakeLists.txt), so zinf.h is checked to
 * be plain C, and the training loop below is what a C embedder would write. */
#define _POSIX_C_SOURCE 200809L

#include "capi_c_part.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zinf/zinf.h"

/* ---- The model --------------------------------------------------------------------------------
 */

static const char* const kModules[] = {"embed", "block0", "block1", "head"};

static const capi_param_def_t kParams[] = {
    {"embed.w", "embed", {37, 13}, 2, ZINF_DTYPE_F32},
    {"block0.w", "block0", {29, 31}, 2, ZINF_DTYPE_BF16},
    {"block0.b", "block0", {29, 0}, 1, ZINF_DTYPE_F32},
    {"block1.w", "block1", {41, 7}, 2, ZINF_DTYPE_BF16},
    {"block1.b", "block1", {41, 0}, 1, ZINF_DTYPE_BF16},
    {"block1.scale", "block1", {0, 0}, 0, ZINF_DTYPE_F32},
    {"head.w", "head", {13, 37}, 2, ZINF_DTYPE_F32},
    {"head.b", "head", {13, 0}, 1, ZINF_DTYPE_F32},
};

#define CAPI_MODULES (sizeof(kModules) / sizeof(kModules[0]))
#define CAPI_PARAMS (sizeof(kParams) / sizeof(kParams[0]))

size_t capi_model_module_count(void) { return CAPI_MODULES; }
const char* capi_model_module(size_t m) { return kModules[m]; }
size_t capi_model_param_count(void) { return CAPI_PARAMS; }
const capi_param_def_t* capi_model_param(size_t p) { return &kParams[p]; }

size_t capi_model_element_count(size_t p) {
  size_t count = 1;
  size_t d;
  for (d = 0; d < kParams[p].ndim; ++d) count *= (size_t)kParams[p].shape[d];
  return count;
}

/* SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014). */
static uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Uniform in [-1, 1): the top 24 bits as a fraction, which a float holds exactly. */
static float uniform(uint64_t* state) {
  return (float)(splitmix64(state) >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

/* bf16 <- f32, round to nearest even (no NaNs here: the values are finite). */
static uint16_t to_bf16(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static float from_bf16(uint16_t value) {
  const uint32_t bits = (uint32_t)value << 16;
  float out;
  memcpy(&out, &bits, sizeof out);
  return out;
}

void capi_model_initial(size_t p, uint64_t seed, float* out) {
  uint64_t state = seed * 1000u + p;
  const size_t count = capi_model_element_count(p);
  size_t i;
  for (i = 0; i < count; ++i) out[i] = uniform(&state);
}

void capi_model_grad(size_t p, const void* w, int rank, int step, int micro, double loss_scale,
                     void* grad) {
  uint64_t state =
      ((uint64_t)rank * 1000003u + (uint64_t)step * 1009u + (uint64_t)micro * 101u + p) *
      2654435761u;
  const size_t count = capi_model_element_count(p);
  const float scale = (float)(0.5 * loss_scale);
  size_t i;
  for (i = 0; i < count; ++i) {
    const float target = uniform(&state);
    if (kParams[p].dtype == ZINF_DTYPE_BF16) {
      const float wi = from_bf16(((const uint16_t*)w)[i]);
      ((uint16_t*)grad)[i] = to_bf16((wi - target) * scale);
    } else {
      const float wi = ((const float*)w)[i];
      ((float*)grad)[i] = (wi - target) * scale;
    }
  }
}

/* ---- Training through the C API ---------------------------------------------------------------
 */

typedef struct rank_task {
  const capi_run_t* run;
  const zinf_config_t* config;
  zinf_device_t* device;
  zinf_comm_group_t* group;
  int rank;
  int code;
  char error[1024];
} rank_task_t;

/* On failure: records the call, the code's name and the message, and leaves through `done`. */
#define CHECK(call)                                                                       \
  do {                                                                                    \
    const zinf_code_t code_ = (call);                                                     \
    if (code_ != ZINF_OK) {                                                               \
      task->code = (int)code_;                                                            \
      snprintf(task->error, sizeof task->error, "rank %d: %s: %s: %s", task->rank, #call, \
               zinf_code_name(code_), zinf_last_error_message());                         \
      goto done;                                                                          \
    }                                                                                     \
  } while (0)

#define EXPECT(condition)                                                                        \
  do {                                                                                           \
    if (!(condition)) {                                                                          \
      task->code = ZINF_INTERNAL;                                                                \
      snprintf(task->error, sizeof task->error, "rank %d: expected %s", task->rank, #condition); \
      goto done;                                                                                 \
    }                                                                                            \
  } while (0)

/* The user data of one parameter's initializer. */
typedef struct initializer_data {
  size_t param;
  uint64_t seed;
  uint32_t* asked; /* NULL: not counted */
} initializer_data_t;

/* Serves elements [first_element, first_element + element_count) of capi_model_initial's values,
 * generating the whole parameter each time (the test's parameters are small). */
static zinf_code_t serve_initial(void* user, size_t first_element, size_t element_count,
                                 float* out) {
  const initializer_data_t* data = (const initializer_data_t*)user;
  const size_t count = capi_model_element_count(data->param);
  float* all = NULL;
  size_t i;
  if (first_element > count || element_count > count - first_element) return ZINF_INTERNAL;
  all = (float*)malloc(count * sizeof(float));
  if (all == NULL) return ZINF_RESOURCE_EXHAUSTED;
  capi_model_initial(data->param, data->seed, all);
  memcpy(out, all + first_element, element_count * sizeof(float));
  free(all);
  if (data->asked != NULL) {
    for (i = 0; i < element_count; ++i) ++data->asked[first_element + i];
  }
  return ZINF_OK;
}

static void train_rank(rank_task_t* task) {
  const capi_run_t* run = task->run;
  zinf_engine_t* engine = NULL;
  zinf_comm_t* comm = NULL;
  zinf_env_t env;
  void* grads[CAPI_PARAMS] = {NULL};
  zinf_gradient_t refs[CAPI_PARAMS];
  float* initial = NULL;
  initializer_data_t init_data[CAPI_PARAMS];
  size_t p;
  size_t m;
  int step;
  int micro;
  int rank = -1;
  int world = 0;
  char track[32];
  int64_t span_start_ns = 0;

  CHECK(zinf_comm_group_get(task->group, task->rank, &comm));
  memset(&env, 0, sizeof env);
  env.struct_size = sizeof env;
  env.device = task->device;
  env.comm = comm;
  if (run->nvme_dir != NULL) {
    env.nvme_paths = &run->nvme_dir;
    env.nvme_path_count = 1;
  }
  env.trace = run->trace;
  snprintf(track, sizeof track, "rank %d", task->rank);
  CHECK(zinf_engine_open(task->config, &env, &engine));
  CHECK(zinf_engine_rank(engine, &rank));
  CHECK(zinf_engine_world_size(engine, &world));
  EXPECT(rank == task->rank && world == run->world_size);

  for (p = 0; p < CAPI_PARAMS; ++p) {
    const size_t count = capi_model_element_count(p);
    if (run->use_initializer) {
      /* init_data lives until finalize below returns, as zinf.h requires. */
      init_data[p].param = p;
      init_data[p].seed = run->seed;
      init_data[p].asked =
          run->asked != NULL ? run->asked[(size_t)task->rank * CAPI_PARAMS + p] : NULL;
      CHECK(zinf_engine_register_parameter_with_initializer(
          engine, kParams[p].name, kParams[p].module, kParams[p].shape, kParams[p].ndim,
          kParams[p].dtype, serve_initial, &init_data[p]));
    } else {
      initial = (float*)malloc(count * sizeof(float));
      EXPECT(initial != NULL);
      capi_model_initial(p, run->seed, initial);
      CHECK(zinf_engine_register_parameter(engine, kParams[p].name, kParams[p].module,
                                           kParams[p].shape, kParams[p].ndim, kParams[p].dtype,
                                           initial));
      free(initial);
      initial = NULL;
    }
    grads[p] = malloc(count * sizeof(float));
    EXPECT(grads[p] != NULL);
  }
  CHECK(zinf_engine_finalize(engine));

  for (step = 1; step <= run->steps; ++step) {
    zinf_step_report_t report;
    if (step == run->lr_change_step) {
      CHECK(zinf_engine_set_learning_rate(engine, run->lr_change_value));
    }
    for (micro = 0; micro < run->micro_batches; ++micro) {
      double loss_scale = 0.0;
      CHECK(zinf_engine_loss_scale(engine, &loss_scale));
      /* Forward: every module's parameters are there, of the registered dtype and size. */
      span_start_ns = zinf_trace_now_ns();
      for (m = 0; m < CAPI_MODULES; ++m) {
        CHECK(zinf_engine_gather(engine, kModules[m]));
        for (p = 0; p < CAPI_PARAMS; ++p) {
          void* data = NULL;
          zinf_dtype_t dtype = ZINF_DTYPE_F16;
          size_t count = 0;
          if (strcmp(kParams[p].module, kModules[m]) != 0) continue;
          CHECK(zinf_engine_parameter(engine, kParams[p].name, &data, &dtype, &count));
          EXPECT(data != NULL && dtype == kParams[p].dtype && count == capi_model_element_count(p));
        }
        CHECK(zinf_engine_release(engine, kModules[m]));
      }
      if (run->trace != NULL) {
        CHECK(zinf_trace_add(run->trace, track, "forward", span_start_ns, zinf_trace_now_ns()));
      }
      /* Backward, in reverse: gradients from the gathered values. */
      span_start_ns = zinf_trace_now_ns();
      for (m = CAPI_MODULES; m-- > 0;) {
        size_t ref_count = 0;
        CHECK(zinf_engine_gather(engine, kModules[m]));
        for (p = 0; p < CAPI_PARAMS; ++p) {
          void* data = NULL;
          if (strcmp(kParams[p].module, kModules[m]) != 0) continue;
          CHECK(zinf_engine_parameter(engine, kParams[p].name, &data, NULL, NULL));
          capi_model_grad(p, data, task->rank, step, micro, loss_scale, grads[p]);
          refs[ref_count].name = kParams[p].name;
          refs[ref_count].data = grads[p];
          refs[ref_count].element_count = capi_model_element_count(p);
          refs[ref_count].dtype = kParams[p].dtype;
          ++ref_count;
        }
        CHECK(zinf_engine_reduce_gradients(engine, kModules[m], refs, ref_count));
        CHECK(zinf_engine_release(engine, kModules[m]));
      }
      if (run->trace != NULL) {
        CHECK(zinf_trace_add(run->trace, track, "backward", span_start_ns, zinf_trace_now_ns()));
      }
    }
    memset(&report, 0, sizeof report);
    report.struct_size = sizeof report;
    CHECK(zinf_engine_step(engine, &report));
    EXPECT(report.step == step || report.skipped);
    run->reports[task->rank] = report;
    if (run->reports_before_lr_change != NULL && step + 1 == run->lr_change_step) {
      run->reports_before_lr_change[task->rank] = report;
    }
  }

  for (p = 0; p < CAPI_PARAMS; ++p) {
    CHECK(zinf_engine_read_parameters(engine, kParams[p].name,
                                      run->finals[(size_t)task->rank * CAPI_PARAMS + p],
                                      capi_model_element_count(p)));
  }
  if (run->counters != NULL) {
    zinf_engine_counters_t* counters = &run->counters[task->rank];
    memset(counters, 0, sizeof *counters);
    counters->struct_size = sizeof *counters;
    CHECK(zinf_engine_counters(engine, counters));
  }
  task->code = 0;

done:
  free(initial);
  for (p = 0; p < CAPI_PARAMS; ++p) free(grads[p]);
  zinf_engine_close(engine);
}

static void* rank_main(void* arg) {
  train_rank((rank_task_t*)arg);
  return NULL;
}

int capi_c_train(const capi_run_t* run, char* error, size_t error_bytes) {
  zinf_config_t* config = NULL;
  zinf_device_t** devices = NULL;
  zinf_comm_group_t* group = NULL;
  rank_task_t* tasks = NULL;
  pthread_t* threads = NULL;
  int code = 0;
  int r;
  const size_t world = (size_t)run->world_size;

  devices = (zinf_device_t**)calloc(world, sizeof(zinf_device_t*));
  tasks = (rank_task_t*)calloc(world, sizeof(rank_task_t));
  threads = (pthread_t*)calloc(world, sizeof(pthread_t));
  if (devices == NULL || tasks == NULL || threads == NULL) {
    snprintf(error, error_bytes, "out of memory");
    code = ZINF_RESOURCE_EXHAUSTED;
    goto done;
  }
  code = (int)zinf_config_from_json(run->config_json, strlen(run->config_json), &config);
  if (code != 0) {
    snprintf(error, error_bytes, "zinf_config_from_json: %s", zinf_last_error_message());
    goto done;
  }
  for (r = 0; r < run->world_size; ++r) {
    code = (int)zinf_host_device_create(r, 0, &devices[r]);
    if (code != 0) {
      snprintf(error, error_bytes, "zinf_host_device_create: %s", zinf_last_error_message());
      goto done;
    }
  }
  code = (int)zinf_local_comm_group_create(devices, run->world_size, 20000, &group);
  if (code != 0) {
    snprintf(error, error_bytes, "zinf_local_comm_group_create: %s", zinf_last_error_message());
    goto done;
  }
  for (r = 0; r < run->world_size; ++r) {
    tasks[r].run = run;
    tasks[r].config = config;
    tasks[r].device = devices[r];
    tasks[r].group = group;
    tasks[r].rank = r;
    tasks[r].code = -1;
    if (pthread_create(&threads[r], NULL, rank_main, &tasks[r]) != 0) {
      /* Ranks already started finish on their own: a missing rank times their collectives out. */
      int started;
      for (started = 0; started < r; ++started) pthread_join(threads[started], NULL);
      snprintf(error, error_bytes, "pthread_create failed for rank %d", r);
      code = ZINF_INTERNAL;
      goto done;
    }
  }
  for (r = 0; r < run->world_size; ++r) pthread_join(threads[r], NULL);
  for (r = 0; r < run->world_size; ++r) {
    if (tasks[r].code != 0) {
      code = tasks[r].code;
      snprintf(error, error_bytes, "%s", tasks[r].error);
      break;
    }
  }

done:
  /* Engines are closed by their ranks; then the group, then the devices (the order the
   * destroy functions enforce). */
  if (group != NULL && zinf_comm_group_destroy(group) != ZINF_OK && code == 0) {
    snprintf(error, error_bytes, "zinf_comm_group_destroy: %s", zinf_last_error_message());
    code = ZINF_INTERNAL;
  }
  if (devices != NULL) {
    for (r = 0; r < run->world_size; ++r) {
      if (zinf_device_destroy(devices[r]) != ZINF_OK && code == 0) {
        snprintf(error, error_bytes, "zinf_device_destroy: %s", zinf_last_error_message());
        code = ZINF_INTERNAL;
      }
    }
  }
  zinf_config_destroy(config);
  free(devices);
  free(tasks);
  free(threads);
  return code;
}

/* ---- Error paths from C -----------------------------------------------------------------------
 */

#define FAIL_IF(condition)                                                                  \
  do {                                                                                      \
    if (condition) {                                                                        \
      snprintf(error, error_bytes, "line %d: %s (last error %s: %s)", __LINE__, #condition, \
               zinf_code_name(zinf_last_error_code()), zinf_last_error_message());          \
      code = 1;                                                                             \
      goto done;                                                                            \
    }                                                                                       \
  } while (0)

int capi_c_error_paths(char* error, size_t error_bytes) {
  static const char kBadStage[] = "{\"zero_optimization\": {\"stage\": 4}}";
  static const char kGood[] =
      "{\"zero_optimization\": {\"stage\": 2}, \"zinf\": {\"cpu_threads\": 1}}";
  const int64_t shape[1] = {5};
  const float values[5] = {0.5f, -0.25f, 1.0f, 2.0f, -3.0f};
  const float grad[4] = {0.1f, 0.2f, 0.3f, 0.4f};
  zinf_config_t* config = NULL;
  zinf_device_t* device = NULL;
  zinf_comm_group_t* group = NULL;
  zinf_comm_t* comm = NULL;
  zinf_engine_t* engine = NULL;
  zinf_env_t env;
  zinf_gradient_t ref;
  int code = 0;

  /* A bad value: the message starts with the key. */
  FAIL_IF(zinf_config_from_json(kBadStage, strlen(kBadStage), &config) != ZINF_INVALID_ARGUMENT);
  FAIL_IF(config != NULL);
  FAIL_IF(zinf_last_error_code() != ZINF_INVALID_ARGUMENT);
  FAIL_IF(strncmp(zinf_last_error_message(), "zero_optimization.stage", 23) != 0);
  /* A success clears the last error. */
  FAIL_IF(zinf_config_from_json(kGood, strlen(kGood), &config) != ZINF_OK);
  FAIL_IF(zinf_last_error_code() != ZINF_OK || zinf_last_error_message()[0] != '\0');

  FAIL_IF(zinf_host_device_create(0, 0, &device) != ZINF_OK);
  FAIL_IF(zinf_local_comm_group_create(&device, 1, 5000, &group) != ZINF_OK);
  FAIL_IF(zinf_comm_group_get(group, 1, &comm) != ZINF_INVALID_ARGUMENT);
  FAIL_IF(zinf_comm_group_get(group, 0, &comm) != ZINF_OK);
  memset(&env, 0, sizeof env);
  env.struct_size = sizeof env;
  env.device = device;
  env.comm = comm;
  FAIL_IF(zinf_engine_open(config, &env, &engine) != ZINF_OK);
  FAIL_IF(zinf_engine_register_parameter(engine, "layer.w", "layer", shape, 1, ZINF_DTYPE_F32,
                                         values) != ZINF_OK);

  /* An unknown module: not found, naming it. */
  FAIL_IF(zinf_engine_gather(engine, "no_such_module") != ZINF_NOT_FOUND);
  FAIL_IF(strstr(zinf_last_error_message(), "no_such_module") == NULL);
  /* A gradient of 4 elements for a parameter of 5: invalid, naming the parameter. */
  ref.name = "layer.w";
  ref.data = grad;
  ref.element_count = 4;
  ref.dtype = ZINF_DTYPE_F32;
  FAIL_IF(zinf_engine_reduce_gradients(engine, "layer", &ref, 1) != ZINF_INVALID_ARGUMENT);
  FAIL_IF(strstr(zinf_last_error_message(), "layer.w") == NULL);
  /* The device and the group refuse to go while the engine uses them. */
  FAIL_IF(zinf_device_destroy(device) != ZINF_FAILED_PRECONDITION);
  FAIL_IF(zinf_comm_group_destroy(group) != ZINF_FAILED_PRECONDITION);

done:
  zinf_engine_close(engine);
  if (zinf_comm_group_destroy(group) != ZINF_OK && code == 0) {
    snprintf(error, error_bytes, "zinf_comm_group_destroy: %s", zinf_last_error_message());
    code = 1;
  }
  if (zinf_device_destroy(device) != ZINF_OK && code == 0) {
    snprintf(error, error_bytes, "zinf_device_destroy: %s", zinf_last_error_message());
    code = 1;
  }
  zinf_config_destroy(config);
  return code;
}
