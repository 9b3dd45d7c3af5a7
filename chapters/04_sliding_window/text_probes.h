#pragma once
// What a forgetful cache costs, scored on generated text: two of chapter 04's probes, as plain functions of
// strings (the third, exact recall, is scored on the model's predictions: experiments.cpp).
//   topic consistency the share of proper names in a continuation that the prompt contains;
//   local fluency     the share of a continuation's words that are words of the corpus.
#include <cctype>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace kvs::ch04 {

// The words of a text: maximal runs of ASCII letters, as written (case kept).
inline std::vector<std::string> words_of(std::string_view text) {
  std::vector<std::string> words;
  std::string word;
  for (char ch : text) {
    if (std::isalpha(static_cast<unsigned char>(ch))) {
      word += ch;
    } else if (!word.empty()) {
      words.push_back(word);
      word.clear();
    }
  }
  if (!word.empty()) words.push_back(word);
  return words;
}

inline std::string lowercase(std::string word) {
  for (char& ch : word) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return word;
}

// The corpus's vocabulary, and its proper names: a word is a name when the corpus never writes it in
// lower case ("Paul", "Jerusalem"; not "And" or "Lord", which also occur as "and", "lord").
struct Lexicon {
  std::set<std::string> words;  // lower-cased
  std::set<std::string> names;  // as written

  explicit Lexicon(std::string_view corpus) {
    std::set<std::string> written_lower, capitalised;
    for (const std::string& word : words_of(corpus)) {
      words.insert(lowercase(word));
      if (std::isupper(static_cast<unsigned char>(word[0]))) capitalised.insert(word);
      else written_lower.insert(word);
    }
    for (const std::string& word : capitalised)
      if (!written_lower.count(lowercase(word))) names.insert(word);
  }
  bool is_name(const std::string& word) const { return names.count(word) > 0; }
};

struct ProbeScore {
  double share = 0;  // of the counted items
  int counted = 0;   // 0: the share is undefined (no words, no names)
};

// Local fluency: the share of the continuation's words (case ignored) that are words of the corpus.
inline ProbeScore known_word_share(std::string_view continuation, const Lexicon& lexicon) {
  ProbeScore score;
  int known = 0;
  for (const std::string& word : words_of(continuation)) {
    ++score.counted;
    known += lexicon.words.count(lowercase(word)) > 0;
  }
  score.share = score.counted ? double(known) / score.counted : 0.0;
  return score;
}

// Topic consistency: of the proper names the continuation uses, the share that the prompt contains.
inline ProbeScore names_from_prompt_share(std::string_view prompt, std::string_view continuation, const Lexicon& lexicon) {
  std::set<std::string> prompt_names;
  for (const std::string& word : words_of(prompt))
    if (lexicon.is_name(word)) prompt_names.insert(word);
  ProbeScore score;
  int from_prompt = 0;
  for (const std::string& word : words_of(continuation)) {
    if (!lexicon.is_name(word)) continue;
    ++score.counted;
    from_prompt += prompt_names.count(word) > 0;
  }
  score.share = score.counted ? double(from_prompt) / score.counted : 0.0;
  return score;
}

}  // namespace kvs::ch04
