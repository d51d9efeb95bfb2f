//! Where a model lives, as a config writes it: `"cpu"`, `"cuda"` (GPU 0) or `"cuda:N"`.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::Device;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// A device named in a config. The CPU is the default; CUDA devices need a build with
/// the `cuda` feature, and opening one without it is an error that says so.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceSpec {
    /// The host.
    #[default]
    Cpu,
    /// The CUDA GPU of this ordinal.
    Cuda(usize),
}

impl DeviceSpec {
    /// Opens the device. Every call for the same GPU returns the same
    /// `candle_core::Device` (one CUDA context and stream per GPU and process):
    /// candle refuses to combine tensors of two devices opened separately, even on one
    /// GPU, so stages that share a GPU must share its handle.
    pub fn open(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(ordinal) => {
                self.check_built()?;
                static OPEN: Mutex<Option<HashMap<usize, Device>>> = Mutex::new(None);
                let mut open = OPEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let open = open.get_or_insert_with(HashMap::new);
                if let Some(d) = open.get(&ordinal) {
                    return Ok(d.clone());
                }
                let d = Device::new_cuda(ordinal).map_err(|e| {
                    Error::invalid(format!("device `{self}`"), format!("cannot be opened: {e}"))
                })?;
                open.insert(ordinal, d.clone());
                Ok(d)
            }
        }
    }

    /// An error when this build cannot open such a device (a GPU without the `cuda`
    /// feature); checks nothing on the machine.
    pub fn check_built(self) -> Result<()> {
        if self.is_gpu() && !cfg!(feature = "cuda") {
            return Err(Error::invalid(
                format!("device `{self}`"),
                "needs a build with the `cuda` feature (e.g. `cargo build --release --features cuda`)",
            ));
        }
        Ok(())
    }

    /// Whether this is a GPU.
    #[must_use]
    pub fn is_gpu(self) -> bool {
        matches!(self, Self::Cuda(_))
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("`{s}` is not a device: expected \"cpu\", \"cuda\" or \"cuda:N\"");
        match s.trim() {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => {
                let n = other.strip_prefix("cuda:").ok_or_else(bad)?;
                n.parse().map(Self::Cuda).map_err(|_| bad())
            }
        }
    }
}

impl TryFrom<String> for DeviceSpec {
    type Error = String;

    fn try_from(s: String) -> std::result::Result<Self, String> {
        s.parse()
    }
}

impl From<DeviceSpec> for String {
    fn from(d: DeviceSpec) -> Self {
        d.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_every_form() {
        for (text, spec) in
            [("cpu", DeviceSpec::Cpu), ("cuda", DeviceSpec::Cuda(0)), ("cuda:3", DeviceSpec::Cuda(3))]
        {
            assert_eq!(text.parse::<DeviceSpec>().unwrap(), spec);
        }
        assert_eq!(DeviceSpec::Cuda(0).to_string(), "cuda:0");
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", ""] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(e.contains("expected \"cpu\""), "{bad}: {e}");
        }
    }

    #[test]
    fn cpu_opens_and_cuda_without_the_feature_says_so() {
        assert!(DeviceSpec::Cpu.open().unwrap().is_cpu());
        if !cfg!(feature = "cuda") {
            let e = DeviceSpec::Cuda(0).open().unwrap_err().to_string();
            assert!(e.contains("`cuda` feature") && e.contains("cuda:0"), "{e}");
        }
    }
}
