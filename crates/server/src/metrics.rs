//! Prometheus metrics in the text exposition format, written by hand (a handful of series).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use ferrite_engine::scheduler::Stats;

/// A cumulative histogram with fixed bucket bounds (seconds).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<(Vec<u64>, f64, u64)>,
}

/// Time to first token: from a few ms (GPU, short prompt) to a minute (CPU, long prompt).
const TTFT_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Inter-token latency: a few ms per token on a GPU to a second on a busy CPU.
const ITL_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            inner: Mutex::new((vec![0; bounds.len()], 0.0, 0)),
        }
    }

    pub fn observe(&self, v: f64) {
        let mut g = self.inner.lock().expect("metrics lock");
        for (i, &b) in self.bounds.iter().enumerate() {
            if v <= b {
                g.0[i] += 1;
            }
        }
        g.1 += v;
        g.2 += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let g = self.inner.lock().expect("metrics lock");
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&g.0) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", g.2);
        let _ = writeln!(out, "{name}_sum {}", g.1);
        let _ = writeln!(out, "{name}_count {}", g.2);
    }
}

/// Server-side counters; the scheduler's gauges come from its [`Stats`].
#[derive(Debug)]
pub struct Metrics {
    /// (endpoint, status) → count.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BOUNDS),
            itl: Histogram::new(ITL_BOUNDS),
        }
    }
}

impl Metrics {
    pub fn request(&self, endpoint: &str, status: u16) {
        *self
            .requests
            .lock()
            .expect("metrics lock")
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
    }

    pub fn render(&self, stats: &Stats) -> String {
        let mut out = String::new();
        let o = &mut out;
        let _ = writeln!(
            o,
            "# HELP ferrite_requests_total HTTP requests by endpoint and status.\n# TYPE ferrite_requests_total counter"
        );
        for ((ep, st), n) in self.requests.lock().expect("metrics lock").iter() {
            let _ = writeln!(
                o,
                "ferrite_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}"
            );
        }
        let counter = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |o: &mut String, name: &str, help: &str, v: usize| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(
            o,
            "ferrite_prompt_tokens_total",
            "Prompt tokens of finished requests.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            o,
            "ferrite_generation_tokens_total",
            "Generated tokens.",
            self.generation_tokens.load(Ordering::Relaxed),
        );
        counter(
            o,
            "ferrite_prefix_cache_hit_tokens_total",
            "Prompt tokens whose keys and values came from the prefix cache instead of prefill.",
            stats.prefix_hit_tokens.load(Ordering::Relaxed),
        );
        counter(
            o,
            "ferrite_preemptions_total",
            "Sequences preempted for lack of KV pages.",
            stats.preemptions.load(Ordering::Relaxed),
        );
        counter(
            o,
            "ferrite_backend_steps_total",
            "Backend forward steps (batched: one per scheduler iteration).",
            stats.steps.load(Ordering::Relaxed),
        );
        counter(
            o,
            "ferrite_step_sequences_total",
            "Sequences summed over the backend steps (divided by the steps: the mean batch).",
            stats.step_seqs.load(Ordering::Relaxed),
        );
        counter(
            o,
            "ferrite_decode_tokens_total",
            "Tokens decoded (one decode row of one sequence each).",
            stats.decode_steps.load(Ordering::Relaxed),
        );
        counter(
            o,
            "ferrite_spec_draft_tokens_total",
            "Draft tokens the MTP head proposed (speculative decoding).",
            stats.spec_drafted.load(Ordering::Relaxed),
        );
        counter(
            o,
            "ferrite_spec_accepted_tokens_total",
            "Draft tokens the model kept (speculative decoding).",
            stats.spec_accepted.load(Ordering::Relaxed),
        );
        self.ttft.write(
            o,
            "ferrite_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
        );
        self.itl.write(
            o,
            "ferrite_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
        );
        gauge(
            o,
            "ferrite_requests_running",
            "Sequences in the running batch.",
            stats.running.load(Ordering::Relaxed),
        );
        gauge(
            o,
            "ferrite_requests_waiting",
            "Requests waiting for admission.",
            stats.waiting.load(Ordering::Relaxed),
        );
        gauge(
            o,
            "ferrite_kv_pages_used",
            "KV cache pages in use.",
            stats.kv_pages_used.load(Ordering::Relaxed),
        );
        gauge(
            o,
            "ferrite_kv_pages_cached",
            "KV cache pages no sequence holds, kept for the prefix cache (evictable).",
            stats.kv_pages_cached.load(Ordering::Relaxed),
        );
        gauge(
            o,
            "ferrite_kv_pages_total",
            "KV cache pages in the budget.",
            stats.kv_pages_total.load(Ordering::Relaxed),
        );
        out
    }
}
