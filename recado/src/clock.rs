//! Wall clock formatting: strftime in local time (for -F's @ sequences and %I, as
//! mosquitto_sub does) and RFC 3339 in UTC (for --json).

use std::ffi::CString;
use std::time::{SystemTime, UNIX_EPOCH};

/// A moment: seconds since the Unix epoch and nanoseconds within the second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moment {
    pub secs: i64,
    pub nanos: u32,
}

impl Moment {
    /// The current wall clock time (the epoch if the clock is before it).
    pub fn now() -> Moment {
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => Moment {
                secs: d.as_secs() as i64,
                nanos: d.subsec_nanos(),
            },
            Err(_) => Moment { secs: 0, nanos: 0 },
        }
    }

    /// `strftime(format)` of this moment in local time (or UTC); an empty string if the
    /// format cannot be used (an interior NUL).
    pub fn strftime(&self, format: &str, local: bool) -> String {
        let Ok(fmt) = CString::new(format) else {
            return String::new();
        };
        let t: libc::time_t = self.secs as libc::time_t;
        // SAFETY: `tm` is plain data filled by localtime_r / gmtime_r, which only read `t`.
        let mut tm: libc::tm = unsafe { std::mem::zeroed() };
        let ok = unsafe {
            if local {
                libc::localtime_r(&t, &mut tm)
            } else {
                libc::gmtime_r(&t, &mut tm)
            }
        };
        if ok.is_null() {
            return String::new();
        }
        let mut buf = vec![0u8; 256];
        // SAFETY: strftime writes at most buf.len() bytes including the NUL and returns the
        // count written without it (0 if it did not fit).
        let n = unsafe {
            libc::strftime(
                buf.as_mut_ptr() as *mut libc::c_char,
                buf.len(),
                fmt.as_ptr(),
                &tm,
            )
        };
        buf.truncate(n);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// ISO 8601 in local time with the offset, as mosquitto_sub's %I:
    /// `2016-08-10T09:47:38+0100`.
    pub fn iso8601(&self) -> String {
        self.strftime("%Y-%m-%dT%H:%M:%S%z", true)
    }

    /// The time stamp of mosquitto_sub's %j: local time with microseconds and the offset.
    pub fn json_tst(&self) -> String {
        format!(
            "{}.{:06}{}",
            self.strftime("%Y-%m-%dT%H:%M:%S", true),
            self.nanos / 1000,
            self.strftime("%z", true)
        )
    }

    /// RFC 3339 in UTC with microseconds: `2026-12-01T23:20:03.123456Z`.
    pub fn rfc3339(&self) -> String {
        format!(
            "{}.{:06}Z",
            self.strftime("%Y-%m-%dT%H:%M:%S", false),
            self.nanos / 1000
        )
    }

    /// Unix time with nanoseconds, as mosquitto_sub's %U: `1470818943.786368637`.
    pub fn unix(&self) -> String {
        format!("{}.{:09}", self.secs, self.nanos)
    }
}

/// Reads the time zone once (TZ, /etc/localtime) before local times are formatted.
pub fn init() {
    extern "C" {
        fn tzset();
    }
    // SAFETY: tzset only reads the environment and the zone files; called once at start,
    // before any thread formats a time.
    unsafe { tzset() };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_in_utc() {
        let m = Moment {
            secs: 1_470_818_943,
            nanos: 786_368_637,
        };
        assert_eq!(m.rfc3339(), "2016-08-10T08:49:03.786368Z");
        assert_eq!(m.unix(), "1470818943.786368637");
        assert_eq!(m.strftime("%Y", false), "2016");
    }
}
