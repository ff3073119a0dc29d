// Int8 scan: the first stage of the predictor's EAMC match (predictor_svc/eamc.py). A query's
// int8 dot products with N int8 rows, each times a per-row float scale, and the k rows with the
// highest score, for T queries at once:
//
//   queries [T, width] int8 (values in [0, 127])   rows [N, width] int8, row stride ld >= width
//        \                                          /
//         dot[t, n] = sum_j queries[t, j] * rows[n, j]    int32, exact
//         score[t, n] = float(dot[t, n]) * scale[n]       one float32 multiply, as numpy does it
//         top k of score[t, :]: out_index [T, kk] int64, out_score [T, kk] float32, kk = min(k, N)
//
// Order of the result: best first, equal scores by lower row index (a total order, so every
// path returns exactly the same rows and scores as the reference `argsort(-score, stable)[:k]`).
//
// Why the query must be non-negative: the x86 int8 products multiply an unsigned byte by a signed
// one (AVX2 vpmaddubsw, AVX-512 VNNI vpdpbusd), so the query is the unsigned operand. In [0, 127]
// its bytes mean the same signed or unsigned, and a pair of products stays inside int16
// (2 * 127 * 128 = 32512 < 32767), so no path saturates and all agree exactly. The EAMC's rows and
// queries are quantised non-negative frequencies; the rows may hold any int8 value.
//
// Paths, chosen once at run time from what the CPU offers (cpuid via __builtin_cpu_supports;
// the compiler's target attributes build each in any configuration, no -march flag needed):
//   avx512_vnni  64 bytes per vpdpbusd, masked tail loads   (x86-64 with AVX-512 F/BW/VNNI)
//   avx2         32 bytes per vpmaddubsw + vpmaddwd          (x86-64 with AVX2)
//   portable     plain C++ (what other CPUs run)
// A path may be forced by name (tests check each one the CPU supports against the others).
//
// Failures are std::invalid_argument: a negative query value, a NaN scale, k == 0, ld < width,
// a forced path this CPU or build does not have.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace expertcache {

enum class Int8ScanPath { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2 };

const char* int8_scan_path_name(Int8ScanPath path);
// The path named `name` ("portable", "avx2", "avx512_vnni"); std::invalid_argument naming the
// valid names for another, and naming what this CPU has when it lacks the one asked for.
Int8ScanPath int8_scan_path_from_name(const std::string& name);
// The paths this CPU and build can run, fastest first; the first is the default.
std::vector<Int8ScanPath> int8_scan_paths();
Int8ScanPath int8_scan_default_path();

// dots[n] = sum_j query[j] * rows[n * ld + j], j < width, for n < num_rows.
void int8_dots(const int8_t* query, const int8_t* rows, size_t num_rows, size_t ld, size_t width,
               Int8ScanPath path, int32_t* dots);

// The top-k scan described above. queries: T rows of stride q_ld; scale: element n at
// scale[n * scale_stride]. Writes min(k, num_rows) entries per query into out_index / out_score
// (row stride min(k, num_rows)). Thread-safe (no shared state); does not allocate per row.
void int8_topk(const int8_t* queries, size_t num_queries, size_t q_ld, const int8_t* rows,
               size_t num_rows, size_t ld, size_t width, const float* scale, size_t scale_stride,
               size_t k, Int8ScanPath path, int64_t* out_index, float* out_score);

}  // namespace expertcache
