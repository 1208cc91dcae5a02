//! The signed worker calls of pdserve/signing.py, byte for byte: `X-PDServe-Auth: v2 <time>
//! <nonce> <hex tag>`, the tag an HMAC-SHA256 (keys.mac_after) over the framed
//! ("v2", method, target) head and the framed (host, time, nonce, sha256(body)) parts; a
//! reply counts only with `X-PDServe-Proof` = the HMAC of ("reply",) + (auth,) under a key.
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

fn framed(out: &mut Vec<u8>, part: &[u8]) {
    out.extend_from_slice(&(part.len() as u64).to_be_bytes());
    out.extend_from_slice(part);
}

/// keys.mac_after(key, head, *parts): HMAC over the framed head, then the framed parts.
pub fn mac_after(key: &[u8], head: &[&[u8]], parts: &[&[u8]]) -> [u8; 32] {
    let mut msg = Vec::with_capacity(128);
    for p in head {
        framed(&mut msg, p);
    }
    for p in parts {
        framed(&mut msg, p);
    }
    let mut mac = HmacSha256::new_from_slice(key).expect("any key length");
    mac.update(&msg);
    mac.finalize().into_bytes().into()
}

pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// signing.sign(ring, method, target, body, now, host) with the nonce given (12 bytes).
pub fn sign_with(
    key: &[u8],
    method: &str,
    target: &str,
    body: &[u8],
    now: f64,
    host: &str,
    nonce: &[u8; 12],
) -> String {
    let ts = format!("{:.3}", now);
    let nonce = hex(nonce);
    let sha: [u8; 32] = Sha256::digest(body).into();
    let tag = mac_after(
        key,
        &[b"v2", method.as_bytes(), target.as_bytes()],
        &[host.as_bytes(), ts.as_bytes(), nonce.as_bytes(), &sha],
    );
    format!("v2 {} {} {}", ts, nonce, hex(&tag))
}

pub fn sign(key: &[u8], method: &str, target: &str, body: &[u8], host: &str) -> String {
    let mut nonce = [0u8; 12];
    getrandom::getrandom(&mut nonce).expect("getrandom");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    sign_with(key, method, target, body, now, host, &nonce)
}

/// signing.proof_ok: true without keys (an unauthenticated local deployment).
pub fn proof_ok(keys: &[Vec<u8>], auth: &str, given: Option<&[u8]>) -> bool {
    if keys.is_empty() {
        return true;
    }
    let Some(given) = given else { return false };
    if given.len() != 64 {
        return false;
    }
    let Ok(given) = std::str::from_utf8(given) else { return false };
    let given = given.to_ascii_lowercase();
    keys.iter().any(|k| {
        let tag = mac_after(k, &[b"reply"], &[auth.as_bytes()]);
        hex(&tag) == given
    })
}
