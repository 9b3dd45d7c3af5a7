#pragma once
// llama2.c "version 0" checkpoints: a header of 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
// vocab_size, seq_len; a negative vocab_size means the classifier is stored separately), then fp32
// tensors in a fixed order. Loading maps the file read-only and validates it completely before any
// tensor is touched; writing produces the same format (used by tests and tools).
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "config.h"

namespace kvs {

// A checkpoint that is malformed, unreadable or inconsistent. what() is one line naming the file, the
// field and what was expected.
struct CheckpointError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Pointers to the tensors of a checkpoint; row-major, shapes as in the file. Per-layer tensors are stored
// layer after layer, e.g. wq holds n_layers blocks of (dim, dim).
struct TensorPointers {
  const float* token_embedding;  // (vocab, dim)
  const float* rms_att;          // (layers, dim)
  const float* wq;               // (layers, dim, dim)
  const float* wk;               // (layers, kv_dim, dim)
  const float* wv;               // (layers, kv_dim, dim)
  const float* wo;               // (layers, dim, dim)
  const float* rms_ffn;          // (layers, dim)
  const float* w1;               // (layers, hidden, dim)
  const float* w2;               // (layers, dim, hidden)
  const float* w3;               // (layers, hidden, dim)
  const float* rms_final;        // (dim)
  const float* classifier;       // (vocab, dim); == token_embedding when shared
};

// A checkpoint mapped into memory (read-only). Moves, does not copy.
class Checkpoint {
 public:
  // Throws CheckpointError if the file cannot be opened or is not a valid version-0 checkpoint.
  explicit Checkpoint(const std::string& path);
  // A model of this shape with random weights, generated in memory (path() is "synthetic"): gibberish text,
  // real timings and bytes, for benchmarks of shapes larger than the shipped model. Throws CheckpointError
  // for a shape the loader would refuse or memory that cannot be had.
  static Checkpoint synthetic(const ModelConfig& config, std::uint64_t seed = 1);
  ~Checkpoint();
  Checkpoint(Checkpoint&& other) noexcept;
  Checkpoint& operator=(Checkpoint&&) = delete;
  Checkpoint(const Checkpoint&) = delete;

  const ModelConfig& config() const { return config_; }
  const TensorPointers& tensors() const { return tensors_; }
  // Throws CheckpointError naming the tensor, its layer and the element if a weight is NaN or infinite (a
  // diverged training run, a damaged file): such a model computes NaN logits, and greedy decoding would
  // still print text. Reads every weight, so the model calls it as it copies them, not the constructor.
  void require_finite_weights() const;
  const std::string& path() const { return path_; }
  // Whether the weights were generated in memory (synthetic()): the host then holds them for the whole run,
  // where a file's are mapped pages the operating system may drop.
  bool generated() const { return generated_; }
  std::size_t file_bytes() const { return bytes_; }

 private:
  Checkpoint() = default;
  void point_at_tensors();  // tensors_ from the mapping, in file order
  std::string path_;
  ModelConfig config_;
  TensorPointers tensors_{};
  void* mapping_ = nullptr;
  std::size_t bytes_ = 0;
  bool generated_ = false;
};

// The same header checks the loader makes, on a header alone; throws CheckpointError naming `path`.
ModelConfig validate_header(const int (&header)[7], const std::string& path);
// Exact size in bytes of a version-0 file with this configuration.
std::size_t checkpoint_bytes(const ModelConfig& config);

// Tensors held in memory, in file order, for writing a checkpoint.
struct HostWeights {
  std::vector<float> token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final;
  std::vector<float> classifier;  // empty when shared with token_embedding
};
// Throws CheckpointError when a tensor's size does not match `config` or the file cannot be written.
void write_checkpoint(const std::string& path, const ModelConfig& config, const HostWeights& weights);

}  // namespace kvs
