//! The instruction set the fused CPU kernels run with.
//!
//! The kernels are written once, generic over [`pulp::Simd`], and [`dispatch`] runs
//! them with the widest instruction set the machine has: AVX-512 (pulp's `V4`, 16
//! lanes) where present, AVX2 + FMA (`V3`, 8 lanes) otherwise, scalar code elsewhere.
//! The matrix products follow the same rule inside `gemm` (its `x86-v4` feature,
//! dispatched at run time).
//!
//! `METRONOME_SIMD=avx2` caps the fused kernels at AVX2 on a machine with AVX-512, so
//! both paths run (and are tested) on one machine; `METRONOME_SIMD=native` (or unset)
//! is the default. `gemm` picks its own kernel from the CPU alone: a build without
//! the `avx512` feature of this crate keeps it at AVX2 (`benches/trl_compare.py` does
//! both for its AVX2-only figure).
//!
//! Results are the same on one machine and one level whatever the batch (every
//! kernel's reduction order depends on the lane count, never on the rows beside a
//! row); between levels they differ in rounding, as any two SIMD widths do.

use std::sync::OnceLock;

/// The environment variable that caps `dispatch`'s instruction set.
pub const SIMD_ENV: &str = "METRONOME_SIMD";

/// An instruction-set ceiling for the fused CPU kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimdLevel {
    /// The widest the machine has (the default).
    Native,
    /// At most AVX2 + FMA (x86-64-v3), even where AVX-512 is present.
    Avx2,
}

impl SimdLevel {
    /// The level [`SIMD_ENV`] asks for: unset or empty is [`SimdLevel::Native`].
    ///
    /// # Errors
    /// A value other than `native` or `avx2`, naming the variable and what it accepts.
    pub fn from_env() -> crate::Result<Self> {
        match std::env::var(SIMD_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(Self::Native),
            Err(std::env::VarError::NotUnicode(v)) => Err(Self::refuse(&v.to_string_lossy())),
            Ok(v) => Self::parse(&v),
        }
    }

    fn parse(value: &str) -> crate::Result<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "native" => Ok(Self::Native),
            "avx2" | "x86-v3" => Ok(Self::Avx2),
            _ => Err(Self::refuse(value)),
        }
    }

    fn refuse(value: &str) -> crate::Error {
        crate::Error::Config {
            what: format!("{SIMD_ENV}={value:?}"),
            reason: "expected \"native\" or \"avx2\"".into(),
        }
    }

    /// The level the kernels of this process use: [`SIMD_ENV`] read once; a value it
    /// refuses counts as [`SimdLevel::Native`] here (the CLI refuses it at start-up,
    /// through [`SimdLevel::from_env`]).
    #[must_use]
    pub fn active() -> Self {
        static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
        *LEVEL.get_or_init(|| Self::from_env().unwrap_or(Self::Native))
    }

    /// The instruction set kernels run with at this level on this machine, for logs
    /// and benchmark reports: `"avx512"`, `"avx2"`, `"neon"` or `"scalar"`.
    #[must_use]
    pub fn instruction_set(self) -> &'static str {
        #[cfg(target_arch = "x86_64")]
        {
            // Without the `avx512` feature pulp has no V4: the widest is AVX2.
            #[cfg(feature = "avx512")]
            if self == Self::Native && pulp::x86::V4::try_new().is_some() {
                return "avx512";
            }
            if pulp::x86::V3::try_new().is_some() {
                return "avx2";
            }
        }
        if cfg!(target_arch = "aarch64") { "neon" } else { "scalar" }
    }
}

/// Runs `op` with the widest instruction set [`SimdLevel::active`] allows.
#[inline(always)]
pub(crate) fn dispatch<Op: pulp::WithSimd>(op: Op) -> Op::Output {
    #[cfg(target_arch = "x86_64")]
    if SimdLevel::active() == SimdLevel::Avx2 {
        // Without AVX2 there is no AVX-512 either: the default dispatch below is the cap.
        if let Some(v3) = pulp::x86::V3::try_new() {
            return pulp::Simd::vectorize(v3, op);
        }
    }
    pulp::Arch::new().dispatch(op)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_accepts_native_and_avx2_and_names_itself_otherwise() {
        assert_eq!(SimdLevel::parse("").unwrap(), SimdLevel::Native);
        assert_eq!(SimdLevel::parse("Native").unwrap(), SimdLevel::Native);
        assert_eq!(SimdLevel::parse(" avx2 ").unwrap(), SimdLevel::Avx2);
        let err = SimdLevel::parse("avx1024").unwrap_err().to_string();
        assert!(err.contains("METRONOME_SIMD") && err.contains("avx1024") && err.contains("avx2"), "{err}");
    }

    /// A kernel generic over the instruction set reports the lanes it ran with.
    struct Lanes;
    impl pulp::WithSimd for Lanes {
        type Output = usize;
        fn with_simd<S: pulp::Simd>(self, _: S) -> usize {
            S::F32_LANES
        }
    }

    #[test]
    fn dispatch_runs_at_the_level_the_machine_and_the_variable_allow() {
        let lanes = dispatch(Lanes);
        let expected = match SimdLevel::active().instruction_set() {
            "avx512" => 16,
            "avx2" => 8,
            "neon" => 4,
            _ => 1,
        };
        assert_eq!(lanes, expected, "{:?}", SimdLevel::active());
    }
}
