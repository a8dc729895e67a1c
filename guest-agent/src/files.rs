//! File operations. Paths must be absolute; OS errors map to typed
//! [`AgentError`]s naming the path.

use std::fs::{self, DirBuilder, File, Metadata, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use tine_protocol::{AgentError, DirEntry, FileData, FileKind, FileStat, ReadFile, WriteFile, MAX_FILE_CHUNK};

fn os_err(path: &str, e: io::Error) -> AgentError {
    let path = path.to_string();
    match e.kind() {
        io::ErrorKind::NotFound => AgentError::NotFound { path },
        io::ErrorKind::PermissionDenied => AgentError::PermissionDenied { path },
        io::ErrorKind::AlreadyExists => AgentError::AlreadyExists { path },
        io::ErrorKind::NotADirectory => AgentError::NotADirectory { path },
        io::ErrorKind::IsADirectory => AgentError::IsADirectory { path },
        io::ErrorKind::StorageFull => AgentError::NoSpace,
        _ => AgentError::Io { message: format!("{path}: {e}") },
    }
}

fn absolute(path: &str) -> Result<&Path, AgentError> {
    let p = Path::new(path);
    if p.is_absolute() {
        Ok(p)
    } else {
        Err(AgentError::InvalidRequest { reason: format!("path '{path}' is not absolute") })
    }
}

fn file_stat(m: &Metadata) -> FileStat {
    let ft = m.file_type();
    let kind = if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    FileStat {
        kind,
        size: m.len(),
        mode: m.mode() & 0o7777,
        mtime_ms: m.mtime().saturating_mul(1000).saturating_add(m.mtime_nsec() / 1_000_000),
    }
}

/// Reads `req.length` bytes (default: to the end) at `req.offset`.
pub fn read(req: &ReadFile) -> Result<FileData, AgentError> {
    let p = absolute(&req.path)?;
    let f = File::open(p).map_err(|e| os_err(&req.path, e))?;
    let m = f.metadata().map_err(|e| os_err(&req.path, e))?;
    if m.is_dir() {
        return Err(AgentError::IsADirectory { path: req.path.clone() });
    }
    let size = m.len();
    let want = req.length.unwrap_or_else(|| size.saturating_sub(req.offset));
    if want > MAX_FILE_CHUNK {
        return Err(AgentError::TooLarge { size: want, limit: MAX_FILE_CHUNK });
    }
    let mut data = vec![0u8; want as usize];
    let mut got = 0usize;
    while got < data.len() {
        match f.read_at(&mut data[got..], req.offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(os_err(&req.path, e)),
        }
    }
    data.truncate(got);
    Ok(FileData { data, size })
}

/// Writes (or appends) `req.data`; returns the bytes written.
pub fn write(req: &WriteFile) -> Result<u64, AgentError> {
    let p = absolute(&req.path)?;
    if req.data.len() as u64 > MAX_FILE_CHUNK {
        return Err(AgentError::TooLarge { size: req.data.len() as u64, limit: MAX_FILE_CHUNK });
    }
    if req.create_parents {
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent).map_err(|e| os_err(&parent.to_string_lossy(), e))?;
        }
    }
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .append(req.append)
        .truncate(!req.append)
        .mode(req.mode.unwrap_or(0o644))
        .open(p)
        .map_err(|e| os_err(&req.path, e))?;
    f.write_all(&req.data).map_err(|e| os_err(&req.path, e))?;
    Ok(req.data.len() as u64)
}

/// Lists a directory, sorted by name.
pub fn list(path: &str) -> Result<Vec<DirEntry>, AgentError> {
    let p = absolute(path)?;
    let mut out = Vec::new();
    for entry in fs::read_dir(p).map_err(|e| os_err(path, e))? {
        let entry = entry.map_err(|e| os_err(path, e))?;
        let Ok(m) = entry.path().symlink_metadata() else { continue };
        out.push(DirEntry { name: entry.file_name().to_string_lossy().into_owned(), stat: file_stat(&m) });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Stats a path (a final symlink is not followed).
pub fn stat(path: &str) -> Result<FileStat, AgentError> {
    let p = absolute(path)?;
    p.symlink_metadata().map(|m| file_stat(&m)).map_err(|e| os_err(path, e))
}

/// Removes a file or (with `recursive` for a non-empty one) a directory.
pub fn remove(path: &str, recursive: bool) -> Result<(), AgentError> {
    let p = absolute(path)?;
    let m = p.symlink_metadata().map_err(|e| os_err(path, e))?;
    let r = if m.is_dir() {
        if recursive {
            fs::remove_dir_all(p)
        } else {
            fs::remove_dir(p)
        }
    } else {
        fs::remove_file(p)
    };
    r.map_err(|e| os_err(path, e))
}

/// Makes a directory (and, with `parents`, its missing parents).
/// Renames `from` to `to` (rename(2)).
pub fn rename(from: &str, to: &str) -> Result<(), AgentError> {
    let (f, t) = (absolute(from)?, absolute(to)?);
    fs::rename(f, t).map_err(|e| os_err(from, e))
}

pub fn mkdir(path: &str, parents: bool, mode: u32) -> Result<(), AgentError> {
    let p = absolute(path)?;
    DirBuilder::new().recursive(parents).mode(mode).create(p).map_err(|e| os_err(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_replaces_the_target_and_refuses_relative_paths() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.part"), dir.path().join("b"));
        fs::write(&a, b"new").unwrap();
        fs::write(&b, b"old").unwrap();
        rename(a.to_str().unwrap(), b.to_str().unwrap()).unwrap();
        assert_eq!(fs::read(&b).unwrap(), b"new");
        assert!(!a.exists());
        let missing = rename(a.to_str().unwrap(), b.to_str().unwrap());
        assert!(matches!(missing, Err(AgentError::NotFound { .. })), "{missing:?}");
        assert!(matches!(rename("rel", b.to_str().unwrap()), Err(AgentError::InvalidRequest { .. })));
    }
}
