//! The scheduler's plan in Rust (docs/router.md, "Ninth pass"): the same decision as
//! router/scheduling/scheduler.py's `Scheduler.plan` for a base-model request, over a
//! snapshot and a prefix index that Python mirrors into it.
//!
//!     prompt ids ─▶ block hashes (blake2b keyed, as pdserve/protocol/hashing.py)
//!                ─▶ prefix index match ─▶ decode ranked (filters, Σ wᵢ·scorerᵢ, picker)
//!                ─▶ the P/D decision (disagg.decide) ─▶ prefill ranked ─▶ stored
//!
//! Python stays the reference: tests/router/test_lane_plan.py gives both the same stream
//! of requests, KV events and loads (and the Python rng's state: ties are broken by the
//! same Mersenne Twister draws) and compares every plan. What this side cannot decide the
//! same way (a KV tier below a pool holds blocks, an adapter's request) it declines
//! (`plan` returns None) and Python plans.
use std::collections::{BTreeMap, HashMap};

pub const ROOT_HASH: u128 = 0;

// -- hashing (pdserve/protocol/hashing.py) -------------------------------------------------

fn keyed(key: &[u8], person: &[u8]) -> blake2b_simd::State {
    blake2b_simd::Params::new().hash_length(16).key(key).personal(person).to_state()
}

fn le128(bytes: &[u8]) -> u128 {
    let mut b = [0u8; 16];
    b.copy_from_slice(&bytes[..16]);
    u128::from_le_bytes(b)
}

/// hashing.salt_root: the parent hash of a prompt's first block under `salt`.
pub fn salt_root(key: &[u8], salt: Option<&str>, extra: Option<&str>) -> u128 {
    let salt = salt.unwrap_or("");
    let extra = extra.unwrap_or("");
    if salt.is_empty() && extra.is_empty() {
        return ROOT_HASH;
    }
    let digest = if extra.is_empty() {
        let mut h = keyed(key, b"pdserve-salt");
        h.update(salt.as_bytes());
        h.finalize()
    } else {
        let mut h = keyed(key, b"pdserve-extra");
        h.update(&(salt.len() as u64).to_le_bytes());
        h.update(salt.as_bytes());
        h.update(extra.as_bytes());
        h.finalize()
    };
    let v = le128(digest.as_bytes());
    if v == 0 {
        1
    } else {
        v
    }
}

/// hashing.block_hashes: the chained hash of every full block.
pub fn block_hashes(ids: &[i64], block_size: usize, parent: u128, key: &[u8]) -> Vec<u128> {
    let base = keyed(key, b"pdserve-block");
    let mut link = parent.to_le_bytes();
    let mut out = Vec::with_capacity(ids.len() / block_size.max(1));
    let mut raw = Vec::with_capacity(block_size * 8);
    for block in ids.chunks_exact(block_size.max(1)) {
        raw.clear();
        for t in block {
            raw.extend_from_slice(&t.to_le_bytes());
        }
        let mut h = base.clone();
        h.update(&link);
        h.update(&raw);
        link.copy_from_slice(&h.finalize().as_bytes()[..16]);
        out.push(u128::from_le_bytes(link));
    }
    out
}

// -- the prefix index (router/scheduling/prefix_index.py, its pool part) ----------------------

/// block hash → the workers holding it, least recently stored or matched first.
pub struct PrefixIndex {
    capacity: usize,
    holders: HashMap<u128, (u64, Vec<u32>)>, // hash → (its place in `order`, worker ids)
    order: BTreeMap<u64, u128>,
    clock: u64,
    names: Vec<String>, // interned worker ids
    ids: HashMap<String, u32>,
    held: Vec<i64>, // by interned id
}

impl PrefixIndex {
    pub fn new(capacity: usize) -> Self {
        PrefixIndex {
            capacity: capacity.max(1),
            holders: HashMap::new(),
            order: BTreeMap::new(),
            clock: 0,
            names: Vec::new(),
            ids: HashMap::new(),
            held: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.holders.len()
    }

    fn intern(&mut self, worker: &str) -> u32 {
        if let Some(&i) = self.ids.get(worker) {
            return i;
        }
        let i = self.names.len() as u32;
        self.names.push(worker.to_string());
        self.ids.insert(worker.to_string(), i);
        self.held.push(0);
        i
    }

    fn touch(&mut self, h: u128) {
        self.clock += 1;
        let now = self.clock;
        if let Some(entry) = self.holders.get_mut(&h) {
            self.order.remove(&entry.0);
            entry.0 = now;
            self.order.insert(now, h);
        }
    }

    pub fn stored(&mut self, worker: &str, hashes: &[u128]) {
        let w = self.intern(worker);
        for &h in hashes {
            if self.holders.contains_key(&h) {
                self.touch(h);
            } else {
                self.clock += 1;
                self.holders.insert(h, (self.clock, Vec::new()));
                self.order.insert(self.clock, h);
            }
            let entry = self.holders.get_mut(&h).expect("just inserted");
            if !entry.1.contains(&w) {
                entry.1.push(w);
                self.held[w as usize] += 1;
            }
        }
        while self.holders.len() > self.capacity {
            let Some((_, h)) = self.order.pop_first() else { break };
            if let Some((_, gone)) = self.holders.remove(&h) {
                for g in gone {
                    self.held[g as usize] -= 1;
                }
            }
        }
    }

    pub fn removed(&mut self, worker: &str, hashes: &[u128]) {
        let Some(&w) = self.ids.get(worker) else { return };
        for h in hashes {
            let Some(entry) = self.holders.get_mut(h) else { continue };
            if let Some(pos) = entry.1.iter().position(|&x| x == w) {
                entry.1.swap_remove(pos);
                self.held[w as usize] -= 1;
                if entry.1.is_empty() {
                    let place = entry.0;
                    self.holders.remove(h);
                    self.order.remove(&place);
                }
            }
        }
    }

    pub fn drop_worker(&mut self, worker: &str) {
        let Some(&w) = self.ids.get(worker) else { return };
        let mine: Vec<u128> = self.holders.iter().filter(|(_, e)| e.1.contains(&w)).map(|(h, _)| *h).collect();
        self.removed(worker, &mine);
    }

    pub fn clear(&mut self) {
        self.holders.clear();
        self.order.clear();
        for n in self.held.iter_mut() {
            *n = 0;
        }
    }

    /// worker id → the number of leading blocks of `hashes` it holds.
    pub fn matched(&mut self, hashes: &[u128]) -> HashMap<u32, usize> {
        let mut out = HashMap::new();
        let mut active: Option<Vec<u32>> = None;
        for (i, h) in hashes.iter().enumerate() {
            let holders: &[u32] = self.holders.get(h).map(|e| e.1.as_slice()).unwrap_or(&[]);
            let next: Vec<u32> = match &active {
                None => holders.to_vec(),
                Some(a) => a.iter().copied().filter(|w| holders.contains(w)).collect(),
            };
            if next.is_empty() {
                break;
            }
            self.touch(*h);
            for &w in &next {
                out.insert(w, i + 1);
            }
            active = Some(next);
        }
        out
    }

    fn id_of(&self, worker: &str) -> Option<u32> {
        self.ids.get(worker).copied()
    }

    fn held_of(&self, id: Option<u32>) -> i64 {
        id.map(|i| self.held[i as usize].max(0)).unwrap_or(0)
    }

    fn held_total(&self) -> i64 {
        self.held.iter().filter(|&&n| n > 0).sum()
    }
}

// -- the snapshot's workers (router/scheduling/snapshot.py) ---------------------------------

#[derive(Clone, Debug, Default)]
pub struct Worker {
    pub url: String,
    pub worker_id: String,
    pub prefill: bool,
    pub healthy: bool,
    pub queued_prompt_tokens: i64, // its stats' (or last report's)
    pub busy: i64,                 // its stats' running + waiting + loading
    pub kv_total: i64,
    pub kv_free: i64,
    pub block_size: i64,
    pub reported: bool,
    pub inflight: i64,
    pub inflight_tokens: i64,
    pub since: i64,
    pub since_tokens: i64,
}

impl Worker {
    fn queued_tokens(&self) -> i64 {
        if self.reported {
            self.queued_prompt_tokens + self.since_tokens
        } else {
            self.queued_prompt_tokens.max(self.inflight_tokens)
        }
    }

    fn running(&self) -> i64 {
        if self.reported {
            self.busy + self.since
        } else {
            self.busy.max(self.inflight)
        }
    }

    fn kv_free_fraction(&self) -> f64 {
        if self.kv_total > 0 {
            self.kv_free as f64 / self.kv_total as f64
        } else {
            0.0
        }
    }
}

// -- the profiles (router/scheduling/profile.py, filters.py, scorers.py, pickers.py) ---------

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Filter {
    KnowsLora, // a base-model request: every worker
    FitsKv,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scorer {
    PrefixMatch,
    QueuedTokens,
    Running,
    FreeKv,
    CacheBalance,
    LoraAffinity, // 0 on every worker for a base-model request
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Picker {
    MaxScore,
    RoundRobin,
}

pub fn filter_named(name: &str) -> Option<Filter> {
    Some(match name {
        "knows-lora" => Filter::KnowsLora,
        "fits-kv" => Filter::FitsKv,
        _ => return None,
    })
}

pub fn scorer_named(name: &str) -> Option<Scorer> {
    Some(match name {
        "prefix-match" => Scorer::PrefixMatch,
        "queued-tokens" => Scorer::QueuedTokens,
        "running" => Scorer::Running,
        "free-kv" => Scorer::FreeKv,
        "cache-balance" => Scorer::CacheBalance,
        "lora-affinity" => Scorer::LoraAffinity,
        _ => return None,
    })
}

pub fn picker_named(name: &str) -> Option<Picker> {
    Some(match name {
        "max-score" => Picker::MaxScore,
        "round-robin" => Picker::RoundRobin,
        _ => return None,
    })
}

#[derive(Clone, Debug)]
pub struct Profile {
    pub filters: Vec<Filter>,
    pub scorers: Vec<(Scorer, f64)>,
    pub picker: Picker,
}

impl Profile {
    /// Profile.reads: whether the picker reads `scorer` with a weight above 0.
    pub fn reads(&self, scorer: Scorer) -> bool {
        self.picker == Picker::MaxScore && self.scorers.iter().any(|(s, w)| *s == scorer && *w > 0.0)
    }
}

/// What routing knows about one request (route_request.RouteRequest).
struct Request<'a> {
    n_prompt: i64,
    n_blocks: usize,
    block_size: i64,
    matched: &'a HashMap<u32, usize>,
    held_total: i64,
}

const QUEUED_TOKENS_SCALE: f64 = 2048.0;
const RUNNING_SCALE: f64 = 8.0;

fn inverse(load: i64, scale: f64) -> f64 {
    1.0 / (1.0 + (load.max(0) as f64) / scale)
}

/// Python's round(x, 9): the nearest 9-decimal value (both sides round the exact binary
/// value correctly, ties to even).
fn round9(x: f64) -> f64 {
    format!("{x:.9}").parse().unwrap_or(x)
}

// -- the Mersenne Twister of Python's random.Random (ties are broken by its draws) ---------

pub struct Mt {
    mt: [u32; 624],
    pos: usize,
}

impl Mt {
    /// From Python's `random.getstate()[1]`: 624 words and the position.
    pub fn from_state(words: &[u32], pos: usize) -> Option<Self> {
        let mut mt = [0u32; 624];
        if words.len() != 624 || pos > 624 {
            return None;
        }
        mt.copy_from_slice(words);
        Some(Mt { mt, pos })
    }

    /// Seeded from the OS (the lane's own stream in production: any draws do).
    pub fn from_os() -> Self {
        let mut bytes = [0u8; 624 * 4];
        let _ = getrandom::getrandom(&mut bytes);
        let mut mt = [0u32; 624];
        for (i, w) in mt.iter_mut().enumerate() {
            *w = u32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]);
        }
        mt[0] |= 0x8000_0000; // never an all-zero state
        Mt { mt, pos: 624 }
    }

    fn next_u32(&mut self) -> u32 {
        if self.pos >= 624 {
            for k in 0..624 {
                let y = (self.mt[k] & 0x8000_0000) | (self.mt[(k + 1) % 624] & 0x7fff_ffff);
                let mut v = self.mt[(k + 397) % 624] ^ (y >> 1);
                if y & 1 != 0 {
                    v ^= 0x9908_b0df;
                }
                self.mt[k] = v;
            }
            self.pos = 0;
        }
        let mut y = self.mt[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }

    /// random.random(): 53 bits in [0, 1).
    pub fn random(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67108864.0 + b) * (1.0 / 9007199254740992.0)
    }
}

// -- the planner -----------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Remote,
    Local,
}

#[derive(Debug)]
pub struct Planned {
    pub kind: Kind,
    pub prefill: Vec<usize>, // indexes into the workers, best first
    pub decode: Vec<usize>,
    pub matched_tokens: i64,
    pub n_blocks: usize,
}

pub enum Outcome {
    Plan(Planned),
    NoWorker,
    Declined,
}

pub struct Planner {
    pub prefill: Profile,
    pub decode: Profile,
    pub threshold: i64,
    pub uses_prefix: bool,
    pub key: Vec<u8>,
    pub workers: Vec<Worker>,
    pub index: PrefixIndex,
    pub tiers_present: bool, // a KV tier below a pool holds blocks: Python plans
    pub rng: Mt,
    pub rr: u64,
}

impl Planner {
    fn block_size(&self) -> i64 {
        self.workers.iter().filter(|w| w.healthy).map(|w| w.block_size).min().unwrap_or(16)
    }

    fn score(&self, w: &Worker, req: &Request<'_>, scorers: &[(Scorer, f64)], id: Option<u32>) -> f64 {
        let mut total = 0.0;
        for &(s, weight) in scorers {
            let value = match s {
                Scorer::PrefixMatch => {
                    if req.n_blocks == 0 {
                        0.0
                    } else {
                        let m = id.and_then(|i| req.matched.get(&i)).copied().unwrap_or(0);
                        m.min(req.n_blocks) as f64 / req.n_blocks as f64
                    }
                }
                Scorer::QueuedTokens => inverse(w.queued_tokens(), QUEUED_TOKENS_SCALE),
                Scorer::Running => inverse(w.running(), RUNNING_SCALE),
                Scorer::FreeKv => w.kv_free_fraction().clamp(0.0, 1.0),
                Scorer::CacheBalance => {
                    if req.held_total <= 0 {
                        1.0
                    } else {
                        1.0 - (self.index.held_of(id).min(req.held_total) as f64) / req.held_total as f64
                    }
                }
                Scorer::LoraAffinity => 0.0,
            };
            total += weight * value;
        }
        total
    }

    fn pick(&mut self, ws: &[usize], req: &Request<'_>, p: &Profile) -> Vec<usize> {
        match p.picker {
            Picker::RoundRobin => {
                let mut ordered = ws.to_vec();
                ordered.sort_by(|a, b| self.workers[*a].url.cmp(&self.workers[*b].url));
                if ordered.is_empty() {
                    return ordered;
                }
                let k = (self.rr % ordered.len() as u64) as usize;
                ordered.rotate_left(k);
                ordered
            }
            Picker::MaxScore => {
                if ws.len() < 2 {
                    return ws.to_vec();
                }
                let mut keyed: Vec<(f64, f64, usize)> = Vec::with_capacity(ws.len());
                for &i in ws {
                    let w = &self.workers[i];
                    let id = self.index.id_of(&w.worker_id);
                    let s = round9(self.score(w, req, &p.scorers, id));
                    keyed.push((s, self.rng.random(), i));
                }
                keyed.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.total_cmp(&b.1)));
                keyed.into_iter().map(|k| k.2).collect()
            }
        }
    }

    fn order(&mut self, candidates: &[usize], req: &Request<'_>, p: &Profile) -> Vec<usize> {
        let mut survivors = candidates.to_vec();
        for f in &p.filters {
            if *f == Filter::FitsKv {
                let need = (req.n_prompt + req.block_size.max(1) - 1) / req.block_size.max(1);
                survivors.retain(|&i| {
                    let w = &self.workers[i];
                    w.kv_total == 0 || w.kv_free >= need
                });
            }
        }
        if survivors.len() == candidates.len() {
            return self.pick(&survivors, req, p);
        }
        let rest: Vec<usize> = candidates.iter().copied().filter(|i| !survivors.contains(i)).collect();
        let mut out = self.pick(&survivors, req, p);
        out.extend(self.pick(&rest, req, p));
        out
    }

    fn pool(&self, prefill: bool) -> Vec<usize> {
        (0..self.workers.len()).filter(|&i| self.workers[i].healthy && self.workers[i].prefill == prefill).collect()
    }

    /// Scheduler.plan for a base-model request (no adapter) with the cache salt given.
    pub fn plan(&mut self, ids: &[i64], salt: Option<&str>) -> Outcome {
        if self.tiers_present {
            return Outcome::Declined;
        }
        let block_size = self.block_size();
        let n_prompt = ids.len() as i64;
        let hashes = if self.uses_prefix {
            let root = salt_root(&self.key, salt, None);
            block_hashes(ids, block_size.max(1) as usize, root, &self.key)
        } else {
            Vec::new()
        };
        let matched = self.index.matched(&hashes);
        let held_total = if self.uses_prefix { self.index.held_total() } else { 0 };
        let req = Request { n_prompt, n_blocks: hashes.len(), block_size, matched: &matched, held_total };
        let matched_tokens = |planner: &Planner, i: usize| -> i64 {
            let id = planner.index.id_of(&planner.workers[i].worker_id);
            let blocks = id.and_then(|x| matched.get(&x)).copied().unwrap_or(0) as i64;
            (blocks * block_size).min(n_prompt)
        };
        let decode_pool = self.pool(false);
        let profile = self.decode.clone();
        let decode = self.order(&decode_pool, &req, &profile);
        if decode.is_empty() {
            return Outcome::NoWorker;
        }
        let prefill_pool = self.pool(true);
        let cached = matched_tokens(self, decode[0]).max(0);
        let uncached = n_prompt - cached.min(n_prompt);
        let remote = !prefill_pool.is_empty() && uncached >= self.threshold;
        let mut plan = Planned { kind: Kind::Local, prefill: Vec::new(), decode, matched_tokens: 0, n_blocks: hashes.len() };
        if remote {
            let profile = self.prefill.clone();
            let prefill = self.order(&prefill_pool, &req, &profile);
            if !prefill.is_empty() {
                plan.matched_tokens = matched_tokens(self, prefill[0]);
                plan.kind = Kind::Remote;
                plan.prefill = prefill;
            }
        }
        self.rr += 1;
        if plan.kind == Kind::Remote && self.uses_prefix {
            let id = self.workers[plan.prefill[0]].worker_id.clone();
            self.index.stored(&id, &hashes);
        }
        Outcome::Plan(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mersenne_twister_matches_the_reference_output() {
        // init_genrand(5489), the reference's default seed: first output 3499211612
        let mut mt = [0u32; 624];
        mt[0] = 5489;
        for i in 1..624 {
            mt[i] = 1812433253u32.wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 30)).wrapping_add(i as u32);
        }
        let mut m = Mt { mt, pos: 624 };
        assert_eq!(m.next_u32(), 3499211612);
    }

    #[test]
    fn round9_ties_to_even_like_python() {
        assert_eq!(round9(0.0009765625), 0.000976562); // 2^-10: a tie at the 10th decimal
        assert_eq!(round9(0.1 + 0.2), 0.3);
    }
}
