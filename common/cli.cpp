#include "cli.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <new>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "backends.h"
#include "number_text.h"
#include "tokenizer.h"

namespace kvs {
namespace fs = std::filesystem;

ArgParser::ArgParser(std::string program, std::string description)
    : program_(std::move(program)), description_(std::move(description)) {}

void ArgParser::add_string(const std::string& name, const std::string& value_name, const std::string& help,
                           std::string* target) {
  flags_.push_back({name, value_name, help, [target](const std::string& v) {
                      if (v.empty()) return std::string("needs a non-empty value");
                      *target = v;
                      return std::string();
                    }});
}

void ArgParser::add_int(const std::string& name, const std::string& help, int* target, int min, int max) {
  flags_.push_back({name, "N", help, [=](const std::string& v) {
                      const std::optional<long long> value = whole_number<long long>(v);
                      if (!value || *value < min || *value > max)
                        return "expects a whole number from " + std::to_string(min) + " to " + std::to_string(max);
                      *target = static_cast<int>(*value);
                      return std::string();
                    }});
}

void ArgParser::add_u64(const std::string& name, const std::string& help, std::uint64_t* target) {
  flags_.push_back({name, "N", help, [=](const std::string& v) {
                      const std::optional<std::uint64_t> value = whole_number<std::uint64_t>(v);
                      if (!value) return std::string("expects a whole number from 0 to 18446744073709551615");
                      *target = *value;
                      return std::string();
                    }});
}

void ArgParser::add_float(const std::string& name, const std::string& help, float* target, float min, float max) {
  flags_.push_back({name, "X", help, [=](const std::string& v) {
                      char* end = nullptr;
                      errno = 0;
                      const float value = std::strtof(v.c_str(), &end);
                      // A number too close to 0 for a float (1e-50) reads as 0 (ERANGE): refused, not taken as 0 (a
                      // --temperature that asked to sample would decode greedily)
                      if (!v.empty() && end == v.c_str() + v.size() && errno == ERANGE && value == 0.0f)
                        return std::string("is too close to 0 for a float (it reads as 0); give 0 or a number further from 0");
                      if (!decimal_number(v) || end != v.c_str() + v.size() || !std::isfinite(value) || value < min ||
                          value > max) {
                        std::ostringstream why;
                        why << "expects a number from " << min << " to " << max;
                        return why.str();
                      }
                      *target = value;
                      return std::string();
                    }});
}

void ArgParser::add_bytes(const std::string& name, const std::string& help, std::int64_t* target) {
  flags_.push_back({name, "SIZE", help, [target](const std::string& v) {
                      try {
                        *target = parse_bytes(v);
                      } catch (const std::invalid_argument&) {
                        return std::string("expects a size of at least 1 byte, a whole number of bytes (within "
                                           "1%), such as 512MiB, 1.5GiB or 4GB (KB, MB, GB, TB: powers of 1000)");
                      }
                      return std::string();
                    }});
}

void ArgParser::add_check(std::function<std::string()> check) { checks_.push_back(std::move(check)); }

void ArgParser::add_read_only_by(const std::string& choice_flag, const std::string* chosen, FlagReaders readers) {
  add_check([this, choice_flag, chosen, readers = std::move(readers)] {
    for (const auto& [flag, values] : readers) {
      if (!given(flag) || std::ranges::find(values, *chosen) != values.end()) continue;
      std::string list;
      for (std::size_t i = 0; i < values.size(); ++i)
        list += (i == 0 ? "" : i + 1 == values.size() ? " or " : ", ") + values[i];
      return flag + " is for " + choice_flag + " " + list + ", not " + *chosen + ": drop it";
    }
    return std::string();
  });
}

void ArgParser::add_switch(const std::string& name, const std::string& help, bool* target) {
  flags_.push_back({name, "", help, [target](const std::string&) {
                      *target = true;
                      return std::string();
                    }});
}

const ArgParser::Flag* ArgParser::find(const std::string& name) const {
  for (const Flag& f : flags_)
    if (f.name == name) return &f;
  return nullptr;
}

// Breaks one line of help at spaces so that none passes kHelpWidth columns (where a word allows), the lines
// after the first indented by `hang` columns; the spacing inside a line is kept (tables line up by it).
// 110 columns fit the terminals help is usually read in.
static std::string wrap_line(std::string line, std::size_t hang) {
  constexpr std::size_t kHelpWidth = 110;
  line.erase(std::min(line.find_last_not_of(' ') + 1, line.size()));  // trailing spaces would wrap into blank lines
  hang = std::min(hang, kHelpWidth / 2);  // half a line at least for the text: every cut below then shortens it
  std::string out;
  while (line.size() > kHelpWidth) {
    std::size_t cut = line.rfind(' ', kHelpWidth);
    if (cut == std::string::npos || cut <= hang) cut = line.find(' ', kHelpWidth);  // a word longer than a line
    if (cut == std::string::npos) break;
    if (const std::size_t last = line.find_last_not_of(' ', cut); last != std::string::npos)
      out += line.substr(0, last + 1) + "\n";  // (nothing but indentation before the cut: no line for it)
    line = std::string(hang, ' ') + line.substr(line.find_first_not_of(' ', cut));
  }
  return out + line;
}

std::string ArgParser::usage() const {
  std::ostringstream out;
  out << "usage: " << program_ << " [options]\n\n";
  // The description keeps its author's line breaks (tables, lists); a line too long is wrapped at its own
  // indentation, or, in a "  name    text" table row whose text starts within 20 columns, under the text.
  std::istringstream lines(description_);
  for (std::string line; std::getline(lines, line);) {
    const std::size_t indent = std::min(line.find_first_not_of(' '), line.size());
    std::size_t hang = indent;
    if (const std::size_t gap = line.find("  ", indent); indent > 0 && gap < 20)
      hang = std::min(line.find_first_not_of(' ', gap), line.size());
    out << wrap_line(line, hang) << "\n";
  }
  out << "\noptions:\n";
  // An option's help is one paragraph, reflowed beside the flag's name.
  constexpr std::size_t kHelpColumn = 25;
  out << "  --help                 print this help and exit\n";
  for (const Flag& f : flags_) {
    std::string left = "  " + f.name + (f.value_name.empty() ? "" : " " + f.value_name);
    if (left.size() < kHelpColumn) {
      left.resize(kHelpColumn, ' ');
    } else {  // a name too long for its column: on a line of its own
      out << left << "\n";
      left = std::string(kHelpColumn, ' ');
    }
    std::string help = f.help;
    std::replace(help.begin(), help.end(), '\n', ' ');
    out << wrap_line(left + help, kHelpColumn) << "\n";
  }
  return out.str();
}

ArgParser::Outcome ArgParser::try_parse(int argc, const char* const* argv) {
  given_.clear();
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    if (arg == "--help" || arg == "-h") return {.help = true, .error = {}};
    bool inline_value = false;
    if (auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      inline_value = true;
    }
    if (arg == "--help") return {.help = false, .error = "--help takes no value"};
    const Flag* flag = find(arg);
    if (!flag) return {.help = false, .error = "unknown option '" + arg + "'"};
    // The last of two would win without a word: a script that adds its own --threads to the caller's ran with one of
    // them, and `--csv a --csv b` wrote b alone.
    if (given_.contains(arg)) return {.help = false, .error = arg + " is given twice; give it once"};
    if (flag->value_name.empty()) {
      if (inline_value) return {.help = false, .error = arg + " takes no value"};
    } else if (!inline_value) {
      if (i + 1 >= argc) return {.help = false, .error = arg + " needs a value (" + flag->value_name + ")"};
      value = argv[++i];
      // `--csv --skip-naive` wrote a file named --skip-naive and dropped the flag: a value that looks like an
      // option is refused (one that really starts with -- can still be given as arg=value).
      if (value.rfind("--", 0) == 0)
        return {.help = false, .error = arg + " needs a value (" + flag->value_name + "), not the option '" + value +
                                        "' (a value that starts with -- goes as " + arg + "=" + value + ")"};
    }
    if (std::string why = flag->set(value); !why.empty()) {
      if (value.empty()) return {.help = false, .error = arg + " " + why};
      return {.help = false, .error = arg + " " + why + ", got '" + value + "'"};
    }
    given_.insert(arg);
  }
  for (const auto& check : checks_)
    if (std::string why = check(); !why.empty()) return {.help = false, .error = why};
  return {};
}

void ArgParser::parse(int argc, const char* const* argv) {
  const Outcome outcome = try_parse(argc, argv);
  if (outcome.help) {  // help that could not be written is a failed run, like any other output
    std::cout << usage() << std::flush;
    if (!std::cout || std::fflush(stdout) != 0 || std::ferror(stdout)) {
      std::cerr << program_ << ": error: cannot write the help to standard output (a full disk or a closed pipe?)\n";
      std::exit(1);
    }
    std::exit(0);
  }
  if (!outcome.error.empty()) {
    std::cerr << program_ << ": error: " << outcome.error << " (run " << program_ << " --help for usage)\n";
    std::exit(2);
  }
}

void add_common_flags(ArgParser& p, CommonOptions& o, const std::string& default_prompt, CommonFlags which) {
  p.add_string("--model", "PATH", "checkpoint to load (default: the shipped model, data/kjv-gpt.bin)", &o.model);
  if (which != CommonFlags::kModelOnly) {
    p.add_string("--prompt", "TEXT", "text to continue (default: " + default_prompt + ")", &o.prompt);
    p.add_string("--prompt-file", "PATH", "read the prompt from a file instead", &o.prompt_file);
    p.add_int("--max-new-tokens", "tokens to generate (default " + std::to_string(o.max_new_tokens) + ")",
              &o.max_new_tokens, 0, 1 << 20);
  }
  if (which == CommonFlags::kGeneration) {
    std::ostringstream temperature;  // the chapter's default: 0 (greedy) in most, 0.8 where samples must differ
    temperature << "0 = greedy, otherwise sample from softmax(logits / X) (default " << o.temperature << ")";
    p.add_float("--temperature", temperature.str(), &o.temperature, 0.0f, 100.0f);
    // At most the byte vocabulary every chapter's model has (Runtime checks it): more would quietly mean all.
    p.add_int("--top-k", "sample among the N most likely tokens only (default 0 = all)", &o.top_k, 0, kByteVocab);
    p.add_u64("--seed", "random seed for sampling (default " + std::to_string(o.seed) + ")", &o.seed);
    p.add_check([&p, &o] {
      if (o.temperature > 0 || (!p.given("--top-k") && !p.given("--seed"))) return std::string();
      return std::string("--top-k and --seed only apply when sampling; add --temperature X (X > 0) or drop them");
    });
  }
  p.add_string("--backend", "NAME",
               "cpu (default), cuda (an NVIDIA GPU, in builds with the CUDA toolkit) or cuda-harness (the CUDA "
               "kernels run on the CPU by the project's harness, to step through one in a debugger: very slow, "
               "never time it)", &o.backend);
  p.add_check([&o] { return backend_unavailable(o.backend); });
  p.add_int("--threads", "CPU threads for matrix products and attention (default: all cores)", &o.threads, 1, 1024);
  p.add_check([&p, &o] {
    if (o.backend != "cpu" && p.given("--threads"))
      return "--threads sets CPU threads; --backend " + o.backend + " does not use it: drop one of the two";
    return std::string();
  });
  p.add_check([&o] {
    const int cores = available_cores();
    if (o.threads <= cores) return std::string();
    return "--threads " + std::to_string(o.threads) + " is more than the " + std::to_string(cores) + " core" +
           (cores > 1 ? "s" : "") + " this process may use; pass at most " + std::to_string(cores) +
           " (an extra thread waits for a core on every step: many times slower)";
  });
  p.add_string("--csv", "PATH", "also write the measurements to this CSV file", &o.csv);
  p.add_bytes("--memory-limit",
              "refuse to start a run whose weights, working buffers and KV cache need more than SIZE (default " +
                  format_bytes(double(o.memory_limit)) + ")",
              &o.memory_limit);
}

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

std::int64_t parse_bytes(const std::string& text) {
  std::size_t used = 0;
  double value = 0;
  try {
    if (decimal_number(text)) value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  // As GNU's tools read them: K, KiB (and M, G, T) are powers of 1024, KB (MB, GB, TB) powers of 1000.
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "K" || unit == "KiB") scale = 1024.0;
  else if (unit == "M" || unit == "MiB") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TiB") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "KB") scale = 1e3;
  else if (unit == "MB") scale = 1e6;
  else if (unit == "GB") scale = 1e9;
  else if (unit == "TB") scale = 1e12;
  const double exact = value * scale, bytes = std::round(exact);
  // Rounding to whole bytes may not change the size noticeably: 0.5 or 1e-9GiB is not a size, 0.1GiB is.
  if (used == 0 || scale == 0 || !std::isfinite(exact) || exact < 1 || bytes > 9.0e18 ||
      std::abs(bytes - exact) > 0.01 * exact)
    throw std::invalid_argument("expects a size of at least 1 byte, a whole number of bytes (within 1%), such as "
                                "512MiB, 16GiB or 4GB (KB, MB, GB, TB: powers of 1000), got '" + text + "'");
  return static_cast<std::int64_t>(bytes);
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> items;
  for (std::size_t start = 0;;) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    items.push_back(text.substr(start, comma - start));
    if (comma == text.size()) return items;
    start = comma + 1;
  }
}

std::vector<int> parse_int_list(const std::string& flag, const std::string& text, int min, int max) {
  if (text.empty()) throw UsageError(flag + " is empty; give whole numbers separated by commas");
  std::vector<int> values;
  for (const std::string& item : split_commas(text)) {  // as the single-number flags read them (number_text.h)
    const std::optional<long long> n = whole_number<long long>(item);
    if (!n || *n < min || *n > max)
      throw UsageError(flag + " expects whole numbers from " + std::to_string(min) + " to " + std::to_string(max) +
                       " separated by commas, got '" + text + "'");
    values.push_back(static_cast<int>(*n));
  }
  return values;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  char out[32];
  std::snprintf(out, sizeof out, bytes == std::floor(bytes) ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return out;
}

namespace {
std::mutex files_read_mutex;
std::vector<std::pair<std::string, std::string>> files_read_so_far;  // guarded by files_read_mutex
}  // namespace

std::vector<std::pair<std::string, std::string>> files_read() {
  const std::lock_guard lock(files_read_mutex);
  return files_read_so_far;
}

std::string read_input_file(const std::string& flag, const std::string& path, std::size_t max_bytes, bool truncate) {
  const std::string what = flag + " " + path;
  // O_NONBLOCK: opening a FIFO must not wait for a writer before its kind is checked.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    throw std::runtime_error("cannot read " + what + ": " + std::strerror(error));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw std::runtime_error(what + " is not a regular file (a directory, a device or a pipe); give a text file");
  }
  const auto size = static_cast<std::size_t>(st.st_size);
  if (size > max_bytes && !truncate) {
    ::close(fd);
    throw std::runtime_error(what + " is " + format_bytes(double(size)) + ", more than the " +
                             format_bytes(double(max_bytes)) + " it may hold");
  }
  std::string text(std::min(size, max_bytes), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::read(fd, text.data() + done, text.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int error = errno;
      ::close(fd);
      throw std::runtime_error("cannot read " + what + ": " + std::strerror(error));
    }
    if (got == 0) break;  // the file shrank while being read
    done += static_cast<std::size_t>(got);
  }
  ::close(fd);
  text.resize(done);
  const std::lock_guard lock(files_read_mutex);
  files_read_so_far.emplace_back(flag, path);
  return text;
}

namespace {

fs::path executable_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : exe.parent_path();
}

}  // namespace

std::string repository_root_above(const std::string& start) {
  std::error_code ec;
  for (fs::path dir = fs::weakly_canonical(start, ec); !ec && !dir.empty(); dir = dir.parent_path()) {
    if (fs::exists(dir / "common" / "model.h", ec) && fs::is_directory(dir / "data", ec)) return dir.string();
    if (dir == dir.parent_path()) break;
  }
  return {};
}

std::string find_data_file(const std::string& relative) {
  // The repository the binary was built in (build/<preset>/bin, build/bin, or anywhere below it), else
  // the source directory baked in at configure time, for builds placed outside the repository.
  std::vector<fs::path> roots;
  if (const std::string root = repository_root_above(executable_dir().string()); !root.empty()) roots.push_back(root);
  roots.push_back(KVS_SOURCE_DIR);
  for (const fs::path& root : roots)
    if (fs::exists(root / "data" / relative)) return fs::weakly_canonical(root / "data" / relative).string();
  throw std::runtime_error("data/" + relative + " was not found (looked in " + (roots.front() / "data").string() + ")");
}

std::string resolve_model_path(const CommonOptions& options) {
  if (!options.model.empty()) return options.model;
  try {
    return find_data_file("kjv-gpt.bin");
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string(e.what()) + "; pass --model PATH or train it with data/train.py");
  }
}

std::string resolve_prompt(const CommonOptions& options, const std::string& default_prompt) {
  if (!options.prompt.empty() && !options.prompt_file.empty())
    throw UsageError("--prompt and --prompt-file both given; pass one of them");
  if (options.prompt_file.empty()) return options.prompt.empty() ? default_prompt : options.prompt;
  // No prompt can be longer than the largest context a checkpoint may declare (2^21 positions); the
  // benchmark cuts its prompts from longer texts, so allow some room.
  const std::string prompt = read_input_file("--prompt-file", options.prompt_file, std::size_t{64} << 20);
  if (prompt.empty()) throw std::runtime_error("--prompt-file " + options.prompt_file + " is empty");
  return prompt;
}

int run_main(const ArgParser& parser, const std::function<int()>& body) {
  auto report = [&](const std::string& what, int code) {
    std::fflush(stdout);
    // On a terminal the streamed text may end mid-line; start the error on a line of its own.
    if (isatty(STDOUT_FILENO) && isatty(STDERR_FILENO)) std::cerr << "\n";
    std::cerr << parser.program() << ": error: " << what
              << (code == 2 ? " (run " + parser.program() + " --help for usage)" : "") << "\n";
    return code;
  };
  int code = 0;
  try {
    code = body();
  } catch (const UsageError& e) {
    return report(e.what(), 2);
  } catch (const std::bad_alloc&) {
    return report("out of memory; lower --max-new-tokens, the prompt or the context, or use a smaller model", 1);
  } catch (const std::exception& e) {
    return report(e.what(), 1);
  }
  std::cout.flush();
  if (std::fflush(stdout) != 0 || std::ferror(stdout) || !std::cout)
    return report("cannot write to standard output (a full disk or a closed pipe?): the text is incomplete", 1);
  return code;
}

}  // namespace kvs
