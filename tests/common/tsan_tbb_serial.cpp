// Linked into the test binaries of a ThreadSanitizer build only (tests/CMakeLists.txt).
//
// oneTBB's scheduler lives in libtbb, which Debian does not build with -fsanitize=thread: the
// synchronisation by which a parallel loop's worker threads hand their chunks back to the caller
// is invisible to ThreadSanitizer, which then reports every loop's task objects and results as
// races (66 reports in the io tests alone, each inside oneTBB's parallel_for and small-object
// pool). Rather than suppressing every report with a oneTBB frame, which would hide races in our
// own code whenever it runs inside a loop, the process allows oneTBB no worker threads: every
// parallel loop and task arena runs on the thread that calls it, where ThreadSanitizer sees its
// accesses in order with that thread's synchronisation. Races between our threads (I/O rings,
// device streams, rank threads, the optimizer pipeline's threads) are checked as before; races
// between the chunks of one oneTBB loop are not (docs/RELIABILITY.md).
#include <tbb/global_control.h>

namespace {

// Constructed before every other static object of the binary (init_priority 101, the first
// a program may use): some tests run a child's whole job from a static initialiser
// (tests/engine/checkpoint_kill_util.cpp), before main().
__attribute__((init_priority(101)))
const tbb::global_control g_one_thread(tbb::global_control::max_allowed_parallelism, 1);

}  // namespace
