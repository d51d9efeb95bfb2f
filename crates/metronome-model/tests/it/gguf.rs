//! GGUF loading and the tokenizers, on files written here: the tiny Llama fixture
//! converted the way llama.cpp's converter does it (rotary rows permuted), with a
//! small byte-level BPE vocabulary.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use metronome_core::{ChatMessage, Tokenizer};
use metronome_model::{Device, GgufTokenizer, HfTokenizer, Model, Tensor, hf_to_gguf_name, permute_for_gguf};
use metronome_testkit::damage::{Damage, check_damaged, positions};

use crate::common::{expected, fixture, max_abs_diff};

const TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// 96 tokens: two control tokens, `Ġ` (space), `Ċ` (newline), the merge `hi`, then `!`..`{`.
fn vocab() -> Vec<String> {
    let mut v: Vec<String> =
        ["<|im_start|>", "<|im_end|>", "Ġ", "Ċ", "hi"].iter().map(|s| (*s).to_owned()).collect();
    v.extend((b'!'..=b'{').map(|b| (b as char).to_string()));
    assert_eq!(v.len(), 96);
    v
}

fn write_gguf(path: &std::path::Path, dtype: GgmlDType) {
    let model = Model::load_hf(&fixture("tiny_llama"), &Device::Cpu).unwrap();
    let cfg = model.config().clone();
    let tensors: Vec<(String, QTensor)> = model
        .parameters()
        .into_iter()
        .map(|(name, var)| {
            let t: Tensor = var.as_tensor().clone();
            let t = if name.ends_with("q_proj.weight") {
                permute_for_gguf(&t, cfg.num_attention_heads).unwrap()
            } else if name.ends_with("k_proj.weight") {
                permute_for_gguf(&t, cfg.num_key_value_heads).unwrap()
            } else {
                t
            };
            // Norms stay f32, as llama.cpp keeps them.
            let dt = if t.rank() == 1 { GgmlDType::F32 } else { dtype };
            (hf_to_gguf_name(&name), QTensor::quantize(&t, dt).unwrap())
        })
        .collect();
    let tokens = vocab();
    let types: Vec<Value> = (0..tokens.len()).map(|i| Value::I32(if i < 2 { 3 } else { 1 })).collect();
    let u = |x: usize| Value::U32(x as u32);
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", u(cfg.num_hidden_layers)),
        ("llama.context_length", u(cfg.max_position_embeddings)),
        ("llama.embedding_length", u(cfg.hidden_size)),
        ("llama.feed_forward_length", u(cfg.intermediate_size)),
        ("llama.attention.head_count", u(cfg.num_attention_heads)),
        ("llama.attention.head_count_kv", u(cfg.num_key_value_heads)),
        ("llama.rope.freq_base", Value::F32(cfg.rope_theta as f32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(cfg.rms_norm_eps as f32)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.merges", Value::Array(vec![Value::String("h i".into())])),
        ("tokenizer.ggml.bos_token_id", Value::U32(0)),
        ("tokenizer.ggml.eos_token_id", Value::U32(1)),
        ("tokenizer.chat_template", Value::String(TEMPLATE.into())),
    ];
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut file, &md_refs, &t_refs).unwrap();
}

/// The fixture written to `dir` as a GGUF file of `dtype`, loaded back.
fn written(dir: &std::path::Path, dtype: GgmlDType) -> (Model, GgufTokenizer) {
    let path = dir.join(format!("tiny-{dtype:?}.gguf"));
    write_gguf(&path, dtype);
    Model::load_gguf(&path, &Device::Cpu).unwrap()
}

/// The largest difference between `model`'s logits and transformers' on the fixture.
fn logit_error(model: &Model) -> f32 {
    let (ids, want) = expected("tiny_llama");
    let got =
        model.forward_logits(&Tensor::new(ids, &Device::Cpu).unwrap()).unwrap().to_vec3::<f32>().unwrap();
    let flat = |x: Vec<Vec<Vec<f32>>>| -> Vec<f32> { x.into_iter().flatten().flatten().collect() };
    max_abs_diff(&flat(got), &flat(want))
}

#[test]
fn f32_gguf_loads_with_transformers_logits() {
    let dir = tempfile::tempdir().unwrap();
    let (model, tok) = written(dir.path(), GgmlDType::F32);
    assert!(!model.config().tie_word_embeddings);
    let d = logit_error(&model);
    assert!(d < 1e-4, "max |gguf logit - transformers| = {d}");

    // The embedded tokenizer: byte-level BPE with the merge, control tokens whole.
    let ids = tok.encode("hi there!").unwrap();
    assert_eq!(ids[0], 4, "`hi` is merged");
    assert_eq!(ids[1], 2, "space is `Ġ`");
    assert_eq!(tok.decode(&ids).unwrap(), "hi there!");
    let text = tok.apply_chat_template(&[ChatMessage::new("user", "hi")], true).unwrap();
    assert_eq!(text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    let ids = tok.encode(&text).unwrap();
    assert_eq!(ids[0], 0);
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 1, "<|im_end|> is one token");
    assert_eq!(tok.decode(&ids).unwrap(), "user\nhi\nassistant\n", "control tokens are skipped");
    assert!(tok.stop_token_ids().contains(&1));

    // The same tokenizer from the file's metadata alone.
    let alone = GgufTokenizer::from_gguf(&dir.path().join("tiny-F32.gguf")).unwrap();
    assert_eq!(alone.encode(&text).unwrap(), ids);
    assert_eq!((alone.stop_token_ids(), alone.bos_token_id()), (tok.stop_token_ids(), tok.bos_token_id()));

    // The same tokenizer through tokenizer.json + tokenizer_config.json.
    tok.as_hf().inner().save(dir.path().join("tokenizer.json"), false).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::json!({ "chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": null })
            .to_string(),
    )
    .unwrap();
    let hf = HfTokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(hf.encode(&text).unwrap(), ids);
    assert_eq!(hf.stop_token_ids(), vec![1]);
    assert_eq!(hf.apply_chat_template(&[ChatMessage::new("user", "hi")], true).unwrap(), text);
}

#[test]
fn quantised_gguf_dequantises_close_to_f32() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = written(dir.path(), GgmlDType::Q8_0);
    let d = logit_error(&model);
    // 8-bit blocks: close, not equal (the fixture's logits reach about 6).
    assert!(d > 0.0 && d < 0.3, "max |q8 logit - f32 logit| = {d}");
}

#[test]
fn bad_gguf_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.gguf");
    std::fs::write(&path, b"not a gguf file at all").unwrap();
    let e = Model::load_gguf(&path, &Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("bad.gguf"), "{e}");
    let e = Model::load_gguf(&dir.path().join("missing.gguf"), &Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("missing.gguf"), "{e}");
    let e = GgufTokenizer::from_gguf(&path).unwrap_err().to_string();
    assert!(e.contains("bad.gguf"), "{e}");
    let e = GgufTokenizer::from_gguf(&dir.path().join("missing.gguf")).unwrap_err().to_string();
    assert!(e.contains("missing.gguf"), "{e}");
}

#[test]
fn truncated_or_corrupted_gguf_files_are_errors_never_panics() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("tiny.gguf");
    write_gguf(&good, GgmlDType::F32);
    let bytes = std::fs::read(&good).unwrap();
    let bad = dir.path().join("bad.gguf");
    // A length or count field set to 0x7f reads as a huge number.
    let damages = [Damage::Cut, Damage::Flip(0xff), Damage::Set(0x7f)];
    let at = positions(bytes.len(), 512, 64, 0x5eed);
    let tried = check_damaged(&bad, &bytes, &at, &damages, &["bad.gguf"], || {
        Model::load_gguf(&bad, &Device::Cpu).map(drop)
    });
    eprintln!("{tried} truncated or corrupted files, every one an error or a load");
    assert!(tried > 1000);
}
