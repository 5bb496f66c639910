//! `synth --mtp` writes a random MTP head beside a Qwen3.5 GGUF (`X.mtp.safetensors`, Hugging
//! Face names), which `Model::load_mtp` finds there; speculation with it is then gate-3 exact
//! (greedy output with the head's drafts equals plain greedy decode) on the CPU.

use ferrite_backend::cpu::CpuBackend;
use ferrite_cli::synth::{self, Preset, SynthArgs, SynthQuant};
use ferrite_engine::speculative::{plain_greedy, speculative_greedy, MtpDrafter};
use ferrite_models::{Model, ModelFile};

#[test]
fn synth_mtp_head_loads_beside_the_gguf_and_speculates_exactly() {
    let dir = std::env::temp_dir().join(format!("ferrite-synth-mtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for preset in [Preset::TinyQwen35, Preset::TinyQwen35Moe] {
        let path = dir.join(format!("{preset:?}.gguf"));
        synth::synth(&SynthArgs {
            preset,
            quant: SynthQuant::Q8_0,
            output: path.clone(),
            vocab: None,
            seed: 4,
            layers: None,
            mtp: true,
        })
        .unwrap();
        assert!(dir.join(format!("{preset:?}.mtp.safetensors")).is_file());
        let be = CpuBackend::new();
        let file = ModelFile::open(&path).unwrap();
        let mut m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).unwrap();
        m.load_mtp(&be, &file).unwrap();
        assert!(m.has_mtp());
        let prompt: Vec<u32> = (0..9u32).map(|i| 100 + (i * 7919) % 5000).collect();
        let want = plain_greedy(&be, &m, &prompt, 24).unwrap();
        for depth in [1, 4] {
            let (got, _, st) =
                speculative_greedy(&be, &m, &prompt, 24, depth, &mut MtpDrafter).unwrap();
            assert_eq!(got, want, "{preset:?}: depth {depth}");
            assert_eq!(st.accepted + st.steps, 23);
        }
    }
    // A non-hybrid preset has no head to write.
    let e = synth::synth(&SynthArgs {
        preset: Preset::TinyQwen3,
        quant: SynthQuant::Q8_0,
        output: dir.join("q3.gguf"),
        vocab: None,
        seed: 4,
        layers: None,
        mtp: true,
    })
    .unwrap_err()
    .to_string();
    std::fs::remove_dir_all(&dir).ok();
    assert!(e.contains("only the Qwen3.5 presets"), "{e}");
}
