//! The control format (`MTRC`): messages are rare and tiny, so the body is
//! `postcard`.

use metronome_core::ControlMessage;

use super::framing::{Reader, Writer};
use super::{CONTROL_FORMAT_VERSION, CONTROL_MAGIC};
use crate::{Error, Result};

/// Encodes a control message.
pub fn encode_control(message: &ControlMessage) -> Result<Vec<u8>> {
    let body = postcard::to_allocvec(message).map_err(|e| Error::Malformed {
        kind: "control",
        field: "body".into(),
        reason: e.to_string(),
    })?;
    let mut w = Writer::new(CONTROL_MAGIC, CONTROL_FORMAT_VERSION, body.len(), "control");
    w.buf.extend_from_slice(&body);
    Ok(w.finish())
}

/// Decodes a control message.
pub fn decode_control(bytes: &[u8]) -> Result<ControlMessage> {
    let mut r = Reader::open(bytes, "control", CONTROL_MAGIC, CONTROL_FORMAT_VERSION)?;
    let body = r.take(r.remaining() as u64, "body")?;
    postcard::from_bytes(body).map_err(|e| Error::Malformed {
        kind: "control",
        field: "body".into(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_core::{PeriodId, PolicyVersion, PromptId};

    #[test]
    fn control_round_trips() {
        for m in [
            ControlMessage::PeriodStart {
                period: PeriodId(4),
                version: PolicyVersion(4),
                prompts: vec![PromptId(1), PromptId(9)],
            },
            ControlMessage::PeriodEnd { period: PeriodId(4) },
            ControlMessage::Shutdown,
        ] {
            assert_eq!(decode_control(&encode_control(&m).unwrap()).unwrap(), m);
        }
    }
}
