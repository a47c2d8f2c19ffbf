// Unicode for the tokenizer.json pipeline (data/hf_tokenizer.h), as Hugging Face tokenizers (Rust) computes it:
// normalization forms and character properties come from utf8proc (Unicode 15), never from tables of our own.
//   - normalize(): NFC, NFD, NFKC, NFKD of UTF-8 text (ASCII is left as it is: every form keeps it);
//   - lowercase(): Rust's char::to_lowercase, one character at a time (no context: a final sigma stays σ), the
//     full mapping (U+0130 İ becomes "i̇", the one unconditional mapping of SpecialCasing.txt to two characters);
//   - the predicates Rust's char methods and its regex crate's classes use (is_whitespace, is_numeric,
//     is_punctuation, \w);
//   - lossy_utf8(): String::from_utf8_lossy (each maximal invalid subsequence becomes one U+FFFD).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tuna::unicode {

enum class NormalForm : uint8_t { nfc, nfd, nfkc, nfkd };

// Decodes the code point at text[*at] (valid UTF-8 assumed) and advances *at past it.
uint32_t next_code_point(std::string_view text, size_t* at);
void append_utf8(uint32_t cp, std::string* out);

std::string normalize(std::string_view text, NormalForm form);
std::string lowercase(std::string_view text);

bool is_whitespace(uint32_t cp);   // Rust char::is_whitespace: the White_Space property
bool is_numeric(uint32_t cp);      // Rust char::is_numeric: general categories Nd, Nl, No
bool is_punctuation(uint32_t cp);  // ASCII punctuation, or categories Pc Pd Ps Pe Pi Pf Po
bool is_word(uint32_t cp);         // the Rust regex crate's \w: Alphabetic, marks, Nd, Pc, Join_Control
bool is_combining_mark(uint32_t cp);  // categories Mn, Mc, Me

std::string lossy_utf8(std::string_view bytes);

}  // namespace tuna::unicode
