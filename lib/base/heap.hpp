// Giving the pages of freed heap memory back to the system.
//
// glibc's malloc maps a block of at least its mmap threshold on its own and unmaps it on free; a
// smaller block comes from one of its heaps (arenas), and when it is freed its pages stay
// resident (and counted in the process's RSS) until the heap is trimmed, which glibc does by
// itself only at the top of the main heap. The threshold is not fixed: it starts at 128 KiB and
// rises (up to 32 MiB on 64-bit) each time the process frees a mapped block larger than it, so
// whether a block of some megabytes is mapped or comes from a heap depends on what the process
// did before. A one-time large free (the registered values' copies at finalize) can therefore
// leave its pages resident for the rest of the run unless they are handed back.
//
// Thread-safety: may be called from any thread; calls run one at a time (a process-wide mutex),
// and glibc locks each arena while it trims it.
#pragma once

namespace zinf {

// Hands the whole free pages of every malloc heap back to the system (glibc: malloc_trim(0),
// which madvises them away; the address space stays reserved, so a later allocation reuses it
// and faults in fresh zero pages). Freed memory that was mapped on its own is already gone, and
// nothing allocated is touched. A no-op where the C library is not glibc.
//
// Cost: one walk of each arena's free chunks under its lock, and a madvise system call for each
// free chunk with whole pages in it, so it grows with the memory handed back: 14 to 36 ms for
// 64 MiB freed in 1024 blocks (tests/base/heap_test.cpp prints it; a shared 2-core machine).
// Cheap after a one-time large free (finalize); not for a step path, where it would only make
// the next allocations fault their pages in again.
void release_freed_memory();

}  // namespace zinf
