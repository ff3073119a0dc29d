// A float's bits and back, without aliasing (the decode and the fused expert FFN use them).
#pragma once

#include <cstdint>
#include <cstring>

namespace expertcache {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace expertcache
