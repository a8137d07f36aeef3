// The tokenizer of GGUF models with a byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`), as HF
// `tokenizers` and llama.cpp run it: special tokens are cut out of the text first, the rest is split by
// the pre-tokenizer (`smollm`: every digit alone, then the GPT-2 regex; `gpt2`: the GPT-2 regex), each
// piece is spelled as bytes and merged by the ranked merges. Host-only; no CUDA.
//
// Bytes are bytes: encode accepts any byte string (an invalid UTF-8 byte is a code point of its own, class
// "other" for the split regex) and decode returns the exact bytes of the tokens, so decode(encode(text))
// == text, except for bytes whose symbol the vocabulary lacks: encode drops those, as HF does (there is no
// byte fallback). SmolLM2 lacks 21: 0x04 0x06 0x13 0x14 0x16 0x1d, and 0xc0 0xc1 0xf1 0xf2 0xf5..0xff,
// which no UTF-8 text of an assigned character contains. decode_lossy replaces ill-formed UTF-8.
//
//   const auto file = smcgraph::GgufFile::open("SmolLM2-135M-Instruct.Q4_1.gguf");
//   const auto tokenizer = smcgraph::Tokenizer::from_gguf(file);
//   const std::string prompt = tokenizer.apply_chat_template({{"user", "What is 2+2?"}});
//   std::vector<int32_t> ids = tokenizer.encode(prompt);    // <|im_start|> etc. become their ids
//   std::string text = tokenizer.decode(ids);               // == prompt
//
// A Tokenizer is immutable after construction; every const member may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace smcgraph {

class GgufFile;

class Tokenizer {
public:
  /// llama.cpp token types (`tokenizer.ggml.token_type`).
  enum TokenType : int32_t {
    kUndefined = 0,
    kNormal = 1,
    kUnknown = 2,
    kControl = 3,     ///< special: matched in the text only with parse_special, skipped by skip_special
    kUserDefined = 4, ///< always matched whole in the text, never skipped
    kUnused = 5,
    kByte = 6,
  };

  /// The vocabulary as the GGUF keys hold it. Tokens are in the GPT-2 byte-to-unicode spelling ("Ġthe");
  /// a token using characters outside that alphabet stands for its own UTF-8 bytes (HF's rule). Control
  /// and user-defined tokens are found in the text by those bytes ("<|im_start|>" is spelled as itself).
  struct Vocabulary {
    std::vector<std::string> tokens;  ///< tokenizer.ggml.tokens; id = index
    std::vector<int32_t> token_types; ///< tokenizer.ggml.token_type; empty = all kNormal
    std::vector<std::string> merges;  ///< tokenizer.ggml.merges, "left right", rank = index
    int32_t bos_id = -1;              ///< -1 = none
    int32_t eos_id = -1;
    int32_t pad_id = -1;
    int32_t unk_id = -1;
    std::string pre_type;      ///< tokenizer.ggml.pre: "smollm" or "gpt2" ("gpt-2")
    std::string chat_template; ///< tokenizer.chat_template (Jinja); empty = none
  };

  /// Validates and indexes `vocabulary`; throws smcgraph::Error naming the field and the bad value: empty
  /// vocabulary, token_types of another size or an unknown type, a merge that is not "a b" of two known
  /// tokens whose concatenation is a token, an id out of range, an unsupported pre_type.
  explicit Tokenizer(Vocabulary vocabulary);
  /// Reads tokenizer.ggml.{model, tokens, token_type, merges, bos_token_id, eos_token_id,
  /// padding_token_id, unknown_token_id, pre} and tokenizer.chat_template. Only model "gpt2" is supported.
  static Tokenizer from_gguf(const GgufFile& file);

  /// Token ids of `text` (any bytes; no BOS is added). With parse_special, control tokens written in the
  /// text ("<|im_start|>") become their ids; user-defined tokens always do. Bytes without a symbol in the
  /// vocabulary are dropped (see above).
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  /// The concatenated bytes of the tokens, which need not be valid UTF-8 (a multi-byte character cut
  /// between ids, or ids no encode would produce). skip_special drops control tokens. Throws on an id
  /// outside [0, vocab_size()).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;
  /// decode, then every ill-formed UTF-8 sequence replaced by U+FFFD (maximal subparts, as Python's
  /// errors="replace" and WHATWG do).
  std::string decode_lossy(const std::vector<int32_t>& ids, bool skip_special = false) const;
  /// The bytes of one token (throws on an id out of range).
  std::string token_text(int32_t id) const;
  /// The type of one token (throws on an id out of range).
  TokenType token_type(int32_t id) const;

  int32_t bos_id() const;
  int32_t eos_id() const;
  int32_t pad_id() const;
  int32_t unk_id() const;
  int vocab_size() const;
  const std::string& pre_type() const;
  const std::string& chat_template() const;
  /// The id of a control or user-defined token given its text, e.g. "<|im_start|>".
  std::optional<int32_t> special_id(std::string_view text) const;

  /// Renders the conversation with the file's ChatML template:
  ///   [<|im_start|>system\n{default system prompt}<|im_end|>\n]   when the first role is not "system"
  ///   <|im_start|>{role}\n{content}<|im_end|>\n                    per message
  ///   <|im_start|>assistant\n                                      with add_generation_prompt
  /// The default system prompt is read from the template; an empty template renders plain ChatML without
  /// one. Throws when the stored template is not ChatML (other templates are not interpreted).
  std::string apply_chat_template(const std::vector<std::pair<std::string, std::string>>& messages,
                                  bool add_generation_prompt = true) const;

  struct Impl; // defined in tokenizer.cpp

private:
  std::shared_ptr<const Impl> impl_;
};

} // namespace smcgraph
