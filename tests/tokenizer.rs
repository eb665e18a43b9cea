//! The tokenizer and chat template built from the real SmolLM2-135M-Instruct GGUF.
//!
//! The model is `$HEADWISE_MODEL`, or the default file in `models/`, fetched if missing.

mod common;

use std::path::PathBuf;

use candle_core::quantized::gguf_file::Content;
use headwise::model::chat::{ChatMessage, ChatTemplate};
use headwise::model::tokenizer::{tokenizer_from_gguf, SpecialTokens, COMPARISON_STRINGS};
use tokenizers::Tokenizer;

/// The real model, fetched if missing (always `Some`; the option keeps call sites simple).
fn model_path() -> Option<PathBuf> {
    Some(common::real_model())
}

fn content() -> Option<Content> {
    let path = model_path()?;
    let mut file = std::fs::File::open(&path).expect("open model");
    Some(Content::read(&mut file).expect("read GGUF metadata"))
}

fn load() -> Option<(Content, Tokenizer, SpecialTokens)> {
    let content = content()?;
    let (tok, sp) = tokenizer_from_gguf(&content).expect("tokenizer from GGUF");
    Some((content, tok, sp))
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
    let Some((_, _, sp)) = load() else { return };
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
    let Some(content) = content() else { return };
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
    let Some((content, tok, _)) = load() else {
        return;
    };
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
    let Some((_, tok, _)) = load() else { return };
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
    let Some((_, tok, _)) = load() else { return };
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
    let Some((_, tok, _)) = load() else { return };
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
    let Some((_, tok, _)) = load() else { return };
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
    let Some((content, tok, _)) = load() else {
        return;
    };
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
    use headwise::engine::mistralrs::MistralRsEngine;
    use headwise::model::tokenizer::MISTRALRS_DIFFERS;

    let Some(path) = model_path() else { return };
    let Some((_, tok, _)) = load() else { return };
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
