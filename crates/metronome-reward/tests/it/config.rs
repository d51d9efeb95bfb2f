//! Building scorers from TOML.

use metronome_reward::{PoolConfig, RewardConfig, ScorerConfig};

use crate::common::{completion, group, prompt};

#[derive(serde::Deserialize)]
struct File {
    reward: RewardConfig,
}

#[test]
fn a_local_composite_from_toml_scores_a_group() {
    let text = r#"
        [reward]
        kind = "local"
        pool = { workers = 2, time_limit_ms = 1000, failure_score = -1.0 }

        [reward.scorer]
        kind = "composite"

        [[reward.scorer.components]]
        name = "correct"
        scorer = { kind = "math", exact = true }

        [[reward.scorer.components]]
        name = "format"
        weight = 0.5
        scorer = { kind = "format" }
    "#;
    let file: File = toml::from_str(text).unwrap();
    let RewardConfig::Local { pool, .. } = &file.reward else { panic!("not local") };
    assert_eq!(
        pool,
        &PoolConfig { workers: 2, time_limit_ms: 1000, failure_score: -1.0, ..PoolConfig::default() }
    );
    let scorer = file.reward.build(metronome_core::AdvantageEstimator::GroupMean).unwrap();
    let g = group(prompt(Some("4"), &[]), &["<think>2+2</think><answer>4</answer>", "<answer>5</answer>"]);
    let scored = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
        .block_on(scorer.score(g))
        .unwrap();
    let totals: Vec<f32> = scored.rewards.iter().map(|r| r.total).collect();
    assert_eq!(totals, [1.5, 0.0]);
    assert_eq!(scored.advantages, [0.75, -0.75]);
}

#[test]
fn every_scorer_kind_builds_from_toml() {
    for (text, reference, answer, expected) in [
        (r#"kind = "math""#, "1/2", r"\boxed{0.5}", 1.0),
        (r#"kind = "exact_match""#, "Paris", "<answer>paris</answer>", 1.0),
        (
            r#"kind = "format"
            pattern = '\A\d+\z'"#,
            "",
            "123",
            1.0,
        ),
        (
            r#"kind = "countdown"
            format_score = 0.25"#,
            "",
            "<answer>2*3+4</answer>",
            0.25,
        ),
        (
            r#"kind = "length"
            max_len = 8
            cache_len = 4
            unit = "chars""#,
            "",
            "abcdef",
            -0.5,
        ),
    ] {
        let config: ScorerConfig = toml::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        let scorer = config.build().unwrap();
        let p = prompt(Some(reference), &[("numbers", "2 3 4"), ("target", "24")]);
        assert_eq!(scorer.score(&p, &completion(0, answer)).total, expected, "{text}");
    }
}

#[test]
fn config_errors_name_the_field() {
    let unknown = toml::from_str::<ScorerConfig>("kind = \"math\"\nrel_tolerance = 0.1").unwrap_err();
    assert!(unknown.to_string().contains("rel_tolerance"), "{unknown}");
    let bad_kind = toml::from_str::<ScorerConfig>("kind = \"magic\"").unwrap_err();
    assert!(bad_kind.to_string().contains("magic"), "{bad_kind}");
    let e = toml::from_str::<ScorerConfig>("kind = \"length\"\nmax_len = 4\ncache_len = 8")
        .unwrap()
        .build()
        .err()
        .unwrap();
    assert!(e.to_string().contains("length.cache_len"), "{e}");
    let e = toml::from_str::<RewardConfig>("kind = \"remote\"\nurl = \"localhost\"")
        .unwrap()
        .build(Default::default())
        .err()
        .unwrap();
    assert!(e.to_string().contains("remote.url"), "{e}");
    let dup = r#"kind = "composite"
        components = [{ name = "a", scorer = { kind = "math" } }, { name = "a", scorer = { kind = "format" } }]"#;
    let e = toml::from_str::<ScorerConfig>(dup).unwrap().build().err().unwrap();
    assert!(e.to_string().contains("composite.components[1].name"), "{e}");
}

#[test]
fn configs_round_trip() {
    let config = RewardConfig::Local {
        scorer: toml::from_str("kind = \"countdown\"").unwrap(),
        pool: PoolConfig::default(),
    };
    let text = toml::to_string(&config).unwrap();
    assert_eq!(toml::from_str::<RewardConfig>(&text).unwrap(), config);
}
