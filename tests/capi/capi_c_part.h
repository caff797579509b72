/* The C side of the C API tests (capi_c_part.c, compiled as C99): a small model, its seeded
 * gradients, and a training run of N ranks (POSIX threads) that uses nothing but zinf.h. The
 * C++ tests (capi_test.cpp) train the same model through zinf::Engine with the same gradients
 * and compare. */
#ifndef ZINF_TESTS_CAPI_C_PART_H_
#define ZINF_TESTS_CAPI_C_PART_H_

#include <stddef.h>
#include <stdint.h>

#include "zinf/zinf.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct capi_param_def {
  const char* name;
  const char* module;
  int64_t shape[2];
  size_t ndim;
  zinf_dtype_t dtype;
} capi_param_def_t;

/* Four modules, f32 and bf16 parameters, counts that 2 does not divide, a scalar. */
size_t capi_model_module_count(void);
const char* capi_model_module(size_t m);
size_t capi_model_param_count(void);
const capi_param_def_t* capi_model_param(size_t p);
size_t capi_model_element_count(size_t p);
/* Uniform in [-1, 1) from a seed of (seed, p). */
void capi_model_initial(size_t p, uint64_t seed, float* out);
/* The gradient of parameter p at (rank, step, micro) from the device copy `w` the rank computed
 * with: g = (w - target) * 0.5 * loss_scale, target seeded by (rank, step, micro, p), written in
 * the parameter's dtype into `grad`. It depends on w, so a wrong or stale gather changes it. */
void capi_model_grad(size_t p, const void* w, int rank, int step, int micro, double loss_scale,
                     void* grad);

typedef struct capi_run {
  const char* config_json;
  const char* nvme_dir; /* NULL: none (passed as zinf_env_t.nvme_paths) */
  int world_size;
  int steps;
  int micro_batches;
  uint64_t seed;
  /* The learning rate set before step `lr_change_step` (0: never). */
  int lr_change_step;
  double lr_change_value;
  /* Out: finals[rank * capi_model_param_count() + p] -> capi_model_element_count(p) floats,
   * allocated by the caller; reports[rank] is each rank's last step report, and
   * reports_before_lr_change[rank] its report of step lr_change_step - 1. */
  float** finals;
  zinf_step_report_t* reports;
  zinf_step_report_t* reports_before_lr_change;
  /* When not NULL, every rank's engine records into it, and each rank adds its "forward" and
   * "backward" spans on a track "rank <r>". */
  zinf_trace_t* trace;
  /* Out: counters[rank], each rank's engine counters at the end. */
  zinf_engine_counters_t* counters;
  /* When not 0, parameters are registered through zinf_engine_register_parameter_with_initializer
   * with a C function that serves capi_model_initial's values, and (when `asked` is not NULL)
   * counts each element it is asked for in asked[rank * capi_model_param_count() + p][i]
   * (caller-allocated, zeroed, capi_model_element_count(p) entries). A range outside the
   * parameter is refused with ZINF_INTERNAL. */
  int use_initializer;
  uint32_t** asked;
} capi_run_t;

/* Trains through the C API only. Returns 0, or the failing zinf_code_t with its call and
 * message in `error` (NUL-terminated, at most error_bytes). */
int capi_c_train(const capi_run_t* run, char* error, size_t error_bytes);

/* Error paths checked from C: returns 0 when every check held, else writes the first failed
 * check into `error`. */
int capi_c_error_paths(char* error, size_t error_bytes);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ZINF_TESTS_CAPI_C_PART_H_ */
