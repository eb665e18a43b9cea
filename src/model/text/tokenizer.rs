//! Tokenizer built from GGUF metadata.
//!
//! A GGUF file carries its tokenizer as metadata under `tokenizer.ggml.*`: the vocabulary
//! (`tokens`), the kind of each token (`token_type`), the BPE `merges`, the tokenizer family
//! (`model`), the pre-tokenizer rule (`pre`) and the special ids. [`tokenizer_from_gguf`]
//! turns that into a [`tokenizers::Tokenizer`], so encoding and decoding run through the
//! same well-tested library as the Hugging Face tokenizers do.
//!
//! The pipeline is built in stages, each chosen from metadata by a small enum: the model
//! family ([`TokenizerFamily`], from `tokenizer.ggml.model`) and, for byte-level BPE, the
//! pre-tokenizer rule ([`PreTokenizerRule`], from `tokenizer.ggml.pre`). Supported today:
//! `gpt2` byte-level BPE with the `smollm` (and equivalent) or default GPT-2 pre-tokenizer
//! (SmolLM2), and `llama` SentencePiece-style BPE (Gemma 3).
//!
//! ## The `smollm` pre-tokenizer
//!
//! SmolLM2's own `tokenizer.json` pre-tokenizes with
//! `Sequence[Digits(individual_digits = true), ByteLevel(add_prefix_space = false,
//! use_regex = true)]`: every numeric character (`\p{N}`) is split off on its own, then the
//! GPT-2 regex (`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`)
//! splits each remaining stretch. llama.cpp maps `tokenizer.ggml.pre = smollm` to the same
//! two expressions (`\p{N}`, then the GPT-2 regex), shared with `starcoder`, `refact`,
//! `codeshell`, `exaone` and `minerva`. The vocabulary agrees: it holds no token of two or
//! more digits. The SmolLM2 BPE model has no unknown token: a byte that has no symbol in
//! the vocabulary (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d and bytes that never occur in UTF-8)
//! is dropped before the merges, as Hugging Face tokenizers (which trained the vocabulary)
//! drop it, rather than mapped to `tokenizer.ggml.unknown_token_id`.
//!
//! ## SentencePiece (`llama`)
//!
//! llama.cpp tokenizes a `llama` vocabulary (`llm_tokenizer_spm` and `tokenize` in
//! `src/llama-vocab.cpp`) in four steps:
//!
//! 1. control, user-defined and unknown tokens are cut out of the raw text (with
//!    `parse_special`; without it only the user-defined ones), longest token first;
//! 2. each remaining fragment gets a leading space when `tokenizer.ggml.add_space_prefix` is
//!    set (llama.cpp's default when the key is absent: true; Gemma 3 files say false), and
//!    its spaces become `▁` (U+2581);
//! 3. the fragment is split into characters, and the adjacent pair whose concatenation is a
//!    vocabulary token with the highest `tokenizer.ggml.scores` entry is merged, again and
//!    again until no adjacent pair forms a token (equal scores: the leftmost pair first);
//! 4. a final piece that is not a token (a single character outside the vocabulary) is
//!    written as the byte tokens `<0xXX>` of its UTF-8 encoding.
//!
//! The same pipeline from `tokenizers` parts: step 1 is the added-token split (control and
//! unknown tokens special, user-defined ones not, all matched on the raw text); step 2 is
//! the normalizer `Prepend("▁")` (only with `add_space_prefix`) then `Replace(" ", "▁")`,
//! which `tokenizers` applies to each fragment between added tokens, as llama.cpp does;
//! there is no pre-tokenizer, so a fragment is one BPE word; steps 3 and 4 are a BPE model
//! with `byte_fallback` whose merges are derived from the vocabulary: every split of a token
//! `t` into two tokens `a + b` is the merge `a b`, and merges are ranked by the score of `t`,
//! highest first. BPE then merges, at each step, the adjacent pair of lowest rank (equal
//! ranks: the leftmost), which is the pair whose merged token scores highest. Decoding is
//! `Replace("▁", " ")`, `ByteFallback`, `Fuse` (and `Strip` of one leading space with
//! `add_space_prefix`), as llama.cpp's `token_to_piece` writes pieces.
//!
//! Where the two can differ, and why Gemma 3 is not affected:
//!
//! - two different tokens with the same score: BPE ranks them by token id, SPM by position.
//!   Gemma 3's normal tokens all have distinct scores; the tied ones (user-defined runs of
//!   newlines, tabs and spaces, HTML tags, all scored -1000) are cut out in step 1, so no
//!   merge ever forms them;
//! - one token reached by two different splits at two places in a fragment: SPM merges the
//!   leftmost first, BPE the split of lower rank first (the splits of one token have
//!   adjacent ranks, so no other merge falls between them). The order matters only when the
//!   first merge enables a merge that scores higher than the token itself;
//! - a character that is not a token but occurs inside tokens: SPM can merge it, BPE only
//!   sees its byte tokens. Every character of Gemma 3's tokens is a token;
//! - byte tokens are never a side of a merge here, because in BPE they stand for bytes of a
//!   character outside the vocabulary, which SPM never merges;
//! - llama.cpp retypes `</s>` (a user-defined HTML tag in Gemma 3) as a control token and
//!   end-of-generation token (a workaround for another model), so with `parse_special =
//!   false` it tokenizes the text `</s>` piece by piece, and it leaves id 212 out of text
//!   decoded without special tokens; headwise keeps the type the file gives (and does not
//!   stop on `</s>`);
//! - with `add_space_prefix`, llama.cpp's detokenizer strips the leading space of the first
//!   token only (none when that token is special); the `Strip` decoder strips the first
//!   space of the decoded text.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::{NormalizerWrapper, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};
use tokenizers::{AddedToken, Tokenizer};

use crate::{Error, Result};

/// Strings on which headwise's tokenizer is compared with mistral.rs's (the
/// `mistralrs_tokenization_matches_except_documented_rule_differences` test in
/// `tests/tokenizer.rs`) and with an independent reference implementation of the model's
/// rule (the `reference_ids` table there).
///
/// mistral.rs 0.8.1 builds every GGUF `gpt2` tokenizer with one fixed split regex, the
/// Llama 3 one with single digits
/// (`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`),
/// whatever `tokenizer.ggml.pre` says, and registers `tokenizer.ggml.unknown_token_id` as
/// the BPE unknown token. On SmolLM2 that gives the same ids as the model's real `smollm`
/// rule (see the module docs) on prose, digits, code without newlines, unicode, emoji and
/// chat markup, and different ids on the strings in [`MISTRALRS_DIFFERS`], for two reasons:
///
/// - newlines: mistral.rs keeps a run of newlines (with the spaces before it) in one piece
///   (`\s*[\r\n]+`) and glues newlines to the punctuation before them (`[^\s..]+[\r\n]*`);
///   the GPT-2 rule splits the last whitespace character before a word off the run, so
///   `two\n\nline` gives `\n`, `\n` (ids 198, 198) for SmolLM2 but `\n\n` (id 1116) for
///   mistral.rs, and `x):\n    return` gives `):`, `\n   `, ` return` for
///   SmolLM2 but `):\n`, `   `, ` return` for mistral.rs. Paragraph breaks in prose hit this:
///   on long documents the two tokenizations differ by about one token per paragraph;
/// - a byte with no symbol in the vocabulary (here U+0004): mistral.rs emits the unknown
///   token `<|endoftext|>` (id 0), SmolLM2 drops the byte.
///
/// The other differences between the two regexes (a letter run glued to one preceding
/// punctuation character, as in `(value`; case-insensitive contractions, as in `IT'S`)
/// split the text differently but give the same ids on the strings here, because the
/// SmolLM2 merges never join across those boundaries for them.
///
/// headwise follows SmolLM2's rule: the tests check headwise's ids against ids from an
/// independent implementation of that rule on every string here, and check that
/// mistral.rs agrees with headwise exactly on the strings not in [`MISTRALRS_DIFFERS`].
pub const COMPARISON_STRINGS: &[&str] = &[
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Year 2026 has 12345 items.",
    "3.14159 and 1,000,000",
    "The needle is 7481 and the key is 'blue-42'.",
    " leading space",
    "multiple   spaces   here",
    "trailing spaces   ",
    "line one\nline two\n\nline four",
    "tab\tseparated\tvalues",
    "I'm sure they'll say it's fine, don't you think?",
    "Café naïve résumé façade",
    "Ünïcödé ΑΒΓ Привет мир",
    "你好，世界！这是一个测试。",
    "Emoji: 😀👍🏽 and ❤️",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n",
    "email me at someone@example.com or see https://example.com/a?q=1",
    "Mixed123Numbers456",
    "½ ² ③ Ⅻ",
    "   ",
    "\n\n\n",
    "...!!!???",
    "print(value)",
    "def foo(x):\n    return x ** 2\n",
    "Hello!\nHow are you?",
    "a  \n  b",
    "I'M SURE IT'S FINE",
    "JSON: {\"key\": [1, 2, 3]}",
    "First paragraph.\n\nSecond paragraph.",
    "end.\r\nnext",
    "end of transmission\u{4}",
];

/// The strings of [`COMPARISON_STRINGS`] on which mistral.rs 0.8.1's GGUF tokenizer and
/// SmolLM2's real `smollm` rule (which headwise follows) give different ids; the reasons
/// are listed on [`COMPARISON_STRINGS`].
pub const MISTRALRS_DIFFERS: &[&str] = &[
    "line one\nline two\n\nline four",
    "def foo(x):\n    return x ** 2\n",
    "a  \n  b",
    "First paragraph.\n\nSecond paragraph.",
    "end.\r\nnext",
    "end of transmission\u{4}",
];

/// Special token ids read from GGUF metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning of sequence (`tokenizer.ggml.bos_token_id`).
    pub bos: Option<u32>,
    /// End of sequence (`tokenizer.ggml.eos_token_id`).
    pub eos: Option<u32>,
    /// Padding (`tokenizer.ggml.padding_token_id`).
    pub pad: Option<u32>,
    /// Every id that ends a turn/generation: eos plus `<|im_end|>` / `<end_of_turn>` /
    /// `<|eot_id|>` (and `<|eom_id|>`, `<|endoftext|>`, as llama.cpp also treats them) when
    /// present in the vocab as control or user-defined tokens; eos first, no duplicates.
    pub stop: Vec<u32>,
    /// Whether encoding with special tokens prepends `bos`
    /// (`tokenizer.ggml.add_bos_token`; when absent: false for `gpt2`, true for `llama`).
    pub add_bos: bool,
}

/// Texts of tokens that end a turn in some chat format; a vocabulary token with one of
/// these texts joins [`SpecialTokens::stop`].
const END_OF_TURN_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
];

/// Token ids of `text`; `add_special` adds what the tokenizer's post-processor adds
/// (BOS where the model expects it).
pub fn encode_ids(tokenizer: &Tokenizer, text: &str, add_special: bool) -> Result<Vec<u32>> {
    let enc = tokenizer
        .encode(text, add_special)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    Ok(enc.get_ids().to_vec())
}

/// Text of `ids`, special tokens included.
pub fn decode_ids(tokenizer: &Tokenizer, ids: &[u32]) -> Result<String> {
    tokenizer
        .decode(ids, false)
        .map_err(|e| Error::Tokenizer(e.to_string()))
}

/// Build a [`tokenizers::Tokenizer`] from the GGUF metadata.
///
/// `tokenizer.ggml.model = "gpt2"`: byte-level BPE from `tokenizer.ggml.tokens`,
/// `tokenizer.ggml.merges` and `tokenizer.ggml.token_type`, with the pre-tokenizer chosen by
/// `tokenizer.ggml.pre` ([`PreTokenizerRule`]).
///
/// `tokenizer.ggml.model = "llama"`: SentencePiece-style BPE from `tokenizer.ggml.tokens`,
/// `tokenizer.ggml.scores`, `tokenizer.ggml.token_type` and
/// `tokenizer.ggml.add_space_prefix` (default true), with byte fallback, giving the ids
/// llama.cpp gives (see the module docs for the construction).
///
/// Control, user-defined and unknown tokens are registered as added tokens, so chat markup
/// such as `<|im_start|>` or `<start_of_turn>` in the text is one token (with or without
/// `add_special_tokens`, as llama.cpp with `parse_special`); control tokens are special
/// (skipped by `decode(.., skip_special_tokens = true)`). `encode(text, true)` prepends the
/// BOS token when [`SpecialTokens::add_bos`] is set; `encode(text, false)` never adds
/// anything.
///
/// Errors: [`Error::Metadata`] for a missing or malformed key (including a scores or token
/// type array whose length differs from the vocabulary's), [`Error::Tokenizer`] for a
/// tokenizer family or pre-tokenizer not supported yet or a vocabulary the BPE model
/// rejects.
pub fn tokenizer_from_gguf(content: &Content) -> Result<(Tokenizer, SpecialTokens)> {
    tokenizer_from_metadata(&content.metadata)
}

/// [`tokenizer_from_gguf`] on the metadata map alone.
fn tokenizer_from_metadata(md: &HashMap<String, Value>) -> Result<(Tokenizer, SpecialTokens)> {
    let vocab = GgufVocab::read(md)?;
    let family = TokenizerFamily::from_metadata(md)?;
    let specials = SpecialTokens::read(md, &vocab, family)?;
    let mut tokenizer = match family {
        TokenizerFamily::Gpt2Bpe => {
            let rule = PreTokenizerRule::from_metadata(md)?;
            byte_level_bpe(md, &vocab, rule)?
        }
        TokenizerFamily::SentencePiece => sentencepiece_bpe(md, &vocab)?,
    };
    register_added_tokens(&mut tokenizer, &vocab, &specials);
    if specials.add_bos {
        let bos = specials.bos.ok_or_else(|| Error::Metadata {
            key: "tokenizer.ggml.add_bos_token".into(),
            reason: "is true but tokenizer.ggml.bos_token_id is missing".into(),
        })?;
        tokenizer.with_post_processor(Some(bos_template(&vocab, bos)?));
    }
    Ok((tokenizer, specials))
}

/// The tokenizer family named by `tokenizer.ggml.model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerFamily {
    /// `gpt2`: byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen2).
    Gpt2Bpe,
    /// `llama`: SentencePiece-style BPE over `▁`-escaped text, merging by token score, with
    /// byte fallback (Llama 2, Mistral, Gemma 3).
    SentencePiece,
}

impl TokenizerFamily {
    /// The families headwise can build, as named in GGUF metadata.
    pub const SUPPORTED: &'static [&'static str] = &["gpt2", "llama"];

    /// Read `tokenizer.ggml.model`.
    pub fn from_metadata(md: &HashMap<String, Value>) -> Result<Self> {
        let name = get_string(md, "tokenizer.ggml.model")?;
        match name {
            "gpt2" => Ok(Self::Gpt2Bpe),
            "llama" => Ok(Self::SentencePiece),
            other => Err(Error::Tokenizer(format!(
                "tokenizer model `{other}` is not supported (supported: {})",
                Self::SUPPORTED.join(", ")
            ))),
        }
    }
}

/// How a byte-level BPE tokenizer splits text into words before BPE merges
/// (`tokenizer.ggml.pre`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizerRule {
    /// The GPT-2 split regex alone (`gpt2`, `default`, or no `tokenizer.ggml.pre`).
    Gpt2,
    /// Every numeric character on its own, then the GPT-2 regex (`smollm`, `starcoder`,
    /// `refact`, `codeshell`, `exaone`, `minerva`).
    DigitsThenGpt2,
}

impl PreTokenizerRule {
    /// Values of `tokenizer.ggml.pre` headwise understands.
    pub const SUPPORTED: &'static [&'static str] = &[
        "default",
        "gpt2",
        "smollm",
        "starcoder",
        "refact",
        "codeshell",
        "exaone",
        "minerva",
    ];

    /// The rule for a `tokenizer.ggml.pre` value (`None`: key absent).
    pub fn from_name(name: Option<&str>) -> Result<Self> {
        match name {
            None | Some("default") | Some("gpt2") => Ok(Self::Gpt2),
            Some("smollm" | "starcoder" | "refact" | "codeshell" | "exaone" | "minerva") => {
                Ok(Self::DigitsThenGpt2)
            }
            Some(other) => Err(Error::Tokenizer(format!(
                "pre-tokenizer `{other}` is not supported yet (supported: {})",
                Self::SUPPORTED.join(", ")
            ))),
        }
    }

    /// Read `tokenizer.ggml.pre`.
    pub fn from_metadata(md: &HashMap<String, Value>) -> Result<Self> {
        let name = match md.get("tokenizer.ggml.pre") {
            None => None,
            Some(v) => Some(v.to_string().map_err(|_| Error::Metadata {
                key: "tokenizer.ggml.pre".into(),
                reason: format!("expected a string, found {:?}", v.value_type()),
            })?),
        };
        Self::from_name(name.map(String::as_str))
    }

    /// The `tokenizers` pre-tokenizer implementing this rule (byte-level output).
    pub fn pre_tokenizer(self) -> PreTokenizerWrapper {
        // add_prefix_space = false, trim_offsets = true, use_regex = true: the GPT-2 regex.
        let byte_level = ByteLevel::new(false, true, true);
        match self {
            Self::Gpt2 => byte_level.into(),
            Self::DigitsThenGpt2 => {
                Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
            }
        }
    }
}

/// The kind of a vocabulary entry (`tokenizer.ggml.token_type`, llama.cpp's numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_code(code: i64) -> Option<Self> {
        Some(match code {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => return None,
        })
    }
}

/// The vocabulary and token kinds, as read from metadata.
struct GgufVocab {
    tokens: Vec<String>,
    /// `None` when the file has no `tokenizer.ggml.token_type`.
    types: Option<Vec<TokenType>>,
}

impl GgufVocab {
    fn read(md: &HashMap<String, Value>) -> Result<Self> {
        let tokens = get_string_array(md, "tokenizer.ggml.tokens")?;
        if tokens.is_empty() {
            return Err(metadata_err("tokenizer.ggml.tokens", "is empty"));
        }
        if u32::try_from(tokens.len()).is_err() {
            return Err(metadata_err(
                "tokenizer.ggml.tokens",
                "has more than 2^32 entries",
            ));
        }
        let types = match md.get("tokenizer.ggml.token_type") {
            None => None,
            Some(v) => {
                let key = "tokenizer.ggml.token_type";
                let arr = v
                    .to_vec()
                    .map_err(|_| metadata_err(key, "expected an array"))?;
                if arr.len() != tokens.len() {
                    return Err(metadata_err(
                        key,
                        format!("has {} entries for {} tokens", arr.len(), tokens.len()),
                    ));
                }
                let types = arr
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        as_i64(v).and_then(TokenType::from_code).ok_or_else(|| {
                            metadata_err(key, format!("entry {i} is not a token type: {v:?}"))
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Some(types)
            }
        };
        Ok(Self { tokens, types })
    }

    fn len(&self) -> usize {
        self.tokens.len()
    }

    fn token_type(&self, id: usize) -> Option<TokenType> {
        self.types.as_ref().map(|t| t[id])
    }

    /// Text to id, for the BPE model. Errors on a repeated token (llama.cpp rejects those
    /// too).
    fn to_map(&self) -> Result<Vocab> {
        let mut map = Vocab::with_capacity(self.len());
        for (id, token) in self.tokens.iter().enumerate() {
            // `id` fits in u32: checked in GgufVocab::read.
            if let Some(first) = map.insert(token.clone(), id as u32) {
                return Err(metadata_err(
                    "tokenizer.ggml.tokens",
                    format!("token {id} repeats token {first} ({token:?})"),
                ));
            }
        }
        Ok(map)
    }

    /// The id of the token with exactly this text, if any.
    fn find(&self, text: &str) -> Option<u32> {
        self.tokens
            .iter()
            .position(|t| t == text)
            .and_then(|i| u32::try_from(i).ok())
    }
}

impl SpecialTokens {
    fn read(
        md: &HashMap<String, Value>,
        vocab: &GgufVocab,
        family: TokenizerFamily,
    ) -> Result<Self> {
        let bos = get_token_id(md, "tokenizer.ggml.bos_token_id", vocab.len())?;
        let eos = get_token_id(md, "tokenizer.ggml.eos_token_id", vocab.len())?;
        let pad = get_token_id(md, "tokenizer.ggml.padding_token_id", vocab.len())?;
        let add_bos = match md.get("tokenizer.ggml.add_bos_token") {
            Some(v) => v
                .to_bool()
                .map_err(|_| metadata_err("tokenizer.ggml.add_bos_token", "expected a boolean"))?,
            None => match family {
                TokenizerFamily::Gpt2Bpe => false,
                TokenizerFamily::SentencePiece => true,
            },
        };
        let mut stop: Vec<u32> = eos.into_iter().collect();
        for text in END_OF_TURN_TEXTS {
            if let Some(id) = vocab.find(text) {
                let kind = vocab.token_type(id as usize);
                let is_markup = matches!(
                    kind,
                    None | Some(TokenType::Control) | Some(TokenType::UserDefined)
                );
                if is_markup && !stop.contains(&id) {
                    stop.push(id);
                }
            }
        }
        Ok(Self {
            bos,
            eos,
            pad,
            stop,
            add_bos,
        })
    }
}

/// Byte-level BPE (`tokenizer.ggml.model = gpt2`).
fn byte_level_bpe(
    md: &HashMap<String, Value>,
    vocab: &GgufVocab,
    rule: PreTokenizerRule,
) -> Result<Tokenizer> {
    let map = vocab.to_map()?;
    let merges = get_string_array(md, "tokenizer.ggml.merges")?
        .into_iter()
        .enumerate()
        .map(|(i, merge)| match merge.split_once(' ') {
            Some((a, b)) if !a.is_empty() && !b.is_empty() => Ok((a.to_owned(), b.to_owned())),
            _ => Err(metadata_err(
                "tokenizer.ggml.merges",
                format!("entry {i} ({merge:?}) is not two space-separated symbols"),
            )),
        })
        .collect::<Result<Vec<_>>>()?;
    // No unknown token: a byte without a symbol in the vocabulary is dropped (see the
    // module docs).
    let bpe = BPE::builder()
        .vocab_and_merges(map, merges)
        .build()
        .map_err(|e| Error::Tokenizer(format!("BPE model from GGUF metadata: {e}")))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(rule.pre_tokenizer()));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tokenizer)
}

/// SentencePiece-style BPE (`tokenizer.ggml.model = llama`), built as the module docs
/// describe.
fn sentencepiece_bpe(md: &HashMap<String, Value>, vocab: &GgufVocab) -> Result<Tokenizer> {
    let scores = read_scores(md, vocab.len())?;
    let add_space_prefix = match md.get("tokenizer.ggml.add_space_prefix") {
        None => true,
        Some(v) => v.to_bool().map_err(|_| {
            metadata_err(
                "tokenizer.ggml.add_space_prefix",
                format!("expected a boolean, found {:?}", v.value_type()),
            )
        })?,
    };
    let unk = get_token_id(md, "tokenizer.ggml.unknown_token_id", vocab.len())?;
    let map = vocab.to_map()?;
    let merges = merges_by_score(vocab, &scores, &map);
    let mut builder = BPE::builder()
        .vocab_and_merges(map, merges)
        .byte_fallback(true);
    // Only used for a character outside the vocabulary whose bytes have no `<0xXX>` token
    // (llama.cpp has no answer there either); with no unknown token such a character is
    // dropped.
    if let Some(unk) = unk {
        builder = builder.unk_token(vocab.tokens[unk as usize].clone());
    }
    let bpe = builder
        .build()
        .map_err(|e| Error::Tokenizer(format!("SentencePiece BPE from GGUF metadata: {e}")))?;

    let replace = |from: &str, to: &str| {
        Replace::new(from, to).map_err(|e| Error::Tokenizer(format!("Replace {from:?}: {e}")))
    };
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if add_space_prefix {
        normalizers.push(Prepend::new(SPM_SPACE.into()).into());
    }
    normalizers.push(replace(" ", SPM_SPACE)?.into());
    let mut decoders: Vec<DecoderWrapper> = vec![
        replace(SPM_SPACE, " ")?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }

    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_normalizer(Some(NormalizerSequence::new(normalizers)));
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

/// SentencePiece's escaped space, `▁` (U+2581).
const SPM_SPACE: &str = "\u{2581}";

/// `tokenizer.ggml.scores` as f32, one per token. llama.cpp also accepts an int32 array.
fn read_scores(md: &HashMap<String, Value>, n_tokens: usize) -> Result<Vec<f32>> {
    let key = "tokenizer.ggml.scores";
    let v = md
        .get(key)
        .ok_or_else(|| metadata_err(key, "missing (SentencePiece merges are ranked by score)"))?;
    let arr = v.to_vec().map_err(|_| {
        metadata_err(
            key,
            format!("expected an array, found {:?}", v.value_type()),
        )
    })?;
    if arr.len() != n_tokens {
        return Err(metadata_err(
            key,
            format!("has {} entries for {n_tokens} tokens", arr.len()),
        ));
    }
    arr.iter()
        .enumerate()
        .map(|(i, v)| {
            let score = match *v {
                Value::F32(x) => Some(x),
                Value::F64(x) => Some(x as f32),
                _ => as_i64(v).map(|x| x as f32),
            };
            match score {
                Some(x) if !x.is_nan() => Ok(x),
                _ => Err(metadata_err(
                    key,
                    format!("entry {i} is not a number: {v:?}"),
                )),
            }
        })
        .collect()
}

/// The BPE merges equivalent to SentencePiece's merge-by-score: for every token `t` and
/// every split of `t` into two tokens `a + b` (byte tokens excluded, see the module docs),
/// the merge `a b`; ordered by the score of `t`, highest first, then by token id, then by
/// split position.
fn merges_by_score(vocab: &GgufVocab, scores: &[f32], map: &Vocab) -> Vec<(String, String)> {
    let is_byte = |id: u32| vocab.token_type(id as usize) == Some(TokenType::Byte);
    // (token id, byte offset of the split)
    let mut splits: Vec<(u32, usize)> = Vec::new();
    for (id, token) in vocab.tokens.iter().enumerate() {
        for (at, _) in token.char_indices().skip(1) {
            let (a, b) = token.split_at(at);
            if let (Some(&a), Some(&b)) = (map.get(a), map.get(b)) {
                if !is_byte(a) && !is_byte(b) {
                    // `id` fits in u32: checked in GgufVocab::read.
                    splits.push((id as u32, at));
                }
            }
        }
    }
    splits.sort_by(|&(x, at_x), &(y, at_y)| {
        scores[y as usize]
            .total_cmp(&scores[x as usize])
            .then(x.cmp(&y))
            .then(at_x.cmp(&at_y))
    });
    splits
        .into_iter()
        .map(|(id, at)| {
            let (a, b) = vocab.tokens[id as usize].split_at(at);
            (a.to_owned(), b.to_owned())
        })
        .collect()
}

/// Register control, user-defined and unknown tokens (or, with no `token_type`, the bos,
/// eos and pad tokens) as added tokens, matched whole in raw text before pre-tokenization.
fn register_added_tokens(tokenizer: &mut Tokenizer, vocab: &GgufVocab, specials: &SpecialTokens) {
    let mut special = Vec::new();
    let mut plain = Vec::new();
    match &vocab.types {
        Some(types) => {
            for (token, kind) in vocab.tokens.iter().zip(types) {
                if token.is_empty() {
                    continue;
                }
                match kind {
                    TokenType::Control | TokenType::Unknown => {
                        special.push(AddedToken::from(token.clone(), true).normalized(false))
                    }
                    TokenType::UserDefined => {
                        plain.push(AddedToken::from(token.clone(), false).normalized(false))
                    }
                    TokenType::Normal | TokenType::Unused | TokenType::Byte => {}
                }
            }
        }
        None => {
            let mut ids: Vec<u32> = [specials.bos, specials.eos, specials.pad]
                .into_iter()
                .flatten()
                .collect();
            ids.sort_unstable();
            ids.dedup();
            for id in ids {
                let token = &vocab.tokens[id as usize];
                if !token.is_empty() {
                    special.push(AddedToken::from(token.clone(), true).normalized(false));
                }
            }
        }
    }
    tokenizer.add_special_tokens(&special);
    tokenizer.add_tokens(&plain);
}

/// A post-processor that prepends the BOS token (to each sequence of a pair).
fn bos_template(vocab: &GgufVocab, bos: u32) -> Result<TemplateProcessing> {
    let text = vocab.tokens[bos as usize].clone();
    let err = |e: String| Error::Tokenizer(format!("BOS post-processor: {e}"));
    // "bos" is the template's name for the token, so the token's text cannot clash with
    // the template syntax.
    let token =
        SpecialToken::new("bos".into(), vec![bos], vec![text]).map_err(|e| err(e.to_string()))?;
    TemplateProcessing::builder()
        .try_single("bos $A")
        .map_err(err)?
        .try_pair("bos $A bos $B:1")
        .map_err(err)?
        .special_tokens(vec![token])
        .build()
        .map_err(|e| err(e.to_string()))
}

fn metadata_err(key: &str, reason: impl Into<String>) -> Error {
    Error::Metadata {
        key: key.into(),
        reason: reason.into(),
    }
}

fn get_string<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<&'a str> {
    let v = md.get(key).ok_or_else(|| metadata_err(key, "missing"))?;
    v.to_string().map(String::as_str).map_err(|_| {
        metadata_err(
            key,
            format!("expected a string, found {:?}", v.value_type()),
        )
    })
}

fn get_string_array(md: &HashMap<String, Value>, key: &str) -> Result<Vec<String>> {
    let v = md.get(key).ok_or_else(|| metadata_err(key, "missing"))?;
    let arr = v.to_vec().map_err(|_| {
        metadata_err(
            key,
            format!("expected an array, found {:?}", v.value_type()),
        )
    })?;
    arr.iter()
        .enumerate()
        .map(|(i, v)| {
            v.to_string()
                .cloned()
                .map_err(|_| metadata_err(key, format!("entry {i} is not a string")))
        })
        .collect()
}

/// An optional token id that must index the vocabulary.
fn get_token_id(md: &HashMap<String, Value>, key: &str, vocab_len: usize) -> Result<Option<u32>> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    let id =
        as_i64(v).ok_or_else(|| metadata_err(key, format!("expected an integer, found {v:?}")))?;
    match u32::try_from(id) {
        Ok(id) if (id as usize) < vocab_len => Ok(Some(id)),
        _ => Err(metadata_err(
            key,
            format!("{id} is not a token id (vocabulary of {vocab_len})"),
        )),
    }
}

/// Any GGUF integer value as i64 (None for other types and out-of-range u64).
fn as_i64(v: &Value) -> Option<i64> {
    match *v {
        Value::U8(x) => Some(x.into()),
        Value::I8(x) => Some(x.into()),
        Value::U16(x) => Some(x.into()),
        Value::I16(x) => Some(x.into()),
        Value::U32(x) => Some(x.into()),
        Value::I32(x) => Some(x.into()),
        Value::U64(x) => i64::try_from(x).ok(),
        Value::I64(x) => Some(x),
        _ => None,
    }
}

/// The text of the token whose id is stored under `key` (e.g. `tokenizer.ggml.bos_token_id`),
/// or `None` when the key is absent.
pub(crate) fn special_token_text(md: &HashMap<String, Value>, key: &str) -> Result<Option<String>> {
    if !md.contains_key(key) {
        return Ok(None);
    }
    let tokens_key = "tokenizer.ggml.tokens";
    let tokens = md
        .get(tokens_key)
        .ok_or_else(|| metadata_err(tokens_key, "missing"))?
        .to_vec()
        .map_err(|_| metadata_err(tokens_key, "expected an array"))?;
    let Some(id) = get_token_id(md, key, tokens.len())? else {
        return Ok(None);
    };
    tokens[id as usize]
        .to_string()
        .map(|t| Some(t.clone()))
        .map_err(|_| metadata_err(tokens_key, format!("entry {id} is not a string")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's byte-to-symbol map for the bytes used below: printable ASCII maps to
    /// itself, space to `Ġ` (U+0120), newline to `Ċ` (U+010A).
    const SPACE: &str = "\u{120}";
    const NEWLINE: &str = "\u{10a}";

    /// A tiny synthetic vocabulary: ids are the positions in `TOKENS`.
    const TOKENS: &[&str] = &[
        "<|endoftext|>", // 0 control
        "<|im_start|>",  // 1 control
        "<|im_end|>",    // 2 control
        "a",             // 3
        "b",             // 4
        "c",             // 5
        "\u{120}",       // 6  " "
        "\u{10a}",       // 7  "\n"
        "1",             // 8
        "2",             // 9
        "ab",            // 10
        "\u{120}ab",     // 11 " ab"
        "12",            // 12 a multi-digit token: only the plain GPT-2 rule can produce it
        "<tool>",        // 13 user-defined
        "'",             // 14
        "s",             // 15
        "'s",            // 16
    ];
    const MERGES: &[&str] = &["a b", "\u{120} ab", "1 2", "' s"];

    fn metadata(pre: Option<&str>) -> HashMap<String, Value> {
        let strings =
            |v: &[&str]| Value::Array(v.iter().map(|s| Value::String(s.to_string())).collect());
        let types = TOKENS
            .iter()
            .enumerate()
            .map(|(i, _)| {
                Value::I32(match i {
                    0..=2 => 3,
                    13 => 4,
                    _ => 1,
                })
            })
            .collect();
        let mut md = HashMap::new();
        md.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
        if let Some(pre) = pre {
            md.insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
        }
        md.insert("tokenizer.ggml.tokens".into(), strings(TOKENS));
        md.insert("tokenizer.ggml.token_type".into(), Value::Array(types));
        md.insert("tokenizer.ggml.merges".into(), strings(MERGES));
        md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
        md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
        md.insert("tokenizer.ggml.padding_token_id".into(), Value::U32(2));
        md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(false));
        md
    }

    fn encode(tok: &Tokenizer, text: &str) -> Vec<u32> {
        tok.encode(text, false).expect("encode").get_ids().to_vec()
    }

    #[test]
    fn synthetic_vocab_encodes_by_hand_derived_ids() {
        assert_eq!(TOKENS[6], SPACE);
        assert_eq!(TOKENS[7], NEWLINE);
        let (smollm, _) = tokenizer_from_metadata(&metadata(Some("smollm"))).unwrap();
        let (gpt2, _) = tokenizer_from_metadata(&metadata(None)).unwrap();
        // (input, ids under `smollm`, ids under the plain GPT-2 rule)
        let rows: &[(&str, &[u32], &[u32])] = &[
            ("ab", &[10], &[10]),
            (" ab", &[11], &[11]),
            ("abc", &[10, 5], &[10, 5]),
            ("a b", &[3, 6, 4], &[3, 6, 4]),
            ("12", &[8, 9], &[12]),
            ("a12", &[3, 8, 9], &[3, 12]),
            (" 12", &[6, 8, 9], &[6, 12]),
            ("ab\nab", &[10, 7, 10], &[10, 7, 10]),
            ("a's", &[3, 16], &[3, 16]),
            ("<|im_start|>ab<|im_end|>", &[1, 10, 2], &[1, 10, 2]),
            ("<|im_start|> ab", &[1, 11], &[1, 11]),
            ("a<tool>b", &[3, 13, 4], &[3, 13, 4]),
            // "x" has no symbol in the vocabulary and there is no unknown token: it is
            // dropped before the merges, so "a" and "b" then merge (as in Hugging Face
            // tokenizers, which trained the model's vocabulary).
            ("axb", &[10], &[10]),
            ("xa", &[3], &[3]),
            ("", &[], &[]),
        ];
        for (text, want_smollm, want_gpt2) in rows {
            assert_eq!(encode(&smollm, text), *want_smollm, "smollm {text:?}");
            assert_eq!(encode(&gpt2, text), *want_gpt2, "gpt2 {text:?}");
        }
    }

    #[test]
    fn decode_inverts_encode_and_skips_control_tokens() {
        let (tok, _) = tokenizer_from_metadata(&metadata(Some("smollm"))).unwrap();
        for text in [
            "ab ab\n12",
            "<|im_start|>a b<|im_end|>",
            "a<tool>b",
            "  c\n\n",
        ] {
            let ids = encode(&tok, text);
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
        }
        let ids = encode(&tok, "<|im_start|>ab<|im_end|><tool>");
        assert_eq!(tok.decode(&ids, true).unwrap(), "ab<tool>");
    }

    #[test]
    fn special_tokens_from_metadata() {
        let (_, sp) = tokenizer_from_metadata(&metadata(Some("smollm"))).unwrap();
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
    fn add_bos_prepends_bos_only_with_special_tokens() {
        let mut md = metadata(Some("smollm"));
        md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
        let (tok, sp) = tokenizer_from_metadata(&md).unwrap();
        assert!(sp.add_bos);
        assert_eq!(tok.encode("ab", true).unwrap().get_ids(), &[1, 10]);
        assert_eq!(tok.encode("ab", false).unwrap().get_ids(), &[10]);
    }

    #[test]
    fn without_token_types_bos_eos_pad_are_special() {
        let mut md = metadata(Some("smollm"));
        md.remove("tokenizer.ggml.token_type");
        let (tok, _) = tokenizer_from_metadata(&md).unwrap();
        assert_eq!(encode(&tok, "<|im_start|>ab<|im_end|>"), vec![1, 10, 2]);
    }

    #[test]
    fn bad_metadata_is_an_error_not_a_panic() {
        type Edit = fn(&mut HashMap<String, Value>);
        let cases: &[(&str, Edit)] = &[
            ("model llama without scores", |md| {
                md.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
            }),
            ("model unknown", |md| {
                md.insert("tokenizer.ggml.model".into(), Value::String("bert".into()));
            }),
            ("no model", |md| {
                md.remove("tokenizer.ggml.model");
            }),
            ("unknown pre", |md| {
                md.insert("tokenizer.ggml.pre".into(), Value::String("qwen2".into()));
            }),
            ("pre not a string", |md| {
                md.insert("tokenizer.ggml.pre".into(), Value::U32(3));
            }),
            ("no tokens", |md| {
                md.remove("tokenizer.ggml.tokens");
            }),
            ("empty tokens", |md| {
                md.insert("tokenizer.ggml.tokens".into(), Value::Array(vec![]));
            }),
            ("tokens not strings", |md| {
                md.insert(
                    "tokenizer.ggml.tokens".into(),
                    Value::Array(vec![Value::U8(1)]),
                );
            }),
            ("no merges", |md| {
                md.remove("tokenizer.ggml.merges");
            }),
            ("merge without a space", |md| {
                md.insert(
                    "tokenizer.ggml.merges".into(),
                    Value::Array(vec![Value::String("ab".into())]),
                );
            }),
            ("merge of unknown symbols", |md| {
                md.insert(
                    "tokenizer.ggml.merges".into(),
                    Value::Array(vec![Value::String("x y".into())]),
                );
            }),
            ("token types too short", |md| {
                md.insert(
                    "tokenizer.ggml.token_type".into(),
                    Value::Array(vec![Value::I32(1)]),
                );
            }),
            ("bad token type", |md| {
                let n = TOKENS.len();
                md.insert(
                    "tokenizer.ggml.token_type".into(),
                    Value::Array(vec![Value::I32(9); n]),
                );
            }),
            ("bos out of range", |md| {
                md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(10_000));
            }),
            ("eos negative", |md| {
                md.insert("tokenizer.ggml.eos_token_id".into(), Value::I32(-1));
            }),
            ("eos a string", |md| {
                md.insert(
                    "tokenizer.ggml.eos_token_id".into(),
                    Value::String("2".into()),
                );
            }),
            ("add_bos without bos", |md| {
                md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
                md.remove("tokenizer.ggml.bos_token_id");
            }),
            ("duplicate token", |md| {
                let mut t: Vec<Value> = TOKENS
                    .iter()
                    .map(|s| Value::String(s.to_string()))
                    .collect();
                t[4] = Value::String("a".into());
                md.insert("tokenizer.ggml.tokens".into(), Value::Array(t));
            }),
        ];
        for (name, edit) in cases {
            let mut md = metadata(Some("smollm"));
            edit(&mut md);
            match tokenizer_from_metadata(&md) {
                Err(Error::Tokenizer(_) | Error::Metadata { .. }) => {}
                Err(e) => panic!("{name}: unexpected error kind {e}"),
                Ok(_) => panic!("{name}: accepted bad metadata"),
            }
        }
    }

    #[test]
    fn pre_tokenizer_names() {
        let rows: &[(Option<&str>, Option<PreTokenizerRule>)] = &[
            (None, Some(PreTokenizerRule::Gpt2)),
            (Some("gpt2"), Some(PreTokenizerRule::Gpt2)),
            (Some("default"), Some(PreTokenizerRule::Gpt2)),
            (Some("smollm"), Some(PreTokenizerRule::DigitsThenGpt2)),
            (Some("starcoder"), Some(PreTokenizerRule::DigitsThenGpt2)),
            (Some("llama-bpe"), None),
            (Some("qwen2"), None),
        ];
        for (name, want) in rows {
            assert_eq!(PreTokenizerRule::from_name(*name).ok(), *want, "{name:?}");
        }
    }

    /// A tiny SentencePiece-style vocabulary: (text, token type, score); ids are positions,
    /// followed by the 256 byte tokens `<0x00>`..`<0xFF>` (ids `SPM_BYTE0 + byte`, score 0).
    const SPM_TOKENS: &[(&str, i32, f32)] = &[
        ("<pad>", 3, 0.0),           // 0
        ("<eos>", 3, 0.0),           // 1
        ("<bos>", 3, 0.0),           // 2
        ("<unk>", 2, 0.0),           // 3
        ("<start_of_turn>", 3, 0.0), // 4
        ("<end_of_turn>", 3, 0.0),   // 5
        ("\n", 4, 0.0),              // 6 user-defined
        ("\u{2581}", 1, -10.0),      // 7 "▁"
        ("a", 1, -11.0),             // 8
        ("b", 1, -12.0),             // 9
        ("c", 1, -13.0),             // 10
        ("ab", 1, -5.0),             // 11
        ("bc", 1, -1.0),             // 12 scores higher than "ab" although its id is larger
        ("\u{2581}a", 1, -2.0),      // 13 "▁a"
        ("\u{2581}ab", 1, -3.0),     // 14 "▁ab"
    ];
    const SPM_BYTE0: u32 = 15;

    fn spm_metadata(add_space_prefix: Option<bool>) -> HashMap<String, Value> {
        let mut tokens: Vec<Value> = SPM_TOKENS
            .iter()
            .map(|(t, _, _)| Value::String(t.to_string()))
            .collect();
        let mut types: Vec<Value> = SPM_TOKENS
            .iter()
            .map(|&(_, ty, _)| Value::I32(ty))
            .collect();
        let mut scores: Vec<Value> = SPM_TOKENS.iter().map(|&(_, _, s)| Value::F32(s)).collect();
        for b in 0..=255u8 {
            tokens.push(Value::String(format!("<0x{b:02X}>")));
            types.push(Value::I32(6));
            scores.push(Value::F32(0.0));
        }
        let mut md = HashMap::new();
        md.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
        md.insert("tokenizer.ggml.tokens".into(), Value::Array(tokens));
        md.insert("tokenizer.ggml.token_type".into(), Value::Array(types));
        md.insert("tokenizer.ggml.scores".into(), Value::Array(scores));
        md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(2));
        md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(1));
        md.insert("tokenizer.ggml.unknown_token_id".into(), Value::U32(3));
        md.insert("tokenizer.ggml.padding_token_id".into(), Value::U32(0));
        if let Some(prefix) = add_space_prefix {
            md.insert(
                "tokenizer.ggml.add_space_prefix".into(),
                Value::Bool(prefix),
            );
        }
        md
    }

    #[test]
    fn spm_merges_are_every_split_ranked_by_the_merged_tokens_score() {
        let md = spm_metadata(None);
        let vocab = GgufVocab::read(&md).unwrap();
        let scores = read_scores(&md, vocab.len()).unwrap();
        let merges = merges_by_score(&vocab, &scores, &vocab.to_map().unwrap());
        // bc (-1), ▁a (-2), ▁ab (-3, split after "▁" then after "▁a"), ab (-5); no merge
        // forms the control, user-defined or byte tokens (their pieces are not tokens).
        let want = [
            ("b", "c"),
            ("\u{2581}", "a"),
            ("\u{2581}", "ab"),
            ("\u{2581}a", "b"),
            ("a", "b"),
        ];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        assert_eq!(merges, want);
    }

    #[test]
    fn spm_encodes_by_hand_derived_ids() {
        let (plain, _) = tokenizer_from_metadata(&spm_metadata(Some(false))).unwrap();
        let (prefixed, _) = tokenizer_from_metadata(&spm_metadata(None)).unwrap();
        let [e_hi, e_lo] = [SPM_BYTE0 + 0xC3, SPM_BYTE0 + 0xA9]; // "é" = C3 A9
                                                                 // (input, ids without the space prefix, ids with it), following llama.cpp's SPM
                                                                 // loop by hand: spaces become ▁; the adjacent pair whose merge scores highest merges
                                                                 // first; a character outside the vocabulary becomes its UTF-8 byte tokens.
        let rows: &[(&str, &[u32], &[u32])] = &[
            // "ab" (-5) merges; with the prefix "▁a" (-2) beats "ab", then "▁a"+"b" = "▁ab".
            ("ab", &[11], &[14]),
            // "bc" (-1) beats "ab" (-5): a + bc, although "ab" has the smaller id.
            ("abc", &[8, 12], &[13, 12]),
            ("bab", &[9, 11], &[7, 9, 11]),
            // "a▁" and "▁b" are not tokens.
            ("a b", &[8, 7, 9], &[13, 7, 9]),
            (" ab", &[14], &[7, 14]),
            // byte fallback
            ("\u{e9}", &[e_hi, e_lo], &[7, e_hi, e_lo]),
            ("a\u{e9} b", &[8, e_hi, e_lo, 7, 9], &[13, e_hi, e_lo, 7, 9]),
            // control and user-defined tokens are cut out first; llama.cpp gives every
            // fragment after one the space prefix too.
            ("<start_of_turn>ab<end_of_turn>", &[4, 11, 5], &[4, 14, 5]),
            ("ab\nab", &[11, 6, 11], &[14, 6, 14]),
            ("", &[], &[]),
        ];
        for (text, want_plain, want_prefixed) in rows {
            assert_eq!(encode(&plain, text), *want_plain, "no prefix {text:?}");
            assert_eq!(encode(&prefixed, text), *want_prefixed, "prefix {text:?}");
        }
    }

    #[test]
    fn spm_decode_inverts_encode() {
        let (plain, _) = tokenizer_from_metadata(&spm_metadata(Some(false))).unwrap();
        let (prefixed, _) = tokenizer_from_metadata(&spm_metadata(Some(true))).unwrap();
        for text in ["ab", " ab", "abc a b", "a\u{e9} b", "  "] {
            assert_eq!(plain.decode(&encode(&plain, text), false).unwrap(), text);
            // The prefix space is stripped again from the first piece.
            assert_eq!(
                prefixed.decode(&encode(&prefixed, text), false).unwrap(),
                text
            );
        }
        assert_eq!(
            plain.decode(&encode(&plain, "ab\nab"), false).unwrap(),
            "ab\nab"
        );
        // The prefix given to the fragment after a user-defined token stays (as in
        // llama.cpp, whose detokenizer strips only the first piece's space).
        let ids = encode(&prefixed, "ab\nab");
        assert_eq!(ids, [14, 6, 14]);
        assert_eq!(prefixed.decode(&ids, false).unwrap(), "ab\n ab");
        let ids = encode(&plain, "<start_of_turn>ab<end_of_turn>");
        assert_eq!(
            plain.decode(&ids, false).unwrap(),
            "<start_of_turn>ab<end_of_turn>"
        );
        assert_eq!(plain.decode(&ids, true).unwrap(), "ab");
        // A lone byte token of an incomplete character decodes to U+FFFD.
        assert_eq!(
            plain.decode(&[SPM_BYTE0 + 0xC3], false).unwrap(),
            "\u{fffd}"
        );
    }

    #[test]
    fn spm_special_tokens_and_bos() {
        let (tok, sp) = tokenizer_from_metadata(&spm_metadata(None)).unwrap();
        // No tokenizer.ggml.add_bos_token: llama's default is true.
        assert_eq!(
            sp,
            SpecialTokens {
                bos: Some(2),
                eos: Some(1),
                pad: Some(0),
                stop: vec![1, 5],
                add_bos: true,
            }
        );
        assert_eq!(tok.encode("ab", true).unwrap().get_ids(), &[2, 14]);
        assert_eq!(tok.encode("ab", false).unwrap().get_ids(), &[14]);
    }

    #[test]
    fn spm_bad_metadata_is_an_error_not_a_panic() {
        type Edit = fn(&mut HashMap<String, Value>);
        fn scores(n: usize) -> Value {
            Value::Array(vec![Value::F32(0.0); n])
        }
        let n = SPM_TOKENS.len() + 256;
        let cases: &[(&str, Edit)] = &[
            ("no scores", |md| {
                md.remove("tokenizer.ggml.scores");
            }),
            ("scores shorter than tokens", |md| {
                let n = SPM_TOKENS.len() + 255;
                md.insert("tokenizer.ggml.scores".into(), scores(n));
            }),
            ("scores longer than tokens", |md| {
                let n = SPM_TOKENS.len() + 257;
                md.insert("tokenizer.ggml.scores".into(), scores(n));
            }),
            ("scores not an array", |md| {
                md.insert("tokenizer.ggml.scores".into(), Value::F32(1.0));
            }),
            ("score not a number", |md| {
                let mut v = vec![Value::F32(0.0); SPM_TOKENS.len() + 256];
                v[3] = Value::String("x".into());
                md.insert("tokenizer.ggml.scores".into(), Value::Array(v));
            }),
            ("score NaN", |md| {
                let mut v = vec![Value::F32(0.0); SPM_TOKENS.len() + 256];
                v[8] = Value::F32(f32::NAN);
                md.insert("tokenizer.ggml.scores".into(), Value::Array(v));
            }),
            ("add_space_prefix not a boolean", |md| {
                md.insert(
                    "tokenizer.ggml.add_space_prefix".into(),
                    Value::String("yes".into()),
                );
            }),
            ("unknown token out of range", |md| {
                md.insert(
                    "tokenizer.ggml.unknown_token_id".into(),
                    Value::U32(1 << 20),
                );
            }),
            ("token types shorter than tokens", |md| {
                md.insert(
                    "tokenizer.ggml.token_type".into(),
                    Value::Array(vec![Value::I32(1); 3]),
                );
            }),
            ("duplicate token", |md| {
                let mut t = md["tokenizer.ggml.tokens"].to_vec().unwrap().clone();
                t[9] = Value::String("a".into());
                md.insert("tokenizer.ggml.tokens".into(), Value::Array(t));
            }),
        ];
        assert_eq!(read_scores(&spm_metadata(None), n).unwrap().len(), n);
        for (name, edit) in cases {
            let mut md = spm_metadata(None);
            edit(&mut md);
            match tokenizer_from_metadata(&md) {
                Err(Error::Tokenizer(_) | Error::Metadata { .. }) => {}
                Err(e) => panic!("{name}: unexpected error kind {e}"),
                Ok(_) => panic!("{name}: accepted bad metadata"),
            }
        }
    }

    #[test]
    fn comparison_lists_are_consistent() {
        assert!(COMPARISON_STRINGS.len() >= 24);
        for s in MISTRALRS_DIFFERS {
            assert!(
                COMPARISON_STRINGS.contains(s),
                "{s:?} not in COMPARISON_STRINGS"
            );
        }
        let mut sorted = COMPARISON_STRINGS.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            COMPARISON_STRINGS.len(),
            "duplicate comparison strings"
        );
    }
}
