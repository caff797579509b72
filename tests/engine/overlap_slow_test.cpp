// overlap_test.cpp's matrix for 200 steps (label slow): the overlapped step against the sequential
// one, the same bits over a run as long as the acceptance run of the overlapped step asks for.
#define OVERLAP_STEPS 200
#define OVERLAP_SUITE OverlapStep200
#define OVERLAP_BACKWARD_SUITE OverlapBackward200
#include "overlap_test.cpp"  // NOLINT(bugprone-suspicious-include)
