//! Text prompts tokenized on the lane's thread (issue 47): the Python router's tokenizer,
//! handed over as its own JSON (`backend_tokenizer.to_str()`: the state transformers left
//! it in, added tokens and post-processor included), loaded into the library the Python
//! `tokenizers` binding wraps, so the ids are the ones `PromptTokenizer.encode` gives
//! (tests/router/test_lane_tokenize.py compares them on many strings). The Python side
//! still parses and checks the body, and uses these ids only when its own prompt text is
//! the text tokenized here and its encode would take the same path (router/fast_lane.py);
//! anything else it tokenizes itself, as before.
use serde_json::value::RawValue;
use std::collections::HashMap;
use tokenizers::Tokenizer;

pub struct Tok {
    inner: Tokenizer,
    max_chars: usize, // serving.INLINE_TEXT_CHARS: a longer prompt is the Python lane's
}

/// A body's text prompt and its ids.
pub struct Prompt {
    pub text: String,
    pub ids: Vec<u32>,
}

impl Tok {
    pub fn from_json(json: &str, max_chars: usize) -> Result<Self, String> {
        let inner: Tokenizer = json.parse().map_err(|e: tokenizers::Error| e.to_string())?;
        Ok(Tok { inner, max_chars })
    }

    /// `encode_batch_fast([text], add_special_tokens)[0].ids`, as the Python router calls it.
    pub fn ids(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        let enc = self.inner.encode_fast(text, add_special_tokens).map_err(|e| e.to_string())?;
        Ok(enc.get_ids().to_vec())
    }

    /// The body's `prompt` when it is a string the Python side tokenizes inline (a JSON
    /// object, at most `max_chars` characters), with its ids; None for any other body.
    pub fn prompt(&self, body: &[u8]) -> Option<Prompt> {
        // the fields as raw text (token ids are not parsed into values); of duplicate keys
        // the last counts, as in Python's json
        let fields: HashMap<String, &RawValue> = serde_json::from_slice(body).ok()?;
        let raw = fields.get("prompt")?.get();
        if !raw.starts_with('"') {
            return None;
        }
        let text: String = serde_json::from_str(raw).ok()?;
        if text.chars().count() > self.max_chars {
            return None;
        }
        let ids = self.ids(&text, true).ok()?;
        Some(Prompt { text, ids })
    }
}
