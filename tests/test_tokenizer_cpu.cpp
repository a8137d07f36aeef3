// Byte-level BPE tokenizer: merge order, the smollm / gpt2 split, special tokens, byte round trips and
// validation on small hand-built vocabularies; with the real SmolLM2 file (when present) every line of
// tests/data/tokenizer_corpus.jsonl against the ids HF `tokenizers` gives (make_tokenizer_corpus.py).
//
// Environment: SMCGRAPH_MODEL_PATH (the .gguf; default <repo>/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf),
// SMCGRAPH_SOURCE_ROOT (the repository; default: the first parent of the cwd holding meson.build and
// tests/data), SMCGRAPH_FUZZ_CORPUS_DIR (when set, seed inputs for tests/fuzz/fuzz_tokenizer.cpp go there).
#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "models/llama/unicode_tables.hpp"
#include "smcgraph/error.hpp"
#include "smcgraph/gguf.hpp"
#include "smcgraph/llama_model.hpp"
#include "smcgraph/tokenizer.hpp"
#include "support/fuzz_corpus.hpp"
#include "support/gguf_writer.hpp"

namespace {

using smcgraph::Tokenizer;
namespace fs = std::filesystem;

// --- GPT-2 byte spelling, written independently of the library -------------------------------------------
std::string spell(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes)
    out += smcgraph::test::gpt2_byte_symbol(b);
  return out;
}

// A vocabulary of the 256 byte symbols (id = byte value), then `merged` tokens, then specials.
struct SmallVocabulary {
  Tokenizer::Vocabulary vocabulary;
  std::vector<std::string> extra; // texts (bytes) of ids 256..

  int32_t id(std::string_view bytes) const {
    if (bytes.size() == 1)
      return static_cast<unsigned char>(bytes[0]);
    for (size_t i = 0; i < extra.size(); ++i)
      if (extra[i] == bytes)
        return static_cast<int32_t>(256 + i);
    FAIL("no token " << bytes);
    return -1;
  }
};

// merges: pairs of byte strings, in rank order; specials: (text, type).
SmallVocabulary make_small(const std::vector<std::pair<std::string, std::string>>& merges,
                           const std::vector<std::pair<std::string, int32_t>>& specials = {},
                           const std::string& pre_type = "smollm") {
  SmallVocabulary small;
  auto& v = small.vocabulary;
  for (int b = 0; b < 256; ++b) {
    v.tokens.push_back(spell(std::string(1, static_cast<char>(b))));
    v.token_types.push_back(Tokenizer::kNormal);
  }
  for (const auto& [left, right] : merges) {
    v.tokens.push_back(spell(left + right));
    v.token_types.push_back(Tokenizer::kNormal);
    v.merges.push_back(spell(left) + " " + spell(right));
    small.extra.push_back(left + right);
  }
  for (const auto& [text, type] : specials) {
    v.tokens.push_back(text);
    v.token_types.push_back(type);
    small.extra.push_back(text);
  }
  v.pre_type = pre_type;
  return small;
}

std::vector<int32_t> ids_of(const SmallVocabulary& small, const std::vector<std::string>& pieces) {
  std::vector<int32_t> ids;
  for (const auto& piece : pieces)
    ids.push_back(small.id(piece));
  return ids;
}

std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const smcgraph::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// --- Locating the data --------------------------------------------------------------------------------
fs::path source_root() {
  if (const char* root = std::getenv("SMCGRAPH_SOURCE_ROOT"); root != nullptr && *root != '\0')
    return root;
  for (fs::path dir = fs::current_path(); !dir.empty(); dir = dir.parent_path()) {
    if (fs::exists(dir / "meson.build") && fs::is_directory(dir / "tests" / "data"))
      return dir;
    if (dir == dir.parent_path())
      break;
  }
  return {};
}

fs::path model_path() {
  return smcgraph::default_llama_model_path();
}

// --- A minimal JSON reader for the corpus lines ---------------------------------------------------------
struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  bool boolean = false;
  int64_t number = 0;
  std::string text;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> fields;

  const Json& operator[](const std::string& key) const {
    for (const auto& [name, value] : fields)
      if (name == key)
        return value;
    static const Json null;
    return null;
  }
  bool has(const std::string& key) const { return (*this)[key].kind != kNull; }
  std::vector<int32_t> ids() const {
    std::vector<int32_t> out;
    for (const auto& item : items)
      out.push_back(static_cast<int32_t>(item.number));
    return out;
  }
};

class JsonParser {
public:
  explicit JsonParser(std::string_view text) : s_(text) {}
  Json parse() {
    Json value = value_();
    skip();
    if (pos_ != s_.size())
      throw std::runtime_error("trailing characters");
    return value;
  }

private:
  void skip() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t'))
      ++pos_;
  }
  char peek() {
    skip();
    if (pos_ >= s_.size())
      throw std::runtime_error("unexpected end");
    return s_[pos_];
  }
  void expect(char c) {
    if (peek() != c)
      throw std::runtime_error(std::string("expected ") + c);
    ++pos_;
  }
  static void utf8(std::string& out, uint32_t cp) {
    // The lead byte carries the top bits, each continuation byte 6 more.
    static constexpr uint8_t kLead[] = {0x00, 0xc0, 0xe0, 0xf0};
    const int continuation = cp < 0x80 ? 0 : cp < 0x800 ? 1 : cp < 0x10000 ? 2 : 3;
    out.push_back(static_cast<char>(kLead[continuation] | (cp >> (6 * continuation))));
    for (int k = continuation - 1; k >= 0; --k)
      out.push_back(static_cast<char>(0x80 | ((cp >> (6 * k)) & 0x3f)));
  }
  uint32_t hex4() {
    if (pos_ + 4 > s_.size())
      throw std::runtime_error("short \\u escape");
    const uint32_t value = static_cast<uint32_t>(std::stoul(std::string(s_.substr(pos_, 4)), nullptr, 16));
    pos_ += 4;
    return value;
  }
  std::string string_() {
    expect('"');
    std::string out;
    while (true) {
      if (pos_ >= s_.size())
        throw std::runtime_error("unterminated string");
      const char c = s_[pos_++];
      if (c == '"')
        return out;
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      const char e = s_[pos_++];
      if (e == 'u') {
        uint32_t cp = hex4();
        if (cp >= 0xd800 && cp < 0xdc00 && s_.substr(pos_, 2) == "\\u") {
          pos_ += 2;
          cp = 0x10000 + ((cp - 0xd800) << 10) + (hex4() - 0xdc00);
        }
        utf8(out, cp);
        continue;
      }
      // The one-character escapes: b f n r t stand for control characters, anything else for itself (\"
      // \\ \/).
      static constexpr std::string_view kFrom = "bfnrt", kTo = "\b\f\n\r\t";
      const size_t at = kFrom.find(e);
      out.push_back(at == std::string_view::npos ? e : kTo[at]);
    }
  }
  Json value_() {
    Json v;
    const char c = peek();
    if (c == '{') {
      v.kind = Json::kObject;
      ++pos_;
      if (peek() == '}') {
        ++pos_;
        return v;
      }
      while (true) {
        std::string key = string_();
        expect(':');
        v.fields.emplace_back(std::move(key), value_());
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = Json::kArray;
      ++pos_;
      if (peek() == ']') {
        ++pos_;
        return v;
      }
      while (true) {
        v.items.push_back(value_());
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = Json::kString;
      v.text = string_();
      return v;
    }
    if (s_.substr(pos_, 4) == "true" || s_.substr(pos_, 5) == "false") {
      v.kind = Json::kBool;
      v.boolean = s_[pos_] == 't';
      pos_ += v.boolean ? 4 : 5;
      return v;
    }
    if (s_.substr(pos_, 4) == "null") {
      pos_ += 4;
      return v;
    }
    v.kind = Json::kNumber;
    size_t used = 0;
    v.number = std::stoll(std::string(s_.substr(pos_, 24)), &used);
    pos_ += used;
    return v;
  }
  std::string_view s_;
  size_t pos_ = 0;
};

fs::path corpus_path() {
  return source_root() / "tests" / "data" / "tokenizer_corpus.jsonl";
}

// Empty when the file cannot be read.
std::vector<Json> read_corpus() {
  std::ifstream in(corpus_path(), std::ios::binary);
  std::vector<Json> records;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty())
      records.push_back(JsonParser(line).parse());
  return records;
}

std::string escape(std::string_view bytes) {
  std::ostringstream out;
  for (unsigned char c : bytes) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out << c;
    } else {
      static const char* hex = "0123456789abcdef";
      out << "\\x" << hex[c >> 4] << hex[c & 15];
    }
  }
  return out.str();
}

std::string random_bytes(std::mt19937_64& rng, size_t max_length) {
  std::string out(rng() % (max_length + 1), '\0');
  for (auto& c : out)
    c = static_cast<char>(rng() & 0xff);
  return out;
}

// Random text from fragments that exercise every branch: specials (whole and cut), contractions, digits,
// white space kinds, multi-byte characters (also cut in half), invalid bytes.
std::string random_text(std::mt19937_64& rng, size_t pieces) {
  static const std::vector<std::string> fragments = {"<|im_start|>",
                                                     "<|im_end|>",
                                                     "<|endoftext|>",
                                                     "<|im_",
                                                     "|>",
                                                     "<tool>",
                                                     "'s",
                                                     "'ll",
                                                     "'",
                                                     "s",
                                                     "re",
                                                     " ",
                                                     "  ",
                                                     "\t",
                                                     "\n",
                                                     "\r\n",
                                                     "\xc2\xa0",
                                                     "\xe3\x80\x80",
                                                     "1",
                                                     "23",
                                                     "4.5",
                                                     "\xd9\xa3",
                                                     "\xef\xbc\x90",
                                                     "he",
                                                     "hello",
                                                     " world",
                                                     "Hello",
                                                     "\xc3\xa9",
                                                     "e\xcc\x81",
                                                     "\xe6\x97\xa5\xe6\x9c\xac",
                                                     "\xf0\x9f\x99\x82",
                                                     "\xf0\x9f",
                                                     "\x80",
                                                     "\xff",
                                                     "\xc0\xaf",
                                                     "\xed\xa0\x80",
                                                     "\xf4\x90\x80\x80",
                                                     "!",
                                                     "...",
                                                     "(",
                                                     "_",
                                                     "x"};
  std::string out;
  for (size_t i = 0; i < pieces; ++i)
    out += fragments[rng() % fragments.size()];
  return out;
}

} // namespace

// =========================================================================================================
// File-free cases.

TEST_CASE("the unicode table is sorted, disjoint and classifies known code points") {
  using smcgraph::detail::unicode::CodePointClass;
  const auto* ranges = smcgraph::detail::unicode::kCodePointRanges;
  const int count = smcgraph::detail::unicode::kCodePointRangeCount;
  for (int i = 0; i < count; ++i) {
    REQUIRE(ranges[i].first <= ranges[i].last);
    REQUIRE(ranges[i].last <= 0x10ffffu);
    if (i > 0)
      REQUIRE(ranges[i - 1].last < ranges[i].first);
  }
  auto cls = [&](uint32_t cp) {
    for (int i = 0; i < count; ++i)
      if (cp >= ranges[i].first && cp <= ranges[i].last)
        return ranges[i].cls;
    return CodePointClass::kOther;
  };
  CHECK(cls('a') == CodePointClass::kLetter);
  CHECK(cls('Z') == CodePointClass::kLetter);
  CHECK(cls('7') == CodePointClass::kNumber);
  CHECK(cls(' ') == CodePointClass::kSpace);
  CHECK(cls('\t') == CodePointClass::kSpace);
  CHECK(cls(0x0b) == CodePointClass::kSpace);
  CHECK(cls(0x1c) == CodePointClass::kOther); // Python's isspace() says yes; \s (White_Space) says no
  CHECK(cls(0x85) == CodePointClass::kSpace);
  CHECK(cls(0xa0) == CodePointClass::kSpace);
  CHECK(cls(0x3000) == CodePointClass::kSpace);
  CHECK(cls(0x2028) == CodePointClass::kSpace);
  CHECK(cls(0x200b) == CodePointClass::kOther);  // zero width space is Cf
  CHECK(cls(0x0301) == CodePointClass::kOther);  // combining marks are \p{M}
  CHECK(cls(0x00b2) == CodePointClass::kNumber); // superscript two (No)
  CHECK(cls(0x216b) == CodePointClass::kNumber); // roman numeral twelve (Nl)
  CHECK(cls(0x0663) == CodePointClass::kNumber);
  CHECK(cls(0x65e5) == CodePointClass::kLetter);
  CHECK(cls(0x1f642) == CodePointClass::kOther);
  CHECK(cls(0x1c89) == CodePointClass::kLetter); // new in Unicode 16, as HF's Oniguruma has it
  CHECK(std::string(smcgraph::detail::unicode::kUnicodeTablesVersion) == "16.0.0");
}

TEST_CASE("merges apply by rank, leftmost among equal ranks") {
  {
    const auto small = make_small({{"a", "b"}, {"b", "c"}});
    const Tokenizer tokenizer(small.vocabulary);
    CHECK(tokenizer.encode("abc") == ids_of(small, {"ab", "c"}));
  }
  {
    const auto small = make_small({{"b", "c"}, {"a", "b"}});
    const Tokenizer tokenizer(small.vocabulary);
    CHECK(tokenizer.encode("abc") == ids_of(small, {"a", "bc"}));
  }
  {
    const auto small = make_small({{"a", "a"}});
    const Tokenizer tokenizer(small.vocabulary);
    CHECK(tokenizer.encode("aaa") == ids_of(small, {"aa", "a"}));
    CHECK(tokenizer.encode("aaaa") == ids_of(small, {"aa", "aa"}));
  }
  {
    // A later merge may use the results of earlier ones; the whole word becomes one token.
    const auto small = make_small({{"l", "l"}, {"h", "e"}, {"he", "ll"}, {"hell", "o"}, {" ", "hello"}});
    const Tokenizer tokenizer(small.vocabulary);
    CHECK(tokenizer.encode("hello") == ids_of(small, {"hello"}));
    CHECK(tokenizer.encode(" hello") == ids_of(small, {" hello"}));
    CHECK(tokenizer.encode("hellohello") == ids_of(small, {"hello", "hello"}));
    CHECK(tokenizer.encode("helo") == ids_of(small, {"he", "l", "o"}));
  }
  {
    // Lowest rank first, not left to right: "y z" (rank 0) goes before "x y", and no merge joins "x"
    // with "yz", although "xy z" would have made "xyz".
    const auto small = make_small({{"y", "z"}, {"x", "y"}, {"xy", "z"}});
    const Tokenizer tokenizer(small.vocabulary);
    CHECK(tokenizer.encode("xyz") == ids_of(small, {"x", "yz"}));
    CHECK(tokenizer.encode("xyx") == ids_of(small, {"xy", "x"}));
  }
}

TEST_CASE("smollm splits every digit; gpt2 keeps number runs") {
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"1", "2"}, {"12", "3"}, {" ", "1"}, {"a", "1"}, {" ", "a"}};
  const auto smollm = make_small(merges, {}, "smollm");
  const auto gpt2 = make_small(merges, {}, "gpt2");
  const Tokenizer digits(smollm.vocabulary), plain(gpt2.vocabulary);
  CHECK(digits.encode("123") == ids_of(smollm, {"1", "2", "3"}));
  CHECK(plain.encode("123") == ids_of(gpt2, {"123"}));
  CHECK(digits.encode(" 1") == ids_of(smollm, {" ", "1"}));
  CHECK(plain.encode(" 1") == ids_of(gpt2, {" 1"}));
  CHECK(digits.encode("a1") == ids_of(smollm, {"a", "1"}));
  CHECK(plain.encode("a1") == ids_of(gpt2, {"a", "1"})); // \p{L}+ and \p{N}+ are separate pieces
  // The run before a digit ends there: its white space is a piece of its own (look-ahead at the end).
  CHECK(digits.encode("a  1") == ids_of(smollm, {"a", " ", " ", "1"}));
  CHECK(plain.encode("a  1") == ids_of(gpt2, {"a", " ", " 1"}));
  // Non-ASCII digits split too (U+0663 ARABIC-INDIC DIGIT THREE, two bytes, one piece).
  const std::string three = "\xd9\xa3";
  CHECK(digits.encode(three + three) == std::vector<int32_t>{0xd9, 0xa3, 0xd9, 0xa3});
}

TEST_CASE("the GPT-2 regex decides where merges may apply") {
  const auto small = make_small(
      {{"o", " "}, {" ", "w"}, {" ", " "}, {"t", "'"}, {"'", "s"}, {"a", "\t"}, {"!", "!"}, {" ", "!"}});
  const Tokenizer tokenizer(small.vocabulary);
  CHECK(tokenizer.encode("o w") == ids_of(small, {"o", " w"}));       // "o " never merges across pieces
  CHECK(tokenizer.encode("a  w") == ids_of(small, {"a", " ", " w"})); // \s+(?!\S) leaves one space
  CHECK(tokenizer.encode("a  ") == ids_of(small, {"a", "  "}));       // at the end the run stays whole
  CHECK(tokenizer.encode("  ") == ids_of(small, {"  "}));
  CHECK(tokenizer.encode("it's") == ids_of(small, {"i", "t", "'s"}));     // contraction is its own piece
  CHECK(tokenizer.encode("IT'S") == ids_of(small, {"I", "T", "'", "S"})); // case-sensitive
  CHECK(tokenizer.encode("a\tb") == ids_of(small, {"a", "\t", "b"}));
  CHECK(tokenizer.encode("!!! !!") == ids_of(small, {"!!", "!", " ", "!!"})); // "! !" (rank 6) before " !"
  CHECK(tokenizer.encode("\n\nx") == std::vector<int32_t>{'\n', '\n', 'x'});
}

TEST_CASE("special tokens: control with parse_special, user-defined always, leftmost-longest") {
  const auto small = make_small({{"h", "i"}}, {{"<|im_start|>", Tokenizer::kControl},
                                               {"<|im_end|>", Tokenizer::kControl},
                                               {"<a>", Tokenizer::kControl},
                                               {"<a>b", Tokenizer::kControl},
                                               {"<tool>", Tokenizer::kUserDefined}});
  auto vocabulary = small.vocabulary;
  vocabulary.bos_id = small.id("<|im_start|>");
  vocabulary.eos_id = small.id("<|im_end|>");
  const Tokenizer tokenizer(vocabulary);
  const int32_t start = small.id("<|im_start|>"), end = small.id("<|im_end|>");
  CHECK(tokenizer.bos_id() == start);
  CHECK(tokenizer.eos_id() == end);
  CHECK(tokenizer.encode("<|im_start|>hi<|im_end|>") == std::vector<int32_t>{start, small.id("hi"), end});
  const auto plain = tokenizer.encode("<|im_start|>hi", false);
  CHECK(plain.size() == 13); // 12 bytes of "<|im_start|>", then "hi"
  CHECK(tokenizer.decode(plain) == "<|im_start|>hi");
  CHECK(tokenizer.encode("<tool>", false) == std::vector<int32_t>{small.id("<tool>")});
  CHECK(tokenizer.encode("x<a>by") == std::vector<int32_t>{'x', small.id("<a>b"), 'y'});
  CHECK(tokenizer.encode("<a>") == std::vector<int32_t>{small.id("<a>")});
  CHECK(tokenizer.encode("<|im_start") ==
        std::vector<int32_t>{'<', '|', 'i', 'm', '_', 's', 't', 'a', 'r', 't'});
  CHECK(tokenizer.special_id("<|im_end|>") == end);
  CHECK(tokenizer.special_id("<tool>") == small.id("<tool>"));
  CHECK_FALSE(tokenizer.special_id("hi").has_value());
  CHECK(tokenizer.token_type(start) == Tokenizer::kControl);
  CHECK(tokenizer.token_type(small.id("<tool>")) == Tokenizer::kUserDefined);
  const std::vector<int32_t> ids = {start, small.id("hi"), small.id("<tool>"), end};
  CHECK(tokenizer.decode(ids) == "<|im_start|>hi<tool><|im_end|>");
  CHECK(tokenizer.decode(ids, true) == "hi<tool>");
  CHECK(tokenizer.token_text(small.id("hi")) == "hi");
  CHECK(tokenizer.token_text(' ') == " ");
}

TEST_CASE("any byte string round-trips; invalid UTF-8 decodes raw or lossy") {
  const auto small =
      make_small({{"h", "e"}, {"l", "l"}, {"he", "ll"}, {" ", "w"}, {"\xc3", "\xa9"}, {"1", "2"}},
                 {{"<|im_start|>", Tokenizer::kControl},
                  {"<|im_end|>", Tokenizer::kControl},
                  {"<tool>", Tokenizer::kUserDefined}},
                 "smollm");
  const Tokenizer tokenizer(small.vocabulary);
  auto gpt2_vocabulary = small.vocabulary;
  gpt2_vocabulary.pre_type = "gpt2";
  const Tokenizer gpt2(gpt2_vocabulary);
  std::mt19937_64 rng(7);
  int checked = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const std::string text = trial % 2 == 0 ? random_bytes(rng, 64) : random_text(rng, rng() % 24);
    for (const Tokenizer* t : {&tokenizer, &gpt2})
      for (bool parse_special : {true, false}) {
        const auto ids = t->encode(text, parse_special);
        const std::string back = t->decode(ids);
        if (back != text)
          FAIL_CHECK("round trip of \"" << escape(text) << "\" gave \"" << escape(back) << "\"");
        ++checked;
      }
  }
  CHECK(checked == 12000);
  // Raw bytes out; lossy replaces maximal subparts as Python's errors="replace" does.
  CHECK(tokenizer.decode({0xff}) == "\xff");
  CHECK(tokenizer.decode_lossy({0xff}) == "\xef\xbf\xbd");
  CHECK(tokenizer.decode_lossy({0xe2, 0x82}) == "\xef\xbf\xbd"); // b"\xe2\x82" -> one U+FFFD
  CHECK(tokenizer.decode_lossy({0xe2, 0x82, 'A'}) == "\xef\xbf\xbd"
                                                     "A");                                     // b"\xe2\x82A"
  CHECK(tokenizer.decode_lossy({0xf0, 0x80, 0x80}) == "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"); // overlong
  CHECK(tokenizer.decode_lossy({0xed, 0xa0, 0x80}) == "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"); // surrogate
  CHECK(tokenizer.decode_lossy({0xc3, 0xa9, 0xc3}) == "\xc3\xa9\xef\xbf\xbd");
  CHECK(tokenizer.decode_lossy({small.id("\xc3\xa9")}) == "\xc3\xa9");
  // A byte whose symbol the vocabulary lacks is dropped (HF's BPE without unk); its neighbours in the
  // same piece become adjacent and may merge.
  auto holes = small.vocabulary;
  holes.tokens[0x04] = "<no byte 4>";
  holes.tokens[0xff] = "<no byte ff>";
  const Tokenizer with_holes(holes);
  CHECK(with_holes.encode("\x04").empty());
  CHECK(with_holes.encode("h\x04"
                          "e\xffll") == ids_of(small, {"h", "e", "ll"}));  // "other" bytes split letters
  CHECK(with_holes.encode("\xc3\x04\xa9") == ids_of(small, {"\xc3\xa9"})); // one "other" piece
  CHECK(with_holes.decode(with_holes.encode("a\x04"
                                            "b\xff")) == "ab");
  // Invalid bytes are "other" for the regex: they join a punctuation run, not a word.
  CHECK(tokenizer.encode("he\xff!") == ids_of(small, {"he", "\xff", "!"}));
  CHECK(tokenizer.encode("\xff\xfe") == std::vector<int32_t>{0xff, 0xfe});
}

TEST_CASE("validation errors name the field") {
  const auto small = make_small({{"a", "b"}});
  auto with = [&](auto change) {
    auto v = small.vocabulary;
    change(v);
    return error_of([&] { Tokenizer t(v); });
  };
  CHECK(with([](Tokenizer::Vocabulary& v) { v.tokens.clear(); }).find("tokens (tokenizer.ggml.tokens)") !=
        std::string::npos);
  CHECK(with([](Tokenizer::Vocabulary& v) { v.token_types.pop_back(); }).find("token_types") !=
        std::string::npos);
  CHECK(with([](Tokenizer::Vocabulary& v) { v.token_types[3] = 9; }).find("token_types[3]") !=
        std::string::npos);
  CHECK(with([](Tokenizer::Vocabulary& v) { v.merges.push_back("ab"); }).find("merges[1]") !=
        std::string::npos);
  CHECK(with([](Tokenizer::Vocabulary& v) { v.merges.push_back("a "); }).find("merges[1]") !=
        std::string::npos);
  CHECK(with([](Tokenizer::Vocabulary& v) { v.merges.push_back("a qq"); }).find("'qq' is not a token") !=
        std::string::npos);
  CHECK(with([](Tokenizer::Vocabulary& v) {
          v.merges.push_back("b a");
        }).find("merged text 'ba' is not a token") != std::string::npos);
  CHECK(with([](Tokenizer::Vocabulary& v) { v.bos_id = 257; }).find("bos_id") != std::string::npos);
  CHECK(with([](Tokenizer::Vocabulary& v) { v.eos_id = -2; }).find("eos_id") != std::string::npos);
  CHECK(with([](Tokenizer::Vocabulary& v) { v.pad_id = 1000; }).find("pad_id") != std::string::npos);
  CHECK(with([](Tokenizer::Vocabulary& v) { v.unk_id = 257; }).find("unk_id") != std::string::npos);
  CHECK(with([](Tokenizer::Vocabulary& v) { v.pre_type = "llama-bpe"; }).find("pre_type") !=
        std::string::npos);
  CHECK(with([](Tokenizer::Vocabulary&) {}) == "(no error)");
  auto v = small.vocabulary;
  v.token_types.clear(); // empty = all normal
  const Tokenizer tokenizer(v);
  CHECK(tokenizer.vocab_size() == 257);
  CHECK(error_of([&] { tokenizer.decode({1, 257}); }).find("ids[1] = 257") != std::string::npos);
  CHECK(error_of([&] { tokenizer.decode({-1}); }).find("ids[0] = -1") != std::string::npos);
  CHECK(error_of([&] { tokenizer.token_text(300); }).find("id = 300") != std::string::npos);
}

TEST_CASE("apply_chat_template renders ChatML with the template's default system prompt") {
  auto small = make_small({});
  {
    const Tokenizer tokenizer(small.vocabulary); // no template: plain ChatML
    CHECK(tokenizer.apply_chat_template({{"user", "Hi"}}) ==
          "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    CHECK(tokenizer.apply_chat_template({{"user", "Hi"}}, false) == "<|im_start|>user\nHi<|im_end|>\n");
  }
  small.vocabulary.chat_template =
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
      "'<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' "
      "+ "
      "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
      "'<|im_start|>assistant\\n' }}{% endif %}";
  {
    const Tokenizer tokenizer(small.vocabulary);
    CHECK(tokenizer.apply_chat_template({{"user", "Hi"}}) ==
          "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    CHECK(tokenizer.apply_chat_template({{"system", "S"}, {"user", "U"}}, false) ==
          "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n");
  }
  small.vocabulary.chat_template =
      "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}";
  const Tokenizer other(small.vocabulary);
  CHECK(error_of([&] {
          other.apply_chat_template({{"user", "Hi"}});
        }).find("not a ChatML template") != std::string::npos);
}

TEST_CASE("from_gguf reads the tokenizer keys of a GGUF file") {
  smcgraph::test::TinyLlamaSpec spec;
  const auto file = smcgraph::GgufFile::from_bytes(smcgraph::test::make_tiny_llama_gguf(spec), "tiny.gguf");
  const Tokenizer tokenizer = Tokenizer::from_gguf(file);
  CHECK(tokenizer.vocab_size() == spec.vocab);
  CHECK(tokenizer.bos_id() == 1);
  CHECK(tokenizer.eos_id() == 2);
  CHECK(tokenizer.pad_id() == 2);
  CHECK(tokenizer.unk_id() == 0);
  CHECK(tokenizer.pre_type() == "smollm");
  CHECK(tokenizer.special_id("<|im_start|>") == 1);
  const auto ids = tokenizer.encode("<|im_start|>hello world 42<|im_end|>");
  CHECK(ids.front() == 1);
  CHECK(ids.back() == 2);
  CHECK(tokenizer.decode(ids) == "<|im_start|>hello world 42<|im_end|>");
  CHECK(tokenizer.decode(ids, true) == "hello world 42");
  CHECK(tokenizer.apply_chat_template({{"user", "Hi"}}).find("You are a helpful AI assistant named SmolLM") !=
        std::string::npos);

  smcgraph::test::GgufWriter spm;
  spm.add_string("tokenizer.ggml.model", "llama");
  spm.add_string_array("tokenizer.ggml.tokens", {"a"});
  CHECK(error_of([&] {
          Tokenizer::from_gguf(smcgraph::GgufFile::from_bytes(spm.bytes(), "spm.gguf"));
        }).find("tokenizer.ggml.model = 'llama'") != std::string::npos);
  smcgraph::test::GgufWriter no_merges;
  no_merges.add_string("tokenizer.ggml.model", "gpt2");
  no_merges.add_string_array("tokenizer.ggml.tokens", {"a"});
  CHECK(error_of([&] {
          Tokenizer::from_gguf(smcgraph::GgufFile::from_bytes(no_merges.bytes(), "m.gguf"));
        }).find("tokenizer.ggml.merges") != std::string::npos);
}

// =========================================================================================================
// The real file.

TEST_CASE("SmolLM2 tokenizer agrees with HF tokenizers on the corpus") {
  const fs::path path = model_path();
  const auto records = read_corpus();
  // Fuzz seeds (tests/fuzz/run_fuzz.sh): some corpus lines, invalid UTF-8, specials; with or without the
  // model.
  for (size_t i = 0; i < records.size(); i += 16)
    if (records[i].has("text"))
      CHECK(smcgraph::test::write_fuzz_seed("tokenizer", "corpus_" + std::to_string(i) + ".txt",
                                            records[i]["text"].text));
  CHECK(smcgraph::test::write_fuzz_seed("tokenizer", "invalid_utf8_0.txt",
                                        std::string("\xff\xfe<|im_start|>\xc0\xaf\xed\xa0\x80 12\xe2\x82")));
  CHECK(smcgraph::test::write_fuzz_seed("tokenizer", "invalid_utf8_1.txt",
                                        std::string("caf\xc3 \xf0\x9f\x99 \x80\x80\x80 \xf4\x90\x80\x80")));
  CHECK(smcgraph::test::write_fuzz_seed(
      "tokenizer", "specials.txt",
      std::string("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|><|im_")));
  CHECK(
      smcgraph::test::write_fuzz_seed("tokenizer", "vocabulary.txt",
                                      std::string("B\nsab\nsabc\nmab c\np\x01\x02\nc<s>\nu<u>\nb\x02\ne\x03\n"
                                                  "hello <s> world 12 ab abc <u>")));

  if (path.empty() || !fs::exists(path)) {
    MESSAGE("skipped: real model file not found (run ./run fetch-model)");
    return;
  }
  REQUIRE_MESSAGE(records.size() >= 300,
                  "cannot read the corpus " << corpus_path() << " (set SMCGRAPH_SOURCE_ROOT)");
  const auto file = smcgraph::GgufFile::open(path.string());
  const Tokenizer tokenizer = Tokenizer::from_gguf(file);
  CHECK(tokenizer.vocab_size() == 49152);
  CHECK(tokenizer.bos_id() == 1);
  CHECK(tokenizer.eos_id() == 2);
  CHECK(tokenizer.pad_id() == 2);
  CHECK(tokenizer.unk_id() == 0);
  CHECK(tokenizer.pre_type() == "smollm");
  CHECK(tokenizer.special_id("<|endoftext|>") == 0);
  CHECK(tokenizer.special_id("<|im_start|>") == 1);
  CHECK(tokenizer.special_id("<|im_end|>") == 2);
  CHECK(tokenizer.special_id("<empty_output>") == 16);
  CHECK(tokenizer.token_text(1) == "<|im_start|>");
  CHECK(tokenizer.token_text(216) == " "); // "Ġ"
  CHECK(tokenizer.token_type(0) == Tokenizer::kControl);
  CHECK(tokenizer.token_type(17) == Tokenizer::kNormal);

  int texts = 0, agree = 0, agree_plain = 0, chats = 0, chats_agree = 0;
  for (const auto& record : records) {
    if (record.has("text")) {
      const std::string& text = record["text"].text;
      const auto expected = record["ids"].ids(), expected_plain = record["ids_plain"].ids();
      const auto ids = tokenizer.encode(text), ids_plain = tokenizer.encode(text, false);
      ++texts;
      agree += ids == expected;
      agree_plain += ids_plain == expected_plain;
      CHECK_MESSAGE(ids == expected, "text \"" << escape(text) << "\"");
      CHECK_MESSAGE(ids_plain == expected_plain, "text (specials as text) \"" << escape(text) << "\"");
      CHECK(tokenizer.decode(expected) == text);
      CHECK(tokenizer.decode(expected_plain) == text);
    } else {
      std::vector<std::pair<std::string, std::string>> messages;
      for (const auto& message : record["messages"].items)
        messages.emplace_back(message.items.at(0).text, message.items.at(1).text);
      const std::string rendered =
          tokenizer.apply_chat_template(messages, record["add_generation_prompt"].boolean);
      ++chats;
      chats_agree += rendered == record["rendered"].text && tokenizer.encode(rendered) == record["ids"].ids();
      CHECK(rendered == record["rendered"].text);
      CHECK(tokenizer.encode(rendered) == record["ids"].ids());
    }
  }
  MESSAGE("corpus: " << agree << "/" << texts << " texts agree with HF (" << agree_plain << "/" << texts
                     << " with specials as text), " << chats_agree << "/" << chats << " chat renderings");
  CHECK(texts >= 300);
  CHECK(chats >= 5);

  // The template output, produced by transformers' apply_chat_template on the file's template.
  CHECK(tokenizer.apply_chat_template({{"user", "What is the capital of France?"}}) ==
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n");
  CHECK(tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n") ==
        std::vector<int32_t>{1, 4093, 198, 26843, 2, 198});

  // Concurrent encodes of a shared tokenizer give the same ids.
  std::vector<std::string> texts_only;
  std::vector<std::vector<int32_t>> expected_ids;
  for (const auto& record : records)
    if (record.has("text")) {
      texts_only.push_back(record["text"].text);
      expected_ids.push_back(record["ids"].ids());
    }
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int repeat = 0; repeat < 3; ++repeat)
        for (size_t i = 0; i < texts_only.size(); ++i)
          mismatches[t] += tokenizer.encode(texts_only[i]) != expected_ids[i];
    });
  for (auto& thread : threads)
    thread.join();
  for (int t = 0; t < 4; ++t)
    CHECK(mismatches[t] == 0);

  // Throughput on this CPU: the corpus lines one by one, and the whole corpus as one text.
  std::string document;
  for (const auto& text : texts_only)
    document += text + "\n";
  const int repeats = 20;
  size_t tokens = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < repeats; ++r)
    for (const auto& text : texts_only)
      tokens += tokenizer.encode(text).size();
  const auto t1 = std::chrono::steady_clock::now();
  size_t document_tokens = 0;
  for (int r = 0; r < repeats; ++r)
    document_tokens += tokenizer.encode(document).size();
  const auto t2 = std::chrono::steady_clock::now();
  const double lines_s = std::chrono::duration<double>(t1 - t0).count();
  const double document_s = std::chrono::duration<double>(t2 - t1).count();
  MESSAGE("encode: " << static_cast<long>(tokens / lines_s) << " tokens/s over the lines, "
                     << static_cast<long>(document_tokens / document_s) << " tokens/s ("
                     << static_cast<long>(repeats * document.size() / document_s / 1e3)
                     << " kB/s) as one text");
}

TEST_CASE("SmolLM2 tokenizer round-trips random bytes") {
  const fs::path path = model_path();
  if (path.empty() || !fs::exists(path)) {
    MESSAGE("skipped: real model file not found (run ./run fetch-model)");
    return;
  }
  const Tokenizer tokenizer = Tokenizer::from_gguf(smcgraph::GgufFile::open(path.string()));
  // The 21 bytes SmolLM2 has no symbol for are dropped; every other byte comes back.
  std::string dropped;
  for (int b = 0; b < 256; ++b)
    if (tokenizer.encode(std::string(1, static_cast<char>(b)), false).empty())
      dropped.push_back(static_cast<char>(b));
  CHECK(escape(dropped) ==
        "\\x04\\x06\\x13\\x14\\x16\\x1d\\xc0\\xc1\\xf1\\xf2\\xf5\\xf6\\xf7\\xf8\\xf9\\xfa\\xfb"
        "\\xfc\\xfd\\xfe\\xff");
  std::mt19937_64 rng(11);
  int failures = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const std::string text = trial % 2 == 0 ? random_bytes(rng, 200) : random_text(rng, rng() % 40);
    std::string kept;
    for (char c : text)
      if (dropped.find(c) == std::string::npos)
        kept.push_back(c);
    for (bool parse_special : {true, false}) {
      const std::string back = tokenizer.decode(tokenizer.encode(text, parse_special));
      if (back != kept) {
        ++failures;
        FAIL_CHECK("round trip of \"" << escape(text) << "\" gave \"" << escape(back) << "\"");
      }
    }
  }
  CHECK(failures == 0);
}
