// What a hostile or careless user does to the binaries, and what must happen: one line saying what is
// wrong, a non-zero exit, no crash, no hang, no lost or destroyed file. Each case here failed before the
// fix it guards (issue #12).
#include <doctest/doctest.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint.h"
#include "cli.h"
#include "cpu_backend.h"
#include "csv.h"
#include "replacing_file.h"
#include "test_backends.h"
#include "test_util.h"

using kvs::test::golden_path;
using kvs::test::run_command;
using kvs::test::TempDir;

namespace {

std::string binary(const std::string& name) { return std::string(KVS_BIN_DIR) + "/" + name; }
std::string small_model() { return " --model " + golden_path("mha.bin") + " --threads 1"; }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

int cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
}

// One command line per binary that runs quickly on the small checkpoint.
struct Binary {
  std::string name, args;
};
const std::vector<Binary>& every_binary() {
  static const std::vector<Binary> all = {
      {"00_perplexity", " --max-bytes 200 --context 64"},
      {"01_naive_generation", " --max-new-tokens 3"},
      {"02_dynamic_cache", " --max-new-tokens 3"},
      {"03_preallocated_cache", " --max-new-tokens 3"},
      {"03_benchmark", " --lengths 8 --max-new-tokens 3 --naive-tokens 3 --repeats 1"},
      {"04_sliding_window", " --max-new-tokens 3 --window 8 --chunk 4"},
      {"05_break_corrupt_key", " --prompt 'In the beginning' --max-new-tokens 3 --layer 0 --position 2"},
      {"06_break_off_by_one", " --max-new-tokens 3"},
      {"08_paged_batching", " --requests 2 --token-budget 32 --max-batch 4 --prompt-lengths 4,8 --output-lengths 2,3"},
      {"09_prefix_sharing", " --samples 2 --max-new-tokens 3 --prompt 'In the beginning'"},
      {"10_quantized_cache", " --max-new-tokens 3 --group 16"},
  };
  return all;
}
const std::string& args_of(const std::string& name) {
  for (const Binary& b : every_binary())
    if (b.name == name) return b.args;
  throw std::logic_error("no binary " + name);
}

// A header-valid checkpoint with a huge trained context: seq_len 2^21 positions, 16 MiB on disk (the legacy
// RoPE tables), a model of a few hundred parameters.
std::string write_long_context_model(const TempDir& dir) {
  const kvs::ModelConfig c{.dim = 8, .hidden_dim = 8, .n_layers = 1, .n_heads = 4, .n_kv_heads = 4,
                           .vocab_size = 256, .seq_len = 1 << 21};
  const std::string path = dir.file("long-context.bin");
  kvs::write_checkpoint(path, c, kvs::test::random_weights(c, 7));
  return path;
}

}  // namespace

TEST_CASE("--help: every binary's fits 110 columns, exits 0 and writes nothing to stderr") {
  for (const Binary& b : every_binary()) {
    CAPTURE(b.name);
    const auto r = run_command(binary(b.name) + " --help");
    CHECK(r.exit_code == 0);
    CHECK(r.err.empty());
    CHECK(r.out.rfind("usage: " + b.name, 0) == 0);
    std::istringstream lines(r.out);
    for (std::string line; std::getline(lines, line);) {
      CAPTURE(line);
      CHECK(line.size() <= 110);
    }
  }
}

TEST_CASE("results: a CSV that cannot be written is an error, not 'wrote'") {
  for (const Binary& b : every_binary()) {
    CAPTURE(b.name);
    const auto r = run_command(binary(b.name) + small_model() + b.args + " --csv /dev/full");
    CHECK(r.exit_code != 0);
    CHECK(r.err.find("--csv /dev/full") != std::string::npos);
    CHECK(r.err.find("wrote") == std::string::npos);
  }
}

// Checked when the run starts (Runtime), not when its results are written: a chapter that printed its setup or
// ran an experiment first (04, 05, 06, 08, 09 and 10 did) would say more than the one line, or waste the run.
TEST_CASE("results: --csv into a folder that does not exist is refused before anything runs, in one line") {
  for (const Binary& b : every_binary()) {
    CAPTURE(b.name);
    const auto r = run_command(binary(b.name) + small_model() + b.args + " --csv /nonexistent/folder/out.csv");
    CHECK(r.exit_code == 2);
    CHECK(r.out.empty());
    CHECK(r.err == b.name + ": error: --csv /nonexistent/folder/out.csv: the folder /nonexistent/folder does not exist (run " +
                       b.name + " --help for usage)\n");
  }
  // The chapters' second outputs too.
  for (const auto& [command, flag] : {std::pair{"05_break_corrupt_key" + small_model() + args_of("05_break_corrupt_key"), "--contamination-csv"},
                                      std::pair{"10_quantized_cache" + small_model() + " --experiment channels --text-bytes 64 --group 16",
                                                "--errors-csv"},
                                      std::pair{"03_benchmark" + small_model() + args_of("03_benchmark"), "--memory-csv"}}) {
    CAPTURE_BINDING(command);
    const auto r = run_command(binary(command) + " " + flag + " /nonexistent/folder/out.csv");
    CHECK(r.exit_code == 2);
    CHECK(r.out.empty());
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.err.find(std::string(flag) + " /nonexistent/folder/out.csv: the folder") != std::string::npos);
  }
}

TEST_CASE("results: a CSV write that fails midway is an error, and the earlier file survives whole") {
  // RLIMIT_FSIZE 0 makes every write to a regular file fail (EFBIG) - the CSV's temporary file included -
  // while stdout and stderr go to a pipe, which the limit does not touch.
  TempDir dir;
  const std::string csv = dir.file("out.csv"), script = dir.file("run.sh");
  std::ofstream(csv) << "earlier results\n";
  std::ofstream(script) << "set -o pipefail\n( ulimit -f 0; trap '' XFSZ; exec " << binary("01_naive_generation")
                        << small_model() << " --max-new-tokens 3 --csv " << csv << " ) 2>&1 | cat\n";
  const auto r = run_command("bash " + script);
  CHECK(r.exit_code == 1);
  CHECK(r.out.find("cannot write --csv " + csv + " (write): File too large") != std::string::npos);
  CHECK(r.out.find("wrote") == std::string::npos);
  CHECK(slurp(csv) == "earlier results\n");
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.file(""))) files += entry.is_regular_file();
  CHECK(files == 2);  // out.csv and run.sh: no temporary left behind
}

TEST_CASE("results: text that cannot be written to stdout is an error") {
  for (const std::string name : {"00_perplexity", "01_naive_generation"}) {
    CAPTURE(name);
    const std::string args = name == std::string("00_perplexity") ? " --max-bytes 200 --context 64" : " --max-new-tokens 3";
    const std::string command = binary(name) + small_model() + args;
    const auto r = run_command("(" + command + " > /dev/full)");
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("standard output") != std::string::npos);
  }
}

TEST_CASE("results: --help that cannot be written is an error, and written it exits 0") {
  for (const std::string name : {"00_perplexity", "01_naive_generation", "02_dynamic_cache", "03_preallocated_cache",
                                 "03_benchmark", "04_sliding_window", "05_break_corrupt_key", "06_break_off_by_one",
                                 "08_paged_batching", "09_prefix_sharing",
                                 "10_quantized_cache"}) {
    CAPTURE(name);
    const std::string help = binary(name) + " --help";
    const auto full = run_command("(" + help + " > /dev/full)");
    CHECK(full.exit_code == 1);
    CHECK(full.err.find(name + ": error: cannot write the help to standard output") != std::string::npos);
    const auto ok = run_command(help);
    CHECK(ok.exit_code == 0);
    CHECK(ok.out.rfind("usage: " + name, 0) == 0);
  }
}

TEST_CASE("results: an output path that is an input is refused and the input survives") {
  TempDir dir;
  const std::string model = dir.file("m.bin"), prompt = dir.file("prompt.txt");
  std::filesystem::copy_file(golden_path("mha.bin"), model);
  std::ofstream(prompt) << "In the beginning";
  const std::string model_before = slurp(model);
  const auto r = run_command(binary("01_naive_generation") + " --model " + model + " --max-new-tokens 3 --csv " + model);
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--csv " + model + " is the same file as --model") != std::string::npos);
  CHECK(slurp(model) == model_before);
  const auto p = run_command(binary("03_preallocated_cache") + small_model() + " --prompt-file " + prompt +
                             " --max-new-tokens 3 --csv " + prompt);
  CHECK(p.exit_code == 2);
  CHECK(p.err.find("is the same file as --prompt-file") != std::string::npos);
  CHECK(slurp(prompt) == "In the beginning");
  const auto t = run_command(binary("00_perplexity") + small_model() + " --text " + prompt + " --csv " + prompt);
  CHECK(t.exit_code == 2);
  CHECK(slurp(prompt) == "In the beginning");
  const auto valid = run_command(binary("03_benchmark") + " --threads 1 --lengths 8 --max-new-tokens 3 --csv " +
                                 kvs::find_data_file("kjv/valid.txt"));
  CHECK(valid.exit_code == 2);
  CHECK(valid.err.find("is the same file as the validation text") != std::string::npos);
  // Any file a chapter reads, wherever it reads it (common/cli.h's files_read): the held-out text, a trace. (With
  // the guard broken, this overwrites the repository's held-out text: `git checkout data/kjv/valid.txt` brings it back.)
  const std::string held_out_before = slurp(kvs::find_data_file("kjv/valid.txt"));
  const auto window = run_command(binary("04_sliding_window") + small_model() +
                                  " --experiment perplexity --windows 8 --max-bytes 40 --csv " +
                                  kvs::find_data_file("kjv/valid.txt"));
  CHECK(window.exit_code == 2);
  CHECK(window.err.find("is the same file as the held-out text; write the results somewhere else") != std::string::npos);
  REQUIRE(slurp(kvs::find_data_file("kjv/valid.txt")) == held_out_before);
  const std::string trace = dir.file("trace.txt");
  std::ofstream(trace) << "0 2 In the beginning\n";
  const auto served = run_command(binary("08_paged_batching") + small_model() + " --trace " + trace + " --csv " + trace);
  CHECK(served.exit_code == 2);
  CHECK(served.err.find("--csv " + trace + " is the same file as --trace") != std::string::npos);
  CHECK(slurp(trace) == "0 2 In the beginning\n");
  const auto both = run_command(binary("03_benchmark") + small_model() + " --lengths 8 --max-new-tokens 3 --csv " +
                                dir.file("x.csv") + " --memory-csv " + dir.file("x.csv"));
  CHECK(both.exit_code == 2);
  CHECK(both.err.find("--memory-csv " + dir.file("x.csv") + " is the same file as --csv") != std::string::npos);
  // Chapter 10's second output: refused before its channels are computed, with nothing printed before the line.
  const auto errors = run_command(binary("10_quantized_cache") + small_model() + " --experiment channels --text-bytes 64 --group 16 --csv " +
                                  dir.file("x.csv") + " --errors-csv " + dir.file("x.csv"));
  CHECK(errors.exit_code == 2);
  CHECK(errors.err.rfind("10_quantized_cache: error: --errors-csv " + dir.file("x.csv") + " is the same file as --csv", 0) == 0);
  CHECK(!std::filesystem::exists(dir.file("x.csv")));
}

TEST_CASE("results: a checkpoint rewritten while it is mapped stays readable (writers replace, never truncate)") {
  TempDir dir;
  const std::string path = dir.file("model.bin");
  const kvs::ModelConfig c{.dim = 16, .hidden_dim = 24, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1,
                           .vocab_size = 32, .seq_len = 8};
  kvs::write_checkpoint(path, c, kvs::test::random_weights(c, 1));
  const kvs::Checkpoint loaded(path);
  const float before = loaded.tensors().rms_final[c.dim - 1];
  kvs::write_checkpoint(path, c, kvs::test::random_weights(c, 2));  // truncating in place here gave SIGBUS below
  CHECK(loaded.tensors().rms_final[c.dim - 1] == before);
  CHECK(kvs::Checkpoint(path).tensors().rms_final[c.dim - 1] != before);
  for (const auto& entry : std::filesystem::directory_iterator(dir.file("")))
    CHECK(entry.path().filename() == "model.bin");  // no temporary left behind
}

TEST_CASE("results: an interrupted run keeps the earlier file (chapters) or the finished rows (benchmark)") {
  TempDir dir;
  const std::string csv = dir.file("out.csv");
  std::ofstream(csv) << "earlier results\n";
  // The shipped model, 1500 naive tokens: far longer than the 1 s before the signal arrives. SIGTERM, not
  // SIGINT: a test started in the background by a non-interactive shell inherits SIGINT ignored.
  const auto chapter = run_command("timeout -s TERM 1 " + binary("01_naive_generation") +
                                   " --threads 1 --max-new-tokens 1500 --csv " + csv);
  CHECK(chapter.exit_code == 124);
  CHECK(slurp(csv) == "earlier results\n");

  const auto bench = run_command("timeout -s TERM 4 " + binary("03_benchmark") +
                                 " --threads 1 --lengths 32,64,96,128,160,192,224,256,1024,2048,2048,2048 --repeats 2 "
                                 "--naive-tokens 8 --csv " + csv);
  CHECK(bench.exit_code == 124);
  const std::vector<std::string> rows = lines_of(csv);
  REQUIRE(rows.size() >= 2);  // the header and at least one finished row
  CHECK(rows[0].rfind("method,", 0) == 0);
  CHECK(rows.size() < 1 + 12 * 4);  // really interrupted
  for (const std::string& row : rows) CHECK(std::count(row.begin(), row.end(), ',') == 6);
}

TEST_CASE("results: Ctrl-C while a result file is replaced ends the run after it, leaving no temporary") {
  // In a child process: "new" written over "old" with an interrupt arriving mid-write - sent to the thread itself
  // (raise), and to the process while the CPU backend's worker thread runs (kill): the kernel hands a process's
  // signal to any thread that does not hold it back, so the workers must hold it too.
  for (const bool to_process : {false, true}) {
    CAPTURE(to_process);
    TempDir dir;
    const std::string target = dir.file("out.csv");
    std::ofstream(target) << "old";
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      std::signal(SIGINT, SIG_DFL);  // doctest's handler would report a crash
      kvs::CpuBackend backend(2);    // one worker thread
      {
        kvs::ReplacingFile file(target, "--csv out.csv");
        file.write("new", 3);
        if (to_process) kill(getpid(), SIGINT);
        else raise(SIGINT);
        usleep(50 * 1000);  // time for a worker to take it, were it not held back
        file.commit();
      }  // the interrupt acts here
      _exit(0);
    }
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    CHECK(WIFSIGNALED(status));  // not lost: the run still ends
    CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGINT));
    CHECK(lines_of(target) == std::vector<std::string>{"new"});  // replaced whole
    int others = 0;
    for (const auto& entry : std::filesystem::directory_iterator(dir.file(""))) others += entry.path() != target;
    CHECK(others == 0);  // no .out.csv.XXXXXX
  }
}

TEST_CASE("results: a CSV path that is a symbolic link writes the file it leads to, and the link stays") {
  TempDir dir;
  std::filesystem::create_directory(dir.file("real"));
  const std::string target = dir.file("real/steps.csv"), link = dir.file("steps.csv");
  std::ofstream(target) << "earlier results\n";
  std::filesystem::create_symlink(target, link);
  const auto r = run_command(binary("01_naive_generation") + small_model() + " --max-new-tokens 3 --csv " + link);
  CHECK(r.exit_code == 0);
  CHECK(std::filesystem::is_symlink(link));  // it was replaced by a regular file holding the results
  const std::vector<std::string> rows = lines_of(target);
  REQUIRE(!rows.empty());
  CHECK(rows[0] == "step,context_tokens,ms");
  for (const auto& entry : std::filesystem::directory_iterator(dir.file("real")))
    CHECK(entry.path().filename() == "steps.csv");  // no temporary left beside the target
}

TEST_CASE("results: two runs writing the same CSV leave one complete file") {
  TempDir dir;
  const std::string csv = dir.file("same.csv");
  const std::string run = binary("03_benchmark") + small_model() +
                          " --lengths 8,16,24,32,40,48 --max-new-tokens 4 --naive-tokens 4 --repeats 2 --csv " + csv;
  const auto r = run_command("(" + run + " & a=$!; " + run + " & b=$!; wait $a && wait $b)");
  CHECK(r.exit_code == 0);
  const std::vector<std::string> rows = lines_of(csv);
  CHECK(rows.size() == 1 + 6 * 4);
  for (const std::string& row : rows) CHECK(std::count(row.begin(), row.end(), ',') == 6);
}

TEST_CASE("inputs: devices, FIFOs and directories are refused before they are read") {
  TempDir dir;
  const std::string fifo = dir.file("fifo");
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  // `timeout` turns a hang into exit 124, which the checks below reject.
  const auto zero_prompt = run_command("timeout 20 " + binary("01_naive_generation") + small_model() +
                                       " --prompt-file /dev/zero");
  CHECK(zero_prompt.exit_code == 1);
  CHECK(zero_prompt.err.find("--prompt-file /dev/zero is not a regular file") != std::string::npos);
  const auto zero_text = run_command("timeout 20 " + binary("00_perplexity") + small_model() +
                                     " --context 64 --text /dev/zero");
  CHECK(zero_text.exit_code == 1);
  CHECK(zero_text.err.find("--text /dev/zero is not a regular file") != std::string::npos);
  const auto fifo_model = run_command("timeout 20 " + binary("01_naive_generation") + " --model " + fifo);
  CHECK(fifo_model.exit_code == 1);
  CHECK(fifo_model.err.find("not a regular file") != std::string::npos);
  const auto directory = run_command(binary("01_naive_generation") + small_model() + " --prompt-file " + dir.file(""));
  CHECK(directory.exit_code == 1);
  CHECK(directory.err.find("--prompt-file") != std::string::npos);
  CHECK(directory.err.find("not a regular file") != std::string::npos);
  const auto memory_csv = run_command(binary("03_benchmark") + small_model() +
                                      " --lengths 8 --max-new-tokens 3 --memory-csv /proc/x.csv");
  CHECK(memory_csv.exit_code != 0);
  CHECK(memory_csv.err.find("--memory-csv /proc/x.csv") != std::string::npos);
}

TEST_CASE("inputs: more threads than cores is refused with a one-line reason") {
  const int n = cores();
  const auto r = run_command(binary("01_naive_generation") + " --model " + golden_path("mha.bin") +
                             " --max-new-tokens 3 --threads " + std::to_string(n + 1));
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--threads " + std::to_string(n + 1)) != std::string::npos);
  CHECK(r.err.find(std::to_string(n) + " core") != std::string::npos);
  const auto ok = run_command(binary("01_naive_generation") + " --model " + golden_path("mha.bin") +
                              " --max-new-tokens 3 --threads " + std::to_string(n));
  CHECK(ok.exit_code == 0);
}

TEST_CASE("inputs: empty values, sub-byte sizes and sampling flags without sampling are refused") {
  const std::string ch01 = binary("01_naive_generation") + small_model();
  for (const std::string flag : {"--model", "--csv", "--prompt-file"}) {
    CAPTURE(flag);
    const auto r = run_command(binary("01_naive_generation") + " " + flag + " ''");
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(flag + " needs a non-empty value") != std::string::npos);
  }
  const auto text = run_command(binary("00_perplexity") + " --text ''");
  CHECK(text.exit_code == 2);
  for (const std::string size : {"0.5", "1e-9GiB", "0"}) {
    CAPTURE(size);
    const auto r = run_command(binary("03_preallocated_cache") + small_model() + " --memory-budget " + size);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("--memory-budget expects a size of at least 1 byte") != std::string::npos);
  }
  for (const std::string flags : {" --top-k 5", " --seed 3", " --temperature 0 --seed 3"}) {
    CAPTURE(flags);
    const auto r = run_command(ch01 + " --max-new-tokens 3" + flags);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("only apply when sampling") != std::string::npos);
  }
  CHECK(run_command(ch01 + " --max-new-tokens 3 --temperature 0.8 --top-k 5 --seed 3").exit_code == 0);
}

// A flag the chosen experiment never reads used to run it anyway, the flag silently dropped (09's prefix ran greedy
// under --temperature 0.5; 04 took --experiment sample for a part of "samples" and ran nothing, exit 0).
TEST_CASE("inputs: a flag the chosen experiment would ignore is refused, and so is a misspelled experiment") {
  for (const auto& [command, message] : std::vector<std::pair<std::string, std::string>>{
           {"04_sliding_window --experiment sample", "--experiment 'sample': use one of"},
           {"04_sliding_window --experiment memory --windows full,64",
            "--windows is for --experiment perplexity, recall, fluency or samples, not memory: drop it"},
           {"04_sliding_window --experiment samples --csv out.csv", "--csv is for --experiment generate,"},
           {"04_sliding_window --experiment perplexity --temperature 0.8", "--temperature is for --experiment generate,"},
           {"04_sliding_window --experiment induction --sinks 2", "--sinks is for --experiment generate,"},
           {"05_break_corrupt_key --experiment sweep --every 2", "--every is for --experiment run, not sweep"},
           {"05_break_corrupt_key --experiment sweep --prompt-bytes 40 --max-new-tokens 12 --kv-head 9",
            "--kv-head 9 is out of range"},  // the sweep reads it
           {"06_break_off_by_one --experiment probes --every 3", "--every is for --experiment run, not probes"},
           {"08_paged_batching --batch-sizes 1,2", "--batch-sizes is for --experiment throughput, not serve: drop it"},
           {"08_paged_batching --experiment throughput --max-batch 4", "--max-batch is for --experiment serve, batching,"},
           {"08_paged_batching --kv-format int8 --group 8", "--group is for --kv-format int4, not int8"},
           {"09_prefix_sharing --experiment prefix --temperature 0.5",
            "--temperature is for --experiment samples, sampling or break, not prefix: drop it"},
           {"09_prefix_sharing --experiment mixed --counts 1,2", "--counts is for --experiment prefix or sampling, not mixed"},
           {"10_quantized_cache --experiment memory --steps 5", "--steps is for --experiment speed, not memory: drop it"},
           {"10_quantized_cache --formats fp16,int8 --group 8", "--group is for --formats with int4, kivi or int4o"},
       }) {
    CAPTURE_BINDING(command);
    const auto r = run_command(binary(command) + small_model());
    CAPTURE(r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.out.empty());
    CHECK(r.err.find(message) != std::string::npos);
    CHECK(std::ranges::count(r.err, '\n') == 1);
  }
}

TEST_CASE("inputs: --backend takes cpu or cuda, and refuses cuda without a build or a GPU for it, or with --threads") {
  const std::string ch01 = binary("01_naive_generation") + " --model " + golden_path("mha.bin") + " --max-new-tokens 3";
  const auto unknown = run_command(ch01 + " --backend tpu");
  CHECK(unknown.exit_code == 2);
  CHECK(unknown.err.find("unknown backend 'tpu'; use --backend cpu, --backend cuda or --backend cuda-harness") !=
        std::string::npos);
  const auto threads = run_command(ch01 + " --backend cuda --threads 1");
  CHECK(threads.exit_code == 2);
#if defined(KVS_HAVE_CUDA)
  CHECK(threads.err.find("--threads sets CPU threads; --backend cuda does not use it") != std::string::npos);
#else
  CHECK(threads.err.find("this build has no CUDA backend") != std::string::npos);  // the first reason given
#endif
  CHECK(run_command(ch01 + " --backend cpu").exit_code == 0);
  const auto cuda = run_command(ch01 + " --backend cuda");
  if (kvs::test::gpu_present()) {
    CHECK(cuda.exit_code == 0);
  } else {
#if defined(KVS_HAVE_CUDA)
    CHECK(cuda.exit_code == 1);  // the build has the backend; this machine has no device
    CHECK(cuda.err.find("no CUDA device found") != std::string::npos);
#else
    CHECK(cuda.exit_code == 2);
    CHECK(cuda.err.find("this build has no CUDA backend") != std::string::npos);
#endif
    CHECK(cuda.err.find("run with --backend cpu") != std::string::npos);
    CHECK(std::count(cuda.err.begin(), cuda.err.end(), '\n') == 1);
  }
}

TEST_CASE("inputs: --backend cuda-harness runs a chapter through the CUDA kernels on the CPU, the text the CPU prints, and is never timed") {
  // Chapter 03 on the shipped model: every kernel of a decode step runs, one fiber per GPU thread.
  const std::string ch03 = binary("03_preallocated_cache") + " --max-new-tokens 12";
  const auto harness = run_command(ch03 + " --backend cuda-harness");
  const auto bench = run_command(binary("03_benchmark") + " --backend cuda-harness --lengths 32");
  CHECK(bench.exit_code == 2);
#if defined(KVS_HAVE_CUDA_HARNESS_MODULE)
  CAPTURE(harness.err);
  CHECK(harness.exit_code == 0);
  CHECK(harness.err.find("CUDA harness") != std::string::npos);  // the backend says what it is
  CHECK(harness.out == run_command(ch03 + " --backend cpu").out);
  CHECK(bench.err.find("its timings are neither GPU nor CPU numbers") != std::string::npos);
  // The timed runs refuse it (chapter 08's throughput accepts it, to run its GPU path, and says so: test_batched).
  for (const std::string timed : {"08_paged_batching --experiment batching", "10_quantized_cache --experiment speed"}) {
    CAPTURE(timed);
    const auto refused = run_command(binary(timed) + " --backend cuda-harness");
    CHECK(refused.exit_code == 2);
    CHECK(refused.err.find("times its steps, and --backend cuda-harness runs the CUDA kernels on the CPU") != std::string::npos);
  }
  // The harness's order, refused in one line when the backend is made (it aborted at the first cudaFree, blaming a
  // kernel), a seed too: strtoul took "random:5x" as 5 and "random:abc" as 0.
  for (const std::string order : {"abc", "random:5x", "random:", "random:-1", "Sequential"}) {
    CAPTURE(order);
    const auto bad = run_command("KVS_CUDA_HARNESS_ORDER='" + order + "' " + binary("01_naive_generation") +
                                 " --model " + golden_path("mha.bin") + " --max-new-tokens 2 --backend cuda-harness");
    CHECK(bad.exit_code == 1);
    CHECK(bad.err == "01_naive_generation: error: KVS_CUDA_HARNESS_ORDER='" + order +
                         "': use sequential, reverse or random:SEED (SEED a whole number below 2^64)\n");
  }
  CHECK(run_command("KVS_CUDA_HARNESS_ORDER=random:7 " + binary("01_naive_generation") + " --model " +
                    golden_path("mha.bin") + " --max-new-tokens 2 --backend cuda-harness").exit_code == 0);
#else
  CHECK(harness.exit_code == 2);
  CHECK(harness.err.find("this build has no CUDA harness") != std::string::npos);
#endif
}

TEST_CASE("errors: usage errors exit 2, runtime errors exit 1, both as one line '<program>: error: ...'") {
  const auto usage = run_command(binary("01_naive_generation") + " --max-new-tokens ten");
  CHECK(usage.exit_code == 2);
  CHECK(usage.err.rfind("01_naive_generation: error: --max-new-tokens expects", 0) == 0);
  TempDir dir;
  std::ofstream(dir.file("bad.bin")) << "not a checkpoint";
  const auto runtime = run_command(binary("01_naive_generation") + " --model " + dir.file("bad.bin"));
  CHECK(runtime.exit_code == 1);
  CHECK(runtime.err.rfind("01_naive_generation: error: " + dir.file("bad.bin") + ": ", 0) == 0);
  CHECK(std::count(runtime.err.begin(), runtime.err.end(), '\n') == 1);
}

TEST_CASE("results: CSV fields that hold commas or quotes are quoted") {
  TempDir dir;
  const std::string text = dir.file("a,\"b\".txt"), csv = dir.file("out.csv");
  std::ofstream(text) << "In the beginning God created the heaven and the earth.";
  const auto r = run_command(binary("00_perplexity") + small_model() + " --context 64 --text '" + text + "' --csv " + csv);
  REQUIRE(r.exit_code == 0);
  const std::vector<std::string> rows = lines_of(csv);
  REQUIRE(rows.size() == 2);
  const std::string quoted_path = dir.file("a,\"\"b\"\".txt");  // quotes inside a quoted field are doubled
  CHECK(rows[1].rfind("\"" + quoted_path + "\",", 0) == 0);
}

TEST_CASE("results: a CSV number reads back as the number written, to the last bit") {
  TempDir dir;
  const std::string path = dir.file("numbers.csv");
  kvs::CsvWriter csv({"--csv", path}, "double,float,count");
  const double third = 1.0 / 3.0, bits = 1.5686190185546875, tiny = 2.5e-9;
  const float tenth = 0.1f;
  csv.row(third, tenth, 7);
  csv.row(bits, -tenth, -1);
  csv.row(tiny, 1e30f, 0);
  csv.commit();
  const std::vector<std::string> rows = lines_of(path);
  REQUIRE(rows.size() == 4);
  auto fields = [&](int row) {
    std::vector<std::string> out;
    std::stringstream line(rows[row]);
    for (std::string field; std::getline(line, field, ',');) out.push_back(field);
    REQUIRE(out.size() == 3);
    return out;
  };
  CHECK(std::stod(fields(1)[0]) == third);  // 6 digits (0.333333) is not 1/3 of a double
  CHECK(std::stof(fields(1)[1]) == tenth);
  CHECK(fields(1)[1] == "0.1");  // a float's shortest text, not the double it widens to (0.10000000149011612)
  CHECK(fields(1)[2] == "7");
  CHECK(std::stod(fields(2)[0]) == bits);
  CHECK(std::stof(fields(2)[1]) == -tenth);
  CHECK(std::stod(fields(3)[0]) == tiny);
  CHECK(std::stof(fields(3)[1]) == 1e30f);
}

TEST_CASE("memory: a huge trained context does not make a short run allocate for it") {
  TempDir dir;
  const std::string model = write_long_context_model(dir);
  // Runs the binary itself (exec), so wait4 reports its own peak resident memory.
  auto peak_rss_mib = [](const std::string& command, int& exit_code) {
    const pid_t pid = fork();
    if (pid == 0) {
      execl("/bin/sh", "sh", "-c", ("exec " + command + " >/dev/null 2>&1").c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    int status = 0;
    rusage usage{};
    wait4(pid, &status, 0, &usage);
    exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return usage.ru_maxrss / 1024.0;
  };
  for (const Binary& b : every_binary()) {
    if (b.name == "03_benchmark") continue;  // its --lengths, not the context, size its buffers
    // Chapters 08-10 size attention's scratch for the model's whole context (Runtime's kv_rows -1: their
    // sequences grow step by step, and their experiments' lengths vary): with this model they ask for 2 GiB
    // and are refused in one line naming --memory-limit.
    if (b.name >= "08") continue;
    CAPTURE(b.name);
    int exit_code = -1;
    const double mib = peak_rss_mib(binary(b.name) + " --model " + model + " --threads 1" + b.args, exit_code);
    CHECK(exit_code == 0);
    CHECK(mib < 200);  // sized for seq_len it touched 2 GiB
  }
  // A run that really needs more than --memory-limit is refused before anything is allocated.
  const auto refused = run_command(binary("00_perplexity") + " --model " + model + " --context 2097152 --threads 1");
  CHECK(refused.exit_code == 2);
  CHECK(refused.err.find("--memory-limit") != std::string::npos);
  const auto limited = run_command(binary("01_naive_generation") + small_model() + " --max-new-tokens 3 --memory-limit 1KiB");
  CHECK(limited.exit_code == 2);
  CHECK(limited.err.find("more than --memory-limit 1 KiB") != std::string::npos);
  // Naive generation keeps no cache, and the plan it is refused with counts none (it once counted one for the
  // whole sequence, and refused runs that fit); chapter 02's, which keeps one, does.
  CHECK(limited.err.find("+ KV cache") == std::string::npos);
  // The model did not fit: refused before it was made, saying that the caches are still to come.
  CHECK(limited.err.find("the model, before any KV cache, needs") != std::string::npos);
  const auto naive_plan = run_command(binary("01_naive_generation") + small_model() + " --max-new-tokens 3");
  CHECK(naive_plan.exit_code == 0);
  const std::size_t equals = naive_plan.err.find(" = ", naive_plan.err.find("memory: weights"));
  REQUIRE(equals != std::string::npos);
  const std::string total = naive_plan.err.substr(equals + 3, naive_plan.err.find('\n', equals) - equals - 3);
  CAPTURE(total);
  // Its own total, rounded up at the printed digit, is enough (0.1 KiB above it; one KV cache of its 17 positions,
  // which it once counted, is 17 KiB).
  REQUIRE(total.ends_with(" KiB"));
  char limit[32];
  std::snprintf(limit, sizeof limit, "%.1fKiB", std::stod(total) + 0.1);
  const auto at_total = run_command(binary("01_naive_generation") + small_model() + " --max-new-tokens 3 --memory-limit " + limit);
  CHECK(at_total.exit_code == 0);
  // A chapter that keeps a cache is refused with it, once the model fits.
  const auto cached = run_command(binary("02_dynamic_cache") + small_model() + " --max-new-tokens 3 --memory-limit " + limit);
  CHECK(cached.exit_code == 2);
  CHECK(cached.err.find("+ KV cache") != std::string::npos);
  // Chapter 04's recall distances on a context this long: the filler between the copies is cut from the held-out
  // text's second half, and a distance it has no room for is refused (up to half the text passed, and the last
  // passages' fillers, cut short, put their repeats nearer than the distance said).
  const auto far = run_command(binary("04_sliding_window") + " --model " + model + " --threads 1 --experiment induction "
                                                                                    "--distances 50000");
  CHECK(far.exit_code == 2);
  CHECK(far.err.find("--distances 50000: the filler between the copies") != std::string::npos);
}
