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
// (kv_format.h's CodedRows). fp32 keeps chapter 03's float rows and write_rows, so the baseline is the same code.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "backend.h"
#include "config.h"
#include "kv_cache.h"
#include "kv_format.h"

namespace kvs::ch10 {

class QuantizedKvCache final : public KvCache {
 public:
  // int4_group: channels per int4 scale (kv_format_shape_error says which groups fit); ignored by other formats.
  QuantizedKvCache(Backend& backend, const ModelConfig& config, int max_positions, KvFormat format, int int4_group)
      : backend_(backend),
        layout_(checked_layout(config, format, int4_group)),
        n_layers_(config.n_layers),
        max_positions_(max_positions),
        block_floats_(block_floats(layout_, max_positions)),
        storage_(backend, std::size_t(config.n_layers) * 2 * block_floats_) {}

  // Bytes the cache allocates for `max_positions` positions: what the memory plan counts, scales included.
  static std::int64_t bytes(const ModelConfig& config, int max_positions, KvFormat format, int int4_group) {
    return std::int64_t(config.n_layers) * 2 * std::int64_t(block_floats(checked_layout(config, format, int4_group), max_positions)) *
           std::int64_t{sizeof(float)};
  }

  void prepare(int pos, int n) override {
    if (pos > length_)
      throw std::invalid_argument("QuantizedKvCache: position " + std::to_string(pos) + " leaves a gap after the " +
                                  std::to_string(length_) + " cached positions");
    if (pos + n > max_positions_)
      throw std::invalid_argument("QuantizedKvCache: positions up to " + std::to_string(pos + n) +
                                  " do not fit; the cache was allocated for " + std::to_string(max_positions_));
    length_ = pos + n;
  }

  // Row p holds position p; the positions come from backend memory, so a recorded step writes the right row.
  void write(int layer, int pos, int n, const int* positions, const float* k, const float* v) override {
    check_write("QuantizedKvCache", layer, n_layers_, pos, n, length_);
    if (layout_.format == KvFormat::kFp32) {
      backend_.write_rows(floats(layer, 0), layout_.width, positions, Ring::unbounded(), k, n, layout_.width);
      backend_.write_rows(floats(layer, 1), layout_.width, positions, Ring::unbounded(), v, n, layout_.width);
      return;
    }
    backend_.write_coded_rows(side(layer, 0), positions, Ring::unbounded(), k, n);  // quantize on write
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
  bool replayable() const override { return true; }
  int length() const override { return length_; }
  void clear() { length_ = 0; }

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
  int max_positions() const { return max_positions_; }
  std::int64_t allocated_bytes() const { return std::int64_t(storage_.size()) * std::int64_t{sizeof(float)}; }

 private:
  static CodedRows checked_layout(const ModelConfig& config, KvFormat format, int int4_group) {
    if (const std::string why = kv_format_shape_error(format, config.head_dim(), int4_group); !why.empty())
      throw std::invalid_argument("QuantizedKvCache: " + why);
    return coded_rows_layout(format, config.n_kv_heads, config.head_dim(), int4_group);
  }
  // Floats of one (layer, side) block's codes, rounded up to whole floats; the block: those, then the scales.
  static std::size_t code_floats(const CodedRows& layout, int max_positions) {
    return (std::size_t(max_positions) * layout.code_bytes() + sizeof(float) - 1) / sizeof(float);
  }
  static std::size_t block_floats(const CodedRows& layout, int max_positions) {
    return code_floats(layout, max_positions) + std::size_t(max_positions) * layout.scales_per_row();
  }
  float* floats(int layer, int kv) const {
    return const_cast<float*>(storage_.data()) + (std::size_t(layer) * 2 + kv) * block_floats_;
  }
  // The coded rows of a layer's keys (kv = 0) or values (kv = 1), in the backend memory of their block.
  CodedRows side(int layer, int kv) const {
    CodedRows rows = layout_;
    float* block = floats(layer, kv);
    rows.codes = reinterpret_cast<std::uint8_t*>(block);
    rows.scales = block + code_floats(layout_, max_positions_);
    return rows;
  }

  Backend& backend_;
  CodedRows layout_;  // the format and shape of every side; no memory
  int n_layers_, max_positions_;
  std::size_t block_floats_;
  Buffer storage_;  // (layers, 2, block_floats)
  int length_ = 0;
};

}  // namespace kvs::ch10
