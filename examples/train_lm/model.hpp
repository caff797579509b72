// A byte-level language model small enough to train on two CPU cores in a few minutes and large
// enough (--params 1B) to put pressure on every tier of zinf.
//
// It predicts byte t from the `context_bytes` bytes before it:
//
//   x    = concat(embed[b(t-k)], ..., embed[b(t-1)])             k * embed_dim
//   h0   = x W_in + b_in                                          hidden
//   h_l+1 = h_l + relu(rms(h_l) W_up_l + b_up_l) W_down_l + b_down_l   for l < blocks
//   logits = rms(h_L) W_out + b_out                               256
//   loss = mean over tokens of -log softmax(logits)[b(t)]        (nats per byte)
//
// where rms(v) = v / sqrt(mean(v^2) + 1e-5) (RMSNorm without a gain). The residual blocks with a
// norm in front of each keep the gradient well scaled whatever the depth.
//
// Parameters are grouped in modules, each a contiguous run of floats (weight [in][out] row-major,
// then bias): embed, in_proj, block0.up, block0.down, ..., out. The model owns its activations
// only: it reads each module's parameters through a ParamAccess when it needs them and hands each
// module's gradient back through it, so a caller (a plain fp32 loop, or zinf's ZeRO-3 engine that
// gathers each module's shards on demand) decides where parameters and gradients live.
//
// Thread-safety: a Model is used by one thread at a time; its matrix products run on oneTBB.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace train_lm {

struct ModelShape {
  std::size_t context_bytes = 16;
  std::size_t embed_dim = 16;
  std::size_t hidden = 128;
  std::size_t ffn = 512;  // width inside each block
  std::size_t blocks = 4;
};

// Chooses `hidden` (a multiple of 16, at least 16) so that the parameter count is as close as it
// can be to `param_count`, with ffn = 4 * hidden and the other fields as given in `base`.
ModelShape shape_for_params(std::uint64_t param_count, const ModelShape& base);

struct ModuleSpec {
  std::string name;      // "embed", "in_proj", "block0.up", ... "out"
  std::size_t in = 0;    // weight rows (the embedding's: 256)
  std::size_t out = 0;   // weight columns
  bool has_bias = true;  // the embedding has none
  std::size_t param_count() const { return in * out + (has_bias ? out : 0); }
};

// The modules in forward order.
std::vector<ModuleSpec> module_specs(const ModelShape& shape);
std::uint64_t param_count(const ModelShape& shape);

// Fills `params` (one module's floats, laid out as ModuleSpec says) with its initial values:
// embeddings N(0, 1), weights U(-a, a) with a = 1/sqrt(in) (the output projection's 10 times
// smaller, so the first loss is close to ln 256 = 5.55), biases 0. Depends only on `seed` and the
// module's index, so any partitioning of the model gets the same start.
void init_module(const ModelShape& shape, std::size_t module_index, std::uint64_t seed,
                 float* params);

// How the model reaches its parameters and where its gradients go.
class ParamAccess {
 public:
  virtual ~ParamAccess() = default;
  // The module's parameters in fp32, valid until release(module_index).
  virtual const float* acquire(std::size_t module_index) = 0;
  virtual void release(std::size_t module_index) = 0;
  // Where backward() writes the module's gradient (overwriting it), and the call that says it is
  // complete. Modules arrive in reverse forward order. The model never holds a gradient buffer
  // and acquired parameters at the same time, so one scratch buffer may serve both.
  virtual float* gradient_buffer(std::size_t module_index) = 0;
  virtual void gradient_ready(std::size_t module_index) = 0;
};

// Where a checkpointing model keeps each block's input between the forward and the backward pass
// (through zinf's Engine::save_activation, or in memory of its own).
class CheckpointStore {
 public:
  virtual ~CheckpointStore() = default;
  // Keeps floats [data, data + count) under `block`. The memory at `data` must keep its values
  // until the next save() or load() returns (so the model alternates two buffers).
  virtual void save(std::size_t block, const float* data, std::size_t count) = 0;
  // Writes what save(block, ...) kept into `data` and forgets it.
  virtual void load(std::size_t block, float* data) = 0;
  // Returns once the last save() no longer reads its memory.
  virtual void flush() = 0;
};

// Activation checkpointing (--checkpoint-activations): the forward pass keeps only each block's
// input (the residual stream h_l, through `store`) and the backward pass recomputes the block's
// norm and ffn activations from it; the embedding output is recomputed from the bytes. The
// gradients are the same bits as without checkpointing: the same products run on the same values.
struct Checkpointing {
  CheckpointStore* store = nullptr;  // null: no checkpointing, every activation kept
  // The two residual-stream buffers (max_tokens x hidden floats each) the model computes in and
  // saves from; null: vectors of the model's own.
  float* stream_buffers[2] = {nullptr, nullptr};
};

class Model {
 public:
  // Activations are sized for up to `max_tokens` tokens a forward pass.
  Model(const ModelShape& shape, std::size_t max_tokens, const Checkpointing& checkpointing = {});

  // Bytes of the forward pass's activations the model holds (fixed at construction; its
  // backward pass's gradient buffers, the same with or without checkpointing, not counted).
  std::uint64_t activation_bytes() const;

  const ModelShape& shape() const { return shape_; }
  const std::vector<ModuleSpec>& modules() const { return modules_; }

  // contexts: token_count rows of context_bytes bytes; targets: token_count bytes.
  // Returns the sum (not the mean) over tokens of the cross-entropy in nats. With
  // `for_backward` false (validation) a checkpointing model saves nothing.
  // REQUIRES: token_count <= max_tokens.
  double forward(const std::uint8_t* contexts, const std::uint8_t* targets, std::size_t token_count,
                 ParamAccess& params, bool for_backward = true);

  // Gradient of loss_scale * (the sum forward() returned) with respect to every parameter.
  // REQUIRES: forward() was the last call, with the same ParamAccess contents.
  void backward(float loss_scale, ParamAccess& params);

 private:
  double forward_checkpointed(const std::uint8_t* contexts, const std::uint8_t* targets,
                              std::size_t token_count, ParamAccess& params, bool for_backward);
  void backward_checkpointed(float loss_scale, ParamAccess& params);
  // The gradients of module `index`, a linear layer y = x W + b of `in` x `out` (x: rows x in),
  // from dy: dW and db handed to the engine, then dx = dy W^T into `dx`.
  void linear_backward(std::size_t index, const float* x, const float* dy, float* dx,
                       std::size_t rows, std::size_t in, std::size_t out, ParamAccess& params);
  // Block l's backward from its norm output, 1/rms and relu activation (kept by the forward
  // pass, or recomputed): dh_ holds the gradient of the block's output and gets its input's.
  void block_backward(std::size_t l, const float* norm, const float* inv_rms, const float* act,
                      ParamAccess& params);
  void embed(const std::uint8_t* contexts, std::size_t token_count, ParamAccess& params, float* x0);
  // Softmax of the logits in probs, in place; the summed cross-entropy against `targets`.
  double softmax_loss(const std::uint8_t* targets, std::size_t token_count, float* probs);
  void embed_backward(const float* dx0, std::size_t token_count, ParamAccess& params);

  ModelShape shape_;
  Checkpointing checkpointing_;
  float* stream_[2] = {nullptr, nullptr};  // checkpointing: the residual stream's two buffers
  std::vector<float> own_stream_;
  float* head_norm_ = nullptr;  // checkpointing: which stream buffer holds the head's norm
  std::vector<ModuleSpec> modules_;
  std::size_t max_tokens_;
  std::size_t token_count_ = 0;
  std::vector<std::uint8_t> contexts_, targets_;
  std::vector<float> x0_;                    // tokens x (context_bytes * embed_dim)
  std::vector<std::vector<float>> h_;        // blocks + 1 residual streams, tokens x hidden
  std::vector<std::vector<float>> norm_;     // blocks + 1 normalised streams
  std::vector<std::vector<float>> inv_rms_;  // blocks + 1, one per token
  std::vector<std::vector<float>> act_;      // blocks, tokens x ffn, after relu
  std::vector<float> probs_;                 // tokens x 256
  std::vector<float> dh_, dnorm_, dact_, dx0_;
};

}  // namespace train_lm
