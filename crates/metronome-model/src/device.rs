//! Where a model lives, as a config writes it: `"cpu"`, `"cuda"` (GPU 0) or `"cuda:N"`.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::Device;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// `METRONOME_CUDA_STAGE_STREAMS=1` (`0` or unset: off; any other value is refused
/// when a GPU is opened) gives the rollout stage a GPU handle of its own,
/// with its own CUDA stream ([`DeviceSpec::open_for`] with [`Stage::Rollout`]), and
/// the trainer an explicit stream too, instead of one handle shared by both stages on
/// candle's per-thread default streams. Off by default until measured on a GPU (issue
/// #31: the engine and the trainer on separate streams, so that `periodic` overlaps
/// them on one GPU); weights cross between the two handles by a device-to-device copy
/// that cudarc orders after the source's last write with a stream event.
pub const STAGE_STREAMS_ENV: &str = "METRONOME_CUDA_STAGE_STREAMS";

/// The GPU handles opened so far, by ordinal and stage (`None`: shared by both).
type Handles = HashMap<(usize, Option<Stage>), Device>;

/// The stage a device handle serves ([`DeviceSpec::open_for`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The trainer: the policy, its reference or teacher, the warm start.
    Trainer,
    /// The rollout engine and what it alone reads (serving, evaluation).
    Rollout,
}

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
    /// Opens the device for the trainer's stage: [`DeviceSpec::open_for`] with
    /// [`Stage::Trainer`].
    pub fn open(self) -> Result<Device> {
        self.open_for(Stage::Trainer)
    }

    /// Opens the device for `stage`. Every call for the same GPU and stage returns the
    /// same `candle_core::Device`: candle refuses to combine tensors of two devices
    /// opened separately, even on one GPU, so what one stage computes together must
    /// share its handle. Both stages share one handle (one CUDA context, candle's
    /// per-thread default streams) unless [`STAGE_STREAMS_ENV`] is `1`, when each
    /// stage has its own handle with its own stream ([`DeviceSpec::open_stream`]);
    /// a model then crosses between them only by a copy (`Model::frozen_copy_on`,
    /// installed snapshots).
    pub fn open_for(self, stage: Stage) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(ordinal) => {
                self.check_built()?;
                let streams = stage_streams(std::env::var_os(STAGE_STREAMS_ENV).as_deref())?;
                let stage = if streams { Some(stage) } else { None };
                static OPEN: Mutex<Option<Handles>> = Mutex::new(None);
                let mut open = OPEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let open = open.get_or_insert_with(HashMap::new);
                if let Some(d) = open.get(&(ordinal, stage)) {
                    return Ok(d.clone());
                }
                let d = match stage {
                    Some(_) => self.open_stream()?,
                    None => Device::new_cuda(ordinal).map_err(|e| self.cannot_open(&e))?,
                };
                open.insert((ordinal, stage), d.clone());
                Ok(d)
            }
        }
    }

    /// A new handle on this GPU with a CUDA stream of its own (the CPU for the CPU): its
    /// work is ordered on that stream whichever host thread issues it, and runs beside
    /// other handles' on the GPU. Its tensors combine with no other handle's.
    pub fn open_stream(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(ordinal) => {
                self.check_built()?;
                Device::new_cuda_with_stream(ordinal).map_err(|e| self.cannot_open(&e))
            }
        }
    }

    fn cannot_open(self, e: &candle_core::Error) -> Error {
        Error::invalid(format!("device `{self}`"), format!("cannot be opened: {e}"))
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

/// Waits until the device has done everything any thread of this process queued on
/// it; nothing on the CPU. On a GPU that is the whole context, whatever stream the work
/// went to: candle's default handle queues each thread's work on that thread's own
/// default stream, and nothing orders those streams among themselves, so weights
/// written on one thread (the optimiser's, an install's copies) and read on another
/// (a snapshot's copies, the engine's decode steps) are waited for here.
pub(crate) fn synchronize_all(device: &Device) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => gpu
            .cuda_stream()
            .context()
            .synchronize()
            .map_err(|e| crate::Error::invalid("the GPU", format!("cannot synchronise its context: {e}"))),
        _ => Ok(()),
    }
}

/// [`STAGE_STREAMS_ENV`]'s value.
fn stage_streams(value: Option<&std::ffi::OsStr>) -> Result<bool> {
    switch(STAGE_STREAMS_ENV, value)
}

/// The value of the switch variable `name`: unset or `0` is off, `1` on; anything else
/// is an error naming the variable (a `true` read as off would go unnoticed).
pub(crate) fn switch(name: &str, value: Option<&std::ffi::OsStr>) -> Result<bool> {
    match value.map(|v| v.to_str()) {
        None | Some(Some("0")) => Ok(false),
        Some(Some("1")) => Ok(true),
        Some(v) => {
            Err(Error::invalid(name, format!("is {:?}, expected `0` or `1`", v.unwrap_or("(not UTF-8)"))))
        }
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
    fn the_stage_streams_variable_is_0_or_1_and_nothing_else() {
        use std::ffi::OsStr;
        assert!(!stage_streams(None).unwrap());
        assert!(!stage_streams(Some(OsStr::new("0"))).unwrap());
        assert!(stage_streams(Some(OsStr::new("1"))).unwrap());
        for bad in ["true", "", " 1"] {
            let e = stage_streams(Some(OsStr::new(bad))).unwrap_err().to_string();
            assert!(e.contains(STAGE_STREAMS_ENV) && e.contains("expected `0` or `1`"), "{bad}: {e}");
            // The same switch reads `METRONOME_CUDA_GRAPHS` for every `KvCache`.
            let e = switch(crate::CUDA_GRAPHS_ENV, Some(OsStr::new(bad))).unwrap_err().to_string();
            assert!(e.contains("METRONOME_CUDA_GRAPHS") && e.contains("expected `0` or `1`"), "{bad}: {e}");
        }
    }

    #[test]
    fn cpu_opens_and_cuda_without_the_feature_says_so() {
        assert!(DeviceSpec::Cpu.open().unwrap().is_cpu());
        for stage in [Stage::Trainer, Stage::Rollout] {
            assert!(DeviceSpec::Cpu.open_for(stage).unwrap().is_cpu());
        }
        assert!(DeviceSpec::Cpu.open_stream().unwrap().is_cpu());
        if !cfg!(feature = "cuda") {
            let e = DeviceSpec::Cuda(0).open().unwrap_err().to_string();
            assert!(e.contains("`cuda` feature") && e.contains("cuda:0"), "{e}");
            let e = DeviceSpec::Cuda(1).open_stream().unwrap_err().to_string();
            assert!(e.contains("`cuda` feature") && e.contains("cuda:1"), "{e}");
        }
    }
}
