#include "model.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>

#include "gemm.hpp"
#include "rng.hpp"

namespace train_lm {
namespace {

constexpr std::size_t kVocab = 256;
constexpr float kRmsEps = 1e-5f;

// y = x / sqrt(mean(x^2) + eps), row by row; keeps 1/sqrt(...) for the backward pass.
void rms_forward(const float* x, float* y, float* inv_rms, std::size_t rows, std::size_t width) {
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, rows, 64),
                    [&](const tbb::blocked_range<std::size_t>& range) {
                      for (std::size_t r = range.begin(); r < range.end(); ++r) {
                        const float* xr = x + r * width;
                        double sum = 0;
                        for (std::size_t c = 0; c < width; ++c) sum += double(xr[c]) * xr[c];
                        const float inv = 1.0f / std::sqrt(float(sum / double(width)) + kRmsEps);
                        inv_rms[r] = inv;
                        for (std::size_t c = 0; c < width; ++c) y[r * width + c] = xr[c] * inv;
                      }
                    });
}

// With y = x * r and r = (mean(x^2) + eps)^-1/2:  dx = r * (dy - y * mean(dy * y)).
// Adds the result into dx (the residual stream's gradient already holds the skip path).
void rms_backward_add(const float* y, const float* inv_rms, const float* dy, float* dx,
                      std::size_t rows, std::size_t width) {
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, rows, 64),
                    [&](const tbb::blocked_range<std::size_t>& range) {
                      for (std::size_t r = range.begin(); r < range.end(); ++r) {
                        const float* yr = y + r * width;
                        const float* dyr = dy + r * width;
                        double dot = 0;
                        for (std::size_t c = 0; c < width; ++c) dot += double(dyr[c]) * yr[c];
                        const float mean = float(dot / double(width));
                        float* dxr = dx + r * width;
                        for (std::size_t c = 0; c < width; ++c) {
                          dxr[c] += inv_rms[r] * (dyr[c] - yr[c] * mean);
                        }
                      }
                    });
}

}  // namespace

std::vector<ModuleSpec> module_specs(const ModelShape& shape) {
  std::vector<ModuleSpec> specs;
  specs.push_back({"embed", kVocab, shape.embed_dim, false});
  specs.push_back({"in_proj", shape.context_bytes * shape.embed_dim, shape.hidden, true});
  for (std::size_t l = 0; l < shape.blocks; ++l) {
    specs.push_back({"block" + std::to_string(l) + ".up", shape.hidden, shape.ffn, true});
    specs.push_back({"block" + std::to_string(l) + ".down", shape.ffn, shape.hidden, true});
  }
  specs.push_back({"out", shape.hidden, kVocab, true});
  return specs;
}

std::uint64_t param_count(const ModelShape& shape) {
  std::uint64_t total = 0;
  for (const ModuleSpec& spec : module_specs(shape)) total += spec.param_count();
  return total;
}

ModelShape shape_for_params(std::uint64_t target, const ModelShape& base) {
  ModelShape best = base;
  std::uint64_t best_gap = ~std::uint64_t{0};
  // The count grows as 8 * blocks * hidden^2, so a step search over multiples of 16 is short:
  // about 350 candidates for 1e9 parameters in 4 blocks.
  for (std::size_t hidden = 16;; hidden += 16) {
    ModelShape shape = base;
    shape.hidden = hidden;
    shape.ffn = 4 * hidden;
    const std::uint64_t count = param_count(shape);
    const std::uint64_t gap = count > target ? count - target : target - count;
    if (gap < best_gap) {
      best_gap = gap;
      best = shape;
    }
    if (count > target) break;
  }
  return best;
}

void init_module(const ModelShape& shape, std::size_t module_index, std::uint64_t seed,
                 float* params) {
  const std::vector<ModuleSpec> specs = module_specs(shape);
  assert(module_index < specs.size());
  const ModuleSpec& spec = specs[module_index];
  Rng rng(seed * 0x9E3779B97F4A7C15ull + module_index + 1);
  const std::size_t weight_count = spec.in * spec.out;
  if (module_index == 0) {
    for (std::size_t i = 0; i < weight_count; ++i) params[i] = rng.normal();
    return;
  }
  float bound = 1.0f / std::sqrt(float(spec.in));
  if (module_index + 1 == specs.size()) bound *= 0.1f;
  for (std::size_t i = 0; i < weight_count; ++i) params[i] = bound * (2.0f * rng.uniform() - 1.0f);
  std::fill(params + weight_count, params + spec.param_count(), 0.0f);
}

Model::Model(const ModelShape& shape, std::size_t max_tokens, const Checkpointing& checkpointing)
    : shape_(shape),
      checkpointing_(checkpointing),
      modules_(module_specs(shape)),
      max_tokens_(max_tokens) {
  const std::size_t T = max_tokens;
  const std::size_t x_width = shape.context_bytes * shape.embed_dim;
  contexts_.resize(T * shape.context_bytes);
  targets_.resize(T);
  if (checkpointing.store != nullptr) {
    // One block's activations, recomputed for each block in turn; the embedding output and the
    // probabilities share the ffn buffer (each is dead while the others live).
    inv_rms_.assign(1, std::vector<float>(T));
    act_.assign(1, std::vector<float>(T * std::max({shape.ffn, x_width, kVocab})));
    if (checkpointing.stream_buffers[0] != nullptr) {
      stream_[0] = checkpointing.stream_buffers[0];
      stream_[1] = checkpointing.stream_buffers[1];
    } else {
      own_stream_.resize(2 * T * shape.hidden);
      stream_[0] = own_stream_.data();
      stream_[1] = own_stream_.data() + T * shape.hidden;
    }
  } else {
    x0_.resize(T * x_width);
    h_.assign(shape.blocks + 1, std::vector<float>(T * shape.hidden));
    norm_.assign(shape.blocks + 1, std::vector<float>(T * shape.hidden));
    inv_rms_.assign(shape.blocks + 1, std::vector<float>(T));
    act_.assign(shape.blocks, std::vector<float>(T * shape.ffn));
    probs_.resize(T * kVocab);
  }
  dh_.resize(T * shape.hidden);
  dnorm_.resize(T * shape.hidden);
  dact_.resize(T * std::max(shape.ffn, kVocab));
  dx0_.resize(T * x_width);
}

std::uint64_t Model::activation_bytes() const {
  std::uint64_t floats = x0_.size() + probs_.size();
  for (const auto& v : h_) floats += v.size();
  for (const auto& v : norm_) floats += v.size();
  for (const auto& v : inv_rms_) floats += v.size();
  for (const auto& v : act_) floats += v.size();
  if (checkpointing_.store != nullptr) floats += 2 * max_tokens_ * shape_.hidden;
  return floats * sizeof(float);
}

void Model::embed(const std::uint8_t* contexts, std::size_t T, ParamAccess& params, float* x0) {
  const ModelShape& s = shape_;
  // Embedding lookup: row t of x0 is the embeddings of its context bytes side by side.
  const float* embed = params.acquire(0);
  const std::size_t x_width = s.context_bytes * s.embed_dim;
  for (std::size_t t = 0; t < T; ++t) {
    for (std::size_t j = 0; j < s.context_bytes; ++j) {
      std::memcpy(&x0[t * x_width + j * s.embed_dim],
                  embed + contexts[t * s.context_bytes + j] * s.embed_dim,
                  s.embed_dim * sizeof(float));
    }
  }
  params.release(0);
}

double Model::softmax_loss(const std::uint8_t* targets, std::size_t T, float* probs) {
  // Softmax and cross-entropy, with the max subtracted for range; the sum is in double so that
  // the loss of a large batch does not lose digits.
  double loss_sum = 0;
  for (std::size_t t = 0; t < T; ++t) {
    float* row = &probs[t * kVocab];
    float max_logit = row[0];
    for (std::size_t v = 1; v < kVocab; ++v) max_logit = std::max(max_logit, row[v]);
    double denom = 0;
    for (std::size_t v = 0; v < kVocab; ++v) {
      row[v] = std::exp(row[v] - max_logit);
      denom += row[v];
    }
    const float inv = float(1.0 / denom);
    loss_sum += std::log(denom) - std::log(double(row[targets[t]]));
    for (std::size_t v = 0; v < kVocab; ++v) row[v] *= inv;
  }
  return loss_sum;
}

void Model::embed_backward(const float* dx0, std::size_t T, ParamAccess& params) {
  const ModelShape& s = shape_;
  const std::size_t x_width = s.context_bytes * s.embed_dim;
  // The embedding's gradient: each context slot adds its slice of dx0 to its byte's row.
  float* grad_embed = params.gradient_buffer(0);
  std::fill(grad_embed, grad_embed + kVocab * s.embed_dim, 0.0f);
  for (std::size_t t = 0; t < T; ++t) {
    for (std::size_t j = 0; j < s.context_bytes; ++j) {
      float* row = grad_embed + contexts_[t * s.context_bytes + j] * s.embed_dim;
      const float* src = &dx0[t * x_width + j * s.embed_dim];
      for (std::size_t e = 0; e < s.embed_dim; ++e) row[e] += src[e];
    }
  }
  params.gradient_ready(0);
}

double Model::forward(const std::uint8_t* contexts, const std::uint8_t* targets,
                      std::size_t token_count, ParamAccess& params, bool for_backward) {
  assert(token_count <= max_tokens_);
  if (checkpointing_.store != nullptr) {
    return forward_checkpointed(contexts, targets, token_count, params, for_backward);
  }
  const ModelShape& s = shape_;
  const std::size_t T = token_count;
  token_count_ = T;
  std::memcpy(contexts_.data(), contexts, T * s.context_bytes);
  std::memcpy(targets_.data(), targets, T);

  embed(contexts, T, params, x0_.data());
  const std::size_t x_width = s.context_bytes * s.embed_dim;

  const float* in_proj = params.acquire(1);
  linear_forward(x0_.data(), in_proj, in_proj + x_width * s.hidden, h_[0].data(), T, x_width,
                 s.hidden);
  params.release(1);

  for (std::size_t l = 0; l < s.blocks; ++l) {
    const std::size_t up = 2 + 2 * l, down = 3 + 2 * l;
    rms_forward(h_[l].data(), norm_[l].data(), inv_rms_[l].data(), T, s.hidden);
    const float* w_up = params.acquire(up);
    linear_forward(norm_[l].data(), w_up, w_up + s.hidden * s.ffn, act_[l].data(), T, s.hidden,
                   s.ffn);
    params.release(up);
    float* act = act_[l].data();
    for (std::size_t i = 0; i < T * s.ffn; ++i) act[i] = std::max(act[i], 0.0f);
    const float* w_down = params.acquire(down);
    linear_forward(act, w_down, w_down + s.ffn * s.hidden, h_[l + 1].data(), T, s.ffn, s.hidden);
    params.release(down);
    // The residual: h_l+1 = h_l + block(h_l).
    for (std::size_t i = 0; i < T * s.hidden; ++i) h_[l + 1][i] += h_[l][i];
  }

  const std::size_t last = s.blocks;
  rms_forward(h_[last].data(), norm_[last].data(), inv_rms_[last].data(), T, s.hidden);
  const std::size_t out_index = modules_.size() - 1;
  const float* w_out = params.acquire(out_index);
  linear_forward(norm_[last].data(), w_out, w_out + s.hidden * kVocab, probs_.data(), T, s.hidden,
                 kVocab);
  params.release(out_index);

  return softmax_loss(targets, T, probs_.data());
}

void Model::backward(float loss_scale, ParamAccess& params) {
  if (checkpointing_.store != nullptr) return backward_checkpointed(loss_scale, params);
  const ModelShape& s = shape_;
  const std::size_t T = token_count_;
  const std::size_t out_index = modules_.size() - 1;

  // d(loss)/d(logits) = loss_scale * (softmax - onehot(target)).
  float* dlogits = dact_.data();
  for (std::size_t t = 0; t < T; ++t) {
    for (std::size_t v = 0; v < kVocab; ++v) {
      dlogits[t * kVocab + v] = loss_scale * probs_[t * kVocab + v];
    }
    dlogits[t * kVocab + targets_[t]] -= loss_scale;
  }
  const std::size_t last = s.blocks;
  linear_backward(out_index, norm_[last].data(), dlogits, dnorm_.data(), T, s.hidden, kVocab,
                  params);
  std::fill(dh_.begin(), dh_.begin() + T * s.hidden, 0.0f);
  rms_backward_add(norm_[last].data(), inv_rms_[last].data(), dnorm_.data(), dh_.data(), T,
                   s.hidden);

  for (std::size_t l = s.blocks; l-- > 0;) {
    block_backward(l, norm_[l].data(), inv_rms_[l].data(), act_[l].data(), params);
  }

  const std::size_t x_width = s.context_bytes * s.embed_dim;
  linear_backward(1, x0_.data(), dh_.data(), dx0_.data(), T, x_width, s.hidden, params);
  embed_backward(dx0_.data(), T, params);
}

// The forward pass with checkpointing. The residual stream alternates between two buffers: block
// l reads h_l in `cur`, saves it, writes its norm into `other`, then its output over that norm
// (dead by then) and the residual sum h_l+1 = h_l + block(h_l) there too, and the buffers swap.
// The save of h_l may still be copying from `cur` while the block computes: the next save (or
// load) waits for it before `cur` is written again as the following block's `other`.
double Model::forward_checkpointed(const std::uint8_t* contexts, const std::uint8_t* targets,
                                   std::size_t token_count, ParamAccess& params,
                                   bool for_backward) {
  const ModelShape& s = shape_;
  const std::size_t T = token_count;
  token_count_ = T;
  std::memcpy(contexts_.data(), contexts, T * s.context_bytes);
  std::memcpy(targets_.data(), targets, T);
  const std::size_t x_width = s.context_bytes * s.embed_dim;
  float* act = act_[0].data();
  float* inv_rms = inv_rms_[0].data();
  float* cur = stream_[0];
  float* other = stream_[1];

  embed(contexts, T, params, act);  // x0, in the ffn buffer
  const float* in_proj = params.acquire(1);
  linear_forward(act, in_proj, in_proj + x_width * s.hidden, cur, T, x_width, s.hidden);
  params.release(1);

  for (std::size_t l = 0; l < s.blocks; ++l) {
    const std::size_t up = 2 + 2 * l, down = 3 + 2 * l;
    if (for_backward) checkpointing_.store->save(l, cur, T * s.hidden);
    rms_forward(cur, other, inv_rms, T, s.hidden);
    const float* w_up = params.acquire(up);
    linear_forward(other, w_up, w_up + s.hidden * s.ffn, act, T, s.hidden, s.ffn);
    params.release(up);
    for (std::size_t i = 0; i < T * s.ffn; ++i) act[i] = std::max(act[i], 0.0f);
    const float* w_down = params.acquire(down);
    linear_forward(act, w_down, w_down + s.ffn * s.hidden, other, T, s.ffn, s.hidden);
    params.release(down);
    for (std::size_t i = 0; i < T * s.hidden; ++i) other[i] += cur[i];
    std::swap(cur, other);
  }
  // The head's norm and probabilities stay for the backward pass, which starts with them. The
  // norm goes where the last save may still be copying from.
  if (for_backward && s.blocks > 0) checkpointing_.store->flush();
  rms_forward(cur, other, inv_rms, T, s.hidden);
  const std::size_t out_index = modules_.size() - 1;
  const float* w_out = params.acquire(out_index);
  linear_forward(other, w_out, w_out + s.hidden * kVocab, act, T, s.hidden, kVocab);
  params.release(out_index);
  head_norm_ = other;
  return softmax_loss(targets, T, act);
}

// The backward pass with checkpointing: the head from what the forward pass left, then each
// block from its reloaded input (norm and ffn activations recomputed, exactly as the forward
// pass computed them), then the input projection from the recomputed embedding output.
void Model::backward_checkpointed(float loss_scale, ParamAccess& params) {
  const ModelShape& s = shape_;
  const std::size_t T = token_count_;
  const std::size_t out_index = modules_.size() - 1;
  float* act = act_[0].data();
  float* inv_rms = inv_rms_[0].data();
  float* norm = head_norm_;
  float* h = norm == stream_[0] ? stream_[1] : stream_[0];

  float* dlogits = dact_.data();
  for (std::size_t t = 0; t < T; ++t) {
    for (std::size_t v = 0; v < kVocab; ++v) {
      dlogits[t * kVocab + v] = loss_scale * act[t * kVocab + v];
    }
    dlogits[t * kVocab + targets_[t]] -= loss_scale;
  }
  linear_backward(out_index, norm, dlogits, dnorm_.data(), T, s.hidden, kVocab, params);
  std::fill(dh_.begin(), dh_.begin() + T * s.hidden, 0.0f);
  rms_backward_add(norm, inv_rms, dnorm_.data(), dh_.data(), T, s.hidden);

  for (std::size_t l = s.blocks; l-- > 0;) {
    const std::size_t up = 2 + 2 * l;
    checkpointing_.store->load(l, h);
    rms_forward(h, norm, inv_rms, T, s.hidden);
    {
      const float* w_up = params.acquire(up);
      linear_forward(norm, w_up, w_up + s.hidden * s.ffn, act, T, s.hidden, s.ffn);
      params.release(up);
    }
    for (std::size_t i = 0; i < T * s.ffn; ++i) act[i] = std::max(act[i], 0.0f);
    block_backward(l, norm, inv_rms, act, params);
  }

  const std::size_t x_width = s.context_bytes * s.embed_dim;
  embed(contexts_.data(), T, params, act);  // x0 again
  linear_backward(1, act, dh_.data(), dx0_.data(), T, x_width, s.hidden, params);
  embed_backward(dx0_.data(), T, params);
}

void Model::linear_backward(std::size_t index, const float* x, const float* dy, float* dx,
                            std::size_t rows, std::size_t in, std::size_t out,
                            ParamAccess& params) {
  float* grad = params.gradient_buffer(index);
  linear_backward_weight(x, dy, grad, grad + in * out, rows, in, out);
  params.gradient_ready(index);
  const float* w = params.acquire(index);
  linear_backward_input(dy, w, dx, rows, in, out);
  params.release(index);
}

void Model::block_backward(std::size_t l, const float* norm, const float* inv_rms, const float* act,
                           ParamAccess& params) {
  const ModelShape& s = shape_;
  const std::size_t T = token_count_;
  const std::size_t up = 2 + 2 * l, down = 3 + 2 * l;
  // dh_ is the gradient of h_l+1, which is also the gradient of the block's output.
  linear_backward(down, act, dh_.data(), dact_.data(), T, s.ffn, s.hidden, params);
  for (std::size_t i = 0; i < T * s.ffn; ++i) {
    if (act[i] <= 0.0f) dact_[i] = 0.0f;
  }
  linear_backward(up, norm, dact_.data(), dnorm_.data(), T, s.hidden, s.ffn, params);
  // dh_ keeps the skip path's gradient; the norm's path adds to it.
  rms_backward_add(norm, inv_rms, dnorm_.data(), dh_.data(), T, s.hidden);
}

}  // namespace train_lm
