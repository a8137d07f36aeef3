// Fuzz target of the tokenizer (libFuzzer entry point; also builds with plain g++ and a driver that feeds
// files, under -fsanitize=address,undefined).
//
// Each input is used three ways:
//  1. as text for a fixed tokenizer -- the real SmolLM2 file when SMCGRAPH_MODEL_PATH names it, else a small
//     vocabulary built here -- encoded with and without parse_special: decode(encode(x)) must give x back
//     (minus the bytes the vocabulary has no symbol for, which encode drops), decode_lossy must be UTF-8;
//  2. as little-endian int32 token ids for decode (smcgraph::Error for ids out of range is expected);
//  3. as a vocabulary description (lines: tokens, merges, specials, ids; see vocabulary_from_bytes) for the
//     Tokenizer constructor, which must either throw smcgraph::Error or build a tokenizer for which 1. holds.
// A violated property calls __builtin_trap(): that is a bug found.
//
// Seeds: SMCGRAPH_FUZZ_CORPUS_DIR=dir build/tests/test_tokenizer_cpu writes tokenizer_seed_*.txt there.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "smcgraph/error.hpp"
#include "smcgraph/gguf.hpp"
#include "smcgraph/tokenizer.hpp"

namespace {

using smcgraph::Tokenizer;

std::string byte_symbol(uint8_t byte) { // GPT-2 bytes_to_unicode, as UTF-8
  const bool printable = (byte >= 0x21 && byte <= 0x7e) || (byte >= 0xa1 && byte <= 0xac) || byte >= 0xae;
  uint32_t code_point = byte;
  if (!printable) {
    code_point = 256;
    for (int b = 0; b < byte; ++b) {
      const bool p = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
      code_point += p ? 0 : 1;
    }
  }
  std::string out;
  if (code_point < 0x80) {
    out.push_back(static_cast<char>(code_point));
  } else {
    out.push_back(static_cast<char>(0xc0 | (code_point >> 6)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3f)));
  }
  return out;
}

std::string spell(std::string_view bytes) {
  std::string out;
  for (unsigned char c : bytes)
    out += byte_symbol(c);
  return out;
}

// 256 byte symbols, merges for a few English words, ChatML specials and one user-defined token.
Tokenizer::Vocabulary builtin_vocabulary() {
  Tokenizer::Vocabulary v;
  for (int b = 0; b < 256; ++b) {
    v.tokens.push_back(byte_symbol(static_cast<uint8_t>(b)));
    v.token_types.push_back(Tokenizer::kNormal);
  }
  const std::pair<const char*, const char*> merges[] = {
      {" ", "t"}, {"h", "e"},     {" t", "he"},     {"i", "n"},    {"in", "g"}, {" ", "a"},
      {"e", "r"}, {"l", "l"},     {"he", "ll"},     {"hell", "o"}, {" ", " "},  {"  ", "  "},
      {"'", "s"}, {"o", "n"},     {"\xc3", "\xa9"}, {"\n", "\n"},  {" ", "w"},  {" w", "or"},
      {"o", "r"}, {" wor", "ld"}, {"l", "d"},       {"1", "2"}};
  for (const auto& [left, right] : merges) {
    v.tokens.push_back(spell(std::string(left) + right));
    v.token_types.push_back(Tokenizer::kNormal);
    v.merges.push_back(spell(left) + " " + spell(right));
  }
  for (const char* control : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    v.tokens.push_back(control);
    v.token_types.push_back(Tokenizer::kControl);
  }
  v.tokens.push_back("<tool>");
  v.token_types.push_back(Tokenizer::kUserDefined);
  v.bos_id = static_cast<int32_t>(v.tokens.size()) - 3;
  v.eos_id = static_cast<int32_t>(v.tokens.size()) - 2;
  v.pre_type = "smollm";
  return v;
}

// What a tokenizer keeps of a text, for the round-trip check: `exact` when no special text contains a byte
// the vocabulary drops (then the expected decode is the text minus the dropped bytes); otherwise only "a
// subsequence of the text" is checked.
struct RoundTripModel {
  bool dropped[2][256] = {};
  bool exact = true;
};

RoundTripModel round_trip_model(const Tokenizer& tokenizer) {
  RoundTripModel model;
  for (int mode = 0; mode < 2; ++mode)
    for (int b = 0; b < 256; ++b)
      model.dropped[mode][b] = tokenizer.encode(std::string(1, static_cast<char>(b)), mode == 1).empty();
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const auto type = tokenizer.token_type(id);
    if (type != Tokenizer::kControl && type != Tokenizer::kUserDefined)
      continue;
    for (unsigned char c : tokenizer.token_text(id))
      if (model.dropped[0][c] || model.dropped[1][c])
        model.exact = false;
  }
  return model;
}

bool is_subsequence(std::string_view part, std::string_view whole) {
  size_t at = 0;
  for (char c : part) {
    while (at < whole.size() && whole[at] != c)
      ++at;
    if (at == whole.size())
      return false;
    ++at;
  }
  return true;
}

bool is_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char b = static_cast<unsigned char>(s[i]);
    int n = b < 0x80                   ? 1
            : (b >= 0xc2 && b <= 0xdf) ? 2
            : (b >= 0xe0 && b <= 0xef) ? 3
            : (b >= 0xf0 && b <= 0xf4) ? 4
                                       : 0;
    if (n == 0 || i + n > s.size())
      return false;
    const unsigned char b1 = n > 1 ? static_cast<unsigned char>(s[i + 1]) : 0x80;
    if ((b == 0xe0 && b1 < 0xa0) || (b == 0xed && b1 > 0x9f) || (b == 0xf0 && b1 < 0x90) ||
        (b == 0xf4 && b1 > 0x8f))
      return false;
    for (int k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80)
        return false;
    i += n;
  }
  return true;
}

void check_text(const Tokenizer& tokenizer, const RoundTripModel& model, std::string_view text) {
  for (int mode = 0; mode < 2; ++mode) {
    const std::vector<int32_t> ids = tokenizer.encode(text, mode == 1);
    for (int32_t id : ids)
      if (id < 0 || id >= tokenizer.vocab_size())
        __builtin_trap();
    const std::string back = tokenizer.decode(ids);
    if (model.exact) {
      std::string expected;
      for (char c : text)
        if (!model.dropped[mode][static_cast<unsigned char>(c)])
          expected.push_back(c);
      if (back != expected)
        __builtin_trap();
    } else if (!is_subsequence(back, text)) {
      __builtin_trap();
    }
    if (!is_utf8(tokenizer.decode_lossy(ids)))
      __builtin_trap();
    // Skipping control tokens only removes their text.
    if (!is_subsequence(tokenizer.decode(ids, true), back))
      __builtin_trap();
  }
}

void check_ids(const Tokenizer& tokenizer, const uint8_t* data, size_t size) {
  std::vector<int32_t> ids(size / 4);
  if (!ids.empty())
    std::memcpy(ids.data(), data, ids.size() * 4);
  bool in_range = true;
  for (int32_t id : ids)
    in_range = in_range && id >= 0 && id < tokenizer.vocab_size();
  try {
    const std::string text = tokenizer.decode(ids);
    if (!in_range)
      __builtin_trap(); // an out-of-range id must throw
    if (!is_utf8(tokenizer.decode_lossy(ids)))
      __builtin_trap();
  } catch (const smcgraph::Error&) {
    if (in_range)
      __builtin_trap();
  }
}

// Lines of the input, '\n'-separated; the first character of a line says what it is:
//   'n' normal token, 'c' control token, 'u' user-defined token, 't' + type byte + token,
//   'm' merge line as written, 'p' + two bytes i j: merge of tokens[i] and tokens[j], result token added,
//   'b' / 'e' + byte: bos / eos id (byte - 1, so 0 gives -1), 'g' pre_type "gpt2", 'x' pre_type = rest,
//   'B' the 256 byte symbols, 's' + text: a token spelled from the text's bytes.
Tokenizer::Vocabulary vocabulary_from_bytes(std::string_view input) {
  Tokenizer::Vocabulary v;
  v.pre_type = "smollm";
  size_t begin = 0;
  while (begin <= input.size()) {
    size_t end = input.find('\n', begin);
    if (end == std::string_view::npos)
      end = input.size();
    const std::string_view line = input.substr(begin, end - begin);
    begin = end + 1;
    if (line.empty())
      continue;
    const std::string rest(line.substr(1));
    switch (line[0]) {
    case 'n':
      v.tokens.push_back(rest), v.token_types.push_back(Tokenizer::kNormal);
      break;
    case 'c':
      v.tokens.push_back(rest), v.token_types.push_back(Tokenizer::kControl);
      break;
    case 'u':
      v.tokens.push_back(rest), v.token_types.push_back(Tokenizer::kUserDefined);
      break;
    case 's':
      v.tokens.push_back(spell(rest)), v.token_types.push_back(Tokenizer::kNormal);
      break;
    case 't':
      if (!rest.empty()) {
        v.tokens.push_back(rest.substr(1));
        v.token_types.push_back(static_cast<int8_t>(rest[0]));
      }
      break;
    case 'm':
      v.merges.push_back(rest);
      break;
    case 'p':
      if (rest.size() >= 2 && !v.tokens.empty()) {
        const std::string& left = v.tokens[static_cast<uint8_t>(rest[0]) % v.tokens.size()];
        const std::string& right = v.tokens[static_cast<uint8_t>(rest[1]) % v.tokens.size()];
        v.merges.push_back(left + " " + right);
        v.tokens.push_back(left + right);
        v.token_types.push_back(Tokenizer::kNormal);
      }
      break;
    case 'b':
      v.bos_id = rest.empty() ? -1 : static_cast<uint8_t>(rest[0]) - 1;
      break;
    case 'e':
      v.eos_id = rest.empty() ? -1 : static_cast<uint8_t>(rest[0]) - 1;
      break;
    case 'g':
      v.pre_type = "gpt2";
      break;
    case 'x':
      v.pre_type = rest;
      break;
    case 'B':
      for (int b = 0; b < 256; ++b) {
        v.tokens.push_back(byte_symbol(static_cast<uint8_t>(b)));
        v.token_types.push_back(Tokenizer::kNormal);
      }
      break;
    default:
      break;
    }
    if (v.tokens.size() > 4096 || v.merges.size() > 4096)
      break; // keep each run fast
  }
  return v;
}

struct Fixed {
  std::unique_ptr<Tokenizer> tokenizer;
  RoundTripModel model;
};

const Fixed& fixed() {
  static const Fixed instance = [] {
    Fixed f;
    const char* path = std::getenv("SMCGRAPH_MODEL_PATH");
    if (path != nullptr && *path != '\0') {
      try {
        f.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_gguf(smcgraph::GgufFile::open(path)));
      } catch (const smcgraph::Error&) {
        f.tokenizer.reset(); // not a usable file: fall back to the built-in vocabulary
      }
    }
    if (!f.tokenizer)
      f.tokenizer = std::make_unique<Tokenizer>(builtin_vocabulary());
    f.model = round_trip_model(*f.tokenizer);
    return f;
  }();
  return instance;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const Fixed& f = fixed();
  check_text(*f.tokenizer, f.model, input);
  check_ids(*f.tokenizer, data, size);
  try {
    const Tokenizer tokenizer(vocabulary_from_bytes(input));
    const RoundTripModel model = round_trip_model(tokenizer);
    check_text(tokenizer, model, input);
    check_ids(tokenizer, data, size);
  } catch (const smcgraph::Error&) {
    // a rejected vocabulary: fine
  }
  return 0;
}
