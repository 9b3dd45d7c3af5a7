// Chapter 05 — break the cache on purpose: corrupt one cached key.
//
// A clean greedy run, then the same prompt again with one cached vector (--layer, --kv-head, --position,
// key or --value) overwritten right after step --at-step, and decoding goes on (corruption.h). The report
// compares the two runs free-running (what a user would see) and teacher-forced (the damaged cache alone),
// shows where the damage spreads in the cache, and whether restoring the vector brings the output back.
// --experiment sweep repeats it over layers, positions, seeds and key/value (experiments.h).
#include <cstdio>
#include <iostream>

#include "break_run.h"
#include "cli.h"
#include "report.h"
#include "runtime.h"
#include "experiments.h"
#include "tokenizer.h"

namespace {

// Genesis 1:1-3 as the corpus writes it: 229 bytes, so the cache holds well over 100 positions when the
// corruption happens after the prefill.
constexpr const char* kDefaultPrompt =
    "Genesis 1\n\n1 In the beginning God created the heaven and the earth.\n2 And the earth was without form, and "
    "void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.\n"
    "3 And God said, ";

}  // namespace

int main(int argc, char** argv) {
  kvs::CommonOptions options;
  options.max_new_tokens = 200;
  std::string experiment = "run", kind_name = "normal", contamination_csv, kl_csv;
  // The defaults make the lesson visible on the shipped model: a random key ~9x the norm of the one it
  // replaces, in layer 3, 28 positions back (default_position); the text changes 26 steps later (the sweep
  // shows the spread).
  kvs::ch05::Corruption corruption{.layer = 3, .kv_head = 0, .at_step = 0, .amount = 16};
  bool value = false;
  int restore_after = 20, prompts = 4, seeds = 3, every = 10, prompt_bytes = 229;
  float amount = 0;  // --amount; the default depends on --kind
  kvs::ArgParser parser(
      "05_break_corrupt_key",
      "Chapter 05: overwrite one cached key vector - one layer, one KV head, one position - and keep decoding.\n"
      "Greedy decoding. A clean run, then with the corruption free-running (the broken run picks its own tokens)\n"
      "and teacher-forced (fed the clean run's tokens: the damaged cache alone), and teacher-forced with the\n"
      "vector restored --restore-after steps later (and, as a control, every cache row restored).\n"
      "--experiment run (default): both texts side by side (stdout), per-step KL, max |dlogit| and the\n"
      "    attention on the corrupted position, and where the damage spread in the cache (stderr);\n"
      "--experiment sweep: every layer x a spread of positions x --seeds x key and value, over --prompts\n"
      "    held-out passages: steps until the first token mismatch, and KL over the steps.\n"
      "CSV columns:\n"
      "  run (--csv): step, position, clean_token, corrupted_token, tokens_match (of the free-running texts), kl,\n"
      "      max_abs_logit (the largest |difference| of a logit; kl and it teacher-forced),\n"
      "      kl_vector_restored, kl_all_restored, head, attention_clean, attention_corrupted (one row per query\n"
      "      head of the corrupted KV head)\n"
      "  run (--contamination-csv): layer, position, max_abs_dkey, max_abs_dvalue (teacher-forced vs clean)\n"
      "  sweep (--csv): prompt, layer, position, part, seed, steps_to_mismatch (-1: none within the run),\n"
      "      kl_mean, attention_mean\n"
      "  sweep (--kl-csv): layer, part, steps_after, kl_median, kl_p90, configs");
  kvs::add_common_flags(parser, options, "Genesis 1:1-3 (229 bytes)", kvs::CommonFlags::kGreedy);
  parser.add_string("--experiment", "NAME", "run or sweep (default run)", &experiment);
  parser.add_int("--layer", "layer of the corrupted vector (default 3)", &corruption.layer, -1000000, 1000000);
  parser.add_int("--kv-head", "KV head of the corrupted vector (default 0)", &corruption.kv_head, -1000000, 1000000);
  parser.add_int("--position",
                 "cached position to corrupt (default: the 28th before the newest cached one at the corruption, 200 with "
                 "the default prompt; needs 100 positions cached)",
                 &corruption.position, -1000000, 1000000);
  parser.add_int("--at-step", "corrupt right after generated token N (default 0: after the prefill)", &corruption.at_step,
                 -1000000, 1000000);
  parser.add_string("--kind", "KIND", "normal (random, seeded), zeros, or scale (default normal)", &kind_name);
  parser.add_float("--amount", "normal: the standard deviation (default 16); scale: the factor (default 10)", &amount,
                   -1e6f, 1e6f);
  parser.add_u64("--corruption-seed", "seed of the random normal vector (default 1)", &corruption.seed);
  parser.add_switch("--value", "corrupt the value vector instead of the key", &value);
  parser.add_int("--restore-after", "restore the vector this many steps after corrupting it (default 20)", &restore_after,
                 1, 1000000);
  parser.add_int("--every", "run: print every Nth step of the table (default 10)", &every, 1, 1000000);
  parser.add_string("--contamination-csv", "PATH", "run: the cache difference per layer and position", &contamination_csv);
  parser.add_int("--prompts", "sweep: held-out passages (default 4)", &prompts, 1, 64);
  parser.add_int("--seeds", "sweep: random vectors per configuration (default 3)", &seeds, 1, 64);
  parser.add_int("--prompt-bytes", "sweep: bytes of each held-out prompt (default 229, as the run's)", &prompt_bytes, 2,
                 1 << 20);
  parser.add_string("--kl-csv", "PATH", "sweep: KL over the steps after the corruption", &kl_csv);
  parser.add_check([&] {
    if (experiment != "run" && experiment != "sweep") return "--experiment '" + experiment + "': use run or sweep";
    if (kind_name != "normal" && kind_name != "zeros" && kind_name != "scale")
      return "--kind '" + kind_name + "': use normal, zeros or scale";
    if (parser.given("--amount") && kind_name == "zeros") return std::string("--amount means nothing with --kind zeros");
    if (parser.given("--corruption-seed") && kind_name != "normal")
      return "--corruption-seed means nothing with --kind " + kind_name + " (only normal draws a random vector)";
    if (kind_name == "normal" && parser.given("--amount") && amount < 0) return std::string("--amount: a standard deviation is >= 0");
    if (options.max_new_tokens < 2) return std::string("--max-new-tokens: at least 2 (one step before the corruption, one after)");
    return std::string();
  });
  // The run corrupts the one vector its flags name; the sweep chooses its own layers, positions, parts and seeds
  // (--kind, --amount and --kv-head are both's).
  kvs::ArgParser::FlagReaders readers;
  for (const char* flag : {"--layer", "--position", "--at-step", "--corruption-seed", "--value",
                           "--restore-after", "--every", "--contamination-csv", "--prompt", "--prompt-file"})
    readers.push_back({flag, {"run"}});
  for (const char* flag : {"--prompts", "--seeds", "--prompt-bytes", "--kl-csv"}) readers.push_back({flag, {"sweep"}});
  parser.add_read_only_by("--experiment", &experiment, std::move(readers));
  parser.parse(argc, argv);

  return kvs::run_main(parser, [&] {
    corruption.part = value ? kvs::ch05::Part::kValue : kvs::ch05::Part::kKey;
    corruption.kind = kind_name == "normal" ? kvs::ch05::Kind::kNormal
                      : kind_name == "zeros" ? kvs::ch05::Kind::kZeros
                                             : kvs::ch05::Kind::kScale;
    corruption.amount = parser.given("--amount") ? amount : kind_name == "scale" ? 10.0f : 16.0f;
    // The sweep cuts its prompts from the held-out text; the run's prompt must fit with its new tokens.
    kvs::Runtime rt(options, kDefaultPrompt, experiment == "run" ? kvs::PromptFit::kMustFit : kvs::PromptFit::kCutByCaller,
                    experiment == "run" ? 0 : prompt_bytes + options.max_new_tokens);
    const kvs::ModelConfig& c = rt.model.config();
    if (experiment == "sweep" && prompt_bytes + options.max_new_tokens > c.seq_len)
      throw kvs::UsageError("--prompt-bytes " + std::to_string(prompt_bytes) + " plus --max-new-tokens " +
                            std::to_string(options.max_new_tokens) + " exceed the model's context of " +
                            std::to_string(c.seq_len));
    const int prompt_len = experiment == "run" ? static_cast<int>(rt.prompt.size()) : prompt_bytes;
    // Caches alive at once, each of prompt + new tokens positions: the run keeps its six runs' caches (clean,
    // free, forced, and three restored), the sweep three (clean, free, forced).
    rt.plan_kv_cache((experiment == "run" ? 6 : 3) * kvs::kv_cache_bytes(c, prompt_len + options.max_new_tokens));
    if (experiment == "run") {  // checked before anything is printed: a refusal is one line
      // (A negative --at-step is check_corruption's to refuse by name, not the default position's to explain.)
      if (!parser.given("--position") && corruption.at_step >= 0)
        corruption.position = kvs::ch05::default_position(prompt_len, corruption.at_step);
      kvs::ch05::check_corruption(corruption, c, prompt_len, options.max_new_tokens);
    } else {
      kvs::ch05::check_kv_head(corruption, c);
    }
    // Both outputs checked before anything is printed (a refusal is one line): the run's steps and contamination,
    // or the sweep's runs and KL curves. Neither may be an input, nor the other.
    const bool run = experiment == "run";
    kvs::CsvWriter csv({"--csv", options.csv},
                       run ? "step,position,clean_token,corrupted_token,tokens_match,kl,max_abs_logit,kl_vector_restored,"
                             "kl_all_restored,head,attention_clean,attention_corrupted"
                           : "prompt,layer,position,part,seed,steps_to_mismatch,kl_mean,attention_mean",
                       rt.inputs());
    kvs::CsvWriter second(run ? kvs::NamedPath{"--contamination-csv", contamination_csv} : kvs::NamedPath{"--kl-csv", kl_csv},
                          run ? "layer,position,max_abs_dkey,max_abs_dvalue" : "layer,part,steps_after,kl_median,kl_p90,configs",
                          csv.taken());
    std::cerr << rt.describe() << "\n";
    if (run) {
      if (!parser.given("--position"))
        std::cerr << "--position not given: " << corruption.position << ", " << kvs::ch05::kDefaultDistance
                  << " positions before the newest one cached at the corruption\n";
      kvs::ch05::report_run(rt.model, rt.prompt, options.max_new_tokens, corruption, restore_after, every, csv, second);
    } else {
      const std::string held_out =
          kvs::read_input_file("the held-out text", kvs::find_data_file("kjv/valid.txt"), 1u << 30);
      kvs::ch05::sweep(rt.model, held_out, prompts, seeds, options.max_new_tokens, prompt_len, corruption, csv, second);
    }
    for (const kvs::CsvWriter* written : {&csv, &second})
      if (written->enabled()) std::cerr << "wrote " << written->path() << "\n";
    return 0;
  });
}
