// The EAMC match (predictor_svc/eamc.py): the query a predictor runs per token, in one call. Given
// a request's partial EAM and the collection's rows, the top_n most similar entries over the
// layers seen so far, their cosines, and the prediction they make:
//
//   counts [T, L, E] (float32)       each query's expert counts so far
//     |  per layer: L2-normalised; q_nonempty = layers with a count among the first `layers`
//     v
//   qn [T, width]  (width = layers * E, float32)  -->  q8 = rint(qn * 127 / max(qn)) in [0, 127]
//     |
//     |  first stage, over every row: score[n] = float(q8 . q4[n, :width]) * rank[n]
//     |  (q4: the rows in 4 bits, 0..15, packed two to a byte; rank: the row's 4-bit scale over
//     |  sqrt(its non-empty layers among the first `layers`)), the `candidates` best kept
//     v
//   exact[c] = (qn . rows[c, :width]) / sqrt(q_nonempty * nonempty[c])   float32, for candidates
//     |  the k best by exact cosine (equal cosines: lower row)
//     v
//   w = max(sim, 0)^sharpness normalised to sum 1 (equal weights if none is positive)
//   prediction[l, e] = clip(sum_k w_k * scale[best_k, l] * rows[best_k, l * E + e], 0, 1)
//
// The numpy code in predictor_svc/eamc.py computes the same with the same formulas; tests check
// the two agree (chosen entries exactly, away from ties; cosines and predictions to float32
// rounding, since sums run in another order).
//
// 4-bit layout (why): the first stage reads every row, so its bytes are the match's cost (10 K
// entries of 24 x 32: 3.8 MB in 4 bits against 7.7 MB in int8). A row of W values is stored as
// ceil(W / 64) groups of 32 bytes; byte i of group g holds value 64g + i in its low nibble and
// value 64g + 32 + i in its high nibble (one AND and one shift unpack 32 bytes into two runs of 32
// consecutive values). Values past W are zero.
//
// Why the int8 products stay exact: the x86 product (vpmaddubsw) multiplies an unsigned byte (the
// query, in [0, 127]) by a signed one (the nibble, in [0, 15]); a pair sums to at most
// 2 * 127 * 15 = 3810, so four groups (lo and hi) add up in int16 (30480 < 32767) before they
// widen to int32: no path saturates, every path gives the same integer dots.
//
// Paths of the first stage, chosen at run time from what the CPU offers (cpuid through
// __builtin_cpu_supports; function-level target attributes build each without a -march flag):
//   avx2       32 packed bytes (64 values) per load   (x86-64 with AVX2; AVX-512 CPUs run it too)
//   portable   plain C++ (what other CPUs run)
//
// Failures are std::invalid_argument: a query value outside [0, 127] or a NaN/negative count, a
// NaN rank, k == 0 or candidates < k, layers outside [1, L], a row stride too short for the
// width, a forced path this CPU does not have.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace expertcache {

enum class Q4ScanPath { kPortable = 0, kAvx2 = 1 };

const char* q4_scan_path_name(Q4ScanPath path);
// The path named `name` ("portable", "avx2"); std::invalid_argument naming the valid names for
// another, and naming what this CPU has when it lacks the one asked for.
Q4ScanPath q4_scan_path_from_name(const std::string& name);
// The paths this CPU and build can run, fastest first; the first is the default.
std::vector<Q4ScanPath> q4_scan_paths();
Q4ScanPath q4_scan_default_path();

// Packed bytes per row for rows of `width` values: ceil(width / 64) * 32.
inline size_t q4_row_bytes(size_t width) { return (width + 63) / 64 * 32; }

// dots[n] = sum_j query[j] * value(rows + n * ld, j), j < width; query values in [0, 127];
// ld >= q4_row_bytes(width) (bytes).
void q4_dots(const int8_t* query, const uint8_t* rows, size_t num_rows, size_t ld, size_t width,
             Q4ScanPath path, int32_t* dots);

// The first stage alone: the k rows with the highest float(dot) * scale[n] for each of T queries
// (query row stride q_ld), best first, equal scores by lower row. Writes min(k, num_rows) entries
// per query. `scale` is contiguous [num_rows].
void q4_topk(const int8_t* queries, size_t num_queries, size_t q_ld, const uint8_t* rows,
             size_t num_rows, size_t ld, size_t width, const float* scale, size_t k,
             Q4ScanPath path, int64_t* out_index, float* out_score);

// The collection side of a match. Row n of each array is entry n; strides are in elements.
struct EamcRows {
  size_t num_rows = 0, layers = 0, experts = 0;
  const uint8_t* q4 = nullptr;      // [N, q4_ld] 4-bit rows (layout above), q4_ld >= q4_row_bytes(L*E)
  size_t q4_ld = 0;
  const float* rank = nullptr;      // [N]: rank column for the query's `layers` (contiguous)
  const float* rows = nullptr;      // [N, rows_ld] block-normalised rows, rows_ld >= L*E
  size_t rows_ld = 0;
  const float* nonempty = nullptr;  // nonempty[n * nonempty_ld]: its non-empty layers among the first `layers`
  size_t nonempty_ld = 0;
  const float* scale = nullptr;     // [N, scale_ld]: per-layer frequency scale, scale_ld >= L
  size_t scale_ld = 0;
};

// The whole match above for T queries `counts` [T, L, E] (contiguous) over the first `layers`
// layers. Outputs: best [T, k] and sims [T, k] (best first), prediction [T, L, E].
// Requires num_rows >= 1 and k <= candidates <= num_rows (the caller scans exactly below that).
void eamc_match(const EamcRows& rows, const float* counts, size_t num_queries, size_t layers,
                size_t candidates, size_t k, float sharpness, Q4ScanPath path, int64_t* out_best,
                float* out_sims, float* out_prediction);

}  // namespace expertcache
