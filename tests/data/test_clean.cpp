// data/clean: UTF-8 repair or refusal, control characters and NUL, whitespace normalization, each quality
// rule.
#include <gtest/gtest.h>

#include <string>

#include "data/clean.h"

namespace tuna {
namespace {

std::string cleaned(const std::string& in, CleanOptions options = {}, CleanResult* result = nullptr) {
  std::string out;
  CleanResult r;
  EXPECT_TRUE(clean_text(in, options, &out, &r));
  if (result) *result = r;
  return out;
}

TEST(Clean, RepairsOrRefusesInvalidUtf8) {
  CleanResult r;
  EXPECT_EQ(cleaned("caf\xC3\xA9 ok", {}, &r), "caf\xC3\xA9 ok");
  EXPECT_FALSE(r.invalid_utf8);
  // A stray byte, an overlong '/', a surrogate, a truncated sequence at the end.
  for (const std::string bad : {"a\xFF" "b", "a\xC0\xAF" "b", "a\xED\xA0\x80" "b", "ab\xE2\x82"}) {
    std::string out = cleaned(bad, {}, &r);
    EXPECT_TRUE(r.invalid_utf8) << bad;
    EXPECT_NE(out.find("\xEF\xBF\xBD"), std::string::npos) << "U+FFFD in place of the bad bytes";
    EXPECT_TRUE(is_valid_utf8(out));
    EXPECT_FALSE(is_valid_utf8(bad));
    std::string refused;
    CleanOptions drop;
    drop.drop_invalid_utf8 = true;
    EXPECT_FALSE(clean_text(bad, drop, &refused, &r));
  }
  EXPECT_EQ(repair_utf8("x\xFFy"), "x\xEF\xBF\xBDy");
}

TEST(Clean, RemovesControlCharactersAndCountsNul) {
  CleanResult r;
  EXPECT_EQ(cleaned(std::string("ab\0c\x01" "d\x7F" "e", 8), {}, &r), "abcde");
  EXPECT_TRUE(r.nul_bytes);
  EXPECT_TRUE(r.control_chars);
  EXPECT_EQ(cleaned("a\xC2\x85" "b", {}, &r), "a\nb") << "NEL is a line end";
  EXPECT_EQ(cleaned("\xEF\xBB\xBFtext\xE2\x80\x8B!", {}, &r), "text!") << "BOM and zero-width space go";
  EXPECT_FALSE(r.control_chars);
}

TEST(Clean, NormalizesWhitespace) {
  EXPECT_EQ(cleaned("  Title \t here  \r\n\r\n\r\n\n  body\u00a0text\t\n\n"), "Title here\n\nbody text");
  EXPECT_EQ(cleaned("a\rb\r\nc"), "a\nb\nc");
  EXPECT_EQ(cleaned("one\ntwo"), "one\ntwo");
  EXPECT_EQ(cleaned(" \n\t \n"), "");
  CleanOptions keep;
  keep.keep_whitespace = true;
  EXPECT_EQ(cleaned("  a\t b\r\n\n\n", keep), "  a\t b\n\n\n");
}

TEST(Quality, EachRuleIsNamed) {
  QualityOptions o;
  o.min_chars = 10;
  o.max_chars = 100;
  o.min_alpha_fraction = 0.5;
  o.max_repeated_line_fraction = 0.3;
  EXPECT_EQ(quality_check("A fine sentence of text.", o), QualityRule::pass);
  EXPECT_EQ(quality_check("short", o), QualityRule::too_short);
  EXPECT_EQ(quality_check(std::string(101, 'a'), o), QualityRule::too_long);
  EXPECT_EQ(quality_check("12345 67890 1112 | -- 13", o), QualityRule::low_alpha);
  EXPECT_EQ(quality_check("same line\nsame line\nsame line\nother line", o), QualityRule::repeated_lines);
  // Characters, not bytes: ten two-byte letters pass min_chars 10, nine do not.
  std::string ten;
  for (int i = 0; i < 10; ++i) ten += "\xC3\xA9";
  EXPECT_EQ(quality_check(ten, o), QualityRule::pass);
  EXPECT_EQ(quality_check(ten.substr(2), o), QualityRule::too_short);
  EXPECT_STREQ(quality_rule_name(QualityRule::low_alpha), "low_alpha");
}

// The repeated-lines rule weighs repeated lines by their characters: a short line that recurs (a copyright
// file's "License: GPL-2+" once per stanza) does not trip it where the line count would; a text made mostly
// of copies of its own lines does, and the measure says by how much.
TEST(Quality, RepeatedLinesCountTheirCharacters) {
  std::string stanzas;
  for (int i = 0; i < 20; ++i)
    stanzas += "Files: src/module" + std::to_string(i) + ".c\nCopyright: 2001-2024 Author Number " + std::to_string(i) +
               " of the project\nLicense: GPL-2+\n\n";
  QualityOptions defaults;
  QualityMeasure m;
  EXPECT_EQ(quality_check(stanzas, defaults, &m), QualityRule::pass);
  QualityOptions by_lines;
  by_lines.max_repeated_line_fraction = 0.3;  // the old rule: 19 of 60 lines repeat
  EXPECT_EQ(quality_check(stanzas, by_lines, &m), QualityRule::repeated_lines);
  EXPECT_STREQ(m.name, "repeated_lines");
  EXPECT_NEAR(m.value, 19.0 / 60.0, 1e-12);

  std::string table = "Totals by quarter\n";
  for (int i = 0; i < 10; ++i) table += "Amount due under this agreement for the quarter\n";
  EXPECT_EQ(quality_check(table, defaults, &m), QualityRule::repeated_lines);
  EXPECT_STREQ(m.name, "repeated_line_chars");
  const double chars = static_cast<double>(table.size());
  EXPECT_NEAR(m.value, 9 * 47 / chars, 1e-12);  // 9 copies of a 47-character line
  EXPECT_DOUBLE_EQ(m.limit, 0.7);
  // A text pasted three times is 2/3 repeats: under 0.7, kept; four times, dropped.
  const std::string body = "First line of a contract.\nSecond line, with the terms.\n";
  EXPECT_EQ(quality_check(body + body + body, defaults), QualityRule::pass);
  EXPECT_EQ(quality_check(body + body + body + body, defaults), QualityRule::repeated_lines);
  QualityOptions off;
  off.max_repeated_line_chars = 1.0;
  EXPECT_EQ(quality_check(table, off), QualityRule::pass);
}

}  // namespace
}  // namespace tuna
