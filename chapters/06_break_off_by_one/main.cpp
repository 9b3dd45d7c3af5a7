// Chapter 06 — break the cache on purpose: write each position one slot off.
//
// The off-by-one cache (off_by_one_kv_cache.h) keeps the right keys and values in the wrong slots. --experiment
// run (default) compares it with the correct cache of chapter 03, as chapter 05 does (first divergence,
// per-step KL, the texts side by side), and runs the project's equivalence check - the one the tests run on
// every cache - against naive decoding, correct cache and broken one. --experiment probes asks how long a
// probe must be to catch the bug: many prompts, probes of 5 to 400 generated tokens.
#include <algorithm>
#include <cstdio>
#include <iostream>

#include "03_preallocated_cache/preallocated_kv_cache.h"
#include "05_break_corrupt_key/report.h"
#include "cli.h"
#include "equivalence.h"
#include "generate.h"
#include "off_by_one_kv_cache.h"
#include "progress.h"
#include "runtime.h"
#include "tokenizer.h"

namespace {

constexpr const char* kDefaultPrompt = "And God said, ";

// A greedy run through `cache`, its logits recorded; teacher-forced when `forced` is not empty.
kvs::RecordedRun greedy(kvs::Model& model, kvs::KvCache& cache, std::span<const int> prompt, int new_tokens,
                        std::span<const int> forced = {}) {
  return kvs::record([&](const kvs::OnLogits& on_logits) {
    kvs::Sampler s(model.config().vocab_size, {});
    return kvs::generate_cached(model, cache, s, prompt, new_tokens, 0, {}, on_logits, forced);
  });
}

std::string verdict(const kvs::Equivalence& e) {
  char line[256];
  if (e.passed())
    std::snprintf(line, sizeof line, "passed: %d steps, largest logit difference %.2e (tolerance %.0e)", e.steps,
                  e.worst_logit_difference, kvs::kLogitTolerance);
  else
    std::snprintf(line, sizeof line, "FAILED: logits off by more than %.0e from step %d, first different token at %s; "
                  "largest logit difference %.3g", kvs::kLogitTolerance, e.first_logit_mismatch,
                  e.first_token_mismatch < 0 ? "none" : ("step " + std::to_string(e.first_token_mismatch)).c_str(),
                  e.worst_logit_difference);
  return line;
}

void run(kvs::Runtime& rt, int shift, int new_tokens, int every, kvs::CsvWriter& csv) {
  kvs::Model& model = rt.model;
  const kvs::ModelConfig& c = model.config();
  const std::span<const int> prompt = rt.prompt;
  const int prompt_len = static_cast<int>(prompt.size()), positions = prompt_len + new_tokens;
  std::fprintf(stderr, "%d new tokens, greedy, after a %d-token prompt; the broken cache writes position p to slot p %+d\n\n",
               new_tokens, prompt_len, shift);
  kvs::ch03::PreallocatedKvCache correct(rt.backend, c, positions);
  const kvs::RecordedRun clean = greedy(model, correct, prompt, new_tokens);
  const std::span<const int> clean_tokens(clean.tokens.begin() + prompt_len, clean.tokens.end());
  kvs::ch06::OffByOneKvCache broken_free(rt.backend, c, positions, shift), broken_forced(rt.backend, c, positions, shift);
  const kvs::RecordedRun free = greedy(model, broken_free, prompt, new_tokens);
  const kvs::RecordedRun forced = greedy(model, broken_forced, prompt, new_tokens, clean_tokens);
  const auto free_steps = kvs::ch05::step_divergence(clean, free, prompt_len);
  const auto forced_steps = kvs::ch05::step_divergence(clean, forced, prompt_len);
  const int first = kvs::ch05::first_mismatch(free_steps);

  std::cout << "the generated text, correct cache and off-by-one cache (free-running), ";
  if (first < 0)
    std::cout << "identical in " << new_tokens << " tokens\n";
  else
    std::cout << "first different at step " << first << (kvs::ch05::colour_output() ? " (in red)" : " (after '[')") << "\n";
  kvs::ch05::print_side_by_side(std::cout, "correct", clean_tokens, "off by " + std::string(shift > 0 ? "+1" : "-1"),
                                std::span<const int>(free.tokens).subspan(prompt_len), first, kvs::ch05::colour_output());
  std::cout.flush();

  std::fprintf(stderr, "\nper step (same: the two free-running texts' tokens at this step; KL and |dlogit| teacher-forced: "
                       "the correct run's tokens fed to the off-by-one cache)\n"
                       "  %5s %5s %5s %10s %11s\n", "step", "pos", "same", "KL", "max|dlogit|");
  for (int s = 0; s < new_tokens; ++s) {
    if (s < 4 || s % every == 0 || s == first || s == new_tokens - 1)
      std::fprintf(stderr, "  %5d %5d %5s %10.2e %11.3f%s\n", s, prompt_len + s - 1, free_steps[s].tokens_match ? "yes" : "NO",
                   forced_steps[s].kl, forced_steps[s].max_abs_logit, s == first ? "  <- first different token" : "");
    csv.row(s, prompt_len + s - 1, clean_tokens[s], free.tokens[prompt_len + s], free_steps[s].tokens_match ? 1 : 0,
            forced_steps[s].kl, forced_steps[s].max_abs_logit);
  }
  csv.commit();

  // The test that catches it: the equivalence check against naive decoding, as tests/test_equivalence.cpp runs it.
  const kvs::RecordedRun naive = kvs::record([&](const kvs::OnLogits& on_logits) {
    kvs::Sampler s(c.vocab_size, {});
    return kvs::generate_naive(model, s, prompt, new_tokens, {}, on_logits);
  });
  std::fprintf(stderr, "\nthe equivalence check (common/equivalence.h, what the tests run) against naive decoding:\n");
  std::fprintf(stderr, "  correct cache:    %s\n", verdict(kvs::check_equivalence(naive, clean, prompt_len)).c_str());
  std::fprintf(stderr, "  off-by-one cache: %s\n", verdict(kvs::check_equivalence(naive, free, prompt_len)).c_str());
  std::fprintf(stderr, "  a check of the tokens alone %s\n",
               first < 0   ? "would pass: only the logits catch this bug here"
               : first > 0 ? ("fails at step " + std::to_string(first) + ": a probe of " + std::to_string(first) +
                              " tokens or fewer passes it").c_str()
                           : "fails at step 0");
}

void probes(kvs::Runtime& rt, const std::string& held_out, int shift, int prompts, int max_prompt_bytes,
            const std::vector<int>& lengths, kvs::CsvWriter& csv) {
  kvs::Model& model = rt.model;
  const kvs::ModelConfig& c = model.config();
  const int longest = lengths.back();
  // Prompts of 16 to 256 bytes (at most max_prompt_bytes) from line starts spread over the held-out text.
  std::vector<std::vector<int>> texts;
  std::size_t longest_prompt = 0;
  for (int k = 0; k < prompts; ++k) {
    std::size_t at = held_out.find('\n', held_out.size() * k / prompts);
    const std::size_t bytes = std::min(std::size_t(16) << (k % 5), std::size_t(max_prompt_bytes));
    if (at == std::string::npos || at + 1 + bytes > held_out.size()) throw std::runtime_error("the held-out text is too short");
    texts.push_back(kvs::encode_bytes(held_out.substr(at + 1, bytes)));
    longest_prompt = std::max(longest_prompt, bytes);
  }
  std::fprintf(stderr, "%d prompts of %d-%d held-out bytes, one greedy run of %d tokens each through the correct and the "
                       "off-by-one (%+d) cache; a probe of n tokens passes if the equivalence check passes its first n "
                       "steps\n", prompts, std::min(16, max_prompt_bytes),
               static_cast<int>(longest_prompt), longest, shift);
  std::vector<int> token_passes(lengths.size()), full_passes(lengths.size());
  kvs::Progress progress("probes", "prompts");
  for (int k = 0; k < prompts; ++k) {
    const std::span<const int> prompt = texts[k];
    const int n = static_cast<int>(prompt.size());
    kvs::ch03::PreallocatedKvCache correct(rt.backend, c, n + longest);
    kvs::ch06::OffByOneKvCache broken(rt.backend, c, n + longest, shift);
    const kvs::RecordedRun reference = greedy(model, correct, prompt, longest), run = greedy(model, broken, prompt, longest);
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      auto probe = [&](const kvs::RecordedRun& r) {  // the first lengths[i] generated tokens of a run
        kvs::RecordedRun p{{r.tokens.begin(), r.tokens.begin() + n + lengths[i]}, {r.logits.begin(), r.logits.begin() + lengths[i]}};
        return p;
      };
      const kvs::Equivalence e = kvs::check_equivalence(probe(reference), probe(run), n);
      token_passes[i] += e.first_token_mismatch < 0;
      full_passes[i] += e.passed();
    }
    progress.update(k + 1, prompts);
  }
  std::fprintf(stderr, "\n  %12s %22s %24s\n", "probe tokens", "passes: tokens only", "passes: tokens + logits");
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    std::fprintf(stderr, "  %12d %15d of %3d %17d of %3d\n", lengths[i], token_passes[i], prompts, full_passes[i], prompts);
    csv.row(shift, lengths[i], prompts, token_passes[i], full_passes[i]);
  }
  csv.commit();
}

}  // namespace

int main(int argc, char** argv) {
  kvs::CommonOptions options;
  options.max_new_tokens = 200;
  std::string experiment = "run";
  int every = 10, prompts = 40;
  std::string probe_tokens = "5,10,20,50,100,200,400";
  kvs::ArgParser parser(
      "06_break_off_by_one",
      "Chapter 06: a cache that writes position p to slot p + --shift (+1 or -1) and reads slot r as position r.\n"
      "Greedy decoding.\n"
      "--experiment run (default): the correct cache and the off-by-one cache side by side (stdout), per-step KL\n"
      "    and max |dlogit| (teacher-forced), and the project's equivalence check on both (stderr);\n"
      "--experiment probes: --prompts held-out prompts, one run each of the longest --probe-tokens: how many\n"
      "    probes of each length pass, checking tokens only and tokens + logits; both shifts unless --shift is given.\n"
      "CSV columns (--csv):\n"
      "  run: step, position, correct_token, broken_token, tokens_match (of the free-running texts), kl,\n"
      "      max_abs_logit (the largest |difference| of a logit; kl and it teacher-forced)\n"
      "  probes: shift, probe_tokens, prompts, passed_tokens_only, passed_tokens_and_logits");
  kvs::add_common_flags(parser, options, '"' + std::string(kDefaultPrompt) + '"', kvs::CommonFlags::kGreedy);
  parser.add_string("--experiment", "NAME", "run or probes (default run)", &experiment);
  // Two values, checked below by name (as a whole number from -1 to 1, "--shift 2" was refused "from -1 to 1", as if
  // 0 were one of them).
  std::string shift_text = "1";
  parser.add_string("--shift", "N", "the write index's error: 1 or -1 (default 1)", &shift_text);
  parser.add_int("--every", "run: print every Nth step of the table (default 10)", &every, 1, 1000000);
  parser.add_int("--prompts", "probes: prompts (default 40)", &prompts, 1, 1000);
  parser.add_string("--probe-tokens", "LIST", "probes: probe lengths in generated tokens (default 5,10,20,50,100,200,400)",
                    &probe_tokens);
  parser.add_check([&] {
    if (experiment != "run" && experiment != "probes") return "--experiment '" + experiment + "': use run or probes";
    if (shift_text == "0") return std::string("--shift 0 is the correct cache (chapter 03); use 1 or -1");
    if (shift_text != "1" && shift_text != "-1") return "--shift " + shift_text + ": the write index's error is 1 or -1";
    // With no step to compare, both caches would "pass" and the run would say nothing true.
    if (options.max_new_tokens < 1) return std::string("--max-new-tokens: at least 1 (the caches are compared step by step)");
    return std::string();
  });
  // The probes cut their own prompts from the held-out text and generate the longest --probe-tokens each.
  parser.add_read_only_by("--experiment", &experiment,
                          {{"--max-new-tokens", {"run"}},
                           {"--prompt", {"run"}},
                           {"--prompt-file", {"run"}},
                           {"--every", {"run"}},
                           {"--prompts", {"probes"}},
                           {"--probe-tokens", {"probes"}}});
  parser.parse(argc, argv);
  const int shift = shift_text == "-1" ? -1 : 1;  // checked above: "1" or "-1"

  return kvs::run_main(parser, [&] {
    std::vector<int> lengths = kvs::parse_int_list("--probe-tokens", probe_tokens, 1, 1 << 20);
    std::sort(lengths.begin(), lengths.end());
    // probes: prompts of up to 256 bytes, and the longest probe.
    const int seq_len = kvs::Checkpoint(kvs::resolve_model_path(options)).config().seq_len;
    const int prompt_bytes = std::min(256, seq_len - lengths.back());
    if (experiment == "probes" && prompt_bytes < 2)
      throw kvs::UsageError("--probe-tokens: probes of " + std::to_string(lengths.back()) +
                            " tokens leave no room for a prompt in the model's context of " + std::to_string(seq_len));
    kvs::Runtime rt(options, kDefaultPrompt, experiment == "probes" ? kvs::PromptFit::kCutByCaller : kvs::PromptFit::kMustFit,
                    experiment == "probes" ? prompt_bytes + lengths.back() : 0);
    // Caches alive at once: run, the correct one and two broken ones; probes, one of each (a broken cache
    // holds two spare rows).
    const int positions = experiment == "probes" ? prompt_bytes + lengths.back()
                                                 : static_cast<int>(rt.prompt.size()) + options.max_new_tokens;
    rt.plan_kv_cache((experiment == "run" ? 3 : 2) * kvs::kv_cache_bytes(rt.model.config(), positions + 2));
    std::cerr << rt.describe() << "\n";
    if (experiment == "run") {
      kvs::CsvWriter csv({"--csv", options.csv}, "step,position,correct_token,broken_token,tokens_match,kl,max_abs_logit",
                         rt.inputs());
      run(rt, shift, options.max_new_tokens, every, csv);
    } else {
      kvs::CsvWriter csv({"--csv", options.csv}, "shift,probe_tokens,prompts,passed_tokens_only,passed_tokens_and_logits",
                         rt.inputs());
      const std::string held_out = kvs::read_input_file("the held-out text", kvs::find_data_file("kjv/valid.txt"), 1u << 30);
      for (int s : parser.given("--shift") ? std::vector<int>{shift} : std::vector<int>{1, -1})
        probes(rt, held_out, s, prompts, prompt_bytes, lengths, csv);
    }
    if (!options.csv.empty()) std::cerr << "wrote " << options.csv << "\n";
    return 0;
  });
}
