//! The reply's bytes as the Python lane writes them (router/api/openai_response.py):
//! TextChunks' SSE lines (json's ensure_ascii escaping), the usage chunk, [DONE], and the
//! whole reply as Starlette's JSONResponse renders it (compact, UTF-8 as is).

/// json.encoder.encode_basestring_ascii: `"` and `\\` escaped, the usual short escapes,
/// every other character outside ' '..='~' as \uXXXX (surrogate pairs past the BMP).
pub fn ascii_string(out: &mut String, s: &str) {
    json_string(out, s, true)
}

/// json.dumps(s, ensure_ascii=False) of a string (JSONResponse's rendering).
pub fn utf8_string(out: &mut String, s: &str) {
    json_string(out, s, false)
}

/// Both renderings: the same short escapes; `ascii` escapes everything outside
/// ' '..='~' (as UTF-16 units), otherwise only the other control characters.
fn json_string(out: &mut String, s: &str, ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ if ascii => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{:04x}", u));
                }
            }
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            _ => out.push(c),
        }
    }
    out.push('"');
}

pub fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// One stream's chunks: the id and model encoded once.
pub struct Chunks {
    head: String,
    mid: String,
}

impl Chunks {
    pub fn new(rid: &str, model: &str) -> Self {
        let mut head = String::from("data: {\"id\":");
        ascii_string(&mut head, rid);
        head.push_str(",\"object\":\"text_completion\",\"created\":");
        let mut mid = String::from(",\"model\":");
        ascii_string(&mut mid, model);
        mid.push_str(",\"choices\":[{\"index\":0,\"text\":");
        Chunks { head, mid }
    }

    pub fn text(&self, out: &mut String, text: &str, finish: Option<&str>) {
        out.push_str(&self.head);
        out.push_str(&now_s().to_string());
        out.push_str(&self.mid);
        ascii_string(out, text);
        out.push_str(",\"logprobs\":null,\"finish_reason\":");
        match finish {
            Some(f) => ascii_string(out, f),
            None => out.push_str("null"),
        }
        out.push_str("}]}\n\n");
    }

    /// The usage chunk (stream_options.include_usage): choices empty, then usage.
    pub fn usage(&self, out: &mut String, prompt: u64, completion: u64, cached: u64) {
        out.push_str(&self.head);
        out.push_str(&now_s().to_string());
        // self.mid ends with the choice's opening: the usage chunk has no choice
        let model_part = self.mid.split(",\"choices\":").next().unwrap_or("");
        out.push_str(model_part);
        out.push_str(",\"choices\":[],\"usage\":");
        usage_json(out, prompt, completion, cached);
        out.push_str("}\n\n");
    }
}

pub fn usage_json(out: &mut String, prompt: u64, completion: u64, cached: u64) {
    out.push_str(&format!(
        "{{\"prompt_tokens\":{},\"completion_tokens\":{},\"total_tokens\":{},\"prompt_tokens_details\":{{\"cached_tokens\":{}}}}}",
        prompt,
        completion,
        prompt + completion,
        cached
    ));
}

pub const DONE: &str = "data: [DONE]\n\n";

/// openai_response.full_response of one completion choice, as JSONResponse renders it.
pub fn whole(
    rid: &str,
    model: &str,
    text: &str,
    finish: Option<&str>,
    prompt: u64,
    completion: u64,
    cached: u64,
) -> String {
    let mut out = String::from("{\"id\":");
    utf8_string(&mut out, rid);
    out.push_str(",\"object\":\"text_completion\",\"created\":");
    out.push_str(&now_s().to_string());
    out.push_str(",\"model\":");
    utf8_string(&mut out, model);
    out.push_str(",\"choices\":[{\"index\":0,\"text\":");
    utf8_string(&mut out, text);
    out.push_str(",\"logprobs\":null,\"finish_reason\":");
    match finish {
        Some(f) => utf8_string(&mut out, f),
        None => out.push_str("null"),
    }
    out.push_str("}],\"usage\":");
    usage_json(&mut out, prompt, completion, cached);
    out.push('}');
    out
}
