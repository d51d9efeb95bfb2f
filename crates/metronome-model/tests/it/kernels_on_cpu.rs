//! This crate's CUDA kernels run on the CPU: `kernels/emulate/` compiles a kernel
//! source as C++ with each block's threads as fibers in lock step (`emulate.h` says
//! what that checks and what not), so CI, which has no GPU, checks the kernels' own
//! indexing, masking, tiling and sums, not only that nvcc compiles them. The GPU tests
//! (`devices.rs`, `cuda_kernel_*`) check them on a device against the portable forms.

use std::path::Path;
use std::process::Command;

/// The flash attention kernels (`kernels/attention.cu`): forward, `dq` and `dk`/`dv`
/// against attention computed in double from the same inputs, over a shared-prompt
/// tree, a nested tree and a plain row, in f32 (within 1e-5 and 1e-4 of the largest
/// magnitude, the portable forms' bounds) and bf16 (1e-2).
#[test]
fn flash_attention_kernels_emulated_on_the_cpu_match_attention_in_double() {
    emulated("attention", 8);
}

/// The decode layout's kernels of `kernels/decode.cu`: `decode_project` (bias,
/// rotation, cache writes through out-of-order block tables; every other cache row
/// kept) and `decode_attention` with padding rows (zeros), against double, with and
/// without a bias, f32 (1e-6 and 1e-5) and bf16 (1e-2), heads of 32 and 64.
#[test]
fn decode_kernels_emulated_on_the_cpu_match_double() {
    emulated("decode", 8);
}

/// The decode layout's kernels of `kernels/layer.cu`: `add_rms_norm` (the sum exactly
/// as the composed add rounds it, the norm within 1e-6 in f32 and 1e-2 in bf16) and
/// `swiglu_stacked`, on rows wider than a block's threads.
#[test]
fn layer_kernels_emulated_on_the_cpu_match_double() {
    emulated("layer", 4);
}

/// Compiles `kernels/emulate/{program}.cpp`, runs it, and expects `checks` lines that
/// end in ` ok` and a zero exit.
fn emulated(program: &str, checks: usize) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/emulate");
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{program}-emulated"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned());
    let compiled = Command::new(&cxx)
        .args(["-std=c++20", "-O2", "-fno-strict-aliasing", "-I"])
        .arg(&dir)
        .arg(dir.join(format!("{program}.cpp")))
        .arg("-o")
        .arg(&exe)
        .output();
    let compiled = match compiled {
        Ok(out) => out,
        // CI installs a C++ compiler (.ci/run): there a missing one is a failure.
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("skipped: no C++ compiler `{cxx}` ({e}); set CXX");
            return;
        }
        Err(e) => panic!("running the C++ compiler `{cxx}`: {e}"),
    };
    assert!(
        compiled.status.success(),
        "compiling the emulation of {program}:\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    eprintln!("{report}{}", String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "the emulated {program} kernels are off their bounds:\n{report}");
    assert_eq!(report.lines().filter(|l| l.ends_with(" ok")).count(), checks, "{report}");
}
