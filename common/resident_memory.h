#pragma once
// How much of a buffer occupies physical memory right now. Allocating reserves address space; the
// operating system backs a page with memory only when it is first written. So a cache allocated for 2048
// positions with 24 written holds a few pages, not its allocated size: this measures that (mincore),
// instead of trusting the cache's own bookkeeping.
#include <cstddef>
#include <cstdint>

namespace kvs {

// Bytes of the pages overlapping [data, data + bytes) that are resident (whole pages).
std::int64_t resident_bytes(const void* data, std::size_t bytes);

// The process's peak resident memory so far (getrusage's ru_maxrss): it only grows.
std::int64_t peak_resident_bytes();

}  // namespace kvs
