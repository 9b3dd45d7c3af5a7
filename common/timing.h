#pragma once
// Wall-clock timing and the statistics the chapters report.
#include <algorithm>
#include <chrono>
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

}  // namespace kvs
