#include "experiments.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>

#include "break_run.h"
#include "progress.h"
#include "report.h"
#include "tokenizer.h"

namespace kvs::ch05 {
namespace {

std::string describe(const Corruption& c) {
  char amount[64];
  if (c.kind == Kind::kNormal)
    std::snprintf(amount, sizeof amount, "a random normal vector (sigma %g, seed %llu)", c.amount,
                  static_cast<unsigned long long>(c.seed));
  else if (c.kind == Kind::kScale)
    std::snprintf(amount, sizeof amount, "the original times %g", c.amount);
  else
    std::snprintf(amount, sizeof amount, "zeros");
  return std::string("the ") + to_string(c.part) + " of position " + std::to_string(c.position) + " (layer " +
         std::to_string(c.layer) + ", KV head " + std::to_string(c.kv_head) + ") replaced by " + amount;
}

double norm(std::span<const float> v) {
  double s = 0;
  for (float x : v) s += double(x) * x;
  return std::sqrt(s);
}

double mean_kl(const std::vector<StepDivergence>& steps, int from) {
  double sum = 0;
  int n = 0;
  for (int s = from; s < static_cast<int>(steps.size()); ++s) sum += steps[s].kl, ++n;
  return n ? sum / n : 0.0;
}

std::string heads_text(const std::vector<float>& weights) {
  std::string s;
  char cell[16];
  for (float w : weights) std::snprintf(cell, sizeof cell, " %5.3f", w), s += cell;
  return s;
}

}  // namespace

void report_run(Model& model, std::span<const int> prompt, int new_tokens, const Corruption& c, int restore_after,
                int every, CsvWriter& steps_csv, CsvWriter& contamination_csv) {
  const ModelConfig& config = model.config();
  Backend& backend = model.backend();
  const int prompt_len = static_cast<int>(prompt.size());
  const int restore_step = c.at_step + restore_after;
  AttentionOnPosition attention(config, c.layer, c.kv_head, c.position);

  std::fprintf(stderr, "%d new tokens, greedy; right after step %d (the cache holds %d positions): %s\n", new_tokens,
               c.at_step, prompt_len + c.at_step, describe(c).c_str());
  std::fprintf(stderr, "runs: clean, corrupted free-running, corrupted teacher-forced, and teacher-forced with the vector "
                       "(or every row) restored after step %d\n", restore_step);
  BreakRun clean = run_greedy(model, prompt, new_tokens, {.attention = &attention});
  const std::span<const int> clean_tokens(clean.recorded.tokens.begin() + prompt_len, clean.recorded.tokens.end());
  const BreakRun free = run_greedy(model, prompt, new_tokens, {.corruption = &c});
  const BreakRun forced = run_greedy(model, prompt, new_tokens, {.corruption = &c, .forced = clean_tokens, .attention = &attention});
  const BreakRun vector_restored = run_greedy(
      model, prompt, new_tokens,
      {.corruption = &c, .forced = clean_tokens, .restore = Restore::kVector, .restore_at_step = restore_step});
  const BreakRun all_restored =
      run_greedy(model, prompt, new_tokens,
                 {.corruption = &c, .forced = clean_tokens, .restore = Restore::kAllRows, .restore_at_step = restore_step,
                  .clean_cache = clean.cache.get()});
  const BreakRun free_restored =
      run_greedy(model, prompt, new_tokens, {.corruption = &c, .restore = Restore::kVector, .restore_at_step = restore_step});

  const auto free_steps = step_divergence(clean.recorded, free.recorded, prompt_len);
  const auto forced_steps = step_divergence(clean.recorded, forced.recorded, prompt_len);
  const auto vector_steps = step_divergence(clean.recorded, vector_restored.recorded, prompt_len);
  const auto all_steps = step_divergence(clean.recorded, all_restored.recorded, prompt_len);
  const auto free_restored_steps = step_divergence(clean.recorded, free_restored.recorded, prompt_len);
  const int first = first_mismatch(free_steps);

  // The vector before and after (the clean cache still holds the original: rows are never rewritten).
  {
    std::vector<float> original(config.head_dim());
    backend.to_host(original.data(), head_of(clean.cache->row(c.layer, c.position), c.part, c.kv_head, config.head_dim()),
                    original.size());
    std::fprintf(stderr, "the %s's norm: %.3f before, %.3f after\n\n", to_string(c.part), norm(original),
                 norm(corrupted_vector(c, original)));
  }

  // The texts.
  std::cout << "the generated text, clean and corrupted (free-running), ";
  if (first < 0)
    std::cout << "identical: the corruption changed no token in " << new_tokens << " steps\n";
  else
    std::cout << "first different at step " << first << (colour_output() ? " (in red)" : " (after '[')") << "\n";
  print_side_by_side(std::cout, "clean", clean_tokens, "corrupted",
                     std::span<const int>(free.recorded.tokens).subspan(prompt_len), first, colour_output());
  std::cout.flush();

  // Per step.
  const int group = config.group();
  std::fprintf(stderr, "\nper step (same: the two free-running texts' tokens at this step; KL and |dlogit| teacher-forced: "
                       "the clean tokens fed to the corrupted cache; attention: "
                       "each query head of KV head %d on position %d, layer %d)\n", c.kv_head, c.position, c.layer);
  std::fprintf(stderr, "  %5s %5s %5s %10s %10s %*s %*s %12s %12s\n", "step", "pos", "same", "KL", "max|dlogit|", 6 * group,
               "attn clean", 6 * group, "attn broken", "KL restored", "KL all rest.");
  for (int s = 0; s < new_tokens; ++s) {
    const bool shown = (s > c.at_step && s <= c.at_step + 3) || s % every == 0 || s == first || s == restore_step + 1 ||
                       s == new_tokens - 1;
    if (shown)
      std::fprintf(stderr, "  %5d %5d %5s %10.2e %10.3f %s %s %12.2e %12.2e%s\n", s, prompt_len + s - 1,
                   free_steps[s].tokens_match ? "yes" : "NO", forced_steps[s].kl, forced_steps[s].max_abs_logit,
                   heads_text(clean.attention[s]).c_str(), heads_text(forced.attention[s]).c_str(), vector_steps[s].kl,
                   all_steps[s].kl,
                   s == c.at_step + 1 ? "  <- first step that reads the corrupted cache"
                   : s == first       ? "  <- first different token"
                   : s == restore_step + 1 ? "  <- first step after the restore"
                                           : "");
    for (int g = 0; g < group; ++g)
      steps_csv.row(s, prompt_len + s - 1, clean_tokens[s], free.recorded.tokens[prompt_len + s],
                    free_steps[s].tokens_match ? 1 : 0, forced_steps[s].kl, forced_steps[s].max_abs_logit,
                    vector_steps[s].kl, all_steps[s].kl, c.kv_head * group + g, clean.attention[s][g],
                    forced.attention[s][g]);
  }
  steps_csv.commit();

  // Summary: how long until it showed, and whether it recovered.
  std::fprintf(stderr, "\nfree-running: ");
  if (first < 0)
    std::fprintf(stderr, "no token differs in the %d steps after the corruption\n", new_tokens - 1 - c.at_step);
  else
    std::fprintf(stderr, "the first different token is step %d, %d steps after the corruption\n", first, first - c.at_step);
  const int after = restore_step + 1;
  if (after >= new_tokens) {
    std::fprintf(stderr, "the run ends before the restore after step %d: give more --max-new-tokens or a smaller "
                         "--restore-after to see whether restoring helps\n", restore_step);
  } else {
    std::fprintf(stderr, "teacher-forced, mean KL over the steps after step %d: %.3e corrupted, %.3e with the vector "
                         "restored, %.3e with every row restored\n", restore_step, mean_kl(forced_steps, after),
                 mean_kl(vector_steps, after), mean_kl(all_steps, after));
    int matching = 0;
    for (int s = after; s < new_tokens; ++s) matching += free_restored_steps[s].tokens_match;
    const int first_restored = first_mismatch(free_restored_steps);
    std::fprintf(stderr, "free-running with the vector restored after step %d: %s; %d of the %d later tokens equal the "
                         "clean run's\n", restore_step,
                 first_restored < 0 ? "no token differs"
                                    : ("the first different token is step " + std::to_string(first_restored)).c_str(),
                 matching, new_tokens - after);
  }

  // Contamination: the teacher-forced run's cache against the clean one, same tokens, same positions.
  const CacheDifference diff = compare_caches(backend, config, *clean.cache, *forced.cache);
  const int written_after = prompt_len + c.at_step;  // the first position cached after the corruption
  std::fprintf(stderr, "\nthe cache after the teacher-forced run vs the clean run's, positions %d.. (max |difference| per row)\n",
               c.position);
  auto from_position = [&](const std::vector<std::vector<float>>& m) {
    std::vector<std::vector<float>> out;
    for (const auto& row : m) out.emplace_back(row.begin() + c.position, row.end());
    return out;
  };
  print_heatmap(std::cerr, "keys", from_position(diff.keys), c.position);
  print_heatmap(std::cerr, "values", from_position(diff.values), c.position);
  std::fprintf(stderr, "  %5s %28s %14s %14s\n", "layer", "rows written after, changed", "max |dK|", "max |dV|");
  for (int layer = 0; layer < config.n_layers; ++layer) {
    int changed = 0, rows = 0;
    float dk = 0, dv = 0;
    for (int p = written_after; p < static_cast<int>(diff.keys[layer].size()); ++p, ++rows) {
      changed += !(diff.keys[layer][p] == 0 && diff.values[layer][p] == 0);  // NaN too
      dk = worst_difference(dk, diff.keys[layer][p]), dv = worst_difference(dv, diff.values[layer][p]);
    }
    std::fprintf(stderr, "  %5d %18d of %6d %14.3e %14.3e\n", layer, changed, rows, dk, dv);
    for (int p = 0; p < static_cast<int>(diff.keys[layer].size()); ++p)
      contamination_csv.row(layer, p, diff.keys[layer][p], diff.values[layer][p]);
  }
  contamination_csv.commit();
}

void sweep(Model& model, const std::string& held_out, int prompts, int seeds, int new_tokens, int prompt_len,
           const Corruption& base, CsvWriter& csv, CsvWriter& kl_csv) {
  const ModelConfig& config = model.config();
  if (base.kind != Kind::kNormal) seeds = 1;  // zeros and scaling are not random
  // Passages of the held-out text starting at line starts, spread over it.
  std::vector<std::vector<int>> texts;
  for (int k = 0; k < prompts; ++k) {
    std::size_t at = held_out.size() * k / prompts;
    if (at > 0) at = held_out.find('\n', at);  // the next line start
    if (at != 0 && at != std::string::npos) ++at;
    if (at == std::string::npos || at + prompt_len > held_out.size())
      throw std::runtime_error("the held-out text is too short for " + std::to_string(prompts) + " prompts");
    texts.push_back(encode_bytes(held_out.substr(at, prompt_len)));
  }
  std::vector<int> positions;
  for (int p : {0, 1, 4, 16, 48, 96, 144, prompt_len - 16, prompt_len - 4, prompt_len - 1})
    if (p >= 0 && p < prompt_len && (positions.empty() || p > positions.back())) positions.push_back(p);
  const int configs = prompts * config.n_layers * static_cast<int>(positions.size()) * 2 * seeds;
  std::fprintf(stderr, "sweep: %d held-out prompts of %d bytes x %d layers x %zu positions x key and value x %d seed%s = %d "
                       "corruptions (%s, amount %g) right after the prefill, KV head %d, %d new tokens each\n",
               prompts, prompt_len, config.n_layers, positions.size(), seeds, seeds > 1 ? "s" : "", configs,
               to_string(base.kind), base.amount, base.kv_head, new_tokens);

  constexpr double kNever = std::numeric_limits<double>::infinity();
  // [part][layer][position index]: steps to the first mismatch of every prompt and seed (kNever: none).
  std::vector<std::vector<std::vector<std::vector<double>>>> steps(
      2, std::vector<std::vector<std::vector<double>>>(config.n_layers, std::vector<std::vector<double>>(positions.size())));
  // [part][layer][step after]: KL of every configuration.
  std::vector<std::vector<std::vector<std::vector<double>>>> kl(
      2, std::vector<std::vector<std::vector<double>>>(config.n_layers, std::vector<std::vector<double>>(new_tokens)));
  int done = 0;
  Progress progress("sweep", "corruptions");
  for (int t = 0; t < prompts; ++t) {
    const std::span<const int> prompt = texts[t];
    const BreakRun clean = run_greedy(model, prompt, new_tokens, {});
    const std::span<const int> clean_tokens(clean.recorded.tokens.begin() + prompt_len, clean.recorded.tokens.end());
    for (int layer = 0; layer < config.n_layers; ++layer)
      for (std::size_t i = 0; i < positions.size(); ++i)
        for (int part = 0; part < 2; ++part)
          for (int seed = 1; seed <= seeds; ++seed) {
            Corruption c = base;
            c.layer = layer, c.position = positions[i], c.at_step = 0, c.part = part ? Part::kValue : Part::kKey;
            c.seed = static_cast<std::uint64_t>(seed);
            AttentionOnPosition attention(config, c.layer, c.kv_head, c.position);
            const BreakRun free = run_greedy(model, prompt, new_tokens, {.corruption = &c});
            const BreakRun forced =
                run_greedy(model, prompt, new_tokens, {.corruption = &c, .forced = clean_tokens, .attention = &attention});
            const int first = first_mismatch(step_divergence(clean.recorded, free.recorded, prompt_len));
            const auto forced_steps = step_divergence(clean.recorded, forced.recorded, prompt_len);
            double kl_sum = 0, attention_sum = 0;
            for (int s = 1; s < new_tokens; ++s) {
              kl[part][layer][s].push_back(forced_steps[s].kl);
              kl_sum += forced_steps[s].kl;
              for (float w : forced.attention[s]) attention_sum += w / config.group();
            }
            steps[part][layer][i].push_back(first < 0 ? kNever : first);
            csv.row(t, layer, c.position, to_string(c.part), seed, first, kl_sum / (new_tokens - 1),
                    attention_sum / (new_tokens - 1));
            progress.update(++done, configs);
          }
    csv.commit();  // a long run keeps what it finished
  }

  // Steps until the first different token: median per layer and position, and overall.
  auto cell = [](double v) { return std::isinf(v) ? std::string("never") : std::to_string(static_cast<int>(v)); };
  for (int part = 0; part < 2; ++part) {
    std::fprintf(stderr, "\n%s corrupted: median steps until the first different token (of %d prompts x %d seeds; never: "
                         "not within %d steps)\n  %8s", part ? "value" : "key", prompts, seeds, new_tokens - 1, "position");
    for (int p : positions) std::fprintf(stderr, " %6d", p);
    std::fprintf(stderr, "\n");
    std::vector<double> all;
    for (int layer = config.n_layers - 1; layer >= 0; --layer) {
      std::fprintf(stderr, "  layer %2d", layer);
      for (std::size_t i = 0; i < positions.size(); ++i) {
        std::fprintf(stderr, " %6s", cell(percentile(steps[part][layer][i], 50)).c_str());
        all.insert(all.end(), steps[part][layer][i].begin(), steps[part][layer][i].end());
      }
      std::fprintf(stderr, "\n");
    }
    const auto never = std::count_if(all.begin(), all.end(), [](double v) { return std::isinf(v); });
    std::fprintf(stderr, "  all %zu: p10 %s, median %s, p90 %s steps; never within %d steps: %ld (%.0f%%)\n", all.size(),
                 cell(percentile(all, 10)).c_str(), cell(percentile(all, 50)).c_str(), cell(percentile(all, 90)).c_str(),
                 new_tokens - 1, static_cast<long>(never), 100.0 * never / all.size());
    for (int layer = 0; layer < config.n_layers; ++layer)
      for (int s = 1; s < new_tokens; ++s)
        kl_csv.row(layer, part ? "value" : "key", s, percentile(kl[part][layer][s], 50), percentile(kl[part][layer][s], 90),
                   kl[part][layer][s].size());
  }
  kl_csv.commit();
}

}  // namespace kvs::ch05
