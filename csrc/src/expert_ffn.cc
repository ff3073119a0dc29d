// One MoE layer's experts, fused, from their stored encoding (csrc/include/expertcache/expert_ffn.h).
// The AVX2 + FMA + F16C and AVX-512 (F, BW, VL) paths are compiled with function-level target
// attributes and chosen at run time; the portable path is the reference they are tested against.
#include "expertcache/expert_ffn.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "expertcache/decode.h"
#include "expertcache/float_bits.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define EXPERTCACHE_FFN_X86 1
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define EXPERTCACHE_FFN_AVX2 __attribute__((target("avx2,fma,f16c")))
#define EXPERTCACHE_FFN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10)
#define EXPERTCACHE_FFN_HAS_BF16 1  // the compiler has AVX-512 BF16's intrinsics
#define EXPERTCACHE_FFN_BF16 __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#endif
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define EXPERTCACHE_FFN_HAS_AMX 1  // the compiler has AMX's intrinsics
#define EXPERTCACHE_FFN_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#endif
#endif

namespace expertcache {
namespace {

constexpr size_t kGroup = 32;       // MXFP4 values per scale
constexpr size_t kGroupBytes = 16;  // their bytes
constexpr size_t kDotChunk = 16;    // output rows per work item (dot)
constexpr size_t kAxpyChunk = 64;   // least output columns per work item (axpy)
constexpr size_t kPrefetchBytes = 1024;  // how far ahead a dot row stream is prefetched
constexpr size_t kByRowsBytes = 1024;    // bfloat16 axpy rows this short are streamed row by row (wide)
constexpr size_t kByRowsMostRows = 2;    // ... for at most this many input rows (more: blocks of rows)
// How far ahead an MXFP4 dot row against NR input rows is prefetched: a kernel for one input row
// streams its weights faster than for more, so it looks further ahead (bench.kernels, 1 thread, 3
// rounds each, 2 KiB against 1 at 1 row: median 0.146 -> 0.128 ms an expert at the e2e shape, 1.59
// -> 1.49 at gpt-oss-20b's; at 2 and 4 rows no faster).
template <int NR>
constexpr size_t kMxfp4Ahead = NR == 1 ? 2 * kPrefetchBytes : kPrefetchBytes;
// Rows per expert from which the AMX kernel is faster than the AVX-512 one (bench.kernels, MXFP4,
// 1 thread: at 4 rows about even, at 8 rows 1.7-2.2x, at 16 rows 3-5x; at 1 row 1.7-2x slower, its
// cost the same for 1 row as for 16).
constexpr size_t kAmxMinRows = 5;

constexpr float kFp4[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FFu;
  if (exp == 0) return float_of(sign) + (sign ? -1.0f : 1.0f) * std::ldexp(float(man), -24);
  if (exp == 31) return float_of(sign | 0x7F800000u | (man << 13));
  return float_of(sign | ((exp + 112) << 23) | (man << 13));
}

float bf16_to_float(uint16_t h) { return float_of(uint32_t(h) << 16); }

// The value `v` takes in `dtype` (torch's rounding), as a float.
inline float round_to(float v, FfnDtype dtype) {
  switch (dtype) {
    case FfnDtype::kBFloat16: {
      const uint32_t u = bits_of(v);
      if ((u & 0x7FFFFFFFu) > 0x7F800000u) return float_of(0xFFFF0000u);  // as float_to_bf16
      return float_of((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
    }
    case FfnDtype::kFloat16: return fp16_to_float(float_to_fp16(v));
    default: return v;
  }
}

// v as a bfloat16 word (rounded as round_to), and whether a word is a subnormal number.
inline uint16_t bf16_word(float v) { return uint16_t(bits_of(round_to(v, FfnDtype::kBFloat16)) >> 16); }
inline bool subnormal_word(uint16_t w) { return (w & 0x7F80u) == 0 && (w & 0x7Fu) != 0; }

float load_value(const uint8_t* p, FfnDtype dtype, size_t i) {
  switch (dtype) {
    case FfnDtype::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return bf16_to_float(h);
    }
    case FfnDtype::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return fp16_to_float(h);
    }
    default: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
  }
}

// Half of each E8M0 scale, 2**(s - 128), against twice each E2M1 value: every factor finite (s = 255
// included, as in expertcache.encodings), every product exact.
struct E8m0Half {
  alignas(64) float value[256];
  E8m0Half() {
    for (int s = 0; s < 256; ++s) value[s] = std::ldexp(1.0f, s - 128);
  }
};
const E8m0Half kE8m0Half;

size_t dtype_bytes(FfnDtype dtype) { return dtype == FfnDtype::kFloat32 ? 4 : 2; }

// e4m3 -> float32, exact (NaN codes: NaN).
float e4m3_value(uint8_t code) { return e4m3_to_float(code); }

float act_value(FfnAct act, float x) {
  switch (act) {
    case FfnAct::kSilu: return x / (1.0f + std::exp(-x));
    case FfnAct::kGelu: return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f));
    case FfnAct::kGeluTanh: {
      const float k = 0.7978845608028654f;  // sqrt(2 / pi)
      return 0.5f * x * (1.0f + std::tanh(k * (x + 0.044715f * x * x * x)));
    }
    case FfnAct::kRelu: return x > 0.0f ? x : (std::isnan(x) ? x : 0.0f);
  }
  return x;
}

// Where input c of an MXFP4 dot row sits in the AVX2 path's order (fp4_group decodes a group's 32
// codes into 4 vectors: v0 = positions 4m (lane 0) and 4m + 1 (lane 1), v1 = 4m + 2 and 4m + 3 for
// m < 4, v2 and v3 the same for positions 16 + ...): c itself on the portable path.
inline size_t mxfp4_position(size_t c) {
  const size_t g = c / kGroup, k = c % kGroup;
  const size_t half = k / 16, q = k % 16;
  const size_t v = 2 * half + ((q & 3) >= 2 ? 1 : 0), lane = q & 1, m = q >> 2;
  return g * kGroup + v * 8 + lane * 4 + m;
}

// Where input c of an MXFP4 dot row of C inputs sits in the AVX-512 path's order: the row's groups
// are decoded in pairs (fp4_pair_avx512: vector k holds elements 4d + k of both groups, d < 8, the
// first group's in lanes 0 .. 7), and a last group without a pair alone (fp4_one_avx512: vector k
// holds its elements 4d + k).
inline size_t mxfp4_position_avx512(size_t c, size_t C) {
  const size_t g = c / kGroup, e = c % kGroup, k = e % 4, d = e / 4;
  if (g < C / kGroup / 2 * 2) return g / 2 * 2 * kGroup + k * 16 + g % 2 * 8 + d;
  return g * kGroup + k * 8 + d;
}

// Where input c of a bfloat16 dot row of C inputs sits in the AVX-512 path's order (dot_bf16_avx512):
// per block of 32 inputs (one 64-byte load of weights), the even ones first, then the odd ones (a
// dword's low word becomes a float by a shift, its high word by a mask); the inputs past the last
// whole block stay where they are.
inline size_t bf16_position_avx512(size_t c, size_t C) {
  if (c >= C / 32 * 32) return c;
  return c / 32 * 32 + c % 2 * 16 + c % 32 / 2;
}

// Where input c of an MXFP4 dot row of C inputs sits as a bfloat16 word for the AMX kernel
// (project_mxfp4_amx): a pair of groups is decoded into two chunks of 32 words, `lo` (each byte's
// low nibble: the groups' even elements, the first group's in words 0 .. 15) and `hi` (their odd
// elements); a last group without a pair into one chunk, its even elements then its odd ones.
inline size_t mxfp4_position_bf16(size_t c, size_t C) {
  const size_t g = c / kGroup, e = c % kGroup, odd = e % 2, j = e / 2;
  if (g < C / kGroup / 2 * 2) return g / 2 * 2 * kGroup + odd * kGroup + g % 2 * 16 + j;
  return g * kGroup + odd * 16 + j;
}

// Where word w (mxfp4_position_bf16) of input row n of a block of 16 input rows sits in the AMX
// kernel's inputs: per chunk of 32 words, [16 dwords][16 rows] (a tile B of tdpbf16ps), i.e. dword
// w / 2 of every row, row by row (row n: row 0's index + 2n).
inline size_t amx_input_index(size_t w, size_t n) { return 2 * ((w / 2) * 16 + n) + w % 2; }

// Whether the AVX-512 path runs projection `p` by dot_bf16_avx512 (plain bfloat16 weights read as dot
// rows), its inputs then in bf16_position_avx512 order.
inline bool bf16_dot_avx512(const FfnProjection& p) {
  return p.encoding == FfnEncoding::kPlain && p.form == FfnForm::kDot && p.weight_dtype == FfnDtype::kBFloat16;
}

// Where input c of an MXFP4 dot row of C inputs sits for the kernels of `path`.
inline size_t mxfp4_input_position(FfnPath path, size_t c, size_t C) {
  switch (path) {
    case FfnPath::kAmx:
    case FfnPath::kAvx512Bf16:
    case FfnPath::kAvx512: return mxfp4_position_avx512(c, C);
    case FfnPath::kAvx2: return mxfp4_position(c);
    default: return c;
  }
}

// -- portable kernels (the reference) -----------------------------------------------------------------

// h[r][i] for i in [i0, i1), r < nr: dot of weight row i with x[r].
void dot_portable(const FfnProjection& p, const uint8_t* slot, const float* x, size_t nr, size_t i0, size_t i1,
                  float* h, FfnDtype compute) {
  const size_t C = p.inputs;
  for (size_t i = i0; i < i1; ++i) {
    for (size_t r = 0; r < nr; ++r) {
      const float* xr = x + r * C;
      float acc = 0.0f;
      if (p.encoding == FfnEncoding::kPlain) {
        const uint8_t* w = slot + p.weight_offset + i * C * dtype_bytes(p.weight_dtype);
        for (size_t c = 0; c < C; ++c) acc += load_value(w, p.weight_dtype, c) * xr[c];
      } else if (p.encoding == FfnEncoding::kMxfp4) {
        const size_t groups = C / kGroup;
        const uint8_t* b = slot + p.weight_offset + i * groups * kGroupBytes;
        const uint8_t* s = slot + p.scale_offset + i * groups;
        for (size_t g = 0; g < groups; ++g) {
          float part = 0.0f;
          for (size_t k = 0; k < kGroupBytes; ++k) {
            const uint8_t byte = b[g * kGroupBytes + k];
            part += 2.0f * kFp4[byte & 0xF] * xr[g * kGroup + 2 * k];
            part += 2.0f * kFp4[byte >> 4] * xr[g * kGroup + 2 * k + 1];
          }
          acc += part * kE8m0Half.value[s[g]];
        }
      } else {  // FP8: each weight as transformers decodes it, rounded to the compute dtype
        const uint8_t* v = slot + p.weight_offset + i * C;
        const float* scale = reinterpret_cast<const float*>(slot + p.scale_offset);
        const size_t grid_cols = (C + p.block_cols - 1) / p.block_cols;
        const float* srow = scale + (i / p.block_rows) * grid_cols;
        for (size_t c = 0; c < C; ++c) acc += round_to(e4m3_value(v[c]) * srow[c / p.block_cols], compute) * xr[c];
      }
      h[r * p.outputs + i] = acc;
    }
  }
}

// h[r][j] for j in [j0, j1): sum over inputs of x[r][k] * M[k][j] (M [inputs, outputs]: plain, or
// FP8 with its block's scale, rounded to the compute dtype).
void axpy_portable(const FfnProjection& p, const uint8_t* slot, const float* x, size_t nr, size_t j0, size_t j1,
                   float* h, FfnDtype compute) {
  const size_t C = p.outputs, R = p.inputs;
  const uint8_t* w = slot + p.weight_offset;
  const float* scale = reinterpret_cast<const float*>(slot + p.scale_offset);
  const bool fp8 = p.encoding == FfnEncoding::kFp8;
  const size_t bytes = fp8 ? 1 : dtype_bytes(p.weight_dtype), grid_cols = fp8 ? (C + p.block_cols - 1) / p.block_cols : 0;
  for (size_t r = 0; r < nr; ++r)
    for (size_t j = j0; j < j1; ++j) {
      float acc = 0.0f;
      for (size_t k = 0; k < R; ++k) {
        const uint8_t* row = w + k * C * bytes;
        const float m = fp8 ? round_to(e4m3_value(row[j]) * scale[(k / p.block_rows) * grid_cols + j / p.block_cols], compute)
                            : load_value(row, p.weight_dtype, j);
        acc += x[r * R + k] * m;
      }
      h[r * C + j] = acc;
    }
}

#ifdef EXPERTCACHE_FFN_X86
// -- AVX2 + FMA + F16C -----------------------------------------------------------------------------------

EXPERTCACHE_FFN_AVX2 inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// 8 plain weights as float32.
template <FfnDtype W>
EXPERTCACHE_FFN_AVX2 inline __m256 load8(const uint8_t* p) {
  if constexpr (W == FfnDtype::kBFloat16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (W == FfnDtype::kFloat16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

// Plain dot rows: RB weight rows at a time (4 for one input row, 2 for more) against NR <= 4 input
// rows; the rows of a block are adjacent, so the block is one sequential stream.
template <FfnDtype W, int NR>
EXPERTCACHE_FFN_AVX2 void dot_plain_avx2(const uint8_t* w0, size_t C, const float* x, size_t i0, size_t i1,
                                         float* h, size_t H) {
  constexpr size_t B = W == FfnDtype::kFloat32 ? 4 : 2;
  constexpr int RB = NR == 1 ? 4 : 2;
  const size_t body = C & ~size_t(7);
  size_t i = i0;
  for (; i + RB <= i1; i += RB) {
    const uint8_t* a = w0 + i * C * B;
    __m256 acc[RB][NR];
    for (int q = 0; q < RB; ++q)
      for (int r = 0; r < NR; ++r) acc[q][r] = _mm256_setzero_ps();
    for (size_t c = 0; c < body; c += 8) {
      _mm_prefetch(reinterpret_cast<const char*>(a + c * B) + kPrefetchBytes, _MM_HINT_T0);
      __m256 wv[RB];
      for (int q = 0; q < RB; ++q) wv[q] = load8<W>(a + (q * C + c) * B);
      for (int r = 0; r < NR; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * C + c);
        for (int q = 0; q < RB; ++q) acc[q][r] = _mm256_fmadd_ps(wv[q], xv, acc[q][r]);
      }
    }
    for (int q = 0; q < RB; ++q)
      for (int r = 0; r < NR; ++r) {
        float sum = hsum(acc[q][r]);
        for (size_t c = body; c < C; ++c) sum += load_value(a + q * C * B, W, c) * x[r * C + c];
        h[r * H + i + q] = sum;
      }
  }
  for (; i < i1; ++i) {
    const uint8_t* a = w0 + i * C * B;
    for (int r = 0; r < NR; ++r) {
      __m256 acc = _mm256_setzero_ps();
      for (size_t c = 0; c < body; c += 8) acc = _mm256_fmadd_ps(load8<W>(a + c * B), _mm256_loadu_ps(x + r * C + c), acc);
      float sum = hsum(acc);
      for (size_t c = body; c < C; ++c) sum += load_value(a, W, c) * x[r * C + c];
      h[r * H + i] = sum;
    }
  }
}

// Each E8M0 scale's 16 E2M1 values, v * 2**(s - 127), as bf16 bits split into low and high bytes
// (16 each, for pshufb). Every such value has at most two significant bits, so its bf16 is exact
// wherever it is finite; where it is not (|v| * 2**(s - 127) >= 2**128), it is +-inf, as in
// transformers' own decode of the same weights into bf16. Folding the scale into the table leaves
// one FMA per 8 weights.
struct Fp4ScaledTables {
  alignas(64) uint8_t bytes[256][32];
  Fp4ScaledTables() {
    for (int s = 0; s < 256; ++s)
      for (int c = 0; c < 16; ++c) {
        const uint32_t u = bits_of(2.0f * kFp4[c] * kE8m0Half.value[s]);  // exact, or +-inf; 0 stays 0
        bytes[s][c] = uint8_t(u >> 16);
        bytes[s][16 + c] = uint8_t(u >> 24);
      }
  }
};
const Fp4ScaledTables kFp4Scaled;

// One group's 32 values times its scale as 4 x 8 floats, in mxfp4_position order: the 16 bytes
// loaded into both lanes, low nibbles kept in lane 0 and high nibbles in lane 1 (a shift per lane),
// the scale's bf16 low and high bytes looked up (pshufb) and interleaved into words, whose even and
// odd words become floats by a shift and a mask.
EXPERTCACHE_FFN_AVX2 inline void fp4_group(const uint8_t* bytes, uint8_t scale, __m256 v[4]) {
  const uint8_t* t = kFp4Scaled.bytes[scale];
  const __m256i tlo = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
  const __m256i thi = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t + 16)));
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                         _mm256_set1_epi8(0x0F));
  const __m256i lo = _mm256_shuffle_epi8(tlo, codes), hi = _mm256_shuffle_epi8(thi, codes);
  const __m256i w0 = _mm256_unpacklo_epi8(lo, hi), w1 = _mm256_unpackhi_epi8(lo, hi);
  const __m256i high = _mm256_set1_epi32(int(0xFFFF0000u));
  v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
  v[1] = _mm256_castsi256_ps(_mm256_and_si256(w0, high));
  v[2] = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
  v[3] = _mm256_castsi256_ps(_mm256_and_si256(w1, high));
}

// Eight rows' partial sums (one ymm each) as one ymm of their 8 totals, each added in hsum's
// order (lanes j and j + 4, then those pairs' 0 + 2 and 1 + 3, then the two): the rows' results
// are hsum's to the bit, with 15 shuffles for the eight rows where hsum takes 24, and no chain of
// dependent adds at the end of each row.
EXPERTCACHE_FFN_AVX2 inline __m256 hsum8(const __m256 r[8]) {
  __m256 a[4];
  for (int q = 0; q < 4; ++q)
    a[q] = _mm256_add_ps(_mm256_permute2f128_ps(r[2 * q], r[2 * q + 1], 0x20),
                         _mm256_permute2f128_ps(r[2 * q], r[2 * q + 1], 0x31));
  const __m256 w0 = _mm256_add_ps(_mm256_shuffle_ps(a[0], a[1], 0x44), _mm256_shuffle_ps(a[0], a[1], 0xEE));
  const __m256 w1 = _mm256_add_ps(_mm256_shuffle_ps(a[2], a[3], 0x44), _mm256_shuffle_ps(a[2], a[3], 0xEE));
  const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(w0, w1, 0x88), _mm256_shuffle_ps(w0, w1, 0xDD));
  return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// One MXFP4 weight row against NR <= 4 input rows (values in mxfp4_position order): each group
// decoded once, its scale folded in; out[r] is input row r's partial sum, still to be added across.
// K accumulators per input row (4 for up to two input rows, 2 beyond) keep enough independent FMA
// chains without spilling registers.
template <int NR>
EXPERTCACHE_FFN_AVX2 inline void mxfp4_row_avx2(const uint8_t* b, const uint8_t* s, const float* x, size_t C,
                                                __m256 out[NR]) {
  constexpr int K = NR <= 2 ? 4 : 2;
  const size_t groups = C / kGroup;
  __m256 acc[NR][K];
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < K; ++k) acc[r][k] = _mm256_setzero_ps();
  for (size_t g = 0; g < groups; ++g) {
    if ((g & 3) == 0)
      _mm_prefetch(reinterpret_cast<const char*>(b + g * kGroupBytes) + kMxfp4Ahead<NR>, _MM_HINT_T0);
    __m256 v[4];
    fp4_group(b + g * kGroupBytes, s[g], v);
    for (int r = 0; r < NR; ++r) {
      const float* xr = x + r * C + g * kGroup;
      for (int j = 0; j < 4; ++j) acc[r][j % K] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(xr + 8 * j), acc[r][j % K]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    __m256 sum = acc[r][0];
    for (int k = 1; k < K; ++k) sum = _mm256_add_ps(sum, acc[r][k]);
    out[r] = sum;
  }
}

// MXFP4 dot rows, a weight row at a time, their sums added across eight rows at a time (hsum8).
template <int NR>
EXPERTCACHE_FFN_AVX2 void dot_mxfp4_avx2(const FfnProjection& p, const uint8_t* slot, const float* x, size_t i0,
                                         size_t i1, float* h) {
  const size_t C = p.inputs, row_bytes = C / kGroup * kGroupBytes, row_scales = C / kGroup;
  const uint8_t* b = slot + p.weight_offset;
  const uint8_t* s = slot + p.scale_offset;
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    __m256 part[NR][8];
    for (int q = 0; q < 8; ++q) {
      __m256 out[NR];
      mxfp4_row_avx2<NR>(b + (i + q) * row_bytes, s + (i + q) * row_scales, x, C, out);
      for (int r = 0; r < NR; ++r) part[r][q] = out[r];
    }
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(h + r * p.outputs + i, hsum8(part[r]));
  }
  for (; i < i1; ++i) {
    __m256 out[NR];
    mxfp4_row_avx2<NR>(b + i * row_bytes, s + i * row_scales, x, C, out);
    for (int r = 0; r < NR; ++r) h[r * p.outputs + i] = hsum(out[r]);
  }
}

// 8 floats rounded to bf16 (to nearest, ties to even) as floats: finite values and +-inf as
// round_to gives them; a NaN's result is not defined here (the callers choose what a NaN becomes).
EXPERTCACHE_FFN_AVX2 inline __m256 bf16_nearest_even(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// 8 FP8 weights times their block's scale, rounded to the compute dtype R (as decoded by
// transformers). e4m3 -> fp16 bits (magnitude << 7, sign << 8) is exact times 2**-8, which the
// scale takes (256 * scale): the code shifted by 7 puts the magnitude in place and the sign in bit
// 14, and adding bit 14 to itself carries it into bit 15. kNan: NaN codes stay NaN, and NaN
// products (a scale that is not finite) are kept as they are; without it, the codes and the scale
// are known to have none.
template <FfnDtype R, bool kNan>
EXPERTCACHE_FFN_AVX2 inline __m256 fp8_load8(const uint8_t* p, __m256 scale256) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i t = _mm_slli_epi16(b, 7);
  __m128i h = _mm_add_epi16(t, _mm_and_si128(t, _mm_set1_epi16(0x4000)));
  if constexpr (kNan) {
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7F));
    h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7E00)));  // fp16 NaN
  }
  __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), scale256);
  if constexpr (R == FfnDtype::kBFloat16) {
    const __m256 r = bf16_nearest_even(v);
    if constexpr (kNan)
      v = _mm256_blendv_ps(r, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    else
      v = r;  // finite or +-inf: the rounding carries into inf, as round_to does
  } else if constexpr (R == FfnDtype::kFloat16) {
    v = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  return v;
}

// Whether bytes [p, p + n) hold an e4m3 NaN code (0x7F or 0xFF).
EXPERTCACHE_FFN_AVX2 inline bool fp8_has_nan(const uint8_t* p, size_t n) {
  const __m256i m = _mm256_set1_epi8(0x7F);
  __m256i any = _mm256_setzero_si256();
  size_t c = 0;
  for (; c + 32 <= n; c += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi8(_mm256_and_si256(b, m), m));
  }
  bool found = !_mm256_testz_si256(any, any);
  for (; c < n; ++c) found |= (p[c] & 0x7F) == 0x7F;
  return found;
}

// Whether a block's piece of a row, bytes [p, p + n) under scale s, needs the decode with NaN
// handling: its codes hold a NaN or its scale is not finite.
EXPERTCACHE_FFN_AVX2 inline bool fp8_special(const uint8_t* p, size_t n, float s) {
  return !std::isfinite(s) || fp8_has_nan(p, n);
}

// Whether a finite block scale `s` is too large for the vector decode, which multiplies the codes'
// values / 256 by s * 256 (above about 1.3e36 that is infinite, where each value * s may not be:
// a 0 code would give NaN, a small one inf). Such a block is decoded one value at a time, as
// transformers' float32 `value * scale`.
inline bool fp8_scale_overflows(float s) { return std::isfinite(s) && !std::isfinite(s * 256.0f); }

// The 8-wide part of one row's block of columns [c0, c1): returns the first column not done.
template <FfnDtype R, int NR, bool kNan>
EXPERTCACHE_FFN_AVX2 inline size_t fp8_segment(const uint8_t* v, const float* x, size_t C, size_t c0, size_t c1,
                                               __m256 s256, __m256 acc[NR]) {
  size_t c = c0;
  for (; c + 8 <= c1; c += 8) {
    const __m256 w = fp8_load8<R, kNan>(v + c, s256);
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * C + c), acc[r]);
  }
  return c;
}

// FP8 dot rows. Each row's block of columns takes the decode without NaN handling unless its codes
// hold a NaN or its scale is not finite (checked per block: a few ops per 32 bytes).
template <FfnDtype R, int NR>
EXPERTCACHE_FFN_AVX2 void dot_fp8_avx2(const FfnProjection& p, const uint8_t* slot, const float* x, size_t i0,
                                       size_t i1, float* h) {
  const size_t C = p.inputs, bn = p.block_cols, grid_cols = (C + bn - 1) / bn;
  const float* scale = reinterpret_cast<const float*>(slot + p.scale_offset);
  for (size_t i = i0; i < i1; ++i) {
    const uint8_t* v = slot + p.weight_offset + i * C;
    const float* srow = scale + (i / p.block_rows) * grid_cols;
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    float tail[NR] = {};
    for (size_t c0 = 0; c0 < C; c0 += bn) {
      const size_t c1 = std::min(C, c0 + bn);
      const float s = srow[c0 / bn];
      const __m256 s256 = _mm256_set1_ps(s * 256.0f);
      const bool special = fp8_special(v + c0, c1 - c0, s);
      size_t c = fp8_scale_overflows(s) ? c0
                 : special              ? fp8_segment<R, NR, true>(v, x, C, c0, c1, s256, acc)
                                        : fp8_segment<R, NR, false>(v, x, C, c0, c1, s256, acc);
      for (; c < c1; ++c) {
        const float w = round_to(e4m3_value(v[c]) * s, R);
        for (int r = 0; r < NR; ++r) tail[r] += w * x[r * C + c];
      }
    }
    for (int r = 0; r < NR; ++r) h[r * p.outputs + i] = hsum(acc[r]) + tail[r];
  }
}

// Axpy weight rows, 8 columns at a time: load(row, q, j) is columns j .. j + 7 of row q of a block
// (row points at its column 0) as float32, as transformers decodes them.
// kInputRows: input rows a block is applied to at once (the more, the fewer loads of its weights,
// but a plain block's broadcast inputs stay in registers only for 2).
template <FfnDtype W>
struct PlainRows {
  static constexpr size_t kBytes = W == FfnDtype::kFloat32 ? 4 : 2;
  static constexpr int kInputRows = 2;
  EXPERTCACHE_FFN_AVX2 __m256 load(const uint8_t* row, int, size_t j) const { return load8<W>(row + j * kBytes); }
};

// FP8 rows: each times its block's scale (scale256[q], 256 * scale_inv: see fp8_load8), rounded to R.
template <FfnDtype R, bool kNan>
struct Fp8Rows {
  static constexpr size_t kBytes = 1;
  static constexpr int kInputRows = 4;  // a decode costs more than the broadcasts' loads
  __m256 scale256[4];
  EXPERTCACHE_FFN_AVX2 __m256 load(const uint8_t* row, int q, size_t j) const {
    return fp8_load8<R, kNan>(row + j, scale256[q]);
  }
};

// One block of Q <= 4 weight rows (k .. k + Q - 1), columns [j0, body), into the partial sums of
// NR <= 4 input rows.
template <int Q, int NR, class Rows>
EXPERTCACHE_FFN_AVX2 inline void axpy_block(const Rows& rows, const uint8_t* r0, size_t stride, const float* x,
                                            size_t R, size_t k, size_t j0, size_t body, float* h, size_t C,
                                            bool prefetch) {
  constexpr size_t B = Rows::kBytes;
  __m256 xb[NR][Q];
  for (int r = 0; r < NR; ++r)
    for (int q = 0; q < Q; ++q) xb[r][q] = _mm256_broadcast_ss(x + r * R + k + q);
  const uint8_t* next = r0 + 2 * Q * stride;  // the block after next: its rows prefetched a line at a time
  for (size_t j = j0; j < body; j += 8) {
    if (prefetch && ((j * B) & 63) == 0)
      for (int q = 0; q < Q; ++q) _mm_prefetch(reinterpret_cast<const char*>(next + q * stride + j * B), _MM_HINT_T0);
    __m256 w[Q];
    for (int q = 0; q < Q; ++q) w[q] = rows.load(r0 + q * stride, q, j);
    for (int r = 0; r < NR; ++r) {
      float* hr = h + r * C + j;
      __m256 a = _mm256_fmadd_ps(w[0], xb[r][0], _mm256_loadu_ps(hr));
      for (int q = 1; q < Q; ++q) a = _mm256_fmadd_ps(w[q], xb[r][q], a);
      _mm256_storeu_ps(hr, a);
    }
  }
}

// Block rows k .. k + Q - 1 into the partial sums of every input row, Rows::kInputRows at a time.
template <int Q, class Rows>
EXPERTCACHE_FFN_AVX2 inline void axpy_rows(const Rows& rows, const uint8_t* r0, size_t stride, const float* x,
                                           size_t nr, size_t R, size_t k, size_t j0, size_t body, float* h, size_t C,
                                           bool ahead) {
  size_t r = 0;  // the first input rows prefetch
  if constexpr (Rows::kInputRows == 4)
    for (; r + 4 <= nr; r += 4) axpy_block<Q, 4>(rows, r0, stride, x + r * R, R, k, j0, body, h + r * C, C, ahead && r == 0);
  for (; r + 2 <= nr; r += 2) axpy_block<Q, 2>(rows, r0, stride, x + r * R, R, k, j0, body, h + r * C, C, ahead && r == 0);
  if (r < nr) axpy_block<Q, 1>(rows, r0, stride, x + r * R, R, k, j0, body, h + r * C, C, ahead && r == 0);
}

// Plain axpy columns [j0, j1) for nr input rows: the weight rows streamed in blocks of 4 (four
// sequential streams), each block applied to the input rows two at a time while it is in L1, the
// partial sums kept in h (zeroed first), so the weights are read once and in order.
template <FfnDtype W>
EXPERTCACHE_FFN_AVX2 void axpy_plain_avx2(const FfnProjection& p, const uint8_t* slot, const float* x, size_t nr,
                                          size_t j0, size_t j1, float* h) {
  constexpr size_t B = PlainRows<W>::kBytes;
  const size_t C = p.outputs, R = p.inputs, stride = C * B;
  const uint8_t* w = slot + p.weight_offset;
  const size_t body = j0 + ((j1 - j0) & ~size_t(7));
  for (size_t r = 0; r < nr; ++r) std::memset(h + r * C + j0, 0, (j1 - j0) * sizeof(float));
  size_t k = 0;
  for (; k + 4 <= R; k += 4) {
    const uint8_t* r0 = w + k * stride;
    axpy_rows<4>(PlainRows<W>{}, r0, stride, x, nr, R, k, j0, body, h, C, k + 12 <= R);
    for (size_t j = body; j < j1; ++j)
      for (size_t i = 0; i < nr; ++i)
        for (int q = 0; q < 4; ++q) h[i * C + j] += x[i * R + k + q] * load_value(r0 + q * stride, W, j);
  }
  for (; k < R; ++k) {
    const uint8_t* row = w + k * stride;
    axpy_rows<1>(PlainRows<W>{}, row, stride, x, nr, R, k, j0, body, h, C, false);
    for (size_t j = body; j < j1; ++j)
      for (size_t i = 0; i < nr; ++i) h[i * C + j] += x[i * R + k] * load_value(row, W, j);
  }
}

// FP8 weight rows k .. k + rows - 1 (4 or 1), columns [a, body), with their scales s256.
template <FfnDtype Rd, bool kNan>
EXPERTCACHE_FFN_AVX2 inline void axpy_fp8_rows(const __m256 s256[4], int rows, const uint8_t* r0, size_t C,
                                               const float* x, size_t nr, size_t R, size_t k, size_t a, size_t body,
                                               float* h, bool ahead) {
  const Fp8Rows<Rd, kNan> fp8{{s256[0], s256[1], s256[2], s256[3]}};
  if (rows == 4)
    axpy_rows<4>(fp8, r0, C, x, nr, R, k, a, body, h, C, ahead);
  else
    axpy_rows<1>(fp8, r0, C, x, nr, R, k, a, body, h, C, false);
}

// FP8 axpy columns [j0, j1) (M [inputs, outputs] FP8, as GPT-OSS lays out its projections): as the
// plain axpy, in blocks of 4 weight rows, each cut at the scale blocks' column edges. A block's
// piece takes the decode without NaN handling unless its codes hold a NaN or a scale is not finite.
template <FfnDtype Rd>
EXPERTCACHE_FFN_AVX2 void axpy_fp8_avx2(const FfnProjection& p, const uint8_t* slot, const float* x, size_t nr,
                                        size_t j0, size_t j1, float* h) {
  const size_t C = p.outputs, R = p.inputs, bm = p.block_rows, bn = p.block_cols, grid_cols = (C + bn - 1) / bn;
  const uint8_t* w = slot + p.weight_offset;
  const float* scale = reinterpret_cast<const float*>(slot + p.scale_offset);
  for (size_t r = 0; r < nr; ++r) std::memset(h + r * C + j0, 0, (j1 - j0) * sizeof(float));
  for (size_t k = 0; k < R;) {
    const int rows = k + 4 <= R ? 4 : 1;
    const uint8_t* r0 = w + k * C;
    const bool ahead = k + 12 <= R;
    for (size_t c0 = j0 / bn * bn; c0 < j1; c0 += bn) {
      const size_t a = std::max(j0, c0), b = std::min(j1, c0 + bn);
      size_t body = a + ((b - a) & ~size_t(7));
      float s[4] = {};
      __m256 s256[4];
      bool special = false, huge = false;
      for (int q = 0; q < 4; ++q) {
        if (q < rows) {
          s[q] = scale[((k + q) / bm) * grid_cols + c0 / bn];
          special |= fp8_special(r0 + q * C + a, b - a, s[q]);
          huge |= fp8_scale_overflows(s[q]);
        }
        s256[q] = _mm256_set1_ps(s[q] * 256.0f);
      }
      if (huge)
        body = a;  // every column of the piece one value at a time, below
      else if (special)
        axpy_fp8_rows<Rd, true>(s256, rows, r0, C, x, nr, R, k, a, body, h, ahead);
      else
        axpy_fp8_rows<Rd, false>(s256, rows, r0, C, x, nr, R, k, a, body, h, ahead);
      for (size_t j = body; j < b; ++j)
        for (int q = 0; q < rows; ++q) {
          const float m = round_to(e4m3_value(r0[q * C + j]) * s[q], Rd);
          for (size_t i = 0; i < nr; ++i) h[i * C + j] += x[i * R + k + q] * m;
        }
    }
    k += size_t(rows);
  }
}

// Dispatch over the input rows in chunks of 4 (the weights of an item stay in cache between them).
template <int NR>
EXPERTCACHE_FFN_AVX2 void project_avx2_nr(const FfnProjection& p, const uint8_t* slot, const float* x, size_t o0,
                                          size_t o1, float* h, FfnDtype compute) {
  switch (p.encoding) {
    case FfnEncoding::kMxfp4: return dot_mxfp4_avx2<NR>(p, slot, x, o0, o1, h);
    case FfnEncoding::kFp8:
      switch (compute) {
        case FfnDtype::kBFloat16: return dot_fp8_avx2<FfnDtype::kBFloat16, NR>(p, slot, x, o0, o1, h);
        case FfnDtype::kFloat16: return dot_fp8_avx2<FfnDtype::kFloat16, NR>(p, slot, x, o0, o1, h);
        default: return dot_fp8_avx2<FfnDtype::kFloat32, NR>(p, slot, x, o0, o1, h);
      }
    default: {
      const uint8_t* w = slot + p.weight_offset;
      switch (p.weight_dtype) {
        case FfnDtype::kBFloat16: return dot_plain_avx2<FfnDtype::kBFloat16, NR>(w, p.inputs, x, o0, o1, h, p.outputs);
        case FfnDtype::kFloat16: return dot_plain_avx2<FfnDtype::kFloat16, NR>(w, p.inputs, x, o0, o1, h, p.outputs);
        default: return dot_plain_avx2<FfnDtype::kFloat32, NR>(w, p.inputs, x, o0, o1, h, p.outputs);
      }
    }
  }
}

void project_avx2(const FfnProjection& p, const uint8_t* slot, const float* x, size_t nr, size_t o0, size_t o1,
                  float* h, FfnDtype compute) {
  if (p.form == FfnForm::kAxpy && p.encoding == FfnEncoding::kFp8) {  // every input row at once
    switch (compute) {
      case FfnDtype::kBFloat16: return axpy_fp8_avx2<FfnDtype::kBFloat16>(p, slot, x, nr, o0, o1, h);
      case FfnDtype::kFloat16: return axpy_fp8_avx2<FfnDtype::kFloat16>(p, slot, x, nr, o0, o1, h);
      default: return axpy_fp8_avx2<FfnDtype::kFloat32>(p, slot, x, nr, o0, o1, h);
    }
  }
  if (p.form == FfnForm::kAxpy) {  // every input row at once: the weights are streamed once
    switch (p.weight_dtype) {
      case FfnDtype::kBFloat16: return axpy_plain_avx2<FfnDtype::kBFloat16>(p, slot, x, nr, o0, o1, h);
      case FfnDtype::kFloat16: return axpy_plain_avx2<FfnDtype::kFloat16>(p, slot, x, nr, o0, o1, h);
      default: return axpy_plain_avx2<FfnDtype::kFloat32>(p, slot, x, nr, o0, o1, h);
    }
  }
  for (size_t r = 0; r < nr; r += 4) {
    const float* xr = x + r * p.inputs;
    float* hr = h + r * p.outputs;
    switch (std::min<size_t>(4, nr - r)) {
      case 1: project_avx2_nr<1>(p, slot, xr, o0, o1, hr, compute); break;
      case 2: project_avx2_nr<2>(p, slot, xr, o0, o1, hr, compute); break;
      case 3: project_avx2_nr<3>(p, slot, xr, o0, o1, hr, compute); break;
      default: project_avx2_nr<4>(p, slot, xr, o0, o1, hr, compute); break;
    }
  }
}

// -- AVX-512 (F, BW, VL): MXFP4 and FP8 dot rows; every other projection runs the AVX2 kernels --------

// Each E8M0 scale's 16 E2M1 values times the scale, as bf16 words (Fp4ScaledTables' values).
struct Fp4ScaledWords {
  alignas(32) uint16_t w[256][16];
  Fp4ScaledWords() {
    for (int s = 0; s < 256; ++s)
      for (int c = 0; c < 16; ++c)
        w[s][c] = uint16_t(kFp4Scaled.bytes[s][c] | unsigned(kFp4Scaled.bytes[s][16 + c]) << 8);
  }
};
const Fp4ScaledWords kFp4Words;

// Two groups' 64 values (32 bytes, scales s0 and s1) times their scales as 4 x 16 floats, in
// mxfp4_position_avx512 order (fp4_pair_avx512). fp4_pair_words: as bfloat16 words, `lo` the
// bytes' low nibbles (the groups' even elements), `hi` their high ones, the first group's in words
// 0 .. 15. The bytes widen to words; a word's low 5 bits index one table of both scales' 16 values
// (vpermw): the low nibble, or the high one shifted down, plus 16 for the second group.
EXPERTCACHE_FFN_AVX512 inline void fp4_pair_words(const uint8_t* bytes, uint8_t s0, uint8_t s1, __m512i& lo,
                                                  __m512i& hi) {
  const __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
  const __m512i table = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(kFp4Words.w[s0]))),
      _mm256_load_si256(reinterpret_cast<const __m256i*>(kFp4Words.w[s1])), 1);
  const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
  // (z & 0x0F) | second: ternary-logic table 0xEA is (A & B) | C.
  const __m512i lo_index = _mm512_ternarylogic_epi32(z, _mm512_set1_epi16(0x0F), second, 0xEA);
  lo = _mm512_permutexvar_epi16(lo_index, table);
  hi = _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(z, 4), second), table);
}

// The same 64 values as 4 x 16 floats: the looked-up words become floats by a shift (even words)
// and a mask (odd words).
EXPERTCACHE_FFN_AVX512 inline void fp4_pair_avx512(const uint8_t* bytes, uint8_t s0, uint8_t s1, __m512 v[4]) {
  __m512i lo, hi;
  fp4_pair_words(bytes, s0, s1, lo, hi);
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16));
  v[1] = _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16));
  v[2] = _mm512_castsi512_ps(_mm512_and_si512(lo, high));
  v[3] = _mm512_castsi512_ps(_mm512_and_si512(hi, high));
}

// One group's 32 values times its scale as 4 x 8 floats (a row's last group, when its groups are
// odd in number), in mxfp4_position_avx512 order: as fp4_pair_avx512 with a 16-word table.
EXPERTCACHE_FFN_AVX512 inline void fp4_one_avx512(const uint8_t* bytes, uint8_t scale, __m256 v[4]) {
  const __m256i z = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kFp4Words.w[scale]));
  const __m256i lo = _mm256_permutexvar_epi16(z, table);  // an index's low 4 bits: the low nibble
  const __m256i hi = _mm256_permutexvar_epi16(_mm256_srli_epi16(z, 4), table);
  const __m256i high = _mm256_set1_epi32(int(0xFFFF0000u));
  v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
  v[1] = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
  v[2] = _mm256_castsi256_ps(_mm256_and_si256(lo, high));
  v[3] = _mm256_castsi256_ps(_mm256_and_si256(hi, high));
}

// One MXFP4 weight row against NR <= 4 input rows (values in mxfp4_position_avx512 order): two
// groups decoded at a time, four accumulators per input row (the 32 registers hold them all);
// out[r] is input row r's partial sum, still to be added across.
template <int NR>
EXPERTCACHE_FFN_AVX512 inline void mxfp4_row_avx512(const uint8_t* b, const uint8_t* s, const float* x, size_t C,
                                                    __m256 out[NR]) {
  const size_t groups = C / kGroup, pairs = groups / 2;
  __m512 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_setzero_ps();
  for (size_t q = 0; q < pairs; ++q) {
    const uint8_t* bq = b + q * 2 * kGroupBytes;
    if ((q & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(bq) + kMxfp4Ahead<NR>, _MM_HINT_T0);
    __m512 v[4];
    fp4_pair_avx512(bq, s[2 * q], s[2 * q + 1], v);
    for (int r = 0; r < NR; ++r) {
      const float* xr = x + r * C + q * 2 * kGroup;
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_fmadd_ps(v[k], _mm512_loadu_ps(xr + 16 * k), acc[r][k]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
    out[r] = _mm256_add_ps(_mm512_castps512_ps256(sum),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1)));
  }
  if (groups % 2) {
    __m256 v[4];
    fp4_one_avx512(b + (groups - 1) * kGroupBytes, s[groups - 1], v);
    for (int r = 0; r < NR; ++r) {
      const float* xr = x + r * C + (groups - 1) * kGroup;
      __m256 t = _mm256_mul_ps(v[0], _mm256_loadu_ps(xr));
      for (int k = 1; k < 4; ++k) t = _mm256_fmadd_ps(v[k], _mm256_loadu_ps(xr + 8 * k), t);
      out[r] = _mm256_add_ps(out[r], t);
    }
  }
}

// MXFP4 dot rows, as dot_mxfp4_avx2 with the AVX-512 row. The same loop, written twice: a target
// attribute holds for a whole function, and the AVX2 one must not be compiled with AVX-512 allowed
// (it runs where there is none), nor this one call its row through a pointer per weight row.
template <int NR>
EXPERTCACHE_FFN_AVX512 void dot_mxfp4_avx512(const FfnProjection& p, const uint8_t* slot, const float* x, size_t i0,
                                             size_t i1, float* h) {
  const size_t C = p.inputs, row_bytes = C / kGroup * kGroupBytes, row_scales = C / kGroup;
  const uint8_t* b = slot + p.weight_offset;
  const uint8_t* s = slot + p.scale_offset;
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    __m256 part[NR][8];
    for (int q = 0; q < 8; ++q) {
      __m256 out[NR];
      mxfp4_row_avx512<NR>(b + (i + q) * row_bytes, s + (i + q) * row_scales, x, C, out);
      for (int r = 0; r < NR; ++r) part[r][q] = out[r];
    }
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(h + r * p.outputs + i, hsum8(part[r]));
  }
  for (; i < i1; ++i) {
    __m256 out[NR];
    mxfp4_row_avx512<NR>(b + i * row_bytes, s + i * row_scales, x, C, out);
    for (int r = 0; r < NR; ++r) h[r * p.outputs + i] = hsum(out[r]);
  }
}

// -- AVX-512 BF16: MXFP4 dot rows for a bfloat16 compute dtype by vdpbf16ps ------------------------
//
// The avx512-bf16 path's kernel: the decoded words of a pair of groups (fp4_pair_words: each value
// times its scale, exact in bfloat16) are multiplied with the inputs as bfloat16 words (exact:
// values of the compute dtype) in mxfp4_position_bf16 order, `lo` against the chunk's first 32
// words and `hi` against the next, by vdpbf16ps: 32 products an instruction where an fma makes 16,
// and no widening of the words to floats. On AMD Zen 4 it issues at the fma's rate (bench.kernels:
// MXFP4 at 4 rows twice as fast). vdpbf16ps reads subnormal operands as zero and flushes subnormal
// results: a call whose inputs hold a subnormal number, or whose weight rows have a scale that makes
// values subnormal, is left to the AVX-512 kernel (project_words_bf16 returns false), as AMX's.

constexpr uint8_t kMinNormalScale = 2;  // 0.5 x 2**(s - 127) >= 2**-126: an E2M1 value times it is normal

// True where every scale of weight rows [o0, o1) is at least kMinNormalScale.
EXPERTCACHE_FFN_AVX512 inline bool scales_normal(const uint8_t* s, size_t row_scales, size_t o0, size_t o1) {
  const uint8_t* p = s + o0 * row_scales;
  const uint8_t* end = s + o1 * row_scales;
  const __m512i least = _mm512_set1_epi8(char(kMinNormalScale));
  __mmask64 below = 0;
  for (; p + 64 <= end; p += 64) below |= _mm512_cmplt_epu8_mask(_mm512_loadu_si512(p), least);
  if (p < end) {
    const __mmask64 tail = ~0ULL >> (64 - (end - p));
    below |= _mm512_mask_cmplt_epu8_mask(tail, _mm512_maskz_loadu_epi8(tail, p), least);
  }
  return below == 0;
}

#ifdef EXPERTCACHE_FFN_HAS_BF16
// One MXFP4 weight row against NR <= 4 input rows of words (mxfp4_position_bf16 order): four
// accumulators per input row; out[r] is input row r's partial sum, still to be added across.
template <int NR>
EXPERTCACHE_FFN_BF16 inline void mxfp4_row_bf16(const uint8_t* b, const uint8_t* s, const uint16_t* x, size_t C,
                                                __m256 out[NR]) {
  const size_t groups = C / kGroup, pairs = groups / 2;
  // Four accumulators per input row, two pairs of groups a step: four chains of vdpbf16ps, so
  // that one input row is not held to the instruction's latency (two chains kept AMD Zen 5 at a
  // third of its issue rate at 1 row).
  __m512 acc[NR][4];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
  size_t q = 0;
  for (; q + 2 <= pairs; q += 2) {
    const uint8_t* bq = b + q * 2 * kGroupBytes;
    _mm_prefetch(reinterpret_cast<const char*>(bq) + kMxfp4Ahead<NR>, _MM_HINT_T0);
    __m512i lo0, hi0, lo1, hi1;
    fp4_pair_words(bq, s[2 * q], s[2 * q + 1], lo0, hi0);
    fp4_pair_words(bq + 2 * kGroupBytes, s[2 * q + 2], s[2 * q + 3], lo1, hi1);
    for (int r = 0; r < NR; ++r) {
      const uint16_t* xr = x + r * C + q * 2 * kGroup;
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)lo0, (__m512bh)_mm512_loadu_si512(xr));
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)hi0, (__m512bh)_mm512_loadu_si512(xr + kGroup));
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], (__m512bh)lo1, (__m512bh)_mm512_loadu_si512(xr + 2 * kGroup));
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], (__m512bh)hi1, (__m512bh)_mm512_loadu_si512(xr + 3 * kGroup));
    }
  }
  if (q < pairs) {  // an odd pair of groups left
    const uint8_t* bq = b + q * 2 * kGroupBytes;
    __m512i lo, hi;
    fp4_pair_words(bq, s[2 * q], s[2 * q + 1], lo, hi);
    for (int r = 0; r < NR; ++r) {
      const uint16_t* xr = x + r * C + q * 2 * kGroup;
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)lo, (__m512bh)_mm512_loadu_si512(xr));
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)hi, (__m512bh)_mm512_loadu_si512(xr + kGroup));
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
    out[r] = _mm256_add_ps(_mm512_castps512_ps256(sum),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1)));
  }
  if (groups % 2) {  // the last group alone: its even elements' words, then its odd ones'
    const size_t g = groups - 1;
    const __m256i z = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + g * kGroupBytes)));
    const __m256i table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kFp4Words.w[s[g]]));
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permutexvar_epi16(z, table)),
                                         _mm256_permutexvar_epi16(_mm256_srli_epi16(z, 4), table), 1);
    for (int r = 0; r < NR; ++r) {
      const __m512 t =
          _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w, (__m512bh)_mm512_loadu_si512(x + r * C + g * kGroup));
      out[r] = _mm256_add_ps(out[r], _mm256_add_ps(_mm512_castps512_ps256(t),
                                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1))));
    }
  }
}

// MXFP4 dot rows from words, as dot_mxfp4_avx512 with the BF16 row (its loop written a third time,
// for the reason dot_mxfp4_avx512 gives: a target attribute holds for a whole function).
template <int NR>
EXPERTCACHE_FFN_BF16 void dot_mxfp4_bf16(const FfnProjection& p, const uint8_t* slot, const uint16_t* x, size_t i0,
                                         size_t i1, float* h) {
  const size_t C = p.inputs, row_bytes = C / kGroup * kGroupBytes, row_scales = C / kGroup;
  const uint8_t* b = slot + p.weight_offset;
  const uint8_t* s = slot + p.scale_offset;
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    __m256 part[NR][8];
    for (int q = 0; q < 8; ++q) {
      __m256 out[NR];
      mxfp4_row_bf16<NR>(b + (i + q) * row_bytes, s + (i + q) * row_scales, x, C, out);
      for (int r = 0; r < NR; ++r) part[r][q] = out[r];
    }
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(h + r * p.outputs + i, hsum8(part[r]));
  }
  for (; i < i1; ++i) {
    __m256 out[NR];
    mxfp4_row_bf16<NR>(b + i * row_bytes, s + i * row_scales, x, C, out);
    for (int r = 0; r < NR; ++r) h[r * p.outputs + i] = hsum(out[r]);
  }
}

// -- AVX-512 BF16: plain bfloat16 dot rows by vdpbf16ps -------------------------------------------
//
// The avx512-bf16 path's kernel for plain bfloat16 [out, in] weights (Mixtral, Qwen-MoE, OLMoE,
// DeepSeek) in a bfloat16 compute dtype: a 64-byte load of a weight row is 32 words, multiplied with
// 32 input words (exact: values of the compute dtype) by one vdpbf16ps, where the avx512 kernel
// widens them to floats by a shift and a mask and takes two fmas; the inputs past the last block of
// 32, and the weights beside them, by masked loads (zero words add nothing). One weight row at a time,
// so that the weights stream in order: a row of a decode step's experts is 1-6 KiB, and rows read
// side by side (the avx512 kernel's 4) cut that stream into pieces too short for the hardware's
// prefetch (AMD Zen 4, bench.kernels' plain layout at the e2e shape: 11 GB/s 4 rows a time, 24-26
// one at a time, at 1 input row; 7.8 and 16-17 at 4). Each sum is rounded once per product, a pair's
// odd product first, as the avx512 kernel's fmas round, in another order; vdpbf16ps reads subnormal
// operands as zero and flushes subnormal sums: a call whose inputs hold a subnormal number is left to
// the avx512 kernel (as AMX's), and a subnormal weight, below 2**-126, moves a sum by less than
// 2**-126 times an input.
template <int NR>
EXPERTCACHE_FFN_BF16 inline void bf16_row_dp(const uint8_t* a, size_t C, const uint16_t* x, size_t i, float* h,
                                            size_t H) {
  const size_t body = C / 64 * 64;
  __m512 acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  size_t c = 0;
  for (; c < body; c += 64) {  // two accumulators a row: two chains of vdpbf16ps
    const __m512i v0 = _mm512_loadu_si512(a + c * 2), v1 = _mm512_loadu_si512(a + c * 2 + 64);
    for (int r = 0; r < NR; ++r) {
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)v0, (__m512bh)_mm512_loadu_si512(x + r * C + c));
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)v1, (__m512bh)_mm512_loadu_si512(x + r * C + c + 32));
    }
  }
  for (; c < C; c += 32) {
    const __mmask32 m = C - c >= 32 ? ~__mmask32(0) : __mmask32((1ULL << (C - c)) - 1);
    const __m512i v = _mm512_maskz_loadu_epi16(m, a + c * 2);
    for (int r = 0; r < NR; ++r)
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)v, (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * C + c));
  }
  for (int r = 0; r < NR; ++r) h[r * H + i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

// Plain bfloat16 dot rows [i0, i1) against NR <= 4 input rows of words (bf16_row_dp).
template <int NR>
EXPERTCACHE_FFN_BF16 void dot_bf16_dp(const uint8_t* w0, size_t C, const uint16_t* x, size_t i0, size_t i1, float* h,
                                      size_t H) {
  for (size_t i = i0; i < i1; ++i) bf16_row_dp<NR>(w0 + i * C * 2, C, x, i, h, H);
}

// An MXFP4 or plain bfloat16 dot projection's weight rows [o0, o1) against nr input rows of words
// at xw (C words a row; MXFP4: in mxfp4_position_bf16 order): h[r * outputs + i]. False, nothing
// written, where an MXFP4 scale of those rows makes values subnormal.
EXPERTCACHE_FFN_BF16 bool project_words_bf16(const FfnProjection& p, const uint8_t* slot, const uint16_t* xw,
                                             size_t nr, size_t o0, size_t o1, float* h) {
  if (bf16_dot_avx512(p)) {
    const uint8_t* w = slot + p.weight_offset;
    for (size_t r = 0; r < nr; r += 4) {
      const uint16_t* xr = xw + r * p.inputs;
      float* hr = h + r * p.outputs;
      switch (std::min<size_t>(4, nr - r)) {
        case 1: dot_bf16_dp<1>(w, p.inputs, xr, o0, o1, hr, p.outputs); break;
        case 2: dot_bf16_dp<2>(w, p.inputs, xr, o0, o1, hr, p.outputs); break;
        case 3: dot_bf16_dp<3>(w, p.inputs, xr, o0, o1, hr, p.outputs); break;
        default: dot_bf16_dp<4>(w, p.inputs, xr, o0, o1, hr, p.outputs); break;
      }
    }
    return true;
  }
  const size_t groups = p.inputs / kGroup;
  if (!scales_normal(slot + p.scale_offset, groups, o0, o1)) return false;
  for (size_t r = 0; r < nr; r += 4) {
    const uint16_t* xr = xw + r * p.inputs;
    float* hr = h + r * p.outputs;
    switch (std::min<size_t>(4, nr - r)) {
      case 1: dot_mxfp4_bf16<1>(p, slot, xr, o0, o1, hr); break;
      case 2: dot_mxfp4_bf16<2>(p, slot, xr, o0, o1, hr); break;
      case 3: dot_mxfp4_bf16<3>(p, slot, xr, o0, o1, hr); break;
      default: dot_mxfp4_bf16<4>(p, slot, xr, o0, o1, hr); break;
    }
  }
  return true;
}
#endif  // EXPERTCACHE_FFN_HAS_BF16

// Q plain bfloat16 weight rows from row i against NR <= 4 input rows (inputs in bf16_position_avx512
// order): each 64-byte load of a row split into its even and odd words as floats (a shift, a mask:
// no conversion), each into its own accumulator.
template <int NR, int Q>
EXPERTCACHE_FFN_AVX512 inline void bf16_rows_avx512(const uint8_t* w0, size_t C, const float* x, size_t i, float* h,
                                                    size_t H) {
  const size_t body = C / 32 * 32;
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  const uint8_t* a = w0 + i * C * 2;
  __m512 even[Q][NR], odd[Q][NR];
  for (int q = 0; q < Q; ++q)
    for (int r = 0; r < NR; ++r) even[q][r] = odd[q][r] = _mm512_setzero_ps();
  for (size_t c = 0; c < body; c += 32) {
    __m512 lo[Q], hi[Q];
    for (int q = 0; q < Q; ++q) {
      const uint8_t* at = a + (q * C + c) * 2;
      _mm_prefetch(reinterpret_cast<const char*>(at) + kPrefetchBytes, _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(at);
      lo[q] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      hi[q] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 xe = _mm512_loadu_ps(x + r * C + c), xo = _mm512_loadu_ps(x + r * C + c + 16);
      for (int q = 0; q < Q; ++q) {
        even[q][r] = _mm512_fmadd_ps(lo[q], xe, even[q][r]);
        odd[q][r] = _mm512_fmadd_ps(hi[q], xo, odd[q][r]);
      }
    }
  }
  for (int q = 0; q < Q; ++q)
    for (int r = 0; r < NR; ++r) {
      float sum = _mm512_reduce_add_ps(_mm512_add_ps(even[q][r], odd[q][r]));
      for (size_t c = body; c < C; ++c) sum += load_value(a + q * C * 2, FfnDtype::kBFloat16, c) * x[r * C + c];
      h[r * H + i + q] = sum;
    }
}

// Plain bfloat16 dot rows [i0, i1) against NR <= 4 input rows: 4 weight rows at a time for one input
// row, 2 for more (bf16_rows_avx512).
template <int NR>
EXPERTCACHE_FFN_AVX512 void dot_bf16_avx512(const uint8_t* w0, size_t C, const float* x, size_t i0, size_t i1,
                                            float* h, size_t H) {
  constexpr int RB = NR == 1 ? 4 : 2;
  size_t i = i0;
  for (; i + RB <= i1; i += RB) bf16_rows_avx512<NR, RB>(w0, C, x, i, h, H);
  for (; i < i1; ++i) bf16_rows_avx512<NR, 1>(w0, C, x, i, h, H);
}

// One block of Q (4 or 16) bfloat16 axpy weight rows (k .. k + Q - 1), columns [j0, body) in steps
// of 16, into the partial sums of NR <= 4 input rows: axpy_block's sums (the same order per column:
// the results are the AVX2 kernel's bit for bit), 16 columns a step, and with 32 registers the
// broadcast inputs of 4 input rows held at once where they fit beside the block's weights (each
// weight decoded once for them; else each FMA broadcasts its input from memory).
template <int Q, int NR>
EXPERTCACHE_FFN_AVX512 inline void bf16_axpy_block(const uint8_t* r0, size_t stride, const float* x, size_t R,
                                                   size_t k, size_t j0, size_t body, float* h, size_t C,
                                                   bool prefetch) {
  constexpr bool kHeld = Q * (NR + 1) <= 24;
  __m512 xb[kHeld ? NR : 1][kHeld ? Q : 1];
  if constexpr (kHeld)
    for (int r = 0; r < NR; ++r)
      for (int q = 0; q < Q; ++q) xb[r][q] = _mm512_set1_ps(x[r * R + k + q]);
#define EXPERTCACHE_AXPY_INPUT(r, q) (kHeld ? xb[kHeld ? (r) : 0][kHeld ? (q) : 0] : _mm512_set1_ps(x[(r) * R + k + (q)]))
  // The block after next, as axpy_block; a block of 16 rows: the next one.
  const uint8_t* next = r0 + (Q == 16 ? 1 : 2) * Q * stride;
  for (size_t j = j0; j < body; j += 16) {
    if (prefetch && ((j * 2) & 63) == 0)
      for (int q = 0; q < Q; ++q) _mm_prefetch(reinterpret_cast<const char*>(next + q * stride + j * 2), _MM_HINT_T0);
    __m512 w[Q];
    for (int q = 0; q < Q; ++q) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + q * stride + j * 2));
      w[q] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
    }
    for (int r = 0; r < NR; ++r) {
      float* hr = h + r * C + j;
      __m512 a = _mm512_fmadd_ps(w[0], EXPERTCACHE_AXPY_INPUT(r, 0), _mm512_loadu_ps(hr));
      for (int q = 1; q < Q; ++q) a = _mm512_fmadd_ps(w[q], EXPERTCACHE_AXPY_INPUT(r, q), a);
      _mm512_storeu_ps(hr, a);
    }
  }
#undef EXPERTCACHE_AXPY_INPUT
}

// Block rows k .. k + Q - 1 of a bfloat16 axpy into every input row's sums: columns [j0, body16) 16
// at a time, 4 input rows at a time (then 2, then 1); [body16, body8) by the AVX2 block.
template <int Q>
EXPERTCACHE_FFN_AVX512 inline void bf16_axpy_rows(const uint8_t* r0, size_t stride, const float* x, size_t nr,
                                                  size_t R, size_t k, size_t j0, size_t body16, size_t body8,
                                                  float* h, size_t C, bool ahead) {
  size_t r = 0;
  for (; r + 4 <= nr; r += 4) bf16_axpy_block<Q, 4>(r0, stride, x + r * R, R, k, j0, body16, h + r * C, C, ahead && r == 0);
  for (; r + 2 <= nr; r += 2) bf16_axpy_block<Q, 2>(r0, stride, x + r * R, R, k, j0, body16, h + r * C, C, ahead && r == 0);
  if (r < nr) bf16_axpy_block<Q, 1>(r0, stride, x + r * R, R, k, j0, body16, h + r * C, C, ahead && r == 0);
  if (body8 > body16) axpy_rows<Q>(PlainRows<FfnDtype::kBFloat16>{}, r0, stride, x, nr, R, k, body16, body8, h, C, false);
}

// A bfloat16 axpy of short rows, row by row: each weight row k's columns [j0, j1) into every input
// row's sums before row k + 1's (the same operations per column in the same order as
// axpy_plain_avx2: FMAs, 16 then 8 columns a step, and the columns past the last 8 by a multiply
// and an add), so the weights stream in order, where a block of rows read a column step at a time
// cuts a short row's stream into pieces the hardware's prefetch does not follow.
EXPERTCACHE_FFN_AVX512 void bf16_axpy_by_rows(const uint8_t* w, size_t stride, const float* x, size_t nr, size_t R,
                                              size_t j0, size_t body16, size_t body8, size_t j1, float* h, size_t C) {
  for (size_t k = 0; k < R; ++k) {
    const uint8_t* row = w + k * stride;
    size_t j = j0;
    for (; j < body16; j += 16) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j * 2));
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
      for (size_t r = 0; r < nr; ++r) {
        float* hr = h + r * C + j;
        _mm512_storeu_ps(hr, _mm512_fmadd_ps(v, _mm512_set1_ps(x[r * R + k]), _mm512_loadu_ps(hr)));
      }
    }
    for (; j < body8; j += 8) {
      const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j * 2));
      const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
      for (size_t r = 0; r < nr; ++r) {
        float* hr = h + r * C + j;
        _mm256_storeu_ps(hr, _mm256_fmadd_ps(v, _mm256_set1_ps(x[r * R + k]), _mm256_loadu_ps(hr)));
      }
    }
    for (; j < j1; ++j)
      for (size_t r = 0; r < nr; ++r) h[r * C + j] += x[r * R + k] * load_value(row, FfnDtype::kBFloat16, j);
  }
}

// Plain bfloat16 axpy columns [j0, j1) (M [inputs, outputs], as GPT-OSS's bf16 checkpoints): as
// axpy_plain_avx2, 16 columns a step. Not `wide` (the avx512 and amx paths, measured on an Intel
// Xeon), blocks of 4 weight rows, and one input row stays on the AVX2 kernel: it streamed its
// weights at memory speed either way, and was 2-7% slower there with 512-bit FMAs (bench.kernels,
// gpt-oss-20b, 3 rounds; 4 rows: 5.2-5.4 -> 3.8-3.9 ms). `wide` (the avx512-bf16 path: AMD Zen 4),
// blocks of 16 weight rows, one input row included: 16 streams in flight and the sums loaded and
// stored once a block, where blocks of 4 streamed one input row at 14-17 GB/s against a read's 21.
// One input row prefetches nothing ahead (beside 16 streams the hardware's prefetch does better:
// gpt-oss-20b 24-25 GB/s without, 20 with); more prefetch the next block (the block after next:
// 18 GB/s there, the next 21). bench.kernels, 1 thread, 5 rounds, against the avx512 path in the
// same rounds: one row 1.13x at the e2e shape and 1.41x at gpt-oss-20b's, two 1.11x / 1.40x, four
// 1.18x / 1.33x. Rows of at most kByRowsBytes (the e2e shape's down projection, 1 KiB) for one or
// two input rows: row by row (bf16_axpy_by_rows; a micro-benchmark of that projection alone, one
// input row: 18.6 GB/s against 10.6 in blocks of 16, at 2 KiB rows 14.7 against 16.1; the e2e
// shape's whole expert, 4 experts a call: one row 178-183 us against 267-277, two rows 213-241
// against 272-280, four rows 332-338 against 304-311, hence at most two).
EXPERTCACHE_FFN_AVX512 void axpy_bf16_avx512(const FfnProjection& p, const uint8_t* slot, const float* x, size_t nr,
                                             size_t j0, size_t j1, float* h, bool wide) {
  if (!wide && nr < 2) return axpy_plain_avx2<FfnDtype::kBFloat16>(p, slot, x, nr, j0, j1, h);
  const size_t C = p.outputs, R = p.inputs, stride = C * 2;
  const uint8_t* w = slot + p.weight_offset;
  const size_t body16 = j0 + ((j1 - j0) & ~size_t(15)), body8 = j0 + ((j1 - j0) & ~size_t(7));
  for (size_t r = 0; r < nr; ++r) std::memset(h + r * C + j0, 0, (j1 - j0) * sizeof(float));
  if (wide && nr <= kByRowsMostRows && (j1 - j0) * 2 <= kByRowsBytes) return bf16_axpy_by_rows(w, stride, x, nr, R, j0, body16, body8, j1, h, C);
  size_t k = 0;
  for (; wide && k + 16 <= R; k += 16) {
    const uint8_t* r0 = w + k * stride;
    bf16_axpy_rows<16>(r0, stride, x, nr, R, k, j0, body16, body8, h, C, nr > 1 && k + 32 <= R);
    for (size_t j = body8; j < j1; ++j)
      for (size_t i = 0; i < nr; ++i)
        for (int q = 0; q < 16; ++q)
          h[i * C + j] += x[i * R + k + q] * load_value(r0 + q * stride, FfnDtype::kBFloat16, j);
  }
  for (; k + 4 <= R; k += 4) {
    const uint8_t* r0 = w + k * stride;
    bf16_axpy_rows<4>(r0, stride, x, nr, R, k, j0, body16, body8, h, C, k + 12 <= R);
    for (size_t j = body8; j < j1; ++j)
      for (size_t i = 0; i < nr; ++i)
        for (int q = 0; q < 4; ++q) h[i * C + j] += x[i * R + k + q] * load_value(r0 + q * stride, FfnDtype::kBFloat16, j);
  }
  for (; k < R; ++k) {
    const uint8_t* row = w + k * stride;
    bf16_axpy_rows<1>(row, stride, x, nr, R, k, j0, body16, body8, h, C, false);
    for (size_t j = body8; j < j1; ++j)
      for (size_t i = 0; i < nr; ++i) h[i * C + j] += x[i * R + k] * load_value(row, FfnDtype::kBFloat16, j);
  }
}

// 16 floats rounded to bf16, as bf16_nearest_even.
EXPERTCACHE_FFN_AVX512 inline __m512 bf16_nearest_even16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// 16 FP8 weights times their block's scale, rounded to the compute dtype R: fp8_load8's decode,
// 16 at a time.
template <FfnDtype R, bool kNan>
EXPERTCACHE_FFN_AVX512 inline __m512 fp8_load16(const uint8_t* p, __m512 scale256) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i t = _mm256_slli_epi16(b, 7);
  __m256i h = _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));
  if constexpr (kNan) {
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7F));
    h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7E00)));  // fp16 NaN
  }
  __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), scale256);
  if constexpr (R == FfnDtype::kBFloat16) {
    const __m512 r = bf16_nearest_even16(v);
    if constexpr (kNan)
      v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, v);
    else
      v = r;
  } else if constexpr (R == FfnDtype::kFloat16) {
    v = _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  return v;
}

// The 16-wide part of one row's block of columns [c0, c1), then its 8-wide part (fp8_segment):
// returns the first column not done.
template <FfnDtype R, int NR, bool kNan>
EXPERTCACHE_FFN_AVX512 inline size_t fp8_segment16(const uint8_t* v, const float* x, size_t C, size_t c0, size_t c1,
                                                   __m512 s256, __m512 acc[NR], __m256 acc8[NR]) {
  size_t c = c0;
  for (; c + 16 <= c1; c += 16) {
    const __m512 w = fp8_load16<R, kNan>(v + c, s256);
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * C + c), acc[r]);
  }
  return fp8_segment<R, NR, kNan>(v, x, C, c, c1, _mm512_castps512_ps256(s256), acc8);
}

// FP8 dot rows, as dot_fp8_avx2 with 16 weights a step (its loop written again, for the reason
// dot_mxfp4_avx512 gives).
template <FfnDtype R, int NR>
EXPERTCACHE_FFN_AVX512 void dot_fp8_avx512(const FfnProjection& p, const uint8_t* slot, const float* x, size_t i0,
                                           size_t i1, float* h) {
  const size_t C = p.inputs, bn = p.block_cols, grid_cols = (C + bn - 1) / bn;
  const float* scale = reinterpret_cast<const float*>(slot + p.scale_offset);
  for (size_t i = i0; i < i1; ++i) {
    const uint8_t* v = slot + p.weight_offset + i * C;
    const float* srow = scale + (i / p.block_rows) * grid_cols;
    __m512 acc[NR];
    __m256 acc8[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps(), acc8[r] = _mm256_setzero_ps();
    float tail[NR] = {};
    for (size_t c0 = 0; c0 < C; c0 += bn) {
      const size_t c1 = std::min(C, c0 + bn);
      const float s = srow[c0 / bn];
      const __m512 s256 = _mm512_set1_ps(s * 256.0f);
      const bool special = fp8_special(v + c0, c1 - c0, s);
      size_t c = fp8_scale_overflows(s) ? c0
                 : special              ? fp8_segment16<R, NR, true>(v, x, C, c0, c1, s256, acc, acc8)
                                        : fp8_segment16<R, NR, false>(v, x, C, c0, c1, s256, acc, acc8);
      for (; c < c1; ++c) {
        const float w = round_to(e4m3_value(v[c]) * s, R);
        for (int r = 0; r < NR; ++r) tail[r] += w * x[r * C + c];
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m256 both = _mm256_add_ps(acc8[r], _mm256_add_ps(_mm512_castps512_ps256(acc[r]),
                                                               _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                                                   _mm512_castps_pd(acc[r]), 1))));
      h[r * p.outputs + i] = hsum(both) + tail[r];
    }
  }
}

template <int NR>
void dot_fp8_avx512_nr(const FfnProjection& p, const uint8_t* slot, const float* x, size_t o0, size_t o1, float* h,
                       FfnDtype compute) {
  switch (compute) {
    case FfnDtype::kBFloat16: return dot_fp8_avx512<FfnDtype::kBFloat16, NR>(p, slot, x, o0, o1, h);
    case FfnDtype::kFloat16: return dot_fp8_avx512<FfnDtype::kFloat16, NR>(p, slot, x, o0, o1, h);
    default: return dot_fp8_avx512<FfnDtype::kFloat32, NR>(p, slot, x, o0, o1, h);
  }
}

// Every weight of an MXFP4 projection decoded into bfloat16 words with its scale, as the AVX-512 and
// AMX kernels decode them (fp4_pair_words, fp4_one_avx512's table), prefetched as they are, and
// nothing else: the words' xor. The cost of a kernel that multiplies nothing (bench.kernels).
EXPERTCACHE_FFN_AVX512 uint64_t decode_mxfp4_avx512(const FfnProjection& p, const uint8_t* slot) {
  const size_t groups = p.inputs / kGroup, pairs = groups / 2, row_bytes = groups * kGroupBytes;
  const uint8_t* b = slot + p.weight_offset;
  const uint8_t* s = slot + p.scale_offset;
  __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0;
  __m256i tail = _mm256_setzero_si256();
  for (size_t i = 0; i < p.outputs; ++i) {
    const uint8_t* row = b + i * row_bytes;
    const uint8_t* rs = s + i * groups;
    for (size_t q = 0; q < pairs; ++q) {
      const uint8_t* bq = row + q * 2 * kGroupBytes;
      if ((q & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(bq) + kPrefetchBytes, _MM_HINT_T0);
      __m512i lo, hi;
      fp4_pair_words(bq, rs[2 * q], rs[2 * q + 1], lo, hi);
      acc0 = _mm512_xor_si512(acc0, lo);
      acc1 = _mm512_xor_si512(acc1, hi);
    }
    if (groups % 2) {
      const __m256i z = _mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (groups - 1) * kGroupBytes)));
      const __m256i table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kFp4Words.w[rs[groups - 1]]));
      tail = _mm256_xor_si256(tail, _mm256_xor_si256(_mm256_permutexvar_epi16(z, table),
                                                     _mm256_permutexvar_epi16(_mm256_srli_epi16(z, 4), table)));
    }
  }
  const __m512i all = _mm512_xor_si512(_mm512_xor_si512(acc0, acc1), _mm512_castsi256_si512(tail));
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, all);
  uint64_t out = 0;
  for (uint64_t v : lanes) out ^= v;
  return out;
}

void project_avx512(const FfnProjection& p, const uint8_t* slot, const float* x, size_t nr, size_t o0, size_t o1,
                    float* h, FfnDtype compute, bool wide) {
  const bool mxfp4 = p.encoding == FfnEncoding::kMxfp4;
  if (p.encoding == FfnEncoding::kPlain && p.form == FfnForm::kAxpy && p.weight_dtype == FfnDtype::kBFloat16)
    return axpy_bf16_avx512(p, slot, x, nr, o0, o1, h, wide);
  if (bf16_dot_avx512(p)) {
    const uint8_t* w = slot + p.weight_offset;
    for (size_t r = 0; r < nr; r += 4) {
      const float* xr = x + r * p.inputs;
      float* hr = h + r * p.outputs;
      switch (std::min<size_t>(4, nr - r)) {
        case 1: dot_bf16_avx512<1>(w, p.inputs, xr, o0, o1, hr, p.outputs); break;
        case 2: dot_bf16_avx512<2>(w, p.inputs, xr, o0, o1, hr, p.outputs); break;
        case 3: dot_bf16_avx512<3>(w, p.inputs, xr, o0, o1, hr, p.outputs); break;
        default: dot_bf16_avx512<4>(w, p.inputs, xr, o0, o1, hr, p.outputs); break;
      }
    }
    return;
  }
  if (!mxfp4 && !(p.encoding == FfnEncoding::kFp8 && p.form == FfnForm::kDot))
    return project_avx2(p, slot, x, nr, o0, o1, h, compute);
  for (size_t r = 0; r < nr; r += 4) {
    const float* xr = x + r * p.inputs;
    float* hr = h + r * p.outputs;
    switch (std::min<size_t>(4, nr - r)) {
      case 1: mxfp4 ? dot_mxfp4_avx512<1>(p, slot, xr, o0, o1, hr) : dot_fp8_avx512_nr<1>(p, slot, xr, o0, o1, hr, compute); break;
      case 2: mxfp4 ? dot_mxfp4_avx512<2>(p, slot, xr, o0, o1, hr) : dot_fp8_avx512_nr<2>(p, slot, xr, o0, o1, hr, compute); break;
      case 3: mxfp4 ? dot_mxfp4_avx512<3>(p, slot, xr, o0, o1, hr) : dot_fp8_avx512_nr<3>(p, slot, xr, o0, o1, hr, compute); break;
      default: mxfp4 ? dot_mxfp4_avx512<4>(p, slot, xr, o0, o1, hr) : dot_fp8_avx512_nr<4>(p, slot, xr, o0, o1, hr, compute); break;
    }
  }
}

// -- the element-wise stages, 8 values at a time ------------------------------------------------------

// round_to for 8 values.
EXPERTCACHE_FFN_AVX2 inline __m256 round8(__m256 v, FfnDtype d) {
  if (d == FfnDtype::kBFloat16)
    return _mm256_blendv_ps(bf16_nearest_even(v), _mm256_castsi256_ps(_mm256_set1_epi32(int(0xFFFF0000u))),
                            _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  if (d == FfnDtype::kFloat16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return v;
}

EXPERTCACHE_FFN_AVX2 inline __m256 load8_any(const uint8_t* base, FfnDtype dtype, size_t i) {
  switch (dtype) {
    case FfnDtype::kBFloat16: return load8<FfnDtype::kBFloat16>(base + 2 * i);
    case FfnDtype::kFloat16: return load8<FfnDtype::kFloat16>(base + 2 * i);
    default: return load8<FfnDtype::kFloat32>(base + 4 * i);
  }
}

// exp(x) for 8 floats (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp).
EXPERTCACHE_FFN_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.72283f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// v = round(round(h) + bias) over h[0 .. n), in place; bias indexed from o0 (or none).
EXPERTCACHE_FFN_AVX2 void finish8(float* h, size_t n, const uint8_t* bias, FfnDtype bias_dtype, size_t o0,
                                  FfnDtype d) {
  size_t o = 0;
  for (; o + 8 <= n; o += 8) {
    __m256 v = round8(_mm256_loadu_ps(h + o), d);
    if (bias) v = round8(_mm256_add_ps(v, load8_any(bias, bias_dtype, o0 + o)), d);
    _mm256_storeu_ps(h + o, v);
  }
  for (; o < n; ++o) {
    float v = round_to(h[o], d);
    if (bias) v = round_to(v + load_value(bias, bias_dtype, o0 + o), d);
    h[o] = v;
  }
}

// dst[o] = round(h[o] * w) for o in [o0, o1).
EXPERTCACHE_FFN_AVX2 void weigh8(const float* h, float* dst, size_t o0, size_t o1, float w, FfnDtype d) {
  const __m256 wv = _mm256_set1_ps(w);
  size_t o = o0;
  for (; o + 8 <= o1; o += 8) _mm256_storeu_ps(dst + o, round8(_mm256_mul_ps(_mm256_loadu_ps(h + o), wv), d));
  for (; o < o1; ++o) dst[o] = round_to(h[o] * w, d);
}

// The SiLU-gated and GPT-OSS activations for 8 intermediate features; false for another act.
EXPERTCACHE_FFN_AVX2 void activate8(const FfnSpec& s, const float* h, size_t inter, float* out, size_t& done) {
  const FfnDtype d = s.compute;
  const __m256 one = _mm256_set1_ps(1.0f);
  size_t i = 0;
  if (s.gate == FfnGate::kGptOss) {
    const __m256 lim = _mm256_set1_ps(s.limit), nlim = _mm256_set1_ps(-s.limit), alpha = _mm256_set1_ps(s.alpha);
    const __m256i deinterleave = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (; i + 8 <= inter; i += 8) {
      // 16 interleaved values: gate at even, up at odd positions.
      const __m256 a = _mm256_permutevar8x32_ps(_mm256_loadu_ps(h + 2 * i), deinterleave);
      const __m256 b = _mm256_permutevar8x32_ps(_mm256_loadu_ps(h + 2 * i + 8), deinterleave);
      __m256 g = _mm256_permute2f128_ps(a, b, 0x20), u = _mm256_permute2f128_ps(a, b, 0x31);
      // clamp keeping NaN: min/max return the second operand when either is NaN.
      g = _mm256_min_ps(lim, g);
      u = _mm256_max_ps(nlim, _mm256_min_ps(lim, u));
      const __m256 ga = round8(_mm256_mul_ps(g, alpha), d);
      const __m256 sig = round8(_mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), ga)))), d);
      const __m256 glu = round8(_mm256_mul_ps(g, sig), d);
      _mm256_storeu_ps(out + i, round8(_mm256_mul_ps(round8(_mm256_add_ps(u, one), d), glu), d));
    }
  } else if (s.act == FfnAct::kSilu) {
    const bool halves = s.gate == FfnGate::kGluHalves;
    for (; i + 8 <= inter; i += 8) {
      const __m256 g = _mm256_loadu_ps(h + i);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
      __m256 v = round8(_mm256_div_ps(g, _mm256_add_ps(one, e)), d);
      if (halves) v = round8(_mm256_mul_ps(v, _mm256_loadu_ps(h + inter + i)), d);
      _mm256_storeu_ps(out + i, v);
    }
  }
  done = i;
}

#ifdef EXPERTCACHE_FFN_HAS_AMX
// -- AMX BF16: MXFP4 dot rows for a bfloat16 compute dtype, 16 weight rows at a time ---------------
//
// C[16 weight rows][N input rows] += A[16][32 words] . B[16 dwords][N]: tdpbf16ps multiplies pairs of
// bfloat16 words (exact products, float32 sums, rounded to nearest even). A tile holds 16 weight
// rows' decoded words of one K-chunk of 32 (fp4_pair_words' `lo` or `hi` of a pair of groups, or a
// last group's lo and hi); B the same chunk's inputs, as bfloat16 words in mxfp4_position_bf16 order,
// laid out per chunk as [16 dwords][N rows] (amx_input_index). AMX reads subnormal operands as zero
// and flushes subnormal sums: a call whose inputs hold a subnormal number, or whose weight rows
// have a scale that makes values subnormal, is left to the AVX-512 kernel (project_mxfp4_amx
// returns false).

constexpr size_t kAmxRows = 16;         // weight rows per tile (M) and input rows per B tile (N) at most
constexpr size_t kAmxPairs = 8;         // pairs of groups decoded per round (16 KiB of staging)

// The tiles of project_mxfp4_amx: tmm0 C [16][16] float; tmm1, tmm2 A [16][32 words]; tmm3, tmm4 B
// [16][16 dwords] (64 bytes a row each). A constant in memory: the compiler does not see
// ldtilecfg read the stores of a local one, and drops them.
struct alignas(64) AmxConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
constexpr AmxConfig kAmxConfig = {1, 0, {}, {64, 64, 64, 64, 64}, {16, 16, 16, 16, 16}};

// Configures the calling thread's tiles until amx_release (per batch of calls, not kept: torch's
// oneDNN kernels configure and release the tiles of the same threads).
EXPERTCACHE_FFN_AMX void amx_configure() { _tile_loadconfig(&kAmxConfig); }
EXPERTCACHE_FFN_AMX void amx_release() { _tile_release(); }

// An MXFP4 projection's weight rows [o0, o1) (at most 16) against nr input rows whose words are at
// xv, in blocks of 16 rows (amx_input_index; a block's rows past nr are read, their sums dropped):
// h[r * outputs + i]. The tiles are configured (amx_configure). False, nothing written, where a
// scale of those rows makes values subnormal.
EXPERTCACHE_FFN_AMX bool project_mxfp4_amx(const FfnProjection& p, const uint8_t* slot, const uint16_t* xv,
                                           size_t nr, size_t o0, size_t o1, float* h) {
  const size_t C = p.inputs, groups = C / kGroup, pairs = groups / 2, row_bytes = groups * kGroupBytes;
  const uint8_t* b = slot + p.weight_offset;
  const uint8_t* s = slot + p.scale_offset;
  if (!scales_normal(s, groups, o0, o1)) return false;
  const size_t rows = o1 - o0;
  alignas(64) uint16_t stage[kAmxPairs][2][kAmxRows][32];
  alignas(64) float c[kAmxRows * kAmxRows];
  for (size_t n0 = 0; n0 < nr; n0 += kAmxRows) {
    const size_t n = std::min(kAmxRows, nr - n0);
    const uint16_t* x = xv + n0 * C;  // this block of input rows: per chunk, [16 dwords][16 rows]
    constexpr size_t chunk_words = 32 * kAmxRows;
    _tile_zero(0);
    for (size_t q0 = 0; q0 < pairs; q0 += kAmxPairs) {
      const size_t qn = std::min(kAmxPairs, pairs - q0);
      for (size_t m = 0; m < kAmxRows; ++m) {
        const uint8_t* row = b + (o0 + std::min(m, rows - 1)) * row_bytes;  // a missing row repeats the last
        const uint8_t* rs = s + (o0 + std::min(m, rows - 1)) * groups;
        for (size_t q = 0; q < qn; ++q) {
          const uint8_t* bq = row + (q0 + q) * 2 * kGroupBytes;
          if ((q & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(bq) + kPrefetchBytes, _MM_HINT_T0);
          __m512i lo, hi;
          fp4_pair_words(bq, rs[2 * (q0 + q)], rs[2 * (q0 + q) + 1], lo, hi);
          _mm512_store_si512(stage[q][0][m], lo);
          _mm512_store_si512(stage[q][1][m], hi);
        }
      }
      for (size_t q = 0; q < qn; ++q) {
        const size_t chunk = 2 * (q0 + q);
        _tile_loadd(1, stage[q][0], 64);
        _tile_loadd(2, stage[q][1], 64);
        _tile_loadd(3, x + chunk * chunk_words, 64);
        _tile_loadd(4, x + (chunk + 1) * chunk_words, 64);
        _tile_dpbf16ps(0, 1, 3);
        _tile_dpbf16ps(0, 2, 4);
      }
    }
    if (groups % 2) {  // the last group alone: its lo and hi words make one chunk
      const size_t g = groups - 1;
      for (size_t m = 0; m < kAmxRows; ++m) {
        const size_t i = o0 + std::min(m, rows - 1);
        const __m256i z =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i * row_bytes + g * kGroupBytes)));
        const __m256i table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kFp4Words.w[s[i * groups + g]]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(stage[0][0][m]), _mm256_permutexvar_epi16(z, table));
        _mm256_store_si256(reinterpret_cast<__m256i*>(stage[0][0][m] + 16),
                           _mm256_permutexvar_epi16(_mm256_srli_epi16(z, 4), table));
      }
      _tile_loadd(1, stage[0][0], 64);
      _tile_loadd(3, x + g * chunk_words, 64);
      _tile_dpbf16ps(0, 1, 3);
    }
    _tile_stored(0, c, 64);
    for (size_t m = 0; m < rows; ++m)
      for (size_t r = 0; r < n; ++r) h[(n0 + r) * p.outputs + o0 + m] = c[m * kAmxRows + r];
  }
  return true;
}
#endif  // EXPERTCACHE_FFN_HAS_AMX

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
#ifdef EXPERTCACHE_FFN_HAS_BF16
bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}
#else  // no vdpbf16ps kernel: no avx512-bf16 path
bool cpu_has_avx512_bf16() { return false; }
bool project_words_bf16(const FfnProjection&, const uint8_t*, const uint16_t*, size_t, size_t, size_t, float*) {
  return false;
}
#endif
#ifdef EXPERTCACHE_FFN_HAS_AMX
// AMX with BF16 on this CPU, and the tile data this process may use (Linux asks for it once).
bool amx_ready() {
  static const bool ready = [] {
    unsigned a, b, c, d;
    if (!cpu_has_avx512() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx = (d >> 22 & 1) && (d >> 24 & 1);  // AMX-BF16, AMX-TILE
#if defined(__linux__)
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return amx && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ready;
}
#endif
#else
bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }
bool cpu_has_avx512_bf16() { return false; }
bool project_words_bf16(const FfnProjection&, const uint8_t*, const uint16_t*, size_t, size_t, size_t, float*) {
  return false;
}
void project_avx2(const FfnProjection&, const uint8_t*, const float*, size_t, size_t, size_t, float*, FfnDtype) {}
void project_avx512(const FfnProjection&, const uint8_t*, const float*, size_t, size_t, size_t, float*, FfnDtype,
                    bool) {}
uint64_t decode_mxfp4_avx512(const FfnProjection&, const uint8_t*) { return 0; }
void finish8(float*, size_t, const uint8_t*, FfnDtype, size_t, FfnDtype) {}
void activate8(const FfnSpec&, const float*, size_t, float*, size_t& done) { done = 0; }
void weigh8(const float*, float*, size_t, size_t, float, FfnDtype) {}
#endif

#ifndef EXPERTCACHE_FFN_HAS_AMX  // no AMX kernel: no AMX path
bool amx_ready() { return false; }
void amx_configure() {}
void amx_release() {}
bool project_mxfp4_amx(const FfnProjection&, const uint8_t*, const uint16_t*, size_t, size_t, size_t, float*) {
  return false;
}
#endif

void project_portable(const FfnProjection& p, const uint8_t* slot, const float* x, size_t nr, size_t o0, size_t o1,
                      float* h, FfnDtype compute) {
  if (p.form == FfnForm::kAxpy)
    axpy_portable(p, slot, x, nr, o0, o1, h, compute);
  else
    dot_portable(p, slot, x, nr, o0, o1, h, compute);
}

// The calling thread's AMX tiles, configured at the first `use` and released when it goes.
class AmxTiles {
 public:
  AmxTiles() = default;
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
  ~AmxTiles() {
    if (configured_) amx_release();
  }
  void use() {
    if (!configured_) amx_configure();
    configured_ = true;
  }
  size_t items = 0;  // run by the AMX kernel

 private:
  bool configured_ = false;
};

// An MXFP4 projection in bfloat16 by the AMX kernel where `amx` holds (the ExpertFfn's path and
// inputs allow it) and it has the rows for it; false where it is left to `project`.
bool project_amx(bool amx, AmxTiles& tiles, const FfnProjection& p, const uint8_t* slot, const uint16_t* xv,
                 size_t nr, size_t o0, size_t o1, float* h) {
  if (!amx || nr < kAmxMinRows) return false;
  tiles.use();
  const bool ran = project_mxfp4_amx(p, slot, xv, nr, o0, o1, h);
  tiles.items += ran;
  return ran;
}

// h[r][o] for o in [o0, o1), r < nr: the projection by the kernels of `path`.
void project(FfnPath path, const FfnProjection& p, const uint8_t* slot, const float* x, size_t nr, size_t o0,
             size_t o1, float* h, FfnDtype compute) {
  switch (path) {
    case FfnPath::kAvx512Bf16:  // its own kernels are project_words_bf16's (MXFP4, bf16 dot rows; bfloat16)
      return project_avx512(p, slot, x, nr, o0, o1, h, compute, true);
    case FfnPath::kAmx:  // its own kernel is project_mxfp4_amx's, for MXFP4 in bfloat16
    case FfnPath::kAvx512: return project_avx512(p, slot, x, nr, o0, o1, h, compute, false);
    case FfnPath::kAvx2: return project_avx2(p, slot, x, nr, o0, o1, h, compute);
    default: return project_portable(p, slot, x, nr, o0, o1, h, compute);
  }
}

// Outputs per work item: a few rows of a dot matrix (each row its own stream), or a thread's share
// of an axpy matrix's columns (its rows are streamed, so the wider the better).
size_t chunk_of(const FfnProjection& p, int threads) {
  if (p.form == FfnForm::kDot) return kDotChunk;
  const size_t share = (p.outputs + size_t(threads) - 1) / size_t(threads);
  return std::max(kAxpyChunk, (share + 7) & ~size_t(7));
}
size_t items_of(const FfnProjection& p, int threads) {
  return (p.outputs + chunk_of(p, threads) - 1) / chunk_of(p, threads);
}

void check_projection(const FfnProjection& p, const char* name, size_t slot_bytes) {
  const std::string what = std::string("expert ffn: ") + name + " ";
  if (p.inputs == 0 || p.outputs == 0) throw std::invalid_argument(what + "has no inputs or outputs");
  if (p.form == FfnForm::kAxpy && p.encoding == FfnEncoding::kMxfp4)
    throw std::invalid_argument(what + "is MXFP4: only plain and FP8 weights can be read transposed (axpy)");
  if (p.encoding == FfnEncoding::kMxfp4 && p.inputs % kGroup)
    throw std::invalid_argument(what + "is MXFP4 with inputs not a multiple of 32");
  if (p.encoding == FfnEncoding::kFp8 && (p.block_rows == 0 || p.block_cols == 0))
    throw std::invalid_argument(what + "is FP8 with an empty block");
  if (p.extent() > slot_bytes)
    throw std::invalid_argument(what + "reads " + std::to_string(p.extent()) + " bytes, past the slot's " +
                                std::to_string(slot_bytes));
}

}  // namespace

size_t FfnProjection::extent() const {
  size_t end = 0;
  switch (encoding) {
    case FfnEncoding::kPlain: end = weight_offset + inputs * outputs * dtype_bytes(weight_dtype); break;
    case FfnEncoding::kMxfp4: {
      const size_t groups = inputs / kGroup;
      end = std::max(weight_offset + outputs * groups * kGroupBytes, scale_offset + outputs * groups);
      break;
    }
    case FfnEncoding::kFp8: {
      const size_t R = form == FfnForm::kDot ? outputs : inputs, C = form == FfnForm::kDot ? inputs : outputs;
      const size_t grid = ((R + block_rows - 1) / block_rows) * ((C + block_cols - 1) / block_cols);
      end = std::max(weight_offset + R * C, scale_offset + grid * 4);
      break;
    }
  }
  if (bias_offset >= 0) end = std::max(end, size_t(bias_offset) + outputs * dtype_bytes(bias_dtype));
  return end;
}

float ffn_round(float v, FfnDtype dtype) { return round_to(v, dtype); }

float ffn_load(const uint8_t* p, FfnDtype dtype, size_t i) { return load_value(p, dtype, i); }

bool ffn_cpu_has_avx2() { return cpu_has_avx2(); }

std::vector<FfnPath> ffn_paths() {
  std::vector<FfnPath> out;
  // AMX first where it runs (Intel, where vdpbf16ps measured no faster than the fma kernels below
  // the 5 rows AMX takes over from); else avx512-bf16 where the CPU has AVX-512 BF16 (AMD Zen 4).
  if (amx_ready()) out.push_back(FfnPath::kAmx);
  if (cpu_has_avx512_bf16()) out.push_back(FfnPath::kAvx512Bf16);
  if (cpu_has_avx512()) out.push_back(FfnPath::kAvx512);
  if (cpu_has_avx2()) out.push_back(FfnPath::kAvx2);
  out.push_back(FfnPath::kPortable);
  return out;
}

const char* ffn_path_name(FfnPath path) {
  switch (path) {
    case FfnPath::kAmx: return "amx";
    case FfnPath::kAvx512Bf16: return "avx512-bf16";
    case FfnPath::kAvx512: return "avx512";
    case FfnPath::kAvx2: return "avx2";
    case FfnPath::kPortable: return "portable";
    default: return "auto";
  }
}

void ffn_plain_dot(const uint8_t* w, FfnDtype wdtype, size_t inputs, size_t outputs, const float* x, size_t rows,
                   float* out, bool avx2) {
  FfnProjection p;
  p.weight_dtype = wdtype;
  p.inputs = inputs;
  p.outputs = outputs;
  if (avx2)
    project_avx2(p, w, x, rows, 0, outputs, out, wdtype);
  else
    project_portable(p, w, x, rows, 0, outputs, out, wdtype);
}

bool ffn_plain_dot_bf16(const uint8_t* w, size_t inputs, size_t outputs, const float* x, size_t rows, float* out,
                        std::vector<uint16_t>& words) {
#ifdef EXPERTCACHE_FFN_HAS_BF16
  static const bool has = cpu_has_avx512_bf16();
  if (!has) return false;
  const size_t n = rows * inputs;
  if (words.size() < n) words.resize(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, 4);
    // Only a bfloat16 value is a word as it is; vdpbf16ps reads a subnormal one as zero.
    if ((bits & 0xFFFFu) || ((bits & 0x7F800000u) == 0 && (bits & 0x007F0000u))) return false;
    words[i] = uint16_t(bits >> 16);
  }
  FfnProjection p;  // the FFN's plain bfloat16 dot rows, the weights at w
  p.encoding = FfnEncoding::kPlain;
  p.form = FfnForm::kDot;
  p.weight_dtype = FfnDtype::kBFloat16;
  p.inputs = inputs;
  p.outputs = outputs;
  return project_words_bf16(p, w, words.data(), rows, 0, outputs, out);
#else
  (void)w, (void)inputs, (void)outputs, (void)x, (void)rows, (void)out, (void)words;
  return false;
#endif
}

bool ffn_cpu_has_avx512_bf16() { return cpu_has_avx512_bf16(); }

// -- a small pool: the caller and threads - 1 workers take items of one job until none is left ----------
struct FfnPool {
  explicit FfnPool(int workers) {
    for (int i = 0; i < workers; ++i) threads.emplace_back([this] { work(); });
  }
  ~FfnPool() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
      ++generation;
    }
    cv.notify_all();
    for (auto& t : threads) t.join();
  }

  // Runs fn(0 .. items - 1) on the caller and the workers; returns when every item is done and no
  // worker still holds the job (a worker enters only while the job is published, under the lock).
  void run(size_t items, const std::function<void(size_t)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu);
      job = &fn;
      total = items;
      next.store(0);
      done.store(0);
      ++generation;
    }
    cv.notify_all();
    take(&fn, items);
    while (done.load(std::memory_order_acquire) < items) std::this_thread::yield();
    {
      std::lock_guard<std::mutex> lock(mu);
      job = nullptr;
    }
    while (active.load(std::memory_order_acquire) > 0) std::this_thread::yield();
  }

 private:
  void take(const std::function<void(size_t)>* fn, size_t items) {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= items) return;
      (*fn)(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
  void work() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(size_t)>* fn;
      size_t items;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return generation != seen; });
        seen = generation;
        if (stop) return;
        if (job == nullptr) continue;
        fn = job;
        items = total;
        active.fetch_add(1);
      }
      take(fn, items);
      active.fetch_sub(1, std::memory_order_release);
    }
  }

  std::vector<std::thread> threads;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;
  bool stop = false;
  const std::function<void(size_t)>* job = nullptr;
  size_t total = 0;
  std::atomic<size_t> next{0}, done{0};
  std::atomic<int> active{0};
};

struct ExpertFfn::Task {
  const uint8_t* arena;
  const int64_t* slots;
  size_t n;
  const int64_t* bounds;
  const int64_t* rows;
  const float* weights;
  float* out;
  size_t items1, items2;  // work items per expert, first and down projection
  // AMX: its inputs prepared (an expert has the rows for it); dp: the avx512-bf16 kernel's inputs
  // prepared (a row's words at row * inputs); the first's / the down projection's inputs hold a
  // subnormal number (AVX-512 then).
  bool amx = false, dp = false, subnormal1 = false, subnormal2 = false;
};

ExpertFfn::ExpertFfn(const FfnSpec& spec) : spec_(spec) {
  check_projection(spec.first, "first projection", spec.slot_bytes);
  check_projection(spec.down, "down projection", spec.slot_bytes);
  const size_t inter = spec.down.inputs;
  const size_t want = spec.gate == FfnGate::kPlain ? inter : 2 * inter;
  if (spec.first.outputs != want)
    throw std::invalid_argument("expert ffn: the first projection has " + std::to_string(spec.first.outputs) +
                                " outputs, the activation needs " + std::to_string(want) + " for " +
                                std::to_string(inter) + " intermediate features");
  const std::vector<FfnPath> paths = ffn_paths();
  if (spec.path == FfnPath::kAuto) {
    path_ = paths.front();
  } else if (std::find(paths.begin(), paths.end(), spec.path) != paths.end()) {
    path_ = spec.path;
  } else {
    std::string runs;
    for (FfnPath p : paths) runs += std::string(runs.empty() ? "" : ", ") + ffn_path_name(p);
    throw std::invalid_argument(std::string("expert ffn: path '") + ffn_path_name(spec.path) +
                                "' does not run on this CPU (it runs " + runs + ")");
  }
  // Where each input of an MXFP4 projection, or of a bfloat16 dot one on the AVX-512 kernels, goes
  // for this path's kernel, once (empty: as it is).
  const bool avx512 = path_ == FfnPath::kAvx512 || path_ == FfnPath::kAvx512Bf16 || path_ == FfnPath::kAmx;
  auto order = [&](const FfnProjection& p) {
    std::vector<uint32_t> at;
    if (avx512 && bf16_dot_avx512(p)) {
      at.resize(p.inputs);
      for (size_t c = 0; c < p.inputs; ++c) at[c] = uint32_t(bf16_position_avx512(c, p.inputs));
      return at;
    }
    if (path_ == FfnPath::kPortable || p.encoding != FfnEncoding::kMxfp4) return at;
    at.resize(p.inputs);
    for (size_t c = 0; c < p.inputs; ++c) at[c] = uint32_t(mxfp4_input_position(path_, c, p.inputs));
    return at;
  };
  first_order_ = order(spec.first);
  down_order_ = order(spec.down);
  // AMX and avx512-bf16: MXFP4 in a bfloat16 compute dtype, its inputs also as bfloat16 words (exact:
  // values of the compute dtype) in the kernel's order; avx512-bf16 also plain bfloat16 dot rows,
  // their words in natural order.
  const bool amx = path_ == FfnPath::kAmx;
  auto words = [&](const FfnProjection& p) {
    std::vector<uint32_t> at;
    if ((!amx && path_ != FfnPath::kAvx512Bf16) || spec.compute != FfnDtype::kBFloat16) return at;
    if (path_ == FfnPath::kAvx512Bf16 && bf16_dot_avx512(p)) {
      at.resize(p.inputs);
      for (size_t c = 0; c < p.inputs; ++c) at[c] = uint32_t(c);
      return at;
    }
    if (p.encoding != FfnEncoding::kMxfp4) return at;
    at.resize(p.inputs);
    for (size_t c = 0; c < p.inputs; ++c) {
      const size_t w = mxfp4_position_bf16(c, p.inputs);
      at[c] = uint32_t(amx ? amx_input_index(w, 0) : w);
    }
    return at;
  };
  first_words_ = words(spec.first);
  down_words_ = words(spec.down);
}

ExpertFfn::~ExpertFfn() = default;

const char* ExpertFfn::path() const { return ffn_path_name(path_); }

uint64_t ExpertFfn::decode_only(const uint8_t* slot) const {
  if (path_ != FfnPath::kAvx512 && path_ != FfnPath::kAvx512Bf16 && path_ != FfnPath::kAmx)
    throw std::invalid_argument(std::string("expert ffn: decode_only runs on the avx512, avx512-bf16 and amx paths, not '") +
                                ffn_path_name(path_) + "'");
  uint64_t out = 0;
  bool any = false;
  for (const FfnProjection* p : {&spec_.first, &spec_.down}) {
    if (p->encoding != FfnEncoding::kMxfp4) continue;
    out ^= decode_mxfp4_avx512(*p, slot);
    any = true;
  }
  if (!any) throw std::invalid_argument("expert ffn: decode_only needs an MXFP4 projection; this expert has none");
  return out;
}

void ExpertFfn::set_threads(int threads) {
  threads = std::max(1, threads);
  if (threads == threads_) return;
  pool_.reset();
  threads_ = threads;
  if (threads > 1) pool_ = std::make_unique<FfnPool>(threads - 1);
}

void ExpertFfn::first_items(const Task& t, size_t begin, size_t end) {
  const FfnProjection& p = spec_.first;
  const size_t chunk = chunk_of(p, threads_);
  const bool amx = t.amx && !first_words_.empty() && !t.subnormal1;
  const bool dp = t.dp && !first_words_.empty() && !t.subnormal1;
  AmxTiles tiles;
  for (size_t item = begin; item < end; ++item) {
    const size_t e = item / t.items1, part = item % t.items1;
    const size_t o0 = part * chunk, o1 = std::min(p.outputs, o0 + chunk);
    const size_t r0 = size_t(t.bounds[e]), nr = size_t(t.bounds[e + 1]) - r0;
    const uint8_t* slot = t.arena + size_t(t.slots[e]) * spec_.slot_bytes;
    const float* x = xin_.data() + r0 * p.inputs;
    float* h = h1_.data() + r0 * p.outputs;
    const uint16_t* words = amx ? xv_.data() + size_t(amx_rows_[r0].first) * p.inputs : nullptr;
    if (!(dp && project_words_bf16(p, slot, xv_.data() + r0 * p.inputs, nr, o0, o1, h)) &&
        !project_amx(amx, tiles, p, slot, words, nr, o0, o1, h))
      project(path_, p, slot, x, nr, o0, o1, h, spec_.compute);
    // The projection's output and bias add, rounded as transformers' are.
    const FfnDtype d = spec_.compute;
    const uint8_t* bias = p.bias_offset >= 0 ? slot + p.bias_offset : nullptr;
    for (size_t r = 0; r < nr; ++r) {
      float* hr = h + r * p.outputs + o0;
      if (path_ != FfnPath::kPortable) {
        finish8(hr, o1 - o0, bias, p.bias_dtype, o0, d);
        continue;
      }
      for (size_t o = o0; o < o1; ++o) {
        float v = round_to(hr[o - o0], d);
        if (bias) v = round_to(v + load_value(bias, p.bias_dtype, o), d);
        hr[o - o0] = v;
      }
    }
  }
  if (tiles.items) amx_items_.fetch_add(tiles.items, std::memory_order_relaxed);
}

void ExpertFfn::down_items(const Task& t, size_t begin, size_t end) {
  const FfnProjection& p = spec_.down;
  const size_t chunk = chunk_of(p, threads_), H = p.outputs;
  const bool amx = t.amx && !down_words_.empty() && !t.subnormal2;
  const bool dp = t.dp && !down_words_.empty() && !t.subnormal2;
  AmxTiles tiles;
  const FfnDtype d = spec_.compute;
  // The rows' products land in a per-call scratch row block, then weighted into out.
  for (size_t item = begin; item < end; ++item) {
    const size_t e = item / t.items2, part = item % t.items2;
    const size_t o0 = part * chunk, o1 = std::min(H, o0 + chunk);
    const size_t r0 = size_t(t.bounds[e]), nr = size_t(t.bounds[e + 1]) - r0;
    const uint8_t* slot = t.arena + size_t(t.slots[e]) * spec_.slot_bytes;
    const float* a = act_.data() + r0 * p.inputs;
    float* h = h1_.data() + r0 * H;  // reused: the first projection's outputs are consumed
    const uint16_t* words = amx ? av_.data() + size_t(amx_rows_[r0].first) * p.inputs : nullptr;
    if (!(dp && project_words_bf16(p, slot, av_.data() + r0 * p.inputs, nr, o0, o1, h)) &&
        !project_amx(amx, tiles, p, slot, words, nr, o0, o1, h))
      project(path_, p, slot, a, nr, o0, o1, h, d);
    const uint8_t* bias = p.bias_offset >= 0 ? slot + p.bias_offset : nullptr;
    for (size_t r = 0; r < nr; ++r) {
      const float w = t.weights[r0 + r];
      float* dst = t.out + size_t(t.rows[r0 + r]) * H;
      float* hr = h + r * H;
      size_t o = o0;
      if (path_ != FfnPath::kPortable) {
        finish8(hr + o0, o1 - o0, bias, p.bias_dtype, o0, d);
        weigh8(hr, dst, o0, o1, w, spec_.round_weighted ? d : FfnDtype::kFloat32);
        continue;
      }
      for (; o < o1; ++o) {
        float v = round_to(hr[o], d);
        if (bias) v = round_to(v + load_value(bias, p.bias_dtype, o), d);
        v *= w;
        dst[o] = spec_.round_weighted ? round_to(v, d) : v;
      }
    }
  }
  if (tiles.items) amx_items_.fetch_add(tiles.items, std::memory_order_relaxed);
}

void ExpertFfn::run(const uint8_t* arena, const int64_t* slots, size_t n, const int64_t* bounds, const int64_t* rows,
                    const int64_t* tokens, const float* weights, const float* x, float* out) {
  if (n == 0) return;
  const FfnProjection& first = spec_.first;
  const FfnProjection& down = spec_.down;
  const size_t total = size_t(bounds[n]);
  const size_t H = first.inputs, inter = down.inputs;
  const FfnDtype d = spec_.compute;
  if (xin_.size() < total * H) xin_.resize(total * H);
  if (h1_.size() < total * std::max(first.outputs, down.outputs))
    h1_.resize(total * std::max(first.outputs, down.outputs));
  if (act_.size() < total * inter) act_.resize(total * inter);
  if (!down_order_.empty() && nat_.size() < total * inter) nat_.resize(total * inter);
  // AMX, where a projection runs on it and an expert has the rows for it (a decode step of one
  // request has not: none of this then): each expert's rows in blocks of 16, the last one padded,
  // and each row's block (its first row there) and place in it (amx_rows_; an expert's first row's
  // block starts its rows).
  size_t most_rows = 0;
  for (size_t e = 0; e < n; ++e) most_rows = std::max(most_rows, size_t(bounds[e + 1] - bounds[e]));
  const bool words = !first_words_.empty() || !down_words_.empty();
  const bool amx = path_ == FfnPath::kAmx && words && most_rows >= kAmxMinRows;
  // avx512-bf16: every call, a row's words at row * inputs.
  const bool dp = path_ == FfnPath::kAvx512Bf16 && words;
  if (dp) {
    if (!first_words_.empty() && xv_.size() < total * H) xv_.resize(total * H);
    if (!down_words_.empty() && av_.size() < total * inter) av_.resize(total * inter);
  }
  if (amx) {
    if (amx_rows_.size() < total) amx_rows_.resize(total);
    size_t at = 0;
    for (size_t e = 0; e < n; ++e) {
      for (size_t r = size_t(bounds[e]); r < size_t(bounds[e + 1]); ++r) {
        const size_t i = r - size_t(bounds[e]);
        amx_rows_[r] = {uint32_t(at + i / 16 * 16), uint32_t(i % 16)};
      }
      at += (size_t(bounds[e + 1]) - size_t(bounds[e]) + 15) / 16 * 16;
    }
    if (!first_words_.empty() && xv_.size() < at * H) xv_.resize(at * H);
    if (!down_words_.empty() && av_.size() < at * inter) av_.resize(at * inter);
  }
  // Row r's C values (as bfloat16 words) into `dst`, a projection's AMX inputs (`at`: each input's
  // index there for the first row of a block) or avx512-bf16 ones (each input's index in its row,
  // row r at r * C); true where one is subnormal.
  auto put_words = [&](uint16_t* dst, const std::vector<uint32_t>& at, size_t C, size_t r, const float* v) {
    uint16_t* block = dp ? dst + r * C : dst + size_t(amx_rows_[r].first) * C + 2 * size_t(amx_rows_[r].n);
    const uint32_t* index = at.data();
    bool subnormal = false;
    for (size_t c = 0; c < C; ++c) {
      const uint16_t w = bf16_word(v[c]);
      subnormal |= subnormal_word(w);
      block[index[c]] = w;
    }
    return subnormal;
  };
  // Inputs gathered by token, in the order the first projection's kernel reads them.
  const uint32_t* first_at = first_order_.empty() ? nullptr : first_order_.data();
  bool subnormal1 = false;
  for (size_t r = 0; r < total; ++r) {
    const float* src = x + size_t(tokens[r]) * H;
    if ((amx || dp) && !first_words_.empty())
      subnormal1 |= put_words(xv_.data(), first_words_, H, r, src);
    float* dst = xin_.data() + r * H;
    if (first_at)
      for (size_t c = 0; c < H; ++c) dst[first_at[c]] = src[c];
    else
      std::memcpy(dst, src, H * sizeof(float));
  }
  Task t{arena, slots, n, bounds, rows, weights, out, items_of(first, threads_), items_of(down, threads_)};
  t.amx = amx;
  t.dp = dp;
  t.subnormal1 = subnormal1;
  auto parallel = [&](size_t items, auto&& body) {
    if (pool_ && items > 1) {
      const std::function<void(size_t)> fn = [&](size_t i) { body(i, i + 1); };
      pool_->run(items, fn);
    } else {
      body(0, items);
    }
  };
  parallel(n * t.items1, [&](size_t b, size_t e) { first_items(t, b, e); });
  // The activation, each op rounded as transformers' is; written in the down kernel's order.
  const uint32_t* down_at = down_order_.empty() ? nullptr : down_order_.data();
  const bool permute_down = down_at != nullptr;
  std::atomic<bool> subnormal2{false};
  auto activate = [&](size_t b, size_t e) {
    for (size_t r = b; r < e; ++r) {
      const float* h = h1_.data() + r * first.outputs;
      // Natural order into `a`, or into the row's own scratch when the down kernel permutes.
      float* a = (permute_down ? nat_.data() : act_.data()) + r * inter;
      size_t start = 0;
      if (path_ != FfnPath::kPortable) activate8(spec_, h, inter, a, start);
      for (size_t i = start; i < inter; ++i) {
        float v;
        if (spec_.gate == FfnGate::kGluHalves) {
          v = round_to(round_to(act_value(spec_.act, h[i]), d) * h[inter + i], d);
        } else if (spec_.gate == FfnGate::kGptOss) {
          float g = h[2 * i], u = h[2 * i + 1];
          const float lim = spec_.limit;
          if (g > lim) g = lim;  // clamp(max=limit); NaN stays NaN
          if (u > lim) u = lim;
          if (u < -lim) u = -lim;
          const float ga = round_to(g * spec_.alpha, d);
          const float sig = round_to(1.0f / (1.0f + std::exp(-ga)), d);
          const float glu = round_to(g * sig, d);
          v = round_to(round_to(u + 1.0f, d) * glu, d);
        } else {
          v = round_to(act_value(spec_.act, h[i]), d);
        }
        a[i] = v;
      }
      if (permute_down) {
        float* dst = act_.data() + r * inter;
        for (size_t i = 0; i < inter; ++i) dst[down_at[i]] = a[i];
      }
      if ((amx || dp) && !down_words_.empty()) {
        if (put_words(av_.data(), down_words_, inter, r, a)) subnormal2.store(true, std::memory_order_relaxed);
      }
    }
  };
  parallel(total, activate);
  t.subnormal2 = subnormal2.load(std::memory_order_relaxed);
  parallel(n * t.items2, [&](size_t b, size_t e) { down_items(t, b, e); });
}

}  // namespace expertcache
