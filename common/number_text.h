#pragma once
// Numbers in text, read one way everywhere: the command line's flags and lists, the environment's settings (the
// CPU's, the CUDA backend's and its harness's). strtol and strtoul skip a leading space and '+', stop at the first
// character that is not a digit and read nothing as 0 (" 4", "+4", "5x" and "abc" passed as numbers); strtod also
// reads hexadecimal ("0x10" as 16). Header only: the CUDA module and the harness include it without kvs_common.
#include <charconv>
#include <optional>
#include <string_view>

namespace kvs {

// `text` as a whole number of type T: from_chars's digits (a leading '-' for a signed T) and nothing else.
template <typename T>
std::optional<T> whole_number(std::string_view text) {
  T value{};
  const char* end = text.data() + text.size();
  const auto [at, error] = std::from_chars(text.data(), end, value);
  if (error != std::errc() || at != end) return std::nullopt;
  return value;
}

// Whether strtod may read `text`: it starts as a decimal number does (a digit, '.' or '-') and holds no 'x' (no
// hexadecimal). What follows the number is the caller's to check (strtod's end, or a unit).
inline bool decimal_number(std::string_view text) {
  return !text.empty() && text.find_first_of("xX") == std::string_view::npos &&
         ((text[0] >= '0' && text[0] <= '9') || text[0] == '.' || text[0] == '-');
}

}  // namespace kvs
