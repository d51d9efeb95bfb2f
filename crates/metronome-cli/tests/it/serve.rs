//! `metronome serve`: the config's model behind the completions API, with its key.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::cluster::{Proc, serial};

/// A plain HTTP/1.1 request; the status code and body.
fn request(port: u16, method: &str, path: &str, key: Option<&str>, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n\
         {auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, text)
}

#[test]
fn serve_answers_with_its_key_only_and_stops_on_sigterm() {
    let _serial = serial();
    let out = tempfile::tempdir().unwrap();
    let key = out.path().join("key");
    std::fs::write(&key, "s3rve-key\n").unwrap();
    let port = metronome_testkit::server::free_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let mut server = Proc::spawn_plain(
        "serve",
        &[
            "serve",
            "--addr",
            &addr,
            "--api-key-file",
            key.to_str().unwrap(),
            "--model-name",
            "tiny",
            "--events",
            "-",
        ],
    );
    let serving = server.wait_event("serving", |_| true);
    assert_eq!(serving["model"], "tiny");
    assert_eq!(serving["addr"], addr.as_str());
    let body = r#"{"model": "tiny", "prompt": "1+2=", "max_tokens": 4, "seed": 1}"#;
    assert_eq!(request(port, "POST", "/v1/completions", None, body).0, 401);
    let (status, text) = request(port, "POST", "/v1/completions", Some("s3rve-key"), body);
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("\"text_completion\""), "{text}");
    server.sigterm();
    assert!(server.finish().success(), "{}", server.log());
    assert!(!server.log().contains("s3rve-key"), "the key was logged");

    // Reachable from other machines, it needs a key.
    let mut open = Proc::spawn_plain("open", &["serve", "--addr", "0.0.0.0:0"]);
    assert!(!open.finish().success());
    assert!(open.log().contains("api_key"), "{}", open.log());
}
