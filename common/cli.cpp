#include "cli.h"

#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>

namespace kvs {
namespace fs = std::filesystem;

ArgParser::ArgParser(std::string program, std::string description)
    : program_(std::move(program)), description_(std::move(description)) {}

void ArgParser::add_string(const std::string& name, const std::string& value_name, const std::string& help,
                           std::string* target, bool* given) {
  flags_.push_back({name, value_name, help, [target, given](const std::string& v) {
                      *target = v;
                      if (given) *given = true;
                      return std::string();
                    }});
}

void ArgParser::add_int(const std::string& name, const std::string& help, int* target, int min, int max) {
  flags_.push_back({name, "N", help, [=](const std::string& v) {
                      long long value = 0;
                      auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), value);
                      if (ec != std::errc() || end != v.data() + v.size() || value < min || value > max)
                        return "expects a whole number from " + std::to_string(min) + " to " + std::to_string(max);
                      *target = static_cast<int>(value);
                      return std::string();
                    }});
}

void ArgParser::add_u64(const std::string& name, const std::string& help, std::uint64_t* target) {
  flags_.push_back({name, "N", help, [=](const std::string& v) {
                      std::uint64_t value = 0;
                      auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), value);
                      if (ec != std::errc() || end != v.data() + v.size())
                        return std::string("expects a whole number from 0 to 18446744073709551615");
                      *target = value;
                      return std::string();
                    }});
}

void ArgParser::add_float(const std::string& name, const std::string& help, float* target, float min, float max) {
  flags_.push_back({name, "X", help, [=](const std::string& v) {
                      char* end = nullptr;
                      const float value = std::strtof(v.c_str(), &end);
                      if (v.empty() || end != v.c_str() + v.size() || !std::isfinite(value) || value < min ||
                          value > max) {
                        std::ostringstream why;
                        why << "expects a number from " << min << " to " << max;
                        return why.str();
                      }
                      *target = value;
                      return std::string();
                    }});
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

std::string ArgParser::usage() const {
  std::ostringstream out;
  out << "usage: " << program_ << " [options]\n\n" << description_ << "\n\noptions:\n";
  out << "  --help                 print this help and exit\n";
  for (const Flag& f : flags_) {
    std::string left = "  " + f.name + (f.value_name.empty() ? "" : " " + f.value_name);
    if (left.size() < 25) left.resize(25, ' ');
    else left += "\n" + std::string(25, ' ');
    out << left << f.help << "\n";
  }
  return out.str();
}

ArgParser::Outcome ArgParser::try_parse(int argc, const char* const* argv) const {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    if (arg == "--help" || arg == "-h") return {.help = true, .error = {}};
    bool inline_value = false;
    if (auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      inline_value = true;
    }
    const Flag* flag = find(arg);
    if (!flag) return {.help = false, .error = "unknown option '" + arg + "'"};
    if (flag->value_name.empty()) {
      if (inline_value) return {.help = false, .error = arg + " takes no value"};
    } else if (!inline_value) {
      if (i + 1 >= argc) return {.help = false, .error = arg + " needs a value (" + flag->value_name + ")"};
      value = argv[++i];
    }
    if (std::string why = flag->set(value); !why.empty()) return {.help = false, .error = arg + " " + why + ", got '" + value + "'"};
  }
  return {};
}

void ArgParser::parse(int argc, const char* const* argv) const {
  const Outcome outcome = try_parse(argc, argv);
  if (outcome.help) {
    std::cout << usage();
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
    p.add_string("--prompt", "TEXT", "text to continue (default: " + default_prompt + ")", &o.prompt, &o.prompt_given);
    p.add_string("--prompt-file", "PATH", "read the prompt from a file instead", &o.prompt_file);
    p.add_int("--max-new-tokens", "tokens to generate (default " + std::to_string(o.max_new_tokens) + ")",
              &o.max_new_tokens, 0, 1 << 20);
  }
  if (which == CommonFlags::kGeneration) {
    p.add_float("--temperature", "0 = greedy (default), otherwise sample from softmax(logits / T)", &o.temperature,
                0.0f, 100.0f);
    p.add_int("--top-k", "sample among the K most likely tokens only (default 0 = all)", &o.top_k, 0, 1 << 21);
    p.add_u64("--seed", "random seed for sampling (default " + std::to_string(o.seed) + ")", &o.seed);
  }
  p.add_int("--threads", "CPU threads for matrix products and attention (default: all cores)", &o.threads, 1, 1024);
  p.add_string("--csv", "PATH", "also write the measurements to this CSV file", &o.csv);
}

namespace {

fs::path executable_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : exe.parent_path();
}

}  // namespace

std::string find_data_file(const std::string& relative) {
  // The binaries live in build/<preset>/bin, three levels below the repository; the source directory
  // baked in at configure time covers builds placed elsewhere.
  const fs::path candidates[] = {executable_dir() / "../../../data" / relative,
                                 fs::path(KVS_SOURCE_DIR) / "data" / relative};
  for (const fs::path& c : candidates)
    if (fs::exists(c)) return fs::weakly_canonical(c).string();
  throw std::runtime_error("data/" + relative + " was not found (looked in " + candidates[1].parent_path().string() + ")");
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
  if (options.prompt_given && !options.prompt_file.empty())
    throw std::runtime_error("--prompt and --prompt-file both given; pass one of them");
  if (options.prompt_given && options.prompt.empty())
    throw std::runtime_error("--prompt is empty; give some text to continue");
  std::string prompt = options.prompt;
  if (!options.prompt_file.empty()) {
    std::ifstream in(options.prompt_file, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read --prompt-file " + options.prompt_file);
    prompt.assign(std::istreambuf_iterator<char>(in), {});
    if (prompt.empty()) throw std::runtime_error("--prompt-file " + options.prompt_file + " is empty");
  }
  return prompt.empty() ? default_prompt : prompt;
}

int run_main(const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::cerr << "\nerror: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace kvs
