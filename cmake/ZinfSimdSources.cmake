# zinf_simd_source_flags(<source>...): gives each *_avx512.cpp and *_avx2.cpp among the sources
# the instruction-set flags its name promises (lib/CMakeLists.txt lists the naming conventions).
# Such a file is called only after a runtime CPU check, so only it may use those instructions.
# Source properties belong to the directory that sets them, so each directory that compiles these
# files (lib/, and tests/ for the fuzz build's copy of the library) calls this itself. They compile
# without the library's precompiled header, which is made without those flags.
function(zinf_simd_source_flags)
  foreach(src IN LISTS ARGN)
    if(src MATCHES "_avx512\\.cpp$")
      set_source_files_properties("${src}" PROPERTIES COMPILE_OPTIONS
        "-mavx512f;-mavx512bw;-mavx512vl;-mavx512dq;-mavx512bf16;-mfma;-mf16c;-mavx2"
        SKIP_PRECOMPILE_HEADERS ON)
    elseif(src MATCHES "_avx2\\.cpp$")
      set_source_files_properties("${src}" PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c"
                                  SKIP_PRECOMPILE_HEADERS ON)
    endif()
  endforeach()
endfunction()
