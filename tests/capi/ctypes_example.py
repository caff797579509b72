#!/usr/bin/env python3
"""zinf from Python through the C API (include/zinf/zinf.h) with ctypes, nothing else.

Two ranks (Python threads; ctypes releases the GIL during each call) fit a two-module model
w = target by gradient g = w - target_seen_by_rank under ZeRO stage 3, and check that both ranks
end with the same masters, that the masters approach the mean target, and that an unknown
module comes back as ZINF_NOT_FOUND naming it.

  python3 tests/capi/ctypes_example.py /path/to/libzinf.so
"""
import array
import ctypes as C
import random
import sys
import threading

lib = C.CDLL(sys.argv[1] if len(sys.argv) > 1 else "libzinf.so")

ZINF_OK, ZINF_NOT_FOUND = 0, 2
ZINF_DTYPE_F32 = 0


class Env(C.Structure):
    # zinf_env_t without its last field (trace): struct_size tells the library how much there is.
    _fields_ = [("struct_size", C.c_size_t), ("device", C.c_void_p), ("comm", C.c_void_p),
                ("nvme_paths", C.POINTER(C.c_char_p)), ("nvme_path_count", C.c_size_t)]


class Gradient(C.Structure):
    _fields_ = [("name", C.c_char_p), ("data", C.c_void_p), ("element_count", C.c_size_t),
                ("dtype", C.c_int)]


class StepReport(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("step", C.c_int64), ("skipped", C.c_int32),
                ("micro_batches", C.c_int32), ("loss_scale", C.c_double),
                ("next_loss_scale", C.c_double), ("grad_norm", C.c_double),
                ("clip_coef", C.c_double)]  # a prefix of zinf_step_report_t: allowed


lib.zinf_version.restype = C.c_char_p
lib.zinf_code_name.restype = C.c_char_p
lib.zinf_last_error_message.restype = C.c_char_p
for name, args in {
    "zinf_config_from_json": [C.c_char_p, C.c_size_t, C.POINTER(C.c_void_p)],
    "zinf_host_device_create": [C.c_int, C.c_uint64, C.POINTER(C.c_void_p)],
    "zinf_local_comm_group_create": [C.POINTER(C.c_void_p), C.c_int, C.c_int64,
                                     C.POINTER(C.c_void_p)],
    "zinf_comm_group_get": [C.c_void_p, C.c_int, C.POINTER(C.c_void_p)],
    "zinf_engine_open": [C.c_void_p, C.POINTER(Env), C.POINTER(C.c_void_p)],
    "zinf_engine_register_parameter": [C.c_void_p, C.c_char_p, C.c_char_p,
                                       C.POINTER(C.c_int64), C.c_size_t, C.c_int,
                                       C.POINTER(C.c_float)],
    "zinf_engine_gather": [C.c_void_p, C.c_char_p],
    "zinf_engine_release": [C.c_void_p, C.c_char_p],
    "zinf_engine_parameter": [C.c_void_p, C.c_char_p, C.POINTER(C.c_void_p),
                              C.POINTER(C.c_int), C.POINTER(C.c_size_t)],
    "zinf_engine_reduce_gradients": [C.c_void_p, C.c_char_p, C.POINTER(Gradient), C.c_size_t],
    "zinf_engine_step": [C.c_void_p, C.POINTER(StepReport)],
    "zinf_engine_read_parameters": [C.c_void_p, C.c_char_p, C.POINTER(C.c_float), C.c_size_t],
    "zinf_engine_close": [C.c_void_p],
    "zinf_comm_group_destroy": [C.c_void_p],
    "zinf_device_destroy": [C.c_void_p],
    "zinf_config_destroy": [C.c_void_p],
}.items():
    getattr(lib, name).argtypes = args


def check(code):
    if code != ZINF_OK:
        raise RuntimeError("%s: %s" % (lib.zinf_code_name(code).decode(),
                                       lib.zinf_last_error_message().decode()))


WORLD, STEPS, N = 2, 300, 4
MODULES = [b"first", b"second"]
config_json = b"""{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                   "optimizer": {"type": "Adam", "params": {"lr": 0.05, "weight_decay": 0}},
                   "zinf": {"cpu_threads": 1}}"""
rng = random.Random(7)
targets = [[[rng.uniform(-1, 1) for _ in range(N)] for _ in MODULES] for _ in range(WORLD)]
initial = (C.c_float * N)(*[0.0] * N)
finals = [[None] * len(MODULES) for _ in range(WORLD)]

config, group = C.c_void_p(), C.c_void_p()
devices = (C.c_void_p * WORLD)()
check(lib.zinf_config_from_json(config_json, len(config_json), C.byref(config)))
for r in range(WORLD):
    device = C.c_void_p()
    check(lib.zinf_host_device_create(r, 0, C.byref(device)))
    devices[r] = device
check(lib.zinf_local_comm_group_create(devices, WORLD, 10000, C.byref(group)))


def rank_main(rank, errors):
    engine, comm = C.c_void_p(), C.c_void_p()
    try:
        check(lib.zinf_comm_group_get(group, rank, C.byref(comm)))
        env = Env(C.sizeof(Env), devices[rank], comm, None, 0)
        check(lib.zinf_engine_open(config, C.byref(env), C.byref(engine)))
        shape = (C.c_int64 * 1)(N)
        for m in MODULES:
            check(lib.zinf_engine_register_parameter(engine, m + b".w", m, shape, 1,
                                                     ZINF_DTYPE_F32, initial))
        if rank == 0:
            assert lib.zinf_engine_gather(engine, b"third") == ZINF_NOT_FOUND
            assert b"third" in lib.zinf_last_error_message()
        grad = (C.c_float * N)()
        report = StepReport(C.sizeof(StepReport))
        for _ in range(STEPS):
            for i in reversed(range(len(MODULES))):
                m = MODULES[i]
                check(lib.zinf_engine_gather(engine, m))
                data, count = C.c_void_p(), C.c_size_t()
                check(lib.zinf_engine_parameter(engine, m + b".w", C.byref(data), None,
                                                C.byref(count)))
                w = C.cast(data, C.POINTER(C.c_float))
                for k in range(N):
                    grad[k] = w[k] - targets[rank][i][k]
                g = Gradient(m + b".w", C.cast(grad, C.c_void_p), N, ZINF_DTYPE_F32)
                check(lib.zinf_engine_reduce_gradients(engine, m, C.byref(g), 1))
                check(lib.zinf_engine_release(engine, m))
            check(lib.zinf_engine_step(engine, C.byref(report)))
        for i, m in enumerate(MODULES):
            out = (C.c_float * N)()
            check(lib.zinf_engine_read_parameters(engine, m + b".w", out, N))
            finals[rank][i] = list(out)
        if rank == 0:
            print("rank 0: step %d, grad norm %.2e" % (report.step, report.grad_norm))
    except Exception as e:  # reported by the main thread
        errors.append("rank %d: %s" % (rank, e))
    finally:
        lib.zinf_engine_close(engine)


errors = []
threads = [threading.Thread(target=rank_main, args=(r, errors)) for r in range(WORLD)]
for t in threads:
    t.start()
for t in threads:
    t.join()
check(lib.zinf_comm_group_destroy(group))
for r in range(WORLD):
    check(lib.zinf_device_destroy(devices[r]))
lib.zinf_config_destroy(config)
if errors:
    sys.exit("\n".join(errors))

# The mean gradient is w - mean(targets): the masters converge to the mean target.
worst = 0.0
for i in range(len(MODULES)):
    assert finals[0][i] == finals[1][i], "ranks differ"
    for k in range(N):
        mean = sum(targets[r][i][k] for r in range(WORLD)) / WORLD
        worst = max(worst, abs(finals[0][i][k] - mean))
print("zinf %s via ctypes: %d ranks, max |w - mean target| = %.2e" %
      (lib.zinf_version().decode(), WORLD, worst))
assert worst < 1e-2, worst
print("OK")
