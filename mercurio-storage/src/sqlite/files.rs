//! Stream segment files: the bodies of stream segments appended to files beside the
//! database, so that a stream's bytes are written once (SQLite writes a blob twice: into the
//! write-ahead log, then into the database at the checkpoint).
//!
//! - Where: `<database>-streams/` (e.g. `mercurio.db-streams/`), a directory per stream
//!   ([`stream_dir`]), files `<n>.seg` numbered from 0 and rolled at [`FILE_BYTES`], so that
//!   retention frees disk in steps of a few MiB.
//! - A `stream_segments` row then has an empty `body` and the segment's place: `file`,
//!   `position`, `length` (bytes). Rows with a body (older builds, the upgrade, `last_value`
//!   streams, and the segments of a durable commit, which in a file would cost it a second
//!   sync) keep it.
//! - Order: a batch's bytes are written before the COMMIT that refers to them, and synced
//!   before the next checkpoint or durable commit (either makes their rows durable); a batch
//!   that fails leaves the ends where they were, so the next one overwrites what it wrote.
//! - Opening ([`SegmentFiles::open`]): each file is cut to the largest end a row refers to
//!   (the rest was written by a transaction that never committed), files no row refers to
//!   are deleted, and the rows whose bytes are not all in their file (a power failure, a
//!   copy without the file) are deleted and logged as lost ([`drop_unbacked`]).
//! - After a commit that trimmed or deleted streams ([`SegmentFiles::tidy`]), the files no
//!   row refers to any more (but the one written to) are unlinked, a deleted stream's
//!   directory removed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use std::borrow::Cow;

use rusqlite::{Connection, OptionalExtension, Row};

use crate::error::StorageError;

/// Size (bytes) from which a stream's next segment starts a new file: 4 MiB, so that a
/// stream keeps at most about that much disk beyond its retention.
pub(super) const FILE_BYTES: u64 = 4 << 20;

/// The directory of the segment files of the database `conn` has open: `<database>-streams`.
/// `None` for a database with no file (in memory), whose segments stay inline.
pub(super) fn root(conn: &Connection) -> Option<PathBuf> {
    let db = conn.path().filter(|p| !p.is_empty() && *p != ":memory:")?;
    Some(PathBuf::from(format!("{db}-streams")))
}

/// The directory of `stream` under `root`: `s-<name>` (a valid name has only letters,
/// digits, `_`, `-` and `.`, so the prefix keeps `.` and `..` from being special), or for
/// a name too long for a file name, `l-<its first 160 bytes>-<hash of the whole name>`.
/// Anything else (a name no valid stream has) is spelled in hexadecimal.
fn stream_dir(root: &Path, stream: &str) -> PathBuf {
    let plain = stream
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    let name = if !plain {
        let hex: String = stream.bytes().map(|b| format!("{b:02x}")).collect();
        format!("x-{}-{:016x}", &hex[..hex.len().min(160)], fnv(stream))
    } else if stream.len() <= 200 {
        format!("s-{stream}")
    } else {
        format!("l-{}-{:016x}", &stream[..160], fnv(stream))
    };
    root.join(name)
}

/// 64-bit FNV-1a of `s`: the name of a long stream's directory (stable across builds).
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn file_path(root: &Path, stream: &str, file: u64) -> PathBuf {
    stream_dir(root, stream).join(format!("{file}.seg"))
}

/// Where one segment's bytes are: its file's number, position and length (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Location {
    pub(super) file: u64,
    pub(super) position: u64,
    pub(super) length: u64,
}

/// The file a stream appends to and its committed end.
struct Current {
    file: u64,
    end: u64,
    /// The lowest file number that may still exist.
    oldest: u64,
    handle: Option<File>,
}

/// The segment files of one database, owned by the SQLite thread.
pub(super) struct SegmentFiles {
    root: PathBuf,
    streams: HashMap<String, Current>,
    /// Files written by commits that did not sync them, to sync before the next checkpoint
    /// (which makes those commits' rows durable) or a durable commit.
    unsynced: HashSet<(String, u64)>,
    /// Directories that gained an entry since their last sync (a new file or directory).
    unsynced_dirs: HashSet<PathBuf>,
    /// When the write-ahead log was last checkpointed ([`SegmentFiles::after_commit`]).
    checkpointed: Instant,
}

/// How often the write-ahead log is checkpointed when segment files are in use (SQLite's
/// automatic checkpoint is off then: a checkpoint makes rows durable, so the bytes they
/// refer to must be synced first).
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

/// Deletes the rows of segments whose bytes are not all in their file, logging each range of
/// offsets lost: a power failure can leave the database holding a commit whose file bytes
/// never reached the disk (without `durable_ack`), and a copy taken while retention deleted
/// a file refers to it. Refusing to start would leave the operator nothing to do but delete
/// the stream. A segment that refers to messages of the message store (`refs`: none written
/// since segments are in files) cannot go without them: that stays an error.
fn drop_unbacked(conn: &Connection, root: &Path) -> Result<(), StorageError> {
    let sql = |e: rusqlite::Error| {
        StorageError::fatal(format!(
            "segment files {}: cannot check the stream segments: {e}",
            root.display()
        ))
    };
    let groups: Vec<(String, i64, i64)> = conn
        .prepare(
            "SELECT stream, file, max(position + length) FROM stream_segments \
             WHERE file IS NOT NULL GROUP BY stream, file",
        )
        .map_err(sql)?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .map_err(sql)?
        .collect::<rusqlite::Result<_>>()
        .map_err(sql)?;
    for (stream, file, end) in groups {
        let path = file_path(root, &stream, unsigned(Some(file)));
        let (len, what) = match std::fs::metadata(&path) {
            Ok(m) => (m.len(), format!("has {} of its {end} bytes", m.len())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => (0, "is missing".to_string()),
            Err(e) => {
                return Err(
                    StorageError::fatal(format!("cannot read {}: {e}", path.display()))
                        .with_source(e),
                )
            }
        };
        if len >= unsigned(Some(end)) {
            continue;
        }
        let len = i64::try_from(len).unwrap_or(i64::MAX);
        let (first, last, messages, refs): (i64, i64, i64, i64) = conn
            .query_row(
                "SELECT min(first_offset), max(last_offset), sum(entries), sum(refs) \
                 FROM stream_segments WHERE stream = ?1 AND file = ?2 \
                 AND position + length > ?3",
                rusqlite::params![stream, file, len],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .map_err(sql)?;
        if refs > 0 {
            return Err(damaged(format!(
                "stream {stream}: the segments of offsets {first} to {last} are in {}, which \
                 {what}, and refer to stored messages",
                path.display()
            )));
        }
        conn.execute(
            "DELETE FROM stream_segments WHERE stream = ?1 AND file = ?2 \
             AND position + length > ?3",
            rusqlite::params![stream, file, len],
        )
        .map_err(sql)?;
        tracing::error!(
            "stream {stream}: {messages} messages lost, offsets {first} to {last}: their \
             segment file {} {what} (a power failure before it was synced, or a copy of the \
             database without it); the rest of the stream is kept",
            path.display()
        );
    }
    Ok(())
}

/// A storage error naming the damage (fatal: a file the database refers to is gone).
fn damaged(message: String) -> StorageError {
    StorageError::fatal(message)
}

impl SegmentFiles {
    /// Opens the segment files of the database `conn` has open (its schema current): drops
    /// the rows whose bytes are not all in their file ([`drop_unbacked`]), cuts each file to
    /// the largest end a row refers to, deletes files no row refers to. `None` for a
    /// database in memory.
    ///
    /// Errors (`Fatal`): a segment referring to stored messages whose file is missing or
    /// short (naming the stream, the file and the offsets), or a directory or file that
    /// cannot be read.
    pub(super) fn open(conn: &Connection) -> Result<Option<SegmentFiles>, StorageError> {
        let Some(root) = root(conn) else {
            return Ok(None);
        };
        let io_error = |what: &str, path: &Path, e: io::Error| {
            StorageError::fatal(format!("cannot {what} {}: {e}", path.display())).with_source(e)
        };
        let sql = |e: rusqlite::Error| {
            StorageError::fatal(format!(
                "segment files {}: cannot read the stream segments: {e}",
                root.display()
            ))
        };
        drop_unbacked(conn, &root)?;
        // Per stream and file, the largest end a row refers to, and the first offset of
        // the row that ends there (to name it).
        let mut ends: BTreeMap<String, BTreeMap<u64, (u64, i64, i64)>> = BTreeMap::new();
        {
            let mut stmt = conn
                .prepare(
                    "SELECT stream, file, max(position + length), first_offset, last_offset \
                     FROM stream_segments WHERE file IS NOT NULL GROUP BY stream, file",
                )
                .map_err(sql)?;
            let mut rows = stmt.query([]).map_err(sql)?;
            while let Some(row) = rows.next().map_err(sql)? {
                let stream: String = row.get(0).map_err(sql)?;
                let file = unsigned(row.get(1).map_err(sql)?);
                let end = unsigned(row.get(2).map_err(sql)?);
                let (first, last) = (row.get(3).map_err(sql)?, row.get(4).map_err(sql)?);
                ends.entry(stream)
                    .or_default()
                    .insert(file, (end, first, last));
            }
        }
        let mut streams = HashMap::new();
        for (stream, files) in &ends {
            let dir = stream_dir(&root, stream);
            for (&file, &(end, first, last)) in files {
                let path = file_path(&root, stream, file);
                let len = match std::fs::metadata(&path) {
                    Ok(m) => m.len(),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        return Err(damaged(format!(
                            "stream {stream}: the segment of offsets {first} to {last} is in \
                             {}, which is missing (it should hold {end} bytes)",
                            path.display()
                        )));
                    }
                    Err(e) => return Err(io_error("read", &path, e)),
                };
                if len < end {
                    return Err(damaged(format!(
                        "stream {stream}: the segment of offsets {first} to {last} ends at byte \
                         {end} of {}, which has {len} bytes",
                        path.display()
                    )));
                }
                if len > end {
                    // Written by a transaction that never committed.
                    let f = OpenOptions::new()
                        .write(true)
                        .open(&path)
                        .map_err(|e| io_error("open", &path, e))?;
                    f.set_len(end).map_err(|e| io_error("truncate", &path, e))?;
                    f.sync_data().map_err(|e| io_error("sync", &path, e))?;
                }
            }
            // Files of this stream no row refers to (a crash after a trim's commit).
            remove_unreferenced(&dir, |n| files.contains_key(&n))
                .map_err(|e| io_error("tidy", &dir, e))?;
            if let (Some((&file, &(end, _, _))), Some((&oldest, _))) =
                (files.last_key_value(), files.first_key_value())
            {
                streams.insert(
                    stream.clone(),
                    Current {
                        file,
                        end,
                        oldest,
                        handle: None,
                    },
                );
            }
        }
        // Directories of streams no row refers to (deleted, or never committed).
        match std::fs::read_dir(&root) {
            Ok(entries) => {
                let kept: HashSet<PathBuf> = ends.keys().map(|s| stream_dir(&root, s)).collect();
                for entry in entries {
                    let entry = entry.map_err(|e| io_error("read", &root, e))?;
                    let path = entry.path();
                    if !kept.contains(&path) && path.is_dir() {
                        std::fs::remove_dir_all(&path).map_err(|e| io_error("remove", &path, e))?;
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_error("read", &root, e)),
        }
        // A checkpoint makes rows durable: this type runs them, after syncing the files.
        conn.pragma_update(None, "wal_autocheckpoint", 0)
            .map_err(sql)?;
        Ok(Some(SegmentFiles {
            root,
            streams,
            unsynced: HashSet::new(),
            unsynced_dirs: HashSet::new(),
            checkpointed: Instant::now(),
        }))
    }

    /// Starts appending for one batch: nothing changes until [`Appends::committed`].
    pub(super) fn appends(&mut self) -> Appends<'_> {
        Appends {
            files: self,
            ends: HashMap::new(),
            opened: HashMap::new(),
            written: HashSet::new(),
        }
    }

    /// Syncs the files written since the last sync (`fdatasync`).
    pub(super) fn sync_unsynced(&mut self) -> io::Result<()> {
        // A new file's name is on disk once its directory is synced.
        for dir in std::mem::take(&mut self.unsynced_dirs) {
            match File::open(&dir) {
                Ok(d) => d.sync_all()?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        for (stream, file) in std::mem::take(&mut self.unsynced) {
            match self
                .streams
                .get(&stream)
                .filter(|c| c.file == file)
                .and_then(|c| c.handle.as_ref())
            {
                Some(h) => h.sync_data()?,
                None => match File::open(file_path(&self.root, &stream, file)) {
                    Ok(f) => f.sync_data()?,
                    // Deleted since (its stream trimmed or deleted): nothing refers to it.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                },
            }
        }
        Ok(())
    }

    /// After a commit: once every [`CHECKPOINT_EVERY`], syncs the files written since the
    /// last sync, then checkpoints the write-ahead log (passive: it never waits for a
    /// reader). Failures are logged and tried again after the next commit; a checkpoint is
    /// not run before the files are synced.
    pub(super) fn after_commit(&mut self, conn: &Connection) {
        if self.checkpointed.elapsed() < CHECKPOINT_EVERY {
            return;
        }
        self.checkpointed = Instant::now();
        if let Err(e) = self.sync_unsynced() {
            tracing::warn!(
                "cannot sync the segment files in {}: {e}",
                self.root.display()
            );
            return;
        }
        if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
            tracing::warn!("cannot checkpoint the database: {e}");
        }
    }

    /// After a commit that trimmed or deleted `streams`: unlinks their files no row refers
    /// to any more (those before the file of the stream's first segment, but the one
    /// written to), and the directory of each that is gone. Failures are logged: what is
    /// left is deleted when the database is opened again.
    pub(super) fn tidy<'s>(&mut self, conn: &Connection, streams: impl Iterator<Item = &'s str>) {
        for stream in streams {
            let dir = stream_dir(&self.root, stream);
            let result = (|| -> Result<(), String> {
                let exists = conn
                    .prepare_cached("SELECT 1 FROM streams WHERE name = ?1")
                    .and_then(|mut s| s.exists([stream]))
                    .map_err(|e| e.to_string())?;
                if !exists {
                    self.streams.remove(stream);
                    return match std::fs::remove_dir_all(&dir) {
                        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e.to_string()),
                        _ => Ok(()),
                    };
                }
                let Some(current) = self.streams.get_mut(stream) else {
                    return Ok(());
                };
                // Files follow offsets: those before the first segment's are unused.
                let first: Option<i64> = conn
                    .prepare_cached(
                        "SELECT file FROM stream_segments WHERE stream = ?1 \
                         AND file IS NOT NULL ORDER BY first_offset LIMIT 1",
                    )
                    .and_then(|mut s| s.query_row([stream], |r| r.get(0)).optional())
                    .map_err(|e| e.to_string())?;
                let upto = first.map_or(current.file, |f| unsigned(Some(f)).min(current.file));
                for n in current.oldest..upto {
                    match std::fs::remove_file(dir.join(format!("{n}.seg"))) {
                        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e.to_string()),
                        _ => current.oldest = n + 1,
                    }
                }
                Ok(())
            })();
            if let Err(e) = result {
                tracing::warn!(
                    "stream {stream}: cannot delete the segment files no longer used in {}: {e}",
                    dir.display()
                );
            }
        }
    }
}

/// Deletes the segment files of `dir` whose number `keep` does not take (a directory that
/// does not exist has none).
fn remove_unreferenced(dir: &Path, keep: impl Fn(u64) -> bool) -> io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let number = name
            .to_str()
            .and_then(|n| n.strip_suffix(".seg"))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(n) = number {
            if !keep(n) {
                std::fs::remove_file(entry.path())?;
            }
        }
    }
    Ok(())
}

/// One batch's appends: where each stream's next segment goes, and the files written (to
/// sync before a durable commit).
pub(super) struct Appends<'a> {
    files: &'a mut SegmentFiles,
    /// Per stream written to, its file and end as of this batch.
    ends: HashMap<String, (u64, u64)>,
    /// Files this batch opened (a stream's first write, or a new file), per stream.
    opened: HashMap<String, (u64, File)>,
    written: HashSet<(String, u64)>,
}

impl Appends<'_> {
    /// Appends `bytes` (one encoded segment) to `stream`'s file with one write, starting a
    /// new file when the current one has reached [`FILE_BYTES`].
    pub(super) fn append(&mut self, stream: &str, bytes: &[u8]) -> io::Result<Location> {
        let committed = self.files.streams.get(stream);
        let (file, end) = self
            .ends
            .get(stream)
            .copied()
            .or_else(|| committed.map(|c| (c.file, c.end)))
            .unwrap_or((0, 0));
        let (file, end) = if end >= FILE_BYTES {
            (file + 1, 0)
        } else {
            (file, end)
        };
        let reuse = committed
            .filter(|c| c.file == file)
            .and_then(|c| c.handle.as_ref());
        let handle = match (reuse, self.opened.get(stream)) {
            (_, Some((n, h))) if *n == file => h,
            (Some(h), _) => h,
            _ => {
                let dir = stream_dir(&self.files.root, stream);
                if !dir.is_dir() {
                    if !self.files.root.is_dir() {
                        if let Some(parent) = self.files.root.parent() {
                            self.files.unsynced_dirs.insert(parent.to_path_buf());
                        }
                    }
                    std::fs::create_dir_all(&dir)?;
                    self.files.unsynced_dirs.insert(self.files.root.clone());
                }
                self.files.unsynced_dirs.insert(dir.clone());
                let h = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .mode(0o600)
                    .open(dir.join(format!("{file}.seg")))?;
                self.opened.insert(stream.to_string(), (file, h));
                &self.opened[stream].1
            }
        };
        handle.write_all_at(bytes, end)?;
        let length = bytes.len() as u64;
        self.ends.insert(stream.to_string(), (file, end + length));
        self.written.insert((stream.to_string(), file));
        Ok(Location {
            file,
            position: end,
            length,
        })
    }

    /// The batch committed: its ends become the streams' committed ends. Without this (a
    /// batch that failed) the next batch writes where this one started.
    pub(super) fn committed(mut self) {
        // Synced before the next checkpoint or durable commit.
        self.files.unsynced.extend(self.written.drain());
        for (stream, (file, end)) in self.ends.drain() {
            let opened = self.opened.remove(&stream).filter(|(n, _)| *n == file);
            let current = self.files.streams.entry(stream).or_insert(Current {
                file,
                end,
                oldest: file,
                handle: None,
            });
            if let Some((_, h)) = opened {
                current.handle = Some(h);
            } else if current.file != file {
                current.handle = None;
            }
            current.file = file;
            current.end = end;
        }
    }
}

fn unsigned(v: Option<i64>) -> u64 {
    v.map_or(0, |v| u64::try_from(v).unwrap_or(0))
}

/// Reads the body of the segment of `stream` at `at` (a row's `file`, `position`,
/// `length`), with one positioned read.
///
/// Errors: the file is missing or shorter than the row says (SQLite's "corrupt", so that it
/// is reported as damage, naming the stream, the file and the offsets).
pub(super) fn read(conn: &Connection, stream: &str, at: Location) -> rusqlite::Result<Vec<u8>> {
    let fail = |what: String| {
        rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CORRUPT),
            Some(what),
        )
    };
    let Some(root) = root(conn) else {
        return Err(fail(format!(
            "stream {stream}: a segment refers to file {} but the database has no directory \
             of segment files",
            at.file
        )));
    };
    let path = file_path(&root, stream, at.file);
    let f = File::open(&path).map_err(|e| {
        fail(format!(
            "stream {stream}: cannot open {} (bytes {} to {} of a segment): {e}",
            path.display(),
            at.position,
            at.position + at.length
        ))
    })?;
    let mut buf = vec![0; usize::try_from(at.length).unwrap_or(usize::MAX)];
    f.read_exact_at(&mut buf, at.position).map_err(|e| {
        fail(format!(
            "stream {stream}: cannot read bytes {} to {} of {}: {e}",
            at.position,
            at.position + at.length,
            path.display()
        ))
    })?;
    Ok(buf)
}

/// The body of the segment row `row` of `stream`, whose columns from `i` on are `body`,
/// `file`, `position`, `length`: the blob when the row has one, else read from its file.
pub(super) fn body<'r>(
    conn: &Connection,
    stream: &str,
    row: &'r Row<'_>,
    i: usize,
) -> rusqlite::Result<Cow<'r, [u8]>> {
    let inline = row.get_ref(i)?.as_blob()?;
    let Some(file) = row.get::<_, Option<i64>>(i + 1)? else {
        return Ok(Cow::Borrowed(inline));
    };
    let at = Location {
        file: unsigned(Some(file)),
        position: unsigned(row.get(i + 2)?),
        length: unsigned(row.get(i + 3)?),
    };
    read(conn, stream, at).map(Cow::Owned)
}

/// A failure to write a segment file as a SQLite I/O error (the writer retries those), or
/// "full" for a full disk.
pub(super) fn write_failure(stream: &str, e: io::Error) -> rusqlite::Error {
    let code = match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => rusqlite::ffi::SQLITE_FULL,
        _ => rusqlite::ffi::SQLITE_IOERR,
    };
    rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error::new(code),
        Some(format!(
            "stream {stream}: cannot write its segment file: {e}"
        )),
    )
}
