#pragma once
// Chapter 10's lesson: chapter 03's preallocated cache with its last factor changed. The cache costs
//   2 · layers · kv_heads · head_dim · positions · bytes,
// and `bytes` is the one factor a runtime may change without touching the model: store each number in 2 bytes
// (fp16, bf16), 1 byte plus a scale per head (int8) or half a byte plus a scale and a minimum per group (int4).
// The model computes k and v in fp32 as always; the cache codes them as it writes them (Backend::write_coded_rows,
// quantize on write) and attention decodes them as it reads them (KvView::key_codes, value_codes): no
// fp32 copy of the cache exists anywhere. Everything else is chapter 03's: one allocation, rows by position,
// the same view at every length (a recorded decode step replays).
//
// Layout: [layer][K or V] blocks; a block is (max_positions, code bytes) codes, then (max_positions, scales) floats
// (kv_format.h's CodedRows). fp32 keeps chapter 03's float rows and write_key_value_rows, so the baseline is the
// same code.
//
// KIVI's keys (Keys::kPerChannel, int4 only): a few channels of this model's keys are large at every position
// (chapter 10's channels experiment), so a scale per token wastes its 16 levels on them; KIVI codes each channel
// over a group of `group` positions instead. A group can be coded only once its last position is written, so the
// open group's keys stay fp32 (open_keys_, KIVI's "residual"; while a call holds more keys than the group, a
// prefill, in call_keys_ instead): the write appends a call's keys there and codes
// every group the call completes; attention reads the groups coded before this call as codes and everything from
// the open group's start on as floats - a prefill attends in fp32 as KIVI's does, a decode step reads its own
// group in fp32 and every earlier one coded. Never a later position's key in an earlier one's rounding: a group
// is coded after every position in it has been read in fp32. Values stay per token (KIVI's per-token values).
// The open group's rows move to the front of their buffer when the next call starts past it (prepare), so a
// view depends on the length: not replayable. Keys::kPerTokenOpen keeps the same open group but codes a completed
// group's keys per token, as int4 does: the control that tells what KIVI's per-channel scales buy from what its
// fp32 open group buys.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "backend.h"
#include "config.h"
#include "kv_cache.h"
#include "kv_format.h"

namespace kvs::ch10 {

// How the keys of an int4 cache share their scales: per token (a scale and a minimum per group of channels of one
// position, like the values) or per channel (KIVI: per channel over a group of positions, the open group in fp32);
// or per token with KIVI's fp32 open group (an experiment's control).
enum class Keys { kPerToken, kPerChannel, kPerTokenOpen };

class QuantizedKvCache final : public KvCache {
 public:
  // int4_group: channels per int4 scale (kv_format_shape_error says which groups fit), and with Keys::kPerChannel
  // also the positions per key scale; ignored by other formats. Per-channel keys need int4.
  QuantizedKvCache(Backend& backend, const ModelConfig& config, int max_positions, KvFormat format, int int4_group,
                   Keys keys = Keys::kPerToken)
      : backend_(backend),
        layout_(checked_layout(config, format, int4_group, Keys::kPerToken)),
        key_layout_(checked_layout(config, format, int4_group, keys)),
        n_layers_(config.n_layers),
        max_positions_(max_positions),
        block_floats_(block_floats(layout_, max_positions)),
        key_block_floats_(block_floats(key_layout_, max_positions)),
        storage_(backend, std::size_t(config.n_layers) * (key_block_floats_ + block_floats_)),
        keys_(keys) {
    if (open_group() > 0) open_keys_ = Buffer(backend, open_floats(open_group()) * n_layers_);
    if (keys == Keys::kPerTokenOpen) all_positions_ = consecutive_positions(backend, 0, max_positions);
  }

  // Bytes the cache holds for `max_positions` positions between calls: what the memory plan counts, scales
  // included, the open group's keys (fp32) and the control's table of positions. A call with more keys than the
  // open group holds (a prefill) adds a buffer of its own for them (call_keys_), given back at the next call that
  // fits the group (hold_open_keys).
  static std::int64_t bytes(const ModelConfig& config, int max_positions, KvFormat format, int int4_group,
                            Keys keys = Keys::kPerToken) {
    const CodedRows key_layout = checked_layout(config, format, int4_group, keys);
    const int open_group = keys == Keys::kPerToken ? 0 : int4_group;
    const std::int64_t position_table = keys == Keys::kPerTokenOpen ? std::int64_t(max_positions) * std::int64_t{sizeof(int)} : 0;
    return std::int64_t(config.n_layers) * std::int64_t{sizeof(float)} *
               std::int64_t(block_floats(checked_layout(config, format, int4_group, Keys::kPerToken), max_positions) +
                            block_floats(key_layout, max_positions) + std::size_t(open_group) * key_layout.width) +
           position_table;
  }

  void prepare(int pos, int n) override {
    if (pos > length_)
      throw std::invalid_argument("QuantizedKvCache: position " + std::to_string(pos) + " leaves a gap after the " +
                                  std::to_string(length_) + " cached positions");
    if (pos + n > max_positions_)
      throw std::invalid_argument("QuantizedKvCache: positions up to " + std::to_string(pos + n) +
                                  " do not fit; the cache was allocated for " + std::to_string(max_positions_));
    if (const int g = open_group(); g > 0) {  // where the open group starts now
      const int open_start = pos / g * g;
      if (open_start < open_start_ && pos % g != 0)
        throw std::invalid_argument("QuantizedKvCache: position " + std::to_string(pos) + " lies in a group of " +
                                    std::to_string(g) + " keys already coded (their floats are gone); start again at a multiple of " +
                                    std::to_string(g));
      if (open_start > open_start_ && pos > open_start)  // the open group's keys so far to the front
        for (int layer = 0; layer < n_layers_; ++layer)
          backend_.copy(open_keys(layer), open_keys(layer) + std::size_t(open_start - open_start_) * key_layout_.width,
                        std::size_t(pos - open_start) * key_layout_.width);
      open_start_ = open_start;
      hold_open_keys(pos - open_start + n, pos - open_start);
    }
    length_ = pos + n;
  }

  // Row p holds position p; the positions come from backend memory, so a recorded step writes the right row.
  void write(int layer, int pos, int n, const int* positions, const float* k, const float* v) override {
    check_write("QuantizedKvCache", layer, n_layers_, pos, n, length_);
    if (open_group() > 0 && pos < open_start_)  // its keys' floats would go before the open group's buffer
      throw std::out_of_range("QuantizedKvCache: a write of position " + std::to_string(pos) + " lies before the open group (" +
                              std::to_string(open_start_) + " on), whose earlier keys are coded already; call prepare "
                              "first and write only what it announced");
    if (layout_.format == KvFormat::kFp32) {
      backend_.write_key_value_rows(floats(layer, 0), floats(layer, 1), layout_.width, positions, Ring::unbounded(), k, v,
                                    n, layout_.width);
      return;
    }
    if (const int g = open_group(); g > 0) {  // keys appended to the open group as floats, coded a group at a time
      float* open = open_keys(layer);
      backend_.copy(open + std::size_t(pos - open_start_) * key_layout_.width, k, std::size_t(n) * key_layout_.width);
      const int completed = (pos + n) / g - open_start_ / g;
      if (keys_ == Keys::kPerChannel)
        backend_.encode_channel_groups(side(layer, 0), open_start_ / g, completed, open);
      else if (completed > 0)
        backend_.write_coded_rows(side(layer, 0), all_positions_.data() + open_start_, Ring::unbounded(), open, completed * g);
    } else {
      backend_.write_coded_rows(side(layer, 0), positions, Ring::unbounded(), k, n);  // quantize on write
    }
    backend_.write_coded_rows(side(layer, 1), positions, Ring::unbounded(), v, n);
  }

  // Every allocated row, whatever the length (chapter 03 says why); coded sides where the format is not fp32.
  KvView view(int layer) const override {
    KvView view{.rows = max_positions_, .row_stride = layout_.width};
    if (layout_.format == KvFormat::kFp32) {
      view.keys = floats(layer, 0), view.values = floats(layer, 1);
    } else {
      view.key_codes = side(layer, 0), view.value_codes = side(layer, 1);
    }
    return view;
  }
  bool replayable() const override { return open_group() == 0; }
  int length() const override { return length_; }
  void clear() { length_ = 0, open_start_ = 0; }

  // A coded row is not kv_dim floats an experiment could overwrite in place (chapter 05's corruption).
  KvRow row(int layer, int position) override {
    if (layer < 0 || layer >= n_layers_ || position < 0 || position >= length_)
      throw row_error("QuantizedKvCache", layer, position,
                      "it holds positions 0.." + std::to_string(length_ - 1) + " of layers 0.." + std::to_string(n_layers_ - 1));
    if (layout_.format != KvFormat::kFp32)
      throw row_error("QuantizedKvCache", layer, position, std::string("its rows are stored as ") + to_string(layout_.format) +
                                                               " codes, not as floats");
    const std::size_t at = std::size_t(position) * layout_.width;
    return {floats(layer, 0) + at, floats(layer, 1) + at};
  }

  KvFormat format() const { return layout_.format; }
  Keys keys() const { return keys_; }
  int max_positions() const { return max_positions_; }
  // What it holds now: bytes(), and while a prefill call's keys are held, their buffer.
  std::int64_t allocated_bytes() const {
    return std::int64_t(storage_.size() + open_keys_.size() + call_keys_.size()) * std::int64_t{sizeof(float)} +
           std::int64_t(all_positions_.size()) * std::int64_t{sizeof(int)};
  }

 private:
  static CodedRows checked_layout(const ModelConfig& config, KvFormat format, int int4_group, Keys keys) {
    if (const std::string why = kv_format_shape_error(format, config.head_dim(), int4_group); !why.empty())
      throw std::invalid_argument("QuantizedKvCache: " + why);
    CodedRows layout = coded_rows_layout(format, config.n_kv_heads, config.head_dim(), int4_group);
    if (keys != Keys::kPerToken) {
      if (format != KvFormat::kInt4)
        throw std::invalid_argument(std::string("QuantizedKvCache: per-channel keys and the open group are int4's options, not ") +
                                    to_string(format) + "'s");
      if (const std::string why = channel_group_error(int4_group); !why.empty())
        throw std::invalid_argument("QuantizedKvCache: " + why);
      if (keys == Keys::kPerChannel) layout.token_group = int4_group;
    }
    return layout;
  }
  std::size_t open_floats(int rows) const { return std::size_t(rows) * key_layout_.width; }
  // Positions of the open group (KIVI's): the int4 group, or 0 for none (per-token keys).
  int open_group() const { return keys_ == Keys::kPerToken ? 0 : layout_.group; }
  // Room for `rows` open keys per layer from open_start_, the first `held` rows of each kept: the open group's
  // buffer while they fit it (a decode step), else a buffer of the call's own (a prefill, which attends to its
  // keys as floats), kept for a prefill's later chunks and given back at the first call that fits the group.
  // (Keeping it had held a 2,047-position prefill's keys, 2.6 MB of floats, beside the shipped model's 1 MB of
  // codes and scales, for as long as the cache lived.)
  void hold_open_keys(int rows, int held) {
    const std::size_t needed = open_floats(rows) * n_layers_;
    if (needed <= open_keys_.size()) {
      if (call_keys_.size() == 0) return;
      move_open_keys(open_keys_.data(), open_keys_.size() / n_layers_, held);
      call_keys_ = Buffer();  // given back
    } else if (needed > call_keys_.size()) {
      Buffer larger(backend_, needed);
      move_open_keys(larger.data(), needed / n_layers_, held);
      call_keys_ = std::move(larger);
    }
  }
  // The first `held` open keys of every layer to `to`, layer_floats apart, from the buffer they are in now.
  void move_open_keys(float* to, std::size_t layer_floats, int held) {
    for (int layer = 0; layer < n_layers_ && held > 0; ++layer)
      backend_.copy(to + layer * layer_floats, open_keys(layer), open_floats(held));
  }
  // The buffer the open keys are in now: a call's own while it has one.
  float* open_keys(int layer) const {
    const Buffer& in = call_keys_.size() == 0 ? open_keys_ : call_keys_;
    return const_cast<float*>(in.data()) + in.size() / n_layers_ * layer;
  }
  // Floats of one (layer, side) block's codes, rounded up to whole floats; the block: those, then the scales.
  static std::size_t code_floats(const CodedRows& layout, int max_positions) {
    return (std::size_t(max_positions) * layout.code_bytes() + sizeof(float) - 1) / sizeof(float);
  }
  static std::size_t block_floats(const CodedRows& layout, int max_positions) {
    return code_floats(layout, max_positions) + std::size_t(layout.scale_floats(max_positions));
  }
  float* floats(int layer, int kv) const {
    return const_cast<float*>(storage_.data()) + std::size_t(layer) * (key_block_floats_ + block_floats_) +
           (kv == 0 ? 0 : key_block_floats_);
  }
  // The coded rows of a layer's keys (kv = 0) or values (kv = 1), in the backend memory of their block.
  CodedRows side(int layer, int kv) const {
    CodedRows rows = kv == 0 ? key_layout_ : layout_;
    float* block = floats(layer, kv);
    rows.codes = reinterpret_cast<std::uint8_t*>(block);
    rows.scales = block + code_floats(rows, max_positions_);
    if (kv == 0 && open_group() > 0) rows.coded_rows = open_start_, rows.open_rows = open_keys(layer);
    return rows;
  }

  Backend& backend_;
  CodedRows layout_;      // the format and shape of the values (and of per-token keys); no memory
  CodedRows key_layout_;  // the keys': layout_, or per channel
  int n_layers_, max_positions_;
  std::size_t block_floats_, key_block_floats_;
  Buffer storage_;     // (layers, keys' block_floats + values' block_floats)
  Keys keys_;
  Buffer open_keys_;   // (layers, open group, kv_dim) floats of the open group, from open_start_
  Buffer call_keys_;   // (layers, rows, kv_dim): instead, while a call holds more than the open group (a prefill)
  int open_start_ = 0;  // the first position not coded yet (a multiple of the open group)
  IntBuffer all_positions_;  // kPerTokenOpen: 0 .. max_positions - 1, the rows a completed group is written to
  int length_ = 0;
};

}  // namespace kvs::ch10
