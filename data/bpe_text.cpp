// The text operations of a tokenizer.json pipeline: see data/bpe_text.h.
#include "data/bpe_text.h"

#include <algorithm>
#include <cctype>

#include "data/clean.h"  // is_valid_utf8

namespace tuna::bpe_text {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof buffer);
  return reinterpret_cast<const char*>(buffer);
}

Regex::Regex(const TextPattern& pattern, const std::string& path, const std::string& what) : path_(path), what_(what) {
  int code;
  PCRE2_SIZE offset;
  const uint32_t options = PCRE2_UTF | PCRE2_NO_UTF_CHECK | (pattern.regex ? PCRE2_UCP : PCRE2_LITERAL);
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.text.data()), pattern.text.size(), options, &code, &offset,
                        nullptr);
  if (!code_)
    fail("tokenizer ", path, ": ", what, ": the regex does not compile at offset ", offset, " (", pcre2_message(code),
         "): ", pattern.text);
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
}

void apply_behavior(SplitBehavior behavior, std::vector<Event>* events) {
  std::vector<Event>& e = *events;
  std::vector<Event> out;
  out.reserve(e.size());
  bool previous = false;
  switch (behavior) {
    case SplitBehavior::isolated:
      for (Event& x : e) x.match = false;
      return;
    case SplitBehavior::removed:
      std::erase_if(e, [](const Event& x) { return x.match; });
      return;
    case SplitBehavior::contiguous:
      for (const Event& x : e) {
        if (x.match == previous && !out.empty()) out.back().end = x.end;
        else out.push_back({x.begin, x.end, false});
        previous = x.match;
      }
      break;
    case SplitBehavior::merged_with_previous:
      for (const Event& x : e) {
        if (x.match && !previous && !out.empty()) out.back().end = x.end;
        else out.push_back({x.begin, x.end, false});
        previous = x.match;
      }
      break;
    case SplitBehavior::merged_with_next:
      for (auto it = e.rbegin(); it != e.rend(); ++it) {
        if (it->match && !previous && !out.empty()) out.back().begin = it->begin;
        else out.push_back({it->begin, it->end, false});
        previous = it->match;
      }
      std::reverse(out.begin(), out.end());
      break;
  }
  e = std::move(out);
}


std::string replace_all(const Regex& regex, std::string_view text, std::string_view content) {
  std::string out;
  out.reserve(text.size());
  size_t prev = 0;
  regex.matches(text, [&](size_t begin, size_t end) {
    out.append(text.substr(prev, begin - prev));
    out.append(content);
    prev = end;
  });
  out.append(text.substr(prev));
  return out;
}

std::vector<std::string> decode_step(const DecoderStep& d, const Regex* regex, std::vector<std::string> tokens) {
  using K = DecoderStep::Kind;
  std::vector<std::string> out;
  switch (d.kind) {
    case K::byte_level: {
      std::string bytes, piece;
      for (const std::string& t : tokens) {
        if (byte_level_decode(t, &piece)) bytes += piece;
        else bytes += t;  // a token outside the alphabet (an added token) stays as written
      }
      out.push_back(unicode::lossy_utf8(bytes));
      return out;
    }
    case K::metaspace:
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::string t;
        const std::string& s = tokens[i];
        for (size_t at = 0; at < s.size();) {
          if (s.compare(at, d.content.size(), d.content) == 0) {
            if (!(i == 0 && d.prepend)) t += ' ';
            at += d.content.size();
          } else {
            t += s[at++];
          }
        }
        out.push_back(std::move(t));
      }
      return out;
    case K::byte_fallback: {
      std::string run;
      int run_count = 0;
      auto flush = [&] {
        if (run_count == 0) return;
        if (is_valid_utf8(run)) out.push_back(run);
        else
          for (int i = 0; i < run_count; ++i) out.push_back("\xEF\xBF\xBD");
        run.clear();
        run_count = 0;
      };
      for (std::string& t : tokens) {
        int byte = -1;
        if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && std::isxdigit(static_cast<uint8_t>(t[3])) &&
            std::isxdigit(static_cast<uint8_t>(t[4])))
          byte = std::stoi(t.substr(3, 2), nullptr, 16);
        if (byte >= 0) {
          run.push_back(static_cast<char>(byte));
          ++run_count;
        } else {
          flush();
          out.push_back(std::move(t));
        }
      }
      flush();
      return out;
    }
    case K::fuse: {
      std::string joined;
      for (const std::string& t : tokens) joined += t;
      out.push_back(std::move(joined));
      return out;
    }
    case K::strip:
      for (const std::string& t : tokens) {
        std::vector<std::pair<size_t, size_t>> chars;  // byte ranges of the characters
        for (size_t i = 0; i < t.size();) {
          const size_t at = i;
          unicode::next_code_point(t, &i);
          chars.emplace_back(at, i);
        }
        auto is_content = [&](size_t c) { return t.compare(chars[c].first, chars[c].second - chars[c].first, d.content) == 0; };
        size_t start_cut = 0, stop_cut = chars.size();
        for (size_t c = 0; c < std::min(d.start, chars.size()) && is_content(c); ++c) start_cut = c + 1;
        for (size_t i = 0; i < d.stop && i < chars.size(); ++i) {
          const size_t c = chars.size() - i - 1;
          if (!is_content(c)) break;
          stop_cut = c;
        }
        out.push_back(stop_cut > start_cut ? t.substr(chars[start_cut].first, chars[stop_cut - 1].second - chars[start_cut].first)
                                           : std::string());
      }
      return out;
    case K::replace:
      for (const std::string& t : tokens) out.push_back(replace_all(*regex, t, d.content));
      return out;
    case K::bpe_suffix:
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::string t;
        const std::string& s = tokens[i];
        const std::string with = i + 1 == tokens.size() ? "" : " ";
        for (size_t at = 0; at < s.size();) {
          if (!d.content.empty() && s.compare(at, d.content.size(), d.content) == 0) {
            t += with;
            at += d.content.size();
          } else {
            t += s[at++];
          }
        }
        out.push_back(std::move(t));
      }
      return out;
  }
  return tokens;
}

}  // namespace tuna::bpe_text
