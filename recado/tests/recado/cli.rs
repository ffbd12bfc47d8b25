//! recado against real brokers: Mercurio (in process) and mosquitto (spawned). Every test
//! runs the recado binary and checks what a user sees: standard output, standard error and
//! the exit code.

use crate::support;

use support::{common, exit, recado, recado_with_input, Background, TestBroker};

#[tokio::test(flavor = "multi_thread")]
async fn sub_pub_round_trip_in_every_protocol_version() {
    for b in TestBroker::both("round_trip").await {
        let port = b.port();
        for v in ["mqttv31", "mqttv311", "mqttv5", "31", "311", "5"] {
            let sub = Background::subscribed(&[
                "sub",
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-V",
                v,
                "-t",
                "rt/#",
                "-v",
                "-C",
                "3",
                "-q",
                "2",
                "-i",
                &format!("s{v}"),
            ])
            .await;
            for q in ["0", "1", "2"] {
                recado(&[
                    "pub",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &port,
                    "-V",
                    v,
                    "-t",
                    &format!("rt/q{q}"),
                    "-m",
                    &format!("hello {v} {q}"),
                    "-q",
                    q,
                ])
                .await
                .ok();
            }
            let run = sub.finish().await;
            assert_eq!(
                run.lines(),
                vec![
                    format!("rt/q0 hello {v} 0"),
                    format!("rt/q1 hello {v} 1"),
                    format!("rt/q2 hello {v} 2")
                ],
                "{} {v}: {run:?}",
                b.name
            );
            assert_eq!(run.code, exit::OK);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn count_timeout_and_exit_after_subscribe() {
    for b in TestBroker::both("count_timeout").await {
        let port = b.port();
        // -W expires: exit code 5 and one sentence.
        let run = recado(&[
            "sub",
            "-p",
            &port,
            "-h",
            "127.0.0.1",
            "-t",
            "quiet/#",
            "-W",
            "0.3",
        ])
        .await;
        assert_eq!(run.code, exit::TIMEOUT, "{}: {run:?}", b.name);
        assert!(run.stderr.contains("timed out"), "{run:?}");
        // -E: done once subscribed.
        let run = recado(&["sub", "-p", &port, "-h", "127.0.0.1", "-t", "quiet/#", "-E"]).await;
        assert_eq!(run.code, exit::OK, "{}: {run:?}", b.name);
        // -C: exactly that many messages (-l publishes one per line).
        let sub = Background::subscribed(&[
            "sub",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            "count",
            "-C",
            "2",
            "-W",
            "10",
        ])
        .await;
        recado_with_input(
            &[
                "pub",
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-t",
                "count",
                "-l",
                "-q",
                "1",
            ],
            b"one\ntwo\nthree\n",
        )
        .await
        .ok();
        let run = sub.finish().await;
        assert_eq!(run.lines(), vec!["one", "two"], "{}: {run:?}", b.name);
        assert_eq!(run.code, exit::OK);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn retained_flags() {
    for b in TestBroker::both("retained_flags").await {
        let port = b.port();
        let p = ["-h", "127.0.0.1", "-p", port.as_str()];
        for (t, m) in [("ret/a", "A"), ("ret/b", "B")] {
            recado(&[&["pub"][..], &p[..], &["-t", t, "-m", m, "-r", "-q", "1"]].concat())
                .await
                .ok();
        }
        // --retained-only: the retained messages, then exit at the first live one; -W as a
        // safety net only.
        let sub = Background::subscribed(
            &[
                &["sub"][..],
                &p[..],
                &["-t", "ret/#", "--retained-only", "-v", "-W", "10"],
            ]
            .concat(),
        )
        .await;
        recado(&[&["pub"][..], &p[..], &["-t", "ret/live", "-m", "L"]].concat())
            .await
            .ok();
        let run = sub.finish().await;
        // Retained messages come in no particular order.
        let mut lines = run.lines();
        lines.sort();
        assert_eq!(lines, vec!["ret/a A", "ret/b B"], "{}: {run:?}", b.name);
        assert_eq!(run.code, exit::OK);
        // -R: retained messages are not printed.
        let sub = Background::subscribed(
            &[
                &["sub"][..],
                &p[..],
                &["-t", "ret/#", "-R", "-v", "-C", "1"],
            ]
            .concat(),
        )
        .await;
        recado(&[&["pub"][..], &p[..], &["-t", "ret/live", "-m", "L"]].concat())
            .await
            .ok();
        let run = sub.finish().await;
        assert_eq!(run.lines(), vec!["ret/live L"], "{}: {run:?}", b.name);
        // --remove-retained clears them: a later subscriber gets none.
        let run = recado(
            &[
                &["sub"][..],
                &p[..],
                &[
                    "-t",
                    "ret/#",
                    "--remove-retained",
                    "--retained-only",
                    "-W",
                    "1",
                ],
            ]
            .concat(),
        )
        .await;
        let mut lines = run.lines();
        lines.sort();
        assert_eq!(lines, vec!["A", "B"], "{}: {run:?}", b.name);
        let run = recado(&[&["sub"][..], &p[..], &["-t", "ret/#", "-W", "0.5"]].concat()).await;
        assert_eq!(run.code, exit::TIMEOUT);
        assert_eq!(
            run.stdout, "",
            "{}: retained messages left: {run:?}",
            b.name
        );
        // --retain-handling never: no retained message at subscribe [MQTT-3.3.1-11].
        recado(&[&["pub"][..], &p[..], &["-t", "ret/h", "-m", "H", "-r"]].concat())
            .await
            .ok();
        let sub = Background::subscribed(
            &[
                &["sub"][..],
                &p[..],
                &[
                    "-V",
                    "5",
                    "-t",
                    "ret/#",
                    "--retain-handling",
                    "never",
                    "-v",
                    "-C",
                    "1",
                ],
            ]
            .concat(),
        )
        .await;
        recado(&[&["pub"][..], &p[..], &["-t", "ret/live", "-m", "L"]].concat())
            .await
            .ok();
        assert_eq!(sub.finish().await.ok(), "ret/live L\n", "{}", b.name);
        recado(&[&["pub"][..], &p[..], &["-t", "ret/h", "-n", "-r"]].concat())
            .await
            .ok();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn format_strings_as_mosquitto_sub() {
    for b in TestBroker::both("format").await {
        let port = b.port();
        let p = ["-h", "127.0.0.1", "-p", port.as_str()];
        recado(
            &[
                &["pub"][..],
                &p[..],
                &[
                    "-V",
                    "5",
                    "-t",
                    "fmt/x",
                    "-m",
                    "hi",
                    "-r",
                    "-q",
                    "1",
                    "-D",
                    "publish",
                    "content-type",
                    "text/plain",
                    "-D",
                    "publish",
                    "user-property",
                    "k",
                    "v",
                    "-D",
                    "publish",
                    "response-topic",
                    "back",
                    "-D",
                    "publish",
                    "correlation-data",
                    "c1",
                    "-D",
                    "publish",
                    "message-expiry-interval",
                    "300",
                    "-D",
                    "publish",
                    "payload-format-indicator",
                    "1",
                ],
            ]
            .concat(),
        )
        .await
        .ok();
        let run = recado(
            &[
                &["sub"][..],
                &p[..],
                &[
                    "-V",
                    "mqttv5",
                    "-t",
                    "fmt/#",
                    "-C",
                    "1",
                    "-F",
                    "%t|%p|%x|%X|%l|%q|%r|%C|%P|%R|%D|%F|[%-6t]|[%6t]|[%.2t]|%%|@@|\\t|@Y",
                ],
            ]
            .concat(),
        )
        .await;
        let out = run.ok();
        let fields: Vec<&str> = out.trim_end_matches('\n').split('|').collect();
        assert_eq!(
            &fields[..17],
            &[
                "fmt/x",
                "hi",
                "6869",
                "6869",
                "2",
                "0",
                "1",
                "text/plain",
                "k:v",
                "back",
                "c1",
                "1",
                "[fmt/x ]",
                "[ fmt/x]",
                "[fm]",
                "%",
                "@"
            ],
            "{}: {out:?}",
            b.name
        );
        assert_eq!(fields[17], "\t");
        assert_eq!(fields[18].len(), 4, "@Y is the year: {out:?}");
        // %E counts down at the broker: at most what was sent.
        let run = recado(
            &[
                &["sub"][..],
                &p[..],
                &["-V", "5", "-t", "fmt/#", "-C", "1", "-F", "%E %I %U %j"],
            ]
            .concat(),
        )
        .await;
        let out = run.ok();
        let mut parts = out.splitn(4, ' ');
        let expiry: u32 = parts.next().unwrap().parse().unwrap();
        assert!((1..=300).contains(&expiry), "{out}");
        assert!(parts.next().unwrap().contains('T'), "%I: {out}");
        assert!(parts.next().unwrap().contains('.'), "%U: {out}");
        let j: serde_json::Value = serde_json::from_str(parts.next().unwrap().trim()).unwrap();
        assert_eq!(j["topic"], "fmt/x");
        assert_eq!(j["payload"], "hi");
        assert_eq!(j["retain"], 1);
        // -N: no newline; a bad format is a usage error.
        let run = recado(&[&["sub"][..], &p[..], &["-t", "fmt/#", "-C", "1", "-N"]].concat()).await;
        assert_eq!(run.ok(), "hi");
        let run = recado(&[&["sub"][..], &p[..], &["-t", "fmt/#", "-F", "%z"]].concat()).await;
        assert_eq!(run.code, exit::USAGE, "{run:?}");
        recado(&[&["pub"][..], &p[..], &["-t", "fmt/x", "-n", "-r"]].concat())
            .await
            .ok();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn json_output_with_mqtt5_properties() {
    for b in TestBroker::both("json").await {
        let port = b.port();
        let p = ["-h", "127.0.0.1", "-p", port.as_str()];
        let sub = Background::subscribed(
            &[
                &["sub"][..],
                &p[..],
                &[
                    "-V",
                    "5",
                    "-t",
                    "js/#",
                    "--json",
                    "-C",
                    "2",
                    "-q",
                    "1",
                    "-D",
                    "subscribe",
                    "subscription-identifier",
                    "9",
                ],
            ]
            .concat(),
        )
        .await;
        recado(
            &[
                &["pub"][..],
                &p[..],
                &[
                    "-V",
                    "5",
                    "-t",
                    "js/text",
                    "-m",
                    "héllo",
                    "-q",
                    "1",
                    "-D",
                    "publish",
                    "user-property",
                    "a",
                    "1",
                    "-D",
                    "publish",
                    "user-property",
                    "a",
                    "2",
                    "-D",
                    "publish",
                    "content-type",
                    "text/plain",
                    "-D",
                    "publish",
                    "response-topic",
                    "js/back",
                    "-D",
                    "publish",
                    "correlation-data",
                    "xyz",
                    "-D",
                    "publish",
                    "message-expiry-interval",
                    "60",
                    "-D",
                    "publish",
                    "payload-format-indicator",
                    "1",
                ],
            ]
            .concat(),
        )
        .await
        .ok();
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::write(&bin, [0u8, 0xff, 0x10]).unwrap();
        recado(
            &[
                &["pub"][..],
                &p[..],
                &["-V", "5", "-t", "js/bin", "-f", bin.to_str().unwrap()],
            ]
            .concat(),
        )
        .await
        .ok();
        let run = sub.finish().await;
        let lines = run.lines();
        assert_eq!(lines.len(), 2, "{}: {run:?}", b.name);
        let t: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(t["topic"], "js/text");
        assert_eq!(t["payload"], "héllo");
        assert_eq!(t["payload_encoding"], "utf-8");
        assert_eq!(t["qos"], 1);
        assert_eq!(t["retain"], false);
        assert_eq!(t["content_type"], "text/plain");
        assert_eq!(t["response_topic"], "js/back");
        assert_eq!(t["correlation_data"], "xyz");
        assert_eq!(t["payload_format_indicator"], 1);
        assert_eq!(t["subscription_identifiers"], serde_json::json!([9]));
        assert_eq!(
            t["user_properties"],
            serde_json::json!([["a", "1"], ["a", "2"]])
        );
        let expiry = t["message_expiry_interval"].as_u64().unwrap();
        assert!((1..=60).contains(&expiry), "{t}");
        let at = t["received_at"].as_str().unwrap();
        assert!(
            at.len() == 27 && at.ends_with('Z') && at.as_bytes()[10] == b'T',
            "{at}"
        );
        let bin: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(bin["payload"], "AP8Q");
        assert_eq!(bin["payload_encoding"], "base64");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn table_printed_once_sorted_when_not_a_terminal() {
    for b in TestBroker::both("table").await {
        let port = b.port();
        let p = ["-h", "127.0.0.1", "-p", port.as_str()];
        for (t, m) in [("tb/z", "last"), ("tb/a", "1"), ("tb/m", "x")] {
            recado(&[&["pub"][..], &p[..], &["-t", t, "-m", m, "-r"]].concat())
                .await
                .ok();
        }
        recado(&[&["pub"][..], &p[..], &["-t", "tb/a", "-m", "2", "-r"]].concat())
            .await
            .ok();
        // -W ends a table run successfully: the table is the output.
        let run = recado(&[&["sub"][..], &p[..], &["-t", "tb/#", "-T", "-W", "1"]].concat()).await;
        let lines = run.lines();
        assert_eq!(run.code, exit::OK, "{}: {run:?}", b.name);
        assert_eq!(lines.len(), 4, "{run:?}");
        assert!(lines[0].starts_with("TOPIC") && lines[0].contains("VALUE"));
        let rows: Vec<Vec<&str>> = lines[1..]
            .iter()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            rows.iter().map(|r| (r[0], r[1])).collect::<Vec<_>>(),
            vec![("tb/a", "2"), ("tb/m", "x"), ("tb/z", "last")]
        );
        // -C ends it too.
        let run =
            recado(&[&["sub"][..], &p[..], &["-t", "tb/#", "--table", "-C", "3"]].concat()).await;
        assert_eq!(run.lines().len(), 4, "{run:?}");
        for t in ["tb/z", "tb/a", "tb/m"] {
            recado(&[&["pub"][..], &p[..], &["-t", t, "-n", "-r"]].concat())
                .await
                .ok();
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sys_topics_as_a_table() {
    // The operator's view of a broker: `recado sub -t '$SYS/broker/#' -T`.
    for b in TestBroker::both("sys_table").await {
        let port = b.port();
        let run = recado(&[
            "sub",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            "$SYS/broker/#",
            "-T",
            "-W",
            "1.5",
        ])
        .await;
        assert_eq!(run.code, exit::OK, "{}: {run:?}", b.name);
        let lines = run.lines();
        assert!(lines.len() > 2, "{}: no $SYS topic: {run:?}", b.name);
        assert!(
            lines[1..].iter().all(|l| l.starts_with("$SYS/broker/")),
            "{run:?}"
        );
        let mut sorted = lines[1..].to_vec();
        sorted.sort();
        assert_eq!(sorted, lines[1..].to_vec(), "sorted by topic");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn request_response() {
    for b in TestBroker::both("rr").await {
        let port = b.port();
        let p = ["-h", "127.0.0.1", "-p", port.as_str()];
        // A responder: prints the request's response topic and correlation data.
        let responder = Background::subscribed(
            &[
                &["sub"][..],
                &p[..],
                &["-V", "5", "-t", "svc/req", "-C", "1", "-F", "%R %D %p"],
            ]
            .concat(),
        )
        .await;
        let mut requester = Background::subscribed(
            &[
                &["rr"][..],
                &p[..],
                &["-t", "svc/req", "-e", "svc/resp", "-m", "ping", "-W", "10"],
            ]
            .concat(),
        )
        .await;
        requester.wait_stderr("sending PUBLISH").await;
        let req = responder.finish().await;
        let req = req.ok().trim_end().to_string();
        let mut parts = req.splitn(3, ' ');
        let (resp_topic, corr, payload) = (
            parts.next().unwrap().to_string(),
            parts.next().unwrap().to_string(),
            parts.next().unwrap().to_string(),
        );
        assert_eq!(
            (resp_topic.as_str(), payload.as_str()),
            ("svc/resp", "ping"),
            "{}",
            b.name
        );
        assert!(!corr.is_empty());
        // A response with other correlation data is not the answer; the right one is.
        recado(
            &[
                &["pub"][..],
                &p[..],
                &[
                    "-V",
                    "5",
                    "-t",
                    &resp_topic,
                    "-m",
                    "other",
                    "-D",
                    "publish",
                    "correlation-data",
                    "nope",
                ],
            ]
            .concat(),
        )
        .await
        .ok();
        recado(
            &[
                &["pub"][..],
                &p[..],
                &[
                    "-V",
                    "5",
                    "-t",
                    &resp_topic,
                    "-m",
                    "pong",
                    "-D",
                    "publish",
                    "correlation-data",
                    &corr,
                ],
            ]
            .concat(),
        )
        .await
        .ok();
        let run = requester.finish().await;
        assert_eq!(run.stdout, "pong\n", "{}: {run:?}", b.name);
        assert_eq!(run.code, exit::OK);
        // No responder: -W gives exit code 5.
        let run = recado(
            &[
                &["rr"][..],
                &p[..],
                &[
                    "-t",
                    "svc/none",
                    "-e",
                    "svc/none/resp",
                    "-m",
                    "x",
                    "-W",
                    "0.5",
                ],
            ]
            .concat(),
        )
        .await;
        assert_eq!(run.code, exit::TIMEOUT, "{run:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn exit_codes_and_one_line_errors() {
    // Nothing listens on this port.
    let port = support::free_port().to_string();
    let run = recado(&["sub", "-h", "127.0.0.1", "-p", &port, "-t", "a"]).await;
    assert_eq!(run.code, exit::UNREACHABLE, "{run:?}");
    assert_eq!(run.stderr.lines().count(), 1, "{run:?}");
    assert!(run.stderr.contains("cannot connect"), "{run:?}");
    let run = recado(&[
        "pub",
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-t",
        "a",
        "-m",
        "x",
        "--quiet",
    ])
    .await;
    assert_eq!((run.code, run.stderr.as_str()), (exit::UNREACHABLE, ""));
    // Bad usage.
    for args in [
        &["sub"][..],
        &["pub", "-t", "a"],
        &["pub", "-t", "a", "-m", "x", "-n"],
        &["sub", "-t", "a", "-V", "4"],
        &["sub", "-t", "a/#/b"],
        &[
            "sub",
            "-t",
            "a",
            "-D",
            "connect",
            "session-expiry-interval",
            "5",
        ],
        &["sub", "-t", "a", "-c"],
        &["sub", "-t", "a", "--bogus"],
    ] {
        let run = recado(args).await;
        assert_eq!(run.code, exit::USAGE, "{args:?}: {run:?}");
    }
    // CONNACK refused: the reason code and its name, in 5.0 and 3.1.1.
    let mut config = support::common::test_config();
    config.auth.allow_anonymous = Some(false);
    let b = TestBroker::mercurio_with(config).await;
    let port = b.port();
    let run = recado(&["sub", "-h", "127.0.0.1", "-p", &port, "-t", "a", "-V", "5"]).await;
    assert_eq!(run.code, exit::CONNACK_REFUSED, "{run:?}");
    assert!(
        run.stderr.contains("0x87 Not authorized")
            || run.stderr.contains("0x86 Bad User Name or Password"),
        "{run:?}"
    );
    let run = recado(&[
        "pub",
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-t",
        "a",
        "-m",
        "x",
        "-u",
        "who",
        "-P",
        "bad",
    ])
    .await;
    assert_eq!(run.code, exit::CONNACK_REFUSED, "{run:?}");
    assert!(run.stderr.contains("return code"), "{run:?}");
    // Refused subscriptions and messages (an ACL lets anonymous clients use open/# only).
    let dir = tempfile::tempdir().unwrap();
    let acl = dir.path().join("acl");
    std::fs::write(&acl, "topic readwrite open/#\n").unwrap();
    let mut config = support::common::test_config();
    config.auth.acl_file = Some(acl.clone());
    let mercurio = TestBroker::mercurio_with(config).await;
    let acl_line = format!("acl_file {}", acl.display());
    let mosquitto = TestBroker::mosquitto("exit_codes", &acl_line)
        .await
        .map(|(m, _)| m);
    for b in std::iter::once(mercurio).chain(mosquitto) {
        let port = b.port();
        let p = ["-h", "127.0.0.1", "-p", port.as_str()];
        let run = recado(
            &[
                &["sub"][..],
                &p[..],
                &["-V", "5", "-t", "closed/x", "-W", "5"],
            ]
            .concat(),
        )
        .await;
        // mosquitto grants a subscription its ACL denies (and delivers nothing).
        if b.name == "mercurio" {
            assert_eq!(run.code, exit::REJECTED, "{}: {run:?}", b.name);
            assert!(run.stderr.contains("closed/x (0x"), "{run:?}");
        }
        let run = recado(
            &[
                &["pub"][..],
                &p[..],
                &["-V", "5", "-t", "closed/x", "-m", "x", "-q", "1"],
            ]
            .concat(),
        )
        .await;
        assert_eq!(run.code, exit::REJECTED, "{}: {run:?}", b.name);
        assert!(run.stderr.contains("Not authorized"), "{run:?}");
        let run = recado(
            &[
                &["pub"][..],
                &p[..],
                &["-V", "5", "-t", "open/x", "-m", "x", "-q", "1"],
            ]
            .concat(),
        )
        .await;
        assert_eq!(run.code, exit::OK, "{}: {run:?}", b.name);
    }
    // Against mosquitto too.
    if let Some((m, _)) = TestBroker::mosquitto("exit_codes", "").await {
        let run = recado(&[
            "sub",
            "-h",
            "127.0.0.1",
            "-p",
            &m.port(),
            "-t",
            "a",
            "-V",
            "31",
            "-i",
            "this-identifier-is-too-long-for-3.1",
        ])
        .await;
        assert_eq!(run.code, exit::USAGE, "{run:?}");
        let run = recado(&[
            "sub",
            "-h",
            "127.0.0.1",
            "-p",
            &m.port(),
            "-t",
            "a",
            "-W",
            "0.2",
        ])
        .await;
        assert_eq!(run.code, exit::TIMEOUT, "{run:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn url_will_and_sessions() {
    for b in TestBroker::both("url_will").await {
        let port = b.port();
        // -L carries host, port and topic.
        let url = format!("mqtt://127.0.0.1:{port}/u/topic");
        let sub = Background::subscribed(&["sub", "-L", &url, "-C", "1", "-v"]).await;
        recado(&["pub", "-L", &url, "-m", "via url"]).await.ok();
        assert_eq!(sub.finish().await.ok(), "u/topic via url\n", "{}", b.name);
        // A will is published when the connection ends without DISCONNECT: a takeover by
        // the same client identifier in 3.1.1 ends the first connection that way.
        let sub = Background::subscribed(&[
            "sub",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            "will/#",
            "-C",
            "1",
            "-v",
        ])
        .await;
        let first = Background::subscribed(&[
            "sub",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            "other",
            "-i",
            "willer",
            "--will-topic",
            "will/t",
            "--will-payload",
            "gone",
            "--will-qos",
            "1",
        ])
        .await;
        let second = Background::subscribed(&[
            "sub",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            "other",
            "-i",
            "willer",
            "-E",
        ])
        .await;
        second.finish().await;
        let run = sub.finish().await;
        assert_eq!(run.ok(), "will/t gone\n", "{}", b.name);
        // The taken over client connects again, as mosquitto_sub does (dropping it ends it).
        let mut first = first;
        first.wait_stderr("connecting again").await;
        drop(first);
        // -c with -x: a persistent session keeps messages while offline; -U unsubscribes.
        let p = ["-h", "127.0.0.1", "-p", port.as_str()];
        recado(
            &[
                &["sub"][..],
                &p[..],
                &[
                    "-V", "5", "-t", "ps", "-q", "1", "-c", "-i", "keeper", "-x", "60", "-E",
                ],
            ]
            .concat(),
        )
        .await
        .ok();
        recado(&[&["pub"][..], &p[..], &["-t", "ps", "-m", "kept", "-q", "1"]].concat())
            .await
            .ok();
        let run = recado(
            &[
                &["sub"][..],
                &p[..],
                &[
                    "-V", "5", "-t", "ps", "-q", "1", "-c", "-i", "keeper", "-x", "60", "-C", "1",
                ],
            ]
            .concat(),
        )
        .await;
        assert_eq!(run.ok(), "kept\n", "{}", b.name);
        let run = recado(
            &[
                &["sub"][..],
                &p[..],
                &["-V", "5", "-U", "ps", "-c", "-i", "keeper", "-x", "0"],
            ]
            .concat(),
        )
        .await;
        assert_eq!(run.code, exit::OK, "{run:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn help_documents_every_flag() {
    let sub = recado(&["sub", "--help"]).await;
    let publ = recado(&["pub", "--help"]).await;
    let rr = recado(&["rr", "--help"]).await;
    let common = [
        "-h, --host",
        "-p, --port",
        "-L, --url",
        "-V, --protocol-version",
        "-i, --id",
        "-I, --id-prefix",
        "-u, --username",
        "-P, --pw",
        "-k, --keepalive",
        "-c, --disable-clean-session",
        "-x, --session-expiry-interval",
        "-D, --property",
        "--will-topic",
        "--will-payload",
        "--will-qos",
        "--will-retain",
        "--tls",
        "--cafile",
        "--cert",
        "--key",
        "--insecure",
        "--tls-server-name",
        "--capath",
        "--tls-use-os-certs",
        "--tls-version",
        "-A, --bind-address",
        "--nodelay",
        "--ws",
        "-d, --debug",
        "--quiet",
        "Exit codes:",
        "-h is the host",
    ];
    let sub_only = [
        "-t, --topic",
        "-q, --qos",
        "-C, --count",
        "-W, --timeout",
        "-E",
        "-R",
        "--retained-only",
        "--remove-retained",
        "-v, --verbose",
        "-N",
        "-F, --format",
        "--json",
        "--pretty",
        "-T, --table",
        "--filter-out",
        "-U, --unsubscribe",
        "mosquitto_sub's -T",
        "--retain-handling",
        "--no-local",
        "--retain-as-published",
        "--stream-offset",
    ];
    let pub_only = [
        "-t, --topic",
        "-m, --message",
        "-f, --file",
        "-l, --stdin-line",
        "-s, --stdin-file",
        "-n, --null-message",
        "-q, --qos",
        "-r, --retain",
        "--repeat",
    ];
    let rr_only = [
        "-t, --topic",
        "-e, --response-topic",
        "--correlation-data",
        "-W, --timeout",
    ];
    for (run, own) in [
        (&sub, &sub_only[..]),
        (&publ, &pub_only[..]),
        (&rr, &rr_only[..]),
    ] {
        let text = run.ok();
        for flag in common.iter().chain(own) {
            assert!(
                text.contains(flag),
                "--help does not document {flag}:\n{text}"
            );
        }
    }
    // The exit codes are listed with their numbers.
    let top = recado(&["--help"]).await;
    for code in [
        "0  success",
        "3  broker unreachable",
        "4  CONNACK refused",
        "5  timeout",
    ] {
        assert!(top.ok().contains(code), "{top:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn keep_alive_pings_and_user_names() {
    let dir = tempfile::tempdir().unwrap();
    let passwd = dir.path().join("passwd");
    let passwd_s = passwd.to_str().unwrap().to_string();
    let have_mosquitto_passwd = std::process::Command::new("mosquitto_passwd")
        .args(["-c", "-b", &passwd_s, "alice", "s3cret"])
        .status()
        .is_ok_and(|s| s.success());
    if !have_mosquitto_passwd {
        mercurio::auth::password_file::set_password(&passwd, "alice", b"s3cret").unwrap();
    }
    let mut config = support::common::test_config();
    config.auth.password_file = Some(passwd.clone());
    config.auth.allow_anonymous = Some(false);
    let mut brokers = vec![TestBroker::mercurio_with(config).await];
    if have_mosquitto_passwd {
        let conf = format!("allow_anonymous false\npassword_file {passwd_s}");
        if let Some((m, _)) = TestBroker::mosquitto("user_names", &conf).await {
            brokers.push(m);
        }
    }
    for b in brokers {
        let port = b.port();
        let p = ["-h", "127.0.0.1", "-p", port.as_str()];
        // -k 1: a PINGREQ each second without traffic, each answered.
        let run = recado(
            &[
                &["sub"][..],
                &p[..],
                &[
                    "-u", "alice", "-P", "s3cret", "-t", "k", "-k", "1", "-W", "2.6", "-d",
                ],
            ]
            .concat(),
        )
        .await;
        assert_eq!(run.code, exit::TIMEOUT, "{}: {run:?}", b.name);
        assert!(
            run.stderr.matches("sending PINGREQ").count() >= 2,
            "{}: {run:?}",
            b.name
        );
        assert!(
            run.stderr.matches("received PINGRESP").count() >= 2,
            "{}: {run:?}",
            b.name
        );
        // The URL's credentials; a wrong password is a CONNACK refusal.
        let url = format!("mqtt://alice:s3cret@127.0.0.1:{port}/k");
        assert_eq!(
            recado(&["pub", "-L", &url, "-m", "x"]).await.code,
            exit::OK,
            "{}",
            b.name
        );
        let url = format!("mqtt://alice:wrong@127.0.0.1:{port}/k");
        let run = recado(&["pub", "-L", &url, "-m", "x", "-V", "5"]).await;
        assert_eq!(run.code, exit::CONNACK_REFUSED, "{}: {run:?}", b.name);
        assert!(
            run.stderr.contains("0x86 Bad User Name or Password")
                || run.stderr.contains("0x87 Not authorized"),
            "{run:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn topic_alias_and_repeat() {
    for b in TestBroker::both("topic_alias").await {
        let port = b.port();
        let p = ["-h", "127.0.0.1", "-p", port.as_str()];
        let sub = Background::subscribed(
            &[
                &["sub"][..],
                &p[..],
                &["-t", "al/#", "-v", "-C", "4", "-q", "1"],
            ]
            .concat(),
        )
        .await;
        // Lines published with a Topic Alias: the topic goes once, then the alias.
        let run = recado_with_input(
            &[
                &["pub"][..],
                &p[..],
                &[
                    "-V",
                    "5",
                    "-t",
                    "al/x",
                    "-l",
                    "-q",
                    "1",
                    "-D",
                    "publish",
                    "topic-alias",
                    "1",
                    "-d",
                ],
            ]
            .concat(),
            b"a\nb\n",
        )
        .await;
        assert_eq!(run.code, exit::OK, "{}: {run:?}", b.name);
        assert!(
            run.stderr.contains("'al/x'") && run.stderr.contains("''"),
            "{run:?}"
        );
        recado(
            &[
                &["pub"][..],
                &p[..],
                &[
                    "-t",
                    "al/y",
                    "-m",
                    "r",
                    "--repeat",
                    "2",
                    "--repeat-delay",
                    "0.05",
                ],
            ]
            .concat(),
        )
        .await
        .ok();
        let run = sub.finish().await;
        assert_eq!(
            run.lines(),
            vec!["al/x a", "al/x b", "al/y r", "al/y r"],
            "{}: {run:?}",
            b.name
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_runs_as_a_subcommand() {
    let b = TestBroker::mercurio().await;
    let run = recado(&[
        "bench",
        "-s",
        "fan-in",
        "-P",
        "2",
        "-d",
        "0.5",
        "-r",
        "200",
        "-p",
        &b.port(),
        "--label",
        "t",
    ])
    .await;
    let last = run.ok().lines().last().unwrap_or_default().to_string();
    let report: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(report["scenario"], "fan-in");
    assert_eq!(report["label"], "t");
    assert!(report["delivered"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["lost"], 0, "{report}");
    // Not loopback: refused as usage.
    let run = recado(&["bench", "-h", "192.0.2.1"]).await;
    assert_eq!(run.code, exit::USAGE, "{run:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_connects_from_the_addresses_of_its_source_network() {
    // A listener that answers every CONNECT with CONNACK 0 and notes where it came from.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let peers = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = std::sync::Arc::clone(&peers);
    let server = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            let Ok((mut s, peer)) = listener.accept().await else {
                return;
            };
            seen.lock().unwrap().push(peer.ip());
            tokio::spawn(async move {
                let mut buf = [0u8; 256];
                // CONNECT (one read is enough for its few bytes on loopback), then CONNACK;
                // then read until DISCONNECT or the end, and close (the server closes first).
                if s.read(&mut buf).await.unwrap_or(0) == 0 {
                    return;
                }
                let _ = s.write_all(&[0x20, 0x02, 0x00, 0x00]).await;
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || buf[..n].contains(&0xE0) {
                        break;
                    }
                }
            });
        }
    });
    let run = recado(&[
        "bench",
        "-s",
        "idle",
        "-C",
        "20",
        "--connect-concurrency",
        "5",
        "-d",
        "0.1",
        "-p",
        &port,
        "--source-net",
        "127.0.77.0/24",
    ])
    .await;
    let last = run.ok().lines().last().unwrap_or_default().to_string();
    let r: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(r["idle"]["connected"], 20, "{r}");
    let mut got: Vec<String> = peers
        .lock()
        .unwrap()
        .iter()
        .map(|ip| ip.to_string())
        .collect();
    got.sort();
    let mut want: Vec<String> = (1..=20).map(|i| format!("127.0.77.{i}")).collect();
    want.sort();
    assert_eq!(
        got, want,
        "one connection from each of the network's first 20 hosts"
    );
    server.abort();
    // Outside loopback, or not a network: refused as usage.
    for bad in ["10.0.0.0/24", "127.0.0.0/40", "localhost"] {
        let run = recado(&["bench", "-s", "idle", "-p", &port, "--source-net", bad]).await;
        assert_eq!(run.code, exit::USAGE, "{bad}: {run:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_sessions_reconnect_with_every_session_present() {
    let b = TestBroker::mercurio().await;
    let sessions = |phase: &'static str, prefix: &'static str, shown: &'static str| {
        let port = b.port();
        async move {
            let run = recado(&[
                "bench",
                "-s",
                "sessions",
                "-N",
                "40",
                "-q",
                "1",
                "--connect-concurrency",
                "10",
                "--phase",
                phase,
                "--session-prefix",
                prefix,
                "-p",
                &port,
            ])
            .await;
            let last = run.ok().lines().last().unwrap_or_default().to_string();
            let r: serde_json::Value = serde_json::from_str(&last).unwrap();
            assert_eq!(r["scenario"], "sessions", "{r}");
            // The figures are the last phase's, and say so.
            assert_eq!(r["sessions"]["phase"], shown, "{r}");
            let label = format!("({shown}): 40/40 sessions");
            assert!(run.stderr.contains(&label), "{}", run.stderr);
            assert_eq!(r["sessions"]["connected"], 40, "{r}");
            assert_eq!(r["sessions"]["failed"], 0, "{r}");
            r["sessions"]["session_present"].as_u64().unwrap()
        }
    };
    // Clean session 0 with no session stored: session present 0 [MQTT-3.2.2-3]; once the
    // sessions exist: 1 for every one [MQTT-3.2.2-2], whatever run made them.
    assert_eq!(sessions("reconnect", "fresh", "reconnect").await, 0);
    assert_eq!(sessions("create", "kept", "create").await, 0);
    assert_eq!(sessions("reconnect", "kept", "reconnect").await, 40);
    assert_eq!(
        sessions("both", "both", "reconnect").await,
        40,
        "create, then reconnect"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_fleet_reports_every_acknowledged_message_delivered() {
    let b = TestBroker::mercurio().await;
    // The broker runs in this process: its CPU % and RSS are this process's.
    let pid = std::process::id().to_string();
    for backends in ["1", "3"] {
        let run = recado(&[
            "bench",
            "-s",
            "fleet",
            "-N",
            "100",
            "-T",
            "0.5",
            "-d",
            "2",
            "--backends",
            backends,
            "-p",
            &b.port(),
            "--broker-pid",
            &pid,
        ])
        .await;
        let last = run.ok().lines().last().unwrap_or_default().to_string();
        let r: serde_json::Value = serde_json::from_str(&last).unwrap();
        assert_eq!(r["scenario"], "fleet", "{r}");
        assert_eq!(r["qos"], 1, "QoS 1 by default: {r}");
        let f = &r["fleet"];
        assert_eq!(f["devices"], 100, "{r}");
        assert_eq!(f["connected"], 100, "{r}");
        assert_eq!(f["offered_per_s"], 200.0, "{r}");
        let sent = r["sent"].as_u64().unwrap();
        // 100 devices, one message per 0.5 s +- 10 %, for 2 s: 3 or 4 each, whatever the phase.
        assert!((300..=500).contains(&sent), "{r}");
        assert_eq!(r["acked"], sent, "{r}");
        assert_eq!(r["delivered"], sent, "{r}");
        assert_eq!(r["lost"], 0, "{r}");
        assert_eq!(r["duplicates"], 0, "{r}");
        let lat = &r["latency_us"];
        assert_eq!(lat["count"], sent, "{r}");
        assert!(lat["max"].as_u64().unwrap() > 0, "{r}");
        assert!(
            lat["p99"].as_u64().unwrap() >= lat["p50"].as_u64().unwrap(),
            "{r}"
        );
        assert!(f["broker_cpu_pct"].as_f64().unwrap() > 0.0, "{r}");
        assert!(f["broker_rss_kib"].as_u64().unwrap() > 0, "{r}");
        if backends == "3" {
            assert_eq!(f["filter"], "$share/backend/#", "{r}");
        } else {
            assert_eq!(f["filter"], "#", "{r}");
        }
        assert!(run.stderr.contains("fleet: 100/100 devices"), "{run:?}");
    }
    // QoS 2 is not a fleet's.
    let run = recado(&["bench", "-s", "fleet", "-q", "2", "-p", &b.port()]).await;
    assert_eq!(run.code, exit::USAGE, "{run:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn mqtt5_to_a_broker_without_it_is_a_connack_refusal() {
    // A 3.1.1-only broker answers a 5.0 CONNECT with return code 1 (MQTT 3.1.1 section
    // 3.1.2.2, [MQTT-3.1.2-2]), a CONNACK 5.0 would call malformed.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let server = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 256];
        let _ = s.read(&mut buf).await;
        s.write_all(&[0x20, 0x02, 0x00, 0x01]).await.unwrap();
    });
    let run = recado(&["sub", "-h", "127.0.0.1", "-p", &port, "-t", "a", "-V", "5"]).await;
    assert_eq!(run.code, exit::CONNACK_REFUSED, "{run:?}");
    assert!(run.stderr.contains("-V mqttv311"), "{run:?}");
    server.await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn sub_connects_again_when_the_broker_restarts() {
    // As mosquitto_sub: a lost connection is opened again and the filters subscribed again.
    let port = support::free_port();
    let port_s = port.to_string();
    let mut config = support::common::test_config();
    config.listeners[0].port = port;
    for v in ["mqttv311", "mqttv5"] {
        let broker = start_on_same_port(&config).await;
        let mut sub = Background::subscribed(&[
            "sub",
            "-h",
            "127.0.0.1",
            "-p",
            &port_s,
            "-V",
            v,
            "-t",
            "again",
            "-C",
            "1",
            "-v",
        ])
        .await;
        broker.shutdown().await;
        drop(broker);
        sub.wait_stderr("connecting again").await;
        let restarted = start_on_same_port(&config).await;
        sub.wait_stderr("connected again").await;
        sub.wait_stderr("received SUBACK").await;
        recado(&[
            "pub",
            "-h",
            "127.0.0.1",
            "-p",
            &port_s,
            "-t",
            "again",
            "-m",
            "back",
        ])
        .await
        .ok();
        let run = sub.finish().await;
        assert_eq!(run.ok(), "again back\n", "{v}");
        restarted.shutdown().await;
    }
}

/// What sub prints reaches a pipe while it runs, as soon as no other message came with it,
/// also when the last message of a read is one it does not print (--filter-out): two
/// retained messages come with the SUBACK, the first printed, the second filtered out.
#[tokio::test(flavor = "multi_thread")]
async fn sub_prints_each_message_while_it_runs() {
    let broker = TestBroker::mercurio().await;
    let port = broker.port();
    for (topic, message) in [("live/a", "first"), ("live/b", "hidden")] {
        recado(&[
            "pub",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-q",
            "1",
            "-r",
            "-t",
            topic,
            "-m",
            message,
        ])
        .await
        .ok();
    }
    let mut sub = Background::subscribed(&[
        "sub",
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-t",
        "live/#",
        "--filter-out",
        "live/b",
        "-v",
        "-C",
        "2",
    ])
    .await;
    sub.wait_stdout("live/a first").await;
    recado(&[
        "pub",
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-t",
        "live/c",
        "-m",
        "second",
    ])
    .await
    .ok();
    sub.wait_stdout("live/c second").await;
    let run = sub.finish().await;
    assert_eq!(run.ok(), "live/a first\nlive/c second\n");
}

/// A stream reader that loses its connection subscribes again from the message after the
/// last one it received, not from its --stream-offset again.
#[tokio::test(flavor = "multi_thread")]
async fn sub_resumes_a_stream_after_its_last_message_when_it_connects_again() {
    let port = support::free_port();
    let port_s = port.to_string();
    let mut config = support::common::test_config();
    config.listeners[0].port = port;
    config.streams = vec![stream_s()];
    let broker = start_on_same_port(&config).await;
    publish_to_stream(&port_s, "a").await;
    publish_to_stream(&port_s, "b").await;
    let mut sub = Background::subscribed(&[
        "sub",
        "-h",
        "127.0.0.1",
        "-p",
        &port_s,
        "-V",
        "5",
        "-i",
        "reader",
        "-t",
        "$stream/s",
        "--stream-offset",
        "earliest",
        "-v",
        "-C",
        "3",
        "-q",
        "1",
    ])
    .await;
    sub.wait_stderr("received PUBLISH").await;
    sub.wait_stderr("received PUBLISH").await;
    assert!(broker.disconnect("reader"), "the reader was connected");
    sub.wait_stderr("connected again").await;
    sub.wait_stderr("received SUBACK").await;
    publish_to_stream(&port_s, "c").await;
    let run = sub.finish().await;
    assert_eq!(
        run.lines(),
        ["st/x @1 a", "st/x @2 b", "st/x @3 c"],
        "{run:?}"
    );
    broker.shutdown().await;
}

/// Starts a broker on the fixed port of `config`, again: the port of a broker just stopped
/// may take a moment to be free.
async fn start_on_same_port(config: &mercurio::config::Config) -> mercurio::BrokerHandle {
    let deadline = tokio::time::Instant::now() + support::DEADLINE;
    loop {
        match mercurio::Broker::builder(config.clone()).start().await {
            Ok(h) => return h,
            Err(e) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "broker restart: {e}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_message_over_the_brokers_maximum_packet_size_is_refused_before_sending() {
    let mut config = support::common::test_config();
    config.server.max_packet_size = 200;
    let mut brokers = vec![TestBroker::mercurio_with(config).await];
    if let Some((m, _)) = TestBroker::mosquitto("max_packet", "max_packet_size 200").await {
        brokers.push(m);
    }
    for b in brokers {
        let port = b.port();
        let big = "x".repeat(300);
        let run = recado(&[
            "pub",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-V",
            "5",
            "-t",
            "big",
            "-m",
            &big,
        ])
        .await;
        assert_eq!(run.code, exit::REJECTED, "{}: {run:?}", b.name);
        assert!(run.stderr.contains("Maximum Packet Size of 200"), "{run:?}");
        let run = recado(&[
            "pub",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-V",
            "5",
            "-t",
            "small",
            "-m",
            "x",
        ])
        .await;
        assert_eq!(run.code, exit::OK, "{}: {run:?}", b.name);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn client_identifier_prefix() {
    for b in TestBroker::both("id_prefix").await {
        let run = recado(&[
            "sub",
            "-h",
            "127.0.0.1",
            "-p",
            &b.port(),
            "-t",
            "a",
            "-E",
            "-d",
            "-I",
            "pfx-",
        ])
        .await;
        assert_eq!(run.code, exit::OK, "{}: {run:?}", b.name);
        let line = run.stderr.lines().next().unwrap_or_default().to_string();
        let id = line.split_whitespace().nth(1).unwrap_or_default();
        assert!(
            id.starts_with("pfx-") && id[4..].parse::<u32>().is_ok(),
            "{line}"
        );
    }
}

/// A stream `s` on `st/#`, unbounded.
fn stream_s() -> mercurio::config::StreamConfig {
    mercurio::config::StreamConfig {
        name: "s".into(),
        filter: "st/#".into(),
        max_age: 0,
        max_bytes: 0,
        last_value: false,
    }
}

/// Publishes `message` at QoS 1 to `st/x` (stream `s`) through the broker on `port`.
async fn publish_to_stream(port: &str, message: &str) {
    recado(&[
        "pub",
        "-h",
        "127.0.0.1",
        "-p",
        port,
        "-t",
        "st/x",
        "-m",
        message,
        "-q",
        "1",
    ])
    .await
    .ok();
}

/// `--stream-offset` starts a stream reader where it says (the SUBSCRIBE's user property);
/// -v prints each message's offset after its topic.
#[tokio::test(flavor = "multi_thread")]
async fn sub_reads_a_stream_from_an_offset() {
    let mut config = common::test_config();
    config.streams = vec![stream_s()];
    let b = TestBroker::mercurio_with(config).await;
    let port = b.port();
    for m in ["a", "b", "c"] {
        publish_to_stream(&port, m).await;
    }
    let run = recado(&[
        "sub",
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-V",
        "5",
        "-t",
        "$stream/s",
        "--stream-offset",
        "2",
        "-v",
        "-C",
        "2",
        "-q",
        "1",
    ])
    .await;
    assert_eq!(run.lines(), ["st/x @2 b", "st/x @3 c"], "{run:?}");
    assert_eq!(run.code, exit::OK);
    let run = recado(&[
        "sub",
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-t",
        "$stream/s",
        "--stream-offset",
        "2",
    ])
    .await;
    assert_eq!(run.code, exit::USAGE, "{run:?}");
    assert!(run.stderr.contains("$stream/<name>/@2"), "{run:?}");
    let run = recado(&[
        "sub",
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-V",
        "5",
        "-t",
        "$stream/s",
        "--stream-offset",
        "soon",
    ])
    .await;
    assert_eq!(run.code, exit::USAGE, "{run:?}");
    assert!(run.stderr.contains("stream-offset \"soon\""), "{run:?}");
    // An offset without a stream to read: refused before connecting, not sent for nothing.
    let run = recado(&[
        "sub",
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-V",
        "5",
        "-t",
        "tenants/#",
        "--stream-offset",
        "earliest",
    ])
    .await;
    assert_eq!(run.code, exit::USAGE, "{run:?}");
    assert!(run.stderr.contains("-t '$stream/<name>'"), "{run:?}");
}
