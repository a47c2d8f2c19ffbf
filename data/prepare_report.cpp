// prepare's report: the outcome names, report.json both ways, and the printed summary (data/prepare.h).
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/progress.h"  // human_bytes
#include "data/prepare.h"
#include "data/shard.h"  // kShardVersion, shard_token_width

namespace tuna {

const char* outcome_name(Outcome outcome) {
  switch (outcome) {
    case Outcome::kept: return "kept";
    case Outcome::malformed_json: return "malformed_json";
    case Outcome::missing_field: return "missing_field";
    case Outcome::truncated: return "truncated";
    case Outcome::oversized: return "oversized";
    case Outcome::invalid_utf8: return "invalid_utf8";
    case Outcome::bad_chat: return "bad_chat";
    case Outcome::empty: return "empty";
    case Outcome::too_short: return "too_short";
    case Outcome::too_long: return "too_long";
    case Outcome::low_alpha: return "low_alpha";
    case Outcome::repeated_lines: return "repeated_lines";
    case Outcome::exact_duplicate: return "exact_duplicate";
    case Outcome::near_duplicate: return "near_duplicate";
    case Outcome::tokenize_failed: return "tokenize_failed";
    case Outcome::count_: break;
  }
  return "?";
}


static std::string fingerprint_hex(uint64_t fingerprint) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(fingerprint));
  return buf;
}

// Bytes as "0x04 0x05 0xF5": the bytes a tokenizer has no token for, in the report and its summary.
static std::string byte_list(std::string_view bytes) {
  std::string out;
  for (char c : bytes) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "%s0x%02X", out.empty() ? "" : " ", static_cast<uint8_t>(c));
    out += hex;
  }
  return out;
}

static bool parse_byte_list(const std::string& list, std::string* bytes) {
  bytes->clear();
  for (size_t at = 0; at < list.size();) {
    unsigned value;
    int used = 0;
    if (std::sscanf(list.c_str() + at, "0x%2X%n", &value, &used) != 1 || used != 4) return false;
    bytes->push_back(static_cast<char>(value));
    at += used;
    if (at < list.size() && list[at++] != ' ') return false;
  }
  return true;
}

nlohmann::json report_json(const PrepareReport& r, const PrepareOptions& o) {
  auto tally = [](const Tally& t) { return nlohmann::json{{"count", t.count}, {"first", t.first}}; };
  auto split = [](const PrepareReport::Split& s) {
    return nlohmann::json{{"documents", s.documents}, {"tokens", s.tokens}, {"shards", s.shards}};
  };
  nlohmann::json outcomes = nlohmann::json::object();
  for (size_t k = 0; k < kOutcomes; ++k) outcomes[outcome_name(static_cast<Outcome>(k))] = tally(r.outcome[k]);
  return nlohmann::json{
      {"files",
       {{"read", r.files_read},
        {"bytes", r.bytes_read},
        {"skipped", tally(r.files_skipped)},
        {"symlinks_not_followed", tally(r.files_symlinks)},
        {"not_regular", tally(r.files_not_regular)},
        {"unreadable", tally(r.files_unreadable)},
        {"damaged", tally(r.files_damaged)}}},
      {"documents",
       {{"read", r.documents_read}, {"kept", r.documents_kept()}, {"outcomes", outcomes}, {"dropped_lists", r.dropped_lists}}},
      {"repairs",
       {{"invalid_utf8", tally(r.repaired_utf8)},
        {"nul_bytes", tally(r.removed_nul)},
        {"control_chars", tally(r.removed_control)}}},
      {"train", split(r.train)},
      {"val", split(r.val)},
      {"tokenizer",
       {{"path", r.tokenizer_path},
        {"format", r.tokenizer_format},
        {"fingerprint", fingerprint_hex(r.tokenizer_fingerprint)},
        {"chat_template", r.chat_template},
        {"trained", r.tokenizer_trained},
        {"vocab_size", r.vocab_size},
        {"bos_id", r.bos_id},
        {"eos_id", r.eos_id},
        {"missing_bytes", byte_list(r.missing_bytes)},
        {"dropped_bytes", {{"count", r.dropped_bytes}, {"documents", tally(r.dropped_byte_documents)}}}}},
      {"shard_format",
       {{"version", kShardVersion},
        {"token_width", shard_token_width(static_cast<uint32_t>(std::max(r.vocab_size, 1)))},
        {"loss_mask", o.sft}}},
      {"options",
       {{"inputs", o.inputs},
        {"val_fraction", o.val_fraction},
        {"text_field", o.text_field},
        {"sft", o.sft},
        {"chat_template", o.chat_template},
        {"prompt_field", o.prompt_field},
        {"response_field", o.response_field},
        {"max_document_bytes", o.max_document_bytes},
        {"drop_invalid_utf8", o.clean.drop_invalid_utf8},
        {"keep_whitespace", o.clean.keep_whitespace},
        {"min_chars", o.quality.min_chars},
        {"max_chars", o.quality.max_chars},
        {"min_alpha_fraction", o.quality.min_alpha_fraction},
        {"max_repeated_line_chars", o.quality.max_repeated_line_chars},
        {"max_repeated_line_fraction", o.quality.max_repeated_line_fraction},
        {"follow_symlinks", o.follow_symlinks},
        {"exact_dedup", o.exact_dedup},
        {"near_dedup", o.near_dedup},
        {"shingle_words", o.minhash.shingle_words},
        {"minhash_bands", o.minhash.bands},
        {"minhash_rows", o.minhash.rows},
        {"sketch_size", o.minhash.sketch_size},
        {"lsh_threshold", r.lsh_threshold},
        {"near_verify", r.near_verify},
        {"shard_tokens", o.shard_tokens}}},
      {"ranks", r.ranks},
      {"threads", r.threads},
      {"seconds", r.seconds},
  };
}

PrepareReport report_from_json(const nlohmann::json& j) {
  auto tally = [](const nlohmann::json& t) {
    Tally out;
    out.count = t.at("count").get<uint64_t>();
    out.first = t.at("first").get<std::string>();
    return out;
  };
  auto split = [](const nlohmann::json& s) {
    PrepareReport::Split out;
    out.documents = s.at("documents").get<uint64_t>();
    out.tokens = s.at("tokens").get<uint64_t>();
    out.shards = s.at("shards").get<std::vector<std::string>>();
    return out;
  };
  try {
    PrepareReport r;
    const auto& files = j.at("files");
    r.files_read = files.at("read").get<uint64_t>();
    r.bytes_read = files.at("bytes").get<uint64_t>();
    r.files_skipped = tally(files.at("skipped"));
    r.files_symlinks = tally(files.at("symlinks_not_followed"));
    r.files_not_regular = tally(files.at("not_regular"));
    r.files_unreadable = tally(files.at("unreadable"));
    r.files_damaged = tally(files.at("damaged"));
    r.documents_read = j.at("documents").at("read").get<uint64_t>();
    r.dropped_lists = j.at("documents").at("dropped_lists").get<std::vector<std::string>>();
    for (size_t k = 0; k < kOutcomes; ++k)
      r.outcome[k] = tally(j.at("documents").at("outcomes").at(outcome_name(static_cast<Outcome>(k))));
    r.repaired_utf8 = tally(j.at("repairs").at("invalid_utf8"));
    r.removed_nul = tally(j.at("repairs").at("nul_bytes"));
    r.removed_control = tally(j.at("repairs").at("control_chars"));
    r.train = split(j.at("train"));
    r.val = split(j.at("val"));
    const auto& tok = j.at("tokenizer");
    r.tokenizer_path = tok.at("path").get<std::string>();
    r.tokenizer_trained = tok.at("trained").get<bool>();
    r.tokenizer_format = tok.at("format").get<std::string>();
    r.tokenizer_fingerprint = std::stoull(tok.at("fingerprint").get<std::string>(), nullptr, 16);
    r.chat_template = tok.at("chat_template").get<std::string>();
    r.vocab_size = tok.at("vocab_size").get<int32_t>();
    r.bos_id = tok.at("bos_id").get<int32_t>();
    r.eos_id = tok.at("eos_id").get<int32_t>();
    if (!parse_byte_list(tok.at("missing_bytes").get<std::string>(), &r.missing_bytes))
      fail("prepare report: tokenizer.missing_bytes: expected bytes as \"0x04 0xF5\", found '",
           tok.at("missing_bytes").get<std::string>(), "'");
    r.dropped_bytes = tok.at("dropped_bytes").at("count").get<uint64_t>();
    r.dropped_byte_documents = tally(tok.at("dropped_bytes").at("documents"));
    r.lsh_threshold = j.at("options").at("lsh_threshold").get<double>();
    r.near_verify = j.at("options").at("near_verify").get<double>();
    r.ranks = j.at("ranks").get<int>();
    r.threads = j.at("threads").get<int>();
    r.seconds = j.at("seconds").get<double>();
    return r;
  } catch (const nlohmann::json::exception& e) {
    fail("prepare report: ", e.what());
  }
}

std::string report_summary(const PrepareReport& r) {
  auto line = [](const std::string& what, const Tally& t) {
    char label[32];
    std::snprintf(label, sizeof label, "  %-18s", what.c_str());
    return str(label, t.count, t.count ? str("   (first: ", t.first, ")") : std::string(), "\n");
  };
  auto shards = [](const PrepareReport::Split& s) {
    return s.shards.empty() ? std::string("no shard")
                            : str(s.shards.size(), " shard(s) ", s.shards.front(),
                                  s.shards.size() > 1 ? str(" .. ", s.shards.back()) : std::string());
  };
  std::string out = str("prepare: ", r.files_read, " file(s), ", human_bytes(static_cast<double>(r.bytes_read)),
                        " read; ", r.documents_read, " document(s) in = ", r.documents_kept(), " kept + ",
                        r.documents_read - r.documents_kept(), " dropped\n");
  out += str("  kept              ", r.documents_kept(), "   (train ", r.train.documents, ", val ",
             r.val.documents, ")\n");
  const char* groups[] = {"malformed:", "filtered:", "deduplicated:"};
  const Outcome starts[] = {Outcome::malformed_json, Outcome::empty, Outcome::exact_duplicate};
  for (size_t k = 1; k < kOutcomes; ++k) {
    for (size_t g = 0; g < 3; ++g)
      if (static_cast<size_t>(starts[g]) == k) out += str(" ", groups[g], "\n");
    out += line(outcome_name(static_cast<Outcome>(k)), r.outcome[k]);
  }
  out += " repaired (still counted above):\n";
  out += line("invalid UTF-8", r.repaired_utf8);
  out += line("NUL bytes", r.removed_nul);
  out += line("control chars", r.removed_control);
  out += " files:\n";
  out += line("skipped", r.files_skipped);
  out += line("symlinks", r.files_symlinks);
  out += line("not regular", r.files_not_regular);
  out += line("unreadable", r.files_unreadable);
  out += line("damaged", r.files_damaged);
  out += str("tokens: train ", r.train.tokens, " in ", shards(r.train), "\n");
  out += str("        val   ", r.val.tokens, " in ", shards(r.val), "\n");
  if (!r.missing_bytes.empty())
    out += str("bytes dropped: ", r.dropped_bytes, " in ", r.dropped_byte_documents.count, " kept document(s)",
               r.dropped_byte_documents.count ? str(" (first: ", r.dropped_byte_documents.first, ")") : std::string(),
               "; the tokenizer has no token for ", r.missing_bytes.size(), " byte(s) (", byte_list(r.missing_bytes),
               ") and drops them, as Hugging Face tokenizers does\n");
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.1f", r.seconds);
  out += str("tokenizer: ", r.tokenizer_path, r.tokenizer_trained ? " (trained)" : "", " (", r.tokenizer_format, "), vocab ",
             r.vocab_size, ", bos ", r.bos_id, ", eos ", r.eos_id, "; near duplicates: Jaccard >= ", r.near_verify, " (LSH ~",
             std::round(r.lsh_threshold * 100) / 100, "); ", r.ranks,
             " rank(s) x ", r.threads, " thread(s); ", secs, " s\n");
  return out;
}


}  // namespace tuna
