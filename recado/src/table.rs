//! `recado sub -T`: the latest message of every topic as a table sorted by topic. On a
//! terminal it is redrawn in place (at most 5 times a second, cut to the window); otherwise it
//! is printed once, whole, when the command ends.

use std::collections::BTreeMap;
use std::io::IsTerminal;

use crate::clock::Moment;
use crate::exit::Failure;
use crate::format::Received;
use crate::output;

struct Row {
    value: String,
    qos: u8,
    retained: bool,
    at: Moment,
    messages: u64,
}

/// The latest value per topic.
pub struct Table {
    rows: BTreeMap<String, Row>,
    live: bool,
    dirty: bool,
}

impl Default for Table {
    fn default() -> Self {
        Self::new()
    }
}

impl Table {
    /// A table drawn live when standard output is a terminal.
    pub fn new() -> Table {
        Table {
            rows: BTreeMap::new(),
            live: std::io::stdout().is_terminal(),
            dirty: true,
        }
    }

    /// True when drawn in place on a terminal.
    pub fn live(&self) -> bool {
        self.live
    }

    /// Records `m` as its topic's latest message.
    pub fn update(&mut self, m: &Received) {
        let p = &m.publish;
        let messages = self.rows.get(&p.topic).map_or(0, |r| r.messages) + 1;
        self.rows.insert(
            p.topic.clone(),
            Row {
                value: printable(&p.payload),
                qos: p.qos as u8,
                retained: p.retain,
                at: m.at,
                messages,
            },
        );
        self.dirty = true;
    }

    /// Redraws the table on the terminal if something changed.
    pub fn draw_live(&mut self) -> Result<(), Failure> {
        if !self.dirty {
            return Ok(());
        }
        self.dirty = false;
        let (cols, lines) = terminal_size().unwrap_or((100, 30));
        let messages: u64 = self.rows.values().map(|r| r.messages).sum();
        let mut text = format!(
            "\x1b[H\x1b[2J{} topics, {messages} messages (Ctrl+C to stop)\n",
            self.rows.len()
        );
        // The status line, the header and "... more topics" take three lines.
        let limit = lines.saturating_sub(3).max(1);
        text.push_str(&self.render(Some(cols), Some(limit)));
        output::write(text.as_bytes()).map(|_| ())
    }

    /// The command ends: the final table (live: drawn once more; otherwise printed whole).
    pub fn finish(&mut self) -> Result<(), Failure> {
        if self.live {
            self.dirty = true;
            return self.draw_live();
        }
        output::write(self.render(None, None).as_bytes()).map(|_| ())
    }

    /// The table as text: a header, then one line per topic in topic order. `width` cuts
    /// values to fit; `rows` keeps the first rows (and says how many are hidden).
    fn render(&self, width: Option<usize>, rows: Option<usize>) -> String {
        let topic_w = self
            .rows
            .keys()
            .map(|t| t.chars().count())
            .max()
            .unwrap_or(0)
            .max(5);
        let topic_w = match width {
            Some(w) => topic_w.min(w / 2),
            None => topic_w,
        };
        let mut out = String::new();
        let fixed = "  QOS  RETAINED  UPDATED   MESSAGES";
        let value_w = width.map(|w| w.saturating_sub(topic_w + 2 + fixed.len() + 2).max(8));
        let value_col = value_w.unwrap_or_else(|| {
            self.rows
                .values()
                .map(|r| r.value.chars().count())
                .max()
                .unwrap_or(0)
                .max(5)
        });
        out.push_str(&format!(
            "{:<topic_w$}  {:<value_col$}{fixed}\n",
            "TOPIC", "VALUE"
        ));
        let shown = rows.unwrap_or(usize::MAX);
        for (i, (topic, r)) in self.rows.iter().enumerate() {
            if i >= shown {
                out.push_str(&format!("... {} more topics\n", self.rows.len() - shown));
                break;
            }
            out.push_str(&format!(
                "{:<topic_w$}  {:<value_col$}  {:>3}  {:<8}  {}  {:>8}\n",
                cut(topic, topic_w),
                cut(&r.value, value_col),
                r.qos,
                if r.retained { "yes" } else { "no" },
                r.at.strftime("%H:%M:%S", true),
                r.messages,
            ));
        }
        if width.is_none() {
            // Not a terminal: no padding at the ends of lines.
            out = out
                .lines()
                .map(|l| l.trim_end().to_string() + "\n")
                .collect();
        }
        out
    }
}

/// Text for a cell: UTF-8 with control characters escaped, else `0x` and hex.
fn printable(b: &[u8]) -> String {
    match std::str::from_utf8(b) {
        Ok(s) => s.chars().flat_map(char::escape_default).collect::<String>(),
        Err(_) => {
            let mut s = String::from("0x");
            for byte in b {
                s.push_str(&format!("{byte:02x}"));
            }
            s
        }
    }
    .replace("\\'", "'")
    .replace("\\\"", "\"")
}

/// `s` cut to `w` characters, `…` marking the cut.
fn cut(s: &str, w: usize) -> String {
    if s.chars().count() <= w {
        return s.to_string();
    }
    let mut out: String = s.chars().take(w.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// Columns and lines of the terminal on standard output.
fn terminal_size() -> Option<(usize, usize)> {
    // SAFETY: TIOCGWINSZ fills a winsize struct; the call fails harmlessly when fd 1 is not a
    // terminal.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::ioctl(1, libc::TIOCGWINSZ, &mut ws) };
    (r == 0 && ws.ws_col > 0 && ws.ws_row > 0).then_some((ws.ws_col as usize, ws.ws_row as usize))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use mercurio_core::codec::{Properties, Publish, QoS};

    fn msg(topic: &str, payload: &str) -> Received {
        Received {
            publish: Publish {
                dup: false,
                qos: QoS::AtMostOnce,
                retain: false,
                topic: topic.into(),
                packet_id: 0,
                properties: Properties::default(),
                payload: Bytes::from(payload.to_string()),
            },
            at: Moment { secs: 0, nanos: 0 },
        }
    }

    #[test]
    fn latest_value_per_topic_sorted() {
        let mut t = Table {
            rows: BTreeMap::new(),
            live: false,
            dirty: false,
        };
        t.update(&msg("b", "1"));
        t.update(&msg("a", "x\ny"));
        t.update(&msg("b", "2"));
        let text = t.render(None, None);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("TOPIC"));
        assert!(lines[1].starts_with("a      x\\ny"), "{text}");
        assert!(lines[2].starts_with("b      2"), "{text}");
        assert!(lines[2].ends_with(" 2"), "two messages on b: {text}");
        let cut = t.render(Some(60), Some(1));
        assert!(cut.contains("... 1 more topics"), "{cut}");
    }
}
