//! Reading the files the configuration names, bounded: a path that names
//! something endless (`/dev/zero`) or far larger than what it should hold (a
//! log, a disk image) is refused with an error naming it, rather than read
//! until the process runs out of memory.

use std::io::Read;
use std::path::Path;
use std::time::Duration;

/// The most a configuration file may hold: far past any real one (a list of
/// 100,000 tenants is a few MiB).
pub const CONFIG_FILE_LIMIT: u64 = 64 << 20;

/// The most a PEM file (a CA bundle, a certificate, a key) may hold: a
/// bundle of every public root is under 1 MiB.
pub const PEM_FILE_LIMIT: u64 = 16 << 20;

/// How long a file may take to open and read: a named pipe (FIFO) with no
/// writer blocks its reader for ever, and so does a network file system
/// that does not answer.
pub const READ_DEADLINE: Duration = Duration::from_secs(10);

/// The bytes of `path`, if it holds at most `limit` and is read within
/// [`READ_DEADLINE`]; else why not.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    read_bounded_within(path, limit, READ_DEADLINE)
}

/// [`read_bounded`] with its deadline given. The read runs on a thread of
/// its own, which a read that never ends leaves behind (the caller exits
/// on the error).
fn read_bounded_within(path: &Path, limit: u64, deadline: Duration) -> Result<Vec<u8>, String> {
    let (done, read) = std::sync::mpsc::channel();
    let path = path.to_path_buf();
    std::thread::Builder::new()
        .name("read-file".into())
        .spawn(move || done.send(read_limited(&path, limit)))
        .map_err(|e| e.to_string())?;
    read.recv_timeout(deadline).unwrap_or_else(|_| {
        Err(format!(
            "nothing could be read from it within {} s: a named pipe with no writer, or a file system that does not answer?",
            deadline.as_secs()
        ))
    })
}

fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > limit {
        return Err(format!(
            "larger than {} MiB, more than such a file holds: is it the right path?",
            limit >> 20
        ));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_within_the_limit_is_read_whole() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut file, b"tenants = [\"a\"]\n").unwrap();
        assert_eq!(
            read_bounded(file.path(), 16).unwrap(),
            b"tenants = [\"a\"]\n"
        );
    }

    #[test]
    fn an_endless_or_oversized_file_is_refused_after_reading_past_the_limit() {
        let error = read_bounded(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(error.starts_with("larger than 1 MiB"), "{error}");
        let mut file = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut file, &[b'x'; 17]).unwrap();
        assert!(read_bounded(file.path(), 16).is_err());
    }

    #[test]
    fn a_named_pipe_with_no_writer_is_refused_at_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let error = read_bounded_within(&fifo, 16, Duration::from_millis(200)).unwrap_err();
        assert!(error.contains("named pipe with no writer"), "{error}");
    }

    #[test]
    fn a_directory_or_a_missing_file_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let error = read_bounded(dir.path(), 16).unwrap_err();
        assert!(error.contains("Is a directory"), "{error}");
        let error = read_bounded(&dir.path().join("missing"), 16).unwrap_err();
        assert!(error.contains("No such file"), "{error}");
    }
}
