#pragma once
// Rotary position embedding, llama2.c's convention: within each head, the pair (2i, 2i+1) is rotated by
// the angle pos · theta^(-2i / head_dim). The angle is computed in double precision, so that positions in
// the thousands keep their accuracy, and rounded to float once. Every backend calls these two functions.
#include <cmath>

#include "host_device.h"

namespace kvs {

inline constexpr double kRopeTheta = 10000.0;

KVS_HOST_DEVICE inline double rope_angle(int pos, int pair, int head_dim) {
  return pos * pow(kRopeTheta, -2.0 * pair / head_dim);
}

// cos and sin of the angle for (pos, pair), as a table row is laid out: [cos, sin].
KVS_HOST_DEVICE inline void rope_cos_sin(int pos, int pair, int head_dim, float* cos_sin) {
  const double angle = rope_angle(pos, pair, head_dim);
  cos_sin[0] = static_cast<float>(cos(angle));
  cos_sin[1] = static_cast<float>(sin(angle));
}

// Rotate one pair (x0, x1) in place by the angle whose [cos, sin] is given.
KVS_HOST_DEVICE inline void rope_rotate(float* pair, const float* cos_sin) {
  const float x0 = pair[0], x1 = pair[1];
  pair[0] = x0 * cos_sin[0] - x1 * cos_sin[1];
  pair[1] = x0 * cos_sin[1] + x1 * cos_sin[0];
}

// Element d of the head vector x once rotated, given the [cos, sin] of d's pair: what rope_rotate would
// leave there, for code that rotates as it reads (read-time rotation, chapter 04).
// `even` and `odd` are the pair's two numbers (d's and its neighbour's), however they were read.
KVS_HOST_DEVICE inline float rope_rotated_element(float even, float odd, int d, const float* cos_sin) {
  float pair[2] = {even, odd};
  rope_rotate(pair, cos_sin);
  return pair[d & 1];
}
KVS_HOST_DEVICE inline float rope_rotated_element(const float* x, int d, const float* cos_sin) {
  return rope_rotated_element(x[d & ~1], x[d | 1], d, cos_sin);
}

}  // namespace kvs
