#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli.h"
#include "progress.h"
#include "test_util.h"

using namespace kvs;

namespace {

struct Parsed {
  CommonOptions options;
  ArgParser::Outcome outcome;
};

Parsed parse(std::vector<const char*> args) {
  Parsed p;
  ArgParser parser("prog", "test");
  add_common_flags(parser, p.options);
  args.insert(args.begin(), "prog");
  p.outcome = parser.try_parse(static_cast<int>(args.size()), args.data());
  return p;
}

}  // namespace

TEST_CASE("cli: the common flags parse, in both --flag value and --flag=value forms") {
  const Parsed p = parse({"--model", "m.bin", "--prompt=Hi there", "--max-new-tokens", "17", "--temperature",
                          "0.8", "--top-k=5", "--seed", "18446744073709551615", "--threads", "1", "--csv", "x.csv"});
  REQUIRE(p.outcome.error.empty());
  CHECK_FALSE(p.outcome.help);
  CHECK(p.options.model == "m.bin");
  CHECK(p.options.prompt == "Hi there");
  CHECK(p.options.max_new_tokens == 17);
  CHECK(p.options.temperature == doctest::Approx(0.8));
  CHECK(p.options.top_k == 5);
  CHECK(p.options.seed == 18446744073709551615ull);
  CHECK(p.options.threads == 1);
  CHECK(p.options.csv == "x.csv");
  CHECK(parse({"--help"}).outcome.help);
}

TEST_CASE("cli: a flag given twice is refused, whatever its form, not the last one taken") {
  CHECK(parse({"--threads", "1", "--threads", "2"}).outcome.error == "--threads is given twice; give it once");
  CHECK(parse({"--csv=a.csv", "--csv", "b.csv"}).outcome.error == "--csv is given twice; give it once");
  CHECK(parse({"--seed", "1", "--threads", "1", "--seed=2"}).outcome.error == "--seed is given twice; give it once");
  CHECK(parse({"--temperature", "0.5", "--temperature", "0.5"}).outcome.error == "--temperature is given twice; give it once");
  CHECK(parse({"--threads", "1", "--csv", "a.csv"}).outcome.error.empty());
}

TEST_CASE("cli: --help wraps long lines at 110 columns, under the text they continue, and keeps tables aligned") {
  std::string unused;
  const std::string long_word(120, 'w');
  ArgParser parser("prog",
                   "A first line that is short.\n"
                   "  name      " + std::string(60, 'a') + " " + std::string(60, 'b') + "\n"
                   "  also      kept as it is\n"
                   "  long      " + long_word + "\n"
                   "plain " + long_word + "\n" +
                   std::string(150, ' ') + "\n" +              // nothing but spaces
                   "  trailing" + std::string(120, ' ') + "\n" +  // a short line padded past the width
                   std::string(120, ' ') + "deep words");        // indented past the width
  parser.add_string("--flag", "X", std::string(50, 'c') + "\n" + std::string(50, 'd') + " " + std::string(30, 'e'),
                    &unused);
  parser.add_string("--a-flag-longer-than-its-column", "VALUE", "short help", &unused);
  std::vector<std::string> lines;
  std::istringstream usage(parser.usage());
  for (std::string line; std::getline(usage, line);) lines.push_back(line);
  const auto line_of = [&](const std::string& text) {
    const auto it = std::find_if(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(text) != std::string::npos; });
    REQUIRE(it != lines.end());
    return std::size_t(it - lines.begin());
  };
  const std::size_t row = line_of("  name      a");
  CHECK(lines[row] == "  name      " + std::string(60, 'a'));
  CHECK(lines[row + 1] == std::string(12, ' ') + std::string(60, 'b'));  // under the text, not the name
  CHECK(lines[row + 2] == "  also      kept as it is");                 // the spacing of a short line is kept
  CHECK(lines[row + 3] == "  long      " + long_word);  // never cut inside the name's indentation
  const std::size_t plain = line_of("plain");
  CHECK(lines[plain] == "plain");
  CHECK(lines[plain + 1] == long_word);  // a word longer than a line is not cut
  CHECK(lines[plain + 2].empty());
  CHECK(lines[plain + 3] == "  trailing");
  CHECK(lines[plain + 4] == std::string(55, ' ') + "deep words");  // continuations keep half a line for text
  CHECK(lines[plain + 5].empty());                                  // the blank line before "options:"
  // An option's help is one paragraph: the author's line break is reflowed, continuations start at column 25.
  const std::size_t flag = line_of("--flag X");
  CHECK(lines[flag] == "  --flag X               " + std::string(50, 'c'));
  CHECK(lines[flag + 1] == std::string(25, ' ') + std::string(50, 'd') + " " + std::string(30, 'e'));  // 106 columns
  const std::size_t longer = line_of("--a-flag-longer");
  CHECK(lines[longer] == "  --a-flag-longer-than-its-column VALUE");
  CHECK(lines[longer + 1] == std::string(25, ' ') + "short help");
}

TEST_CASE("cli: unknown flags and bad values are named in the error") {
  CHECK(parse({"--frobnicate"}).outcome.error == "unknown option '--frobnicate'");
  CHECK(parse({"--max-new-tokens", "ten"}).outcome.error ==
        "--max-new-tokens expects a whole number from 0 to 1048576, got 'ten'");
  CHECK(parse({"--max-new-tokens", "-1"}).outcome.error.find("got '-1'") != std::string::npos);
  CHECK(parse({"--max-new-tokens", "99999999999"}).outcome.error.find("expects a whole number") != std::string::npos);
  CHECK(parse({"--threads", "0"}).outcome.error.find("--threads expects a whole number from 1") != std::string::npos);
  CHECK(parse({"--temperature", "nan"}).outcome.error.find("--temperature expects a number") != std::string::npos);
  CHECK(parse({"--temperature", "-0.5"}).outcome.error.find("got '-0.5'") != std::string::npos);
  CHECK(parse({"--temperature", "1.0x"}).outcome.error.find("got '1.0x'") != std::string::npos);
  CHECK(parse({"--temperature", "0x1"}).outcome.error.find("expects a number from 0 to 100, got '0x1'") != std::string::npos);
  CHECK(parse({"--temperature", " 1"}).outcome.error.find("expects a number") != std::string::npos);
  // 1e-50 reads as 0 (strtof underflows): it asked to sample, and 0 would have decoded greedily without a word
  CHECK(parse({"--temperature", "1e-50"}).outcome.error ==
        "--temperature is too close to 0 for a float (it reads as 0); give 0 or a number further from 0, got '1e-50'");
  CHECK(parse({"--temperature", "0"}).outcome.error.empty());
  CHECK(parse({"--temperature", "0.0"}).outcome.error.empty());
  CHECK(parse({"--temperature", "1e-3"}).outcome.error.empty());
  CHECK(parse({"--seed", "12a"}).outcome.error.find("--seed expects") != std::string::npos);
  CHECK(parse({"--model"}).outcome.error == "--model needs a value (PATH)");
  // A missing value does not swallow the next option (`--csv --threads 1` wrote a file named --threads).
  CHECK(parse({"--csv", "--threads", "1"}).outcome.error ==
        "--csv needs a value (PATH), not the option '--threads' (a value that starts with -- goes as --csv=--threads)");
  CHECK(parse({"--prompt=--not-a-flag"}).outcome.error.empty());
  CHECK(parse({"--prompt", "-1 is a fine prompt"}).outcome.error.empty());
  CHECK(parse({"--help=1"}).outcome.error == "--help takes no value");
}

TEST_CASE("cli: a list is whole numbers between commas, and an empty item anywhere is refused") {
  CHECK(parse_int_list("--lengths", "8,40,512", 1, 1000) == std::vector<int>{8, 40, 512});
  CHECK(parse_int_list("--lengths", "7", 1, 1000) == std::vector<int>{7});
  CHECK(parse_int_list("--x", "-3,0", -5, 5) == std::vector<int>{-3, 0});
  // the trailing comma used to pass (getline yields no empty last item), as did spaces and '+' (stoll skips them)
  for (const std::string bad : {"8,40,", ",8", "8,,40", ",", "", "8, 40", " 8", "+8", "8x", "1001", "0", "99999999999"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(parse_int_list("--lengths", bad, 1, 1000), UsageError);
  }
  CHECK(split_commas("8,,40,") == std::vector<std::string>{"8", "", "40", ""});
  CHECK(split_commas("") == std::vector<std::string>{""});
  CHECK_THROWS_WITH(parse_int_list("--lengths", "8,40,", 1, 1000),
                    "--lengths expects whole numbers from 1 to 1000 separated by commas, got '8,40,'");
}

TEST_CASE("cli: prompts come from --prompt, --prompt-file or the chapter's default, never two at once") {
  CommonOptions o;
  CHECK(resolve_prompt(o, "default") == "default");
  CHECK(parse({"--prompt", ""}).outcome.error == "--prompt needs a non-empty value");
  o.prompt = "given";
  CHECK(resolve_prompt(o, "default") == "given");
  o.prompt_file = "/nonexistent/prompt.txt";
  CHECK_THROWS_AS(resolve_prompt(o, "default"), UsageError);
  CHECK_THROWS_WITH(resolve_prompt(o, "default"), doctest::Contains("--prompt and --prompt-file both given"));
  o.prompt.clear();
  CHECK_THROWS_WITH(resolve_prompt(o, "default"), doctest::Contains("cannot read --prompt-file"));
}

TEST_CASE("cli: sizes are whole bytes, at least one, and nothing is silently rounded to zero") {
  CHECK(parse_bytes("512MiB") == 512ll << 20);
  CHECK(parse_bytes("1.5G") == 3ll << 29);
  CHECK(parse_bytes("0.1GiB") == 107374182);  // 0.4 bytes of rounding is not noticeable
  CHECK(parse_bytes("1000000") == 1000000);
  CHECK(parse_bytes("4MB") == 4000000);  // as GNU's tools: MB is 10^6 bytes, M and MiB 2^20
  CHECK(parse_bytes("4M") == 4ll << 20);
  CHECK(parse_bytes("2TB") == 2000000000000ll);
  for (const std::string bad : {"0", "0.5", "1e-9GiB", "-1MiB", "lots", "12XB", "", "inf", "0x100", " 5MiB", "+5MiB"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(parse_bytes(bad), std::invalid_argument);
  }
  CHECK(format_bytes(1024) == "1 KiB");
  CHECK(format_bytes(5.5 * 1024 * 1024) == "5.5 MiB");
}

TEST_CASE("cli: the shipped model is looked up in the binary's own repository, never in a neighbour's data/") {
  test::TempDir dir;
  namespace fs = std::filesystem;
  // parent/data/kjv-gpt.bin is a stray neighbour; parent/repo is this project, built with `cmake -B build`.
  const fs::path parent = dir.file("parent"), repo = parent / "repo";
  fs::create_directories(parent / "data");
  fs::create_directories(repo / "common");
  fs::create_directories(repo / "data");
  fs::create_directories(repo / "build" / "bin");
  fs::create_directories(parent / "elsewhere" / "bin");
  std::ofstream(repo / "common" / "model.h") << "";
  CHECK(repository_root_above((repo / "build" / "bin").string()) == fs::weakly_canonical(repo).string());
  CHECK(repository_root_above((repo / "build" / "release" / "bin").string()) == fs::weakly_canonical(repo).string());
  CHECK(repository_root_above((parent / "elsewhere" / "bin").string()).empty());  // parent has data/ but no common/
}

TEST_CASE("cli: more threads than cores and sampling flags without sampling are command-line errors") {
  const std::string too_many = std::to_string(available_cores() + 1);
  CHECK(parse({"--threads", too_many.c_str()}).outcome.error.find("is more than the") != std::string::npos);
  CHECK(parse({"--threads", "1"}).outcome.error.empty());
  CHECK(parse({"--top-k", "3"}).outcome.error.find("only apply when sampling") != std::string::npos);
  CHECK(parse({"--temperature", "0.5", "--top-k", "3"}).outcome.error.empty());
  CHECK(parse({"--temperature", "0.5", "--top-k", "256"}).outcome.error.empty());
  // more than the vocabulary quietly meant all of it
  CHECK(parse({"--temperature", "0.5", "--top-k", "257"}).outcome.error ==
        "--top-k expects a whole number from 0 to 256, got '257'");
  CHECK(parse({"--csv", ""}).outcome.error == "--csv needs a non-empty value");
}

TEST_CASE("cli: a flag that the chosen experiment does not read is refused, naming the experiments that do") {
  auto outcome = [](std::vector<const char*> args) {
    std::string experiment = "run", windows, csv;
    int every = 1;
    ArgParser parser("prog", "test");
    parser.add_string("--experiment", "NAME", "run, sweep or probe", &experiment);
    parser.add_string("--windows", "LIST", "sweep only", &windows);
    parser.add_int("--every", "run and probe", &every, 1, 100);
    parser.add_string("--csv", "PATH", "every experiment", &csv);
    parser.add_read_only_by("--experiment", &experiment,
                            {{"--windows", {"sweep"}}, {"--every", {"run", "probe"}}, {"--csv", {"run", "sweep", "probe"}}});
    args.insert(args.begin(), "prog");
    return parser.try_parse(static_cast<int>(args.size()), args.data()).error;
  };
  // The default experiment counts as chosen; one reader, two, and the flags no rule names pass.
  CHECK(outcome({"--windows", "8"}) == "--windows is for --experiment sweep, not run: drop it");
  CHECK(outcome({"--experiment", "sweep", "--every", "2"}) == "--every is for --experiment run or probe, not sweep: drop it");
  CHECK(outcome({"--experiment", "sweep", "--windows", "8", "--csv", "x"}).empty());
  CHECK(outcome({"--every", "3", "--csv", "x"}).empty());
  CHECK(outcome({"--experiment", "probe", "--every", "3"}).empty());
  CHECK(outcome({}).empty());
}

// What a Progress wrote to a temporary file.
std::string progress_output(int terminal, double interval_ms, const std::vector<std::pair<int, int>>& updates) {
  std::FILE* out = std::tmpfile();
  REQUIRE(out != nullptr);
  {
    Progress progress("prefill", "positions", {.out = out, .interval_ms = interval_ms, .terminal = terminal});
    for (const auto& [done, total] : updates) progress.update(done, total);
  }
  std::string text(static_cast<std::size_t>(std::ftell(out)), '\0');
  std::rewind(out);
  CHECK(std::fread(text.data(), 1, text.size(), out) == text.size());
  std::fclose(out);
  return text;
}

TEST_CASE("progress: quiet within its interval, a line per update off a terminal, one rewritten line on one") {
  const std::vector<std::pair<int, int>> updates = {{1, 3}, {2, 3}, {3, 3}, {3, 3}};
  // A run shorter than the interval (an hour here) prints nothing, its last update included.
  CHECK(progress_output(0, 3.6e6, updates).empty());
  CHECK(progress_output(1, 3.6e6, updates).empty());
  // Every update once the interval has passed (0): lines of their own in a file, the last one once.
  CHECK(progress_output(0, 0, updates) ==
        "  prefill: 1 of 3 positions, 0 s\n  prefill: 2 of 3 positions, 0 s\n  prefill: 3 of 3 positions, 0 s\n");
  // On a terminal, one line rewritten in place, ended once.
  CHECK(progress_output(1, 0, updates) ==
        "\r  prefill: 1 of 3 positions, 0 s\r  prefill: 2 of 3 positions, 0 s\r  prefill: 3 of 3 positions, 0 s\n");
  // A run that stops before its last update still ends the terminal's line.
  CHECK(progress_output(1, 0, {{1, 3}}) == "\r  prefill: 1 of 3 positions, 0 s\n");
}
