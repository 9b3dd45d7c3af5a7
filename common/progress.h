#pragma once
// Progress of a run that may take long, on stderr: nothing during its first second (a short run stays
// quiet), then an update at most once a second, and always the last one once anything was shown. On a
// terminal an update rewrites one line (\r); anywhere else - a log file, a pipe, a test - each update is a
// line of its own, since carriage returns in a file are noise. The environment variable KVS_PROGRESS_MS sets
// the interval (0: every update, as the tests use it; the first second's silence follows it too).
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

#include "timing.h"

namespace kvs {

class Progress {
 public:
  struct Options {
    std::FILE* out = stderr;
    double interval_ms = -1;  // -1: KVS_PROGRESS_MS, or 1000
    int terminal = -1;        // -1: whether `out` is a terminal; 0 or 1 to say so (tests)
  };
  // Updates read "  <what>: <done> of <total> <unit>, <seconds> s".
  Progress(std::string what, std::string unit) : Progress(std::move(what), std::move(unit), Options{}) {}
  Progress(std::string what, std::string unit, Options options);
  ~Progress();  // ends a terminal's open line
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void update(std::int64_t done, std::int64_t total);

 private:
  std::string what_, unit_;
  std::FILE* out_;
  double interval_ms_;
  bool terminal_;
  Stopwatch clock_;
  double next_ms_;
  bool shown_ = false, finished_ = false;  // something printed; the last update printed
};

}  // namespace kvs
