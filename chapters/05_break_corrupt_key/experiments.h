#pragma once
// Chapter 05's two experiments; main.cpp picks one with --experiment.
#include <span>
#include <string>

#include "corruption.h"
#include "csv.h"
#include "model.h"

namespace kvs::ch05 {

// One corruption, reported in full: the texts side by side (stdout), per-step KL, max |dlogit| and the
// attention on the corrupted position, the contamination of the cache and whether restoring helps (stderr).
void report_run(Model& model, std::span<const int> prompt, int new_tokens, const Corruption& corruption,
                int restore_after, int every, CsvWriter& steps_csv, CsvWriter& contamination_csv);

// The distribution: every layer x a spread of positions x `seeds` random vectors x key and value, on
// `prompts` held-out passages as long as the run's prompt, corrupted right after the prefill with `base`'s
// kind and amount. Progress and tables on stderr.
void sweep(Model& model, const std::string& held_out, int prompts, int seeds, int new_tokens, int prompt_len,
           const Corruption& base, CsvWriter& csv, CsvWriter& kl_csv);

}  // namespace kvs::ch05
