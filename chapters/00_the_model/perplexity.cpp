// Chapter 00 — the model we use: teacher-forced bits per byte and perplexity of a text (by default the
// held-out validation text), computed by common/perplexity.cpp.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <stdexcept>
#include <string>

#include "backends.h"
#include "cli.h"
#include "perplexity.h"
#include "progress.h"
#include "runtime.h"
#include "timing.h"
#include "tokenizer.h"

int main(int argc, char** argv) {
  kvs::CommonOptions options;
  std::string text_path;
  int context = 512, max_bytes = 0;
  kvs::ArgParser parser("00_perplexity",
                        "Chapter 00: how well the model predicts a text. The text is cut into chunks of --context\n"
                        "bytes; each chunk is one forward pass from position 0 that scores every next byte. Prints\n"
                        "bits per byte and perplexity (per byte) to stdout - its one line of results, as a\n"
                        "chapter's text is - and progress to stderr.\n"
                        "CSV columns (--csv): text, bytes, context, chunks, bits_per_byte, perplexity, seconds.");
  kvs::add_common_flags(parser, options, "", kvs::CommonFlags::kModelOnly);
  parser.add_string("--text", "PATH", "text to evaluate (default: data/kjv/valid.txt, the held-out part)", &text_path);
  parser.add_int("--context", "bytes per chunk (default 512; at most the model's context)", &context, 1, 1 << 21);
  parser.add_int("--max-bytes", "evaluate only the first N bytes of the text (default 0 = all)", &max_bytes, 0,
                 1 << 30);
  parser.add_check([&] {  // one byte predicts nothing: the run would fail after loading, as if the text were at fault
    if (max_bytes != 1) return std::string();
    return std::string("--max-bytes 1 leaves nothing to predict; give at least 2 (or 0 for the whole text)");
  });
  parser.parse(argc, argv);

  return kvs::run_main(parser, [&] {
    // No prompt, no sampler, no cache: just the model, reading the text below.
    const kvs::Checkpoint checkpoint = kvs::load_byte_level_checkpoint(options);
    if (context > checkpoint.config().seq_len)
      throw kvs::UsageError("--context " + std::to_string(context) + " exceeds the model's context of " +
                            std::to_string(checkpoint.config().seq_len));
    const std::unique_ptr<kvs::Backend> backend_owner = kvs::make_backend(options.backend, options.threads);
    kvs::Backend& backend = *backend_owner;
    const kvs::MemoryPlan memory = kvs::plan_memory(checkpoint, backend, context, 0);
    kvs::check_memory(memory, options.memory_limit);
    // Printed and written as the user gave it, or as the repository names the default: the same on every machine.
    const std::string text_name = text_path.empty() ? "data/kjv/valid.txt" : text_path;
    if (text_path.empty()) text_path = kvs::find_data_file("kjv/valid.txt");
    kvs::CsvWriter csv({"--csv", options.csv}, "text,bytes,context,chunks,bits_per_byte,perplexity,seconds",
                       {{"--model", checkpoint.path()}, {"--text", text_path}});
    // Up to 1 GiB, or only the first --max-bytes of a larger file.
    const std::string text = kvs::read_input_file("--text", text_path, max_bytes > 0 ? std::size_t(max_bytes) : 1u << 30,
                                                  max_bytes > 0);
    if (text.size() < 2)  // said before the setup lines: nothing has run
      throw std::runtime_error("--text " + text_name + " holds " + std::to_string(text.size()) +
                               " byte(s); one byte predicts nothing: give a text of at least 2");
    kvs::Model model(checkpoint, backend, context, context);  // one chunk of `context` positions per call
    std::cerr << kvs::describe_setup(checkpoint, backend) << "\n" << memory.describe() << "\nevaluating "
              << text.size() << " bytes of " << text_name << " in chunks of " << context << "\n";

    const kvs::Stopwatch timer;
    const std::vector<int> tokens = kvs::encode_bytes(text);
    kvs::Progress progress("evaluated", "chunks");  // once a second at most (--context 3 makes 70,000 chunks)
    const kvs::Perplexity p = kvs::evaluate_perplexity(model, tokens, context,
                                                       [&](int done, int total) { progress.update(done, total); });
    const double seconds = timer.milliseconds() / 1000;
    std::printf("%.6f bits/byte, perplexity %.4f per byte (%lld bytes predicted, context %d, %d chunks, %.1f s)\n",
                p.bits_per_byte, p.perplexity, static_cast<long long>(p.predicted), context, p.chunks, seconds);
    csv.row(text_name, text.size(), context, p.chunks, p.bits_per_byte, p.perplexity, seconds);
    csv.commit();
    return 0;
  });
}
