# Initial cache for the GPU bundle (scripts/gpu-bundle passes it with -C): a Release build of the
# CUDA and NCCL backends for sm_80 and sm_90 (plus compute_90 PTX), the CUDA runtime linked
# statically so that only the driver is needed on the GPU machine, and executables that look for
# their shared libraries in ../lib beside them first.
#
# DT_RPATH, not DT_RUNPATH (--disable-new-dtags): DT_RPATH is searched before LD_LIBRARY_PATH and
# for the libraries' own dependencies too, so the bundled TBB, fmt, ... are the ones loaded,
# whatever the GPU machine's environment says. Not in that folder, so found through the system or
# LD_LIBRARY_PATH: libnccl.so.2 (scripts/gpu-check locates it) and libstdc++/libgcc_s (bundled in
# lib/cxx, which gpu-check puts on LD_LIBRARY_PATH only when the machine's own libstdc++ is too
# old; ours needs glibc 2.36, the machine's is made for its glibc). CMake's own build-tree RPATH
# (it would name /usr/local/cuda/lib64 here) is switched off, so only $ORIGIN/../lib is recorded.
# The Makefile generator runs link lines from a script through the shell: the quotes keep $ORIGIN.
# FORCE: a second configure of the same build directory gets these values again.
set(CMAKE_BUILD_TYPE Release CACHE STRING "" FORCE)
set(ZINF_WITH_CUDA ON CACHE STRING "" FORCE)
set(ZINF_WITH_NCCL ON CACHE STRING "" FORCE)
set(ZINF_CUDA_RUNTIME Static CACHE STRING "" FORCE)
# The GPU machine has no Open MPI (none of our Debian packages), so MpiComm stays out of the
# bundle: a one-GPU machine cannot run the two-process MpiComm + CudaDevice job without it.
set(ZINF_WITH_MPI OFF CACHE STRING "" FORCE)
set(CMAKE_CUDA_ARCHITECTURES "80-real;90-real;90-virtual" CACHE STRING "" FORCE)
set(CMAKE_SKIP_BUILD_RPATH ON CACHE BOOL "" FORCE)
set(CMAKE_EXE_LINKER_FLAGS "-Wl,--disable-new-dtags -Wl,-rpath,'$ORIGIN/../lib'" CACHE STRING "" FORCE)
