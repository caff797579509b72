# Resolves ZINF_WITH_CUDA / ZINF_WITH_NCCL (AUTO, ON, OFF) into ZINF_WITH_CUDA_RESOLVED and
# ZINF_WITH_NCCL_RESOLVED. AUTO turns a backend on when its compiler or header is found, so the
# CUDA sources are compiled wherever nvcc exists (and cannot rot) even with no GPU attached.
#
# ZINF_CUDA_RUNTIME (Shared or Static) picks CUDA::cudart or CUDA::cudart_static; the GPU bundle
# (scripts/gpu-bundle) links the runtime statically so that it needs only the driver there.
#
# NCCL is looked for in NCCL_ROOT / $NCCL_ROOT / $NCCL_HOME, the CUDA toolkit, and the nvidia/nccl
# folder of python3's pip NCCL (nvidia-nccl-cu*), which ships only libnccl.so.2 and nccl.h: the
# library is accepted under that name too. Either way the binaries record NEEDED libnccl.so.2
# (NCCL's soname), so the NCCL they meet at run time is whichever the loader finds then.
set(ZINF_CUDA_RUNTIME Shared CACHE STRING "Link the CUDA runtime as Shared or Static")
set_property(CACHE ZINF_CUDA_RUNTIME PROPERTY STRINGS Shared Static)
set(ZINF_WITH_CUDA_RESOLVED OFF)
set(ZINF_WITH_NCCL_RESOLVED OFF)

if(NOT ZINF_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER)
    find_program(_zinf_nvcc nvcc HINTS /usr/local/cuda/bin ENV CUDA_PATH PATH_SUFFIXES bin)
    if(_zinf_nvcc)
      set(CMAKE_CUDA_COMPILER "${_zinf_nvcc}" CACHE FILEPATH "CUDA compiler")
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Machine code for A100 and H100/H200, and PTX for what comes after.
      set(CMAKE_CUDA_ARCHITECTURES "80-real;90-real;90-virtual" CACHE STRING "CUDA architectures")
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(ZINF_WITH_CUDA_RESOLVED ON)
    if(ZINF_CUDA_RUNTIME STREQUAL "Static")
      set(ZINF_CUDART_TARGET CUDA::cudart_static)
    elseif(ZINF_CUDA_RUNTIME STREQUAL "Shared")
      set(ZINF_CUDART_TARGET CUDA::cudart)
    else()
      message(FATAL_ERROR "ZINF_CUDA_RUNTIME must be Shared or Static, not '${ZINF_CUDA_RUNTIME}'")
    endif()
    message(STATUS "zinf: CUDA backend ON (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, "
                   "architectures ${CMAKE_CUDA_ARCHITECTURES})")
  elseif(ZINF_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ZINF_WITH_CUDA=ON but no CUDA compiler (nvcc) was found")
  else()
    message(STATUS "zinf: CUDA backend OFF (no nvcc found)")
  endif()
endif()

if(ZINF_WITH_CUDA_RESOLVED AND NOT ZINF_WITH_NCCL STREQUAL "OFF")
  set(_zinf_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME})
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    # pip's NCCL: site-packages/nvidia/nccl/{include,lib}. A namespace package, hence __path__.
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
      OUTPUT_VARIABLE _zinf_pip_nccl OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
      RESULT_VARIABLE _zinf_pip_nccl_rc)
    if(_zinf_pip_nccl_rc EQUAL 0 AND IS_DIRECTORY "${_zinf_pip_nccl}")
      list(APPEND _zinf_nccl_hints "${_zinf_pip_nccl}")
    endif()
  endif()
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_zinf_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
                                         /usr/local/cuda/include PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2
               HINTS ${_zinf_nccl_hints} ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64
               PATH_SUFFIXES lib lib64)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(ZINF_WITH_NCCL_RESOLVED ON)
    if(NOT TARGET zinf_nccl)
      add_library(zinf_nccl UNKNOWN IMPORTED)
      set_target_properties(zinf_nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                                                 INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
    endif()
    message(STATUS "zinf: NCCL ON (${NCCL_LIBRARY})")
  elseif(ZINF_WITH_NCCL STREQUAL "ON")
    message(FATAL_ERROR "ZINF_WITH_NCCL=ON but nccl.h / libnccl were not found")
  else()
    message(STATUS "zinf: NCCL OFF (nccl.h or libnccl not found)")
  endif()
elseif(ZINF_WITH_NCCL STREQUAL "ON")
  message(FATAL_ERROR "ZINF_WITH_NCCL=ON needs the CUDA backend")
endif()
