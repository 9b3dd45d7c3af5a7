#include <doctest/doctest.h>

#include <vector>

#include "cli.h"

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
                          "0.8", "--top-k=5", "--seed", "18446744073709551615", "--threads", "2", "--csv", "x.csv"});
  REQUIRE(p.outcome.error.empty());
  CHECK_FALSE(p.outcome.help);
  CHECK(p.options.model == "m.bin");
  CHECK(p.options.prompt == "Hi there");
  CHECK(p.options.max_new_tokens == 17);
  CHECK(p.options.temperature == doctest::Approx(0.8));
  CHECK(p.options.top_k == 5);
  CHECK(p.options.seed == 18446744073709551615ull);
  CHECK(p.options.threads == 2);
  CHECK(p.options.csv == "x.csv");
  CHECK(parse({"--help"}).outcome.help);
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
  CHECK(parse({"--seed", "12a"}).outcome.error.find("--seed expects") != std::string::npos);
  CHECK(parse({"--model"}).outcome.error == "--model needs a value (PATH)");
}

TEST_CASE("cli: prompts come from --prompt, --prompt-file or the chapter's default, never two at once") {
  CommonOptions o;
  CHECK(resolve_prompt(o, "default") == "default");
  o.prompt_given = true;
  CHECK_THROWS_WITH(resolve_prompt(o, "default"), doctest::Contains("--prompt is empty"));
  o.prompt = "given";
  CHECK(resolve_prompt(o, "default") == "given");
  o.prompt_file = "/nonexistent/prompt.txt";
  CHECK_THROWS_WITH(resolve_prompt(o, "default"), doctest::Contains("--prompt and --prompt-file both given"));
  o.prompt.clear();
  o.prompt_given = false;
  CHECK_THROWS_WITH(resolve_prompt(o, "default"), doctest::Contains("cannot read --prompt-file"));
}
