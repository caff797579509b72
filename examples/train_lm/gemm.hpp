// The three matrix products of a linear layer y = x W + b, forward and backward, in fp32 on the
// CPU. W is stored [in][out] row-major, activations [rows][features] row-major.
//
// Every output element is computed by one task, summing in a fixed order, so the results are the
// same bits whatever the number of threads: two runs with the same seed train the same model.
// The loops are blocked so that the compiler vectorises their inner loop (AVX2+FMA where the CPU
// has it, chosen at load time; SSE2 otherwise) and oneTBB runs the blocks in parallel.
#pragma once

#include <cstddef>

namespace train_lm {

// y[r][o] = b[o] + sum_i x[r][i] * w[i][o]. `b` may be null (no bias).
void linear_forward(const float* x, const float* w, const float* b, float* y, std::size_t rows,
                    std::size_t in, std::size_t out);

// dx[r][i] = sum_o dy[r][o] * w[i][o]  (dx = dy W^T). Overwrites dx.
void linear_backward_input(const float* dy, const float* w, float* dx, std::size_t rows,
                           std::size_t in, std::size_t out);

// dw[i][o] = sum_r x[r][i] * dy[r][o]  (dw = x^T dy) and db[o] = sum_r dy[r][o]. Overwrites both;
// `db` may be null.
void linear_backward_weight(const float* x, const float* dy, float* dw, float* db, std::size_t rows,
                            std::size_t in, std::size_t out);

}  // namespace train_lm
