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

}  // namespace
}  // namespace tuna
