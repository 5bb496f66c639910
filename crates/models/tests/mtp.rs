//! The MTP head against its oracle (tools/oracle/mtp_oracle.py): a float64 numpy head,
//! built on a decoder layer that reproduces transformers' own full-attention layer of the
//! same fixtures to NMSE ~3e-14, with seeded bf16 MTP weights (`mtp.safetensors` beside
//! each tiny Qwen3.5 checkpoint) and transformers' final hidden states as its input.

mod common;

use common::{data_dir, nmse};
use ferrite_backend::cpu::CpuBackend;
use ferrite_backend::Backend;
use ferrite_models::{Logits, Model, ModelFile};

/// The head's logits against the float64 oracle: f32 summation order is the only
/// difference (as the models' own oracle bar in oracle.rs: ~1e-12 expected, and a wrong
/// norm, column half or position gives ≥ 1e-2).
const ORACLE_NMSE: f64 = 1e-5;

struct MtpOracle {
    hidden_in: Vec<f32>,
    tokens_in: Vec<u32>,
    logits: Vec<f32>,
    draft_hidden: Vec<f32>,
}

fn read_mtp_oracle(name: &str) -> MtpOracle {
    let bytes = std::fs::read(data_dir().join(name).join("mtp_oracle.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |n: &str| -> Vec<f32> {
        let t = st.tensor(n).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{n}");
        t.data()
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let tokens_in = st
        .tensor("tokens_in")
        .unwrap()
        .data()
        .chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    MtpOracle {
        hidden_in: f32s("hidden_in"),
        tokens_in,
        logits: f32s("logits"),
        draft_hidden: f32s("draft_hidden"),
    }
}

fn argmaxes(v: &[f32], vocab: usize) -> Vec<usize> {
    v.chunks(vocab)
        .map(|r| {
            r.iter()
                .enumerate()
                .fold(0, |b, (i, &x)| if x > r[b] { i } else { b })
        })
        .collect()
}

fn load(name: &str) -> (CpuBackend, Model<CpuBackend>) {
    let be = CpuBackend::new();
    let file = ModelFile::open(&data_dir().join(name)).unwrap();
    let mut m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).unwrap();
    m.load_mtp(&be, &file).expect("the MTP head loads");
    (be, m)
}

/// The head alone, fed transformers' hidden states: logits and draft hidden states.
fn check_head(name: &str) {
    let o = read_mtp_oracle(name);
    let (be, m) = load(name);
    assert!(m.has_mtp());
    let (t, h, vocab) = (o.tokens_in.len(), m.cfg.hidden, m.cfg.vocab);
    let mut kv = m.new_kv(&be, t).unwrap();
    let mut ws = m.workspace(&be, t, Logits::All).unwrap();
    let hidden = be.from_host(&o.hidden_in, t, h).unwrap();
    // Row i: token x[i+1] with h[i], at position i.
    be.set_step(&mut ws.step, &o.tokens_in, 0).unwrap();
    m.mtp_forward(&be, &mut ws, &hidden, &mut kv, Logits::All)
        .unwrap();
    let logits = be.to_host(&ws.logits).unwrap();
    let dh = be.to_host(ws.hidden()).unwrap();
    let (e, eh) = (nmse(&logits, &o.logits), nmse(&dh, &o.draft_hidden));
    println!("{name}: MTP logits NMSE {e:.2e}, draft hidden NMSE {eh:.2e}");
    assert!(
        e < ORACLE_NMSE && eh < ORACLE_NMSE,
        "{name}: {e:e} / {eh:e}"
    );
    assert_eq!(argmaxes(&logits, vocab), argmaxes(&o.logits, vocab));

    // Token by token (the decode shape): the same rows, one step each, the head's cache
    // carrying the earlier positions.
    let mut kv = m.new_kv(&be, t).unwrap();
    let mut ws1 = m.workspace(&be, 1, Logits::Last).unwrap();
    let mut stepped = Vec::new();
    for i in 0..t {
        let row = be
            .from_host(&o.hidden_in[i * h..(i + 1) * h], 1, h)
            .unwrap();
        be.set_step(&mut ws1.step, &o.tokens_in[i..i + 1], i)
            .unwrap();
        m.mtp_forward(&be, &mut ws1, &row, &mut kv, Logits::Last)
            .unwrap();
        stepped.extend(be.to_host(&ws1.logits).unwrap());
    }
    let e1 = nmse(&stepped, &o.logits);
    println!("{name}: MTP logits one row at a time NMSE {e1:.2e}");
    assert!(e1 < ORACLE_NMSE, "{name}: {e1:e}");
}

#[test]
fn mtp_head_matches_oracle_dense() {
    check_head("qwen35-tiny");
}

#[test]
fn mtp_head_matches_oracle_moe() {
    check_head("qwen35-moe-tiny");
}

/// End to end: the model's own final hidden states (not transformers') feed the head, as
/// speculative decoding runs it; the logits still meet the oracle.
#[test]
fn mtp_head_on_the_models_own_hidden_states() {
    for name in ["qwen35-tiny", "qwen35-moe-tiny"] {
        let o = read_mtp_oracle(name);
        let (be, m) = load(name);
        let t = o.tokens_in.len();
        let oracle = common::read_oracle(&data_dir().join(name));
        let mut kv = m.new_kv(&be, t + 1).unwrap();
        let mut ws = m.workspace(&be, t, Logits::All).unwrap();
        // The target over x[0..t): its hidden rows h[0..t).
        be.set_step(&mut ws.step, &oracle.tokens[..t], 0).unwrap();
        m.forward(&be, &mut ws, &mut kv, Logits::All).unwrap();
        let hidden = be
            .from_host(&be.to_host(ws.hidden()).unwrap(), t, m.cfg.hidden)
            .unwrap();
        let mut mws = m.workspace(&be, t, Logits::All).unwrap();
        be.set_step(&mut mws.step, &o.tokens_in, 0).unwrap();
        m.mtp_forward(&be, &mut mws, &hidden, &mut kv, Logits::All)
            .unwrap();
        let e = nmse(&be.to_host(&mws.logits).unwrap(), &o.logits);
        println!("{name}: MTP on the model's hidden states NMSE {e:.2e}");
        assert!(e < ORACLE_NMSE, "{name}: {e:e}");
    }
}

#[test]
fn mtp_head_absent_or_wrong_model_is_a_clear_error() {
    let be = CpuBackend::new();
    // A plain Qwen3 has no MTP head of this kind.
    let file = ModelFile::open(&data_dir().join("qwen3-tiny")).unwrap();
    let mut m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).unwrap();
    let e = m.load_mtp(&be, &file).unwrap_err().to_string();
    assert!(e.contains("Qwen3.5"), "{e}");
    // A Qwen3.5 checkpoint without `mtp.*` tensors (the head file left out).
    let dir = std::env::temp_dir().join(format!("ferrite-no-mtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(data_dir().join("qwen35-tiny").join(f), dir.join(f)).unwrap();
    }
    let file = ModelFile::open(&dir).unwrap();
    let mut m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).unwrap();
    let e = format!("{:#}", m.load_mtp(&be, &file).unwrap_err());
    std::fs::remove_dir_all(&dir).ok();
    assert!(e.contains("no multi-token-prediction head"), "{e}");
    assert!(!m.has_mtp());
}
