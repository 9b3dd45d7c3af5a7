#pragma once
// Where a paged cache keeps each position (chapter 08, vLLM's PagedAttention): the cache's storage is a pool of
// fixed-size blocks of `block_size` rows; a sequence owns a block table, its i-th block of positions -> a
// physical block of the pool, so position p of the sequence lives in physical row
//   blocks[p / block_size] · block_size + p % block_size.
// The one definition of that arithmetic: the CPU and CUDA attention, the cache write and the tests call it.
// Within a block the rows are consecutive; two neighbouring blocks of a sequence need not be.
#include "host_device.h"

namespace kvs {

struct BlockTable {
  const int* blocks = nullptr;  // (blocks a sequence holds) physical block ids, in the memory of who reads it
  int block_size = 0;           // rows per block, >= 1

  // The physical row of the sequence's row (= position) `row`.
  KVS_HOST_DEVICE int physical_row(int row) const {
    return blocks[row / block_size] * block_size + row % block_size;
  }
  // The end of the run of rows stored one after another from `row` on: its block's end, at most `end`.
  KVS_HOST_DEVICE int run_end(int row, int end) const {
    const int block_end = (row / block_size + 1) * block_size;
    return block_end < end ? block_end : end;
  }
};

// Blocks a sequence of `positions` positions needs (ceil(positions / block_size)).
KVS_HOST_DEVICE inline int blocks_needed(int positions, int block_size) {
  return (positions + block_size - 1) / block_size;
}

}  // namespace kvs
