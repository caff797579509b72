#include "gemm.hpp"

#include <tbb/blocked_range.h>
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

// Rows (or input features) per block, and output columns per tile: a tile of 8 x 256 floats
// (8 KiB) stays in L1 while the other operand streams past it.
constexpr std::size_t kRowBlock = 8;
constexpr std::size_t kColTile = 256;

TRAIN_LM_CLONES
void forward_block(const float* x, const float* w, const float* b, float* y, std::size_t r0,
                   std::size_t r1, std::size_t in, std::size_t out) {
  for (std::size_t c0 = 0; c0 < out; c0 += kColTile) {
    const std::size_t c1 = std::min(out, c0 + kColTile);
    for (std::size_t r = r0; r < r1; ++r) {
      float* yr = y + r * out;
      for (std::size_t c = c0; c < c1; ++c) yr[c] = b != nullptr ? b[c] : 0.0f;
    }
    for (std::size_t i = 0; i < in; ++i) {
      const float* wi = w + i * out;
      for (std::size_t r = r0; r < r1; ++r) {
        const float xv = x[r * in + i];
        float* yr = y + r * out;
        for (std::size_t c = c0; c < c1; ++c) yr[c] += xv * wi[c];
      }
    }
  }
}

TRAIN_LM_CLONES
void backward_input_block(const float* dy, const float* w, float* dx, std::size_t r0,
                          std::size_t r1, std::size_t in, std::size_t out) {
  // Dot products of dy rows with w rows; eight partial sums let the compiler use vector lanes
  // without reassociating a single sum (which it may not do without -ffast-math).
  constexpr std::size_t kLanes = 8;
  const std::size_t out_main = out - out % kLanes;
  for (std::size_t r = r0; r < r1; ++r) {
    const float* dyr = dy + r * out;
    for (std::size_t i = 0; i < in; ++i) {
      const float* wi = w + i * out;
      float acc[kLanes] = {};
      for (std::size_t o = 0; o < out_main; o += kLanes) {
        for (std::size_t l = 0; l < kLanes; ++l) acc[l] += dyr[o + l] * wi[o + l];
      }
      float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (std::size_t o = out_main; o < out; ++o) sum += dyr[o] * wi[o];
      dx[r * in + i] = sum;
    }
  }
}

TRAIN_LM_CLONES
void backward_weight_block(const float* x, const float* dy, float* dw, std::size_t i0,
                           std::size_t i1, std::size_t rows, std::size_t in, std::size_t out) {
  for (std::size_t c0 = 0; c0 < out; c0 += kColTile) {
    const std::size_t c1 = std::min(out, c0 + kColTile);
    for (std::size_t i = i0; i < i1; ++i) {
      std::memset(dw + i * out + c0, 0, (c1 - c0) * sizeof(float));
    }
    for (std::size_t r = 0; r < rows; ++r) {
      const float* dyr = dy + r * out;
      for (std::size_t i = i0; i < i1; ++i) {
        const float xv = x[r * in + i];
        float* dwi = dw + i * out;
        for (std::size_t c = c0; c < c1; ++c) dwi[c] += xv * dyr[c];
      }
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
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, rows, kRowBlock),
                    [&](const tbb::blocked_range<std::size_t>& range) {
                      for (std::size_t r = range.begin(); r < range.end(); r += kRowBlock) {
                        forward_block(x, w, b, y, r, std::min(range.end(), r + kRowBlock), in, out);
                      }
                    });
}

void linear_backward_input(const float* dy, const float* w, float* dx, std::size_t rows,
                           std::size_t in, std::size_t out) {
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, rows, kRowBlock),
                    [&](const tbb::blocked_range<std::size_t>& range) {
                      backward_input_block(dy, w, dx, range.begin(), range.end(), in, out);
                    });
}

void linear_backward_weight(const float* x, const float* dy, float* dw, float* db, std::size_t rows,
                            std::size_t in, std::size_t out) {
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, in, kRowBlock),
                    [&](const tbb::blocked_range<std::size_t>& range) {
                      for (std::size_t i = range.begin(); i < range.end(); i += kRowBlock) {
                        backward_weight_block(x, dy, dw, i, std::min(range.end(), i + kRowBlock),
                                              rows, in, out);
                      }
                    });
  if (db != nullptr) bias_grad(dy, db, rows, out);
}

}  // namespace train_lm
