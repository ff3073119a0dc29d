// zlib's CRC-32 (reflected polynomial 0xEDB88320; the store manifest's checksum), by the fastest
// implementation this build and CPU have: ISA-L when the build found libisal, else carry-less
// multiplication (PCLMULQDQ) when the CPU has it, else zlib's table-driven code.
#pragma once

#include <cstdint>

namespace expertcache {

// "isa-l", "pclmul" or "zlib": the implementation crc32() uses on this machine.
const char* crc32_impl();

// zlib-compatible CRC-32 of nbytes at data.
uint32_t crc32(const void* data, uint64_t nbytes);

// zlib's crc32(crc, data, nbytes): continues crc (0 to start) over nbytes more at data.
uint32_t crc32_update(uint32_t crc, const void* data, uint64_t nbytes);

namespace detail {
// The carry-less multiplication path alone (the CPU must have PCLMULQDQ and SSE4.1), for tests.
uint32_t crc32_pclmul(uint32_t crc, const uint8_t* p, uint64_t n);
bool cpu_has_pclmul();
// zlib's crc32 over any length (zlib takes a uInt length).
uint32_t crc32_zlib(uint32_t crc, const uint8_t* p, uint64_t n);
}  // namespace detail

}  // namespace expertcache
