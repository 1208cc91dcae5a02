//! The GenerateRequest the lane sends a decode worker, spliced from the PrefillRequest's
//! JSON text (codec.encode's bytes, router/fast_lane.py): its id, prompt, sampling, salt
//! and adapter are copied as text, never parsed into values (a prompt of n ids was n
//! number values to build and write again per request), and the handle, the first token
//! and the resumed tokens are written in at each call. Key order and spacing are the
//! codec's (tests/router/test_fast_lane.py compares the bytes with codec.encode).
use serde_json::value::RawValue;
use std::collections::HashMap;

#[derive(Default)]
pub struct Generate {
    head: String, // {"request_id":…,"prompt_token_ids":[…],"sampling":{…}
    salt: String,
    lora: String,
}

impl Generate {
    /// From a PrefillRequest (or a GenerateRequest: the same fields) as the codec wrote it.
    pub fn of(request: &[u8]) -> Result<Self, String> {
        let m: HashMap<&str, &RawValue> = serde_json::from_slice(request).map_err(|e| e.to_string())?;
        let get = |k: &str| m.get(k).map(|r| r.get()).unwrap_or("null");
        Ok(Generate {
            head: format!(
                "{{\"request_id\":{},\"prompt_token_ids\":{},\"sampling\":{}",
                get("request_id"),
                get("prompt_token_ids"),
                get("sampling")
            ),
            salt: get("cache_salt").to_string(),
            lora: get("lora").to_string(),
        })
    }

    /// The body: `handle`, `first` and `resume` as JSON text ("null" when there is none).
    pub fn body(&self, handle: &str, first: &str, resume: &str) -> Vec<u8> {
        let mut out = String::with_capacity(self.head.len() + handle.len() + resume.len() + 160);
        out.push_str(&self.head);
        for (k, v) in [
            ("kv_handle", handle),
            ("first_token_id", first),
            ("cache_salt", &self.salt),
            ("resume_token_ids", resume),
            ("lora", &self.lora),
            ("prefill", "null"),
            ("type", "\"generate_request\""),
        ] {
            out.push_str(",\"");
            out.push_str(k);
            out.push_str("\":");
            out.push_str(v);
        }
        out.push('}');
        out.into_bytes()
    }
}
