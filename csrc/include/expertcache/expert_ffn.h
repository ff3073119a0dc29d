// One MoE layer's experts on the CPU, straight from their stored encoding: for each expert, its
// rows' first projection (gate_up or up), the activation, the down projection and the routing
// weight, fused, with no decoded copy of any weight. Used by compute for decode steps (a few rows
// per expert), where the experts' bytes, not arithmetic, bound the time.
//
//   x      float32 [T, H]     the layer's input rows (values of the compute dtype, exact in float32)
//   expert e (weights at arena + slot_e * slot_bytes): its rows r = pair rows rows[b_e .. b_(e+1))
//          of token tokens[r], routing weight weights[r]
//   out    float32 [T * K, H] pair rows, out[r] = weight[r] * down(act(first(x[token r])))
//
// A projection reads its matrix M [R, C] (row-major, as stored) in one of two ways:
//   dot    out[i] = sum_c M[i, c] * in[c]  (R outputs): plain [out, in] weights (transformers'
//          is_transposed=False), every MXFP4 tensor (its blocks' rows are output features) and
//          block-FP8 [out, in] (DeepSeek-V3, Qwen3 FP8)
//   axpy   out[j] = sum_r in[r] * M[r, j]  (C outputs): plain or block-FP8 weights [in, out]
//          (transformers' is_transposed=True: GPT-OSS); the scale blocks are of M [in, out]
// Weights: plain bfloat16 / float16 / float32, MXFP4 (E2M1 codes by look-up, one E8M0 scale per 32),
// block FP8 e4m3 (decoded and multiplied by its block's scale_inv, rounded to the compute dtype
// as transformers' dequantisation does).
//
// Numerics: products and sums in float32 (the order differs from a BLAS GEMM, so the last bits
// of a sum may too). Every other rounding of transformers' forward in the compute dtype is
// repeated: each projection's output, its bias add, each op of the activation, the weighted
// output when the routing weights have the compute dtype. Activations:
//   kGluHalves   gate, up = h.chunk(2): act(gate) * up        (Mixtral, Qwen-MoE, OLMoE, DeepSeek)
//   kGptOss      gate, up = h[::2], h[1::2]; gate = min(gate, limit); up = clamp(up, ±limit);
//                (up + 1) * (gate * sigmoid(gate * alpha))    (GPT-OSS)
//   kPlain       act(h)                                        (experts without a gate)
// with act one of silu, gelu (erf), gelu_tanh, relu.
//
// Threads: the work of a call is split over `threads` (ExpertFfn::set_threads) by output rows,
// the caller's thread included; a call allocates nothing once its scratch has grown to the
// largest call seen.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <vector>

namespace expertcache {

enum class FfnDtype { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum class FfnEncoding { kPlain = 0, kMxfp4 = 1, kFp8 = 2 };
enum class FfnForm { kDot = 0, kAxpy = 1 };
enum class FfnGate { kGluHalves = 0, kGptOss = 1, kPlain = 2 };
enum class FfnAct { kSilu = 0, kGelu = 1, kGeluTanh = 2, kRelu = 3 };

// One projection of an expert, at fixed offsets inside every slot.
struct FfnProjection {
  FfnEncoding encoding = FfnEncoding::kPlain;
  FfnForm form = FfnForm::kDot;
  FfnDtype weight_dtype = FfnDtype::kBFloat16;  // plain weights only
  size_t inputs = 0, outputs = 0;               // the projection maps inputs -> outputs
  size_t weight_offset = 0;                     // plain values, MXFP4 blocks, FP8 values
  size_t scale_offset = 0;                      // MXFP4 scales, FP8 scale_inv
  size_t block_rows = 0, block_cols = 0;        // FP8 blocks (of M [R, C])
  int64_t bias_offset = -1;                     // [outputs] of bias_dtype, or -1
  FfnDtype bias_dtype = FfnDtype::kBFloat16;
  // Bytes of the slot this projection reads, from offset 0: checked against the slot size.
  size_t extent() const;
};

// The SIMD path of an ExpertFfn. kAvx512 runs AVX-512 kernels where it has them (MXFP4 and FP8 dot
// rows) and the AVX2 ones elsewhere. kAmx is kAvx512 but for MXFP4 projections in a bfloat16 compute
// dtype, which it multiplies 16 weight rows at a time by AMX tiles (tdpbf16ps), but where an input
// or a scaled weight is subnormal (which AMX reads as zero): the AVX-512 kernel's then. kAvx512Bf16
// is kAvx512 but for MXFP4 projections in a bfloat16 compute dtype, which it multiplies with the
// inputs as bfloat16 words by vdpbf16ps (AVX-512 BF16), at every row count, with the same fallback
// as kAmx, plain bfloat16 dot rows by vdpbf16ps too (one weight row at a time), and bfloat16 axpy
// projections 16 weight rows a block, or row by row where a row is at most 1 KiB and the input rows
// one or two (the tuning of a CPU without AMX, AMD Zen 4). kAuto is the fastest this CPU runs (ffn_paths()[0]).
enum class FfnPath { kAuto, kPortable, kAvx2, kAvx512, kAmx, kAvx512Bf16 };

struct FfnSpec {
  FfnProjection first;  // gate_up (2I outputs) or up (I outputs)
  FfnProjection down;   // I -> H
  FfnGate gate = FfnGate::kGluHalves;
  FfnAct act = FfnAct::kSilu;
  float alpha = 1.702f, limit = 7.0f;  // kGptOss
  FfnDtype compute = FfnDtype::kBFloat16;
  bool round_weighted = false;  // the routing weights have the compute dtype: round the product
  size_t slot_bytes = 0;
  FfnPath path = FfnPath::kAuto;  // one this CPU runs (ffn_paths()), else std::invalid_argument
};

// The paths this CPU runs, fastest first; their names ("amx", "avx512", "avx2", "portable"). "amx" needs
// the CPU's AMX-TILE and AMX-BF16 and the kernel's leave to use the tile data (Linux, asked once).
std::vector<FfnPath> ffn_paths();
const char* ffn_path_name(FfnPath path);

struct FfnPool;

// Arrays on cache lines: a kernel's 64-byte loads of an input row (whose length is a multiple of 16
// floats wherever a vector kernel reads it) then never straddle two lines.
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};

class ExpertFfn {
 public:
  // std::invalid_argument naming what is inconsistent (sizes, a form an encoding cannot take, a
  // projection past the slot).
  explicit ExpertFfn(const FfnSpec& spec);
  ~ExpertFfn();
  ExpertFfn(const ExpertFfn&) = delete;
  ExpertFfn& operator=(const ExpertFfn&) = delete;

  const FfnSpec& spec() const { return spec_; }
  size_t hidden() const { return spec_.down.outputs; }
  size_t intermediate() const { return spec_.down.inputs; }
  // The SIMD path in use: "amx", "avx512", "avx2" or "portable".
  const char* path() const;
  void set_threads(int threads);
  int threads() const { return threads_; }
  // The MXFP4 projections of the expert in `slot` (slot_bytes from it) decoded into bfloat16 words as
  // the avx512 and amx paths' kernels decode them, and nothing computed: their xor. What a kernel that
  // multiplies nothing costs (bench.kernels); std::invalid_argument on another path or without MXFP4.
  uint64_t decode_only(const uint8_t* slot) const;
  // Work items (a projection's 16 output rows for one expert's rows) the AMX kernel has run.
  uint64_t amx_items() const { return amx_items_.load(std::memory_order_relaxed); }

  // The layer's experts (see the header comment). `slots`, `bounds` [n + 1] (bounds[0] = 0),
  // `rows`, `tokens`, `weights` [bounds[n]]. The caller checks every index (the binding does).
  void run(const uint8_t* arena, const int64_t* slots, size_t n, const int64_t* bounds, const int64_t* rows,
           const int64_t* tokens, const float* weights, const float* x, float* out);

 private:
  struct Task;
  void first_items(const Task& t, size_t begin, size_t end);
  void down_items(const Task& t, size_t begin, size_t end);

  FfnSpec spec_;
  FfnPath path_ = FfnPath::kPortable;  // never kAuto
  // Per input of an MXFP4 projection, its place in the order path_'s kernel reads (empty where the
  // inputs are read as they are): derived once from path_ and the projection's inputs.
  std::vector<uint32_t> first_order_, down_order_;
  // kAmx, per input of an MXFP4 projection in bfloat16, its word's index in a block of the AMX
  // kernel's inputs, for the block's first row (kAvx512Bf16, MXFP4 and plain bfloat16 dot rows in
  // bfloat16: in its row of the vdpbf16ps kernel's inputs; empty: the projection runs on neither); per
  // expert row, its block of 16 input rows in the AMX inputs (AmxRow), an expert's blocks padded
  // to 16 rows.
  std::vector<uint32_t> first_words_, down_words_;
  struct AmxRow {
    uint32_t first, n;  // the block's first row in the AMX inputs, this row's place in it
  };
  std::vector<AmxRow> amx_rows_;
  int threads_ = 1;
  std::atomic<uint64_t> amx_items_{0};
  std::unique_ptr<FfnPool> pool_;
  // Scratch, grown to the largest call: per expert row, the inputs (in the first projection's
  // order), the first projection's outputs, the activations (and in natural order, nat_, when the
  // down kernel reads them permuted).
  std::vector<float, CacheLineAllocator<float>> xin_, h1_, act_, nat_;
  // The AMX or vdpbf16ps kernel's inputs as bfloat16 words, first and down projection.
  std::vector<uint16_t, CacheLineAllocator<uint16_t>> xv_, av_;
};

// Shared with the dense part of a decode step (decode_attention.h):
// the value `v` takes in `dtype` (torch's round to nearest even), as a float;
float ffn_round(float v, FfnDtype dtype);
// value i of an array of `dtype` at `p`, as a float;
float ffn_load(const uint8_t* p, FfnDtype dtype, size_t i);
// out[r * outputs + i] = sum_c W[i, c] * x[r * inputs + c] for i < outputs, r < rows: plain W
// [outputs, inputs] of `wdtype`, float32 products and sums (the FFN's dot kernel; `avx2` where
// ffn_cpu_has_avx2()).
void ffn_plain_dot(const uint8_t* w, FfnDtype wdtype, size_t inputs, size_t outputs, const float* x, size_t rows,
                   float* out, bool avx2);
bool ffn_cpu_has_avx2();
// The same for plain bfloat16 W by vdpbf16ps (the avx512-bf16 path's dot rows: one weight row at a
// time, float32 sums in their order), where this CPU has AVX-512 BF16 and every x is a bfloat16
// value that is not subnormal: x as words in `words` (grown to rows * inputs). False, nothing
// written, otherwise: the caller runs ffn_plain_dot.
bool ffn_plain_dot_bf16(const uint8_t* w, size_t inputs, size_t outputs, const float* x, size_t rows, float* out,
                        std::vector<uint16_t>& words);
bool ffn_cpu_has_avx512_bf16();

}  // namespace expertcache
