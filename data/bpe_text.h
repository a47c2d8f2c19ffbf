// The text operations of a tokenizer.json pipeline (data/byte_bpe.cpp): regexes matched as the library's engine
// (Oniguruma) finds them, through PCRE2; a split's behaviours over its matches; replace; and the decoders over token
// strings. Internal to data/: the tokenizer is data/byte_bpe.h.
#pragma once

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "data/byte_bpe.h"  // TextPattern, SplitBehavior, DecoderStep
#include "data/unicode.h"

namespace tuna::bpe_text {

std::string pcre2_message(int code);

// Per-thread match state: the match data (only the whole match is read) and a JIT stack that grows to 8 MB,
// enough for \s+(?!\S) over megabytes of spaces.
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

// One match or one stretch between matches.
struct Event {
  size_t begin, end;
  bool match;
};

class Regex {
 public:
  // what: where the pattern is, for errors ("pre_tokenizer Split").
  Regex(const TextPattern& pattern, const std::string& path, const std::string& what);
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls fn(begin, end) for every match, in order, as Oniguruma's find_iter yields them: an empty match is
  // reported, except one right where the previous match ended (the search then steps over one character).
  template <typename Fn>
  void matches(std::string_view text, Fn&& fn) const {
    thread_local MatchState state;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t at = 0;
    bool matched = false;
    size_t last_end = 0;
    while (at <= text.size()) {
      const int rc = jit_ ? pcre2_jit_match(code_, subject, text.size(), at, 0, state.data, state.context)
                          : pcre2_match(code_, subject, text.size(), at, PCRE2_NO_UTF_CHECK, state.data, state.context);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) fail("tokenizer ", path_, ": ", what_, ": the regex failed at byte ", at, ": ", pcre2_message(rc));
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(state.data);
      const size_t begin = ov[0], end = ov[1];
      if (begin < at || end < begin || end > text.size())
        fail("tokenizer ", path_, ": ", what_, ": the regex reported a match at bytes [", begin, ", ", end, ") from byte ",
             at, " (a \\K inside a lookaround?)");
      if (begin == end && matched && last_end == end) {
        if (at == text.size()) break;
        ++at;
        while (at < text.size() && (static_cast<uint8_t>(text[at]) & 0xC0) == 0x80) ++at;
        continue;
      }
      fn(begin, end);
      matched = true;
      last_end = at = end;
    }
  }

  // The matches and the stretches between them, covering text (the library's Pattern::find_matches).
  void events(std::string_view text, std::vector<Event>* out) const {
    out->clear();
    if (text.empty()) {
      out->push_back({0, 0, false});
      return;
    }
    size_t prev = 0;
    matches(text, [&](size_t begin, size_t end) {
      if (prev != begin) out->push_back({prev, begin, false});
      out->push_back({begin, end, true});
      prev = end;
    });
    if (prev != text.size()) out->push_back({prev, text.size(), false});
  }

 private:
  std::string path_, what_;
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// Events of a per-character predicate: each matching character is a match of its own.
template <typename Pred>
void char_events(std::string_view text, Pred&& pred, std::vector<Event>* out) {
  out->clear();
  if (text.empty()) {
    out->push_back({0, 0, false});
    return;
  }
  size_t last = 0;
  for (size_t i = 0; i < text.size();) {
    const size_t at = i;
    const uint32_t cp = unicode::next_code_point(text, &i);
    if (!pred(cp)) continue;
    if (last < at) out->push_back({last, at, false});
    out->push_back({at, i, true});
    last = i;
  }
  if (last < text.size()) out->push_back({last, text.size(), false});
}

// What a split keeps of its events (the library's NormalizedString::split), in place: the pieces to keep, as
// events with match = false (removed ones are dropped).
void apply_behavior(SplitBehavior behavior, std::vector<Event>* events);

// Replaces every match of a regex (the library's NormalizedString::replace and the Replace decoder).
std::string replace_all(const Regex& regex, std::string_view text, std::string_view content);

// One decoder over the token strings (the library's Decoder::decode_chain); regex: a Replace decoder's pattern.
std::vector<std::string> decode_step(const DecoderStep& d, const Regex* regex, std::vector<std::string> tokens);

}  // namespace tuna::bpe_text
