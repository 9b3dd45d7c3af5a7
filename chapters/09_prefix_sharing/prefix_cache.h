#pragma once
// Chapter 09's cache: chapter 08's pool of blocks, with reference counts and a memory of what each block holds
// (vLLM's automatic prefix caching), so that sequences whose tokens begin alike hold those blocks once.
//
// Why it is safe: a position's key and value depend on its token and on every token before it, nothing else
// (the model is causal). Two sequences that agree on their first p tokens have the same K/V at positions
// 0 .. p-1 - and from the first token where they differ on, nothing more in common. So a *full* block can
// serve any sequence whose tokens agree with it up to the block's end, and only then.
//
// How a block is found again (vLLM's way rather than SGLang's radix tree: the pool already thinks in blocks,
// and one flat table is less code than a tree): a full block is *published* under a key - the serial number of
// the block before it (0 for a sequence's first block) and its block_size tokens. A lookup walks a new
// sequence's tokens block by block from its first, each step keyed by the serial the last step found. Keys
// are hashed to find candidates quickly, and a candidate matches only when its parent serial and every one of
// its tokens are equal: a hash says where to look, never that two blocks are the same. Serials are never
// reused, so an entry whose parent was evicted (its block reused for other text) can never be reached again.
//
// Lifetime: a block held by k sequences has reference count k. At 0 it joins the back of the free queue and
// stays published - a later request can still find it and take it back out - until the pool needs a block:
// blocks are taken from the front, least recently given back first, and a published one is unpublished then
// (evicted). A sequence gives its blocks back last block first, so a prefix's tail is evicted before its head,
// which more requests share.
//
// Copy-on-write: a block held by several sequences is never written. A sequence about to append into a shared
// block (siblings of parallel sampling share their prompt's last, partly filled block) gets a copy of it first
// (writable_block). Published blocks are never written at all: only full blocks are published, and a sequence
// starts with at least its prompt's last token uncached (start), so it appends after its cached blocks.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "08_paged_batching/paged_kv_cache.h"
#include "08_paged_batching/scheduler.h"

namespace kvs::ch09 {

// Where a published block's key is looked for: any function of the key will do for correctness (tests use
// one that sends every key to the same place), only lookups get slower when keys collide.
using BlockHash = std::uint64_t (*)(std::uint64_t parent_serial, std::span<const int> tokens);
std::uint64_t fnv1a_block_hash(std::uint64_t parent_serial, std::span<const int> tokens);

struct PrefixCacheOptions {
  // Off only for the break experiment: a sequence then appends into a block its siblings hold.
  bool copy_on_write = true;
  BlockHash hash = fnv1a_block_hash;
};

struct PrefixCacheStats {
  long evictions = 0;    // published blocks unpublished because the pool needed them
  long cow_copies = 0;   // shared blocks copied before a write
};

class PrefixCache final : public ch08::BlockSource, public ch08::SequenceCaches {
 public:
  // Takes every block of `pool` (it must have all of them free) and manages them from then on: the pool lends
  // them for the cache's life (the two are made and dropped together, a run's pool and its cache).
  explicit PrefixCache(ch08::BlockPool& pool, PrefixCacheOptions options = {});
  PrefixCache(const PrefixCache&) = delete;

  // ---- BlockSource: what a PagedSequence over this cache calls ----
  int take_block() override;  // the front of the free queue (evicting it if published), or -1
  void give_back_blocks(std::span<const int> blocks) override;
  void share_block(int block) override;
  void sequence_started(int table_slot) override { progress_[table_slot] = Progress{}; }
  bool shared(int block) const override { return references_[block] > 1; }
  int writable_block(int block) override;  // copy-on-write

  // ---- SequenceCaches: what chapter 08's scheduler calls ----
  ch08::BlockPool& pool() override { return pool_; }
  // A sequence holding the longest cached prefix of `tokens` (whole blocks, leaving the last token uncached).
  std::unique_ptr<ch08::PagedSequence> start(std::span<const int> tokens) override;
  // Publishes each block of `cache` that the last forward pass filled (tokens: what it holds), for any sequence
  // over this cache (one not made by start() is walked from its first block).
  void filled(ch08::PagedSequence& cache, std::span<const int> tokens) override;
  int available_blocks() const override { return queued_; }
  int held_blocks() const override { return pool_.blocks() - queued_; }
  // Every block's reference count equals the number of `running` sequences that hold it, the free queue holds
  // exactly the blocks no one holds, and every published block's key finds it: std::logic_error naming the
  // first block that disagrees.
  void audit(const std::vector<const ch08::PagedSequence*>& running) override;

  // The cached blocks a sequence with `tokens` would start with, without taking them.
  std::vector<int> match(std::span<const int> tokens) const;
  int references(int block) const { return references_[block]; }
  bool published(int block) const { return serial_[block] != 0; }
  int published_blocks() const;
  const PrefixCacheStats& stats() const { return stats_; }

 private:
  // The published block with this key, or -1.
  int find(std::uint64_t parent_serial, std::span<const int> tokens) const;
  void publish(int block, std::uint64_t parent_serial, std::span<const int> tokens);
  void unpublish(int block);
  std::span<const int> tokens_of(int block) const {
    return {block_tokens_.data() + std::size_t(block) * pool_.block_size(), std::size_t(pool_.block_size())};
  }
  // The free queue, a doubly linked list through the blocks: front = evicted first.
  void queue_push(int block, bool front);
  void queue_remove(int block);

  ch08::BlockPool& pool_;
  PrefixCacheOptions options_;
  PrefixCacheStats stats_;
  std::vector<int> references_;            // (blocks) sequences holding each block
  std::vector<int> previous_, next_;       // (blocks) free-queue links, -1 at the ends; -2: not queued
  int front_ = -1, back_ = -1, queued_ = 0;
  // The published blocks: a hash table chained through the blocks themselves (no allocation after construction).
  std::vector<std::uint64_t> serial_;      // (blocks) serial number while published, 0 otherwise
  std::vector<std::uint64_t> parent_;      // (blocks) the parent serial of its key
  std::vector<std::uint64_t> hash_;        // (blocks) its key's hash
  std::vector<int> block_tokens_;          // (blocks, block_size) its key's tokens
  std::vector<int> bucket_, chain_;        // (buckets) first block, (blocks) next block in the same bucket
  std::uint64_t next_serial_ = 1;
  // What filled() has published of each running sequence, by its table slot: whole blocks done, and the serial
  // its next block's key takes as parent.
  struct Progress {
    int blocks = 0;
    std::uint64_t parent_serial = 0;
  };
  std::vector<Progress> progress_;         // (sequence slots)
  std::vector<int> holders_;               // (blocks) audit's scratch
};

}  // namespace kvs::ch09
