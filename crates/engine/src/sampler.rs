//! Token sampling and stop strings.
//!
//! [`Sampler::sample`] runs one fixed chain over the logits of the last position:
//!
//! ```text
//! penalties -> top-k -> softmax(logits / temperature) -> top-p -> min-p -> draw
//! ```
//!
//! This is llama.cpp's default order (penalties, top-k, top-p, min-p, dist) with the
//! temperature applied before top-p/min-p, as Hugging Face `transformers` and vLLM do, so
//! that `top_p` and `min_p` act on the distribution the token is actually drawn from.
//! `temperature == 0` is greedy: the argmax after penalties, ties to the lowest id.
//!
//! Determinism: with `seed: Some(s)` the same config, logits and history give the same
//! tokens. Every intermediate ordering is total (logit descending, then id ascending), so
//! no result depends on the unstable partitioning order of `select_nth_unstable`.
//!
//! NaN logits are treated as `-inf` (never chosen unless every logit is NaN/-inf, in which
//! case id 0 is returned); `+inf` is treated as `f32::MAX`.
//!
//! [`StopChecker`] finds stop strings in streamed text and says how much of it is safe to
//! emit.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Sampling parameters of one request. `Default` is plain sampling at temperature 1 with
/// every filter and penalty off (the OpenAI API defaults); [`SamplerConfig::greedy`] is
/// argmax.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplerConfig {
    /// Softmax temperature; `0` = greedy argmax ([`SamplerConfig::validate`] refuses one
    /// below 0; [`Sampler`] still takes it as greedy).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; `0` = off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability sums to at least
    /// `top_p`; `1` = off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely token's;
    /// `0` = off.
    pub min_p: f32,
    /// llama.cpp / Hugging Face repetition penalty over the tokens in `history`: a positive
    /// logit is divided by it, a negative one multiplied; `1` = off.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty: `logit -= presence_penalty` for every token seen at least
    /// once in `history`.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: `logit -= frequency_penalty * count` for a token seen
    /// `count` times in `history`.
    pub frequency_penalty: f32,
    /// RNG seed; `None` = seeded from the OS entropy source.
    pub seed: Option<u64>,
    /// OpenAI `logit_bias`: `(token, bias)` pairs added to those tokens' logits after the
    /// penalties and before temperature and the filters (ids past the logits are ignored);
    /// `-100` all but bans a token, `100` all but forces it.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplerConfig {
    /// No repetition, presence or frequency penalty: the logits need no history.
    pub fn no_penalties(&self) -> bool {
        self.repetition_penalty == 1.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.logit_bias.is_empty()
    }

    /// Greedy (temperature 0) with no penalty: the choice is the logits' argmax, which the
    /// device can make.
    pub fn is_plain_greedy(&self) -> bool {
        self.no_penalties() && self.temperature <= 0.0
    }

    /// Refuses values outside what each parameter means: NaN or infinite values, a negative
    /// temperature, `top_p` outside (0, 1], `min_p` outside [0, 1], a repetition penalty
    /// that is not positive. (The server's OpenAI ranges are narrower and checked there.)
    pub fn validate(&self) -> anyhow::Result<()> {
        let t = self.temperature;
        anyhow::ensure!(
            t.is_finite() && t >= 0.0,
            "temperature must be a finite number ≥ 0 (0 = greedy), got {t}"
        );
        anyhow::ensure!(
            self.top_p > 0.0 && self.top_p <= 1.0,
            "top_p must be in (0, 1] (1 = off), got {}",
            self.top_p
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.min_p),
            "min_p must be in [0, 1] (0 = off), got {}",
            self.min_p
        );
        anyhow::ensure!(
            self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0,
            "the repetition penalty must be a finite number > 0 (1 = off), got {}",
            self.repetition_penalty
        );
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            anyhow::ensure!(v.is_finite(), "{name} must be a finite number, got {v}");
        }
        for &(t, b) in &self.logit_bias {
            anyhow::ensure!(
                (-100.0..=100.0).contains(&b),
                "logit_bias of token {t} must be in [-100, 100], got {b}"
            );
        }
        Ok(())
    }

    /// Greedy decoding: argmax, no penalties.
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        }
    }
}

/// Index of the largest logit; ties go to the lowest id, NaN counts as `-inf`. Returns 0 for
/// an empty slice or when every logit is NaN/`-inf`.
pub fn argmax(logits: &[f32]) -> u32 {
    // Two passes: a max that vectorizes (f32::max ignores NaN), then the first index
    // holding it.
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m > f32::NEG_INFINITY {
        return logits.iter().position(|&v| v == m).unwrap_or(0) as u32;
    }
    0
}

#[cfg(test)]
fn argmax_scalar(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        // `>` (not `>=`) keeps the first of equal values; NaN compares false.
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

/// A candidate token during sampling: its id and its logit, later its (unnormalized)
/// probability.
#[derive(Clone, Copy, Debug)]
struct Cand {
    id: u32,
    v: f32,
}

/// Total order used everywhere: larger value first, then lower id.
#[inline]
fn desc(a: &Cand, b: &Cand) -> std::cmp::Ordering {
    b.v.total_cmp(&a.v).then(a.id.cmp(&b.id))
}

/// One sequence's sampler: the config, its RNG and scratch buffers reused across calls (no
/// allocation per token after the first).
pub struct Sampler {
    cfg: SamplerConfig,
    rng: StdRng,
    /// Occurrence count per token id in the current `history` (all zero between calls).
    counts: Vec<u32>,
    /// Ids whose count is non-zero (to reset `counts` without touching the whole vocab).
    seen: Vec<u32>,
    cands: Vec<Cand>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig, vocab_size: usize) -> Self {
        let rng = match cfg.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Sampler {
            cfg,
            rng,
            counts: vec![0; vocab_size],
            seen: Vec::new(),
            cands: Vec::with_capacity(vocab_size),
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Pick the next token. `logits` (one per vocab entry) is modified in place: NaN and
    /// infinities are sanitized and the penalties applied. `history` is the window of
    /// previous tokens the penalties look at (the caller chooses it: the prompt plus the
    /// output, or only the last N tokens as llama.cpp's `penalty_last_n`). Ids in `history`
    /// outside the vocabulary are ignored.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        match self.candidates(logits, history) {
            Some(greedy) => greedy,
            None => self.draw(),
        }
    }

    /// The distribution [`Sampler::sample`] draws from (temperature, penalties, top-k, top-p
    /// and min-p applied), as `(id, probability)` pairs summing to 1, without drawing:
    /// speculative sampling compares it with the draft's. Greedy is the one token with
    /// probability 1. `logits` is modified as by `sample`.
    pub fn distribution(&mut self, logits: &mut [f32], history: &[u32]) -> Vec<(u32, f64)> {
        if let Some(greedy) = self.candidates(logits, history) {
            return vec![(greedy, 1.0)];
        }
        let sum = match self.shape() {
            Ok(sum) => sum,
            Err(best) => return vec![(best, 1.0)],
        };
        self.cands
            .iter()
            .filter(|c| c.v > 0.0)
            .map(|c| (c.id, c.v as f64 / sum))
            .collect()
    }

    /// A draw from `dist` (`(id, probability)` pairs, not necessarily normalized) with this
    /// sampler's RNG; the last token with mass where rounding runs past the end.
    pub fn pick(&mut self, dist: &[(u32, f64)]) -> u32 {
        let sum: f64 = dist.iter().map(|d| d.1).sum();
        let u = self.rng.random::<f64>() * sum;
        let mut acc = 0f64;
        for &(id, p) in dist {
            acc += p;
            if u < acc {
                return id;
            }
        }
        dist.iter()
            .rev()
            .find(|d| d.1 > 0.0)
            .or(dist.first())
            .map_or(0, |d| d.0)
    }

    /// A uniform number in [0, 1) from this sampler's RNG.
    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// Sanitizes `logits` (NaN → -inf, +inf → MAX), applies the penalties, and either gives
    /// the greedy token (temperature not positive; `Some`) or fills `self.cands` with the
    /// finite candidates, cut to the top-k, for [`Sampler::shape`] (`None`).
    fn candidates(&mut self, logits: &mut [f32], history: &[u32]) -> Option<u32> {
        if logits.is_empty() {
            return Some(0);
        }
        // Branch-free so it vectorizes: NaN -> -inf, +inf -> MAX.
        for l in logits.iter_mut() {
            *l = if l.is_nan() {
                f32::NEG_INFINITY
            } else {
                l.min(f32::MAX)
            };
        }
        if !self.cfg.no_penalties() {
            self.apply_penalties(logits, history);
            for &(t, b) in &self.cfg.logit_bias {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l += b;
                }
            }
        }
        // Greedy unless the temperature is a positive number (NaN included).
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        if !(self.cfg.temperature > 0.0) {
            return Some(argmax(logits));
        }

        // Candidates: all finite-probability tokens.
        let cands = &mut self.cands;
        cands.clear();
        cands.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, v)| **v > f32::NEG_INFINITY)
                .map(|(i, &v)| Cand { id: i as u32, v }),
        );
        if cands.is_empty() {
            return Some(0);
        }

        // top-k: partition so the k best come first, drop the rest, and sort them (best
        // first, ties to the lower id) so the draw below sees the same order whether the
        // candidates were selected here or on the device (`sample_top_k`).
        let k = self.cfg.top_k;
        if k > 0 && k < cands.len() {
            cands.select_nth_unstable_by(k - 1, desc);
            cands.truncate(k);
            cands.sort_unstable_by(desc);
        }
        None
    }

    /// Samples from the `top_k` best candidates already selected on the device: `(id, logit)`
    /// sorted best first, ties to the lower id. Gives the same token as [`Sampler::sample`]
    /// on the full logits with the same configuration and RNG state, when no penalties apply
    /// and `cands` holds the configured `top_k` best logits.
    pub fn sample_top_k(&mut self, cands: &[(u32, f32)]) -> u32 {
        // Greedy unless the temperature is a positive number (NaN included), as `sample`.
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        if !(self.cfg.temperature > 0.0) {
            return cands.first().map_or(0, |c| c.0);
        }
        self.cands.clear();
        self.cands.extend(
            cands
                .iter()
                .filter(|c| !c.1.is_nan() && c.1 > f32::NEG_INFINITY)
                .map(|&(id, v)| Cand {
                    id,
                    v: v.min(f32::MAX),
                }),
        );
        if self.cands.is_empty() {
            return cands.first().map_or(0, |c| c.0);
        }
        self.draw()
    }

    /// Temperature softmax, top-p, min-p and the seeded draw over `self.cands`.
    fn draw(&mut self) -> u32 {
        let sum = match self.shape() {
            Ok(sum) => sum,
            Err(best) => return best,
        };
        // Draw: inverse CDF over the (deterministically ordered) survivors.
        let cands = &self.cands;
        let u: f64 = self.rng.random::<f64>() * sum;
        let mut acc = 0f64;
        for c in cands.iter() {
            acc += c.v as f64;
            if u < acc {
                return c.id;
            }
        }
        // Rounding put u at the very end: take the last token with non-zero mass.
        cands
            .iter()
            .rev()
            .find(|c| c.v > 0.0)
            .map_or(cands[0].id, |c| c.id)
    }

    /// Turns `self.cands`' logits into unnormalized probabilities: temperature softmax, then
    /// top-p and min-p cut the set. Their sum, or `Err(the most likely token)` where min-p
    /// keeps nothing.
    fn shape(&mut self) -> Result<f64, u32> {
        let cands = &mut self.cands;
        // softmax(logits / T), unnormalized: exp((l - max) / T), the max gets 1.
        let max = cands.iter().map(|c| c.v).fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0 / self.cfg.temperature;
        let mut sum = 0f64;
        for c in cands.iter_mut() {
            c.v = ((c.v - max) * inv_t).exp();
            sum += c.v as f64;
        }

        // top-p: smallest prefix (by probability) whose mass reaches top_p; at least one.
        let top_p = self.cfg.top_p;
        if top_p < 1.0 && cands.len() > 1 {
            let keep = top_p_prefix(cands, sum, top_p as f64);
            cands.truncate(keep);
            sum = cands.iter().map(|c| c.v as f64).sum();
        }

        // min-p: relative to the most likely token, whose unnormalized probability is 1.
        let min_p = self.cfg.min_p;
        if min_p > 0.0 && cands.len() > 1 {
            let before = cands.len();
            let best = cands
                .iter()
                .fold(cands[0], |b, c| if c.v > b.v { *c } else { b })
                .id;
            cands.retain(|c| c.v >= min_p);
            if cands.is_empty() {
                return Err(best); // min_p > 1 keeps nothing: the most likely token
            }
            if cands.len() != before {
                sum = cands.iter().map(|c| c.v as f64).sum();
            }
        }
        Ok(sum)
    }

    fn apply_penalties(&mut self, logits: &mut [f32], history: &[u32]) {
        let n = logits.len();
        if self.counts.len() < n {
            self.counts.resize(n, 0);
        }
        for &t in history {
            let t = t as usize;
            if t < n {
                if self.counts[t] == 0 {
                    self.seen.push(t as u32);
                }
                self.counts[t] += 1;
            }
        }
        let (rep, pres, freq) = (
            self.cfg.repetition_penalty,
            self.cfg.presence_penalty,
            self.cfg.frequency_penalty,
        );
        for &t in &self.seen {
            let t = t as usize;
            let count = self.counts[t];
            let l = &mut logits[t];
            if *l == f32::NEG_INFINITY {
                continue;
            }
            // Same arithmetic as llama.cpp's `llama_sampler_penalties_apply`.
            if *l <= 0.0 {
                *l *= rep;
            } else {
                *l /= rep;
            }
            *l -= count as f32 * freq + if count > 0 { pres } else { 0.0 };
            self.counts[t] = 0;
        }
        self.seen.clear();
    }
}

/// Reorders `cands` so that the top-p nucleus comes first and returns its length: the
/// smallest set of most likely tokens whose mass reaches `top_p * sum`, at least one.
///
/// A full sort of a 150k vocabulary costs milliseconds; this partitions instead. Chunks of
/// growing size are split off the front with `select_nth_unstable`; a chunk that does not
/// reach the target is kept whole (unsorted), the chunk where the target is crossed is split
/// further until it is small, and only that last small chunk is sorted. The kept set is
/// exactly the full-sort prefix; its internal order is deterministic but not sorted.
fn top_p_prefix(cands: &mut [Cand], sum: f64, top_p: f64) -> usize {
    const SORT_BELOW: usize = 256;
    let target = top_p * sum;
    let n = cands.len();
    // Invariants: every element of cands[..done] is >= every element after it, `acc` is
    // its mass and stays < target; the crossing lies in cands[done..hi], whose elements
    // are all >= those of cands[hi..].
    let (mut done, mut hi, mut acc, mut step) = (0usize, n, 0f64, 64usize);
    loop {
        let m = (done + step).min(hi);
        if m < hi {
            cands[done..hi].select_nth_unstable_by(m - done - 1, desc);
        }
        let chunk: f64 = cands[done..m].iter().map(|c| c.v as f64).sum();
        if acc + chunk < target && m < n {
            acc += chunk;
            done = m;
            step = step.saturating_mul(4);
            continue;
        }
        hi = m;
        if m - done <= SORT_BELOW {
            cands[done..m].sort_unstable_by(desc);
            for (i, c) in cands[done..m].iter().enumerate() {
                acc += c.v as f64;
                if acc >= target {
                    return done + i + 1;
                }
            }
            // Only reachable through rounding when the target is the whole mass.
            return m;
        }
        step = (m - done) / 8;
    }
}

/// What [`StopChecker::check`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopCheck {
    /// No stop string yet. `text[..safe_len]` can be emitted; the rest could be the start
    /// of a stop string and must be held back until more text arrives.
    Continue { safe_len: usize },
    /// Stop string number `stop` begins at byte `len`: the final text is `text[..len]`
    /// (the stop string itself is not part of the output, as in the OpenAI API).
    Stop { len: usize, stop: usize },
}

/// Finds stop strings in generated text as it grows, including stop strings that span
/// token boundaries. Feed it the whole decoded output so far after every token; it only
/// searches the part that can hold a new match.
#[derive(Clone, Debug, Default)]
pub struct StopChecker {
    stops: Vec<String>,
    max_len: usize,
    /// Length of the text at the previous call: no stop string ends at or before it.
    checked: usize,
}

impl StopChecker {
    /// Empty stop strings are ignored.
    pub fn new<I, S>(stops: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let stops: Vec<String> = stops
            .into_iter()
            .map(Into::into)
            .filter(|s| !s.is_empty())
            .collect();
        let max_len = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        StopChecker {
            stops,
            max_len,
            checked: 0,
        }
    }

    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Start over for a new generation.
    pub fn reset(&mut self) {
        self.checked = 0;
    }

    /// Check `text`, the whole output so far (it must only grow between calls; a shorter
    /// text restarts the search). On several matches the earliest wins (then the first
    /// listed stop string).
    pub fn check(&mut self, text: &str) -> StopCheck {
        if self.stops.is_empty() {
            return StopCheck::Continue {
                safe_len: text.len(),
            };
        }
        if text.len() < self.checked {
            self.checked = 0;
        }
        // A new match must end after `checked`, so it starts after `checked - max_len`.
        let start = floor_char_boundary(text, self.checked.saturating_sub(self.max_len - 1));
        self.checked = text.len();
        let hay = &text[start..];
        let mut best: Option<(usize, usize)> = None;
        for (si, s) in self.stops.iter().enumerate() {
            if let Some(pos) = hay.find(s.as_str()) {
                if best.is_none_or(|(p, _)| pos < p) {
                    best = Some((pos, si));
                }
            }
        }
        if let Some((pos, stop)) = best {
            return StopCheck::Stop {
                len: start + pos,
                stop,
            };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let tail_start = floor_char_boundary(text, text.len().saturating_sub(self.max_len - 1));
        for (i, _) in text[tail_start..].char_indices() {
            let suffix = &text[tail_start + i..];
            if self.stops.iter().any(|s| s.starts_with(suffix)) {
                return StopCheck::Continue {
                    safe_len: tail_start + i,
                };
            }
        }
        StopCheck::Continue {
            safe_len: text.len(),
        }
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    if i >= s.len() {
        return s.len();
    }
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32) -> SamplerConfig {
        SamplerConfig {
            temperature,
            seed: Some(42),
            ..Default::default()
        }
    }

    /// Deterministic pseudo-random logits (no RNG crate needed for inputs).
    fn logits(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
            })
            .collect()
    }

    #[test]
    fn argmax_ties_and_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, f32::NAN, 0.5]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -1e30]), 1);
        assert_eq!(
            argmax(&[f32::NEG_INFINITY, f32::INFINITY, f32::INFINITY]),
            1
        );
        for seed in 0..10 {
            let l = logits(10_000, seed);
            assert_eq!(argmax(&l), argmax_scalar(&l));
        }
    }

    #[test]
    fn greedy_is_argmax_with_nan() {
        let mut s = Sampler::new(SamplerConfig::greedy(), 5);
        let mut l = vec![0.1, f32::NAN, 2.0, 2.0, -1.0];
        assert_eq!(s.sample(&mut l, &[]), 2);
        assert!(l[1] == f32::NEG_INFINITY);
        // Negative temperature is greedy too.
        let mut s = Sampler::new(
            SamplerConfig {
                temperature: -1.0,
                ..cfg(1.0)
            },
            5,
        );
        assert_eq!(s.sample(&mut [0.1, 5.0, 2.0, 2.0, -1.0], &[]), 1);
    }

    #[test]
    fn validate_refuses_out_of_range_parameters() {
        assert!(SamplerConfig::default().validate().is_ok());
        assert!(SamplerConfig::greedy().validate().is_ok());
        type Set = fn(&mut SamplerConfig);
        let bad: [(&str, Set); 11] = [
            ("temperature", |c| c.temperature = -0.5),
            ("temperature", |c| c.temperature = f32::NAN),
            ("temperature", |c| c.temperature = f32::INFINITY),
            ("top_p", |c| c.top_p = 0.0),
            ("top_p", |c| c.top_p = 1.5),
            ("top_p", |c| c.top_p = f32::NAN),
            ("min_p", |c| c.min_p = -0.1),
            ("min_p", |c| c.min_p = f32::NAN),
            ("repetition penalty", |c| c.repetition_penalty = 0.0),
            ("presence_penalty", |c| c.presence_penalty = f32::NAN),
            ("frequency_penalty", |c| c.frequency_penalty = f32::INFINITY),
        ];
        for (name, set) in bad {
            let mut c = cfg(1.0);
            set(&mut c);
            let e = c.validate().expect_err(name).to_string();
            assert!(e.contains(name), "{name}: {e}");
        }
    }

    #[test]
    fn all_nan_does_not_panic() {
        for t in [0.0, 1.0] {
            let mut s = Sampler::new(
                SamplerConfig {
                    top_p: 0.5,
                    min_p: 0.1,
                    top_k: 3,
                    ..cfg(t)
                },
                4,
            );
            assert_eq!(s.sample(&mut [f32::NAN; 4], &[1, 2, 9]), 0);
        }
        let mut s = Sampler::new(cfg(1.0), 4);
        let mut l = vec![f32::NAN, f32::INFINITY, 0.0, f32::INFINITY];
        let t = s.sample(&mut l, &[]);
        assert!(t == 1 || t == 3, "{t}");
        let mut s = Sampler::new(cfg(1.0), 0);
        assert_eq!(s.sample(&mut [], &[]), 0);
    }

    #[test]
    fn seeded_is_reproducible() {
        let base = logits(1000, 7);
        let run = |seed| {
            let mut s = Sampler::new(
                SamplerConfig {
                    seed: Some(seed),
                    top_k: 50,
                    top_p: 0.9,
                    ..cfg(1.0)
                },
                1000,
            );
            (0..200)
                .map(|_| s.sample(&mut base.clone(), &[]))
                .collect::<Vec<_>>()
        };
        let a = run(1);
        assert_eq!(a, run(1));
        assert_ne!(a, run(2));
        // It really samples: more than one distinct token.
        let mut d = a.clone();
        d.sort();
        d.dedup();
        assert!(d.len() > 5, "{d:?}");
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        for seed in 0..20 {
            let base = logits(150_000, seed);
            let want = argmax(&base);
            let mut s = Sampler::new(
                SamplerConfig {
                    top_k: 1,
                    seed: Some(seed),
                    ..cfg(1.5)
                },
                base.len(),
            );
            assert_eq!(s.sample(&mut base.clone(), &[]), want);
            let mut s = Sampler::new(
                SamplerConfig {
                    top_p: 1e-9,
                    seed: Some(seed),
                    ..cfg(1.5)
                },
                base.len(),
            );
            assert_eq!(s.sample(&mut base.clone(), &[]), want);
            // min_p = 1 keeps only the max.
            let mut s = Sampler::new(
                SamplerConfig {
                    min_p: 1.0,
                    seed: Some(seed),
                    ..cfg(1.5)
                },
                base.len(),
            );
            assert_eq!(s.sample(&mut base.clone(), &[]), want);
        }
        // Ties: lowest id wins under top-k=1.
        let mut s = Sampler::new(
            SamplerConfig {
                top_k: 1,
                ..cfg(1.0)
            },
            4,
        );
        assert_eq!(s.sample(&mut [0.0, 3.0, 3.0, 3.0], &[]), 1);
    }

    #[test]
    fn top_k_restricts_support() {
        let base = logits(5000, 3);
        let mut order: Vec<u32> = (0..5000).collect();
        order.sort_by(|&a, &b| base[b as usize].total_cmp(&base[a as usize]));
        let top: std::collections::HashSet<u32> = order[..10].iter().copied().collect();
        let mut s = Sampler::new(
            SamplerConfig {
                top_k: 10,
                ..cfg(5.0)
            },
            5000,
        );
        for _ in 0..500 {
            assert!(top.contains(&s.sample(&mut base.clone(), &[])));
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // probs (T=1): exp of ln p -> 0.5, 0.3, 0.15, 0.05
        let base: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        // top_p 0.79 -> {0, 1}; 0.81 -> {0, 1, 2}
        let mut s = Sampler::new(
            SamplerConfig {
                top_p: 0.79,
                ..cfg(1.0)
            },
            4,
        );
        let mut seen = [0u32; 4];
        for _ in 0..2000 {
            seen[s.sample(&mut base.clone(), &[]) as usize] += 1;
        }
        assert!(
            seen[0] > 0 && seen[1] > 0 && seen[2] == 0 && seen[3] == 0,
            "{seen:?}"
        );
        let mut s = Sampler::new(
            SamplerConfig {
                top_p: 0.81,
                ..cfg(1.0)
            },
            4,
        );
        let mut seen = [0u32; 4];
        for _ in 0..4000 {
            seen[s.sample(&mut base.clone(), &[]) as usize] += 1;
        }
        assert!(seen[2] > 0 && seen[3] == 0, "{seen:?}");
        // Frequencies follow the renormalized nucleus (0.5, 0.3, 0.15)/0.95 within 3 sigma.
        let n = 4000.0;
        for (i, p) in [0.5f64, 0.3, 0.15].iter().enumerate() {
            let p = p / 0.95;
            let sd = (n * p * (1.0 - p)).sqrt();
            assert!((seen[i] as f64 - n * p).abs() < 4.0 * sd, "{i}: {seen:?}");
        }
    }

    #[test]
    fn top_p_on_large_vocab_matches_full_sort() {
        // The growing-prefix top-p must keep exactly what a full sort keeps.
        for (seed, p) in [
            (1u64, 0.5f64),
            (2, 0.9),
            (3, 0.99),
            (4, 0.999),
            (5, 1e-9),
            (6, 1.0),
        ] {
            let base = logits(20_000, seed);
            let mut cands: Vec<Cand> = base
                .iter()
                .enumerate()
                .map(|(i, &v)| Cand {
                    id: i as u32,
                    v: (v * 2.0).exp(),
                })
                .collect();
            let sum: f64 = cands.iter().map(|c| c.v as f64).sum();
            let mut full = cands.clone();
            full.sort_by(desc);
            let mut acc = 0f64;
            let want = full.iter().position(|c| {
                acc += c.v as f64;
                acc >= p * sum
            });
            let keep = top_p_prefix(&mut cands, sum, p);
            assert_eq!(Some(keep - 1), want);
            let mut a: Vec<u32> = cands[..keep].iter().map(|c| c.id).collect();
            let mut b: Vec<u32> = full[..keep].iter().map(|c| c.id).collect();
            a.sort();
            b.sort();
            assert_eq!(a, b);
        }
    }

    #[test]
    fn min_p_filters_relative_to_max() {
        // probs 0.5, 0.3, 0.15, 0.05 -> min_p 0.25 keeps p >= 0.125: ids 0, 1, 2.
        let base: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let mut s = Sampler::new(
            SamplerConfig {
                min_p: 0.25,
                ..cfg(1.0)
            },
            4,
        );
        let mut seen = [0u32; 4];
        for _ in 0..3000 {
            seen[s.sample(&mut base.clone(), &[]) as usize] += 1;
        }
        assert!(
            seen[0] > 0 && seen[1] > 0 && seen[2] > 0 && seen[3] == 0,
            "{seen:?}"
        );
        // min_p 0.61 keeps only p >= 0.305: id 0 only.
        let mut s = Sampler::new(
            SamplerConfig {
                min_p: 0.61,
                ..cfg(1.0)
            },
            4,
        );
        for _ in 0..200 {
            assert_eq!(s.sample(&mut base.clone(), &[]), 0);
        }
    }

    #[test]
    fn temperature_sharpens() {
        // Low temperature: almost always the max; high: spread.
        let base = vec![1.0f32, 0.9, 0.8, 0.0];
        let mut s = Sampler::new(cfg(0.01), 4);
        for _ in 0..200 {
            assert_eq!(s.sample(&mut base.clone(), &[]), 0);
        }
        let mut s = Sampler::new(cfg(100.0), 4);
        let mut seen = [0u32; 4];
        for _ in 0..2000 {
            seen[s.sample(&mut base.clone(), &[]) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 350), "{seen:?}");
    }

    #[test]
    fn penalties_exact_values() {
        let c = SamplerConfig {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplerConfig::greedy()
        };
        let mut s = Sampler::new(c, 6);
        let mut l = vec![4.0f32, -4.0, 0.0, 3.0, 1.0, f32::NAN];
        // token 0 twice, token 1 once, token 2 three times, 5 once (NaN stays -inf),
        // 99 out of vocab (ignored).
        let tok = s.sample(&mut l, &[0, 1, 2, 0, 2, 2, 5, 99]);
        assert_eq!(l[0], 4.0 / 2.0 - 0.5 - 2.0 * 0.25); // 1.0
        assert_eq!(l[1], -4.0 * 2.0 - 0.5 - 0.25); // -8.75
        assert_eq!(l[2], 0.0 * 2.0 - 0.5 - 3.0 * 0.25); // -1.25
        assert_eq!(l[3], 3.0);
        assert_eq!(l[4], 1.0);
        assert_eq!(l[5], f32::NEG_INFINITY);
        assert_eq!(tok, 3);
        // Scratch counts were reset: a second call with no history changes nothing.
        let mut l2 = l.clone();
        s.sample(&mut l2, &[]);
        assert_eq!(l2, l);
        // And a second call with history applies the penalty once, not accumulated.
        let mut l3 = vec![4.0f32, -4.0, 0.0, 3.0, 1.0, 0.0];
        s.sample(&mut l3, &[0]);
        assert_eq!(l3[0], 4.0 / 2.0 - 0.5 - 0.25);
    }

    #[test]
    fn repetition_penalty_alone() {
        let mut s = Sampler::new(
            SamplerConfig {
                repetition_penalty: 1.3,
                ..SamplerConfig::greedy()
            },
            3,
        );
        let mut l = vec![2.6f32, -1.0, 2.5];
        // Seen token 0 drops below token 2.
        assert_eq!(s.sample(&mut l, &[0, 0, 0, 1]), 2);
        assert_eq!(l[0], 2.6 / 1.3);
        assert_eq!(l[1], -1.3); // the negative logit -1.0, times the penalty
    }

    #[test]
    fn stop_whole_and_spanning_tokens() {
        let mut sc = StopChecker::new(["</s>", "\n\nUser:"]);
        // Stream token pieces; the stop string spans three of them.
        let pieces = ["Hello", " world", "<", "/", "s>", " more"];
        let mut text = String::new();
        let mut emitted = 0;
        let mut out = String::new();
        let mut stopped = None;
        for p in pieces {
            text.push_str(p);
            match sc.check(&text) {
                StopCheck::Continue { safe_len } => {
                    assert!(safe_len >= emitted);
                    out.push_str(&text[emitted..safe_len]);
                    emitted = safe_len;
                }
                StopCheck::Stop { len, stop } => {
                    out.push_str(&text[emitted..len]);
                    stopped = Some(stop);
                    break;
                }
            }
        }
        assert_eq!(stopped, Some(0));
        assert_eq!(out, "Hello world");
    }

    #[test]
    fn stop_holdback() {
        let mut sc = StopChecker::new(["\n\nUser:"]);
        assert_eq!(sc.check("abc"), StopCheck::Continue { safe_len: 3 });
        assert_eq!(sc.check("abc\n"), StopCheck::Continue { safe_len: 3 });
        assert_eq!(sc.check("abc\n\nUs"), StopCheck::Continue { safe_len: 3 });
        // Diverges: everything becomes safe.
        assert_eq!(sc.check("abc\n\nUsx"), StopCheck::Continue { safe_len: 8 });
        assert_eq!(
            sc.check("abc\n\nUsx\n\nUser:"),
            StopCheck::Stop { len: 8, stop: 0 }
        );
    }

    #[test]
    fn stop_earliest_wins_and_multibyte() {
        let mut sc = StopChecker::new(["world", "lo w", ""]);
        assert_eq!(sc.stops().len(), 2);
        assert_eq!(sc.check("hello world"), StopCheck::Stop { len: 3, stop: 1 });
        // Multi-byte text: boundaries stay on chars; holdback of a multi-byte prefix.
        let mut sc = StopChecker::new(["émoji🙂end"]);
        assert_eq!(
            sc.check("ça va é"),
            StopCheck::Continue {
                safe_len: "ça va ".len()
            }
        );
        assert_eq!(
            sc.check("ça va émoji🙂"),
            StopCheck::Continue {
                safe_len: "ça va ".len()
            }
        );
        assert_eq!(
            sc.check("ça va émoji🙂en"),
            StopCheck::Continue {
                safe_len: "ça va ".len()
            }
        );
        assert_eq!(
            sc.check("ça va émoji🙂end!"),
            StopCheck::Stop {
                len: "ça va ".len(),
                stop: 0
            }
        );
        // No stops: everything is safe.
        let mut sc = StopChecker::new(Vec::<String>::new());
        assert!(sc.is_empty());
        assert_eq!(sc.check("abc"), StopCheck::Continue { safe_len: 3 });
    }

    #[test]
    fn stop_restart_on_shorter_text() {
        let mut sc = StopChecker::new(["ab"]);
        assert_eq!(sc.check("xxxxa"), StopCheck::Continue { safe_len: 4 });
        assert_eq!(sc.check("ab"), StopCheck::Stop { len: 0, stop: 0 });
        sc.reset();
        assert_eq!(sc.check("xab"), StopCheck::Stop { len: 1, stop: 0 });
    }

    #[test]
    fn device_top_k_path_draws_the_same_tokens() {
        // Candidates as the device returns them (best first, ties to the lower id) must give
        // the same draws as sampling the full logits with the same top_k and seed.
        let vocab = 5000;
        let mut logits: Vec<f32> = (0..vocab)
            .map(|i| ((i * 7919) % 1000) as f32 / 137.0)
            .collect();
        logits[17] = logits[4000]; // a tie
        for (k, t, p, mp) in [
            (40, 0.8, 0.95, 0.0),
            (5, 1.3, 1.0, 0.05),
            (64, 0.5, 0.9, 0.1),
        ] {
            let cfg = SamplerConfig {
                temperature: t,
                top_k: k,
                top_p: p,
                min_p: mp,
                seed: Some(9),
                ..Default::default()
            };
            let mut idx: Vec<u32> = (0..vocab as u32).collect();
            idx.sort_by(|&a, &b| {
                logits[b as usize]
                    .total_cmp(&logits[a as usize])
                    .then(a.cmp(&b))
            });
            let top: Vec<(u32, f32)> = idx[..k].iter().map(|&i| (i, logits[i as usize])).collect();
            let (mut full, mut dev) = (Sampler::new(cfg.clone(), vocab), Sampler::new(cfg, vocab));
            for _ in 0..200 {
                let a = full.sample(&mut logits.clone(), &[]);
                let b = dev.sample_top_k(&top);
                assert_eq!(a, b);
            }
        }
    }

    /// logit_bias moves greedy and sampled choices, bans a token at -100, and leaves the
    /// other tokens' logits as they were.
    #[test]
    fn logit_bias_moves_the_choice() {
        let logits = [0.1f32, 5.0, 2.0, 4.5, -1.0];
        let with = |bias: Vec<(u32, f32)>, temperature: f32| SamplerConfig {
            temperature,
            logit_bias: bias,
            seed: Some(7),
            ..Default::default()
        };
        let greedy = |c: SamplerConfig| Sampler::new(c, 5).sample(&mut logits.clone(), &[]);
        assert_eq!(greedy(with(vec![], 0.0)), 1);
        assert_eq!(greedy(with(vec![(3, 1.0)], 0.0)), 3, "4.5 + 1 beats 5");
        assert_eq!(greedy(with(vec![(1, -100.0)], 0.0)), 3, "banned");
        assert_eq!(
            greedy(with(vec![(9, 50.0)], 0.0)),
            1,
            "ids past the logits ignored"
        );
        assert!(
            !with(vec![(1, 0.5)], 0.0).no_penalties(),
            "biased logits go to the host"
        );
        // Sampling at a high temperature never draws the banned token.
        let mut s = Sampler::new(with(vec![(1, -100.0), (3, -100.0)], 2.0), 5);
        for _ in 0..200 {
            let t = s.sample(&mut logits.clone(), &[]);
            assert!(t != 1 && t != 3, "drew banned token {t}");
        }
        assert!(with(vec![(0, 101.0)], 1.0).validate().is_err());
        assert!(with(vec![(0, f32::NAN)], 1.0).validate().is_err());
    }
}
