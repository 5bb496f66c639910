//! The end-to-end gates of `ferrite check` run the CPU backend against itself here (no GPU in
//! CI): every comparison must pass with zero difference, which exercises the oracle loading,
//! the synthetic models and the gate plumbing that the GPU run relies on.

use std::path::Path;

use ferrite_backend::cpu::CpuBackend;

#[test]
fn e2e_gates_cpu_against_itself() {
    let oracle = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle");
    let scratch = std::env::temp_dir().join(format!("ferrite-e2e-{}", std::process::id()));
    let failed = ferrite_cli::check_e2e::run(&CpuBackend::new(), &oracle, &scratch).unwrap();
    std::fs::remove_dir_all(&scratch).ok();
    assert_eq!(failed, 0);
}
