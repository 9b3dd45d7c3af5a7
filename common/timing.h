#pragma once
// Wall-clock timing and the statistics the chapters report.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

namespace kvs {

class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  double milliseconds() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

inline double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  const auto mid = values.begin() + values.size() / 2;
  std::nth_element(values.begin(), mid, values.end());
  if (values.size() % 2) return *mid;
  return (*mid + *std::max_element(values.begin(), mid)) / 2;
}

// The q-th percentile (0 <= q <= 100), nearest rank: the smallest value with at least q% of the values at
// or below it. p50 is the median's nearest rank; p99 the time 1 step in 100 exceeds.
inline double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const std::size_t rank = static_cast<std::size_t>(std::ceil(q / 100.0 * values.size()));
  return values[rank == 0 ? 0 : rank - 1];
}

}  // namespace kvs
