// zlib's CRC-32 (see csrc/include/expertcache/crc32.h).
//
// The carry-less multiplication path folds the message 1024 bits at a time in eight 128-bit
// lanes (eight independent chains keep the multiplier busy), then eight lanes into four, four into
// one, then 128 bits to 64 and to 32 bits, and ends with a Barrett
// reduction: the method of Gopal et al., "Fast CRC Computation for Generic Polynomials Using
// PCLMULQDQ Instruction" (Intel, 2009), with the constants of the reflected CRC-32 polynomial.
// Each constant is a power of x modulo P(x) (bit-reflected, shifted left by one), as follows:
//   k7 = x^(8*128+32) mod P, k8 = x^(8*128-32) mod P   fold 1024 bits
//   k1 = x^(4*128+32) mod P, k2 = x^(4*128-32) mod P   fold 512 bits
//   k3 = x^(128+32) mod P,   k4 = x^(128-32) mod P     fold 128 bits
//   k5 = x^64 mod P                                    128 -> 96 -> 64 bits
//   mu = floor(x^64 / P), p = P                        Barrett reduction to 32 bits
// Bytes short of 64, and the last n mod 16, go through zlib.
#include "expertcache/crc32.h"

#include <zlib.h>

#include <algorithm>

#ifdef EXPERTCACHE_WITH_ISAL
#include <isa-l/crc.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EXPERTCACHE_CRC_X86 1
#define EXPERTCACHE_CLMUL __attribute__((target("pclmul,sse4.1")))
#endif

namespace expertcache {
namespace detail {

uint32_t crc32_zlib(uint32_t crc, const uint8_t* p, uint64_t n) {
  uLong c = crc;
  while (n > 0) {
    const uInt piece = static_cast<uInt>(std::min<uint64_t>(n, 1u << 30));
    c = ::crc32(c, p, piece);
    p += piece;
    n -= piece;
  }
  return static_cast<uint32_t>(c);
}

#ifdef EXPERTCACHE_CRC_X86

bool cpu_has_pclmul() {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return has;
}

namespace {

constexpr long long kK7 = 0x1e88ef372LL;
constexpr long long kK8 = 0x14a7fe880LL;
constexpr long long kK1 = 0x154442bd4LL;
constexpr long long kK2 = 0x1c6e41596LL;
constexpr long long kK3 = 0x1751997d0LL;
constexpr long long kK4 = 0x0ccaa009eLL;
constexpr long long kK5 = 0x163cd6124LL;
constexpr long long kMu = 0x1f7011641LL;
constexpr long long kPoly = 0x1db710641LL;

// x's low half times k's low, x's high half times k's high, plus the next 128 bits.
EXPERTCACHE_CLMUL inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  const __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
  const __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

EXPERTCACHE_CLMUL inline __m128i load(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

}  // namespace

EXPERTCACHE_CLMUL uint32_t crc32_pclmul(uint32_t crc, const uint8_t* p, uint64_t n) {
  if (n < 64) return crc32_zlib(crc, p, n);
  // zlib's CRC is the complement of the shift register.
  const uint32_t reg = ~crc;
  const __m128i k1k2 = _mm_set_epi64x(kK2, kK1);
  const __m128i k3k4 = _mm_set_epi64x(kK4, kK3);
  __m128i x1 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(reg)));
  __m128i x2 = load(p + 16);
  __m128i x3 = load(p + 32);
  __m128i x4 = load(p + 48);
  p += 64;
  n -= 64;
  if (n >= 64) {
    // Eight lanes, 1024 bits apart, while 128 bytes remain; then lanes 1-4 fold into 5-8.
    const __m128i k7k8 = _mm_set_epi64x(kK8, kK7);
    __m128i x5 = load(p), x6 = load(p + 16), x7 = load(p + 32), x8 = load(p + 48);
    p += 64;
    n -= 64;
    while (n >= 128) {
      x1 = fold(x1, k7k8, load(p));
      x2 = fold(x2, k7k8, load(p + 16));
      x3 = fold(x3, k7k8, load(p + 32));
      x4 = fold(x4, k7k8, load(p + 48));
      x5 = fold(x5, k7k8, load(p + 64));
      x6 = fold(x6, k7k8, load(p + 80));
      x7 = fold(x7, k7k8, load(p + 96));
      x8 = fold(x8, k7k8, load(p + 112));
      p += 128;
      n -= 128;
    }
    x1 = fold(x1, k1k2, x5);
    x2 = fold(x2, k1k2, x6);
    x3 = fold(x3, k1k2, x7);
    x4 = fold(x4, k1k2, x8);
  }
  while (n >= 64) {
    x1 = fold(x1, k1k2, load(p));
    x2 = fold(x2, k1k2, load(p + 16));
    x3 = fold(x3, k1k2, load(p + 32));
    x4 = fold(x4, k1k2, load(p + 48));
    p += 64;
    n -= 64;
  }
  x1 = fold(x1, k3k4, x2);
  x1 = fold(x1, k3k4, x3);
  x1 = fold(x1, k3k4, x4);
  while (n >= 16) {
    x1 = fold(x1, k3k4, load(p));
    p += 16;
    n -= 16;
  }
  // 128 -> 64 bits (and the 32 zero bits a CRC appends): the low half times k4.
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(x1, k3k4, 0x10));
  // 96 -> 64 bits: the low 32 bits times k5.
  const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
  const __m128i k5 = _mm_set_epi64x(0, kK5);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 4), _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k5, 0x00));
  // Barrett: q = (low 32 bits * mu) mod x^32, then the register = x1 + q * P.
  const __m128i mu_poly = _mm_set_epi64x(kMu, kPoly);
  __m128i q = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), mu_poly, 0x10);
  q = _mm_clmulepi64_si128(_mm_and_si128(q, mask32), mu_poly, 0x00);
  x1 = _mm_xor_si128(x1, q);
  crc = ~static_cast<uint32_t>(_mm_extract_epi32(x1, 1));
  return crc32_zlib(crc, p, n);
}

#else

bool cpu_has_pclmul() { return false; }

uint32_t crc32_pclmul(uint32_t crc, const uint8_t* p, uint64_t n) { return crc32_zlib(crc, p, n); }

#endif

}  // namespace detail

const char* crc32_impl() {
#ifdef EXPERTCACHE_WITH_ISAL
  return "isa-l";
#else
  return detail::cpu_has_pclmul() ? "pclmul" : "zlib";
#endif
}

uint32_t crc32_update(uint32_t crc, const void* data, uint64_t nbytes) {
  const auto* p = static_cast<const uint8_t*>(data);
#ifdef EXPERTCACHE_WITH_ISAL
  // ISA-L's reflected gzip CRC is zlib's: carry-less multiplication with AVX-512 where present.
  return crc32_gzip_refl(crc, p, nbytes);
#else
  if (detail::cpu_has_pclmul()) return detail::crc32_pclmul(crc, p, nbytes);
  return detail::crc32_zlib(crc, p, nbytes);
#endif
}

uint32_t crc32(const void* data, uint64_t nbytes) { return crc32_update(0, data, nbytes); }

}  // namespace expertcache
