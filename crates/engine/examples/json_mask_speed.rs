//! What JSON output costs a step: the time of `json_mode::mask` over a vocabulary, at a few
//! points of an output (`cargo run --release -p ferrite-engine --example json_mask_speed --
//! [PATH]`: a tokenizer.json, or a GGUF with a tokenizer; by default Qwen2's 151,936-token
//! vocabulary, tests/data/tokenizers/qwen2-gguf/ggml-vocab-qwen2.gguf).

use std::time::Instant;

use ferrite_engine::json_mode::{mask, JsonState, Schema};
use ferrite_tokenizer::Tokenizer;

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "tests/data/tokenizers/qwen2-gguf/ggml-vocab-qwen2.gguf".into());
    let tok = if path.ends_with(".json") {
        Tokenizer::from_json_file(std::path::Path::new(&path), None)?
    } else {
        Tokenizer::from_gguf(&ferrite_formats::gguf::GgufFile::open(
            std::path::Path::new(&path),
        )?)?
    };
    let schema = Schema::any_object();
    let vocab = tok.vocab_size();
    for (what, prefix) in [
        ("before the object", ""),
        ("inside a string", "{\"name\": \"Par"),
        ("after a value", "{\"name\": \"Paris\""),
        ("inside a number", "{\"n\": 12"),
    ] {
        let mut st = JsonState::default();
        for b in prefix.bytes() {
            anyhow::ensure!(st.feed(&schema, b), "{prefix}");
        }
        let mut logits = vec![0f32; vocab];
        let reps = 20;
        let t0 = Instant::now();
        let mut kept = 0;
        for _ in 0..reps {
            logits.fill(0.0);
            kept = mask(&st, &schema, &tok, false, &mut logits);
        }
        println!(
            "{what:>18}: {:.2} ms a step over {vocab} tokens ({} threads), {kept} allowed",
            t0.elapsed().as_secs_f64() * 1e3 / reps as f64,
            rayon::current_num_threads()
        );
    }
    Ok(())
}
