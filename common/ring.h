#pragma once
// Where a sliding-window cache keeps each position: a ring of `slots` slots whose first `sinks` slots hold
// positions 0 .. sinks-1 forever (attention sinks) and whose other slots are reused in turn, position p
// (p >= sinks) in slot sinks + (p - sinks) mod (slots - sinks). The one definition of that arithmetic:
// the CPU cache, the CUDA kernels and the tests all call these functions.
//
// How many slots: a forward pass over n positions writes all n before any of its queries attends, so a
// ring that must still show each query its window of W keys needs W + n - 1 slots (n = the most positions
// one call writes: 1 when decoding, the chunk size when prefilling in chunks). With exactly W slots, a
// chunk's later positions would overwrite keys its earlier queries still need.
#include "host_device.h"

namespace kvs {

struct Ring {
  int slots = 1;  // > sinks
  int sinks = 0;

  // The ring that never wraps: position p in slot p (chapter 03's preallocated cache, whose row p holds
  // position p), for positions below 2^31 - 1.
  static constexpr Ring unbounded() { return Ring{2147483647, 0}; }

  // The slot position `pos` is written to.
  KVS_HOST_DEVICE int write_slot(int pos) const {
    return pos < sinks ? pos : sinks + (pos - sinks) % (slots - sinks);
  }
  // The position slot `slot` holds once positions 0 .. length-1 have been written in order, or -1 if the
  // slot was never written.
  KVS_HOST_DEVICE int position_in(int slot, int length) const {
    if (slot < sinks) return slot < length ? slot : -1;
    const int turn = slots - sinks, written = length - sinks, offset = slot - sinks;
    if (offset >= written) return -1;  // the ring has not reached this slot yet
    const int last = written - 1;      // the newest position's offset past the sinks
    return sinks + last - (last - offset) % turn;
  }
};

}  // namespace kvs
