//! `mercurioctl config import-mosquitto`: the mosquitto.conf examples of mosquitto's manual
//! page (mosquitto.conf(5)) and Debian's packaged file, converted and then checked by
//! `mercuriod --check-config`; a converted configuration serving mosquitto's clients with a
//! mosquitto_passwd file and an ACL file as they are; every option of the manual page either
//! carried over or explained.
//!
//! mercuriod runs through mercurio-testkit (found next to mercurioctl in the target directory,
//! built when missing). The test that runs mosquitto's clients skips without them (fails under
//! `CI=true`).
#![cfg(unix)]

use std::path::Path;
use std::process::{Command, Output};

use mercurio_core::config::Config;
use mercurio_testkit::{mercuriod_bin, mosquitto_clients, program, Daemon, Mosquitto};

/// The mercurioctl binary under test.
const MERCURIOCTL: &str = env!("CARGO_BIN_EXE_mercurioctl");

/// `mercurioctl config import-mosquitto FILE`: (status, stdout, stderr).
fn import(file: &Path) -> (Option<i32>, String, String) {
    let out: Output = Command::new(MERCURIOCTL)
        .args(["config", "import-mosquitto"])
        .arg(file)
        .output()
        .expect("run mercurioctl");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Converts `file`, expects success, writes the result beside it as `mercuriod.toml`, runs
/// `mercuriod -c mercuriod.toml --check-config` on it, and returns the TOML and the
/// configuration mercuriod's reader makes of it.
fn round_trip(file: &Path) -> (String, Config) {
    let (code, toml, err) = import(file);
    assert_eq!(code, Some(0), "{err}\n{toml}");
    let out_path = file.with_file_name("mercuriod.toml");
    std::fs::write(&out_path, &toml).expect("write converted");
    let out = Command::new(mercuriod_bin())
        .arg("-c")
        .arg(&out_path)
        .arg("--check-config")
        .output()
        .expect("run mercuriod --check-config");
    assert_eq!(
        out.status.code(),
        Some(0),
        "mercuriod --check-config: {}\n{toml}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("configuration OK"),
        "{out:?}"
    );
    let config = toml::from_str(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    (toml, config)
}

fn write(path: &Path, text: &str) {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("mkdir");
    }
    std::fs::write(path, text).expect("write");
}

fn ports(config: &Config) -> Vec<u16> {
    config.listeners.iter().map(|l| l.port).collect()
}

/// mosquitto.conf(5), include_dir: "Load Order for include_dir" (00, 01, A, a, B, b) and "Load
/// Order for Multiple include_dir" (one.d's B, C, then two.d's A, D). Each file opens a
/// listener on its own port, so the listeners' order is the order the files were read in.
#[test]
fn include_dir_examples_of_the_manual_page() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    let single = d.join("conf.d");
    for (i, name) in ["b.conf", "A.conf", "01.conf", "a.conf", "B.conf", "00.conf"]
        .iter()
        .enumerate()
    {
        write(&single.join(name), &format!("listener {}\n", 1900 + i));
    }
    // Not a .conf file: not read.
    write(&single.join("README"), "listener 1999\n");
    let main = d.join("mosquitto.conf");
    write(
        &main,
        &format!("allow_anonymous true\ninclude_dir {}\n", single.display()),
    );
    let (toml, config) = round_trip(&main);
    // 00, 01, A, a, B, b.
    assert_eq!(
        ports(&config),
        [1905, 1902, 1901, 1903, 1904, 1900],
        "{toml}"
    );
    assert!(toml.contains("00.conf:1 `listener 1905`"), "{toml}");

    let one = d.join("one.d");
    let two = d.join("two.d");
    write(&one.join("B.conf"), "listener 1911\n");
    write(&one.join("C.conf"), "listener 1912\n");
    write(&two.join("A.conf"), "listener 1913\n");
    write(&two.join("D.conf"), "listener 1914\n");
    write(
        &main,
        &format!(
            "include_dir {}\ninclude_dir {}\nallow_anonymous true\n",
            one.display(),
            two.display()
        ),
    );
    let (toml, config) = round_trip(&main);
    assert_eq!(ports(&config), [1911, 1912, 1913, 1914], "{toml}");
    // The security option after the include_dir lines is still global.
    assert_eq!(config.auth.allow_anonymous, Some(true));
}

/// mosquitto.conf(5), topic: "Bridge Topic Remapping", and the topic example of the same
/// entry (`topic # both 2 local/topic/ remote/topic/`), with restart_timeout's examples.
#[test]
fn bridge_examples_of_the_manual_page() {
    let dir = tempfile::tempdir().expect("temp dir");
    let main = dir.path().join("mosquitto.conf");
    write(
        &main,
        "listener 1883 127.0.0.1\nallow_anonymous true\n\n\
         connection test-mosquitto-org\naddress test.mosquitto.org\ncleansession true\n\
         topic clients/total in 0 test/mosquitto/org/ $SYS/broker/\n\
         topic # both 2 local/topic/ remote/topic/\nrestart_timeout 10 30\n",
    );
    let (toml, _) = round_trip(&main);
    // Written as [[bridges]] entries, commented out while this version has no bridges.
    let bridges: String = toml
        .lines()
        .skip_while(|l| !l.contains("[[bridges]]"))
        .map(|l| l.strip_prefix("# ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let table: toml::Table = bridges.parse().unwrap_or_else(|e| panic!("{e}\n{bridges}"));
    let bridge = &table["bridges"][0];
    assert_eq!(bridge["name"].as_str(), Some("test-mosquitto-org"));
    assert_eq!(
        bridge["addresses"].as_array().map(|a| a.len()),
        Some(1),
        "{bridge}"
    );
    assert_eq!(
        bridge["addresses"][0].as_str(),
        Some("test.mosquitto.org:1883")
    );
    assert_eq!(bridge["clean_start"].as_bool(), Some(true));
    assert_eq!(bridge["protocol_version"].as_str(), Some("mqttv311"));
    assert_eq!(bridge["keepalive"].as_integer(), Some(60));
    assert_eq!(bridge["notifications"].as_bool(), Some(true));
    let topic = &bridge["topics"][0];
    assert_eq!(topic["pattern"].as_str(), Some("clients/total"));
    assert_eq!(topic["direction"].as_str(), Some("in"));
    assert_eq!(topic["qos"].as_integer(), Some(0));
    assert_eq!(topic["local_prefix"].as_str(), Some("test/mosquitto/org/"));
    assert_eq!(topic["remote_prefix"].as_str(), Some("$SYS/broker/"));
    let topic = &bridge["topics"][1];
    assert_eq!(topic["pattern"].as_str(), Some("#"));
    assert_eq!(topic["direction"].as_str(), Some("both"));
    assert_eq!(topic["qos"].as_integer(), Some(2));
    // What has no equivalent is said, with its line.
    assert!(
        toml.contains("mosquitto.conf:9 `restart_timeout 10 30`:"),
        "{toml}"
    );
}

/// Debian's /etc/mosquitto/mosquitto.conf (mosquitto 2.0.11), with its paths moved into a
/// temp dir: local-only mode, persistence, a log file, and an include_dir.
#[test]
fn debian_packaged_configuration() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    let lib = d.join("var/lib/mosquitto");
    let log = d.join("var/log/mosquitto");
    std::fs::create_dir_all(&lib).expect("mkdir");
    std::fs::create_dir_all(&log).expect("mkdir");
    let confd = d.join("conf.d");
    write(
        &confd.join("README"),
        "Any files placed in this directory...\n",
    );
    let main = d.join("mosquitto.conf");
    write(
        &main,
        &format!(
            "# Place your local configuration in /etc/mosquitto/conf.d/\n#\n\
             # A full description of the configuration file is at\n\
             # /usr/share/doc/mosquitto/examples/mosquitto.conf.example\n\n\
             pid_file /run/mosquitto/mosquitto.pid\n\npersistence true\n\
             persistence_location {}/\n\nlog_dest file {}/mosquitto.log\n\n\
             include_dir {}\n",
            lib.display(),
            log.display(),
            confd.display()
        ),
    );
    let (toml, config) = round_trip(&main);
    // No listener line: mosquitto's local-only mode, anonymous clients on the loopback.
    assert_eq!(ports(&config), [1883]);
    assert_eq!(config.listeners[0].host, "127.0.0.1");
    assert_eq!(config.auth.allow_anonymous, Some(true));
    assert_eq!(
        config.storage.path.as_deref(),
        Some(lib.join("mercurio.db").as_path())
    );
    assert_eq!(
        config.logging.file.as_deref(),
        Some(log.join("mosquitto.log").as_path())
    );
    assert!(
        toml.contains("mosquitto.conf:6 `pid_file /run/mosquitto/mosquitto.pid`:"),
        "{toml}"
    );
}

/// The system's own files, when mosquitto is installed: converted without error (their paths
/// may not exist here, so mercuriod's file checks are not run).
#[test]
fn installed_example_files_convert() {
    for file in [
        "/etc/mosquitto/mosquitto.conf",
        "/usr/share/doc/mosquitto/examples/mosquitto.conf",
    ] {
        let path = Path::new(file);
        if !path.exists() {
            mercurio_testkit::skip(
                "installed_example_files_convert",
                &format!("no {file} (it comes with Debian's mosquitto package)"),
            );
            continue;
        }
        let (code, toml, err) = import(path);
        assert_eq!(code, Some(0), "{file}: {err}\n{toml}");
        let _: Config = toml::from_str(&toml).unwrap_or_else(|e| panic!("{file}: {e}\n{toml}"));
    }
}

/// Every option of mosquitto.conf(5) (general, listener, TLS, PSK, bridge), each on its own
/// line: the conversion succeeds and every line is named in the output, either beside the key
/// it became or in the list of lines not carried over.
#[test]
fn every_option_of_the_manual_page_is_carried_or_explained() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path().display().to_string();
    let lines = [
        "per_listener_settings false",
        "acl_file /etc/mosquitto/acl",
        "allow_anonymous false",
        "allow_duplicate_messages false",
        "allow_zero_length_clientid true",
        "auth_opt_db_host localhost",
        "auth_plugin_deny_special_chars true",
        "auto_id_prefix auto-",
        "autosave_interval 1800",
        "autosave_on_changes false",
        "check_retain_source false",
        "clientid_prefixes sensor-",
        "connection_messages true",
        "log_dest stdout",
        "log_facility 5",
        "log_timestamp true",
        "log_timestamp_format %Y-%m-%dT%H:%M:%S",
        "log_type information",
        "max_inflight_bytes 0",
        "max_inflight_messages 20",
        "max_keepalive 65535",
        "max_packet_size 0",
        "max_queued_bytes 0",
        "max_queued_messages 1000",
        "memory_limit 0",
        "password_file /etc/mosquitto/passwd",
        "persistence true",
        &format!("persistence_file {d}/mosquitto.db"),
        &format!("persistence_location {d}/"),
        "persistent_client_expiration 1w",
        "pid_file /run/mosquitto.pid",
        "retain_available true",
        "set_tcp_nodelay false",
        "sys_interval 10",
        "upgrade_outgoing_qos false",
        "user mosquitto",
        "listener 1883",
        "bind_interface eth0",
        "max_connections -1",
        "max_qos 2",
        "max_topic_alias 10",
        "protocol mqtt",
        "socket_domain ipv4",
        "use_username_as_clientid false",
        "listener 8080 127.0.0.1",
        "protocol websockets",
        "http_dir /var/www",
        "websockets_log_level 0",
        "websockets_headers_size 1024",
        "listener 8883",
        "cafile /etc/mosquitto/ca.crt",
        "capath /etc/mosquitto/ca",
        "certfile /etc/mosquitto/server.crt",
        "ciphers HIGH",
        "ciphers_tls1.3 TLS_AES_256_GCM_SHA384",
        "crlfile /etc/mosquitto/crl.pem",
        "dhparamfile /etc/mosquitto/dh.pem",
        "keyfile /etc/mosquitto/server.key",
        "require_certificate true",
        "tls_engine pkcs11",
        "tls_keyform pem",
        "tls_version tlsv1.2",
        "use_identity_as_username true",
        "use_subject_as_username false",
        "listener 8884",
        "connection remote",
        "addresses remote.example.com:1883 backup.example.com",
        "bridge_attempt_unsubscribe true",
        "bridge_bind_address 10.0.0.1",
        "bridge_max_packet_size 0",
        "bridge_outgoing_retain true",
        "bridge_protocol_version mqttv50",
        "cleansession false",
        "local_cleansession false",
        "keepalive_interval 60",
        "idle_timeout 60",
        "local_clientid local",
        "local_password secret",
        "local_username local",
        "notifications true",
        "notifications_local_only false",
        "notification_topic $SYS/bridge",
        "remote_clientid remote-id",
        "remote_password secret",
        "remote_username remote-user",
        "restart_timeout 5 30",
        "round_robin false",
        "start_type automatic",
        "threshold 10",
        "topic sensors/# out 1",
        "try_private true",
        "bridge_alpn mqtt",
        "bridge_cafile /etc/mosquitto/bridge-ca.crt",
        "bridge_certfile /etc/mosquitto/bridge.crt",
        "bridge_insecure false",
        "bridge_keyfile /etc/mosquitto/bridge.key",
        "bridge_require_ocsp false",
        "bridge_tls_version tlsv1.2",
    ];
    let main = dir.path().join("mosquitto.conf");
    write(&main, &(lines.join("\n") + "\n"));
    let (code, toml, err) = import(&main);
    assert_eq!(code, Some(0), "{err}\n{toml}");
    for (i, line) in lines.iter().enumerate() {
        let place = format!("mosquitto.conf:{} ", i + 1);
        assert!(
            toml.contains(&place),
            "line {} `{line}` not named:\n{toml}",
            i + 1
        );
    }
    // Secrets are not repeated in comments.
    assert!(!toml.contains("local_password secret"), "{toml}");
    let config: Config = toml::from_str(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    assert_eq!(config.server.persistent_client_expiration, 7 * 86_400);
    assert_eq!(config.server.max_packet_size, 268_435_455);
    assert_eq!(ports(&config), [1883, 8080, 8883, 8884]);
    assert_eq!(config.listeners[0].host, "0.0.0.0");
    let ws = &config.listeners[1];
    assert_eq!(ws.host, "127.0.0.1");
    assert_eq!(ws.http_dir.as_deref(), Some(Path::new("/var/www")));
    let tls = &config.listeners[2];
    assert!(tls.require_certificate && tls.use_identity_as_username);
    assert_eq!(
        tls.ca_file.as_deref(),
        Some(Path::new("/etc/mosquitto/ca.crt"))
    );
    assert_eq!(
        config.auth.password_file.as_deref(),
        Some(Path::new("/etc/mosquitto/passwd"))
    );
    assert_eq!(config.auth.allow_anonymous, Some(false));
}

/// `per_listener_settings true`: each listener's security options go to its own table;
/// mount_point, allow_zero_length_clientid, message_size_limit, check_retain_source and
/// upgrade_outgoing_qos carried over.
#[test]
fn per_listener_settings_and_mosquitto_options() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    let passwd = d.join("passwd");
    write(&passwd, "");
    let acl = d.join("acl");
    write(&acl, "topic read public/#\n");
    let main = d.join("mosquitto.conf");
    write(
        &main,
        &format!(
            "per_listener_settings true\nmessage_size_limit 1000\n\
             check_retain_source true\nupgrade_outgoing_qos true\n\
             listener 1883 127.0.0.1\nallow_anonymous true\nmount_point local/\n\
             allow_zero_length_clientid false\n\
             listener 8883 0.0.0.0\npassword_file {}\nacl_file {}\nallow_zero_length_clientid false\n",
            passwd.display(),
            acl.display()
        ),
    );
    let (toml, config) = round_trip(&main);
    assert_eq!(config.auth.allow_anonymous, Some(false), "{toml}");
    assert!(config.server.check_retain_source, "{toml}");
    assert!(config.server.upgrade_outgoing_qos, "{toml}");
    let (local, public) = (&config.listeners[0], &config.listeners[1]);
    assert_eq!(local.allow_anonymous, Some(true));
    assert_eq!(local.mount_point.as_deref(), Some("local/"));
    assert_eq!(local.password_file, None);
    assert_eq!(public.allow_anonymous, Some(false));
    assert_eq!(public.password_file.as_deref(), Some(passwd.as_path()));
    assert_eq!(public.acl_file.as_deref(), Some(acl.as_path()));
    assert!(!config.server.allow_zero_length_clientid);
    assert_eq!(config.server.message_size_limit, 1000);
}

/// Values mosquitto refuses are refused with the file and line (exit status 78); options
/// mosquitto does not know are listed, not fatal.
#[test]
fn invalid_values_name_their_line() {
    let dir = tempfile::tempdir().expect("temp dir");
    let main = dir.path().join("mosquitto.conf");
    for (text, words) in [
        (
            "listener 1883\npersistent_client_expiration 3600\n",
            "mosquitto.conf:2",
        ),
        ("listener 70000\n", "mosquitto.conf:1: listener 70000"),
        ("allow_anonymous yes\n", "not true or false"),
        ("topic a/# out 0\n", "outside a bridge"),
    ] {
        write(&main, text);
        let (code, out, err) = import(&main);
        assert_eq!(code, Some(78), "{text}: {err}");
        assert!(out.is_empty(), "{out}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(words), "{text}: {err}");
    }
    write(
        &main,
        "listener 1883 127.0.0.1\nallow_anonymous true\nno_such_option 1\n",
    );
    let (toml, _) = round_trip(&main);
    assert!(
        toml.contains("mosquitto.conf:3 `no_such_option 1`: not a mosquitto 2.0 option"),
        "{toml}"
    );
    let (code, _, err) = import(&dir.path().join("missing.conf"));
    assert_eq!(code, Some(78));
    assert!(err.contains("missing.conf: cannot read"), "{err}");
}

/// A converted configuration with a password file made by mosquitto_passwd and an ACL file,
/// both used as they are: mosquitto_pub/mosquitto_sub with the right user publish and read;
/// anonymous clients and wrong passwords are refused; the ACL denies what it does not allow.
#[test]
fn converted_configuration_serves_mosquitto_clients() {
    const TEST: &str = "converted_configuration_serves_mosquitto_clients";
    if !mosquitto_clients(TEST) || !program(TEST, "mosquitto_passwd", "apt-get install mosquitto") {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    let passwd = d.join("passwd");
    let status = Command::new("mosquitto_passwd")
        .args(["-c", "-b"])
        .arg(&passwd)
        .args(["alice", "wonderland"])
        .status()
        .expect("mosquitto_passwd");
    assert!(status.success());
    let acl = d.join("acl");
    write(&acl, "user alice\ntopic readwrite room/#\n");
    let main = d.join("mosquitto.conf");
    write(
        &main,
        &format!(
            "listener 1883 127.0.0.1\npassword_file {}\nacl_file {}\n",
            passwd.display(),
            acl.display()
        ),
    );
    let (toml, config) = round_trip(&main);
    assert_eq!(config.auth.allow_anonymous, Some(false), "{toml}");

    // Port 0 instead of 1883, and the admin socket in the temp dir.
    let socket = d.join("mercuriod.sock");
    let text = toml.replace("port = 1883", "port = 0")
        + &format!("\n[admin]\nsocket = {:?}\n", socket.display().to_string());
    let daemon = Daemon::with_config(&text).socket(socket).start();
    let port = daemon.port().to_string();

    let client = |tool: &str, args: &[&str]| -> Output {
        Command::new(tool)
            .args(["-h", "127.0.0.1", "-p", &port, "-V", "mqttv311"])
            .args(args)
            .output()
            .expect("run a mosquitto client")
    };
    let ok = client(
        "mosquitto_pub",
        &[
            "-u",
            "alice",
            "-P",
            "wonderland",
            "-t",
            "room/1",
            "-m",
            "hi",
            "-r",
            "-q",
            "1",
        ],
    );
    assert!(ok.status.success(), "{ok:?}");
    // The retained message, read back by alice.
    let got = client(
        "mosquitto_sub",
        &[
            "-u",
            "alice",
            "-P",
            "wonderland",
            "-t",
            "room/#",
            "-C",
            "1",
            "-W",
            "10",
        ],
    );
    assert!(got.status.success(), "{got:?}");
    assert_eq!(String::from_utf8_lossy(&got.stdout).trim(), "hi");

    for args in [
        &["-t", "room/1", "-m", "x"][..],
        &["-u", "alice", "-P", "wrong", "-t", "room/1", "-m", "x"],
    ] {
        let refused = client("mosquitto_pub", args);
        assert!(!refused.status.success(), "{args:?}: {refused:?}");
        let err = String::from_utf8_lossy(&refused.stderr).to_lowercase();
        assert!(
            err.contains("not authori") || err.contains("bad user name or password"),
            "{args:?}: {err}"
        );
    }
    // Outside the ACL: alice's subscription to other/# is refused (SUBACK 0x80), so nothing
    // retained there reaches her within the wait.
    let denied = client(
        "mosquitto_sub",
        &[
            "-u",
            "alice",
            "-P",
            "wonderland",
            "-t",
            "other/#",
            "-C",
            "1",
            "-W",
            "2",
            "-d",
        ],
    );
    let out = String::from_utf8_lossy(&denied.stdout);
    assert!(out.contains("Subscribed (mid: 1): 128"), "{out}");
}

/// The files of one TLS test, in a directory mosquitto can read once it has dropped root for
/// its own user (a temp dir is 0700): ca.pem, server.pem and server.key (for 127.0.0.1), the
/// client certificates good.pem/good.key (serial 1001) and revoked.pem/revoked.key (serial
/// 1002), crl.pem (the CA revokes 1002), and empty passwd and acl files.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        use rcgen::{
            BasicConstraints, CertificateParams, CertificateRevocationListParams, DnType,
            ExtendedKeyUsagePurpose, IsCa, KeyIdMethod, KeyPair, KeyUsagePurpose,
            RevokedCertParams, SerialNumber,
        };
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let pki = Pki { dir };
        let ca_key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(DnType::CommonName, "import test CA");
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = p.self_signed(&ca_key).expect("CA");
        pki.write("ca.pem", &ca.pem());
        let leaf = |name: &str, cn: &str, server: bool, serial: u64| {
            let key = KeyPair::generate().expect("key");
            let names = if server {
                vec!["localhost".to_string(), "127.0.0.1".to_string()]
            } else {
                Vec::new()
            };
            let mut p = CertificateParams::new(names).expect("params");
            p.distinguished_name.push(DnType::CommonName, cn);
            p.serial_number = Some(SerialNumber::from(serial));
            p.extended_key_usages = vec![if server {
                ExtendedKeyUsagePurpose::ServerAuth
            } else {
                ExtendedKeyUsagePurpose::ClientAuth
            }];
            let cert = p.signed_by(&key, &ca, &ca_key).expect("leaf");
            pki.write(&format!("{name}.pem"), &cert.pem());
            pki.write(&format!("{name}.key"), &key.serialize_pem());
        };
        leaf("server", "localhost", true, 1000);
        leaf("good", "good-device", false, 1001);
        leaf("revoked", "revoked-device", false, 1002);
        let crl = CertificateRevocationListParams {
            this_update: rcgen::date_time_ymd(2024, 1, 1),
            next_update: rcgen::date_time_ymd(2099, 1, 1),
            crl_number: SerialNumber::from(1u64),
            issuing_distribution_point: None,
            revoked_certs: vec![RevokedCertParams {
                serial_number: SerialNumber::from(1002u64),
                revocation_time: rcgen::date_time_ymd(2024, 6, 1),
                reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                invalidity_date: None,
            }],
            key_identifier_method: KeyIdMethod::Sha256,
        }
        .signed_by(&ca, &ca_key)
        .expect("CRL");
        pki.write("crl.pem", &crl.pem().expect("CRL PEM"));
        pki.write("passwd", "");
        pki.write("acl", "topic read public/#\n");
        pki
    }

    fn write(&self, name: &str, text: &str) {
        use std::os::unix::fs::PermissionsExt;
        let path = self.path(name);
        write(Path::new(&path), text);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    /// `text` with `{pki}` replaced by the directory.
    fn fill(&self, text: &str) -> String {
        text.replace("{pki}", &self.dir.path().display().to_string())
    }
}

/// The start of each security test's mosquitto.conf: lines 1 and 2.
const HEAD: &str = "listener 1883 127.0.0.1\nallow_anonymous true\n";

/// Proves that the installed mosquitto runs with `HEAD` + `extra` (its `{port}` a free port):
/// mosquitto exits on a configuration it refuses, and then never listens. False when
/// mosquitto is not installed (`test` skips; a failure under CI=true).
fn mosquitto_accepts(test: &str, extra: &str) -> bool {
    Mosquitto::start(test, 0, extra).is_some()
}

/// Converts `HEAD` + `extra` (its `{port}` becoming 8883) from a file in `dir`: (status,
/// TOML, standard error).
fn convert(dir: &Path, extra: &str) -> (Option<i32>, String, String) {
    let main = dir.join("mosquitto.conf");
    write(&main, &format!("{HEAD}{}", extra.replace("{port}", "8883")));
    import(&main)
}

/// A security line that cannot be carried over fails the import (status 78, no TOML), naming
/// the file, the line and the key, and saying what to do.
fn assert_refused(test: &str, extra: &str, line: usize, key: &str, words: &str) {
    let pki = Pki::new();
    let extra = pki.fill(extra);
    if !mosquitto_accepts(test, &extra) {
        return;
    }
    let (code, toml, err) = convert(pki.dir.path(), &extra);
    assert_eq!(code, Some(78), "{test}: {err}\n{toml}");
    assert!(toml.is_empty(), "{test}: {toml}");
    assert_eq!(err.lines().count(), 1, "{test}: {err}");
    let place = format!("mosquitto.conf:{line} `{key}");
    assert!(err.contains(&place), "{test}: {place:?} not in {err}");
    assert!(err.contains("would weaken security"), "{test}: {err}");
    assert!(err.contains(words), "{test}: {words:?} not in {err}");
}

/// A TLS listener's certificate, key, CA, revocation list, client certificate requirement and
/// certificate-name user names are carried over, each beside the line it came from; a
/// minimum TLS version of 1.2 and a subject not used as user name need no key.
#[test]
fn tls_listener_security_is_carried() {
    const TEST: &str = "tls_listener_security_is_carried";
    let pki = Pki::new();
    let extra = pki.fill(
        "listener {port} 127.0.0.1\ncafile {pki}/ca.pem\ncertfile {pki}/server.pem\n\
         keyfile {pki}/server.key\ncrlfile {pki}/crl.pem\nrequire_certificate true\n\
         use_identity_as_username true\nuse_subject_as_username false\ntls_version tlsv1.2\n",
    );
    if !mosquitto_accepts(TEST, &extra) {
        return;
    }
    let (code, toml, err) = convert(pki.dir.path(), &extra);
    assert_eq!(code, Some(0), "{err}\n{toml}");
    let config: Config = toml::from_str(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    let tls = &config.listeners[1];
    let path = |name: &str| Some(std::path::PathBuf::from(pki.path(name)));
    assert_eq!(tls.port, 8883);
    assert_eq!(tls.ca_file, path("ca.pem"));
    assert_eq!(tls.cert_file, path("server.pem"));
    assert_eq!(tls.key_file, path("server.key"));
    assert_eq!(tls.crl_file, path("crl.pem"), "{toml}");
    assert!(tls.require_certificate && tls.use_identity_as_username);
    for (line, key) in [
        (7, "crlfile"),
        (8, "require_certificate"),
        (9, "use_identity"),
    ] {
        assert!(
            toml.contains(&format!("mosquitto.conf:{line} `{key}")),
            "{key}: {toml}"
        );
    }
    for (line, key) in [(10, "use_subject_as_username"), (11, "tls_version")] {
        assert!(
            toml.contains(&format!("mosquitto.conf:{line} `{key}")),
            "{key}: {toml}"
        );
    }
}

/// password_file, acl_file and allow_anonymous are carried over.
#[test]
fn authentication_and_access_are_carried() {
    const TEST: &str = "authentication_and_access_are_carried";
    let pki = Pki::new();
    let extra = pki.fill("password_file {pki}/passwd\nacl_file {pki}/acl\nallow_anonymous false\n");
    if !mosquitto_accepts(TEST, &extra) {
        return;
    }
    let (code, toml, err) = convert(pki.dir.path(), &extra);
    assert_eq!(code, Some(0), "{err}\n{toml}");
    let config: Config = toml::from_str(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    assert_eq!(
        config.auth.password_file,
        Some(std::path::PathBuf::from(pki.path("passwd")))
    );
    assert_eq!(
        config.auth.acl_file,
        Some(std::path::PathBuf::from(pki.path("acl")))
    );
    assert_eq!(config.auth.allow_anonymous, Some(false), "{toml}");
}

/// A TLS bridge stays a TLS bridge: its CA, certificate, key and credentials are carried over;
/// the host name check (bridge_insecure false), no OCSP and TLS 1.2 need no key.
#[test]
fn bridge_tls_and_credentials_are_carried() {
    const TEST: &str = "bridge_tls_and_credentials_are_carried";
    let pki = Pki::new();
    let extra = pki.fill(
        "connection remote\naddress 127.0.0.1:1\ntopic a/# out 1\n\
         bridge_cafile {pki}/ca.pem\nbridge_certfile {pki}/good.pem\nbridge_keyfile {pki}/good.key\n\
         remote_username bridge-user\nremote_password bridge-secret\nbridge_insecure false\n\
         bridge_require_ocsp false\nbridge_tls_version tlsv1.2\n",
    );
    if !mosquitto_accepts(TEST, &extra) {
        return;
    }
    let (code, toml, err) = convert(pki.dir.path(), &extra);
    assert_eq!(code, Some(0), "{err}\n{toml}");
    let config: Config = toml::from_str(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    let b = &config.bridges[0];
    assert!(b.tls(), "{toml}");
    assert_eq!(b.cafile, Some(std::path::PathBuf::from(pki.path("ca.pem"))));
    assert_eq!(
        b.certfile,
        Some(std::path::PathBuf::from(pki.path("good.pem")))
    );
    assert_eq!(
        b.keyfile,
        Some(std::path::PathBuf::from(pki.path("good.key")))
    );
    assert_eq!(b.username.as_deref(), Some("bridge-user"));
    assert_eq!(b.password.as_deref(), Some("bridge-secret"));
    // The secret is not repeated in comments, and where to move it is said.
    assert_eq!(toml.matches("bridge-secret").count(), 1, "{toml}");
    assert!(toml.contains("named by password_file"), "{toml}");
    for (line, key) in [
        (11, "bridge_insecure"),
        (12, "bridge_require_ocsp"),
        (13, "bridge_tls_version"),
    ] {
        assert!(
            toml.contains(&format!("mosquitto.conf:{line} `{key}")),
            "{key}: {toml}"
        );
    }
}

/// bridge_capath: Mercurio bridges have no CA directory, and without it the bridge would
/// connect in plaintext (sending remote_password in clear).
#[test]
fn bridge_capath_is_refused() {
    assert_refused(
        "bridge_capath_is_refused",
        "connection remote\naddress 127.0.0.1:1\ntopic a/# out 1\nremote_username u\n\
         remote_password p\nbridge_capath {pki}\n",
        8,
        "bridge_capath",
        "put the CA certificates in one PEM file",
    );
}

/// bridge_identity / bridge_psk: TLS-PSK bridges are not offered.
#[test]
fn bridge_psk_is_refused() {
    assert_refused(
        "bridge_psk_is_refused",
        "connection remote\naddress 127.0.0.1:1\ntopic a/# out 1\nbridge_identity id\n\
         bridge_psk 0123\n",
        6,
        "bridge_identity",
        "bridge_cafile",
    );
}

/// bridge_insecure true: the remote's host name is always checked.
#[test]
fn bridge_insecure_is_refused() {
    assert_refused(
        "bridge_insecure_is_refused",
        "connection remote\naddress 127.0.0.1:1\ntopic a/# out 1\n\
         bridge_cafile {pki}/ca.pem\nbridge_insecure true\n",
        7,
        "bridge_insecure",
        "tls_server_name",
    );
}

/// bridge_require_ocsp true: OCSP is not checked.
#[test]
fn bridge_require_ocsp_is_refused() {
    assert_refused(
        "bridge_require_ocsp_is_refused",
        "connection remote\naddress 127.0.0.1:1\ntopic a/# out 1\n\
         bridge_cafile {pki}/ca.pem\nbridge_require_ocsp true\n",
        7,
        "bridge_require_ocsp",
        "OCSP",
    );
}

/// bridge_tls_version tlsv1.3: a bridge cannot be held to one version.
#[test]
fn bridge_tls_version_1_3_is_refused() {
    assert_refused(
        "bridge_tls_version_1_3_is_refused",
        "connection remote\naddress 127.0.0.1:1\ntopic a/# out 1\n\
         bridge_cafile {pki}/ca.pem\nbridge_tls_version tlsv1.3\n",
        7,
        "bridge_tls_version",
        "TLS 1.2 or 1.3",
    );
}

/// tls_version tlsv1.3: a listener cannot be limited to TLS 1.3.
#[test]
fn tls_version_1_3_is_refused() {
    assert_refused(
        "tls_version_1_3_is_refused",
        "listener {port} 127.0.0.1\ncertfile {pki}/server.pem\nkeyfile {pki}/server.key\n\
         tls_version tlsv1.3\n",
        6,
        "tls_version",
        "cannot be limited to 1.3",
    );
}

/// use_subject_as_username true: only the common name can be the user name.
#[test]
fn use_subject_as_username_is_refused() {
    assert_refused(
        "use_subject_as_username_is_refused",
        "listener {port} 127.0.0.1\ncertfile {pki}/server.pem\nkeyfile {pki}/server.key\n\
         cafile {pki}/ca.pem\nrequire_certificate true\nuse_subject_as_username true\n",
        8,
        "use_subject_as_username",
        "use_identity_as_username",
    );
}

/// use_username_as_clientid true: without it a client could take another's identifier, and
/// the ACL patterns written with %c.
#[test]
fn use_username_as_clientid_is_refused() {
    assert_refused(
        "use_username_as_clientid_is_refused",
        "listener {port} 127.0.0.1\nallow_anonymous true\nuse_username_as_clientid true\n",
        5,
        "use_username_as_clientid",
        "%u patterns",
    );
}

/// psk_hint / psk_file: a PSK listener would become a plaintext one.
#[test]
fn psk_listener_is_refused() {
    assert_refused(
        "psk_listener_is_refused",
        "psk_file {pki}/passwd\nlistener {port} 127.0.0.1\npsk_hint hint\n",
        3,
        "psk_file",
        "certfile and keyfile",
    );
    assert_refused(
        "psk_listener_is_refused",
        "listener {port} 127.0.0.1\npsk_hint hint\n",
        4,
        "psk_hint",
        "certfile and keyfile",
    );
}

/// plugin / auth_plugin: a mosquitto plugin (here the dynamic security plugin of Debian's
/// package, when installed) cannot be loaded.
#[test]
fn authentication_plugins_are_refused() {
    const PLUGIN: &str = "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so";
    let plugin = if Path::new(PLUGIN).exists() {
        PLUGIN.to_string()
    } else {
        mercurio_testkit::skip(
            "authentication_plugins_are_refused",
            &format!("no {PLUGIN} (Debian's mosquitto package has it): checked without mosquitto"),
        );
        // The import refuses the line whatever the path.
        let dir = tempfile::tempdir().expect("temp dir");
        for key in ["plugin", "auth_plugin"] {
            let (code, _, err) = convert(dir.path(), &format!("{key} /usr/lib/p.so\n"));
            assert_eq!(code, Some(78), "{err}");
            assert!(err.contains(&format!("mosquitto.conf:3 `{key} ")), "{err}");
        }
        return;
    };
    for key in ["plugin", "auth_plugin"] {
        assert_refused(
            "authentication_plugins_are_refused",
            &format!("{key} {plugin}\n"),
            3,
            key,
            "password_file",
        );
    }
}

/// `sys_interval 0` turns $SYS off and `max_queued_messages 0` lifts the count limit, in
/// mosquitto as in Mercurio: both are carried over as 0.
#[test]
fn zero_sys_interval_and_unlimited_queues_are_carried() {
    const TEST: &str = "zero_sys_interval_and_unlimited_queues_are_carried";
    let extra = "sys_interval 0\nmax_queued_messages 0\n";
    if !mosquitto_accepts(TEST, extra) {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let (code, toml, err) = convert(dir.path(), extra);
    assert_eq!(code, Some(0), "{err}\n{toml}");
    let config: Config = toml::from_str(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    assert_eq!(config.server.sys_interval, 0, "{toml}");
    assert_eq!(config.server.max_queued_messages, 0, "{toml}");
    assert_eq!(config.server.max_queued_qos0_messages, 0, "{toml}");
    let resolved = config.server.clone().resolved();
    assert_eq!(resolved.max_queued_messages, usize::MAX);
    assert!(!toml.contains("86400"), "{toml}");
}

/// End to end: mosquitto with crlfile refuses a revoked client certificate; after the import,
/// mercuriod with the converted configuration refuses it too, and still accepts a
/// certificate the list does not name (mosquitto_pub over TLS, both times).
#[test]
fn a_revoked_certificate_stays_refused_after_the_import() {
    const TEST: &str = "a_revoked_certificate_stays_refused_after_the_import";
    if !mosquitto_clients(TEST) {
        return;
    }
    let pki = Pki::new();
    let extra = pki.fill(
        "listener {port} 127.0.0.1\ncafile {pki}/ca.pem\ncertfile {pki}/server.pem\n\
         keyfile {pki}/server.key\nrequire_certificate true\ncrlfile {pki}/crl.pem\n",
    );
    let publish = |port: u16, client: &str| -> Output {
        Command::new("mosquitto_pub")
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-V", "mqttv311"])
            .args(["--cafile", &pki.path("ca.pem")])
            .args(["--cert", &pki.path(&format!("{client}.pem"))])
            .args(["--key", &pki.path(&format!("{client}.key"))])
            .args(["-i", client, "-t", "t", "-m", "x", "-q", "1"])
            .output()
            .expect("run mosquitto_pub")
    };
    // mosquitto itself, with this configuration.
    let Some(mosquitto) = Mosquitto::start(TEST, 0, &extra) else {
        return;
    };
    let good = publish(mosquitto.extra_port, "good");
    assert!(good.status.success(), "mosquitto, good: {good:?}");
    let revoked = publish(mosquitto.extra_port, "revoked");
    assert!(!revoked.status.success(), "mosquitto, revoked: {revoked:?}");
    drop(mosquitto);

    let (code, toml, err) = convert(pki.dir.path(), &extra);
    assert_eq!(code, Some(0), "{err}\n{toml}");
    let socket = pki.dir.path().join("mercuriod.sock");
    let text = toml
        .replace("port = 1883", "port = 0")
        .replace("port = 8883", "port = 0")
        + &format!("\n[admin]\nsocket = {:?}\n", socket.display().to_string());
    let mut daemon = Daemon::with_config(&text).socket(socket).start();
    let tls_port = daemon.wait_listeners(2)[1].port();
    let good = publish(tls_port, "good");
    assert!(good.status.success(), "mercuriod, good: {good:?}\n{text}");
    let revoked = publish(tls_port, "revoked");
    assert!(
        !revoked.status.success(),
        "mercuriod accepted the revoked certificate: {revoked:?}\n{text}"
    );
}
