#include "progress.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "number_text.h"

namespace kvs {
namespace {

double interval_from_environment() {
  const char* value = std::getenv("KVS_PROGRESS_MS");
  if (!value || !*value) return 1000;
  char* end = nullptr;
  const double ms = std::strtod(value, &end);
  if (decimal_number(value) && *end == '\0' && ms >= 0 && ms <= 1e9) return ms;
  // Anything else: the default, never an error in a run (progress only shows it), but said once.
  static bool said = false;
  if (!std::exchange(said, true))
    std::fprintf(stderr, "KVS_PROGRESS_MS=%s is not milliseconds from 0 to 1e9: progress every 1000 ms\n", value);
  return 1000;
}

}  // namespace

Progress::Progress(std::string what, std::string unit, Options options)
    : what_(std::move(what)),
      unit_(std::move(unit)),
      out_(options.out),
      interval_ms_(options.interval_ms >= 0 ? options.interval_ms : interval_from_environment()),
      terminal_(options.terminal >= 0 ? options.terminal == 1 : isatty(fileno(options.out)) == 1),
      next_ms_(interval_ms_) {}

Progress::~Progress() {
  if (terminal_ && shown_ && !finished_) std::fputc('\n', out_);  // the rewritten line is still open
}

void Progress::update(std::int64_t done, std::int64_t total) {
  const bool last = done >= total;
  if (finished_) return;
  const double now = clock_.milliseconds();
  if (now < next_ms_ && !(last && shown_)) return;  // quiet during the first interval, then once an interval
  finished_ = last;
  if (terminal_ && !shown_ && out_ == stderr && isatty(STDOUT_FILENO)) {
    std::fflush(stdout);  // streamed text may end mid-line on the same screen: start below it
    std::fputc('\n', out_);
  }
  shown_ = true;
  next_ms_ = now + interval_ms_;
  std::fprintf(out_, "%s  %s: %lld of %lld %s, %.0f s", terminal_ ? "\r" : "", what_.c_str(),
               static_cast<long long>(done), static_cast<long long>(total), unit_.c_str(), now / 1000);
  if (!terminal_ || last) std::fputc('\n', out_);
  std::fflush(out_);
}

}  // namespace kvs
