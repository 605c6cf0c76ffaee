// How fast the SDXL trainer's cached dataset delivers samples from the page
// cache (the data lies in memory after the first epoch): CachedDataset::sample()
// and collate() of a batch, in samples per second, for SDXL-sized samples
// (4x128x128 latents, 77x2048 text embeddings, fp16: ~450 KiB each) and for
// the tiny test model's (a few KiB each, where per-read overhead dominates).
//
//   build/cpu-torch/bench/cpu/bench_cached_dataset [--benchmark_filter=...]
//
// The dataset is written once per size into a temporary directory (SDXL:
// 128 samples, ~57 MiB) and read once before timing, so the numbers exclude
// the disk.
#include <benchmark/benchmark.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/cached_dataset.hpp"
#include "data/loader.hpp"

namespace {

using namespace sdxl::data;

struct Shape {
  const char* name;
  LatentSize latent;
  TextDims text;
  std::size_t samples;
};

const Shape kSdxl{"sdxl", {128, 128}, {77, 2048, 1280}, 128};
const Shape kTiny{"tiny", {16, 16}, {7, 64, 32}, 1024};

class Fixture {
 public:
  explicit Fixture(const Shape& shape) {
    std::string pattern = (std::filesystem::temp_directory_path() / "bench_cached_dataset.XXXXXX").string();
    if (!::mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed for " + pattern);
    dir_ = pattern;
    CachedDatasetWriter writer(dir_, {.samples_per_shard = 64, .text_dims = shape.text});
    SplitMix64 rng(7);
    for (std::size_t i = 0; i < shape.samples; ++i) {
      Sample s;
      s.latent_shape = {kLatentChannels, shape.latent.height, shape.latent.width};
      s.latents.resize(static_cast<std::size_t>(kLatentChannels * shape.latent.height * shape.latent.width));
      s.prompt_embeds_shape = {shape.text.sequence_length, shape.text.width};
      s.prompt_embeds.resize(static_cast<std::size_t>(shape.text.sequence_length * shape.text.width));
      s.pooled_prompt_embeds.resize(static_cast<std::size_t>(shape.text.pooled_width));
      for (auto* v : {&s.latents, &s.prompt_embeds, &s.pooled_prompt_embeds})
        for (float& x : *v) x = rng.uniform() - 0.5f;
      writer.add(s);
    }
    writer.finish();
    dataset = CachedDataset::open(dir_);
    for (std::size_t i = 0; i < dataset->size(); ++i) benchmark::DoNotOptimize(dataset->sample(i));  // warm the page cache
  }
  ~Fixture() {
    dataset.reset();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  std::shared_ptr<CachedDataset> dataset;

 private:
  std::filesystem::path dir_;
};

Fixture& fixture(const Shape& shape) {
  static std::map<std::string, std::unique_ptr<Fixture>> fixtures;
  auto& f = fixtures[shape.name];
  if (!f) f = std::make_unique<Fixture>(shape);
  return *f;
}

void BM_sample(benchmark::State& state, const Shape& shape) {
  const CachedDataset& dataset = *fixture(shape).dataset;
  std::size_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(dataset.sample(i));
    i = (i + 1) % dataset.size();
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_collate(benchmark::State& state, const Shape& shape) {
  const CachedDataset& dataset = *fixture(shape).dataset;
  const std::size_t batch = static_cast<std::size_t>(state.range(0));
  RankBatch rank_batch;
  rank_batch.bucket = shape.latent;
  std::size_t next = 0;
  for (auto _ : state) {
    rank_batch.indices.clear();
    for (std::size_t k = 0; k < batch; ++k) rank_batch.indices.push_back(next++ % dataset.size());
    benchmark::DoNotOptimize(collate(dataset, rank_batch));
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(batch));
}

BENCHMARK_CAPTURE(BM_sample, sdxl, kSdxl)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_sample, tiny, kTiny)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_collate, sdxl, kSdxl)->Arg(8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_collate, tiny, kTiny)->Arg(64)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
