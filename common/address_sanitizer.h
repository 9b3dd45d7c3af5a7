#pragma once
// KVS_ADDRESS_SANITIZER is 1 in a build under AddressSanitizer, 0 otherwise. g++ says so by defining
// __SANITIZE_ADDRESS__; Clang 14 does not, and says so only through __has_feature(address_sanitizer). Code that
// must change under the sanitizer (the harness's fiber switches, the malloc counter) asks this, not either one,
// so that both compilers' sanitizer builds take it.
#if defined(__SANITIZE_ADDRESS__)
#define KVS_ADDRESS_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVS_ADDRESS_SANITIZER 1
#endif
#endif
#ifndef KVS_ADDRESS_SANITIZER
#define KVS_ADDRESS_SANITIZER 0
#endif
