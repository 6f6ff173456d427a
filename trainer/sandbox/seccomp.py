"""The system-call filter of the bubblewrap sandbox: what model-written code may never ask the
kernel for, compiled once per process to the BPF program that `bwrap --seccomp FD` loads before
the interpreter starts (so nothing inside can remove it: a filter can only be narrowed).

Denied with EPERM: tracing and reading other processes' memory, mounting and namespaces (the
boundary's own tools), loading kernel code, BPF, keyrings, io_uring (its operations bypass this
filter), perf, userfaultfd, handles to host files, changing the clock, rebooting. `clone3` answers
ENOSYS, so that the C library falls back to `clone`, whose namespace flags are filterable (a
seccomp filter cannot read clone3's arguments). Built with libseccomp through pyseccomp, not by
writing BPF by hand.
"""
from __future__ import annotations

import errno
import functools

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount",
    "fsconfig", "fspick", "mount_setattr", "setns", "unshare",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "open_by_handle_at", "name_to_handle_at", "reboot", "swapon", "swapoff", "syslog", "acct",
    "quotactl", "sethostname", "setdomainname", "iopl", "ioperm", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "lookup_dcookie", "vhangup",
    "personality",
)
# clone(2) flags that make a namespace (CLONE_NEWNS ... CLONE_NEWTIME)
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                   0x40000000, 0x00000080)


class FilterUnavailable(RuntimeError):
    pass


@functools.cache
def bpf_program() -> bytes:
    """The filter as a BPF program (raises FilterUnavailable naming what is missing)."""
    try:
        import pyseccomp as sc
        f = sc.SyscallFilter(defaction=sc.ALLOW)
    except Exception as e:  # noqa: BLE001 -- ImportError, or libseccomp.so.2 missing (OSError, ...)
        raise FilterUnavailable(f"libseccomp cannot be used ({type(e).__name__}: {e}); install "
                                "the Debian package libseccomp2 and the Python package pyseccomp") \
            from None
    for name in DENIED:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):
            pass   # a call this architecture does not have
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in NAMESPACE_FLAGS:
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    import tempfile
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()
