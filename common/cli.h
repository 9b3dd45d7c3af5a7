#pragma once
// The command line every chapter binary shares: one parser, one set of common flags, one way to fail.
//   --help, --model PATH, --prompt TEXT | --prompt-file PATH, --max-new-tokens N, --temperature T,
//   --top-k K, --seed S, --threads N, --csv PATH
// A chapter adds its own flags to the same parser. Text goes to stdout; everything else to stderr.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kvs {

class ArgParser {
 public:
  ArgParser(std::string program, std::string description);

  // `given`, when not null, is set when the flag appears (so an explicit empty value differs from none).
  void add_string(const std::string& name, const std::string& value_name, const std::string& help, std::string* target,
                  bool* given = nullptr);
  void add_int(const std::string& name, const std::string& help, int* target, int min, int max);
  void add_u64(const std::string& name, const std::string& help, std::uint64_t* target);
  void add_float(const std::string& name, const std::string& help, float* target, float min, float max);
  void add_switch(const std::string& name, const std::string& help, bool* target);

  struct Outcome {
    bool help = false;  // --help was given
    std::string error;  // one line naming the bad flag or value; empty when all was well
  };
  // Parses argv into the targets without printing or exiting.
  Outcome try_parse(int argc, const char* const* argv) const;
  // Parses argv. --help prints the usage to stdout and exits 0; an unknown flag or a bad value prints one
  // line naming it (and how to get help) to stderr and exits 2. Returns normally only on success.
  void parse(int argc, const char* const* argv) const;
  std::string usage() const;

 private:
  struct Flag {
    std::string name, value_name, help;
    std::function<std::string(const std::string&)> set;  // returns an error message, empty on success
  };
  const Flag* find(const std::string& name) const;
  std::string program_, description_;
  std::vector<Flag> flags_;
};

struct CommonOptions {
  std::string model;  // empty: the shipped model
  std::string prompt;
  bool prompt_given = false;  // --prompt appeared, possibly with an empty value
  std::string prompt_file;
  int max_new_tokens = 200;
  float temperature = 0.0f;
  int top_k = 0;
  std::uint64_t seed = 42;
  int threads = 0;  // 0: every core
  std::string csv;
};

// Which of the common flags a binary takes: a binary never accepts a flag it would ignore.
enum class CommonFlags {
  kGeneration,  // all of them (the chapters)
  kGreedy,      // no --temperature, --top-k, --seed (a benchmark that must decode greedily)
  kModelOnly,   // --model, --threads, --csv (reads a text instead of generating)
};

// Registers the common flags; `default_prompt` is described in --help (and the current option values are
// shown as defaults).
void add_common_flags(ArgParser& parser, CommonOptions& options, const std::string& default_prompt = "",
                      CommonFlags which = CommonFlags::kGeneration);

// A file of the repository's data/ folder, found from the binary's location or the source directory
// baked in at configure time; throws std::runtime_error naming it when it is missing.
std::string find_data_file(const std::string& relative);
// The checkpoint to load: --model, or the shipped model data/kjv-gpt.bin.
std::string resolve_model_path(const CommonOptions& options);
// The prompt's bytes: --prompt, --prompt-file, or the given default. Throws std::runtime_error.
std::string resolve_prompt(const CommonOptions& options, const std::string& default_prompt);

// Runs a chapter's body; prints "error: <what>" for any exception and returns exit code 1.
int run_main(const std::function<int()>& body);

}  // namespace kvs
