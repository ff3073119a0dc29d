// Expert decode on the CPU (expertcache/encodings.py owns the layouts and documents them): an
// MXFP4 or block-FP8 expert tensor into bf16 / fp16 / fp32, at memory speed, bit for bit what
// transformers' own dequantisation gives on an x86 CPU. Compute decodes every expert at every use
// into a reused scratch buffer, so this runs once per expert tensor per token.
//
// MXFP4 (transformers.integrations.mxfp4.convert_moe_packed_tensors):
//
//   blocks uint8 [R, G, 16]   byte k of group g: two E2M1 codes, low nibble first
//   scales uint8 [R, G]       E8M0: 2**(s - 127) for the 32 values of group g
//   out    [R, G * 32]        out[r, 32g + 2k]     = FP4[blocks[r, g, k] & 0xF] * 2**(scales[r, g] - 127)
//                             out[r, 32g + 2k + 1] = FP4[blocks[r, g, k] >> 4]  * 2**(scales[r, g] - 127)
//
// Exact by construction: a group's 32 values take only the 16 values of its scale, so a table
// [256 scales][16 codes] per output dtype is built once (the product FP4 * 2**(s - 127) by ldexp,
// exact in float32 for every s: two significant bits, subnormal down to 2**-128, inf above;
// rounded once to fp16, and exact in bf16) and decoding is pure look-ups: per group, the 32 codes
// index its scale's row (vpermw / vpermps on AVX-512, pshufb / vpermps on AVX2). Never NaN: the
// factors are finite.
//
// Block FP8 (transformers.integrations.finegrained_fp8.Fp8Dequantize._dequantize_one):
//
//   values    float8_e4m3fn [R, C]                      (passed as its bytes)
//   scale_inv float32 [ceil(R / bm), ceil(C / bn)]      a last partial block takes its block's scale
//   out       [R, C]  = round(float32(values[r, c]) * scale_inv[r / bm, c / bn])
//
// The e4m3 -> float32 conversion is exact (torch's bits: the NaN codes 0x7F / 0xFF become
// 0x7FF00000 / 0xFFF00000), the product is one IEEE float32 multiply (what torch's does), and the
// rounding to the output dtype is torch's x86 CPU conversion (its AVX2 / AVX-512 kernels):
//   bf16  round to nearest even on the bits (subnormals and overflow to inf included); every NaN
//         becomes 0xFFFF (torch's vectorised conversion loses the sign)
//   fp16  IEEE round to nearest even as vcvtps2ph (subnormals, overflow to inf); a NaN keeps its
//         sign and the top 10 bits of its payload, quiet bit set (0x7F / 0xFF: 0x7F80 / 0xFF80)
// A NaN code gives its own NaN whatever the scale. An x86 product keeps its NaN operand anyway;
// only when the scale is NaN too does it return the first operand's, and torch's loops put either
// first (transformers' bits vary within one tensor there), so that one case has no reference.
//
// With bf16 / fp16 outputs and big blocks (>= 32 columns, >= 2048 values: 128 x 128 in practice)
// the avx512 path computes each block's 256 possible outputs once with the same arithmetic and
// looks the values up: rounding is symmetric, so codes 0..127 suffice (two vpermi2w over 64
// entries, bit 6 picks one, bit 7 flips the sign; the NaN pair, whose bf16 outputs are both
// 0xFFFF, is patched), and a block whose outputs are not symmetric (a NaN or infinite scale)
// looks up all 256. About 10 instructions per 32 values instead of ~25 per 16.
//
// Paths, chosen at run time from what the CPU offers (__builtin_cpu_supports; function-level
// target attributes build each without a -march flag, so the module runs on any x86-64 and builds
// elsewhere with the portable path only):
//   avx512    AVX-512 F/BW/VL: one 64-byte store per MXFP4 group; FP8 by block tables or 16
//             values per step
//   avx2      AVX2 + F16C: pshufb look-ups, 8 FP8 values per step
//   portable  plain C++ (the reference the others are tested against)
// Every path gives the same bits. Single-threaded: the caller's thread (the GIL released by the
// binding).
//
// Failures are std::invalid_argument: a block size of 0, a forced path this CPU does not have, an
// unknown dtype or path name. Buffer sizes are the caller's to check (the binding does).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace expertcache {

enum class DecodeDtype { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };
enum class DecodePath { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// "bfloat16", "float16", "float32" (torch's names); std::invalid_argument listing them otherwise.
DecodeDtype decode_dtype_from_name(const std::string& name);
const char* decode_dtype_name(DecodeDtype dtype);
size_t decode_dtype_size(DecodeDtype dtype);  // bytes per output value

const char* decode_path_name(DecodePath path);
// The path named `name` ("avx512", "avx2", "portable"); std::invalid_argument naming the valid
// names for another, and naming what this CPU has when it lacks the one asked for.
DecodePath decode_path_from_name(const std::string& name);
// The paths this CPU and build can run, fastest first; the first is the default.
std::vector<DecodePath> decode_paths();
DecodePath decode_default_path();

// The scalar conversions every path matches (exposed for tests).
float e4m3_to_float(uint8_t code);
uint16_t float_to_bf16(float value);
uint16_t float_to_fp16(float value);

// out [rows, groups * 32] of `dtype` (uint16 bits for bf16/fp16, float for fp32) from blocks
// [rows, groups, 16] and scales [rows, groups], all contiguous.
void decode_mxfp4(const uint8_t* blocks, const uint8_t* scales, size_t rows, size_t groups,
                  DecodeDtype dtype, DecodePath path, void* out);

// out [rows, cols] of `dtype` from e4m3 bytes [rows, cols] and scale_inv
// [ceil(rows / block_rows), ceil(cols / block_cols)], all contiguous.
void decode_fp8(const uint8_t* values, const float* scale_inv, size_t rows, size_t cols,
                size_t block_rows, size_t block_cols, DecodeDtype dtype, DecodePath path, void* out);

}  // namespace expertcache
