// Untrusted JSON: deep nesting, overflowing numbers and repeated keys are clean errors, never a crash.
#include "core/json.h"

#include <gtest/gtest.h>

#include "core/error.h"

namespace tuna {
namespace {

std::string error_of(std::string_view text) {
  try {
    parse_json(text, "x.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Json, DeepNestingIsRefusedBeforeParsing) {
  // A million levels overflow nlohmann's recursive parser's stack (SIGSEGV); the depth scan refuses them.
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  EXPECT_NE(error_of(deep).find("nested deeper than 64"), std::string::npos);
  const std::string objects = [] {
    std::string s;
    for (int i = 0; i < 100; i++) s += "{\"a\":";
    return s + "1" + std::string(100, '}');
  }();
  EXPECT_NE(error_of(objects).find("nested deeper"), std::string::npos);
  // Brackets inside strings are not nesting.
  EXPECT_EQ(error_of("{\"k\": \"" + std::string(1000, '[') + "\\\"[\"}"), "");
  EXPECT_EQ(error_of(std::string(64, '[') + std::string(64, ']')), "");
}

TEST(Json, ParserFailuresAreErrors) {
  EXPECT_NE(error_of("{\"hidden_size\": 1e400}").find("x.json: not valid JSON"), std::string::npos);
  EXPECT_NE(error_of("{\"a\": 1,}").find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of("\"\xff\xfe\"").find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of("").find("not valid JSON"), std::string::npos);
}

TEST(Json, RepeatedKeysAreRefusedAtAnyDepth) {
  EXPECT_NE(error_of("{\"a\": 1, \"a\": 2}").find("key 'a' appears more than once"), std::string::npos);
  EXPECT_NE(error_of("{\"x\": {\"b\": 1, \"b\": 1}}").find("key 'b'"), std::string::npos);
  EXPECT_EQ(error_of("{\"x\": {\"b\": 1}, \"y\": {\"b\": 1}}"), "");  // the same key in two objects is fine
}

TEST(Json, TypedFieldsNameTheField) {
  const nlohmann::json j = parse_json(R"({"step": 12, "neg": -9223372036854775808, "big": 18446744073709551615,
                                          "f": 1.5, "s": "3"})", "state.json");
  EXPECT_EQ(json_int(j, "step", "state.json", 0, 100), 12);
  auto error = [&](auto f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error([&] { json_int(j, "neg", "state.json", 0, INT64_MAX); }).find("field 'neg'"), std::string::npos);
  EXPECT_NE(error([&] { json_int(j, "big", "state.json", 0, INT64_MAX); }).find("field 'big'"), std::string::npos);
  EXPECT_NE(error([&] { json_int(j, "f", "state.json", 0, 9); }).find("expected an integer"), std::string::npos);
  EXPECT_NE(error([&] { json_int(j, "s", "state.json", 0, 9); }).find("expected an integer, found \"3\""),
            std::string::npos);
  EXPECT_NE(error([&] { json_int(j, "gone", "state.json", 0, 9); }).find("field 'gone' is missing"),
            std::string::npos);
  EXPECT_DOUBLE_EQ(json_number(j, "f", "state.json", 0, 2), 1.5);
  EXPECT_NE(error([&] { json_number(j, "f", "state.json", 0, 1); }).find("field 'f'"), std::string::npos);
}

}  // namespace
}  // namespace tuna
