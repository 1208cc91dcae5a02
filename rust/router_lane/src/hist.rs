//! A histogram the lane counts in, folded into the Python series on scrape
//! (router/fast_metrics.py `Histogram.pull`): per-token observations stay off the loop.

pub struct Hist {
    bounds: Vec<f64>, // upper bounds, the last +inf (fast_metrics.Histogram.bounds)
    counts: Vec<u64>, // per bucket, not cumulative
    sum: f64,
}

impl Hist {
    pub fn new(bounds: Vec<f64>) -> Self {
        let n = bounds.len().max(1);
        Hist { bounds, counts: vec![0; n], sum: 0.0 }
    }

    /// fast_metrics.Buckets.observe: the first bound >= x (bisect_left).
    /// `n` observations of `x` (a delta's tokens, Buckets.observe's `times`).
    pub fn observe_n(&mut self, x: f64, n: u64) {
        let i = self.bounds.partition_point(|b| *b < x).min(self.counts.len() - 1);
        self.counts[i] += n;
        self.sum += x * n as f64;
    }

    /// What was counted since the last take.
    pub fn take(&mut self) -> (Vec<u64>, f64) {
        let n = self.counts.len();
        (std::mem::replace(&mut self.counts, vec![0; n]), std::mem::take(&mut self.sum))
    }
}
