// data/chat_template: conversations rendered as the reference implementations do (Hugging Face's Llama 3
// template through jinja2 and tokenizers; Meta's Llama 2 chat_completion through sentencepiece), the loss mask
// on the assistant's turns, the format found from the tokenizer, and conversations that are refused.
#include <gtest/gtest.h>

#include "data/chat_template.h"
#include "tests/data/data_test_util.h"
#include "tests/data/tokenizer_fixtures.h"

namespace tuna {
namespace {

using testing_data::expect_error;
using testing_data::TempDir;
using testing_data::TokenizerFixtures;

std::vector<ChatMessage> to_messages(const std::vector<std::pair<std::string, std::string>>& chat) {
  std::vector<ChatMessage> out;
  for (const auto& [role, content] : chat) out.push_back({role, content});
  return out;
}

// The text the mask trains on: the tokens with mask 1, decoded run by run.
std::vector<std::string> trained_runs(const Tokenizer& tok, const RenderedChat& r) {
  std::vector<std::string> runs;
  for (size_t i = 0; i < r.tokens.size();) {
    if (!r.mask[i]) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < r.tokens.size() && r.mask[j]) ++j;
    runs.push_back(tok.decode(std::span<const int32_t>(r.tokens).subspan(i, j - i)));
    i = j;
  }
  return runs;
}

TEST(ChatTemplate, Llama3EqualsHuggingFacesTemplate) {
  const TokenizerFixtures& f = TokenizerFixtures::get();
  const Tokenizer& tok = f.llama3();
  ASSERT_EQ(resolve_chat_format(tok, "auto"), ChatFormat::llama3);
  const CachedEncoder encoder(tok);
  const auto chats = f.chats();
  const auto expected = f.ids("chat_llama3");
  ASSERT_EQ(chats.size(), expected.size());
  for (size_t c = 0; c < chats.size(); ++c) {
    RenderedChat r;
    std::string why;
    ASSERT_TRUE(render_chat(encoder, tok, ChatFormat::llama3, to_messages(chats[c]), &r, &why)) << why;
    EXPECT_EQ(r.tokens, expected[c]) << "chat " << c;
    ASSERT_EQ(r.mask.size(), r.tokens.size());
    // Exactly the assistant's stripped contents, each with its <|eot_id|>, train.
    std::vector<std::string> answers;
    for (const auto& [role, content] : chats[c])
      if (role == "assistant") answers.push_back(strip_whitespace(content) + "<|eot_id|>");
    EXPECT_EQ(trained_runs(tok, r), answers) << "chat " << c;
  }
}

TEST(ChatTemplate, Llama2EqualsMetasChatCompletion) {
  const TokenizerFixtures& f = TokenizerFixtures::get();
  const Tokenizer& tok = f.spm();
  ASSERT_EQ(resolve_chat_format(tok, "auto"), ChatFormat::llama2);
  const CachedEncoder encoder(tok);
  const auto chats = f.chats();
  const auto expected = f.ids("chat_llama2");
  for (size_t c = 0; c < chats.size(); ++c) {
    RenderedChat r;
    std::string why;
    ASSERT_TRUE(render_chat(encoder, tok, ChatFormat::llama2, to_messages(chats[c]), &r, &why)) << why;
    EXPECT_EQ(r.tokens, expected[c]) << "chat " << c;
    // The answers train, each with its EOS (</s> decodes to nothing in sentencepiece).
    std::vector<std::string> answers;
    for (const auto& [role, content] : chats[c])
      if (role == "assistant") answers.push_back(strip_whitespace(content) + " ");
    const std::vector<std::string> runs = trained_runs(tok, r);
    ASSERT_EQ(runs.size(), answers.size()) << "chat " << c;
    for (size_t i = 0; i < runs.size(); ++i) EXPECT_EQ(strip_whitespace(runs[i]), strip_whitespace(answers[i]));
    EXPECT_EQ(r.mask.back(), 1) << "EOS trains";
    EXPECT_EQ(r.tokens.back(), tok.eos_id());
  }
}

TEST(ChatTemplate, FormatFromTheModelsConfig) {
  const TokenizerFixtures& f = TokenizerFixtures::get();
  TempDir dir;
  std::filesystem::copy_file(f.spm_model(), dir.file("tokenizer.model"));
  auto with_template = [&](const std::string& chat_template) {
    testing_data::write_file(dir.file("tokenizer_config.json"),
                             nlohmann::json{{"chat_template", chat_template}}.dump());
    return Tokenizer(dir.path().string());
  };
  EXPECT_EQ(resolve_chat_format(with_template("{{ bos_token + '[INST] ' + m + ' [/INST]' }}"), "auto"), ChatFormat::llama2);
  EXPECT_EQ(resolve_chat_format(with_template("{{ '<|start_header_id|>' + role }}"), "auto"), ChatFormat::llama3);
  const Tokenizer chatml = with_template("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}");
  expect_error([&] { resolve_chat_format(chatml, "auto"); },
               {dir.file("tokenizer_config.json"), "neither Llama 3's", "--chat-template"});
  EXPECT_EQ(resolve_chat_format(chatml, "llama2"), ChatFormat::llama2) << "an explicit choice overrides";
  expect_error([&] { resolve_chat_format(chatml, "chatml"); }, {"chat template 'chatml'", "llama3 and llama2"});
  expect_error([&] { resolve_chat_format(f.llama3(), "mistral"); }, {"'mistral'"});
  // A list of named templates: the default one is read; a name or template that is not a string is an error
  // naming the file (it was a json::type_error with no file named; found by make fuzz).
  testing_data::write_file(dir.file("tokenizer_config.json"),
                           R"({"chat_template": [{"name": "tool_use", "template": "[INST]"},
                                                 {"name": "default", "template": "<|start_header_id|>"}]})");
  EXPECT_EQ(resolve_chat_format(Tokenizer(dir.path().string()), "auto"), ChatFormat::llama3);
  for (const char* bad : {R"([{"name": 5, "template": "[INST]"}])", R"([{"name": "default", "template": null}])",
                          R"(["[INST]"])", "7"}) {
    testing_data::write_file(dir.file("tokenizer_config.json"), str(R"({"chat_template": )", bad, "}"));
    const Tokenizer tok(dir.path().string());
    expect_error([&] { resolve_chat_format(tok, "auto"); },
                 {dir.file("tokenizer_config.json"), "field 'chat_template'", "expected a string or a list"});
  }
}

TEST(ChatTemplate, RefusedConversations) {
  const TokenizerFixtures& f = TokenizerFixtures::get();
  const CachedEncoder llama3(f.llama3()), llama2(f.spm());
  RenderedChat r;
  std::string why;
  EXPECT_FALSE(render_chat(llama3, f.llama3(), ChatFormat::llama3, {{"user", "hi"}, {"asistant", "hello"}}, &r, &why));
  EXPECT_NE(why.find("role 'asistant'"), std::string::npos) << why;
  EXPECT_FALSE(render_chat(llama3, f.llama3(), ChatFormat::llama3, {{"system", "s"}, {"user", "hi"}}, &r, &why));
  EXPECT_NE(why.find("no assistant"), std::string::npos) << why;
  EXPECT_FALSE(render_chat(llama2, f.spm(), ChatFormat::llama2, {{"user", "a"}, {"user", "b"}}, &r, &why));
  EXPECT_NE(why.find("expects 'assistant'"), std::string::npos) << why;
  EXPECT_FALSE(render_chat(llama2, f.spm(), ChatFormat::llama2, {{"user", "a"}, {"assistant", "b"}, {"user", "c"}}, &r, &why));
  EXPECT_NE(why.find("ends with a user turn"), std::string::npos) << why;
  EXPECT_FALSE(render_chat(llama2, f.spm(), ChatFormat::llama2, {{"system", "s"}, {"assistant", "b"}}, &r, &why));
  // A tokenizer without Llama 3's header tokens cannot render llama3.
  expect_error([&] { render_chat(llama2, f.spm(), ChatFormat::llama3, {{"user", "a"}, {"assistant", "b"}}, &r, &why); },
               {"<|start_header_id|>"});
}

// The roles docs/prepare.md names: llama3 takes ipython and tool too, a tool's result headed "ipython" (as the
// templates of Llama 3.1 and later render it); llama2 refuses both, counted as bad_chat by prepare.
TEST(ChatTemplate, ToolMessagesAreHeadedIpython) {
  const TokenizerFixtures& f = TokenizerFixtures::get();
  const CachedEncoder llama3(f.llama3()), llama2(f.spm());
  RenderedChat tool, ipython;
  std::string why;
  ASSERT_TRUE(render_chat(llama3, f.llama3(), ChatFormat::llama3, {{"user", "q"}, {"tool", "42"}, {"assistant", "a"}},
                          &tool, &why)) << why;
  ASSERT_TRUE(render_chat(llama3, f.llama3(), ChatFormat::llama3, {{"user", "q"}, {"ipython", "42"}, {"assistant", "a"}},
                          &ipython, &why)) << why;
  EXPECT_EQ(tool.tokens, ipython.tokens);
  EXPECT_NE(f.llama3().decode(tool.tokens).find("<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"),
            std::string::npos);
  RenderedChat r;
  EXPECT_FALSE(render_chat(llama2, f.spm(), ChatFormat::llama2, {{"user", "q"}, {"tool", "42"}, {"assistant", "a"}}, &r, &why));
}

TEST(ChatTemplate, StripIsPythons) {
  EXPECT_EQ(strip_whitespace("  a b \n\t"), "a b");
  EXPECT_EQ(strip_whitespace("\xC2\xA0\xE3\x80\x80x\xE2\x80\xA8"), "x");  // NBSP, ideographic space, U+2028
  EXPECT_EQ(strip_whitespace("\xC3\xA9"), "\xC3\xA9");
  EXPECT_EQ(strip_whitespace(" \n "), "");
  EXPECT_EQ(strip_whitespace(""), "");
}

}  // namespace
}  // namespace tuna
