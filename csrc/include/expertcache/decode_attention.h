// The dense half of a decoder layer for a decode step on the CPU, in one call: for R rows (one
// new token each, of R requests),
//
//   x       = input_norm(h)                       RMSNorm
//   q, k, v = x Wq^T + bq, x Wk^T + bk, x Wv^T + bv   (optional per-head RMSNorm of q and k)
//   q, k    = rotary(q, k) at each row's position  half-split rotation, cos/sin given [R, d/2]
//   cache   : k, v written at index length[r] of row r's cache of this layer
//   a       = attention of q over row r's keys/values 0 .. length[r] (within the sliding window)
//   h       = h + (a Wo^T + bo)                   the residual, in place
//   mlp_in  = post_norm(h)
//   logits  = mlp_in Wr^T + br                    the router's logits, where the spec asks for them
//   ids, scores = topk(logits, k), softmax(top)   its top k, where the spec asks for them too
//
// which is the part of every decoder layer of GPT-OSS, Mixtral, Qwen2-MoE and Qwen3-MoE before its
// MLP; the MLP (router, experts, shared experts) stays the model's own module. Values are the
// compute dtype's (bf16, fp16 or fp32 bits in memory); each op's output is rounded to it as
// transformers' eager ops round, products and sums in float32 (their order differs from a BLAS
// GEMM, so the last bits of a sum may too). Attention follows the model's implementation:
//   kEager  transformers' eager attention (GPT-OSS): scores rounded, scaled, the sink appended,
//           the max subtracted, softmax, probabilities rounded, then weighted values;
//   kFused  scaled_dot_product_attention on the CPU: scores, softmax and the weighted sum in
//           float32, the exponentials rounded to the compute dtype for the value product.
// RMSNorm: kCastThenWeight (Llama's: w * dtype(x / rms)) or kWeightThenCast (GPT-OSS: dtype(w * x / rms)).
//
// A row's cache of a layer is the model's own tensor [kv_heads, capacity, head_dim] of the compute
// dtype (compute_svc.engine.kv_cache.SequenceKV's buffers). Single-threaded; allocates only when a call
// is larger than every earlier one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "expertcache/expert_ffn.h"

namespace expertcache {

enum class AttnNorm { kCastThenWeight = 0, kWeightThenCast = 1 };
enum class AttnSoftmax { kEager = 0, kFused = 1 };

struct AttentionSpec {
  size_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0;
  FfnDtype dtype = FfnDtype::kBFloat16;
  float eps = 1e-6f;
  float scaling = 1.0f;
  AttnNorm norm = AttnNorm::kCastThenWeight;
  AttnSoftmax softmax = AttnSoftmax::kFused;
  size_t router_outputs = 0;  // the router's experts (0: the caller routes)
  // The router's top k and their softmax after the logits (0: the caller takes them). Only for a
  // 2-byte dtype and k < 8 (router_top_k_supported): there torch's CPU softmax is scalar code
  // (std::exp, a sum in order, x * (1 / sum), rounded), which is what `run` computes.
  size_t router_top_k = 0;
};

// Whether DecodeAttention computes the router's top k for `dtype` as torch does (see router_top_k).
bool router_top_k_supported(FfnDtype dtype, size_t k);

// One layer's tensors (of the compute dtype), nullptr where the model has none.
struct AttentionWeights {
  const uint8_t* input_norm = nullptr;  // [hidden]
  const uint8_t* post_norm = nullptr;   // [hidden]
  const uint8_t *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;  // [out, in]
  const uint8_t *q_bias = nullptr, *k_bias = nullptr, *v_bias = nullptr, *o_bias = nullptr;
  const uint8_t *q_norm = nullptr, *k_norm = nullptr;  // [head_dim], per head
  const uint8_t* sinks = nullptr;                       // [heads] (kEager only)
  const uint8_t *router = nullptr, *router_bias = nullptr;  // [router_outputs, hidden], [router_outputs]
  size_t window = 0;                                    // keys within the last `window` (0: all)
};

// The model's head after the last layer: logits = h RMSNorm(norm, eps) W^T (+ bias), W [vocab, hidden].
struct HeadWeights {
  const uint8_t* norm = nullptr;    // [hidden]
  float eps = 1e-6f;
  const uint8_t* weight = nullptr;  // [vocab, hidden]
  const uint8_t* bias = nullptr;    // [vocab] or nullptr
  size_t vocab = 0;
};

class DecodeAttention {
 public:
  // std::invalid_argument naming what is inconsistent.
  explicit DecodeAttention(const AttentionSpec& spec);

  const AttentionSpec& spec() const { return spec_; }
  size_t layers() const { return layers_.size(); }
  // The projections' kernel: "avx512-bf16" (vdpbf16ps rows: a bfloat16 dtype on a CPU with AVX-512
  // BF16; a call whose inputs hold a subnormal number runs "avx2"), "avx2" or "portable".
  const char* path() const { return dp_ ? "avx512-bf16" : avx2_ ? "avx2" : "portable"; }
  void add_layer(const AttentionWeights& w);
  void set_head(const HeadWeights& w);
  bool has_head() const { return head_.weight != nullptr; }
  size_t vocab() const { return head_.vocab; }

  // Rows r < rows: h and mlp_in [rows, hidden], cos/sin [rows, head_dim / 2]; keys[r], values[r]
  // the layer's cache of row r, capacity[r] > length[r] positions; logits [rows, router_outputs]
  // (nullptr without a router); with router_top_k, top_ids [rows, k] and top_scores [rows, k] of
  // the dtype: torch.topk(logits, k) (its indices) and torch.softmax of its values. The caller
  // checks every size.
  void run(size_t layer, size_t rows, uint8_t* h, uint8_t* mlp_in, const uint8_t* cos, const uint8_t* sin,
           uint8_t* const* keys, uint8_t* const* values, const int64_t* capacity, const int64_t* length,
           uint8_t* logits, int64_t* top_ids = nullptr, uint8_t* top_scores = nullptr);

  // Layer-ahead: the router of `layer` on `rows` rows of x [rows, hidden] (the dtype's values; a
  // step's mlp_in, another layer's MoE input): its top k, ids [rows, k] and scores [rows, k] of the
  // dtype, computed as `run` computes a layer's own (the logits rounded, topk, softmax). Needs
  // the layer's router and router_top_k (std::invalid_argument otherwise).
  void route_with(size_t layer, size_t rows, const uint8_t* x, int64_t* ids, uint8_t* scores);

  // After the last layer: out [rows, vocab] (the dtype's storage) = the head (set_head) of h [rows,
  // hidden], the norm rounded as the layers' norms round and each logit once (as addmm rounds).
  void head(size_t rows, const uint8_t* h, uint8_t* out);

 private:
  void norm(const uint8_t* weight, const float* x, size_t n, float* out) const { norm(weight, x, n, out, spec_.eps); }
  void norm(const uint8_t* weight, const float* x, size_t n, float* out, float eps) const;
  void linear(const uint8_t* w, const uint8_t* bias, const float* x, size_t rows, size_t in, size_t out,
              float* y);
  void attend(const AttentionWeights& w, const float* q, const uint8_t* keys, const uint8_t* values,
              size_t capacity, size_t length, float* out);
  void route(const float* logits, size_t rows, int64_t* ids, uint8_t* scores);

  AttentionSpec spec_;
  bool avx2_ = false;
  bool dp_ = false;             // the projections by ffn_plain_dot_bf16 where their inputs allow
  std::vector<uint16_t> words_;  // their inputs as bfloat16 words (grown to the largest call)
  std::vector<AttentionWeights> layers_;
  HeadWeights head_;
  // Scratch, grown to the largest call: the normed rows, q, k, v, the attention output, one
  // projection's sums, one head's scores.
  std::vector<float> x_, q_, k_, v_, a_, y_, s_;
  std::vector<std::pair<float, int64_t>> queue_;
  std::vector<float> ahead_x_, ahead_logits_;  // route_with's rows as floats, and their logits  // one row's (logit, expert), for the top k
};

}  // namespace expertcache
