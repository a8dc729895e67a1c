//! A writer for the "newc" cpio format the kernel unpacks as an initramfs
//! (Documentation/driver-api/early-userspace/buffer-format.rst).

/// Builds a newc archive in memory.
#[derive(Default)]
pub struct Writer {
    out: Vec<u8>,
    ino: u32,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFCHR: u32 = 0o020000;

impl Writer {
    /// An empty archive.
    pub fn new() -> Self {
        Self::default()
    }

    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        self.ino += 1;
        let fields = [
            self.ino,
            mode,
            0, // uid
            0, // gid
            if mode & S_IFDIR != 0 { 2 } else { 1 },
            0, // mtime
            data.len() as u32,
            0, // dev major
            0, // dev minor
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0, // check
        ];
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }

    /// Adds a directory.
    pub fn dir(&mut self, name: &str, perm: u32) {
        self.entry(name, S_IFDIR | perm, (0, 0), &[]);
    }

    /// Adds a regular file.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, S_IFREG | perm, (0, 0), data);
    }

    /// Adds a character device node.
    pub fn char_device(&mut self, name: &str, perm: u32, major: u32, minor: u32) {
        self.entry(name, S_IFCHR | perm, (major, minor), &[]);
    }

    /// Ends the archive with the trailer and returns its bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        // The kernel reads the archive in 512-byte blocks.
        while !self.out.len().is_multiple_of(512) {
            self.out.push(0);
        }
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_aligned_and_parse() {
        let mut w = Writer::new();
        w.dir("dev", 0o755);
        w.file("init", 0o755, b"abc");
        w.char_device("dev/console", 0o600, 5, 1);
        let a = w.finish();
        assert_eq!(a.len() % 512, 0);
        // Walk the archive back.
        let mut off = 0;
        let mut names = Vec::new();
        loop {
            assert_eq!(&a[off..off + 6], b"070701");
            let field = |i: usize| {
                u32::from_str_radix(std::str::from_utf8(&a[off + 6 + i * 8..off + 14 + i * 8]).unwrap(), 16).unwrap()
            };
            let (mode, size, rmaj, namesize) = (field(1), field(6) as usize, field(9), field(11) as usize);
            let name = std::str::from_utf8(&a[off + 110..off + 110 + namesize - 1]).unwrap().to_string();
            off = (off + 110 + namesize + 3) & !3;
            if name == "init" {
                assert_eq!(&a[off..off + size], b"abc");
                assert_eq!(mode, S_IFREG | 0o755);
            }
            if name == "dev/console" {
                assert_eq!((mode & S_IFCHR, rmaj), (S_IFCHR, 5));
            }
            off = (off + size + 3) & !3;
            let done = name == "TRAILER!!!";
            names.push(name);
            if done {
                break;
            }
        }
        assert_eq!(names, ["dev", "init", "dev/console", "TRAILER!!!"]);
    }
}
