//! Pseudo-terminals: the master side read and written asynchronously, the slave given to the child.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

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

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Opens a PTY pair with the given size; the slave is owned by `uid:gid`.
pub fn open(cols: u16, rows: u16, uid: u32, gid: u32) -> io::Result<PtyPair> {
    // SAFETY: posix_openpt returns a new fd or -1.
    let master =
        cvt(unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) })?;
    // SAFETY: master is a fresh fd we own.
    let master = unsafe { OwnedFd::from_raw_fd(master) };
    // SAFETY: plain calls on a valid master fd.
    unsafe {
        cvt(libc::grantpt(master.as_raw_fd()))?;
        cvt(libc::unlockpt(master.as_raw_fd()))?;
    }
    let mut name = [0 as libc::c_char; 128];
    // SAFETY: name is a writable buffer of the given length.
    let rc = unsafe { libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len()) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    // SAFETY: ptsname_r wrote a NUL-terminated path into name.
    let slave = cvt(unsafe {
        libc::open(
            name.as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    })?;
    // SAFETY: slave is a fresh fd we own.
    let slave = unsafe { OwnedFd::from_raw_fd(slave) };
    // The terminal belongs to the user whose shell runs on it, as login(1) would arrange.
    // SAFETY: fchown on a valid fd.
    let _ = unsafe { libc::fchown(slave.as_raw_fd(), uid, gid) };
    set_size(master.as_raw_fd(), cols, rows)?;
    // SAFETY: fcntl on a valid fd.
    unsafe {
        let flags = cvt(libc::fcntl(master.as_raw_fd(), libc::F_GETFL))?;
        cvt(libc::fcntl(
            master.as_raw_fd(),
            libc::F_SETFL,
            flags | libc::O_NONBLOCK,
        ))?;
    }
    // SAFETY: the OwnedFd is moved into the AsyncFd and stays open for its whole lifetime.
    let fd = unsafe { AsyncFd::register(master) }.map_err(|e| e.into_parts().1)?;
    Ok(PtyPair {
        master: PtyMaster { fd },
        slave,
    })
}

fn set_size(fd: libc::c_int, cols: u16, rows: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize from the pointer.
    cvt(unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) })?;
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
        set_size(self.fd.get_ref().as_raw_fd(), cols, rows)
    }
}
