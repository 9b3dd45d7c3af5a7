// Counts heap allocations. Two ways, one per kind of build:
//  - normally, glibc lets a program interpose malloc and friends: these forward to glibc's own allocator
//    and count;
//  - under AddressSanitizer, which brings its own allocator (and is not ready yet when the first malloc of
//    the process runs, so an interposed malloc crashes it), the count comes from the sanitizer's
//    allocation hook instead.
#include "malloc_counter.h"

#include <atomic>
#include <cerrno>
#include <cstddef>

#include "address_sanitizer.h"

namespace {
std::atomic<long> g_allocations{0};
}

long kvs::heap_allocations() { return g_allocations.load(std::memory_order_relaxed); }

#if KVS_ADDRESS_SANITIZER
// From the sanitizer runtime's allocator interface (declared here: g++ does not install its headers).
extern "C" int __sanitizer_install_malloc_and_free_hooks(void (*on_malloc)(const volatile void*, std::size_t),
                                                        void (*on_free)(const volatile void*));

namespace {
void count_allocation(const volatile void*, std::size_t) { g_allocations.fetch_add(1, std::memory_order_relaxed); }
void ignore_free(const volatile void*) {}
// Installed before main; the allocations before it are not decode steps.
const int g_hooks_installed = __sanitizer_install_malloc_and_free_hooks(count_allocation, ignore_free);
}  // namespace

#else
extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);
void __libc_free(void*);
}

extern "C" {
void* malloc(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_malloc(n);
}
void* calloc(std::size_t count, std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_calloc(count, n);
}
void* realloc(void* p, std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_realloc(p, n);
}
void* memalign(std::size_t alignment, std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_memalign(alignment, n);
}
void* aligned_alloc(std::size_t alignment, std::size_t n) { return memalign(alignment, n); }
int posix_memalign(void** out, std::size_t alignment, std::size_t n) {
  *out = memalign(alignment, n);
  return *out ? 0 : ENOMEM;
}
void free(void* p) { __libc_free(p); }
}
#endif
