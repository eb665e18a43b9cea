//! Chat templates from GGUF metadata.
//!
//! A chat model ships its prompt format as a Jinja template under `tokenizer.chat_template`
//! (Hugging Face's `chat_template`). [`ChatTemplate`] renders it with minijinja configured
//! the way `transformers` configures Jinja2 for chat templates: `trim_blocks` and
//! `lstrip_blocks` on, loop controls (`{% break %}`, `{% continue %}`) enabled, Python
//! string and dict methods (`.strip()`, `.startswith()`, `.items()`, ...) through
//! minijinja-contrib's `pycompat`, a `raise_exception(message)` function that fails the
//! render with that message, and a `tojson` filter that writes JSON as Python's
//! `json.dumps` does (`", "` and `": "` separators, optional `indent`, non-ASCII kept).
//! The context holds `messages`, `add_generation_prompt`, `bos_token` and `eos_token`.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{Content, Value};
use minijinja::value::Kwargs;
use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::model::text::tokenizer::special_token_text;
use crate::{Error, Result};

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who speaks: `system`, `user` or `assistant` (templates may know others).
    pub role: String,
    /// What they say.
    pub content: String,
}

impl ChatMessage {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// The name under which the template is stored in its environment.
const TEMPLATE_NAME: &str = "chat_template";

/// Jinja chat template from `tokenizer.chat_template`, rendered with minijinja.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos: Option<String>,
    eos: Option<String>,
}

impl ChatTemplate {
    /// The template in `tokenizer.chat_template`, with `bos_token` / `eos_token` the texts of
    /// the tokens `tokenizer.ggml.bos_token_id` / `eos_token_id`; `Ok(None)` when the file
    /// has no template. Errors: [`Error::Metadata`] when a key has the wrong type or an id is
    /// out of the vocabulary, [`Error::ChatTemplate`] when the template does not parse.
    pub fn from_gguf(content: &Content) -> Result<Option<Self>> {
        Self::from_metadata(&content.metadata)
    }

    fn from_metadata(md: &HashMap<String, Value>) -> Result<Option<Self>> {
        let key = "tokenizer.chat_template";
        let Some(value) = md.get(key) else {
            return Ok(None);
        };
        let source = value.to_string().map_err(|_| Error::Metadata {
            key: key.into(),
            reason: format!("expected a string, found {:?}", value.value_type()),
        })?;
        let bos = special_token_text(md, "tokenizer.ggml.bos_token_id")?;
        let eos = special_token_text(md, "tokenizer.ggml.eos_token_id")?;
        Self::new(source, bos, eos).map(Some)
    }

    /// Parse a template; `bos` / `eos` fill `bos_token` / `eos_token` (the empty string
    /// when `None`). Errors: [`Error::ChatTemplate`] with minijinja's message and line.
    pub fn new(source: &str, bos: Option<String>, eos: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(template_err)?;
        Ok(Self {
            env,
            source: source.to_owned(),
            bos,
            eos,
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Render a conversation; with `add_generation_prompt` the result ends with the
    /// markup that opens the assistant's turn. Errors: [`Error::ChatTemplate`] (including
    /// the template's own `raise_exception` messages).
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self.env.get_template(TEMPLATE_NAME).map_err(template_err)?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos.as_deref().unwrap_or(""),
                eos_token => self.eos.as_deref().unwrap_or(""),
            })
            .map_err(template_err)
    }
}

fn template_err(e: minijinja::Error) -> Error {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(inner) = source {
        msg.push_str(": ");
        msg.push_str(&inner.to_string());
        source = inner.source();
    }
    Error::ChatTemplate(msg)
}

/// `raise_exception(message)`: what Hugging Face templates call to reject a conversation.
fn raise_exception(message: String) -> std::result::Result<minijinja::Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `value | tojson(indent=None)` with Python `json.dumps` formatting (as `transformers`
/// uses): `", "` / `": "` separators when compact, `","` / `": "` with `indent`; no HTML
/// escaping, non-ASCII characters written as they are.
fn tojson(
    value: minijinja::Value,
    kwargs: Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let result = match indent {
        Some(n) => {
            let spaces = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&spaces);
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, fmt))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonCompact,
        )),
    };
    result.map_err(|e| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "tojson failed").with_source(e)
    })?;
    let text = String::from_utf8(out).map_err(|e| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "tojson failed").with_source(e)
    })?;
    Ok(minijinja::Value::from_safe_string(text))
}

/// serde_json formatter writing `json.dumps`'s default separators, `", "` and `": "`.
struct PythonCompact;

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's `tokenizer.chat_template`, verbatim from the GGUF file.
    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn smollm2() -> ChatTemplate {
        ChatTemplate::new(
            SMOLLM2_TEMPLATE,
            Some("<|im_start|>".into()),
            Some("<|im_end|>".into()),
        )
        .unwrap()
    }

    #[test]
    fn smollm2_chatml_rows() {
        let t = smollm2();
        let default_system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";
        // (messages, add_generation_prompt, expected)
        let rows: Vec<(Vec<ChatMessage>, bool, String)> = vec![
            (
                vec![
                    ChatMessage::system("You are terse."),
                    ChatMessage::user("What is 2+2?"),
                ],
                true,
                "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n".into(),
            ),
            (
                vec![
                    ChatMessage::system("You are terse."),
                    ChatMessage::user("What is 2+2?"),
                ],
                false,
                "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n".into(),
            ),
            (
                vec![ChatMessage::user("Hi")],
                true,
                format!("{default_system}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
            ),
            (
                vec![
                    ChatMessage::user("Hi"),
                    ChatMessage::assistant("Hello!"),
                    ChatMessage::user("Bye"),
                ],
                false,
                format!("{default_system}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"),
            ),
            (vec![], true, "<|im_start|>assistant\n".into()),
        ];
        for (messages, gen, want) in rows {
            assert_eq!(
                t.render(&messages, gen).unwrap(),
                want,
                "{messages:?} {gen}"
            );
        }
    }

    #[test]
    fn hf_template_features() {
        // (template, expected output for one system + one user message)
        let rows: &[(&str, &str)] = &[
            // bos/eos tokens and loop variables
            (
                "{{ bos_token }}{% for m in messages %}{{ loop.index0 }}:{{ m.role }}{% if not loop.last %},{% endif %}{% endfor %}{{ eos_token }}",
                "<s>0:system,1:user</s>",
            ),
            // Python string methods (pycompat)
            (
                "{% for m in messages %}[{{ m.content.strip().upper() }}]{% if m.role.startswith('sys') %}S{% endif %}{% endfor %}",
                "[BE BRIEF.]S[HI THERE]",
            ),
            // trim_blocks + lstrip_blocks: block tags leave no whitespace behind
            (
                "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}",
                "  hi there  \n",
            ),
            // loop controls
            (
                "{% for m in messages %}{% if m.role == 'user' %}{% break %}{% endif %}{{ m.role }}{% endfor %}",
                "system",
            ),
            // namespace, slicing, filters
            (
                "{% set ns = namespace(n=0) %}{% for m in messages[1:] %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ messages | length }}|{{ messages[0].content | trim }}",
                "1|2|Be brief.",
            ),
            // tojson with Python separators, no HTML escaping
            (
                "{{ messages[0] | tojson }}",
                "{\"role\": \"system\", \"content\": \" Be brief. \"}",
            ),
            (
                "{{ {'a': [1, 'é<'] } | tojson(indent=2) }}",
                "{\n  \"a\": [\n    1,\n    \"é<\"\n  ]\n}",
            ),
        ];
        let messages = [
            ChatMessage::system(" Be brief. "),
            ChatMessage::user("  hi there  "),
        ];
        for (source, want) in rows {
            let t = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into())).unwrap();
            assert_eq!(t.render(&messages, false).unwrap(), *want, "{source}");
        }
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok",
            None,
            None,
        )
        .unwrap();
        assert_eq!(t.render(&[ChatMessage::user("x")], false).unwrap(), "ok");
        match t.render(&[ChatMessage::assistant("x")], false) {
            Err(Error::ChatTemplate(msg)) => {
                assert!(msg.contains("Conversation must start with user"), "{msg}")
            }
            other => panic!("expected a chat template error, got {other:?}"),
        }
    }

    #[test]
    fn bad_templates_are_errors() {
        for source in ["{% for m in messages %}", "{{ messages[0] ", "{% endif %}"] {
            assert!(
                matches!(
                    ChatTemplate::new(source, None, None),
                    Err(Error::ChatTemplate(_))
                ),
                "{source}"
            );
        }
        // Parses, fails at render time: an unknown filter on a real value.
        let t = ChatTemplate::new("{{ messages | nosuchfilter }}", None, None);
        match t {
            Err(Error::ChatTemplate(_)) => {}
            Ok(t) => assert!(matches!(t.render(&[], false), Err(Error::ChatTemplate(_)))),
            Err(e) => panic!("unexpected error {e}"),
        }
    }

    #[test]
    fn missing_bos_eos_render_empty() {
        let t = ChatTemplate::new("[{{ bos_token }}|{{ eos_token }}]", None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "[|]");
    }

    #[test]
    fn from_metadata_reads_template_and_token_texts() {
        let mut md = HashMap::new();
        md.insert(
            "tokenizer.ggml.tokens".to_string(),
            Value::Array(
                ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
                    .iter()
                    .map(|s| Value::String(s.to_string()))
                    .collect(),
            ),
        );
        assert!(ChatTemplate::from_metadata(&md).unwrap().is_none());
        md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
        md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
        md.insert(
            "tokenizer.chat_template".into(),
            Value::String("{{ bos_token }}{{ eos_token }}".into()),
        );
        let t = ChatTemplate::from_metadata(&md).unwrap().unwrap();
        assert_eq!(t.render(&[], true).unwrap(), "<|im_start|><|im_end|>");
        assert_eq!(t.source(), "{{ bos_token }}{{ eos_token }}");

        md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(7));
        assert!(matches!(
            ChatTemplate::from_metadata(&md),
            Err(Error::Metadata { .. })
        ));
        md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
        md.insert("tokenizer.chat_template".into(), Value::U32(1));
        assert!(matches!(
            ChatTemplate::from_metadata(&md),
            Err(Error::Metadata { .. })
        ));
    }

    #[test]
    fn chat_message_serde_round_trip() {
        let m = ChatMessage::user("hi \"there\"\n");
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(json, r#"{"role":"user","content":"hi \"there\"\n"}"#);
        assert_eq!(serde_json::from_str::<ChatMessage>(&json).unwrap(), m);
    }
}
