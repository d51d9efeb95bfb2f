//! Writes checkpoints with [`Model::save_hf`] for `fixtures/check_checkpoint.py`, which
//! loads them in `transformers` and compares logits with the ones written here; and
//! LoRA adapters on them with [`Model::save_lora_adapter`] (`<arch>/lora/`, with the
//! adapted model's logits) for `fixtures/check_lora.py`, which loads each adapter onto
//! its base with `peft.PeftModel.from_pretrained` and compares.
//!
//! ```text
//! cargo run -p metronome-model --example export_checkpoint -- /tmp/ckpt
//! python3 crates/metronome-model/fixtures/check_checkpoint.py /tmp/ckpt
//! python3 crates/metronome-model/fixtures/check_lora.py /tmp/ckpt
//! ```

use std::path::{Path, PathBuf};

use metronome_model::{Architecture, Device, LoraConfig, Model, ModelConfig, Tensor};

/// Writes `model`'s logits for `ids` to `dir/expected.json`.
fn write_expected(model: &Model, ids: &[Vec<u32>], dir: &Path) -> anyhow::Result<()> {
    let logits = model.forward_logits(&Tensor::new(ids.to_vec(), &Device::Cpu)?)?.to_vec3::<f32>()?;
    let text = serde_json::json!({ "input_ids": ids, "logits": logits }).to_string();
    Ok(std::fs::write(dir.join("expected.json"), text)?)
}

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
        write_expected(&model, &ids, &dir)?;
        println!("wrote {}", dir.display());
        // Adapters on every projection with B moved off zero (as training moves it),
        // so that each one changes the logits PEFT must reproduce.
        let lora = LoraConfig { rank: 4, alpha: 8.0, ..LoraConfig::default() };
        let adapted = model.with_lora(&lora, 11)?;
        for (pname, var) in adapted.adapter_parameters() {
            if pname.contains("lora_B") {
                let t = (Tensor::arange(0f32, var.elem_count() as f32, var.device())? * 0.37)?.sin()?;
                var.set(&(t.reshape(var.dims())? * 0.2)?)?;
            }
        }
        let lora_dir = dir.join("lora");
        adapted.save_lora_adapter(&lora_dir)?;
        write_expected(&adapted, &ids, &lora_dir)?;
        println!("wrote {}", lora_dir.display());
    }
    Ok(())
}
