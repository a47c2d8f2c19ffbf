// Cleaning and quality filters: functions of one document's text, no state, safe on any thread.
//
// clean_text: UTF-8 validation (an invalid byte becomes U+FFFD, or the document is refused, by option),
// control characters removed (C0 but \t \n, DEL, C1; NUL counted apart since it usually means binary data),
// \r\n and \r -> \n, zero-width spaces and BOMs removed, and (unless whitespace is kept) every run of spaces,
// tabs and Unicode spaces -> one ' ', lines stripped at both ends, at most one blank line in a row, no
// blank lines at either end of the document. The result is what gets hashed for dedup and tokenized.
//
// quality_check: the rules, in the order they are tried (the first that fails names the drop):
//   too_short       fewer than min_chars characters (code points)
//   too_long        more than max_chars characters (0: no limit)
//   low_alpha       letters / non-space characters below min_alpha_fraction (any code point at or above
//                   U+00C0 counts as a letter, except punctuation and symbol blocks and U+FFFD)
//   repeated_lines  the characters of lines that repeat an earlier line of the same document (each copy after
//                   the first), as a share of the document's characters, above max_repeated_line_chars; or
//                   (off by default) such lines as a share of the non-blank lines above
//                   max_repeated_line_fraction.
// Why characters: Gopher and RefinedWeb count the characters in duplicated lines, so that a short line that
// recurs ("License: GPL-2+" 44 times in one Debian copyright file) weighs what it holds, not one line each.
// Why 0.7 and not their 0.2: legal text repeats whole licence paragraphs once per copyright holder. Measured
// on the 440 distinct Debian copyright files (benchmarks/2026-11-30-prepare-filters-debian.md): the largest
// share is 0.61 (the MIT licence repeated per holder), Gopher's 0.2 drops 59 of them and the old line share at
// 0.3 drops 42; 0.7 drops none and still drops a text made mostly of copies of its own lines (a line or a
// block repeated four times or more).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tuna {

struct CleanOptions {
  bool drop_invalid_utf8 = false;  // refuse a document with invalid UTF-8 instead of repairing it
  bool keep_whitespace = false;    // only control characters and line ends are normalized
};

struct CleanResult {
  bool invalid_utf8 = false;   // had invalid UTF-8 (repaired, or refused when drop_invalid_utf8)
  bool nul_bytes = false;      // had NUL bytes (removed)
  bool control_chars = false;  // had other control characters (removed)
};

// Cleans `in` into *out (replacing it). Returns false only when the document is refused (invalid UTF-8
// with drop_invalid_utf8); *out is then unspecified.
bool clean_text(std::string_view in, const CleanOptions& options, std::string* out, CleanResult* result);

// Whether bytes are valid UTF-8, and a copy with each invalid byte replaced by U+FFFD (JSON lines are
// repaired before parsing, since a JSON parser refuses invalid UTF-8).
bool is_valid_utf8(std::string_view s);
// Decodes one UTF-8 code point at s[i]; returns its length, or 0 when the bytes there are not valid UTF-8
// (overlong forms, surrogates and values above U+10FFFF are invalid).
size_t decode_utf8(std::string_view s, size_t i, uint32_t* cp);
std::string repair_utf8(std::string_view s);

struct QualityOptions {
  uint64_t min_chars = 1;
  uint64_t max_chars = 0;  // 0: no limit
  double min_alpha_fraction = 0.25;
  double max_repeated_line_chars = 0.7;     // 1: off
  double max_repeated_line_fraction = 1.0;  // 1: off
};

enum class QualityRule { pass, too_short, too_long, low_alpha, repeated_lines };
const char* quality_rule_name(QualityRule rule);

// What a failing rule measured, for the report: e.g. {"repeated_line_chars", 0.74, 0.7}.
struct QualityMeasure {
  const char* name = "";
  double value = 0, limit = 0;
};

QualityRule quality_check(std::string_view text, const QualityOptions& options, QualityMeasure* measure = nullptr);

}  // namespace tuna
