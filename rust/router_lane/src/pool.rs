//! Keep-alive HTTP/1.1 connections to the workers and to the Python server behind the lane
//! (hyper's client connections, one request at a time each, reused once a reply was read
//! to its end; anything else drops the connection).
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Body;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::sync::Mutex;
use tokio::net::TcpStream;

pub type Sender = SendRequest<Full<Bytes>>;

pub struct Pool<B = Full<Bytes>> {
    idle: Mutex<HashMap<String, Vec<SendRequest<B>>>>,
}

impl<B> Default for Pool<B> {
    fn default() -> Self {
        Pool { idle: Mutex::new(HashMap::new()) }
    }
}

impl<B> Pool<B>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    pub async fn get(&self, authority: &str) -> Result<SendRequest<B>, String> {
        loop {
            let cached = self.idle.lock().unwrap().get_mut(authority).and_then(|v| v.pop());
            match cached {
                Some(s) if !s.is_closed() && s.is_ready() => return Ok(s),
                Some(_) => continue,
                None => break,
            }
        }
        let stream = TcpStream::connect(authority).await.map_err(|e| format!("connect: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    pub fn put(&self, authority: &str, sender: SendRequest<B>) {
        if sender.is_closed() {
            return;
        }
        self.idle.lock().unwrap().entry(authority.to_string()).or_default().push(sender);
    }
}

/// (authority "host:port", path prefix) of an http:// worker URL; None for anything else.
pub fn split_url(url: &str) -> Option<(String, String)> {
    let rest = url.strip_prefix("http://")?;
    let (auth, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    Some((auth.to_string(), path.trim_end_matches('/').to_string()))
}
