//! Writes checkpoints with [`Model::save_hf`] for `fixtures/check_checkpoint.py`, which
//! loads them in `transformers` and compares logits with the ones written here.
//!
//! ```text
//! cargo run -p metronome-model --example export_checkpoint -- /tmp/ckpt
//! python3 crates/metronome-model/fixtures/check_checkpoint.py /tmp/ckpt
//! ```

use std::path::PathBuf;

use metronome_model::{Architecture, Device, Model, ModelConfig, Tensor};

fn main() -> anyhow::Result<()> {
    // Under `cargo test` (built with cfg(test), run from the package directory) the
    // default goes to the temporary directory instead of a `target/` inside the crate.
    let default = if cfg!(test) {
        std::env::temp_dir().join("metronome-export_checkpoint")
    } else {
        "target/export_checkpoint".into()
    };
    let out = std::env::args().nth(1).map_or(default, PathBuf::from);
    for (name, arch, tied) in [("llama", Architecture::Llama, false), ("qwen2", Architecture::Qwen2, true)] {
        let mut cfg = ModelConfig::tiny();
        cfg.architecture = arch;
        cfg.tie_word_embeddings = tied;
        let model = Model::new(cfg.clone(), &Device::Cpu, 5)?;
        // Larger weights and non-trivial norm scales than the N(0, 0.02) init, so that
        // the comparison is sensitive to every tensor (biases included).
        for (pname, var) in model.parameters() {
            let t = var.as_tensor();
            let new = if pname.ends_with("norm.weight") {
                ((Tensor::arange(0f32, t.elem_count() as f32, t.device())? * 0.01)?.sin()? + 1.0)?
            } else if pname.ends_with("bias") {
                (Tensor::arange(0f32, t.elem_count() as f32, t.device())? * 0.003)?.cos()?
            } else {
                (t * 10.0)?
            };
            var.set(&new)?;
        }
        let dir = out.join(name);
        model.save_hf(&dir)?;
        let ids: Vec<Vec<u32>> =
            (0..2u32).map(|r| (0..9u32).map(|i| 3 + (r * 31 + i * 17) % 90).collect()).collect();
        let logits = model.forward_logits(&Tensor::new(ids.clone(), &Device::Cpu)?)?.to_vec3::<f32>()?;
        std::fs::write(
            dir.join("expected.json"),
            serde_json::json!({ "input_ids": ids, "logits": logits }).to_string(),
        )?;
        println!("wrote {}", dir.display());
    }
    Ok(())
}
