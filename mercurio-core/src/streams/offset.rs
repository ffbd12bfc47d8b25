//! Where a stream reader starts: the `stream-offset` value of a SUBSCRIBE (its user property,
//! or the `@<value>` level of a `$stream/` filter), parsed.

use std::fmt;

/// Where a reader starts reading a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartAt {
    /// The oldest message the stream still holds.
    Earliest,
    /// The next message appended (nothing already in the stream); the default.
    Latest,
    /// The message with this logical offset, or the first one after it that the stream still
    /// holds (an offset retention removed starts at the oldest kept).
    Offset(u64),
    /// The first message appended at or after this time, milliseconds since the Unix epoch.
    Time(u64),
}

/// A `stream-offset` value that is none of the accepted forms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadOffset(pub String);

impl fmt::Display for BadOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "stream-offset {:?} is not earliest, latest, an offset (a number), a Unix time in \
             milliseconds (ms:<number>) or an RFC 3339 time (2026-01-31T08:00:00Z)",
            self.0
        )
    }
}

impl std::error::Error for BadOffset {}

/// Numbers at or above this are Unix times in milliseconds, not offsets: 2001-09-09 in
/// milliseconds, an offset no stream reaches (ten billion messages a day for 270 years).
pub const TIME_MS_FROM: u64 = 1_000_000_000_000;

impl StartAt {
    /// Parses `earliest`, `latest`, an offset (`42`), a Unix time in milliseconds
    /// (`ms:1767225600000`, or a bare number of 13 digits or more: at least
    /// [`TIME_MS_FROM`]) or an RFC 3339 time (`2026-01-31T08:00:00Z`,
    /// `2026-01-31T09:00:00.250+01:00`).
    pub fn parse(value: &str) -> Result<StartAt, BadOffset> {
        let bad = || BadOffset(value.to_string());
        let v = value.trim();
        match v {
            "earliest" => return Ok(StartAt::Earliest),
            "latest" => return Ok(StartAt::Latest),
            _ => {}
        }
        if let Some(ms) = v.strip_prefix("ms:") {
            return ms.parse().map(StartAt::Time).map_err(|_| bad());
        }
        if v.bytes().all(|b| b.is_ascii_digit()) {
            let n: u64 = v.parse().map_err(|_| bad())?;
            return Ok(if n >= TIME_MS_FROM {
                StartAt::Time(n)
            } else {
                StartAt::Offset(n)
            });
        }
        rfc3339_ms(v).map(StartAt::Time).ok_or_else(bad)
    }
}

/// An RFC 3339 date-time (`YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)`, `t`/`z`/space
/// accepted) as milliseconds since the Unix epoch; `None` when malformed or before 1970.
pub fn rfc3339_ms(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() < 20 {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let part = s.get(r)?;
        if !part.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        part.parse().ok()
    };
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    if b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let mut i = 19;
    let mut millis = 0i64;
    if b[i] == b'.' {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == start {
            return None;
        }
        let digits = &s[start..i.min(start + 3)];
        millis = digits.parse::<i64>().ok()? * 10i64.pow(3 - digits.len() as u32);
    }
    let offset_secs = match &s[i..] {
        "Z" | "z" => 0,
        zone => {
            let zb = zone.as_bytes();
            if zb.len() != 6 || zb[3] != b':' {
                return None;
            }
            let sign = match zb[0] {
                b'+' => 1,
                b'-' => -1,
                _ => return None,
            };
            let h = num(i + 1..i + 3)?;
            let m = num(i + 4..i + 6)?;
            if h > 23 || m > 59 {
                return None;
            }
            sign * (h * 3600 + m * 60)
        }
    };
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second.min(59) - offset_secs;
    u64::try_from(secs * 1000 + millis).ok()
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        assert_eq!(StartAt::parse("earliest"), Ok(StartAt::Earliest));
        assert_eq!(StartAt::parse("latest"), Ok(StartAt::Latest));
        assert_eq!(StartAt::parse("42"), Ok(StartAt::Offset(42)));
        assert_eq!(
            StartAt::parse("1767225600000"),
            Ok(StartAt::Time(1_767_225_600_000))
        );
        assert_eq!(StartAt::parse("ms:5"), Ok(StartAt::Time(5)));
        assert_eq!(
            StartAt::parse("2026-01-01T00:00:00Z"),
            Ok(StartAt::Time(1_767_225_600_000))
        );
        assert_eq!(
            StartAt::parse("2026-01-01T01:00:00.25+01:00"),
            Ok(StartAt::Time(1_767_225_600_250))
        );
        assert_eq!(
            StartAt::parse("1970-01-01T00:00:00.001Z"),
            Ok(StartAt::Time(1))
        );
        assert_eq!(
            StartAt::parse("2024-02-29T12:00:00-00:30"),
            Ok(StartAt::Time(1_709_209_800_000))
        );
        for bad in [
            "",
            "first",
            "-1",
            "2026-13-01T00:00:00Z",
            "2025-02-29T00:00:00Z",
            "2026-01-01T00:00:00",
            "2026-01-01T00:00:00+0100",
            "ms:x",
        ] {
            assert!(StartAt::parse(bad).is_err(), "{bad:?}");
        }
    }
}
