// DataLoader: fixed-length training sequences from token shards, disjoint across data-parallel ranks,
// shuffled per epoch, with a cursor that resumes exactly.
//
// Windows. Window w of a shard is its tokens [w*T, w*T + T + 1): inputs are the first T, targets the
// last T (the same window shifted by one). Windows pack across document boundaries (BOS/EOS mark them)
// and consecutive windows share one token, so every token of a shard but the first is a target exactly
// once. A shard of n tokens holds floor((n - 1) / T) training windows; one with fewer than T + 1 tokens
// holds none (counted in short_shards()). Evaluation scores every target once: the shard's tail (or a shard
// shorter than a window, such as one short SFT conversation) is one more window, padded after its last token
// (inputs 0, targets kIgnoreIndex), so a shard of n >= 2 tokens holds ceil((n - 1) / T) evaluation windows.
// A target whose token has loss mask 0 becomes kIgnoreIndex (-100).
//
// Order (training). All windows of all shards are numbered 0..N-1 (shard order, then window order) and
// epoch e visits them in the order of a pseudo-random permutation drawn from (seed, e). Rank r of dp takes
// positions r, r + dp, r + 2*dp, ... of that order, so ranks never share a window; each rank takes
// floor(N / dp) windows per epoch, the remainder is dropped that epoch (a different remainder every epoch).
// A batch that reaches the end of an epoch continues into the next one: every batch is full.
//
// The permutation is a 4-round Feistel network over the smallest power-of-4 domain >= N with cycle
// walking, keyed by splitmix64 of (seed, epoch): a bijection computed per index in O(1) memory and time,
// identical on every platform (no std::shuffle, no distribution objects), so the position of a window in
// the order is a pure function and seeking to a cursor costs nothing even with a billion windows.
//
// Order (eval). Windows in their natural order, once: rank r takes r, r + dp, ...; each rank runs
// ceil(N / dp) positions so all ranks make the same number of calls, and a position past N (and the tail
// of the last batch) is a padding row: inputs 0, targets all kIgnoreIndex, so it adds nothing to a loss.
//
// Preference pairs (shards of version 3 with the pairs flag, data/shard.h). A pair never straddles two windows, and
// many share one: pair windows are packed once, at open, greedily in shard order: a window takes the shard's next
// pairs while their documents' tokens (prompt + chosen, prompt + rejected) fit in T, each document whole and
// consecutive, its positions restarting, the rest of the window padding (inputs 0, targets kIgnoreIndex). A
// document's targets are its own next tokens (its last token's is kIgnoreIndex), the prompt's too, so that ORPO's
// NLL can take them; PairRows says which sequence each token is in and whether its target is a completion token.
// A pair longer than T is an error naming the shard and the pair (prepare --preference --seq_len drops them). The
// order, the split over ranks, eval padding and the cursor are those of plain windows. The shards of one loader are
// all pair shards or none.
//
// Cursor. (epoch, position): position counts the windows this rank has taken in `epoch`. It is the same
// number on every rank (they move in lockstep), so one cursor in state.json serves them all, and it does
// not depend on micro_batch. set_cursor(c) makes the following batches equal to those the original run
// produced after reaching c.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "data/shard.h"

namespace tuna {

struct LoaderOptions {
  int64_t seq_len = 0;      // T: tokens per sequence
  int64_t micro_batch = 1;  // B: sequences per next()
  int64_t dp_rank = 0;
  int64_t dp_size = 1;
  uint64_t seed = 0;
  int64_t vocab_size = 0;  // the model's: every shard's vocabulary and every token must fit under it
  bool eval = false;       // windows once, in order, no shuffle (see above)
  // The model's tokenizer (Tokenizer::fingerprint) and its name for messages; 0: not checked. A shard that
  // records another fingerprint is refused (shards of version 1 record none and pass).
  uint64_t tokenizer_fingerprint = 0;
  std::string tokenizer_name;
};

struct LoaderCursor {
  uint64_t epoch = 0;
  uint64_t position = 0;  // windows this rank has taken in `epoch`
  // The data order the cursor belongs to, filled by DataLoader::cursor(); set_cursor refuses a cursor
  // whose order differs, since resuming it would silently train on other data.
  uint64_t seed = 0;
  int64_t seq_len = 0;
  int64_t dp_size = 0;
  uint64_t total_windows = 0;
  // Where this run's segment (one process's life: constant micro_batch, grad_accum and dp_size) began: its
  // first step and cursor, carried unchanged by the loader, so that a resume can check the cursor against
  // the step (check_cursor_progress). Absent (has_segment false) in checkpoints written before it existed.
  bool has_segment = true;
  uint64_t segment_step = 0, segment_epoch = 0, segment_position = 0;

  bool operator==(const LoaderCursor&) const = default;
};

// {"epoch", "position", "seed", "seq_len", "dp_size", "total_windows", "segment": {"step", "epoch",
// "position"}}. from_json fails with a message naming the missing or mistyped field ("segment" is optional).
void to_json(nlohmann::json& j, const LoaderCursor& c);
void from_json(const nlohmann::json& j, LoaderCursor& c);

// A resume's checks and conversion of a saved cursor, every product checked for overflow.
// check_cursor_progress: from its segment's start to `step`, a rank takes windows_per_step (micro_batch x
// grad_accum) windows a step, so epoch x windows_per_epoch + position must be exactly that far past the
// segment's start (a hand-edited position or epoch, or a cursor of another checkpoint, is refused naming both).
// reshard_cursor: the cursor of c.dp_size ranks for dp_size ranks (the same global count of windows consumed
// in the epoch, spread over a different number of ranks); it must divide evenly.
void check_cursor_progress(const LoaderCursor& c, uint64_t step, uint64_t windows_per_step, const std::string& where);
LoaderCursor reshard_cursor(LoaderCursor c, int64_t dp_size);

// Which split a list of shards is for. build/prepare writes both splits into one directory (train-*.bin,
// val-*.bin), so a directory given for one role must not take the other's shards.
enum class ShardRole { Any, Train, Val };
const char* shard_role_prefix(ShardRole role);  // "train-", "val-", "" for Any

// Expands shard specs in the order given: a file is itself; anything with * ? or [ is a glob pattern, matches
// in name order; a directory is its "*.bin" files (directly inside it, in name order), and for a role, only
// that role's: a directory holding train-*.bin or val-*.bin files (a prepare output) gives its train-* shards
// for ShardRole::Train and its val-* shards for ShardRole::Val, and fails when it has none of the role's; a
// directory with neither prefix gives all its shards. A spec that matches nothing is an error.
std::vector<std::string> expand_shard_paths(const std::vector<std::string>& specs, ShardRole role = ShardRole::Any);
// The same check at a tool's start, before anything is loaded: a spec that matches no shard fails naming the
// option it came from (--val_data, --train_data). No spec: nothing to check.
void check_shard_specs(const std::string& option, const std::vector<std::string>& specs, ShardRole role);

class DataLoader {
 public:
  // Opens and validates every shard (see ShardReader), refuses a shard whose vocab_size exceeds
  // options.vocab_size or that another tokenizer wrote (options.tokenizer_fingerprint), and fails when there is no window at all (saying how many tokens were found
  // against the T + 1 needed) or fewer windows than ranks.
  DataLoader(const std::vector<std::string>& shard_specs, const LoaderOptions& options);

  // Fills inputs and targets, each [micro_batch, seq_len] row-major. Training: always a full batch,
  // returns true. Eval: returns false (writing nothing) once the pass is over; call reset() to run it
  // again. A token id outside [0, vocab_size) is a tuna::Error naming the shard, the token index, the value.
  bool next(int32_t* inputs, int32_t* targets);
  // Pair shards: the same, and the micro-batch's sequences (model/objective.h PairRows): sequence[B * T] (2p, 2p + 1
  // for the micro-batch's pair p, -1 for padding), completion[B * T], and *pair_ids (cleared, then one per pair: its
  // index among all pairs of all shards, the key of a precomputed reference). positions are required.
  bool next_pairs(int32_t* inputs, int32_t* targets, int32_t* positions, int32_t* sequence, uint8_t* completion,
                  std::vector<uint64_t>* pair_ids);
  // The same, and document boundaries: positions[b * T + j] is input token j's position inside its
  // document (0 where a document starts), so that a trainer can restart positions or mask attention at
  // boundaries. A padding row of the eval pass gets positions 0. With SFT shards, targets already carry the
  // loss mask (prompt tokens are kIgnoreIndex).
  bool next(int32_t* inputs, int32_t* targets, int32_t* positions);

  LoaderCursor cursor() const;
  void set_cursor(const LoaderCursor& cursor);
  void reset() { epoch_ = 0, position_ = 0; }  // back to the start of epoch 0 (the eval pass)

  const LoaderOptions& options() const { return options_; }
  // Positions this rank runs per epoch: floor(N / dp) in training, ceil(N / dp) in eval (with padding).
  uint64_t windows_per_epoch() const { return per_rank_; }
  // next() calls per epoch: floor in training (a batch may straddle epochs), ceil in eval.
  uint64_t batches_per_epoch() const;
  uint64_t total_windows() const { return window_begin_.back(); }  // N, all ranks together
  uint64_t total_tokens() const { return total_tokens_; }          // in all shards
  size_t shard_count() const { return shards_.size(); }
  size_t short_shards() const { return short_shards_; }  // shards with fewer than T + 1 tokens
  bool pairs() const { return pairs_; }                  // the shards hold preference pairs
  uint64_t total_pairs() const { return pair_begin_.empty() ? 0 : pair_begin_.back(); }
  // Pairs that pair window w holds (pair shards).
  uint32_t pairs_in_window(uint64_t w) const { return pair_windows_[w].pairs; }
  const ShardReader& shard(size_t i) const { return shards_[i]; }

  // The global window index that this rank reads at (epoch, position) in training mode; exposed for tests.
  uint64_t window_at(uint64_t epoch, uint64_t position) const;

 private:
  void fill_row(uint64_t window, int32_t* inputs, int32_t* targets, int32_t* positions);
  // A pair window's row; sequence numbers start at 2 * *pairs, which grows by the window's pairs.
  void fill_pair_row(uint64_t window, int32_t* inputs, int32_t* targets, int32_t* positions, int32_t* sequence,
                     uint8_t* completion, std::vector<uint64_t>* pair_ids);
  // The windows of this rank's next batch (training: continuing into the next epoch; eval: past N is padding).
  bool next_windows(std::vector<uint64_t>& windows);
  struct PairWindow {
    uint32_t shard = 0, pairs = 0;
    uint64_t first_pair = 0;  // in its shard
  };

  LoaderOptions options_;
  std::vector<ShardReader> shards_;
  std::vector<uint64_t> window_begin_;  // window_begin_[s] = windows in shards before s; back() = N
  uint64_t total_tokens_ = 0;
  size_t short_shards_ = 0;
  uint64_t per_rank_ = 0;
  uint64_t epoch_ = 0;
  LoaderCursor segment_;  // the segment the cursor carries (see LoaderCursor)
  std::string fingerprint_shard_;  // the first shard with a fingerprint, when the model has no tokenizer
  uint64_t fingerprint_ = 0;
  uint64_t position_ = 0;
  std::vector<int32_t> row_;  // T + 1 tokens of the window being copied
  bool pairs_ = false;
  std::vector<PairWindow> pair_windows_;  // pair shards: every window, in window order
  std::vector<uint64_t> pair_begin_;      // pair shards: pairs in shards before s; back() = all pairs
  std::vector<uint64_t> windows_;         // scratch: this batch's windows
};

// A bijection of [0, n) drawn from (seed, epoch); see the comment at the top. Exposed for tests.
class WindowPermutation {
 public:
  WindowPermutation(uint64_t n, uint64_t seed, uint64_t epoch);
  uint64_t operator()(uint64_t i) const;

 private:
  uint64_t n_;
  int half_bits_;
  uint64_t half_mask_;
  uint64_t keys_[4];
};

}  // namespace tuna
