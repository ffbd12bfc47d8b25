//! Reading a mosquitto.conf as mosquitto 2.0 does: one `key value...` per line, `#` at the start
//! of a line for comments, `include_dir` expanded in place (its `*.conf` files in mosquitto's
//! order: case-insensitive first, upper case before lower case of the same letter).
//!
//! Only the syntax is handled here; what each key means is `import_mosquitto`'s business.

use std::cmp::Ordering;
use std::fmt;
use std::path::{Path, PathBuf};

/// One setting: `key` and the rest of its line, with where it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// The file it came from (the main file or one of an `include_dir`).
    pub file: PathBuf,
    /// 1-based line number in `file`.
    pub number: usize,
    /// The first word, e.g. `listener`.
    pub key: String,
    /// The rest of the line, leading and trailing white space removed (may be empty).
    pub value: String,
    /// True for the first line of each included file: mosquitto starts every file with no
    /// current listener or bridge.
    pub starts_file: bool,
    /// True for the lines of an `include_dir` file.
    pub included: bool,
}

impl Line {
    /// The value's words, split on spaces and tabs.
    pub fn words(&self) -> Vec<&str> {
        self.value.split_whitespace().collect()
    }

    /// `file:line`, for comments and errors.
    pub fn place(&self) -> String {
        let name = self
            .file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.file.display().to_string());
        format!("{name}:{}", self.number)
    }

    /// The line as written: `key value`.
    pub fn text(&self) -> String {
        if self.value.is_empty() {
            self.key.clone()
        } else {
            format!("{} {}", self.key, self.value)
        }
    }
}

/// A file that cannot be read.
#[derive(Debug)]
pub struct ReadError {
    pub path: PathBuf,
    pub message: String,
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.message)
    }
}

/// Every setting of `path` and of the files its `include_dir` lines name, in the order
/// mosquitto reads them. An `include_dir` line itself is kept (with `starts_file` false) so
/// that the caller can say where the included lines came from; one inside an included file is
/// kept but not expanded (mosquitto reads `include_dir` only in the main file).
pub fn read(path: &Path) -> Result<Vec<Line>, ReadError> {
    let mut lines = Vec::new();
    for line in read_one(path)? {
        let expand = line.key == "include_dir" && !line.value.is_empty();
        let dir = PathBuf::from(&line.value);
        lines.push(line);
        if expand {
            for file in conf_files(&dir)? {
                let mut included = read_one(&file)?;
                for l in &mut included {
                    l.included = true;
                }
                if let Some(first) = included.first_mut() {
                    first.starts_file = true;
                }
                lines.extend(included);
            }
        }
    }
    Ok(lines)
}

/// The settings of one file, comments and blank lines left out.
fn read_one(path: &Path) -> Result<Vec<Line>, ReadError> {
    let error = |message: String| ReadError {
        path: path.to_path_buf(),
        message,
    };
    if path.is_dir() {
        return Err(error("is a directory, not a configuration file".into()));
    }
    let bytes = std::fs::read(path).map_err(|e| error(format!("cannot read: {e}")))?;
    let text = String::from_utf8_lossy(&bytes);
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let (key, value) = match trimmed.find([' ', '\t']) {
            Some(at) => (&trimmed[..at], trimmed[at..].trim()),
            None => (trimmed, ""),
        };
        lines.push(Line {
            file: path.to_path_buf(),
            number: i + 1,
            key: key.to_string(),
            value: value.to_string(),
            starts_file: false,
            included: false,
        });
    }
    Ok(lines)
}

/// The `*.conf` files of an `include_dir`, in mosquitto's order.
fn conf_files(dir: &Path) -> Result<Vec<PathBuf>, ReadError> {
    let entries = std::fs::read_dir(dir).map_err(|e| ReadError {
        path: dir.to_path_buf(),
        message: format!("include_dir: cannot read the directory: {e}"),
    })?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".conf"))
        .collect();
    names.sort_by(|a, b| include_order(a, b));
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

/// mosquitto's order of included files: letters compared without case first, then upper case
/// before lower case; `00.conf`, `01.conf`, `A.conf`, `a.conf`, `B.conf`, `b.conf`.
pub fn include_order(a: &str, b: &str) -> Ordering {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    for (x, y) in a.iter().zip(b) {
        let by_letter = x.to_ascii_uppercase().cmp(&y.to_ascii_uppercase());
        if by_letter != Ordering::Equal {
            return by_letter;
        }
        if x != y {
            return x.cmp(y);
        }
    }
    a.len().cmp(&b.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn include_order_is_mosquittos() {
        // mosquitto.conf(5), include_dir: "Load Order for include_dir".
        let mut names = vec!["b.conf", "A.conf", "01.conf", "a.conf", "B.conf", "00.conf"];
        names.sort_by(|a, b| include_order(a, b));
        assert_eq!(
            names,
            ["00.conf", "01.conf", "A.conf", "a.conf", "B.conf", "b.conf"]
        );
    }

    #[test]
    fn lines_and_comments() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("m.conf");
        std::fs::write(
            &path,
            "# comment\n\nlistener 1883  0.0.0.0 \n  # indented comment\nallow_anonymous\ttrue\r\n",
        )
        .expect("write");
        let lines = read(&path).expect("read");
        assert_eq!(lines.len(), 2);
        assert_eq!(
            (lines[0].key.as_str(), lines[0].value.as_str()),
            ("listener", "1883  0.0.0.0")
        );
        assert_eq!(lines[0].words(), ["1883", "0.0.0.0"]);
        assert_eq!(lines[0].number, 3);
        assert_eq!(lines[1].text(), "allow_anonymous true");
        assert_eq!(lines[1].place(), "m.conf:5");
    }
}
