//! State snapshots for speculative decoding (`Backend::kv_snapshots`, `kv_snapshot`,
//! `kv_restore`) on the tiny Hugging Face oracle checkpoints: a hybrid model's conv and
//! recurrent state rolled back to a snapshot continues exactly (bitwise, on the CPU) as if the
//! rolled-back tokens had never run; attention layers need no snapshot (their positions are
//! written again).

use std::path::{Path, PathBuf};

use ferrite_backend::cpu::CpuBackend;
use ferrite_backend::Backend;
use ferrite_models::{Logits, Model, ModelFile};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle")
}

const VOCAB_TOKENS: u32 = 1024;

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7919 + 13) % VOCAB_TOKENS)
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

struct Runner {
    be: CpuBackend,
    m: Model<CpuBackend>,
}

impl Runner {
    fn new(name: &str) -> Runner {
        let be = CpuBackend::new();
        let file = ModelFile::open(&data_dir().join(name)).expect("checkpoint opens");
        let m = Model::load(&be, &file, &|_, _| {}).expect("model loads");
        Runner { be, m }
    }

    /// A fresh cache with `prompt` prefilled in one step.
    fn prefilled(&self, prompt: &[u32]) -> <CpuBackend as Backend>::Kv {
        let mut kv = self.m.new_kv(&self.be, 64).unwrap();
        let mut ws = self
            .m
            .workspace(&self.be, prompt.len(), Logits::All)
            .unwrap();
        self.m
            .run(&self.be, &mut ws, &mut kv, 0, prompt, Logits::All)
            .unwrap();
        kv
    }

    /// Every row's logits of `tokens` decoded one per step from position `pos0`.
    fn decode(
        &self,
        kv: &mut <CpuBackend as Backend>::Kv,
        pos0: usize,
        tokens: &[u32],
    ) -> Vec<f32> {
        let mut ws = self.m.workspace(&self.be, 1, Logits::All).unwrap();
        self.m
            .run(&self.be, &mut ws, kv, pos0, tokens, Logits::All)
            .unwrap()
    }
}

/// Prefill, snapshot, decode 3 draft tokens, restore, decode them again: the same logits bit
/// for bit. Restore again and decode other tokens: the logits of a fresh run of that path.
/// A second slot taken after the first accepted draft token rolls back to there.
fn check_rollback(name: &str) {
    let r = Runner::new(name);
    let p = prompt(20);
    let pos = p.len();
    let draft = [101, 7, 555];
    let other = [42, 900, 3];

    let mut kv = r.prefilled(&p);
    r.be.kv_snapshots(&mut kv, 2).unwrap();
    r.be.kv_snapshot(&mut kv, 0).unwrap();
    let first = r.decode(&mut kv, pos, &draft);

    // Without a restore the state has moved on: the same tokens give other logits (so the
    // equalities below are not vacuous).
    let moved = r.decode(&mut kv, pos, &draft);
    assert_ne!(bits(&moved), bits(&first), "{name}: state did not change");

    r.be.kv_restore(&mut kv, 0).unwrap();
    let again = r.decode(&mut kv, pos, &draft);
    assert_eq!(
        bits(&again),
        bits(&first),
        "{name}: replay after restore differs"
    );

    r.be.kv_restore(&mut kv, 0).unwrap();
    let alt = r.decode(&mut kv, pos, &other);
    let mut fresh_kv = r.prefilled(&p);
    let fresh = r.decode(&mut fresh_kv, pos, &other);
    assert_eq!(
        bits(&alt),
        bits(&fresh),
        "{name}: rolled-back path differs from a fresh run"
    );

    // Accept the first draft token, reject the rest: snapshot after it (slot 1), run the
    // remaining drafts, roll back to slot 1 and continue with another token.
    r.be.kv_restore(&mut kv, 0).unwrap();
    r.decode(&mut kv, pos, &draft[..1]);
    r.be.kv_snapshot(&mut kv, 1).unwrap();
    r.decode(&mut kv, pos + 1, &draft[1..]);
    r.be.kv_restore(&mut kv, 1).unwrap();
    let tail = r.decode(&mut kv, pos + 1, &other[..2]);
    let mut fresh_kv = r.prefilled(&p);
    r.decode(&mut fresh_kv, pos, &draft[..1]);
    let fresh_tail = r.decode(&mut fresh_kv, pos + 1, &other[..2]);
    assert_eq!(
        bits(&tail),
        bits(&fresh_tail),
        "{name}: rollback to slot 1 differs"
    );
    // Slot 0 is untouched by the snapshot into slot 1.
    r.be.kv_restore(&mut kv, 0).unwrap();
    assert_eq!(
        bits(&r.decode(&mut kv, pos, &draft)),
        bits(&first),
        "{name}: slot 0 changed"
    );
}

#[test]
fn qwen35_rollback_is_exact() {
    check_rollback("qwen35-tiny");
}

#[test]
fn qwen35_moe_rollback_is_exact() {
    check_rollback("qwen35-moe-tiny");
}

#[test]
fn bad_slots_are_errors() {
    let r = Runner::new("qwen35-tiny");
    let mut kv = r.prefilled(&prompt(4));
    let e = r.be.kv_snapshot(&mut kv, 0).unwrap_err().to_string();
    assert!(e.contains("slot 0 of a cache with 0 slots"), "{e}");
    r.be.kv_snapshots(&mut kv, 2).unwrap();
    let e = r.be.kv_restore(&mut kv, 1).unwrap_err().to_string();
    assert!(e.contains("holds no snapshot"), "{e}");
    let e = r.be.kv_snapshot(&mut kv, 2).unwrap_err().to_string();
    assert!(e.contains("slot 2 of a cache with 2 slots"), "{e}");
    let e = r.be.kv_restore(&mut kv, 5).unwrap_err().to_string();
    assert!(e.contains("slot 5 of a cache with 2 slots"), "{e}");
    r.be.kv_snapshot(&mut kv, 1).unwrap();
    r.be.kv_restore(&mut kv, 1).unwrap();
    // New slots start empty.
    r.be.kv_snapshots(&mut kv, 2).unwrap();
    assert!(r.be.kv_restore(&mut kv, 1).is_err());
}

/// An attention-only model: slots hold nothing, rollback is just decoding at the old
/// position again (the positions are overwritten), and bad slots are still errors.
#[test]
fn attention_only_caches_roll_back_for_free() {
    let r = Runner::new("qwen3-tiny");
    let p = prompt(20);
    let pos = p.len();
    let mut kv = r.prefilled(&p);
    r.be.kv_snapshots(&mut kv, 1).unwrap();
    r.be.kv_snapshot(&mut kv, 0).unwrap();
    let first = r.decode(&mut kv, pos, &[101, 7, 555]);
    r.be.kv_restore(&mut kv, 0).unwrap();
    let alt = r.decode(&mut kv, pos, &[42, 900, 3]);
    let mut fresh_kv = r.prefilled(&p);
    assert_eq!(
        bits(&alt),
        bits(&r.decode(&mut fresh_kv, pos, &[42, 900, 3]))
    );
    r.be.kv_restore(&mut kv, 0).unwrap();
    assert_eq!(bits(&r.decode(&mut kv, pos, &[101, 7, 555])), bits(&first));
    assert!(r.be.kv_snapshot(&mut kv, 1).is_err());
}
