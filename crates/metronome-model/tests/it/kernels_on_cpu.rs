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

/// The draw kernels of `kernels/draw.cu` draw what the host's reference
/// (`draw::draw_row`) draws from the same logits: the plain draw (temperature, greedy);
/// the truncated one (top-k, top-p, min-p and their combinations, `k` past the
/// vocabulary, `min_p = 1` keeping only the tied maxima); the plain one on rows
/// penalised by `penalise_rows` (factors above and below 1, repeated ids and ids past
/// the vocabulary, an empty context) and the raw log-prob of what it drew
/// (`raw_logprobs`); over rows with ties, NaN and `-inf`, f32 and bf16: the same token,
/// and log-probs within 1e-6 (their sums run in another order); a row without a finite
/// maximum comes back undrawn from both.
#[test]
fn draw_kernels_emulated_on_the_cpu_draw_what_the_host_draws() {
    use metronome_model::draw::{DrawScratch, draw_row};
    use metronome_model::{Draw, Penalty, Truncation};
    use std::fmt::Write as _;

    let Some(exe) = compile("draw") else { return };
    let truncations = [
        Truncation { top_k: 1, ..Truncation::NONE },
        Truncation { top_k: 7, ..Truncation::NONE },
        Truncation { top_k: 299, ..Truncation::NONE },
        Truncation { top_k: 5000, ..Truncation::NONE },
        Truncation { top_p: 0.3, ..Truncation::NONE },
        Truncation { top_p: 0.9, ..Truncation::NONE },
        Truncation { top_p: 0.999, ..Truncation::NONE },
        Truncation { min_p: 0.05, ..Truncation::NONE },
        Truncation { min_p: 1.0, ..Truncation::NONE },
        Truncation { top_k: 40, top_p: 0.95, min_p: 0.01 },
        Truncation { top_k: 3, top_p: 0.5, min_p: 0.0 },
    ];
    let (rows, vocab) = (66usize, 300usize);
    // Each row's context: up to five ids, repeated, some past the vocabulary; none in a fourth.
    let contexts: Vec<Vec<u32>> = (0..rows as u64)
        .map(|r| (0..(r % 4) * 9).map(|j| (metronome_core::mix64(r * 31 + j % 5) % 330) as u32).collect())
        .collect();
    for bf16 in [false, true] {
        let mut draws = Vec::new();
        let mut logits = vec![0f32; rows * vocab];
        for (r, row) in logits.chunks_exact_mut(vocab).enumerate() {
            let r64 = r as u64;
            // Multiples of 1/8 in [-6, 6): bf16 holds them exactly, and many tie.
            for (i, x) in row.iter_mut().enumerate() {
                *x = (metronome_core::mix64(r64 * 7919 + i as u64) % 96) as f32 / 8.0 - 6.0;
            }
            row[(r * 13) % vocab] = f32::NAN;
            row[(r * 29 + 1) % vocab] = f32::NEG_INFINITY;
            if r == rows - 1 {
                row.fill(f32::NEG_INFINITY);
                row[3] = f32::NAN;
            }
            let temperature = [0.7, 1.0, 1.3, 0.0, 0.4][r % 5];
            let u = (metronome_core::mix64(r64 + 1234) >> 11) as f64 / (1u64 << 53) as f64;
            let mut truncation = truncations[r % truncations.len()];
            if r == rows - 2 {
                // -0 ties +0, as the host compares them: the top two are tokens 0 and 1.
                row.fill(0.0);
                row[0] = -0.0;
                truncation = Truncation { top_k: 2, ..Truncation::NONE };
            }
            let penalty = Penalty { factor: [1.7, 0.6, 1.0, 3.0][r % 4], context: &contexts[r] };
            draws.push(Draw { truncation, penalty: Some(penalty), ..Draw::new(temperature, u) });
        }
        let mut input = format!("{} {rows} {vocab}\n", u32::from(bf16));
        let mut ids = Vec::new();
        for d in &draws {
            let inv = metronome_model::draw::inv_temperature(d.temperature);
            let t = d.truncation;
            let floor = t.min_p_floor();
            let greedy = u32::from(d.temperature == 0.0);
            let penalty = d.penalty.unwrap();
            penalty.distinct(vocab, &mut ids);
            let (inv, u, p, floor) = (inv.to_bits(), d.u.to_bits(), t.top_p.to_bits(), floor.to_bits());
            write!(
                input,
                "{inv:x} {u:x} {greedy} {} {p:x} {floor:x} {:x} {}",
                t.top_k,
                penalty.factor.to_bits(),
                ids.len()
            )
            .unwrap();
            for id in &ids {
                write!(input, " {id}").unwrap();
            }
            input.push('\n');
        }
        for x in &logits {
            let bits = if bf16 { x.to_bits() >> 16 } else { x.to_bits() };
            write!(input, "{bits:x} ").unwrap();
        }
        let out = run(&exe, &input);
        let mut scratch = DrawScratch::default();
        let mut compared = [0usize; 4];
        for (r, line) in out.lines().enumerate() {
            let f: Vec<u32> = line.split(' ').map(|v| u32::from_str_radix(v, 16).unwrap()).collect();
            let row = &logits[r * vocab..(r + 1) * vocab];
            let d = draws[r];
            let plain = Draw { truncation: Truncation::NONE, penalty: None, ..d };
            let kernels = [
                (f[0], f32::from_bits(f[1])),
                (f[2], f32::from_bits(f[3])),
                (f[4], f32::from_bits(f[5])),
                (f[4], f32::from_bits(f[6])),
            ];
            let references = [
                // The plain kernel reads no truncation; greedy rows never reach the truncated one.
                Some(plain),
                (d.temperature != 0.0).then_some(Draw { penalty: None, ..d }),
                Some(Draw { truncation: Truncation::NONE, ..d }),
                Some(Draw { truncation: Truncation::NONE, raw_logprob: true, ..d }),
            ];
            for (k, ((token, logprob), reference)) in kernels.into_iter().zip(references).enumerate() {
                let Some(reference) = reference else { continue };
                let what = format!("bf16 {bf16}, row {r}, {reference:?}, kernel {k}");
                match draw_row(row, reference, &mut scratch) {
                    Ok(host) => {
                        assert_eq!(token, host.token, "{what}");
                        assert!(
                            (logprob - host.logprob).abs() <= 1e-6,
                            "{what}: {logprob} vs {}",
                            host.logprob
                        );
                        compared[k] += 1;
                    }
                    Err(_) => assert_eq!(token, u32::MAX, "{what}: a row without a finite maximum"),
                }
            }
        }
        let all = rows - 1;
        assert_eq!(compared, [all, all - all.div_ceil(5), all, all], "every row compared");
    }
}

/// Compiles `kernels/emulate/{program}.cpp`, runs it, and expects `checks` lines that
/// end in ` ok` and a zero exit.
fn emulated(program: &str, checks: usize) {
    let Some(exe) = compile(program) else { return };
    let run = Command::new(&exe).output().unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    eprintln!("{report}{}", String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "the emulated {program} kernels are off their bounds:\n{report}");
    assert_eq!(report.lines().filter(|l| l.ends_with(" ok")).count(), checks, "{report}");
}

/// Runs the emulation `exe` with `input` on its stdin; its stdout.
fn run(exe: &Path, input: &str) -> String {
    use std::io::Write as _;
    let mut child = Command::new(exe)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}: {}", exe.display(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Compiles `kernels/emulate/{program}.cpp`; `None` (the test skipped) when there is no
/// C++ compiler outside CI.
fn compile(program: &str) -> Option<std::path::PathBuf> {
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
            return None;
        }
        Err(e) => panic!("running the C++ compiler `{cxx}`: {e}"),
    };
    assert!(
        compiled.status.success(),
        "compiling the emulation of {program}:\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    Some(exe)
}
