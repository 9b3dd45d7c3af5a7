#include "prefix_cache.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kvs::ch09 {
namespace {
constexpr int kNotQueued = -2;
}

std::uint64_t fnv1a_block_hash(std::uint64_t parent_serial, std::span<const int> tokens) {
  std::uint64_t h = 14695981039346656037ull;
  auto mix = [&](std::uint64_t value) {
    for (int byte = 0; byte < 8; ++byte) h = (h ^ ((value >> (8 * byte)) & 0xff)) * 1099511628211ull;
  };
  mix(parent_serial);
  for (int token : tokens) mix(static_cast<std::uint32_t>(token));
  return h;
}

PrefixCache::PrefixCache(ch08::BlockPool& pool, PrefixCacheOptions options)
    : pool_(pool), options_(options), references_(pool.blocks(), 0), previous_(pool.blocks(), kNotQueued),
      next_(pool.blocks(), kNotQueued), serial_(pool.blocks(), 0), parent_(pool.blocks(), 0), hash_(pool.blocks(), 0),
      block_tokens_(std::size_t(pool.blocks()) * pool.block_size(), 0), chain_(pool.blocks(), -1),
      progress_(pool.sequences()) {
  if (!options_.hash) throw std::invalid_argument("PrefixCache: no hash function");
  if (pool.free_blocks() != pool.blocks()) throw std::invalid_argument("PrefixCache: the pool has blocks in use");
  std::size_t buckets = 1;
  while (buckets < 2 * std::size_t(pool.blocks())) buckets *= 2;  // at most one published key per two buckets
  bucket_.assign(buckets, -1);
  for (int block; (block = pool.take_block()) >= 0;) queue_push(block, false);  // 0 first, as chapter 08's pool
}

// ---- the free queue ----

void PrefixCache::queue_push(int block, bool front) {
  if (front) {
    previous_[block] = -1, next_[block] = front_;
    if (front_ >= 0) previous_[front_] = block;
    else back_ = block;
    front_ = block;
  } else {
    previous_[block] = back_, next_[block] = -1;
    if (back_ >= 0) next_[back_] = block;
    else front_ = block;
    back_ = block;
  }
  ++queued_;
}

void PrefixCache::queue_remove(int block) {
  if (previous_[block] == kNotQueued) throw std::logic_error("PrefixCache: block " + std::to_string(block) + " is not free");
  if (previous_[block] >= 0) next_[previous_[block]] = next_[block];
  else front_ = next_[block];
  if (next_[block] >= 0) previous_[next_[block]] = previous_[block];
  else back_ = previous_[block];
  previous_[block] = next_[block] = kNotQueued;
  --queued_;
}

// ---- the published blocks ----

int PrefixCache::find(std::uint64_t parent_serial, std::span<const int> tokens) const {
  const std::uint64_t h = options_.hash(parent_serial, tokens);
  for (int block = bucket_[h & (bucket_.size() - 1)]; block >= 0; block = chain_[block])
    if (hash_[block] == h && parent_[block] == parent_serial && std::ranges::equal(tokens_of(block), tokens))
      return block;  // the same key: its parent (so its whole prefix) and every token
  return -1;
}

void PrefixCache::publish(int block, std::uint64_t parent_serial, std::span<const int> tokens) {
  const std::uint64_t h = options_.hash(parent_serial, tokens);
  std::ranges::copy(tokens, block_tokens_.begin() + std::ptrdiff_t(block) * pool_.block_size());
  serial_[block] = next_serial_++, parent_[block] = parent_serial, hash_[block] = h;
  int& first = bucket_[h & (bucket_.size() - 1)];
  chain_[block] = first, first = block;
}

void PrefixCache::unpublish(int block) {
  int* link = &bucket_[hash_[block] & (bucket_.size() - 1)];
  while (*link != block) link = &chain_[*link];
  *link = chain_[block];
  chain_[block] = -1, serial_[block] = 0;
}

int PrefixCache::published_blocks() const {
  return static_cast<int>(std::ranges::count_if(serial_, [](std::uint64_t s) { return s != 0; }));
}

// ---- BlockSource ----

int PrefixCache::take_block() {
  const int block = front_;
  if (block < 0) return -1;
  queue_remove(block);
  if (published(block)) unpublish(block), ++stats_.evictions;  // the least recently used cached block goes
  references_[block] = 1;
  return block;
}

void PrefixCache::give_back_blocks(std::span<const int> blocks) {
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {  // the last block first: evicted before the head
    const int block = *it;
    if (references_[block] < 1) throw std::logic_error("PrefixCache: block " + std::to_string(block) + " given back by no holder");
    if (--references_[block] > 0) continue;  // another sequence still holds it
    // Free. A published block keeps its key, at the back: found again until it is the oldest. An unpublished
    // one (a partly filled last block, a duplicate) holds nothing a lookup can find: reused first.
    queue_push(block, !published(block));
  }
}

void PrefixCache::share_block(int block) {
  if (references_[block] == 0) queue_remove(block);  // a cached block no one held: out of the free queue
  ++references_[block];
}

int PrefixCache::writable_block(int block) {
  if (references_[block] <= 1 || !options_.copy_on_write) return block;
  const int copy = take_block();
  if (copy < 0) return -1;
  pool_.copy_block(copy, block);
  --references_[block];  // the others keep the original
  ++stats_.cow_copies;
  return copy;
}

// ---- SequenceCaches ----

std::vector<int> PrefixCache::match(std::span<const int> tokens) const {
  const int block_size = pool_.block_size();
  // Whole blocks only, and never the last token: its forward pass gives the logits of the next one.
  const int lookups = tokens.empty() ? 0 : static_cast<int>(tokens.size() - 1) / block_size;
  std::vector<int> blocks;
  std::uint64_t parent = 0;
  for (int i = 0; i < lookups; ++i) {
    const int block = find(parent, tokens.subspan(std::size_t(i) * block_size, block_size));
    if (block < 0) break;
    blocks.push_back(block);
    parent = serial_[block];
  }
  return blocks;
}

std::unique_ptr<ch08::PagedSequence> PrefixCache::start(std::span<const int> tokens) {
  const std::vector<int> cached = match(tokens);
  auto cache = std::make_unique<ch08::PagedSequence>(pool_, this);
  if (!cached.empty()) cache->start_from(cached, static_cast<int>(cached.size()) * pool_.block_size());
  progress_[cache->table_slot()] = Progress{static_cast<int>(cached.size()), cached.empty() ? 0 : serial_[cached.back()]};
  return cache;
}

void PrefixCache::filled(ch08::PagedSequence& cache, std::span<const int> tokens) {
  Progress& done = progress_[cache.table_slot()];
  const int block_size = pool_.block_size();
  for (; (done.blocks + 1) * block_size <= cache.length(); ++done.blocks) {
    const int block = cache.blocks()[done.blocks];
    const std::span<const int> own = tokens.subspan(std::size_t(done.blocks) * block_size, block_size);
    // The block whose serial keys our next block: ours, or - when another sequence published the same tokens
    // first (both prefilled them at once) - that one's; ours then stays unpublished.
    int keyed = block;
    if (!published(block)) {
      const int same = find(done.parent_serial, own);
      if (same < 0) publish(block, done.parent_serial, own);
      else keyed = same;
    }
    done.parent_serial = serial_[keyed];
  }
}

void PrefixCache::audit(const std::vector<const ch08::PagedSequence*>& running) {
  holders_.assign(pool_.blocks(), 0);
  for (const ch08::PagedSequence* s : running)
    for (int block : s->blocks()) ++holders_[block];
  auto fail = [](int block, const std::string& what) { return std::logic_error("block " + std::to_string(block) + what); };
  for (int block = 0; block < pool_.blocks(); ++block) {  // (before every scheduler step: no string unless it fails)
    if (references_[block] != holders_[block])
      throw fail(block, " has reference count " + std::to_string(references_[block]) + " but " +
                            std::to_string(holders_[block]) + " running sequences hold it");
    if ((references_[block] == 0) != (previous_[block] != kNotQueued))
      throw fail(block, references_[block] == 0 ? " is held by no one but not free" : " is free and held");
    if (published(block) && find(parent_[block], tokens_of(block)) != block)
      throw fail(block, " is published but its key finds another block");
  }
  int count = 0;
  for (int block = front_; block >= 0; block = next_[block]) ++count;
  if (count != queued_) throw std::logic_error("PrefixCache: the free queue holds " + std::to_string(count) +
                                               " blocks, not the " + std::to_string(queued_) + " it counts");
}

}  // namespace kvs::ch09
