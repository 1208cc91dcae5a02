//! The lane: an HTTP/1.1 server on the router's public socket. POST /v1/completions goes to
//! Python once (`begin`: the gate, admission, parse, the plan, the two worker bodies) and
//! is then served here: the signed prefill call, the generate call, the SSE relay, retries
//! on the next worker and migration mid-stream. Every other request, and a completion
//! the Python side declines, is passed to the Python server behind (loopback) as it came.
use crate::pool::{split_url, Pool};
use crate::sign;
use crate::sse;
use crate::tokenize::Prompt;
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use serde_json::Value;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

pub type Body = BoxBody<Bytes, hyper::Error>;

/// What Python answered for one request.
pub enum Begin {
    Fallback,
    Error(u16, Bytes, Vec<(String, String)>),
    Go(Box<Plan>),
}

pub struct Plan {
    pub token: u64, // the request's entry on the Python side (ticket, tracking)
    pub rid: String,
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
    pub prefill: Vec<String>,
    pub decode: Vec<String>,
    pub prefill_body: Bytes,
    pub generate: crate::generate::Generate, // the GenerateRequest, spliced per call
    pub n_prompt: u64,
    pub timeout: Duration,
    pub err_midstream: Bytes, // the 502 body once a decode token was sent
    pub err_no_worker: Bytes, // the 503 body
}

/// Jobs for the Python side (lib.rs turns them into tuples).
pub enum Job {
    // prompt: a text prompt tokenized here (tokenize.rs), its ids offered to Python
    Begin { id: u64, body: Bytes, headers: Vec<(Bytes, Bytes)>, peer: SocketAddr, prompt: Option<Prompt> },
    First { token: u64, ttft: f64 },
    Failed { token: u64, url: String, role: &'static str, down: bool, reason: String },
    // tokens: the call's prompt tokens counted in flight on its worker (prefill; decode: 0)
    Track { url: String, role: &'static str, step: i8, tokens: u64 },
    // a batch's tracks of one worker call site summed (lib.rs `netted`): Python reads these
    Net { url: String, role: &'static str, step: i64, tokens: i64 },
    Migrated { token: u64 },
    Counted { status: u16 },
    SlowReader { token: u64, waited: f64 },
    Stalled { token: u64, url: String, role: &'static str, quiet: f64 },
    AwaitDecode { id: u64, token: u64, rid: String, touched: Vec<String> },
    End(End),
}

pub struct End {
    pub token: u64,
    pub status: u16,
    pub completion: u64,
    pub e2e: f64,
    pub tpot: Option<f64>,
}

pub trait Host: Send + Sync + 'static {
    fn push(&self, job: Job);
    fn begin(&self, body: Bytes, headers: Vec<(Bytes, Bytes)>, peer: SocketAddr, prompt: Option<Prompt>) -> oneshot::Receiver<Begin>;
    /// Every decode candidate failed: the decode workers ready within failover_wait_s
    /// (Dispatcher._await_decode; those this request touched were told to drop it).
    fn await_decode(&self, token: u64, rid: String, touched: Vec<String>) -> oneshot::Receiver<Vec<String>>;
}

/// Workers whose last health check failed, and the stall limit (Dispatcher.cut_stalled):
/// a call quiet for `stall` on such a worker is cut.
pub struct Health {
    pub failing: std::sync::RwLock<std::collections::HashSet<String>>,
    pub stall: std::sync::Mutex<Duration>,
}

pub struct Lane {
    pub host: Arc<dyn Host>,
    pub keys: Vec<Vec<u8>>,
    pub backend: String,
    pub peer_token: String,
    pub workers: Pool,
    pub python: Pool<ProxyBody>,
    pub health: Health,
    pub inline_body: usize,     // bodies up to this are read here (serving.INLINE_BODY_BYTES)
    pub body_timeout: Duration, // --body-timeout
    pub err_408: Bytes,         // its error, as the Python lane words it
    pub write_timeout: Duration, // --stream-write-timeout
    pub itl: std::sync::Mutex<crate::hist::Hist>, // inter-token latencies, folded on scrape
    pub tok: Option<crate::tokenize::Tok>, // the router's tokenizer, when it can be had here
}

pub type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// The Python server's reply body; its connection goes back to the pool at the end.
struct Pooled {
    inner: Incoming,
    sender: Option<hyper::client::conn::http1::SendRequest<ProxyBody>>,
    lane: Arc<Lane>,
}

impl hyper::body::Body for Pooled {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if let std::task::Poll::Ready(None) = polled {
            if let Some(s) = self.sender.take() {
                self.lane.python.put(&self.lane.backend, s);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

impl Lane {
    fn failing(&self, url: &str) -> bool {
        self.health.failing.read().unwrap().contains(url)
    }
}

/// `fut`, cut when it waits `request_timeout` or, on a worker that fails its health
/// check, the stall limit (StreamWatch + Dispatcher.cut_stalled).
async fn watched<F: std::future::Future>(
    lane: &Lane,
    url: &str,
    role: &'static str,
    token: u64,
    timeout: Duration,
    fut: F,
) -> Result<F::Output, Failed> {
    let start = Instant::now();
    let mut fut = std::pin::pin!(fut);
    loop {
        let stall = *lane.health.stall.lock().unwrap();
        let tick = (stall / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        match tokio::time::timeout(tick, &mut fut).await {
            Ok(v) => return Ok(v),
            Err(_) => {
                let quiet = start.elapsed();
                if quiet >= stall && lane.failing(url) {
                    lane.host.push(Job::Stalled { token, url: url.to_string(), role, quiet: quiet.as_secs_f64() });
                    return Err(Failed::Worker(format!("stream cut: no bytes for {:.1}s and its health check fails", quiet.as_secs_f64()), true));
                }
                if quiet >= timeout {
                    return Err(Failed::Worker("timed out".into(), true));
                }
            }
        }
    }
}

fn full(status: u16, ctype: &'static str, body: Bytes) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", ctype)
        .header("content-length", body.len())
        .body(Full::new(body).map_err(|n| match n {}).boxed())
        .unwrap()
}

pub async fn handle(lane: Arc<Lane>, req: Request<Incoming>, peer: SocketAddr) -> Result<Response<Body>, Infallible> {
    let hot = req.method() == hyper::Method::POST && req.uri().path() == "/v1/completions" && req.uri().query().is_none();
    let length = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let (parts, incoming) = req.into_parts();
    // A large or unsized body is the Python lane's (its limits, its off-loop parse)
    let Some(n) = length.filter(|n| hot && *n <= lane.inline_body) else {
        return Ok(proxy(&lane, parts, incoming.boxed(), peer).await);
    };
    let _ = n;
    let body = match tokio::time::timeout(lane.body_timeout, incoming.collect()).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(_)) => return Ok(full(400, "text/plain", Bytes::from_static(b"bad body"))),
        Err(_) => {
            // edge.read_body's 408: a client trickling its body holds nothing
            lane.host.push(Job::Counted { status: 408 });
            let mut r = full(408, "application/json", lane.err_408.clone());
            r.headers_mut().insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("close"));
            return Ok(r);
        }
    };
    let headers = parts
        .headers
        .iter()
        .map(|(k, v)| (Bytes::copy_from_slice(k.as_str().as_bytes()), Bytes::copy_from_slice(v.as_bytes())))
        .collect();
    let prompt = lane.tok.as_ref().and_then(|t| t.prompt(&body));
    match lane.host.begin(body.clone(), headers, peer, prompt).await {
        Ok(Begin::Go(plan)) => return Ok(serve(lane, *plan).await),
        Ok(Begin::Error(status, b, headers)) => {
            let mut r = full(status, "application/json", b);
            for (k, v) in headers {
                if k.eq_ignore_ascii_case("content-type") {
                    continue;
                }
                if let (Ok(k), Ok(v)) = (hyper::header::HeaderName::from_bytes(k.as_bytes()), hyper::header::HeaderValue::from_str(&v)) {
                    r.headers_mut().append(k, v);
                }
            }
            return Ok(r);
        }
        Ok(Begin::Fallback) | Err(_) => {}
    }
    let body = Full::new(body).map_err(|n| match n {}).boxed();
    Ok(proxy(&lane, parts, body, peer).await)
}

/// The request as it came, to the Python server behind, with the client's address (the
/// Python side believes it only with this process's token: router/fast_lane.py).
async fn proxy(lane: &Arc<Lane>, parts: hyper::http::request::Parts, body: ProxyBody, peer: SocketAddr) -> Response<Body> {
    let mut b = Request::builder().method(parts.method.clone()).uri(parts.uri.clone()).version(parts.version);
    for (k, v) in parts.headers.iter() {
        if k.as_str().starts_with("x-pdserve-lane-") {
            continue;
        }
        b = b.header(k, v);
    }
    b = b.header("x-pdserve-lane-peer", peer.to_string()).header("x-pdserve-lane-token", lane.peer_token.as_str());
    let Ok(out) = b.body(body) else {
        return full(400, "text/plain", Bytes::from_static(b"bad request"));
    };
    let mut sender = match lane.python.get(&lane.backend).await {
        Ok(s) => s,
        Err(e) => return full(502, "text/plain", Bytes::from(format!("router lane: {e}"))),
    };
    match sender.send_request(out).await {
        Ok(resp) => {
            let (p, inc) = resp.into_parts();
            let body = Pooled { inner: inc, sender: Some(sender), lane: lane.clone() };
            let sse = p.headers.get("content-type").is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
            let body = if sse { relay(lane.clone(), body) } else { body.boxed() };
            Response::from_parts(p, body)
        }
        Err(e) => full(502, "text/plain", Bytes::from(format!("router lane: {e}"))),
    }
}

/// A stream the Python server answers (a declined request), relayed under the lane's
/// --stream-write-timeout: a frame the client does not take within it cuts the relay,
/// which drops the Python server's connection (it aborts the request on its workers, as
/// for a client that goes) and counts the slow reader. Relayed straight, the hop's socket
/// buffers (MBs on loopback) would hold the Python server's writes from ever waiting.
fn relay(lane: Arc<Lane>, mut body: Pooled) -> Body {
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, hyper::Error>>(1);
    tokio::spawn(async move {
        let wait = lane.write_timeout;
        while let Some(frame) = body.frame().await {
            let failed = frame.is_err();
            match tokio::time::timeout(wait, tx.send(frame)).await {
                Ok(Ok(())) if !failed => {}
                Ok(_) => break, // the client went, or the Python server's stream failed
                Err(_) => {
                    lane.host.push(Job::SlowReader { token: 0, waited: wait.as_secs_f64() });
                    break;
                }
            }
        }
        // dropped here: a stream read to its end has put its connection back (Pooled)
    });
    StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed()
}

struct Call {
    sender: crate::pool::Sender,
    authority: String,
    resp: Response<Incoming>,
}

enum Failed {
    Worker(String, bool),       // reason, down
    Refused(u16, Bytes),        // a 4xx: the client hears it
}

async fn post(lane: &Lane, url: &str, path: &str, body: Bytes, timeout: Duration) -> Result<Call, Failed> {
    post_as(lane, url, path, body, timeout, "abort", 0).await
}

async fn post_as(lane: &Lane, url: &str, path: &str, body: Bytes, timeout: Duration, role: &'static str, token: u64) -> Result<Call, Failed> {
    let Some((authority, prefix)) = split_url(url) else {
        return Err(Failed::Worker(format!("not an http:// URL: {url}"), true));
    };
    let target = format!("{prefix}{path}");
    let auth = lane.keys.first().map(|k| sign::sign(k, "POST", &target, &body, &authority));
    let mut b = Request::builder()
        .method("POST")
        .uri(target.as_str())
        .header("host", authority.as_str())
        .header("content-type", "application/json");
    if let Some(a) = &auth {
        b = b.header("x-pdserve-auth", a.as_str());
    }
    let req = b.body(Full::new(body)).map_err(|e| Failed::Worker(e.to_string(), true))?;
    let fut = async {
        let mut sender = lane.workers.get(&authority).await?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        Ok::<_, String>((sender, resp))
    };
    let (sender, resp) = match watched(lane, url, role, token, timeout, fut).await? {
        Ok(x) => x,
        Err(e) => return Err(Failed::Worker(e, true)),
    };
    if let Some(a) = &auth {
        let given = resp.headers().get("x-pdserve-proof").map(|v| v.as_bytes());
        if !sign::proof_ok(&lane.keys, a, given) {
            return Err(Failed::Worker("the worker did not prove the service secret".into(), true));
        }
    }
    let status = resp.status().as_u16();
    if status != 200 {
        let body = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        if status >= 500 || status == 429 {
            return Err(Failed::Worker(format!("HTTP {status}"), true));
        }
        return Err(Failed::Refused(status, body));
    }
    Ok(Call { sender, authority, resp })
}

async fn read_all(lane: &Lane, call: Call, timeout: Duration) -> Result<Bytes, Failed> {
    read_all_as(lane, call, timeout, "abort", "", 0).await
}

async fn read_all_as(lane: &Lane, call: Call, timeout: Duration, role: &'static str, url: &str, token: u64) -> Result<Bytes, Failed> {
    let Call { sender, authority, resp } = call;
    match watched(lane, url, role, token, timeout, resp.into_body().collect()).await? {
        Ok(b) => {
            lane.workers.put(&authority, sender);
            Ok(b.to_bytes())
        }
        Err(e) => Err(Failed::Worker(format!("read: {e}"), true)),
    }
}

fn abort(lane: &Arc<Lane>, url: String, rid: String) {
    let lane = lane.clone();
    tokio::spawn(async move {
        let body = format!("{{\"request_id\":{},\"type\":\"request_ref\"}}", serde_json::to_string(&rid).unwrap());
        if let Ok(call) = post(&lane, &url, "/abort", Bytes::from(body), Duration::from_secs(5)).await {
            let _ = read_all(&lane, call, Duration::from_secs(5)).await;
        }
    });
}

/// One request's state while it runs here (RequestState's fields the lane needs).
struct Run {
    lane: Arc<Lane>,
    plan: Plan,
    start: Instant,
    first_at: Option<Instant>,
    last_at: Option<Instant>,
    itls: Vec<(f64, u64)>, // (latency, tokens sharing it)
    output: Vec<Value>, // every token id sent, as the worker wrote it
    completion: u64,
    cached: u64,
    remote_prefill: bool,
    migrations: u32,
    finish: Option<String>,
    touched: Vec<String>,
    open: Vec<(String, &'static str)>, // worker calls counted in flight now
    chunks: sse::Chunks,
    text: String, // the whole reply's text (not streamed)
    status: u16,
}

impl Run {
    fn token(&self) -> u64 {
        self.plan.token
    }

    fn track(&mut self, url: &str, role: &'static str, step: i8) {
        if step > 0 {
            self.open.push((url.to_string(), role));
        } else if let Some(i) = self.open.iter().position(|(u, r)| u == url && *r == role) {
            self.open.swap_remove(i);
        }
        let tokens = if role == "prefill" { self.plan.n_prompt } else { 0 };
        self.lane.host.push(Job::Track { url: url.to_string(), role, step, tokens });
    }

    fn touch(&mut self, url: &str) {
        if !self.touched.iter().any(|u| u == url) {
            self.touched.push(url.to_string());
        }
    }

    /// Dispatcher._delta: clocks, metrics, the chunk (streamed) or the text (whole).
    fn delta(&mut self, out: &mut String, text: &str, n: u64, finish: Option<String>) {
        let now = Instant::now();
        if n > 0 {
            match self.first_at {
                // one inter-token latency per token after the first (Dispatcher._delta):
                // a delta's n tokens share its gap, the first delta's others count 0
                None => {
                    self.first_at = Some(now);
                    let ttft = (now - self.start).as_secs_f64();
                    self.lane.host.push(Job::First { token: self.token(), ttft });
                    if n > 1 {
                        self.itls.push((0.0, n - 1));
                    }
                }
                Some(_) => {
                    if let Some(last) = self.last_at {
                        self.itls.push(((now - last).as_secs_f64() / n as f64, n));
                    }
                }
            }
            self.last_at = Some(now);
        }
        self.completion += n;
        self.finish = finish;
        if self.plan.stream {
            if !text.is_empty() || self.finish.is_some() || n > 0 {
                self.chunks.text(out, text, self.finish.as_deref());
            }
        } else {
            self.text.push_str(text);
        }
    }

    fn end(&self, out: &mut String) {
        if self.plan.include_usage {
            self.chunks.usage(out, self.plan.n_prompt, self.completion, self.cached);
        }
        out.push_str(sse::DONE);
    }
}

/// An error before anything was sent: an HTTP error; after: the SSE error event and [DONE].
enum Outcome {
    Http(u16, Bytes),
}

pub async fn serve(lane: Arc<Lane>, plan: Plan) -> Response<Body> {
    let chunks = sse::Chunks::new(&plan.rid, &plan.model);
    let mut run = Run {
        lane: lane.clone(),
        plan,
        start: Instant::now(),
        first_at: None,
        last_at: None,
        itls: Vec::new(),
        output: Vec::new(),
        completion: 0,
        cached: 0,
        remote_prefill: false,
        migrations: 0,
        finish: None,
        touched: Vec::new(),
        open: Vec::new(),
        chunks,
        text: String::new(),
        status: 200,
    };
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, hyper::Error>>(64);
    let (head_tx, head_rx) = oneshot::channel::<Result<(), Outcome>>();
    let stream = run.plan.stream;
    // The client going away: this handler dropped by hyper before the reply started (or,
    // not streamed, before it was made), or the stream's receiver dropped after.
    let gone = Arc::new(tokio::sync::Notify::new());
    let mut guard = Gone(Some(gone.clone()));
    let task = tokio::spawn(async move {
        let closed = tx.clone();
        tokio::select! {
            _ = drive(&mut run, tx, head_tx) => {}
            _ = gone.notified() => { client_gone(&mut run) }
            _ = closed.closed() => { client_gone(&mut run) }
        }
        run
    });
    let head = head_rx.await;
    if stream {
        guard.0 = None; // from here the body's receiver tells
    }
    match head {
        Ok(Ok(())) if stream => Response::builder()
            .status(200)
            .header("content-type", "text/event-stream; charset=utf-8")
            .body(StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed())
            .unwrap(),
        Ok(Ok(())) => {
            let run = task.await.expect("lane task");
            let body = sse::whole(&run.plan.rid, &run.plan.model, &run.text, run.finish.as_deref(), run.plan.n_prompt, run.completion, run.cached);
            full(200, "application/json", Bytes::from(body))
        }
        Ok(Err(Outcome::Http(status, body))) => full(status, "application/json", body),
        Err(_) => full(500, "application/json", Bytes::from_static(b"{\"error\":{\"message\":\"internal error: lane\",\"type\":\"server_error\",\"param\":null,\"code\":null}}")),
    }
}

type Tx = mpsc::Sender<Result<Frame<Bytes>, hyper::Error>>;

struct Gone(Option<Arc<tokio::sync::Notify>>);

impl Drop for Gone {
    fn drop(&mut self) {
        if let Some(n) = self.0.take() {
            n.notify_one();
        }
    }
}

/// The client went away mid-request: 499, the workers told to drop it, the end counted.
fn client_gone(run: &mut Run) {
    run.status = 499;
    for (url, role) in std::mem::take(&mut run.open) {
        let tokens = if role == "prefill" { run.plan.n_prompt } else { 0 };
        run.lane.host.push(Job::Track { url, role, step: -1, tokens });
    }
    for url in run.touched.clone() {
        abort(&run.lane, url, run.plan.rid.clone());
    }
    finish(run);
}

/// The whole trip; sends the head verdict (Ok: the reply starts) once the first delta is
/// in or the request failed; then the stream's chunks through `tx`.
async fn drive(run: &mut Run, tx: Tx, head_tx: oneshot::Sender<Result<(), Outcome>>) {
    let mut head = Some(head_tx);
    let result = trip(run, &tx, &mut head).await;
    let streaming = head.is_none() && run.plan.stream;
    match result {
        Ok(()) => {}
        Err(Outcome::Http(status, body)) => {
            run.status = status;
            if let Some(h) = head.take() {
                let _ = h.send(Err(Outcome::Http(status, body)));
            } else if streaming {
                let mut s = String::from("data: ");
                s.push_str(std::str::from_utf8(&body).unwrap_or("{}"));
                s.push_str("\n\n");
                s.push_str(sse::DONE);
                let _ = tx.send(Ok(Frame::data(Bytes::from(s)))).await;
            }
        }
    }
    if let Some(h) = head.take() {
        let _ = h.send(Ok(()));
    }
    if run.finish.is_none() {
        for url in run.touched.clone() {
            abort(&run.lane, url, run.plan.rid.clone());
        }
    }
    finish(run);
}

/// The request's end, to Python: Runtime.finish's figures and the slot back.
fn finish(run: &mut Run) {
    let e2e = run.start.elapsed().as_secs_f64();
    let tpot = match (run.first_at, run.last_at) {
        (Some(f), Some(l)) if run.completion > 1 => Some((l - f).as_secs_f64() / (run.completion - 1) as f64),
        _ => None,
    };
    {
        let mut itl = run.lane.itl.lock().unwrap();
        for (x, n) in run.itls.drain(..) {
            itl.observe_n(x, n);
        }
    }
    run.lane.host.push(Job::End(End { token: run.plan.token, status: run.status, completion: run.completion, e2e, tpot }));
}

async fn send(run: &mut Run, tx: &Tx, head: &mut Option<oneshot::Sender<Result<(), Outcome>>>, out: String) -> bool {
    if !run.plan.stream {
        return true;
    }
    if let Some(h) = head.take() {
        let _ = h.send(Ok(()));
    }
    if out.is_empty() {
        return true;
    }
    let wait = run.lane.write_timeout;
    match tokio::time::timeout(wait, tx.send(Ok(Frame::data(Bytes::from(out))))).await {
        Ok(Ok(())) => true,
        Ok(Err(_)) => {
            run.status = 499; // the client went away
            false
        }
        Err(_) => {
            // a client that stopped reading (SSEStream's --stream-write-timeout)
            run.status = 499;
            let waited = wait.as_secs_f64();
            run.lane.host.push(Job::SlowReader { token: run.plan.token, waited });
            false
        }
    }
}

fn refused(status: u16, body: Bytes) -> Outcome {
    // a worker's 4xx: its error body when it has one (worker_calls/errors.from_worker_body)
    let ok = serde_json::from_slice::<Value>(&body).map(|v| v.get("error").is_some()).unwrap_or(false);
    if ok {
        return Outcome::Http(status, body);
    }
    let msg = format!("{{\"error\":{{\"message\":\"worker refused the request\",\"type\":\"invalid_request_error\",\"param\":null,\"code\":null}}}}");
    Outcome::Http(status, Bytes::from(msg))
}

async fn trip(run: &mut Run, tx: &Tx, head: &mut Option<oneshot::Sender<Result<(), Outcome>>>) -> Result<(), Outcome> {
    let lane = run.lane.clone();
    let timeout = run.plan.timeout;
    let generate = std::mem::take(&mut run.plan.generate);
    // the GenerateRequest's handle, first token and resumed tokens, as JSON text
    let (mut kv_handle, mut first_id, mut resume) = ("null".to_string(), "null".to_string(), "null".to_string());
    let n_prompt = run.plan.n_prompt;
    // -- remote prefill: the next prefill worker on a failure, then a local prefill
    let prefill: Vec<String> = run.plan.prefill.iter().take(3).cloned().collect();
    for url in prefill {
        run.touch(&url);
        run.track(&url, "prefill", 1);
        let token = run.token();
        let got = match post_as(&lane, &url, "/prefill", run.plan.prefill_body.clone(), timeout, "prefill", token).await {
            Ok(call) => read_all_as(&lane, call, timeout, "prefill", &url, token).await,
            Err(e) => Err(e),
        };
        run.track(&url, "prefill", -1);
        let raw = match got {
            Ok(raw) => raw,
            Err(Failed::Refused(s, b)) => return Err(refused(s, b)),
            Err(Failed::Worker(reason, down)) => {
                lane.host.push(Job::Failed { token: run.token(), url: url.clone(), role: "prefill", down, reason });
                abort(&lane, url, run.plan.rid.clone());
                continue;
            }
        };
        let Ok(reply) = serde_json::from_slice::<Value>(&raw) else {
            let reason = "bad prefill reply".to_string();
            lane.host.push(Job::Failed { token: run.token(), url: url.clone(), role: "prefill", down: true, reason });
            continue;
        };
        let first = reply.get("first_token_id").cloned().unwrap_or(Value::Null);
        let text = reply.get("text").and_then(Value::as_str).unwrap_or("").to_string();
        let finish = reply.get("finish_reason").and_then(Value::as_str).map(str::to_string);
        let handle = reply.get("kv_handle").cloned().unwrap_or(Value::Null);
        run.remote_prefill = true;
        run.cached = reply.get("num_cached_tokens").and_then(Value::as_u64).unwrap_or(0);
        run.output.push(first.clone());
        let mut out = String::new();
        run.delta(&mut out, &text, 1, finish.clone());
        if finish.is_some() || handle.is_null() {
            if run.finish.is_none() {
                run.finish = Some("stop".into());
            }
            if run.plan.stream {
                run.end(&mut out);
            }
            send(run, tx, head, out).await;
            return Ok(());
        }
        if !send(run, tx, head, out).await {
            return Ok(());
        }
        kv_handle = handle.to_string();
        first_id = first.to_string();
        break;
    }
    // -- decode: the next decode worker while nothing of its own was sent; after, migrate
    let mut candidates: Vec<String> = run.plan.decode.iter().take(3).cloned().collect();
    candidates.reverse();
    let mut relayed = false;
    let mut attempt = 0;
    let mut waits = 0;
    loop {
        if candidates.is_empty() {
            // every candidate failed: wait for one to come (back), twice at most
            if waits == 2 {
                break;
            }
            waits += 1;
            let rx = lane.host.await_decode(run.token(), run.plan.rid.clone(), run.touched.clone());
            candidates = rx.await.unwrap_or_default();
            if candidates.is_empty() {
                break;
            }
            candidates.reverse();
        }
        let Some(url) = candidates.pop() else { break };
        if attempt > 0 {
            // the last worker may have claimed the handle (single-use): the next one
            // recomputes the prompt and every token sent (the migration's request)
            kv_handle = "null".into();
            first_id = "null".into();
            resume = serde_json::to_string(&run.output).unwrap_or_else(|_| "null".into());
            if relayed {
                run.migrations += 1;
                lane.host.push(Job::Migrated { token: run.token() });
            }
        }
        attempt += 1;
        run.touch(&url);
        run.track(&url, "decode", 1);
        let body = Bytes::from(generate.body(&kv_handle, &first_id, &resume));
        let r = stream_decode(run, tx, head, &url, body, &mut relayed, n_prompt).await;
        run.track(&url, "decode", -1);
        match r {
            Ok(()) => return Ok(()),
            Err(Failed::Refused(s, b)) => return Err(refused(s, b)),
            Err(Failed::Worker(reason, down)) => {
                if run.status == 499 {
                    return Ok(());
                }
                lane.host.push(Job::Failed { token: run.token(), url: url.clone(), role: "decode", down, reason });
                abort(&lane, url, run.plan.rid.clone());
            }
        }
    }
    if relayed {
        return Err(Outcome::Http(502, run.plan.err_midstream.clone()));
    }
    Err(Outcome::Http(503, run.plan.err_no_worker.clone()))
}

async fn stream_decode(
    run: &mut Run,
    tx: &Tx,
    head: &mut Option<oneshot::Sender<Result<(), Outcome>>>,
    url: &str,
    body: Bytes,
    relayed: &mut bool,
    _n_prompt: u64,
) -> Result<(), Failed> {
    let lane = run.lane.clone();
    let timeout = run.plan.timeout;
    let call = post_as(&lane, url, "/generate", body, timeout, "decode", run.token()).await?;
    let Call { sender, authority, resp } = call;
    let mut incoming = resp.into_body();
    let mut rest: Vec<u8> = Vec::new();
    loop {
        let frame = match watched(&lane, url, "decode", run.token(), timeout, incoming.frame()).await? {
            None => break,
            Some(Err(e)) => {
                if run.finish.is_some() {
                    return Ok(());
                }
                return Err(Failed::Worker(format!("stream: {e}"), true));
            }
            Some(Ok(f)) => f,
        };
        let Ok(data) = frame.into_data() else { continue };
        if run.finish.is_some() {
            continue; // read on to the end: the connection goes back to the pool
        }
        rest.extend_from_slice(&data);
        let Some(cut) = rest.iter().rposition(|&b| b == b'\n') else { continue };
        let lines: Vec<u8> = rest.drain(..=cut).collect();
        let mut out = String::new();
        // lines that came together: one delta (worker_client.merge_lines)
        let mut text = String::new();
        let mut n = 0u64;
        let mut finish: Option<String> = None;
        for line in lines.split(|&b| b == b'\n') {
            if line.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            let Ok(msg) = serde_json::from_slice::<Value>(line) else {
                return Err(Failed::Worker("bad stream line".into(), true));
            };
            if let Some(err) = msg.get("error").filter(|e| !e.is_null()) {
                if n > 0 || !text.is_empty() {
                    run.delta(&mut out, &text, n, finish.take());
                    send(run, tx, head, std::mem::take(&mut out)).await;
                }
                if err.get("code").and_then(Value::as_str) == Some("request_failed") {
                    let body = serde_json::json!({"error": {
                        "message": err.get("message").cloned().unwrap_or(Value::Null),
                        "type": err.get("type").cloned().unwrap_or(Value::Null),
                        "param": err.get("param").cloned().unwrap_or(Value::Null),
                        "code": err.get("code").cloned().unwrap_or(Value::Null),
                    }});
                    return Err(Failed::Refused(422, Bytes::from(body.to_string())));
                }
                return Err(Failed::Worker("worker error".into(), false));
            }
            if let Some(ids) = msg.get("token_ids").and_then(Value::as_array) {
                n += ids.len() as u64;
                run.output.extend(ids.iter().cloned());
            }
            text.push_str(msg.get("text").and_then(Value::as_str).unwrap_or(""));
            if let Some(u) = msg.get("usage").filter(|u| !u.is_null()) {
                if !run.remote_prefill && run.migrations == 0 {
                    run.cached = u.get("cached_tokens").and_then(Value::as_u64).unwrap_or(0);
                }
            }
            if let Some(f) = msg.get("finish_reason").and_then(Value::as_str) {
                finish = Some(f.to_string());
                break;
            }
        }
        *relayed = *relayed || n > 0 || !text.is_empty();
        run.delta(&mut out, &text, n, finish);
        if run.finish.is_some() && run.plan.stream {
            run.end(&mut out);
        }
        if !send(run, tx, head, out).await {
            return Ok(());
        }
    }
    if run.finish.is_none() {
        return Err(Failed::Worker("stream ended without a finish_reason".into(), true));
    }
    lane.workers.put(&authority, sender);
    Ok(())
}
