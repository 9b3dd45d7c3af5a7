#pragma once
// The context wall measured (03_benchmark --context-wall): "keep increasing T until allocation fails".
// Preallocated caches of growing length are allocated for real, one at a time, and their last position
// written, until the memory refuses one; bisection then narrows the wall down to 0.1%. Next to it, the
// formula's prediction: the memory left after the weights and working buffers, divided by the cache's
// bytes per position, 2 · layers · kv_heads · head_dim · 4.
//
// What refuses: on a GPU, cudaMalloc (device memory is backed when allocated; the prediction uses the free
// memory the driver reports before the first cache). On the CPU, Linux hands out address space lazily and
// backs a page only when it is first written, so an allocation alone refuses only far past the physical
// memory; there the wall is the stated budget, --memory-limit, which the run's memory plan enforces.
#include "csv.h"
#include "runtime.h"

namespace kvs::ch03 {

// A table of the attempts and the wall on stderr; one CSV row per attempt.
void measure_context_wall(Runtime& rt, CsvWriter& csv);

}  // namespace kvs::ch03
