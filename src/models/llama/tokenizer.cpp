// Byte-level BPE tokenizer (include/smcgraph/tokenizer.hpp). Follows HF `tokenizers` as the SmolLM2
// tokenizer.json configures it (added tokens split first, leftmost-longest; Digits(individual_digits);
// ByteLevel(use_regex) with the GPT-2 regex; BPE merging the lowest-ranked pair, leftmost on ties), which is
// also llama.cpp's `smollm` pre-tokenizer. tests/data/tokenizer_corpus.jsonl holds HF's ids to compare with.
#include "smcgraph/tokenizer.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_map>

#include "models/llama/unicode_tables.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/gguf.hpp"

namespace smcgraph {
namespace {

using detail::unicode::CodePointClass;

// ---------------------------------------------------------------------------------------------------------
// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes are spelled
// U+0100.. in byte order. Every code point of the alphabet is below U+0144.
struct ByteAlphabet {
  std::array<uint32_t, 256> code_point{};
  std::array<int16_t, 0x144> byte_of{}; // -1 = not in the alphabet

  ByteAlphabet() {
    byte_of.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
      code_point[b] = printable ? static_cast<uint32_t>(b) : next++;
      byte_of[code_point[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

// ---------------------------------------------------------------------------------------------------------
// Strict UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF). Returns the sequence length at
// `pos` (1..4) and its code point, or 0 when the bytes at `pos` do not start a well-formed sequence.
constexpr uint32_t kInvalid = 0xffffffffu;

// What a UTF-8 lead byte announces (Unicode Table 3-7): the sequence length (0: not a lead byte; 1: ASCII)
// and the allowed range of the second byte (narrower after E0, ED, F0 and F4).
struct Utf8Lead {
  int length = 0;
  unsigned char low = 0x80, high = 0xbf;
};

Utf8Lead utf8_lead(unsigned char b0) {
  // The rows of Table 3-7: a range of lead bytes and what they announce.
  struct Row {
    unsigned char first, last;
    Utf8Lead lead;
  };
  static constexpr Row kTable[] = {
      {0x00, 0x7f, {1}},             // U+0000..U+007F
      {0xc2, 0xdf, {2}},             // U+0080..U+07FF
      {0xe0, 0xe0, {3, 0xa0, 0xbf}}, // U+0800..U+0FFF
      {0xe1, 0xec, {3}},             // U+1000..U+CFFF
      {0xed, 0xed, {3, 0x80, 0x9f}}, // U+D000..U+D7FF (no surrogates)
      {0xee, 0xef, {3}},             // U+E000..U+FFFF
      {0xf0, 0xf0, {4, 0x90, 0xbf}}, // U+10000..U+3FFFF
      {0xf1, 0xf3, {4}},             // U+40000..U+FFFFF
      {0xf4, 0xf4, {4, 0x80, 0x8f}}, // U+100000..U+10FFFF
  };
  for (const Row& row : kTable)
    if (b0 >= row.first && b0 <= row.last)
      return row.lead;
  return {}; // C0, C1, F5..FF and continuation bytes
}

// Length of the maximal subpart of an ill-formed sequence at `pos` (Unicode §3.9 "U+FFFD substitution of
// maximal subparts"): the lead byte and the continuation bytes that still fit, at least 1. For a well-formed
// sequence it is the sequence's length.
int utf8_maximal_subpart(std::string_view text, size_t pos) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const Utf8Lead lead = utf8_lead(s[pos]);
  if (lead.length <= 1)
    return 1;
  int taken = 1;
  for (int k = 1; k < lead.length && pos + k < text.size(); ++k) {
    const unsigned char b = s[pos + k];
    const bool fits = k == 1 ? (b >= lead.low && b <= lead.high) : (b & 0xc0) == 0x80;
    if (!fits)
      break;
    ++taken;
  }
  return taken;
}

// The sequence at `pos`: its length (0 when the bytes there are ill-formed) and its code point.
struct Utf8Sequence {
  int length = 0;
  uint32_t code_point = 0;
};

Utf8Sequence utf8_sequence(std::string_view text, size_t pos) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const Utf8Lead lead = utf8_lead(s[pos]);
  if (lead.length == 0 || utf8_maximal_subpart(text, pos) != lead.length)
    return {};
  uint32_t cp = lead.length == 1 ? s[pos] : s[pos] & (0x7f >> lead.length);
  for (int k = 1; k < lead.length; ++k)
    cp = (cp << 6) | (s[pos + k] & 0x3f);
  return {lead.length, cp};
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out.push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

// ---------------------------------------------------------------------------------------------------------
// Code-point classes (src/models/llama/unicode_tables.hpp), with an ASCII shortcut.
struct ClassTable {
  std::array<CodePointClass, 128> ascii{};
  ClassTable() {
    for (uint32_t cp = 0; cp < 128; ++cp)
      ascii[cp] = lookup(cp);
  }
  static CodePointClass lookup(uint32_t cp) {
    const auto* begin = detail::unicode::kCodePointRanges;
    const auto* end = begin + detail::unicode::kCodePointRangeCount;
    const auto* it =
        std::upper_bound(begin, end, cp, [](uint32_t value, const detail::unicode::CodePointRange& r) {
          return value < r.first;
        });
    if (it == begin)
      return CodePointClass::kOther;
    --it;
    return cp <= it->last ? it->cls : CodePointClass::kOther;
  }
  CodePointClass operator()(uint32_t cp) const { return cp < 128 ? ascii[cp] : lookup(cp); }
};

const ClassTable& class_table() {
  static const ClassTable table;
  return table;
}

// One unit of the text the split regex sees: a well-formed code point, or one byte of ill-formed UTF-8
// (code point kInvalid, class other).
struct Unit {
  uint32_t offset;
  uint32_t code_point;
  CodePointClass cls;
};

// A printable, bounded rendering of a value for error messages.
std::string quoted(std::string_view text) {
  std::string out = "'";
  const size_t limit = 64;
  for (size_t i = 0; i < text.size() && i < limit; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (text.size() > limit)
    out += "...";
  return out + "'";
}

[[noreturn]] void fail(const std::string& field, const std::string& value, const std::string& requirement) {
  throw Error("Tokenizer: " + field + " = " + value + ": " + requirement);
}

struct MergeEntry {
  int32_t rank;
  int32_t result;
};

constexpr uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// A queued merge of the BPE loop: ordered by rank, then by position (HF's Word::merge_all).
struct QueuedMerge {
  int32_t rank;
  int32_t position;
  int32_t result;
};
struct QueuedMergeAfter {
  bool operator()(const QueuedMerge& a, const QueuedMerge& b) const {
    return a.rank != b.rank ? a.rank > b.rank : a.position > b.position;
  }
};

struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  bool removed;
};

// Per-call scratch buffers, reused across the pieces of one encode.
struct Scratch {
  std::vector<Unit> units;
  std::vector<Symbol> symbols;
  std::vector<QueuedMerge> queue;
};

} // namespace

// -----------------------------------------------------------------------------------------------------------
struct Tokenizer::Impl {
  std::vector<std::string> token_bytes;
  std::vector<int32_t> types;
  std::array<int32_t, 256> byte_token{}; // -1: no symbol for this byte, dropped
  std::unordered_map<uint64_t, MergeEntry> merges;
  struct Special {
    std::string text;
    int32_t id;
    bool control;
  };
  std::array<std::vector<Special>, 256> specials_by_first_byte; // longest first
  std::unordered_map<std::string, int32_t> special_ids;
  bool split_digits = false;
  int32_t bos = -1, eos = -1, pad = -1, unk = -1;
  std::string pre_type;
  std::string chat_template;

  void encode_segment(std::string_view text, Scratch& scratch, std::vector<int32_t>& out) const;
  void encode_piece(const std::vector<Unit>& units, size_t begin, size_t end, size_t end_offset,
                    std::string_view text, Scratch& scratch, std::vector<int32_t>& out) const;
  void encode_word(std::string_view word, Scratch& scratch, std::vector<int32_t>& out) const;
};

namespace {

// The bytes a vocabulary entry stands for: its byte-alphabet spelling decoded, or (HF's rule for tokens
// with any other character, and for strings that are not UTF-8) its own bytes.
std::string token_bytes_of(const std::string& token) {
  const auto& alphabet = byte_alphabet();
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t pos = 0; pos < token.size();) {
    const auto [length, cp] = utf8_sequence(token, pos);
    if (length == 0 || cp >= alphabet.byte_of.size() || alphabet.byte_of[cp] < 0)
      return token;
    bytes.push_back(static_cast<char>(alphabet.byte_of[cp]));
    pos += length;
  }
  return bytes;
}

} // namespace

Tokenizer::Tokenizer(Vocabulary vocabulary) {
  auto impl = std::make_shared<Impl>();
  const size_t count = vocabulary.tokens.size();
  if (count == 0)
    fail("tokens (tokenizer.ggml.tokens)", "[]", "the vocabulary is empty");
  if (count > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    fail("tokens (tokenizer.ggml.tokens)", std::to_string(count) + " entries", "more than 2^31 - 1 tokens");
  const int32_t n = static_cast<int32_t>(count);

  if (vocabulary.token_types.empty()) {
    impl->types.assign(count, kNormal);
  } else {
    if (vocabulary.token_types.size() != count)
      fail("token_types (tokenizer.ggml.token_type)",
           std::to_string(vocabulary.token_types.size()) + " entries",
           "must have one entry per token (" + std::to_string(count) + ")");
    for (size_t i = 0; i < count; ++i) {
      const int32_t type = vocabulary.token_types[i];
      if (type < kUndefined || type > kByte)
        fail("token_types[" + std::to_string(i) + "] (tokenizer.ggml.token_type)", std::to_string(type),
             "not a llama.cpp token type (0..6)");
    }
    impl->types = std::move(vocabulary.token_types);
  }

  auto check_id = [n](int32_t id, const char* field) {
    if (id < -1 || id >= n)
      fail(field, std::to_string(id), "must be -1 (none) or a token id below " + std::to_string(n));
  };
  check_id(vocabulary.bos_id, "bos_id (tokenizer.ggml.bos_token_id)");
  check_id(vocabulary.eos_id, "eos_id (tokenizer.ggml.eos_token_id)");
  check_id(vocabulary.pad_id, "pad_id (tokenizer.ggml.padding_token_id)");
  check_id(vocabulary.unk_id, "unk_id (tokenizer.ggml.unknown_token_id)");
  impl->bos = vocabulary.bos_id;
  impl->eos = vocabulary.eos_id;
  impl->pad = vocabulary.pad_id;
  impl->unk = vocabulary.unk_id;

  if (vocabulary.pre_type == "smollm") {
    impl->split_digits = true;
  } else if (vocabulary.pre_type == "gpt2" || vocabulary.pre_type == "gpt-2") {
    impl->split_digits = false;
  } else {
    fail("pre_type (tokenizer.ggml.pre)", quoted(vocabulary.pre_type),
         "unsupported (supported: smollm, gpt2)");
  }
  impl->pre_type = std::move(vocabulary.pre_type);
  impl->chat_template = std::move(vocabulary.chat_template);

  // Token text -> id; a repeated text maps to its last id (as in HF and llama.cpp).
  std::unordered_map<std::string_view, int32_t> id_of;
  id_of.reserve(count);
  for (int32_t id = 0; id < n; ++id)
    id_of[vocabulary.tokens[id]] = id;

  impl->token_bytes.reserve(count);
  for (const auto& token : vocabulary.tokens)
    impl->token_bytes.push_back(token_bytes_of(token));

  // A byte without its symbol in the vocabulary is dropped from the text by encode, as HF does (no unk).
  const auto& alphabet = byte_alphabet();
  for (int b = 0; b < 256; ++b) {
    std::string symbol;
    append_utf8(symbol, alphabet.code_point[b]);
    const auto it = id_of.find(symbol);
    impl->byte_token[b] = it == id_of.end() ? -1 : it->second;
  }

  impl->merges.reserve(vocabulary.merges.size() * 2);
  const size_t merge_count = vocabulary.merges.size();
  if (merge_count > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    fail("merges (tokenizer.ggml.merges)", std::to_string(merge_count) + " entries",
         "more than 2^31 - 1 merges");
  for (size_t rank = 0; rank < merge_count; ++rank) {
    const std::string& merge = vocabulary.merges[rank];
    const auto field = [&] { return "merges[" + std::to_string(rank) + "] (tokenizer.ggml.merges)"; };
    // llama.cpp's split: the first space after the first character.
    const size_t space = merge.size() > 1 ? merge.find(' ', 1) : std::string::npos;
    if (space == std::string::npos || space + 1 >= merge.size())
      fail(field(), quoted(merge), "not \"left right\" (two tokens separated by one space)");
    const std::string_view left(merge.data(), space);
    const std::string_view right(merge.data() + space + 1, merge.size() - space - 1);
    const auto left_it = id_of.find(left);
    if (left_it == id_of.end())
      fail(field(), quoted(merge), quoted(left) + " is not a token");
    const auto right_it = id_of.find(right);
    if (right_it == id_of.end())
      fail(field(), quoted(merge), quoted(right) + " is not a token");
    const std::string joined = std::string(left) + std::string(right);
    const auto result_it = id_of.find(joined);
    if (result_it == id_of.end())
      fail(field(), quoted(merge), "the merged text " + quoted(joined) + " is not a token");
    // A repeated pair keeps its first (best) rank, as llama.cpp does.
    impl->merges.emplace(pair_key(left_it->second, right_it->second),
                         MergeEntry{static_cast<int32_t>(rank), result_it->second});
  }

  for (int32_t id = 0; id < n; ++id) {
    const int32_t type = impl->types[id];
    if (type != kControl && type != kUserDefined)
      continue;
    const std::string& text = impl->token_bytes[id];
    if (text.empty())
      continue; // nothing to match
    impl->special_ids[text] = id;
  }
  // One entry per distinct text (the last id of a repeated text), longest first within a first byte.
  for (const auto& [text, id] : impl->special_ids) {
    impl->specials_by_first_byte[static_cast<unsigned char>(text[0])].push_back(
        Impl::Special{text, id, impl->types[id] == kControl});
  }
  for (auto& list : impl->specials_by_first_byte)
    std::sort(list.begin(), list.end(), [](const Impl::Special& a, const Impl::Special& b) {
      return a.text.size() != b.text.size() ? a.text.size() > b.text.size() : a.text < b.text;
    });

  impl_ = std::move(impl);
}

Tokenizer Tokenizer::from_gguf(const GgufFile& file) {
  const std::string model = file.get_string("tokenizer.ggml.model");
  if (model != "gpt2")
    throw Error("Tokenizer::from_gguf: tokenizer.ggml.model = " + quoted(model) +
                ": unsupported (only \"gpt2\", byte-level BPE)");
  Vocabulary vocabulary;
  vocabulary.tokens = file.get_string_array("tokenizer.ggml.tokens");
  if (file.has("tokenizer.ggml.token_type")) {
    const auto types = file.get_int_array("tokenizer.ggml.token_type");
    vocabulary.token_types.reserve(types.size());
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i] < std::numeric_limits<int32_t>::min() || types[i] > std::numeric_limits<int32_t>::max())
        throw Error("Tokenizer::from_gguf: tokenizer.ggml.token_type[" + std::to_string(i) +
                    "] = " + std::to_string(types[i]) + ": not a llama.cpp token type (0..6)");
      vocabulary.token_types.push_back(static_cast<int32_t>(types[i]));
    }
  }
  vocabulary.merges = file.get_string_array("tokenizer.ggml.merges");
  auto read_id = [&file](const char* key) -> int32_t {
    const int64_t value = file.get_int(key, -1);
    if (value < -1 || value > std::numeric_limits<int32_t>::max())
      throw Error(std::string("Tokenizer::from_gguf: ") + key + " = " + std::to_string(value) +
                  ": not a token id");
    return static_cast<int32_t>(value);
  };
  vocabulary.bos_id = read_id("tokenizer.ggml.bos_token_id");
  vocabulary.eos_id = read_id("tokenizer.ggml.eos_token_id");
  vocabulary.pad_id = read_id("tokenizer.ggml.padding_token_id");
  vocabulary.unk_id = read_id("tokenizer.ggml.unknown_token_id");
  if (file.has("tokenizer.ggml.pre"))
    vocabulary.pre_type = file.get_string("tokenizer.ggml.pre");
  if (file.has("tokenizer.chat_template"))
    vocabulary.chat_template = file.get_string("tokenizer.chat_template");
  return Tokenizer(std::move(vocabulary));
}

// -----------------------------------------------------------------------------------------------------------
// Encoding.

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  const Impl& impl = *impl_;
  if (text.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    throw Error("Tokenizer::encode: text = " + std::to_string(text.size()) +
                " bytes: longer than 2^31 - 1 bytes");
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  Scratch scratch;
  size_t segment_begin = 0;
  for (size_t pos = 0; pos < text.size();) {
    const auto& candidates = impl.specials_by_first_byte[static_cast<unsigned char>(text[pos])];
    const Impl::Special* match = nullptr;
    for (const auto& special : candidates) {
      if (special.control && !parse_special)
        continue;
      if (text.size() - pos >= special.text.size() &&
          std::memcmp(text.data() + pos, special.text.data(), special.text.size()) == 0) {
        match = &special; // longest first: the first hit is the longest at this position
        break;
      }
    }
    if (match == nullptr) {
      ++pos;
      continue;
    }
    impl.encode_segment(text.substr(segment_begin, pos - segment_begin), scratch, out);
    out.push_back(match->id);
    pos += match->text.size();
    segment_begin = pos;
  }
  impl.encode_segment(text.substr(segment_begin), scratch, out);
  return out;
}

void Tokenizer::Impl::encode_segment(std::string_view text, Scratch& scratch,
                                     std::vector<int32_t>& out) const {
  if (text.empty())
    return;
  const auto& classes = class_table();
  auto& units = scratch.units;
  units.clear();
  for (size_t pos = 0; pos < text.size();) {
    const auto [length, cp] = utf8_sequence(text, pos);
    if (length == 0) {
      units.push_back(Unit{static_cast<uint32_t>(pos), kInvalid, CodePointClass::kOther});
      pos += 1;
    } else {
      units.push_back(Unit{static_cast<uint32_t>(pos), cp, classes(cp)});
      pos += length;
    }
  }
  const auto unit_end = [&](size_t u) { return u + 1 < units.size() ? units[u + 1].offset : text.size(); };
  if (!split_digits) {
    encode_piece(units, 0, units.size(), text.size(), text, scratch, out);
    return;
  }
  // Digits(individual_digits = true): each number code point is a piece alone; the runs between are split
  // by the regex, each as a text of its own (its end is the end of input for the look-ahead).
  size_t run_begin = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].cls != CodePointClass::kNumber)
      continue;
    if (run_begin < u)
      encode_piece(units, run_begin, u, units[u].offset, text, scratch, out);
    encode_word(text.substr(units[u].offset, unit_end(u) - units[u].offset), scratch, out);
    run_begin = u + 1;
  }
  if (run_begin < units.size())
    encode_piece(units, run_begin, units.size(), text.size(), text, scratch, out);
}

// The GPT-2 split regex over units [begin, end) (end_offset = byte offset of `end`), matched by hand:
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// Alternatives are tried in order at each position (leftmost-first, greedy), as Oniguruma does.
void Tokenizer::Impl::encode_piece(const std::vector<Unit>& units, size_t begin, size_t end,
                                   size_t end_offset, std::string_view text, Scratch& scratch,
                                   std::vector<int32_t>& out) const {
  const auto offset_of = [&](size_t u) {
    return u < end ? static_cast<size_t>(units[u].offset) : end_offset;
  };
  const auto cp_at = [&](size_t u) { return u < end ? units[u].code_point : kInvalid; };
  size_t u = begin;
  while (u < end) {
    size_t match_end = u; // exclusive unit index
    const uint32_t cp = units[u].code_point;
    if (cp == '\'' && u + 1 < end) {
      const uint32_t c1 = cp_at(u + 1), c2 = cp_at(u + 2);
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        match_end = u + 2;
      } else if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
        match_end = u + 3;
      }
    }
    if (match_end == u) {
      // ` ?X+` for X = letter, number, other (not space/letter/number): the optional space is U+0020 only.
      const size_t first = (cp == ' ' && u + 1 < end) ? u + 1 : u;
      const CodePointClass cls = units[first].cls;
      if (cls != CodePointClass::kSpace) {
        size_t k = first + 1;
        while (k < end && units[k].cls == cls)
          ++k;
        match_end = k;
      }
    }
    if (match_end == u) {
      // White space: \s+(?!\S) keeps the last space for the next token when a non-space follows, unless
      // the run is one character long, when \s+ takes it.
      size_t k = u + 1;
      while (k < end && units[k].cls == CodePointClass::kSpace)
        ++k;
      match_end = (k < end && k - u >= 2) ? k - 1 : k;
    }
    const size_t from = offset_of(u);
    encode_word(text.substr(from, offset_of(match_end) - from), scratch, out);
    u = match_end;
  }
}

// BPE over the bytes of one pre-token: start from one symbol per byte (bytes the vocabulary has no symbol
// for are left out, HF's BPE without unk), repeatedly merge the adjacent pair with the lowest rank (leftmost
// among equal ranks) until no pair has a merge. A queue entry is stale when
// its position was absorbed or its pair changed; a changed pair always joins to a longer text than the
// entry's result, so checking the result id is exact (HF's Word::merge_all).
void Tokenizer::Impl::encode_word(std::string_view word, Scratch& scratch, std::vector<int32_t>& out) const {
  if (word.size() == 1) {
    const int32_t id = byte_token[static_cast<unsigned char>(word[0])];
    if (id >= 0)
      out.push_back(id);
    return;
  }
  auto& symbols = scratch.symbols;
  auto& queue = scratch.queue;
  symbols.clear();
  queue.clear();
  for (const char byte : word) {
    const int32_t id = byte_token[static_cast<unsigned char>(byte)];
    if (id >= 0)
      symbols.push_back(Symbol{id, 0, 0, false});
  }
  const int32_t size = static_cast<int32_t>(symbols.size());
  if (size == 0)
    return;
  for (int32_t i = 0; i < size; ++i) {
    symbols[i].prev = i - 1;
    symbols[i].next = i + 1 < size ? i + 1 : -1;
  }
  const auto find_merge = [this](int32_t left, int32_t right) -> const MergeEntry* {
    const auto it = merges.find(pair_key(left, right));
    return it == merges.end() ? nullptr : &it->second;
  };
  const QueuedMergeAfter after;
  for (int32_t i = 0; i + 1 < size; ++i)
    if (const MergeEntry* m = find_merge(symbols[i].id, symbols[i + 1].id))
      queue.push_back(QueuedMerge{m->rank, i, m->result});
  std::make_heap(queue.begin(), queue.end(), after);
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), after);
    const QueuedMerge top = queue.back();
    queue.pop_back();
    Symbol& left = symbols[top.position];
    if (left.removed || left.next < 0)
      continue;
    Symbol& right = symbols[left.next];
    const MergeEntry* current = find_merge(left.id, right.id);
    if (current == nullptr || current->result != top.result)
      continue;
    left.id = top.result;
    right.removed = true;
    left.next = right.next;
    if (right.next >= 0)
      symbols[right.next].prev = top.position;
    if (left.prev >= 0)
      if (const MergeEntry* m = find_merge(symbols[left.prev].id, left.id)) {
        queue.push_back(QueuedMerge{m->rank, left.prev, m->result});
        std::push_heap(queue.begin(), queue.end(), after);
      }
    if (left.next >= 0)
      if (const MergeEntry* m = find_merge(left.id, symbols[left.next].id)) {
        queue.push_back(QueuedMerge{m->rank, top.position, m->result});
        std::push_heap(queue.begin(), queue.end(), after);
      }
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next)
    out.push_back(symbols[i].id);
}

// -----------------------------------------------------------------------------------------------------------
// Decoding and queries.

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  const Impl& impl = *impl_;
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= static_cast<int32_t>(impl.token_bytes.size()))
      throw Error("Tokenizer::decode: ids[" + std::to_string(i) + "] = " + std::to_string(id) +
                  ": not a token id (vocabulary of " + std::to_string(impl.token_bytes.size()) + ")");
    if (skip_special && impl.types[id] == kControl)
      continue;
    out += impl.token_bytes[id];
  }
  return out;
}

std::string Tokenizer::decode_lossy(const std::vector<int32_t>& ids, bool skip_special) const {
  const std::string raw = decode(ids, skip_special);
  std::string out;
  out.reserve(raw.size());
  for (size_t pos = 0; pos < raw.size();) {
    const int length = utf8_sequence(raw, pos).length;
    if (length > 0) {
      out.append(raw, pos, length);
      pos += length;
    } else {
      out += "\xef\xbf\xbd";
      pos += utf8_maximal_subpart(raw, pos);
    }
  }
  return out;
}

std::string Tokenizer::token_text(int32_t id) const {
  if (id < 0 || id >= vocab_size())
    throw Error("Tokenizer::token_text: id = " + std::to_string(id) + ": not a token id (vocabulary of " +
                std::to_string(vocab_size()) + ")");
  return impl_->token_bytes[id];
}

Tokenizer::TokenType Tokenizer::token_type(int32_t id) const {
  if (id < 0 || id >= vocab_size())
    throw Error("Tokenizer::token_type: id = " + std::to_string(id) + ": not a token id (vocabulary of " +
                std::to_string(vocab_size()) + ")");
  return static_cast<TokenType>(impl_->types[id]);
}

int32_t Tokenizer::bos_id() const {
  return impl_->bos;
}
int32_t Tokenizer::eos_id() const {
  return impl_->eos;
}
int32_t Tokenizer::pad_id() const {
  return impl_->pad;
}
int32_t Tokenizer::unk_id() const {
  return impl_->unk;
}
int Tokenizer::vocab_size() const {
  return static_cast<int>(impl_->token_bytes.size());
}
const std::string& Tokenizer::pre_type() const {
  return impl_->pre_type;
}
const std::string& Tokenizer::chat_template() const {
  return impl_->chat_template;
}

std::optional<int32_t> Tokenizer::special_id(std::string_view text) const {
  const auto it = impl_->special_ids.find(std::string(text));
  if (it == impl_->special_ids.end())
    return std::nullopt;
  return it->second;
}

// -----------------------------------------------------------------------------------------------------------
// Chat template. Only ChatML is rendered (the format of SmolLM2's template); the template text is inspected
// for the default system prompt it inserts when the conversation does not start with one, written as a
// string literal '<|im_start|>system\n...<|im_end|>' (a real newline or the escape \n).

namespace {

std::string unescape_jinja_literal(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\' || i + 1 == text.size()) {
      out.push_back(text[i]);
      continue;
    }
    const char c = text[++i];
    switch (c) {
    case 'n':
      out.push_back('\n');
      break;
    case 't':
      out.push_back('\t');
      break;
    case 'r':
      out.push_back('\r');
      break;
    default:
      out.push_back(c);
      break; // \\ \' \"
    }
  }
  return out;
}

} // namespace

std::string Tokenizer::apply_chat_template(const std::vector<std::pair<std::string, std::string>>& messages,
                                           bool add_generation_prompt) const {
  const std::string& chat = impl_->chat_template;
  static const std::string kStart = "<|im_start|>", kEnd = "<|im_end|>";
  std::optional<std::string> default_system;
  if (!chat.empty()) {
    if (chat.find(kStart) == std::string::npos || chat.find(kEnd) == std::string::npos)
      throw Error("Tokenizer::apply_chat_template: tokenizer.chat_template = " + quoted(chat) +
                  ": not a ChatML template (only ChatML, <|im_start|>role\\ncontent<|im_end|>, is rendered)");
    for (const char* opener : {"<|im_start|>system\n", "<|im_start|>system\\n"}) {
      const size_t at = chat.find(opener);
      if (at == std::string::npos)
        continue;
      const size_t begin = at + std::strlen(opener);
      const size_t end = chat.find(kEnd, begin);
      if (end == std::string::npos)
        continue;
      default_system = unescape_jinja_literal(std::string_view(chat).substr(begin, end - begin));
      break;
    }
  }
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& [role, content] = messages[i];
    if (i == 0 && role != "system" && default_system)
      out += kStart + "system\n" + *default_system + kEnd + "\n";
    out += kStart + role + "\n" + content + kEnd + "\n";
  }
  if (add_generation_prompt)
    out += kStart + "assistant\n";
  return out;
}

} // namespace smcgraph
