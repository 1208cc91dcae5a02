//! `pdserve_lane.Planner`: plan.rs seen from Python (router/lane_plan.py mirrors the
//! snapshot and the KV events into it; tests/router/test_lane_plan.py compares its plans
//! with the Python scheduler's).
use crate::plan::{self, Kind, Mt, Outcome, Planner as Inner, Profile, Worker};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

/// (filters, [(scorer, weight)], picker) by registry names.
type ProfileSpec = (Vec<String>, Vec<(String, f64)>, String);

fn profile(spec: ProfileSpec) -> PyResult<Profile> {
    let (filters, scorers, picker) = spec;
    let unknown = |kind: &str, name: &str| PyValueError::new_err(format!("unknown {kind} {name:?}"));
    Ok(Profile {
        filters: filters.iter().map(|f| plan::filter_named(f).ok_or_else(|| unknown("filter", f))).collect::<PyResult<_>>()?,
        scorers: scorers
            .iter()
            .map(|(s, w)| plan::scorer_named(s).map(|s| (s, *w)).ok_or_else(|| unknown("scorer", s)))
            .collect::<PyResult<_>>()?,
        picker: plan::picker_named(&picker).ok_or_else(|| unknown("picker", &picker))?,
    })
}

/// One worker as router/lane_plan.py sends it: (url, worker_id, is_prefill, healthy,
/// reported, [queued_prompt_tokens, running + waiting + loading, kv_blocks_total,
/// kv_blocks_free, block_size, inflight, inflight_prompt_tokens, since_report,
/// since_report_tokens]).
type WorkerRow = (String, String, bool, bool, bool, [i64; 9]);

#[pyclass(module = "pdserve_lane")]
pub struct Planner {
    pub inner: Arc<Mutex<Inner>>,
}

#[pymethods]
impl Planner {
    #[new]
    fn new(prefill: ProfileSpec, decode: ProfileSpec, threshold: i64, key: Vec<u8>, capacity: usize) -> PyResult<Self> {
        let prefill = profile(prefill)?;
        let decode = profile(decode)?;
        let uses_prefix = prefill.reads(plan::Scorer::PrefixMatch);
        Ok(Planner {
            inner: Arc::new(Mutex::new(Inner {
                prefill,
                decode,
                threshold,
                uses_prefix,
                key,
                workers: Vec::new(),
                index: plan::PrefixIndex::new(capacity),
                tiers_present: false,
                rng: Mt::from_os(),
                rr: 0,
            })),
        })
    }

    /// Whether routing reads the prefix index (RouterConfig.uses_prefix).
    #[getter]
    fn uses_prefix(&self) -> bool {
        self.inner.lock().unwrap().uses_prefix
    }

    /// The snapshot's workers, in its order.
    fn set_workers(&self, rows: Vec<WorkerRow>) {
        let workers = rows
            .into_iter()
            .map(|(url, worker_id, prefill, healthy, reported, n)| Worker {
                url,
                worker_id,
                prefill,
                healthy,
                reported,
                queued_prompt_tokens: n[0],
                busy: n[1],
                kv_total: n[2],
                kv_free: n[3],
                block_size: n[4],
                inflight: n[5],
                inflight_tokens: n[6],
                since: n[7],
                since_tokens: n[8],
            })
            .collect();
        self.inner.lock().unwrap().workers = workers;
    }

    /// Ties are broken by these Mersenne Twister draws (Python's `random.getstate()[1]`).
    fn set_rng(&self, words: Vec<u32>, pos: usize) -> PyResult<()> {
        let mt = Mt::from_state(&words, pos).ok_or_else(|| PyValueError::new_err("624 words and a position <= 624"))?;
        self.inner.lock().unwrap().rng = mt;
        Ok(())
    }

    /// The round-robin counter (Scheduler._rr).
    #[getter]
    fn get_rr(&self) -> u64 {
        self.inner.lock().unwrap().rr
    }

    #[setter]
    fn set_rr(&self, n: u64) {
        self.inner.lock().unwrap().rr = n;
    }

    /// Whether a KV tier below a pool holds blocks (then Python plans: `plan` declines).
    fn set_tiers_present(&self, present: bool) {
        self.inner.lock().unwrap().tiers_present = present;
    }

    /// The prefix index's pool part: a worker's blocks stored, removed, or all dropped.
    fn kv_stored(&self, worker: &str, hashes: Vec<u128>) {
        self.inner.lock().unwrap().index.stored(worker, &hashes);
    }

    fn kv_removed(&self, worker: &str, hashes: Vec<u128>) {
        self.inner.lock().unwrap().index.removed(worker, &hashes);
    }

    fn kv_drop(&self, worker: &str) {
        self.inner.lock().unwrap().index.drop_worker(worker);
    }

    fn kv_clear(&self) {
        self.inner.lock().unwrap().index.clear();
    }

    fn index_len(&self) -> usize {
        self.inner.lock().unwrap().index.len()
    }

    /// Scheduler.plan for a base-model request: None when this side declines (Python
    /// plans), ("no_worker",) when no decode worker is healthy, else (kind, prefill URLs,
    /// decode URLs, matched tokens).
    #[pyo3(signature = (ids, salt=None))]
    fn plan(&self, py: Python<'_>, ids: Vec<i64>, salt: Option<String>) -> PyResult<PyObject> {
        let mut p = self.inner.lock().unwrap();
        Ok(match p.plan(&ids, salt.as_deref()) {
            Outcome::Declined => py.None(),
            Outcome::NoWorker => ("no_worker",).into_pyobject(py)?.into_any().unbind(),
            Outcome::Plan(plan) => {
                let urls = |v: &[usize]| v.iter().map(|&i| p.workers[i].url.clone()).collect::<Vec<_>>();
                let kind = if plan.kind == Kind::Remote { "remote_prefill" } else { "local_prefill" };
                (kind, urls(&plan.prefill), urls(&plan.decode), plan.matched_tokens).into_pyobject(py)?.into_any().unbind()
            }
        })
    }
}

/// hashing.block_hashes and hashing.salt_root (tests compare them with the Python's).
#[pyfunction]
#[pyo3(signature = (ids, block_size, key, salt=None, extra=None))]
pub fn block_hashes(ids: Vec<i64>, block_size: usize, key: Vec<u8>, salt: Option<String>, extra: Option<String>) -> PyResult<Vec<u128>> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be > 0"));
    }
    let root = plan::salt_root(&key, salt.as_deref(), extra.as_deref());
    Ok(plan::block_hashes(&ids, block_size, root, &key))
}

#[pyfunction]
#[pyo3(signature = (key, salt=None, extra=None))]
pub fn salt_root(key: Vec<u8>, salt: Option<String>, extra: Option<String>) -> u128 {
    plan::salt_root(&key, salt.as_deref(), extra.as_deref())
}
