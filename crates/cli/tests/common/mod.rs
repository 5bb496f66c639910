//! Helpers shared by the integration tests that rewrite a synthetic GGUF and compare logits.

use std::path::Path;

use ferrite_backend::cpu::CpuBackend;
use ferrite_formats::gguf::{GgufFile, GgufTensorInfo, GgufWriter};
use ferrite_formats::quant::StoredType;
use ferrite_models::{Logits, Model, ModelFile};

/// The CPU reference's logits at every position of `tokens`, run through the model at `path`.
pub fn cpu_logits(path: &Path, tokens: &[u32]) -> Vec<f32> {
    let be = CpuBackend::new();
    let file = ModelFile::open(path).unwrap();
    let m: Model<CpuBackend> = Model::load(&be, &file, &|_, _| {}).unwrap();
    let mut kv = m.new_kv(&be, tokens.len()).unwrap();
    let mut ws = m.workspace(&be, tokens.len(), Logits::All).unwrap();
    m.run(&be, &mut ws, &mut kv, 0, tokens, Logits::All)
        .unwrap()
}

/// `src` rewritten into each of `dsts`: its metadata (the alignment aside) and its tensors in
/// order, tensor `i` stored in destination `k` as the type and bytes `f(i, info, bytes)[k]`.
pub fn rewrite_tensors<const N: usize>(
    src: &Path,
    dsts: [&Path; N],
    mut f: impl FnMut(usize, &GgufTensorInfo, &[u8]) -> [(StoredType, Vec<u8>); N],
) {
    let file = GgufFile::open(src).unwrap();
    let mut ws = dsts.map(|d| GgufWriter::create(d).unwrap());
    for w in &mut ws {
        w.add_metadata_of(&file).unwrap();
    }
    let mut data = Vec::new();
    for (i, info) in file.tensor_infos().iter().enumerate() {
        let out = f(i, info, file.tensor_data(info));
        for (w, (ty, _)) in ws.iter_mut().zip(&out) {
            w.add_tensor_info(&info.name, *ty, &info.shape).unwrap();
        }
        data.push((info.name.clone(), out));
    }
    for w in &mut ws {
        w.write_header().unwrap();
    }
    for (name, out) in &data {
        for (w, (_, bytes)) in ws.iter_mut().zip(out) {
            w.write_tensor_data(name, bytes).unwrap();
        }
    }
    for w in ws {
        w.finish().unwrap();
    }
}
