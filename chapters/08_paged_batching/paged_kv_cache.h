#pragma once
// Chapter 08's cache: a pool of fixed-size blocks shared by every sequence a server runs (vLLM's
// PagedAttention). The pool is allocated once, for the budget the run is given; a sequence takes a block when
// its next position needs one and gives every block back when it finishes (or is preempted). Its block table
// says where each of its blocks sits: position p in physical row table[p / block_size] · block_size +
// p % block_size (common/block_table.h), which the cache write and attention both compute.
//
// Why blocks: a cache preallocated per sequence (chapter 03) must reserve the longest sequence it might
// hold, and holds it until the sequence ends; a paged sequence holds at most block_size - 1 positions it does
// not use (the tail of its last block). A block size equal to the model's context is that per-sequence
// reservation again: one block a sequence, of every position it might ever need.
//
// Layout: [layer][K or V][physical row][kv_dim], rows = blocks · block_size: a block's rows are consecutive,
// so attention reads a block as it reads chapter 03's buffer; the blocks of one sequence are anywhere.
// Block tables live in backend memory too, one row of table_width() entries per sequence slot.
// A pool may store its rows coded (chapter 10's formats, common/kv_format.h): a side is then its rows' codes,
// then their scales (CodedRows), each indexed by the same physical row - so a block table finds a coded row
// exactly as it finds a float one, and the same budget holds more blocks.
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend.h"
#include "block_table.h"
#include "config.h"
#include "kv_cache.h"
#include "kv_format.h"

namespace kvs::ch08 {

// Where a paged sequence's blocks come from and where they go back. Chapter 08's pool hands each block to one
// sequence at a time. Chapter 09's prefix cache counts references instead, so that sequences with a common
// prefix hold its blocks once, and keeps a block given back findable until the pool needs it.
class BlockSource {
 public:
  virtual ~BlockSource() = default;
  // A block for one sequence's own use, or -1 when none is left.
  virtual int take_block() = 0;
  // Every block of a sequence that finishes (or is preempted), in its table's order.
  virtual void give_back_blocks(std::span<const int> blocks) = 0;
  // One more sequence holds `block` (it starts with a cached prefix, or is forked from a sibling).
  virtual void share_block(int block) = 0;
  // A sequence took row `table_slot` of the pool's block tables: it holds no block yet.
  virtual void sequence_started(int /*table_slot*/) {}
  // Whether another sequence holds `block` too: it must not be written (see writable_block).
  virtual bool shared(int /*block*/) const { return false; }
  // The block a sequence appends into in place of `block`, the last of its table: `block` itself when no one
  // else holds it, or else a private copy (copy-on-write: chapter 09); -1 when the copy finds no free block.
  virtual int writable_block(int block) { return block; }
};

// How a pool stores its rows: chapter 10's formats (common/kv_format.h); fp32 unless a run asks.
struct PoolFormat {
  KvFormat format = KvFormat::kFp32;
  int int4_group = 32;  // int4: channels per scale
};

class BlockPool final : public BlockSource {
 public:
  // `blocks` blocks of `block_size` positions, for up to `max_sequences` sequences at once of up to
  // `max_positions` positions each, every row stored in `format`. Throws std::invalid_argument for sizes that
  // make no pool.
  BlockPool(Backend& backend, const ModelConfig& config, int blocks, int block_size, int max_sequences,
            int max_positions, PoolFormat format = {})
      : backend_(backend),
        format_(format),
        layout_(checked_layout(config, format, check_positive("block size", block_size))),
        kv_dim_(config.kv_dim()),
        n_layers_(config.n_layers),
        blocks_(check_blocks(blocks, block_size)),
        block_size_(block_size),
        table_width_(blocks_needed(check_positive("positions per sequence", max_positions), block_size)),
        side_floats_(std::size_t(blocks) * block_size * (layout_.code_bytes() + sizeof(float) * layout_.scales_per_row()) / sizeof(float)),
        storage_(backend, std::size_t(config.n_layers) * 2 * side_floats_),
        tables_(backend, std::size_t(check_positive("sequences", max_sequences)) * table_width_) {
    for (int b = blocks - 1; b >= 0; --b) free_blocks_.push_back(b);  // taken from the back: block 0 first
    for (int s = max_sequences - 1; s >= 0; --s) free_tables_.push_back(s);
  }
  BlockPool(const BlockPool&) = delete;

  // A free block, or -1 when none is left.
  int take_block() override {
    if (free_blocks_.empty()) return -1;
    const int block = free_blocks_.back();
    free_blocks_.pop_back();
    return block;
  }
  void give_back_block(int block) {
    free_blocks_.push_back(block);
    if (double_free_next_) free_blocks_.push_back(block), double_free_next_ = false;  // the bug: see break_double_free
  }
  void give_back_blocks(std::span<const int> blocks) override {
    for (int block : blocks) give_back_block(block);
  }
  void share_block(int block) override {
    throw std::logic_error("BlockPool: block " + std::to_string(block) + " would be held twice; this pool gives each "
                           "block to one sequence (sharing needs chapter 09's reference counts)");
  }
  // Every layer's keys and values of block `from` into block `to` (copy-on-write's copy): codes and scales.
  void copy_block(int to, int from) {
    const std::size_t code_floats = std::size_t(block_size_) * layout_.code_bytes() / sizeof(float),
                      scale_floats = std::size_t(block_size_) * layout_.scales_per_row();
    for (int layer = 0; layer < n_layers_; ++layer)
      for (int kv = 0; kv < 2; ++kv) {
        const CodedRows s = side(layer, kv);
        float* codes = reinterpret_cast<float*>(s.codes);
        backend_.copy(codes + to * code_floats, codes + from * code_floats, code_floats);
        if (scale_floats > 0) backend_.copy(s.scales + to * scale_floats, s.scales + from * scale_floats, scale_floats);
      }
  }
  // Chapter 08's break experiment, a classic allocator bug: the next block given back goes on the free list
  // twice, so two later requests are both handed it, each believing it is its own. Nothing else changes.
  void break_double_free() { double_free_next_ = true; }
  // A free row of the backend's block tables (a sequence slot), or -1.
  int take_table() {
    if (free_tables_.empty()) return -1;
    const int table = free_tables_.back();
    free_tables_.pop_back();
    return table;
  }
  void give_back_table(int table) { free_tables_.push_back(table); }

  int blocks() const { return blocks_; }
  static int max_blocks(int block_size) { return 2147483647 / block_size; }  // the most blocks a pool may have
  int free_blocks() const { return static_cast<int>(free_blocks_.size()); }
  const std::vector<int>& free_list() const { return free_blocks_; }
  int used_blocks() const { return blocks_ - free_blocks(); }
  int block_size() const { return block_size_; }
  int table_width() const { return table_width_; }  // blocks one sequence may hold
  int sequences() const { return static_cast<int>(tables_.size()) / table_width_; }  // sequence slots
  int kv_dim() const { return kv_dim_; }
  int n_layers() const { return n_layers_; }
  Backend& backend() { return backend_; }
  KvFormat format() const { return layout_.format; }
  PoolFormat pool_format() const { return format_; }
  // A layer's keys (kv = 0) or values (kv = 1) of an fp32 pool: (blocks · block_size, kv_dim) rows.
  float* rows(int layer, int kv) const {
    if (layout_.format != KvFormat::kFp32)
      throw std::logic_error(std::string("BlockPool: its rows are ") + to_string(layout_.format) + " codes, not floats");
    return side_start(layer, kv);
  }
  // A layer's keys (kv = 0) or values (kv = 1) as coded rows, whatever the format (fp32: float rows).
  CodedRows side(int layer, int kv) const {
    CodedRows s = layout_;
    s.codes = reinterpret_cast<std::uint8_t*>(side_start(layer, kv));
    s.scales = side_start(layer, kv) + std::size_t(blocks_) * block_size_ * layout_.code_bytes() / sizeof(float);
    return s;
  }
  // Row `table` of the block tables in backend memory: (table_width) physical block ids.
  int* table(int table) { return tables_.data() + std::size_t(table) * table_width_; }
  // The keys and values of every block: 2 · layers · blocks · block_size · (what a row of one side costs in the
  // format, scales included) - for fp32, 2 · layers · kv_heads · head_dim · blocks · block_size · 4 bytes.
  std::int64_t allocated_bytes() const { return std::int64_t(storage_.size()) * sizeof(float); }
  std::int64_t bytes_per_position() const { return std::int64_t{2} * n_layers_ * layout_.row_bytes(); }
  // What one block of `block_size` positions costs in `format`: what a budget is divided by.
  static std::int64_t block_bytes(const ModelConfig& config, int block_size, PoolFormat format = {}) {
    return std::int64_t{2} * config.n_layers * block_size * checked_layout(config, format, block_size).row_bytes();
  }

 private:
  // Rows are ints (BlockTable::physical_row: block · block_size + offset), so a pool holds at most 2^31 - 1 of them.
  static int check_blocks(int blocks, int block_size) {
    if (std::int64_t(check_positive("blocks", blocks)) > max_blocks(block_size))
      throw std::invalid_argument("BlockPool: " + std::to_string(blocks) + " blocks of " + std::to_string(block_size) +
                                  " rows are more rows than an int numbers");
    return blocks;
  }
  static int check_positive(const char* what, int value) {
    if (value < 1) throw std::invalid_argument(std::string("BlockPool: ") + what + " must be at least 1, not " + std::to_string(value));
    return value;
  }
  // The shape of a side's rows in `format`; a block's codes must be whole floats, so that copy_block copies floats.
  static CodedRows checked_layout(const ModelConfig& config, PoolFormat f, int block_size) {
    if (const std::string why = kv_format_shape_error(f.format, config.head_dim(), f.int4_group); !why.empty())
      throw std::invalid_argument("BlockPool: " + why);
    const CodedRows layout = coded_rows_layout(f.format, config.n_kv_heads, config.head_dim(), f.int4_group);
    if (std::int64_t(block_size) * layout.code_bytes() % sizeof(float) != 0)
      throw std::invalid_argument("BlockPool: a block of " + std::to_string(block_size) + " " + to_string(f.format) +
                                  " rows is " + std::to_string(std::int64_t(block_size) * layout.code_bytes()) +
                                  " bytes of codes, not whole floats; use a block size that is a multiple of 4");
    return layout;
  }
  float* side_start(int layer, int kv) const {
    return const_cast<float*>(storage_.data()) + (std::size_t(layer) * 2 + kv) * side_floats_;
  }
  Backend& backend_;
  PoolFormat format_;
  CodedRows layout_;  // the format and shape of every side's rows; no memory
  int kv_dim_, n_layers_, blocks_, block_size_, table_width_;
  std::size_t side_floats_;        // one side of one layer: (blocks · block_size) rows of codes, then their scales
  Buffer storage_;                 // (layers, 2, side_floats): fp32 (layers, 2, blocks · block_size, kv_dim)
  IntBuffer tables_;               // (max_sequences, table_width) block ids
  std::vector<int> free_blocks_;   // a stack: the block given back last is taken first
  std::vector<int> free_tables_;
  bool double_free_next_ = false;
};

// One sequence's cache: its block table over the pool. Positions are appended in order from 0 (a sequence
// that must start again - preempted - gets a new PagedSequence), or from the end of blocks it starts with
// (start_from: chapter 09's shared prefixes). Blocks are taken from `source` (the pool itself unless given) in
// prepare(), never in a layer's write; running out is std::runtime_error there, which a scheduler never lets
// happen (it checks the free blocks first: blocks_to_grow).
class PagedSequence final : public KvCache {
 public:
  explicit PagedSequence(BlockPool& pool, BlockSource* source = nullptr)
      : pool_(pool), source_(source ? *source : pool), table_(pool.take_table()) {
    if (table_ < 0) throw std::runtime_error("PagedSequence: every sequence slot of the pool is in use");
    blocks_.reserve(pool.table_width());  // the decode loop never allocates
    source_.sequence_started(table_);
  }
  ~PagedSequence() override { release(); }
  PagedSequence(const PagedSequence&) = delete;

  // A new sequence that starts holding `length` positions in `blocks` (its source shares each): a cached
  // prefix, or a sibling's whole cache (parallel sampling).
  void start_from(std::span<const int> blocks, int length) {
    if (table_ < 0 || !blocks_.empty() || length < 1 || static_cast<int>(blocks.size()) != blocks_needed(length, pool_.block_size()) ||
        static_cast<int>(blocks.size()) > pool_.table_width())
      throw std::invalid_argument("PagedSequence: start_from needs an empty sequence and the blocks of its " +
                                  std::to_string(length) + " positions");
    for (int block : blocks) source_.share_block(block), blocks_.push_back(block);
    pool_.backend().from_host(pool_.table(table_), blocks_.data(), blocks_.size());
    length_ = length;
  }

  // Blocks a call over `n` more positions must take from the pool: new ones, and a private copy of the last
  // one when it is shared and the call appends into it.
  int blocks_to_grow(int n) const {
    const bool copies = n > 0 && appends_into_last_block() && source_.shared(blocks_.back());
    return blocks_needed(length_ + n, pool_.block_size()) - static_cast<int>(blocks_.size()) + (copies ? 1 : 0);
  }

  void prepare(int pos, int n) override {
    if (table_ < 0) throw std::logic_error("PagedSequence: prepare after release");
    if (pos != length_)
      throw std::invalid_argument("PagedSequence: position " + std::to_string(pos) + " after " + std::to_string(length_) +
                                  " cached positions; a paged sequence appends");
    const int needed = blocks_needed(pos + n, pool_.block_size());
    if (needed > pool_.table_width())
      throw std::invalid_argument("PagedSequence: " + std::to_string(pos + n) + " positions exceed the " +
                                  std::to_string(pool_.table_width() * pool_.block_size()) + " a sequence of this pool may hold");
    int first_new = static_cast<int>(blocks_.size());
    // The new entries of the table, into backend memory where attention reads them (also before a throw, so the
    // table in backend memory never disagrees with blocks_).
    auto upload = [&] {
      if (static_cast<int>(blocks_.size()) > first_new)
        pool_.backend().from_host(pool_.table(table_) + first_new, blocks_.data() + first_new, blocks_.size() - first_new);
    };
    if (n > 0 && appends_into_last_block()) {  // a shared last block is copied before anything is written into it
      const int own = source_.writable_block(blocks_.back());
      if (own < 0) throw std::runtime_error("PagedSequence: the pool has no free block to copy a shared block into");
      if (own != blocks_.back()) blocks_.back() = own, first_new -= 1;
    }
    while (static_cast<int>(blocks_.size()) < needed) {
      const int block = source_.take_block();
      if (block < 0) {
        upload();
        throw std::runtime_error("PagedSequence: the pool has no free block (chapter 08's scheduler preempts a "
                                 "sequence before this happens; without it, make the pool larger)");
      }
      blocks_.push_back(block);
    }
    upload();
    length_ = pos + n;
  }

  // The pool's rows of this layer through this sequence's table; a coded pool quantizes on write (chapter 10).
  // The model writes the sequences of a batch that share the pool together (Backend::write_paged_batch: on a GPU
  // one launch a layer); write() is the same call for this sequence alone.
  std::optional<PagedWrite> paged_write(int layer, int pos, int n) const override {
    check_write("PagedSequence", layer, pool_.n_layers(), pos, n, length_);
    return PagedWrite{pool_.side(layer, 0), pool_.side(layer, 1), BlockTable{pool_.table(table_), pool_.block_size()}};
  }
  void write(int layer, int pos, int n, const int* positions, const float* k, const float* v) override {
    const PagedWrite where = *paged_write(layer, pos, n);
    const Backend::PagedPart alone[] = {{0, n, where.table}};
    pool_.backend().write_paged_batch(where.keys, where.values, positions, alone, k, v);
  }

  // Rows 0 .. length-1 = positions 0 .. length-1, through the block table; coded sides in a coded pool.
  KvView view(int layer) const override {
    KvView view{.rows = length_, .row_stride = pool_.kv_dim(), .paged = BlockTable{pool_.table(table_), pool_.block_size()}};
    if (pool_.format() == KvFormat::kFp32)
      view.keys = pool_.rows(layer, 0), view.values = pool_.rows(layer, 1);
    else
      view.key_codes = pool_.side(layer, 0), view.value_codes = pool_.side(layer, 1);
    return view;
  }
  int length() const override { return length_; }
  KvRow row(int layer, int position) override {
    if (layer < 0 || layer >= pool_.n_layers() || position < 0 || position >= length_)
      throw row_error("PagedSequence", layer, position, "it holds positions 0.." + std::to_string(length_ - 1));
    if (pool_.format() != KvFormat::kFp32)
      throw row_error("PagedSequence", layer, position, std::string("its pool stores ") + to_string(pool_.format()) +
                                                          " codes, not floats");
    const std::size_t at = std::size_t(BlockTable{blocks_.data(), pool_.block_size()}.physical_row(position)) * pool_.kv_dim();
    return {pool_.rows(layer, 0) + at, pool_.rows(layer, 1) + at};
  }

  // Every block and the table slot back to the pool; the sequence holds nothing afterwards.
  void release() {
    source_.give_back_blocks(blocks_);
    blocks_.clear();
    if (table_ >= 0) pool_.give_back_table(table_);
    table_ = -1, length_ = 0;
  }
  const std::vector<int>& blocks() const { return blocks_; }  // the host copy of the block table
  int table_slot() const { return table_; }  // its row of the pool's block tables; -1 once released

 private:
  // Whether the next position lands in the last block held (not at a block's start).
  bool appends_into_last_block() const { return length_ % pool_.block_size() != 0; }
  BlockPool& pool_;
  BlockSource& source_;
  int table_;               // this sequence's row of the pool's block tables; -1 once released
  std::vector<int> blocks_; // (blocks held) physical block ids, host copy
  int length_ = 0;
};

}  // namespace kvs::ch08
