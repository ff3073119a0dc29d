// Expert decode (csrc/include/expertcache/decode.h): MXFP4 by per-scale tables, block FP8 by an
// exact e4m3 conversion, one float32 product and torch's rounding. The SIMD paths are compiled with
// function-level target attributes, so every build has them whatever its -march; whether they run
// is decided at run time from cpuid.
#include "expertcache/decode.h"
#include "expertcache/float_bits.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define EXPERTCACHE_X86_SIMD 1
#include <immintrin.h>
#endif

namespace expertcache {
namespace {

constexpr size_t kGroupBytes = 16;   // one MXFP4 group: 16 bytes ...
constexpr size_t kGroupValues = 32;  // ... two codes each
constexpr int kE8M0Bias = 127;
// E2M1 code -> value; codes 8..15 are the negatives of 0..7 (the top bit is the sign).
constexpr float kFp4Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
// What torch's e4m3 -> float32 conversion gives for the NaN codes (before the sign).
constexpr uint32_t kE4m3NanBits = 0x7FF00000u;
constexpr uint8_t kE4m3NanMagnitude = 0x7F;
// FP8 blocks decoded by look-up tables (AVX-512, 16-bit outputs): at least this wide and this big.
constexpr size_t kTableMinBlockCols = 32;
constexpr size_t kTableMinBlockValues = 2048;

// Per scale byte s, the 16 values FP4[c] * 2**(s - 127) in each output dtype (header: exact by
// construction). The AVX2 path looks 16-bit values up byte-wise (pshufb), so those tables also
// come split: the 16 low bytes, then the 16 high bytes.
struct Mxfp4Tables {
  alignas(64) uint16_t bf16[256][16];
  alignas(64) uint16_t fp16[256][16];
  alignas(64) uint32_t fp32[256][16];  // float bits
  alignas(64) uint8_t bf16_split[256][32];
  alignas(64) uint8_t fp16_split[256][32];

  Mxfp4Tables() {
    for (int s = 0; s < 256; ++s) {
      for (int c = 0; c < 16; ++c) {
        // ldexp: exact (two significant bits; subnormal down to 2**-128, inf past float32's range).
        const float v = std::ldexp(kFp4Values[c], s - kE8M0Bias);
        fp32[s][c] = bits_of(v);
        bf16[s][c] = float_to_bf16(v);
        fp16[s][c] = float_to_fp16(v);
        bf16_split[s][c] = uint8_t(bf16[s][c] & 0xFF);
        bf16_split[s][16 + c] = uint8_t(bf16[s][c] >> 8);
        fp16_split[s][c] = uint8_t(fp16[s][c] & 0xFF);
        fp16_split[s][16 + c] = uint8_t(fp16[s][c] >> 8);
      }
    }
  }
};

const Mxfp4Tables& mxfp4_tables() {
  static const Mxfp4Tables* tables = new Mxfp4Tables();  // built once, thread-safe; never freed
  return *tables;
}

// e4m3 code -> float32 (e4m3_to_float), for the portable path.
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int c = 0; c < 256; ++c) value[c] = e4m3_to_float(uint8_t(c));
  }
};

const float* e4m3_table() {
  static const E4m3Table* table = new E4m3Table();
  return table->value;
}

// -- portable --------------------------------------------------------------------------------------

template <typename T>
void mxfp4_portable(const uint8_t* blocks, const uint8_t* scales, size_t n, const T (*table)[16], T* out) {
  for (size_t i = 0; i < n; ++i) {
    const T* t = table[scales[i]];
    const uint8_t* b = blocks + i * kGroupBytes;
    T* o = out + i * kGroupValues;
    for (size_t k = 0; k < kGroupBytes; ++k) {
      o[2 * k] = t[b[k] & 0x0F];
      o[2 * k + 1] = t[b[k] >> 4];
    }
  }
}

template <DecodeDtype D>
void fp8_row_portable(const uint8_t* values, const float* scale, size_t n, void* out) {
  const float* e4m3 = e4m3_table();
  for (size_t c = 0; c < n; ++c) {
    const float q = e4m3[values[c]];
    const float p = (values[c] & 0x7F) == kE4m3NanMagnitude ? q : q * scale[c];
    if constexpr (D == DecodeDtype::kBFloat16) {
      static_cast<uint16_t*>(out)[c] = float_to_bf16(p);
    } else if constexpr (D == DecodeDtype::kFloat16) {
      static_cast<uint16_t*>(out)[c] = float_to_fp16(p);
    } else {
      static_cast<uint32_t*>(out)[c] = bits_of(p);
    }
  }
}

#ifdef EXPERTCACHE_X86_SIMD

// GCC 12's AVX-512 headers initialise their "undefined" operands from themselves, which
// -Wmaybe-uninitialized / -Wuninitialized report at every inlined use (GCC bug 105593, fixed in
// GCC 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// -- AVX-512 (F, BW, VL) ---------------------------------------------------------------------------

#define EXPERTCACHE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// The 32 codes of one group as 16-bit indices in output order: word 2k = low nibble of byte k,
// word 2k + 1 = its high nibble. Byte b widened to the dword b | b << 12 holds both nibbles at
// bits 0..3 and 16..19.
EXPERTCACHE_AVX512 inline __m512i group_codes_avx512(const uint8_t* bytes) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  return _mm512_and_si512(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), _mm512_set1_epi32(0x000F000F));
}

// 16-bit outputs: one vpermw per group (the scale's 16 entries, in both halves).
EXPERTCACHE_AVX512 void mxfp4_16_avx512(const uint8_t* blocks, const uint8_t* scales, size_t n,
                                        const uint16_t (*table)[16], uint16_t* out) {
  for (size_t i = 0; i < n; ++i) {
    const __m512i codes = group_codes_avx512(blocks + i * kGroupBytes);
    const __m512i t = _mm512_broadcast_i64x4(_mm256_load_si256(reinterpret_cast<const __m256i*>(table[scales[i]])));
    _mm512_storeu_si512(out + i * kGroupValues, _mm512_permutexvar_epi16(codes, t));
  }
}

// float32 outputs: two vpermps per group over the scale's 16 entries.
EXPERTCACHE_AVX512 void mxfp4_32_avx512(const uint8_t* blocks, const uint8_t* scales, size_t n,
                                        const uint32_t (*table)[16], uint32_t* out) {
  for (size_t i = 0; i < n; ++i) {
    const __m512i codes = group_codes_avx512(blocks + i * kGroupBytes);
    const __m512 t = _mm512_load_ps(reinterpret_cast<const float*>(table[scales[i]]));
    const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(codes));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(codes, 1));
    float* o = reinterpret_cast<float*>(out + i * kGroupValues);
    _mm512_storeu_ps(o, _mm512_permutexvar_ps(lo, t));
    _mm512_storeu_ps(o + 16, _mm512_permutexvar_ps(hi, t));
  }
}

// float32(values) * scale for 16 e4m3 bytes (widened to dwords), NaN codes keeping their value:
// normal codes by moving the exponent and mantissa into place (+ (127 - 7) << 23), subnormal codes
// (exponent 0) as mantissa * 2**-9, both exact; the NaN codes as kE4m3NanBits.
EXPERTCACHE_AVX512 inline __m512 fp8_product_avx512(__m512i code, __m512 scale) {
  const __m512i mag = _mm512_and_si512(code, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(code, _mm512_set1_epi32(0x80)), 24);
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
  const __mmask16 is_subnormal = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8));
  const __mmask16 is_nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(kE4m3NanMagnitude));
  __m512i v = _mm512_mask_blend_epi32(is_subnormal, normal, _mm512_castps_si512(subnormal));
  v = _mm512_mask_blend_epi32(is_nan, v, _mm512_set1_epi32(int(kE4m3NanBits)));
  const __m512 q = _mm512_castsi512_ps(_mm512_or_si512(v, sign));
  return _mm512_mask_blend_ps(is_nan, _mm512_mul_ps(q, scale), q);
}

// float32 -> bf16 bits in dwords: round to nearest even, every NaN 0xFFFF (torch's conversion).
EXPERTCACHE_AVX512 inline __m512i to_bf16_avx512(__m512 p) {
  const __m512i x = _mm512_castps_si512(p);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0xFFFF));
}

template <DecodeDtype D>
EXPERTCACHE_AVX512 inline void fp8_store_avx512(void* out, size_t c, __m512 p, __mmask16 mask) {
  if constexpr (D == DecodeDtype::kBFloat16) {
    _mm512_mask_cvtepi32_storeu_epi16(static_cast<uint16_t*>(out) + c, mask, to_bf16_avx512(p));
  } else if constexpr (D == DecodeDtype::kFloat16) {
    const __m256i h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + c, mask, h);
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + c, mask, p);
  }
}

template <DecodeDtype D>
EXPERTCACHE_AVX512 void fp8_row_avx512(const uint8_t* values, const float* scale, size_t n, void* out) {
  size_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values + c)));
    fp8_store_avx512<D>(out, c, fp8_product_avx512(code, _mm512_loadu_ps(scale + c)), 0xFFFF);
  }
  if (c < n) {  // the last 1..15 values: masked loads and stores
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - c)) - 1);
    const __m512i code = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, values + c));
    fp8_store_avx512<D>(out, c, fp8_product_avx512(code, _mm512_maskz_loadu_ps(mask, scale + c)), mask);
  }
}

// FP8 into bf16 / fp16 by look-up: within a block every value is round(e4m3(code) * s) of one
// scale, so the block's 256 possible outputs are computed once (fp8_product_avx512, the same bits)
// and its values become table look-ups: 32 codes at a time, four vpermi2w over 64 entries each
// (code bits 0..5), two of the four picked by bit 6 and one of those by bit 7.
struct Fp8Table512 {
  __m512i t[8];  // entries 32i .. 32i + 31
};

template <DecodeDtype D>
EXPERTCACHE_AVX512 void fp8_table_avx512(float scale, uint16_t* table) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 s = _mm512_set1_ps(scale);
  for (int k = 0; k < 256; k += 16)
    fp8_store_avx512<D>(table, size_t(k), fp8_product_avx512(_mm512_add_epi32(iota, _mm512_set1_epi32(k)), s), 0xFFFF);
}

EXPERTCACHE_AVX512 inline __m512i fp8_look_up_avx512(const Fp8Table512& t, __m512i code) {
  const __m512i r0 = _mm512_permutex2var_epi16(t.t[0], code, t.t[1]);
  const __m512i r1 = _mm512_permutex2var_epi16(t.t[2], code, t.t[3]);
  const __m512i r2 = _mm512_permutex2var_epi16(t.t[4], code, t.t[5]);
  const __m512i r3 = _mm512_permutex2var_epi16(t.t[6], code, t.t[7]);
  const __mmask32 bit6 = _mm512_test_epi16_mask(code, _mm512_set1_epi16(0x40));
  const __mmask32 bit7 = _mm512_test_epi16_mask(code, _mm512_set1_epi16(0x80));
  return _mm512_mask_blend_epi16(bit7, _mm512_mask_blend_epi16(bit6, r0, r1), _mm512_mask_blend_epi16(bit6, r2, r3));
}

// The same with half the table: rounding is symmetric (round(-x) = -round(x)), so the output of
// code c | 0x80 is that of c with the sign bit flipped, except the NaN pair 0x7F / 0xFF (torch's
// bf16 NaN is 0xFFFF for both), patched by a compare. Two vpermi2w per 32 codes instead of four.
struct Fp8HalfTable512 {
  __m512i t[4];  // entries 32i .. 32i + 31 of codes 0..127
  __m512i nan_ff;  // the output of code 0xFF
};

EXPERTCACHE_AVX512 inline __m512i fp8_look_up_half_avx512(const Fp8HalfTable512& t, __m512i code) {
  const __m512i r0 = _mm512_permutex2var_epi16(t.t[0], code, t.t[1]);
  const __m512i r1 = _mm512_permutex2var_epi16(t.t[2], code, t.t[3]);
  const __mmask32 bit6 = _mm512_test_epi16_mask(code, _mm512_set1_epi16(0x40));
  const __m512i sign = _mm512_and_si512(_mm512_slli_epi16(code, 8), _mm512_set1_epi16(int16_t(0x8000)));
  const __m512i r = _mm512_xor_si512(_mm512_mask_blend_epi16(bit6, r0, r1), sign);
  return _mm512_mask_mov_epi16(r, _mm512_cmpeq_epi16_mask(code, _mm512_set1_epi16(0xFF)), t.nan_ff);
}

// Whether a block's 256 outputs are sign-symmetric but for the NaN pair: every block whose scale
// is finite (a NaN scale makes every output that NaN; 0 * inf is the same NaN for +0 and -0).
bool fp8_table_is_symmetric(const uint16_t* table) {
  for (int c = 0; c < 0x7F; ++c)
    if (table[c | 0x80] != (table[c] ^ 0x8000)) return false;
  return true;
}

// n values of one block (a row's run of one block column) through its table.
template <typename Table, __m512i (*LookUp)(const Table&, __m512i)>
EXPERTCACHE_AVX512 inline void fp8_run_avx512(const Table& t, const uint8_t* values, size_t n, uint16_t* out) {
  size_t c = 0;
  for (; c + 32 <= n; c += 32) {
    const __m512i code = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + c)));
    _mm512_storeu_si512(out + c, LookUp(t, code));
  }
  if (c < n) {
    const __mmask32 mask = static_cast<__mmask32>((1u << (n - c)) - 1);
    const __m512i code = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, values + c));
    _mm512_mask_storeu_epi16(out + c, mask, LookUp(t, code));
  }
}

EXPERTCACHE_AVX512 void fp8_block_run_avx512(const uint16_t* table, bool symmetric, const uint8_t* values, size_t n,
                                             uint16_t* out) {
  if (symmetric) {
    Fp8HalfTable512 t;
    for (int i = 0; i < 4; ++i) t.t[i] = _mm512_loadu_si512(table + 32 * i);
    t.nan_ff = _mm512_set1_epi16(int16_t(table[0xFF]));
    return fp8_run_avx512<Fp8HalfTable512, fp8_look_up_half_avx512>(t, values, n, out);
  }
  Fp8Table512 t;
  for (int i = 0; i < 8; ++i) t.t[i] = _mm512_loadu_si512(table + 32 * i);
  fp8_run_avx512<Fp8Table512, fp8_look_up_avx512>(t, values, n, out);
}

template <DecodeDtype D>
void fp8_tables_avx512(const uint8_t* values, const float* scale_inv, size_t rows, size_t cols, size_t block_rows,
                       size_t block_cols, uint16_t* out) {
  const size_t grid_cols = (cols + block_cols - 1) / block_cols;
  std::vector<uint16_t> tables(grid_cols * 256);  // one block row's tables
  std::vector<char> symmetric(grid_cols);
  for (size_t r0 = 0; r0 < rows; r0 += block_rows) {
    for (size_t j = 0; j < grid_cols; ++j) {
      fp8_table_avx512<D>(scale_inv[r0 / block_rows * grid_cols + j], &tables[256 * j]);
      symmetric[j] = fp8_table_is_symmetric(&tables[256 * j]);
    }
    for (size_t r = r0; r < std::min(rows, r0 + block_rows); ++r)
      for (size_t j = 0, c = 0; j < grid_cols; ++j, c += block_cols)
        fp8_block_run_avx512(&tables[256 * j], symmetric[j], values + r * cols + c, std::min(block_cols, cols - c),
                             out + r * cols + c);
  }
}

// -- AVX2 + F16C -----------------------------------------------------------------------------------

#define EXPERTCACHE_AVX2 __attribute__((target("avx2,f16c")))

// The 32 codes of one group as bytes in output order: codes[0] values 0..15, codes[1] 16..31.
EXPERTCACHE_AVX2 inline void group_codes_avx2(const uint8_t* bytes, __m128i codes[2]) {
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i lo = _mm_and_si128(b, nibble);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
  codes[0] = _mm_unpacklo_epi8(lo, hi);
  codes[1] = _mm_unpackhi_epi8(lo, hi);
}

// 16-bit outputs: pshufb the low and the high bytes of the scale's entries, interleave them.
EXPERTCACHE_AVX2 void mxfp4_16_avx2(const uint8_t* blocks, const uint8_t* scales, size_t n,
                                    const uint8_t (*split)[32], uint16_t* out) {
  for (size_t i = 0; i < n; ++i) {
    __m128i codes[2];
    group_codes_avx2(blocks + i * kGroupBytes, codes);
    const __m256i idx = _mm256_set_m128i(codes[1], codes[0]);
    const uint8_t* t = split[scales[i]];
    const __m256i t_lo = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
    const __m256i t_hi = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t + 16)));
    const __m256i lo = _mm256_shuffle_epi8(t_lo, idx);
    const __m256i hi = _mm256_shuffle_epi8(t_hi, idx);
    const __m256i w0 = _mm256_unpacklo_epi8(lo, hi);  // values 0..7 | 16..23
    const __m256i w1 = _mm256_unpackhi_epi8(lo, hi);  // values 8..15 | 24..31
    __m256i* o = reinterpret_cast<__m256i*>(out + i * kGroupValues);
    _mm256_storeu_si256(o, _mm256_permute2x128_si256(w0, w1, 0x20));
    _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(w0, w1, 0x31));
  }
}

// float32 outputs: vpermps looks up 8 entries, so entries 0..7 and 8..15 are looked up apart and
// code bit 3 (moved to the sign bit) picks one.
EXPERTCACHE_AVX2 void mxfp4_32_avx2(const uint8_t* blocks, const uint8_t* scales, size_t n,
                                    const uint32_t (*table)[16], uint32_t* out) {
  for (size_t i = 0; i < n; ++i) {
    __m128i codes[2];
    group_codes_avx2(blocks + i * kGroupBytes, codes);
    const float* t = reinterpret_cast<const float*>(table[scales[i]]);
    const __m256 t_lo = _mm256_load_ps(t), t_hi = _mm256_load_ps(t + 8);
    float* o = reinterpret_cast<float*>(out + i * kGroupValues);
    for (int q = 0; q < 4; ++q) {
      const __m128i c = q % 2 ? _mm_srli_si128(codes[q / 2], 8) : codes[q / 2];
      const __m256i idx = _mm256_cvtepu8_epi32(c);
      const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t_lo, idx), _mm256_permutevar8x32_ps(t_hi, idx),
                                        _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
      _mm256_storeu_ps(o + 8 * q, v);
    }
  }
}

// fp8_product_avx512 for 8 values.
EXPERTCACHE_AVX2 inline __m256 fp8_product_avx2(__m256i code, __m256 scale) {
  const __m256i mag = _mm256_and_si256(code, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
  const __m256i is_subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);
  const __m256i is_nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(kE4m3NanMagnitude));
  __m256i v = _mm256_blendv_epi8(normal, _mm256_castps_si256(subnormal), is_subnormal);
  v = _mm256_blendv_epi8(v, _mm256_set1_epi32(int(kE4m3NanBits)), is_nan);
  const __m256 q = _mm256_castsi256_ps(_mm256_or_si256(v, sign));
  return _mm256_blendv_ps(_mm256_mul_ps(q, scale), q, _mm256_castsi256_ps(is_nan));
}

template <DecodeDtype D>
EXPERTCACHE_AVX2 void fp8_row_avx2(const uint8_t* values, const float* scale, size_t n, void* out) {
  size_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(values + c)));
    const __m256 p = fp8_product_avx2(code, _mm256_loadu_ps(scale + c));
    if constexpr (D == DecodeDtype::kBFloat16) {
      const __m256i x = _mm256_castps_si256(p);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q)));
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // 8 words, in order
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + c), _mm256_castsi256_si128(packed));
    } else if constexpr (D == DecodeDtype::kFloat16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + c),
                       _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
      _mm256_storeu_ps(static_cast<float*>(out) + c, p);
    }
  }
  if (c < n) {
    void* tail = static_cast<char*>(out) + c * decode_dtype_size(D);
    fp8_row_portable<D>(values + c, scale + c, n - c, tail);
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

bool cpu_has(DecodePath path) {
  __builtin_cpu_init();
  switch (path) {
    case DecodePath::kPortable: return true;
    case DecodePath::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case DecodePath::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  }
  return false;
}

#else  // not x86 (or a compiler without target attributes): the portable path only

bool cpu_has(DecodePath path) { return path == DecodePath::kPortable; }

#endif

constexpr DecodePath kAllPaths[] = {DecodePath::kAvx512, DecodePath::kAvx2, DecodePath::kPortable};

void check_path(DecodePath path) {
  if (!cpu_has(path))
    throw std::invalid_argument(std::string("decode path '") + decode_path_name(path) +
                                "' is not supported on this CPU");
}

using Fp8RowFn = void (*)(const uint8_t* values, const float* scale, size_t n, void* out);

template <DecodeDtype D>
Fp8RowFn fp8_row_fn(DecodePath path) {
#ifdef EXPERTCACHE_X86_SIMD
  if (path == DecodePath::kAvx512) return fp8_row_avx512<D>;
  if (path == DecodePath::kAvx2) return fp8_row_avx2<D>;
#endif
  (void)path;
  return fp8_row_portable<D>;
}

}  // namespace

// -- scalar conversions ----------------------------------------------------------------------------

float e4m3_to_float(uint8_t code) {
  const uint32_t sign = uint32_t(code & 0x80) << 24;
  const uint32_t mag = code & 0x7F;
  uint32_t magnitude_bits;
  if (mag == kE4m3NanMagnitude) {
    magnitude_bits = kE4m3NanBits;
  } else if (mag < 8) {  // exponent 0: mantissa * 2**-9
    magnitude_bits = bits_of(std::ldexp(float(mag), -9));
  } else {  // (1 + m / 8) * 2**(e - 7): exponent rebiased by 127 - 7
    magnitude_bits = (mag << 20) + (120u << 23);
  }
  return float_of(sign | magnitude_bits);
}

uint16_t float_to_bf16(float value) {
  const uint32_t x = bits_of(value);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;
  return uint16_t((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

uint16_t float_to_fp16(float value) {
  const uint32_t x = bits_of(value);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uint16_t(sign | 0x7E00u | ((a >> 13) & 0x03FFu));  // NaN: quiet, payload's top
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // 65520 and up round to inf (65504 is odd)
  if (a >= 0x38800000u) {  // a normal half (>= 2**-14): round the 13 dropped bits, rebias 127 -> 15
    const uint32_t rounded = a + 0x0FFFu + ((a >> 13) & 1u);
    return uint16_t(sign | ((rounded - (112u << 23)) >> 13));
  }
  if (a <= 0x33000000u) return sign;  // <= 2**-25: half the smallest subnormal, ties to even 0
  // A subnormal half m * 2**-24 (m may round up to 1024, the smallest normal: the same bits).
  const uint32_t exponent = a >> 23;  // 102..112
  const uint32_t mantissa = (a & 0x007FFFFFu) | 0x00800000u;
  const uint32_t shift = 126 - exponent;  // 14..24
  uint32_t m = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (m & 1u))) ++m;
  return uint16_t(sign | m);
}

// -- names and paths -------------------------------------------------------------------------------

DecodeDtype decode_dtype_from_name(const std::string& name) {
  for (DecodeDtype d : {DecodeDtype::kBFloat16, DecodeDtype::kFloat16, DecodeDtype::kFloat32})
    if (name == decode_dtype_name(d)) return d;
  throw std::invalid_argument("unknown decode output dtype '" + name + "': use one of bfloat16, float16, float32");
}

const char* decode_dtype_name(DecodeDtype dtype) {
  switch (dtype) {
    case DecodeDtype::kBFloat16: return "bfloat16";
    case DecodeDtype::kFloat16: return "float16";
    case DecodeDtype::kFloat32: return "float32";
  }
  return "?";
}

size_t decode_dtype_size(DecodeDtype dtype) { return dtype == DecodeDtype::kFloat32 ? 4 : 2; }

const char* decode_path_name(DecodePath path) {
  switch (path) {
    case DecodePath::kPortable: return "portable";
    case DecodePath::kAvx2: return "avx2";
    case DecodePath::kAvx512: return "avx512";
  }
  return "?";
}

std::vector<DecodePath> decode_paths() {
  std::vector<DecodePath> out;
  for (DecodePath p : kAllPaths)
    if (cpu_has(p)) out.push_back(p);
  return out;
}

DecodePath decode_default_path() {
  static const DecodePath best = decode_paths().front();
  return best;
}

DecodePath decode_path_from_name(const std::string& name) {
  for (DecodePath p : kAllPaths) {
    if (name != decode_path_name(p)) continue;
    if (!cpu_has(p)) {
      std::string have;
      for (DecodePath q : decode_paths()) have += std::string(have.empty() ? "" : ", ") + decode_path_name(q);
      throw std::invalid_argument("decode path '" + name + "' is not supported on this CPU (it has: " + have + ")");
    }
    return p;
  }
  throw std::invalid_argument("unknown decode path '" + name + "': use one of avx512, avx2, portable");
}

// -- the decodes -----------------------------------------------------------------------------------

void decode_mxfp4(const uint8_t* blocks, const uint8_t* scales, size_t rows, size_t groups, DecodeDtype dtype,
                  DecodePath path, void* out) {
  check_path(path);
  const Mxfp4Tables& t = mxfp4_tables();
  const size_t n = rows * groups;  // groups are independent: [R, G] is one run of R * G groups
  const bool is16 = dtype != DecodeDtype::kFloat32;
  const auto& table16 = dtype == DecodeDtype::kBFloat16 ? t.bf16 : t.fp16;
#ifdef EXPERTCACHE_X86_SIMD
  if (path == DecodePath::kAvx512) {
    if (is16) return mxfp4_16_avx512(blocks, scales, n, table16, static_cast<uint16_t*>(out));
    return mxfp4_32_avx512(blocks, scales, n, t.fp32, static_cast<uint32_t*>(out));
  }
  if (path == DecodePath::kAvx2) {
    if (is16) {
      const auto& split = dtype == DecodeDtype::kBFloat16 ? t.bf16_split : t.fp16_split;
      return mxfp4_16_avx2(blocks, scales, n, split, static_cast<uint16_t*>(out));
    }
    return mxfp4_32_avx2(blocks, scales, n, t.fp32, static_cast<uint32_t*>(out));
  }
#endif
  if (is16) return mxfp4_portable(blocks, scales, n, table16, static_cast<uint16_t*>(out));
  mxfp4_portable(blocks, scales, n, t.fp32, static_cast<uint32_t*>(out));
}

void decode_fp8(const uint8_t* values, const float* scale_inv, size_t rows, size_t cols, size_t block_rows,
                size_t block_cols, DecodeDtype dtype, DecodePath path, void* out) {
  if (block_rows == 0 || block_cols == 0)
    throw std::invalid_argument("decode_fp8: block sizes must be >= 1, got " + std::to_string(block_rows) + " x " +
                                std::to_string(block_cols));
  check_path(path);
#ifdef EXPERTCACHE_X86_SIMD
  // Look-up tables pay off when a block holds many values (256 table entries per block), and a
  // block column's run must fill vectors of 32.
  if (path == DecodePath::kAvx512 && dtype != DecodeDtype::kFloat32 && block_cols >= kTableMinBlockCols &&
      block_rows * block_cols >= kTableMinBlockValues) {
    auto* o = static_cast<uint16_t*>(out);
    if (dtype == DecodeDtype::kBFloat16)
      return fp8_tables_avx512<DecodeDtype::kBFloat16>(values, scale_inv, rows, cols, block_rows, block_cols, o);
    return fp8_tables_avx512<DecodeDtype::kFloat16>(values, scale_inv, rows, cols, block_rows, block_cols, o);
  }
#endif
  Fp8RowFn row_fn = dtype == DecodeDtype::kBFloat16  ? fp8_row_fn<DecodeDtype::kBFloat16>(path)
                    : dtype == DecodeDtype::kFloat16 ? fp8_row_fn<DecodeDtype::kFloat16>(path)
                                                     : fp8_row_fn<DecodeDtype::kFloat32>(path);
  const size_t grid_cols = (cols + block_cols - 1) / block_cols;
  const size_t out_row_bytes = cols * decode_dtype_size(dtype);
  // The scale of every column of the current block row, so a row is one uniform run whatever the
  // block width (partial last blocks included).
  std::vector<float> scale_row(cols);
  size_t current = SIZE_MAX;
  for (size_t r = 0; r < rows; ++r) {
    const size_t block_row = r / block_rows;
    if (block_row != current) {
      const float* s = scale_inv + block_row * grid_cols;
      for (size_t j = 0, c = 0; j < grid_cols; ++j)
        for (const size_t end = std::min(cols, c + block_cols); c < end; ++c) scale_row[c] = s[j];
      current = block_row;
    }
    row_fn(values + r * cols, scale_row.data(), cols, static_cast<char*>(out) + r * out_row_bytes);
  }
}

}  // namespace expertcache
