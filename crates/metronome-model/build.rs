//! With the `cuda` feature, compiles the crate's CUDA kernels (`kernels/*.cu`) to PTX
//! with nvcc, for `src/cuda.rs` to embed and load at run time; without it, nothing.
//!
//! nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on the `PATH` (`cargo xtask
//! gpu` points these at the toolkit it assembles). The PTX targets the virtual
//! architecture `compute_$CUDA_COMPUTE_CAP` (default 80): the driver compiles it for the
//! GPU it runs on, that one or newer.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: [&str; 4] = ["draw", "layer", "decode", "attention"];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rerun-if-env-changed=CUDA_HOME");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    for k in KERNELS {
        println!("cargo::rerun-if-changed=kernels/{k}.cu");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var_os("NVCC").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("CUDA_HOME")
            .map(|h| PathBuf::from(h).join("bin/nvcc"))
            .filter(|p| p.exists())
            .unwrap_or_else(|| PathBuf::from("nvcc"))
    });
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for k in KERNELS {
        let ptx = out.join(format!("{k}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("-arch=compute_{cap}"))
            .arg(format!("kernels/{k}.cu"))
            .arg("-o")
            .arg(&ptx)
            .status()
            .unwrap_or_else(|e| {
                panic!("running {} for kernels/{k}.cu: {e} (set NVCC or CUDA_HOME)", nvcc.display())
            });
        assert!(status.success(), "{} failed on kernels/{k}.cu ({status})", nvcc.display());
    }
}
