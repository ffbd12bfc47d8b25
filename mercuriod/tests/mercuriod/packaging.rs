//! packaging/mercuriod.service: what the daemon relies on.

#[test]
fn systemd_unit() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../packaging/mercuriod.service"
    );
    let unit = std::fs::read_to_string(path).expect("read packaging/mercuriod.service");
    let lines: Vec<&str> = unit.lines().map(str::trim).collect();
    for line in [
        "Type=notify",
        "Restart=on-failure",
        "RestartPreventExitStatus=78",
        "StateDirectory=mercurio",
        "RuntimeDirectory=mercurio",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "NoNewPrivileges=true",
        "ProtectSystem=strict",
    ] {
        assert!(lines.contains(&line), "{line} missing from {path}");
    }
    assert!(lines.iter().any(|l| l.starts_with("WatchdogSec=")));
}

/// `rust-version` (and README's "Rust X.Y or later") is at least the highest `rust-version` of
/// the crates Cargo.lock pins, as found in cargo's registry sources on this machine (crates of
/// other platforms are never downloaded here and are left out). A dependency update that needs
/// a newer Rust fails here until both are raised.
#[test]
fn rust_version_covers_the_locked_dependencies() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let read = |name: &str| {
        std::fs::read_to_string(format!("{root}/{name}")).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let version = |text: &str| -> Option<(u32, u32)> {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with("rust-version"))?;
        let value = line.split('"').nth(1)?;
        let mut parts = value.split('.').map(|p| p.parse::<u32>().ok());
        Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
    };
    let ours = version(&read("Cargo.toml")).expect("rust-version in Cargo.toml");
    let readme = read("README.md");
    assert!(
        readme.contains(&format!("Rust {}.{} or later", ours.0, ours.1)),
        "README.md does not say Rust {}.{} or later",
        ours.0,
        ours.1
    );

    let home = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cargo")));
    let Some(registries) = home
        .map(|h| h.join("registry/src"))
        .and_then(|d| std::fs::read_dir(d).ok())
    else {
        mercurio_testkit::skip(
            "rust_version_covers_the_locked_dependencies",
            "no cargo registry sources to read the dependencies' rust-version from",
        );
        return;
    };
    let registries: Vec<_> = registries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .collect();
    let lock = read("Cargo.lock");
    let mut highest = ((0, 0), String::new());
    let mut checked = 0;
    for package in lock.split("[[package]]").skip(1) {
        let field = |key: &str| {
            package
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{key} = \"")))
                .and_then(|v| v.strip_suffix('"'))
                .map(str::to_string)
        };
        let (Some(name), Some(v), Some(_)) = (field("name"), field("version"), field("source"))
        else {
            continue;
        };
        let Some(manifest) = registries
            .iter()
            .map(|r| r.join(format!("{name}-{v}/Cargo.toml")))
            .find(|p| p.exists())
        else {
            continue;
        };
        checked += 1;
        let text = std::fs::read_to_string(&manifest).expect("read a crate's Cargo.toml");
        if let Some(needs) = version(&text) {
            if needs > highest.0 {
                highest = (needs, format!("{name} {v}"));
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} locked crates found in {registries:?}"
    );
    assert!(
        highest.0 <= ours,
        "{} needs Rust {}.{}, rust-version says {}.{}",
        highest.1,
        highest.0 .0,
        highest.0 .1,
        ours.0,
        ours.1
    );
}
