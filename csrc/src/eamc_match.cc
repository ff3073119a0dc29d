// The EAMC match (csrc/include/expertcache/eamc_match.h): query normalisation, the 4-bit first
// stage, the exact rescoring of its candidates and the prediction, in one pass without Python.
// The SIMD path is compiled with a function-level target attribute, so every build has it
// whatever its -march; whether it runs is decided at run time from cpuid.
#include "expertcache/eamc_match.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define EXPERTCACHE_X86_SIMD 1
#include <immintrin.h>
#endif

namespace expertcache {
namespace {

// query: padded with zeros to whole groups (64 values), so a width inside a group reads the
// group's other values times zero.
using DotsFn = void (*)(const int8_t* query, const uint8_t* rows, size_t num_rows, size_t ld,
                        size_t groups, int32_t* dots);

constexpr size_t kGroupValues = 64;
constexpr size_t kGroupBytes = 32;
// Rows scanned per block: every query of a batch reads the block while it is in L2
// (256 rows of 24 x 32 values = 96 KiB packed).
constexpr size_t kBlockRows = 256;
// Groups whose int16 partial sums may add up before they widen (header: 4 * 7620 < 32767).
constexpr size_t kInt16Groups = 4;

// Groups a width of `width` values spans (the last one padded).
size_t groups_of(size_t width) { return (width + kGroupValues - 1) / kGroupValues; }

void dots_portable(const int8_t* query, const uint8_t* rows, size_t num_rows, size_t ld,
                   size_t groups, int32_t* dots) {
  for (size_t n = 0; n < num_rows; ++n) {
    const uint8_t* r = rows + n * ld;
    int32_t s = 0;
    for (size_t g = 0; g < groups; ++g) {
      const int8_t* q = query + g * kGroupValues;
      const uint8_t* b = r + g * kGroupBytes;
      for (size_t i = 0; i < kGroupBytes; ++i)
        s += int32_t(q[i]) * int32_t(b[i] & 0x0F) + int32_t(q[i + kGroupBytes]) * int32_t(b[i] >> 4);
    }
    dots[n] = s;
  }
}

#ifdef EXPERTCACHE_X86_SIMD

__attribute__((target("avx2"))) inline int32_t hsum_avx2(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// int16 lanes: the products of one packed group with the query's two runs of 32 values.
__attribute__((target("avx2"))) inline __m256i group_avx2(__m256i q_lo, __m256i q_hi, const uint8_t* r) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r));
  const __m256i lo = _mm256_and_si256(v, nibble);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
  return _mm256_add_epi16(_mm256_maddubs_epi16(q_lo, lo), _mm256_maddubs_epi16(q_hi, hi));
}

// Four rows at a time, so each query vector loaded serves four rows; int16 sums over up to
// kInt16Groups groups, then widened into int32.
__attribute__((target("avx2"))) void dots_avx2(const int8_t* query, const uint8_t* rows,
                                               size_t num_rows, size_t ld, size_t groups,
                                               int32_t* dots) {
  const __m256i ones = _mm256_set1_epi16(1);
  size_t n = 0;
  for (; n + 4 <= num_rows; n += 4) {
    const uint8_t* r0 = rows + n * ld;
    const uint8_t* r1 = r0 + ld;
    const uint8_t* r2 = r1 + ld;
    const uint8_t* r3 = r2 + ld;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t g0 = 0; g0 < groups; g0 += kInt16Groups) {
      const size_t g1 = std::min(groups, g0 + kInt16Groups);
      __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
      for (size_t g = g0; g < g1; ++g) {
        const __m256i q_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(query + g * kGroupValues));
        const __m256i q_hi =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(query + g * kGroupValues + kGroupBytes));
        const size_t off = g * kGroupBytes;
        s0 = _mm256_add_epi16(s0, group_avx2(q_lo, q_hi, r0 + off));
        s1 = _mm256_add_epi16(s1, group_avx2(q_lo, q_hi, r1 + off));
        s2 = _mm256_add_epi16(s2, group_avx2(q_lo, q_hi, r2 + off));
        s3 = _mm256_add_epi16(s3, group_avx2(q_lo, q_hi, r3 + off));
      }
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(s0, ones));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(s1, ones));
      a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(s2, ones));
      a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(s3, ones));
    }
    dots[n] = hsum_avx2(a0);
    dots[n + 1] = hsum_avx2(a1);
    dots[n + 2] = hsum_avx2(a2);
    dots[n + 3] = hsum_avx2(a3);
  }
  if (n < num_rows) dots_portable(query, rows + n * ld, num_rows - n, ld, groups, dots + n);
}

bool cpu_has(Q4ScanPath path) {
  __builtin_cpu_init();
  switch (path) {
    case Q4ScanPath::kPortable: return true;
    case Q4ScanPath::kAvx2: return __builtin_cpu_supports("avx2");
  }
  return false;
}

#else  // not x86 (or a compiler without target attributes): the portable path only

bool cpu_has(Q4ScanPath path) { return path == Q4ScanPath::kPortable; }

#endif

DotsFn dots_fn(Q4ScanPath path) {
  if (!cpu_has(path))
    throw std::invalid_argument(std::string("q4 scan path '") + q4_scan_path_name(path) +
                                "' is not supported on this CPU");
#ifdef EXPERTCACHE_X86_SIMD
  if (path == Q4ScanPath::kAvx2) return dots_avx2;
#endif
  return dots_portable;
}

struct Candidate {
  float score;
  int64_t index;
};

// The result order: higher score first, equal scores by lower index. As a heap comparator it
// keeps the worst kept candidate at the front.
struct Better {
  bool operator()(const Candidate& a, const Candidate& b) const {
    return a.score > b.score || (a.score == b.score && a.index < b.index);
  }
};
constexpr Better better{};

// The query padded with zeros to whole groups, after checking its values.
std::vector<int8_t> padded_query(const int8_t* query, size_t width, size_t t) {
  std::vector<int8_t> out(groups_of(width) * kGroupValues, 0);
  for (size_t j = 0; j < width; ++j) {
    if (query[j] < 0)
      throw std::invalid_argument("q4 scan: query values must be in [0, 127] (the unsigned operand of "
                                  "the int8 product), got " + std::to_string(int(query[j])) + " at [" +
                                  std::to_string(t) + ", " + std::to_string(j) + "]");
    out[j] = query[j];
  }
  return out;
}

void check_stride(size_t num_rows, size_t ld, size_t width) {
  if (num_rows > 0 && ld < q4_row_bytes(width))
    throw std::invalid_argument("q4 scan: row stride " + std::to_string(ld) + " bytes is less than the " +
                                std::to_string(q4_row_bytes(width)) + " that " + std::to_string(width) +
                                " values take");
}

// The best `keep` candidates of a stream of rows that come in increasing index: a buffer of up to
// 2 * keep, cut back to the best `keep` (nth_element) whenever it fills. Once cut, a row enters
// only with a score strictly above the worst kept one (it has a higher index, so an equal score
// loses the tie). Amortised O(1) per row that enters, against a heap's O(log keep).
class TopC {
 public:
  explicit TopC(size_t keep) : keep_(keep) { buf_.reserve(2 * keep); }

  // Offers rows first, first + 1, ... with these scores.
  void offer(const float* scores, size_t n, int64_t first) {
    float floor = floor_;  // a local: the loop's one compare needs no reload after each store
    for (size_t i = 0; i < n; ++i) {
      if (!(scores[i] > floor)) continue;  // -inf until the first cut
      buf_.push_back({scores[i], first + static_cast<int64_t>(i)});
      if (buf_.size() == 2 * keep_) {
        cut();
        floor = floor_;
      }
    }
  }

  // The kept candidates, best first.
  std::vector<Candidate>& result() {
    if (buf_.size() > keep_) cut();
    std::sort(buf_.begin(), buf_.end(), better);
    return buf_;
  }

 private:
  void cut() {
    std::nth_element(buf_.begin(), buf_.begin() + (keep_ - 1), buf_.end(), better);
    buf_.resize(keep_);
    floor_ = buf_[keep_ - 1].score;  // the worst kept: nth_element puts it at keep - 1
  }

  size_t keep_;
  float floor_ = -std::numeric_limits<float>::infinity();
  std::vector<Candidate> buf_;
};

// Top-k of float(dot) * scale over every row for each query (queries already padded), best first.
void topk_padded(const std::vector<std::vector<int8_t>>& queries, const uint8_t* rows, size_t num_rows,
                 size_t ld, size_t groups, const float* scale, size_t k, DotsFn fn,
                 std::vector<std::vector<Candidate>>& out) {
  const size_t kk = std::min(k, num_rows);
  out.assign(queries.size(), {});
  if (kk == 0) return;
  std::vector<TopC> tops(queries.size(), TopC(kk));
  int32_t dots[kBlockRows];
  float scores[kBlockRows];
  for (size_t b0 = 0; b0 < num_rows; b0 += kBlockRows) {
    const size_t bn = std::min(kBlockRows, num_rows - b0);
    for (size_t t = 0; t < queries.size(); ++t) {
      fn(queries[t].data(), rows + b0 * ld, bn, ld, groups, dots);
      // float(dot) * scale: one correctly rounded float32 multiply, as numpy computes it (a
      // plain loop the compiler vectorises).
      for (size_t i = 0; i < bn; ++i) scores[i] = static_cast<float>(dots[i]) * scale[b0 + i];
      tops[t].offer(scores, bn, static_cast<int64_t>(b0));
    }
  }
  for (size_t t = 0; t < queries.size(); ++t) out[t] = std::move(tops[t].result());
}

void check_scale(const float* scale, size_t num_rows, const char* name) {
  bool nan = false;
  for (size_t n = 0; n < num_rows; ++n) nan |= scale[n] != scale[n];  // no early exit: vectorised
  if (!nan) return;
  for (size_t n = 0; n < num_rows; ++n)
    if (std::isnan(scale[n]))
      throw std::invalid_argument(std::string("q4 scan: ") + name + "[" + std::to_string(n) + "] is NaN");
}

// Dot product of two float32 runs with eight partial sums (independent adds the compiler can
// keep in vector lanes).
float dot_f32(const float* a, const float* b, size_t width) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t j = 0;
  for (; j + 8 <= width; j += 8)
    for (size_t u = 0; u < 8; ++u) s[u] += a[j + u] * b[j + u];
  float total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; j < width; ++j) total += a[j] * b[j];
  return total;
}

}  // namespace

const char* q4_scan_path_name(Q4ScanPath path) {
  switch (path) {
    case Q4ScanPath::kPortable: return "portable";
    case Q4ScanPath::kAvx2: return "avx2";
  }
  return "unknown";
}

std::vector<Q4ScanPath> q4_scan_paths() {
  std::vector<Q4ScanPath> out;
  for (Q4ScanPath p : {Q4ScanPath::kAvx2, Q4ScanPath::kPortable})
    if (cpu_has(p)) out.push_back(p);
  return out;
}

Q4ScanPath q4_scan_default_path() {
  static const Q4ScanPath best = q4_scan_paths().front();
  return best;
}

Q4ScanPath q4_scan_path_from_name(const std::string& name) {
  for (Q4ScanPath p : {Q4ScanPath::kAvx2, Q4ScanPath::kPortable}) {
    if (name != q4_scan_path_name(p)) continue;
    if (!cpu_has(p)) {
      std::string have;
      for (Q4ScanPath q : q4_scan_paths()) have += std::string(have.empty() ? "" : ", ") + q4_scan_path_name(q);
      throw std::invalid_argument("q4 scan path '" + name + "' is not supported on this CPU (it has: " + have + ")");
    }
    return p;
  }
  throw std::invalid_argument("unknown q4 scan path '" + name + "': use one of avx2, portable");
}

void q4_dots(const int8_t* query, const uint8_t* rows, size_t num_rows, size_t ld, size_t width,
             Q4ScanPath path, int32_t* dots) {
  check_stride(num_rows, ld, width);
  const std::vector<int8_t> q = padded_query(query, width, 0);
  dots_fn(path)(q.data(), rows, num_rows, ld, q.size() / kGroupValues, dots);
}

void q4_topk(const int8_t* queries, size_t num_queries, size_t q_ld, const uint8_t* rows,
             size_t num_rows, size_t ld, size_t width, const float* scale, size_t k,
             Q4ScanPath path, int64_t* out_index, float* out_score) {
  if (k == 0) throw std::invalid_argument("q4 scan: k must be >= 1");
  check_stride(num_rows, ld, width);
  if (num_queries > 1 && q_ld < width)
    throw std::invalid_argument("q4 scan: query stride " + std::to_string(q_ld) + " is less than the width " +
                                std::to_string(width));
  std::vector<std::vector<int8_t>> padded;
  for (size_t t = 0; t < num_queries; ++t) padded.push_back(padded_query(queries + t * q_ld, width, t));
  check_scale(scale, num_rows, "scale");
  const DotsFn fn = dots_fn(path);
  std::vector<std::vector<Candidate>> best;
  topk_padded(padded, rows, num_rows, ld, groups_of(width), scale, k, fn, best);
  const size_t kk = std::min(k, num_rows);
  for (size_t t = 0; t < num_queries; ++t)
    for (size_t i = 0; i < kk; ++i) {
      out_index[t * kk + i] = best[t][i].index;
      out_score[t * kk + i] = best[t][i].score;
    }
}

void eamc_match(const EamcRows& rows, const float* counts, size_t num_queries, size_t layers,
                size_t candidates, size_t k, float sharpness, Q4ScanPath path, int64_t* out_best,
                float* out_sims, float* out_prediction) {
  const size_t L = rows.layers, E = rows.experts, N = rows.num_rows;
  if (L == 0 || E == 0) throw std::invalid_argument("eamc match: the EAM shape must be at least 1 x 1");
  if (layers < 1 || layers > L)
    throw std::invalid_argument("eamc match: layers must be in [1, " + std::to_string(L) + "], got " +
                                std::to_string(layers));
  if (k == 0) throw std::invalid_argument("eamc match: k must be >= 1");
  if (candidates < k || candidates > N)
    throw std::invalid_argument("eamc match: candidates must be in [k, N] = [" + std::to_string(k) + ", " +
                                std::to_string(N) + "], got " + std::to_string(candidates));
  if (!std::isfinite(sharpness) || sharpness < 0)
    throw std::invalid_argument("eamc match: sharpness must be a finite number >= 0");
  const size_t full = L * E, width = layers * E;
  check_stride(N, rows.q4_ld, full);
  if (rows.rows_ld < full || rows.scale_ld < L)
    throw std::invalid_argument("eamc match: a row stride is shorter than its row (rows " +
                                std::to_string(rows.rows_ld) + " < " + std::to_string(full) + " or scale " +
                                std::to_string(rows.scale_ld) + " < " + std::to_string(L) + ")");
  check_scale(rows.rank, N, "rank");

  // Each query normalised per layer, and its int8 copy.
  std::vector<std::vector<float>> qn(num_queries, std::vector<float>(width));
  std::vector<float> q_nonempty(num_queries, 0.0f);
  std::vector<std::vector<int8_t>> q8(num_queries);
  for (size_t t = 0; t < num_queries; ++t) {
    const float* x = counts + t * full;
    for (size_t j = 0; j < full; ++j)
      if (!(x[j] >= 0.0f) || std::isinf(x[j]))
        throw std::invalid_argument("eamc match: counts must be finite and >= 0, got " + std::to_string(x[j]) +
                                    " at [" + std::to_string(t) + ", " + std::to_string(j / E) + ", " +
                                    std::to_string(j % E) + "]");
    float top = 0.0f;
    for (size_t l = 0; l < layers; ++l) {
      float ss = 0.0f;
      for (size_t e = 0; e < E; ++e) ss += x[l * E + e] * x[l * E + e];
      const float norm = std::sqrt(ss);
      if (norm > 0) q_nonempty[t] += 1.0f;
      const float safe = norm > 0 ? norm : 1.0f;
      for (size_t e = 0; e < E; ++e) {
        const float v = x[l * E + e] / safe;
        qn[t][l * E + e] = v;
        top = std::max(top, v);
      }
    }
    // In [0, 127] by construction, written straight into the zero-padded groups of the scan.
    const float f = 127.0f / (top > 0 ? top : 1.0f);
    q8[t].assign(groups_of(width) * kGroupValues, 0);
    for (size_t j = 0; j < width; ++j) q8[t][j] = static_cast<int8_t>(std::nearbyint(qn[t][j] * f));
  }

  // First stage, then the exact cosine of each candidate.
  std::vector<std::vector<Candidate>> best;
  topk_padded(q8, rows.q4, N, rows.q4_ld, groups_of(width), rows.rank, candidates, dots_fn(path), best);
  for (size_t t = 0; t < num_queries; ++t) {
    std::vector<Candidate>& cand = best[t];
    // The candidates' float rows are scattered over a matrix far larger than the caches: each
    // row's lines are asked for while the row before it is read, so that its first misses
    // overlap that work (measured: ~5 of ~30 us at 10 K entries of 24 x 32; asking for every
    // candidate's lines at once saved nothing).
    const auto prefetch_row = [&](size_t i) {
      if (i >= cand.size()) return;
      const char* r = reinterpret_cast<const char*>(rows.rows + static_cast<size_t>(cand[i].index) * rows.rows_ld);
      for (size_t b = 0; b < width * sizeof(float); b += 64) __builtin_prefetch(r + b);
    };
    prefetch_row(0);
    size_t next = 1;
    for (Candidate& c : cand) {
      prefetch_row(next++);
      const size_t n = static_cast<size_t>(c.index);
      const float dot = dot_f32(rows.rows + n * rows.rows_ld, qn[t].data(), width);
      const float d = std::sqrt(q_nonempty[t] * rows.nonempty[n * rows.nonempty_ld]);
      c.score = d > 0 ? dot / d : 0.0f;
    }
    std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), better);

    std::vector<float> weights(k);
    float total = 0.0f;
    for (size_t i = 0; i < k; ++i) {
      out_best[t * k + i] = cand[i].index;
      out_sims[t * k + i] = cand[i].score;
      weights[i] = std::pow(std::max(cand[i].score, 0.0f), sharpness);
      total += weights[i];
    }
    for (size_t i = 0; i < k; ++i) weights[i] = total > 0 ? weights[i] / total : 1.0f / float(k);

    float* out = out_prediction + t * full;
    std::fill(out, out + full, 0.0f);
    for (size_t i = 0; i < k; ++i) {
      const size_t n = static_cast<size_t>(cand[i].index);
      const float* r = rows.rows + n * rows.rows_ld;
      const float* s = rows.scale + n * rows.scale_ld;
      for (size_t l = 0; l < L; ++l) {
        const float ws = weights[i] * s[l];
        for (size_t e = 0; e < E; ++e) out[l * E + e] += ws * r[l * E + e];
      }
    }
    for (size_t j = 0; j < full; ++j) out[j] = std::min(std::max(out[j], 0.0f), 1.0f);
  }
}

}  // namespace expertcache
