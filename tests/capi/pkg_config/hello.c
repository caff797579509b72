/* A C program built without CMake: `cc hello.c $(pkg-config --static --cflags --libs zinf)`
 * (tests/capi/pkg_config/run.cmake). One rank, one parameter, one Adam step: the first step of
 * Adam moves each weight by lr * g / (|g| + eps), about lr against the gradient's sign. Prints
 * "zinf pkg-config consumer ok" when the master moved so. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "zinf/zinf.h"

#define CHECK(call)                                                                          \
  do {                                                                                       \
    zinf_code_t c_ = (call);                                                                 \
    if (c_ != ZINF_OK) {                                                                     \
      fprintf(stderr, "%s: %s: %s\n", #call, zinf_code_name(c_), zinf_last_error_message()); \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

int main(void) {
  static const char json[] =
      "{\"optimizer\": {\"type\": \"Adam\", \"params\": {\"lr\": 0.01, \"weight_decay\": 0}},"
      " \"zero_optimization\": {\"stage\": 2}, \"zinf\": {\"cpu_threads\": 1}}";
  const float values[4] = {0.5f, -1.25f, 2.0f, 0.125f};
  const float grads[4] = {0.75f, -0.5f, 0.25f, -2.0f};
  const int64_t shape[1] = {4};
  float master[4] = {0};
  zinf_config_t* config = NULL;
  zinf_device_t* device = NULL;
  zinf_comm_group_t* group = NULL;
  zinf_comm_t* comm = NULL;
  zinf_engine_t* engine = NULL;
  zinf_env_t env;
  zinf_gradient_t gradient = {"w", grads, 4, ZINF_DTYPE_F32};
  int i;

  CHECK(zinf_config_from_json(json, sizeof json - 1, &config));
  CHECK(zinf_host_device_create(0, 0, &device));
  CHECK(zinf_local_comm_group_create(&device, 1, 0, &group));
  CHECK(zinf_comm_group_get(group, 0, &comm));
  memset(&env, 0, sizeof env);
  env.struct_size = sizeof env;
  env.device = device;
  env.comm = comm;
  CHECK(zinf_engine_open(config, &env, &engine));
  CHECK(zinf_engine_register_parameter(engine, "w", "m", shape, 1, ZINF_DTYPE_F32, values));
  CHECK(zinf_engine_reduce_gradients(engine, "m", &gradient, 1));
  CHECK(zinf_engine_step(engine, NULL));
  CHECK(zinf_engine_read_parameters(engine, "w", master, 4));
  for (i = 0; i < 4; ++i) {
    const double expected = values[i] - 0.01 * grads[i] / (fabs(grads[i]) + 1e-8);
    if (fabs(master[i] - expected) > 1e-6) {
      fprintf(stderr, "w[%d] = %.9g, expected %.9g\n", i, master[i], expected);
      return 1;
    }
  }
  zinf_engine_close(engine);
  CHECK(zinf_comm_group_destroy(group));
  CHECK(zinf_device_destroy(device));
  zinf_config_destroy(config);
  printf("zinf pkg-config consumer ok (zinf %s)\n", zinf_version());
  return 0;
}
