#include "checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "replacing_file.h"
#include "rope.h"

namespace kvs {
namespace {

constexpr std::size_t kHeaderBytes = 7 * sizeof(std::int32_t);

// Generous bounds that no sane checkpoint exceeds; they keep every size computation far from overflow.
struct Bound {
  const char* name;
  int max;
};
constexpr Bound kBounds[7] = {{"dim", 1 << 16},      {"hidden_dim", 1 << 18}, {"n_layers", 1024},
                              {"n_heads", 1024},     {"n_kv_heads", 1024},    {"vocab_size", 1 << 21},
                              {"seq_len", 1 << 21}};

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw CheckpointError(path + ": " + what);
}

// llama2.c's legacy RoPE tables, between the final norm and the classifier: cos and sin of every (position, pair).
// Kept in the format, recomputed, never read.
std::uint64_t legacy_rope_floats(const ModelConfig& c) { return 2 * std::uint64_t(c.seq_len) * (c.head_dim() / 2); }

// Floats of every tensor in file order, legacy RoPE tables included.
std::uint64_t checkpoint_floats(const ModelConfig& c) { return std::uint64_t(parameter_count(c)) + legacy_rope_floats(c); }

// The tensors in file order (llama2.c's legacy RoPE tables sit between rms_final and the classifier): name,
// floats per layer, layers, and the member that holds it in a mapped checkpoint and in HostWeights - the one list
// that reading, checking and writing a checkpoint walk. The classifier is last; a shared one is the embedding
// table, not stored again.
struct TensorShape {
  const char* name;
  std::size_t per_layer, layers;
  const float* TensorPointers::*mapped;
  std::vector<float> HostWeights::*host;
};
std::array<TensorShape, 12> tensor_shapes(const ModelConfig& c) {
  const std::size_t dim = c.dim, kv_dim = c.kv_dim(), hidden = c.hidden_dim, L = c.n_layers, vocab = c.vocab_size;
  using T = TensorPointers;
  using H = HostWeights;
  return {{{"token_embedding", vocab * dim, 1, &T::token_embedding, &H::token_embedding},
           {"rms_att", dim, L, &T::rms_att, &H::rms_att},
           {"wq", dim * dim, L, &T::wq, &H::wq},
           {"wk", kv_dim * dim, L, &T::wk, &H::wk},
           {"wv", kv_dim * dim, L, &T::wv, &H::wv},
           {"wo", dim * dim, L, &T::wo, &H::wo},
           {"rms_ffn", dim, L, &T::rms_ffn, &H::rms_ffn},
           {"w1", hidden * dim, L, &T::w1, &H::w1},
           {"w2", dim * hidden, L, &T::w2, &H::w2},
           {"w3", hidden * dim, L, &T::w3, &H::w3},
           {"rms_final", dim, 1, &T::rms_final, &H::rms_final},
           {"classifier", vocab * dim, 1, &T::classifier, &H::classifier}}};
}
bool is_classifier(const TensorShape& shape) { return shape.mapped == &TensorPointers::classifier; }

}  // namespace

ModelConfig validate_header(const int (&h)[7], const std::string& path) {
  for (int i = 0; i < 7; ++i) {
    const int value = i == 5 && h[i] < 0 && h[i] != INT32_MIN ? -h[i] : h[i];  // vocab_size may be negative
    if (value <= 0)
      fail(path, std::string("header field ") + kBounds[i].name + " = " + std::to_string(h[i]) +
                     " must be positive (is this a llama2.c version-0 checkpoint?)");
    if (value > kBounds[i].max)
      fail(path, std::string("header field ") + kBounds[i].name + " = " + std::to_string(value) +
                     " is larger than the limit " + std::to_string(kBounds[i].max) +
                     " (is this a llama2.c version-0 checkpoint?)");
  }
  ModelConfig c{.dim = h[0], .hidden_dim = h[1], .n_layers = h[2], .n_heads = h[3], .n_kv_heads = h[4],
                .vocab_size = h[5] < 0 ? -h[5] : h[5], .seq_len = h[6], .shared_classifier = h[5] > 0};
  if (c.dim % c.n_heads != 0)
    fail(path, "header field dim = " + std::to_string(c.dim) + " must be a multiple of n_heads = " +
                   std::to_string(c.n_heads));
  if (c.n_heads % c.n_kv_heads != 0)
    fail(path, "header field n_kv_heads = " + std::to_string(c.n_kv_heads) + " must divide n_heads = " +
                   std::to_string(c.n_heads));
  if (c.head_dim() % 2 != 0)
    fail(path, "head_dim = dim / n_heads = " + std::to_string(c.head_dim()) +
                   " must be even (RoPE rotates pairs of dimensions)");
  return c;
}

std::size_t checkpoint_bytes(const ModelConfig& config) {
  return kHeaderBytes + checkpoint_floats(config) * sizeof(float);
}

Checkpoint::Checkpoint(const std::string& path) : path_(path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer before the kind of file is checked.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    fail(path, std::string("cannot open: ") + std::strerror(error) + " (check the --model path)");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    fail(path, std::string("cannot read its size: ") + std::strerror(error));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file (a directory, a device or a pipe); give a checkpoint file");
  }
  const auto size = static_cast<std::size_t>(st.st_size);
  if (size < kHeaderBytes) {
    ::close(fd);
    fail(path, "file is " + std::to_string(size) + " bytes, smaller than the 28-byte header (truncated?)");
  }
  int header[7];
  if (const ssize_t got = ::pread(fd, header, sizeof header, 0); got != static_cast<ssize_t>(sizeof header)) {
    const int error = errno;
    ::close(fd);
    fail(path, std::string("cannot read the header: ") +
                   (got < 0 ? std::strerror(error) : "the file shrank while it was opened"));
  }
  try {
    config_ = validate_header(header, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  const std::size_t expected = checkpoint_bytes(config_);
  if (size != expected) {
    ::close(fd);
    fail(path, "file is " + std::to_string(size) + " bytes but its header (dim " + std::to_string(config_.dim) +
                   ", hidden_dim " + std::to_string(config_.hidden_dim) + ", n_layers " +
                   std::to_string(config_.n_layers) + ", n_heads " + std::to_string(config_.n_heads) +
                   ", n_kv_heads " + std::to_string(config_.n_kv_heads) + ", vocab_size " +
                   std::to_string(header[5]) + ", seq_len " + std::to_string(config_.seq_len) + ") implies " +
                   std::to_string(expected) + " bytes" + (size < expected ? " (truncated?)" : " (trailing data?)"));
  }
  void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_error = errno;  // before close() can change it
  ::close(fd);
  if (mapping == MAP_FAILED) fail(path, std::string("cannot map the file: ") + std::strerror(map_error));
  mapping_ = mapping;
  bytes_ = size;
  point_at_tensors();
}

void Checkpoint::point_at_tensors() {
  const ModelConfig& c = config_;
  const float* p = reinterpret_cast<const float*>(static_cast<const char*>(mapping_) + kHeaderBytes);
  for (const TensorShape& shape : tensor_shapes(c)) {
    if (is_classifier(shape)) {
      p += legacy_rope_floats(c);
      if (c.shared_classifier) {
        tensors_.classifier = tensors_.token_embedding;
        break;
      }
    }
    tensors_.*shape.mapped = p;
    p += shape.per_layer * shape.layers;
  }
}

void Checkpoint::require_finite_weights() const {
  for (const TensorShape& shape : tensor_shapes(config_)) {
    const float* data = tensors_.*shape.mapped;
    const float* end = data + shape.per_layer * shape.layers;
    const float* bad = std::find_if(data, end, [](float w) { return !std::isfinite(w); });
    if (bad == end) continue;
    const std::size_t at = static_cast<std::size_t>(bad - data);
    fail(path_, std::string("tensor ") + shape.name +
                    (shape.layers > 1 ? " of layer " + std::to_string(at / shape.per_layer) : "") + " holds " +
                    (std::isnan(*bad) ? "NaN" : "an infinity") + " at element " + std::to_string(at % shape.per_layer) +
                    "; the weights are corrupt (a diverged training run or a damaged file): retrain or restore the file");
  }
}

Checkpoint Checkpoint::synthetic(const ModelConfig& config, std::uint64_t seed) {
  const int header[7] = {config.dim, config.hidden_dim, config.n_layers, config.n_heads, config.n_kv_heads,
                         config.shared_classifier ? config.vocab_size : -config.vocab_size, config.seq_len};
  Checkpoint checkpoint;
  checkpoint.path_ = "synthetic";
  checkpoint.generated_ = true;
  checkpoint.config_ = validate_header(header, checkpoint.path_);
  checkpoint.bytes_ = checkpoint_bytes(checkpoint.config_);
  void* mapping = ::mmap(nullptr, checkpoint.bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapping == MAP_FAILED)
    fail("synthetic", "cannot allocate " + std::to_string(checkpoint.bytes_) + " bytes for the weights; choose a smaller shape");
  checkpoint.mapping_ = mapping;
  std::memcpy(mapping, header, sizeof header);
  checkpoint.point_at_tensors();
  // Uniform in ±1/sqrt(dim), the scale that keeps x · Wᵀ of unit-size activations at unit size; norms of 1.
  // A xorshift generator: gigabytes of weights in seconds. The text is gibberish; the timings are real.
  const float scale = 1.0f / std::sqrt(float(config.dim));
  float* floats = reinterpret_cast<float*>(static_cast<char*>(mapping) + kHeaderBytes);
  const std::size_t count = (checkpoint.bytes_ - kHeaderBytes) / sizeof(float);
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::size_t i = 0; i < count; ++i) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    floats[i] = scale * (float(state >> 40) / float(1 << 23) - 1.0f);  // 24 random bits -> [-1, 1)
  }
  const ModelConfig& c = checkpoint.config_;
  const TensorPointers& t = checkpoint.tensors_;
  // The norms' weights: 1. (tensors_ points into the mapping read-only; `floats` is the same memory, writable.)
  auto ones = [&](const float* tensor, std::size_t n) { std::fill_n(floats + (tensor - floats), n, 1.0f); };
  ones(t.rms_att, std::size_t(c.n_layers) * c.dim);
  ones(t.rms_ffn, std::size_t(c.n_layers) * c.dim);
  ones(t.rms_final, c.dim);
  ::mprotect(mapping, checkpoint.bytes_, PROT_READ);
  return checkpoint;
}

Checkpoint::~Checkpoint() {
  if (mapping_) ::munmap(mapping_, bytes_);
}

Checkpoint::Checkpoint(Checkpoint&& o) noexcept
    : path_(std::move(o.path_)),
      config_(o.config_),
      tensors_(o.tensors_),
      mapping_(o.mapping_),
      bytes_(o.bytes_),
      generated_(o.generated_) {
  o.mapping_ = nullptr;
  o.bytes_ = 0;
}

void write_checkpoint(const std::string& path, const ModelConfig& c, const HostWeights& w) {
  const auto shapes = tensor_shapes(c);
  for (const TensorShape& shape : shapes) {
    const bool stored = !(is_classifier(shape) && c.shared_classifier);  // a shared classifier is the embedding
    const std::size_t floats = stored ? shape.per_layer * shape.layers : 0, held = (w.*shape.host).size();
    if (held != floats)
      fail(path, std::string("cannot write: tensor ") + shape.name + " holds " + std::to_string(held) +
                     " floats, the configuration needs " + std::to_string(floats));
  }
  const int header[7] = {c.dim,        c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                         c.shared_classifier ? c.vocab_size : -c.vocab_size, c.seq_len};
  validate_header(header, path);

  // Written beside `path` and renamed over it (replacing_file.h): a process that has the old file mapped
  // keeps reading it, and an interrupted write leaves it whole.
  try {
    ReplacingFile out(path, path);
    auto put = [&out](const float* data, std::size_t floats) { out.write(data, floats * sizeof(float)); };
    out.write(header, sizeof header);
    for (const TensorShape& shape : shapes) {  // sizes checked above; the walk point_at_tensors makes
      if (is_classifier(shape)) {
        // The two legacy tables llama2.c once read: cos then sin of every (position, pair). Kept for the format.
        const int pairs = c.head_dim() / 2;
        std::vector<float> cos_table(legacy_rope_floats(c) / 2), sin_table(cos_table.size());  // (seq_len, pairs) each
        for (int pos = 0; pos < c.seq_len; ++pos)
          for (int p = 0; p < pairs; ++p) {
            float cs[2];
            rope_cos_sin(pos, p, c.head_dim(), cs);
            cos_table[std::size_t(pos) * pairs + p] = cs[0];
            sin_table[std::size_t(pos) * pairs + p] = cs[1];
          }
        put(cos_table.data(), cos_table.size());
        put(sin_table.data(), sin_table.size());
        if (c.shared_classifier) break;
      }
      put((w.*shape.host).data(), (w.*shape.host).size());
    }
    out.commit();
  } catch (const std::runtime_error& e) {
    throw CheckpointError(e.what());  // the message names the file
  }
}

}  // namespace kvs
