//! The batching identity gate on the CPU reference backend: a batched step over a paged KV
//! cache — decode rows and prefill chunks of several sequences at different positions, their
//! pages scattered through a shared pool — gives bitwise the same logits for every sequence
//! as that sequence run alone through the single-sequence API (contiguous cache, one prefill
//! of the whole prompt), for the last row of each sequence or for several of its last rows
//! (a speculative verify's).

use std::path::{Path, PathBuf};

use ferrite_backend::cpu::CpuBackend;
use ferrite_backend::{Backend, PagedKv, SeqRows};
use ferrite_models::{Logits, Model, ModelFile};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle")
}

/// SplitMix64: a small deterministic generator for schedules and tokens.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const PAGE: usize = 4;
const MAX_PAGES: usize = 16;

/// Runs `lens.len()` sequences of random tokens through batched steps of a random schedule
/// (each step: a random subset of the unfinished sequences, each with a chunk of 1..=12
/// tokens, some asking for the logits of several of their last rows, then decode-only steps)
/// and compares every sequence's logits after each of its chunks with the logits of the same
/// positions from the sequence alone.
fn check_batched_identity(name: &str, lens: &[usize], seed: u64) {
    let file = ModelFile::open(&data_dir().join(name)).expect("checkpoint opens");
    let be = CpuBackend::new();
    let m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).expect("model loads");
    let vocab = m.cfg.vocab;
    let mut rng = Rng(seed);
    let seqs: Vec<Vec<u32>> = lens
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(vocab) as u32).collect())
        .collect();

    // Alone: each sequence through the single-sequence API, logits of every position.
    let alone: Vec<Vec<f32>> = seqs
        .iter()
        .map(|toks| {
            let mut kv = m.new_kv(&be, toks.len()).unwrap();
            let mut ws = m.workspace(&be, toks.len(), Logits::All).unwrap();
            m.run(&be, &mut ws, &mut kv, 0, toks, Logits::All).unwrap()
        })
        .collect();

    // Batched: a shared pool of pages handed out in a shuffled order.
    let n_pages = seqs.iter().map(|s| s.len().div_ceil(PAGE)).sum::<usize>() + 3;
    let mut pool: Vec<u32> = (0..n_pages as u32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, rng.below(i + 1));
    }
    let max_rows = 12 * seqs.len();
    let mut kv = m
        .new_paged_kv(
            &be,
            PagedKv {
                n_pages,
                page_size: PAGE,
                max_pages: MAX_PAGES,
                max_rows: seqs.len(),
                q8_0: false,
            },
            seqs.len(),
        )
        .unwrap();
    let mut ws = m
        .batch_workspace(&be, max_rows, seqs.len(), max_rows, MAX_PAGES, PAGE)
        .unwrap();
    let mut done = vec![0usize; seqs.len()];
    let mut pages: Vec<Vec<u32>> = vec![vec![]; seqs.len()];
    let (mut steps, mut checked, mut mixed, mut several) = (0, 0, 0, 0);
    while done.iter().zip(&seqs).any(|(d, s)| *d < s.len()) {
        // The first steps mix prefill chunks and single rows; after that, decode only.
        let decode_only = steps >= 6;
        let mut plan = vec![];
        for (i, s) in seqs.iter().enumerate() {
            let left = s.len() - done[i];
            if left == 0 || (!decode_only && rng.below(4) == 0) {
                continue;
            }
            let n = if decode_only {
                1
            } else {
                (1 + rng.below(12)).min(left)
            };
            // Logits of its last l rows: one, or (a third of the chunks) up to all of them.
            let l = if n > 1 && rng.below(3) == 0 {
                several += 1;
                1 + rng.below(n)
            } else {
                1
            };
            while pages[i].len() * PAGE < done[i] + n {
                pages[i].push(pool.pop().expect("enough pages"));
            }
            plan.push((i, n, l));
        }
        if plan.is_empty() {
            continue;
        }
        if plan.iter().any(|&(_, n, _)| n > 1) && plan.iter().any(|&(_, n, _)| n == 1) {
            mixed += 1;
        }
        let rows: Vec<SeqRows> = plan
            .iter()
            .map(|&(i, n, l)| SeqRows {
                tokens: &seqs[i][done[i]..done[i] + n],
                pos0: done[i],
                pages: &pages[i],
                logits: l,
                state: i,
            })
            .collect();
        be.set_batch(&mut ws.step, &rows).unwrap();
        m.forward(&be, &mut ws, &mut kv, Logits::SeqLast).unwrap();
        let logits = be.to_host(&ws.logits).unwrap();
        let wanted: usize = plan.iter().map(|p| p.2).sum();
        assert_eq!(logits.len(), wanted * vocab);
        let mut row = 0;
        for &(i, n, l) in &plan {
            for pos in done[i] + n - l..done[i] + n {
                let got = &logits[row * vocab..(row + 1) * vocab];
                let want = &alone[i][pos * vocab..(pos + 1) * vocab];
                let same = got
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{name}: sequence {i} at position {pos} (step {steps}, {} sequences, \
                     {} rows): batched logits differ from the sequence alone",
                    plan.len(),
                    ws.step.rows
                );
                checked += 1;
                row += 1;
            }
            done[i] += n;
        }
        steps += 1;
    }
    assert!(
        mixed > 0 && several > 0,
        "the schedule never mixed prefill chunks and decode rows ({mixed}) or asked for \
         several rows' logits ({several})"
    );
    println!("{name}: {steps} batched steps, {checked} sequence logits bitwise equal");
}

#[test]
fn batched_steps_equal_sequences_alone_qwen3() {
    check_batched_identity("qwen3-tiny", &[23, 7, 40, 1, 15, 33], 1);
}

#[test]
fn batched_steps_equal_sequences_alone_llama() {
    check_batched_identity("llama-tiny", &[30, 2, 17, 9], 4);
}

#[test]
fn batched_steps_equal_sequences_alone_moe() {
    check_batched_identity("qwen3-moe-tiny", &[12, 25, 3, 19, 40], 3);
}

/// Qwen3.5 hybrids: each sequence's Gated DeltaNet layers continue its own state slot of the
/// pooled cache, its gated attention layers read its own pages.
#[test]
fn batched_steps_equal_sequences_alone_qwen35() {
    check_batched_identity("qwen35-tiny", &[19, 4, 37, 1, 26], 5);
}

#[test]
fn batched_steps_equal_sequences_alone_qwen35_moe() {
    check_batched_identity("qwen35-moe-tiny", &[28, 9, 2, 33], 8);
}

/// The single-sequence API keeps working next to batched steps: a batched step of several
/// sequences on a contiguous cache is refused, and a paged cache refuses set_step.
#[test]
fn paged_and_contiguous_caches_refuse_the_other_step_kind() {
    let file = ModelFile::open(&data_dir().join("qwen3-tiny")).unwrap();
    let be = CpuBackend::new();
    let m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).unwrap();
    let paged = PagedKv {
        n_pages: 8,
        page_size: PAGE,
        max_pages: MAX_PAGES,
        max_rows: 2,
        q8_0: false,
    };
    let mut ws = m.batch_workspace(&be, 8, 2, 2, MAX_PAGES, PAGE).unwrap();
    let (p0, p1) = ([0u32, 1], [2u32]);
    let rows = [
        SeqRows {
            tokens: &[5, 6, 7],
            pos0: 0,
            pages: &p0,
            logits: 1,
            state: 0,
        },
        SeqRows {
            tokens: &[9],
            pos0: 0,
            pages: &p1,
            logits: 1,
            state: 1,
        },
    ];
    be.set_batch(&mut ws.step, &rows).unwrap();
    let mut contiguous = m.new_kv(&be, 16).unwrap();
    let e = m
        .forward(&be, &mut ws, &mut contiguous, Logits::SeqLast)
        .unwrap_err();
    assert!(format!("{e:#}").contains("paged"), "{e:#}");

    let mut kv = m.new_paged_kv(&be, paged, 2).unwrap();
    be.set_step(&mut ws.step, &[5, 6], 0).unwrap();
    let e = m.forward(&be, &mut ws, &mut kv, Logits::Last).unwrap_err();
    assert!(format!("{e:#}").contains("batched step"), "{e:#}");

    // Pages that do not cover the positions are refused before anything runs.
    let short = [SeqRows {
        tokens: &[1, 2, 3, 4, 5],
        pos0: 0,
        pages: &p1,
        logits: 1,
        state: 0,
    }];
    assert!(be.set_batch(&mut ws.step, &short).is_err());
    // Two sequences of a step on one state slot are refused.
    let shared = [
        rows[0],
        SeqRows {
            state: 0,
            ..rows[1]
        },
    ];
    let e = be.set_batch(&mut ws.step, &shared).unwrap_err();
    assert!(format!("{e:#}").contains("state slot"), "{e:#}");

    // A hybrid model's pooled cache: its state slots are checked, and it takes only batched
    // steps (a single-sequence step names no slot).
    let hybrid = ModelFile::open(&data_dir().join("qwen35-tiny")).unwrap();
    let h: Model<CpuBackend> = Model::load(&be, &hybrid, &|_, _| {}).unwrap();
    let mut hkv = h.new_paged_kv(&be, paged, 2).unwrap();
    let mut hws = h.batch_workspace(&be, 8, 2, 2, MAX_PAGES, PAGE).unwrap();
    be.set_batch(&mut hws.step, &rows).unwrap();
    h.forward(&be, &mut hws, &mut hkv, Logits::SeqLast).unwrap();
    let outside = [
        rows[0],
        SeqRows {
            state: 2,
            ..rows[1]
        },
    ];
    be.set_batch(&mut hws.step, &outside).unwrap();
    let e = h
        .forward(&be, &mut hws, &mut hkv, Logits::SeqLast)
        .unwrap_err();
    assert!(format!("{e:#}").contains("state slot 2"), "{e:#}");
    assert!(be.kv_clear_state(&mut hkv, 2).is_err());
    be.set_step(&mut hws.step, &[5, 6], 0).unwrap();
    assert!(h.forward(&be, &mut hws, &mut hkv, Logits::Last).is_err());
    // Pooled caches take no snapshots (speculation runs per sequence).
    assert!(be.kv_snapshots(&mut hkv, 1).is_err());
}
