#pragma once
// The command line every chapter binary shares: one parser, one set of common flags, one way to fail.
//   --help, --model PATH, --prompt TEXT | --prompt-file PATH, --max-new-tokens N, --temperature X,
//   --top-k N, --seed N, --backend NAME, --threads N, --csv PATH, --memory-limit SIZE
// A chapter adds its own flags to the same parser. Text goes to stdout; everything else to stderr.
//
// Errors, in every binary: one line on stderr, "<program>: error: <what is wrong and how to fix it>".
// Exit code 2: the command line is wrong (an unknown flag, a bad value, flags that contradict each other
// or ask for more than the model or --memory-limit allows); exit code 1: the run failed (a file that
// cannot be read or written, a malformed checkpoint, no memory).
#include <cstdint>
#include <functional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvs {

// A command line that asks for something impossible: run_main reports it and exits with code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class ArgParser {
 public:
  ArgParser(std::string program, std::string description);

  // An empty value is refused: it would otherwise silently mean "the default".
  void add_string(const std::string& name, const std::string& value_name, const std::string& help, std::string* target);
  void add_int(const std::string& name, const std::string& help, int* target, int min, int max);
  void add_u64(const std::string& name, const std::string& help, std::uint64_t* target);
  void add_float(const std::string& name, const std::string& help, float* target, float min, float max);
  void add_switch(const std::string& name, const std::string& help, bool* target);
  // A size in bytes, e.g. 512MiB or 1.5GiB (see parse_bytes).
  void add_bytes(const std::string& name, const std::string& help, std::int64_t* target);
  // A rule about several flags, checked after all of them are parsed: returns the error, empty when all is well.
  void add_check(std::function<std::string()> check);
  // Flags that only some values of a choice read (the experiments of --experiment): each entry names a flag and
  // the values that read it. A flag given with a value that does not read it is refused after parsing, naming
  // the values that do ("--windows is for --experiment perplexity, recall, fluency or samples, not induction"),
  // so that no run ignores a flag it was given. `chosen` is read after parsing (its default where not given).
  using FlagReaders = std::vector<std::pair<std::string, std::vector<std::string>>>;
  void add_read_only_by(const std::string& choice_flag, const std::string* chosen, FlagReaders readers);
  // Whether the flag appeared on the command line (after parsing).
  bool given(const std::string& name) const { return given_.count(name) > 0; }
  const std::string& program() const { return program_; }

  struct Outcome {
    bool help = false;  // --help was given
    std::string error;  // one line naming the bad flag or value; empty when all was well
  };
  // Parses argv into the targets without printing or exiting.
  Outcome try_parse(int argc, const char* const* argv);
  // Parses argv. --help prints the usage to stdout and exits 0; an unknown flag or a bad value prints one
  // line naming it (and how to get help) to stderr and exits 2. Returns normally only on success.
  void parse(int argc, const char* const* argv);
  std::string usage() const;

 private:
  struct Flag {
    std::string name, value_name, help;
    std::function<std::string(const std::string&)> set;  // returns an error message, empty on success
  };
  const Flag* find(const std::string& name) const;
  std::string program_, description_;
  std::vector<Flag> flags_;
  std::vector<std::function<std::string()>> checks_;
  std::set<std::string> given_;
};

struct CommonOptions {
  std::string model;  // empty: the shipped model
  // DIM,LAYERS,HEADS,KV_HEADS: instead of a checkpoint, random weights of that shape (Checkpoint::synthetic;
  // only benchmarks offer the flag). Empty: none.
  std::string synthetic;
  std::string prompt;       // empty: --prompt-file, or the chapter's default
  std::string prompt_file;
  int max_new_tokens = 200;
  float temperature = 0.0f;
  int top_k = 0;
  std::uint64_t seed = 42;
  std::string backend = "cpu";  // --backend: cpu, cuda or cuda-harness
  int threads = 0;  // 0: every core
  std::string csv;
  std::int64_t memory_limit = std::int64_t{2} << 30;  // bytes a run may plan to use
};

// Which of the common flags a binary takes: a binary never accepts a flag it would ignore.
enum class CommonFlags {
  kGeneration,  // all of them (the chapters)
  kGreedy,      // no --temperature, --top-k, --seed (a benchmark that must decode greedily)
  kModelOnly,   // --model, --backend, --threads, --csv, --memory-limit (reads a text instead of generating)
};

// Registers the common flags; `default_prompt` is described in --help (and the current option values are
// shown as defaults).
void add_common_flags(ArgParser& parser, CommonOptions& options, const std::string& default_prompt = "",
                      CommonFlags which = CommonFlags::kGeneration);

// Cores this process may run on (its CPU affinity), at least 1.
int available_cores();

// Reads "512MiB", "16GiB", "1.5G", "1000000" (bytes); K/M/G/T (with or without B/iB) are binary, 1024.
// Rounded to whole bytes when that changes the size by at most 1% (0.1GiB is a size; 0.5 or 1e-9GiB,
// which would round to 0 or 1 byte, are not). Throws std::invalid_argument for anything else.
std::int64_t parse_bytes(const std::string& text);
std::string format_bytes(double bytes);  // "5.2 MiB"
// The items of a comma-separated list, every one between two commas, empty ones included: "8,,40," is "8", "", "40"
// and "" (std::getline drops a trailing empty item, so a list ending in a comma passed for one that did not).
std::vector<std::string> split_commas(const std::string& text);
// "8,40,512" given as `flag`: whole numbers from min to max, in the order given. Throws UsageError naming
// the flag for anything else (an empty list or item included).
std::vector<int> parse_int_list(const std::string& flag, const std::string& text, int min, int max);

// The whole content of a regular file given as `flag` (e.g. "--prompt-file"), at most `max_bytes` bytes
// of it when `truncate` is set. Its kind and size are checked before anything is read: a directory, a
// device such as /dev/zero or a FIFO is refused, and so is a file larger than max_bytes unless `truncate`.
// Throws std::runtime_error naming the flag and the path.
std::string read_input_file(const std::string& flag, const std::string& path, std::size_t max_bytes,
                            bool truncate = false);
// Every file read_input_file has read in this process, as {flag, path}: no results file may replace one
// (check_output_path, csv.h), whichever chapter read it (a --csv over data/kjv/valid.txt would destroy the text).
std::vector<std::pair<std::string, std::string>> files_read();

// The repository a binary belongs to: the nearest folder at or above `start` that holds common/model.h
// and data/ (a repository of this project), or empty if there is none. A neighbour's data/ never counts.
std::string repository_root_above(const std::string& start);
// A file of the repository's data/ folder: the repository that holds the binary, else the source
// directory baked in at configure time; throws std::runtime_error naming it when it is missing.
std::string find_data_file(const std::string& relative);
// The checkpoint to load: --model, or the shipped model data/kjv-gpt.bin.
std::string resolve_model_path(const CommonOptions& options);
// The prompt's bytes: --prompt, --prompt-file, or the given default. Throws UsageError or std::runtime_error.
std::string resolve_prompt(const CommonOptions& options, const std::string& default_prompt);

// Runs a binary's body and returns its exit code. An exception becomes one line,
// "<program>: error: <what>", and exit code 2 (UsageError) or 1 (anything else). Text that could not be
// written to stdout (a full disk, a closed pipe) is an error too: the run did not deliver its result.
int run_main(const ArgParser& parser, const std::function<int()>& body);

}  // namespace kvs
