// Cleaning and quality filters: see data/clean.h.
#include "data/clean.h"

#include <xxhash.h>

#include <algorithm>
#include <unordered_set>
#include <vector>

namespace tuna {

size_t decode_utf8(std::string_view s, size_t i, uint32_t* cp) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[i + k]); };
  const uint8_t c = b(0);
  if (c < 0x80) return *cp = c, 1;
  auto cont = [&](size_t k) { return i + k < s.size() && (b(k) & 0xC0) == 0x80; };
  if (c >= 0xC2 && c <= 0xDF) {
    if (!cont(1)) return 0;
    *cp = (uint32_t{c} & 0x1F) << 6 | (b(1) & 0x3F);
    return 2;
  }
  if (c >= 0xE0 && c <= 0xEF) {
    if (!cont(1) || !cont(2)) return 0;
    *cp = (uint32_t{c} & 0x0F) << 12 | (uint32_t{b(1)} & 0x3F) << 6 | (b(2) & 0x3F);
    if (*cp < 0x800 || (*cp >= 0xD800 && *cp <= 0xDFFF)) return 0;
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (!cont(1) || !cont(2) || !cont(3)) return 0;
    *cp = (uint32_t{c} & 0x07) << 18 | (uint32_t{b(1)} & 0x3F) << 12 | (uint32_t{b(2)} & 0x3F) << 6 |
          (b(3) & 0x3F);
    if (*cp < 0x10000 || *cp > 0x10FFFF) return 0;
    return 4;
  }
  return 0;
}

namespace {

bool is_horizontal_space(uint32_t cp) {
  return cp == ' ' || cp == '\t' || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}
bool is_vertical_space(uint32_t cp) {
  return cp == '\n' || cp == 0x0B || cp == 0x0C || cp == 0x85 || cp == 0x2028 || cp == 0x2029;
}
bool is_control(uint32_t cp) { return cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp <= 0x9F); }
bool is_invisible(uint32_t cp) { return cp == 0x200B || cp == 0xFEFF; }

bool is_letter(uint32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  if (cp < 0xC0 || cp == 0xD7 || cp == 0xF7) return false;  // Latin-1 symbols
  if (cp >= 0x2000 && cp <= 0x2BFF) return false;           // punctuation, symbols, arrows, box drawing
  if (cp >= 0x3000 && cp <= 0x303F) return false;           // CJK punctuation
  if (cp == 0xFFFD) return false;
  return true;
}

}  // namespace

bool clean_text(std::string_view in, const CleanOptions& options, std::string* out, CleanResult* result) {
  *result = CleanResult{};
  out->clear();
  out->reserve(in.size());
  bool pending_space = false;  // a run of horizontal space not written yet
  int pending_newlines = 0;    // line ends not written yet
  bool line_start = true;

  auto emit_bytes = [&](const char* p, size_t n) {
    if (options.keep_whitespace) {
      out->append(p, n);
      return;
    }
    if (pending_newlines > 0 && !out->empty()) {
      out->append(static_cast<size_t>(std::min(pending_newlines, 2)), '\n');
      line_start = true;
    }
    if (pending_space && !line_start) out->push_back(' ');
    pending_space = false;
    pending_newlines = 0;
    line_start = false;
    out->append(p, n);
  };
  auto newline = [&] {
    if (options.keep_whitespace) return out->push_back('\n');
    ++pending_newlines;
    pending_space = false;
  };

  for (size_t i = 0; i < in.size();) {
    // Fast path: a run of printable ASCII other than space (most of any Latin-script text) goes out whole.
    size_t run = i;
    while (run < in.size() && static_cast<uint8_t>(in[run]) > 0x20 && static_cast<uint8_t>(in[run]) < 0x7F) ++run;
    if (run > i) {
      emit_bytes(in.data() + i, run - i);
      i = run;
      continue;
    }
    uint32_t cp;
    size_t len = decode_utf8(in, i, &cp);
    if (len == 0) {
      result->invalid_utf8 = true;
      if (options.drop_invalid_utf8) return false;
      emit_bytes("\xEF\xBF\xBD", 3);  // U+FFFD
      ++i;
      continue;
    }
    const char* bytes = in.data() + i;
    i += len;
    if (cp == '\r') {
      if (i < in.size() && in[i] == '\n') ++i;
      newline();
    } else if (is_vertical_space(cp)) {
      newline();
    } else if (is_horizontal_space(cp)) {
      if (options.keep_whitespace)
        out->append(bytes, len);
      else
        pending_space = true;
    } else if (is_control(cp)) {
      (cp == 0 ? result->nul_bytes : result->control_chars) = true;
    } else if (is_invisible(cp)) {
      // dropped silently: a BOM or zero-width space carries no text
    } else {
      emit_bytes(bytes, len);
    }
  }
  return true;
}

bool is_valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    uint32_t cp;
    const size_t len = decode_utf8(s, i, &cp);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::string repair_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 16);
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const size_t len = decode_utf8(s, i, &cp);
    if (len == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
    } else {
      out.append(s.data() + i, len);
      i += len;
    }
  }
  return out;
}

const char* quality_rule_name(QualityRule rule) {
  switch (rule) {
    case QualityRule::pass:
      return "pass";
    case QualityRule::too_short:
      return "too_short";
    case QualityRule::too_long:
      return "too_long";
    case QualityRule::low_alpha:
      return "low_alpha";
    case QualityRule::repeated_lines:
      return "repeated_lines";
  }
  return "?";
}

QualityRule quality_check(std::string_view text, const QualityOptions& o, QualityMeasure* measure) {
  auto failed = [&](QualityRule rule, const char* name, double value, double limit) {
    if (measure) *measure = {name, value, limit};
    return rule;
  };
  uint64_t chars = 0, letters = 0, visible = 0;
  for (size_t i = 0; i < text.size();) {
    uint32_t cp;
    size_t len = decode_utf8(text, i, &cp);
    if (len == 0) cp = 0xFFFD, len = 1;  // cleaned text is valid; tolerate raw text all the same
    i += len;
    ++chars;
    if (cp == ' ' || cp == '\n' || cp == '\t' || cp == '\r') continue;
    ++visible;
    letters += is_letter(cp);
  }
  if (chars < o.min_chars)
    return failed(QualityRule::too_short, "chars", static_cast<double>(chars), static_cast<double>(o.min_chars));
  if (o.max_chars > 0 && chars > o.max_chars)
    return failed(QualityRule::too_long, "chars", static_cast<double>(chars), static_cast<double>(o.max_chars));
  if (o.min_alpha_fraction > 0 && static_cast<double>(letters) < o.min_alpha_fraction * static_cast<double>(visible))
    return failed(QualityRule::low_alpha, "alpha_fraction", static_cast<double>(letters) / static_cast<double>(visible),
                  o.min_alpha_fraction);
  if (o.max_repeated_line_chars < 1.0 || o.max_repeated_line_fraction < 1.0) {
    std::unordered_set<uint64_t> seen;
    uint64_t lines = 0, repeated = 0, repeated_chars = 0;
    size_t begin = 0;
    while (begin < text.size()) {
      size_t end = text.find('\n', begin);
      if (end == std::string_view::npos) end = text.size();
      std::string_view line = text.substr(begin, end - begin);
      begin = end + 1;
      if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
      ++lines;
      if (seen.insert(XXH3_64bits(line.data(), line.size())).second) continue;
      ++repeated;
      // Code points: every byte that does not continue a UTF-8 sequence.
      for (char c : line) repeated_chars += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
    }
    const double char_share = static_cast<double>(repeated_chars) / static_cast<double>(std::max<uint64_t>(chars, 1));
    if (o.max_repeated_line_chars < 1.0 && char_share > o.max_repeated_line_chars)
      return failed(QualityRule::repeated_lines, "repeated_line_chars", char_share, o.max_repeated_line_chars);
    const double line_share = static_cast<double>(repeated) / static_cast<double>(std::max<uint64_t>(lines, 1));
    if (o.max_repeated_line_fraction < 1.0 && line_share > o.max_repeated_line_fraction)
      return failed(QualityRule::repeated_lines, "repeated_lines", line_share, o.max_repeated_line_fraction);
  }
  return QualityRule::pass;
}

}  // namespace tuna
