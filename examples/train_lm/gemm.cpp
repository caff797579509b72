#include "gemm.hpp"

#include <tbb/blocked_range.h>
#include <tbb/blocked_range2d.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>

// GCC builds each kernel twice, for x86-64-v3 (AVX2, FMA) and for the baseline, and picks one
// when the program loads; the example needs no special compile flags, as a user's would not.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define TRAIN_LM_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define TRAIN_LM_CLONES
#endif

namespace train_lm {
namespace {

// The helpers below take and return 32-byte vectors and are always inlined into the kernels, so
// no call passes one across the baseline ABI, which GCC would otherwise warn about (at the end of
// the file, hence for all of it).
#pragma GCC diagnostic ignored "-Wpsabi"

// Eight floats as one value: one AVX register in the x86-64-v3 build, two SSE registers in the
// baseline one. The compiler's vector extension, so no intrinsics and no special flags.
typedef float V8 __attribute__((vector_size(32)));
constexpr std::size_t kLanes = 8;

[[gnu::always_inline]] inline V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
[[gnu::always_inline]] inline void store8(float* p, V8 v) { std::memcpy(p, &v, sizeof v); }
[[gnu::always_inline]] inline V8 splat(float s) {
  const V8 first = {s};
  return __builtin_shufflevector(first, first, 0, 0, 0, 0, 0, 0, 0, 0);
}

// Each kernel keeps a block of outputs in registers and streams the weights past it once: with a
// training step's few rows (tokens), the products are bound by reading W, so each task owns a
// slice of W's columns (forward) or rows (backward) and reads it from memory once. Every output
// element still sums its terms one after another in the order of the plain loop (forward and
// weight gradient), or in the eight lane sums of the input gradient, so the bits do not depend
// on the blocking or the number of threads.

// Output columns per register tile (two vectors), columns per forward task (a run of W's row
// that the hardware prefetches well), inputs per pass over a task's columns (a strip of 64 x 16
// floats of W, 4 KiB, stays in L1 while the row blocks reuse it), and rows per forward task
// where there are many.
constexpr std::size_t kTileCols = 2 * kLanes;
constexpr std::size_t kSliceCols = 16 * kTileCols;
constexpr std::size_t kChunk = 64;
constexpr std::size_t kRowsPerTask = 64;

// The register tile of the forward and the weight gradient: A rows of 16 outputs. add_outer
// adds s[a * stride] * v[0..16) to row a, the one term of each of its sums; store_tile writes the
// rows `pitch` floats apart.
template <std::size_t A>
[[gnu::always_inline]] inline void add_outer(V8 (&acc)[A][2], const float* s, std::size_t stride,
                                             const float* v) {
  const V8 v0 = load8(v);
  const V8 v1 = load8(v + kLanes);
  for (std::size_t a = 0; a < A; ++a) {
    const V8 sa = splat(s[a * stride]);
    acc[a][0] += sa * v0;
    acc[a][1] += sa * v1;
  }
}

template <std::size_t A>
[[gnu::always_inline]] inline void store_tile(const V8 (&acc)[A][2], float* dst,
                                              std::size_t pitch) {
  for (std::size_t a = 0; a < A; ++a) {
    store8(dst + a * pitch, acc[a][0]);
    store8(dst + a * pitch + kLanes, acc[a][1]);
  }
}

// y[r][c0..c0+16) for R rows from r0, over inputs [i0, i1): starts from the bias (or 0) when
// i0 == 0, else from the partial sums in y.
template <std::size_t R>
[[gnu::always_inline]] inline void forward_tile(const float* x, const float* w, const float* b,
                                                float* y, std::size_t r0, std::size_t c0,
                                                std::size_t i0, std::size_t i1, std::size_t in,
                                                std::size_t out) {
  V8 acc[R][2];
  for (std::size_t r = 0; r < R; ++r) {
    for (std::size_t v = 0; v < 2; ++v) {
      const float* from = i0 == 0 ? b : y + (r0 + r) * out;
      acc[r][v] = from != nullptr ? load8(from + c0 + v * kLanes) : V8{};
    }
  }
  for (std::size_t i = i0; i < i1; ++i) add_outer(acc, x + r0 * in + i, in, w + i * out + c0);
  store_tile(acc, y + r0 * out + c0, out);
}

TRAIN_LM_CLONES
void forward_block(const float* x, const float* w, const float* b, float* y, std::size_t r_begin,
                   std::size_t r_end, std::size_t c_begin, std::size_t c_end, std::size_t in,
                   std::size_t out) {
  const std::size_t c_main = c_begin + (c_end - c_begin) / kTileCols * kTileCols;
  // At least one pass, so that y gets the bias even with no inputs.
  for (std::size_t i0 = 0; i0 == 0 || i0 < in; i0 += kChunk) {
    const std::size_t i1 = std::min(in, i0 + kChunk);
    for (std::size_t c = c_begin; c < c_main; c += kTileCols) {
      std::size_t r = r_begin;
      for (; r + 4 <= r_end; r += 4) forward_tile<4>(x, w, b, y, r, c, i0, i1, in, out);
      for (; r < r_end; ++r) forward_tile<1>(x, w, b, y, r, c, i0, i1, in, out);
    }
  }
  // The last columns of a slice whose width is not a multiple of the tile, summed in y.
  if (c_main == c_end) return;
  for (std::size_t r = r_begin; r < r_end; ++r) {
    for (std::size_t c = c_main; c < c_end; ++c) y[r * out + c] = b != nullptr ? b[c] : 0.0f;
  }
  for (std::size_t i = 0; i < in; ++i) {
    for (std::size_t r = r_begin; r < r_end; ++r) {
      const float xv = x[r * in + i];
      float* yr = y + r * out;
      for (std::size_t c = c_main; c < c_end; ++c) yr[c] += xv * w[i * out + c];
    }
  }
}

// The eight lane sums of dx[r][i] folded in a fixed order, then the columns past the last full
// vector.
[[gnu::always_inline]] inline float finish_dot(V8 acc, const float* dyr, const float* wi,
                                               std::size_t from, std::size_t out) {
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (std::size_t o = from; o < out; ++o) sum += dyr[o] * wi[o];
  return sum;
}

// dx[r][i] for RR rows from r0 and RI inputs from i0.
template <std::size_t RR, std::size_t RI>
[[gnu::always_inline]] inline void input_tile(const float* dy, const float* w, float* dx,
                                              std::size_t r0, std::size_t i0, std::size_t in,
                                              std::size_t out) {
  const std::size_t out_main = out - out % kLanes;
  V8 acc[RR][RI] = {};
  for (std::size_t o = 0; o < out_main; o += kLanes) {
    V8 wv[RI];
    for (std::size_t k = 0; k < RI; ++k) wv[k] = load8(w + (i0 + k) * out + o);
    for (std::size_t r = 0; r < RR; ++r) {
      const V8 d = load8(dy + (r0 + r) * out + o);
      for (std::size_t k = 0; k < RI; ++k) acc[r][k] += d * wv[k];
    }
  }
  for (std::size_t r = 0; r < RR; ++r) {
    for (std::size_t k = 0; k < RI; ++k) {
      dx[(r0 + r) * in + i0 + k] =
          finish_dot(acc[r][k], dy + (r0 + r) * out, w + (i0 + k) * out, out_main, out);
    }
  }
}

TRAIN_LM_CLONES
void backward_input_rows(const float* dy, const float* w, float* dx, std::size_t i_begin,
                         std::size_t i_end, std::size_t rows, std::size_t in, std::size_t out) {
  std::size_t i = i_begin;
  for (; i + 4 <= i_end; i += 4) {
    std::size_t r = 0;
    for (; r + 2 <= rows; r += 2) input_tile<2, 4>(dy, w, dx, r, i, in, out);
    for (; r < rows; ++r) input_tile<1, 4>(dy, w, dx, r, i, in, out);
  }
  for (; i < i_end; ++i) {
    for (std::size_t r = 0; r < rows; ++r) input_tile<1, 1>(dy, w, dx, r, i, in, out);
  }
}

// dw[i][c0..c0+16) for RI inputs from i0: sum over the rows, from 0.
template <std::size_t RI>
[[gnu::always_inline]] inline void weight_tile(const float* x, const float* dy, float* dw,
                                               std::size_t i0, std::size_t c0, std::size_t rows,
                                               std::size_t in, std::size_t out) {
  V8 acc[RI][2] = {};
  for (std::size_t r = 0; r < rows; ++r) add_outer(acc, x + r * in + i0, 1, dy + r * out + c0);
  store_tile(acc, dw + i0 * out + c0, out);
}

TRAIN_LM_CLONES
void backward_weight_rows(const float* x, const float* dy, float* dw, std::size_t i_begin,
                          std::size_t i_end, std::size_t rows, std::size_t in, std::size_t out) {
  const std::size_t out_main = out - out % kTileCols;
  std::size_t i = i_begin;
  for (; i + 4 <= i_end; i += 4) {
    for (std::size_t c = 0; c < out_main; c += kTileCols)
      weight_tile<4>(x, dy, dw, i, c, rows, in, out);
  }
  for (; i < i_end; ++i) {
    for (std::size_t c = 0; c < out_main; c += kTileCols)
      weight_tile<1>(x, dy, dw, i, c, rows, in, out);
  }
  for (i = i_begin; i < i_end; ++i) {
    for (std::size_t c = out_main; c < out; ++c) {
      float sum = 0.0f;
      for (std::size_t r = 0; r < rows; ++r) sum += x[r * in + i] * dy[r * out + c];
      dw[i * out + c] = sum;
    }
  }
}

TRAIN_LM_CLONES
void bias_grad(const float* dy, float* db, std::size_t rows, std::size_t out) {
  std::memset(db, 0, out * sizeof(float));
  for (std::size_t r = 0; r < rows; ++r) {
    const float* dyr = dy + r * out;
    for (std::size_t c = 0; c < out; ++c) db[c] += dyr[c];
  }
}

}  // namespace

void linear_forward(const float* x, const float* w, const float* b, float* y, std::size_t rows,
                    std::size_t in, std::size_t out) {
  // A task per slice of columns (the last also takes the columns past the last whole tile), so
  // that a training step's few rows read W from memory once; many rows are split too (blocks of
  // 64), so that a narrow layer still runs on every thread.
  const std::size_t slices = (out + kSliceCols - 1) / kSliceCols;
  tbb::parallel_for(tbb::blocked_range2d<std::size_t>(0, rows, kRowsPerTask, 0, slices, 1),
                    [&](const tbb::blocked_range2d<std::size_t>& range) {
                      forward_block(x, w, b, y, range.rows().begin(), range.rows().end(),
                                    range.cols().begin() * kSliceCols,
                                    std::min(out, range.cols().end() * kSliceCols), in, out);
                    });
}

void linear_backward_input(const float* dy, const float* w, float* dx, std::size_t rows,
                           std::size_t in, std::size_t out) {
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, in, 8),
                    [&](const tbb::blocked_range<std::size_t>& range) {
                      backward_input_rows(dy, w, dx, range.begin(), range.end(), rows, in, out);
                    });
}

void linear_backward_weight(const float* x, const float* dy, float* dw, float* db, std::size_t rows,
                            std::size_t in, std::size_t out) {
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, in, 8),
                    [&](const tbb::blocked_range<std::size_t>& range) {
                      backward_weight_rows(x, dy, dw, range.begin(), range.end(), rows, in, out);
                    });
  if (db != nullptr) bias_grad(dy, db, rows, out);
}

}  // namespace train_lm
