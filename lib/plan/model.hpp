// Model shapes for the planner: a decoder-only transformer described by its layer shapes, the
// parameter count those shapes give, and presets taken from published configs.
//
// Parameter count of a decoder-only transformer, V = vocab, h = hidden, I = intermediate (MLP)
// width, L = layers, a = attention heads, k = key/value heads, d = h / a (head width),
// T = learned positions (0 for rotary):
//
//   embeddings   V·h  (+ T·h learned positions)
//   per layer    attention: q h·h, k and v h·(k·d) each, out h·h   (+ biases when `biases`)
//                MLP: 2·h·I (up, down), 3·h·I when gated (SwiGLU: gate, up, down)
//                norms: 2·h (RMSNorm) or 4·h (LayerNorm: weight and bias)
//   final norm   h or 2·h
//   output head  V·h unless tied to the embeddings
//
// GPT-2 (LayerNorm, biases, 4h GeLU MLP, learned positions, tied head) and Llama / Mistral
// (RMSNorm, no biases, SwiGLU, rotary, untied head) both fit this description.
// Thread-safety: values and pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "zinf/status.hpp"

namespace zinf::plan {

// What kind of network the shape describes; their activations differ (estimate.hpp).
enum class ModelKind : std::uint8_t {
  kTransformer = 0,  // the decoder-only transformer above
  // examples/train_lm's byte model: an embedding of the `context_bytes` bytes before each target
  // (embed_dim floats each, concatenated), an input projection to `hidden`, `layers` residual
  // blocks h + W2·relu(W1·rmsnorm(h) + b1) + b2 of width `intermediate` (4h), an output
  // projection to the 256 byte values, biases on every projection. It computes in fp32 (fp32
  // activations); the engine's device copy of its parameters is bf16 by default (train_lm's
  // --param-dtype bf16, which the estimate's half params count), cast to fp32 once gathered.
  kTrainLm = 1,
};

struct ModelShape {
  ModelKind kind = ModelKind::kTransformer;
  std::uint64_t context_bytes = 0;  // kTrainLm: bytes of context each target sees
  std::uint64_t embed_dim = 0;      // kTrainLm: embedding width of one byte
  std::string name;                 // preset name, or "custom"
  std::uint64_t vocab = 0;          // V
  std::uint64_t hidden = 0;         // h
  std::uint64_t intermediate = 0;   // I: MLP width
  std::uint64_t layers = 0;         // L
  std::uint64_t heads = 0;          // a
  std::uint64_t kv_heads = 0;       // k (== heads without grouped-query attention)
  std::uint64_t positions = 0;      // T: learned position embeddings (0 for rotary)
  bool gated_mlp = false;           // SwiGLU: three MLP matrices instead of two
  bool biases = false;              // linear layers carry biases
  bool layer_norm = false;          // LayerNorm (weight + bias) rather than RMSNorm (weight)
  bool tied_embeddings = false;     // output head shares the embedding matrix
  // When nonzero, the model is given by its count alone (`zinf plan --params`): the shape
  // fields above only serve the activation and working-set estimates.
  std::uint64_t param_count_override = 0;
  // The count its publisher lists for the released checkpoint; 0 for custom shapes.
  std::uint64_t published_param_count = 0;
  std::string source;  // where the shape and the published count come from
  // Fine-tuning with frozen parameters (docs/ENGINE.md, "Frozen parameters"; zinf plan
  // --trainable, --lora-rank). adapter_params: LoRA adapters added to the model, counted in
  // param_count() and trainable. trainable_params: how many of param_count() take gradients and
  // optimizer steps; 0 means every one (the default: nothing frozen).
  std::uint64_t adapter_params = 0;
  std::uint64_t trainable_params = 0;
  // Runs of trainable parameters in the model's registration order, which the engine's
  // optimizer pass cuts its sub-groups at (docs/ENGINE.md, "Frozen parameters"): LoRA's adapters
  // follow each adapted projection (PEFT's module order), one run a projection, layers x targets.
  // 0: unknown (--trainable), taken as one.
  std::uint64_t trainable_runs = 0;
  // The adapters' rank (apply_lora); 0 without LoRA. Each adapter is a tensor of r x in and one
  // of out x r, which the estimate's sub-group cuts look at (estimate.hpp).
  std::uint64_t lora_rank = 0;
  // The frozen parameters' values are exact in the run's half dtype (widening the rounded value
  // gives it back bit for bit): a bf16 checkpoint's with bf16, an fp16 one's with fp16 (zinf plan
  // --frozen-exact). A bf16 checkpoint is not exact in fp16 (values below 2^-17 or above 65504
  // round), so the engine keeps their masters there. The engine then keeps no fp32 master of
  // them with the optimizer state in host memory or on the GPU (estimate.hpp, "Frozen parameters
  // and the state in host memory" and "... in device memory"). false: not known, so counted as
  // any value's (an upper bound).
  bool frozen_exact_in_half = false;
};

// Parameter count from the layer shapes (see the formula above), or param_count_override; plus
// adapter_params.
std::uint64_t param_count(const ModelShape& model);

// The parameters that train (trainable_params, or every one when it is 0) and those frozen (the
// rest).
std::uint64_t trainable_param_count(const ModelShape& model);
std::uint64_t frozen_param_count(const ModelShape& model);

// `zinf plan --trainable TEXT` for a model of `model_params` parameters: a count as --params
// takes it ("40M", "1.2B", "350k", "123456"; k = 1e3, M = 1e6, B or G = 1e9, T = 1e12: a count
// of base/size_text.hpp's parse_scaled()) or a share of the model ("0.5%", or a plain fraction
// below 1 such as "0.005"), rounded to the nearest parameter. Fails with
// invalid_argument, the message naming --trainable, when the text is not such a number, is
// negative, gives 0 parameters (the engine refuses a model whose every parameter is frozen) or
// more than `model_params` (a number past a double's range included).
Result<std::uint64_t> parse_trainable(std::string_view text, std::uint64_t model_params);

// `zinf plan --lora-rank TEXT`: a whole number of at least 1. Fails with invalid_argument, the
// message naming --lora-rank, for a negative number, one past 64 bits, 0 or not a number.
Result<std::uint64_t> parse_lora_rank(std::string_view text);

// Adds to *model LoRA adapters of rank r (Hu et al. 2021, "LoRA: Low-Rank Adaptation of
// Large Language Models") on the projections named in `targets`, a comma-separated list of q, k,
// v, o (attention: query, key, value, output) and gate, up, down (MLP; gate only in a gated
// MLP), in every layer. An adapter of a W of `in` inputs and `out` outputs is A (r x in) and B
// (out x r): r·(in + out) parameters. With d = h / a the head width and k·d the key/value width:
//   q, o      r·2h            k, v      r·(h + k·d)
//   gate, up  r·(h + I)       down      r·(I + h)
// PEFT's default target_modules for Llama are q_proj and v_proj ("q,v"). GPT-2 fuses the query,
// key and value into one c_attn (h inputs, 3h outputs; PEFT's default target for GPT-2), whose
// adapter is r·(h + 3h) = 4rh a layer: the count "q,v" gives here ("q,k,v" counts three separate
// adapters, 6rh). Fails with invalid_argument (naming --lora-rank or --lora-targets) for rank 0,
// a rank above the smallest min(in, out) of the adapted projections (no adapter has a higher
// rank), an unknown or repeated target, gate without a gated MLP, a count past 64 bits, or a
// model that is not a transformer (ModelKind::kTrainLm), leaving *model as it was. On success
// the adapters train alone: adapter_params and trainable_params are their count, lora_rank is
// `rank`, and trainable_runs is layers x targets (one run an adapted projection).
// REQUIRES: model has no adapters and nothing frozen yet (adapter_params and trainable_params 0).
Status apply_lora(ModelShape* model, std::uint64_t rank, std::string_view targets);

// A parameter count as people write it, three significant figures or so: "950", "60.0k",
// "1.20M", "6.74B" (1k = 1e3, 1M = 1e6, 1B = 1e9).
std::string format_param_count(std::uint64_t params);

// Parameters of the largest single tensor (embedding V·h or one MLP matrix h·I): stage 3 must
// gather at least this much at once.
std::uint64_t largest_tensor_params(const ModelShape& model);

// Parameters of one transformer layer (attention + MLP + its norms); for a model given by count
// alone, (count − 2·V·h) / L.
std::uint64_t layer_params(const ModelShape& model);

// Parameters in norms and biases: tensors small enough to stay gathered in stage 3 (below
// stage3_param_persistence_threshold when that is at least h).
std::uint64_t small_tensor_params(const ModelShape& model);

// The presets: GPT-2 124M/355M/774M/1.5B, Llama-2 7B/13B/70B, Llama-3 8B/70B, Mistral 7B.
std::span<const ModelShape> model_presets();
// Looks `name` up among the presets (case-insensitive; "llama2-7b" and "llama-2-7b" both work).
std::optional<ModelShape> find_model_preset(std::string_view name);

// examples/train_lm's model (ModelKind::kTrainLm) of `layers` blocks of `hidden` (ffn 4h), its
// input the embeddings of `context_bytes` bytes of `embed_dim` floats (train_lm's --context,
// --embed); vocab 256. Its parameter count is train_lm's: 256·E + (C·E·h + h) + L·(8h² + 5h) +
// (256·h + 256).
ModelShape train_lm_model(std::uint64_t layers, std::uint64_t hidden, std::uint64_t context_bytes,
                          std::uint64_t embed_dim);

// A model known only by parameter count, layers and hidden size (heads = hidden / 128, MLP 4h,
// vocab 32000): enough for activation and working-set estimates.
ModelShape custom_model(std::uint64_t params, std::uint64_t layers, std::uint64_t hidden);

}  // namespace zinf::plan
