// DataLoader: see data/loader.h for the window, order and cursor contracts.
#include "data/loader.h"

#include <glob.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kernels/cpu/classifier.h"  // kIgnoreIndex

namespace tuna {

namespace fs = std::filesystem;

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

bool is_glob(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// The tokenizer a prepare run names in the report.json beside its shards, if it is there.
std::string tokenizer_of_prepare_run(const std::string& shard) {
  const fs::path report = fs::path(shard).parent_path() / "report.json";
  std::ifstream in(report);
  if (!in) return {};
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("tokenizer") || !j["tokenizer"].is_object() ||
      !j["tokenizer"].contains("path") || !j["tokenizer"]["path"].is_string())
    return {};
  return j["tokenizer"]["path"].get<std::string>();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Cursor <-> JSON

void to_json(nlohmann::json& j, const LoaderCursor& c) {
  j = nlohmann::json{{"epoch", c.epoch},     {"position", c.position}, {"seed", c.seed},
                     {"seq_len", c.seq_len}, {"dp_size", c.dp_size},   {"total_windows", c.total_windows}};
  if (c.has_segment)
    j["segment"] = {{"step", c.segment_step}, {"epoch", c.segment_epoch}, {"position", c.segment_position}};
}

void from_json(const nlohmann::json& j, LoaderCursor& c) {
  if (!j.is_object()) fail("data cursor: expected a JSON object, found ", j.dump());
  auto field = [&](const char* name) -> uint64_t {
    auto it = j.find(name);
    if (it == j.end()) fail("data cursor: field '", name, "' is missing (found ", j.dump(), ")");
    // A signed integer that is not negative is fine too (json(int64_t{8}) stores a signed 8).
    if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0))
      fail("data cursor: field '", name, "': expected a non-negative integer, found ", it->dump());
    return it->get<uint64_t>();
  };
  c.epoch = field("epoch");
  c.position = field("position");
  c.seed = field("seed");
  c.seq_len = static_cast<int64_t>(field("seq_len"));
  c.dp_size = static_cast<int64_t>(field("dp_size"));
  c.total_windows = field("total_windows");
  // Sizes that no real run reaches: 2^62 ranks or windows would overflow the products formed below.
  constexpr uint64_t kMax = uint64_t{1} << 62;
  if (c.dp_size < 1 || uint64_t(c.dp_size) > (uint64_t{1} << 24))
    fail("data cursor: field 'dp_size': expected 1 to 2^24 ranks, found ", c.dp_size);
  if (c.total_windows > kMax || c.epoch > kMax || c.position > kMax)
    fail("data cursor: 'epoch', 'position' and 'total_windows' must be at most 2^62 (found ", j.dump(), ")");
  const auto segment = j.find("segment");
  c.has_segment = segment != j.end();
  if (c.has_segment) {
    if (!segment->is_object()) fail("data cursor: field 'segment': expected an object, found ", segment->dump());
    LoaderCursor s;
    auto sub = [&](const char* name) -> uint64_t {
      auto it = segment->find(name);
      if (it == segment->end() || !(it->is_number_unsigned() || (it->is_number_integer() && it->get<int64_t>() >= 0)))
        fail("data cursor: field 'segment.", name, "': expected a non-negative integer, found ",
             it == segment->end() ? std::string("nothing") : it->dump());
      if (it->get<uint64_t>() > kMax) fail("data cursor: field 'segment.", name, "': more than 2^62");
      return it->get<uint64_t>();
    };
    c.segment_step = sub("step"), c.segment_epoch = sub("epoch"), c.segment_position = sub("position");
  }
}

namespace {

uint64_t checked_mul(uint64_t a, uint64_t b, const char* what) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) fail("data cursor: ", what, " = ", a, " x ", b, " overflows 64 bits");
  return r;
}

uint64_t checked_add(uint64_t a, uint64_t b, const char* what) {
  uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) fail("data cursor: ", what, " = ", a, " + ", b, " overflows 64 bits");
  return r;
}

}  // namespace

void check_cursor_progress(const LoaderCursor& c, uint64_t step, uint64_t windows_per_step, const std::string& where) {
  if (!c.has_segment) return;  // written before cursors carried their segment: nothing to compare with
  if (c.segment_step > step)
    fail(where, ": data cursor: its segment starts at step ", c.segment_step, ", after the checkpoint's step ", step);
  const uint64_t per_epoch = c.total_windows / static_cast<uint64_t>(c.dp_size);  // a rank's windows per epoch
  const uint64_t at = checked_add(checked_mul(c.epoch, per_epoch, "epoch x windows per epoch"), c.position, "windows taken");
  const uint64_t from = checked_add(checked_mul(c.segment_epoch, per_epoch, "segment epoch x windows per epoch"),
                                    c.segment_position, "windows taken at the segment's start");
  const uint64_t expected =
      checked_add(from, checked_mul(step - c.segment_step, windows_per_step, "steps x windows per step"), "expected windows");
  if (at != expected)
    fail(where, ": data cursor (epoch ", c.epoch, ", position ", c.position, ") is not where step ", step,
         " leaves the data: from its segment's start (step ", c.segment_step, ", epoch ", c.segment_epoch, ", position ",
         c.segment_position, "), ", step - c.segment_step, " steps of ", windows_per_step,
         " windows per rank (micro_batch x grad_accum) lead to epoch ", per_epoch ? expected / per_epoch : 0,
         ", position ", per_epoch ? expected % per_epoch : expected,
         " (", per_epoch, " windows per epoch per rank): a damaged or hand-edited checkpoint, or a cursor of another one");
}

LoaderCursor reshard_cursor(LoaderCursor c, int64_t dp_size) {
  if (dp_size < 1) fail("data cursor: resharding for ", dp_size, " data-parallel ranks");
  if (c.dp_size == dp_size) return c;
  const uint64_t consumed = checked_mul(c.position, static_cast<uint64_t>(c.dp_size), "position x dp_size");
  if (consumed % static_cast<uint64_t>(dp_size) != 0)
    fail("cannot resume the data order of ", c.dp_size, " data-parallel ranks on ", dp_size, ": ", consumed,
         " windows of the epoch are consumed, not a multiple of ", dp_size);
  c.position = consumed / static_cast<uint64_t>(dp_size);
  c.dp_size = dp_size;
  return c;
}

// ---------------------------------------------------------------------------------------------------
// Shard list

void check_shard_specs(const std::string& option, const std::vector<std::string>& specs, ShardRole role) {
  if (specs.empty()) return;
  try {
    (void)expand_shard_paths(specs, role);
  } catch (const Error& e) {
    fail("option '", option, "': ", e.what());
  }
}

const char* shard_role_prefix(ShardRole role) {
  switch (role) {
    case ShardRole::Train: return "train-";
    case ShardRole::Val: return "val-";
    case ShardRole::Any: break;
  }
  return "";
}

namespace {

// The shards of a directory, in name order: all of them, or for a role, that role's when the directory
// names its shards by split (see loader.h).
std::vector<std::string> directory_shards(const std::string& dir, ShardRole role) {
  std::vector<std::string> all, of_role;
  bool named_by_split = false;
  const std::string prefix = shard_role_prefix(role);
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::directory_entry& entry = *it;
    std::error_code kind;
    if (!entry.is_regular_file(kind) || entry.path().extension() != kShardExtension) continue;
    const std::string name = entry.path().filename().string();
    all.push_back(entry.path().string());
    named_by_split |= name.rfind(shard_role_prefix(ShardRole::Train), 0) == 0 ||
                      name.rfind(shard_role_prefix(ShardRole::Val), 0) == 0;
    if (role != ShardRole::Any && name.rfind(prefix, 0) == 0) of_role.push_back(entry.path().string());
  }
  if (ec) fail("data: cannot list the directory ", dir, ": ", ec.message());
  std::vector<std::string>& found = role != ShardRole::Any && named_by_split ? of_role : all;
  std::sort(found.begin(), found.end());
  if (found.empty() && named_by_split)
    fail("data: directory ", dir, " holds shards of the other split but no ", prefix, "*", kShardExtension,
         " (a directory given as ", role == ShardRole::Train ? "training" : "validation",
         " data is read for its ", prefix, "* shards; name the files or a glob to use others)");
  return found;
}

}  // namespace

std::vector<std::string> expand_shard_paths(const std::vector<std::string>& specs, ShardRole role) {
  std::vector<std::string> paths;
  for (const std::string& spec : specs) {
    std::vector<std::string> found;
    if (is_glob(spec)) {
      glob_t g{};
      int rc = ::glob(spec.c_str(), 0, nullptr, &g);  // sorted by name
      if (rc == 0)
        for (size_t i = 0; i < g.gl_pathc; ++i) found.emplace_back(g.gl_pathv[i]);
      ::globfree(&g);
    } else {
      // Status calls with an error code: a symlink loop or an unreadable directory is an error naming the
      // spec, not a filesystem_error thrown from deep inside.
      std::error_code ec;
      const fs::file_status status = fs::status(spec, ec);
      if (ec && ec != std::errc::no_such_file_or_directory)
        fail("data: shard path ", spec, ": ", ec.message());
      if (fs::is_directory(status)) {
        found = directory_shards(spec, role);
      } else if (fs::exists(status)) {
        found.push_back(spec);  // ShardReader refuses anything but a regular file, by name
      } else {
        fail("data: shard path ", spec, " does not exist");
      }
    }
    if (found.empty())
      fail("data: no shards match ", spec,
           is_glob(spec) ? "" : str(" (a directory is read for *", kShardExtension, " files)"));
    paths.insert(paths.end(), found.begin(), found.end());
  }
  return paths;
}

// ---------------------------------------------------------------------------------------------------
// WindowPermutation

WindowPermutation::WindowPermutation(uint64_t n, uint64_t seed, uint64_t epoch) : n_(n) {
  TUNA_CHECK(n <= (uint64_t{1} << 62), "window count ", n, " exceeds the permutation's domain");
  half_bits_ = 0;
  while ((uint64_t{1} << (2 * half_bits_)) < n) ++half_bits_;
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
  uint64_t state = splitmix64(seed) ^ splitmix64(epoch + 0x632be59bd9b4e019ull);
  for (uint64_t& k : keys_) k = state = splitmix64(state);
}

uint64_t WindowPermutation::operator()(uint64_t i) const {
  TUNA_CHECK(i < n_, "index ", i, " of a permutation of ", n_);
  // Cycle walking: the Feistel network permutes [0, 4^h); following the cycle of i until it returns
  // inside [0, n) restricts it to a permutation of [0, n). The domain is below 4n, so on average fewer
  // than 4 steps.
  uint64_t x = i;
  do {
    uint64_t left = x >> half_bits_, right = x & half_mask_;
    for (uint64_t key : keys_) {
      uint64_t f = splitmix64(right ^ key) & half_mask_;
      uint64_t next_right = left ^ f;
      left = right;
      right = next_right;
    }
    x = (left << half_bits_) | right;
  } while (x >= n_);
  return x;
}

// ---------------------------------------------------------------------------------------------------
// DataLoader

DataLoader::DataLoader(const std::vector<std::string>& shard_specs, const LoaderOptions& options)
    : options_(options) {
  auto positive = [](const char* name, int64_t v) {
    if (v < 1) fail("data loader: option '", name, "' must be at least 1, found ", v);
  };
  positive("seq_len", options.seq_len);
  positive("micro_batch", options.micro_batch);
  positive("dp_size", options.dp_size);
  positive("vocab_size", options.vocab_size);
  if (options.dp_rank < 0 || options.dp_rank >= options.dp_size)
    fail("data loader: option 'dp_rank' must lie in [0, dp_size = ", options.dp_size, "), found ",
         options.dp_rank);

  const uint64_t T = static_cast<uint64_t>(options.seq_len);
  window_begin_.push_back(0);
  pair_begin_.push_back(0);
  // Pair windows of shard s: its pairs in order, as many to a window as fit in T tokens.
  auto pack_pairs = [&](const ShardReader& shard, size_t s) -> uint64_t {
    const size_t before = pair_windows_.size();
    PairWindow window{static_cast<uint32_t>(s), 0, 0};
    uint64_t used = 0;
    for (uint64_t p = 0; p < shard.pair_count(); ++p) {
      const uint64_t tokens = shard.document(2 * p + 1).second - shard.document(2 * p).first;
      if (tokens > T)
        fail("shard ", shard.path(), ": preference pair ", p, " holds ", tokens, " tokens (prompt + chosen, prompt + "
             "rejected), more than seq_len ", T, ": a pair is never cut or split over windows; prepare the data with "
             "--preference --seq_len ", T, " (which drops such pairs, counting them) or train with a longer seq_len");
      if (window.pairs > 0 && used + tokens > T) {
        pair_windows_.push_back(window);
        window.first_pair = p, window.pairs = 0, used = 0;
      }
      window.pairs++, used += tokens;
    }
    if (window.pairs > 0) pair_windows_.push_back(window);
    pair_begin_.push_back(pair_begin_.back() + shard.pair_count());
    return pair_windows_.size() - before;
  };
  for (const std::string& path : expand_shard_paths(shard_specs)) {
    ShardReader shard(path);
    if (shard.vocab_size() > static_cast<uint64_t>(options.vocab_size))
      fail("shard ", path, ": written by a tokenizer with vocab_size ", shard.vocab_size(),
           ", larger than the model's vocab_size ", options.vocab_size);
    if (options.tokenizer_fingerprint != 0 && shard.tokenizer_fingerprint() != 0 &&
        shard.tokenizer_fingerprint() != options.tokenizer_fingerprint) {
      const std::string writer = tokenizer_of_prepare_run(path);
      fail("shard ", path, ": written by another tokenizer (", writer.empty() ? std::string() : writer + ", ",
           "fingerprint ", hex(shard.tokenizer_fingerprint()), ") than the model's, ", options.tokenizer_name,
           " (fingerprint ", hex(options.tokenizer_fingerprint), "): prepare the data with the model's tokenizer");
    }
    // Without a tokenizer to compare with (a model trained from scratch, or a directory without one), the
    // shards must at least agree with each other: two tokenizers' tokens are never mixed.
    if (options.tokenizer_fingerprint == 0 && shard.tokenizer_fingerprint() != 0) {
      if (fingerprint_shard_.empty()) fingerprint_shard_ = path, fingerprint_ = shard.tokenizer_fingerprint();
      else if (shard.tokenizer_fingerprint() != fingerprint_)
        fail("shard ", path, ": written by another tokenizer (fingerprint ", hex(shard.tokenizer_fingerprint()),
             ") than shard ", fingerprint_shard_, " (fingerprint ", hex(fingerprint_),
             "): the shards of one run must come from one tokenizer");
    }
    const uint64_t n = shard.token_count();
    if (shards_.empty()) pairs_ = shard.has_pairs();
    if (shard.has_pairs() != pairs_)
      fail("shard ", path, pairs_ ? " holds no preference pairs, but " : " holds preference pairs, but ",
           shards_.front().path(), pairs_ ? " does" : " does not",
           ": the shards of one run are all pairs (prepare --preference) or none");
    // Training takes whole windows only. Evaluation scores every token once: a shard's tail (or a shard
    // shorter than a window: one short SFT conversation) is one more window, padded after its last token.
    // Pair shards: whole pairs packed into windows (see loader.h), the same for training and evaluation.
    const uint64_t windows = pairs_ ? pack_pairs(shard, shards_.size())
                             : options.eval ? (n >= 2 ? (n - 2) / T + 1 : 0) : (n >= T + 1 ? (n - 1) / T : 0);
    if (windows == 0) ++short_shards_;
    total_tokens_ += n;
    window_begin_.push_back(window_begin_.back() + windows);
    shards_.push_back(std::move(shard));
  }
  const uint64_t N = total_windows();
  const auto largest = [&] {
    return std::max_element(shards_.begin(), shards_.end(), [](const ShardReader& a, const ShardReader& b) {
             return a.token_count() < b.token_count();
           })->token_count();
  };
  if (N == 0 && !options.eval)
    fail("data: no training window in ", shards_.size(), " shard(s) (", shard_specs.front(),
         shard_specs.size() > 1 ? ", ..." : "", "): a window needs seq_len + 1 = ", T + 1,
         " tokens in one shard; the largest shard has ", largest(), ", all shards together ", total_tokens_);
  if (N == 0)
    fail("data: nothing to evaluate in ", shards_.size(), " shard(s) (", shard_specs.front(),
         shard_specs.size() > 1 ? ", ..." : "", "): every shard has fewer than 2 tokens (the largest has ", largest(),
         "); for a validation split, prepare with a larger --val-fraction, or train without one (--val_data \"\")");
  const uint64_t dp = static_cast<uint64_t>(options.dp_size);
  if (options.eval) {
    per_rank_ = (N + dp - 1) / dp;
  } else {
    per_rank_ = N / dp;
    if (per_rank_ == 0)
      fail("data: ", N, " window(s) of ", T + 1, " tokens for ", dp,
           " data-parallel ranks: every rank needs at least one");
  }
  row_.resize(T + 1);
}

uint64_t DataLoader::batches_per_epoch() const {
  const uint64_t B = static_cast<uint64_t>(options_.micro_batch);
  return options_.eval ? (per_rank_ + B - 1) / B : per_rank_ / B;
}

uint64_t DataLoader::window_at(uint64_t epoch, uint64_t position) const {
  const uint64_t slot =
      position * static_cast<uint64_t>(options_.dp_size) + static_cast<uint64_t>(options_.dp_rank);
  if (options_.eval) return slot;  // may be >= N: a padding row
  return WindowPermutation(total_windows(), options_.seed, epoch)(slot);
}

bool DataLoader::next(int32_t* inputs, int32_t* targets) { return next(inputs, targets, nullptr); }

bool DataLoader::next_windows(std::vector<uint64_t>& windows) {
  const int64_t B = options_.micro_batch;
  windows.clear();
  if (options_.eval) {
    if (position_ >= per_rank_) return false;
    for (int64_t b = 0; b < B; ++b, ++position_)
      windows.push_back(position_ < per_rank_ ? window_at(0, position_) : total_windows());  // past N: padding
    position_ = std::min(position_, per_rank_);
    return true;
  }
  // One permutation object per epoch touched: its keys cost four hashes, not worth caching across calls.
  WindowPermutation order(total_windows(), options_.seed, epoch_);
  const uint64_t dp = static_cast<uint64_t>(options_.dp_size), rank = static_cast<uint64_t>(options_.dp_rank);
  for (int64_t b = 0; b < B; ++b) {
    if (position_ == per_rank_) {
      ++epoch_;
      position_ = 0;
      order = WindowPermutation(total_windows(), options_.seed, epoch_);
    }
    windows.push_back(order(position_ * dp + rank));
    ++position_;
  }
  return true;
}

bool DataLoader::next(int32_t* inputs, int32_t* targets, int32_t* positions) {
  if (pairs_)
    fail("data: the shards hold preference pairs (", shards_.front().path(), "): train them with a preference "
         "objective (--objective dpo, simpo or orpo)");
  const int64_t T = options_.seq_len;
  if (!next_windows(windows_)) return false;
  for (size_t b = 0; b < windows_.size(); ++b) {
    if (windows_[b] < total_windows()) {
      fill_row(windows_[b], inputs + b * T, targets + b * T, positions ? positions + b * T : nullptr);
    } else {
      if (positions) std::fill(positions + b * T, positions + (b + 1) * T, 0);
      std::fill(inputs + b * T, inputs + (b + 1) * T, 0);
      std::fill(targets + b * T, targets + (b + 1) * T, cpu::kIgnoreIndex);
    }
  }
  return true;
}

bool DataLoader::next_pairs(int32_t* inputs, int32_t* targets, int32_t* positions, int32_t* sequence,
                            uint8_t* completion, std::vector<uint64_t>* pair_ids) {
  if (!pairs_)
    fail("data: a preference objective needs shards of preference pairs (prepare --preference); ",
         shards_.front().path(), " holds plain documents");
  TUNA_CHECK(positions && sequence && completion && pair_ids, "next_pairs needs every output");
  const int64_t T = options_.seq_len;
  pair_ids->clear();
  if (!next_windows(windows_)) return false;
  for (size_t b = 0; b < windows_.size(); ++b) {
    if (windows_[b] < total_windows()) {
      fill_pair_row(windows_[b], inputs + b * T, targets + b * T, positions + b * T, sequence + b * T,
                    completion + b * T, pair_ids);
    } else {
      std::fill(positions + b * T, positions + (b + 1) * T, 0);
      std::fill(inputs + b * T, inputs + (b + 1) * T, 0);
      std::fill(targets + b * T, targets + (b + 1) * T, cpu::kIgnoreIndex);
      std::fill(sequence + b * T, sequence + (b + 1) * T, -1);
      std::fill(completion + b * T, completion + (b + 1) * T, 0);
    }
  }
  return true;
}

void DataLoader::fill_pair_row(uint64_t w, int32_t* inputs, int32_t* targets, int32_t* positions, int32_t* sequence,
                               uint8_t* completion, std::vector<uint64_t>* pair_ids) {
  const PairWindow& window = pair_windows_[w];
  const ShardReader& shard = shards_[window.shard];
  const int64_t T = options_.seq_len;
  const int64_t vocab = std::min<int64_t>(options_.vocab_size, shard.vocab_size());
  const uint8_t* mask = shard.mask_data();
  int64_t at = 0;
  for (uint64_t p = window.first_pair; p < window.first_pair + window.pairs; ++p) {
    const int32_t pair = static_cast<int32_t>(pair_ids->size());
    pair_ids->push_back(pair_begin_[window.shard] + p);
    for (int half = 0; half < 2; ++half) {
      const auto [begin, end] = shard.document(2 * p + half);
      const int64_t n = static_cast<int64_t>(end - begin);
      shard.read_tokens(begin, end - begin, inputs + at);
      for (int64_t j = 0; j < n; ++j) {
        const int32_t token = inputs[at + j];
        if (token < 0 || token >= vocab)
          fail("shard ", shard.path(), ": token ", begin + j, " is ", static_cast<uint32_t>(token), ", outside ",
               vocab == options_.vocab_size ? "the model's vocabulary" : "the vocabulary its header declares", " [0, ",
               vocab, ")");
        if (mask[begin + j] > 1)
          fail("shard ", shard.path(), ": loss mask of token ", begin + j, " must be 0 or 1, found ", int{mask[begin + j]});
        positions[at + j] = static_cast<int32_t>(j);
        sequence[at + j] = 2 * pair + half;
        const bool last = j + 1 == n;
        targets[at + j] = last ? cpu::kIgnoreIndex : static_cast<int32_t>(shard.token(begin + j + 1));
        completion[at + j] = last ? 0 : mask[begin + j + 1];
      }
      at += n;
    }
  }
  TUNA_CHECK(at <= T, "pair window ", w, " holds ", at, " tokens for seq_len ", T);
  std::fill(inputs + at, inputs + T, 0);
  std::fill(targets + at, targets + T, cpu::kIgnoreIndex);
  std::fill(positions + at, positions + T, 0);
  std::fill(sequence + at, sequence + T, -1);
  std::fill(completion + at, completion + T, 0);
}

void DataLoader::fill_row(uint64_t window, int32_t* inputs, int32_t* targets, int32_t* positions) {
  const uint64_t T = static_cast<uint64_t>(options_.seq_len);
  const size_t s = static_cast<size_t>(std::upper_bound(window_begin_.begin(), window_begin_.end(), window) -
                                       window_begin_.begin() - 1);
  const ShardReader& shard = shards_[s];
  const uint64_t start = (window - window_begin_[s]) * T;
  // An evaluation window at a shard's end holds fewer than T + 1 tokens: inputs past them are 0 and their
  // targets ignored (causal attention: they change no earlier position's logits).
  const uint64_t have = std::min<uint64_t>(T + 1, shard.token_count() - start);
  shard.read_tokens(start, have, row_.data());
  // Below the model's vocabulary, and below the vocab_size the shard's own header declares (checked here,
  // as the tokens are read, rather than by a scan of every shard at open).
  const int64_t vocab = std::min<int64_t>(options_.vocab_size, shard.vocab_size());
  for (uint64_t i = 0; i < have; ++i)
    if (row_[i] < 0 || row_[i] >= vocab)
      fail("shard ", shard.path(), ": token ", start + i, " is ", static_cast<uint32_t>(row_[i]), ", outside ",
           vocab == options_.vocab_size ? "the model's vocabulary" : "the vocabulary its header declares", " [0, ",
           vocab, ")");
  std::fill(row_.begin() + static_cast<int64_t>(have), row_.end(), 0);
  std::copy(row_.begin(), row_.begin() + static_cast<int64_t>(T), inputs);
  const uint8_t* mask = shard.mask_data();
  for (uint64_t j = 0; j < T; ++j) {
    if (j + 1 >= have) {
      targets[j] = cpu::kIgnoreIndex;
      continue;
    }
    int32_t target = row_[j + 1];
    if (mask) {
      uint8_t m = mask[start + j + 1];
      if (m > 1)
        fail("shard ", shard.path(), ": loss mask of token ", start + j + 1, " must be 0 or 1, found ",
             int{m});
      if (m == 0) target = cpu::kIgnoreIndex;
    }
    targets[j] = target;
  }
  if (positions) {
    uint64_t d = shard.document_of(start);
    for (uint64_t j = 0; j < T; ++j) {
      if (j >= have) {  // padding
        positions[j] = 0;
        continue;
      }
      while (start + j >= shard.document(d).second) ++d;  // skips empty documents too
      positions[j] = static_cast<int32_t>(start + j - shard.document(d).first);
    }
  }
}

LoaderCursor DataLoader::cursor() const {
  LoaderCursor c;
  c.epoch = epoch_;
  c.position = position_;
  c.seed = options_.seed;
  c.seq_len = options_.seq_len;
  c.dp_size = options_.dp_size;
  c.total_windows = total_windows();
  c.has_segment = true;
  c.segment_step = segment_.segment_step, c.segment_epoch = segment_.segment_epoch;
  c.segment_position = segment_.segment_position;
  return c;
}

void DataLoader::set_cursor(const LoaderCursor& c) {
  auto same = [](const char* field, auto saved, auto here) {
    if (saved != here)
      fail("data cursor: field '", field, "': the cursor was saved with ", saved, ", this loader has ", here,
           "; resuming would not reproduce the data order (same shards, seq_len, dp_size and seed needed)");
  };
  same("seed", c.seed, options_.seed);
  same("seq_len", c.seq_len, options_.seq_len);
  same("dp_size", c.dp_size, options_.dp_size);
  same("total_windows", c.total_windows, total_windows());
  if (c.position > per_rank_)
    fail("data cursor: field 'position': ", c.position, " is past the ", per_rank_,
         " windows this rank takes per epoch");
  epoch_ = c.epoch;
  position_ = c.position;
  segment_ = c;
}

}  // namespace tuna
