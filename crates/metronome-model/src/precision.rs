//! The number format a model computes in, as a config writes it: `"f32"` or `"bf16"`.

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

/// The precision of a model's compute weights and activations.
///
/// Training in `Bf16` is mixed precision as FSDP2 and Megatron do it: the weights the
/// optimiser updates stay f32 (the masters), a bf16 copy of them runs the forward and
/// backward, and what needs the range or the accuracy (RMSNorm's statistics, the
/// softmaxes, the log-prob head's log-softmax and every loss reduction) is computed in
/// f32. [`crate::Model::compute_copy`] makes the bf16 copy; the trainer owns the rest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Precision {
    /// Everything in f32: the CPU's default, bit-for-bit what the fused CPU kernels
    /// compute.
    #[default]
    F32,
    /// bf16 compute on f32 masters: the default on GPUs, whose tensor cores multiply
    /// bf16 at many times their f32 rate.
    Bf16,
}

impl Precision {
    /// The default for `device`: f32 on the CPU, bf16 elsewhere.
    #[must_use]
    pub fn for_device(device: &Device) -> Self {
        if device.is_cpu() { Self::F32 } else { Self::Bf16 }
    }

    /// The candle type of the compute weights.
    #[must_use]
    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
        }
    }

    /// The name a config writes.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            other => Err(format!("`{other}` is not a precision (expected `bf16` or `f32`)")),
        }
    }
}

impl TryFrom<String> for Precision {
    type Error = String;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Precision> for String {
    fn from(p: Precision) -> Self {
        p.as_str().to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_ones_say_what_is_expected() {
        for p in [Precision::F32, Precision::Bf16] {
            assert_eq!(p.to_string().parse::<Precision>().unwrap(), p);
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(serde_json::from_str::<Precision>(&json).unwrap(), p);
        }
        let e = serde_json::from_str::<Precision>("\"fp8\"").unwrap_err().to_string();
        assert!(e.contains("`fp8` is not a precision (expected `bf16` or `f32`)"), "{e}");
        assert_eq!(Precision::for_device(&Device::Cpu), Precision::F32);
        assert_eq!(Precision::Bf16.dtype(), DType::BF16);
    }
}
