//! The tokenizer and chat template built from the real SmolLM2-135M-Instruct GGUF.
//!
//! The model is `$HEADWISE_MODEL`, or the default file in `models/`, fetched if missing.

mod common;

use candle_core::quantized::gguf_file::Content;
use headwise::model::text::chat::{ChatMessage, ChatTemplate};
use headwise::model::text::tokenizer::{tokenizer_from_gguf, SpecialTokens, COMPARISON_STRINGS};
use tokenizers::Tokenizer;

/// The real model's GGUF metadata (the model fetched if missing).
fn content() -> Content {
    let mut file = std::fs::File::open(common::real_model()).expect("open model");
    Content::read(&mut file).expect("read GGUF metadata")
}

fn load() -> (Content, Tokenizer, SpecialTokens) {
    let content = content();
    let (tok, sp) = tokenizer_from_gguf(&content).expect("tokenizer from GGUF");
    (content, tok, sp)
}

fn encode(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text, false).expect("encode").get_ids().to_vec()
}

/// The id of a vocabulary entry, looked up in the GGUF token list itself.
fn vocab_id(content: &Content, token: &str) -> u32 {
    let tokens = content.metadata["tokenizer.ggml.tokens"].to_vec().unwrap();
    let pos = tokens
        .iter()
        .position(|t| t.to_string().unwrap() == token)
        .unwrap_or_else(|| panic!("{token:?} not in the vocabulary"));
    pos as u32
}

#[test]
fn special_tokens_of_smollm2() {
    let (_, _, sp) = load();
    // Metadata: bos 1 (<|im_start|>), eos 2 (<|im_end|>), pad 2, add_bos_token false;
    // <|endoftext|> (0) also ends generation.
    assert_eq!(
        sp,
        SpecialTokens {
            bos: Some(1),
            eos: Some(2),
            pad: Some(2),
            stop: vec![2, 0],
            add_bos: false,
        }
    );
}

#[test]
fn vocabulary_has_no_multi_digit_tokens() {
    let content = content();
    let tokens = content.metadata["tokenizer.ggml.tokens"].to_vec().unwrap();
    let multi_digit = tokens
        .iter()
        .map(|t| t.to_string().unwrap())
        .filter(|t| t.chars().filter(|c| c.is_ascii_digit()).count() >= 2)
        .count();
    assert_eq!(multi_digit, 0);
    assert_eq!(tokens.len(), 49152);
}

#[test]
fn encodes_to_hand_derived_vocabulary_pieces() {
    let (content, tok, _) = load();
    // (input, the pieces the smollm rule gives, by hand: \p{N} isolated, then the GPT-2
    // regex; `Ġ` is a space, `Ċ` a newline in GPT-2's byte-to-symbol map)
    let rows: &[(&str, &[&str])] = &[
        ("Hello world", &["Hello", "Ġworld"]),
        ("The cat sat.", &["The", "Ġcat", "Ġsat", "."]),
        ("Paris, France", &["Paris", ",", "ĠFrance"]),
        ("it's", &["it", "'s"]),
        ("12345", &["1", "2", "3", "4", "5"]),
        (" 2026", &["Ġ", "2", "0", "2", "6"]),
        ("a  b", &["a", "Ġ", "Ġb"]),
        ("x\n\ny", &["x", "Ċ", "Ċ", "y"]),
        ("end\n\n\n", &["end", "ĊĊĊ"]),
        ("<|im_start|>user\n", &["<|im_start|>", "user", "Ċ"]),
        ("<|im_end|>", &["<|im_end|>"]),
    ];
    for (text, pieces) in rows {
        let want: Vec<u32> = pieces.iter().map(|p| vocab_id(&content, p)).collect();
        assert_eq!(encode(&tok, text), want, "{text:?}");
    }
}

#[test]
fn chat_markup_is_one_token_and_digits_split() {
    let (_, tok, _) = load();
    assert_eq!(encode(&tok, "<|im_start|>"), vec![1]);
    assert_eq!(encode(&tok, "<|im_end|>"), vec![2]);
    assert_eq!(tok.encode("<|im_start|>", true).unwrap().get_ids(), &[1]);
    let digits = encode(&tok, "9876543210");
    assert_eq!(digits.len(), 10);
    for (id, d) in digits.iter().zip("9876543210".chars()) {
        assert_eq!(tok.id_to_token(*id).unwrap(), d.to_string());
    }
}

#[test]
fn decode_inverts_encode() {
    let (_, tok, _) = load();
    let strings = [
        "Hello world",
        "Year 2026 has 12345 items.",
        "3.14159 and -1,000,000",
        " leading space",
        "  two leading spaces",
        "multiple   spaces   here",
        "trailing spaces   ",
        "line one\nline two\n\nline four\n",
        "\n\n\n",
        "tab\tseparated\tvalues\t",
        "carriage\r\nreturn",
        "I'm sure they'll say it's fine, don't you think?",
        "Café naïve résumé façade Ångström",
        "Ünïcödé ΑΒΓ Привет мир",
        "你好，世界！这是一个测试。",
        "日本語のテキスト",
        "مرحبا بالعالم",
        "Emoji: 😀👍🏽🇺🇸 and ❤️",
        "½ ² ③ Ⅻ",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "def foo(x):\n    return x ** 2\n",
        "JSON: {\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
        "https://example.com/a?q=1&r=2#frag",
        "",
        " ",
        "\u{7}bell and \u{1b}[0m escape",
    ];
    assert!(strings.len() >= 20);
    for s in strings {
        let ids = encode(&tok, s);
        assert_eq!(tok.decode(&ids, false).unwrap(), s, "{s:?} -> {ids:?}");
    }
}

#[test]
fn bytes_missing_from_the_vocabulary_are_dropped() {
    let (_, tok, _) = load();
    // U+0004 has no byte symbol in SmolLM2's vocabulary; the model's tokenizer has no
    // unknown token and drops it (Hugging Face tokenizers, which trained the vocabulary, do
    // the same). It is still a piece of its own for the pre-tokenizer.
    assert_eq!(encode(&tok, "\u{4}"), Vec::<u32>::new());
    let mut a_then_b = encode(&tok, "a");
    a_then_b.extend(encode(&tok, "b"));
    assert_eq!(encode(&tok, "a\u{4}b"), a_then_b);
    assert_ne!(a_then_b, encode(&tok, "ab"));
}

// Reference ids for `reference_ids` below come from this independent implementation of
// the smollm rule (Python, reading the same GGUF with the `gguf` package; run as
// `python3 ref_tok.py MODEL.gguf < strings.jsonl`), not from the code under test:
//
// # Independent reference tokenizer for SmolLM2 (GGUF `tokenizer.ggml.pre = smollm`):
// # special tokens split out first; then every \p{N} character isolated; then the GPT-2 split
// # regex on each remaining stretch; GPT-2 byte-to-unicode; BPE by merge rank.
// import sys, json, regex
// from gguf import GGUFReader
// r = GGUFReader(sys.argv[1])
// toks = r.fields['tokenizer.ggml.tokens'].contents()
// types = r.fields['tokenizer.ggml.token_type'].contents()
// merges = r.fields['tokenizer.ggml.merges'].contents()
// ids = {t: i for i, t in enumerate(toks)}
// rank = {tuple(m.split(' ', 1)): i for i, m in enumerate(merges)}
// special = sorted([t for t, ty in zip(toks, types) if ty != 1], key=len, reverse=True)
// vis = list(range(33, 127)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
// b2u, n = {}, 0
// for b in range(256):
//     if b in vis: b2u[b] = chr(b)
//     else: b2u[b] = chr(256 + n); n += 1
// GPT2 = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
// def bpe(word):
//     parts = [c for c in word if c in ids]  # bytes absent from the vocab are dropped
//     while len(parts) > 1:
//         best = min(range(len(parts) - 1), key=lambda i: rank.get((parts[i], parts[i+1]), 1 << 30))
//         if (parts[best], parts[best+1]) not in rank: break
//         parts[best:best+2] = [parts[best] + parts[best+1]]
//     return [ids[p] for p in parts]
// def encode_plain(text):
//     out = []
//     for piece in regex.split(r'(\p{N})', text):
//         if not piece: continue
//         for w in GPT2.findall(piece):
//             out += bpe(''.join(b2u[b] for b in w.encode('utf-8')))
//     return out
// def encode(text):
//     pat = '(' + '|'.join(regex.escape(s) for s in special) + ')'
//     out = []
//     for piece in regex.split(pat, text):
//         if piece in ids and piece in special: out.append(ids[piece])
//         elif piece: out += encode_plain(piece)
//     return out
// for line in sys.stdin:
//     s = json.loads(line)
//     print(json.dumps({'text': s, 'ids': encode(s)}, ensure_ascii=False))
const REFERENCE_IDS: &[(&str, &[u32])] = &[
    ("Hello world", &[19556, 905]),
    ("The quick brown fox jumps over the lazy dog.", &[504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30]),
    ("Year 2026 has 12345 items.", &[19840, 216, 34, 32, 34, 38, 553, 216, 33, 34, 35, 36, 37, 3723, 30]),
    ("3.14159 and 1,000,000", &[35, 30, 33, 36, 33, 37, 41, 284, 216, 33, 28, 32, 32, 32, 28, 32, 32, 32]),
    ("The needle is 7481 and the key is 'blue-42'.", &[504, 12668, 314, 216, 39, 36, 40, 33, 284, 260, 1646, 314, 637, 16591, 29, 36, 34, 4289]),
    (" leading space", &[2899, 1898]),
    ("multiple   spaces   here", &[30404, 256, 5600, 256, 1535]),
    ("trailing spaces   ", &[4861, 4966, 5600, 333]),
    ("line one\nline two\n\nline four", &[1311, 582, 198, 1311, 827, 198, 198, 1311, 1876]),
    ("tab\tseparated\tvalues", &[15999, 197, 19509, 483, 197, 6347]),
    ("I'm sure they'll say it's fine, don't you think?", &[57, 5248, 2090, 502, 3060, 1643, 357, 506, 4979, 28, 1326, 982, 346, 1510, 47]),
    ("Café naïve résumé façade", &[51, 1939, 2756, 15486, 46494, 412, 2756, 5422, 2756, 40852]),
    ("Ünïcödé ΑΒΓ Привет мир", &[142, 246, 94, 25972, 83, 7466, 84, 2756, 5664, 235, 153, 236, 153, 237, 5470, 249, 46879, 16464, 32547, 41337, 7872, 9175]),
    ("你好，世界！这是一个测试。", &[18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230, 8083, 219, 48287, 27830, 43340, 43222, 229, 16313, 239, 19076]),
    ("Emoji: 😀👍🏽 and ❤️", &[10809, 33777, 42, 40303, 218, 10813, 235, 231, 10813, 233, 138, 284, 4636, 247, 114, 31752]),
    ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", &[1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198]),
    ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n", &[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198]),
    ("email me at someone@example.com or see https://example.com/a?q=1", &[10349, 549, 418, 2206, 48, 7434, 30, 824, 355, 963, 5141, 1742, 7434, 30, 824, 31, 81, 47, 97, 45, 33]),
    ("Mixed123Numbers456", &[61, 13609, 33, 34, 35, 39006, 36, 37, 38]),
    ("½ ² ③ Ⅻ", &[16738, 216, 19133, 216, 173, 235, 112, 216, 173, 223, 121]),
    ("   ", &[333]),
    ("\n\n\n", &[16506]),
    ("...!!!???", &[2026, 29646, 16693, 47]),
    ("print(value)", &[3272, 24, 3221, 25]),
    ("def foo(x):\n    return x ** 2\n", &[1604, 29856, 24, 104, 727, 472, 1003, 1792, 1903, 216, 34, 198]),
    ("Hello!\nHow are you?", &[19556, 17, 198, 2020, 359, 346, 47]),
    ("a  \n  b", &[81, 256, 3805, 278]),
    ("I'M SURE IT'S FINE", &[57, 23, 61, 334, 15672, 9627, 23, 67, 426, 12770]),
    ("JSON: {\"key\": [1, 2, 3]}", &[27936, 42, 9583, 2393, 1799, 933, 33, 28, 216, 34, 28, 216, 35, 28852]),
    ("First paragraph.\n\nSecond paragraph.", &[5345, 8510, 30, 198, 198, 12556, 8510, 30]),
    ("end.\r\nnext", &[486, 30, 201, 198, 11282]),
    ("end of transmission\u{4}", &[486, 282, 6700]),
];

#[test]
fn reference_ids() {
    let (_, tok, _) = load();
    for s in COMPARISON_STRINGS {
        assert!(
            REFERENCE_IDS.iter().any(|(t, _)| t == s),
            "no reference ids for {s:?}"
        );
    }
    for (text, want) in REFERENCE_IDS {
        assert_eq!(encode(&tok, text), *want, "{text:?}");
    }
}

#[test]
fn chat_template_from_gguf_renders_chatml() {
    let (content, tok, _) = load();
    let template = ChatTemplate::from_gguf(&content)
        .expect("chat template")
        .expect("SmolLM2 ships a chat template");
    let messages = [
        ChatMessage::system("You are a concise assistant."),
        ChatMessage::user("What is the capital of France?"),
    ];
    let prompt = template.render(&messages, true).unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = encode(&tok, &prompt);
    assert_eq!(
        ids.iter().filter(|&&i| i == 1).count(),
        3,
        "three <|im_start|>"
    );
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2, "two <|im_end|>");
    // "<|im_start|>assistant\n": `assistant` is two tokens, `ass` + `istant` (reference
    // implementation above).
    let tail = ["<|im_start|>", "ass", "istant", "Ċ"].map(|t| vocab_id(&content, t));
    assert_eq!(&ids[ids.len() - 4..], &tail);
    // Without a system message the template inserts SmolLM's default one.
    let prompt = template.render(&[ChatMessage::user("Hi")], true).unwrap();
    assert!(prompt.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
}

/// headwise vs mistral.rs on [`COMPARISON_STRINGS`]: equal ids everywhere except on
/// [`MISTRALRS_DIFFERS`], where mistral.rs's fixed Llama-3-style split regex (and its
/// unknown token) depart from the model's `smollm` rule; there headwise must give the
/// reference ids and mistral.rs must not (if mistral.rs changes to the real rule, this
/// test says so).
#[cfg(feature = "mistralrs")]
#[test]
fn mistralrs_tokenization_matches_except_documented_rule_differences() {
    use headwise::model::text::tokenizer::MISTRALRS_DIFFERS;
    use headwise::reference::mistralrs::MistralRsEngine;

    let path = common::real_model();
    let (_, tok, _) = load();
    let engine = MistralRsEngine::load(&path).expect("load mistral.rs");
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for text in COMPARISON_STRINGS {
        let ours = encode(&tok, text);
        let theirs = engine.tokenize(text, false).expect("mistral.rs tokenize");
        let reference = REFERENCE_IDS
            .iter()
            .find(|(t, _)| t == text)
            .map(|(_, ids)| ids.to_vec())
            .expect("reference ids");
        let expected_to_differ = MISTRALRS_DIFFERS.contains(text);
        if ours != theirs {
            report.push(format!(
                "{text:?}\n  headwise  {ours:?}\n  mistral.rs {theirs:?}"
            ));
        }
        if ours != reference {
            failures.push(format!(
                "{text:?}: headwise {ours:?} != reference {reference:?}"
            ));
        }
        if expected_to_differ == (ours == theirs) {
            failures.push(format!(
                "{text:?}: expected mistral.rs to {} headwise, headwise {ours:?}, mistral.rs {theirs:?}",
                if expected_to_differ { "differ from" } else { "agree with" }
            ));
        }
    }
    eprintln!(
        "{} of {} strings tokenize differently:\n{}",
        report.len(),
        COMPARISON_STRINGS.len(),
        report.join("\n")
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------
// Gemma 3 (SentencePiece-style `llama` vocabulary) against llama.cpp.
// ---------------------------------------------------------------------------------------

/// The Gemma 3 270M GGUF's metadata, fetched like every real model (`common::real_gemma`).
fn gemma_content() -> Content {
    let mut file = std::fs::File::open(common::real_gemma()).expect("open Gemma model");
    Content::read(&mut file).expect("read Gemma GGUF metadata")
}

fn gemma() -> (Content, Tokenizer, SpecialTokens) {
    let content = gemma_content();
    let (tok, sp) = tokenizer_from_gguf(&content).expect("Gemma tokenizer from GGUF");
    (content, tok, sp)
}

/// The 2,000-character paragraph of the reference table: `GEMMA_PARAGRAPH` repeated, cut
/// at 2,000 characters.
fn gemma_paragraph() -> String {
    GEMMA_PARAGRAPH.repeat(8).chars().take(2000).collect()
}

const GEMMA_PARAGRAPH: &str = "The history of the printing press is often told as a story of one man and one machine, but the reality was slower and stranger. Movable type had existed in East Asia for centuries before Gutenberg; what changed in fifteenth-century Mainz was a combination of metal alloys, oil-based inks, and a screw press adapted from wine making. ";

// Reference ids from llama.cpp itself (llama_cpp_python 0.3.36's vendored llama.cpp, build
// b1-0c1e570), not from the code under test. The server ran on loopback:
//
//   llama-server -m models/gemma-3-270m-q4_k_m.gguf --host 127.0.0.1 --port 8912 -t 1 -c 2048
//
// and each string was sent as
//
//   curl -s -X POST http://127.0.0.1:8912/tokenize -d '{"content": TEXT, "add_special": false}'
//
// (`parse_special` defaults to true there: control tokens such as `<start_of_turn>` in the
// text are one token, as in headwise). `GEMMA_REFERENCE_IDS_NO_PARSE_SPECIAL` adds
// `"parse_special": false`; only the strings whose ids change are listed. The same requests
// with `"add_special": true` gave `2` (`<bos>`) followed by the same ids, and
// `POST /detokenize {"tokens": IDS}` gave the text back (with `▁` written as a space). The
// table holds the strings of `COMPARISON_STRINGS` and the Gemma-specific ones after them;
// the 2,000-character paragraph (`gemma_paragraph()`) is `GEMMA_PARAGRAPH_IDS`.
const GEMMA_REFERENCE_IDS: &[(&str, &[u32])] = &[
    ("Hello world", &[9259, 1902]),
    ("The quick brown fox jumps over the lazy dog.", &[818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761]),
    ("Year 2026 has 12345 items.", &[16431, 236743, 236778, 236771, 236778, 236825, 815, 236743, 236770, 236778, 236800, 236812, 236810, 4852, 236761]),
    ("3.14159 and 1,000,000", &[236800, 236761, 236770, 236812, 236770, 236810, 236819, 532, 236743, 236770, 236764, 236771, 236771, 236771, 236764, 236771, 236771, 236771]),
    ("The needle is 7481 and the key is 'blue-42'.", &[818, 30659, 563, 236743, 236832, 236812, 236828, 236770, 532, 506, 2307, 563, 756, 9503, 236772, 236812, 236778, 6748]),
    (" leading space", &[5830, 2557]),
    ("multiple   spaces   here", &[43819, 139, 35220, 139, 8472]),
    ("trailing spaces   ", &[136697, 9952, 139]),
    ("line one\nline two\n\nline four", &[1257, 886, 107, 1257, 1156, 108, 1257, 2390]),
    ("tab\tseparated\tvalues", &[4823, 255968, 74010, 255968, 7558]),
    ("I'm sure they'll say it's fine, don't you think?", &[236777, 236789, 236757, 2889, 901, 236789, 859, 1879, 625, 236789, 236751, 5851, 236764, 1537, 236789, 236745, 611, 1751, 236881]),
    ("Café naïve résumé façade", &[160319, 236859, 120362, 118515, 96008]),
    ("Ünïcödé ΑΒΓ Привет мир", &[238194, 236749, 238527, 236755, 55515, 236859, 20306, 240104, 239357, 15745, 8362, 58562]),
    ("你好，世界！这是一个测试。", &[144626, 236900, 12811, 237354, 120509, 30203, 236924]),
    ("Emoji: 😀👍🏽 and ❤\u{fe0f}", &[127268, 236787, 163543, 240493, 242713, 532, 64813]),
    ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", &[236820, 236909, 548, 236779, 3041, 111038, 2364, 107, 3689, 563, 236743, 236778, 236862, 236778, 145912, 236909, 548, 236779, 643, 111038, 107, 236820, 236909, 548, 236779, 3041, 111038, 111457, 107]),
    ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n", &[236820, 236909, 548, 236779, 3041, 111038, 9731, 107, 3048, 659, 496, 11045, 12498, 16326, 7489, 166184, 42476, 236764, 15453, 684, 22798, 3801, 7117, 236820, 236909, 548, 236779, 643, 111038, 107]),
    ("email me at someone@example.com or see https://example.com/a?q=1", &[6774, 786, 657, 5026, 236940, 8358, 236761, 854, 653, 1460, 4560, 1411, 8358, 236761, 854, 236786, 236746, 236881, 236809, 236784, 236770]),
    ("Mixed123Numbers456", &[105367, 236770, 236778, 236800, 37091, 236812, 236810, 236825]),
    ("½ ² ③ Ⅻ", &[238612, 145191, 131917, 236743, 464, 371, 409]),
    ("   ", &[139]),
    ("\n\n\n", &[109]),
    ("...!!!???", &[1390, 11145, 31237]),
    ("print(value)", &[1995, 236769, 2394, 236768]),
    ("def foo(x):\n    return x ** 2\n", &[2063, 46293, 236769, 236781, 1473, 107, 140, 2060, 1123, 5213, 236743, 236778, 107]),
    ("Hello!\nHow are you?", &[9259, 236888, 107, 3910, 659, 611, 236881]),
    ("a  \n  b", &[236746, 138, 107, 138, 236763]),
    ("I'M SURE IT'S FINE", &[236777, 236789, 236792, 186427, 9053, 236789, 236773, 162092]),
    ("JSON: {\"key\": [1, 2, 3]}", &[12324, 236787, 3714, 2478, 1083, 870, 236770, 236764, 236743, 236778, 236764, 236743, 236800, 21111]),
    ("First paragraph.\n\nSecond paragraph.", &[7280, 15649, 236761, 108, 12400, 15649, 236761]),
    ("end.\r\nnext", &[643, 236761, 251, 107, 4874]),
    ("end of transmission\u{4}", &[643, 529, 12268, 242]),
    (" Hello world", &[26352, 1902]),
    ("  two leading spaces", &[138, 13498, 5830, 9952]),
    ("trailing space ", &[136697, 2557, 236743]),
    ("a   b    c     d", &[236746, 139, 236763, 140, 236755, 141, 236753]),
    ("\n", &[107]),
    ("\n\n", &[108]),
    ("line\n\nbreak", &[1257, 108, 7284]),
    ("\ttab\t\ttabs", &[255968, 4823, 255969, 39218]),
    ("12345", &[236770, 236778, 236800, 236812, 236810]),
    ("3.14159265358979", &[236800, 236761, 236770, 236812, 236770, 236810, 236819, 236778, 236825, 236810, 236800, 236810, 236828, 236819, 236832, 236819]),
    ("日本語のテキストです。東京は大きい。", &[94951, 236945, 95830, 3652, 236924, 31414, 237048, 98042, 236924]),
    ("Emoji 😀🎉👍🏽 family 👨\u{200d}👩\u{200d}👧", &[127268, 163543, 242061, 240493, 242713, 2523, 236743, 243874, 237243, 243767, 237243, 244814]),
    ("Crème brûlée à la française, São Paulo, Zürich", &[15760, 9809, 125501, 155666, 1608, 759, 64859, 236764, 30342, 29150, 236764, 116315]),
    ("rare: 𝄞 𐍈 ༺༻ 🧬", &[43128, 236787, 236743, 246859, 236743, 478, 382, 379, 374, 236743, 248302, 248262, 236743, 253633]),
    ("fn main() {\n    let x: Vec<u32> = vec![1, 2, 3];\n    println!(\"{:?}\", x);\n}\n", &[15059, 1689, 825, 642, 107, 140, 1184, 1123, 236787, 29089, 236820, 236756, 236800, 236778, 236813, 578, 23454, 24960, 236770, 236764, 236743, 236778, 236764, 236743, 236800, 2312, 107, 140, 4629, 236355, 125425, 1123, 626, 107, 236783, 107]),
    ("<start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\n", &[105, 2364, 107, 9259, 236888, 106, 107, 105, 4368, 107]),
    ("<bos><start_of_turn>user", &[2, 105, 2364]),
    ("text with <eos> inside and <pad> too", &[1005, 607, 236743, 1, 4888, 532, 236743, 0, 2311]),
    ("<table><tr><td>cell</td></tr></table> <b>bold</b> </s>", &[168, 173, 175, 5447, 183, 181, 176, 236743, 200, 15640, 209, 236743, 212]),
    ("<0x41> literal byte token text", &[236820, 236771, 236781, 236812, 236770, 236813, 37087, 16812, 8369, 1816]),
    ("▁already escaped▁space", &[3016, 41685, 2557]),
];

const GEMMA_PARAGRAPH_IDS: &[u32] = &[
    818, 4083, 529, 506, 16386, 2686, 563, 3187, 4173, 618, 496, 3925, 529, 886, 880, 532, 886,
    5464, 236764, 840, 506, 9496, 691, 31878, 532, 42030, 236761, 72759, 742, 1722, 1053, 26077,
    528, 7123, 11560, 573, 24744, 1680, 180558, 236793, 1144, 6692, 528, 135461, 236772, 33201,
    163952, 691, 496, 8376, 529, 6211, 34758, 236764, 4446, 236772, 5140, 106301, 236764, 532, 496,
    21792, 2686, 22882, 699, 10135, 3043, 236761, 669, 4083, 529, 506, 16386, 2686, 563, 3187,
    4173, 618, 496, 3925, 529, 886, 880, 532, 886, 5464, 236764, 840, 506, 9496, 691, 31878, 532,
    42030, 236761, 72759, 742, 1722, 1053, 26077, 528, 7123, 11560, 573, 24744, 1680, 180558,
    236793, 1144, 6692, 528, 135461, 236772, 33201, 163952, 691, 496, 8376, 529, 6211, 34758,
    236764, 4446, 236772, 5140, 106301, 236764, 532, 496, 21792, 2686, 22882, 699, 10135, 3043,
    236761, 669, 4083, 529, 506, 16386, 2686, 563, 3187, 4173, 618, 496, 3925, 529, 886, 880, 532,
    886, 5464, 236764, 840, 506, 9496, 691, 31878, 532, 42030, 236761, 72759, 742, 1722, 1053,
    26077, 528, 7123, 11560, 573, 24744, 1680, 180558, 236793, 1144, 6692, 528, 135461, 236772,
    33201, 163952, 691, 496, 8376, 529, 6211, 34758, 236764, 4446, 236772, 5140, 106301, 236764,
    532, 496, 21792, 2686, 22882, 699, 10135, 3043, 236761, 669, 4083, 529, 506, 16386, 2686, 563,
    3187, 4173, 618, 496, 3925, 529, 886, 880, 532, 886, 5464, 236764, 840, 506, 9496, 691, 31878,
    532, 42030, 236761, 72759, 742, 1722, 1053, 26077, 528, 7123, 11560, 573, 24744, 1680, 180558,
    236793, 1144, 6692, 528, 135461, 236772, 33201, 163952, 691, 496, 8376, 529, 6211, 34758,
    236764, 4446, 236772, 5140, 106301, 236764, 532, 496, 21792, 2686, 22882, 699, 10135, 3043,
    236761, 669, 4083, 529, 506, 16386, 2686, 563, 3187, 4173, 618, 496, 3925, 529, 886, 880, 532,
    886, 5464, 236764, 840, 506, 9496, 691, 31878, 532, 42030, 236761, 72759, 742, 1722, 1053,
    26077, 528, 7123, 11560, 573, 24744, 1680, 180558, 236793, 1144, 6692, 528, 135461, 236772,
    33201, 163952, 691, 496, 8376, 529, 6211, 34758, 236764, 4446, 236772, 5140, 106301, 236764,
    532, 496, 21792, 2686, 22882, 699, 10135, 3043, 236761, 669, 4083, 529, 506, 16386, 2686, 563,
    3187, 4173, 618, 496, 3925, 529, 886, 880, 532, 886, 5464, 236764, 840, 506, 9496, 691, 31878,
    532, 42030, 236761, 72759, 742, 1722, 1053, 26077, 528, 7123, 11560, 573, 24744, 1680, 180558,
    236793, 1144, 6692, 528, 135461, 236772, 33201, 163952, 691, 496, 8376, 529, 6211, 34758,
    236764, 4446, 236772, 5140, 106301, 236764, 532, 496, 21792, 2686, 22882, 699, 10135, 3043,
    236761, 807,
];

const GEMMA_REFERENCE_IDS_NO_PARSE_SPECIAL: &[(&str, &[u32])] = &[
    (
        "<start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\n",
        &[
            236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107, 9259, 200322, 643, 236779,
            1340, 236779, 887, 236813, 107, 236820, 3041, 236779, 1340, 236779, 887, 236813, 4368,
            107,
        ],
    ),
    (
        "<bos><start_of_turn>user",
        &[
            236820, 46757, 1798, 3041, 236779, 1340, 236779, 887, 236813, 2364,
        ],
    ),
    (
        "text with <eos> inside and <pad> too",
        &[
            1005, 607, 655, 211827, 236813, 4888, 532, 655, 13039, 236813, 2311,
        ],
    ),
    (
        "<table><tr><td>cell</td></tr></table> <b>bold</b> </s>",
        &[
            168, 173, 175, 5447, 183, 181, 176, 236743, 200, 15640, 209, 1454, 236751, 236813,
        ],
    ),
];

#[test]
fn gemma_matches_llama_cpp_reference_ids() {
    let (_, tok, _) = gemma();
    for s in COMPARISON_STRINGS {
        assert!(
            GEMMA_REFERENCE_IDS.iter().any(|(t, _)| t == s),
            "no Gemma reference ids for {s:?}"
        );
    }
    let paragraph = gemma_paragraph();
    let rows = GEMMA_REFERENCE_IDS
        .iter()
        .copied()
        .chain([(paragraph.as_str(), GEMMA_PARAGRAPH_IDS)]);
    let mut failures = Vec::new();
    for (text, want) in rows {
        let got = encode(&tok, text);
        if got != want {
            failures.push(format!(
                "{text:?}\n  headwise  {got:?}\n  llama.cpp {want:?}"
            ));
        }
        // add_bos_token = true: `<bos>` (2) first, as llama.cpp's add_special.
        let with_bos = tok.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(with_bos[0], 2, "{text:?}");
        assert_eq!(&with_bos[1..], want, "{text:?} with BOS");
        // Decoding gives the text back, with a literal `▁` read as a space (as llama.cpp's
        // /detokenize does).
        let decoded = tok.decode(want, false).unwrap();
        assert_eq!(decoded, text.replace('\u{2581}', " "), "decode {want:?}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// With `encode_special_tokens` set, control tokens in the text are plain text, as with
/// llama.cpp's `parse_special = false`; user-defined tokens (runs of spaces, newlines and
/// tabs, HTML tags) are still cut out first in both. The one difference: llama.cpp retypes
/// `</s>` (user-defined in Gemma 3's file) as a control token, so it spells it out.
#[test]
fn gemma_matches_llama_cpp_without_parse_special() {
    let (_, mut tok, _) = gemma();
    tok.set_encode_special_tokens(true);
    for (text, want) in GEMMA_REFERENCE_IDS_NO_PARSE_SPECIAL {
        let got = encode(&tok, text);
        if let Some(head) = text.strip_suffix(" </s>") {
            // headwise: `▁` then `</s>` whole; llama.cpp: `▁</`, `s`, `>`.
            let n = encode(&tok, head).len();
            assert_eq!(got[..n], want[..n], "{text:?}");
            assert_eq!(got[n..], [236743, 212], "{text:?}");
            assert_eq!(want[n..], [1454, 236751, 236813], "{text:?}");
        } else {
            assert_eq!(got, *want, "{text:?}");
        }
    }
}

#[test]
fn gemma_special_tokens_and_no_chat_template() {
    let (content, tok, sp) = gemma();
    // Metadata: bos 2, eos 1, pad 0, add_bos_token true; `<end_of_turn>` (106) also ends a
    // turn.
    assert_eq!(
        sp,
        SpecialTokens {
            bos: Some(2),
            eos: Some(1),
            pad: Some(0),
            stop: vec![1, 106],
            add_bos: true,
        }
    );
    assert_eq!(tok.token_to_id("<end_of_turn>"), Some(106));
    assert_eq!(tok.token_to_id("<start_of_turn>"), Some(105));
    // The file carries no `tokenizer.chat_template`.
    assert!(ChatTemplate::from_gguf(&content)
        .expect("no error")
        .is_none());
    // Control tokens are special: skipped when decoding with skip_special_tokens.
    let ids = encode(&tok, "<start_of_turn>user\nHi<end_of_turn>\n");
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nHi\n");
}
