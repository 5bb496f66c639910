//! `ferrite check --device cpu` checks the CPU backend against itself: every case must pass
//! with NMSE 0 (the harness itself is what is under test here: case construction, output
//! poisoning, the capacity-row guard, graph capture fallback, the report).

use std::process::Command;

#[test]
fn check_cpu_against_itself_quick() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["check", "--device", "cpu", "--quick"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.trim_end().ends_with("ALL GREEN"), "{stdout}");
    assert!(!stdout.contains("FAIL"), "{stdout}");
    // Every Backend op has cases, even in the quick set: a new op without one fails here.
    assert!(
        stdout.contains("coverage: every Backend op has cases"),
        "{stdout}"
    );
    assert!(!stdout.contains("Backend ops with no case"), "{stdout}");
}

#[test]
fn check_filter_and_perf() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args([
            "check", "--device", "cpu", "--quick", "--filter", "swiglu", "--perf", "--reps", "2",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let lines: Vec<&str> = stdout.lines().filter(|l| l.contains(" OK")).collect();
    assert!(!lines.is_empty(), "{stdout}");
    assert!(
        lines.iter().all(|l| (l.starts_with("swiglu")
            || l.starts_with("matmul_swiglu")
            || l.starts_with("matmul_add+matmul_swiglu"))
            && l.contains("GB/s")),
        "{stdout}"
    );
}

/// `--eager` times the same cases by launches back to back (no graph): the same lines, and
/// it is refused without --perf.
#[test]
fn check_perf_eager() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_ferrite"))
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&[
        "check", "--device", "cpu", "--quick", "--filter", "swiglu", "--perf", "--eager", "--reps",
        "2",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let lines: Vec<&str> = stdout.lines().filter(|l| l.contains(" OK")).collect();
    assert!(!lines.is_empty(), "{stdout}");
    assert!(
        lines.iter().all(|l| l.contains("µs") && l.contains("GB/s")),
        "{stdout}"
    );
    let out = run(&["check", "--device", "cpu", "--quick", "--eager"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--perf"));
}
