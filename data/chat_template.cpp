// Chat templates: see data/chat_template.h.
#include "data/chat_template.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "data/tokenizer_impl.h"  // model_config_file

namespace tuna {

const char* chat_format_name(ChatFormat format) { return format == ChatFormat::llama3 ? "llama3" : "llama2"; }

namespace {

// Python's str.isspace() code points.
bool is_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

// The code point starting at s[i] and its length (invalid bytes: the byte itself, length 1).
uint32_t decode_at(const std::string& s, size_t i, size_t* length) {
  const uint8_t c = static_cast<uint8_t>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (i + n > s.size()) n = 1;
  uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  *length = n;
  return cp;
}

int32_t required_token(const Tokenizer& tokenizer, const char* name, ChatFormat format) {
  const int32_t id = tokenizer.token_id(name);
  if (id < 0)
    fail("chat template ", chat_format_name(format), ": the tokenizer ", tokenizer.path(), " has no ", name, " token");
  return id;
}

void append(std::vector<int32_t>* tokens, std::vector<uint8_t>* mask, const std::vector<int32_t>& ids, uint8_t train) {
  tokens->insert(tokens->end(), ids.begin(), ids.end());
  mask->insert(mask->end(), ids.size(), train);
}

bool render_llama3(const CachedEncoder& encoder, const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages,
                   RenderedChat* out, std::string* why) {
  const int32_t start = required_token(tokenizer, "<|start_header_id|>", ChatFormat::llama3);
  const int32_t end = required_token(tokenizer, "<|end_header_id|>", ChatFormat::llama3);
  const int32_t eot = required_token(tokenizer, "<|eot_id|>", ChatFormat::llama3);
  if (tokenizer.bos_id() >= 0) append(&out->tokens, &out->mask, {tokenizer.bos_id()}, 0);
  std::vector<int32_t> ids;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const uint8_t train = m.role == "assistant";
    append(&out->tokens, &out->mask, {start}, 0);
    ids.clear();
    // A tool's result is headed "ipython", as the templates of Llama 3.1 and later render a "tool" message.
    encoder.encode(m.role == "tool" ? std::string("ipython") : m.role, &ids);
    append(&out->tokens, &out->mask, ids, 0);
    append(&out->tokens, &out->mask, {end}, 0);
    // "\n\n" and the content in one piece of text, as Hugging Face's template tokenizes them (Llama 3's
    // pre-tokenizer splits "\n\n" off stripped content, so Meta's separate encoding gives the same ids).
    std::vector<int32_t> newlines;
    encoder.encode("\n\n", &newlines);
    ids.clear();
    encoder.encode("\n\n" + strip_whitespace(m.content), &ids);
    if (ids.size() < newlines.size() || !std::equal(newlines.begin(), newlines.end(), ids.begin())) {
      *why = str("messages[", i, "]: the content merges with the header's newlines");
      return false;
    }
    append(&out->tokens, &out->mask, newlines, 0);
    append(&out->tokens, &out->mask, std::vector<int32_t>(ids.begin() + static_cast<int64_t>(newlines.size()), ids.end()), train);
    append(&out->tokens, &out->mask, {eot}, train);
  }
  return true;
}

bool validate_llama3(const std::vector<ChatMessage>& messages, std::string* why) {
  bool trains = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant" && role != "ipython" && role != "tool") {
      *why = str("messages[", i, "]: role '", role, "' (llama3 takes system, user, assistant, ipython, tool)");
      return false;
    }
    trains |= role == "assistant";
  }
  if (!trains) *why = "no assistant message to train on";
  return trains;
}

// Meta's chat_completion folds a system message into the first user turn.
std::vector<ChatMessage> llama2_dialog(const std::vector<ChatMessage>& messages) {
  std::vector<ChatMessage> dialog = messages;
  if (dialog.size() >= 2 && dialog[0].role == "system" && dialog[1].role == "user") {
    dialog[1].content = "<<SYS>>\n" + dialog[0].content + "\n<</SYS>>\n\n" + dialog[1].content;
    dialog.erase(dialog.begin());
  }
  return dialog;
}

bool validate_llama2(const std::vector<ChatMessage>& messages, std::string* why) {
  if (!messages.empty() && messages[0].role == "system" && (messages.size() < 2 || messages[1].role != "user")) {
    *why = "a system message must be followed by a user message (llama2)";
    return false;
  }
  const std::vector<ChatMessage> dialog = llama2_dialog(messages);
  for (size_t i = 0; i < dialog.size(); ++i) {
    const char* expected = i % 2 == 0 ? "user" : "assistant";
    if (dialog[i].role != expected) {
      *why = str("turn ", i, " is '", dialog[i].role, "' where llama2 expects '", expected,
                 "' (user and assistant alternate, after an optional system message)");
      return false;
    }
  }
  if (dialog.size() < 2) {
    *why = "no assistant message to train on";
    return false;
  }
  if (dialog.size() % 2 != 0) {
    *why = "the conversation ends with a user turn, which llama2 cannot train on";
    return false;
  }
  return true;
}

bool render_llama2(const CachedEncoder& encoder, const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages,
                   RenderedChat* out, std::string* why) {
  const std::vector<ChatMessage> dialog = llama2_dialog(messages);
  std::vector<int32_t> prompt, whole;
  for (size_t i = 0; i + 1 < dialog.size(); i += 2) {
    const std::string question = "[INST] " + strip_whitespace(dialog[i].content) + " [/INST]";
    const std::string text = question + " " + strip_whitespace(dialog[i + 1].content) + " ";
    prompt.clear(), whole.clear();
    encoder.encode(question, &prompt);
    encoder.encode(text, &whole);
    // The answer's tokens follow the question's: the question must encode to a prefix of the whole (it
    // does where the model cuts at word starts, as LLaMA 2's does).
    if (whole.size() < prompt.size() || !std::equal(prompt.begin(), prompt.end(), whole.begin())) {
      *why = "the tokenizer does not split the answer from the question at a token boundary";
      return false;
    }
    if (tokenizer.bos_id() >= 0) append(&out->tokens, &out->mask, {tokenizer.bos_id()}, 0);
    append(&out->tokens, &out->mask, prompt, 0);
    append(&out->tokens, &out->mask, std::vector<int32_t>(whole.begin() + static_cast<int64_t>(prompt.size()), whole.end()), 1);
    if (tokenizer.eos_id() >= 0) append(&out->tokens, &out->mask, {tokenizer.eos_id()}, 1);
  }
  return true;
}

}  // namespace

std::string strip_whitespace(const std::string& text) {
  size_t begin = 0, end = text.size(), n;
  while (begin < end && is_space(decode_at(text, begin, &n))) begin += n;
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
    if (!is_space(decode_at(text, start, &n)) || start + n != end) break;
    end = start;
  }
  return text.substr(begin, end - begin);
}

ChatFormat resolve_chat_format(const Tokenizer& tokenizer, const std::string& requested) {
  if (requested == "llama3") return ChatFormat::llama3;
  if (requested == "llama2") return ChatFormat::llama2;
  if (requested != "auto")
    fail("chat template '", requested, "': tuna renders llama3 and llama2 (or auto: the model's own, if it is one of them)");
  const std::string config = model_config_file(tokenizer.path(), "tokenizer_config.json");
  if (!config.empty()) {
    const nlohmann::json c = read_json_file(config, config);  // core/json.h: bounded, repeated keys refused
    if (c.is_object() && c.contains("chat_template") && !c["chat_template"].is_null()) {
      const nlohmann::json& t = c["chat_template"];
      // A string, or a list of named templates ({"name": "default", "template": ...}).
      std::string text;
      auto refuse = [&](const nlohmann::json& found) {
        fail("chat template of ", config, ": field 'chat_template': expected a string or a list of {\"name\": string, "
             "\"template\": string}, found ", found.dump().substr(0, 200));
      };
      if (t.is_string()) {
        text = t.get<std::string>();
      } else if (t.is_array()) {
        for (const auto& named : t) {
          if (!named.is_object() || !named.contains("name") || !named["name"].is_string() ||
              !named.contains("template") || !named["template"].is_string())
            refuse(named);
          if (named["name"] == "default") text = named["template"].get<std::string>();
        }
      } else {
        refuse(t);
      }
      const bool llama3 = text.find("<|start_header_id|>") != std::string::npos;
      const bool llama2 = text.find("[INST]") != std::string::npos;
      if (llama3 != llama2) return llama3 ? ChatFormat::llama3 : ChatFormat::llama2;
      fail("chat template of ", config, ": neither Llama 3's (<|start_header_id|>) nor Llama 2's ([INST]); tuna "
           "renders those two only: pass --chat-template llama3 or llama2 to use one of them instead");
    }
  }
  if (tokenizer.token_id("<|start_header_id|>") >= 0 && tokenizer.token_id("<|end_header_id|>") >= 0 &&
      tokenizer.token_id("<|eot_id|>") >= 0)
    return ChatFormat::llama3;
  if (tokenizer.format() == TokenizerFormat::sentencepiece && tokenizer.bos_id() >= 0 && tokenizer.eos_id() >= 0)
    return ChatFormat::llama2;
  fail("tokenizer ", tokenizer.path(), ": no chat template found (no tokenizer_config.json chat_template, no Llama 3 "
       "header tokens, not a sentencepiece model with BOS and EOS): pass --chat-template llama3 or llama2");
}

bool validate_chat(ChatFormat format, const std::vector<ChatMessage>& messages, std::string* why) {
  return format == ChatFormat::llama3 ? validate_llama3(messages, why) : validate_llama2(messages, why);
}

bool render_chat(const CachedEncoder& encoder, const Tokenizer& tokenizer, ChatFormat format,
                 const std::vector<ChatMessage>& messages, RenderedChat* out, std::string* why) {
  out->tokens.clear();
  out->mask.clear();
  if (!validate_chat(format, messages, why)) return false;
  return format == ChatFormat::llama3 ? render_llama3(encoder, tokenizer, messages, out, why)
                                      : render_llama2(encoder, tokenizer, messages, out, why);
}

}  // namespace tuna
