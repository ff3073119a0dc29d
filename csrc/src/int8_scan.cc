// Int8 scan of the EAMC match: dot products of int8 queries with int8 rows and a per-query top-k
// (csrc/include/expertcache/int8_scan.h). The SIMD paths are compiled with function-level target
// attributes, so every build has them whatever its -march; which one runs is decided at run time
// from cpuid (__builtin_cpu_supports, which also checks that the OS saves the wide registers).
#include "expertcache/int8_scan.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define EXPERTCACHE_X86_SIMD 1
#include <immintrin.h>
#endif

namespace expertcache {
namespace {

using DotsFn = void (*)(const int8_t* query, const int8_t* rows, size_t num_rows, size_t ld,
                        size_t width, int32_t* dots);

// Rows scanned per block: every query of a batch reads the block while it is in L2
// (256 rows of 24 x 32 bytes = 192 KiB).
constexpr size_t kBlockRows = 256;

int32_t dot_scalar(const int8_t* q, const int8_t* r, size_t from, size_t width) {
  int32_t s = 0;
  for (size_t j = from; j < width; ++j) s += int32_t(q[j]) * int32_t(r[j]);
  return s;
}

void dots_portable(const int8_t* query, const int8_t* rows, size_t num_rows, size_t ld,
                   size_t width, int32_t* dots) {
  for (size_t n = 0; n < num_rows; ++n) dots[n] = dot_scalar(query, rows + n * ld, 0, width);
}

#ifdef EXPERTCACHE_X86_SIMD

__attribute__((target("avx2"))) inline int32_t hsum_avx2(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// acc += the int32 sums of 4 adjacent products of q (unsigned bytes) and r (signed bytes).
// vpmaddubsw adds pairs into int16: exact for q in [0, 127] (2 * 127 * 128 < 32767).
__attribute__((target("avx2"))) inline __m256i madd_avx2(__m256i acc, __m256i q, const int8_t* r) {
  const __m256i pairs = _mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Four rows at a time, so each query vector loaded serves four rows; the last width % 32 bytes
// by the scalar loop.
__attribute__((target("avx2"))) void dots_avx2(const int8_t* query, const int8_t* rows,
                                               size_t num_rows, size_t ld, size_t width,
                                               int32_t* dots) {
  const size_t body = width & ~size_t(31);
  size_t n = 0;
  for (; n + 4 <= num_rows; n += 4) {
    const int8_t* r0 = rows + n * ld;
    const int8_t* r1 = r0 + ld;
    const int8_t* r2 = r1 + ld;
    const int8_t* r3 = r2 + ld;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t j = 0; j < body; j += 32) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(query + j));
      a0 = madd_avx2(a0, q, r0 + j);
      a1 = madd_avx2(a1, q, r1 + j);
      a2 = madd_avx2(a2, q, r2 + j);
      a3 = madd_avx2(a3, q, r3 + j);
    }
    dots[n] = hsum_avx2(a0) + dot_scalar(query, r0, body, width);
    dots[n + 1] = hsum_avx2(a1) + dot_scalar(query, r1, body, width);
    dots[n + 2] = hsum_avx2(a2) + dot_scalar(query, r2, body, width);
    dots[n + 3] = hsum_avx2(a3) + dot_scalar(query, r3, body, width);
  }
  for (; n < num_rows; ++n) {
    const int8_t* r = rows + n * ld;
    __m256i a = _mm256_setzero_si256();
    for (size_t j = 0; j < body; j += 32)
      a = madd_avx2(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(query + j)), r + j);
    dots[n] = hsum_avx2(a) + dot_scalar(query, r, body, width);
  }
}

#define EXPERTCACHE_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))

// The sum of the 16 lanes, through memory: GCC 12's headers for the 512 -> 256-bit extracts
// (and so _mm512_reduce_add_epi32) warn of an uninitialised value under -Wall.
EXPERTCACHE_VNNI_TARGET inline int32_t hsum_avx512(__m512i v) {
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, v);
  int32_t s = 0;
  for (int32_t x : lanes) s += x;
  return s;
}

// vpdpbusd: acc += the int32 sums of 4 adjacent products of q (unsigned) and r (signed), exact.
// The last width % 64 bytes come through masked loads, which read nothing past the mask.
EXPERTCACHE_VNNI_TARGET void dots_avx512_vnni(const int8_t* query, const int8_t* rows,
                                               size_t num_rows, size_t ld, size_t width,
                                               int32_t* dots) {
  const size_t body = width & ~size_t(63);
  const size_t tail = width - body;
  const __mmask64 tail_mask = tail ? (~__mmask64(0) >> (64 - tail)) : __mmask64(0);
  const __m512i q_tail = _mm512_maskz_loadu_epi8(tail_mask, query + body);
  size_t n = 0;
  for (; n + 4 <= num_rows; n += 4) {
    const int8_t* r0 = rows + n * ld;
    const int8_t* r1 = r0 + ld;
    const int8_t* r2 = r1 + ld;
    const int8_t* r3 = r2 + ld;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t j = 0; j < body; j += 64) {
      const __m512i q = _mm512_loadu_si512(query + j);
      a0 = _mm512_dpbusd_epi32(a0, q, _mm512_loadu_si512(r0 + j));
      a1 = _mm512_dpbusd_epi32(a1, q, _mm512_loadu_si512(r1 + j));
      a2 = _mm512_dpbusd_epi32(a2, q, _mm512_loadu_si512(r2 + j));
      a3 = _mm512_dpbusd_epi32(a3, q, _mm512_loadu_si512(r3 + j));
    }
    if (tail) {
      a0 = _mm512_dpbusd_epi32(a0, q_tail, _mm512_maskz_loadu_epi8(tail_mask, r0 + body));
      a1 = _mm512_dpbusd_epi32(a1, q_tail, _mm512_maskz_loadu_epi8(tail_mask, r1 + body));
      a2 = _mm512_dpbusd_epi32(a2, q_tail, _mm512_maskz_loadu_epi8(tail_mask, r2 + body));
      a3 = _mm512_dpbusd_epi32(a3, q_tail, _mm512_maskz_loadu_epi8(tail_mask, r3 + body));
    }
    dots[n] = hsum_avx512(a0);
    dots[n + 1] = hsum_avx512(a1);
    dots[n + 2] = hsum_avx512(a2);
    dots[n + 3] = hsum_avx512(a3);
  }
  for (; n < num_rows; ++n) {
    const int8_t* r = rows + n * ld;
    __m512i a = _mm512_setzero_si512();
    for (size_t j = 0; j < body; j += 64)
      a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(query + j), _mm512_loadu_si512(r + j));
    if (tail) a = _mm512_dpbusd_epi32(a, q_tail, _mm512_maskz_loadu_epi8(tail_mask, r + body));
    dots[n] = hsum_avx512(a);
  }
}

bool cpu_has(Int8ScanPath path) {
  __builtin_cpu_init();
  switch (path) {
    case Int8ScanPath::kPortable: return true;
    case Int8ScanPath::kAvx2: return __builtin_cpu_supports("avx2");
    case Int8ScanPath::kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vnni");
  }
  return false;
}

#else  // not x86 (or a compiler without target attributes): the portable path only

bool cpu_has(Int8ScanPath path) { return path == Int8ScanPath::kPortable; }

#endif

DotsFn dots_fn(Int8ScanPath path) {
  if (!cpu_has(path))
    throw std::invalid_argument(std::string("int8 scan path '") + int8_scan_path_name(path) +
                                "' is not supported on this CPU");
#ifdef EXPERTCACHE_X86_SIMD
  switch (path) {
    case Int8ScanPath::kAvx512Vnni: return dots_avx512_vnni;
    case Int8ScanPath::kAvx2: return dots_avx2;
    case Int8ScanPath::kPortable: break;
  }
#endif
  return dots_portable;
}

struct Candidate {
  float score;
  int64_t index;
};

// The result order: higher score first, equal scores by lower index. As a heap comparator it
// keeps the worst kept candidate at the front.
bool better(const Candidate& a, const Candidate& b) {
  return a.score > b.score || (a.score == b.score && a.index < b.index);
}

void check_query(const int8_t* query, size_t width, size_t t) {
  for (size_t j = 0; j < width; ++j)
    if (query[j] < 0)
      throw std::invalid_argument("int8 scan: query values must be in [0, 127] (the unsigned operand of "
                                  "the int8 product), got " + std::to_string(int(query[j])) + " at [" +
                                  std::to_string(t) + ", " + std::to_string(j) + "]");
}

}  // namespace

const char* int8_scan_path_name(Int8ScanPath path) {
  switch (path) {
    case Int8ScanPath::kPortable: return "portable";
    case Int8ScanPath::kAvx2: return "avx2";
    case Int8ScanPath::kAvx512Vnni: return "avx512_vnni";
  }
  return "unknown";
}

std::vector<Int8ScanPath> int8_scan_paths() {
  std::vector<Int8ScanPath> out;
  for (Int8ScanPath p : {Int8ScanPath::kAvx512Vnni, Int8ScanPath::kAvx2, Int8ScanPath::kPortable})
    if (cpu_has(p)) out.push_back(p);
  return out;
}

Int8ScanPath int8_scan_default_path() {
  static const Int8ScanPath best = int8_scan_paths().front();
  return best;
}

Int8ScanPath int8_scan_path_from_name(const std::string& name) {
  for (Int8ScanPath p : {Int8ScanPath::kAvx512Vnni, Int8ScanPath::kAvx2, Int8ScanPath::kPortable}) {
    if (name != int8_scan_path_name(p)) continue;
    if (!cpu_has(p)) {
      std::string have;
      for (Int8ScanPath q : int8_scan_paths()) have += std::string(have.empty() ? "" : ", ") + int8_scan_path_name(q);
      throw std::invalid_argument("int8 scan path '" + name + "' is not supported on this CPU (it has: " +
                                  have + ")");
    }
    return p;
  }
  throw std::invalid_argument("unknown int8 scan path '" + name +
                              "': use one of avx512_vnni, avx2, portable");
}

void int8_dots(const int8_t* query, const int8_t* rows, size_t num_rows, size_t ld, size_t width,
               Int8ScanPath path, int32_t* dots) {
  if (num_rows > 1 && ld < width)
    throw std::invalid_argument("int8 scan: row stride " + std::to_string(ld) + " is less than the width " +
                                std::to_string(width));
  check_query(query, width, 0);
  dots_fn(path)(query, rows, num_rows, ld, width, dots);
}

void int8_topk(const int8_t* queries, size_t num_queries, size_t q_ld, const int8_t* rows,
               size_t num_rows, size_t ld, size_t width, const float* scale, size_t scale_stride,
               size_t k, Int8ScanPath path, int64_t* out_index, float* out_score) {
  if (k == 0) throw std::invalid_argument("int8 scan: k must be >= 1");
  if (num_rows > 1 && ld < width)
    throw std::invalid_argument("int8 scan: row stride " + std::to_string(ld) + " is less than the width " +
                                std::to_string(width));
  if (num_queries > 1 && q_ld < width)
    throw std::invalid_argument("int8 scan: query stride " + std::to_string(q_ld) +
                                " is less than the width " + std::to_string(width));
  for (size_t t = 0; t < num_queries; ++t) check_query(queries + t * q_ld, width, t);
  for (size_t n = 0; n < num_rows; ++n)
    if (std::isnan(scale[n * scale_stride]))
      throw std::invalid_argument("int8 scan: scale[" + std::to_string(n) + "] is NaN");
  const DotsFn fn = dots_fn(path);
  const size_t kk = std::min(k, num_rows);
  if (kk == 0) return;

  std::vector<std::vector<Candidate>> heaps(num_queries);
  for (auto& h : heaps) h.reserve(kk);
  int32_t dots[kBlockRows];
  for (size_t b0 = 0; b0 < num_rows; b0 += kBlockRows) {
    const size_t bn = std::min(kBlockRows, num_rows - b0);
    for (size_t t = 0; t < num_queries; ++t) {
      fn(queries + t * q_ld, rows + b0 * ld, bn, ld, width, dots);
      std::vector<Candidate>& h = heaps[t];
      for (size_t i = 0; i < bn; ++i) {
        // float(dot) * scale: one correctly rounded float32 multiply, as numpy computes it.
        const Candidate c{static_cast<float>(dots[i]) * scale[(b0 + i) * scale_stride],
                          static_cast<int64_t>(b0 + i)};
        if (h.size() < kk) {
          h.push_back(c);
          std::push_heap(h.begin(), h.end(), better);
        } else if (better(c, h.front())) {
          std::pop_heap(h.begin(), h.end(), better);
          h.back() = c;
          std::push_heap(h.begin(), h.end(), better);
        }
      }
    }
  }
  for (size_t t = 0; t < num_queries; ++t) {
    std::vector<Candidate>& h = heaps[t];
    std::sort_heap(h.begin(), h.end(), better);  // best first
    for (size_t i = 0; i < kk; ++i) {
      out_index[t * kk + i] = h[i].index;
      out_score[t * kk + i] = h[i].score;
    }
  }
}

}  // namespace expertcache
