/* zinf.h: the C ABI of zinf, for embedding the engine in other languages (Python via ctypes or
 * cffi, Rust, Julia, C).
 *
 * It is a thin layer over the C++ API (include/zinf/engine.hpp, config.hpp, device.hpp,
 * comm.hpp): each handle owns one C++ object, each call forwards to one C++ call, and the
 * numbers are the same bits as through C++. See docs/CAPI.md for an example.
 *
 * Errors. Every function that can fail returns a zinf_code_t whose values map zinf::Code one for
 * one (ZINF_OK is 0). The status of the last such call on the calling thread is kept in
 * thread-local storage: zinf_last_error_code(), zinf_last_error_sys_code() (the raw errno,
 * cudaError_t or ncclResult_t behind it, 0 when none) and zinf_last_error_message() (the message
 * alone: it names the config key, module, parameter, file or path involved; "" after success).
 * A call refused for bad input (a null pointer, an unknown name, a wrong size) changes nothing:
 * out-parameters keep their values (but zinf_config_to_json's needed_bytes, which says how much
 * to allocate) and handles stay usable. An operating error (I/O, a collective) may leave an
 * output buffer partly written, and an engine's operating errors are sticky (see
 * zinf_engine_open). Nothing is thrown across this ABI: an exception inside (for example
 * std::bad_alloc) becomes ZINF_RESOURCE_EXHAUSTED or ZINF_INTERNAL with its message. Passing a
 * null handle or a null pointer where one is required returns ZINF_INVALID_ARGUMENT naming the
 * argument.
 *
 * Ownership. Objects made by a *_create / *_open / *_from_* function belong to the caller, who
 * frees them with the matching *_destroy / *_close function (each accepts NULL). A handle that
 * others depend on refuses to be destroyed while they live, returning ZINF_FAILED_PRECONDITION
 * and destroying nothing: a device while a communicator group or an engine uses it, a
 * communicator group while an engine uses one of its communicators. So close engines first,
 * then communicator groups, then devices; a garbage-collected embedder may simply retry later.
 * Strings passed in are read during the call only; strings returned are owned by the library and
 * valid as stated at each function.
 *
 * Thread-safety. zinf_last_error_* read the calling thread's own state. Configs are immutable
 * values: any thread may read one concurrently. Devices may be used from any thread. An engine
 * must be called from one thread at a time (normally its rank's thread); engines of different
 * ranks run on different threads at once. Create and destroy handles from one thread at a time
 * each; never destroy a handle while another thread is inside a call that uses it.
 *
 * Collectives. As in C++, zinf_engine_finalize, _gather, _reduce_gradients, _step and
 * _read_parameters are collective: every rank makes the same calls in the same order. A call
 * refused for bad input on one rank only leaves the other ranks waiting in their next collective
 * until zinf.collective_timeout_ms, after which they fail with ZINF_TIMEOUT.
 *
 * The header is C99 and C++ (extern "C"); it uses no C++ types. Structs that may grow carry a
 * struct_size field, which the caller sets to sizeof(the struct) as it was compiled; the
 * library reads or writes only that many bytes, so an older caller keeps working with a newer
 * library. */
#ifndef ZINF_ZINF_H_
#define ZINF_ZINF_H_

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define ZINF_C_API __attribute__((visibility("default")))
#else
#define ZINF_C_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this C ABI: raised when a function or struct changes incompatibly. */
#define ZINF_C_ABI_VERSION 1

/* ---- Status --------------------------------------------------------------------------------- */

/* One for one with zinf::Code (include/zinf/status.hpp). */
typedef enum zinf_code {
  ZINF_OK = 0,
  ZINF_INVALID_ARGUMENT = 1,    /* a caller-supplied value is wrong (config key, shape, size) */
  ZINF_NOT_FOUND = 2,           /* a named thing (file, key, module, parameter) does not exist */
  ZINF_IO_ERROR = 3,            /* a read, write, open or sync failed; sys_code holds errno */
  ZINF_CORRUPTION = 4,          /* data read back does not match its checksum or format */
  ZINF_NO_SPACE = 5,            /* a filesystem or device ran out of space */
  ZINF_RESOURCE_EXHAUSTED = 6,  /* a bounded pool or memory budget is used up (or out of memory) */
  ZINF_TIMEOUT = 7,             /* a wait ran out (a rank did not arrive in a collective) */
  ZINF_UNSUPPORTED = 8,         /* the platform or this version refuses a feature */
  ZINF_FAILED_PRECONDITION = 9, /* the call is not allowed in the object's current state */
  ZINF_DEVICE_ERROR = 10,       /* a device (CUDA) call failed; sys_code holds cudaError_t */
  ZINF_COMM_ERROR = 11,         /* a collective failed; sys_code holds ncclResult_t from NCCL */
  ZINF_ABORTED = 12,            /* stopped because an earlier (sticky) error happened elsewhere */
  ZINF_INTERNAL = 13,           /* a bug in zinf, or an unexpected exception at the boundary */
  ZINF_CODE_MAX_ENUM = 0x7fffffff /* not a code: keeps the enum int-sized on every compiler */
} zinf_code_t;

/* The stable lowercase name of `code` ("ok", "invalid_argument", ...; "unknown" for a value
 * outside the enum). Static storage. Thread-safe. */
ZINF_C_API const char* zinf_code_name(zinf_code_t code);

/* The status of the last zinf call on this thread that returns a zinf_code_t (these three
 * functions do not change it). The message is owned by the thread's state and valid until the
 * thread's next such call; copy it to keep it. */
ZINF_C_API zinf_code_t zinf_last_error_code(void);
ZINF_C_API int zinf_last_error_sys_code(void);
ZINF_C_API const char* zinf_last_error_message(void);

/* The library version, "MAJOR.MINOR.PATCH" (static storage), and ZINF_C_ABI_VERSION as the
 * library was built (compare with the header's to detect a mismatch). Thread-safe. */
ZINF_C_API const char* zinf_version(void);
ZINF_C_API int zinf_c_abi_version(void);

/* ---- Element types -------------------------------------------------------------------------- */

/* One for one with zinf::DType. */
typedef enum zinf_dtype {
  ZINF_DTYPE_F32 = 0,              /* IEEE binary32 */
  ZINF_DTYPE_F16 = 1,              /* IEEE binary16 */
  ZINF_DTYPE_BF16 = 2,             /* bfloat16 (the top 16 bits of a binary32) */
  ZINF_DTYPE_MAX_ENUM = 0x7fffffff /* not a dtype: keeps the enum int-sized */
} zinf_dtype_t;

/* ---- Config --------------------------------------------------------------------------------- */

/* A parsed and validated engine config (the DeepSpeed-style JSON of include/zinf/config.hpp and
 * docs/ENGINE.md). Immutable; an engine copies it at open, so it may be destroyed after.
 * Thread-safety: any number of threads may read one config at once (zinf_engine_open,
 * zinf_config_to_json); destroy it once no call uses it. */
typedef struct zinf_config zinf_config_t;

/* Parses `json_bytes` bytes of JSON text at `json`. ZINF_INVALID_ARGUMENT whose message starts
 * with the dotted key that is wrong ("zero_optimization.stage: 4 is not 1, 2 or 3"), or says
 * where the JSON is malformed. On success *out is a new config owned by the caller. */
ZINF_C_API zinf_code_t zinf_config_from_json(const char* json, size_t json_bytes,
                                             zinf_config_t** out);
/* Reads and parses the file at `path` (NUL-terminated). ZINF_NOT_FOUND or ZINF_IO_ERROR naming
 * the path (a directory: ZINF_IO_ERROR "config <path>: Is a directory", sys_code EISDIR); parse
 * errors as zinf_config_from_json. */
ZINF_C_API zinf_code_t zinf_config_load(const char* path, zinf_config_t** out);
/* Writes the config as JSON (the format parse reads back equal), NUL-terminated, into `buffer`
 * of `buffer_bytes` bytes, and the bytes it needs (with the NUL) into *needed_bytes when not
 * NULL. `buffer` may be NULL when buffer_bytes is 0, to ask for the size.
 * ZINF_RESOURCE_EXHAUSTED (writing nothing) when the buffer is too small. */
ZINF_C_API zinf_code_t zinf_config_to_json(const zinf_config_t* config, char* buffer,
                                           size_t buffer_bytes, size_t* needed_bytes);
ZINF_C_API void zinf_config_destroy(zinf_config_t* config);

/* ---- Devices and communicators -------------------------------------------------------------- */

/* One rank's device. Thread-safety: usable from any thread (engines and communicators of its
 * rank run their own threads on it); destroy it from one thread, after its users. */
typedef struct zinf_device zinf_device_t;

/* A HostDevice: device memory is host memory, streams are worker threads (how zinf runs every
 * stage, tier and rank count on a CPU-only machine). `ordinal` names it ("host:<ordinal>");
 * allocations beyond `memory_limit_bytes` (0: the default, 16 GiB) fail with
 * ZINF_RESOURCE_EXHAUSTED as a full GPU would. */
ZINF_C_API zinf_code_t zinf_host_device_create(int ordinal, uint64_t memory_limit_bytes,
                                               zinf_device_t** out);
/* A CudaDevice on GPU `ordinal` (memory_limit_bytes 0: the whole GPU). ZINF_UNSUPPORTED naming
 * ZINF_WITH_CUDA when zinf was built without CUDA, or when no GPU is usable. */
ZINF_C_API zinf_code_t zinf_cuda_device_create(int ordinal, uint64_t memory_limit_bytes,
                                               zinf_device_t** out);
/* ZINF_FAILED_PRECONDITION while a communicator group or an engine uses the device. */
ZINF_C_API zinf_code_t zinf_device_destroy(zinf_device_t* device);

/* A group of `world_size` ranks' communicators in this process (LocalComm): rank r runs on
 * devices[r] and is meant to be driven by its own thread. Collectives move data through shared
 * memory and sum in rank order, so results are the same bits on every rank and in every run. */
typedef struct zinf_comm_group zinf_comm_group_t;
/* One rank's communicator; owned by its group. Thread-safety: zinf_comm_group_get and
 * zinf_comm_group_world_size may be called from any thread; each communicator belongs to the
 * one engine (and thread) of its rank. */
typedef struct zinf_comm zinf_comm_t;

/* `timeout_ms`: how long a rank waits in a collective for the others before it fails with
 * ZINF_TIMEOUT on every rank (0: the default, 60 s); give the config's zinf.collective_timeout_ms
 * the same value (zinf_engine_open warns on rank 0 when they differ; the same holds for
 * zinf_mpi_comm_group_create's timeout_ms). REQUIRES: the devices are distinct
 * HostDevices; they must outlive the group (enforced, see zinf_device_destroy). */
ZINF_C_API zinf_code_t zinf_local_comm_group_create(zinf_device_t* const* devices, int world_size,
                                                    int64_t timeout_ms, zinf_comm_group_t** out);
/* zinf_comm_group_get's `rank` meaning "this process's own rank", in a group of one process per
 * rank (zinf_mpi_comm_group_create, zinf_nccl_comm_group_create). */
#define ZINF_RANK_OF_THIS_PROCESS (-1)

/* Rank `rank`'s communicator (borrowed: valid until the group is destroyed). In a group of one
 * process per rank, `rank` is this process's rank, or ZINF_RANK_OF_THIS_PROCESS (-1) for a
 * program that does not know it (zinf initialised MPI): zinf_comm_rank on the communicator then
 * tells it. ZINF_INVALID_ARGUMENT when rank is outside [0, world_size), is another process's, or
 * is -1 for a LocalComm group of more than one rank. */
ZINF_C_API zinf_code_t zinf_comm_group_get(zinf_comm_group_t* group, int rank, zinf_comm_t** out);
ZINF_C_API zinf_code_t zinf_comm_group_world_size(const zinf_comm_group_t* group, int* world_size);
/* ZINF_FAILED_PRECONDITION while an engine uses one of its communicators (the group is kept).
 * ZINF_ABORTED naming MPI_Finalize when MPI_Finalize ran while an MPI group was open and
 * collectives were lost to it (zinf_mpi_comm_group_create): the group is destroyed all the same. */
ZINF_C_API zinf_code_t zinf_comm_group_destroy(zinf_comm_group_t* group);

/* Jobs of one process per rank (mpirun, srun, torchrun). Each call makes a group that holds this
 * process's one communicator: zinf_comm_group_get(group, ZINF_RANK_OF_THIS_PROCESS, &comm) gives
 * it (or with this process's rank, where the program knows it), zinf_comm_rank(comm, &rank,
 * &world_size) tells its rank, and zinf_comm_group_world_size gives the job's world size.
 *
 * MpiComm on `device` (a HostDevice or a CudaDevice): `mpi_comm` points at an MPI_Comm (pass
 * &comm), or is NULL for MPI_COMM_WORLD. Initialises MPI (MPI_THREAD_MULTIPLE) when the program
 * has not. `timeout_ms` bounds every collective's wait for the other ranks (0: 60 s): a rank that
 * died or stalled fails the others' collectives with ZINF_TIMEOUT naming it.
 * ZINF_UNSUPPORTED naming ZINF_WITH_MPI when zinf was built without MPI. Every rank calls it.
 * The end of a job, in this order: zinf_engine_close, zinf_comm_group_destroy, then MPI_Finalize.
 * The group's communicator calls MPI (a progress thread) until it is destroyed. MPI_Finalize
 * before that stops the communicator first (the delete callback of an attribute on
 * MPI_COMM_SELF): its collectives in flight and every later one fail with ZINF_ABORTED naming
 * MPI_Finalize, it makes no MPI call after it, zinf_engine_close still closes the engine and
 * zinf_comm_group_destroy the group (ZINF_ABORTED where collectives were lost, otherwise
 * ZINF_OK). When zinf initialised MPI, it also finalises it, at exit (an atexit
 * handler; skipped after a failed collective, whose dead peer MPI_Finalize could wait for): the
 * program need not call MPI_Finalize, and if it does (after destroying the group) zinf leaves
 * it at that; either way, destroy the group before main returns. */
ZINF_C_API zinf_code_t zinf_mpi_comm_group_create(zinf_device_t* device, const void* mpi_comm,
                                                  int64_t timeout_ms, zinf_comm_group_t** out);
/* NcclComm on `device` (a CudaDevice): from the caller's ncclComm_t (`nccl_comm`, destroyed with
 * the group when take_ownership is non-zero), or, with nccl_comm NULL, bootstrapped from the
 * launcher's environment (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; or mpirun/srun,
 * the unique id broadcast over MPI), bounded by init_timeout_ms (0: 5 minutes).
 * ZINF_UNSUPPORTED naming ZINF_WITH_NCCL when zinf was built without NCCL. */
ZINF_C_API zinf_code_t zinf_nccl_comm_group_create(zinf_device_t* device, void* nccl_comm,
                                                   int take_ownership, int64_t init_timeout_ms,
                                                   zinf_comm_group_t** out);
/* The communicator's rank and the job's world size (either pointer may be NULL). */
ZINF_C_API zinf_code_t zinf_comm_rank(const zinf_comm_t* comm, int* rank, int* world_size);

/* ---- Traces -------------------------------------------------------------------------------- */

/* Timed spans on named tracks, written as Chrome trace JSON (Perfetto and chrome://tracing open
 * it): the engine's gather, reduce and step phases, the optimizer pipeline's reads, updates and
 * writes, and any spans the embedder adds. Engines of several ranks may share one trace. At most
 * `max_events` spans are kept (later ones are counted as dropped). Thread-safe: every function
 * may be called from any thread. */
typedef struct zinf_trace zinf_trace_t;

/* max_events 0: the default (1 Mi spans). */
ZINF_C_API zinf_code_t zinf_trace_create(size_t max_events, zinf_trace_t** out);
/* The trace's clock (CLOCK_MONOTONIC), nanoseconds: the time base of zinf_trace_add. */
ZINF_C_API int64_t zinf_trace_now_ns(void);
/* Records a finished span `name` on the track `track` (created on first use), for example the
 * embedder's forward and backward passes beside the engine's spans. */
ZINF_C_API zinf_code_t zinf_trace_add(zinf_trace_t* trace, const char* track, const char* name,
                                      int64_t start_ns, int64_t end_ns);
/* Spans kept so far, and spans dropped beyond max_events. */
ZINF_C_API zinf_code_t zinf_trace_event_count(const zinf_trace_t* trace, size_t* kept,
                                              size_t* dropped);
/* Writes the trace as Chrome trace JSON to `path`; the error names the path. */
ZINF_C_API zinf_code_t zinf_trace_write_json(const zinf_trace_t* trace, const char* path);
/* ZINF_FAILED_PRECONDITION while an engine records into it. */
ZINF_C_API zinf_code_t zinf_trace_destroy(zinf_trace_t* trace);

/* ---- Engine --------------------------------------------------------------------------------- */

/* One rank's share of ZeRO training (include/zinf/engine.hpp). Thread-safety: every
 * zinf_engine_* call on one engine must come from one thread at a time (its rank's); the engine
 * runs its own stream, I/O and optimizer threads, and different ranks' engines run at once. */
typedef struct zinf_engine zinf_engine_t;

/* What an engine runs on (zinf::Env). Set struct_size = sizeof(zinf_env_t). */
typedef struct zinf_env {
  size_t struct_size;
  zinf_device_t* device; /* this rank's device (required) */
  zinf_comm_t* comm;     /* this rank's communicator, on `device` (required) */
  /* When nvme_path_count > 0, the swap directories for everything on NVMe, overriding the
   * config's nvme_path keys (several stripe across drives). Read during the call. */
  const char* const* nvme_paths;
  size_t nvme_path_count;
  /* When not NULL, the engine records its spans here (on track "rank<r> engine", and the
   * optimizer pipeline's "read", "update", "write"). The trace must outlive the engine (enforced,
   * see zinf_trace_destroy). */
  zinf_trace_t* trace;
} zinf_env_t;

/* Opens an engine on `env` with a copy of `config`. Checks the config, the env (the
 * communicator runs on the device, the world size against zinf.world_size) and each NVMe
 * directory, with errors naming the key and the path. The device and the communicator's group
 * must outlive the engine (enforced by their destroy functions). A communicator serves one open
 * engine at a time: ZINF_FAILED_PRECONDITION naming it while another engine on it is open.
 * Errors of a collective or of I/O are sticky: once one happens every later call on the engine
 * returns it; bad input (an unknown name, a wrong size) changes nothing and the engine stays
 * usable. */
ZINF_C_API zinf_code_t zinf_engine_open(const zinf_config_t* config, const zinf_env_t* env,
                                        zinf_engine_t** out);
/* Closes the engine: waits for its background work and frees its memory. Accepts NULL, and does
 * nothing for the engine zinf_run_local lends a rank function (zinf_run_local closes it). A
 * handle closed already (closed twice) is left alone with a warning in the log, and every
 * zinf_engine_* call on it returns ZINF_INVALID_ARGUMENT ("engine 0x... is not open"), as does
 * one on a lent engine after zinf_run_local returned: until a later zinf_engine_open happens to
 * return the same address, which then names that new engine. */
ZINF_C_API void zinf_engine_close(zinf_engine_t* engine);

ZINF_C_API zinf_code_t zinf_engine_rank(const zinf_engine_t* engine, int* rank);
ZINF_C_API zinf_code_t zinf_engine_world_size(const zinf_engine_t* engine, int* world_size);

/* Registers one parameter: `name` unique (for example "layers.3.attn.qkv.weight"), `module` the
 * module that uses it (not empty), `shape` of `ndim` dimensions each > 0 (ndim 0: a scalar;
 * shape may then be NULL), `dtype` of the device copy the model computes with, and
 * `initial_values`: product(shape) fp32 values read during the call, the same on every rank.
 * ZINF_INVALID_ARGUMENT naming the parameter for an empty or duplicate name, an empty module, a
 * bad shape or dtype, or null values; ZINF_FAILED_PRECONDITION after finalize. */
ZINF_C_API zinf_code_t zinf_engine_register_parameter(zinf_engine_t* engine, const char* name,
                                                      const char* module, const int64_t* shape,
                                                      size_t ndim, zinf_dtype_t dtype,
                                                      const float* initial_values);

/* Writes the initial fp32 values of elements [first_element, first_element + element_count) of
 * one parameter (flattened in row-major order of its shape) to out[0, element_count), and
 * returns ZINF_OK, or another code that fails zinf_engine_finalize. `user` is the pointer given
 * at registration. */
typedef zinf_code_t (*zinf_initializer_fn)(void* user, size_t first_element, size_t element_count,
                                           float* out);

/* As zinf_engine_register_parameter, but nothing is copied at registration: during
 * zinf_engine_finalize (or the first gather, reduce_gradients or step) the engine calls
 * `initializer(user, ...)`, on the thread making that call, for exactly the elements of this
 * parameter in this rank's partition, each once, never outside [0, product(shape)); so a model
 * need never be held whole in host memory. The function must be deterministic: the same value
 * for an element on every rank whatever the order or split of the calls (they change with the
 * world size, stage and sub_group_size). A code other than ZINF_OK fails finalize with that code
 * and a message naming the parameter and the elements. `user` must stay valid until finalize
 * returns; the engine does not use it afterwards. ZINF_INVALID_ARGUMENT as for
 * zinf_engine_register_parameter, and for a null initializer. */
ZINF_C_API zinf_code_t zinf_engine_register_parameter_with_initializer(
    zinf_engine_t* engine, const char* name, const char* module, const int64_t* shape, size_t ndim,
    zinf_dtype_t dtype, zinf_initializer_fn initializer, void* user);

/* Defines a parameter group (zinf::Engine::add_param_group, torch's param_groups): its
 * parameters step with the optimizer's hyper-parameters except `weight_decay` (< 0: the
 * optimizer's) and a learning rate of the optimizer's (as scheduled or set) times `lr_scale`
 * (finite, >= 0). The usual "no decay" group of biases and normalisation weights is
 * ("no_decay", 0.0, 1.0). ZINF_INVALID_ARGUMENT naming the group for an empty or repeated name, a
 * weight_decay or lr_scale that is not finite, or more than 63 groups; ZINF_FAILED_PRECONDITION
 * after finalize. */
ZINF_C_API zinf_code_t zinf_engine_add_param_group(zinf_engine_t* engine, const char* name,
                                                   double weight_decay, double lr_scale);

/* As zinf_engine_register_parameter (initial_values set, initializer NULL) or
 * zinf_engine_register_parameter_with_initializer (initial_values NULL, initializer set), with
 * the parameter in parameter group `group` ("" is the default group, the optimizer's own). The
 * group may be defined before or after this call, but before finalize: a name that no
 * zinf_engine_add_param_group defined fails zinf_engine_finalize with ZINF_INVALID_ARGUMENT
 * naming the parameter and the group. ZINF_INVALID_ARGUMENT when both or neither of
 * initial_values and initializer are given, and as for zinf_engine_register_parameter. */
ZINF_C_API zinf_code_t zinf_engine_register_parameter_in_group(
    zinf_engine_t* engine, const char* name, const char* module, const int64_t* shape, size_t ndim,
    zinf_dtype_t dtype, const char* group, const float* initial_values,
    zinf_initializer_fn initializer, void* user);

/* Lays out the partitions, checks that every rank registered the same parameters, allocates
 * every buffer and places the initial values. Collective. Done by the first gather,
 * reduce_gradients or step when not called before. */
ZINF_C_API zinf_code_t zinf_engine_finalize(zinf_engine_t* engine);

/* Makes `module`'s parameters available on the device (stage 3 all-gathers them; a check only
 * at stages 1 and 2). ZINF_NOT_FOUND for an unknown module; ZINF_FAILED_PRECONDITION when it is
 * gathered already; ZINF_RESOURCE_EXHAUSTED when it does not fit
 * stage3_max_live_parameters. */
ZINF_C_API zinf_code_t zinf_engine_gather(zinf_engine_t* engine, const char* module);
/* Frees the module's gathered parameters. ZINF_NOT_FOUND for an unknown module,
 * ZINF_FAILED_PRECONDITION when it is not gathered. */
ZINF_C_API zinf_code_t zinf_engine_release(zinf_engine_t* engine, const char* module);
/* The caller's compute stream, a cudaStream_t of the engine's CudaDevice (NULL: none, the
 * default), as Engine::set_compute_stream (include/zinf/engine.hpp): the engine then orders
 * itself with the work queued on it by CUDA events instead of host waits. gather() makes the
 * stream wait for the module's all-gather; release() and reduce_gradients() make the engine's
 * streams wait for the work queued on it so far (so the caller need not synchronise it before
 * them), and the stream waits for reduce_gradients()'s read of the gradients; step() waits on
 * the host for it. The engine borrows the stream: it must outlive the engine or be cleared (NULL)
 * first. ZINF_FAILED_PRECONDITION while a module is gathered; ZINF_INVALID_ARGUMENT when the
 * engine's device is not a CudaDevice; ZINF_UNSUPPORTED (naming ZINF_WITH_CUDA) for a non-NULL
 * stream when zinf was built without CUDA. */
ZINF_C_API zinf_code_t zinf_engine_set_cuda_stream(zinf_engine_t* engine, void* cuda_stream);

/* The device copy of parameter `name` of a gathered module: *data (a device pointer, valid
 * while the module is gathered: until it is released at stage 3, always at stages 1 and 2),
 * *dtype and *element_count; any out-pointer may be NULL. ZINF_NOT_FOUND for an
 * unknown parameter, ZINF_FAILED_PRECONDITION when its module is not gathered. */
ZINF_C_API zinf_code_t zinf_engine_parameter(zinf_engine_t* engine, const char* name, void** data,
                                             zinf_dtype_t* dtype, size_t* element_count);

/* One parameter's gradient: element_count elements of `dtype` (f32, bf16 or f16) at device
 * pointer `data`. */
typedef struct zinf_gradient {
  const char* name;
  const void* data;
  size_t element_count;
  zinf_dtype_t dtype;
} zinf_gradient_t;

/* Reduces this micro-batch's gradients of every parameter of `module`, exactly once each: the
 * array holds `gradient_count` entries. Validates everything before anything changes:
 * ZINF_NOT_FOUND for an unknown module or a parameter not in it, ZINF_INVALID_ARGUMENT (naming
 * the parameter) for a missing or repeated parameter, a wrong element count or a null pointer.
 * Returns once the gradients have been read, so their memory may be reused at once. */
ZINF_C_API zinf_code_t zinf_engine_reduce_gradients(zinf_engine_t* engine, const char* module,
                                                    const zinf_gradient_t* gradients,
                                                    size_t gradient_count);

/* What one step did (zinf::StepReport). Set struct_size = sizeof(zinf_step_report_t). */
typedef struct zinf_step_report {
  size_t struct_size;
  int64_t step;           /* optimizer steps applied so far (counting this one) */
  int32_t skipped;        /* 1: an overflow (inf/NaN gradient on some rank); nothing changed */
  int32_t micro_batches;  /* reduce_gradients rounds averaged into this step */
  double loss_scale;      /* the scale this step's gradients carried */
  double next_loss_scale; /* the scale for the next micro-batches */
  double grad_norm;       /* global L2 norm of the mean unscaled gradient, before clipping */
  double clip_coef;       /* the factor clipping applied (1: none) */
  /* Wall time of each phase, nanoseconds. */
  int64_t reduce_ns;
  int64_t norm_ns;
  int64_t optimizer_ns;
  int64_t publish_ns;
  int64_t wall_ns;
  /* Bytes moved to and from NVMe by this step. */
  uint64_t optimizer_nvme_read_bytes;
  uint64_t optimizer_nvme_write_bytes;
  uint64_t param_nvme_write_bytes;
  uint64_t master_nvme_read_bytes;
  /* The overlapped step (zinf.overlap_step; docs/ENGINE.md "The overlapped step"). overlapped 1:
   * step() decided this step and returned while its optimizer pass runs on; optimizer_ns,
   * publish_ns, the NVMe byte counts and hidden_ns are then the previous step's pass. */
  int32_t overlapped;
  int32_t in_backward;    /* 1: this step's pass began during its backward */
  int64_t hidden_ns;      /* of that pass's time, the part hidden behind the caller's compute */
  int64_t gather_wait_ns; /* gathers since the previous step waiting for the pass's parameters */
  int32_t read_ahead;     /* 1: this step's pass began during its backward, reading ahead only */
} zinf_step_report_t;

/* Applies the optimizer to the gradients reduced since the last step. When `report` is not
 * NULL, fills its first report->struct_size bytes (ZINF_INVALID_ARGUMENT, before stepping, when
 * struct_size is smaller than the struct_size field itself). REQUIRES: every parameter's
 * gradients were reduced the same number (>= 1) of times since the last step (else
 * ZINF_FAILED_PRECONDITION naming a parameter) and no module is gathered. Collective. */
ZINF_C_API zinf_code_t zinf_engine_step(zinf_engine_t* engine, zinf_step_report_t* report);
/* zinf_engine_step with the accumulated gradients divided by `average_over` micro-batches instead
 * of by the number reduced since the last step (0: the same as zinf_engine_step): DeepSpeed
 * divides every micro-batch's loss by gradient_accumulation_steps however many a step has, so a
 * step cut short passes gradient_accumulation_steps. ZINF_INVALID_ARGUMENT (nothing changes) when
 * it is negative or below the micro-batches reduced (Engine::step(average_over)). */
ZINF_C_API zinf_code_t zinf_engine_step_average(zinf_engine_t* engine, int32_t average_over,
                                                zinf_step_report_t* report);

/* Checkpoints (docs/ENGINE.md "Checkpoints"), in DeepSpeed's layout: <dir>/<tag>/ per checkpoint
 * and <dir>/latest naming the newest. Collective: every rank calls them with the same directory
 * `dir` and tag (NUL-terminated; a path all ranks can reach); both finalize the engine if it is
 * not yet.
 *
 * save: writes <dir>/<tag>/ (each rank's fp32 master and optimizer moments, the step, loss scaler,
 * learning-rate schedule and gather order, each file's size and xxh3-64 in manifest.json, written
 * last), all into <dir>/.<tag>.tmp, synced and renamed; then replaces <dir>/latest atomically
 * and, with zinf.keep_last > 0, deletes older tags beyond that many (by default none). A save cut
 * short at any instant leaves <dir>/latest
 * naming the previous complete checkpoint. A tag that exists already is replaced (as DeepSpeed
 * writes over it), the complete new tag swapped in for the old one, so a crash leaves the old tag
 * or the new one. Creates `dir` if needed. ZINF_INVALID_ARGUMENT for a tag that is not 1-200
 * characters of [A-Za-z0-9._-] (or starts with '.', or is "latest" or "latest.tmp");
 * ZINF_FAILED_PRECONDITION when <dir>/<tag> exists and is not a checkpoint (neither a manifest nor
 * rank files), or gradients were reduced since the last step, or a module is gathered. tag NULL:
 * "global_step<N>", N the steps applied. */
ZINF_C_API zinf_code_t zinf_engine_save_checkpoint_tag(zinf_engine_t* engine, const char* dir,
                                                       const char* tag);
/* zinf_engine_save_checkpoint_tag(engine, dir, NULL). */
ZINF_C_API zinf_code_t zinf_engine_save_checkpoint(zinf_engine_t* engine, const char* dir);

/* load: replaces the engine's state with the checkpoint <dir>/<tag> (tag NULL or "": the one
 * <dir>/latest names) and republishes the parameters from the loaded master. The checkpoint may
 * come from another world size, stage or offload placement (re-sliced by parameter name).
 * ZINF_INVALID_ARGUMENT naming the parameter when the registered parameters differ, or both
 * optimizers; ZINF_CORRUPTION naming the file when its size or checksum does not match the
 * manifest; ZINF_NOT_FOUND naming <dir>/latest or the manifest when there is no checkpoint.
 * These leave the engine as it was. */
ZINF_C_API zinf_code_t zinf_engine_load_checkpoint_tag(zinf_engine_t* engine, const char* dir,
                                                       const char* tag);
/* zinf_engine_load_checkpoint_tag(engine, dir, NULL). */
ZINF_C_API zinf_code_t zinf_engine_load_checkpoint(zinf_engine_t* engine, const char* dir);

/* The optimizer steps the engine has applied (zinf_step_report_t.step of the last step; a step
 * skipped for overflow does not count): 0 after open, the checkpoint's count after a load, so a
 * resumed run knows the step it resumes at (zinf_engine_counters' steps count calls since open
 * instead). */
ZINF_C_API zinf_code_t zinf_engine_applied_steps(const zinf_engine_t* engine,
                                                 int64_t* applied_steps);

/* The client state: an opaque blob (a data loader's position, an epoch, a random generator's
 * state) saved with the following checkpoints, as Engine::set_client_state. set copies `bytes`
 * bytes at `data` (data may be NULL when bytes is 0: empty); rank 0's blob is the one a save
 * writes (<dir>/<tag>/client_state.bin), and a load gives every rank that blob (empty when the
 * checkpoint has none). get gives the engine's blob: *data (owned by the engine, valid until the
 * next zinf_engine_set_client_state, checkpoint load or zinf_engine_close on it) and *bytes;
 * either pointer may be NULL. Not collective. */
ZINF_C_API zinf_code_t zinf_engine_set_client_state(zinf_engine_t* engine, const void* data,
                                                    size_t bytes);
ZINF_C_API zinf_code_t zinf_engine_client_state(const zinf_engine_t* engine, const void** data,
                                                size_t* bytes);

/* The fp32 master values of parameter `name` into `out`, which holds `out_count` floats: exactly
 * the parameter's element count (else ZINF_INVALID_ARGUMENT, before the collective). Collective:
 * every rank calls it with the same name. ZINF_NOT_FOUND for an unknown name. */
ZINF_C_API zinf_code_t zinf_engine_read_parameters(zinf_engine_t* engine, const char* name,
                                                   float* out, size_t out_count);

/* The scale the next micro-batches' loss must be multiplied by before the backward pass (1
 * unless fp16 is enabled). */
ZINF_C_API zinf_code_t zinf_engine_loss_scale(const zinf_engine_t* engine, double* loss_scale);
/* The learning rate of the following steps. ZINF_INVALID_ARGUMENT unless finite and >= 0. */
ZINF_C_API zinf_code_t zinf_engine_set_learning_rate(zinf_engine_t* engine, double learning_rate);

/* Bytes of this rank's state on each tier, fixed at finalize (zinf::MemoryReport). Set
 * struct_size = sizeof(zinf_memory_report_t). */
typedef struct zinf_memory_report {
  size_t struct_size;
  uint64_t device_bytes;
  uint64_t host_bytes;
  uint64_t nvme_bytes;
  /* Activation checkpoints (zinf_engine_save_activation), outside the figures above: the most
   * bytes of activations on the device at once since open (the checkpoints the engine keeps
   * there, cpu_checkpointing false, plus the caller's zinf_engine_set_activation_bytes figure),
   * the pinned arena and NVMe staging blocks, the activation swap file's capacity, and the bytes
   * of checkpoints written to and read back from NVMe since open. */
  uint64_t activation_device_bytes_peak;
  uint64_t activation_host_bytes;
  uint64_t activation_nvme_bytes;
  uint64_t activation_nvme_write_bytes;
  uint64_t activation_nvme_read_bytes;
} zinf_memory_report_t;
/* Running totals since open (zinf::EngineCounters). Set struct_size =
 * sizeof(zinf_engine_counters_t). */
typedef struct zinf_engine_counters {
  size_t struct_size;
  uint64_t gathers;              /* zinf_engine_gather calls */
  uint64_t gathers_issued;       /* module all-gathers issued (on demand + prefetch) */
  uint64_t prefetches_issued;    /* issued ahead of their gather */
  uint64_t prefetch_hits;        /* a gather found its module prefetched */
  uint64_t prefetches_dropped;   /* prefetched, then freed unused */
  uint64_t order_misses;         /* a gather of a module off the recorded order */
  uint64_t live_elements;        /* gathered elements now (persistent ones excluded) */
  uint64_t live_elements_peak;   /* most at once since open */
  uint64_t persistent_elements;  /* elements kept gathered (stage 3) */
  uint64_t all_gather_bytes;     /* bytes received by all-gathers (this rank) */
  uint64_t reduce_scatter_bytes; /* bytes sent into reduce-scatters (this rank) */
  uint64_t buckets_reduced;      /* both 0 for one rank reducing in place (zinf/engine.hpp) */
  uint64_t param_nvme_read_bytes;
  uint64_t param_nvme_write_bytes;
  uint64_t steps;
  uint64_t skipped_steps;
} zinf_engine_counters_t;
ZINF_C_API zinf_code_t zinf_engine_counters(const zinf_engine_t* engine,
                                            zinf_engine_counters_t* counters);

/* ZINF_FAILED_PRECONDITION before finalize. */
ZINF_C_API zinf_code_t zinf_engine_memory(const zinf_engine_t* engine,
                                          zinf_memory_report_t* report);

/* ---- Activation checkpoints (docs/ACTIVATIONS.md) ------------------------------------------ */

/* Copies `bytes` (> 0) at device pointer `data` into the engine's activation store under `key`
 * (NUL-terminated): a device copy (activation_checkpointing.cpu_checkpointing false), pinned
 * host memory within zinf.activation_host_bytes, or beyond it NVMe (zinf.activation_nvme_path).
 * Asynchronous: the memory at `data` must keep its values until the engine's next
 * save / load / flush of activations returns. Not collective; usable before finalize.
 * ZINF_INVALID_ARGUMENT for a null or empty key, a null pointer, 0 bytes or a pointer the device
 * refuses to copy from as not `bytes` of its memory;
 * ZINF_FAILED_PRECONDITION when `key` is saved and not loaded since; ZINF_RESOURCE_EXHAUSTED
 * when it fits neither the host arena nor an NVMe tier. Each message names the key; these
 * change nothing. An I/O error is sticky and aborts the communicator (see zinf_engine_open). */
ZINF_C_API zinf_code_t zinf_engine_save_activation(zinf_engine_t* engine, const char* key,
                                                   const void* data, size_t bytes);
/* Copies the checkpoint `key` back into device pointer `data`, which holds `data_bytes` bytes:
 * exactly the bytes saved under the key (else ZINF_INVALID_ARGUMENT naming the key and both
 * sizes, nothing changes), and frees it in the store; returns once the values are there. A
 * pointer the device refuses to copy to as not its memory is ZINF_INVALID_ARGUMENT naming the
 * key, and the checkpoint stays saved.
 * ZINF_NOT_FOUND naming the key when it is not saved. ZINF_IO_ERROR (with errno) or
 * ZINF_CORRUPTION (a block read back from NVMe does not match its checksum) name the key; they
 * are sticky and abort the communicator, so every other rank's next collective fails. */
ZINF_C_API zinf_code_t zinf_engine_load_activation(zinf_engine_t* engine, const char* key,
                                                   void* data, size_t data_bytes);
/* Returns once the last zinf_engine_save_activation has finished reading its device memory. */
ZINF_C_API zinf_code_t zinf_engine_flush_activations(zinf_engine_t* engine);
/* The bytes of activations the caller holds on the device now, outside the store, for the
 * memory report's activation_device_bytes_peak. */
ZINF_C_API zinf_code_t zinf_engine_set_activation_bytes(zinf_engine_t* engine,
                                                        uint64_t device_bytes);

/* ---- Ranks as threads ------------------------------------------------------------------------ */

/* What zinf_run_local calls on each rank's thread: `user` as given, the rank's engine (opened on
 * the config, nothing registered yet; valid during the call only; zinf_run_local closes it, and
 * zinf_engine_close on it does nothing; it runs on a host device, so zinf_engine_set_cuda_stream
 * refuses a stream with ZINF_INVALID_ARGUMENT) and the rank. Returns ZINF_OK, or the code of the
 * error that ends the job. */
typedef zinf_code_t (*zinf_rank_fn)(void* user, zinf_engine_t* engine, int rank);

/* Runs a job of `world_size` ranks as threads of this process (zinf::run_local,
 * include/zinf/run_local.hpp): makes one host device per rank and a local communicator group,
 * opens one engine per rank on `config`, calls fn(user, engine, rank) on each rank's thread, and
 * closes the engines, the group and the devices in that order once every thread has returned.
 * Returns ZINF_OK when every rank's fn did. Otherwise returns the code of the first rank to fail;
 * the calling thread's zinf_last_error_message() names that rank ("rank 1: ...") and carries the
 * message of the last failed zinf call on that rank's thread when its code is the one fn
 * returned. The other ranks' communicators are aborted at once, so a rank waiting for the failed
 * one in a collective returns ZINF_ABORTED. Every thread has been joined when this returns. */
ZINF_C_API zinf_code_t zinf_run_local(int world_size, const zinf_config_t* config, zinf_rank_fn fn,
                                      void* user);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ZINF_ZINF_H_ */
