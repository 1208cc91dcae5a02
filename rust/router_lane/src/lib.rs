//! pdserve_lane: the router's compiled lane (docs/router.md, "Eighth pass").
//!
//! A tokio thread serves the router's public socket (lane.rs); the Python router stays
//! the reference and does everything stateful: it drains this module's job queue on its
//! event loop (a pipe wakes it) and answers each request's `begin` (router/fast_lane.py).
mod generate;
mod hist;
mod lane;
mod plan;
mod planner_py;
mod pool;
mod sign;
mod sse;
mod tokenize;

use bytes::Bytes;
use lane::{Begin, Job, Plan};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Queue {
    jobs: Mutex<Vec<Job>>,
    waiting: Mutex<HashMap<u64, oneshot::Sender<Begin>>>,
    decode_waits: Mutex<HashMap<u64, oneshot::Sender<Vec<String>>>>,
    next: AtomicU64,
    wake: UnixStream, // written when the queue goes from empty to not
    woken: AtomicBool,
}

impl Queue {
    fn wake(&self) {
        if !self.woken.swap(true, Ordering::AcqRel) {
            let _ = (&self.wake).write(b"!");
        }
    }
}

impl lane::Host for Queue {
    /// Every job wakes the loop at once, coalesced: one pipe write until the loop drains
    /// (`take`), so the jobs queued meanwhile ride along. The eighth pass held the jobs
    /// that need no answer (a first token, an end: the slot back) up to 2 ms for the next
    /// `begin`; a slot or a load count back 2 ms late held requests on the wall.
    fn push(&self, job: Job) {
        self.jobs.lock().unwrap().push(job);
        self.wake();
    }

    fn begin(&self, body: Bytes, headers: Vec<(Bytes, Bytes)>, peer: SocketAddr, prompt: Option<tokenize::Prompt>) -> oneshot::Receiver<Begin> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiting.lock().unwrap().insert(id, tx);
        self.push(Job::Begin { id, body, headers, peer, prompt });
        rx
    }

    fn await_decode(&self, token: u64, rid: String, touched: Vec<String>) -> oneshot::Receiver<Vec<String>> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.decode_waits.lock().unwrap().insert(id, tx);
        self.push(Job::AwaitDecode { id, token, rid, touched });
        rx
    }
}

#[pyclass(module = "pdserve_lane")]
struct Lane {
    queue: Arc<Queue>,
    state: Arc<lane::Lane>,
    wake_read: UnixStream,
    stop: Mutex<Option<oneshot::Sender<()>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

#[pymethods]
impl Lane {
    /// listen_fd: a bound, listening TCP socket (dup'ed: the lane owns its copy);
    /// backend: "127.0.0.1:PORT" of the Python server; keys: the http KeyRing's keys.
    /// tokenizer: the router's tokenizer as JSON (`backend_tokenizer.to_str()`), when the
    /// lane may tokenize text prompts up to `inline_text` characters (tokenize.rs).
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (listen_fd, backend, keys, peer_token, inline_body, stall_s, body_timeout_s, err_408, write_timeout_s, itl_bounds, tokenizer=None, inline_text=0))]
    fn new(
        listen_fd: i32,
        backend: String,
        keys: Vec<Vec<u8>>,
        peer_token: String,
        inline_body: usize,
        stall_s: f64,
        body_timeout_s: f64,
        err_408: Vec<u8>,
        write_timeout_s: f64,
        itl_bounds: Vec<f64>,
        tokenizer: Option<&str>,
        inline_text: usize,
    ) -> PyResult<Self> {
        let tok = tokenizer.map(|json| tokenize::Tok::from_json(json, inline_text)).transpose().map_err(PyValueError::new_err)?;
        let (wake_read, wake) = UnixStream::pair().map_err(|e| PyValueError::new_err(e.to_string()))?;
        wake_read.set_nonblocking(true).map_err(|e| PyValueError::new_err(e.to_string()))?;
        wake.set_nonblocking(true).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let queue = Arc::new(Queue {
            jobs: Mutex::new(Vec::new()),
            waiting: Mutex::new(HashMap::new()),
            decode_waits: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            wake,
            woken: AtomicBool::new(false),
        });
        let std_listener = unsafe { std::net::TcpListener::from_raw_fd(listen_fd) };
        std_listener.set_nonblocking(true).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let host: Arc<dyn lane::Host> = queue.clone();
        let state = Arc::new(lane::Lane {
            host,
            keys,
            backend,
            peer_token,
            inline_body,
            body_timeout: Duration::from_secs_f64(body_timeout_s.max(0.001)),
            err_408: Bytes::from(err_408),
            write_timeout: Duration::from_secs_f64(write_timeout_s.max(0.001)),
            itl: Mutex::new(hist::Hist::new(itl_bounds)),
            tok,
            workers: Default::default(),
            python: Default::default(),
            health: lane::Health {
                failing: Default::default(),
                stall: Mutex::new(Duration::from_secs_f64(stall_s.max(0.001))),
            },
        });
        let state_py = state.clone();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("pdserve-lane".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio");
                rt.block_on(accept(std_listener, state, stop_rx));
            })
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Lane { queue, state: state_py, wake_read, stop: Mutex::new(Some(stop_tx)), thread: Mutex::new(Some(thread)) })
    }

    /// The fd the Python loop watches (add_reader): readable when jobs wait.
    fn notify_fd(&self) -> i32 {
        self.wake_read.as_raw_fd()
    }

    /// Every job queued, as tuples (router/fast_lane.py reads them).
    fn take<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let mut buf = [0u8; 64];
        while let Ok(n) = (&self.wake_read).read_some(&mut buf) {
            if n == 0 {
                break;
            }
        }
        self.queue.woken.store(false, Ordering::Release);
        let jobs = netted(std::mem::take(&mut *self.queue.jobs.lock().unwrap()));
        let out = PyList::empty(py);
        for job in jobs {
            let t: Bound<'py, PyTuple> = match job {
                Job::Begin { id, body, headers, peer, prompt } => {
                    let hs = PyList::empty(py);
                    for (k, v) in headers {
                        hs.append((PyBytes::new(py, &k), PyBytes::new(py, &v)))?;
                    }
                    let prompt = prompt.map(|p| (p.text, p.ids));
                    ("begin", id, PyBytes::new(py, &body), hs, (peer.ip().to_string(), peer.port()), prompt).into_pyobject(py)?
                }
                Job::First { token, ttft } => ("first", token, ttft).into_pyobject(py)?,
                Job::Failed { token, url, role, down, reason } => ("failed", token, url, role, down, reason).into_pyobject(py)?,
                Job::Track { .. } => unreachable!("tracks are summed into Net by netted"),
                Job::Net { url, role, step, tokens } => ("track", url, role, step, tokens).into_pyobject(py)?,
                Job::Migrated { token } => ("migrated", token).into_pyobject(py)?,
                Job::Counted { status } => ("counted", status).into_pyobject(py)?,
                Job::SlowReader { token, waited } => ("slow_reader", token, waited).into_pyobject(py)?,
                Job::Stalled { token, url, role, quiet } => ("stalled", token, url, role, quiet).into_pyobject(py)?,
                Job::AwaitDecode { id, token, rid, touched } => ("await_decode", id, token, rid, touched).into_pyobject(py)?,
                Job::End(e) => ("end", e.token, e.status, e.completion, e.e2e, e.tpot).into_pyobject(py)?,
            };
            out.append(t)?;
        }
        Ok(out)
    }

    /// Python's answer to a `begin`: ("fallback",), ("error", status, body) or ("go", ...).
    fn answer(&self, id: u64, result: &Bound<'_, PyTuple>) -> PyResult<()> {
        let kind: String = result.get_item(0)?.extract()?;
        let begin = match kind.as_str() {
            "fallback" => Begin::Fallback,
            "error" => {
                let status: u16 = result.get_item(1)?.extract()?;
                let body: Vec<u8> = result.get_item(2)?.downcast::<PyBytes>()?.as_bytes().to_vec();
                let headers: Vec<(String, String)> = result.get_item(3)?.extract()?;
                Begin::Error(status, Bytes::from(body), headers)
            }
            "go" => {
                // bytes read in place (a Vec<u8> extraction walks a bytes object per item)
                let item = |i: usize| result.get_item(i);
                let raw = |i: usize| -> PyResult<Bytes> {
                    Ok(Bytes::copy_from_slice(item(i)?.downcast::<PyBytes>()?.as_bytes()))
                };
                let pb = raw(8)?;
                let gb = raw(9)?;
                let generate = generate::Generate::of(if gb.is_empty() { &pb } else { &gb })
                    .map_err(PyValueError::new_err)?;
                let timeout: f64 = item(11)?.extract()?;
                Begin::Go(Box::new(Plan {
                    token: item(1)?.extract()?,
                    rid: item(2)?.extract()?,
                    model: item(3)?.extract()?,
                    stream: item(4)?.extract()?,
                    include_usage: item(5)?.extract()?,
                    prefill: item(6)?.extract()?,
                    decode: item(7)?.extract()?,
                    prefill_body: pb,
                    generate,
                    n_prompt: item(10)?.extract()?,
                    timeout: Duration::from_secs_f64(timeout.max(0.001)),
                    err_midstream: raw(12)?,
                    err_no_worker: raw(13)?,
                }))
            }
            other => return Err(PyValueError::new_err(format!("unknown answer {other:?}"))),
        };
        if let Some(tx) = self.queue.waiting.lock().unwrap().remove(&id) {
            let _ = tx.send(begin);
        }
        Ok(())
    }

    /// The inter-token latencies counted since the last call: (per-bucket counts, sum).
    fn take_itl(&self) -> (Vec<u64>, f64) {
        self.state.itl.lock().unwrap().take()
    }

    /// The decode workers an `await_decode` found ([]: none came).
    fn decode_ready(&self, id: u64, urls: Vec<String>) {
        if let Some(tx) = self.queue.decode_waits.lock().unwrap().remove(&id) {
            let _ = tx.send(urls);
        }
    }

    /// After each health round: the workers whose check failed, and the stall limit.
    fn set_health(&self, failing: Vec<String>, stall_s: f64) {
        *self.state.health.failing.write().unwrap() = failing.into_iter().collect();
        *self.state.health.stall.lock().unwrap() = Duration::from_secs_f64(stall_s.max(0.001));
    }

    /// Stop accepting and end the lane's thread (requests in flight are cut).
    fn close(&self, py: Python<'_>) {
        if let Some(tx) = self.stop.lock().unwrap().take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.lock().unwrap().take() {
            py.allow_threads(|| {
                let _ = t.join();
            });
        }
    }
}

/// The batch's in-flight tracks summed per worker call site (url, role), first, then every
/// other job in its order: one `track` per worker with the batch's net count and prompt
/// tokens (a call begun and ended in the batch nets out), where the ninth pass handed
/// Python one per call begun or ended (~2.8 a request at concurrency 64). The tracks
/// record calls the lane has already made or ended, so the batch's begins plan over
/// counts that are at least as current as one at a time.
fn netted(jobs: Vec<Job>) -> Vec<Job> {
    let tracks = jobs.iter().filter(|j| matches!(j, Job::Track { .. })).count();
    if tracks == 0 {
        return jobs;
    }
    let mut sums: Vec<(String, &'static str, i64, i64)> = Vec::new();
    let mut rest = Vec::with_capacity(jobs.len() - tracks);
    for job in jobs {
        match job {
            Job::Track { url, role, step, tokens } => {
                let signed = if step > 0 { tokens as i64 } else { -(tokens as i64) };
                match sums.iter_mut().find(|(u, r, _, _)| *u == url && *r == role) {
                    Some(s) => {
                        s.2 += step as i64;
                        s.3 += signed;
                    }
                    None => sums.push((url, role, step as i64, signed)),
                }
            }
            other => rest.push(other),
        }
    }
    let mut out: Vec<Job> = Vec::with_capacity(sums.len() + rest.len());
    for (url, role, step, tokens) in sums {
        if step != 0 || tokens != 0 {
            out.push(Job::Net { url, role, step, tokens });
        }
    }
    out.extend(rest);
    out
}

/// What `take` hands Python for these (token, url, role, step, tokens) tracks (the token
/// only names the call in the test's table): one
/// (url, role, net step, net tokens) per worker call site (tests/router/test_fast_lane.py).
#[pyfunction]
fn netted_tracks(tracks: Vec<(u64, String, String, i8, u64)>) -> Vec<(String, String, i64, i64)> {
    let role = |r: &str| -> &'static str { if r == "prefill" { "prefill" } else { "decode" } };
    let jobs = tracks
        .into_iter()
        .map(|(_token, url, r, step, tokens)| Job::Track { url, role: role(&r), step, tokens })
        .collect();
    netted(jobs)
        .into_iter()
        .filter_map(|j| match j {
            Job::Net { url, role, step, tokens } => Some((url, role.to_string(), step, tokens)),
            _ => None,
        })
        .collect()
}

/// The GenerateRequest of a PrefillRequest (codec.encode's fields, in order), before its
/// prefill: the test compares it with codec.encode(GenerateRequest(...)).
/// `resume`: the JSON text of the tokens a migration resumes from.
#[pyfunction]
#[pyo3(signature = (prefill, resume="null"))]
fn generate_request_of(prefill: &[u8], resume: &str) -> PyResult<String> {
    let g = generate::Generate::of(prefill).map_err(PyValueError::new_err)?;
    String::from_utf8(g.body("null", "null", resume)).map_err(|e| PyValueError::new_err(e.to_string()))
}

trait ReadSome {
    fn read_some(&mut self, buf: &mut [u8]) -> std::io::Result<usize>;
}

impl ReadSome for &UnixStream {
    fn read_some(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        std::io::Read::read(self, buf)
    }
}

async fn accept(listener: std::net::TcpListener, state: Arc<lane::Lane>, mut stop: oneshot::Receiver<()>) {
    let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut stop => return,
            got = listener.accept() => match got {
                Ok(x) => x,
                Err(_) => continue,
            },
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| lane::handle(state.clone(), req, peer));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// signing.sign with the time and nonce given (tests compare it with the Python's).
#[pyfunction]
fn sign_with(key: Vec<u8>, method: &str, target: &str, body: Vec<u8>, now: f64, host: &str, nonce: Vec<u8>) -> PyResult<String> {
    let nonce: [u8; 12] = nonce.try_into().map_err(|_| PyValueError::new_err("nonce: 12 bytes"))?;
    Ok(sign::sign_with(&key, method, target, &body, now, host, &nonce))
}

/// signing.proof_ok over the keys given.
#[pyfunction]
#[pyo3(signature = (keys, auth, given=None))]
fn proof_ok(keys: Vec<Vec<u8>>, auth: &str, given: Option<Vec<u8>>) -> bool {
    sign::proof_ok(&keys, auth, given.as_deref())
}

/// One streamed chunk, the usage chunk and the whole reply (tests compare them with the
/// Python's bytes).
#[pyfunction]
#[pyo3(signature = (rid, model, text, finish=None))]
fn text_chunk(rid: &str, model: &str, text: &str, finish: Option<&str>) -> String {
    let mut out = String::new();
    sse::Chunks::new(rid, model).text(&mut out, text, finish);
    out
}

#[pyfunction]
fn usage_chunk(rid: &str, model: &str, prompt: u64, completion: u64, cached: u64) -> String {
    let mut out = String::new();
    sse::Chunks::new(rid, model).usage(&mut out, prompt, completion, cached);
    out
}

#[pyfunction]
#[pyo3(signature = (rid, model, text, finish, prompt, completion, cached))]
fn whole(rid: &str, model: &str, text: &str, finish: Option<&str>, prompt: u64, completion: u64, cached: u64) -> String {
    sse::whole(rid, model, text, finish, prompt, completion, cached)
}

/// The ids the lane gives each text (tokenizer: `backend_tokenizer.to_str()`), as
/// `encode_batch_fast([text], add_special_tokens)[0].ids` (tests compare them).
#[pyfunction]
#[pyo3(name = "tokenize", signature = (tokenizer, texts, add_special_tokens=true))]
fn tokenize_texts(tokenizer: &str, texts: Vec<String>, add_special_tokens: bool) -> PyResult<Vec<Vec<u32>>> {
    let tok = tokenize::Tok::from_json(tokenizer, usize::MAX).map_err(PyValueError::new_err)?;
    texts.iter().map(|t| tok.ids(t, add_special_tokens).map_err(PyValueError::new_err)).collect()
}

/// The text prompt the lane finds in a body, with its ids (None: Python tokenizes).
#[pyfunction]
fn body_prompt(tokenizer: &str, inline_text: usize, body: &[u8]) -> PyResult<Option<(String, Vec<u32>)>> {
    let tok = tokenize::Tok::from_json(tokenizer, inline_text).map_err(PyValueError::new_err)?;
    Ok(tok.prompt(body).map(|p| (p.text, p.ids)))
}

#[pymodule]
fn pdserve_lane(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Lane>()?;
    m.add_class::<planner_py::Planner>()?;
    m.add_function(wrap_pyfunction!(planner_py::block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(planner_py::salt_root, m)?)?;
    m.add_function(wrap_pyfunction!(sign_with, m)?)?;
    m.add_function(wrap_pyfunction!(proof_ok, m)?)?;
    m.add_function(wrap_pyfunction!(text_chunk, m)?)?;
    m.add_function(wrap_pyfunction!(usage_chunk, m)?)?;
    m.add_function(wrap_pyfunction!(whole, m)?)?;
    m.add_function(wrap_pyfunction!(generate_request_of, m)?)?;
    m.add_function(wrap_pyfunction!(netted_tracks, m)?)?;
    m.add_function(wrap_pyfunction!(tokenize_texts, m)?)?;
    m.add_function(wrap_pyfunction!(body_prompt, m)?)?;
    Ok(())
}
