// Chat templates for SFT: a conversation ({"messages": [{"role", "content"}, ...]}) becomes token ids and a
// loss mask that trains on the assistant's turns only. tuna renders the two chat formats of the LLaMA family
// itself (a Jinja interpreter is not worth carrying for two templates) and refuses any other by name:
//   llama3  Meta's reference ChatFormat (Llama 3, 3.1, 3.2 without tools): <|begin_of_text|>, then per message
//           <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>, the content stripped of surrounding
//           whitespace; the assistant's content and its <|eot_id|> train. Equal to Hugging Face's Llama 3.0
//           template (3.1's also writes a "Cutting Knowledge Date" system preamble, which tuna does not add).
//   llama2  Meta's reference chat_completion: a system message is folded into the first user turn as
//           "<<SYS>>\nSYSTEM\n<</SYS>>\n\n"; each user/assistant pair is <s>[INST] USER [/INST] ASSISTANT </s>;
//           the assistant's text (and </s>) train.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace tuna {

enum class ChatFormat : uint8_t { llama3, llama2 };
const char* chat_format_name(ChatFormat format);

struct ChatMessage {
  std::string role;  // system, user, assistant (llama3 also: ipython, and tool, rendered as ipython)
  std::string content;
};

// The chat format of the model whose tokenizer this is. requested: "llama3", "llama2" or "auto". auto reads
// the chat_template of the tokenizer_config.json beside the tokenizer and recognizes either format by its
// markers (<|start_header_id|>, [INST]); a template that is neither is refused, naming the file. Without a
// template: llama3 when the tokenizer has <|start_header_id|>, <|end_header_id|> and <|eot_id|>, llama2 for a
// sentencepiece model with BOS and EOS; anything else is an error saying to pass --chat-template.
ChatFormat resolve_chat_format(const Tokenizer& tokenizer, const std::string& requested);

struct RenderedChat {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;  // one per token: 1 = trains (assistant content and its end of turn)
};

// The checks of render_chat that need no tokenizer: false, with *why, for an unknown role, llama2 roles out of
// order (user/assistant alternating, after an optional system), no assistant turn to train on.
bool validate_chat(ChatFormat format, const std::vector<ChatMessage>& messages, std::string* why);

// Renders messages (contents already cleaned). False, with *why, for a conversation the format cannot take
// (validate_chat). Encodes text through encoder (its cache), special tokens by id.
bool render_chat(const CachedEncoder& encoder, const Tokenizer& tokenizer, ChatFormat format,
                 const std::vector<ChatMessage>& messages, RenderedChat* out, std::string* why);

// Python's str.strip(): leading and trailing whitespace (ASCII and Unicode White_Space) removed.
std::string strip_whitespace(const std::string& text);

}  // namespace tuna
