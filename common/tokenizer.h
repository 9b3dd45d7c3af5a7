#pragma once
// Byte-level tokenizer of the shipped model: token id = byte value, vocabulary 256. Lossless for any
// input bytes, UTF-8 or not; a multi-byte character simply takes several tokens.
#include <algorithm>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvs {

inline constexpr int kByteVocab = 256;

inline std::vector<int> encode_bytes(std::string_view text) {
  std::vector<int> ids;
  ids.reserve(text.size());
  for (unsigned char byte : text) ids.push_back(byte);
  return ids;
}

inline char decode_byte(int id) { return static_cast<char>(static_cast<unsigned char>(id)); }

inline std::string decode_bytes(std::span<const int> ids) {
  std::string text;
  text.reserve(ids.size());
  for (int id : ids) text.push_back(decode_byte(id));
  return text;
}

// The text of `ids` with its newlines as spaces: one line of a table, or of texts shown side by side.
inline std::string decode_on_one_line(std::span<const int> ids) {
  std::string text = decode_bytes(ids);
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

}  // namespace kvs
