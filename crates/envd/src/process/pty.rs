//! Pseudo-terminals: the master side read and written asynchronously, the slave given to the child.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;

/// The master side of a PTY.
pub struct PtyMaster {
    fd: AsyncFd<OwnedFd>,
}

/// A freshly opened PTY pair.
pub struct PtyPair {
    pub master: PtyMaster,
    pub slave: OwnedFd,
}

/// Opens a PTY pair with the given size; the slave is owned by `uid:gid`.
pub fn open(cols: u16, rows: u16, uid: u32, gid: u32) -> io::Result<PtyPair> {
    use rustix::fs::{Mode, OFlags};
    use rustix::pty::OpenptFlags;
    let master =
        rustix::pty::openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    let name = rustix::pty::ptsname(&master, Vec::new())?;
    let slave = rustix::fs::open(
        name.as_c_str(),
        OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    // The terminal belongs to the user whose shell runs on it, as login(1) would arrange.
    let _ = rustix::fs::fchown(
        &slave,
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
    );
    set_size(&master, cols, rows)?;
    let flags = rustix::fs::fcntl_getfl(&master)?;
    rustix::fs::fcntl_setfl(&master, flags | OFlags::NONBLOCK)?;
    // SAFETY: the OwnedFd is moved into the AsyncFd and stays open for its whole lifetime.
    let fd = unsafe { AsyncFd::register(master) }.map_err(|e| e.into_parts().1)?;
    Ok(PtyPair {
        master: PtyMaster { fd },
        slave,
    })
}

fn set_size(fd: impl AsFd, cols: u16, rows: u16) -> io::Result<()> {
    let ws = rustix::termios::Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    rustix::termios::tcsetwinsize(fd, ws)?;
    Ok(())
}

impl PtyMaster {
    /// Reads output; 0 means the terminal is closed (EIO once every slave fd is gone).
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd.readable().await?;
            let res = guard.try_io(|fd| {
                // SAFETY: buf is writable for its length.
                let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(Ok(n)) => return Ok(n),
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    /// Writes all of `data` as terminal input.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.fd.writable().await?;
            let res = guard.try_io(|fd| {
                // SAFETY: data is readable for its length.
                let n = unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }

    pub fn resize(&self, cols: u16, rows: u16) -> io::Result<()> {
        set_size(self.fd.get_ref(), cols, rows)
    }
}
