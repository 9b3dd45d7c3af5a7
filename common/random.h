#pragma once
// Random draws that are the same with every compiler, standard library and instruction set, for the
// chapters whose experiments are seeded (05's corrupted vectors, 08's and 09's request traces): the book's
// transcripts say a seed gives the same counts and text on your machine. The integers are the same to the bit
// everywhere; the exponentials and normals call the C library's log, which another libm may round differently in
// its last bit - what 08's and 09's whole-step arrivals and 05's float vectors all but always absorb.
// <random>'s engines are specified to the bit; its distributions are not. libstdc++ and libc++ draw different
// numbers from one mt19937_64, and libstdc++'s normal_distribution<float> itself gives other numbers with
// -march=native than without (the compiler fuses its x·x + y·y into one FMA instruction). So the engine is
// mt19937_64 and the distributions are written out here. uniform_int and exponential are the algorithms
// libstdc++ (GCC 11 and later) runs for a 64-bit engine, so they draw what std::uniform_int_distribution and
// std::exponential_distribution<double> draw there (tests/test_tokenizer_sampler.cpp compares them). GCC or Clang:
// the product of two 64-bit numbers is an unsigned __int128.
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>

namespace kvs {

class Random {
 public:
  explicit Random(std::uint64_t seed) : engine_(seed) {}

  // An integer in [lo, hi], each equally likely. Lemire's multiply-and-reject ("Fast random integer generation
  // in an interval", 2019): the high 64 bits of a draw times the range; the draws whose low 64 bits fall in the
  // first 2^64 mod range values are rejected, since they would make some results more likely than others.
  std::int64_t uniform_int(std::int64_t lo, std::int64_t hi) {
    if (hi < lo) throw std::invalid_argument("Random::uniform_int: an empty range");
    const std::uint64_t range = std::uint64_t(hi) - std::uint64_t(lo) + 1;  // 0: all 2^64 values
    if (range == 0) return std::int64_t(std::uint64_t(lo) + engine_());  // [INT64_MIN, INT64_MAX]: lo + a draw
    unsigned __int128 product = (unsigned __int128)engine_() * range;
    if (std::uint64_t(product) < range) {
      const std::uint64_t threshold = (0 - range) % range;  // 2^64 mod range
      while (std::uint64_t(product) < threshold) product = (unsigned __int128)engine_() * range;
    }
    return std::int64_t(std::uint64_t(lo) + std::uint64_t(product >> 64));
  }

  // In [0, 1): a draw scaled by 2^-64 (rounded to a double, and kept below 1 where it rounds up to it).
  double uniform() {
    const double u = double(engine_()) * 0x1p-64;
    return u < 1.0 ? u : std::nextafter(1.0, 0.0);
  }

  // Exponentially distributed with the given rate (mean 1 / rate): -ln(1 - u) / rate.
  double exponential(double rate) { return -std::log(1.0 - uniform()) / rate; }

  // Standard normal: Marsaglia's polar method - a point drawn in the square [-1, 1)², kept if it lies inside
  // the unit circle, gives two independent values; the second is kept for the next call. The coordinates have
  // 24 random bits, so that x² + y² is exact in a double before its one rounding: a compiler that fuses it into
  // an FMA instruction gets the same bits.
  double normal() {
    if (saved_available_) {
      saved_available_ = false;
      return saved_;
    }
    double x, y, r2;
    do {
      x = coordinate(), y = coordinate();
      r2 = x * x + y * y;
    } while (r2 >= 1.0 || r2 == 0.0);
    const double scale = std::sqrt(-2.0 * std::log(r2) / r2);
    saved_ = x * scale, saved_available_ = true;
    return y * scale;
  }

 private:
  double coordinate() { return double(engine_() >> 40) * 0x1p-23 - 1.0; }  // [-1, 1), in steps of 2^-23

  std::mt19937_64 engine_;
  double saved_ = 0;
  bool saved_available_ = false;
};

}  // namespace kvs
