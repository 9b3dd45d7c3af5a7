// Chapter 09: prefix caching, copy-on-write and parallel sampling. Sharing must change nothing a sequence
// computes: outputs with sharing equal outputs without (and each request alone), a shared block is never
// written, a block someone holds is never evicted, and every reference is given back.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "08_paged_batching/paged_kv_cache.h"
#include "08_paged_batching/scheduler.h"
#include "09_prefix_sharing/parallel_sampling.h"
#include "09_prefix_sharing/prefix_cache.h"
#include "test_backends.h"
#include "test_util.h"
#include "tokenizer.h"

using namespace kvs;
using namespace kvs::ch09;
using ch08::BlockPool;
using ch08::PagedSequence;
using ch08::Request;

namespace {

// A model shape for the pool's bookkeeping alone (K/V rows tagged by hand, no forward pass).
const ModelConfig kOneLayer{.dim = 16, .hidden_dim = 32, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1, .vocab_size = 256,
                            .seq_len = 64};

// Every key lands in one bucket: only comparing parent serials and tokens can tell blocks apart.
std::uint64_t same_hash_for_all(std::uint64_t, std::span<const int>) { return 7; }

// Position- and sequence-tagged K/V: position p of a sequence tagged t holds value t·1000 + p in every channel.
void append_tagged(Backend& backend, const ModelConfig& c, PagedSequence& s, int tag, int length) {
  for (int p = s.length(); p < length; ++p) {
    s.prepare(p, 1);
    const std::vector<float> row(c.kv_dim(), float(tag * 1000 + p));
    const Buffer d_row = test::to_backend(backend, row);
    const IntBuffer position = consecutive_positions(backend, p, 1);
    for (int layer = 0; layer < c.n_layers; ++layer) s.write(layer, p, 1, position.data(), d_row.data(), d_row.data());
  }
}
// The value `s` reads at `position`, last channel of layer `layer`'s key and value (they must agree).
float tag_read(Backend& backend, const ModelConfig& c, PagedSequence& s, int layer, int position) {
  float key = 0, value = 0;
  const KvRow row = s.row(layer, position);
  backend.to_host(&key, row.key + c.kv_dim() - 1, 1);
  backend.to_host(&value, row.value + c.kv_dim() - 1, 1);
  CHECK(key == value);
  return value;
}

}  // namespace

TEST_CASE("copy-on-write: a sequence appending to a block its sibling holds never changes what the sibling reads") {
  const ModelConfig c{.dim = 16, .hidden_dim = 32, .n_layers = 2, .n_heads = 2, .n_kv_heads = 1, .vocab_size = 256,
                      .seq_len = 64};
  test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
    for (int block_size : {1, 3, 16}) {
      for (int length : {block_size * 2 - 1, block_size * 2, block_size * 2 + 1}) {
        CAPTURE(block_size);
        CAPTURE(length);  // the shared prefix ends inside a block, at its end, one past it (blocks of 1: always at an end)
        BlockPool pool(backend, c, 40, block_size, 3, c.seq_len);
        PrefixCache cache(pool);
        {
          PagedSequence a(pool, &cache), b(pool, &cache);
          append_tagged(backend, c, a, 1, length);
          b.start_from(a.blocks(), length);  // b: a's every block, the partly filled last one too
          for (int block : a.blocks()) CHECK(cache.references(block) == 2);
          const bool inside = length % block_size != 0;
          CHECK(b.blocks_to_grow(1) == 1);  // inside a block: a copy of it; at its end: a new block
          append_tagged(backend, c, b, 2, length + 5);       // b appends first: copies the shared last block
          append_tagged(backend, c, a, 1, length + 3);       // then a, into its own
          CHECK(cache.stats().cow_copies == (inside ? 1 : 0));
          for (int layer = 0; layer < c.n_layers; ++layer)
            for (int p = 0; p < length + 5; ++p) {
              CAPTURE(p);
              if (p < length + 3) CHECK(tag_read(backend, c, a, layer, p) == float(1000 + p));
              CHECK(tag_read(backend, c, b, layer, p) == float((p < length ? 1000 : 2000) + p));
            }
          cache.audit({&a, &b});
        }
        cache.audit({});  // both gone: every reference back, every block in the free queue
        CHECK(cache.available_blocks() == pool.blocks());
      }
    }
  });
}

TEST_CASE("prefix cache: a block someone holds is never evicted - a cached block no one holds is, oldest first") {
  CpuBackend cpu(1);
  const ModelConfig& c = kOneLayer;
  BlockPool pool(cpu, c, 8, 4, 4, c.seq_len);
  PrefixCache cache(pool);
  std::vector<int> tokens(13);
  for (int i = 0; i < 13; ++i) tokens[i] = 'a' + i;
  auto first = cache.start(tokens);  // nothing cached yet
  CHECK(first->length() == 0);
  append_tagged(cpu, c, *first, 1, 13);
  cache.filled(*first, tokens);
  CHECK(cache.published_blocks() == 3);  // the three full blocks; the 13th position's block is not full
  auto second = cache.start(tokens);      // finds them: 12 positions, the last token left to run
  CHECK(second->length() == 12);
  const std::vector<int> held = second->blocks();
  first.reset();  // the first finishes: its blocks stay held by the second
  for (int block : held) CHECK(cache.references(block) == 1);
  // Exhaust the pool: every block it hands out is one the second does not hold.
  std::vector<int> taken;
  for (int block; (block = cache.take_block()) >= 0;) {
    CHECK(std::find(held.begin(), held.end(), block) == held.end());
    taken.push_back(block);
  }
  CHECK(taken.size() == 5);
  CHECK(cache.stats().evictions == 0);  // the cached blocks were held: nothing published was evicted
  cache.give_back_blocks(taken);
  second.reset();  // now the cached blocks are free but still published...
  CHECK(cache.published_blocks() == 3);
  CHECK(cache.match(tokens).size() == 3);
  for (int i = 0; i < 6; ++i) taken[i % 5] = cache.take_block();  // ...until the pool needs them: unpublished first
  CHECK(cache.stats().evictions == 1);
  CHECK(cache.match(tokens).size() == 2);  // the tail block went first: the head still serves
}

TEST_CASE("prefix cache: blocks freed earlier are evicted earlier, across sequences") {
  CpuBackend cpu(1);
  const ModelConfig& c = kOneLayer;
  BlockPool pool(cpu, c, 6, 4, 2, c.seq_len);
  PrefixCache cache(pool);
  std::vector<int> a(9, 'a'), b(9, 'b');  // two blocks and one position each
  auto first = cache.start(a), second = cache.start(b);
  append_tagged(cpu, c, *first, 1, 9), append_tagged(cpu, c, *second, 2, 9);
  cache.filled(*first, a), cache.filled(*second, b);
  second.reset();  // b's blocks are given back first...
  first.reset();   // ...then a's: b is the least recently used
  CHECK(cache.match(a).size() == 2);
  CHECK(cache.match(b).size() == 2);
  std::vector<int> taken;
  for (int i = 0; i < 2; ++i) taken.push_back(cache.take_block());  // the two unpublished partial blocks go first
  CHECK(cache.stats().evictions == 0);
  for (int i = 0; i < 2; ++i) taken.push_back(cache.take_block());  // then b's cached blocks, tail first
  CHECK(cache.stats().evictions == 2);
  CHECK(cache.match(b).empty());
  CHECK(cache.match(a).size() == 2);  // a, given back later, is still cached
  cache.give_back_blocks(taken);
}

TEST_CASE("prefix cache: two prompts equal but for one byte in the last shared block never share that block") {
  CpuBackend cpu(1);
  const ModelConfig& c = kOneLayer;
  for (BlockHash hash : {&fnv1a_block_hash, &same_hash_for_all}) {
    BlockPool pool(cpu, c, 16, 4, 4, c.seq_len);
    PrefixCache cache(pool, PrefixCacheOptions{.hash = hash});
    std::vector<int> a(14);
    for (int i = 0; i < 14; ++i) a[i] = 'a' + i;
    std::vector<int> b = a;
    b[11] = 'z';  // the last byte of the third block
    auto first = cache.start(a);
    append_tagged(cpu, c, *first, 1, 14);
    cache.filled(*first, a);
    CHECK(cache.match(a).size() == 3);
    CHECK(cache.match(b).size() == 2);  // blocks 0 and 1 only
    std::vector<int> c2 = a;
    c2[0] = 'z';  // the first byte: nothing shared, even though every later block's tokens are equal
    CHECK(cache.match(c2).empty());
    std::vector<int> d(a.begin() + 4, a.end());  // a's second and third blocks, as a prompt's first two
    CHECK(cache.match(d).empty());               // same tokens, another prefix: another parent
  }
}

TEST_CASE("prefix cache: served with sharing, every request's greedy tokens equal the request alone - hits as expected") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const std::string text = test::validation_text();
  CpuBackend cpu(test::test_threads());
  Model model(checkpoint, cpu, 64, checkpoint.config().seq_len);
  long tight_evictions = 0;
  for (int block_size : {1, 3, 16}) {
    CAPTURE(block_size);
    // A document of 3 blocks; prompts that end inside its 4th block, at its end, one past it; then the same
    // three prompts again, and each with a question after it - arriving once the first wave is cached.
    const std::string document = text.substr(3000, 3 * block_size);
    std::vector<Request> requests;
    for (int extra : {block_size / 2, block_size, block_size + 1})
      requests.push_back(Request{encode_bytes(document + text.substr(9000, std::max(extra, 1))), 7, 0});
    const int first_wave = static_cast<int>(requests.size());
    for (int i = 0; i < first_wave; ++i) requests.push_back(Request{requests[i].prompt, 7, 40});
    for (int i = 0; i < first_wave; ++i) {
      std::vector<int> longer = requests[i].prompt;
      std::string more = "#";  // a byte this model never generates, so no output can have filled the block
      more += text.substr(20000 + 100 * i, 4);
      for (int t : encode_bytes(more)) longer.push_back(t);
      requests.push_back(Request{longer, 6, 40});
    }
    for (bool tight : {false, true}) {
      CAPTURE(tight);
      BlockPool pool(cpu, model.config(), tight ? blocks_needed(4 * block_size + 20, block_size) + 2 : 400, block_size, 9,
                     model.config().seq_len);
      PrefixCache cache(pool);
      std::vector<ch08::RequestResult> results;
      const ch08::RunStats stats = ch08::serve(model, cache, requests, ch08::SchedulerOptions{.max_batch = 9, .token_budget = 32},
                                               results);
      for (std::size_t i = 0; i < requests.size(); ++i) {
        CAPTURE(i);
        CHECK(results[i].output == ch08::serve_alone(model, requests[i]));
        if (tight || i < std::size_t(first_wave)) continue;
        // The first wave's prompts are prefixes of one another and all in the cache by step 40. The same prompt
        // again finds every whole block but the one holding its last token; a prompt with 5 more bytes, every
        // whole block of the first wave's prompt (the block those bytes begin in holds other text).
        const int length = static_cast<int>(requests[i].prompt.size());
        const int expected = i < 2u * first_wave ? (length - 1) / block_size * block_size
                                                 : (length - 5) / block_size * block_size;
        CHECK(results[i].cached_prompt_tokens == expected);
      }
      CHECK(stats.cached_prompt_tokens > 0);
      cache.audit({});  // every reference back
      CHECK(cache.available_blocks() == pool.blocks());
      if (tight) tight_evictions += cache.stats().evictions;
    }
  }
  CHECK(tight_evictions > 0);  // the tight pools reused cached blocks: sharing held up under eviction
}

TEST_CASE("prefix cache: a long randomized trace under a small pool - audited every step, no reference leaked") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const std::string text = test::validation_text();
  CpuBackend cpu(test::test_threads());
  Model model(checkpoint, cpu, 64, checkpoint.config().seq_len);
  std::mt19937 random(20261123);
  // Under the sanitizers 16 requests: still enough to preempt and evict (both checked below).
  const int count = test::sanitizer_run() ? 16 : 40;
  std::vector<Request> requests;
  for (int i = 0; i < count; ++i) {  // four documents, shared or cut short at random points, and prompts of their own
    const int document = random() % 4;
    std::string prompt = random() % 3 == 0 ? text.substr(50000 + 1000 * i, 10 + random() % 40)
                                           : text.substr(2000 + 500 * document, 20 + random() % 40) + text.substr(7000 + 3 * i, random() % 9);
    requests.push_back(Request{encode_bytes(prompt), 3 + int(random() % 10), i / 2});
  }
  BlockPool pool(cpu, model.config(), 24, 4, 8, model.config().seq_len);
  PrefixCache cache(pool);
  std::vector<ch08::RequestResult> results;
  const ch08::RunStats stats = ch08::serve(model, cache, requests, ch08::SchedulerOptions{.max_batch = 8, .token_budget = 24},
                                           results);  // audit_blocks: PrefixCache::audit before every forward pass
  for (std::size_t i = 0; i < requests.size(); ++i) {
    CAPTURE(i);
    CHECK(results[i].output == ch08::serve_alone(model, requests[i]));
  }
  CHECK(stats.preemptions > 0);
  CHECK(cache.stats().evictions > 0);
  CHECK(stats.cached_prompt_tokens > 0);
  cache.audit({});
  for (int block = 0; block < pool.blocks(); ++block) CHECK(cache.references(block) == 0);
  CHECK(cache.available_blocks() == pool.blocks());
}

TEST_CASE("parallel sampling: shared samples equal separate requests and each sample alone, same seeds - CoW copies") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const std::string text = test::validation_text();
  CpuBackend cpu(test::test_threads());
  Model model(checkpoint, cpu, 64, checkpoint.config().seq_len);
  const SamplerSettings settings{.temperature = 0.9f, .seed = 77};
  const int block_size = 16, samples = 4, new_tokens = 12;
  for (int length : {2 * block_size - 3, 2 * block_size, 2 * block_size + 1}) {
    CAPTURE(length);  // the prompt ends inside a block, at its end, one past it
    const std::vector<int> prompt = encode_bytes(text.substr(4000, length));
    SamplingRun runs[2];
    for (bool share : {false, true}) {
      BlockPool pool(cpu, model.config(), samples * blocks_needed(length + new_tokens, block_size), block_size, samples,
                     model.config().seq_len);
      PrefixCache cache(pool);
      runs[share] = sample_in_parallel(model, cache, prompt, samples, new_tokens, settings, share);
      cache.audit({});
    }
    for (int i = 0; i < samples; ++i) {
      CAPTURE(i);
      CHECK(runs[1].outputs[i] == runs[0].outputs[i]);
      CHECK(runs[1].outputs[i] == sample_alone(model, prompt, new_tokens, settings, i));
    }
    CHECK(runs[1].outputs[0] != runs[1].outputs[1]);  // the samples differ: the seeds were used
    CHECK(runs[1].cow_copies == (length % block_size != 0 ? samples - 1 : 0));
    CHECK(runs[0].cow_copies == 0);
    CHECK(runs[1].prefill_tokens == length);
    CHECK(runs[0].prefill_tokens == samples * length);
    // Shared: the prompt's full blocks once, each sample's own blocks after them.
    const int full = length / block_size, per_sample = blocks_needed(length + new_tokens, block_size);
    CHECK(runs[1].peak_held_blocks == full + samples * (per_sample - full));
    CHECK(runs[0].peak_held_blocks == samples * per_sample);
  }
}

TEST_CASE("parallel sampling without copy-on-write: a sibling's text changes, and the check against each sample alone catches it") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const std::string text = test::validation_text();
  CpuBackend cpu(test::test_threads());
  Model model(checkpoint, cpu, 64, checkpoint.config().seq_len);
  const SamplerSettings settings{.temperature = 0.9f, .seed = 5};
  const int samples = 3, new_tokens = 16;
  const std::vector<int> prompt = encode_bytes(text.substr(4000, 37));  // ends inside a block
  BlockPool pool(cpu, model.config(), 30, 16, samples, model.config().seq_len);
  PrefixCache cache(pool, PrefixCacheOptions{.copy_on_write = false});
  const SamplingRun broken = sample_in_parallel(model, cache, prompt, samples, new_tokens, settings, true);
  int differ = 0;
  for (int i = 0; i < samples; ++i) differ += broken.outputs[i] != sample_alone(model, prompt, new_tokens, settings, i) ? 1 : 0;
  CHECK(differ > 0);
  CHECK(broken.cow_copies == 0);
}

TEST_CASE("chapter 09: the samples, break and mixed runs check themselves - bad flags get one line") {
  const std::string bin = std::string(KVS_BIN_DIR) + "/09_prefix_sharing";
  const auto samples = test::run_command(bin + " --samples 3 --max-new-tokens 10");
  CHECK(samples.exit_code == 0);
  CHECK(samples.err.find("3 of 3 samples identical to the separate requests, 3 of 3 to each sample alone") != std::string::npos);
  CHECK(samples.out.find("[sample 2]") != std::string::npos);
  const auto broken = test::run_command(bin + " --experiment break --samples 3 --max-new-tokens 16");
  CHECK(broken.exit_code == 0);
  CHECK(broken.err.find("the check catches every changed one") != std::string::npos);
  CHECK(broken.out.find("without copy-on-write:") != std::string::npos);
  const auto prefix = test::run_command(bin + " --experiment prefix --counts 1,3 --prefix-length 100 --question-length 8 "
                                              "--max-new-tokens 4");
  CHECK(prefix.exit_code == 0);
  CHECK(prefix.err.find("3 of 3") != std::string::npos);
  // Refused before anything runs: among them 80 requests' questions past the held-out text's end (the run died in
  // std::string::substr after its header), and the mixed trace's 704-position requests on a model of 96.
  const std::vector<std::string> refused = {
      "--experiment nope", "--samples 0", "--experiment break --samples 1", "--experiment prefix --prefix-length 2040",
      "--experiment mixed --kv-memory 100KiB", "--experiment prefix --counts 80 --token-budget 128",
      "--experiment mixed --model " + test::golden_path("mha.bin") + " --token-budget 32",
      // a budget past the context (it failed after the table's header), and one the experiment would not read
      "--experiment prefix --counts 2 --token-budget 4096", "--samples 2 --token-budget 8"};
  for (const std::string& flags : refused) {
    CAPTURE(flags);
    const auto r = test::run_command(bin + " " + flags);
    CAPTURE(r.err);
    CHECK(r.exit_code == 2);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
}

TEST_CASE("prefix cache: a sequence not made by start() publishes its own blocks, whatever held its slot before") {
  CpuBackend cpu(1);
  const ModelConfig& c = kOneLayer;
  BlockPool pool(cpu, c, 16, 4, 1, c.seq_len);  // one sequence slot: the second sequence takes the first's
  PrefixCache cache(pool);
  std::vector<int> a(13), b(13);
  for (int i = 0; i < 13; ++i) a[i] = 'a' + i, b[i] = 'A' + i;
  {
    auto first = cache.start(a);
    append_tagged(cpu, c, *first, 1, 13);
    cache.filled(*first, a);
  }
  PagedSequence direct(pool, &cache);
  append_tagged(cpu, c, direct, 2, 13);
  cache.filled(direct, b);
  CHECK(cache.match(a).size() == 3);
  CHECK(cache.match(b).size() == 3);  // its progress started at its first block, not where the first one stopped
}
